"""Scheduler overhead: microseconds per schedule() + update_from_output(), by running-batch size.

Prints JSON. Two loads per size:
  decode   - N running requests, every step one token each (steady decode)
  mixed    - N running decodes plus a queue of 1,000-token prompts fed in 512-token chunks
Usage: python bench/scheduler_overhead.py [--steps 200] [--sizes 16 64 256 1024]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core import Request, SamplingParams, Scheduler, SchedulerConfig  # noqa: E402


def build(n_running: int, mixed: bool, prompt_len: int = 128) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=n_running + (512 if mixed else 0),
                          max_num_seqs=n_running + (8 if mixed else 0), max_model_len=8192,
                          block_size=16, num_gpu_blocks=200_000, enable_prefix_caching=True)
    s = Scheduler(cfg)
    for i in range(n_running):
        s.add_request(Request(f"d{i}", [(i * 31 + j) % 30000 for j in range(prompt_len)],
                              SamplingParams(max_tokens=4096, ignore_eos=True)))
    # Prefill everything in as many steps as the budget needs, then start measuring.
    while s.waiting:
        drive(s)
    if mixed:
        for i in range(2000):
            s.add_request(Request(f"p{i}", [(i * 7 + j) % 30000 for j in range(1000)],
                                  SamplingParams(max_tokens=1, ignore_eos=True)))
    return s


def drive(s: Scheduler) -> None:
    out = s.schedule()
    reqs = s.requests
    sampled = {rid: [11] for rid in out.num_scheduled_tokens
               if reqs[rid].num_computed_tokens == reqs[rid].num_tokens}
    s.update_from_output(out, sampled)


def measure(n_running: int, mixed: bool, steps: int, repeats: int) -> dict:
    per_step = []
    for _ in range(repeats):
        s = build(n_running, mixed)
        t0 = time.perf_counter()
        for _ in range(steps):
            drive(s)
        per_step.append((time.perf_counter() - t0) / steps * 1e6)
    med = statistics.median(per_step)
    return {"running": n_running, "load": "mixed" if mixed else "decode",
            "us_per_step": round(med, 1), "us_per_running_request": round(med / n_running, 3),
            "repeats_us_per_step": [round(x, 1) for x in per_step]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024])
    a = ap.parse_args()
    rows = [measure(n, mixed, a.steps, a.repeats) for mixed in (False, True) for n in a.sizes]
    print(json.dumps({"benchmark": "scheduler_overhead", "python": platform.python_version(),
                      "target_us_per_running_request": 2.0, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
