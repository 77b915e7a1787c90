"""What-if sweeps: `servetwin sweep SCENARIO.yaml --set FIELD=V1,V2 ... --rates R1,R2,...`.

Every combination of the --set values (any scenario field, by its dotted path) is simulated at
every rate with every seed. Output: a table (means over seeds, with the seeds' range), the plots
of TTFT, TPOT and ITL p50/p99 against rate per setting (bands: min to max over seeds), and each
setting's knee: the rate where the seed-mean p99 TTFT crosses the scenario's `slo.ttft_s`
(linear between the two rates around the crossing).

Defaults may sit in the scenario:

    sweep:
      set: {scheduler.max_num_batched_tokens: [512, 2048, 8192]}
      rates: [2, 4, 8, 16]
      seeds: 2
      requests: 500            # per run (default: the workload's num_requests)
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from scenarios.compose import at_rate, load_raw, measure, set_field, strip
from sim.scenario import ScenarioError, parse_scenario, parse_set, setting_label, settings


class SweepError(ScenarioError):
    pass


def sweep_task(t: dict) -> dict:
    """One setting at one rate, every seed (pure: the same inputs give the same numbers)."""
    runs = [measure(at_rate(t["data"], t["rate"], t.get("requests")), t["base_dir"], seed) for seed in t["seeds"]]
    return {"runs": runs}


def knee(rates: list[float], p99_ttft: list[float], slo: float | None) -> dict:
    """Where p99 TTFT first leaves its SLO, interpolated between the two rates around it."""
    if slo is None:
        return {"rate": None, "note": "no slo.ttft_s in the scenario"}
    for i, (r, v) in enumerate(zip(rates, p99_ttft)):
        if v is None or v != v or v > slo:
            if i == 0:
                return {"rate": None, "note": f"above the SLO already at {r:g} req/s", "below": None, "above": r}
            r0, v0 = rates[i - 1], p99_ttft[i - 1]
            x = r0 + (r - r0) * (slo - v0) / (v - v0) if v == v and v is not None and v > v0 else r
            return {"rate": x, "below": r0, "above": r, "note": f"between {r0:g} and {r:g} req/s"}
    return {"rate": None, "note": f"within the SLO up to {rates[-1]:g} req/s", "below": rates[-1], "above": None}


def sweep(path: str | Path, set_items: list[str] | None = None, rates: list[float] | None = None,
          seeds: int | None = None, requests: int | None = None, out_dir: str | Path | None = None,
          workers: int = 2, progress: bool = True) -> dict:
    data, base_dir = load_raw(path)
    cfg = data.get("sweep") or {}
    if not isinstance(cfg, dict):
        raise SweepError(f"{path}: sweep: must be a mapping")
    unknown = set(cfg) - {"set", "rates", "seeds", "requests"}
    if unknown:
        raise SweepError(f"{path}: sweep.{sorted(unknown)[0]}: unknown key; expected set, rates, seeds, requests")
    fields = dict(cfg.get("set") or {})
    fields = {k: (v if isinstance(v, list) else [v]) for k, v in fields.items()}
    if set_items:
        fields.update(parse_set(set_items))
    rates = rates or cfg.get("rates")
    if not rates:
        raise SweepError(f"{path}: no rates: give --rates 2,4,8 or sweep.rates")
    if any(not isinstance(r, (int, float)) or isinstance(r, bool) or r <= 0 for r in rates):
        raise SweepError(f"{path}: rates={rates!r}: must be numbers > 0")
    rates = sorted(float(r) for r in rates)
    nseeds = seeds or cfg.get("seeds", 2)
    requests = requests or cfg.get("requests")
    base_seed = data.get("seed", 0) if isinstance(data.get("seed", 0), int) else 0
    seed_list = [base_seed + i for i in range(int(nseeds))]
    base = strip(data)
    sets = settings(fields)
    composed = []
    for s in sets:
        d = base
        for k, v in s.items():
            d = set_field(d, k, v)
        try:  # fail early, naming the field, before simulating anything
            parse_scenario(set_field(at_rate(d, rates[0]), "workload.num_requests", 2), base_dir=base_dir, seed=0)
        except ScenarioError as e:
            raise SweepError(f"{path}: {setting_label(s)}: {e}") from None
        composed.append(d)
    slo = (data.get("slo") or {}).get("ttft_s")

    from scenarios.runner import Runner
    runner = Runner(Path(out_dir) / "cache" if out_dir else None, workers, None, progress)
    tasks = [{"data": d, "base_dir": str(base_dir), "rate": r, "seeds": seed_list, "requests": requests}
             for d in composed for r in rates]
    results = runner.run("scenarios.sweep:sweep_task", tasks, "sweep")
    runner.close()
    rows = []
    by_setting = []
    k = 0
    for s in sets:
        pts = []
        for r in rates:
            runs = results[k]["runs"]
            k += 1
            row = {"setting": setting_label(s), **{f: v for f, v in s.items()}, "rate": r}
            for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
                for p in ("p50", "p99"):
                    vals = [m[metric][p] for m in runs if m[metric][p] is not None]
                    row[f"{p}_{metric}"] = float(np.mean(vals)) if vals else None
                    row[f"{p}_{metric}_min"] = float(np.min(vals)) if vals else None
                    row[f"{p}_{metric}_max"] = float(np.max(vals)) if vals else None
            row["throughput_rps"] = float(np.mean([m["throughput_rps"] for m in runs]))
            row["goodput_rps"] = float(np.mean([m["goodput_rps"] for m in runs]))
            row["preemptions"] = float(np.mean([m["preemptions"] for m in runs]))
            rows.append(row)
            pts.append(row)
        by_setting.append({"setting": setting_label(s), "values": s,
                           "knee": knee(rates, [p["p99_ttft_s"] for p in pts], slo), "points": pts})
    result = {"scenario": str(path), "fields": fields, "rates": rates, "seeds": seed_list,
              "slo_ttft_s": slo, "rows": rows, "settings": by_setting,
              "simulated_tasks": runner.simulated, "cached_tasks": runner.cached}
    if out_dir is not None:
        write_outputs(result, Path(out_dir))
    return result


def format_table(result: dict) -> str:
    head = (f"{'setting':<34} {'rate':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
            f"{'ITL p50':>8} {'ITL p99':>8} {'req/s':>7}")
    lines = [head, "-" * len(head)]

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.0f}"
    for s in result["settings"]:
        for p in s["points"]:
            lines.append(f"{s['setting'][:34]:<34} {p['rate']:>6g} {ms(p['p50_ttft_s']):>9} {ms(p['p99_ttft_s']):>9} "
                         f"{ms(p['p50_tpot_s']):>9} {ms(p['p99_tpot_s']):>9} {ms(p['p50_itl_s']):>8} "
                         f"{ms(p['p99_itl_s']):>8} {p['throughput_rps']:>7.2f}")
    lines.append("(ms; means over seeds " + ", ".join(map(str, result["seeds"])) + ")")
    slo = result["slo_ttft_s"]
    for s in result["settings"]:
        kn = s["knee"]
        where = f"~{kn['rate']:.1f} req/s ({kn['note']})" if kn.get("rate") else kn["note"]
        lines.append(f"knee, {s['setting']}: p99 TTFT leaves {slo:g} s at {where}" if slo else
                     f"knee, {s['setting']}: {kn['note']}")
    return "\n".join(lines)


def write_outputs(result: dict, out: Path) -> None:
    import pandas as pd
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sweep.json", "w") as f:
        json.dump(result, f, indent=1, default=float)
    pd.DataFrame(result["rows"]).to_csv(out / "sweep.csv", index=False)
    plot(result, out / "latency_vs_load.png")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (metric, title) in zip(axes, (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"))):
        for i, s in enumerate(result["settings"]):
            c = colors[i % len(colors)]
            pts = s["points"]
            x = [p["rate"] for p in pts]
            for pct, ls in (("p50", "--"), ("p99", "-")):
                y = [_ms(p[f"{pct}_{metric}"]) for p in pts]
                lo = [_ms(p[f"{pct}_{metric}_min"]) for p in pts]
                hi = [_ms(p[f"{pct}_{metric}_max"]) for p in pts]
                ax.plot(x, y, ls, color=c, marker="o", ms=3, label=f"{s['setting']} {pct}")
                ax.fill_between(x, lo, hi, color=c, alpha=0.12)
        if metric == "ttft_s" and result["slo_ttft_s"]:
            ax.axhline(result["slo_ttft_s"] * 1e3, color="red", ls=":", label="TTFT SLO")
            for i, s in enumerate(result["settings"]):
                if s["knee"].get("rate"):
                    ax.axvline(s["knee"]["rate"], color=colors[i % len(colors)], ls=":", lw=0.8)
        ys = [_ms(p[f"{pct}_{metric}"]) for s in result["settings"] for p in s["points"] for pct in ("p50", "p99")]
        if any(y > 0 for y in ys if y == y):
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "undefined (single-token outputs)", ha="center", transform=ax.transAxes)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} p50 (dashed) and p99 (solid) vs load")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ms(x):
    return math.nan if x is None else x * 1e3
