"""Simulator speed on the Azure LLM inference conversation trace, one replica at ~70% load.

Prints JSON: simulated requests per wall second for 10k and 100k requests (the trace tiled past
its 19,366 rows), end to end (a `servetwin simulate` subprocess: start-up, trace parsing,
simulation, metrics and files) and for the simulation alone, and simulated vs wall time.

Load: the replica's capacity on this workload is measured first (the trace's requests all
arriving at once: completed requests per second over the drain), and the trace is rescaled to
70% of it. Reference points (from the issue, measured on this machine class, not here): Vidur
about 400 req/s (10k: 23 s of simulation, 43 s end to end); AISimulate 3.3 s end to end for 10k
and 9.8 s for 100k.

    python bench/sim_speed.py [--trace PATH] [--sizes 10000 100000] [--load 0.7] [--plain]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"
DEPLOYMENT = {"model": "llama-3.1-8b", "device": "h100-sxm", "tp": 1, "replicas": 1}
SCHEDULER = {"max_num_batched_tokens": 8192, "max_num_seqs": 1024}


def scenario(trace: Path, n: int, workload_extra: dict, steady: bool = True) -> dict:
    return {"name": f"azure-{n}", "seed": 0, "deployment": DEPLOYMENT, "scheduler": SCHEDULER,
            "workload": {"trace": {"path": str(trace), "max_requests": n, **workload_extra.pop("trace", {})},
                         **workload_extra},
            "output": {"plots": False}, "simulation": {"steady_decode": steady}}


def capacity(trace: Path, n: int = 3000) -> float:
    """Completed requests per second when n trace requests arrive together (saturation)."""
    from scenarios.schema import parse_scenario, run_scenario
    sc = parse_scenario(scenario(trace, n, {"arrival": {"type": "constant", "rate": 1e6}}))
    s = run_scenario(sc).summary
    return s["throughput"]["requests_per_s"]


def run_one(trace: Path, n: int, rate: float, steady: bool, tmp: Path) -> dict:
    path = tmp / f"azure-{n}.yaml"
    path.write_text(yaml.safe_dump(scenario(trace, n, {"trace": {"rate": rate}}, steady)))
    out = tmp / f"out-{n}"
    exe = Path(sys.executable).parent / "servetwin"
    cmd = [str(exe), "simulate", str(path), "--out", str(out), "--no-progress", "--no-plots"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    end_to_end = time.perf_counter() - t0
    s = json.loads((out / "summary.json").read_text())
    return {
        "num_requests": n,
        "wall_s_end_to_end": round(end_to_end, 3),
        "wall_s_simulation": round(s["wall_s"], 3),
        "requests_per_wall_s_end_to_end": round(n / end_to_end, 1),
        "requests_per_wall_s_simulation": round(n / s["wall_s"], 1),
        "simulated_s": round(s["simulated_s"], 1),
        "simulated_s_per_wall_s": round(s["simulated_s"] / end_to_end, 1),
        "num_steps": s["num_steps"],
        "completed": s["requests"]["completed"],
        "preemptions": s["requests"]["preemptions"],
        "ttft_p50_ms": round(s["ttft_s"]["p50"] * 1e3, 1),
        "tpot_p50_ms": round(s["tpot_s"]["p50"] * 1e3, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--plain", action="store_true", help="every step through schedule() (for comparison)")
    a = ap.parse_args()
    if not a.trace.exists():
        sys.exit(f"trace not found: {a.trace}")
    cap = capacity(a.trace)
    rate = a.load * cap
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_one(a.trace, n, rate, not a.plain, Path(tmp)) for n in a.sizes]
    print(json.dumps({
        "benchmark": "sim_speed", "trace": a.trace.name, "deployment": DEPLOYMENT, "scheduler": SCHEDULER,
        "capacity_requests_per_s": round(cap, 2), "load": a.load, "arrival_rate": round(rate, 2),
        "steady_decode": not a.plain, "results": rows,
        "reference_not_measured_here": {
            "vidur": {"requests_per_wall_s": 400, "10k_wall_s_simulation": 23, "10k_wall_s_end_to_end": 43},
            "aisimulate": {"10k_wall_s_end_to_end": 3.3, "100k_wall_s_end_to_end": 9.8}},
    }, indent=1))


if __name__ == "__main__":
    main()
