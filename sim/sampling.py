"""What a step's sampler costs on the GPU, by the requests' sampling parameters and the vLLM release.

vLLM samples every scheduled row of a step after the forward (outside its CUDA graphs). Greedy
rows take an argmax; rows at a temperature without top-k/top-p a softmax and one random draw:
tens of microseconds, `Overheads.sampler_s`. Top-k and top-p (nucleus) filtering is another
matter: how it is done depends on the release.

- The PyTorch implementation (`apply_top_k_top_p`) sorts every row's whole vocabulary (plus a
  softmax, a cumulative sum and a scatter back). Published microbenchmarks of that path:
  64 x 32,768 logits 0.373 ms and 128 x 32,768 0.613 ms for top-p (vLLM PR #40376, whose tests
  ran on a B200); 1,024 x 32,768 4.24 ms (PR #33538); top-k alone 256 x 131,072 3.81 ms (PR
  #32558); a single row of 32,768 about 0.1 ms (PR #42191, #51507). FILTER_FLOOR_S + rows x
  vocabulary x SORT_S_PER_LOGIT reads the top-p ones within 6% and top-k alone 17% high. vLLM's
  own note when it first replaced the sort (PR #11394): "the sorting op can take ~20% performance
  overhead in high-throughput settings".
- A Triton kernel (PR #33538) for steps of at least 8 rows: 0.24-0.26 ms for 64-128 x 32,768 and
  0.92 ms for 512 x 32,768 top-p, 0.10-0.14 ms for top-k (PR #40376's table): TRITON_FLOOR_S +
  rows x vocabulary x TRITON_S_PER_LOGIT, within 0.12 ms of the top-p ones.
- FlashInfer's rejection-sampling kernels: 0.05-0.13 ms over the same sizes, no sort; counted as
  the plain sampler.

Which one a release runs for top-k/top-p by default in vLLM's CUDA image (filter_implementation):
- before 0.9: PyTorch. V0's sampler sorts too; V1 fell back to PyTorch with FlashInfer >= 0.2.3
  (PR #14815).
- 0.9 to 0.11.0: FlashInfer (PR #15777; the image ships FlashInfer).
- 0.11.1 to 0.15: PyTorch (PR #26859 disabled FlashInfer's sampler by default, Oct 2025).
- 0.16 to 0.19: Triton from 8 rows, PyTorch below (PR #33538).
- 0.20 on: FlashInfer (PR #40376, Apr 2026).

The requests' parameters (workload.sampling): `greedy` (temperature 0), `random` (a temperature,
no filter), `top_p`, `top_k`, `top_k_top_p`, or `model_default` (the request sets none, so vLLM
applies the checkpoint's generation_config.json: ModelSpec.generation_filter). Clients differ:
inference-perf and aiperf send no sampling parameters; the benchmark_serving.py that
InferenceMAX runs sends temperature 0. A step that samples any filtering row sorts all of its
rows; every row of a workload here has the same parameters.

Not every table says which GPU it ran on; they agree with each other per logit within 10%, and
the figures are used as they are on every GPU.
"""
from __future__ import annotations

import re

SAMPLING_MODES = ("model_default", "greedy", "random", "top_p", "top_k", "top_k_top_p")
FILTERS = ("top_p", "top_k", "top_k_top_p")

FILTER_FLOOR_S = 1.0e-4          # a row of 32k logits through the PyTorch top-k/top-p path
SORT_S_PER_LOGIT = 1.3e-10       # each further logit (rows x vocabulary) of that path
TRITON_FLOOR_S = 2.0e-4
TRITON_S_PER_LOGIT = 4.0e-11
TRITON_MIN_ROWS = 8


def release(version: str | None) -> tuple[int, int, int]:
    """(major, minor, patch) of deployment.vllm_version ("0.15.1", "v0.19"); None: the default
    release (sim.specs.DEFAULT_VLLM_VERSION)."""
    from sim.specs import DEFAULT_VLLM_VERSION, vllm_version_tuple
    major, minor = vllm_version_tuple(version)  # ValueError naming the field on a bad release
    m = re.match(r"v?\d+\.\d+\.(\d+)", str(version or DEFAULT_VLLM_VERSION).strip())
    return major, minor, int(m.group(1)) if m else 0


def filter_implementation(version: tuple[int, ...]) -> str:
    """'pytorch', 'triton' or 'flashinfer': what a vLLM release (major, minor[, patch]) runs for
    top-k/top-p sampling by default on CUDA (see the module docstring)."""
    v = tuple(version) + (0,) * (3 - len(version))
    if v < (0, 9, 0):
        return "pytorch"
    if v < (0, 11, 1):
        return "flashinfer"
    if v < (0, 16, 0):
        return "pytorch"
    if v < (0, 20, 0):
        return "triton"
    return "flashinfer"


def filters(mode: str, generation_filter: str) -> bool:
    """Whether requests of this workload.sampling mode filter by top-k/top-p on this model."""
    if mode not in SAMPLING_MODES:
        raise ValueError(f"workload.sampling={mode!r}: one of {list(SAMPLING_MODES)}")
    if mode == "model_default":
        return generation_filter in FILTERS
    return mode in FILTERS


def filter_cost_s(implementation: str, rows: int, vocab_size: int) -> float:
    """Seconds the top-k/top-p filtering of `rows` sampled rows adds to a step, over the plain
    sampler (Overheads.sampler_s)."""
    if rows <= 0 or implementation == "flashinfer":
        return 0.0
    logits = rows * vocab_size
    if implementation == "triton" and rows >= TRITON_MIN_ROWS:
        return TRITON_FLOOR_S + logits * TRITON_S_PER_LOGIT
    return FILTER_FLOOR_S + logits * SORT_S_PER_LOGIT
