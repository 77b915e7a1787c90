"""Prediction intervals for simulated percentiles.

A simulated percentile is uncertain for two reasons, and the interval combines both:

- the workload: another draw of the same arrival process and length distributions gives another
  value (workload seed replicates);
- the cost model: a step's real time scatters around the fitted prediction (drawn per step by
  NoisyCostModel from the profile's noise quantiles: the out-of-sample residuals with each sweep
  group's own mean taken out), and the fit can be off systematically for a regime it did not
  see (the profile's held-out group biases, metadata.cv_group_bias, 5th to 95th percentile).

`interval(values, profile_meta)` turns one percentile's values over the replicates into
[min / (1 + b95), max / (1 + b05)], where b are the held-out group biases (prediction/measured - 1).
A cost model without residuals (the analytic roofline, or a synthetic profile fitted to it)
contributes nothing: its interval covers workload variation only, and says so.
"""
from __future__ import annotations

import numpy as np

from sim.cost_model import CostModel

METRICS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")
STATS = ("p50", "p90", "p95", "p99")


class NoisyCostModel(CostModel):
    """A fitted model whose step times scatter as the profiled engine's did: each step takes the
    prediction times a ratio measured/predicted drawn from the profile's noise quantiles
    (interpolated between them): the out-of-sample residuals with each sweep group's mean ratio
    taken out, so a regime's systematic error (which the intervals carry) is not replayed as
    per-step scatter; each kind's ratio then has the mean that makes that kind's expected time
    add up to its measured time over the calibration (calibration.fit.sum_unbiased_noise). A
    profile fitted before those were kept has only
    the residual quantiles, and draws from them. Per kind of step where the profile has them
    (`..._by_kind`): a step with a prefill chunk draws from the prefill steps' and a decode-only
    step from the decode steps' (a prefill chunk scatters less); otherwise from the pooled ones."""

    kind = "fitted+noise"

    def __init__(self, base, seed: int, scale: float = 1.0) -> None:
        noise = base.noise_quantiles
        self.source = "noise_quantiles" if len(noise) >= 2 else "residual_quantiles"
        self.source_text = ("per-step noise (its out-of-sample residuals less each group's mean)"
                            if len(noise) >= 2 else "out-of-sample residuals")
        q = noise if len(noise) >= 2 else base.residual_quantiles
        if len(q) < 2:
            raise ValueError("cost_model.profile: residual_quantiles has fewer than 2 levels; "
                             "recalibrate with servetwin calibrate")
        self._u, self._ratio = _ratio_table(q)
        by_kind = base.noise_quantiles_by_kind if len(noise) >= 2 else base.residual_quantiles_by_kind
        self._prefill = _ratio_table(by_kind["prefill"]) if len(by_kind.get("prefill", ())) >= 2 else None
        self._decode = _ratio_table(by_kind["decode"]) if len(by_kind.get("decode", ())) >= 2 else None
        self.base = base
        self.rng = np.random.default_rng(seed)
        self.scale = scale
        self.metadata = base.metadata

    def ratio_table(self, f) -> tuple[np.ndarray, np.ndarray]:
        """(uniform levels, ratio measured/predicted) the noise of a step with features f draws from."""
        table = self._prefill if f.num_prefill_reqs else self._decode
        return table if table is not None else (self._u, self._ratio)

    def set_group_tokens(self, num_tokens: int | None) -> None:
        self.base.set_group_tokens(num_tokens)

    def dp_pads(self, num_tokens: int) -> bool:
        return self.base.dp_pads(num_tokens)

    def step_time(self, f) -> float:
        u, ratio = self.ratio_table(f)
        return self.base.step_time(f) * self.scale * float(np.interp(self.rng.random(), u, ratio))

    def mean_ratio(self, f) -> float:
        """The mean of the ratio a step with features f is multiplied by (times scale)."""
        return self.scale * _table_mean(*self.ratio_table(f))

    def describe(self) -> dict:
        return {"kind": self.kind, **self.metadata}


def _table_mean(u: np.ndarray, ratio: np.ndarray) -> float:
    """The mean of the ratio NoisyCostModel.step_time draws from (u, ratio): linear between the
    levels, flat beyond the first and the last."""
    inner = float(np.sum((ratio[1:] + ratio[:-1]) * np.diff(u)) / 2)
    return inner + u[0] * ratio[0] + (1.0 - u[-1]) * ratio[-1]


def quantiles_mean_ratio(q: dict) -> float:
    """The mean ratio measured/predicted that a step drawing from quantiles q ({"p05": r, ...},
    r = predicted / measured - 1) is multiplied by."""
    return _table_mean(*_ratio_table(q))


def _ratio_table(q: dict) -> tuple[np.ndarray, np.ndarray]:
    """Residual (or noise) quantiles {"p05": r, ...} (r = predicted / measured - 1) as (uniform levels
    ascending, ratio measured / predicted = 1 / (1 + r)): the p-quantile of r is the
    (1 - p)-quantile of the ratio."""
    levels = sorted(q, key=lambda k: int(k[1:]))
    p = np.array([int(k[1:]) / 100 for k in levels])
    return (1.0 - p)[::-1], np.array([1.0 / (1.0 + q[k]) for k in levels])[::-1]


def has_residuals(cost_model) -> bool:
    return len(cost_model.residual_quantiles) >= 2


def group_bias_range(meta: dict) -> tuple[float, float]:
    b = np.asarray(meta.get("cv_group_bias") or [0.0], dtype=float)
    return float(np.quantile(b, 0.05)), float(np.quantile(b, 0.95))


def interval(values: list[float], meta: dict) -> list[float] | None:
    v = [x for x in values if x is not None and x == x]
    if not v:
        return None
    lo, hi = group_bias_range(meta)
    return [min(v) / (1 + hi), max(v) / (1 + lo)]


def add_intervals(summary: dict, replicate_summaries: list[dict], meta: dict, how: str) -> None:
    """summary[metric][stat + '_interval'] = [lo, hi] over the main run and the replicates."""
    runs = [summary, *replicate_summaries]
    for k in METRICS:
        for st in STATS:
            iv = interval([r[k].get(st) for r in runs], meta)
            if iv is not None:
                summary[k][f"{st}_interval"] = iv
    summary["intervals"] = {"replicates": len(replicate_summaries), "method": how}
