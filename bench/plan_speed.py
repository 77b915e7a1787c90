"""Wall time of `servetwin plan` on the example plan scenarios, with each answer, as JSON.

    python bench/plan_speed.py [--scenarios scenarios/capacity-chat-h100.yaml ...] [--workers 2]

Each plan runs from an empty cache in a temporary folder. Run on a quiet machine: the planner
uses every worker it is given.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from scenarios.plan import plan

EXAMPLES = ["scenarios/capacity-chat-h100.yaml", "scenarios/pd-vs-agg.yaml", "scenarios/rag-long-prompt.yaml",
            "scenarios/aiconfigurator-8b-h100.yaml"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", nargs="*", default=EXAMPLES)
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args()
    out = []
    for path in a.scenarios:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            res = plan(path, Path(d) / "plan", workers=a.workers, progress=False)
            wall = time.perf_counter() - t0
        w = res["winner"] or {}
        out.append({"scenario": path, "wall_s": round(wall, 1), "simulations": res["simulated_tasks"],
                    "winner": w.get("label"), "replicas": w.get("replicas"), "gpus": w.get("gpus"),
                    "cost_per_hour": w.get("cost_per_hour"), "capacity_rps": w.get("capacity_rps"),
                    "headroom": w.get("headroom"),
                    "confirm_requests": (w.get("confirmation") or {}).get("requests"),
                    "one_fewer_passes": ((w.get("confirmation") or {}).get("one_fewer") or {}).get("pass")})
        print(json.dumps(out[-1]), flush=True)


if __name__ == "__main__":
    main()
