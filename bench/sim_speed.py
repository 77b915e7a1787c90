"""Simulator speed on the Azure LLM inference conversation trace, one replica at ~70% load, side by
side with AISimulate on the same workload when it is installed.

Prints JSON. For each size (the trace tiled past its 19,366 rows), runs alternate between the
tools (`--reps` times each, medians reported):
  - ServeTwin: `servetwin simulate --replicates 0` (one simulation, no prediction-interval
    replicates) in a subprocess, once per engine.core build (`--builds`: the mypyc-compiled
    build of engine/core/compiled.py, reported as "servetwin" when present, and the pure-Python
    reference, "servetwin_pure"). end_to_end_s is its wall time (start-up, trace parsing,
    simulation, metrics and files); simulation_s is the simulation loop alone (summary wall_s).
  - AISimulate: `aisimulate predict` in a subprocess on a Mooncake trace written from the very
    same workload (arrival times, prompt and output lengths; unique content per request), with
    the same KV pool (usable blocks of 16 tokens), token budget and max_num_seqs. ServeTwin's side
    also runs its default client, the API server's request path, which AISimulate does not model
    (its TTFT then reads a few ms more).
    end_to_end_s is its wall time, simulation_s its reported wall_time_ms.
  - peak_rss_mib: each subprocess's peak resident memory; with several sizes, also its growth
    per 100k more requests (slope between the smallest and the largest size).
  - ratio: ServeTwin / AISimulate (below 1: ServeTwin is faster).

Load: the replica's capacity on this workload is measured first (the trace's requests all
arriving at once: completed requests per second over the drain), and the trace is rescaled to
70% of it.

AISimulate runs in its own virtual environment (its dependencies, jax among them, are not
ServeTwin's). Set it up once:

    python -m venv AISIM_VENV
    AISIM_VENV/bin/pip install aisimulate==0.13.0.dev202610270000000085

(the plain 0.13.0 on the index is a placeholder that cannot install) and pass
`--aisimulate AISIM_VENV/bin/aisimulate` (or set AISIMULATE). Without it the
bench says so on stderr and reports ServeTwin alone.

    python bench/sim_speed.py [--trace PATH] [--sizes 10000 100000] [--load 0.7] [--reps 3]
                              [--plain] [--aisimulate PATH | --no-aisimulate]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"
DEFAULT_AISIMULATE = os.environ.get("AISIMULATE", "aisimulate")  # an executable on PATH, by default
DEPLOYMENT = {"model": "llama-3.1-8b", "device": "h100-sxm", "tp": 1, "replicas": 1}
SCHEDULER = {"max_num_batched_tokens": 8192, "max_num_seqs": 1024}
AISIM_MODEL = "meta-llama/Meta-Llama-3.1-8B"
AISIM_HARDWARE = "h100_sxm"
MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake file written for AISimulate


def scenario(trace: Path, n: int, workload_extra: dict, steady: bool = True) -> dict:
    return {"name": f"azure-{n}", "seed": 0, "deployment": DEPLOYMENT, "scheduler": SCHEDULER,
            "workload": {"trace": {"path": str(trace), "max_requests": n, **workload_extra.pop("trace", {})},
                         **workload_extra},
            "output": {"plots": False}, "simulation": {"steady_decode": steady}}


def capacity(trace: Path, n: int = 3000) -> float:
    """Completed requests per second when n trace requests arrive together (saturation)."""
    from sim.scenario import parse_scenario, run_scenario
    sc = parse_scenario(scenario(trace, n, {"arrival": {"type": "constant", "rate": 1e6}}))
    s = run_scenario(sc).summary
    return s["throughput"]["requests_per_s"]


# Runs a command and reports its peak RSS. A child forked from this (large) process would
# start its peak at our RSS; forked from this small wrapper, it starts near zero.
_WRAPPER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
sys.stderr.write(f"\\nsim_speed-maxrss-kib={usage.ru_maxrss}\\n")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, float]:
    """Run a command; (wall seconds, peak RSS of the command in MiB)."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-S", "-c", _WRAPPER, *cmd], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    wall = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    kib = int(p.stderr.rsplit("sim_speed-maxrss-kib=", 1)[1].split()[0])
    return wall, kib / 1024  # Linux reports KiB


# ------------------------------------------------------------------ ServeTwin
def servetwin_setup(trace: Path, n: int, rate: float, steady: bool, tmp: Path) -> tuple[Path, dict]:
    path = tmp / f"azure-{n}.yaml"
    data = scenario(trace, n, {"trace": {"rate": rate}}, steady)
    path.write_text(yaml.safe_dump(data))
    return path, data


def servetwin_run(path: Path, n: int, tmp: Path, pure: bool = False) -> dict:
    out = tmp / f"out-{n}"
    exe = Path(sys.executable).parent / "servetwin"
    # One simulation, as AISimulate runs one (servetwin simulate adds seed replicates for
    # prediction intervals by default).
    wall, rss = timed([str(exe), "simulate", str(path), "--out", str(out), "--no-progress", "--no-plots",
                       "--replicates", "0"], env={"SERVETWIN_PURE_PYTHON": "1" if pure else "0"})
    s = json.loads((out / "summary.json").read_text())
    return {"end_to_end_s": wall, "simulation_s": s["wall_s"], "peak_rss_mib": rss,
            "simulated_s": s["simulated_s"], "num_steps": s["num_steps"],
            "completed": s["requests"]["completed"], "preemptions": s["requests"]["preemptions"],
            "ttft_p50_ms": s["ttft_s"]["p50"] * 1e3, "tpot_p50_ms": s["tpot_s"]["p50"] * 1e3}


# ----------------------------------------------------------------- AISimulate
def write_mooncake_trace(path: Path, wl, timestamps: bool = True) -> None:
    """A workload's requests as a Mooncake trace for AISimulate: arrival times in ms (all 0 with
    `timestamps=False`, for a concurrency load), prompt and output lengths, and hash ids unique
    to each request (one per MOONCAKE_BLOCK prompt tokens: no prefix is shared)."""
    arrivals = wl.arrival_s.tolist() if timestamps else [0.0] * len(wl)
    next_id = 0
    with open(path, "w") as f:
        for a, p, o in zip(arrivals, wl.prompt_len.tolist(), wl.output_len.tolist()):
            k = -(-p // MOONCAKE_BLOCK)
            f.write(json.dumps({"timestamp": round(a * 1e3, 6), "input_length": p, "output_length": o,
                                "hash_ids": list(range(next_id, next_id + k))}) + "\n")
            next_id += k


def aisimulate_setup(data: dict, tmp: Path) -> Path:
    """The same workload as a Mooncake trace (unique hash ids per request) and a prediction
    config with the same KV pool, budget and max_num_seqs."""
    from sim.scenario import parse_scenario
    sc = parse_scenario(data)
    wl, cfg = sc.workload, sc.scheduler_config
    trace = tmp / f"aisim-{len(wl)}.jsonl"
    write_mooncake_trace(trace, wl)
    config = {
        "traffic": {"source": {"type": "trace", "paths": [str(trace)], "format": "mooncake",
                               "block_size": MOONCAKE_BLOCK},
                    "load": {"type": "trace_timestamps"}},
        "engine": {"mode": "aggregated", "model": AISIM_MODEL, "hardware": AISIM_HARDWARE,
                   "backend": "vllm",
                   "workers": {"aggregated": {
                       "scheduler": {"max_batched_tokens": cfg.max_num_batched_tokens,
                                     "max_sequences": cfg.max_num_seqs},
                       "kv_cache": {"block_size": cfg.block_size,
                                    "capacity": {"type": "fixed", "blocks": cfg.num_gpu_blocks - 1}}}}},
    }
    path = tmp / f"aisim-{len(wl)}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def aisimulate_run(exe: str, config: Path, n: int, tmp: Path) -> dict:
    out = tmp / f"aisim-out-{n}"
    wall, rss = timed([exe, "predict", "--config", str(config), "--output-dir", str(out), "--overwrite"])
    s = json.loads((out / "prediction.json").read_text())
    return {"end_to_end_s": wall, "simulation_s": s["wall_time_ms"] / 1e3, "peak_rss_mib": rss,
            "simulated_s": s["duration_ms"] / 1e3, "completed": s["completed_requests"],
            "ttft_p50_ms": s["median_ttft_ms"], "tpot_p50_ms": s["median_tpot_ms"]}


def aisimulate_exe(arg: str | None) -> tuple[str | None, str | None]:
    """(executable, None) or (None, why it is skipped)."""
    if arg is None:
        return None, "--no-aisimulate"
    if not (os.path.isfile(arg) and os.access(arg, os.X_OK)):
        return None, (f"AISimulate not found at {arg}. Set it up in its own venv: "
                      "python -m venv AISIM_VENV && AISIM_VENV/bin/pip install "
                      "aisimulate==0.13.0.dev202610270000000085, then pass --aisimulate "
                      "AISIM_VENV/bin/aisimulate (or set AISIMULATE)")
    return arg, None


def median_row(runs: list[dict]) -> dict:
    row = {}
    for k in runs[0]:
        vals = [r[k] for r in runs]
        row[k] = statistics.median(vals) if isinstance(vals[0], float) else vals[0]
        if isinstance(row[k], float):
            row[k] = round(row[k], 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--reps", type=int, default=3, help="runs of each tool per size (medians)")
    ap.add_argument("--plain", action="store_true", help="every step through schedule() (for comparison)")
    ap.add_argument("--builds", nargs="+", choices=("compiled", "pure"), default=None,
                    help="engine.core builds to time side by side (default: compiled and pure when "
                         "a current compiled build exists, else pure; engine/core/compiled.py)")
    ap.add_argument("--aisimulate", default=DEFAULT_AISIMULATE, help="aisimulate executable")
    ap.add_argument("--no-aisimulate", dest="aisimulate", action="store_const", const=None)
    a = ap.parse_args()
    if not a.trace.exists():
        sys.exit(f"trace not found: {a.trace}")
    exe, skipped = aisimulate_exe(a.aisimulate)
    if skipped and a.aisimulate is not None:
        print(f"sim_speed: skipping AISimulate: {skipped}", file=sys.stderr)
    from engine.core import compiled
    builds = a.builds or (["compiled", "pure"] if compiled.ACTIVE else ["pure"])
    if "compiled" in builds and not compiled.ACTIVE:
        sys.exit(f"sim_speed: --builds compiled, but engine.core runs {compiled.STATUS}")
    cap = capacity(a.trace)
    rate = a.load * cap
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for n in a.sizes:
            path, data = servetwin_setup(a.trace, n, rate, not a.plain, tmp)
            aconf = aisimulate_setup(data, tmp) if exe else None
            st_runs: dict[str, list] = {b: [] for b in builds}
            ai_runs = []
            for _ in range(a.reps):  # alternate, so every tool and build sees the same machine load
                for b in builds:
                    st_runs[b].append(servetwin_run(path, n, tmp, pure=b == "pure"))
                if exe:
                    ai_runs.append(aisimulate_run(exe, aconf, n, tmp))
            row = {"num_requests": n}
            suffix = {b: "" if b == builds[0] else f"_{b}" for b in builds}  # the first is "servetwin"
            for b in builds:
                st = median_row(st_runs[b])
                st["requests_per_wall_s_end_to_end"] = round(n / st["end_to_end_s"], 1)
                st["runs_end_to_end_s"] = [round(r["end_to_end_s"], 3) for r in st_runs[b]]
                st["runs_simulation_s"] = [round(r["simulation_s"], 3) for r in st_runs[b]]
                row["servetwin" + suffix[b]] = {"engine_core": b, **st}
            if exe:
                ai = median_row(ai_runs)
                ai["runs_end_to_end_s"] = [round(r["end_to_end_s"], 3) for r in ai_runs]
                row["aisimulate"] = ai
                for b in builds:
                    st = row["servetwin" + suffix[b]]
                    row["ratio_servetwin_over_aisimulate" + suffix[b]] = {
                        "end_to_end": round(st["end_to_end_s"] / ai["end_to_end_s"], 3),
                        "simulation": round(st["simulation_s"] / ai["simulation_s"], 3),
                        "peak_rss": round(st["peak_rss_mib"] / ai["peak_rss_mib"], 3)}
            else:
                row["aisimulate"] = {"skipped": skipped}
            rows.append(row)
            print(f"sim_speed: {n} requests done", file=sys.stderr, flush=True)
    # Memory per request: the slope of peak RSS between the smallest and the largest size.
    marginal = {}
    if len(rows) > 1 and rows[-1]["num_requests"] > rows[0]["num_requests"]:
        span = rows[-1]["num_requests"] - rows[0]["num_requests"]
        for tool in ("servetwin", "aisimulate"):
            if "peak_rss_mib" in rows[-1][tool]:
                d = rows[-1][tool]["peak_rss_mib"] - rows[0][tool]["peak_rss_mib"]
                marginal[tool] = round(d * 100_000 / span, 1)
    print(json.dumps({
        "benchmark": "sim_speed", "trace": a.trace.name, "deployment": DEPLOYMENT, "scheduler": SCHEDULER,
        "capacity_requests_per_s": round(cap, 2), "load": a.load, "arrival_rate": round(rate, 2),
        "steady_decode": not a.plain, "engine_core_builds": builds, "reps": a.reps, "statistic": "median", "results": rows,
        "peak_rss_mib_per_100k_more_requests": marginal,
    }, indent=1))


if __name__ == "__main__":
    main()
