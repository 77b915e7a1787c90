"""Composing scenarios: a base scenario's YAML mapping with fields replaced, then run and measured.

Plans and sweeps are many such scenarios. Nothing here times or schedules anything: every number
comes from `run_scenario` on a scenario the user could have written by hand.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from sim.scenario import ScenarioError, parse_scenario, read_yaml, run_scenario, set_field
from sim.metrics import meets_slo

OPEN_LOOP = ("poisson", "gamma", "constant")
LATENCY_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")
PCTS = ("p50", "p90", "p95", "p99")


def load_raw(path: str | Path) -> tuple[dict, Path]:
    """A scenario file's mapping (unvalidated) and the folder its relative paths start from."""
    path = Path(path)
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: must be a mapping")
    data.setdefault("name", path.stem)
    return data, path.parent.resolve()


def strip(data: dict) -> dict:
    """The scenario alone: no plan or sweep sections (they do not change a simulation)."""
    return {k: copy.deepcopy(v) for k, v in data.items() if k not in ("plan", "sweep")}


def at_rate(data: dict, rate: float, num_requests: int | None = None) -> dict:
    """The scenario with its open-loop arrivals (or its trace's timestamps) scaled to `rate` req/s."""
    out = copy.deepcopy(data)
    wl = out.get("workload")
    if not isinstance(wl, dict):
        raise ScenarioError("workload: required")
    arrival = wl.get("arrival")
    if isinstance(arrival, dict):
        if arrival.get("type") not in OPEN_LOOP:
            raise ScenarioError(f"workload.arrival.type={arrival.get('type')!r}: a rate search needs open-loop "
                                f"arrivals ({', '.join(OPEN_LOOP)}) or a timed trace")
        arrival["rate"] = float(rate)
    elif isinstance(wl.get("trace"), dict):
        wl["trace"].pop("time_scale", None)
        wl["trace"]["rate"] = float(rate)
    else:
        raise ScenarioError("workload.arrival: required to set a rate")
    if num_requests is not None:
        wl["num_requests"] = int(num_requests)
    return out


def saturating(data: dict, concurrency: int, num_requests: int) -> dict:
    """The same requests as a closed loop of `concurrency` clients (the deployment kept full)."""
    out = copy.deepcopy(data)
    wl = out["workload"]
    wl["arrival"] = {"type": "concurrency", "concurrency": int(concurrency)}
    wl.pop("cancellation", None)
    wl["num_requests"] = int(num_requests)
    if isinstance(wl.get("trace"), dict):
        wl["trace"].pop("time_scale", None)
        wl["trace"].pop("rate", None)
    return out


def measure(data: dict, base_dir: str | Path | None, seed: int) -> dict:
    """Run one composed scenario; a flat record of its latencies (seconds), throughput and SLO
    attainment (completed requests meeting every `slo:` threshold over all requests)."""
    data = copy.deepcopy(data)
    data.setdefault("output", {})["plots"] = False
    sc = parse_scenario(data, base_dir=Path(base_dir) if base_dir else None, seed=seed)
    res = run_scenario(sc)
    s = res.summary
    m: dict = {"seed": seed}
    for k in LATENCY_KEYS:
        m[k] = {p: s[k][p] for p in ("mean",) + PCTS}
    r = s["requests"]
    m["throughput_rps"] = s["throughput"]["requests_per_s"]
    m["output_tokens_per_s"] = s["throughput"]["output_tokens_per_s"]
    m["goodput_rps"] = s["goodput_requests_per_s"]
    m["completed"], m["total"], m["rejected"] = r["completed"], r["total"], r["rejected"]
    m["preemptions"] = r["preemptions"]
    m["attainment"] = (float(np.sum(meets_slo(res.request_table, sc.slo))) / r["total"]
                       if sc.slo and r["total"] else None)
    m["simulated_s"] = s["simulated_s"]
    # A closed loop is full until its last request is sent: its completions per second up to
    # then are the deployment's throughput at that concurrency (the drain after is not).
    t = res.request_table
    last_sent = float(np.max(t["arrival_s"])) if r["total"] else 0.0
    done = int(np.sum(t["finish_s"] <= last_sent)) if last_sent > 0 else 0
    m["full_throughput_rps"] = done / last_sent if done else m["throughput_rps"]
    m["max_in_system"] = max_in_system(t["arrival_s"], t["finish_s"])
    return m


def max_in_system(arrival_s, finish_s) -> int:
    """Most requests present at once (arrived, not finished; an arrival counts before a finish at
    the same instant). No replica ever runs more than this many at once."""
    a = np.asarray(arrival_s, dtype=float)
    f = np.nan_to_num(np.asarray(finish_s, dtype=float), nan=np.inf)
    if a.size == 0:
        return 0
    times = np.concatenate([a, f])
    delta = np.concatenate([np.ones(a.size, np.int64), -np.ones(f.size, np.int64)])
    order = np.lexsort((-delta, times))  # by time, arrivals (+1) first at ties
    return int(np.max(np.cumsum(delta[order])))


def mean_metrics(runs: list[dict]) -> dict:
    """Seed-averaged record (the mean of each number over the runs)."""
    out: dict = {}
    for k, v in runs[0].items():
        if isinstance(v, dict):
            out[k] = {p: _mean([r[k][p] for r in runs]) for p in v}
        elif (v is None or isinstance(v, (int, float))) and k != "seed":
            out[k] = _mean([r[k] for r in runs])
    out["seeds"] = [r["seed"] for r in runs]
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None and x == x]
    return float(np.mean(xs)) if xs else None


__all__ = ["load_raw", "strip", "set_field", "at_rate", "saturating", "measure", "max_in_system", "mean_metrics"]
