"""The `servetwin` command line."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms < 1000 else f"{ms / 1000:.1f}k"


def format_summary(summary: dict) -> str:
    """The end-of-run table: latencies in milliseconds, then throughput and counts."""
    lines = [f"{'metric':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p95':>10}{'p99':>10}{'count':>9}"]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E"),
                       ("queue_s", "queue")):
        s = summary[key]
        cells = "".join(f"{(s[k] * 1e3 if s[k] is not None else float('nan')):>10.1f}"
                        for k in ("mean", "p50", "p90", "p95", "p99"))
        lines.append(f"{label + ' (ms)':<10}{cells}{s['count']:>9}")
        if "p50_interval" in s:  # prediction intervals (sim.intervals)
            cells = "".join(f"{'':>10}" if k == "mean" else
                            f"{_ms(s[k + '_interval'][0]) + '-' + _ms(s[k + '_interval'][1]):>10}"
                            for k in ("mean", "p50", "p90", "p95", "p99"))
            lines.append(f"{'  90% int':<10}{cells}")
    t, r = summary["throughput"], summary["requests"]
    lines.append("")
    lines.append(f"throughput: {t['requests_per_s']:.2f} req/s, {t['output_tokens_per_s']:.0f} output tok/s, "
                 f"{t['total_tokens_per_s']:.0f} total tok/s")
    slo = summary.get("slo") or {}
    if slo:
        lines.append(f"goodput: {summary['goodput_requests_per_s']:.2f} req/s meeting "
                     + ", ".join(f"{k}<={v * 1e3:g}ms" for k, v in slo.items()))
    lines.append(f"requests: {r['completed']} completed, {r['aborted']} aborted, {r['rejected']} rejected, "
                 f"{r['preemptions']} preemptions")
    pd = summary.get("pd")
    if pd:
        tr, wait = pd["kv_transfer_s"], pd["wait_for_room_s"]
        if tr["count"]:
            lines.append(f"P/D: {pd['prefill_replicas']} prefill + {pd['decode_replicas']} decode replicas; "
                         f"KV transfer mean {tr['mean'] * 1e3:.2f} ms, p99 {tr['p99'] * 1e3:.2f} ms; "
                         f"wait for decode room mean {wait['mean'] * 1e3:.1f} ms, max {wait['max'] * 1e3:.1f} ms; "
                         f"wait for the decode step that starts the load mean "
                         f"{pd['wait_for_load_start_s']['mean'] * 1e3:.1f} ms")
    if "simulated_s" in summary:
        lines.append(f"simulated {summary['simulated_s']:.1f} s in {summary['wall_s']:.2f} s wall "
                     f"({summary.get('num_steps', 0)} steps)")
    return "\n".join(lines)


def cmd_simulate(a) -> int:
    from sim.scenario import ScenarioError, load_scenario, run_scenario
    try:
        sc = load_scenario(a.scenario, seed=a.seed)
    except ScenarioError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"scenario {sc.name}: {sc.describe()}", file=sys.stderr)
    for w in sc.warnings:
        print(f"warning: {w}", file=sys.stderr)
    result = run_scenario(sc, progress=not a.no_progress)
    if sc.warnings:
        result.summary["warnings"] = list(sc.warnings)
    if a.replicates and sc.pd is None:
        add_replicate_intervals(a.scenario, sc, result.summary, a.replicates)
    print(format_summary(result.summary))
    out = Path(a.out) if a.out else Path("results") / sc.name
    result.save(out, plots=not a.no_plots)
    print(f"results: {out}/ (summary.json, requests.csv, steps.csv"
          + ("" if a.no_plots else ", latency_cdf.png, kv_and_batch.png") + ")")
    return 0


def add_replicate_intervals(path, sc, summary: dict, n: int) -> None:
    """90% intervals for every percentile: n more runs with other workload seeds and, when the
    profile has measured residuals, step times drawn from them (sim.intervals)."""
    from sim.scenario import load_scenario, run_scenario
    from sim.intervals import NoisyCostModel, add_intervals, has_residuals
    noisy = has_residuals(sc.cost_model)
    reps = []
    drawn = ""
    for k in range(n):
        rk = load_scenario(path, seed=sc.seed + 1 + k)
        if noisy:
            rk.cost_model = NoisyCostModel(rk.cost_model, seed=sc.seed + 1 + k)
            drawn = rk.cost_model.source_text
        reps.append(run_scenario(rk).summary)
    how = (f"workload seeds {sc.seed + 1}..{sc.seed + n}"
           + (f" x step times drawn from the profile's {drawn} x its held-out group bias"
              if noisy else " only (this cost model has no measured residuals)"))
    add_intervals(summary, reps, getattr(sc.cost_model, "metadata", {}) if noisy else {}, how)


def cmd_plan(a) -> int:
    from scenarios.plan import PlanError, plan
    from scenarios.plan_report import deploy_commands, format_table, provenance_text, why
    from sim.scenario import ScenarioError
    out = Path(a.out) if a.out else None
    try:
        result = plan(a.scenario, out, workers=a.workers, ray_address=a.ray, progress=not a.no_progress,
                      target_rate=a.rate, target_gpus=a.gpus)
    except (PlanError, ScenarioError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    target = (f"{result['target_rate']:g} req/s" if result["mode"] == "rate"
              else f"the most traffic on {result['target_gpus']} GPUs")
    print(f"plan for {result['model']} at {target}, SLOs: {result['slo_text']}; ranked by {result['ranking']}")
    print(format_table(result, limit=a.top))
    w = result["winner"]
    print("")
    if w is None:
        print("no candidate meets the SLOs in a cluster simulation; loosen the SLOs or widen the grid")
    else:
        print("winner:")
        for line in deploy_commands(result, w):
            print(f"  {line}")
        print(why(result))
    for line in provenance_text(result):
        print(f"  {line}")
    print(f"\nplanned in {result['wall_s']:.1f} s ({result['simulated_tasks']} simulations, "
          f"{result['cached_tasks']} from cache)"
          + (f"; wrote {out}/plan.json, plan.csv, winner.yaml, report.html" if out else ""))
    return 0 if w is not None else 1


def cmd_sweep(a) -> int:
    from sim.scenario import ScenarioError
    from scenarios.sweep import format_table, sweep
    try:
        rates = [float(x) for x in a.rates.split(",")] if a.rates else None
    except ValueError:
        print(f"error: --rates {a.rates!r}: expected numbers separated by commas", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else None
    try:
        result = sweep(a.scenario, a.set, rates, a.seeds, a.requests, out, workers=a.workers,
                       progress=not a.no_progress)
    except ScenarioError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    if out:
        print(f"results: {out}/ (sweep.json, sweep.csv, latency_vs_load.png)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="servetwin", description="ServeTwin: LLM serving digital twin")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("simulate", help="simulate a scenario YAML")
    p.add_argument("scenario", help="scenario file, e.g. scenarios/quickstart.yaml")
    p.add_argument("--out", help="output directory (default results/<scenario name>)")
    p.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--replicates", type=int, default=0,
                   help="N more runs for 90%% prediction intervals (other seeds, step-time noise), at N+1 "
                        "times the cost; default 0: one simulation, no intervals")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("plan", help="capacity plan: the cheapest deployment meeting the scenario's `plan:` SLOs")
    p.add_argument("scenario", help="scenario file with a plan: section, e.g. scenarios/capacity-chat-h100.yaml")
    p.add_argument("--out", help="output directory for plan.json, plan.csv, report.html, plots and the cache")
    p.add_argument("--workers", type=int, default=2, help="local worker processes (default 2)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="evaluate on Ray: a cluster address, or none for a local Ray instance")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rate", type=float, default=None, help="override plan.target: serve this many req/s")
    g.add_argument("--gpus", type=int, default=None,
                   help="override plan.target: the most traffic this many GPUs serve within the SLOs")
    p.add_argument("--top", type=int, default=None, help="print only the first N candidates")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("sweep", help="what-if sweep: latency against load for each setting of any fields")
    p.add_argument("scenario", help="scenario file (its sweep: section gives defaults)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=V1,V2",
                   help="a scenario field and its values, e.g. scheduler.max_num_batched_tokens=512,2048 "
                        "(repeat for a grid)")
    p.add_argument("--rates", help="arrival rates in req/s, e.g. 2,4,8,16")
    p.add_argument("--seeds", type=int, default=None, help="seeds per point (default 2)")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default: the scenario's)")
    p.add_argument("--out", help="output directory (sweep.json, sweep.csv, latency_vs_load.png)")
    p.add_argument("--workers", type=int, default=2, help="local worker processes (default 2)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_sweep)

    try:
        from engine.cli import add_generate_args
    except ImportError:  # the engine extra (torch) is not installed
        add_generate_args = None
    if add_generate_args is not None:
        add_generate_args(sub)
    try:
        from engine.server.cli import add_serve_args
    except ImportError:
        add_serve_args = None
    if add_serve_args is not None:
        add_serve_args(sub)
    from calibration.cli import add_calibration_args
    add_calibration_args(sub)

    a = ap.parse_args(argv)
    try:
        return a.func(a)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in _ENGINE_DEPS:
            print(f"error: `servetwin {a.cmd}` runs the real engine, which needs {e.name!r}: install the "
                  "engine extra (pip install -e '.[engine]', or `make test`, which installs it)",
                  file=sys.stderr)
            return 2
        raise


_ENGINE_DEPS = {"torch", "transformers", "gguf", "accelerate", "safetensors", "triton", "fastapi",
                "uvicorn", "prometheus_client", "httpx"}


if __name__ == "__main__":
    raise SystemExit(main())
