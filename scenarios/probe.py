"""Steady-state probes: does one unit of a deployment (a replica, or one P/D group) meet the SLOs
at a given arrival rate, in steady state?

A probe sends one long open-loop stream through the scenario and judges only the requests of its
measurement window, the middle of the stream:

    requests  [0, W)          warm-up: the replica fills from empty (optimistic), not measured
              [W, W + M)      measured: M requests, enough for the strictest percentile
                              (at least TAIL_SAMPLES beyond it: p99 -> 2,000)
              [W + M, N)      cool-down: arrivals keep coming while the measured requests finish,
                              so their last tokens are not served by a draining replica

W covers `warmup_requests` or WARMUP_LIFETIMES request lifetimes, whichever is more; the
cool-down is one lifetime. A lifetime is what the SLOs allow a request (E2E limit, or TTFT limit
+ mean output x TPOT limit), capped at PREFIX_E2E_FACTOR x the mean E2E measured on the probe's
own fail-fast prefix (`lifetime_s`).

A probe is refused as unstable when its replica is not in steady state over the window: the
requests in the system (arrived, not finished), sampled at 64 instants, grow along their linear
trend by more than `stable_tol` of the offered rate x the window's length and by more than
NOISE_SIGMAS times their spread around the trend (+ 2). A queue that keeps growing fails
whatever the percentiles say.

Fail fast. A replica that starts empty is at its least loaded; its first requests see shorter
queues and smaller batches than steady state. So a short prefix of the stream (a quarter of the
measured window's count, judged over all its requests) that already misses an SLO proves the
long probe would fail too; such a probe stops there (`stage` 1). Only probes that pass the
prefix run the whole stream. Passing is never decided on the prefix.

Units of a cluster. In a cluster of n units behind a round-robin router, each unit receives
every n-th request of the cluster's stream: for Poisson arrivals at rate T, gamma gaps of shape n
at rate T / n (less bursty than Poisson at T / n); a `random` router thins the stream
(Poisson at T / n). `unit_view` builds that stream, so a probe at (T, n) reads what one unit of
the n-unit cluster sees. Other routers (least_outstanding, prefix_affinity) balance better than
round robin: the round-robin view is the cautious stand-in, and the cluster simulation of the
plan's confirmation step decides.
"""
from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path

import numpy as np

from scenarios.compose import LATENCY_KEYS, at_rate
from sim.scenario import ScenarioError, parse_scenario, run_scenario
from sim.metrics import meets_slo, stats

TAIL_SAMPLES = 20          # requests beyond the strictest percentile in the measured window
MIN_MEASURED = 500         # measured requests at least (means and medians)
WARMUP_LIFETIMES = 3       # warm-up: request lifetimes before the window opens
DEFAULT_LIFETIME_S = 4.0   # a request's lifetime when no TTFT/TPOT SLO bounds it
PREFIX_SHARE = 4           # the fail-fast prefix: a quarter of the measured window's requests
PREFIX_E2E_FACTOR = 3      # a lifetime is at most this many times the prefix's mean E2E
STATS = ("mean", "p50", "p90", "p95", "p99")
NOISE_SIGMAS = 4           # growth must exceed this many standard deviations of the population
STABLE_LIFETIMES = 4       # a cluster window this many lifetimes long gets the stability test


def measured_requests(slo: dict, floor: int | None = None) -> int:
    """Requests in a probe's measurement window: TAIL_SAMPLES beyond the strictest percentile
    SLO (p99: 2,000), at least MIN_MEASURED (or `floor`, the plan's search.min_requests)."""
    n = max(MIN_MEASURED, floor or 0)
    for _metric, stat, _limit in slo["percentiles"]:
        if stat.startswith("p"):
            q = int(stat[1:]) / 100
            n = max(n, math.ceil(TAIL_SAMPLES / (1 - q)))
    if slo.get("attainment") is not None:
        n = max(n, math.ceil(TAIL_SAMPLES / max(1 - slo["attainment"], 1e-3)))
    return n


def lifetime_s(slo: dict, mean_output: float, prefix_e2e_s: float | None = None) -> float:
    """A request's time in the system, to size warm-ups and cool-downs: what the SLOs allow
    (the E2E limit, else TTFT limit + mean output x TPOT limit), but no more than
    PREFIX_E2E_FACTOR x the mean E2E its fail-fast prefix measured (a loose SLO must not make a
    probe endless); DEFAULT_LIFETIME_S when neither is known."""
    lim = {m: v for m, _s, v in slo["percentiles"]}
    allowed = None
    if "e2e_s" in lim:
        allowed = lim["e2e_s"]
    elif "ttft_s" in lim or "tpot_s" in lim:
        allowed = lim.get("ttft_s", 0.0) + max(mean_output - 1, 0) * lim.get("tpot_s", 0.0)
    seen = PREFIX_E2E_FACTOR * prefix_e2e_s if prefix_e2e_s and prefix_e2e_s == prefix_e2e_s else None
    got = [x for x in (allowed, seen) if x]
    return min(got) if got else DEFAULT_LIFETIME_S


def prefix_requests(slo: dict, search: dict) -> int:
    """Requests of a probe's fail-fast prefix: a quarter of its measured window, at least 100."""
    return max(100, measured_requests(slo, search.get("min_requests")) // PREFIX_SHARE)


def layout(rate: float, slo: dict, search: dict, life_s: float) -> tuple[int, int, int]:
    """(warm-up, measured, cool-down) request counts of a probe at `rate` req/s per unit whose
    requests live about `life_s` seconds."""
    m = measured_requests(slo, search.get("min_requests"))
    w = max(int(search.get("warmup_requests", 0)), math.ceil(rate * WARMUP_LIFETIMES * life_s), m // 4)
    c = max(math.ceil(rate * life_s), 50)
    return w, m, c


def unit_view(data: dict, total_rate: float, units: int, num_requests: int) -> dict:
    """The scenario as one of `units` identical units behind the scenario's router sees it, the
    cluster receiving `total_rate` req/s (see the module doc)."""
    out = at_rate(data, total_rate / units, num_requests)
    router = (out.get("deployment") or {}).get("router", "round_robin")
    arrival = out["workload"].get("arrival")
    if units > 1 and router != "random" and isinstance(arrival, dict):
        kind = arrival.get("type")
        if kind == "poisson":
            arrival.update(type="gamma", burstiness=float(units))
        elif kind == "gamma":
            arrival["burstiness"] = float(arrival.get("burstiness", 1.0)) * units
    for key in ("replicas",):
        out.setdefault("deployment", {})[key] = 1
    return out


def in_system(arrival_s: np.ndarray, finish_s: np.ndarray, t: float) -> int:
    """Requests arrived by t and not finished by t."""
    f = np.nan_to_num(finish_s, nan=np.inf)
    return int(np.sum(arrival_s <= t) - np.sum(f <= t))


def window_metrics(res, sc, lo: int, hi: int) -> dict:
    """Latency statistics, attainment and stability of the requests with send index in [lo, hi)."""
    t = res.request_table
    n = len(t["arrival_s"])
    hi = min(hi, n)
    sel = slice(lo, hi)
    a = np.asarray(t["arrival_s"], dtype=float)
    f = np.asarray(t["finish_s"], dtype=float)
    m: dict = {}
    for k in LATENCY_KEYS:
        if k == "itl_s":
            m[k] = _itl_stats(res, lo, hi)
            continue
        v = np.asarray(t[k][sel], dtype=float)
        s = stats(v[~np.isnan(v)])
        m[k] = {p: s[p] for p in STATS}
    fr = np.asarray(t["finish_reason"][sel], dtype=object)
    completed = int(np.sum((fr == "stop") | (fr == "length")))
    m["completed"], m["total"] = completed, hi - lo
    m["attainment"] = (float(np.sum(meets_slo({k: v[sel] for k, v in t.items()}, sc.slo))) / (hi - lo)
                       if sc.slo and hi > lo else None)
    t0, t1 = float(a[lo]), float(a[hi - 1])
    dur = max(t1 - t0, 1e-9)
    # The population (arrived, not finished) at 64 instants across the window, its linear trend
    # over the window (growth) and the spread around that trend (the noise it must stand out of).
    ts = np.linspace(t0, t1, 64)
    fin = np.sort(np.nan_to_num(f, nan=np.inf))
    pop = np.searchsorted(np.sort(a), ts, side="right") - np.searchsorted(fin, ts, side="right")
    slope, icpt = np.polyfit(ts - t0, pop, 1) if dur > 1e-9 else (0.0, float(pop[0]))
    growth = float(slope * dur)
    spread = float(np.std(pop - (slope * (ts - t0) + icpt)))
    offered = (hi - lo - 1) / dur
    m["window_s"] = [t0, t1]
    m["offered_rps"] = offered
    m["served_rps"] = offered - growth / dur
    m["in_system"] = [int(pop[0]), int(pop[-1])]
    m["queue_growth"] = growth
    m["noise_floor"] = NOISE_SIGMAS * spread + 2
    done = f[sel]
    m["throughput_rps"] = completed / max(float(np.nanmax(done)) - t0, 1e-9) if completed else 0.0
    out_tokens = np.asarray(t["num_output_tokens"][sel], dtype=float)
    m["output_tokens_per_s"] = float(out_tokens.sum()) / dur
    return m


def _itl_stats(res, lo: int, hi: int) -> dict:
    """ITL of the window's requests from their token times when kept, else of the whole run."""
    recs = res.records[lo:hi]
    gaps = [np.diff(r.token_times_s) for r in recs if r.token_times_s is not None and len(r.token_times_s) > 1]
    if gaps:
        s = stats(np.concatenate(gaps))
    else:
        v, w = res.itl
        s = stats(v, w)
    return {p: s[p] for p in STATS}


def stable(m: dict, tol: float) -> bool:
    """No queue growth beyond `tol` of the offered load over the window, past the noise floor."""
    dur = m["window_s"][1] - m["window_s"][0]
    g = m["queue_growth"]
    return not (g > m["noise_floor"] and g > tol * m["offered_rps"] * dur)


def violations(m: dict, slo: dict, tol: float | None = None) -> list[dict]:
    """The SLOs a window violates, each with its value, limit and value / limit; `tol`: also
    refuse an unstable window (a queue that keeps growing)."""
    out = []
    for metric, stat, limit in slo["percentiles"]:
        v = m[metric][stat]
        if v is None or v != v or v > limit:
            v = math.inf if v is None or v != v else v
            out.append({"slo": f"{stat} {metric}", "value": v, "limit": limit, "ratio": v / limit})
    a = slo.get("attainment")
    if a is not None:
        got = m.get("attainment") or 0.0
        if got < a:
            out.append({"slo": "attainment", "value": got, "limit": a, "ratio": (1 - got) / max(1 - a, 1e-9)})
    if m["completed"] < m["total"]:
        out.append({"slo": "completion", "value": m["completed"], "limit": m["total"],
                    "ratio": m["total"] / max(m["completed"], 1)})
    if tol is not None and not stable(m, tol):
        out.append({"slo": "unstable", "value": m["served_rps"], "limit": m["offered_rps"],
                    "ratio": m["offered_rps"] / max(m["served_rps"], 1e-9)})
    return out


def run(data: dict, base_dir, seed: int, keep_token_times: bool = False):
    """Parse and simulate one composed scenario (no plots): (scenario, result). Kernel-table
    fallbacks are not warned about here: they are counted (`cost_provenance`) and reported."""
    data = copy.deepcopy(data)
    out = data.setdefault("output", {})
    out["plots"] = False
    if keep_token_times:
        out["record_token_times"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        sc = parse_scenario(data, base_dir=Path(base_dir) if base_dir else None, seed=seed)
        return sc, run_scenario(sc)


def cost_provenance(sc, into: dict | None = None) -> dict:
    """Table lookups and fallbacks (per term, with the range of queries outside the tables) of
    the cost models of a scenario that has run, added into `into`."""
    out = into if into is not None else {"lookups": 0, "fallbacks": {}, "fallback_range": {}}
    models = [sc.cost_model] if sc.pd is None else [sc.pd["prefill"][1], sc.pd["decode"][1]]
    for cm in models:
        base = getattr(cm, "base", cm)
        out["lookups"] += int(getattr(base, "lookups", 0))
        for term, n in (getattr(base, "fallbacks", None) or {}).items():
            out["fallbacks"][term] = out["fallbacks"].get(term, 0) + int(n)
        for term, rng in (getattr(base, "fallback_range", None) or {}).items():
            lo, hi = rng
            have = out["fallback_range"].get(term)
            out["fallback_range"][term] = (
                [lo, hi] if have is None else
                [[min(a, b) for a, b in zip(have[0], lo)], [max(a, b) for a, b in zip(have[1], hi)]])
    return out


def workload_stats(data: dict, base_dir) -> dict:
    """Means and standard deviations of the scenario workload's prompt and output lengths (a
    2,000-request draw)."""
    from scenarios.compose import set_field
    from sim.workload import build_workload
    wl = set_field(data, "workload.num_requests", 2000).get("workload")
    w = build_workload(wl, seed=0, base_dir=Path(base_dir) if base_dir else None)
    if not len(w):
        return {"prompt_tokens_mean": 1.0, "prompt_tokens_std": 0.0, "output_tokens_mean": 1.0,
                "output_tokens_std": 0.0}
    return {"prompt_tokens_mean": float(np.mean(w.prompt_len)), "prompt_tokens_std": float(np.std(w.prompt_len)),
            "output_tokens_mean": float(np.mean(w.output_len)), "output_tokens_std": float(np.std(w.output_len))}


def _mean_e2e(res) -> float | None:
    v = np.asarray(res.request_table["e2e_s"], dtype=float)
    v = v[~np.isnan(v)]
    return float(v.mean()) if v.size else None


def probe(data: dict, base_dir, total_rate: float, units: int, slo: dict, search: dict,
          out_len: float) -> dict:
    """One unit of an n-unit cluster at `total_rate` (see the module doc): every seed in turn,
    each first as its fail-fast prefix, whose mean E2E sizes the warm-up and cool-down
    (`lifetime_s`). ok: every seed's window met every SLO and was stable."""
    rate = total_rate / units
    itl = any(metric == "itl_s" for metric, _s, _v in slo["percentiles"])
    tol = search.get("stable_tol", 0.05)
    first = prefix_requests(slo, search)
    runs = []
    prov = None
    lay = None
    for seed in search["seeds"]:
        sc, res = run(unit_view(data, total_rate, units, first), base_dir, seed, itl)
        prov = cost_provenance(sc, prov)
        pm = window_metrics(res, sc, 0, first)
        v = violations(pm, slo)  # no stability test: from empty, the population always grows
        rec = {"seed": seed, "stage": 1, "requests": first, "simulated_s": res.summary["simulated_s"]}
        if not v:
            if lay is None:  # sized once, from the first seed's prefix: every seed runs the same layout
                lay = layout(rate, slo, search, lifetime_s(slo, out_len, _mean_e2e(res)))
            w, mm, c = lay
            total = w + mm + c
            sc, res = run(unit_view(data, total_rate, units, total), base_dir, seed, itl)
            prov = cost_provenance(sc, prov)
            pm = window_metrics(res, sc, w, w + mm)
            v = violations(pm, slo, tol)
            rec.update(stage=2, requests=total, simulated_s=res.summary["simulated_s"])
        runs.append({**rec, "metrics": pm, "violations": v})
        if v:
            break
    layout_rec = dict(zip(("warmup", "measured", "cooldown"), lay)) if lay else None
    return {"total_rate": total_rate, "units": units, "rate": rate, "ok": not runs[-1]["violations"],
            "layout": layout_rec, "runs": runs, "provenance": prov}


def confirm(data: dict, base_dir, rate: float, slo: dict, search: dict, out_len: float) -> dict:
    """A whole cluster (the composed scenario `data`) at `rate` req/s from empty, every seed:
    `search["confirm_requests"]` requests, or more when the cluster's warm-up, measured window
    and cool-down (`layout` at the cluster's rate) need more. Judged over all its requests (what
    `servetwin simulate` reports) and over its steady window (after the warm-up, before the
    cool-down, with the stability test when the window spans STABLE_LIFETIMES lifetimes).
    ok: both met every SLO on every seed. A seed whose fail-fast prefix misses an SLO ends the
    check."""
    itl = any(metric == "itl_s" for metric, _s, _v in slo["percentiles"])
    tol = search.get("stable_tol", 0.05)
    base = int(search.get("confirm_requests", 8000))
    first = max(base // 8, 200)
    runs = []
    prov = None
    lay = None
    for seed in search["seeds"]:
        sc, res = run(at_rate(data, rate, first), base_dir, seed, itl)
        prov = cost_provenance(sc, prov)
        am = window_metrics(res, sc, 0, first)
        v = violations(am, slo)
        rec = {"seed": seed, "stage": 1, "requests": first, "simulated_s": res.summary["simulated_s"],
               "all": am, "steady": None}
        if not v:
            if lay is None:
                life = lifetime_s(slo, out_len, _mean_e2e(res))
                w, m, c = layout(rate, slo, search, life)
                lay = (w, c, max(base, w + m + c), life)
            w, c, n, life = lay
            sc, res = run(at_rate(data, rate, n), base_dir, seed, itl)
            prov = cost_provenance(sc, prov)
            am, sm = window_metrics(res, sc, 0, n), window_metrics(res, sc, w, n - c)
            # The stability test needs a window of several lifetimes; a shorter one (a busy
            # cluster's few seconds) is judged on its percentiles, its units on their probes.
            long_enough = sm["window_s"][1] - sm["window_s"][0] >= STABLE_LIFETIMES * life
            v = violations(am, slo) + [dict(x, slo=f"steady {x['slo']}")
                                       for x in violations(sm, slo, tol if long_enough else None)]
            rec.update(stage=2, requests=n, simulated_s=res.summary["simulated_s"], all=am, steady=sm,
                       steady_window=[w, n - c])
        runs.append({**rec, "violations": v})
        if v:
            break
    return {"rate": rate, "ok": not runs[-1]["violations"], "runs": runs, "provenance": prov}


__all__ = ["measured_requests", "prefix_requests", "lifetime_s", "layout", "unit_view", "window_metrics", "violations", "stable", "probe",
           "confirm", "run", "workload_stats", "cost_provenance", "ScenarioError"]
