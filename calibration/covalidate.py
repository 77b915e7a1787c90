"""Co-validation: one workload through the real engine and through the simulator, error table.

The engine replays the workload in real time (a request is added once the engine clock passes
its arrival); the simulator runs the same requests with the same scheduler configuration and KV
pool, timing steps with a cost profile fitted to this engine (calibration.profile_engine). The
table compares TTFT, TPOT, E2E and queue-time statistics; both sides use sim.metrics.

    python -m calibration.covalidate --profile sim/profiles/cpu-smollm2-135m.json --requests 80
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from engine.core import SamplingParams, SchedulerConfig
from sim.cost_model import FittedCostModel, load_profile
from sim.metrics import itl_from_token_times, requests_frame, summarize
from sim.simulation import Simulation
from sim.workload import Workload, build_workload


def engine_token_ids(spec, vocab: int) -> list[int]:
    """Map the workload's synthetic ids into the model's vocabulary (injective enough: equal ids
    stay equal, so shared prefixes stay shared)."""
    span = vocab - 200
    return [100 + (t * 2654435761) % span for t in spec.token_ids()]


def run_engine(engine, workload: Workload, progress: bool = True):
    specs = sorted(workload, key=lambda s: s.arrival_s)
    t0 = engine.now()
    i = 0
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(specs), desc="engine", unit="req")
    done = 0
    while i < len(specs) or engine.has_unfinished_requests():
        now = engine.now() - t0
        while i < len(specs) and specs[i].arrival_s <= now:
            s = specs[i]
            engine.add_request(s.request_id, engine_token_ids(s, engine.vocab_size),
                               SamplingParams(max_tokens=s.output_len, ignore_eos=True, temperature=0),
                               arrival_time=t0 + s.arrival_s)
            i += 1
        if engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished and bar is not None:
                    bar.update(1)
                done += o.finished
        elif i < len(specs):
            time.sleep(max(0.0, min(0.05, specs[i].arrival_s - (engine.now() - t0))))
    if bar is not None:
        bar.close()
    recs = [engine.request_records[s.request_id] for s in specs]
    for r in recs:  # onto the workload's clock
        for f in ("arrival_s", "first_scheduled_s", "first_token_s", "last_token_s", "finish_s"):
            v = getattr(r, f)
            if v is not None:
                setattr(r, f, v - t0)
        r.token_times_s = [x - t0 for x in (r.token_times_s or [])]
    return recs


def compare(engine_summary: dict, sim_summary: dict) -> list[dict]:
    rows = []
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s"):
        for stat in ("mean", "p50", "p90", "p99"):
            e, s = engine_summary[key][stat], sim_summary[key][stat]
            if e is None or s is None:
                continue
            rows.append({"metric": key, "stat": stat, "engine_ms": round(e * 1e3, 2),
                         "sim_ms": round(s * 1e3, 2),
                         "rel_error": round((s - e) / e, 3) if e else None})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="profile JSON fitted to this engine")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON report here too")
    a = ap.parse_args(argv)
    prof = load_profile(a.profile)
    meta = prof["metadata"]
    from engine.llm_engine import LLMEngine
    engine = LLMEngine(model=a.model, device=a.device,
                       max_num_batched_tokens=meta.get("max_num_batched_tokens", 512),
                       max_num_seqs=32, num_gpu_blocks=meta["num_gpu_blocks"])
    workload = build_workload({
        "num_requests": a.requests, "arrival": {"type": "poisson", "rate": a.rate},
        "prompt_len": {"type": "uniform", "min": 32, "max": 384},
        "output_len": {"type": "uniform", "min": 16, "max": 96},
        "shared_prefix": {"num_prefixes": 2, "length": 64, "fraction": 0.5}}, seed=a.seed)
    for _ in range(3):  # warm up the engine (first forwards are slow)
        engine.add_request("warm", [100] * 64, SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        engine.request_records.pop("warm", None)
    recs = run_engine(engine, workload)
    eng_df = requests_frame(recs)
    itl, w = itl_from_token_times(recs)
    eng_sum = summarize(eng_df, itl, w)

    cfg = SchedulerConfig(max_num_batched_tokens=engine.scheduler_config.max_num_batched_tokens,
                          max_num_seqs=engine.scheduler_config.max_num_seqs,
                          max_model_len=engine.max_model_len, block_size=engine.block_size,
                          num_gpu_blocks=engine.num_gpu_blocks)
    sim = Simulation(workload, cfg, FittedCostModel.from_profile(prof)).run()
    rows = compare(eng_sum, sim.summary)
    report = {"profile": a.profile, "requests": a.requests, "rate": a.rate,
              "engine_throughput": eng_sum["throughput"], "sim_throughput": sim.summary["throughput"],
              "errors": rows,
              "median_abs_rel_error": float(np.median([abs(r["rel_error"]) for r in rows if r["rel_error"] is not None]))}
    print(f"{'metric':<9}{'stat':<6}{'engine ms':>11}{'sim ms':>11}{'rel err':>9}")
    for r in rows:
        print(f"{r['metric']:<9}{r['stat']:<6}{r['engine_ms']:>11.2f}{r['sim_ms']:>11.2f}{r['rel_error']:>9.1%}")
    print(json.dumps({k: report[k] for k in ("median_abs_rel_error", "engine_throughput", "sim_throughput")}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
