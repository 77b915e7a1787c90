"""The machine's speed now: a fixed reference workload timed on the engine.

A shared machine (a cloud VM with noisy neighbours, a laptop changing clocks) runs the same step
at different speeds from one minute to the next: on this project's 2-core VM the same decode
step took 75 ms in one minute and 95 ms in another, with nothing of our own running. A profile
fitted through such drift absorbs it into its coefficients wherever the sweep's order lines up
with a feature (the long prompts measured last look slow), and a validation run in a fast
minute sees a profile from a slow one as a bias.

`speed_probe(engine)` times a reference that never changes: PROBE_REQUESTS requests of
PROBE_PROMPT tokens (the same ids on every call, seeded; fewer on an engine too small for them,
see `probe_shape`) each decoding PROBE_DECODES tokens, and returns the median period of its steps
in which all of them decode. It takes a few seconds.

- `servetwin calibrate` runs it before every sweep group and after the last, divides each
  group's step periods by that group's speed factor (the geometric mean of the probes around it
  over the median probe; calibration.calibrate.run_sweep), and keeps the probes in the profile
  (metadata.speed_probe): the fit sees the machine at its median speed.
- How much the steps follow the probe is itself fitted: the factor is raised to an exponent b
  in [0, 1] chosen by the fit's leave-one-group-out error (calibration.calibrate.
  fit_probe_exponent; metadata.speed_probe.exponent). A probe is a few steps of one small batch
  at one moment: on a noisy machine it tracks real drift (b near 1), on a steady one its own
  scatter is most of what it reads (b near 0).
- `servetwin validate` runs it before every engine run and scales the profile for the
  simulator's side of that run by L x (f / L) ** b, f = probe / profile probe and L the geometric
  mean of f over the validation's runs: b describes deviations around a calibration's own median,
  not a shift of the whole machine since it (calibration.validate.applied_factors; raw and
  applied factors are reported per run).
  What drift remains within a run widens the prediction interval by the spread of the ratio of
  consecutive probes measured during calibration.

Two speeds, not one. Decode steps of a small model on a CPU stream the weights (memory-bound);
prefill chunks run GEMMs (compute-bound). A noisy neighbour slows the two differently: in this
project's validation runs, when decode steps ran 1.6-1.85x slower than at calibration, steps with
a prefill chunk ran only ~0.8-0.85 of that factor, and scaling a whole prediction by the decode
probe over-predicted every prefill by about 9%. `compute_probe(engine)` times a second reference,
one COMPUTE_PROMPT-token prefill step (fresh ids each call: no prefix-cache hit); calibrate and
validate scale the prefill part of a step (what its prefill chunks add to the fitted time,
`split_time`) by the compute probe and the rest by the decode probe (`SplitSpeedModel`).
"""
from __future__ import annotations

import itertools
import math
import statistics
from contextlib import contextmanager

import numpy as np

from calibration.driver import Arrival, drive
from engine.core import SamplingParams
from sim.cost_model import CostModel

PROBE_REQUESTS = 4
PROBE_PROMPT = 64
PROBE_DECODES = 16
COMPUTE_PROMPT = 256
COMPUTE_REPEATS = 3
_calls = itertools.count()


# The scheduler the probes run under, whatever the engine serves with: a setting's budget,
# max_num_seqs, policy or max_model_len must not change the reference's shape (a 128-token budget
# once cut the 256-token compute reference in two and read the machine as twice as fast).
PROBE_KNOBS = {"max_num_batched_tokens": 512, "max_num_seqs": 32, "policy": "fcfs", "enable_chunked_prefill": True,
               "long_prefill_token_threshold": 0, "enable_prefix_caching": True, "watermark": 0.0,
               "reserve_full_prompt": True}


@contextmanager
def probe_scheduler(engine):
    """Run the block under the probes' own scheduler (PROBE_KNOBS, max_model_len as large as the
    KV pool and the model allow) and give the engine its own back afterwards, with its prefix
    cache emptied (the probe wrote into blocks it may have cached). An engine without
    `reconfigure` (a stand-in) runs as it is."""
    if not hasattr(engine, "reconfigure"):
        yield
        return
    saved, saved_cfg, saved_len = engine.scheduler, engine.scheduler_config, engine.max_model_len
    cap = (engine.num_gpu_blocks - 1) * engine.block_size
    engine.reconfigure(**PROBE_KNOBS, max_model_len=min(cap, engine.model.config.max_position_embeddings))
    try:
        yield
    finally:
        engine.scheduler, engine.scheduler_config, engine.max_model_len = saved, saved_cfg, saved_len
        engine.memory_profile["max_model_len"] = saved_len
        engine.reset_prefix_cache()


def speed_probe(engine, seed: int = 20261130) -> float:
    """Median step period (s) of the reference decode on `engine` now (under the probes' own
    scheduler: the same shape whatever the engine serves with)."""
    with probe_scheduler(engine):
        return _speed_probe(engine, seed)


def _speed_probe(engine, seed: int) -> float:
    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    k, prompt = probe_shape(engine)
    n = next(_calls)
    reqs = [Arrival(0.0, f"speed-probe-{n}-{i}", rng.integers(100, vocab - 100, prompt).tolist(),
                    SamplingParams(max_tokens=PROBE_DECODES, ignore_eos=True, temperature=0), "speed-probe")
            for i in range(k)]
    res = drive(engine, reqs)
    periods = [p for s, p in zip(res.steps, res.periods_s)
               if p is not None and s.num_prefill_reqs == 0 and s.num_decode_reqs == k]
    if not periods:
        raise RuntimeError("speed probe: no step with every probe request decoding was timed")
    return float(statistics.median(periods))


def compute_probe(engine, seed: int = 20261201) -> float:
    """Median duration (s) of a prefill-only step of COMPUTE_PROMPT tokens (fewer on an engine too
    small for them) on `engine` now, over COMPUTE_REPEATS steps (under the probes' own scheduler:
    the same shape whatever the engine serves with)."""
    with probe_scheduler(engine):
        return _compute_probe(engine, seed)


def _compute_probe(engine, seed: int) -> float:
    n = next(_calls)
    rng = np.random.default_rng(seed + n)
    vocab = engine.vocab_size
    tokens = max(1, min(COMPUTE_PROMPT, engine.scheduler_config.max_num_batched_tokens, engine.max_model_len - 2))
    times = []
    for i in range(COMPUTE_REPEATS):
        a = Arrival(0.0, f"compute-probe-{n}-{i}", rng.integers(100, vocab - 100, tokens).tolist(),
                    SamplingParams(max_tokens=1, ignore_eos=True, temperature=0), "compute-probe")
        res = drive(engine, [a])
        times.extend(s.end_s - s.start_s for s in res.steps if s.num_prefill_reqs == 1 and s.num_decode_reqs == 0)
    if not times:
        raise RuntimeError("compute probe: no prefill-only step was timed")
    return float(statistics.median(times))


def split_time(model, f) -> tuple[float, float]:
    """(rest, prefill part) of a fitted model's step time: the same step without its prefill
    chunks (its decodes and per-step cost), and what the prefill chunks add to it."""
    rest = model._time(f.num_decode_reqs, f.num_decode_reqs, 0, 0, 0, f.decode_context_tokens)
    return rest, model.step_time(f) - rest


class SplitSpeedModel(CostModel):
    """A fitted model at a machine speed measured by both probes: the prefill part of each step
    scaled by `compute_factor`, the rest by `decode_factor` (either may be a callable of nothing,
    for a speed that moves with the simulated time)."""

    def __init__(self, base, decode_factor, compute_factor) -> None:
        self.base = base
        self.decode_factor = decode_factor if callable(decode_factor) else (lambda v=float(decode_factor): v)
        self._compute = compute_factor if callable(compute_factor) else (lambda v=float(compute_factor): v)
        self.residual_quantiles = base.residual_quantiles
        self.residual_quantiles_by_kind = base.residual_quantiles_by_kind
        self.noise_quantiles = base.noise_quantiles
        self.noise_quantiles_by_kind = base.noise_quantiles_by_kind
        self.metadata = base.metadata
        self.kind = base.kind

    @property
    def compute_factor(self) -> float:
        return float(self._compute())

    def step_time(self, f) -> float:
        rest, pf = split_time(self.base, f)
        return rest * self.decode_factor() + pf * self._compute()

    def describe(self) -> dict:
        return self.base.describe()


def speed_around(before_s: float, after_s: float) -> float:
    """The machine's speed over a span, from the probes before and after it: their geometric mean."""
    return math.sqrt(before_s * after_s)


def probe_shape(engine) -> tuple[int, int]:
    """(requests, prompt tokens) of the reference on this engine: PROBE_REQUESTS x PROBE_PROMPT,
    fewer where max_num_seqs or max_model_len are smaller (a tiny test engine)."""
    k = max(1, min(PROBE_REQUESTS, engine.scheduler_config.max_num_seqs))
    return k, max(1, min(PROBE_PROMPT, engine.max_model_len - PROBE_DECODES - 1))


def drift_range(probes: list[float]) -> tuple[float, float]:
    """5th and 95th percentile of the ratio of consecutive probes: how far the machine's speed
    moves over one group's time after it was measured (1.0, 1.0 with fewer than 3 probes)."""
    if len(probes) < 3:
        return 1.0, 1.0
    r = np.asarray(probes[1:]) / np.asarray(probes[:-1])
    return float(np.quantile(r, 0.05)), float(np.quantile(r, 0.95))


def probe_metadata(probes: list[float], compute: list[float] | None = None) -> dict:
    lo, hi = drift_range(probes)
    extra = {}
    if compute:
        extra["compute"] = {"median_s": float(statistics.median(compute)),
                            "probes_s": [round(p, 6) for p in compute],
                            "reference": f"one {COMPUTE_PROMPT}-token prefill-only step, median of "
                                         f"{COMPUTE_REPEATS} (calibration.probe.compute_probe)",
                            "applied": "the prefill part of each step (split_time) by this probe, "
                                       "the rest by the decode probe"}
    return {**extra, "median_s": float(statistics.median(probes)), "probes_s": [round(p, 6) for p in probes],
            "drift_range": [lo, hi],
            "reference": f"{PROBE_REQUESTS} requests x {PROBE_PROMPT} prompt tokens, {PROBE_DECODES} decodes "
                         "each; median period of the steps where all decode (calibration.probe)",
            "applied": "each sweep group's periods divided by the geometric mean of the probes around "
                       "it over median_s before the fit"}
