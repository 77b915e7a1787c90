"""CPU work around a GPU step, and asynchronous scheduling.

A served engine step is GPU work (the forward and sampling kernels) plus CPU work in the engine
process: scheduling, input preparation (token ids, positions, slot mapping, block tables),
launching the (CUDA-graph) forward, and turning the sampled ids into per-request outputs.

    synchronous  (the shared scheduler, engine.core):  period = cpu + gpu
    asynchronous (vLLM's GPU default, --async-scheduling): step n+1 is scheduled and its inputs
                 prepared while the GPU runs step n, so   period = max(cpu, gpu)

`WithCpuWork` wraps any cost model whose GPU time it can tell apart (see `gpu_time_fn`) and
is itself a cost model: the replica's plain steps and the scheduler's steady runs both call its
`step_time`, so both see the same periods. Async never makes a step slower: max(c, g) <= c + g.

Admission follows too (sim/replica.py, `Replica.async_admission`, on when the cost model says
`async_scheduling`): a request that reaches the engine while step n runs misses step n+1, which
was scheduled as n started, and first runs in step n+2; an idle engine takes it at once.

API-server work (HTTP, tokenization, detokenization + SSE) happens in the front-end process, not
in the engine step: sim/clients.py adds it to each request's client-visible times.

Default values: vLLM V1 on an H100/H200 host (Sapphire Rapids / Genoa class CPU). They are
order-of-magnitude figures from public profiles, not fits to any serving benchmark:
  - vLLM's v0.6.0 performance post (blog.vllm.ai, 2024-09-05) measured CPU work (API server and
    scheduling) at over half of a Llama-3-8B H100 decode step before V1; V1 (blog, 2025-01-27)
    moved the API server to its own process and cut scheduling/input preparation to around a
    millisecond per step with a persistent batch.
  - async scheduling hides that CPU time: vllm-ascend's async-scheduling PR reports Qwen3-32B
    TP4, 48 concurrent requests, TPOT 44.2 ms (sync) -> 41.9 ms (async), i.e. ~2.3 ms of CPU per
    step at 48 requests, the order of step_s + 48 * per_req_s below.
  - per-request cost: scheduler + input preparation + output processing (update_from_output,
    output serialisation to the front end) are Python loops over requests, ~10-30 us each.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

from engine.core.features import BatchFeatures
from sim.cost_model import CostModel


@dataclass(frozen=True)
class CpuWork:
    """Engine-process CPU seconds of one step (schedule + prepare inputs + process outputs)."""

    step_s: float = 1.0e-3         # fixed: scheduler call, persistent-batch update, graph launch
    per_req_s: float = 2.0e-5      # per scheduled request (schedule, block table, outputs)
    per_token_s: float = 5.0e-8    # per scheduled token (ids, positions, slot mapping in numpy)
    # Per sampled token when the API server shares the engine's CPU (a single-process front end,
    # e.g. vLLM V0 or --api-server-count 0 setups); 0 with V1's separate front-end process.
    per_output_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ValueError(f"scheduler.cpu_work.{f.name}={v!r}: must be a number >= 0 (seconds)")

    def time(self, f: BatchFeatures) -> float:
        if f.num_reqs == 0:
            return 0.0
        tokens = f.num_prefill_tokens + f.num_decode_reqs
        outputs = f.num_decode_reqs + f.num_prefill_reqs  # upper bound: last chunks sample
        return (self.step_s + self.per_req_s * f.num_reqs + self.per_token_s * tokens
                + self.per_output_s * outputs)


def gpu_time_fn(model: CostModel) -> Callable[[BatchFeatures], float]:
    """The GPU-only step time of a cost model (its `gpu_time_fn()`: kernel tables' gpu_time, the
    analytic roofline less its overhead terms), or ValueError when its times include CPU work
    that cannot be told apart (a fitted profile measured on the engine: its periods already hold
    the engine's synchronous CPU work, so neither CPU work nor async scheduling can be added)."""
    fn = model.gpu_time_fn()
    if fn is not None:
        return fn
    raise ValueError(
        f"cost model {model.kind!r} times whole engine steps "
        "(its CPU work is inside them): scheduler.cpu_work / scheduler.async_scheduling need a "
        "cost model with a GPU-only time (analytic, or kernel tables)")


class WithCpuWork(CostModel):
    """A cost model: the wrapped model's GPU time combined with CPU work.

    The CPU work is `cpu` when given, else the wrapped model's own `cpu_time(features)` if it
    has one (kernel tables carry their per-step overheads), else CpuWork()'s defaults."""

    kind = "cpu+gpu"

    def __init__(self, base, cpu: CpuWork | None = None, async_scheduling: bool = True) -> None:
        self.base = base
        self.cpu = cpu
        self.async_scheduling = bool(async_scheduling)
        self._gpu = gpu_time_fn(base)
        own_cpu = base.cpu_time_fn()
        if cpu is not None:
            self._cpu = cpu.time
        elif own_cpu is not None:
            self._cpu = own_cpu
        else:
            self.cpu = CpuWork()
            self._cpu = self.cpu.time
        self.kind = base.kind
        self.metadata = dict(base.metadata)
        # decode_step_time(n, ctx), the fast steps' shortcut for a decode-only step: where the
        # base has one for its GPU time (kernel tables) and the CPU work of such a step depends
        # on n alone (CpuWork, or the base's own default), else step_time(features) is used.
        gpu_decode = base.decode_gpu_time_fn()
        if cpu is not None:
            cpu_decode = self._cpu_decode
        else:
            cpu_decode = base.decode_cpu_time_fn() if own_cpu is not None else None
        if gpu_decode is not None and cpu_decode is not None:
            self._gpu_decode, self._cpu_decode_of = gpu_decode, cpu_decode
            self._memo_c: dict[int, float] = {}
            self.decode_step_time = self._decode_step_time

    def _cpu_decode(self, n: int, ctx: int) -> float:
        c = self._memo_c.get(n)
        if c is None:
            c = self._memo_c[n] = self.cpu.time(BatchFeatures(num_reqs=n, num_decode_reqs=n))
        return c

    def _decode_step_time(self, n: int, ctx: int) -> float:
        """step_time of a step of n decodes reading ctx KV tokens, without building its features."""
        g = self._gpu_decode(n, ctx)
        c = self._cpu_decode_of(n, ctx)
        return (c if c > g else g) if self.async_scheduling else c + g

    @property
    def residual_quantiles(self) -> dict:
        return self.base.residual_quantiles

    @property
    def residual_quantiles_by_kind(self) -> dict:
        return self.base.residual_quantiles_by_kind

    @property
    def noise_quantiles(self) -> dict:
        return self.base.noise_quantiles

    @property
    def noise_quantiles_by_kind(self) -> dict:
        return self.base.noise_quantiles_by_kind

    def gpu_time_fn(self) -> Callable[[BatchFeatures], float]:
        return self.gpu_time

    def cpu_time_fn(self) -> Callable[[BatchFeatures], float]:
        return self.cpu_time

    def set_group_tokens(self, num_tokens: int | None) -> None:
        self.base.set_group_tokens(num_tokens)

    def dp_pads(self, num_tokens: int) -> bool:
        return self.base.dp_pads(num_tokens)

    def gpu_time(self, f: BatchFeatures) -> float:
        return self._gpu(f)

    def cpu_time(self, f: BatchFeatures) -> float:
        return self._cpu(f)

    def step_time(self, f: BatchFeatures) -> float:
        if f.num_reqs == 0:
            return 0.0
        g = self._gpu(f)
        c = self._cpu(f)
        return (c if c > g else g) if self.async_scheduling else c + g

    def describe(self) -> dict:
        cpu = asdict(self.cpu) if self.cpu is not None else "the cost model's own cpu_time"
        return {**self.base.describe(), "cpu_work": cpu, "async_scheduling": self.async_scheduling}


@dataclass(frozen=True)
class TimingSettings:
    """How a deployment's step period is composed from its cost model: the scenario's
    `scheduler.async_scheduling` (None: not given) and `scheduler.cpu_work` (None: not given)."""

    async_scheduling: bool | None = None
    cpu: CpuWork | None = None


def timing_model(cost, settings: TimingSettings):
    """The one place a pool's step time is composed: the cost model's GPU time with CPU work and
    async scheduling (WithCpuWork), for every pool of a deployment (aggregated replicas, P/D
    prefill and decode pools) alike.

    async_scheduling defaults to vLLM's GPU default (true) for a cost model with a GPU-only time
    and CPU work of its own (`cpu_time_fn()`, e.g. kernel tables); other models keep their own step times unless asked
    (the analytic roofline then trades its overhead terms for this CPU work; a fitted profile
    measured on the engine cannot separate them and is refused with ValueError)."""
    given = settings.async_scheduling is not None
    if not (given or settings.cpu is not None or cost.cpu_time_fn() is not None):
        return cost
    return WithCpuWork(cost, settings.cpu, settings.async_scheduling if given else True)


def timing_settings(sc) -> TimingSettings:
    """`scheduler.async_scheduling` / `scheduler.cpu_work` of a scenario (sc: its SpecMap)."""
    async_ = sc.boolean("async_scheduling") if sc.has("async_scheduling") else None
    cm = sc.sub("cpu_work")
    cpu = None
    if cm is not None:
        cpu = CpuWork(**{f.name: cm.number(f.name, getattr(CpuWork, f.name), ge=0)
                         for f in fields(CpuWork)})
        cm.done()
    return TimingSettings(async_, cpu)


def with_cpu_work(sc, cost):
    """`timing_model` with the settings of a scenario's `scheduler:` mapping (sc: its SpecMap);
    a cost model that cannot take them is refused naming the key. cpu_work: {step_s, per_req_s,
    per_token_s, per_output_s} (seconds; CpuWork's defaults for keys not given; when absent, a
    model's own cpu_time is used if it has one)."""
    settings = timing_settings(sc)
    try:
        return timing_model(cost, settings)
    except ValueError as e:
        key = "async_scheduling" if settings.async_scheduling is not None else "cpu_work"
        raise sc.error(f"scheduler.{key}: {e}") from None


__all__ = ["CpuWork", "TimingSettings", "WithCpuWork", "gpu_time_fn", "timing_model", "timing_settings",
           "with_cpu_work"]
