"""Scenario files (YAML): validated into a runnable simulation.

    name: quickstart            # used for the default output directory
    seed: 0
    deployment: {model, device, tp, replicas, router, gpu_memory_utilization, num_gpu_blocks}
    scheduler:  {max_num_batched_tokens, max_num_seqs, max_model_len, block_size,
                 enable_chunked_prefill, long_prefill_token_threshold, enable_prefix_caching,
                 policy, reserve_full_prompt, unhashed_blocks_first, watermark,
                 uncache_unscheduled_victims}
    cost_model: {type: fitted, profile: NAME|PATH} | {type: analytic, efficiency: {...}}
    workload:   see sim/workload.py
    slo:        {ttft_s, tpot_s, e2e_s, queue_s}
    output:     {record_token_times, plots}
    simulation: {steady_decode, max_time_s}

Errors name the file, the key path and the value. Scheduler defaults are those of a vLLM server
on a data-center GPU (8192 batched tokens, 1024 sequences), not the scheduler class defaults.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from engine.core import SchedulerConfig
from engine.core.policy import POLICIES
from sim.cost_model import PROFILES_DIR, AnalyticCostModel, CostModel, FittedCostModel, load_profile
from sim.simulation import ROUTERS, SimResult, Simulation
from sim.specmap import SpecError, SpecMap
from sim.specs import DEVICES, MODELS, get_device, get_model, kv_cache_blocks
from sim.workload import Workload, build_workload


class ScenarioError(SpecError):
    pass


class _M(SpecMap):
    error = ScenarioError


TOP_KEYS = ("name", "description", "seed", "deployment", "scheduler", "cost_model", "workload", "slo",
            "output", "simulation")


@dataclass
class Scenario:
    name: str
    seed: int
    path: Path | None
    scheduler_config: SchedulerConfig
    cost_model: CostModel
    workload: Workload
    replicas: int
    router: str
    slo: dict
    record_token_times: bool
    plots: bool
    steady_decode: bool
    max_time_s: float | None
    deployment: dict

    def describe(self) -> str:
        c = self.scheduler_config
        d = self.deployment
        w = self.workload.describe()
        return (f"{d.get('model')} on {self.replicas}x {d.get('device')} (tp={d.get('tp')}), "
                f"{c.num_gpu_blocks - 1} KV blocks of {c.block_size} per replica, "
                f"budget {c.max_num_batched_tokens} tokens / {c.max_num_seqs} seqs; "
                f"{len(self.workload)} requests ({w.get('source', '?')}), "
                f"cost model {self.cost_model.kind}")


def load_scenario(path: str | Path, seed: int | None = None) -> Scenario:
    path = Path(path)
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such scenario file") from None
    except yaml.YAMLError as e:
        raise ScenarioError(f"{path}: not valid YAML: {e}") from None
    try:
        return parse_scenario(data, base_dir=path.parent, seed=seed, path=path)
    except SpecError as e:
        raise ScenarioError(f"{path}: {e}") from None


def parse_scenario(data, base_dir: Path | None = None, seed: int | None = None,
                   path: Path | None = None) -> Scenario:
    root = _M(data if data is not None else {}, "scenario")
    root.done(allowed=TOP_KEYS)
    name = root.text("name", path.stem if path else "scenario")
    root.text("description", "")
    seed = root.integer("seed", 0, ge=0) if seed is None else seed

    # Deployment: model x device x tp x replicas (+ router).
    dep = root.sub("deployment") or _M({}, "deployment")
    model_v = dep.raw("model", "llama-3.1-8b")
    device_v = dep.raw("device", "h100-sxm")
    try:
        model, device = get_model(model_v), get_device(device_v)
    except ValueError as e:
        raise ScenarioError(str(e)) from None
    tp = dep.integer("tp", 1, ge=1)
    if model.num_heads % tp or model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ScenarioError(f"deployment.tp={tp}: must divide num_heads={model.num_heads} of {model.name}")
    replicas = dep.integer("replicas", 1, ge=1)
    router = dep.text("router", "round_robin", choices=ROUTERS)
    util = dep.number("gpu_memory_utilization", 0.9, gt=0, le=1)
    blocks = dep.integer("num_gpu_blocks", None, ge=2)
    dep.done()

    # Cost model: a fitted profile (by default the shipped one for this deployment, if any),
    # else the analytic roofline.
    cm = root.sub("cost_model")
    default_profile = f"{device.name}-{model.name}" if tp == 1 else f"{device.name}-tp{tp}-{model.name}"
    if cm is None:
        shipped = (PROFILES_DIR / f"{default_profile}.json").exists()
        cm = _M({"type": "fitted" if shipped else "analytic"}, "cost_model")
    kind = cm.text("type", "fitted", choices=("fitted", "analytic"))
    profile_meta = {}
    if kind == "fitted":
        prof_name = cm.text("profile", default_profile)
        prof_ref: str | Path = prof_name
        if prof_name.endswith(".json") and not Path(prof_name).is_absolute() and base_dir is not None:
            prof_ref = base_dir / prof_name
        try:
            prof = load_profile(prof_ref)
        except ValueError as e:
            raise ScenarioError(str(e)) from None
        cost: CostModel = FittedCostModel.from_profile(prof)
        profile_meta = prof.get("metadata", {})
        for key, mine in (("model", model.name), ("device", device.name), ("tp", tp)):
            theirs = profile_meta.get(key)
            if theirs is not None and theirs != mine:
                raise ScenarioError(
                    f"cost_model.profile={prof_name!r} was made for {key}={theirs!r} but "
                    f"deployment.{key}={mine!r}; use a matching profile or cost_model.type: analytic")
    else:
        eff = cm.raw("efficiency", None)
        try:
            cost = AnalyticCostModel(model, device, tp, eff)
        except (TypeError, ValueError) as e:
            raise ScenarioError(f"cost_model.efficiency={eff!r}: {e}") from None
    cm.done()

    # Scheduler, with the KV pool from the deployment (explicit > profile > memory accounting).
    sc = root.sub("scheduler") or _M({}, "scheduler")
    block_size = sc.integer("block_size", 16, ge=1)
    if blocks is None:
        if profile_meta.get("num_gpu_blocks") and profile_meta.get("block_size", block_size) == block_size:
            blocks = int(profile_meta["num_gpu_blocks"])
        else:
            try:
                blocks = kv_cache_blocks(model, device, tp, block_size, util)
            except ValueError as e:
                raise ScenarioError(str(e)) from None
    default_len = min(model.max_position_embeddings, (blocks - 1) * block_size)
    policy = sc.text("policy", "fcfs", choices=tuple(POLICIES))
    try:
        cfg = SchedulerConfig(
            max_num_batched_tokens=sc.integer("max_num_batched_tokens", 8192, ge=1),
            max_num_seqs=sc.integer("max_num_seqs", 1024, ge=1),
            max_model_len=sc.integer("max_model_len", default_len, ge=2),
            block_size=block_size, num_gpu_blocks=blocks,
            enable_chunked_prefill=sc.boolean("enable_chunked_prefill", True),
            long_prefill_token_threshold=sc.integer("long_prefill_token_threshold", 0, ge=0),
            enable_prefix_caching=sc.boolean("enable_prefix_caching", True),
            policy=policy,
            reserve_full_prompt=sc.boolean("reserve_full_prompt", True),
            unhashed_blocks_first=sc.boolean("unhashed_blocks_first", True),
            watermark=sc.number("watermark", 0.0, ge=0, le=0.99),
            uncache_unscheduled_victims=sc.boolean("uncache_unscheduled_victims", False))
    except ValueError as e:
        if isinstance(e, SpecError):
            raise
        raise ScenarioError(str(e).replace("SchedulerConfig.", "scheduler.")) from None
    sc.done()

    wl = root.raw("workload")
    workload = build_workload(wl, seed=seed, base_dir=base_dir)

    slo_m = root.sub("slo")
    slo = {}
    if slo_m is not None:
        for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
            v = slo_m.number(key, None, gt=0)
            if v is not None:
                slo[key] = v
        slo_m.done()
    out_m = root.sub("output") or _M({}, "output")
    record_times = out_m.boolean("record_token_times", False)
    plots = out_m.boolean("plots", True)
    out_m.done()
    sim_m = root.sub("simulation") or _M({}, "simulation")
    steady = sim_m.boolean("steady_decode", True)
    max_time = sim_m.number("max_time_s", None, gt=0)
    sim_m.done()

    return Scenario(name=name, seed=seed, path=path, scheduler_config=cfg, cost_model=cost,
                    workload=workload, replicas=replicas, router=router, slo=slo,
                    record_token_times=record_times, plots=plots, steady_decode=steady,
                    max_time_s=max_time,
                    deployment={"model": model.name, "device": device.name, "tp": tp,
                                "replicas": replicas, "router": router, "num_gpu_blocks": blocks})


def run_scenario(sc: Scenario, progress: bool = False) -> SimResult:
    sim = Simulation(sc.workload, sc.scheduler_config, sc.cost_model, num_replicas=sc.replicas,
                     router=sc.router, seed=sc.seed, use_steady=sc.steady_decode,
                     keep_token_times=sc.record_token_times, progress=progress, slo=sc.slo,
                     max_time_s=sc.max_time_s)
    result = sim.run()
    result.summary["scenario"] = {"name": sc.name, "seed": sc.seed, **sc.deployment,
                                  "cost_model": sc.cost_model.describe(),
                                  "scheduler": {k: getattr(sc.scheduler_config, k) for k in (
                                      "max_num_batched_tokens", "max_num_seqs", "max_model_len",
                                      "block_size", "enable_prefix_caching", "policy")}}
    if sim.rejections:
        result.summary["rejections"] = sim.rejections[:20]
    return result


__all__ = ["Scenario", "ScenarioError", "load_scenario", "parse_scenario", "run_scenario",
           "MODELS", "DEVICES"]
