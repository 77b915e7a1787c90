"""An upper bound on what one unit of a deployment can serve, from its timing model alone.

No simulation: the planner uses it to order candidates and to skip those that cannot beat the
best answer found so far (a lower bound on their cost), then simulates only near the answer.

A unit serving lambda req/s in steady state must, every second, run lambda x O decode rows and
lambda x (P_u + O) tokens, where O is the mean output and P_u the mean prompt tokens left after
ideal prefix-cache hits. Its step times t(.) are sub-additive in the work of a step (weights are
read once per step), so the cheapest way to run that work is in the largest steps allowed:

    decode rows  in steps of b <= B* decodes:   time >= lambda x O x min_b t_dec(b) / b
    tokens       in steps of T <= budget:       time >= lambda x (P_u + O) x min_T t_pre(T) / T

and time <= 1 s per second. B* is the largest decode batch the unit can hold (max_num_seqs, the
KV pool at the mean request length) and, with a TPOT SLO, whose decode step fits the TPOT limit
x TPOT_SLACK. t_pre(T) is one prefill chunk of T tokens on an empty context (attention at its
least). The bound is lambda_max = 1 / max(the two per-request times) x SLACK: a generous margin,
since it steers the search and a bound set too low would hide a candidate.
"""
from __future__ import annotations

import math

import numpy as np

from engine.core.features import BatchFeatures
from engine.core.kv_cache_manager import window_reserve_blocks

SLACK = 1.3        # the bound is an upper bound on capacity with this margin
TPOT_SLACK = 1.5   # a decode batch counts as allowed while its step fits TPOT limit x this


def _decode(n: int, ctx: float) -> BatchFeatures:
    return BatchFeatures(num_reqs=n, num_decode_reqs=n, decode_context_tokens=int(n * ctx))


def _prefill(t: int) -> BatchFeatures:
    f = BatchFeatures(num_reqs=1)
    f.add(t, 0)
    return f


def _log_points(hi: int) -> list[int]:
    pts = sorted({int(round(x)) for x in np.geomspace(1, max(hi, 1), 48)} | {hi})
    return [p for p in pts if 1 <= p <= hi]


def decode_seconds_per_row(cost, max_batch: int, ctx: float, tpot_limit: float | None) -> tuple[float, int]:
    """(min over allowed b of t_dec(b) / b, the largest allowed b)."""
    best, top = math.inf, 1
    for b in _log_points(max_batch):
        t = cost.step_time(_decode(b, ctx))
        if tpot_limit is not None and b > 1 and t > tpot_limit * TPOT_SLACK:
            break
        top = b
        if t / b < best:
            best = t / b
    return best, top


def token_seconds(cost, budget: int) -> float:
    """min over T <= budget of t_pre(T) / T (a prefill chunk of T tokens, empty context)."""
    return min(cost.step_time(_prefill(t)) / t for t in _log_points(budget))


def workload_means(sc) -> tuple[float, float]:
    """(mean uncached prompt tokens, mean output tokens) of a parsed scenario's workload."""
    w = sc.workload
    if not len(w):
        return 1.0, 1.0
    p = float(np.mean(w.prompt_len))
    if sc.scheduler_config.enable_prefix_caching:
        p *= 1.0 - w.describe().get("ideal_prefix_hit_fraction", 0.0)
    return max(p, 1.0), float(np.mean(w.output_len))


def _pool_bound(cost, cfg, p_u: float, out: float, tpot: float | None, prefill_only=False,
                decode_only=False) -> float:
    ctx = p_u + out / 2
    # (a sliding-window model's running request also holds its window: KVCacheManager's charge)
    window = window_reserve_blocks(1, cfg.block_size, cfg.sliding_window, cfg.sliding_kv_bytes,
                                   cfg.kv_bytes) * cfg.block_size if cfg.sliding_window else 0
    kv_reqs = max(1, (cfg.num_gpu_blocks - 1) * cfg.block_size // max(int(p_u + out) + window, 1))
    per_req = 0.0
    if not prefill_only:
        row, _ = decode_seconds_per_row(cost, max(1, min(cfg.max_num_seqs, kv_reqs)), ctx, tpot)
        per_req = max(per_req, out * row)
    if not decode_only:
        tokens = p_u + (1 if prefill_only else out)
        per_req = max(per_req, tokens * token_seconds(cost, cfg.max_num_batched_tokens))
    return SLACK / per_req if per_req > 0 else math.inf


def capacity_bound(sc, tpot_limit: float | None) -> float:
    """Upper bound (req/s) on what one unit of the parsed scenario `sc` serves (see the module
    doc); a P/D unit: the smaller of its prefill pool's and its decode pool's bounds."""
    p_u, out = workload_means(sc)
    if sc.pd is None:  # a unit of data_parallel ranks, each its own scheduler and pool
        return sc.data_parallel * _pool_bound(sc.cost_model, sc.scheduler_config, p_u, out, tpot_limit)
    pcfg, pcost = sc.pd["prefill"]
    dcfg, dcost = sc.pd["decode"]
    ranks = {pool: sc.pd[f"{pool}_replicas"] * sc.pd.get(f"{pool}_data_parallel", 1) for pool in ("prefill", "decode")}
    pre = ranks["prefill"] * _pool_bound(pcost, pcfg, p_u, out, None, prefill_only=True)
    dec = ranks["decode"] * _pool_bound(dcost, dcfg, p_u, out, tpot_limit, decode_only=True)
    return min(pre, dec)


__all__ = ["capacity_bound", "decode_seconds_per_row", "token_seconds", "workload_means", "SLACK"]
