"""Scenario files (YAML): validated into a runnable simulation.

    name: quickstart            # used for the default output directory
    seed: 0
    deployment: {model, model_config, weight_dtype (or the old `dtype`: weights only), kv_dtype,
                 device, tp, expert_parallel, data_parallel (MoE), replicas, router,
                 gpu_memory_utilization, num_gpu_blocks, vllm_version (whose memory profiling
                 sizes the pool; default sim.specs.DEFAULT_VLLM_VERSION), api_server_count,
                 interconnect: {bandwidth_gb_s, latency_s},  # required for tp beyond one node
                 pd: {prefill_replicas, decode_replicas, prefill_tp, decode_tp,
                      link_bandwidth_gb_s, link_latency_s,      # disaggregated pools (sim/disagg.py)
                      first_token: decode|prefill,
                      {prefill,decode}_expert_parallel, {prefill,decode}_data_parallel (MoE),
                      {prefill,decode}_max_num_seqs, {prefill,decode}_max_num_batched_tokens}}
    scheduler:  {max_num_batched_tokens, max_num_seqs, max_model_len, block_size,
                 enable_chunked_prefill, long_prefill_token_threshold, enable_prefix_caching,
                 policy, reserve_full_prompt, unhashed_blocks_first, watermark,
                 uncache_unscheduled_victims, async_scheduling,
                 cpu_work: {step_s, per_req_s, per_token_s, per_output_s}}  # sim/cpu_work.py
    cost_model: {type: fitted, profile: NAME|PATH} | {type: kernels, overheads: {...}, moe_activations: bf16|mxfp8,
                 moe_backend: auto|triton}
                | {type: analytic, efficiency: {...}}
                default: the shipped profile for the deployment if any, else measured kernel tables
                (H100/H200/B200), else the analytic roofline
    workload:   see sim/workload.py
    slo:        {ttft_s, tpot_s, e2e_s, queue_s}
    output:     {record_token_times, plots}
    simulation: {steady_decode, max_time_s}
    plan:       read by scenarios/plan.py (`servetwin plan`)
    sweep:      read by scenarios/sweep.py (`servetwin sweep`)

Errors name the file, the key path and the value. Scheduler defaults are those of a vLLM server
on the deployment's GPU (8192 batched tokens and 1024 sequences on H100, H200, B200; 2048 and 256
on A100, L40S, A10G: DeviceSpec.serve_defaults), not the scheduler class defaults.
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from engine.core import SchedulerConfig
from engine.core.kv_cache_manager import window_reserve_blocks
from engine.core.policy import POLICIES
from sim.cost_model import PROFILES_DIR, AnalyticCostModel, CostModel, load_profile
from sim.kernel_model import MOE_ACTIVATIONS, MOE_BACKENDS, KernelCostModel, cost_model_from_profile, profile_name
from sim.cpu_work import timing_model, timing_settings
from sim.simulation import ROUTERS, SimResult, Simulation
from sim.specmap import SpecError, SpecMap
from sim.sampling import SAMPLING_MODES
from sim.clients import default_api_servers
from sim.specs import DEVICES, MODELS, get_device, get_model, kv_cache_blocks, memory_breakdown, vllm_version_tuple
from sim.workload import Workload, build_workload


class ScenarioError(SpecError):
    pass


class _M(SpecMap):
    error = ScenarioError


TOP_KEYS = ("name", "description", "seed", "deployment", "scheduler", "cost_model", "workload", "slo",
            "output", "simulation", "plan", "sweep")


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
    pd: dict | None = None  # disaggregated: pool sizes, link, and a (config, cost model) per pool
    warnings: list[str] = field(default_factory=list)  # e.g. a profile used outside what it measured
    data_parallel: int = 1  # data-parallel attention ranks per replica (MoE)
    api_servers: int = 1  # API server processes per engine (vLLM's --api-server-count)

    def describe(self) -> str:
        c = self.scheduler_config
        d = self.deployment
        w = self.workload.describe()
        if self.pd is not None:
            p = self.pd
            def shape(pool: str) -> str:
                cfg = p[pool][0]  # the pool's own scheduler (its limits)
                return (f"tp={p[f'{pool}_tp']}"
                        + (f", dp={p[f'{pool}_data_parallel']}" if p.get(f"{pool}_data_parallel", 1) > 1 else "")
                        + (", ep" if p.get(f"{pool}_expert_parallel") else "")
                        + f"; {cfg.max_num_seqs} seqs" + (f", budget {cfg.max_num_batched_tokens}"
                                                           if pool == "prefill" else ""))
            return (f"{d.get('model')} on {d.get('device')}: {p['prefill_replicas']} prefill replica(s) "
                    f"({shape('prefill')}) + {p['decode_replicas']} decode replica(s) ({shape('decode')}), "
                    f"KV link {p['link_bandwidth_gb_s']:g} GB/s; {len(self.workload)} requests "
                    f"({w.get('source', '?')})")
        dp = f", dp={self.data_parallel}" if self.data_parallel > 1 else ""
        wd = d.get("weight_dtype")
        weights = f" ({wd} weights)" if wd not in (None, "bfloat16", "float16") else ""
        return (f"{d.get('model')}{weights} on {self.replicas}x {d.get('device')} (tp={d.get('tp')}{dp}), "
                f"{c.num_gpu_blocks - 1} KV blocks of {c.block_size} per {'rank' if dp else 'replica'}, "
                f"budget {c.max_num_batched_tokens} tokens / {c.max_num_seqs} seqs; "
                f"{len(self.workload)} requests ({w.get('source', '?')}), "
                f"cost model {self.cost_model.kind}")


def set_field(data: dict, dotted: str, value) -> dict:
    """A copy with `a.b.c` set (mappings created on the way); value None removes the key."""
    out = copy.deepcopy(data)
    node = out
    keys = dotted.split(".")
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {}
        node = node[k]
    if value is None:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = copy.deepcopy(value)
    return out


# --set fields whose values are text however they look: a release "0.10" is not the number 0.1
TEXT_SET_FIELDS = ("deployment.vllm_version",)


def parse_set(items: list[str]) -> dict[str, list]:
    """["a.b=1,2", "c=x,y"] -> {"a.b": [1, 2], "c": ["x", "y"]} (each value read as YAML, but
    TEXT_SET_FIELDS' as written)."""
    out: dict[str, list] = {}
    for item in items:
        if "=" not in item:
            raise ScenarioError(f"--set {item!r}: expected FIELD=V1,V2,... (e.g. scheduler.max_num_seqs=64,256)")
        key, vals = item.split("=", 1)
        read = str.strip if key.strip() in TEXT_SET_FIELDS else yaml.safe_load
        values = [read(v) for v in vals.split(",") if v.strip() != ""]
        if not key or not values:
            raise ScenarioError(f"--set {item!r}: needs a field and at least one value")
        out[key.strip()] = values
    return out


def settings(fields: dict[str, list]) -> list[dict]:
    keys = list(fields)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(fields[k] for k in keys))] or [{}]


def setting_label(s: dict) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in s.items()) or "scenario as is"


def read_yaml(path: Path):
    """A scenario file's parsed YAML, or ScenarioError naming the file."""
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such scenario file") from None
    except yaml.YAMLError as e:
        raise ScenarioError(f"{path}: not valid YAML: {e}") from None


def load_scenario(path: str | Path, seed: int | None = None) -> Scenario:
    path = Path(path)
    data = read_yaml(path)
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
    model_cfg = dep.text("model_config", None)
    try:
        model = get_model(model_cfg if model_cfg is not None else model_v, base_dir=base_dir)
        if model_cfg is not None and dep.has("model") and isinstance(model_v, str):
            model = replace(model, name=model_v)
        device = get_device(device_v)
        # Weights: `weight_dtype`, or the old `dtype` key (weights only). KV: `kv_dtype`, bf16
        # unless fp8 is asked for, as vLLM's --kv-cache-dtype auto keeps it with fp8 weights.
        wd = dep.text("weight_dtype", None) or dep.text("dtype", None)
        model = model.with_dtypes(weight_dtype=wd, kv_dtype=dep.text("kv_dtype", None))
    except ValueError as e:
        raise ScenarioError(str(e)) from None
    tp = dep.integer("tp", 1, ge=1)

    def heads_split(t: int) -> bool:
        """Whether vLLM splits the query heads and every layer kind's KV heads over t GPUs (a share
        each, or KV heads replicated when t is a multiple of them)."""
        kvs = {model.num_kv_heads, model.attention_shape(sliding=True)[0]}
        return not model.num_heads % t and all(not kv % t or not t % kv for kv in kvs)
    if not heads_split(tp):
        raise ScenarioError(f"deployment.tp={tp}: must divide num_heads={model.num_heads} of {model.name}")
    # vLLM's --enable-expert-parallel with data parallel size 1: each rank holds 1/tp of the
    # experts whole instead of 1/tp of every expert: the same weight bytes (memory as TP); kernel
    # tables time the MoE layers from the fused-MoE kernels measured with that split (skewed
    # routing loads the ranks unevenly), other cost models as TP. Data-parallel attention (ranks
    # stepping together, the all-to-all dispatch) is not modelled: refused, not run as something else.
    ep = dep.boolean("expert_parallel", False)
    if ep and not model.is_moe:
        raise ScenarioError(f"deployment.expert_parallel=true: {model.name} has no experts")
    # vLLM's --data-parallel-size for a MoE model (data-parallel attention): dp engine ranks of tp
    # GPUs each, stepping together (sim.replica.DataParallelGroup); the MoE layers over all
    # tp x dp GPUs and all ranks' tokens. A dense model's independent engines are `replicas`.
    dp = dep.integer("data_parallel", 1, ge=1)
    if dp > 1 and not model.is_moe:
        raise ScenarioError(f"deployment.data_parallel={dp}: attention data parallelism is for mixtures of "
                            f"experts; {model.name} is dense (use replicas for independent engines)")
    replicas = dep.integer("replicas", 1, ge=1)
    router = dep.text("router", "round_robin", choices=ROUTERS)
    util = dep.number("gpu_memory_utilization", 0.9, gt=0, le=1)
    # The vLLM release whose startup profiling sizes the pool (sim.specs.activation_reserve_bytes):
    # the sampler warm-up before 0.17 and the CUDA-graph estimate from 0.21 differ by GiBs.
    if isinstance(dep.raw("vllm_version", None), float):  # YAML reads 0.10 as 0.1
        v = dep.raw("vllm_version")
        raise ScenarioError(f"deployment.vllm_version={v!r}: quote the release (vllm_version: '{v}'); YAML "
                            "reads an unquoted one as a number, and 0.10 as 0.1")
    vllm_version = dep.text("vllm_version", None)
    try:
        vllm_version_tuple(vllm_version)
    except ValueError as e:
        raise ScenarioError(str(e)) from None
    blocks = dep.integer("num_gpu_blocks", None, ge=2)
    # vLLM's --api-server-count: the API server processes of one engine (a data-parallel group's
    # ranks share them), each with its own tokenizer. Default: vLLM's for the release.
    api_given = dep.integer("api_server_count", None, ge=1)
    pd_m = dep.sub("pd")
    if pd_m is not None and api_given is not None:
        raise ScenarioError(f"deployment.api_server_count={api_given}: not supported with deployment.pd "
                            "(each prefill engine has one API server)")
    api_servers = default_api_servers(vllm_version, dp) if api_given is None else api_given
    if pd_m is not None and dp > 1:
        raise ScenarioError(f"deployment.data_parallel={dp}: with deployment.pd, give each pool its own "
                            "(pd.prefill_data_parallel, pd.decode_data_parallel)")
    # the widest engine (its GPUs, and the keys that make it so, for the message)
    engines = [(tp * dp, f"deployment.tp={tp}" if dp == 1 else f"deployment.tp={tp} x data_parallel={dp}")]
    for k in ("prefill", "decode") if pd_m is not None else ():
        t, r = pd_m.d.get(f"{k}_tp", tp), pd_m.d.get(f"{k}_data_parallel", 1)
        if isinstance(t, int) and isinstance(r, int):
            engines.append((t * r, f"deployment.pd.{k}_tp={t}" + (f" x {k}_data_parallel={r}" if r > 1 else "")))
    widest, widest_keys = max(engines, key=lambda e: e[0])
    ic = dep.sub("interconnect")
    if ic is not None:  # a TP group beyond one node: its all-reduce runs over this link
        device = replace(device, interconnect_bandwidth=ic.number("bandwidth_gb_s", gt=0) * 1e9,
                         interconnect_latency_s=ic.number("latency_s", device.interconnect_latency_s, ge=0),
                         gpus_per_node=max(device.gpus_per_node, widest))
        ic.done()
    elif widest > device.gpus_per_node:
        raise ScenarioError(
            f"{widest_keys}: spans more than one node of {device.gpus_per_node} {device.name} GPUs; "
            "declare the link between nodes (deployment.interconnect: {bandwidth_gb_s, latency_s}) "
            "for its all-reduce")
    pd = None
    if pd_m is not None:
        pd = {"prefill_replicas": pd_m.integer("prefill_replicas", 1, ge=1),
              "decode_replicas": pd_m.integer("decode_replicas", 1, ge=1),
              "prefill_tp": pd_m.integer("prefill_tp", tp, ge=1),
              "decode_tp": pd_m.integer("decode_tp", tp, ge=1),
              "link_bandwidth_gb_s": pd_m.number("link_bandwidth_gb_s", 50.0, gt=0),
              "link_latency_s": pd_m.number("link_latency_s", 1e-4, ge=0),
              # which engine streams the client's first token (sim/disagg.py)
              "first_token": pd_m.text("first_token", "decode", choices=("decode", "prefill"))}
        # Each pool's engine as vLLM's flags shape it (a pool replica is one engine of data_parallel
        # ranks of tp GPUs each, as deployment.data_parallel is for an aggregated replica), and its
        # own scheduler limits where the pools' servers differ (default: the scheduler section's).
        for pool in ("prefill", "decode"):
            pd[f"{pool}_expert_parallel"] = pd_m.boolean(f"{pool}_expert_parallel", ep)
            pd[f"{pool}_data_parallel"] = pd_m.integer(f"{pool}_data_parallel", 1, ge=1)
            pd[f"{pool}_max_num_seqs"] = pd_m.integer(f"{pool}_max_num_seqs", None, ge=1)
            pd[f"{pool}_max_num_batched_tokens"] = pd_m.integer(f"{pool}_max_num_batched_tokens", None, ge=1)
            if not model.is_moe:
                for key, off in (("expert_parallel", False), ("data_parallel", 1)):
                    if pd[f"{pool}_{key}"] != off:
                        raise ScenarioError(f"deployment.pd.{pool}_{key}={pd[f'{pool}_{key}']!r}: {model.name} "
                                            "has no experts (data-parallel attention and expert parallelism "
                                            "are for mixtures of experts)")
        pd_m.done()
        if replicas != 1:
            raise ScenarioError(f"deployment.replicas={replicas}: with deployment.pd, size the pools with "
                                "pd.prefill_replicas and pd.decode_replicas")
        for key in ("prefill_tp", "decode_tp"):
            t = pd[key]
            if not heads_split(t):
                raise ScenarioError(f"deployment.pd.{key}={t}: must divide num_heads={model.num_heads} "
                                    f"of {model.name}")
    dep.done()

    # Cost model: a fitted profile (by default the shipped one for this deployment, if any),
    # else the analytic roofline. Read once, built for each tensor-parallel size in use.
    cm = root.sub("cost_model")
    explicit_cm = cm is not None
    if cm is None:
        cm = _M({}, "cost_model")
    kind = cm.text("type", "fitted", choices=("fitted", "kernels", "analytic")) if explicit_cm else None
    prof_name = cm.text("profile", None) if kind == "fitted" else None
    eff = cm.raw("efficiency", None) if kind == "analytic" else None
    ovh = cm.raw("overheads", None) if kind == "kernels" else None
    moe_act = cm.text("moe_activations", "bf16", choices=MOE_ACTIVATIONS) if kind == "kernels" else "bf16"
    moe_backend = cm.text("moe_backend", "auto", choices=MOE_BACKENDS) if kind == "kernels" else "auto"
    cm.done()

    # The requests' sampling parameters (workload.sampling) price the sampler of a GPU step
    # (sim.sampling): read here, before the cost models are built (build_workload reads it too).
    wl_raw = root.raw("workload", None)
    sampling = (_M(wl_raw, "workload").text("sampling", "model_default", choices=SAMPLING_MODES)
                if isinstance(wl_raw, dict) else "model_default")

    def cost_for(t: int, ep: bool = ep, dp: int = dp, dp_key: str = "deployment.data_parallel") -> tuple[CostModel, dict]:
        built, meta = _cost_for(t, ep, dp, dp_key)
        if isinstance(built, KernelCostModel):  # a profile's stored spec may predate generation_filter
            built.set_sampling(sampling, vllm_version, model.generation_filter)
        return built, meta

    def _cost_for(t: int, ep: bool, dp: int, dp_key: str) -> tuple[CostModel, dict]:
        # Shipped profiles are named device-[tpN-]model[-fp8|-fp8block][-kvfp8] (sim/profiles/README.md;
        # another weight format has a suffix of its own, which no shipped profile has).
        default_profile = profile_name(device.name, model, t)
        k = kind
        if k is None and dp > 1:  # data-parallel ranks: only the kernel tables time them
            k = "kernels"
        if k is None:  # a shipped profile, else measured kernel tables, else the roofline
            k = ("fitted" if (PROFILES_DIR / f"{default_profile}.json").exists()
                 else "kernels" if device.kernel_tables else "analytic")
        if dp > 1 and k != "kernels":
            raise ScenarioError(f"{dp_key}={dp}: timed by cost_model.type kernels only "
                                f"(the {k} model has no data-parallel ranks)")
        if k == "analytic":
            try:
                return AnalyticCostModel(model, device, t, eff), {}
            except (TypeError, ValueError) as e:
                raise ScenarioError(f"cost_model.efficiency={eff!r}: {e}") from None
        if k == "kernels":
            try:
                return KernelCostModel(model, device, t, ovh, expert_parallel=ep, data_parallel=dp,
                                       moe_activations=moe_act, moe_backend=moe_backend), {}
            except (TypeError, ValueError) as e:
                raise ScenarioError(f"cost_model (kernels, overheads={ovh!r}): {e}") from None
        name = prof_name or default_profile
        prof_ref: str | Path = name
        if name.endswith(".json") and not Path(name).is_absolute() and base_dir is not None:
            prof_ref = base_dir / name
        try:
            prof = load_profile(prof_ref)
        except ValueError as e:
            raise ScenarioError(str(e)) from None
        meta = prof.get("metadata", {})
        for key, mine in (("model", model.name), ("device", device.name), ("tp", t),
                          ("weight_dtype", model.weight_dtype), ("kv_dtype", model.kv_dtype)):
            theirs = meta.get(key)
            if theirs is not None and theirs != mine:
                raise ScenarioError(
                    f"cost_model.profile={name!r} was made for {key}={theirs!r} but "
                    f"deployment.{key}={mine!r}; use a matching profile or cost_model.type: kernels/analytic")
        return cost_model_from_profile(prof), meta

    base_cost, profile_meta = cost_for(tp)

    # Scheduler, with the KV pool from the deployment (explicit > profile > memory accounting).
    sc = root.sub("scheduler") or _M({}, "scheduler")
    block_size = sc.integer("block_size", 16, ge=1)

    util_given = dep.has("gpu_memory_utilization")
    # vLLM's defaults on this GPU; the pool is sized for the limits the server runs with
    default_budget, default_seqs = device.serve_defaults()
    budget = sc.integer("max_num_batched_tokens", default_budget, ge=1)
    max_seqs = sc.integer("max_num_seqs", default_seqs, ge=1)

    def blocks_for(t: int, meta: dict, dp: int = dp, budget: int = budget, max_seqs: int = max_seqs) -> int:
        if blocks is not None:
            return blocks
        measured = meta.get("num_gpu_blocks") and meta.get("block_size", block_size) == block_size
        if measured and util_given and device.name.startswith("cpu"):
            raise ScenarioError(
                f"deployment.gpu_memory_utilization={util}: the profile's KV pool of {meta['num_gpu_blocks']} "
                f"blocks was measured on {device.name}, which has no GPU memory to account; set "
                "deployment.num_gpu_blocks instead")
        if measured and not util_given:
            return int(meta["num_gpu_blocks"])
        try:
            return kv_cache_blocks(model, device, t, block_size, util, max_num_batched_tokens=budget,
                                   max_num_seqs=max_seqs, data_parallel=dp, vllm_version=vllm_version)
        except ValueError as e:
            raise ScenarioError(str(e)) from None

    explicit_blocks = blocks
    # With pools, the scheduler section's own pool (and the default max_model_len) is that of one
    # decode engine; each pool's is sized below.
    base_t, base_dp = (pd["decode_tp"], pd["decode_data_parallel"]) if pd is not None else (tp, dp)
    blocks = blocks_for(base_t, profile_meta if (base_t, base_dp) == (tp, dp) else {}, base_dp)
    state_note: list[str] = []

    def state_cap(t: int, pool_dp: int, pool_budget: int, seqs: int, key: str | None) -> int:
        """max_num_seqs of an engine of TP t (and pool_dp ranks): a linear-attention hybrid runs no
        more requests than the pool holds states for (each running request keeps one per linear
        layer): vLLM's pool runs out of state blocks there. Noted under `key` when it binds (None:
        not noted)."""
        if not model.is_hybrid or explicit_blocks is not None:
            return seqs
        held = memory_breakdown(model, device, t, util, block_size, max_num_batched_tokens=pool_budget,
                                max_num_seqs=seqs, data_parallel=pool_dp,
                                vllm_version=vllm_version)["linear_state_requests"]
        if held >= seqs:
            return seqs
        if key is not None:
            state_note.append(f"{key}={seqs}: {model.name} at tp={t} on {device.name} holds the linear-attention "
                              f"state of {held} requests in the memory it leaves (half of it at most); at most "
                              f"{held} run at once")
        return held

    sc_seqs = max_seqs  # as asked: with pools, each pool caps (and notes) its own below
    max_seqs = state_cap(base_t, base_dp, budget, max_seqs, "scheduler.max_num_seqs" if pd is None else None)
    def window_charge(t: int) -> dict:
        """SchedulerConfig's sliding-window charge at TP t: sliding-window layers keep each running
        request's window in the pool (vLLM's hybrid KV cache manager); {} without such layers."""
        sliding, full = model.sliding_kv_pool_bytes_per_token_per_gpu(t), model.kv_bytes_per_token_per_gpu(t)
        return {"sliding_window": model.sliding_window, "sliding_kv_bytes": sliding, "kv_bytes": full} \
            if sliding and full else {}

    def reserve_for(t: int, pool_budget: int) -> int:
        """Pool blocks a prompt's window holds while a chunk of the whole budget prefills (0: none)."""
        c = window_charge(t)
        return window_reserve_blocks(pool_budget, block_size, c["sliding_window"], c["sliding_kv_bytes"],
                                     c["kv_bytes"]) if c else 0

    def room(t: int, pool_blocks: int, where: str, pool_budget: int = budget,
             budget_key: str = "scheduler.max_num_batched_tokens") -> int:
        """Tokens a request may hold in a pool of pool_blocks at TP t, after its window's reserve."""
        held = reserve_for(t, pool_budget)
        left = pool_blocks - 1 - held
        if left < 1:
            raise ScenarioError(f"{where}: {model.name}'s sliding-window layers hold {held} KV blocks for one "
                                f"request's window while a chunk of {budget_key}={pool_budget} prefills "
                                f"at tp={t}, but the pool has {pool_blocks - 1}: lower the budget or raise tp")
        return left * block_size

    default_len = min(model.max_position_embeddings,
                      room(base_t, blocks, f"deployment.tp={tp}" if pd is None else f"deployment.pd.decode_tp={base_t}"))
    policy = sc.text("policy", "fcfs", choices=tuple(POLICIES))
    try:
        cfg = SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            max_model_len=sc.integer("max_model_len", default_len, ge=2),
            block_size=block_size, num_gpu_blocks=blocks,
            enable_chunked_prefill=sc.boolean("enable_chunked_prefill", True),
            long_prefill_token_threshold=sc.integer("long_prefill_token_threshold", 0, ge=0),
            enable_prefix_caching=sc.boolean("enable_prefix_caching", True),
            policy=policy,
            reserve_full_prompt=sc.boolean("reserve_full_prompt", True),
            unhashed_blocks_first=sc.boolean("unhashed_blocks_first", True),
            watermark=sc.number("watermark", 0.0, ge=0, le=0.99),
            uncache_unscheduled_victims=sc.boolean("uncache_unscheduled_victims", False),
            **window_charge(tp))
    except ValueError as e:
        if isinstance(e, SpecError):
            raise
        raise ScenarioError(str(e).replace("SchedulerConfig.", "scheduler.")) from None
    # One timing composition for every pool: the cost model's GPU time with CPU work and async
    # scheduling around it (sim.cpu_work.timing_model), aggregated replicas and P/D pools alike.
    timing = timing_settings(sc)
    sc.done()

    def timing_for(t: int, pool_ep: bool = ep, pool_dp: int = dp,
                   dp_key: str = "deployment.data_parallel") -> tuple[CostModel, dict]:
        base, meta = ((base_cost, profile_meta) if (t, pool_ep, pool_dp) == (tp, ep, dp)
                      else cost_for(t, pool_ep, pool_dp, dp_key))
        try:
            return timing_model(base, timing), meta
        except ValueError as e:
            key = "async_scheduling" if timing.async_scheduling is not None else "cpu_work"
            raise ScenarioError(f"scheduler.{key}: {e}") from None

    cost, _ = timing_for(tp)  # the aggregated replicas' (and the summary's) timing

    wl = root.raw("workload")
    workload = build_workload(wl, seed=seed, base_dir=base_dir)
    range_notes = _range_warnings(profile_meta, prof_name or "(default)", cfg, workload)
    if pd is not None and isinstance(wl, dict) and wl.get("cancellation"):
        raise ScenarioError("workload.cancellation: not supported with deployment.pd (disaggregated pools)")

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

    if pd is not None:
        blocks = explicit_blocks
        for pool in ("prefill", "decode"):
            t, pdp = pd[f"{pool}_tp"], pd[f"{pool}_data_parallel"]
            pool_cost, meta = timing_for(t, pd[f"{pool}_expert_parallel"], pdp, f"deployment.pd.{pool}_data_parallel")
            own = {k: pd[f"{pool}_{k}"] is not None for k in ("max_num_seqs", "max_num_batched_tokens")}
            limits = {"max_num_seqs": pd[f"{pool}_max_num_seqs"] or sc_seqs,
                      "max_num_batched_tokens": pd[f"{pool}_max_num_batched_tokens"] or cfg.max_num_batched_tokens}
            key = {k: f"deployment.pd.{pool}_{k}" if own[k] else f"scheduler.{k}" for k in own}
            limits["max_num_seqs"] = state_cap(t, pdp, limits["max_num_batched_tokens"], limits["max_num_seqs"],
                                               key["max_num_seqs"])
            pool_blocks = blocks_for(t, meta, pdp, limits["max_num_batched_tokens"], limits["max_num_seqs"])
            pool_len = room(t, pool_blocks, f"deployment.pd.{pool}_tp={t}", limits["max_num_batched_tokens"],
                            key["max_num_batched_tokens"])
            pool_cfg = replace(cfg, num_gpu_blocks=pool_blocks, **window_charge(t), **limits,
                               max_model_len=min(cfg.max_model_len, pool_len))
            pd[pool] = (pool_cfg, pool_cost)
        pd["kv_bytes_per_token"] = model.kv_bytes_per_token
        blocks = pd["decode"][0].num_gpu_blocks

    return Scenario(name=name, seed=seed, path=path, scheduler_config=cfg, cost_model=cost,
                    workload=workload, replicas=replicas, data_parallel=dp, api_servers=api_servers,
                    router=router, slo=slo,
                    record_token_times=record_times, plots=plots, steady_decode=steady,
                    max_time_s=max_time, pd=pd, warnings=state_note + range_notes,
                    deployment={"model": model.name, "device": device.name, "tp": tp,
                                "weight_dtype": model.weight_dtype, "kv_dtype": model.kv_dtype,
                                "replicas": replicas, "router": router, "num_gpu_blocks": blocks,
                                "gpu_memory_utilization": util,
                                **({"vllm_version": vllm_version} if vllm_version else {}),
                                **({"expert_parallel": True} if ep else {}),
                                **({"data_parallel": dp} if dp > 1 else {}),
                                **({"api_server_count": api_servers} if api_servers > 1 or api_given else {}),
                                **({"pd": {k: v for k, v in pd.items() if k not in ("prefill", "decode")}}
                                   if pd else {})})


def _range_warnings(meta: dict, name: str, cfg: SchedulerConfig, workload: Workload) -> list[str]:
    """Where the scenario asks the profile for step shapes it never measured (extrapolation)."""
    r = meta.get("measured_ranges")
    if not r:
        return []
    out = []
    longest = int((workload.prompt_len + workload.output_len).max()) if len(workload) else 0
    for what, asked, key in (("scheduler.max_num_batched_tokens", cfg.max_num_batched_tokens, "num_tokens"),
                             ("scheduler.max_num_seqs", cfg.max_num_seqs, "num_reqs"),
                             ("the workload's longest request (tokens)", longest, "mean_decode_context_tokens")):
        seen = r.get(key, [0, 0])[1]
        if asked > seen:
            out.append(f"cost_model.profile={name!r} measured {key} up to {seen}; {what}={asked} "
                       "extrapolates beyond it")
    return out


def run_scenario(sc: Scenario, progress: bool = False) -> SimResult:
    if sc.pd is not None:
        from sim.disagg import DisaggSimulation
        sim = DisaggSimulation(sc.workload, sc.pd, router=sc.router, seed=sc.seed,
                               keep_token_times=sc.record_token_times, progress=progress, slo=sc.slo,
                               max_time_s=sc.max_time_s)
    else:
        sim = Simulation(sc.workload, sc.scheduler_config, sc.cost_model, num_replicas=sc.replicas,
                         data_parallel=sc.data_parallel, api_servers=sc.api_servers,
                         router=sc.router, seed=sc.seed, use_steady=sc.steady_decode,
                         keep_token_times=sc.record_token_times, progress=progress, slo=sc.slo,
                         max_time_s=sc.max_time_s)
    result = sim.run()
    if getattr(sc.workload, "stages", None):
        from sim.metrics import stage_metrics
        result.summary["stages"] = stage_metrics(result.request_table, sc.workload.stages)
    result.summary["scenario"] = {"name": sc.name, "seed": sc.seed, **sc.deployment,
                                  "cost_model": sc.cost_model.describe(),
                                  "scheduler": {k: getattr(sc.scheduler_config, k) for k in (
                                      "max_num_batched_tokens", "max_num_seqs", "max_model_len",
                                      "block_size", "enable_prefix_caching", "policy")}}
    if sim.rejections:
        result.summary["rejections"] = sim.rejections[:20]
    return result


__all__ = ["Scenario", "ScenarioError", "load_scenario", "parse_scenario", "run_scenario", "set_field", "parse_set", "settings", "setting_label",
           "MODELS", "DEVICES"]
