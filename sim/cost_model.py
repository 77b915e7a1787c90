"""Per-step cost models: predicted seconds for one engine step from its batch features.

Every model computes `step_time(features)` from the features of `engine.core.batch_features`
(the simulator calls it once per step, also for steady decode steps, so fast paths and plain
steps see the same times).

- FittedCostModel: a linear model with a convex piecewise-linear token term, fitted with
  non-negative least squares from profiled engine steps (calibration/), loaded from a profile
  JSON. Keeps residual quantiles for prediction intervals.
- AnalyticCostModel: a roofline over a model spec and a device spec (weights and KV bytes over
  bandwidth, FLOPs over peak), plus tensor-parallel all-reduce and per-step overheads; its
  efficiency factors can be fitted from a profile so it extrapolates to unprofiled devices/TP.
- KernelCostModel (sim/kernel_model.py): GEMM, attention and all-reduce times measured on real
  GPUs with vLLM's kernels, per layer, interpolated; the default on H100/H200/B200. A profile of
  kind "kernels" holds it reduced to one deployment (sim.kernel_model.cost_model_from_profile
  reads either kind).
"""
from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType

from engine.core.features import BatchFeatures
from sim.specs import WEIGHT_ONLY_4BIT, DeviceSpec, ModelSpec, get_device, get_model

PROFILE_FORMAT = "servetwin-profile/1"
PROFILES_DIR = Path(__file__).parent / "profiles"
_EMPTY: dict = MappingProxyType({})  # type: ignore[assignment]  # read-only, shared


class CostModel:
    """The cost-model protocol: every model the simulator runs is a CostModel, and callers read
    these members directly (no probing for optional abilities):

        step_time(f)            seconds of one engine step with batch features f
        decode_step_time        (n, ctx) -> step_time of a step of n decodes reading ctx KV tokens
                                and nothing else, without building features; None: not offered
        gpu_time_fn()           the GPU-only part of step_time, or None where the model's times
                                hold CPU work that cannot be told apart (a fitted engine profile)
        cpu_time_fn()           the model's own CPU work around a step, or None (CpuWork's)
        decode_gpu_time_fn(), decode_cpu_time_fn()   decode-only shortcuts of those two, or None
        async_scheduling        whether the CPU work of step n+1 overlaps step n (the replica
                                then admits an arrival during step n in step n+2)
        group_step_time(fs, n)  one step of n data-parallel ranks stepping together, rank i with
                                batch fs[i]: the slowest rank's step_time with the MoE layers
                                over the group's tokens (set_group_tokens; a wrapper passes it
                                on to the model it wraps, a model with no MoE notion ignores
                                it), each rank padded to the largest where dp_pads(tokens)
        residual_quantiles, noise_quantiles (and their _by_kind): empty unless fitted
        kind, metadata, describe()

    The base class implements step_time through `_time` on plain numbers."""

    kind = "base"
    metadata: dict
    async_scheduling = False
    decode_step_time: Callable[[int, int], float] | None = None
    residual_quantiles: dict = _EMPTY
    residual_quantiles_by_kind: dict = _EMPTY
    noise_quantiles: dict = _EMPTY
    noise_quantiles_by_kind: dict = _EMPTY

    def gpu_time_fn(self) -> Callable[[BatchFeatures], float] | None:
        return None

    def cpu_time_fn(self) -> Callable[[BatchFeatures], float] | None:
        return None

    def decode_gpu_time_fn(self) -> Callable[[int, int], float] | None:
        return None

    def decode_cpu_time_fn(self) -> Callable[[int, int], float] | None:
        return None

    def _time(self, num_reqs: int, num_tokens: int, num_prefill_reqs: int, prefill_pairs: int,
              prefill_ctx: int, decode_ctx: int) -> float:
        raise NotImplementedError

    def set_group_tokens(self, num_tokens: int | None) -> None:
        """The tokens of every data-parallel rank in the step being timed (their MoE layers run
        on all of them), or None: a single engine. Ignored by models with no MoE notion."""

    def dp_pads(self, num_tokens: int) -> bool:
        """Whether a data-parallel step whose largest rank has num_tokens runs in CUDA graphs, so
        that vLLM pads every rank to that count (vllm/v1/worker/dp_utils.py: the ranks agree on
        the smallest CUDA-graph mode and pad to the largest token count unless it is none).
        False here: a model with no CUDA-graph notion."""
        return False

    def group_step_time(self, features: list[BatchFeatures], ranks: int | None = None) -> float:
        """One step of `ranks` data-parallel ranks (default: one per batch; an idle rank runs a
        dummy batch), rank i with batch features[i]: the slowest rank's step_time with the MoE
        layers over the group's tokens, every rank padded to the largest one's count where
        dp_pads says so, else the ranks' own tokens summed."""
        tokens = [f.num_prefill_tokens + f.num_decode_reqs for f in features]
        top = max(tokens)
        n = max(ranks or 0, len(features))
        self.set_group_tokens(n * top if self.dp_pads(top) else sum(tokens))
        try:
            return max(self.step_time(f) for f in features)
        finally:
            self.set_group_tokens(None)

    def step_time(self, f: BatchFeatures) -> float:
        return self._time(f.num_reqs, f.num_prefill_tokens + f.num_decode_reqs, f.num_prefill_reqs,
                          f.prefill_attn_pairs, f.prefill_context_tokens, f.decode_context_tokens)

    def describe(self) -> dict:
        return {"kind": self.kind, **self.metadata}


@dataclass
class FittedCostModel(CostModel):
    """t = intercept + per_req*num_reqs + per_token*tokens + sum_j slope_j*max(0, tokens - knot_j)
         + sum_i rise_i*min(tokens, cap_i)
         + per_prefill_req*prefill_reqs + per_prefill_pair*pairs + per_prefill_ctx*prefill_ctx
         + per_decode_ctx*decode_ctx            (all coefficients >= 0, seconds)

    The hinges bend the token term up (GEMMs turning compute-bound); the saturating terms
    min(tokens, cap) bend it down at small token counts, where a CPU step with one token runs
    matrix-vector kernels and two or more run packed GEMMs (a step of 2 tokens costs far more
    than one, a step of 8 little more than 4)."""

    intercept_s: float = 0.0
    per_req_s: float = 0.0
    per_token_s: float = 0.0
    hinges: list[tuple[float, float]] = field(default_factory=list)  # (knot_tokens, extra slope)
    saturations: list[tuple[float, float]] = field(default_factory=list)  # (cap_tokens, slope below it)
    per_prefill_req_s: float = 0.0
    per_prefill_pair_s: float = 0.0
    per_prefill_ctx_s: float = 0.0
    per_decode_ctx_s: float = 0.0
    residual_quantiles: dict[str, float] = field(default_factory=dict)  # relative residuals
    # The same, per kind of step ("prefill": with a prefill chunk, "decode": decode only); empty
    # in profiles fitted before they were kept.
    residual_quantiles_by_kind: dict[str, dict[str, float]] = field(default_factory=dict)
    # The residuals with each sweep group's mean (per kind of step) taken out: a step's noise
    # around its regime (calibration.fit); empty in profiles fitted before they were kept.
    noise_quantiles: dict[str, float] = field(default_factory=dict)
    noise_quantiles_by_kind: dict[str, dict[str, float]] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    kind = "fitted"

    def _time(self, num_reqs, num_tokens, num_prefill_reqs, prefill_pairs, prefill_ctx, decode_ctx):
        t = self.intercept_s + self.per_req_s * num_reqs + self.per_token_s * num_tokens
        for knot, slope in self.hinges:
            if num_tokens > knot:
                t += slope * (num_tokens - knot)
        for cap, slope in self.saturations:
            t += slope * (num_tokens if num_tokens < cap else cap)
        return (t + self.per_prefill_req_s * num_prefill_reqs + self.per_prefill_pair_s * prefill_pairs
                + self.per_prefill_ctx_s * prefill_ctx + self.per_decode_ctx_s * decode_ctx)

    # ---------------------------------------------------------------- files
    def to_profile(self) -> dict:
        d = asdict(self)
        meta = d.pop("metadata")
        rq = d.pop("residual_quantiles")
        by_kind = d.pop("residual_quantiles_by_kind")
        noise, noise_by_kind = d.pop("noise_quantiles"), d.pop("noise_quantiles_by_kind")
        prof = {"format": PROFILE_FORMAT, "kind": "fitted", "metadata": meta,
                "coefficients": d, "residual_quantiles": rq}
        if by_kind:
            prof["residual_quantiles_by_kind"] = by_kind
        if noise:
            prof["noise_quantiles"] = noise
        if noise_by_kind:
            prof["noise_quantiles_by_kind"] = noise_by_kind
        return prof

    @classmethod
    def from_profile(cls, prof: dict) -> "FittedCostModel":
        c = dict(prof["coefficients"])
        c["hinges"] = [tuple(h) for h in c.get("hinges", [])]
        c["saturations"] = [tuple(h) for h in c.get("saturations", [])]
        return cls(**c, residual_quantiles=prof.get("residual_quantiles", {}),
                   residual_quantiles_by_kind=prof.get("residual_quantiles_by_kind", {}),
                   noise_quantiles=prof.get("noise_quantiles", {}),
                   noise_quantiles_by_kind=prof.get("noise_quantiles_by_kind", {}),
                   metadata=prof.get("metadata", {}))


# The chunk of the Gated DeltaNet's chunked prefill kernel (vLLM's fla chunk_gated_delta_rule: 64)
GDN_CHUNK = 64


@dataclass
class Efficiency:
    """Fractions of peak achieved (fit from a profile, or defaults from public measurements)."""

    bandwidth: float = 0.75      # weights and KV streaming
    flops: float = 0.55          # dense GEMMs at large token counts
    attention_flops: float = 0.35
    step_overhead_s: float = 0.002   # scheduler, input prep, sampling, launch per step
    per_req_overhead_s: float = 1.5e-5


class AnalyticCostModel(CostModel):
    kind = "analytic"

    def __init__(self, model: ModelSpec | str | dict, device: DeviceSpec | str | dict, tp: int = 1,
                 efficiency: Efficiency | dict | None = None) -> None:
        self.model = get_model(model)
        self.device = get_device(device)
        if tp < 1 or self.model.num_heads % tp:
            raise ValueError(f"deployment.tp={tp}: must be >= 1 and divide num_heads={self.model.num_heads}")
        self.tp = tp
        e = efficiency if isinstance(efficiency, Efficiency) else Efficiency(**(efficiency or {}))
        self.eff = e
        m, d = self.model, self.device
        # Weights streamed once per step: not the input embedding (a gather of a few rows), and
        # of a MoE model's routed experts only those the step's tokens touch (_moe_time).
        self._w_time = ((m.weight_read_bytes_per_gpu(tp) - m.expert_weight_bytes_per_gpu(tp))
                        / (d.mem_bandwidth * e.bandwidth))
        # Dense FLOPs per token: linear layers at their weight dtype's peak (fp8 tensor cores for
        # fp8 weights), the LM head at the activation dtype's (an upper bound: it runs per token
        # here, though only sampling rows need it).
        flop_s = sum(2 * layers * n * k / (d.peak_flops(dtype) * e.flops)
                     for _name, n, k, layers, dtype in m.step_gemms(tp))
        head = -(-m.vocab_size // tp) * m.hidden_size
        self._flop_time_per_token = flop_s + 2 * head / (d.peak_flops(m.act_dtype) * e.flops)
        # Routed experts: bytes of all of them on this GPU, FLOPs per token (top-k experts).
        self._expert_s = m.expert_weight_bytes_per_gpu(tp) / (d.mem_bandwidth * e.bandwidth)
        edt = m.expert_dtype or m.weight_dtype
        epeak = d.peak_flops("bfloat16" if edt in WEIGHT_ONLY_4BIT else edt)
        self._expert_flop_s = (2 * m.num_moe_layers * m.num_experts_per_tok
                               * sum(n * k for n, k in m.expert_gemms(tp).values()) / (epeak * e.flops)) if m.is_moe else 0.0
        widths = ((m.num_attention_layers - m.num_sliding_layers) * m.head_dim
                  + m.num_sliding_layers * m.attention_shape(sliding=True)[1])  # query-key widths, every layer
        self._attn_time_per_pair = 4 * m.num_heads * widths / tp / (d.flops * e.attention_flops)
        # KV bytes of this GPU's KV heads (replicated, not divided, when TP > KV heads).
        self._kv_time_per_token = m.kv_bytes_per_token_per_gpu(tp) / (d.mem_bandwidth * e.bandwidth)
        # Sliding-window layers read at most their window's tokens of each request
        self._sliding_kv_time_per_token = m.sliding_kv_bytes_per_token_per_gpu(tp) / (d.mem_bandwidth * e.bandwidth)
        # Linear-attention layers (Gated DeltaNet, Mamba-2): every request of a step reads and
        # writes its fixed state once (conv window and a k x v matrix per value head, per layer),
        # and each token costs the state's products both ways (2 k x v multiply-adds per value
        # head) and the chunked form's intra-chunk terms (GDN_CHUNK tokens of k and v), as the
        # kernel model's roofline (sim.kernel_model._gdn_ctx_roof) counts them.
        self._state_time_per_req = 2 * m.linear_state_bytes_per_request_per_gpu(tp) / (d.mem_bandwidth * e.bandwidth)
        dk, dv = m.linear_k_head_dim, m.linear_v_head_dim
        self._linear_time_per_token = (m.num_linear_layers * (m.linear_num_v_heads // tp)
                                       * (4 * dk * dv + 2 * GDN_CHUNK * (dk + dv)) / (d.flops * e.attention_flops))
        if tp > 1:
            ring = 2 * (tp - 1) / tp
            ars = m.num_sublayers  # an all-reduce after each mixer and each MLP
            self._comm_fixed = ars * d.interconnect_latency_s
            self._comm_per_token = ars * ring * m.hidden_size * m.act_dtype_bytes / d.interconnect_bandwidth
        else:
            self._comm_fixed = self._comm_per_token = 0.0
        self.metadata = {"model": m.name, "device": d.name, "tp": tp, "dtype": m.weight_dtype,
                         "weight_dtype": m.weight_dtype, "kv_dtype": m.kv_dtype, "act_dtype": m.act_dtype,
                         "efficiency": asdict(e), "source": "analytic roofline"}

    def gpu_time_fn(self) -> Callable[[BatchFeatures], float]:
        """step_time less the per-step and per-request overheads (the CPU-work stand-ins of
        Efficiency), which CpuWork replaces when the model is wrapped."""
        eff = self.eff

        def gpu(f: BatchFeatures) -> float:
            t = self.step_time(f)
            if t == 0.0:
                return 0.0
            return max(0.0, t - eff.step_overhead_s - eff.per_req_overhead_s * f.num_reqs)
        return gpu

    def _time(self, num_reqs, num_tokens, num_prefill_reqs, prefill_pairs, prefill_ctx, decode_ctx):
        if num_tokens == 0:
            return 0.0
        lin = max(self._w_time, self._flop_time_per_token * num_tokens)
        if self._expert_s:
            m = self.model
            lin += max(self._expert_s * m.experts_touched(num_tokens) / m.num_experts,
                       self._expert_flop_s * num_tokens)
        if self.model.compressed_mqa:  # (DeepSeek-V4: a query reads its window and picked entries at most)
            prefill_pairs = min(prefill_pairs, num_tokens * (self.model.sliding_window + self.model.index_topk))
        attn = self._attn_time_per_pair * prefill_pairs + self._kv_time_per_token * (decode_ctx + prefill_ctx)
        if self._sliding_kv_time_per_token:  # (at most the window's tokens of each request)
            attn += self._sliding_kv_time_per_token * min(decode_ctx + prefill_ctx, num_reqs * self.model.sliding_window)
        if self._state_time_per_req:
            attn += self._state_time_per_req * num_reqs + self._linear_time_per_token * num_tokens
        comm = self._comm_fixed + self._comm_per_token * num_tokens
        return self.eff.step_overhead_s + self.eff.per_req_overhead_s * num_reqs + lin + attn + comm


# -------------------------------------------------------------------- loading
def load_profile(name_or_path: str | Path) -> dict:
    p = Path(name_or_path)
    if not str(name_or_path).endswith(".json"):  # a shipped profile's name
        p = PROFILES_DIR / f"{name_or_path}.json"
    if not p.exists():
        known = sorted(x.stem for x in PROFILES_DIR.glob("*.json"))
        raise ValueError(f"cost_model.profile={str(name_or_path)!r}: no such profile file; shipped: {known}")
    try:
        with open(p) as f:
            prof = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"cost_model.profile={str(p)!r}: not valid JSON ({e})") from None
    check_profile(prof, str(p))
    return prof


_COEFFICIENTS = {f.name for f in fields(FittedCostModel)} - {"residual_quantiles", "residual_quantiles_by_kind",
                                                              "noise_quantiles", "noise_quantiles_by_kind",
                                                              "metadata"}
STEP_KINDS = ("prefill", "decode")  # residual_quantiles_by_kind: steps with a prefill chunk, decode-only steps


def check_profile(prof, where: str) -> None:
    """ValueError naming the field for a profile that is not a fitted profile of this format."""
    def bad(field_name: str, value, why: str):
        raise ValueError(f"cost_model.profile={where!r}: {field_name}={value!r}: {why}")

    if not isinstance(prof, dict):
        bad("(top level)", type(prof).__name__, "a profile is a JSON object")
    if prof.get("format") != PROFILE_FORMAT:
        bad("format", prof.get("format"), f"expected {PROFILE_FORMAT!r}")
    if prof.get("kind") not in ("fitted", "kernels"):
        bad("kind", prof.get("kind"), "expected 'fitted' or 'kernels'")
    if prof["kind"] == "kernels":
        for key in ("metadata", "reduced_tables"):
            if not isinstance(prof.get(key), dict):
                bad(key, prof.get(key), "missing, or not an object")
        for key in ("model_spec", "device_spec", "tp"):
            if key not in prof["metadata"]:
                bad(f"metadata.{key}", None, "required in a kernels profile")
        return
    for key in ("metadata", "coefficients"):
        if not isinstance(prof.get(key), dict):
            bad(key, prof.get(key), "missing, or not an object")
    for k, v in prof["coefficients"].items():
        if k not in _COEFFICIENTS:
            bad(f"coefficients.{k}", v, f"unknown coefficient; known: {sorted(_COEFFICIENTS)}")
        if k in ("hinges", "saturations"):
            if not isinstance(v, list) or not all(isinstance(h, list) and len(h) == 2 and
                                                  all(_number(x) and x >= 0 for x in h) for h in v):
                what = "knot_tokens" if k == "hinges" else "cap_tokens"
                bad(f"coefficients.{k}", v, f"a list of [{what}, slope_s] pairs of numbers >= 0")
        elif not _number(v) or v < 0:
            bad(f"coefficients.{k}", v, "must be a number >= 0 (seconds)")
    for name in ("residual_quantiles", "noise_quantiles"):
        rq = prof.get(name, {})
        if not isinstance(rq, dict) or not all(_number(x) for x in rq.values()):
            bad(name, rq, "an object of quantile name -> number")
        by_kind = prof.get(f"{name}_by_kind", {})
        if not isinstance(by_kind, dict):
            bad(f"{name}_by_kind", by_kind, f"an object of step kind ({', '.join(STEP_KINDS)}) -> quantiles")
        for k, q in by_kind.items():
            if k not in STEP_KINDS:
                bad(f"{name}_by_kind.{k}", q, f"unknown step kind; known: {list(STEP_KINDS)}")
            if not isinstance(q, dict) or not all(_number(x) for x in q.values()):
                bad(f"{name}_by_kind.{k}", q, "an object of quantile name -> number")
    for key in ("model", "device"):
        if key in prof["metadata"] and not isinstance(prof["metadata"][key], str):
            bad(f"metadata.{key}", prof["metadata"][key], "must be a string")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def today() -> str:
    return _dt.date.today().isoformat()
