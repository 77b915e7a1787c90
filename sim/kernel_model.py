"""Step times from kernel times measured on real GPUs (NVIDIA AIConfigurator's vLLM tables,
converted by calibration/convert_kernel_tables.py into calibration/kernels/<gpu>.json).

One step of a dense decoder on one GPU of a TP group is, per layer:
    qkv, o_proj, gate_up, down GEMMs      M = tokens in the step, (N, K) from shape and TP
    attention                              prefill chunks (batch x length with the same
                                           query-key pairs) + decodes (batch x mean KV length)
    elementwise kernels                    2 RMSNorm(+residual), RoPE, KV write, SiLU*mul (+ q/k
                                           norms for Qwen3): max(launch latency, bytes / bandwidth)
    2 all-reduces when TP > 1              message = tokens x hidden (bf16), by TP size
and once per step: the embedding gather and its all-reduce, the LM head GEMM and sampling over
the rows that sample, and the CPU work around the step (a simple hook; see `cpu_time`).

Each measured term is interpolated in log-log space between measured points. Points the table
lacks (holes, or queries beyond its edges) take the roofline of that kernel scaled to the
nearest measured point; such lookups are counted in `fallbacks` (and warned about once), never
silent. A model whose heads or dtype have no table at all uses the roofline for that term (also
counted). The model is reduced at construction to small per-deployment tables (GEMMs of one
layer vs M, attention vs batch and length, all-reduce vs tokens), which a profile file stores.
"""
from __future__ import annotations

import bisect
import json
import math
import warnings
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from engine.core.features import BatchFeatures
from sim.cost_model import GDN_CHUNK, PROFILE_FORMAT, CostModel, FittedCostModel
from sim.specs import (DTYPE_BYTES, EXPERT_DTYPE_BYTES, FP8, INDEXER_GEMMS, INT4, WEIGHT_ONLY_4BIT, DeviceSpec, ModelSpec, get_device, get_model,
                       vllm_version_tuple)
from sim.sampling import filter_cost_s, filter_implementation, filters as sampling_filters

KERNELS_DIR = Path(__file__).resolve().parent.parent / "calibration" / "kernels"
KV_NAMES = {"bfloat16": "bf16", "float16": "bf16", "fp8": "fp8"}
GEMM_NAMES = {"bfloat16": "bf16", "float16": "bf16", "fp8": "fp8", "fp8_block": "fp8_block", "nvfp4": "nvfp4"}
# GEMMs of a few columns or rows, often outside the tables' N or K axis (the router; a linear-attention
# layer's decay and step sizes, and KDA's rank-head_dim gate up projections; the sparse-attention
# indexer's key, head weights and key-pool gate): their roofline is not counted as a fallback of the
# layer, it is a few percent of it at most
UNCOUNTED_GEMMS = ("router", "in_proj_ba", "kda_f_b", "kda_g_b", "index_k", "index_weights", "index_gate")


@lru_cache(maxsize=8)
def load_tables(name: str) -> dict:
    p = KERNELS_DIR / f"{name}.json"
    if not p.exists():
        raise ValueError(f"cost_model: no kernel tables {p.name} in {KERNELS_DIR}")
    with open(p) as f:
        return json.load(f)


def suffix_min(t: np.ndarray) -> np.ndarray:
    """Each entry replaced by the minimum over entries at or above it on every axis."""
    out = np.array(t, dtype=float)
    for ax in range(out.ndim):
        out = np.flip(np.minimum.accumulate(np.flip(out, ax), axis=ax), ax)
    return out


class Grid:
    """A measured table over log-spaced axes: multilinear interpolation of log(time) in
    log(axes). Holes are filled once, from the nearest measured point scaled by the roofline;
    queries past an edge take the edge value scaled by the roofline. Either is a fallback.

    `monotone` (the default): more work never takes less time. Every axis counts work (tokens,
    batch, context, message size), and a kernel given less can always do what it does with more
    (padding), so each entry is lowered to the least time measured at or above it on every axis
    (a suffix minimum per axis). This removes measured inversions such as an all-reduce whose
    measured time drops 34% from 256K to 512K elements (b200_sxm, 8 GPUs: an algorithm switch
    in the benchmarked build) without touching monotone data."""

    def __init__(self, values: list[list[float]], us, roofline: Callable[..., float] | None,
                 measured=None, monotone: bool = True) -> None:
        self.values = [list(map(float, v)) for v in values]
        self.logs = [[math.log(x) for x in v] for v in self.values]
        t = np.array(us, dtype=float)
        have = np.isfinite(t) & (t > 0)
        ok = have if measured is None else np.asarray(measured, dtype=bool) & have
        if not have.any():
            raise ValueError("kernel table without a value")
        self.roofline = roofline
        if not have.all():
            if roofline is None:
                raise ValueError("kernel table with holes needs a roofline to fill them")
            pts = np.argwhere(have)
            logpos = [np.array(lg) for lg in self.logs]
            coords = np.stack([logpos[d][pts[:, d]] for d in range(len(self.logs))], axis=1)
            for idx in np.argwhere(~have):
                q = np.array([logpos[d][i] for d, i in enumerate(idx)])
                j = int(np.argmin(((coords - q) ** 2).sum(axis=1)))
                src = tuple(pts[j])
                qv = [self.values[d][i] for d, i in enumerate(idx)]
                sv = [self.values[d][i] for d, i in enumerate(src)]
                t[tuple(idx)] = t[src] * roofline(*qv) / roofline(*sv)
        if monotone:
            t = suffix_min(t)
        self.us = t
        self.logt = np.log(t)
        self.measured = ok
        # Plain-Python copies for the 1-D and 2-D lookups a simulated step makes (numpy scalar
        # indexing costs more than the arithmetic): log times, and per cell whether all its
        # corners were measured. The first axis's position is memoised per query value (a
        # decode run asks for one batch size at many lengths).
        self._fast = None
        if self.logt.ndim in (1, 2) and all(len(v) > 1 for v in self.values):
            self._L = self.logt.tolist()
            if self.logt.ndim == 1:
                self._cell_ok = (ok[:-1] & ok[1:]).tolist()
            else:
                self._cell_ok = (ok[:-1, :-1] & ok[1:, :-1] & ok[:-1, 1:] & ok[1:, 1:]).tolist()
            self._pos0: dict = {}
            self._rows: dict = {}
            self._fast = self._call1 if self.logt.ndim == 1 else self._call2
            # The last axis, for on_row's inlined copy of _axis (the hottest lookup of a run).
            v = self.values[-1]
            self._vy, self._lgy, self._ylo, self._yhi, self._ylast = v, self.logs[-1], v[0], v[-1], len(v) - 2

    def _axis(self, d: int, x: float) -> tuple[float, int, float]:
        """(clamped x, lower index, fraction in log space) on axis d."""
        v, lg = self.values[d], self.logs[d]
        xc = min(max(x, v[0]), v[-1])
        i = min(max(bisect.bisect_right(v, xc) - 1, 0), len(v) - 2)
        return xc, i, (math.log(xc) - lg[i]) / (lg[i + 1] - lg[i])

    def _first(self, x: float) -> tuple[float, int, float]:
        """_axis(0, x), memoised per query value."""
        p = self._pos0.get(x)
        if p is None:
            p = self._axis(0, x)
            if len(self._pos0) < 65536:
                self._pos0[x] = p
        return p

    def _call1(self, x: float) -> tuple[float, bool]:
        xc, i, f = self._first(x)
        L = self._L
        acc = 0.0
        acc += (1.0 - f) * L[i]
        acc += f * L[i + 1]
        exact = xc == x and (self._cell_ok[i] or self._corners_measured((i,), (f,)))
        t = math.exp(acc)
        if xc != x and self.roofline is not None:
            t *= self.roofline(x) / self.roofline(xc)
        return t, exact

    def row(self, x: float) -> tuple:
        """A 2-D table with its first axis resolved at x (for on_row), memoised per x: a run of
        decode steps asks for one batch size at many context lengths."""
        r = self._rows.get(x)
        if r is None:
            xc, i, f = self._axis(0, x)
            r = (xc, i, f, self._L[i], self._L[i + 1], self._cell_ok[i])
            if len(self._rows) < 65536:
                self._rows[x] = r
        return r

    def _call2(self, x: float, y: float) -> tuple[float, bool]:
        return self.on_row(self.row(x), x, y)

    def on_row(self, row: tuple, x: float, y: float) -> tuple[float, bool]:
        """__call__(x, y) of a 2-D table, its first axis resolved by row(x)."""
        xc, i, f, a, b, cell_ok = row
        # self._axis(1, y), inlined: the same clamping, cell and fraction, to the bit.
        yc = y
        if yc < self._ylo:
            yc = self._ylo
        elif yc > self._yhi:
            yc = self._yhi
        j = bisect.bisect_right(self._vy, yc) - 1
        if j < 0:
            j = 0
        elif j > self._ylast:
            j = self._ylast
        lg = self._lgy
        g = (math.log(yc) - lg[j]) / (lg[j + 1] - lg[j])
        acc = 0.0  # the corners in __call__'s order, so the result is the same to the bit
        acc += ((1.0 - f) * (1.0 - g)) * a[j]
        acc += (f * (1.0 - g)) * b[j]
        acc += ((1.0 - f) * g) * a[j + 1]
        acc += (f * g) * b[j + 1]
        exact = xc == x and yc == y and (cell_ok[j] or self._corners_measured((i, j), (f, g)))
        t = math.exp(acc)
        if (xc != x or yc != y) and self.roofline is not None:
            t *= self.roofline(x, y) / self.roofline(xc, yc)
        return t, exact

    def _corners_measured(self, lo: tuple, fr: tuple) -> bool:
        """Whether every corner that carries weight was measured."""
        nd = len(lo)
        for corner in range(1 << nd):
            idx = []
            for d in range(nd):
                up = (corner >> d) & 1
                if (fr[d] if up else 1.0 - fr[d]) == 0.0:
                    break
                idx.append(lo[d] + up)
            else:
                if not self.measured[tuple(idx)]:
                    return False
        return True

    def __call__(self, *q: float) -> tuple[float, bool]:
        """(microseconds, exact): exact when every point used was measured and q is inside."""
        if self._fast is not None:
            return self._fast(*q)
        exact = True
        clamped = []
        lo_idx, fr = [], []
        for x, v, lg in zip(q, self.values, self.logs):
            xc = min(max(x, v[0]), v[-1])
            if xc != x:
                exact = False
            clamped.append(xc)
            if len(v) == 1:
                lo_idx.append(0)
                fr.append(0.0)
                continue
            i = min(max(bisect.bisect_right(v, xc) - 1, 0), len(v) - 2)
            lo_idx.append(i)
            fr.append((math.log(xc) - lg[i]) / (lg[i + 1] - lg[i]))
        acc = 0.0
        nd = len(q)
        for corner in range(1 << nd):
            w = 1.0
            idx = []
            for d in range(nd):
                up = (corner >> d) & 1
                f = fr[d]
                if up and (len(self.values[d]) == 1):
                    w = 0.0
                    break
                w *= f if up else 1.0 - f
                idx.append(lo_idx[d] + up)
            if w == 0.0:
                continue
            idx = tuple(idx)
            acc += w * self.logt[idx]
            if not self.measured[idx]:
                exact = False
        t = math.exp(acc)
        if clamped != list(q) and self.roofline is not None:
            t *= self.roofline(*q) / self.roofline(*clamped)
        return t, exact

    def to_json(self) -> dict:
        return {"values": self.values, "us": [float(f"{x:.4g}") for x in self.us.ravel()],
                "shape": list(self.us.shape), "measured": [int(x) for x in self.measured.ravel()]}

    @classmethod
    def from_json(cls, d: dict, roofline=None) -> "Grid":
        shape = d["shape"]
        return cls(d["values"], np.array(d["us"], dtype=float).reshape(shape), roofline,
                   np.array(d["measured"], dtype=bool).reshape(shape))


@dataclass
class Overheads:
    """GPU-side terms the kernel tables do not measure (seconds). CPU work of the engine loop is
    not here: see `cpu_time`.

    - sampler_s: greedy sampling, logits to fp32 and a step's input/output copies, an
      order-of-magnitude figure (~50-100 us), not fitted. Top-k/top-p filtering, where the
      release sorts the vocabulary, is added per step by sim.sampling (KernelCostModel.set_sampling).
    - elementwise_latency_s: one small kernel inside a CUDA graph, end to end (~1-3 us).
    - cudagraph_max_tokens, eager_layer_launch_s: a step with a prefill chunk and more tokens
      than vLLM captures in CUDA graphs (max_cudagraph_capture_size, 512 by default) runs its
      compiled forward without a graph. The host then launches every kernel of every layer, and
      the GPU cannot finish the step before the last launch, so such a step takes at least
      num_layers x eager_layer_launch_s. Without this floor, a 1k-token prefill of Llama-3.1-70B
      at TP8 costs its kernels alone (~10 ms), and TTFT at TP4/TP8 came out half of what vLLM
      serves. AIConfigurator's vLLM backend adds a per-request dispatch cost of 0.8 ms per layer
      for the same reason. Such a step's layer all-reduces (decode-only ones too) are read from
      the eager all-reduce table, not the graph one (KernelCostModel._by_tokens); the logits
      gather keeps the graph table, and each data-parallel rank decides by its own tokens.
      Decode-only steps past the graph sizes (more than 512 running requests) are not floored:
      the figure was fitted on prefill steps, and no data here says what a graph-less decode
      step costs on the host.

    - serving_slowdown: the kernels' time in serving over their micro-benchmark time (1: as
      measured).
    - gemm_compute_slowdown: compute-bound GEMMs (M >= 1024 tokens; log-linear from 1 at M = 64)
      take this much longer than the GEMM tables say (grouped MoE GEMMs and prefill attention
      too, see below). 1.13, measured on an H200
      (docs/reports/2026-12-04-h200.md): `bench/gpu_kernel_check.py`, 32 cuBLAS bf16 GEMMs back
      to back per sample over Llama-3.1-8B and 70B-TP8 layers, gives table / measured 0.87 in the
      median at M >= 1024 (0.79-0.97), and `bench/gpu_sustained_check.py` shows the card at its
      700 W cap 2-3% slower after 20 s than in its first step. The fp8 tables could not be
      checked that way (vLLM's fp8 kernels are not torch's per-tensor `_scaled_mm`); the factor
      applies to every dtype, as the tables of all dtypes were measured the same way. On the
      allowed B200 rows (`bench/silicon_check.py --backend vllm --system b200_sxm`) it takes
      Llama-3.1-70B fp8's TTFT from -12.8% to -8.0% in the median (|error| 13.9% -> 9.1%, TPOT
      unchanged) and MiniMax-M2.5's from -26.4% to -25.7%; the published H100 runs
      (`bench/gpu_runs.py`) move by 0.2 points or less.
      The same clocks hold every compute-bound kernel of a large step, so the factor also scales
      the routed experts' fused-MoE tables (by the step's tokens T, as a dense GEMM's M) and the
      prefill attention (by its b x s query rows). It was not refitted for that. On the same B200
      rows (MiniMax-M2.5 then on the generic recipe, before InferenceX#947's script was given to
      its rows) that takes the MoE models' median TTFT error from -21.7% to -16.0% (MiniMax-M2.5),
      -26.1% to -22.5% (gpt-oss-120b) and -14.7% to -7.9% (Kimi-K2.5), and Llama-3.1-70B's from
      -8.0% to -7.6%; TPOT by at most two points (MiniMax-M2.5 -5.2% -> -3.6%); the H100 runs'
      leave-one-run-out errors move by less than 0.1 point.
      A GPU's own value (DeviceSpec.gemm_compute_slowdown) replaces the default unless the
      scenario sets this key or the caller passes an Overheads instance (taken as it is): B200's
      is 1.25, chosen on its Llama-3.1-70B rows (sim.specs).
    - dp_dispatch_s: per MoE layer and step under data-parallel attention, the dispatch and
      combine beyond their bytes over the link (KernelCostModel._dispatch_roof) and the link's two
      latencies: the ranks' per-step synchronisation. 0 by default. Chosen among 0 / 15 / 30 us on
      the allowed vLLM rows with attention DP (`bench/silicon_check.py`: MiniMax-M2.5, DP 2 and 4,
      each at its client's concurrency, batch_size x dp, on InferenceX#947's script, with every
      rank padded as vLLM pads it: CostModel.group_step_time), the value whose median TPOT error
      is nearest the same model's rows without DP: on B200's 23 rows -6.0% / +0.5% / +4.7% at DP 2
      and -6.1% / +1.3% / +7.1% at DP 4, against -3.2% without DP; on B300's 5, +0.4% / +2.1% /
      +3.9% and +2.5% / +5.9% / +9.3%, against -4.3%. (It was 60 us while those rows ran at
      batch_size alone, a dp-th of their clients' concurrency; 0 was kept before the padding, on
      the generic recipe.)
    - moe_routing_s: per MoE layer and step, the routing kernel (the gate's logits to top-k ids
      and weights: softmax or sigmoid with its bias, top-k and renormalisation in one CUDA kernel,
      vLLM's topk_softmax, topk_sigmoid or grouped_topk, from 0.15 on), where the experts' reading
      leaves it out: the fused-MoE tables of AIConfigurator's earlier collector (kernel
      `vllm_fused_moe`: A100's and B200's Triton tables), which timed fused_experts on precomputed
      top-k ids, and the GEMM estimate of a MoE layer no table holds. The other tables were
      measured through vLLM's FusedMoE layer on router logits, routing included. 4 us, vLLM
      PR #34206's measurement of its grouped top-k kernel on an H200 (about 4 us for the
      small-expert-count variant, 7 us for the generic one), not fitted.
    - tp_step_s: per step and per GPU of a TP group beyond the first, coordination that no kernel
      table holds. 0 by default: stock vLLM shows none beyond its kernels (the allowed B200 rows
      of `bench/silicon_check.py`, TP 1-8, lose their TPOT accuracy with any: +60% at TP 8 with
      0.6 ms). The published H100 runs of ../shared/gpu-runs, served by a vLLM build with
      per-step tracing, do pay one: 0.3 ms there (bench/gpu_runs.py sets it for them).

    elementwise_latency_s (1.5 us) and eager_layer_launch_s (1.0 ms) were chosen against the
    allowed vLLM B200 serving rows (`python bench/silicon_check.py --backend vllm --system
    b200_sxm`; the sweep is in docs/reports/2026-12-02-measurements.md), never against the held-out
    vLLM H100/H200 rows.
    The 0.3 ms of tp_step_s for the traced build was fitted on its 11 published H100 runs
    (`python bench/gpu_runs.py --loro` refits it without each run and reports that run's error)."""

    elementwise_latency_s: float = 1.5e-6
    sampler_s: float = 6.0e-5
    cudagraph_max_tokens: int = 512
    eager_layer_launch_s: float = 1.0e-3
    serving_slowdown: float = 1.0
    tp_step_s: float = 0.0
    dp_dispatch_s: float = 0.0
    gemm_compute_slowdown: float = 1.13
    moe_routing_s: float = 4.0e-6

    def gemm_factor(self, m: float) -> float:
        """gemm_compute_slowdown at M >= 1024 tokens, 1 at M <= 64, log-linear between."""
        s = self.gemm_compute_slowdown
        if s == 1.0 or m <= 64:
            return 1.0
        return 1.0 + (s - 1.0) * min(1.0, math.log(m / 64) / math.log(16))

    def __post_init__(self) -> None:
        for k, v in self.__dict__.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"cost_model.overheads.{k}={v!r}: must be a number >= 0")

    def launch_floor(self, num_tokens: int, num_prefill_reqs: int, num_layers: int) -> float:
        """The least time of a step's GPU work set by the host's launches: 0 for a step inside
        a CUDA graph (or decode-only, see above)."""
        if num_tokens > self.cudagraph_max_tokens and num_prefill_reqs:
            return num_layers * self.eager_layer_launch_s
        return 0.0


def _overheads(d: dict) -> Overheads:
    """Overheads from a scenario's `cost_model.overheads` mapping; an unknown key is refused,
    naming it (values are checked by Overheads itself)."""
    known = Overheads.__dataclass_fields__
    for k in d:
        if k not in known:
            raise ValueError(f"cost_model.overheads.{k}: unknown (expected one of {', '.join(known)})")
    return Overheads(**d)


_BUILT: dict = {}


def derive_head_table(tabs: dict, kvn: str, q: int, kv: int, head_dim: int, phase: str, roof=None):
    """An attention table for a head configuration the measurements lack (e.g. Llama-2's 32 query
    and 32 KV heads, Qwen2.5-7B's 28/4), from measured neighbours of the same KV dtype and head
    dim, as (axes, microseconds, note), or None:
      1. the same KV heads, query heads bracketed (q1 < q < q2): geometric interpolation in q;
      2. decode: every table of the same queries per KV head (KV heads within 8x), each read at
         the batch that gives the same batch x KV heads, their geometric mean (at least two);
         prefill, or fewer tables: KV heads bracketed, geometric interpolation in kv;
      3. the nearest measured configuration, scaled by the work that grows with the heads:
         KV heads for decode (it streams each KV head once), query heads for prefill.
    Interpolation runs on the first table's axes, the other table read there by its own grid
    (holes filled by `roof`, the roofline of the configuration asked for, scaled to a neighbour)."""
    have = []
    for k in tabs:
        parts = k.split("/")
        if len(parts) == 4 and parts[0] == kvn and int(parts[3]) == head_dim:
            have.append((int(parts[1]), int(parts[2]), k))
    if not have:
        return None

    def blend(ka, kb, w, note):
        ta, tb = tabs[ka], tabs[kb]
        ga = Grid(ta["values"], ta["us"], roof)
        gb = Grid(tb["values"], tb["us"], roof)
        us = [[float(np.exp((1 - w) * np.log(ga(b, s)[0]) + w * np.log(gb(b, s)[0]))) for s in ta["values"][1]]
              for b in ta["values"][0]]
        return ta["values"], us, note

    def bracket(pairs, x):  # (value, key) pairs: the nearest below and above x
        lo = max((p for p in pairs if p[0] < x), default=None)
        hi = min((p for p in pairs if p[0] > x), default=None)
        return lo, hi

    lo, hi = bracket([(qq, k) for qq, kk, k in have if kk == kv], q)
    if lo and hi:
        w = math.log(q / lo[0]) / math.log(hi[0] / lo[0])
        return blend(lo[1], hi[1], w, f"interpolated in query heads between {lo[1]} and {hi[1]}")
    if phase == "generation":
        # Decode attention streams each (sequence, KV head) pair's keys and values once, and its
        # kernels split the work over batch x KV heads: at the same queries per KV head, b
        # sequences with kv heads are the work of b x kv / kk sequences with kk heads. Every such
        # measured table (kk within 8x of kv), read at that batch; their geometric mean (over the
        # tables whose batch axis holds that batch, where any does).
        same = [(kk, k) for qq, kk, k in have if qq * kv == q * kk and 1 / 8 <= kv / kk <= 8]
        if len(same) >= 2:
            axes = tabs[min(same, key=lambda t: abs(math.log(t[0] / kv)))[1]]["values"]
            grids = [(kv / kk, Grid(tabs[k]["values"], tabs[k]["us"], roof), tabs[k]["values"][0]) for kk, k in same]

            def mean_at(b, s):
                inside = [(sc, g) for sc, g, ax in grids if ax[0] <= b * sc <= ax[-1]] or [g[:2] for g in grids]
                return float(np.exp(np.mean([np.log(g(b * sc, s)[0]) for sc, g in inside])))
            us = [[mean_at(b, s) for s in axes[1]] for b in axes[0]]
            return axes, us, (f"mean of {len(same)} tables of {q / kv:g} queries per KV head at the same "
                              f"batch x KV heads ({', '.join(k for _kk, k in sorted(same))})")
    lo, hi = bracket([(kk, k) for qq, kk, k in have if qq * kv == q * kk], kv)
    if lo and hi:
        w = math.log(kv / lo[0]) / math.log(hi[0] / lo[0])
        return blend(lo[1], hi[1], w, f"interpolated in KV heads between {lo[1]} and {hi[1]}")
    qq, kk, k = min(have, key=lambda t: abs(math.log(t[0] / q)) + abs(math.log(t[1] / kv)))
    scale = kv / kk if phase == "generation" else q / qq
    t = tabs[k]
    return (t["values"], [[None if u is None else u * scale for u in row] for row in t["us"]],
            f"{k} scaled by {scale:.3g}")


def _log_grid(lo: int, hi: int, per_octave: int = 4) -> list[int]:
    out, x = [], float(lo)
    while x < hi * 1.0001:
        v = int(round(x))
        if not out or v > out[-1]:
            out.append(v)
        x *= 2 ** (1 / per_octave)
    return out


# cost_model.moe_activations: what MXFP4 experts multiply in (mxfp8: the tables' mxfp4_mxfp8 kernel)
MOE_ACTIVATIONS = ("bf16", "mxfp8")
# cost_model.moe_backend: `auto`, the kernel vLLM's own selection runs (the `moe` tables); `triton`,
# vLLM's Triton fused-MoE kernel, what a server runs with --moe-backend triton or, before that
# flag, VLLM_USE_FLASHINFER_MOE_FP8=0 and VLLM_MOE_USE_DEEP_GEMM=0 (the `moe_triton` tables where
# `moe` holds another kernel for the format, e.g. FlashInfer's on B200)
MOE_BACKENDS = ("auto", "triton")
# ModelSpec expert dtype -> the weight format of the fused-MoE tables (fp8 per channel is timed
# with the 128x128-block kernel's table: the same bytes and math; fp16 as bf16).
MOE_FORMATS = {"bfloat16": "bf16", "float16": "bf16", "fp8_block": "fp8_block", "fp8": "fp8_block",
               "mxfp4": "mxfp4", "int4": "int4", "int4_g32": "int4", "nvfp4": "nvfp4"}


def _is_triton(kernel: str) -> bool:
    """Whether a fused-MoE table's kernel is vLLM's Triton one: named so from vLLM 0.24, and
    `vllm_fused_moe` in the earlier releases the wheel measured (A100's 0.14; B200's 0.19)."""
    return "triton" in kernel or kernel == "vllm_fused_moe"


def _grouped_expert_gemms(m: ModelSpec, T: float, tp: int) -> list[tuple[float, int, int]]:
    """(M, N, K) of one MoE layer's routed experts for T tokens, as one grouped GEMM: the e experts
    the tokens touch (ModelSpec.experts_touched), each against its share of the T x top-k rows,
    their weights side by side (N = e x the expert's N)."""
    e = m.experts_touched(T)
    rows = max(1.0, T * m.num_experts_per_tok / e)
    return [(rows, e * n, k) for n, k in m.expert_gemms(tp).values()]


def _uniform_routing(tab: dict, spec: ModelSpec, distribution: str):
    """A fused-MoE table as a function of the step's tokens T under uniform random routing (what
    ModelSpec.experts_touched assumes), from the distribution the table was measured with.

    `balanced` (AIConfigurator's balanced_logits) spreads the T x k token rows over as many
    experts as it can, min(E, T x k): at a given T it touches more experts than random routing,
    which touches e(T) = E (1 - (1 - k/E)^T) on average, and a decode-sized step is the time to
    stream the touched experts' weights. So the time at T is the table's at the token count where
    balanced routing touches e(T) experts (e(T)/k), and at least the table's time at T scaled by
    the share of experts touched, e(T) / min(E, T k) (the two agree where weights dominate; at
    large T both routings touch every expert and the table is read as measured). Any other
    distribution is read as measured. Returns (token axis, microseconds) for a Grid."""
    grid = Grid(tab["values"], tab["us"], None)
    if distribution != "balanced":
        return tab["values"], tab["us"]
    E, k = spec.num_experts, spec.num_experts_per_tok
    lo, hi = tab["values"][0][0], tab["values"][0][-1]
    ts = _log_grid(max(1, int(lo)), int(hi))
    out = []
    for T in ts:
        e = spec.experts_touched(T)
        t_eff = min(max(e / k, lo), T)
        a, _ = grid(t_eff)
        b, _ = grid(T)
        out.append(max(a, b * e / min(E, T * k)))
    return [ts], out


def _moe_reading(tables: dict, skewed: dict, key: str, spec: ModelSpec, distribution: str):
    """One MoE layer's time over the step's tokens T, from the fused-MoE table `key` of `tables`
    (measured with `distribution`) and, where `skewed` has the same key, the table measured with a
    skewed routing (convert_kernel_tables.MOE_SKEWED: per-expert token counts from a power law).

    A trained router is neither. Uniform random routing (_uniform_routing) streams the most
    experts a decode batch can touch; a skewed routing loads its busiest expert with more rows
    than balanced routing ever does, which is what a prefill-sized step waits on. Each is what the
    other leaves out, so the reading is the slower of the two at each T: the uniform reading at a
    decode batch (more experts touched), the skewed one where it is slower (B200, 8192 tokens:
    10% for MiniMax-M2's shape at TP2, 8% for gpt-oss's; 24-30% at 1024-2048 tokens).
    Returns (token axis, microseconds) for a Grid."""
    vals, us = _uniform_routing(tables[key], spec, distribution)
    if key in skewed:
        g = Grid(skewed[key]["values"], skewed[key]["us"], None)
        us = [max(u, g(t)[0]) for t, u in zip(vals[0], us)]
    return vals, us


def _routing_ratio(ref_moe: dict, key: str, spec: ModelSpec):
    """T -> the two-routing reading (_moe_reading of a balanced table and its skewed one) over
    the skewed table's alone, for table `key` of another GPU's `moe` section that has both; None
    where it lacks either. Not below 1: the skewed table is one of the two."""
    tabs, sk = ref_moe.get("tables", {}), ref_moe.get("skewed_tables", {})
    if ref_moe.get("distribution") != "balanced" or key not in tabs or key not in sk:
        return None
    both = Grid(*_moe_reading(tabs, sk, key, spec, "balanced"), None)
    alone = Grid(sk[key]["values"], sk[key]["us"], None)
    # past the shorter of the two tables' token axes, the ratio at its end (each table alone
    # would clamp to its own end)
    lo = max(tabs[key]["values"][0][0], sk[key]["values"][0][0])
    hi = min(tabs[key]["values"][0][-1], sk[key]["values"][0][-1])

    def ratio(T):
        q = min(max(T, lo), hi)
        return max(1.0, both(q)[0] / alone(q)[0])
    return ratio


def _kernel_shape(m: ModelSpec, kernel: str, fmt: str, slices: int) -> ModelSpec:
    """m's experts as the fused-MoE kernel `kernel` holds them, each expert sliced `slices` ways:
    vLLM pads MXFP4 experts for FlashInfer's TRT-LLM kernels (Blackwell) to multiples of 256 in
    the hidden size and in each rank's slice of the intermediate size (gpt-oss-120b: 2880 ->
    3072, and 360 -> 512 per GPU at TP 8), and for the OAI Triton kernel (Hopper) each rank's
    intermediate slice to a multiple of 64 (Mxfp4MoEMethod.create_weights). A shape read from its
    own table was measured so padded; this is for one scaled from another shape's table."""
    if fmt not in ("mxfp4", "mxfp4_mxfp8") or not kernel:
        return m
    if "flashinfer_trtllm" in kernel:
        h_to, i_to = 256, 256
    elif "triton" in kernel:
        h_to, i_to = 1, 64
    else:
        return m
    part = -(-(m.moe_intermediate_size // slices) // i_to) * i_to
    return replace(m, hidden_size=-(-m.hidden_size // h_to) * h_to, moe_intermediate_size=part * slices)


def _nearest_moe_table(tables: dict, fmt: str, m: ModelSpec, moe_tp: int, moe_ep: int = 1):
    """The measured fused-MoE shape nearest to m's (same format and sharding): the closest top-k,
    then expert bytes and expert count on a log scale. Returns (key, m with that shape) or None."""
    best = None
    for key in tables:
        f, h, i, k, e, t, ep = key.split("/")
        if f != fmt or int(t) != moe_tp or int(ep) != moe_ep:
            continue
        h, i, k, e = int(h), int(i), int(k), int(e)
        d = (abs(math.log(k / m.num_experts_per_tok)) * 4
             + abs(math.log(h * i * e / (m.hidden_size * m.moe_intermediate_size * m.num_experts)))
             + abs(math.log(e / m.num_experts)))
        if best is None or d < best[0]:
            best = (d, key, (h, i, k, e))
    if best is None:
        return None
    h, i, k, e = best[2]
    spec = replace(m, hidden_size=h, moe_intermediate_size=i, num_experts_per_tok=k, num_experts=e)
    return best[1], spec


# The vLLM release from which data-parallel ranks are padded to the largest only in CUDA-graph
# steps (KernelCostModel.dp_pads)
DP_PAD_GRAPHS_ONLY_FROM = (0, 16)
# The MLA layer shape the `mla_module` tables were measured at (DeepSeek-V3's; Kimi-K2's is the same)
MLA_MODULE_SHAPE = {"hidden_size": 7168, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                    "qk_nope_head_dim": 128, "v_head_dim": 128}
MLA_MODULE_DTYPES = {"bfloat16": "bf16", "fp8_block": "fp8_block"}


# The sparse-attention layer shapes the `dsa_module` tables were measured at (GLM-5's from GLM-5.2's rows)
DSA_MODULE_SHAPES = {
    "deepseek-v3.2": {**MLA_MODULE_SHAPE, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048},
    "glm-5": {"hidden_size": 6144, "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
              "qk_nope_head_dim": 192, "v_head_dim": 256, "index_n_heads": 32, "index_head_dim": 128,
              "index_topk": 2048}}


def _mla_module_key(m: ModelSpec, tp: int, tables: dict | None) -> str | None:
    """The measured latent-attention layer table that times this model's prefill on one GPU of a
    TP group, as "section/key": `mla_module` kv_dtype/weight_dtype/heads for DeepSeek-V3's shape,
    `dsa_module` shape/kv_dtype/weight_dtype/heads for a sparse-attention shape it holds; None for
    another shape, an attention weight format or head count the tables lack, or no such tables."""
    if not m.is_mla or m.attn_output_gate or m.index_pool > 1:
        return None  # (the tables' layer has no output gate, Kimi-K3's has; nor a key pool, GLM-5.3-Flash's)
    w = MLA_MODULE_DTYPES.get(m.attn_dtype)
    base = f"{KV_NAMES.get(m.kv_dtype, 'bf16')}/{w}/{m.num_heads // tp}"
    if m.index_topk:
        section = "dsa_module"
        shape = next((name for name, sh in DSA_MODULE_SHAPES.items()
                      if all(getattr(m, f) == v for f, v in sh.items())), None)
        key = f"{shape}/{base}" if shape else None
    else:
        section = "mla_module"
        key = base if all(getattr(m, f) == v for f, v in MLA_MODULE_SHAPE.items()) else None
    doc = (tables or {}).get(section) or {}
    return f"{section}/{key}" if w and key and key in doc.get("context", {}) else None


class KernelCostModel(CostModel):
    """Per-step seconds from measured kernel tables for one deployment (model x device x TP)."""

    kind = "kernels"

    def __init__(self, model: ModelSpec | str | dict, device: DeviceSpec | str | dict, tp: int = 1,
                 overheads: Overheads | dict | None = None, tables: dict | str | None = None,
                 reduced: dict | None = None, expert_parallel: bool = False, data_parallel: int = 1,
                 moe_activations: str = "bf16", moe_backend: str = "auto", sampling: str = "model_default",
                 vllm_version: str | None = None) -> None:
        self.model = m = get_model(model)
        self.device = d = get_device(device)
        if moe_backend not in MOE_BACKENDS:
            raise ValueError(f"cost_model.moe_backend={moe_backend!r}: one of {list(MOE_BACKENDS)}")
        self.moe_backend = moe_backend
        # MXFP4 experts' activations: bf16 (vLLM's default kernels) or mxfp8 (FlashInfer's
        # TRT-LLM kernel on Blackwell, VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1)
        if moe_activations not in MOE_ACTIVATIONS:
            raise ValueError(f"cost_model.moe_activations={moe_activations!r}: one of {list(MOE_ACTIVATIONS)}")
        self.moe_activations = moe_activations
        # vLLM's data-parallel attention (--data-parallel-size, MoE models): dp ranks of tp GPUs
        # each, attention and dense layers per rank, the MoE layers over all tp x dp GPUs and all
        # ranks' tokens (set_group_tokens; sim.replica.DataParallelGroup steps the ranks together)
        self.dp = int(data_parallel)
        if self.dp < 1 or (self.dp > 1 and not m.is_moe):
            raise ValueError(f"deployment.data_parallel={data_parallel}: attention data parallelism is for "
                             f"mixtures of experts (>= 1; {m.name} is dense: use replicas)")
        self.moe_ranks = tp * self.dp
        # vLLM's --enable-expert-parallel: a MoE layer from the tables measured with the experts
        # split whole over the ranks (moe_tp 1, moe_ep tp x dp) instead of sliced (moe_tp tp x dp)
        self.expert_parallel = bool(expert_parallel) and m.is_moe and self.moe_ranks > 1
        self._group_tokens: int | None = None
        if tp < 1 or m.num_heads % tp:
            raise ValueError(f"deployment.tp={tp}: must be >= 1 and divide num_heads={m.num_heads}")
        self.tp = tp
        self.ovh = overheads if isinstance(overheads, Overheads) else _overheads(overheads or {})
        if (not isinstance(overheads, Overheads) and "gemm_compute_slowdown" not in (overheads or {})
                and d.gemm_compute_slowdown is not None):  # the GPU's own, unless the scenario sets one
            self.ovh = replace(self.ovh, gemm_compute_slowdown=d.gemm_compute_slowdown)
        self._tp_step = (tp - 1) * self.ovh.tp_step_s
        self._filter_impl: str | None = None
        self._plain = self.ovh.serving_slowdown == 1.0 and self._tp_step == 0.0
        if self._plain:  # the kernels' time as it is: no wrapper call per step (the hot path)
            self.gpu_time = self._kernel_time
            self.decode_gpu_time = self._decode_kernel_time
        self.fallbacks: dict[str, int] = {}
        # Per term, the smallest and largest query (each axis) answered outside the tables.
        self.fallback_range: dict[str, list[list[float]]] = {}
        self.lookups = 0
        self._warned: set[str] = set()
        self.cpu_model: Callable[[BatchFeatures], float] | None = None  # replaces cpu_time if set
        self._memo_t: dict = {}   # token count -> (terms, lookups): breakdown's per-T terms
        self._memo_s: dict = {}   # sampled rows -> ((lm_head, sampler, gather), lookups)
        self._memo_d: dict = {}   # decodes in a decode-only step -> its terms but attention
        self._memo_c: dict = {}   # decodes in a decode-only step -> default CPU work
        self._cpu_work = None
        self.kv_heads = m.kv_heads_per_gpu(tp)
        self.q_heads = m.num_heads // tp
        # Attention as its kernels see it: MLA runs as multi-query attention over the latent
        # (one KV head of kv_lora_rank + qk_rope_head_dim, as vLLM's MLA decode kernels do).
        self.attn_head_dim = m.head_dim
        if m.is_mla:
            self.kv_heads, self.attn_head_dim = 1, m.kv_lora_rank + m.qk_rope_head_dim
        self.g_moe = None
        self._moe_unrouted = False  # g_moe leaves each layer's routing kernel out (_build)
        self.g_gdn_ctx = self.g_gdn_gen = None  # linear-attention layers (hybrids): _build
        self._mla_key = None  # an MLA layer's prefill read from the mla_module tables: _build
        self.g_mla_proj = None  # and then its decode tokens' projections by themselves
        self.g_ctx_sw = self.g_gen_sw = None  # sliding-window layers of their own shape: _build
        if m.num_linear_layers and (m.linear_num_k_heads % tp or m.linear_num_v_heads % tp):
            raise ValueError(f"deployment.tp={tp}: must divide the linear-attention heads "
                             f"({m.linear_num_k_heads} key, {m.linear_num_v_heads} value heads of {m.name})")
        if reduced is not None:
            self._from_reduced(reduced)
        elif tables is None or isinstance(tables, str):
            # Grids are read-only once built: deployments seen before (a plan's candidates at
            # many rates and seeds) share them.
            key = (m, d, tp, tables or d.kernel_tables, self.expert_parallel, self.dp,
                   self.ovh.gemm_compute_slowdown, moe_activations, moe_backend)
            if key not in _BUILT:
                name = tables or d.kernel_tables
                t = load_tables(name) if name else None
                self.source = t.get("sources", {}) if t else {}
                self._build(t)
                if len(_BUILT) > 64:
                    _BUILT.clear()
                _BUILT[key] = (self.g_layer, self.g_head, self.g_ctx, self.g_gen, self.g_ar, self.g_ar_eager,
                               self._ar_releases, self.g_moe, self._moe_unrouted, self.g_gdn_ctx, self.g_gdn_gen,
                               self._mla_key, self.g_mla_proj, self.g_ctx_sw, self.g_gen_sw, self.coverage,
                               self.source)
            (self.g_layer, self.g_head, self.g_ctx, self.g_gen, self.g_ar, self.g_ar_eager, self._ar_releases,
             self.g_moe, self._moe_unrouted, self.g_gdn_ctx, self.g_gdn_gen, self._mla_key, self.g_mla_proj,
             self.g_ctx_sw, self.g_gen_sw, self.coverage, self.source) = _BUILT[key]
        else:
            self.source = tables.get("sources", {})
            self._build(tables)
        self.metadata = {"model": m.name, "device": d.name, "tp": tp, "weight_dtype": m.weight_dtype,
                         **({"experts": m.num_experts, "experts_per_tok": m.num_experts_per_tok,
                             "expert_dtype": m.expert_dtype or m.weight_dtype,
                             "expert_parallel": self.expert_parallel, "data_parallel": self.dp,
                             "moe_activations": moe_activations, "moe_backend": moe_backend}
                            if m.is_moe else {}),
                         "kv_dtype": m.kv_dtype, "act_dtype": m.act_dtype, "kv_heads_per_gpu": self.kv_heads,
                         "source": "measured kernel tables (AIConfigurator, vLLM kernels); roofline outside them",
                         "tables": self.source, "table_coverage": self.coverage,
                         "overheads": self.ovh.__dict__.copy()}
        self.set_sampling(sampling, vllm_version)

    def set_sampling(self, sampling: str = "model_default", vllm_version: str | None = None,
                     generation_filter: str | None = None) -> None:
        """Price the sampler for requests of workload.sampling `sampling` served by vLLM release
        `vllm_version` (None: the default release): top-k/top-p filtering adds
        sim.sampling.filter_cost_s per step where the release filters without FlashInfer.
        `generation_filter` replaces the model's own (a profile's stored spec may predate it).
        The release also picks the all-reduce tables: those of the latest release measured at or
        before it (the earliest measured for an older one), since their times changed between
        releases (calibration/convert_kernel_tables.py, `allreduce_releases`); the default release
        (0.33) reads each GPU's latest (H100, H200, B300: 0.31.0; B200: 0.24.0); and when
        data-parallel ranks are padded (dp_pads)."""
        gen = self.model.generation_filter if generation_filter is None else generation_filter
        release = vllm_version_tuple(vllm_version)  # ValueError naming deployment.vllm_version
        self._select_allreduce(release, vllm_version)
        self._dp_pads_every_step = release < DP_PAD_GRAPHS_ONLY_FROM  # dp_pads
        impl = filter_implementation(release) if sampling_filters(sampling, gen, release) else None
        self._filter_impl = impl  # filter_cost_s prices each implementation (FlashInfer: nothing extra)
        self._memo_s.clear()
        self._memo_d.clear()
        self.metadata.update(sampling=sampling, vllm_version=vllm_version, sampler_filter=impl or "none")

    def _select_allreduce(self, release: tuple[int, int], vllm_version: str | None) -> None:
        """The all-reduce grids of the latest release measured at or before `release` (the
        earliest for an older one); a warning where the tables hold one release only."""
        if self._ar_releases:
            rel = max((r for r in self._ar_releases if r <= release), default=min(self._ar_releases))
            name, g, e = self._ar_releases[rel]
            if (g, e) != (self.g_ar, self.g_ar_eager):
                self.g_ar, self.g_ar_eager = g, e
                self._memo_t.clear()
            self.metadata["allreduce_release"] = name
            self.metadata["allreduce_source"] = self.source.get("allreduce_releases", {}).get(name)
        elif vllm_version is not None and self.g_ar is not None and "allreduce" not in self._warned:
            self._warned.add("allreduce")  # a profile written before the tables held releases
            warnings.warn(f"kernel cost model ({self.model.name} on {self.device.name}, tp={self.tp}): its "
                          f"all-reduce tables are of one vLLM release, not of deployment.vllm_version="
                          f"{vllm_version!r} (a profile from before they held releases: regenerate it)")

    # ------------------------------------------------------------------ rooflines
    def _derived_gemm_grid(self, dtype: str, roof, tables: dict | None) -> tuple["Grid | None", str | None]:
        """A GEMM grid for fp8 weights on a GPU whose tables lack that format (A100: none; L40S: no
        128x128 blocks), and for 4-bit integer weights (W4A16, which no table holds): the measured
        table of the nearest format at each (M, N, K), times the ratio of the two formats' rooflines
        there (the same math and bytes for fp8 blocks read from the per-channel fp8 table; from
        bf16, the weights' bytes halve for fp8, and the math goes at the fp8 rate where the GPU has
        one, else at bf16's, as vLLM's weight-only fp8 kernels run on Ampere; for int4 the weights'
        bytes fall to 0.52 a weight (int4_g32: 0.56) and the math stays at bf16's, as Marlin and
        Machete dequantize to 16 bits). Every lookup counts as a fallback. (None, None) without a
        table to read."""
        gem = (tables or {}).get("gemm", {})
        src = "fp8" if dtype == "fp8_block" and "fp8" in gem else "bf16" if "bf16" in gem else None
        if src is None:
            return None, None
        t = gem[src]
        sroof = self._gemm_roof("fp8" if src == "fp8" else "bfloat16")
        us = np.array(t["us"], dtype=float)
        for idx in np.ndindex(us.shape):
            M, N, K = (t["values"][d][i] for d, i in enumerate(idx))
            us[idx] *= roof(M, N, K) / sroof(M, N, K)
        return Grid(t["values"], us.tolist(), roof, np.zeros(us.shape, dtype=bool)), f"{src} table x roofline ratio"

    def _gemm_roof(self, dtype: str) -> Callable[..., float]:
        d, m = self.device, self.model
        sub_byte = dtype in WEIGHT_ONLY_4BIT  # weight-only formats: bf16 math after dequantizing
        # (NVFP4 runs on FP4 tensor cores where the GPU has them, else weight-only: peak_flops)
        peak = d.peak_flops("bfloat16" if sub_byte else dtype)
        wb = EXPERT_DTYPE_BYTES[dtype] if sub_byte or dtype == "nvfp4" else (1 if dtype in ("fp8", "fp8_block") else 2)
        a = m.act_dtype_bytes

        def roof(M, N, K):
            return max(2 * M * N * K / peak, (M * K * a + N * K * wb + M * N * a) / d.mem_bandwidth) + 2e-6
        return roof

    def _v_dim(self, hd):
        """The value heads' width beside query-key heads of hd: MLA's latent is both; a GQA model's
        v_head_dim where it has one (MiMo-V2), else hd."""
        return hd if self.model.is_mla else (self.model.v_head_dim or hd)

    def _ctx_roof(self, b, s, kv_heads=None, hd=None):
        """Prefill attention of b causal sequences of s tokens by the roofline, for this GPU's
        heads (kv_heads, hd: a sliding-window layer's own shape)."""
        m, d = self.model, self.device
        hd = hd or self.attn_head_dim
        v, kv = self._v_dim(hd), kv_heads or self.kv_heads
        flops = b * s * s * self.q_heads * (hd + v)  # causal: half of 2*s^2*h*(d_qk + d_v)
        by = b * s * ((self.q_heads + kv) * hd + kv * v) * m.act_dtype_bytes * 2
        return max(flops / d.flops, by / d.mem_bandwidth) + 5e-6

    def _gen_roof(self, b, s, kv_heads=None, hd=None):
        """b decodes reading s cached tokens each by the roofline (kv_heads, hd as _ctx_roof)."""
        m, d = self.model, self.device
        hd = hd or self.attn_head_dim
        v = self._v_dim(hd)
        if m.compressed_mqa:  # one cached latent entry per key (vLLM's fp8 layout)
            by = b * s * m.latent_entry_bytes
        else:  # (MLA: one latent per token, keys and values alike)
            by = b * s * (kv_heads or self.kv_heads) * (hd if m.is_mla else hd + v) * m.kv_dtype_bytes
        flops = 2 * b * s * self.q_heads * (hd + v)
        return max(flops / d.flops, by / d.mem_bandwidth) + 5e-6

    def _ar_roof(self, n):
        d, tp = self.device, self.tp
        return 2 * (tp - 1) / tp * n * self.model.act_dtype_bytes / d.interconnect_bandwidth + d.interconnect_latency_s

    def _dispatch_roof(self, tokens: int) -> float:
        """One MoE layer's dispatch and combine under data-parallel attention: every rank's tokens
        gathered to the tp x dp GPUs and the outputs reduced back, by the link's bandwidth (the
        traffic of an all-reduce of their hidden states; a latent MoE's in the latent width, which
        its tokens are projected to first), plus two latencies and Overheads.dp_dispatch_s."""
        d, g = self.device, self.moe_ranks
        return (2 * (g - 1) / g * tokens * self.model.expert_hidden * self.model.act_dtype_bytes
                / d.interconnect_bandwidth + 2 * d.interconnect_latency_s + self.ovh.dp_dispatch_s)

    # ------------------------------------------------------------------ building
    def _attention_roof(self, phase: str, kv: int, hd: int):
        """The roofline of one phase's attention ("context" or "generation") for kv KV heads of hd."""
        roof = self._ctx_roof if phase == "context" else self._gen_roof
        return lambda b, s, r=roof, kv=kv, hd=hd: r(b, s, kv, hd)

    def _attention_grid(self, tables: dict | None, phase: str, kv: int, hd: int) -> tuple:
        """(Grid, coverage note) of one phase's attention for this GPU's query heads over kv KV
        heads of width hd: the measured table of that shape, else one derived from neighbours
        (derive_head_table), else the roofline (counted as fallbacks)."""
        kvn = KV_NAMES.get(self.model.kv_dtype, "bf16")
        key = f"{kvn}/{self.q_heads}/{kv}/{hd}"
        roof = self._attention_roof(phase, kv, hd)
        tabs = (tables or {}).get(f"{phase}_attention", {}).get("tables", {})
        tab = tabs.get(key)
        derived = None if tab is not None else derive_head_table(tabs, kvn, self.q_heads, kv, hd, phase, roof)
        if tab is None and derived is None:
            bs, ss = _log_grid(1, 4096, 1), _log_grid(1, 262144, 1)
            us = [[roof(b, s) * 1e6 for s in ss] for b in bs]
            return Grid([bs, ss], us, roof, np.zeros((len(bs), len(ss)), dtype=bool)), None
        values, us = (tab["values"], tab["us"]) if tab is not None else derived[:2]
        if phase == "context":  # prefill attention: compute-bound over its b x s query rows
            us = [[None if u is None else u * self.ovh.gemm_factor(b * s) for s, u in zip(values[1], row)]
                  for b, row in zip(values[0], us)]
        return Grid(values, us, roof), (key if tab is not None else derived[2])

    def _build(self, tables: dict | None) -> None:
        m, tp = self.model, self.tp
        cov = {}
        # A latent-attention layer of DeepSeek-V3's shape (Kimi-K2's too) from vLLM's measured
        # MLA layer tables where they hold this GPU's heads, cache and weight format: its
        # projections, RoPE, cache write and attention in one reading (mla_module), so its GEMMs
        # leave the layer's GEMM sum.
        self._mla_key = _mla_module_key(m, tp, tables)
        # GEMMs of one layer (averaged over layer kinds: a MoE model's dense, shared-expert and
        # router GEMMs weighted by how many layers have them) and the LM head, as functions of M;
        # each GEMM from the table of its weight dtype.
        grids: dict[str, tuple] = {}
        derived: dict[str, str] = {}  # fp8 formats read from another format's table: how

        def grid_of(dtype, experts: bool = False):
            # 4-bit integer weights: the dense layers' GEMMs from the bf16 table (derived); the
            # experts' estimate keeps its roofline, as the fused-MoE tables time them where they can
            key = (dtype, "experts") if experts and dtype in INT4 else dtype
            if key not in grids:
                gname = GEMM_NAMES.get(dtype)
                t = (tables or {}).get("gemm", {}).get(gname) if gname else None
                roof = self._gemm_roof(dtype)
                g = Grid(t["values"], t["us"], roof) if t else None
                if g is None and key == dtype and dtype in FP8 + INT4:
                    g, how = self._derived_gemm_grid(dtype, roof, tables)
                    if how:
                        derived[dtype] = how
                grids[key] = (g, roof, t)
            return grids[key]
        step = [(n, k, layers / m.num_layers, dtype, name not in UNCOUNTED_GEMMS)
                for name, n, k, layers, dtype in self._step_gemms()]
        for _n, _k, _w, dtype, _c in step:
            grid_of(dtype)
        grid_a, roof_a, ga = grid_of(m.act_dtype)
        measured_ms = set()
        for _g, _r, t in grids.values():
            measured_ms |= set(t["values"][0] if t else [])
        ms = sorted(measured_ms | set(_log_grid(32768, 262144))) if measured_ms else _log_grid(1, 262144)
        vocab = -(-m.vocab_size // tp)
        layer, head, ok_l, ok_h = [], [], [], []

        def gemm(grid, roof, M, n, k):
            if grid is None:
                return roof(M, n, k) * 1e6, False
            # Wider than the table (a 128k-vocabulary LM head): equal column slices, each measured.
            parts = -(-n // int(grid.values[1][-1]))
            t, e = grid(M, n / parts, k)
            return parts * t * self.ovh.gemm_factor(M), e

        proj = ([(n, k, name not in UNCOUNTED_GEMMS, self._proj_share(name))
                 for name, (n, k) in m.attention_gemm_shapes(tp).items()] if self._mla_key else [])
        gw_p, rw_p, _t = grid_of(m.attn_dtype)
        mla_proj, ok_p = [], []
        for M in ms:
            tot, ok = 0.0, True
            for n, k, wgt, dtype, counted in step:
                gw, rw, _t = grids[dtype]
                t, e = gemm(gw, rw, M, n, k)
                tot += wgt * t
                ok &= e or not counted
            layer.append(tot)
            ok_l.append(ok)
            t, e = gemm(grid_a, roof_a, M, vocab, m.hidden_size)
            head.append(t)
            ok_h.append(e)
            if proj:  # the MLA projections of a step's decode tokens (mla_module times the prefill's)
                ts = [(*gemm(gw_p, rw_p, M, n, k), counted, share) for n, k, counted, share in proj]
                mla_proj.append(sum(share * t for t, _e, _c, share in ts))
                ok_p.append(all(e or not c for _t, e, c, _s in ts))
        self.g_layer = Grid([ms], layer, self._layer_roof, ok_l)
        self.g_mla_proj = Grid([ms], mla_proj, self._mla_proj_roof, ok_p) if proj else None
        self.g_head = Grid([ms], head, self._head_roof, ok_h)
        cov["gemm"] = all(grids[dtype][2] is not None for _n, _k, _w, dtype, _c in step)
        if derived:
            cov["gemm_derived"] = derived
        cov["lm_head_gemm"] = bool(grid_a)
        # Routed experts of one MoE layer, as a function of the step's tokens T: vLLM's fused-MoE
        # kernel measured for this very shape and sharding where the tables have it (`moe`:
        # dtype/hidden/inter/topk/experts/moe_tp/moe_ep; read by _moe_reading: the slower of
        # uniform and skewed routing at each T). Otherwise the nearest measured shape
        # of the same format and sharding, scaled by the ratio of this model's grouped-GEMM
        # estimate for the two (counted as fallbacks); with expert parallelism and no table of the
        # format split whole, its sliced table times the bf16 tables' whole/sliced ratio. The
        # estimate: the experts the tokens touch (ModelSpec.experts_touched: e of them), each expert's weights against its share of the
        # T * top-k token rows, as one GEMM of those rows against the touched experts' weights side
        # by side (N = e x the expert's N) from the measured dense GEMM table of the experts' dtype:
        # all touched weights streamed once, one launch. With no table at all, that estimate.
        self.g_moe = None
        if m.is_moe:
            # the experts as the fused-MoE kernel sees them: a latent MoE's in the latent's width
            ev = replace(m, hidden_size=m.expert_hidden, moe_latent_size=0) if m.moe_latent_size else m
            edt = m.expert_dtype or m.weight_dtype
            ge, re_, _t = grid_of(edt, experts=True)

            def estimate(spec, T):
                tot, ok = 0.0, True
                for rows, n, k in _grouped_expert_gemms(spec, T, self.moe_ranks):
                    t, ex = gemm(ge, re_, rows, n, k)
                    tot += t
                    ok &= ex
                return tot, ok
            moe_doc = (tables or {}).get("moe", {})
            fmt = MOE_FORMATS.get(edt)
            if self.moe_backend == "triton" and fmt and not _is_triton(moe_doc.get("kernels", {}).get(fmt, "triton")):
                moe_doc = (tables or {}).get("moe_triton", {})
                if fmt not in moe_doc.get("kernels", {}):
                    raise ValueError(f"cost_model.moe_backend='triton': vLLM's Triton fused-MoE kernel was not "
                                     f"measured for {fmt} experts on {self.device.name}")
            mt = moe_doc.get("tables", {})
            dist = moe_doc.get("distribution", "")
            if self.moe_activations == "mxfp8":
                if fmt != "mxfp4":
                    raise ValueError(f"cost_model.moe_activations='mxfp8': for MXFP4 experts only "
                                     f"({m.name}'s are {edt})")
                fmt = "mxfp4_mxfp8"
                if not any(k.startswith("mxfp4_mxfp8/") for k in (tables or {}).get("moe", {}).get("tables", {})):
                    raise ValueError(f"cost_model.moe_activations='mxfp8': no MXFP8-activation MoE kernel "
                                     f"was measured on {self.device.name} (Blackwell GPUs have it)")
            mtp, mep = (1, self.moe_ranks) if self.expert_parallel else (self.moe_ranks, 1)
            skewed = moe_doc.get("skewed_tables", {})
            ts = _log_grid(1, 262144)
            # Tables timed with skewed routing only (A100's) take the uniform-routing reading from
            # a GPU that has both for the same kernel and shape (moe.routing_reference): at each
            # T, its two-routing reading over its skewed table alone (_routing_ratio).
            ref_name = moe_doc.get("routing_reference") if dist != "balanced" else None
            ref_moe = load_tables(ref_name).get("moe", {}) if ref_name else {}

            def reading(k, spec):
                vals, us = _moe_reading(mt, skewed, k, spec, dist)
                ratio = _routing_ratio(ref_moe, k, spec)
                if ratio is None:
                    return (vals, us), ""
                return (vals, [u * ratio(T) for T, u in zip(vals[0], us)]), f" (uniform routing by {ref_name}'s ratio)"

            def measured(f, tp_, ep_):
                """((axes, microseconds) for a Grid, note, exact) from the tables of format f at
                sharding (tp_, ep_): this shape's table, else the nearest shape's scaled by the
                estimate's ratio over ts; None without either."""
                key = f"{f}/{ev.hidden_size}/{m.moe_intermediate_size}/{m.num_experts_per_tok}/{m.num_experts}/{tp_}/{ep_}"
                if key in mt and m.mlp_gated:
                    got_, note = reading(key, ev)
                    return got_, key + note, True
                # (the tables' experts are gated, SwiGLU's: a squared-ReLU model's own shape is
                # read as a gated one's and scaled like a neighbour's)
                ref = (key, ev) if key in mt else _nearest_moe_table(mt, f, ev, tp_, ep_)
                if ref is None:
                    return None
                rkey, rspec = ref[0], replace(ref[1], mlp_gated=True)
                (vals, us), note = reading(rkey, rspec)
                rgrid = Grid(vals, us, None)
                lo, hi = vals[0][0], vals[0][-1]
                mine = _kernel_shape(ev, moe_doc.get("kernels", {}).get(f, ""), f,
                                     1 if ep_ > 1 else tp_)
                out = []
                for T in ts:
                    q = min(max(T, lo), hi)
                    out.append(rgrid(q)[0] * estimate(mine, T)[0] / estimate(rspec, q)[0])
                return ([ts], out), f"scaled from {rkey}{note}", False

            got = measured(fmt, mtp, mep) if fmt else None
            if got is None and fmt and self.expert_parallel:
                # No table of this format split whole over the ranks (a shape measured with the
                # experts sliced only): its sliced table (moe_tp = ranks), times what splitting
                # whole costs over slicing in the bf16 tables, which have both, at each T.
                parts = (measured(fmt, self.moe_ranks, 1), measured("bf16", 1, self.moe_ranks),
                         measured("bf16", self.moe_ranks, 1))
                if all(x is not None for x in parts):
                    def over_ts(x):  # a reading at each T of ts (a scaled one already is)
                        (axes, us), _note, exact = x
                        return [Grid(axes, us, None)(T)[0] for T in ts] if exact else us
                    sliced, ep_b, tp_b = map(over_ts, parts)
                    got = (([ts], [u * e / t for u, e, t in zip(sliced, ep_b, tp_b)]),
                           f"{parts[0][1]} x bf16 EP/TP ({parts[1][1]} over {parts[2][1]})", False)
            # The routing (router logits to top-k ids and weights) is in a table measured through
            # vLLM's FusedMoE layer, which the collector calls on router logits; the earlier
            # collector's tables (kernel `vllm_fused_moe`: A100's, B200's Triton ones) timed
            # fused_experts on precomputed top-k ids, and the estimate is the experts' GEMMs alone.
            kern = moe_doc.get("kernels", {}).get(fmt, "") if fmt else ""
            self._moe_unrouted = got is None or kern == "vllm_fused_moe"
            if got is not None:
                (axes, us), cov["moe"], exact = got
                # the tables' microbenchmark clocks: a step's grouped GEMMs are as compute-bound
                # as its dense ones at the same token count (Overheads.gemm_compute_slowdown)
                us = [u * self.ovh.gemm_factor(T) for T, u in zip(axes[0], us)]
                self.g_moe = Grid(axes, us, self._moe_roof, None if exact else [False] * len(axes[0]))
            else:
                moe, ok_m = [], []
                for T in ts:
                    t, ok = estimate(m, T)
                    moe.append(t)
                    ok_m.append(ok)
                cov["moe"] = "dense GEMM tables" if ge is not None else None
                self.g_moe = Grid([ts], moe, self._moe_roof, ok_m)
        # Linear attention (Gated DeltaNet) of a hybrid's linear layers, for this GPU's heads: the
        # `linear_attention` tables (calibration/convert_kernel_tables.py --linear-attention):
        # prefill by batch x tokens per sequence, decode by batch, each the conv1d and the delta
        # rule's kernels together; the roofline without them (counted as fallbacks), and for every
        # Mamba-2 layer (the tables hold the delta rule's kernels only).
        if m.num_linear_layers:
            la = (tables or {}).get("linear_attention", {})
            lkey = (f"{m.linear_num_k_heads // tp}/{m.linear_num_v_heads // tp}/"
                    f"{m.linear_k_head_dim}/{m.linear_v_head_dim}")
            for phase, roof, attr, axes in (("context", self._gdn_ctx_roof, "g_gdn_ctx",
                                             [_log_grid(1, 4096, 1), _log_grid(1, 262144, 1)]),
                                            ("generation", self._gdn_gen_roof, "g_gdn_gen", [_log_grid(1, 4096, 1)])):
                tab = la.get(phase, {}).get(lkey) if not m.linear_kind else None  # (the delta rule's only)
                if tab is not None:
                    setattr(self, attr, Grid(tab["values"], tab["us"], roof))
                else:
                    pts = np.array(np.meshgrid(*axes, indexing="ij")).reshape(len(axes), -1).T
                    us = np.array([roof(*q) * 1e6 for q in pts]).reshape([len(a) for a in axes])
                    setattr(self, attr, Grid(axes, us.tolist(), roof, np.zeros(us.shape, dtype=bool)))
                cov[f"linear_attention_{phase}"] = lkey if tab is not None else None
        if m.index_topk:  # the sparse attention's indexer: no table, the roofline (_indexer_roof)
            cov["sparse_attention_indexer"] = None
        # Attention for this GPU's heads; sliding-window layers of another shape (Gemma-4, MiMo-V2)
        # from their own tables
        for phase, attr in (("context", "g_ctx"), ("generation", "g_gen")):
            grid, cov[f"{phase}_attention"] = self._attention_grid(tables, phase, self.kv_heads, self.attn_head_dim)
            setattr(self, attr, grid)
            if self._mla_key and phase == "context":
                section, key = self._mla_key.split("/", 1)
                doc = tables[section]
                mt = doc["context"][key]
                us = [[None if u is None else u * self.ovh.gemm_factor(b * s) for s, u in zip(mt["values"][1], row)]
                      for b, row in zip(mt["values"][0], mt["us"])]
                self.g_ctx = Grid(mt["values"], us, self._mla_layer_roof)
                kernel = doc["kernels"]["context"][key.split("/")[0]] if section == "mla_module" else doc["kernel"]
                cov["context_attention"] = f"{section} {key} ({kernel})"
        self.g_ctx_sw = self.g_gen_sw = None
        if m.has_sliding_shape:
            kv, hd = m.kv_heads_per_gpu(tp, sliding=True), m.attention_shape(sliding=True)[1]
            self.g_ctx_sw, cov["sliding_context_attention"] = self._attention_grid(tables, "context", kv, hd)
            self.g_gen_sw, cov["sliding_generation_attention"] = self._attention_grid(tables, "generation", kv, hd)
        # All-reduce by message elements: inside CUDA graphs (g_ar), and outside them (g_ar_eager,
        # the `allreduce_eager` table: a step of more tokens than vLLM captures, see _by_tokens;
        # None where the tables have no such table, and g_ar serves both).
        self.g_ar = self.g_ar_eager = None
        # release (major, minor) -> (its name, its graph grid, its eager grid: the main one where
        # that release has none); set_sampling picks one by the deployment's release
        self._ar_releases = {}
        if tp > 1:
            eager = (tables or {}).get("allreduce_eager", {}).get("tables", {}).get(str(tp))
            if eager is not None:
                self.g_ar_eager = Grid(eager["values"], eager["us"], self._ar_roof)
            cov["allreduce_eager"] = eager is not None
            for rel, doc in (tables or {}).get("allreduce_releases", {}).items():
                g, e = doc.get("tables", {}).get(str(tp)), doc.get("eager_tables", {}).get(str(tp))
                if g is not None:
                    self._ar_releases[vllm_version_tuple(rel)] = (
                        rel, Grid(g["values"], g["us"], self._ar_roof),
                        self.g_ar_eager if e is None else Grid(e["values"], e["us"], self._ar_roof))
            tab = (tables or {}).get("allreduce", {}).get("tables", {}).get(str(tp))
            if tab is not None:
                self.g_ar = Grid(tab["values"], tab["us"], self._ar_roof)
            else:
                ns = _log_grid(128, 1 << 30, 1)
                self.g_ar = Grid([ns], [self._ar_roof(n) * 1e6 for n in ns], self._ar_roof,
                                 np.zeros(len(ns), dtype=bool))
            cov["allreduce"] = tab is not None
        self.coverage = cov

    def to_reduced(self) -> dict:
        r = {"g_layer": self.g_layer.to_json(), "g_head": self.g_head.to_json(),
             "g_ctx": self.g_ctx.to_json(), "g_gen": self.g_gen.to_json(),
             "coverage": self.coverage, "sources": self.source}
        if self.g_ar is not None:
            r["g_ar"] = self.g_ar.to_json()
        if self.g_ar_eager is not None:
            r["g_ar_eager"] = self.g_ar_eager.to_json()
        if self._ar_releases:
            r["g_ar_releases"] = {name: {"g_ar": g.to_json(), **({"g_ar_eager": e.to_json()} if e else {})}
                                  for _rel, (name, g, e) in sorted(self._ar_releases.items())}
        if self.g_moe is not None:
            r["g_moe"] = self.g_moe.to_json()
            if self._moe_unrouted:
                r["moe_unrouted"] = True
        if self.g_gdn_ctx is not None:
            r["g_gdn_ctx"], r["g_gdn_gen"] = self.g_gdn_ctx.to_json(), self.g_gdn_gen.to_json()
        if self.g_mla_proj is not None:
            r["g_mla_proj"], r["mla_key"] = self.g_mla_proj.to_json(), self._mla_key
        if self.g_ctx_sw is not None:
            r["g_ctx_sw"], r["g_gen_sw"] = self.g_ctx_sw.to_json(), self.g_gen_sw.to_json()
        return r

    def _from_reduced(self, r: dict) -> None:
        self.g_layer = Grid.from_json(r["g_layer"], self._layer_roof)
        self.g_head = Grid.from_json(r["g_head"], self._head_roof)
        self.g_ctx = Grid.from_json(r["g_ctx"], self._ctx_roof)
        self.g_gen = Grid.from_json(r["g_gen"], self._gen_roof)
        self.g_ar = Grid.from_json(r["g_ar"], self._ar_roof) if "g_ar" in r else None
        self.g_ar_eager = Grid.from_json(r["g_ar_eager"], self._ar_roof) if "g_ar_eager" in r else None
        self._ar_releases = {vllm_version_tuple(rel): (rel, Grid.from_json(x["g_ar"], self._ar_roof),
                                                       Grid.from_json(x["g_ar_eager"], self._ar_roof)
                                                       if "g_ar_eager" in x else self.g_ar_eager)
                             for rel, x in r.get("g_ar_releases", {}).items()}
        self.g_moe = Grid.from_json(r["g_moe"], self._moe_roof) if "g_moe" in r else None
        # (a profile reduced before the flag existed: an estimated MoE layer, which has no table, is
        # known by its coverage; one read from an earlier collector's table is not)
        self._moe_unrouted = bool(r.get("moe_unrouted", "g_moe" in r and r.get("coverage", {}).get("moe")
                                        in (None, "dense GEMM tables")))
        if "g_mla_proj" in r:
            self._mla_key = r["mla_key"]
            self.g_mla_proj = Grid.from_json(r["g_mla_proj"], self._mla_proj_roof)
            self.g_ctx = Grid.from_json(r["g_ctx"], self._mla_layer_roof)
        if "g_gdn_ctx" in r:
            self.g_gdn_ctx = Grid.from_json(r["g_gdn_ctx"], self._gdn_ctx_roof)
            self.g_gdn_gen = Grid.from_json(r["g_gdn_gen"], self._gdn_gen_roof)
        elif self.model.num_linear_layers:
            raise ValueError(f"a kernel profile of {self.model.name} without its linear-attention grids "
                             "(made before ServeTwin timed them): regenerate it")
        self.g_ctx_sw = self.g_gen_sw = None
        if "g_ctx_sw" in r:
            kv, hd = self.model.kv_heads_per_gpu(self.tp, sliding=True), self.model.attention_shape(sliding=True)[1]
            self.g_ctx_sw = Grid.from_json(r["g_ctx_sw"], self._attention_roof("context", kv, hd))
            self.g_gen_sw = Grid.from_json(r["g_gen_sw"], self._attention_roof("generation", kv, hd))
        elif self.model.has_sliding_shape:
            raise ValueError(f"a kernel profile of {self.model.name} without its sliding layers' attention grids "
                             "(made before ServeTwin timed them): regenerate it")
        self.coverage = r.get("coverage", {})
        self.source = r.get("sources", {})

    def _step_gemms(self) -> list:
        """The layer GEMMs the GEMM term sums (ModelSpec.step_gemms), less the attention
        projections when an MLA layer table times them with its attention (_mla_key)."""
        gemms = self.model.step_gemms(self.tp)
        if self._mla_key:
            proj = set(self.model.attention_gemm_shapes(self.tp))
            gemms = [g for g in gemms if g[0] not in proj]
        return gemms

    def _layer_roof(self, M):
        m = self.model
        return sum(layers / m.num_layers * self._gemm_roof(dtype)(M, n, k)
                   for _name, n, k, layers, dtype in self._step_gemms())

    def _mla_flash_floor(self, b, s) -> float:
        """The least an MLA prefill's attention takes: FlashAttention over the decompressed keys
        (query-key dims qk_nope + qk_rope, value dims v_head_dim) for b causal sequences of s
        tokens (each query at most index_topk keys with sparse attention), at the GPU's peak."""
        m = self.model
        keys = min(s, 2.0 * m.index_topk) if m.index_topk else s
        return b * s * keys * self.q_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) / self.device.flops

    def _mla_layer_roof(self, b, s):
        """A measured MLA layer table's roofline: the attention's and its projections' of b x s
        tokens (an indexer's in every layer, as the table was measured)."""
        return self._ctx_roof(b, s) + self._mla_proj_roof(b * s, per_layer_share=False)

    def _mla_proj_roof(self, M, per_layer_share: bool = True):
        """One MLA layer's projections for M tokens by the roofline, the indexer's at the share of
        layers that keep one (_proj_share; per_layer_share False: in every layer)."""
        m = self.model
        return sum((self._proj_share(name) if per_layer_share else 1.0) * self._gemm_roof(m.attn_dtype)(M, n, k)
                   for name, (n, k) in m.attention_gemm_shapes(self.tp).items())

    def _index_proj_roof(self, M):
        """The sparse-attention indexer's projections (INDEXER_GEMMS) for M tokens, by the roofline."""
        m = self.model
        return sum(self._gemm_roof(m.attn_dtype)(M, n, k)
                   for name, (n, k) in m.attention_gemm_shapes(self.tp).items() if name in INDEXER_GEMMS)

    def _proj_share(self, name: str) -> float:
        """The share of the latent-attention layers that run an attention projection: the
        sparse-attention indexer's (INDEXER_GEMMS) only in those with an indexer of their own, every
        other one in all."""
        m = self.model
        return m.index_layers / m.num_full_attention_layers if name in INDEXER_GEMMS else 1.0

    def _moe_roof(self, T):
        """One MoE layer's routed experts for T tokens, by the roofline (see _build)."""
        m = self.model
        roof = self._gemm_roof(m.expert_dtype or m.weight_dtype)
        return sum(roof(*g) for g in _grouped_expert_gemms(m, T, self.moe_ranks))

    def _indexer_roof(self, pairs: float, rows: float, keys: float) -> float:
        """One layer's sparse-attention indexer by the roofline (no table holds it): the scores of
        `pairs` (query, earlier token) pairs over index_n_heads heads of index_head_dim in the
        keys' dtype (fp8, or 16-bit for MiniMax-M3's; on every TP rank: its projections are
        replicated), reading `keys` cached keys (with their scales), writing each pair's fp32 score
        and reading it back for the top-k, and the `rows` queries' top-k indices. A decode reads
        each of its sequence's keys (keys = pairs); a prefill chunk's queries share them (keys: its
        context once)."""
        m, d = self.model, self.device
        pairs, keys = pairs / m.index_pool, keys / m.index_pool  # (a key pool: one pooled key per index_pool)
        flops = 2.0 * pairs * m.index_n_heads * m.index_head_dim
        by = keys * m.index_key_bytes + pairs * 8 + rows * m.index_topk * 4
        return max(flops / d.peak_flops(m.index_key_dtype), by / d.mem_bandwidth) + 5e-6

    def _roofline_term(self, term: str, seconds: float) -> float:
        """A term no kernel table holds, by its roofline: counted as a lookup and a fallback."""
        self.lookups += 1
        self.fallbacks[term] = self.fallbacks.get(term, 0) + 1
        return seconds

    def _gdn_ctx_roof(self, b, s):
        """One linear-attention layer's prefill kernels for b sequences of s new tokens, by the
        roofline: the conv1d (taps x channels per token) and the chunked delta rule (per token and
        value head, the state's k x v products both ways and a chunk of 64 tokens' k and v), over
        reading the chunk's q, k, v and writing its output, and each sequence's state read and
        written."""
        m, tp, d = self.model, self.tp, self.device
        T = b * s
        hv, dk, dv = m.linear_num_v_heads // tp, m.linear_k_head_dim, m.linear_v_head_dim
        conv = m.linear_conv_dim(tp)
        flops = T * (2 * conv * m.linear_conv_kernel + hv * (4 * dk * dv + 2 * GDN_CHUNK * (dk + dv)))
        by = (T * (2 * conv + hv * dv) * m.act_dtype_bytes
              + 2 * b * hv * dk * dv * DTYPE_BYTES[m.linear_state_dtype])
        return max(flops / d.flops, by / d.mem_bandwidth) + 5e-6

    def _gdn_gen_roof(self, n):
        """One linear-attention layer's decode kernels for n sequences, by the roofline: each
        sequence's state (the conv window and the k x v matrices) read and written once."""
        m, tp, d = self.model, self.tp, self.device
        st = m.linear_state_bytes_per_request_per_gpu(tp) / m.num_linear_layers
        return 2 * n * st / d.mem_bandwidth + 5e-6

    def _head_roof(self, M):
        return self._gemm_roof(self.model.act_dtype)(M, -(-self.model.vocab_size // self.tp), self.model.hidden_size)

    # ------------------------------------------------------------------ lookups
    def _look(self, term: str, grid: Grid, *q) -> float:
        fast = grid._fast
        t, exact = fast(*q) if fast is not None else grid(*q)
        self.lookups += 1
        if not exact:
            self.fallbacks[term] = self.fallbacks.get(term, 0) + 1
            r = self.fallback_range.get(term)
            if r is None:
                self.fallback_range[term] = [list(q), list(q)]
            else:
                r[0] = [min(a, b) for a, b in zip(r[0], q)]
                r[1] = [max(a, b) for a, b in zip(r[1], q)]
            if term not in self._warned:
                self._warned.add(term)
                cov = getattr(self, "coverage", None) or {}
                derived = (term == "gemm" and cov.get("gemm_derived")) or (
                    term == "moe" and any(w in str(cov.get("moe")) for w in ("scaled from", " x bf16 ")))
                how = "a table derived from another shape or format (table_coverage) " if derived else ""
                warnings.warn(f"kernel cost model ({self.model.name} on {self.device.name}, tp={self.tp}): "
                              f"{term} at {tuple(round(x, 1) for x in q)} is outside the measured kernel "
                              f"table; using {how or 'the roofline scaled to the nearest measured point '}"
                              "(counted in fallbacks)", stacklevel=3)
        return t * 1e-6

    def _elementwise(self, T: int) -> float:
        """Small memory-bound kernels of one layer (each at least a launch inside a graph)."""
        m, tp = self.model, self.tp
        a, lat, bw = m.act_dtype_bytes, self.ovh.elementwise_latency_s, self.device.mem_bandwidth
        h = m.hidden_size
        # the MLP's activation width per token, averaged over layer kinds (MoE: top-k experts' and
        # the shared experts' intermediate)
        moe_w = m.num_experts_per_tok * m.moe_intermediate_size + m.shared_intermediate_size
        width = ((m.mlp_layers - m.num_moe_layers) * m.intermediate_size + m.num_moe_layers * moe_w) / m.num_layers
        norms = m.num_sublayers / m.num_layers  # fused add + RMSNorm per mixer and per MLP
        kernels = [(m.up_factor + 1) * T * width / tp * a]       # SiLU * mul (squared ReLU: in place)

        def attn(kv: int, hd: int) -> float:  # one attention layer's, for kv KV heads of hd
            if m.compressed_mqa:  # one latent (key and value alike), rotated in its rope dims only
                qk, write = (self.q_heads + kv) * m.qk_rope_head_dim, T * kv * hd * a + T * m.latent_entry_bytes
            else:
                qk, write = (self.q_heads + kv) * hd, T * kv * (hd + self._v_dim(hd)) * (a + m.kv_dtype_bytes)
            ks = [write]                                         # KV write
            if m.rotary:
                ks += [2 * T * qk * a]                           # RoPE on q and k
            if m.qk_norm:
                ks += [2 * T * qk * a]
            return sum(max(lat, b / bw) for b in ks)
        # the attention layers' kernels, averaged over the layers (a hybrid's linear layers have
        # none; sliding-window layers of their own shape theirs)
        own = m.num_sliding_layers if m.has_sliding_shape else 0
        layers = (m.num_attention_layers - own) * attn(self.kv_heads, self.attn_head_dim)
        if own:
            layers += own * attn(m.kv_heads_per_gpu(tp, sliding=True), m.attention_shape(sliding=True)[1])
        # (hyper-connections: each sublayer's residual mixing reads and writes residual_streams copies)
        return (norms * max(lat, 3 * T * h * a * m.residual_streams / bw) + sum(max(lat, b / bw) for b in kernels)
                + layers / m.num_layers)

    def gpu_time_fn(self) -> Callable[[BatchFeatures], float]:
        return self.gpu_time

    def cpu_time_fn(self) -> Callable[[BatchFeatures], float]:
        return self.cpu_time

    def decode_gpu_time_fn(self) -> Callable[[int, int], float]:
        return self.decode_gpu_time

    def decode_cpu_time_fn(self) -> Callable[[int, int], float]:
        return self.decode_cpu_time

    def gpu_time(self, f: BatchFeatures) -> float:
        """sum(breakdown(f).values()): the kernels' time x serving_slowdown, plus the TP group's
        per-step coordination (Overheads); _kernel_time itself when both are neutral."""
        t = self._kernel_time(f)
        return t * self.ovh.serving_slowdown + self._tp_step if t else 0.0

    def set_group_tokens(self, num_tokens: int | None) -> None:
        self._group_tokens = num_tokens if self.dp > 1 else None

    def dp_pads(self, num_tokens: int) -> bool:
        """Whether vLLM pads every data-parallel rank to the group's largest (num_tokens) in this
        step. From vLLM 0.16 (vllm-project/vllm#34102, February 2026) only where that rank runs
        in a CUDA graph, up to cudagraph_max_tokens tokens, prefill or decode (vLLM captures no
        larger batch); before, in every step while CUDA graphs are on at all (the default), long
        prefill chunks included (vllm/v1/worker/dp_utils.py: padding allowed by the compilation
        config's cudagraph mode). vLLM pads to the graph size above it (a few tokens more); the
        raw count is taken here. Only the MoE layers' tokens are padded here: each rank's dense
        layers and attention are still timed at its own tokens."""
        return self._dp_pads_every_step or num_tokens <= self.ovh.cudagraph_max_tokens

    def _kernel_time(self, f: BatchFeatures) -> float:
        """The step's kernel time, as the tables (and the launch floor) give it."""
        if (not f.num_prefill_tokens and not f.num_prefill_reqs and f.num_decode_reqs
                and self._group_tokens is None):
            return self._decode_kernel_time(f.num_decode_reqs, f.decode_context_tokens)
        T = f.num_prefill_tokens + f.num_decode_reqs
        if T == 0:
            return 0.0
        L = self.model.num_layers
        tk = self._by_tokens(T)
        att = self._attention(f)
        S = f.num_decode_reqs + f.num_prefill_reqs
        ar = tk["allreduce"]
        head = sampler = 0.0
        if S:
            head, sampler, gather = self._by_rows(S)
            ar += gather
        t = 0 + tk["gemm"] + tk["moe"] + tk.get("moe_routing", 0.0) + tk.get("moe_dispatch", 0.0) + tk["elementwise"] + ar + att + head + sampler
        floor = self.ovh.launch_floor(T, f.num_prefill_reqs, L)
        return floor if floor > t else t

    def breakdown(self, f: BatchFeatures) -> dict[str, float]:
        """Seconds of each GPU term of the step (their sum is gpu_time)."""
        T = f.num_prefill_tokens + f.num_decode_reqs
        if T == 0:
            return {}
        L = self.model.num_layers
        out = dict(self._by_tokens(T))
        out["attention"] = self._attention(f)
        # Rows that sample: every decode, and (an upper bound) every prefill chunk.
        S = f.num_decode_reqs + f.num_prefill_reqs
        out["lm_head"] = out["sampler"] = 0.0
        if S:
            head, sampler, gather = self._by_rows(S)
            out["lm_head"], out["sampler"] = head, sampler
            out["allreduce"] += gather
        floor = self.ovh.launch_floor(T, f.num_prefill_reqs, L)
        if floor:  # the host's launches may outlast the kernels
            out["eager_launch"] = max(0.0, floor - sum(out.values()))
        if not self._plain:
            out = {k: v * self.ovh.serving_slowdown for k, v in out.items()}
            out["tp_step"] = self._tp_step
        return out

    def decode_gpu_time(self, n: int, ctx: int) -> float:
        """gpu_time of a step of n decodes reading ctx KV tokens (see _decode_kernel_time)."""
        return self._decode_kernel_time(n, ctx) * self.ovh.serving_slowdown + self._tp_step

    def _decode_kernel_time(self, n: int, ctx: int) -> float:
        """The kernel time of a step of n decodes reading ctx KV tokens: the terms that depend on n
        alone are memoised as one sum (counters replayed), the attention is looked up.

        A simulated run asks this for most of its steps, so the attention lookup takes the grid's
        row at n from the memo (Grid.on_row, the same float as a lookup); a query that is not
        exact there (outside the measured axes, or an unmeasured corner) goes through _look
        (fallback count, warning)."""
        hit = self._memo_d.get(n)
        if hit is None:
            hit = self._decode_terms(n)  # counts its lookups as it makes them
        elif hit[3]:
            self.lookups += hit[3]
            if hit[4]:
                for k, v in hit[4].items():
                    self.fallbacks[k] += v
        pre, head, sampler, _n, _fb, row = hit
        y = ctx / n
        if y < 1.0:
            y = 1.0
        m = self.model
        if (m.num_sliding_layers and y > m.sliding_window) or m.index_topk or self.g_gen_sw is not None \
                or m.compressed_mqa:
            return pre + self._decode_attention(n, y) + head + sampler
        A = m.num_attention_layers
        if row is not None:
            t, exact = self.g_gen.on_row(row, n, y)
            if exact:
                self.lookups += 1
                return pre + (0.0 + A * (t * 1e-6)) + head + sampler
        att = 0.0 + A * self._look("generation_attention", self.g_gen, n, y)
        return pre + att + head + sampler

    def _decode_attention(self, n: int, y: float) -> float:
        """Attention of n decodes reading y KV tokens each, every attention layer: sliding-window
        layers read at most their window, sparse attention at most its top-k latents after its
        indexer scored all y (linear-attention layers: _decode_terms)."""
        m = self.model
        full = m.num_full_attention_layers
        if m.compressed_mqa:
            return self._compressed_attention(n, n * y, min(y, float(m.sliding_window)), y, n * y)
        if m.index_topk:  # sparse attention: the attention reads the top-k; the indexer all
            sparse = m.sparse_attention_layers
            att = (sparse * self._look("generation_attention", self.g_gen, n, min(y, float(m.index_topk)))
                   + m.index_layers * self._roofline_term("indexer", self._indexer_roof(n * y, n, n * y)))
            if full > sparse:  # (MiniMax-M3's layers without an indexer)
                att += (full - sparse) * self._look("generation_attention", self.g_gen, n, y)
            return att
        att = full * self._look("generation_attention", self.g_gen, n, y) if full else 0.0
        if m.num_sliding_layers:
            grid = self.g_gen if self.g_gen_sw is None else self.g_gen_sw
            att += m.num_sliding_layers * self._look("generation_attention", grid, n,
                                                     max(min(y, float(m.sliding_window)), 1.0))
        return att

    def _compressed_attention(self, rows: float, pairs: float, window: float, ctx: float, keys: float,
                              prefill: bool = False) -> float:
        """DeepSeek-V4's attention over every layer for `rows` sequences (decodes, or prefill
        chunks) whose queries make `pairs` (query, earlier token) pairs, a query `ctx` of them on
        average: each layer reads its window's raw latents (at most sliding_window a query); a
        CSA layer also the index_topk compressed entries its indexer picks of one per csa_ratio
        tokens, after the indexer scored them all (`keys`: the cached tokens its scoring reads);
        an HCA layer every entry of one per hca_ratio tokens. Read from the attention table (one
        KV head of head_dim) at those lengths: a decode's keys per query, a prefill chunk's causal
        length sqrt(2 x pairs / chunks) at the pairs each kind sees."""
        m = self.model
        phase, grid = ("context_attention", self.g_ctx) if prefill else ("generation_attention", self.g_gen)
        per_query = pairs / max(ctx, 1.0)  # the queries
        csa = window + min(ctx / m.csa_ratio, float(m.index_topk))
        hca = window + ctx / m.hca_ratio

        def look(keys_per_query: float) -> float:
            if prefill:
                return self._look(phase, grid, rows, max(math.sqrt(2.0 * per_query * keys_per_query / rows), 1.0))
            return self._look(phase, grid, rows, max(keys_per_query, 1.0))
        swa = m.num_layers - m.num_csa_layers - m.num_hca_layers
        att = swa * look(window) if swa else 0.0
        if m.num_csa_layers:
            att += m.num_csa_layers * (look(csa) + self._roofline_term("indexer", self._indexer_roof(
                pairs / m.csa_ratio, per_query, keys / m.csa_ratio)))
        if m.num_hca_layers:
            att += m.num_hca_layers * look(hca)
        return att

    def _attention(self, f: BatchFeatures) -> float:
        """The step's attention kernels over every layer. Prefill chunks are read from the context
        table at the causal length with the chunks' query-key pairs (sqrt(2 x pairs / chunks)); in
        a sliding-window layer a query sees at most the window's keys, so its pairs are at most
        prefill tokens x window. A hybrid's linear-attention layers run their own kernels: prefill
        by the chunks' batch and mean length, decode by the batch."""
        m, att = self.model, 0.0
        if m.num_linear_layers:
            if f.num_prefill_reqs:
                att += m.num_linear_layers * self._look("linear_attention", self.g_gdn_ctx, f.num_prefill_reqs,
                                                        max(f.num_prefill_tokens / f.num_prefill_reqs, 1.0))
            if f.num_decode_reqs:
                att += m.num_linear_layers * self._look("linear_attention", self.g_gdn_gen, f.num_decode_reqs)
        if f.num_prefill_reqs and m.compressed_mqa:
            b = f.num_prefill_reqs
            pairs, T = f.prefill_attn_pairs, f.num_prefill_tokens
            att += self._compressed_attention(b, pairs, min(pairs / T, float(m.sliding_window)),
                                              pairs / T, f.prefill_context_tokens + T, prefill=True)
        elif f.num_prefill_reqs:
            b = f.num_prefill_reqs
            full = m.num_full_attention_layers
            if full and self.g_mla_proj is not None:
                # vLLM's measured MLA layer (mla_module; dsa_module with sparse attention, its
                # indexer included) at the chunks' causal length holds the projections of b x s
                # tokens: its attention is what is left above them (at least the attention's work
                # at peak), and the projections are the chunks' own tokens'
                s = max(math.sqrt(2.0 * f.prefill_attn_pairs / b), 1.0)
                layer = self._look("context_attention", self.g_ctx, b, s)
                own = self._look("gemm", self.g_mla_proj, b * s)  # at the layers' share of the indexer's
                shared = full - m.index_layers if m.index_topk else 0
                if shared:  # the table's layer was measured with an indexer's projections in every layer
                    own += shared / full * self._index_proj_roof(b * s)
                floor = self._mla_flash_floor(b, s)
                att += full * (max(layer - own, floor) + self._look("gemm", self.g_mla_proj, f.num_prefill_tokens))
                if shared:
                    # and its scoring: a layer that shares an indexer does not score (the
                    # roofline, a lower bound of what the table holds of it)
                    att -= shared * min(self._indexer_roof(
                        f.prefill_attn_pairs, f.num_prefill_tokens, f.prefill_context_tokens + f.num_prefill_tokens),
                        max(layer - own - floor, 0.0))
            elif full and m.index_topk:
                # sparse attention: each query reads at most top-k keys; the indexer scores
                # every earlier token (layers without an indexer: all pairs)
                sparse = m.sparse_attention_layers
                pairs = min(f.prefill_attn_pairs, f.num_prefill_tokens * m.index_topk)
                s = math.sqrt(2.0 * pairs / b)
                if full > sparse:
                    att += (full - sparse) * self._look("context_attention", self.g_ctx, b,
                                                        max(math.sqrt(2.0 * f.prefill_attn_pairs / b), 1.0))
                att += (sparse * self._look("context_attention", self.g_ctx, b, max(s, 1.0))
                        + m.index_layers * self._roofline_term("indexer", self._indexer_roof(
                            f.prefill_attn_pairs, f.num_prefill_tokens,
                            f.prefill_context_tokens + f.num_prefill_tokens)))
            elif full:
                s = math.sqrt(2.0 * f.prefill_attn_pairs / b)
                att += full * self._look("context_attention", self.g_ctx, b, max(s, 1.0))
            if m.num_sliding_layers:
                pairs = min(f.prefill_attn_pairs, f.num_prefill_tokens * m.sliding_window)
                s = math.sqrt(2.0 * pairs / b)
                grid = self.g_ctx if self.g_ctx_sw is None else self.g_ctx_sw
                att += m.num_sliding_layers * self._look("context_attention", grid, b, max(s, 1.0))
        if f.num_decode_reqs:
            att += self._decode_attention(f.num_decode_reqs, max(f.decode_context_tokens / f.num_decode_reqs, 1.0))
            if self.g_mla_proj is not None:  # the decode tokens' MLA projections (_mla_key)
                att += m.num_full_attention_layers * self._look("gemm", self.g_mla_proj, f.num_decode_reqs)
        return att

    def _decode_terms(self, n: int) -> tuple:
        """decode_gpu_time's memo entry for n decodes: (GEMM, elementwise and all-reduce sum, LM head,
        sampler, lookups and fallbacks to replay, the attention grid's row at batch n or None)."""
        before = (self.lookups, dict(self.fallbacks))
        tk = self._by_tokens(n)
        head, sampler, gather = self._by_rows(n)
        pre = 0 + tk["gemm"] + tk["moe"] + tk.get("moe_routing", 0.0) + tk.get("moe_dispatch", 0.0) + tk["elementwise"] + (tk["allreduce"] + gather)
        if self.model.num_linear_layers:  # linear-attention layers: by the batch alone
            pre += self.model.num_linear_layers * self._look("linear_attention", self.g_gdn_gen, n)
        if self.g_mla_proj is not None:  # MLA projections outside the GEMM term (_mla_key)
            pre += self.model.num_full_attention_layers * self._look("gemm", self.g_mla_proj, n)
        num_lookups, fallbacks = self._delta(before)
        grid = self.g_gen
        row = grid.row(n) if grid._fast == grid._call2 else None
        hit = (pre, head, sampler, num_lookups, fallbacks, row)
        if len(self._memo_d) < 65536:
            self._memo_d[n] = hit
        return hit

    def decode_step_time(self, n: int, ctx: int) -> float:
        """step_time of a step of n decodes reading ctx KV tokens (the simulator's fast steps ask
        this instead of building features): gpu_time plus cpu_time, as step_time adds them."""
        return self.decode_gpu_time(n, ctx) + self.decode_cpu_time(n, ctx)

    def decode_cpu_time(self, n: int, ctx: int) -> float:
        """cpu_time of a decode-only step of n requests reading ctx KV tokens; memoised per n with
        the default CpuWork, which does not depend on the context read."""
        if self.cpu_model is not None:  # a hook may read anything
            return self.cpu_model(BatchFeatures(num_reqs=n, num_decode_reqs=n, decode_context_tokens=ctx))
        c = self._memo_c.get(n)
        if c is None:
            c = self.cpu_time(BatchFeatures(num_reqs=n, num_decode_reqs=n))
            if len(self._memo_c) < 65536:
                self._memo_c[n] = c
        return c

    def _by_tokens(self, T: int) -> dict[str, float]:
        """The terms that depend on the step's token count alone (GEMMs, elementwise kernels,
        all-reduce of the hidden states), memoised: a run has few distinct token counts.

        With data-parallel attention, the MoE layers take the tokens of every rank (those
        set_group_tokens gave; else dp x T, ranks alike), gathered to every GPU of the group and
        their outputs reduced back (dispatch and combine: the volume of an all-reduce of those
        tokens' hidden states over the tp x dp GPUs, per MoE layer; `moe_dispatch`)."""
        G = self._group_tokens if self._group_tokens is not None else T * self.dp
        key = T if self.dp == 1 else (T, G)
        hit = self._memo_t.get(key)
        if hit is not None:
            self._replay(hit)
            return hit[0]
        before = (self.lookups, dict(self.fallbacks))
        m, L = self.model, self.model.num_layers
        out = {"gemm": L * self._look("gemm", self.g_layer, T)}
        out["moe"] = m.num_moe_layers * self._look("moe", self.g_moe, G) if self.g_moe is not None else 0.0
        if self._moe_unrouted:  # each MoE layer's routing kernel, which the experts' reading leaves out
            out["moe_routing"] = m.num_moe_layers * self.ovh.moe_routing_s
        if self.dp > 1:
            out["moe_dispatch"] = m.num_moe_layers * self._dispatch_roof(G)
        out["elementwise"] = L * self._elementwise(T) + max(
            self.ovh.elementwise_latency_s, T * m.hidden_size * m.act_dtype_bytes * 2 / self.device.mem_bandwidth)
        out["allreduce"] = 0.0
        if self.g_ar is not None:
            # a step of more tokens than vLLM captures in CUDA graphs runs without one, and so do
            # its all-reduces: vLLM's custom all-reduce then copies each input into its registered
            # buffer first (the eager table: 1.05-1.2x the graph time from 4 M elements on NVLink
            # GPUs, 1.3-2.9x at 1 M, 1.3-11x at 128 K and below; about 1x on L40S's PCIe from
            # 1 M, NCCL either way)
            eager = self.g_ar_eager is not None and T > self.ovh.cudagraph_max_tokens
            g_ar = self.g_ar_eager if eager else self.g_ar
            # one after each mixer and each MLP (two a layer; Nemotron-H's blocks one each), and the head's
            out["allreduce"] = (m.num_sublayers + 1) * self._look("allreduce", g_ar, T * m.hidden_size)
            if m.qk_norm_across_heads:
                # per layer, the q/k norms' partial sums (2 fp32 = 4 bf16 elements per token),
                # latency-bound: read no lower than the smallest measured message; and the extra
                # kernel that splits the norm around it
                smallest = g_ar.values[0][0]
                out["allreduce"] += L * self._look("allreduce", g_ar, max(4.0 * T, smallest))
                out["elementwise"] += L * self.ovh.elementwise_latency_s
        if len(self._memo_t) < 65536:
            self._memo_t[key] = (out, *self._delta(before))
        return out

    def _by_rows(self, S: int) -> tuple[float, float, float]:
        """(LM head, sampler, logits gather) for S sampled rows, memoised."""
        hit = self._memo_s.get(S)
        if hit is not None:
            self._replay(hit)
            return hit[0]
        before = (self.lookups, dict(self.fallbacks))
        head = self._look("lm_head", self.g_head, S)
        gather = 0.0
        if self.g_ar is not None:  # logits gathered across the TP group
            gather = self._look("allreduce", self.g_ar, S * -(-self.model.vocab_size // self.tp))
        sampler = self.ovh.sampler_s
        if self._filter_impl is not None:  # top-k/top-p over every sampled row (sim.sampling)
            sampler += filter_cost_s(self._filter_impl, S, self.model.vocab_size)
        res = (head, sampler, gather)
        if len(self._memo_s) < 65536:
            self._memo_s[S] = (res, *self._delta(before))
        return res

    def _delta(self, before) -> tuple[int, dict]:
        """Lookups and fallbacks counted since `before` (a memo entry replays them on a hit, so
        the counters read as if every step had looked its terms up)."""
        n0, fb0 = before
        return self.lookups - n0, {k: v - fb0.get(k, 0) for k, v in self.fallbacks.items() if v != fb0.get(k, 0)}

    def _replay(self, hit) -> None:
        self.lookups += hit[1]
        for k, v in hit[2].items():
            self.fallbacks[k] += v

    def cpu_time(self, f: BatchFeatures) -> float:
        """CPU work around the step: `cpu_model` if set (a hook: features -> seconds), else
        sim.cpu_work.CpuWork's defaults, the one place CPU work is modelled. `step_time` adds it
        to the GPU time (synchronous); scenarios wrap this model in sim.cpu_work.WithCpuWork,
        which takes gpu_time and this and overlaps them under async scheduling."""
        if self.cpu_model is not None:
            return self.cpu_model(f)
        if self._cpu_work is None:
            from sim.cpu_work import CpuWork
            self._cpu_work = CpuWork()
        return self._cpu_work.time(f)

    def _time(self, num_reqs, num_tokens, num_prefill_reqs, prefill_pairs, prefill_ctx, decode_ctx):
        f = BatchFeatures(num_reqs=num_reqs, num_prefill_reqs=num_prefill_reqs,
                          num_decode_reqs=num_reqs - num_prefill_reqs, prefill_context_tokens=prefill_ctx,
                          prefill_attn_pairs=prefill_pairs, decode_context_tokens=decode_ctx)
        f.num_prefill_tokens = num_tokens - f.num_decode_reqs
        return self.step_time(f)

    def step_time(self, f: BatchFeatures) -> float:
        if f.num_prefill_tokens + f.num_decode_reqs == 0:
            return 0.0
        return self.gpu_time(f) + self.cpu_time(f)

    def describe(self) -> dict:
        return {"kind": self.kind, **self.metadata, "lookups": self.lookups, "fallbacks": dict(self.fallbacks)}

    # ------------------------------------------------------------------ profiles
    def to_profile(self, extra_metadata: dict | None = None) -> dict:
        meta = {**self.metadata, **(extra_metadata or {})}
        meta["model_spec"] = {k: getattr(self.model, k) for k in self.model.__slots__}
        meta["device_spec"] = {k: getattr(self.device, k) for k in self.device.__slots__}
        return {"format": PROFILE_FORMAT, "kind": "kernels", "metadata": meta,
                "overheads": self.ovh.__dict__.copy(), "reduced_tables": self.to_reduced()}

    @classmethod
    def from_profile(cls, prof: dict) -> "KernelCostModel":
        meta = prof["metadata"]
        ovh = dict(prof.get("overheads") or {})
        # a profile reduced before gemm_compute_slowdown existed holds the tables as measured
        ovh.setdefault("gemm_compute_slowdown", 1.0)
        return cls(meta["model_spec"], meta["device_spec"], meta["tp"], ovh,
                   reduced=prof["reduced_tables"], expert_parallel=bool(meta.get("expert_parallel")),
                   data_parallel=int(meta.get("data_parallel", 1)),
                   sampling=meta.get("sampling", "model_default"), vllm_version=meta.get("vllm_version"))


# ---------------------------------------------------------------------- shipped profiles
SHIPPED = [  # (device, model, tp): each in bf16 and fp8 weights (KV bf16, as vLLM's default)
    ("h100-sxm", "llama-3.1-8b", 1), ("h100-sxm", "llama-3.1-70b", 4), ("h100-sxm", "qwen3-32b", 2),
    ("h200", "llama-3.1-8b", 1), ("h200", "llama-3.1-70b", 4), ("h200", "qwen3-32b", 2),
]


def profile_name(device: str, model: ModelSpec, tp: int) -> str:
    """device-[tpN-]model[-fp8|-fp8block][-kvfp8], the name the scenario loader looks for by default
    (another weight format gets a suffix of its own, e.g. -int4 or -nvfp4, which no shipped profile
    has, so the kernel tables time it)."""
    return (f"{device}-" + (f"tp{tp}-" if tp > 1 else "") + model.name
            + {"bfloat16": "", "float16": "", "fp8": "-fp8", "fp8_block": "-fp8block"}.get(
                model.weight_dtype, "-" + model.weight_dtype.replace("_", ""))
            + ("-kvfp8" if model.kv_dtype == "fp8" else ""))


def write_profiles(out_dir: Path | None = None) -> list[Path]:
    """The shipped kernel-table profiles (sim/profiles/), from calibration/kernels/."""
    import datetime
    out_dir = Path(out_dir or Path(__file__).parent / "profiles")
    prov = (KERNELS_DIR / "PROVENANCE.md").name
    written = []
    for dev, name, tp in SHIPPED:
        for wd in ("bfloat16", "fp8"):
            model = get_model(name).with_dtypes(weight_dtype=wd)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                k = KernelCostModel(model, dev, tp)
            prof = k.to_profile({
                "made": datetime.date.today().isoformat(), "synthetic": False,
                "provenance": f"calibration/kernels/{prov}: NVIDIA AIConfigurator perf database "
                              "(aisimulate 0.13.0.dev202610270000000085, Apache-2.0), vLLM kernels "
                              "measured on this GPU; reduced to this deployment by sim/kernel_model.py",
                "error_is": "kernel times not fitted to any serving result; two overheads (elementwise_latency_s, "
                            "eager_layer_launch_s) chosen against the allowed vLLM B200 serving rows, and "
                            "gemm_compute_slowdown measured on an H200 (see Overheads); see "
                            "bench/silicon_check.py for end-to-end checks"})
            p = out_dir / f"{profile_name(dev, model, tp)}.json"
            with open(p, "w") as f:
                json.dump(prof, f, separators=(",", ":"))
            written.append(p)
    return written


if __name__ == "__main__":  # python -m sim.kernel_model: rewrite the shipped profiles
    for p in write_profiles():
        print(p, f"{p.stat().st_size / 1e3:.0f} kB")


def cost_model_from_profile(prof: dict) -> CostModel:
    """The cost model a profile file holds: fitted coefficients, or reduced kernel tables."""
    if prof.get("kind") == "kernels":
        return KernelCostModel.from_profile(prof)
    return FittedCostModel.from_profile(prof)
