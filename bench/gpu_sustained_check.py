"""Does a GPU keep its micro-benchmark speed through a long prefill? Burst against sustained
GEMM throughput, with the clocks and power the card reports.

The kernel tables the cost model prices steps with were measured one kernel at a time, with idle
gaps between (the burst case). A long prefill runs the same GEMMs back to back for tens of
milliseconds, and a loaded server does so for minutes: if the card then lowers its clocks (power
or thermal limits), every compute-bound step is slower than the tables say, by a factor that
grows with the prefill's share of the work. This script measures that factor on the current CUDA
device.

One "step" is the four GEMMs (qkv, o, gate_up, down) of every layer of a Llama-3.1-70B shape at
TP8 (80 layers) with M tokens (default 8192), weights cycled over 8 distinct layer copies (more
than the L2 holds). Per dtype (bf16; fp8 via torch._scaled_mm where the card has it):

- burst: after `--idle` seconds of idle, the first `--burst-steps` steps, each timed with CUDA
  events;
- sustained: steps back to back for `--seconds`, each timed with CUDA events;
- meanwhile `nvidia-smi` samples SM clock, power, temperature and throttle reasons every 100 ms.

Prints JSON: per dtype, the step time of the burst and of the sustained run's second half (ms,
medians), their ratio, the table's time for the same step (sim.kernel_model.Grid), and the clock
and power medians in each phase.

    python bench/gpu_sustained_check.py [--out FILE] [--seconds 20] [--tokens 8192]
    python bench/gpu_sustained_check.py --dry-run      # on a CPU: tiny sizes, the code path only
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_kernel_check import SHAPES, device_and_system  # noqa: E402
from sim.kernel_model import Grid, load_tables  # noqa: E402

LAYERS = 80
COPIES = 8
SMI_FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,{reasons}"


def _smi_start(path: Path):
    if shutil.which("nvidia-smi") is None:
        return None
    helptext = subprocess.run(["nvidia-smi", "--help-query-gpu"], capture_output=True, text=True).stdout
    # newer drivers name the throttle reasons "clocks_event_reasons"
    reasons = "clocks_event_reasons.active" if "clocks_event_reasons.active" in helptext else "clocks_throttle_reasons.active"
    f = open(path, "w")
    return subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS.format(reasons=reasons)}", "--format=csv,noheader,nounits",
                             "-lms", "100"], stdout=f, stderr=subprocess.DEVNULL), f


def _smi_rows(text: str) -> list[dict]:
    rows = []
    for r in csv.reader(io.StringIO(text)):
        if len(r) < 6:
            continue
        try:
            ts = time.mktime(time.strptime(r[0].strip().split(".")[0], "%Y/%m/%d %H:%M:%S"))
            ts += float("0." + r[0].strip().split(".")[1]) if "." in r[0] else 0.0
            rows.append({"t": ts, "sm_mhz": float(r[1]), "mem_mhz": float(r[2]), "power_w": float(r[3]),
                         "temp_c": float(r[4]), "throttle": r[5].strip()})
        except (ValueError, IndexError):
            continue
    return rows


def _phase(rows: list[dict], t0: float, t1: float) -> dict:
    sel = [r for r in rows if t0 <= r["t"] <= t1]
    if not sel:
        return {"samples": 0}
    return {"samples": len(sel), "sm_mhz_median": statistics.median(r["sm_mhz"] for r in sel),
            "sm_mhz_min": min(r["sm_mhz"] for r in sel),
            "power_w_median": statistics.median(r["power_w"] for r in sel),
            "temp_c_max": max(r["temp_c"] for r in sel),
            "throttle_reasons": sorted({r["throttle"] for r in sel})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", default=None, help="the kernel tables to compare with (default: from the GPU's name)")
    ap.add_argument("--tokens", type=int, default=8192, help="M of every GEMM (the prefill chunk)")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the sustained run per dtype")
    ap.add_argument("--idle", type=float, default=3.0, help="idle seconds before the burst")
    ap.add_argument("--burst-steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: the code path only")
    a = ap.parse_args(argv)
    import torch

    found = device_and_system(a.dry_run, a.system, "gpu_sustained_check")
    if found is None:
        return 2
    device, name, system = found
    tables = load_tables(system)["gemm"]
    gemms = {"x": (64, 32)} if a.dry_run else SHAPES["llama-3.1-70b-tp8"]
    m = 16 if a.dry_run else a.tokens
    layers, copies = (4, 2) if a.dry_run else (LAYERS, COPIES)
    seconds, idle = (0.2, 0.05) if a.dry_run else (a.seconds, a.idle)
    fp8 = device == "cuda" and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability() >= (8, 9)
    out_dir = Path(a.out).parent if a.out else Path(".")
    smi = _smi_start(out_dir / "gpu_sustained_smi.csv") if device == "cuda" else None
    t_origin = time.time()
    res: dict = {"device": name, "system_tables": system, "torch": torch.__version__, "dry_run": a.dry_run,
                 "tokens": m, "layers": layers, "gemms": gemms, "dtypes": {}}
    phases = {}
    try:
        for dtype in ("bf16", "fp8") if fp8 else ("bf16",):
            tab = tables.get(dtype)
            wb = 1 if dtype == "fp8" else 2
            roof = (lambda M, N, K, wb=wb: max(2 * M * N * K / 1e15, (2 * M * K + wb * N * K + 2 * M * N) / 4e12) + 2e-6)
            grid = Grid(tab["values"], tab["us"], roof) if tab else None
            table_step_ms = (layers * sum(float(grid(m, n, k)[0]) for n, k in gemms.values()) / 1e3) if grid else None
            flops = layers * sum(2 * m * n * k for n, k in gemms.values())
            one = torch.ones((), device=device, dtype=torch.float32)
            ws = {g: [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
                  for g, (n, k) in gemms.items()}
            xs = {g: torch.randn(m, k, device=device, dtype=torch.bfloat16) for g, (n, k) in gemms.items()}
            if dtype == "fp8":
                ws = {g: [w.to(torch.float8_e4m3fn).t() for w in v] for g, v in ws.items()}
                xs = {g: x.to(torch.float8_e4m3fn) for g, x in xs.items()}

            def step():
                for layer in range(layers):
                    for g in gemms:
                        w = ws[g][layer % copies]
                        if dtype == "fp8":
                            torch._scaled_mm(xs[g], w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                        else:
                            torch.nn.functional.linear(xs[g], w)

            def timed(n_steps: int | None, until: float | None) -> list[tuple[float, float]]:
                """(wall time at the step's end, step ms) per step."""
                out = []
                while (n_steps is None or len(out) < n_steps) and (until is None or time.time() < until):
                    if device == "cuda":
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        step()
                        e1.record()
                        e1.synchronize()
                        out.append((time.time(), e0.elapsed_time(e1)))
                    else:
                        t = time.perf_counter()
                        step()
                        out.append((time.time(), (time.perf_counter() - t) * 1e3))
                return out

            step()  # warm-up: kernels chosen, weights touched
            if device == "cuda":
                torch.cuda.synchronize()
            time.sleep(idle)
            tb0 = time.time()
            burst = timed(a.burst_steps, None)
            tb1 = time.time()
            sus = timed(None, time.time() + seconds)
            ts1 = time.time()
            half = [ms for t, ms in sus if t >= tb1 + (ts1 - tb1) / 2] or [ms for _, ms in sus]
            burst_ms = statistics.median(ms for _, ms in burst)
            sus_ms = statistics.median(half)
            res["dtypes"][dtype] = {
                "burst_step_ms": [round(ms, 3) for _, ms in burst],
                "sustained_steps": len(sus),
                "sustained_second_half_step_ms_median": round(sus_ms, 3),
                "sustained_over_burst": round(sus_ms / burst_ms, 4),
                "sustained_tflops": round(flops / sus_ms / 1e9, 1),
                "burst_tflops": round(flops / burst_ms / 1e9, 1),
                "table_step_ms": round(table_step_ms, 3) if table_step_ms else None,
                "table_over_burst": round(table_step_ms / burst_ms, 4) if table_step_ms else None,
                "table_over_sustained": round(table_step_ms / sus_ms, 4) if table_step_ms else None,
                "step_ms_by_second": [round(statistics.median([ms for t, ms in sus if int(t - tb1) == s]), 3)
                                      for s in range(int(ts1 - tb1) + 1) if any(int(t - tb1) == s for t, _ in sus)],
            }
            phases[dtype] = (tb0, tb1, tb1 + (ts1 - tb1) / 2, ts1)
            del ws, xs
            if device == "cuda":
                torch.cuda.empty_cache()
            time.sleep(idle)
    finally:
        if smi:
            proc, f = smi
            proc.terminate()
            proc.wait()
            f.close()
    if smi:
        rows = _smi_rows((out_dir / "gpu_sustained_smi.csv").read_text())
        res["idle_before"] = _phase(rows, t_origin, t_origin + idle)
        for dtype, (tb0, tb1, th, ts1) in phases.items():
            res["dtypes"][dtype]["clocks_burst"] = _phase(rows, tb0 - 0.1, tb1 + 0.1)
            res["dtypes"][dtype]["clocks_sustained_second_half"] = _phase(rows, th, ts1)
    res["note"] = ("sustained_over_burst > 1: the card slows down under sustained load; "
                   "table_over_sustained < 1: the tables are faster than this card sustains")
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text if a.dry_run else json.dumps({k: v for k, v in res.items() if k != "gemms"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
