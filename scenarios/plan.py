"""Capacity planning: `servetwin plan SCENARIO.yaml --out DIR`.

The scenario's `plan:` section:

    plan:
      target: {rate: 40}                 # req/s the deployment must serve; or {gpus: 8}: the most
                                         # traffic 8 GPUs serve within the SLOs, and the shape
      slo:                               # per metric: mean and/or percentiles (seconds)
        ttft_s: {p99: 1.0}
        tpot_s: {p99: 0.05, mean: 0.03}
        e2e_s: {p90: 20}                 # also itl_s, queue_s
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
      search: {seeds: 2, min_requests: null, rel_tol: 0.1, min_rate: 0.05, refine_steps: 3,
               alternatives: 2, confirm_requests: 8000, max_extra_replicas: 4, stable_tol: 0.05}

How an answer is found (scenarios/search.py has the search, scenarios/probe.py the probes):
  1. prune: memory accounting (weights, reserve and KV per GPU; the KV pool must hold the
     longest request of the workload), each pruned candidate with its reason;
  2. bound: an upper bound on each candidate's capacity from its timing model alone
     (scenarios/bounds.py), so a lower bound on its cost; candidates are searched cheapest
     bound first and skipped once their bound cannot beat the best answer found;
  3. steady-state probes: one unit (replica or P/D group) at the load it would carry in the
     cluster, judged on a measurement window after warm-up that holds enough requests for the
     strictest percentile; an unstable queue fails; a probe whose short prefix already misses
     an SLO stops there;
  4. verify: the winner and `alternatives` more are simulated as whole clusters at the target
     rate (`confirm_requests` requests, every seed), judged over all their requests and over
     their steady window; the winner is also simulated with one unit fewer, which must fail.

Ranking: cost first ($/h), then headroom (the total rate the deployment sustains over the
target), then the label. With `target: {gpus: G}`: the most traffic first, then cost.

Every simulation is a pure function of its inputs: local processes and Ray give the same numbers,
and DIR/cache/ keeps each result under a hash of its inputs, so a re-run only simulates what
changed.
"""
from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from engine.core.policy import POLICIES
from scenarios.bounds import capacity_bound
from scenarios.candidates import (GRID_KEYS, budget_rank_key, candidates, compose, gpus_per_unit, label,
                                  rank_key)
from scenarios.compose import load_raw, set_field, strip
from scenarios.probe import layout, measured_requests, workload_stats
from scenarios.runner import Runner
from scenarios.search import CONFIRM, PROBE, State, refine, search_budget, search_rate
from sim.scenario import ScenarioError, parse_scenario
from sim.simulation import ROUTERS
from sim.specmap import SpecError, SpecMap
from sim.specs import DEVICES, DeviceSpec, ModelSpec, get_device, get_model, memory_breakdown
from sim.workload import build_workload

# USD per GPU-hour: rough on-demand list prices of GPU clouds in 2025 (single GPUs in 8-GPU
# nodes). They only rank candidates; put your own in `plan.prices`.
DEFAULT_PRICES = {"h100-sxm": 3.00, "h200": 3.70, "b200": 5.50, "a100-80g": 1.80, "a100-40g": 1.30,
                  "l40s": 1.00, "a10g": 0.75, "cpu-2core": 0.05}

SLO_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")
STATS = ("mean", "p50", "p90", "p95", "p99")


class PlanError(ScenarioError):
    pass


class _P(SpecMap):
    error = PlanError


@dataclass
class PlanSpec:
    target_rate: float | None
    target_gpus: int | None
    slo: list  # (metric, statistic, limit seconds)
    attainment: float | None
    grid: dict
    prices: dict
    seeds: list
    min_requests: int | None
    rel_tol: float
    min_rate: float
    refine_steps: int
    alternatives: int
    confirm_requests: int
    max_extra_replicas: int
    stable_tol: float
    scenario_slo: dict = field(default_factory=dict)

    def slo_spec(self) -> dict:
        return {"percentiles": [list(x) for x in self.slo], "attainment": self.attainment}

    def search_spec(self) -> dict:
        return {"seeds": self.seeds, "min_requests": self.min_requests, "rel_tol": self.rel_tol,
                "min_rate": self.min_rate, "stable_tol": self.stable_tol,
                "confirm_requests": self.confirm_requests}

    def describe_slo(self) -> str:
        parts = [f"{s} {m[:-2].upper()} <= {_fmt_s(v)}" for m, s, v in self.slo]
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
        raise PlanError("plan.target: required, e.g. {rate: 40} or {gpus: 8}")
    rate = t.number("rate", None, gt=0)
    gpus = t.integer("gpus", None, ge=1)
    t.done()
    if (rate is None) == (gpus is None):
        raise PlanError(f"plan.target={data['plan']['target']!r}: give exactly one of rate (req/s to serve) "
                        "or gpus (a fixed GPU budget)")

    s = p.sub("slo")
    if s is None:
        raise PlanError("plan.slo: required, e.g. {ttft_s: {p99: 1.0}, tpot_s: {p99: 0.05}}")
    slo = []
    for key in SLO_KEYS:
        m = s.sub(key)
        if m is None:
            continue
        for stat in STATS:
            v = m.number(stat, None, gt=0)
            if v is not None:
                slo.append((key, stat, v))
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
    if "requests" in se.d:
        raise PlanError(f"plan.search.requests={se.d['requests']!r}: probes are steady-state now; the "
                        "measured requests per probe follow from the SLO percentiles (set a floor with "
                        "plan.search.min_requests)")
    seeds_v = se.raw("seeds", 2)
    if isinstance(seeds_v, list):
        if len(seeds_v) < 1 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in seeds_v):
            raise PlanError(f"plan.search.seeds={seeds_v!r}: a count >= 1 or a list of seeds >= 0")
        seeds = list(seeds_v)
    else:
        n = se.integer("seeds", 2, ge=1)
        base = data.get("seed", 0) if isinstance(data.get("seed", 0), int) else 0
        seeds = [base + i for i in range(n)]
    spec = PlanSpec(
        target_rate=rate, target_gpus=gpus, slo=slo, attainment=attainment, grid=grid, prices=prices,
        seeds=seeds,
        min_requests=se.integer("min_requests", None, ge=20),
        rel_tol=se.number("rel_tol", 0.1, gt=0, le=1),
        min_rate=se.number("min_rate", 0.05, gt=0),
        refine_steps=se.integer("refine_steps", 3, ge=0),
        alternatives=se.integer("alternatives", 2, ge=0),
        confirm_requests=se.integer("confirm_requests", 8000, ge=100),
        max_extra_replicas=se.integer("max_extra_replicas", 4, ge=0),
        stable_tol=se.number("stable_tol", 0.05, gt=0, le=1),
        scenario_slo=dict(scenario_slo))
    se.done()
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
    elif key in ("tp", "data_parallel", "max_num_batched_tokens", "max_num_seqs"):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise bad("must be an integer >= 1")
    elif key == "policy" and v not in POLICIES:
        raise bad(f"must be one of {', '.join(POLICIES)}")
    elif key == "router" and v not in ROUTERS:
        raise bad(f"must be one of {', '.join(ROUTERS)}")
    elif key == "pd" and v is not None:
        if not isinstance(v, dict):
            raise bad("must be null (aggregated) or a mapping {prefill_replicas, decode_replicas, ...}")


# ------------------------------------------------------------------------------ memory
def memory_report(model: ModelSpec, device: DeviceSpec, tp: int = 1, gpu_memory_utilization: float = 0.9,
                  block_size: int = 16, activation_reserve_bytes: int | None = None, data_parallel: int = 1,
                  max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                  vllm_version: str | None = None) -> dict:
    """Per-GPU memory of one replica: the accounting sim.specs.kv_cache_blocks sizes pools with
    (sim.specs.memory_breakdown: memory x utilisation - the loaded model - vLLM's reserve profiled
    at the server's limits = KV bytes; KV per token per GPU is that GPU's share of the KV heads,
    replicated past TP > KV heads)."""
    return memory_breakdown(model, device, tp, gpu_memory_utilization, block_size, activation_reserve_bytes,
                            max_num_batched_tokens, max_num_seqs, data_parallel=data_parallel,
                            vllm_version=vllm_version)


def plan_model(data: dict, base_dir=None) -> ModelSpec:
    """The scenario's model with its dtypes, or PlanError naming deployment.model once."""
    dep = data.get("deployment") or {}
    try:
        model = get_model(dep.get("model_config") or dep.get("model", "llama-3.1-8b"), base_dir=base_dir)
        return model.with_dtypes(weight_dtype=dep.get("weight_dtype") or dep.get("dtype"),
                                 kv_dtype=dep.get("kv_dtype"))
    except ValueError as e:
        raise PlanError(str(e)) from None


def prune_reason(data: dict, cand: dict, longest: int, base_dir=None) -> str | None:
    """Why a candidate cannot run this workload, or None. Memory accounting first, then the
    scenario's own validation."""
    dep = data.get("deployment") or {}
    sch = data.get("scheduler") or {}
    model = plan_model(data, base_dir)
    try:
        device = get_device(cand["device"])
    except ValueError as e:
        return str(e)
    util = dep.get("gpu_memory_utilization", 0.9)
    bs = sch.get("block_size", 16)
    pd = cand.get("pd") or {}
    budget = cand.get("max_num_batched_tokens") or sch.get("max_num_batched_tokens")
    seqs = cand.get("max_num_seqs") or sch.get("max_num_seqs")
    # every engine shape of the candidate: (tp, data-parallel ranks, budget, max_num_seqs), one per
    # pool with disaggregated pools (each with its own ranks and limits where the pool gives them)
    shapes = sorted({(pd.get(f"{p}_tp", cand["tp"]), pd.get(f"{p}_data_parallel", 1),
                      pd.get(f"{p}_max_num_batched_tokens") or budget, pd.get(f"{p}_max_num_seqs") or seqs)
                     for p in ("prefill", "decode")} if pd else
                    {(cand["tp"], cand.get("data_parallel", 1), budget, seqs)}, key=str)
    for tp, dp, shape_budget, shape_seqs in shapes:
        if model.num_heads % tp:
            return f"tp={tp} does not divide the {model.num_heads} attention heads of {model.name}"
        if model.num_linear_layers and (model.linear_num_k_heads % tp or model.linear_num_v_heads % tp):
            return f"tp={tp} does not divide the {model.linear_num_k_heads} linear-attention key heads of {model.name}"
        if tp * dp > device.gpus_per_node and not dep.get("interconnect"):
            width = f"tp={tp}" if dp == 1 else f"tp={tp} x data_parallel={dp}"
            return (f"{width} spans more than one node of {device.gpus_per_node} {device.name} GPUs; declare "
                    "deployment.interconnect to plan it")
        m = memory_report(model, device, tp, util, bs, data_parallel=dp, max_num_batched_tokens=shape_budget,
                          max_num_seqs=shape_seqs, vllm_version=dep.get("vllm_version"))
        if not m["fits"]:
            return (f"model {m['loaded_bytes_per_gpu'] / 1e9:.1f} GB per GPU at tp={tp} + reserve "
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
    pools = [sc.pd[p][0] for p in ("prefill", "decode")] if sc.pd is not None else [sc.scheduler_config]
    held = min(c.max_model_len for c in pools)
    if held < longest:
        return f"max_model_len {held} < longest request ({longest} tokens)"
    return None


def longest_request(data: dict, base_dir, seeds: list, n: int) -> int:
    """Longest prompt + output among the first n requests of each seed's workload."""
    out = 0
    for seed in seeds:
        wl = set_field(strip(data), "workload.num_requests", n).get("workload")
        w = build_workload(wl, seed=seed, base_dir=base_dir)
        if len(w):
            out = max(out, int((w.prompt_len + w.output_len).max()))
    return out


def _tpot_limit(spec: PlanSpec) -> float | None:
    lims = [v for m, _s, v in spec.slo if m == "tpot_s"]
    if "tpot_s" in spec.scenario_slo and spec.attainment is not None:
        lims.append(spec.scenario_slo["tpot_s"])
    return min(lims) if lims else None


# ------------------------------------------------------------------------------ the plan
def plan(path: str | Path, out_dir: str | Path | None = None, workers: int = 2,
         ray_address: str | None = None, progress: bool = True, target_rate: float | None = None,
         slo_override: dict | None = None, target_gpus: int | None = None) -> dict:
    """Evaluate the scenario's plan; return the ranked result (and write DIR/plan.json, plan.csv,
    report.html, winner.yaml and the plots when out_dir is given)."""
    wall0 = time.perf_counter()
    data, base_dir = load_raw(path)
    if slo_override is not None:
        data = json.loads(json.dumps(data))
        data["plan"]["slo"] = slo_override
    if target_rate is not None or target_gpus is not None:
        data = json.loads(json.dumps(data))
        data["plan"]["target"] = {"rate": target_rate} if target_rate is not None else {"gpus": target_gpus}
    try:
        spec = parse_plan(data)
        plan_model(data, base_dir)
        longest = longest_request(data, base_dir, spec.seeds, spec.confirm_requests)
    except (ScenarioError, SpecError) as e:
        raise PlanError(f"{path}: {e}") from None
    rows = []
    for c in candidates(data, spec):
        why = prune_reason(data, c, longest, base_dir)
        rows.append({"cand": c, "label": label(c), "pruned": why, "gpus_per_unit": gpus_per_unit(c),
                     "price": spec.prices.get(c["device"])})
    for r in rows:
        if r["pruned"] is None and spec.target_gpus is not None and r["gpus_per_unit"] > spec.target_gpus:
            r["pruned"] = f"one unit needs {r['gpus_per_unit']} GPUs, more than plan.target.gpus={spec.target_gpus}"
    live = [r for r in rows if r["pruned"] is None]
    if not live:
        reasons = "; ".join(f"{r['label']}: {r['pruned']}" for r in rows[:6])
        raise PlanError(f"{path}: plan.grid: nothing fits ({reasons})")
    for r in live:
        if r["price"] is None:
            raise PlanError(f"{path}: plan.prices.{r['cand']['device']}: no price for this device")

    slo, search = spec.slo_spec(), spec.search_spec()
    means = workload_stats(strip(data), base_dir)
    out_len = means["output_tokens_mean"]
    tpot = _tpot_limit(spec)
    for i, r in enumerate(live):
        unit = compose(data, r["cand"])
        r["unit"] = unit
        sc = parse_scenario(set_field(unit, "workload.num_requests", 2000), base_dir=base_dir, seed=spec.seeds[0])
        with warnings.catch_warnings():  # table fallbacks are counted and reported per candidate
            warnings.simplefilter("ignore", UserWarning)
            r["bound"] = capacity_bound(sc, tpot)
        r["cost_model"] = _describe_cost(sc)
        r["state"] = State(key=i, bound=r["bound"], unit_cost=r["gpus_per_unit"] * r["price"],
                           max_units=_max_units(spec, r))
    cache = Path(out_dir) / "cache" if out_dir is not None else None
    runner = Runner(cache, workers, ray_address, progress)

    def run_probes(asks):
        tasks = [{"data": live[s.key]["unit"], "base_dir": str(base_dir), "total_rate": total, "units": n,
                  "slo": slo, "search": search, "out_len": out_len} for s, total, n in asks]
        return runner.run(PROBE, tasks, "probes")

    def run_confirms(asks):
        tasks = [{"data": compose(data, live[s.key]["cand"], n), "base_dir": str(base_dir), "rate": rate,
                  "slo": slo, "search": search, "out_len": out_len} for s, rate, n in asks]
        return runner.run(CONFIRM, tasks, "cluster checks")

    states = [r["state"] for r in live]
    try:
        if spec.target_rate is not None:
            for s in states:
                s.fail_n = max(0, math.ceil(spec.target_rate / s.bound - 1e-9) - 1)
            confirms = plan_rate(states, spec, run_probes, run_confirms, first_wave=max(2, runner.workers))
        else:
            units = {s.key: spec.target_gpus // live[s.key]["gpus_per_unit"] for s in states}
            search_budget(states, units, run_probes, spec.rel_tol, spec.min_rate)
            confirms = _confirm_budget(states, units, spec, run_confirms)
    finally:
        runner.close()

    from scenarios.plan_report import assemble, write_outputs
    result = assemble(rows, live, confirms, spec, data, str(path), means, plan_model(data, base_dir).name)
    result["wall_s"] = time.perf_counter() - wall0
    result["simulated_tasks"], result["cached_tasks"] = runner.simulated, runner.cached
    result["simulated_by_kind"] = runner.simulated_by_kind
    if out_dir is not None:
        write_outputs(result, Path(out_dir), data)
    return result


def _max_units(spec: PlanSpec, r: dict) -> int:
    if spec.target_rate is None:
        return 1
    return max(1, math.ceil(spec.target_rate / spec.min_rate))


def _describe_cost(sc) -> dict:
    """What the candidate's step times come from (kind, source, tables, CPU work), compactly."""
    d = dict(sc.cost_model.describe())
    for k in ("lookups", "fallbacks", "table_coverage", "model_spec", "device_spec"):
        d.pop(k, None)
    if sc.pd is not None:
        d["pools"] = "prefill and decode pools timed by the same composition (sim.cpu_work.timing_model)"
    return d


def _shown_rate(states: list[State], spec: PlanSpec) -> list[State]:
    """The states whose capacity is refined: every one tied at the cheapest cost (headroom breaks
    the tie) and the next `alternatives` by cost."""
    done = sorted([s for s in states if s.cost is not None], key=lambda s: (s.cost, s.key))
    if not done:
        return []
    cheapest = done[0].cost
    ties = [s for s in done if s.cost <= cheapest + 1e-9]
    rest = [s for s in done if s.cost > cheapest + 1e-9][:spec.alternatives]
    return ties + rest


def plan_rate(states: list[State], spec: PlanSpec, run_probes, run_confirms, first_wave: int) -> dict:
    """Search, refine and confirm at the target rate. A winner whose cluster check fails costs
    more than its unit probes said, and the search may have ruled candidates out as dearer than
    that lower cost: those whose cost bound is below the confirmed winner's are searched again
    against it, and the new cheapest confirmed in turn (a few rounds at most). Returns
    _confirm_rate's {"results", "gone"}, merged over the rounds."""
    results: dict[int, dict[int, dict]] = {}
    gone: set[int] = set()
    for _round in range(4):
        search_rate(states, spec.target_rate, run_probes, first_wave=first_wave)
        refine([s for s in _shown_rate(states, spec) if s.refined_n != s.pass_n],
               spec.target_rate, run_probes, spec.refine_steps, spec.rel_tol)
        got = _confirm_rate(states, spec, run_confirms, results, gone)
        won = [s.cost for s in states if s.pass_n is not None and s.key not in gone
               and results.get(s.key, {}).get(s.pass_n, {}).get("ok")]
        best = min(won) if won else math.inf
        reopen = [s for s in states if s.done == "dearer" and s.pass_n is None and s.cost_lb < best - 1e-9]
        if not reopen:
            return got
        for s in reopen:
            s.done = None
    return got


def _confirm_rate(states: list[State], spec: PlanSpec, run_confirms, results: dict | None = None,
                  gone: set | None = None) -> dict:
    """Cluster simulations at the target rate: the winner (stepping up while it fails and down
    while one unit fewer passes) and `alternatives` more. {state key: {units: result}}."""
    T = spec.target_rate
    results = {} if results is None else results  # {state key: {units: result}}, kept across calls
    first = {s.key: min([s.pass_n, *results.get(s.key, {})]) for s in states if s.pass_n is not None}
    gone = set() if gone is None else gone
    for _ in range(4 * (spec.max_extra_replicas + 4)):
        ranked = sorted([s for s in states if s.pass_n is not None and s.key not in gone], key=rank_key)
        top = ranked[:1 + spec.alternatives]
        asks, changed = [], False
        for i, s in enumerate(top):
            mine = results.setdefault(s.key, {})
            n = s.pass_n
            if n not in mine:
                asks.append((s, T, n))
                continue
            if not mine[n]["ok"]:
                if n < first[s.key] + spec.max_extra_replicas:
                    s.fail_n, s.pass_n = n, n + 1
                else:
                    gone.add(s.key)
                changed = True
                if i == 0:
                    break
                continue
            if i == 0 and n > 1:
                if n - 1 not in mine:
                    asks.append((s, T, n - 1))
                elif mine[n - 1]["ok"]:
                    s.pass_n, changed = n - 1, True
                    break
        if asks:
            for (s, rate, n), res in zip(asks, run_confirms(asks)):
                results[s.key][n] = res
        elif not changed:
            break
    return {"results": results, "gone": sorted(gone)}


def _confirm_budget(states: list[State], units: dict, spec: PlanSpec, run_confirms) -> dict:
    """Fixed GPU budget: the winner's cluster at its highest passing rate, stepped down by
    rel_tol while it fails and up while one step more passes; alternatives at their rate."""
    results: dict[int, dict[float, dict]] = {}
    step = 1 + spec.rel_tol
    gone: set[int] = set()
    for _ in range(40):
        ranked = sorted([s for s in states if s.lo is not None and s.key not in gone],
                        key=lambda s: budget_rank_key(s, units[s.key]))
        top = ranked[:1 + spec.alternatives]
        asks, changed = [], False
        for i, s in enumerate(top):
            mine = results.setdefault(s.key, {})
            r = round(s.lo, 9)
            if r not in mine:
                asks.append((s, r, units[s.key]))
                continue
            if not mine[r]["ok"]:
                s.hi, s.lo, changed = s.lo, s.lo / step, True
                if s.lo < spec.min_rate:
                    gone.add(s.key)
                if i == 0:
                    break
                continue
            if i == 0:
                up = round(s.lo * step, 9)
                if up not in mine:
                    asks.append((s, up, units[s.key]))
                elif mine[up]["ok"]:
                    s.lo, changed = up, True
                    break
        if asks:
            for (s, rate, n), res in zip(asks, run_confirms(asks)):
                results[s.key][round(rate, 9)] = res
        elif not changed:
            break
    return {"results": results, "gone": sorted(gone)}


__all__ = ["DEFAULT_PRICES", "PlanError", "PlanSpec", "parse_plan", "candidates", "compose", "memory_report",
           "prune_reason", "plan", "rank_key", "DEVICES", "layout", "measured_requests"]
