"""What a plan prints and writes: the ranked table, the winner as deploy commands with the reason
it won, plan.json, plan.csv, the plots and one self-contained report.html."""
from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

CSV_COLUMNS = ("rank", "status", "label", "device", "tp", "replicas", "gpus", "max_num_batched_tokens",
               "max_num_seqs", "policy", "router", "max_rate_per_replica", "rate_lo", "rate_hi",
               "saturation_rps", "cost_per_hour", "binding_slo", "p50_ttft_s", "p99_ttft_s", "p50_tpot_s",
               "p99_tpot_s", "p99_itl_s", "p99_e2e_s", "attainment", "reason")


def _ms(x) -> str:
    return "-" if x is None or x != x else f"{x * 1e3:.0f}"


def _num(x, fmt="{:.1f}") -> str:
    return "-" if x is None or (isinstance(x, float) and (x != x or math.isinf(x))) else fmt.format(x)


def format_table(result: dict, limit: int | None = None) -> str:
    head = (f"{'#':>3} {'candidate':<40} {'repl':>4} {'GPUs':>4} {'$/h':>7} {'req/s/repl':>10} "
            f"{'interval':>13} {'binding':>12} {'TTFT p99':>8} {'TPOT p99':>8}  status")
    lines = [head, "-" * len(head)]
    cands = result["candidates"]
    shown = cands if limit is None else cands[:limit]
    for c in shown:
        pr = c.get("predicted") or {}
        iv = c.get("rate_interval")
        ivs = f"[{_num(iv[0])},{_num(iv[1])}]" if iv else "-"
        lines.append(
            f"{c['rank']:>3} {c['label'][:40]:<40} {_num(c['replicas'], '{}'):>4} {_num(c['gpus'], '{}'):>4} "
            f"{_num(c['cost_per_hour'], '{:.2f}'):>7} {_num(c['max_rate_per_replica']):>10} {ivs:>13} "
            f"{(pretty_slo(c['binding_slo']) if c.get('binding_slo') else '-'):>12} {_ms(pr.get('p99_ttft_s')):>8} {_ms(pr.get('p99_tpot_s')):>8}  "
            f"{c['status']}" + (f": {c['reason']}" if c["status"] in ("pruned", "infeasible") else ""))
    if limit is not None and len(cands) > limit:
        lines.append(f"    ... {len(cands) - limit} more in plan.csv")
    lines.append("(latencies in ms, predicted by the cluster simulation at the target rate; "
                 "interval = [highest passing, lowest failing] probed rate per replica)")
    return "\n".join(lines)


def deploy_commands(result: dict, c: dict) -> list[str]:
    """vllm serve and servetwin serve lines for a candidate (one per pool when disaggregated)."""
    model, util = result["hf_model"], result["gpu_memory_utilization"]
    b, s = c["max_num_batched_tokens"], c["max_num_seqs"]
    pol = {"priority": " --scheduling-policy priority"}.get(c["policy"], "")
    note = ("  # vLLM has no shortest-prompt-first policy: it schedules fcfs"
            if c["policy"] == "shortest_prompt_first" else "")
    n = c["replicas"] or 1
    pd = c.get("pd")
    if not pd:
        return [f"vllm serve {model} --tensor-parallel-size {c['tp']} --max-num-seqs {s} "
                f"--max-num-batched-tokens {b} --gpu-memory-utilization {util:g}{pol}   x {n} replica(s), "
                f"{c['router']} router{note}",
                f"servetwin serve --model {model} --max-num-seqs {s} --max-num-batched-tokens {b} "
                f"--gpu-memory-utilization {util:g} --policy {c['policy']}   x {n} replica(s)"]
    kv = " --kv-transfer-config '{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}'"
    out = []
    for pool in ("prefill", "decode"):
        k = pd.get(f"{pool}_replicas", 1) * n
        tp = pd.get(f"{pool}_tp", c["tp"])
        out.append(f"vllm serve {model} --tensor-parallel-size {tp} --max-num-seqs {s} "
                   f"--max-num-batched-tokens {b} --gpu-memory-utilization {util:g}{pol}{kv}   "
                   f"x {k} {pool} replica(s)")
    out.append(f"servetwin simulate <scenario with deployment.pd: {json.dumps(pd)} x {n}>  "
               "(servetwin serve has no disaggregated mode)")
    return out


def pretty_slo(name: str | None) -> str:
    """'p99 ttft_s' -> 'p99 TTFT'."""
    if not name:
        return "no SLO below the search's max rate"
    parts = name.split(" ")
    return " ".join(p[:-2].upper() if p.endswith("_s") else p for p in parts)


def why(result: dict) -> str:
    w = result["winner"]
    if w is None:
        return "No candidate met the SLOs at the target rate in a cluster simulation."
    others = [c for c in result["candidates"] if c is not w and c["status"] in ("confirmed", "bound")]
    ties = [c for c in others if abs(c["cost_per_hour"] - w["cost_per_hour"]) < 1e-9]
    dearer = [c for c in others if c["cost_per_hour"] > w["cost_per_hour"] + 1e-9]
    lo, hi = w["rate_interval"]
    unit = "P/D unit" if w.get("pd") else "replica"
    hi_s = f"{hi:.1f}" if hi else "beyond the search"
    tail = ""
    if ties:
        tail += (f"; {len(ties)} other candidate(s) cost the same and this one ranks first by its "
                 f"per-{unit} rate")
    if dearer:
        tail += (f"; the next cheapest, {dearer[0]['label']}, costs ${dearer[0]['cost_per_hour']:.2f}/h"
                 + (" or more" if dearer[0]["status"] == "bound" else ""))
    return (f"{w['label']} won because it is the cheapest configuration whose cluster meets "
            f"{result['slo_text']} at {result['target_rate']:g} req/s: {w['replicas']} {unit}(s), "
            f"{w['gpus']} GPU(s), ${w['cost_per_hour']:.2f}/h; one {unit} sustains {lo:.1f} req/s "
            f"(it fails at {hi_s}) before {pretty_slo(w['binding_slo'])} binds{tail}.")


def write_outputs(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "plan.json", "w") as f:
        json.dump(_finite(result), f, indent=1, default=_json_default, allow_nan=False)
    import pandas as pd
    rows = []
    for c in result["candidates"]:
        pr = c.get("predicted") or {}
        iv = c.get("rate_interval") or [None, None]
        row = {k: c.get(k) for k in CSV_COLUMNS}
        row.update(rate_lo=iv[0], rate_hi=iv[1], **{k: pr.get(k) for k in CSV_COLUMNS if k in pr})
        rows.append(row)
    pd.DataFrame(rows, columns=list(CSV_COLUMNS)).to_csv(out / "plan.csv", index=False)
    plots = write_plots(result, out)
    (out / "report.html").write_text(report_html(result, plots))


def _finite(x):
    """JSON has no infinity or NaN: an unbounded value (a probe whose requests never finished)
    is written as null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _json_default(x):
    if isinstance(x, float) and math.isinf(x):
        return None
    return float(x)


# ----------------------------------------------------------------------------------- plots
def write_plots(result: dict, out: Path) -> dict[str, Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    pts = [c for c in result["candidates"] if c.get("at_max_rate")]
    # Pareto front: output tokens/s per GPU at each candidate's max rate vs its median TPOT there.
    fig, ax = plt.subplots(figsize=(7.5, 5))
    xy = []
    for c in pts:
        m = c["at_max_rate"]
        tpot = m["tpot_s"]["p50"]
        if tpot is None:
            continue
        xy.append((tpot * 1e3, m["output_tokens_per_s"] / c["gpus_per_replica"], c))
    if xy:
        ax.scatter([p[0] for p in xy], [p[1] for p in xy], s=18, color="tab:gray", alpha=0.7, label="candidates")
        front, best = [], -1.0
        for x, y, c in sorted(xy, key=lambda p: (p[0], -p[1])):
            if y > best:
                front.append((x, y, c))
                best = y
        ax.plot([p[0] for p in front], [p[1] for p in front], "o-", color="tab:blue", label="Pareto front")
        for x, y, c in front:
            ax.annotate(c["label"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        w = result["winner"]
        if w is not None and w.get("at_max_rate"):
            m = w["at_max_rate"]
            ax.scatter([m["tpot_s"]["p50"] * 1e3], [m["output_tokens_per_s"] / w["gpus_per_replica"]],
                       marker="*", s=180, color="tab:red", label="winner", zorder=5)
    ax.set_xlabel("per-user latency: median TPOT at the candidate's max rate (ms)")
    ax.set_ylabel("throughput per GPU (output tokens/s)")
    ax.set_title("Throughput per GPU vs per-user latency")
    ax.grid(alpha=0.3)
    if xy:
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths["pareto"] = out / "pareto.png"
    fig.savefig(paths["pareto"], dpi=110)
    plt.close(fig)

    # Cost against target rate: ceil(rate / max rate per replica) replicas, for the best candidate
    # of each device and shape, and the cheapest of all (from the rate search; the cluster check
    # confirms the plan's own target only).
    fig, ax = plt.subplots(figsize=(7.5, 5))
    target = result["target_rate"]
    rates = [target * i / 40 for i in range(1, 121)]
    feas = [c for c in result["candidates"] if c.get("max_rate_per_replica")]

    def cost(c, r):
        return math.ceil(r / c["max_rate_per_replica"] - 1e-9) * c["gpus_per_replica"] * c["price_per_gpu_hour"]
    groups: dict = {}
    for c in feas:
        key = (c["device"], c["tp"], json.dumps(c.get("pd"), sort_keys=True))
        if key not in groups or c["max_rate_per_replica"] > groups[key]["max_rate_per_replica"]:
            groups[key] = c
    for c in list(groups.values())[:8]:
        shape = c["label"].split(" B")[0]
        ax.step(rates, [cost(c, r) for r in rates], where="post", lw=1.0, alpha=0.8,
                label=f"{shape} (best: B{c['max_num_batched_tokens']} S{c['max_num_seqs']})")
    if feas:
        ax.step(rates, [min(cost(c, r) for c in feas) for r in rates], where="post", color="black", lw=2.2,
                label="cheapest candidate")
    ax.axvline(target, color="black", ls="--", lw=0.8, label=f"target {target:g} req/s")
    ax.set_xlabel("target rate (req/s)")
    ax.set_ylabel("cost ($ per hour)")
    ax.set_title("Cost against target rate (replicas = ceil(rate / max rate per replica))")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)  # the target line has a label even when no candidate is feasible
    fig.tight_layout()
    paths["cost"] = out / "cost_vs_rate.png"
    fig.savefig(paths["cost"], dpi=110)
    plt.close(fig)
    return paths


# ----------------------------------------------------------------------------------- html
def report_html(result: dict, plots: dict[str, Path]) -> str:
    e = html.escape
    w = result["winner"]
    cmds = deploy_commands(result, w) if w else []
    head = ["#", "candidate", "status", "replicas", "GPUs", "$/h", "req/s per replica", "interval",
            "binding SLO", "TTFT p99 (ms)", "TPOT p99 (ms)", "ITL p99 (ms)", "note"]
    trs = []
    for c in result["candidates"]:
        pr = c.get("predicted") or {}
        iv = c.get("rate_interval")
        cells = [c["rank"], c["label"], c["status"], _num(c["replicas"], "{}"), _num(c["gpus"], "{}"),
                 _num(c["cost_per_hour"], "{:.2f}"), _num(c["max_rate_per_replica"]),
                 f"[{_num(iv[0])}, {_num(iv[1])}]" if iv else "-", pretty_slo(c.get("binding_slo")) if c.get("binding_slo") else "-",
                 _ms(pr.get("p99_ttft_s")), _ms(pr.get("p99_tpot_s")), _ms(pr.get("p99_itl_s")),
                 c.get("reason") or ""]
        style = ' class="win"' if c is w else ""
        trs.append(f"<tr{style}>" + "".join(f"<td>{e(str(x))}</td>" for x in cells) + "</tr>")
    imgs = "".join(
        f'<figure><img alt="{e(k)}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        f"</figure>" for k, p in plots.items())
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>ServeTwin plan: {e(result['scenario'])}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1300px; }}
table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 6px; text-align: right; }}
td:nth-child(2), td:last-child {{ text-align: left; }}
tr.win {{ background: #e6f4e6; font-weight: bold; }}
pre {{ background: #f4f4f4; padding: 0.8em; white-space: pre-wrap; }}
img {{ max-width: 640px; margin-right: 1em; }} figure {{ display: inline-block; margin: 0; }}
</style></head><body>
<h1>Capacity plan: {e(result['model'])}, {result['target_rate']:g} req/s</h1>
<p>Scenario <code>{e(result['scenario'])}</code>. SLOs: {e(result['slo_text'])}.
Search: seeds {e(str(result['search']['seeds']))}, {result['search']['requests']} requests per probe and
replica, relative tolerance {result['search']['rel_tol']:g}. Prices in USD per GPU-hour:
{e(', '.join(f'{k} {v:g}' for k, v in result['prices'].items()))}.</p>
<h2>Winner</h2>
<p>{e(why(result))}</p>
<pre>{e(chr(10).join(cmds))}</pre>
<h2>Plots</h2>{imgs}
<h2>All candidates, best first</h2>
<table><tr>{''.join(f'<th>{e(h)}</th>' for h in head)}</tr>
{chr(10).join(trs)}
</table>
<p>Latencies are predicted by a cluster simulation at the target rate (mean over seeds).
Status: confirmed = cluster-checked; bound = never cluster-checked because even its lower bound
(ceil(target / max rate per replica) replicas) is no cheaper than the winner; pruned = cannot run the workload (memory accounting); infeasible =
misses the SLOs at the lowest rate searched. Simulated by ServeTwin: the step times come from its
cost models, not from measurements of these GPUs.</p>
</body></html>
"""
