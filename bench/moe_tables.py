"""The touched-experts estimate against vLLM's measured fused-MoE kernels.

For every fused-MoE table in calibration/kernels/<system>.json (vLLM's kernels, AIConfigurator's
measurements: dtype/hidden/inter/topk/experts/moe_tp/moe_ep, EP off here), the kernel model's
grouped-GEMM estimate for that shape (ModelSpec.experts_touched experts, each against its share
of the T x top-k rows, timed from the dense GEMM table: what the simulator uses for a shape the
MoE tables lack) beside the measured time, by token count. Prints JSON: per system and format,
the median and 10-90% range of estimate / measured by regime (rows per touched expert < 4:
decode-like; 4-64; > 64: prefill-like), and a few shapes in full.

    python bench/moe_tables.py [--system h100_sxm]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import warnings

from sim.kernel_model import KernelCostModel, load_tables
from sim.specs import get_model

FORMAT_DTYPE = {"bf16": ("bfloat16", ""), "fp8_block": ("fp8_block", ""), "mxfp4": ("bfloat16", "mxfp4"),
                "int4": ("bfloat16", "int4")}
DEVICE = {"h100_sxm": "h100", "h200_sxm": "h200", "b200_sxm": "b200"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", action="append", help="h100_sxm, h200_sxm, b200_sxm (repeatable)")
    a = ap.parse_args()
    base = get_model("qwen3-30b-a3b")
    out = {}
    warnings.simplefilter("ignore")
    for system in a.system or list(DEVICE):
        tables = load_tables(system)["moe"]["tables"]
        ratios: dict = {}
        shown = {}
        for key, tab in tables.items():
            fmt, h, i, k, e, tp, ep = key.split("/")
            h, i, k, e, tp, ep = map(int, (h, i, k, e, tp, ep))
            if ep != 1 or tp > 8 or (2 * i) % tp or fmt not in FORMAT_DTYPE:
                continue
            wd, ed = FORMAT_DTYPE[fmt]
            m = dataclasses.replace(base, name=f"moe-{key}", hidden_size=h, moe_intermediate_size=i,
                                    num_experts_per_tok=k, num_experts=e, num_heads=64, num_kv_heads=8,
                                    weight_dtype=wd, expert_dtype=ed, num_layers=1, num_moe_layers=1)
            km = KernelCostModel(m, DEVICE[system], tp, tables={**load_tables(system), "moe": {"tables": {}}})
            rows = []
            for T, us in zip(tab["values"][0], tab["us"]):
                if us is None:
                    continue
                est = km._look("moe", km.g_moe, T) * 1e6
                per_expert = T * k / m.experts_touched(T)
                regime = "decode-like" if per_expert < 4 else "mid" if per_expert <= 64 else "prefill-like"
                ratios.setdefault(f"{fmt} {regime}", []).append(est / us)
                rows.append((T, round(us, 1), round(est, 1)))
            if tp == 1 and len(shown) < 6 and fmt in ("bf16", "fp8_block"):
                shown[key] = {"tokens, measured us, estimate us": [r for r in rows if r[0] in (1, 8, 64, 512, 4096, 16384)]}
        out[system] = {"estimate_over_measured": {
            g: {"n": len(v), "median": round(statistics.median(v), 3),
                "p10": round(sorted(v)[len(v) // 10], 3), "p90": round(sorted(v)[9 * len(v) // 10], 3)}
            for g, v in sorted(ratios.items())}, "shapes": shown}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
