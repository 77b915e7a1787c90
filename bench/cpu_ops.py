"""The fused CPU elementwise ops of a Llama layer (engine/attention/paged_decode_cpu.cpp) against the
torch ops they replace, side by side in one process, at a decode-sized and a prefill-sized step of
the default model's shapes (hidden 576, intermediate 1536, 9 query and 3 KV heads of 64). Prints
JSON: the median microseconds of each op chain per call, and torch / fused.

    python bench/cpu_ops.py [--tokens 64 2048] [--calls 200]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def median_us(fn, calls: int, reps: int = 5) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        ts.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 2048])
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    from engine.attention import cpu_kernel
    from engine.model import llama
    if cpu_kernel.load() is None:
        sys.exit("cpu_ops: the CPU kernel library did not build")
    torch.set_grad_enabled(False)
    real = llama._fused
    rows = []
    for t in a.tokens:
        g = torch.Generator().manual_seed(t)
        x, res = torch.randn(t, 576, generator=g), torch.randn(t, 576, generator=g)
        norm, mlp_in = llama.RMSNorm(576, 1e-5), torch.randn(t, 3072, generator=g)
        q, k, _ = torch.randn(t, 960, generator=g).split([576, 192, 192], -1)
        q, k = q.view(t, 9, 64), k.view(t, 3, 64)
        rot = llama.RotaryEmbedding(64, 1e5, None)
        cs = rot.cos_sin(torch.arange(t), torch.float32)
        silu = llama.MLP.forward  # the MLP's activation alone: down_proj replaced by identity
        mlp = type("M", (), {"gate_up_proj": staticmethod(lambda _x: mlp_in), "down_proj": staticmethod(lambda y: y)})()
        row = {"tokens": t}
        for mode in ("torch", "fused"):
            llama._fused = real if mode == "fused" else (lambda _x: None)
            row[mode] = {"add_rms_norm_us": round(median_us(lambda: norm(x, res.clone()), a.calls), 1),
                         "silu_mul_us": round(median_us(lambda: silu(mlp, x), a.calls), 1),
                         "rope_q_k_us": round(median_us(lambda: rot(None, q, k, cs), a.calls), 1)}
        llama._fused = real
        row["torch_over_fused"] = {k: round(row["torch"][k] / row["fused"][k], 2) for k in row["torch"]}
        rows.append(row)
    print(json.dumps({"benchmark": "cpu_ops", "torch_threads": torch.get_num_threads(),
                      "statistic": "median of 5", "results": rows}, indent=1))


if __name__ == "__main__":
    main()
