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

Which one a release runs for top-k/top-p (filter_implementation):
- before 0.17: PyTorch. vLLM 0.9-0.11.0 used FlashInfer's kernel where FlashInfer was installed
  (PRs #15777, #26859), but the startup logs of 0.10-0.16 that size the memory reserve
  (sim.specs.activation_reserve_bytes) show the sort's buffers in the sampler warm-up, so the
  sort is what those releases are timed with. The 0.16 logs still show the sort and 0.19's the
  Triton kernel's smaller footprint; 0.17 is taken as its first release, as the memory model does.
- 0.17 to 0.19: Triton from 8 rows, PyTorch below (PR #33538).
- 0.20 on: FlashInfer (PR #40376, Apr 2026).

The requests' parameters (workload.sampling): `greedy` (temperature 0), `random` (a temperature,
no filter), `top_p`, `top_k`, `top_k_top_p`, or `model_default` (the request sets none, so vLLM
from 0.8 applies the checkpoint's generation_config.json, ModelSpec.generation_filter: PR #12622;
before 0.8, its own defaults, which do not filter). Clients differ:
inference-perf and aiperf send no sampling parameters; the benchmark_serving.py that
InferenceMAX runs sends temperature 0. A step that samples any filtering row sorts all of its
rows; every row of a workload here has the same parameters.

Not every table says which GPU it ran on. From 64 rows up they agree per logit within 10% (PR
#51507's figures for 4-16 rows vary several-fold between its two tables). The figures are used as
they are on every GPU.
"""
from __future__ import annotations

SAMPLING_MODES = ("model_default", "greedy", "random", "top_p", "top_k", "top_k_top_p")
FILTERS = ("top_p", "top_k", "top_k_top_p")

FILTER_FLOOR_S = 1.0e-4          # a row of 32k logits through the PyTorch top-k/top-p path
SORT_S_PER_LOGIT = 1.3e-10       # each further logit (rows x vocabulary) of that path
TRITON_FLOOR_S = 2.0e-4
TRITON_S_PER_LOGIT = 4.0e-11
TRITON_MIN_ROWS = 8

GENERATION_CONFIG_FROM = (0, 8)  # vLLM applies generation_config.json by default (PR #12622)
SAMPLER_SORT_UNTIL = (0, 17)     # the PyTorch sort before; Triton from 8 rows from (PR #33538)
FLASHINFER_FROM = (0, 20)        # FlashInfer's sampler by default (PR #40376)


def filter_implementation(version: tuple[int, int]) -> str:
    """'pytorch', 'triton' or 'flashinfer': what a vLLM release (major, minor) runs for top-k/top-p
    sampling by default on CUDA (see the module docstring)."""
    v = tuple(version)[:2]
    if v < SAMPLER_SORT_UNTIL:
        return "pytorch"
    return "triton" if v < FLASHINFER_FROM else "flashinfer"


def check_generation_filter(value: str) -> None:
    """ValueError naming generation_filter unless `value` is "" (no filter) or one of FILTERS."""
    if value not in ("",) + FILTERS:
        raise ValueError(f"generation_filter={value!r}: one of {['', *FILTERS]}")


def filters(mode: str, generation_filter: str, version: tuple[int, int]) -> bool:
    """Whether requests of this workload.sampling mode filter by top-k/top-p on this model
    (generation_filter: ModelSpec.generation_filter) under vLLM release `version` (major, minor)."""
    if mode not in SAMPLING_MODES:
        raise ValueError(f"workload.sampling={mode!r}: one of {list(SAMPLING_MODES)}")
    check_generation_filter(generation_filter)
    if mode == "model_default":
        return generation_filter in FILTERS and tuple(version)[:2] >= GENERATION_CONFIG_FROM
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
