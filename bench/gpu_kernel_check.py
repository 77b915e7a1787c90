"""The kernel tables of this GPU against GEMMs timed on it: are the tables the cost model prices
steps with (calibration/kernels/<system>.json, AIConfigurator's measurements of vLLM's kernels)
what this very card does?

Times torch's dense GEMMs (cuBLAS, as vLLM's unquantized and per-tensor fp8 linear layers) on the
current CUDA device for the GEMMs of a Llama-3.1-8B and a Llama-3.1-70B (TP8) layer, bf16 and fp8
(torch._scaled_mm, per-tensor scales), M (tokens) from 1 to 8192; each the median over `--iters`
samples of CUDA-event timings of 32 launches back to back, divided by 32, the weight read from
memory (copies used in turn: not from the L2 cache). Beside each, the table's time for the same (M, N, K)
(sim.kernel_model.Grid, interpolated as the simulator reads it). Prints JSON: every shape, and the
median and 10-90% range of table / measured by regime (M <= 64: weight-streaming; M >= 1024:
compute-bound).

    python bench/gpu_kernel_check.py [--system h200_sxm] [--out FILE] [--graph]
    python bench/gpu_kernel_check.py --dry-run      # on a CPU: tiny sizes, the code path only
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

from sim.kernel_model import Grid, load_tables

SHAPES = {  # name: (N, K) of each GEMM of one layer
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "llama-3.1-70b-tp8": {"qkv": (1280, 8192), "o": (8192, 1024), "gate_up": (7168, 8192), "down": (8192, 3584)},
}
MS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SYSTEMS = {"H200": "h200_sxm", "H100": "h100_sxm", "B200": "b200_sxm", "A100": "a100_sxm", "L40S": "l40s"}


def device_and_system(dry_run: bool, system: str | None, script: str) -> tuple[str, str, str] | None:
    """(torch device, its name, the kernel tables' system) for a device bench: the CPU for a dry
    run, else the CUDA device (None, with a message, where there is none); the system from the
    GPU's name unless given."""
    import torch

    device = "cpu" if dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(f"{script}: no CUDA device (use --dry-run on a CPU)", file=sys.stderr)
        return None
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    return device, name, system or next((v for k, v in SYSTEMS.items() if k in name), "h200_sxm")


def _time_us(fns, iters: int, device: str, graph: bool = False) -> float:
    """Median time of one launch: each sample times len(fns) launches back to back (the CPU's
    launch cost hidden behind the GPU's work, as in a real step) and divides by their number.
    `graph` (CUDA): the launches captured once in a CUDA graph and each sample one replay, so
    that no host launch latency is left in small kernels (as vLLM's decode steps run)."""
    import time

    import torch
    for fn in fns[:3]:
        fn()
    ts = []
    if graph and device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
            for fn in fns[:3]:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for fn in fns:
                fn()
        g.replay()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / len(fns))
        del g
        return statistics.median(ts)
    for _ in range(iters):
        if device != "cuda":
            t = time.perf_counter()
            for fn in fns:
                fn()
            ts.append((time.perf_counter() - t) * 1e6 / len(fns))
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for fn in fns:
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / len(fns))
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", default=None, help="the kernel tables to compare with (default: from the GPU's name)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: the code path only")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (no host launch cost)")
    a = ap.parse_args(argv)
    import torch

    found = device_and_system(a.dry_run, a.system, "gpu_kernel_check")
    if found is None:
        return 2
    device, name, system = found
    tables = load_tables(system)["gemm"]
    shapes = {"tiny": {"x": (64, 32)}} if a.dry_run else SHAPES
    ms = (1, 8, 64) if a.dry_run else MS
    iters = 2 if a.dry_run else a.iters
    fp8 = device == "cuda" and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability() >= (8, 9)
    rows, ratios = [], {}
    for dtype in ("bf16", "fp8") if fp8 else ("bf16",):
        tab = tables.get(dtype)
        wb = 1 if dtype == "fp8" else 2
        # a generic roofline: the Grid fills the table's holes from measured neighbours scaled by
        # it (only its ratios count), as the simulator does with the device's own
        roof = (lambda M, N, K, wb=wb: max(2 * M * N * K / 1e15, (2 * M * K + wb * N * K + 2 * M * N) / 4e12) + 2e-6)
        grid = Grid(tab["values"], tab["us"], roof) if tab else None
        for model, gemms in shapes.items():
            for gname, (n, k) in gemms.items():
                # Several copies of the weight, used in turn, so that each launch reads its weight
                # from memory and not from the L2 cache (60 MB on an H100/H200), as a step's
                # layers do: at least 256 MB of weights in all.
                copies = 1 if a.dry_run else max(2, min(16, -(-(256 << 20) // (2 * n * k))))
                ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
                one = torch.ones((), device=device, dtype=torch.float32)
                wqs = [w.to(torch.float8_e4m3fn).t() for w in ws] if dtype == "fp8" else None  # column-major
                for m in ms:
                    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                    if dtype == "fp8":
                        xq = x.to(torch.float8_e4m3fn)
                        fns = [lambda wq=wq: torch._scaled_mm(xq, wq, scale_a=one, scale_b=one,
                                                              out_dtype=torch.bfloat16) for wq in wqs]
                    else:
                        fns = [lambda w=w: torch.nn.functional.linear(x, w) for w in ws]
                    fns = fns * max(1, 32 // len(fns))
                    row = {"dtype": dtype, "model": model, "gemm": gname, "M": m, "N": n, "K": k}
                    try:
                        us = _time_us(fns, iters, device, a.graph)
                    except RuntimeError as e:  # e.g. a shape this torch's fp8 GEMM refuses
                        rows.append({**row, "error": str(e).splitlines()[0][:200]})
                        continue
                    table_us, measured = (grid(m, n, k) if grid else (None, False))
                    row = {**row, "measured_us": round(us, 2),
                           "table_us": round(float(table_us), 2) if table_us is not None else None,
                           "table_point_measured": bool(measured)}
                    if table_us:
                        row["table_over_measured"] = round(float(table_us) / us, 3)
                        regime = "M<=64" if m <= 64 else "M>=1024" if m >= 1024 else "64<M<1024"
                        ratios.setdefault(f"{dtype} {regime}", []).append(float(table_us) / us)
                    rows.append(row)
                del ws, wqs
    summary = {k: {"n": len(v), "median": round(float(np.median(v)), 3),
                   "p10": round(float(np.percentile(v, 10)), 3), "p90": round(float(np.percentile(v, 90)), 3)}
               for k, v in sorted(ratios.items())}
    res = {"device": name, "system_tables": system, "torch": torch.__version__, "dry_run": a.dry_run,
           "cuda_graph": a.graph,
           "note": "table_over_measured < 1: the tables are faster than this card's cuBLAS at that shape",
           "table_over_measured_by_regime": summary, "rows": rows}
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(json.dumps({k: res[k] for k in ("device", "system_tables", "table_over_measured_by_regime")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
