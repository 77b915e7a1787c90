"""Convert NVIDIA AIConfigurator's measured kernel tables (the parquet files shipped in the
`aisimulate` wheel) into the small JSON files under calibration/kernels/ that
sim/kernel_model.py reads. Run once, with a Python that has pandas + pyarrow and the wheel
(the simulator itself never imports aisimulate):

    VENV/bin/python calibration/convert_kernel_tables.py --site VENV/lib/python3.11/site-packages \
        [--out calibration/kernels] [--aiconfigurator | --moe | --linear-attention]

Kept (vLLM backend only, the kernels vLLM itself runs):
  gemm:        bf16 (torch linear), fp8 per-tensor (CutlassFP8ScaledMM) and fp8 128x128 blocks
               (DeepGEMM, else CUTLASS block-scaled) on the regular (m, n, k) grid (points it
               lacks are null), n and k >= 256 (dense models of 1B+ at TP 1-8).
  attention:   context (prefill, batch x isl, causal, no prefix) and generation (decode,
               batch x KV length) for head_dim 64/128, no sliding window, KV bf16 and fp8,
               one kernel per GPU (FA3 on Hopper, FlashInfer TRT-LLM kernels on Blackwell).
  linear attention (--linear-attention, added to the files already written): vLLM's Gated
               DeltaNet kernels (Qwen3.5, Qwen3-Next) per layer, prefill by batch x tokens and
               decode by batch, keyed by the heads one GPU holds; and the head-dim-256 attention
               tables of those models' full-attention layers.
  all-reduce:  vLLM custom all-reduce under CUDA graphs, bf16, by element count; with
               --allreduce-eager (added to the files already written) the same outside graphs, and
               both for every vLLM release the wheel timed.
  moe (--moe, added to the files already written): vLLM's fused-MoE layer (routing excluded:
               the grouped expert GEMMs with their activation), by token count, per weight
               format (the kernel vLLM picks for it on that GPU), model shape (hidden, expert
               intermediate, top-k, experts) and sharding (moe_tp x moe_ep), tokens routed with
               the power-law (1.01) skew AIConfigurator measures as its default.
Latencies are converted from ms to microseconds and rounded to 4 significant digits.
Nothing else is read: in particular not silicon_sample.csv.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pandas as pd

SYSTEMS = {
    # system: (gemm version, attention version, comm version, attention kernel), from the
    # aisimulate wheel's database (package aisimulate_core)
    "h100_sxm": ("0.31.0", "0.25.0", "0.31.0", "vllm_flash_attn_fa3"),
    "h200_sxm": ("0.31.0", "0.25.0", "0.31.0", "vllm_flash_attn_fa3"),
    "b200_sxm": ("0.27.1", "0.25.0", "0.24.0", None),  # per table, below
    "b300_sxm": ("0.27.1", "0.25.0", "0.24.0", None),  # B300 SXM6 measured as B200: the same choices
    # GB200 and GB300 (the Grace-Blackwell NVL72 racks' GPUs), measured on their own: B200's choices
    "gb200": ("0.27.1", "0.25.0", "0.24.0", None),
    "gb300": ("0.27.1", "0.25.0", "0.24.0", None),
}
# The GPUs the aisimulate wheel has no vLLM tables for, from AIConfigurator 0.12.0's wheel
# (package aiconfigurator_core): Ampere A100 SXM (vLLM 0.14.0: FlashAttention 2 as
# `vllm_flash_attn`, bf16 GEMMs as `vllm_default`) and Ada L40S (vLLM 0.24.0, FlashAttention 2).
AIC_SYSTEMS = {
    "a100_sxm": ("0.14.0", "0.14.0", "0.14.0", "vllm_flash_attn"),
    "l40s": ("0.24.0", "0.24.0", "0.22.0", "vllm_flash_attn_fa2"),
}
B200_ATTN = {"context": "vllm_flashinfer_trtllmprefill",
             "generation": "vllm_flashinfer_flashinfertrtllmapidecode"}
GEMM_DTYPES = {"bf16": ("bfloat16", ["torch.nn.functional.linear", "vllm_default"]),
               "fp8": ("fp8", ["CutlassFP8ScaledMMLinearKernel"]),
               # 128x128 block-scaled fp8 (e.g. Qwen's own -FP8 checkpoints): DeepGEMM where measured
               # (M >= 32; vLLM's default on Hopper/Blackwell when deep_gemm is installed), else
               # CUTLASS's block-scaled kernel.
               "fp8_block": ("fp8_block", ["DeepGemmFp8BlockScaledMMKernel", "CutlassFp8BlockScaledMMKernel"])}
KV_DTYPES = {"bf16": "bfloat16", "fp8": "fp8"}
# A GEMM dtype read from another version than the system's: B200's block-scaled fp8 in 0.27.1 has a
# floor of 0.16-0.27 ms on every shape (a 1 x 4096 x 3072 GEMM: 0.270 ms, where 0.25.0 measured
# 0.011 ms and 0.27.1's own per-channel fp8 0.020 ms), which no kernel of that size takes on the GPU.
GEMM_VERSION = {(s, "fp8_block"): "0.25.0" for s in ("b200_sxm", "b300_sxm", "gb200", "gb300")}


def sig(x: float, digits: int = 4):
    if x is None or not math.isfinite(x):
        return None
    if x == 0:
        return 0.0
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def grid(df: pd.DataFrame, axes: list[str]) -> dict:
    """A dense N-d grid over the axes' distinct values; missing points are null."""
    values = [sorted(int(v) for v in df[a].unique()) for a in axes]
    s = df.groupby(axes)["latency"].median()  # duplicates (re-runs) -> median
    def build(prefix, depth):
        if depth == len(axes):
            v = s.get(tuple(prefix) if len(prefix) > 1 else prefix[0])
            return sig(float(v) * 1000.0) if v is not None else None
        return [build(prefix + [x], depth + 1) for x in values[depth]]
    return {"axes": axes, "values": values, "us": build([], 0)}


def attention_tables(root: Path, system: str, av: str, attn_kernel: str | None, phase: str,
                     head_dims: tuple[int, ...]) -> tuple[Path, str, dict]:
    """(parquet path, kernel, tables) of one attention phase: the GPU's kernel (attn_kernel, or
    B200_ATTN's per phase), no sliding window, bf16 queries, KV bf16 and fp8, at these head dims;
    context by batch x isl (causal, no prefix), generation by batch x KV tokens read."""
    p = root / system / "attention" / "vllm" / av / f"{phase}_attention_perf.parquet"
    a = pd.read_parquet(p)
    kern = attn_kernel or B200_ATTN[phase]
    window = a.window_size == 0 if "window_size" in a.columns else True  # older tables: none
    a = a[(a.kernel_source == kern) & window & (a.head_dim.isin(list(head_dims))) & (a.attn_dtype == "bfloat16")]
    axis = "isl"
    if phase == "generation":
        a = a.assign(kv_len=a.isl + a.step)  # KV tokens read per sequence
        axis = "kv_len"
    tables = {}
    for kv_name, kv_dt in KV_DTYPES.items():
        for (h, kvh, d), sub in a[a.kv_cache_dtype == kv_dt].groupby(["num_heads", "num_key_value_heads", "head_dim"]):
            tables[f"{kv_name}/{h}/{kvh}/{d}"] = grid(sub, ["batch_size", axis])
    return p, kern, tables


def gemm_table(g: pd.DataFrame, dt: str, kerns: list[str]) -> dict | None:
    """One weight format's GEMM table from a gemm_perf frame: its kernels (the first in the list
    that measured a point wins it), n and k >= 256, on the regular (m, n, k) grid; None if none."""
    x = g[(g.gemm_dtype == dt) & (g.kernel_source.isin(kerns)) & (g.n >= 256) & (g.k >= 256)]
    if x.empty:
        return None
    rank = {k: i for i, k in enumerate(kerns)}  # first kernel in the list wins a point
    x = (x.assign(_r=x.kernel_source.map(rank)).sort_values("_r")
         .drop_duplicates(["m", "n", "k"], keep="first"))
    # the regular grid only (off-grid widths measured at a single k are dropped);
    # (m, n, k) points missing from it stay null and are filled at load time
    ns = sorted(n for n, c in x.groupby("n").k.nunique().items() if c >= 5)
    ks = sorted(k for k, c in x.groupby("k").n.nunique().items() if c >= 5)
    x = x[x.n.isin(ns) & x.k.isin(ks)]
    return {"kernel": " > ".join(kerns), **grid(x, ["m", "n", "k"])}


def read_kernel_file(out: Path, system: str) -> tuple[Path, dict]:
    """A kernel file written by convert (path, parsed JSON), for a step that adds to it."""
    path = out / f"{system}.json"
    return path, json.loads(path.read_text())


def write_kernel_file(path: Path, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))


def convert(site: Path, out: Path, systems: dict | None = None, package: str = "aisimulate_core") -> None:
    root = site / package / "systems" / "data"
    out.mkdir(parents=True, exist_ok=True)
    for system, (gv, av, cv, attn_kernel) in (systems or SYSTEMS).items():
        doc = {"system": system, "backend": "vllm", "unit": "us", "sources": {}}
        # GEMM -------------------------------------------------------------------------
        p = root / system / "gemm" / "vllm" / gv / "gemm_perf.parquet"
        g = pd.read_parquet(p)
        doc["sources"]["gemm"] = str(p.relative_to(site))
        doc["device_name"] = str(g.device.iloc[0])
        doc["gemm"] = {}
        for name, (dt, kerns) in GEMM_DTYPES.items():
            x = g
            if (system, name) in GEMM_VERSION:
                p = root / system / "gemm" / "vllm" / GEMM_VERSION[system, name] / "gemm_perf.parquet"
                x = pd.read_parquet(p)
                doc["sources"][f"gemm_{name}"] = str(p.relative_to(site))
            table = gemm_table(x, dt, kerns)
            if table is not None:
                doc["gemm"][name] = table
        # attention --------------------------------------------------------------------
        for phase in ("context", "generation"):
            p, kern, tables = attention_tables(root, system, av, attn_kernel, phase, (64, 128))
            doc["sources"][f"{phase}_attention"] = str(p.relative_to(site))
            doc[f"{phase}_attention"] = {"kernel": kern, "key": "kv_dtype/q_heads/kv_heads/head_dim",
                                         "tables": tables}
        # all-reduce -------------------------------------------------------------------
        p = root / system / "comm" / "vllm" / cv / "custom_allreduce_perf.parquet"
        c = pd.read_parquet(p)
        doc["sources"]["allreduce"] = str(p.relative_to(site))
        c = c[(c.kernel_source == "vLLM_custom_graph") & (c.allreduce_dtype == "bfloat16")]
        doc["allreduce"] = {"kernel": "vLLM_custom_graph", "dtype": "bf16", "size_unit": "elements",
                            "tables": {str(n): grid(sub, ["message_size"]) for n, sub in c.groupby("num_gpus")}}
        write_kernel_file(out / f"{system}.json", doc)
        print(f"{system}: {(out / f'{system}.json').stat().st_size / 1e6:.2f} MB")


# The wheel's only fused-MoE tables for A100 (vLLM 0.14.0: vLLM's Triton kernel, bf16, skewed routings
# only) and L40S (0.24.0: Triton for bf16 and fp8 blocks, Marlin for int4 and MXFP4).
MOE_SYSTEMS = {"h100_sxm": "0.25.0", "h200_sxm": "0.25.0", "b200_sxm": "0.25.0", "b300_sxm": "0.25.0",
               "gb200": "0.25.0", "gb300": "0.25.0",
               "a100_sxm": "0.14.0", "l40s": "0.24.0"}
# A file without balanced routing names a GPU whose tables have both routings for the same kernel
# (vLLM's Triton fused MoE) and shapes: the kernel model takes the uniform-routing reading from its
# ratio (sim.kernel_model._routing_ratio). A100's: L40S's, which has 65 of its 106 shapes.
MOE_ROUTING_REFERENCE = {"a100_sxm": "l40s"}
# weight format -> (moe_dtype of the table, kernels in order of preference: what vLLM runs)
MOE_KERNELS = {
    "bf16": ("bfloat16", ["vllm_unquantizedfusedmoe_triton_tritonexperts",
                          "vllm_unquantizedfusedmoe_flashinfer_trtllm_trtllmbf16experts",
                          "vllm_fused_moe"]),  # (A100's release names its Triton kernel so)
    "fp8_block": ("fp8_block", ["vllm_fp8moe_triton_tritonexperts",
                                "vllm_fp8moe_flashinfer_trtllm_trtllmfp8expertsmonolithic",
                                "vllm_fp8moe_flashinfer_cutlass_flashinferexperts",
                                "vllm_fp8moe_flashinfer_trtllm_trtllmfp8expertsmodular"]),
    "mxfp4": ("w4a16_mxfp4", ["vllm_gptossmxfp4moe_triton_oaitritonmxfp4expertsmonolithic",
                              "vllm_gptossmxfp4moe_flashinfer_trtllm_mxfp4_bf16_trtllmmxfp4expertsmonolithic",
                              "vllm_gptossmxfp4moe_marlin_marlinexperts"]),  # (Marlin: L40S, no FP4 units)
    "int4": ("int4_wo", ["vllm_compressedtensorswna16marlinmoe_marlin_marlinexperts"]),
    # NVFP4 experts (W4A4, NVIDIA's -NVFP4 checkpoints) on Blackwell: FlashInfer's TRT-LLM kernel,
    # monolithic where it supports the configuration, else modular, else its CUTLASS kernel
    "nvfp4": ("nvfp4", ["vllm_compressedtensorsw4a4nvfp4moe_flashinfer_trtllm_trtllmnvfp4expertsmonolithic",
                        "vllm_compressedtensorsw4a4nvfp4moe_flashinfer_trtllm_trtllmnvfp4expertsmodular",
                        "vllm_compressedtensorsw4a4nvfp4moe_flashinfer_cutlass_flashinferexperts"]),
    # MXFP4 experts with MXFP8 activations (FlashInfer's TRT-LLM kernel on Blackwell, vLLM's
    # VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1); the kernel model reads it for
    # cost_model.moe_activations: mxfp8
    "mxfp4_mxfp8": ("w4a8_mxfp4_mxfp8", ["vllm_mxfp4moe_flashinfer_trtllm_mxfp4_mxfp8_trtllmmxfp4expertsmodular"]),
}
# Formats whose kernel vLLM picks by the sharding as well as the GPU: each shape is read from the
# first kernel of the list measured at it. vLLM 0.25's fp8 MoE selection (model_executor/layers/
# fused_moe/oracle/fp8.py) prefers, on Hopper for 128x128 blocks, Triton with the experts sliced
# (TP) and FlashInfer's CUTLASS kernel with them split whole (EP), and the wheel measured exactly
# those (Triton at moe_ep 1 only, CUTLASS at moe_ep > 1 only); on Blackwell FlashInfer's TRT-LLM
# kernel, monolithic where it supports the configuration, else modular. Other formats: the first
# kernel of the list measured on the GPU, at every shape it has.
MOE_BY_SHAPE = {"fp8_block", "nvfp4"}
# The routings the tables were measured with. `balanced` (tokens spread over as many experts as
# they can touch): the kernel model reads it for uniform random routing (kernel_model.
# _uniform_routing), the most experts a decode batch streams. `power_law_1.01` (AIConfigurator's
# and AISimulate's default for MoE models: per-expert token counts drawn from a power law): fewer
# experts at a decode batch, but the busiest expert's extra rows at a prefill-sized step, which
# balanced routing leaves out. The kernel model takes the slower of the two at each token count
# (kernel_model._moe_reading).
MOE_DISTRIBUTION = "balanced"
MOE_SKEWED = "power_law_1.01"


MOE_SHAPE = ["hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size", "moe_ep_size"]


def moe_grids(every: pd.DataFrame, name: str, dt: str, kernel_of, tables: dict, skewed: dict,
              base: str = MOE_DISTRIBUTION) -> None:
    """Add format `name`'s fused-MoE tables (moe_dtype dt) under both routings to tables / skewed,
    keyed dtype/hidden/inter/topk/experts/moe_tp/moe_ep, each shape read from kernel_of(key).
    With `base` MOE_SKEWED (a file without balanced routing) the skewed tables are the base ones
    and `skewed` stays empty."""
    routings = [(base, tables)] + ([(MOE_SKEWED, skewed)] if base != MOE_SKEWED else [])
    for dist, out_tables in routings:
        y = every[(every.distribution == dist) & (every.moe_dtype == dt)]
        for key, sub in y.groupby(MOE_SHAPE):
            tkey = f"{name}/" + "/".join(str(v) for v in key)
            sub = sub[sub.kernel_source == kernel_of(tkey)]
            if not sub.empty:
                out_tables[tkey] = grid(sub, ["num_tokens"])


def convert_moe(site: Path, out: Path, systems: dict | None = None, package: str = "aisimulate_core") -> None:
    """Add the fused-MoE tables to calibration/kernels/<system>.json (written by convert)."""
    root = site / package / "systems" / "data"
    for system, version in (systems or MOE_SYSTEMS).items():
        path, doc = read_kernel_file(out, system)
        p = root / system / "moe" / "vllm" / version / "moe_perf.parquet"
        every = pd.read_parquet(p)
        # the routing read for uniform routing: balanced where measured, else the skewed one (as measured)
        base = MOE_DISTRIBUTION if (every.distribution == MOE_DISTRIBUTION).any() else MOE_SKEWED
        m = every[every.distribution == base]
        doc["sources"]["moe"] = str(p.relative_to(site))
        tables, skewed, kernels, by_shape = {}, {}, {}, {}
        for name, (dt, kerns) in MOE_KERNELS.items():
            x = m[(m.moe_dtype == dt) & m.kernel_source.isin(kerns)]
            if x.empty:
                if ((every.moe_dtype == dt) & every.kernel_source.isin(kerns)).any():
                    print(f"{system}: {name} measured without {base} routing only: not converted")
                continue
            kern = next(k for k in kerns if (x.kernel_source == k).any())
            kernels[name] = kern
            # each shape's kernel: the first measured of the list (MOE_BY_SHAPE), else `kern`
            owner = {}
            for k_ in (kerns[kerns.index(kern):] if name in MOE_BY_SHAPE else [kern]):
                for key in x[x.kernel_source == k_].groupby(MOE_SHAPE).size().index:
                    owner.setdefault(f"{name}/" + "/".join(str(v) for v in key), k_)
            moe_grids(every, name, dt, lambda tkey, owner=owner, kern=kern: owner.get(tkey, kern), tables, skewed,
                      base)
            by_shape.update({k: v for k, v in owner.items() if v != kern})
        doc["moe"] = {"kernels": kernels, "distribution": base,
                      "key": "dtype/hidden/inter/topk/experts/moe_tp/moe_ep", "tables": tables,
                      "skewed_distribution": MOE_SKEWED, "skewed_tables": skewed,
                      "kernels_by_shape": by_shape}
        if base != MOE_DISTRIBUTION and system in MOE_ROUTING_REFERENCE:
            doc["moe"]["routing_reference"] = MOE_ROUTING_REFERENCE[system]
        write_kernel_file(path, doc)
        print(f"{system}: {len(tables)} MoE tables ({len(skewed)} skewed), {path.stat().st_size / 1e6:.2f} MB")


# vLLM's Triton fused-MoE kernel where the tables of MOE_SYSTEMS hold another one for a format:
# on B200, vLLM's own selection runs FlashInfer's TRT-LLM kernels for bf16 and fp8 blocks, and the
# Triton kernel runs where a server turns those off (VLLM_USE_FLASHINFER_MOE_FP8=0 and
# VLLM_MOE_USE_DEEP_GEMM=0, or --moe-backend triton). The wheel measured it as `vllm_fused_moe` on
# its vLLM 0.19.0 image. Read for cost_model.moe_backend: triton (sim/kernel_model.py).
MOE_TRITON = {"b200_sxm": ("0.19.0", "vllm_fused_moe", {"bf16": "bfloat16", "fp8_block": "fp8_block"})}


def convert_moe_triton(site: Path, out: Path, systems: dict | None = None, package: str = "aisimulate_core") -> None:
    """Add the Triton fused-MoE tables (MOE_TRITON) to calibration/kernels/<system>.json as
    `moe_triton`, in the layout of `moe` (written by convert_moe)."""
    root = site / package / "systems" / "data"
    for system, (version, kern, formats) in (systems or MOE_TRITON).items():
        path, doc = read_kernel_file(out, system)
        p = root / system / "moe" / "vllm" / version / "moe_perf.parquet"
        every = pd.read_parquet(p)
        doc["sources"]["moe_triton"] = str(p.relative_to(site))
        tables, skewed = {}, {}
        for name, dt in formats.items():
            moe_grids(every, name, dt, lambda _key, kern=kern: kern, tables, skewed)
        doc["moe_triton"] = {"kernels": {name: kern for name in formats}, "version": version,
                             "distribution": MOE_DISTRIBUTION, "key": "dtype/hidden/inter/topk/experts/moe_tp/moe_ep",
                             "tables": tables, "skewed_distribution": MOE_SKEWED, "skewed_tables": skewed}
        write_kernel_file(path, doc)
        print(f"{system}: {len(tables)} Triton MoE tables ({len(skewed)} skewed), {path.stat().st_size / 1e6:.2f} MB")


def convert_allreduce_eager(site: Path, out: Path, systems: list[str] | None = None,
                            package: str = "aisimulate_core") -> None:
    """Add to calibration/kernels/<system>.json (written by convert) the all-reduce of a step that
    runs outside CUDA graphs, and the all-reduce of every vLLM release the wheel timed.

    `allreduce_eager`: a prefill step of more tokens than vLLM captures runs without a graph, and
    outside a graph vLLM's custom all-reduce first copies its input into a registered buffer, so on
    NVLink GPUs it takes longer than `allreduce` (timed inside graphs; L40S's PCIe all-reduce is
    NCCL's either way and reads about the same). The wheel times both (`vLLM_custom_eager`,
    `vLLM_custom_graph`) in every release folder of `comm/vllm/`. The table is `allreduce` (the
    graph times) times the median over those releases of eager / graph at each GPU count and
    message size; a median, because one release's eager times can stray (H100 and H200 in 0.31.0:
    180-300 us for every message of 0.5-8 M elements at TP 4 and 8, where their other releases
    read 1.1-1.4x the graph times). With one release (A100) it is that release's ratio, with two
    (L40S) their mean.

    `allreduce_releases`: {release: {"tables": graph times, "eager_tables": those times the same
    median ratio}} for every release folder, because the graph times changed between releases:
    H100's and H200's 0.31.0 read about 3 us for a small message and 5-6 us at 256 K elements at
    TP 4 and 8, where 0.14.0-0.24.0 read 4.5 us and 10-20 us. sim/kernel_model.py reads the
    release a deployment names (deployment.vllm_version)."""
    root = site / package / "systems" / "data"
    for system in systems or [p.stem for p in sorted(out.glob("*.json"))]:
        path, doc = read_kernel_file(out, system)
        if "allreduce" not in doc or not (root / system / "comm" / "vllm").is_dir():
            continue
        ratios: dict[tuple[int, int], list[float]] = {}
        used, graphs = [], {}
        for folder in sorted((root / system / "comm" / "vllm").iterdir()):
            f = folder / "custom_allreduce_perf.parquet"
            if not f.exists():
                continue
            c = pd.read_parquet(f)
            c = c[c.allreduce_dtype == "bfloat16"]
            t = c.pivot_table(index=["num_gpus", "message_size"], columns="kernel_source", values="latency",
                              aggfunc="median")
            if "vLLM_custom_graph" in t.columns:
                g = c[c.kernel_source == "vLLM_custom_graph"]
                graphs[folder.name] = (str(f.relative_to(site)),
                                       {str(n): grid(sub, ["message_size"]) for n, sub in g.groupby("num_gpus")})
            if not {"vLLM_custom_eager", "vLLM_custom_graph"} <= set(t.columns):
                continue
            used.append(str(f.relative_to(site)))
            for (n, size), r in (t["vLLM_custom_eager"] / t["vLLM_custom_graph"]).dropna().items():
                ratios.setdefault((int(n), int(size)), []).append(float(r))

        def eager_of(graph_tables: dict) -> dict:
            tables = {}
            for tp, tab in graph_tables.items():
                sizes, us = tab["values"][0], tab["us"]
                have = [float(pd.Series(ratios[int(tp), int(size)]).median())
                        for size in sizes if (int(tp), int(size)) in ratios]
                if len(have) == len(sizes):  # else a GPU count not timed outside graphs: none
                    tables[tp] = {"values": [sizes],
                                  "us": [None if u is None else sig(u * r) for u, r in zip(us, have)]}
            return tables
        tables = eager_of(doc["allreduce"]["tables"])
        if tables:
            doc["sources"]["allreduce_eager"] = used
            doc["allreduce_eager"] = {"kernel": "vLLM_custom_eager", "dtype": "bf16", "size_unit": "elements",
                                      "method": "allreduce x the median over the releases of eager / graph",
                                      "tables": tables}
        doc["sources"]["allreduce_releases"] = {rel: src for rel, (src, _t) in graphs.items()}
        doc["allreduce_releases"] = {rel: {"tables": t, "eager_tables": eager_of(t)}
                                     for rel, (_src, t) in graphs.items()}
        write_kernel_file(path, doc)
        print(f"{system}: eager all-reduce for TP {sorted(tables, key=int)} from {len(used)} releases; "
              f"graph all-reduce of releases {sorted(graphs)}")


# Gated DeltaNet (Qwen3.5, Qwen3-Next linear attention) as vLLM runs it, from the wheel's vLLM
# 0.25.0 tables: per layer, prefill = the causal conv1d over the chunk (causal_conv1d_fn) + the
# chunked gated delta rule (chunk_gated_delta_rule_flashinfer), by batch x tokens per sequence;
# decode = the conv1d's one-token update (causal_conv1d_update) + the recurrent step
# (fused_recurrent_gated_delta_rule_packed_decode), by batch; both kernels summed at each point.
# Keyed by the heads one GPU holds: k_heads/v_heads/k_dim/v_dim. B300 has no vLLM table: B200's (the
# same kernels on the same architecture). The full-attention layers of the same models have head
# dim 256: those attention tables are added from the system's attention release.
# system: (the system folder read, the vLLM release) of the tables B300 takes from B200
HOPPER_BLACKWELL_025 = {"h100_sxm": ("h100_sxm", "0.25.0"), "h200_sxm": ("h200_sxm", "0.25.0"),
                        "b200_sxm": ("b200_sxm", "0.25.0"), "b300_sxm": ("b200_sxm", "0.25.0"),
                        "gb200": ("gb200", "0.25.0"), "gb300": ("gb300", "0.25.0")}
LINEAR_ATTENTION = HOPPER_BLACKWELL_025
GDN_KERNELS = {"context": ["causal_conv1d_fn", "chunk_gated_delta_rule_flashinfer"],
               "generation": ["causal_conv1d_update", "fused_recurrent_gated_delta_rule_packed_decode"]}
GDN_KEY = ["num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"]


def convert_linear_attention(site: Path, out: Path, systems: dict | None = None,
                             package: str = "aisimulate_core") -> None:
    """Add `linear_attention` (LINEAR_ATTENTION) and the head-dim-256 attention tables to
    calibration/kernels/<system>.json (written by convert)."""
    root = site / package / "systems" / "data"
    for system, (src, version) in (systems or LINEAR_ATTENTION).items():
        path, doc = read_kernel_file(out, system)
        p = root / src / "linear_attention" / "vllm" / version / "gdn_perf.parquet"
        g = pd.read_parquet(p)
        doc["sources"]["linear_attention"] = str(p.relative_to(site))
        la = {"kernels": GDN_KERNELS, "key": "k_heads/v_heads/k_dim/v_dim"}
        for phase, kerns in GDN_KERNELS.items():
            x = g[(g.phase == phase) & g.kernel_source.isin(kerns)]
            axes = ["batch_size", "seq_len"] if phase == "context" else ["batch_size"]
            # one latency per kernel and point (the median over the models that share the heads:
            # d_model does not enter these kernels), then the two kernels summed
            per = x.groupby(GDN_KEY + axes + ["kernel_source"])["latency"].median().unstack("kernel_source")
            per = per.dropna()  # a point needs both kernels
            tables = {}
            for key, sub in per.reset_index().groupby(GDN_KEY):
                sub = sub.assign(latency=sub[kerns].sum(axis=1))
                tables["/".join(str(v) for v in key)] = grid(sub, axes)
            la[phase] = tables
        doc["linear_attention"] = la
        attn_version = (SYSTEMS.get(system) or AIC_SYSTEMS[system])[1]
        attn_kernel = (SYSTEMS.get(system) or AIC_SYSTEMS[system])[3]
        added = 0
        for phase in ("context", "generation"):
            _p, kern, tables = attention_tables(root, system, attn_version, attn_kernel, phase, (256,))
            assert kern == doc[f"{phase}_attention"]["kernel"], (system, phase, kern)
            doc[f"{phase}_attention"]["tables"].update(tables)
            added += len(tables)
        write_kernel_file(path, doc)
        print(f"{system}: GDN tables for {len(la['context'])} head configurations (from {src} {version}); "
              f"{added} head-dim-256 attention tables")


# vLLM's whole multi-head latent attention layer (DeepSeek-V3's shape: hidden 7168, q latent 1536,
# KV latent 512 + rope 64, heads of 128 + 64 and values of 128; Kimi-K2 has the same with half the
# heads): the projections, RoPE, cache write and attention, per GPU's heads, from the wheel's vLLM
# 0.25.0 `mla/*_module` tables. Prefill (batch x isl, no prefix) and decode (batch x KV tokens),
# per KV-cache dtype and the projections' weight format. The backend vLLM runs: prefill through
# FlashAttention on the decompressed keys (FLASH_ATTN) on every GPU; decode FA3's MLA kernel
# (FLASH_ATTN_MLA) with a bf16 cache and FlashMLA with an fp8 one on Hopper, FlashInfer's MLA
# (FLASHINFER_MLA) on Blackwell. B300: B200's tables.
MLA_MODULE = HOPPER_BLACKWELL_025
MLA_KERNELS = {"context": {"bf16": "FLASH_ATTN", "fp8": "FLASH_ATTN"},
               "generation_hopper": {"bf16": "FLASH_ATTN_MLA", "fp8": "FLASHMLA"},
               "generation_blackwell": {"bf16": "FLASHINFER_MLA", "fp8": "FLASHINFER_MLA"}}
# the projections' weight formats kept from the MLA and DSA layer tables, as the kernel model names them
LAYER_GEMM = {"bfloat16": "bf16", "fp8_block": "fp8_block"}


def convert_mla_module(site: Path, out: Path, systems: dict | None = None,
                       package: str = "aisimulate_core") -> None:
    """Add `mla_module` (MLA_MODULE) to calibration/kernels/<system>.json (written by convert)."""
    root = site / package / "systems" / "data"
    for system, (src, version) in (systems or MLA_MODULE).items():
        path, doc = read_kernel_file(out, system)
        gen_kernels = MLA_KERNELS["generation_hopper" if src.startswith("h") else "generation_blackwell"]
        mod = {"model_shape": "deepseek-v3", "key": "kv_dtype/weight_dtype/heads",
               "kernels": {"context": MLA_KERNELS["context"], "generation": gen_kernels}}
        for phase, axis, kernels in (("context", "isl", MLA_KERNELS["context"]), ("generation", "kv_len", gen_kernels)):
            p = root / src / "mla" / "vllm" / version / f"mla_{phase}_module_perf.parquet"
            x = pd.read_parquet(p)
            x = x.assign(kv_len=x.isl + x.step)  # KV tokens a decode reads (as attention_tables)
            doc["sources"][f"mla_{phase}_module"] = str(p.relative_to(site))
            x = x[(x.model == "deepseek-ai/DeepSeek-V3") & x.gemm_type.isin(list(LAYER_GEMM))]
            tables = {}
            for kv_name, kv_dt in KV_DTYPES.items():
                y = x[(x.kv_cache_dtype == kv_dt) & (x.kernel_source == kernels[kv_name])]
                for (g, h), sub in y.groupby(["gemm_type", "num_heads"]):
                    tables[f"{kv_name}/{LAYER_GEMM[g]}/{h}"] = grid(sub, ["batch_size", axis])
            mod[phase] = tables
        doc["mla_module"] = mod
        write_kernel_file(path, doc)
        print(f"{system}: MLA module tables, prefill {len(mod['context'])}, decode {len(mod['generation'])} "
              f"(from {src} {version})")


# vLLM's whole sparse-attention (DSA) layer of DeepSeek-V3.2's and GLM-5's shapes (the wheel's
# GLM-5.2 rows: GLM-5's attention dims, every layer with its own indexer): projections, the
# indexer and FlashMLA's sparse prefill (FLASHMLA_SPARSE), per GPU's heads, KV-cache dtype and
# projections' weight format, by batch x prompt length (no prefix), from the wheel's vLLM 0.24.0
# `sparse_attention/dsa_context_module` tables. Prefill only, as for MLA (mla_module). B300: B200's.
DSA_MODULE = {"h100_sxm": ("h100_sxm", "0.24.0"), "h200_sxm": ("h200_sxm", "0.24.0"),
              "b200_sxm": ("b200_sxm", "0.24.0"), "b300_sxm": ("b200_sxm", "0.24.0"),
              "gb200": ("gb200", "0.24.0"), "gb300": ("gb300", "0.24.0")}
DSA_MODELS = {"deepseek-ai/DeepSeek-V3.2": "deepseek-v3.2", "zai-org/GLM-5.2": "glm-5"}


def convert_dsa_module(site: Path, out: Path, systems: dict | None = None,
                       package: str = "aisimulate_core") -> None:
    """Add `dsa_module` (DSA_MODULE) to calibration/kernels/<system>.json (written by convert)."""
    root = site / package / "systems" / "data"
    for system, (src, version) in (systems or DSA_MODULE).items():
        path, doc = read_kernel_file(out, system)
        p = root / src / "sparse_attention" / "vllm" / version / "dsa_context_module_perf.parquet"
        x = pd.read_parquet(p)
        doc["sources"]["dsa_context_module"] = str(p.relative_to(site))
        x = x[(x.op_name == "dsa_context_module") & (x.step == 0) & x.model.isin(list(DSA_MODELS))
              & x.gemm_type.isin(list(LAYER_GEMM))]
        tables = {}
        for kv_name, kv_dt in KV_DTYPES.items():
            y = x[x.kv_cache_dtype == kv_dt]
            for (mdl, g, h), sub in y.groupby(["model", "gemm_type", "num_heads"]):
                tables[f"{DSA_MODELS[mdl]}/{kv_name}/{LAYER_GEMM[g]}/{h}"] = grid(sub, ["batch_size", "isl"])
        doc["dsa_module"] = {"kernel": "FLASHMLA_SPARSE", "key": "model_shape/kv_dtype/weight_dtype/heads",
                             "context": tables}
        write_kernel_file(path, doc)
        print(f"{system}: DSA prefill layer tables, {len(tables)} (from {src} {version})")


# NVFP4 (4-bit e2m1 weights and activations in groups of 16 with fp8 scales: NVIDIA's -NVFP4
# checkpoints) on Blackwell, which has FP4 tensor cores: the dense GEMM (FlashInfer's CuTe DSL
# kernel, vLLM 0.27.1 as the other B200 GEMMs) added as gemm.nvfp4. Its fused-MoE tables come with
# --moe (MOE_KERNELS' nvfp4).
NVFP4_GEMM = {"b200_sxm": "0.27.1", "b300_sxm": "0.27.1", "gb200": "0.27.1", "gb300": "0.27.1"}
NVFP4_KERNELS = ["FlashInferCuteDslNvFp4LinearKernel"]


def convert_nvfp4(site: Path, out: Path, systems: dict | None = None, package: str = "aisimulate_core") -> None:
    """Add gemm.nvfp4 (NVFP4_GEMM) to calibration/kernels/<system>.json (written by convert)."""
    root = site / package / "systems" / "data"
    for system, version in (systems or NVFP4_GEMM).items():
        path, doc = read_kernel_file(out, system)
        p = root / system / "gemm" / "vllm" / version / "gemm_perf.parquet"
        table = gemm_table(pd.read_parquet(p), "nvfp4", NVFP4_KERNELS)
        doc["gemm"]["nvfp4"] = table
        doc["sources"]["gemm_nvfp4"] = str(p.relative_to(site))
        write_kernel_file(path, doc)
        print(f"{system}: NVFP4 GEMM table, {len(table['values'][0])} x {len(table['values'][1])} x "
              f"{len(table['values'][2])} (m, n, k)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", type=Path, default=None, help="site-packages of a Python with the wheel")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "kernels")
    ap.add_argument("--aiconfigurator", action="store_true",
                    help="convert AIC_SYSTEMS from an aiconfigurator==0.12.0 site-packages (--site) instead")
    ap.add_argument("--moe", action="store_true", help="add the fused-MoE tables to the files in --out")
    ap.add_argument("--moe-triton", action="store_true",
                    help="add the Triton fused-MoE tables (MOE_TRITON) to the files in --out")
    ap.add_argument("--linear-attention", action="store_true",
                    help="add the Gated DeltaNet tables and the head-dim-256 attention tables (LINEAR_ATTENTION) "
                         "to the files in --out")
    ap.add_argument("--nvfp4", action="store_true",
                    help="add the NVFP4 GEMM tables (NVFP4_GEMM) to the files in --out")
    ap.add_argument("--dsa-module", action="store_true",
                    help="add vLLM's measured sparse-attention prefill layer tables (DSA_MODULE) to the files in --out")
    ap.add_argument("--mla-module", action="store_true",
                    help="add vLLM's measured MLA layer tables (MLA_MODULE) to the files in --out")
    ap.add_argument("--allreduce-eager", action="store_true",
                    help="add the all-reduce outside CUDA graphs to the files in --out (with --aiconfigurator: "
                         "AIC_SYSTEMS from its wheel)")
    ap.add_argument("--system", action="append",
                    help="convert only these systems (repeatable; default: every system of the pass)")
    args = ap.parse_args()
    if args.site is None:
        ap.error("--site: the site-packages folder that holds the wheel")
    if args.system:  # every pass reads its systems from these tables: keep only the named ones
        for table in (SYSTEMS, AIC_SYSTEMS, MOE_SYSTEMS, MOE_TRITON, LINEAR_ATTENTION, MLA_MODULE, DSA_MODULE,
                      NVFP4_GEMM):
            for name in [k for k in table if k not in args.system]:
                del table[name]
    if args.allreduce_eager:
        if args.aiconfigurator:
            convert_allreduce_eager(args.site, args.out, list(AIC_SYSTEMS), "aiconfigurator_core")
        else:
            convert_allreduce_eager(args.site, args.out, list(SYSTEMS))
    elif args.nvfp4:
        convert_nvfp4(args.site, args.out)
    elif args.dsa_module:
        convert_dsa_module(args.site, args.out)
    elif args.mla_module:
        convert_mla_module(args.site, args.out)
    elif args.linear_attention:
        convert_linear_attention(args.site, args.out)
    elif args.moe_triton:
        convert_moe_triton(args.site, args.out)
    elif args.moe:
        convert_moe(args.site, args.out)
    elif args.aiconfigurator:
        convert(args.site, args.out, AIC_SYSTEMS, "aiconfigurator_core")
    else:
        convert(args.site, args.out)


if __name__ == "__main__":
    main()
