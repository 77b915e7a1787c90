"""The engine's MoE experts on this GPU: the Triton grouped GEMM against the torch reference
(correctness) and against vLLM's fused-MoE kernel as AIConfigurator measured it (speed).

One MoE layer of Qwen3-30B-A3B's shape (128 experts, top-8, hidden 2048, expert intermediate
768; bf16 weights N(0, 0.02), inputs N(0, 1), router logits N(0, 1), softmax top-k renormalised
as Qwen3-MoE routes) for T tokens: `engine.model.moe_triton.fused_experts` (at BLOCK_M 16 and 64)
and `engine.model.moe.fused_experts_torch` (a matmul per expert). Per T: max |diff| of the Triton
output against the torch one relative to the torch output's max |value|, each one's time
(median over `--iters` samples of CUDA events over 8 calls), and the fused-MoE table's time for
the same shape (calibration/kernels/<system>.json, `bf16/2048/768/8/128/1/1`).

    python bench/gpu_moe_check.py [--out FILE] [--iters 10]
    python bench/gpu_moe_check.py --dry-run     # on a CPU under TRITON_INTERPRET=1: tiny sizes
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_kernel_check import device_and_system  # noqa: E402
from sim.kernel_model import load_tables  # noqa: E402

SHAPE = {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}
TOKENS = (1, 8, 64, 512, 4096, 16384)
TABLE_KEY = "bf16/2048/768/8/128/1/1"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", default=None)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    if a.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from engine.model.moe import fused_experts_torch, route
    from engine.model.moe_triton import fused_experts

    found = device_and_system(a.dry_run, a.system, "gpu_moe_check")
    if found is None:
        return 2
    device, name, system = found
    tab = load_tables(system)["moe"]["tables"].get(TABLE_KEY)
    table = dict(zip(tab["values"][0], tab["us"])) if tab and not a.dry_run else {}
    shape = {"experts": 8, "top_k": 2, "hidden": 32, "inter": 16} if a.dry_run else SHAPE
    tokens = (1, 8) if a.dry_run else TOKENS
    dtype = torch.float32 if a.dry_run else torch.bfloat16
    iters = 1 if a.dry_run else a.iters
    g = torch.Generator(device="cpu").manual_seed(0)
    e, k, h, i = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.02).to(device, dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.02).to(device, dtype)

    def timed(fn) -> float:
        fn()
        ts = []
        for _ in range(iters):
            if device == "cuda":
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(8):
                    fn()
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e3 / 8)
            else:
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e6)
        return statistics.median(ts)

    rows = []
    for t in tokens:
        x = torch.randn(t, h, generator=g).to(device, dtype)
        weights, ids = route(torch.randn(t, e, generator=g).to(device), k, renormalize=True)
        ref = fused_experts_torch(x, w13, w2, weights, ids)
        scale = ref.abs().max().item() or 1.0
        row = {"tokens": t, "experts_touched": int(torch.unique(ids).numel()),
               "torch_loop_us": round(timed(lambda: fused_experts_torch(x, w13, w2, weights, ids)), 1)}
        for bm in (16, 64):
            out = fused_experts(x, w13, w2, weights, ids, block_m=bm)
            row[f"triton_bm{bm}_rel_max_diff"] = float(f"{(out - ref).abs().max().item() / scale:.3g}")
            row[f"triton_bm{bm}_us"] = round(timed(lambda bm=bm: fused_experts(x, w13, w2, weights, ids, block_m=bm)), 1)
        us = table.get(t)
        row["vllm_table_us"] = us
        if us:
            row["ours_best_over_table"] = round(min(row["triton_bm16_us"], row["triton_bm64_us"]) / us, 2)
        rows.append(row)
    res = {"device": name, "system_tables": system, "table": TABLE_KEY if tab else None, "shape": shape,
           "dtype": str(dtype), "torch": torch.__version__, "dry_run": a.dry_run, "rows": rows,
           "note": "rel_max_diff: max |triton - torch| / max |torch| (bf16 outputs: ~1e-2 is bf16 rounding)"}
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
