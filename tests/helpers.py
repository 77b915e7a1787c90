"""Small drivers shared by the tests: scheduler drivers, and a subprocess runner for Triton
kernels under the interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

from engine.core import Request, SamplingParams, Scheduler, SchedulerConfig


def make_scheduler(**kw) -> Scheduler:
    base = dict(max_num_batched_tokens=1024, max_num_seqs=128, max_model_len=4096, block_size=16,
                num_gpu_blocks=1000, enable_chunked_prefill=True, long_prefill_token_threshold=0,
                enable_prefix_caching=True, policy="fcfs")
    base.update(kw)
    return Scheduler(SchedulerConfig(**base))


def make_request(rid: str, n_prompt: int = 0, max_tokens: int = 16, tokens=None, priority: int = 0,
                 arrival: float = 0.0, eos=None, **sp) -> Request:
    # The prompt is a function of the id: crc32, not hash(), which is salted per process, so two
    # ids whose prompts would collide (a prefix-cache hit no test expects) collide in every run or
    # in none, instead of once in a thousand runs.
    base = zlib.crc32(rid.encode()) % 4000
    tokens = list(tokens) if tokens is not None else [1000 + base * 10 + i % 10 for i in range(n_prompt)]
    sp.setdefault("ignore_eos", eos is None)
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **sp), arrival_time=arrival,
                   priority=priority, eos_token_id=eos)


def step(s: Scheduler, token: int | dict = 7):
    """schedule() + update_from_output() with `token` sampled by every request that reached the
    end of its known tokens (a finished prefill or a decode). Returns (output, core outputs)."""
    out = s.schedule()
    sampled = {}
    for rid in out.num_scheduled_tokens:
        r = s.requests[rid]
        if r.num_computed_tokens >= r.num_tokens:
            sampled[rid] = [token[rid] if isinstance(token, dict) else token]
    return out, s.update_from_output(out, sampled)


def run_interpreted(call: str, marker: str, timeout: int = 600) -> None:
    """Run `call` (Python source, e.g. "from tests.x import check; check()") in a subprocess with
    TRITON_INTERPRET=1 (set before triton is imported, as the interpreter needs) and assert that it
    succeeded and printed `marker`."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(repo)}
    env.pop("SERVETWIN_ATTN_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", call], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0 and marker in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
