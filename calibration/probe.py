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
- `servetwin validate` runs it before every engine run and scales the profile by
  probe / profile probe for the simulator's side of that run (the factor is reported per run).
  What drift remains within a run widens the prediction interval by the spread of the ratio of
  consecutive probes measured during calibration.
"""
from __future__ import annotations

import itertools
import math
import statistics

import numpy as np

from calibration.driver import Arrival, drive
from engine.core import SamplingParams

PROBE_REQUESTS = 4
PROBE_PROMPT = 64
PROBE_DECODES = 16
_calls = itertools.count()


def speed_probe(engine, seed: int = 20261130) -> float:
    """Median step period (s) of the reference decode on `engine` now."""
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


def probe_metadata(probes: list[float]) -> dict:
    lo, hi = drift_range(probes)
    return {"median_s": float(statistics.median(probes)), "probes_s": [round(p, 6) for p in probes],
            "drift_range": [lo, hi],
            "reference": f"{PROBE_REQUESTS} requests x {PROBE_PROMPT} prompt tokens, {PROBE_DECODES} decodes "
                         "each; median period of the steps where all decode (calibration.probe)",
            "applied": "each sweep group's periods divided by the geometric mean of the probes around "
                       "it over median_s before the fit"}
