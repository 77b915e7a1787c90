"""Capacity planning: `servetwin plan SCENARIO.yaml --out DIR`.

The scenario's `plan:` section:

    plan:
      target: {rate: 40}                 # req/s; the workload's arrivals (or trace) scaled to it
      slo:                               # percentiles of the run (seconds) and/or attainment
        ttft_s: {p99: 1.0}
        tpot_s: {p99: 0.05}
        attainment: 0.99                 # >= 99% of requests meet every threshold of `slo:`
      grid:                              # any subset; a missing key keeps the scenario's value
        device: [h100-sxm, h200]
        tp: [1, 2]
        max_num_batched_tokens: [2048, 8192]
        max_num_seqs: [64, 256]
        policy: [fcfs]
        router: [round_robin]
        pd: [null, {prefill_replicas: 1, decode_replicas: 2}]   # disaggregated units
      prices: {h100-sxm: 3.0}            # USD per GPU-hour, over DEFAULT_PRICES
      search: {seeds: 2, requests: 300, rel_tol: 0.1, min_rate: 0.05, max_rate: 2000,
               confirm_top: 3, max_extra_replicas: 4}

Per candidate (a point of the grid), with one unit = one replica, or one prefill+decode group:
  1. prune: memory accounting (weights, reserve and KV per GPU; the KV pool must hold the
     longest request of the workload), each pruned candidate with its reason;
  2. pilot: the unit's throughput X in a closed loop of min(max_num_seqs, requests / 3)
     clients, counted while the loop is full (a start point that does not depend on the target);
  3. rate search: probes at open-loop rates from X, up x2 (or down /1.5) until a pass and a fail
     bracket the answer, then geometric bisection until hi/lo <= 1 + rel_tol. A probe runs
     each seed in turn and passes when every seed meets every SLO (a failing seed ends it).
     max_rate_per_replica = lo (the highest passing probe), reported with [lo, hi];
     binding_slo = the SLO furthest over its limit at hi;
  4. cluster check: replicas = ceil(target / lo), simulated at the target rate with
     requests x replicas requests (routing matters), every seed; one more replica until it
     passes (at most max_extra_replicas more).
Cluster checks run cheapest lower bound first: the top `confirm_top`, then every candidate whose
lower bound (ceil(target / lo) units) is below the cheapest confirmed cost, so the winner is the
cheapest candidate a cluster simulation confirms. Candidates never checked show their bound.

Every evaluation is a pure function of (composed scenario, SLOs, search settings[, target]):
local processes and Ray give the same numbers, and DIR/cache/ keeps each result under a hash of
its inputs, so a re-run only simulates what changed.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.core.policy import POLICIES
from scenarios.compose import at_rate, load_raw, mean_metrics, measure, saturating, set_field, strip
from scenarios.schema import ScenarioError, parse_scenario
from sim.simulation import ROUTERS
from sim.specmap import SpecMap
from sim.specmap import SpecError
from sim.specs import DEVICES, DeviceSpec, ModelSpec, get_device, get_model, memory_breakdown
from sim.workload import build_workload

# USD per GPU-hour: rough on-demand list prices of GPU clouds in 2025 (single GPUs in 8-GPU
# nodes). They only rank candidates; put your own in `plan.prices`.
DEFAULT_PRICES = {"h100-sxm": 3.00, "h200": 3.70, "a100-80g": 1.80, "a100-40g": 1.30,
                  "l40s": 1.00, "a10g": 0.75, "cpu-2core": 0.05}

# The Hugging Face repository a catalog model is served from (for the printed vllm command).
HF_NAMES = {"llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
            "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
            "llama-3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
            "llama-3.2-3b": "meta-llama/Llama-3.2-3B-Instruct",
            "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct", "qwen2.5-72b": "Qwen/Qwen2.5-72B-Instruct",
            "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
            "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}

GRID_KEYS = ("device", "tp", "max_num_batched_tokens", "max_num_seqs", "policy", "router", "pd")
SLO_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")
PCTS = ("p50", "p90", "p95", "p99")
CACHE_VERSION = 1


class PlanError(ScenarioError):
    pass


class _P(SpecMap):
    error = PlanError


@dataclass
class PlanSpec:
    target_rate: float
    slo: list  # (metric, percentile, limit seconds)
    attainment: float | None
    grid: dict
    prices: dict
    seeds: list
    requests: int
    rel_tol: float
    min_rate: float
    max_rate: float
    confirm_top: int
    max_extra_replicas: int
    scenario_slo: dict = field(default_factory=dict)

    def slo_spec(self) -> dict:
        return {"percentiles": [list(x) for x in self.slo], "attainment": self.attainment}

    def search_spec(self) -> dict:
        return {"seeds": self.seeds, "requests": self.requests, "rel_tol": self.rel_tol,
                "min_rate": self.min_rate, "max_rate": self.max_rate}

    def describe_slo(self) -> str:
        parts = [f"{p} {m[:-2].upper()} <= {_fmt_s(v)}" for m, p, v in self.slo]
        if self.attainment is not None:
            parts.append(f">= {self.attainment:.0%} of requests within "
                         + ", ".join(f"{k[:-2].upper()} {_fmt_s(v)}" for k, v in self.scenario_slo.items()))
        return ", ".join(parts)


def _fmt_s(v: float) -> str:
    return f"{v * 1e3:g} ms" if v < 1 else f"{v:g} s"


# ------------------------------------------------------------------------------ the plan section
def parse_plan(data: dict) -> PlanSpec:
    """The `plan:` section, validated; errors name the field."""
    if not isinstance(data.get("plan"), dict):
        raise PlanError("plan: required (a mapping with target, slo and grid) for `servetwin plan`")
    p = _P(data["plan"], "plan")
    t = p.sub("target")
    if t is None:
        raise PlanError("plan.target: required, e.g. {rate: 40}")
    rate = t.number("rate", gt=0)
    t.done()

    s = p.sub("slo")
    if s is None:
        raise PlanError("plan.slo: required, e.g. {ttft_s: {p99: 1.0}, tpot_s: {p99: 0.05}}")
    slo = []
    for key in SLO_KEYS:
        m = s.sub(key)
        if m is None:
            continue
        for pct in PCTS:
            v = m.number(pct, None, gt=0)
            if v is not None:
                slo.append((key, pct, v))
        m.done()
    attainment = s.number("attainment", None, gt=0, le=1)
    s.done()
    scenario_slo = data.get("slo") or {}
    if attainment is not None and not scenario_slo:
        raise PlanError(f"plan.slo.attainment={attainment}: needs thresholds in the scenario's `slo:` "
                        "(e.g. slo: {ttft_s: 1.0, tpot_s: 0.05})")
    if not slo and attainment is None:
        raise PlanError("plan.slo: empty; give at least one percentile (e.g. ttft_s: {p99: 1.0}) or attainment")

    g = p.sub("grid") or _P({}, "plan.grid")
    grid = {}
    for key in GRID_KEYS:
        if key not in g.d:
            continue
        vals = g.raw(key)
        vals = vals if isinstance(vals, list) else [vals]
        if not vals:
            raise PlanError(f"plan.grid.{key}=[]: empty; give at least one value")
        for v in vals:
            _check_grid_value(key, v)
        grid[key] = vals
    g.done()

    prices = dict(DEFAULT_PRICES)
    pr = p.sub("prices")
    if pr is not None:
        for k in list(pr.d):
            prices[k] = pr.number(k, gt=0)
        pr.done()

    se = p.sub("search") or _P({}, "plan.search")
    seeds_v = se.raw("seeds", 2)
    if isinstance(seeds_v, list):
        if len(seeds_v) < 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in seeds_v):
            raise PlanError(f"plan.search.seeds={seeds_v!r}: a count >= 2 or a list of >= 2 seeds >= 0")
        seeds = list(seeds_v)
    else:
        n = se.integer("seeds", 2, ge=2)
        base = data.get("seed", 0) if isinstance(data.get("seed", 0), int) else 0
        seeds = [base + i for i in range(n)]
    spec = PlanSpec(
        target_rate=rate, slo=slo, attainment=attainment, grid=grid, prices=prices, seeds=seeds,
        requests=se.integer("requests", 300, ge=20),
        rel_tol=se.number("rel_tol", 0.1, gt=0, le=1),
        min_rate=se.number("min_rate", 0.05, gt=0),
        max_rate=se.number("max_rate", 2000.0, gt=0),
        confirm_top=se.integer("confirm_top", 3, ge=1),
        max_extra_replicas=se.integer("max_extra_replicas", 4, ge=0),
        scenario_slo=dict(scenario_slo))
    se.done()
    if spec.min_rate >= spec.max_rate:
        raise PlanError(f"plan.search.min_rate={spec.min_rate}: must be below max_rate={spec.max_rate}")
    p.done()
    return spec


def _check_grid_value(key: str, v) -> None:
    def bad(why):
        return PlanError(f"plan.grid.{key}={v!r}: {why}")
    if key == "device":
        try:
            get_device(v)
        except ValueError as e:
            raise bad(str(e).split(": ", 1)[-1]) from None
    elif key in ("tp", "max_num_batched_tokens", "max_num_seqs"):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad("must be an integer >= 1")
    elif key == "policy" and v not in POLICIES:
        raise bad(f"must be one of {', '.join(POLICIES)}")
    elif key == "router" and v not in ROUTERS:
        raise bad(f"must be one of {', '.join(ROUTERS)}")
    elif key == "pd" and v is not None:
        if not isinstance(v, dict):
            raise bad("must be null (aggregated) or a mapping {prefill_replicas, decode_replicas, ...}")


# ------------------------------------------------------------------------------ candidates
def candidates(data: dict, spec: PlanSpec) -> list[dict]:
    """The grid's points, in grid order; keys missing from the grid keep the scenario's values."""
    dep = data.get("deployment") or {}
    sch = data.get("scheduler") or {}
    base = {"device": dep.get("device", "h100-sxm"), "tp": dep.get("tp", 1),
            "max_num_batched_tokens": sch.get("max_num_batched_tokens", 8192),
            "max_num_seqs": sch.get("max_num_seqs", 1024), "policy": sch.get("policy", "fcfs"),
            "router": dep.get("router", "round_robin"), "pd": dep.get("pd")}
    axes = [spec.grid.get(k, [base[k]]) for k in GRID_KEYS]
    return [dict(zip(GRID_KEYS, combo)) for combo in itertools.product(*axes)]


def compose(data: dict, cand: dict, units: int = 1) -> dict:
    """The scenario of `units` units of a candidate (a unit: one replica, or one P/D group)."""
    out = strip(data)
    for key, path in (("device", "deployment.device"), ("tp", "deployment.tp"),
                      ("router", "deployment.router"), ("policy", "scheduler.policy"),
                      ("max_num_batched_tokens", "scheduler.max_num_batched_tokens"),
                      ("max_num_seqs", "scheduler.max_num_seqs")):
        out = set_field(out, path, cand[key])
    pd = cand.get("pd")
    if pd:
        pd = dict(pd)
        pd["prefill_replicas"] = pd.get("prefill_replicas", 1) * units
        pd["decode_replicas"] = pd.get("decode_replicas", 1) * units
        out = set_field(out, "deployment.pd", pd)
        out = set_field(out, "deployment.replicas", 1)
    else:
        out = set_field(out, "deployment.pd", None)
        out = set_field(out, "deployment.replicas", units)
    return out


def gpus_per_unit(cand: dict) -> int:
    pd = cand.get("pd")
    if not pd:
        return int(cand["tp"])
    return (pd.get("prefill_replicas", 1) * pd.get("prefill_tp", cand["tp"])
            + pd.get("decode_replicas", 1) * pd.get("decode_tp", cand["tp"]))


def label(cand: dict) -> str:
    pd = cand.get("pd")
    shape = (f"tp{cand['tp']}" if not pd else
             f"P{pd.get('prefill_replicas', 1)}xtp{pd.get('prefill_tp', cand['tp'])}"
             f"+D{pd.get('decode_replicas', 1)}xtp{pd.get('decode_tp', cand['tp'])}")
    return (f"{cand['device']} {shape} B{cand['max_num_batched_tokens']} S{cand['max_num_seqs']} "
            f"{cand['policy']}" + (f" {cand['router']}" if cand["router"] != "round_robin" else ""))


# ------------------------------------------------------------------------------ memory
def memory_report(model: ModelSpec, device: DeviceSpec, tp: int = 1, gpu_memory_utilization: float = 0.9,
                  block_size: int = 16, activation_reserve_bytes: int | None = None) -> dict:
    """Per-GPU memory of one replica: the accounting sim.specs.kv_cache_blocks sizes pools with
    (sim.specs.memory_breakdown: memory x utilisation - weight shard - vLLM's profiled reserve =
    KV bytes; KV per token per GPU is that GPU's share of the KV heads, replicated past TP > KV heads)."""
    return memory_breakdown(model, device, tp, gpu_memory_utilization, block_size, activation_reserve_bytes)


def prune_reason(data: dict, cand: dict, longest: int, base_dir=None) -> str | None:
    """Why a candidate cannot run this workload, or None. Memory accounting first, then the
    scenario's own validation."""
    dep = data.get("deployment") or {}
    sch = data.get("scheduler") or {}
    try:
        model = get_model(dep.get("model_config") or dep.get("model", "llama-3.1-8b"), base_dir=base_dir)
        # the deployment's dtypes, as the scenario reads them (fp8 weights, KV dtype)
        model = model.with_dtypes(weight_dtype=dep.get("weight_dtype") or dep.get("dtype"),
                                  kv_dtype=dep.get("kv_dtype"))
        device = get_device(cand["device"])
    except ValueError as e:
        return str(e)
    util = dep.get("gpu_memory_utilization", 0.9)
    bs = sch.get("block_size", 16)
    pd = cand.get("pd") or {}
    tps = sorted({pd.get("prefill_tp", cand["tp"]), pd.get("decode_tp", cand["tp"])} if pd else {cand["tp"]})
    for tp in tps:
        if model.num_heads % tp:
            return f"tp={tp} does not divide the {model.num_heads} attention heads of {model.name}"
        m = memory_report(model, device, tp, util, bs)
        if not m["fits"]:
            return (f"weights {m['weight_bytes_per_gpu'] / 1e9:.1f} GB per GPU at tp={tp} + reserve "
                    f"{m['reserve_bytes'] / 1e9:.1f} GB leave no KV cache in {m['usable_bytes'] / 1e9:.1f} GB "
                    f"({device.name} x {util})")
        if dep.get("num_gpu_blocks") is None and m["kv_tokens"] < longest:
            return (f"KV cache of {m['kv_tokens']} tokens per replica at tp={tp} "
                    f"({m['kv_bytes_per_gpu'] / 1e9:.1f} GB per GPU) cannot hold the longest request "
                    f"({longest} tokens)")
    try:
        sc = parse_scenario(set_field(compose(data, cand), "workload.num_requests", 1), seed=0, base_dir=base_dir)
    except ScenarioError as e:
        return str(e)
    if sc.scheduler_config.max_model_len < longest:
        return f"max_model_len {sc.scheduler_config.max_model_len} < longest request ({longest} tokens)"
    return None


def longest_request(data: dict, base_dir, spec: PlanSpec) -> int:
    """Longest prompt + output of the requests the search will simulate (every seed)."""
    out = 0
    for seed in spec.seeds:
        wl = set_field(strip(data), "workload.num_requests", spec.requests).get("workload")
        w = build_workload(wl, seed=seed, base_dir=base_dir)
        if len(w):
            out = max(out, int((w.prompt_len + w.output_len).max()))
    return out


# ------------------------------------------------------------------------------ SLO checks
def check(m: dict, slo: dict) -> list[dict]:
    """The SLOs a measured run violates, each with its value, limit and value/limit."""
    out = []
    for metric, pct, limit in slo["percentiles"]:
        v = m[metric][pct]
        if v is None or v != v or v > limit:
            v = math.inf if v is None or v != v else v
            out.append({"slo": f"{pct} {metric}", "value": v, "limit": limit, "ratio": v / limit})
    a = slo.get("attainment")
    if a is not None:
        got = m.get("attainment") or 0.0
        if got < a:
            out.append({"slo": "attainment", "value": got, "limit": a,
                        "ratio": (1 - got) / max(1 - a, 1e-9)})
    if m["completed"] < m["total"]:
        out.append({"slo": "completion", "value": m["completed"], "limit": m["total"],
                    "ratio": m["total"] / max(m["completed"], 1)})
    return out


def memo_measure(data: dict, base_dir, seed: int, memo: Path | None) -> dict:
    """`measure`, reusing a run that differs only in max_num_seqs when that cap could not have
    acted in either run: no more requests were ever in the system than either cap allows (the
    scheduler admits the same requests in the same steps, so the run is the same, number for
    number). Runs are shared through files in `memo` (a folder every worker can see)."""
    sch = data.get("scheduler") or {}
    cap = sch.get("max_num_seqs")
    if memo is None or cap is None or (data.get("deployment") or {}).get("pd"):
        return measure(data, base_dir, seed)
    key = cache_key("run", {"data": set_field(data, "scheduler.max_num_seqs", None), "seed": seed,
                            "base_dir": str(base_dir)})
    path = memo / f"{key}.json"
    try:
        for rec in json.loads(path.read_text()):
            if rec["m"]["max_in_system"] < min(cap, rec["cap"]) or rec["cap"] == cap:
                return rec["m"]
        recs = json.loads(path.read_text())
    except (OSError, ValueError):
        recs = []
    m = measure(data, base_dir, seed)
    memo.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(recs + [{"cap": cap, "m": m}], default=float))
    os.replace(tmp, path)
    return m


def probe(data: dict, base_dir, rate: float, slo: dict, search: dict, units: int = 1,
          memo: Path | None = None) -> dict:
    """One rate, every seed in turn (a failing seed ends the probe: it has failed)."""
    runs = []
    for seed in search["seeds"]:
        m = memo_measure(at_rate(data, rate, search["requests"] * units), base_dir, seed, memo)
        m["violations"] = check(m, slo)
        runs.append(m)
        if m["violations"]:
            break
    return {"rate": rate, "ok": not runs[-1]["violations"], "runs": runs}


# ------------------------------------------------------------------------------ tasks (pure)
def search_task(t: dict) -> dict:
    """Highest per-unit rate meeting the SLOs: pilot, bracket, bisect (see the module doc)."""
    data, base_dir, slo, search = t["data"], t["base_dir"], t["slo"], t["search"]
    wall0 = time.perf_counter()
    cand = t["cand"]
    conc = cand["max_num_seqs"] * ((cand.get("pd") or {}).get("decode_replicas", 1) if cand.get("pd") else 1)
    conc = max(1, min(conc, search["requests"] // 3))
    memo = Path(t["memo"]) if t.get("memo") else None
    pilot = memo_measure(saturating(data, conc, search["requests"]), base_dir, search["seeds"][0], memo)
    x = max(pilot["full_throughput_rps"], search["min_rate"])
    lo = hi = None
    probes = []
    r = min(x, search["max_rate"])
    while lo is None or hi is None:
        p = probe(data, base_dir, r, slo, search, memo=memo)
        probes.append(p)
        if p["ok"]:
            lo = r
            if hi is None:
                if r >= search["max_rate"]:
                    break
                r = min(r * 2, search["max_rate"])
        else:
            hi = r
            if lo is None:
                if r <= search["min_rate"]:
                    break
                r = max(r / 1.5, search["min_rate"])
    while lo is not None and hi is not None and hi / lo > 1 + search["rel_tol"]:
        r = math.sqrt(lo * hi)
        p = probe(data, base_dir, r, slo, search, memo=memo)
        probes.append(p)
        if p["ok"]:
            lo = r
        else:
            hi = r
    at_lo = next((p for p in probes if p["rate"] == lo), None)
    at_hi = next((p for p in probes if p["rate"] == hi), None)
    binding = None
    if at_hi is not None:
        v = max(at_hi["runs"][-1]["violations"], key=lambda x: x["ratio"])
        binding = v
    return {"pilot_rps": pilot["full_throughput_rps"], "max_rate": lo, "interval": [lo, hi],
            "binding": binding, "at_max": mean_metrics(at_lo["runs"]) if at_lo else None,
            "probes": [{"rate": p["rate"], "ok": p["ok"], "seeds": [m["seed"] for m in p["runs"]],
                        "violations": p["runs"][-1]["violations"]} for p in probes],
            "wall_s": time.perf_counter() - wall0}


def confirm_task(t: dict) -> dict:
    """The cluster for the target rate: ceil(target / max_rate) units, one more until it passes."""
    data, base_dir, slo, search = t["data"], t["base_dir"], t["slo"], t["search"]
    wall0 = time.perf_counter()
    tries = []
    for n in range(t["units"], t["units"] + t["max_extra"] + 1):
        p = probe(compose(data, t["cand"], n), base_dir, t["target"], slo, search, units=n)
        tries.append({"units": n, "ok": p["ok"], "violations": p["runs"][-1]["violations"]})
        if p["ok"]:
            return {"units": n, "confirmed": True, "metrics": mean_metrics(p["runs"]), "tries": tries,
                    "wall_s": time.perf_counter() - wall0}
    return {"units": None, "confirmed": False, "metrics": None, "tries": tries,
            "wall_s": time.perf_counter() - wall0}


def run_task(kind: str, task: dict) -> dict:
    if kind == "sweep":
        from scenarios.sweep import sweep_task
        return sweep_task(task)
    return search_task(task) if kind == "search" else confirm_task(task)


# ------------------------------------------------------------------------------ running many
@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """A digest of everything a cached simulation's result depends on besides its task: the
    simulator, scheduler and scenario code, the shipped profiles and the kernel tables. A cache
    entry made by other code or data is never served."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for pattern in ("sim/*.py", "engine/core/*.py", "scenarios/*.py", "sim/profiles/*.json",
                    "calibration/kernels/*.json"):
        for p in sorted(root.glob(pattern)):
            h.update(p.relative_to(root).as_posix().encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cache_key(kind: str, task: dict) -> str:
    blob = json.dumps({"v": CACHE_VERSION, "code": code_digest(), "kind": kind, "task": task},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


class Runner:
    """Runs tasks in local processes (workers > 1), inline (workers == 1) or on Ray, with a
    progress bar (tqdm shows the time left) and a per-task cache."""

    def __init__(self, cache_dir: Path | None, workers: int = 2, ray_address: str | None = None,
                 progress: bool = True) -> None:
        self.cache_dir = cache_dir
        self.workers = max(1, workers)
        self.ray_address = ray_address
        self.progress = progress
        self.simulated = 0
        self.cached = 0
        self.simulated_by_kind: dict[str, int] = {}
        self._ray_started = False

    def run(self, kind: str, tasks: list[dict], desc: str, order: list[int] | None = None) -> list[dict]:
        """Results in the order of `tasks`; `order` is the order to start them in."""
        results: list = [None] * len(tasks)
        todo = []
        for i, t in enumerate(tasks):
            hit = self._load(kind, t)
            if hit is not None:
                results[i] = hit
                self.cached += 1
            else:
                todo.append(i)
        if order is not None:
            rank = {i: k for k, i in enumerate(order)}
            todo.sort(key=rank.__getitem__)
        if not todo:
            return results
        from tqdm import tqdm
        tqdm.monitor_interval = 0  # no monitor thread in the parent when the worker pool forks
        bar = tqdm(total=len(todo), desc=desc, unit="cand", disable=not self.progress, file=sys.stderr,
                   mininterval=0.5)
        for i, r in self._execute(kind, [tasks[i] for i in todo], todo):
            results[i] = r
            self._store(kind, tasks[i], r)
            self.simulated += 1
            self.simulated_by_kind[kind] = self.simulated_by_kind.get(kind, 0) + 1
            bar.update(1)
        bar.close()
        return results

    def _execute(self, kind, tasks, idx):
        if self.ray_address is not None:
            yield from self._ray(kind, tasks, idx)
        elif self.workers == 1 or len(tasks) == 1:
            for i, t in zip(idx, tasks):
                yield i, run_task(kind, t)
        else:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor, as_completed
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
            with ProcessPoolExecutor(min(self.workers, len(tasks)), mp_context=ctx) as ex:
                futs = {ex.submit(run_task, kind, t): i for i, t in zip(idx, tasks)}
                for f in as_completed(futs):
                    yield futs[f], f.result()

    def _ray(self, kind, tasks, idx):
        import ray
        if not ray.is_initialized():
            if self.ray_address in ("", "local"):
                ray.init(num_cpus=self.workers, include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=self.ray_address, log_to_driver=False)
            self._ray_started = True
        remote = ray.remote(num_cpus=1)(run_task)
        refs = {remote.remote(kind, t): i for i, t in zip(idx, tasks)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                yield refs[ref], ray.get(ref)

    def close(self) -> None:
        if self._ray_started:
            import ray
            ray.shutdown()

    def _path(self, kind, task) -> Path | None:
        task = {k: v for k, v in task.items() if k != "memo"}  # where runs are shared is not an input
        return None if self.cache_dir is None else self.cache_dir / f"{kind}-{cache_key(kind, task)}.json"

    def _load(self, kind, task):
        p = self._path(kind, task)
        if p is None or not p.exists():
            return None
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return None

    def _store(self, kind, task, result) -> None:
        p = self._path(kind, task)
        if p is None:
            return
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, default=float))
        os.replace(tmp, p)


# ------------------------------------------------------------------------------ the plan
def plan(path: str | Path, out_dir: str | Path | None = None, workers: int = 2,
         ray_address: str | None = None, progress: bool = True, target_rate: float | None = None,
         slo_override: dict | None = None, log=None) -> dict:
    """Evaluate every candidate of the scenario's plan; return the ranked result (and write
    DIR/plan.json, plan.csv, report.html and the plots when out_dir is given)."""
    wall0 = time.perf_counter()
    data, base_dir = load_raw(path)
    if slo_override is not None:
        data = json.loads(json.dumps(data))
        data["plan"]["slo"] = slo_override
    try:
        spec = parse_plan(data)
    except ScenarioError as e:
        raise PlanError(f"{path}: {e}") from None
    if target_rate is not None:
        spec.target_rate = target_rate
    try:
        longest = longest_request(data, base_dir, spec)
    except SpecError as e:
        raise PlanError(f"{path}: {e}") from None
    cands = candidates(data, spec)
    rows = []
    for c in cands:
        why = prune_reason(data, c, longest, base_dir)
        rows.append({"cand": c, "label": label(c), "pruned": why, "gpus_per_unit": gpus_per_unit(c),
                     "price": spec.prices.get(c["device"])})
    live = [r for r in rows if r["pruned"] is None]
    if not live:
        reasons = "; ".join(f"{r['label']}: {r['pruned']}" for r in rows[:6])
        raise PlanError(f"{path}: plan.grid: nothing fits ({reasons})")
    for r in live:
        if r["price"] is None:
            raise PlanError(f"{path}: plan.prices.{r['cand']['device']}: no price for this device")

    slo, search = spec.slo_spec(), spec.search_spec()
    cache = Path(out_dir) / "cache" if out_dir is not None else None
    runner = Runner(cache, workers, ray_address, progress)
    try:
        memo = None
        if cache is not None and (ray_address is None or ray_address in ("", "local")):
            memo = str(cache / "runs")
        tasks = [{"cand": r["cand"], "data": compose(data, r["cand"]), "base_dir": str(base_dir),
                  "slo": slo, "search": search, "memo": memo} for r in live]
        # Largest max_num_seqs first: their runs serve the smaller caps that never bind.
        start = sorted(range(len(live)), key=lambda i: (-live[i]["cand"]["max_num_seqs"], i))
        for r, res in zip(live, runner.run("search", tasks, "rate search", start)):
            r["search"] = res
            lo = res["max_rate"]
            if lo:
                r["units_lb"] = max(1, math.ceil(spec.target_rate / lo - 1e-9))
                r["cost_lb"] = r["units_lb"] * r["gpus_per_unit"] * r["price"]
        # Cluster checks, cheapest lower bound first, until no unchecked bound beats the best.
        order = sorted([r for r in live if r.get("cost_lb") is not None],
                       key=lambda r: (r["cost_lb"], -r["search"]["max_rate"], r["label"]))
        batch = order[:spec.confirm_top]
        while batch:
            ctasks = [{"cand": r["cand"], "data": strip(data), "base_dir": str(base_dir), "slo": slo,
                       "search": search, "target": spec.target_rate, "units": r["units_lb"],
                       "max_extra": spec.max_extra_replicas} for r in batch]
            for r, res in zip(batch, runner.run("confirm", ctasks, "cluster check")):
                r["confirm"] = res
            best = min((r["confirm"]["units"] * r["gpus_per_unit"] * r["price"] for r in order
                        if r.get("confirm", {}).get("confirmed")), default=math.inf)
            batch = [r for r in order if "confirm" not in r and r["cost_lb"] < best]
    finally:
        runner.close()

    result = assemble(rows, spec, data, str(path))
    result["wall_s"] = time.perf_counter() - wall0
    result["simulated_tasks"], result["cached_tasks"] = runner.simulated, runner.cached
    result["simulated_by_kind"] = runner.simulated_by_kind
    if out_dir is not None:
        from scenarios.plan_report import write_outputs
        write_outputs(result, Path(out_dir))
    return result


def assemble(rows: list[dict], spec: PlanSpec, data: dict, path: str) -> dict:
    """The ranked candidate records of plan.json."""
    dep = data.get("deployment") or {}
    model = get_model(dep.get("model", "llama-3.1-8b")).name
    util = dep.get("gpu_memory_utilization", 0.9)
    out = []
    for r in rows:
        c = r["cand"]
        rec = {"label": r["label"], "device": c["device"], "tp": c["tp"], "pd": c.get("pd"),
               "max_num_batched_tokens": c["max_num_batched_tokens"], "max_num_seqs": c["max_num_seqs"],
               "policy": c["policy"], "router": c["router"], "gpus_per_replica": r["gpus_per_unit"],
               "price_per_gpu_hour": r["price"], "status": None, "replicas": None, "gpus": None,
               "cost_per_hour": None, "max_rate_per_replica": None, "rate_interval": None,
               "saturation_rps": None, "binding_slo": None, "predicted": None, "reason": None}
        if r["pruned"]:
            rec.update(status="pruned", reason=r["pruned"])
            out.append(rec)
            continue
        s = r["search"]
        rec.update(max_rate_per_replica=s["max_rate"], rate_interval=s["interval"], saturation_rps=s["pilot_rps"],
                   binding_slo=(s["binding"] or {}).get("slo"), binding=s["binding"], at_max_rate=s["at_max"],
                   probes=s["probes"])
        if not s["max_rate"]:
            rec.update(status="infeasible",
                       reason=f"misses the SLOs even at {spec.min_rate:g} req/s per replica "
                              f"({rec['binding_slo']})")
        elif "confirm" not in r:
            n = r["units_lb"]
            rec.update(status="bound", replicas=n, gpus=n * r["gpus_per_unit"], cost_per_hour=r["cost_lb"],
                       reason="not cluster-checked: its lower bound is no cheaper than the winner")
        elif not r["confirm"]["confirmed"]:
            rec.update(status="unconfirmed", cluster_tries=r["confirm"]["tries"],
                       reason=f"the cluster misses the SLOs at {spec.target_rate:g} req/s even with "
                              f"{r['units_lb'] + spec.max_extra_replicas} replicas")
        else:
            n = r["confirm"]["units"]
            m = r["confirm"]["metrics"]
            rec.update(status="confirmed", replicas=n, gpus=n * r["gpus_per_unit"],
                       cost_per_hour=n * r["gpus_per_unit"] * r["price"], cluster_tries=r["confirm"]["tries"],
                       predicted={**{f"{p}_{k}": m[k][p] for k in SLO_KEYS for p in ("p50", "p99")},
                                  "attainment": m["attainment"], "goodput_rps": m["goodput_rps"],
                                  "throughput_rps": m["throughput_rps"]})
        out.append(rec)
    rank = {"confirmed": 0, "bound": 1, "unconfirmed": 2, "infeasible": 3, "pruned": 4}
    out.sort(key=lambda x: (rank[x["status"]], x["cost_per_hour"] if x["cost_per_hour"] is not None else math.inf,
                            x["gpus"] or 0, -(x["max_rate_per_replica"] or 0),
                            (x["predicted"] or {}).get("p99_ttft_s") or 0, x["label"]))
    for i, x in enumerate(out):
        x["rank"] = i + 1
    return {"scenario": path, "model": model, "hf_model": HF_NAMES.get(model, model),
            "gpu_memory_utilization": util, "target_rate": spec.target_rate, "slo": spec.slo_spec(),
            "slo_text": spec.describe_slo(), "scenario_slo": spec.scenario_slo, "search": spec.search_spec(),
            "prices": spec.prices, "candidates": out,
            "winner": out[0] if out and out[0]["status"] == "confirmed" else None}


__all__ = ["DEFAULT_PRICES", "PlanError", "PlanSpec", "parse_plan", "candidates", "memory_report",
           "prune_reason", "search_task", "confirm_task", "plan", "DEVICES"]
