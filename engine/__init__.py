"""ServeTwin's real serving engine.

`engine.core` (the shared scheduler) is pure Python and must import without torch, so this
package imports nothing heavy eagerly: `from engine import LLM` loads torch on first use.
"""
from engine.core.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams"]


def __getattr__(name):
    if name in ("LLM", "LLMEngine"):
        from engine import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
