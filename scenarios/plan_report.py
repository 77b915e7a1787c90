"""What a plan prints and writes: the ranked candidate records, the winner as deploy commands
with the reason it won, plan.json, plan.csv, winner.yaml, the plots and one self-contained
report.html."""
from __future__ import annotations

import base64
import html
import json
import math
import shlex
from pathlib import Path

import yaml

from scenarios.candidates import budget_rank_key, compose, hf_checkpoint, rank_key


SLO_KEYS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")
CSV_COLUMNS = ("rank", "status", "label", "device", "tp", "replicas", "gpus", "max_num_batched_tokens",
               "max_num_seqs", "policy", "router", "cost_per_hour", "headroom", "max_rate_per_replica",
               "rate_lo", "rate_hi", "bound_rps", "binding_slo", "p50_ttft_s", "p99_ttft_s", "p50_tpot_s",
               "p99_tpot_s", "p99_itl_s", "p99_e2e_s", "attainment", "confirm_requests", "reason")
STATUS_TEXT = {
    "confirmed": "a cluster simulation at the target confirms it",
    "unconfirmed": "its cluster misses the SLOs even with max_extra_replicas more units",
    "estimated": "unit probes only (not among the shown alternatives, so not cluster-checked)",
    "dearer": "cannot beat the winner's cost: it fails at every unit count that would cost no more",
    "infeasible": "misses the SLOs at every load the search tried",
    "lower": "cannot carry more traffic than the winner within the GPU budget",
    "pruned": "cannot run the workload (memory accounting or scenario validation)",
}


# ----------------------------------------------------------------------------------- records
def _avg(runs: list[dict], part: str) -> dict:
    """Seed mean of each metric statistic of the runs' `part` ("all" or "steady")."""
    out: dict = {}
    got = [r[part] for r in runs if r.get(part)]
    if not got:
        return out
    for k in SLO_KEYS:
        for st in ("mean", "p50", "p90", "p99"):
            vals = [g[k][st] for g in got if g[k][st] is not None and g[k][st] == g[k][st]]
            out[f"{st}_{k}"] = sum(vals) / len(vals) if vals else None
    for k in ("attainment", "throughput_rps", "output_tokens_per_s"):
        vals = [g[k] for g in got if g.get(k) is not None]
        out[k] = sum(vals) / len(vals) if vals else None
    return out


def _compact_runs(res: dict) -> list[dict]:
    return [{"seed": r["seed"], "stage": r["stage"], "requests": r["requests"],
             "simulated_s": r["simulated_s"], "pass": not r["violations"],
             "violations": r["violations"],
             **({"steady_window": r["steady_window"]} if "steady_window" in r else {}),
             "percentiles": {k: r["all"][k] for k in SLO_KEYS} if r.get("all") else None}
            for r in res["runs"]]


def _confirmation(res: dict | None, units: int, rate: float) -> dict | None:
    if res is None:
        return None
    full = [r for r in res["runs"] if r["stage"] == 2]
    return {"units": units, "rate": rate, "pass": res["ok"],
            "requests": max((r["requests"] for r in res["runs"]), default=0),
            "simulated_s": sum(r["simulated_s"] for r in res["runs"]),
            "seeds": [r["seed"] for r in res["runs"]], "runs": _compact_runs(res),
            "all_requests": _avg(full, "all"), "steady": _avg(full, "steady")}


def _binding(probes: dict, key) -> dict | None:
    res = probes.get(key)
    if res is None or res["ok"]:
        return None
    v = res["runs"][-1]["violations"]
    return max(v, key=lambda x: x["ratio"]) if v else None


def _probe_list(state) -> list[dict]:
    out = []
    for (total, n), res in sorted(state.probes.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        out.append({"total_rate": total, "units": n, "rate_per_unit": total / n, "ok": res["ok"],
                    "layout": res["layout"],
                    "runs": [{"seed": r["seed"], "stage": r["stage"], "requests": r["requests"],
                              "simulated_s": r["simulated_s"], "violations": r["violations"]}
                             for r in res["runs"]]})
    return out


def _fallbacks(state, confirms: dict) -> dict:
    lookups, fb, rng = 0, {}, {}
    sources = [res.get("provenance") for res in state.probes.values()]
    sources += [res.get("provenance") for res in confirms.values()]
    for p in sources:
        if not p:
            continue
        lookups += p["lookups"]
        for k, v in p["fallbacks"].items():
            fb[k] = fb.get(k, 0) + v
        for k, (lo, hi) in p.get("fallback_range", {}).items():
            have = rng.get(k)
            rng[k] = ([lo, hi] if have is None else
                      [[min(a, b) for a, b in zip(have[0], lo)], [max(a, b) for a, b in zip(have[1], hi)]])
    return {"lookups": lookups, "fallbacks": fb, "fallback_range": rng}


def assemble(rows: list[dict], live: list[dict], confirms: dict, spec, data: dict, path: str,
             means: dict, model: str) -> dict:
    """The ranked candidate records of plan.json."""
    budget = spec.target_gpus is not None
    T = spec.target_rate
    results, gone = confirms["results"], set(confirms["gone"])
    dep = data.get("deployment") or {}
    recs = []
    for r in rows:
        c = r["cand"]
        rec = {"label": r["label"], "device": c["device"], "tp": c["tp"],
               "data_parallel": c.get("data_parallel", 1), "pd": c.get("pd"),
               "max_num_batched_tokens": c["max_num_batched_tokens"], "max_num_seqs": c["max_num_seqs"],
               "policy": c["policy"], "router": c["router"], "gpus_per_replica": r["gpus_per_unit"],
               "price_per_gpu_hour": r["price"], "status": None, "replicas": None, "gpus": None,
               "cost_per_hour": None, "max_rate_per_replica": None, "rate_interval": None,
               "capacity_rps": None, "headroom": None, "bound_rps": r.get("bound"), "binding_slo": None,
               "predicted": None, "confirmation": None, "reason": None}
        if r["pruned"]:
            rec.update(status="pruned", reason=r["pruned"])
            recs.append((rec, None))
            continue
        s = r["state"]
        mine = results.get(s.key, {})
        rec["probes"] = _probe_list(s)
        rec["cost_model"] = r["cost_model"]
        rec["table_fallbacks"] = _fallbacks(s, mine)
        if budget:
            n = spec.target_gpus // r["gpus_per_unit"]
            rec.update(replicas=n, gpus=n * r["gpus_per_unit"], cost_per_hour=n * s.unit_cost)
            if s.lo is None:
                rec.update(status="infeasible" if s.done == "infeasible" else "lower",
                           reason=STATUS_TEXT["infeasible" if s.done == "infeasible" else "lower"])
            else:
                rate = round(s.lo, 9)
                res = mine.get(rate)
                rec.update(capacity_rps=s.lo, max_rate_per_replica=s.lo / n,
                           rate_interval=[s.lo / n, s.hi / n] if s.hi else None,
                           status="confirmed" if res and res["ok"] else "estimated")
                if s.key in gone:
                    rec["status"] = "unconfirmed"
                if res is not None:
                    rec["confirmation"] = _confirmation(res, n, s.lo)
                    rec["predicted"] = rec["confirmation"]["all_requests"]
                    up = mine.get(round(s.lo * (1 + spec.rel_tol), 9))
                    if up is not None:
                        rec["confirmation"]["one_step_more"] = _confirmation(up, n, s.lo * (1 + spec.rel_tol))
                b = _binding(s.probes, (round(s.hi, 9), n)) if s.hi else None
                rec["binding"], rec["binding_slo"] = b, (b or {}).get("slo")
            recs.append((rec, s))
            continue
        if s.pass_n is None:
            st = "infeasible" if s.done == "infeasible" else "dearer"
            rec.update(status=st, reason=STATUS_TEXT[st])
            if st == "dearer":
                rec["cost_per_hour"] = None
                rec["cost_lower_bound"] = s.cost_lb
            recs.append((rec, s))
            continue
        n = s.pass_n
        rec.update(replicas=n, gpus=n * r["gpus_per_unit"], cost_per_hour=s.cost)
        if s.refined_n == n and s.lo is not None:
            rec.update(capacity_rps=s.lo, headroom=s.lo / T, max_rate_per_replica=s.lo / n,
                       rate_interval=[s.lo / n, s.hi / n])
        else:
            hi = T / s.fail_n if s.fail_n >= 1 else None
            rec.update(max_rate_per_replica=T / n, rate_interval=[T / n, hi / 1 if hi else None],
                       capacity_rps=T, headroom=None)
        b = _binding(s.probes, (round(T, 9), s.fail_n)) or (
            _binding(s.probes, (round(s.hi, 9), n)) if s.hi else None)
        rec["binding"], rec["binding_slo"] = b, (b or {}).get("slo")
        res = mine.get(n)
        if res is not None:
            rec["confirmation"] = _confirmation(res, n, T)
            rec["predicted"] = rec["confirmation"]["all_requests"]
            if n - 1 in mine:
                rec["confirmation"]["one_fewer"] = _confirmation(mine[n - 1], n - 1, T)
            rec["status"] = "confirmed" if res["ok"] else "unconfirmed"
        else:
            rec["status"] = "estimated"
        if s.key in gone:
            rec["status"] = "unconfirmed"
        recs.append((rec, s))

    order = {"confirmed": 0, "estimated": 1, "unconfirmed": 2, "dearer": 3, "lower": 3, "infeasible": 4,
             "pruned": 5}
    def key(x):
        rec, s = x
        if s is None:
            return (order[rec["status"]], math.inf, 0, 0, rec["label"])
        mine = budget_rank_key(s, rec["replicas"] or 0) if budget else rank_key(s)
        return (order[rec["status"]],) + mine + (rec["label"],)
    recs.sort(key=key)
    out = [rec for rec, _s in recs]
    for i, x in enumerate(out):
        x["rank"] = i + 1
        if x["status"] not in ("pruned",) and not x.get("reason"):
            x["reason"] = STATUS_TEXT.get(x["status"])
    winner = out[0] if out and out[0]["status"] == "confirmed" else None
    hf_model, quantization = hf_checkpoint(model, dep.get("weight_dtype"), _catalog_dtype(model))
    result = {"scenario": path, "model": model, "hf_model": hf_model, "serve_quantization": quantization,
              "gpu_memory_utilization": dep.get("gpu_memory_utilization", 0.9),
              "expert_parallel": bool(dep.get("expert_parallel", False)),
              "moe_activations": ((data.get("cost_model") or {}).get("moe_activations") or "bf16"),
              "moe_backend": ((data.get("cost_model") or {}).get("moe_backend") or "auto"),
              "api_server_count": dep.get("api_server_count"),
              "mode": "gpus" if budget else "rate", "target_rate": T, "target_gpus": spec.target_gpus,
              "slo": spec.slo_spec(), "slo_text": spec.describe_slo(), "scenario_slo": spec.scenario_slo,
              "search": {**spec.search_spec(), "refine_steps": spec.refine_steps,
                         "alternatives": spec.alternatives, "max_extra_replicas": spec.max_extra_replicas},
              "ranking": ("most traffic within the GPU budget, then cost" if budget else
                          "cost ($/h) first, then headroom (total rate sustained / target), then label"),
              "prices": spec.prices, "candidates": out, "winner": winner,
              "pareto": pareto(live)}
    result["workload_means"] = means
    return result


def _catalog_dtype(model: str) -> str | None:
    """The weight dtype of a catalog model's own checkpoint (None for a model the catalog lacks)."""
    from sim.specs import get_model
    try:
        return get_model(model).weight_dtype
    except (ValueError, KeyError, TypeError):
        return None


def pareto(live: list[dict]) -> list[dict]:
    """Throughput per GPU against throughput per user (1 / mean TPOT) of every probe that ran its
    whole stream (each seed a point), with the front of points no other point beats on both."""
    pts = []
    for r in live:
        s = r["state"]
        for (total, n), res in s.probes.items():
            for run in res["runs"]:
                if run["stage"] != 2:
                    continue
                m = run["metrics"]
                tpot = m["tpot_s"]["mean"]
                if not tpot:
                    continue
                pts.append({"label": r["label"], "units": n, "total_rate": total, "seed": run["seed"],
                            "tokens_per_s_per_gpu": m["output_tokens_per_s"] / r["gpus_per_unit"],
                            "tokens_per_s_per_user": 1.0 / tpot, "meets_slo": not run["violations"]})
    for p in pts:
        p["front"] = not any(q["tokens_per_s_per_gpu"] >= p["tokens_per_s_per_gpu"] and
                             q["tokens_per_s_per_user"] >= p["tokens_per_s_per_user"] and
                             (q["tokens_per_s_per_gpu"], q["tokens_per_s_per_user"]) !=
                             (p["tokens_per_s_per_gpu"], p["tokens_per_s_per_user"]) for q in pts)
    pts.sort(key=lambda p: -p["tokens_per_s_per_user"])
    return pts


# ----------------------------------------------------------------------------------- text
def _ms(x) -> str:
    return "-" if x is None or x != x else f"{x * 1e3:.0f}"


def _num(x, fmt="{:.1f}") -> str:
    return "-" if x is None or (isinstance(x, float) and (x != x or math.isinf(x))) else fmt.format(x)


def format_table(result: dict, limit: int | None = None) -> str:
    head = (f"{'#':>3} {'candidate':<40} {'repl':>4} {'GPUs':>4} {'$/h':>7} {'headroom':>8} "
            f"{'req/s/repl':>10} {'interval':>13} {'binding':>12} {'TTFT p99':>8} {'TPOT p99':>8}  status")
    lines = [head, "-" * len(head)]
    cands = result["candidates"]
    shown = cands if limit is None else cands[:limit]
    for c in shown:
        pr = c.get("predicted") or {}
        iv = c.get("rate_interval")
        ivs = f"[{_num(iv[0])},{_num(iv[1])}]" if iv else "-"
        lines.append(
            f"{c['rank']:>3} {c['label'][:40]:<40} {_num(c['replicas'], '{}'):>4} {_num(c['gpus'], '{}'):>4} "
            f"{_num(c['cost_per_hour'], '{:.2f}'):>7} {_num(c.get('headroom'), '{:.2f}'):>8} "
            f"{_num(c['max_rate_per_replica']):>10} {ivs:>13} "
            f"{(pretty_slo(c['binding_slo']) if c.get('binding_slo') else '-'):>12} "
            f"{_ms(pr.get('p99_ttft_s')):>8} {_ms(pr.get('p99_tpot_s')):>8}  "
            f"{c['status']}" + (f": {c['reason']}" if c["status"] in ("pruned", "infeasible") else ""))
    if limit is not None and len(cands) > limit:
        lines.append(f"    ... {len(cands) - limit} more in plan.csv")
    lines.append("(latencies in ms over all requests of the cluster simulation at the target; "
                 "headroom = total rate sustained / target; interval = [highest passing, lowest failing] "
                 "rate per replica)")
    return "\n".join(lines)


def _serve_args(c: dict, util: float) -> str:
    pol = " --scheduling-policy priority" if c["policy"] == "priority" else ""
    return (f"--max-num-seqs {c['max_num_seqs']} --max-num-batched-tokens {c['max_num_batched_tokens']} "
            f"--gpu-memory-utilization {util:g}{pol}")


def _replica_lines(model: str, tp: int, n: int, args: str, port0: int, extra: str = "", env: str = "",
                   per_node: int = 8, dp: int = 1) -> list[str]:
    """One `vllm serve` per replica of one node (GPUs and ports numbered), and how many nodes; a
    replica of dp data-parallel ranks takes tp x dp GPUs."""
    width = tp * dp
    fit = max(1, per_node // width)
    lines = []
    for i in range(min(n, fit)):
        gpus = ",".join(str(g) for g in range(i * width, (i + 1) * width))
        lines.append(f"CUDA_VISIBLE_DEVICES={gpus} {env}vllm serve {shlex.quote(model)} --tensor-parallel-size {tp} "
                     f"{args}{extra} --port {port0 + i} &")
    nodes = math.ceil(n / fit)
    if nodes > 1:
        last = n - (nodes - 1) * fit
        lines.insert(0, f"# {n} replicas: run the lines below on each of {nodes} nodes "
                        f"({fit} per node; the last node runs the first {last})")
    return lines


def deploy_commands(result: dict, c: dict) -> list[str]:
    """Pasteable lines: vllm serve per replica (or per pool when disaggregated), a servetwin serve
    line where it can serve the shape, and a client command that checks the winner at the target."""
    model, util = result["hf_model"], result["gpu_memory_utilization"]
    n = c["replicas"] or 1
    pd = c.get("pd")
    dp = c.get("data_parallel", 1)
    common = ""  # the flags every server of the plan takes
    if result.get("serve_quantization"):
        common += f" --quantization {result['serve_quantization']}"
    if result.get("moe_backend", "auto") != "auto":  # the MoE kernel the plan was timed with
        common += f" --moe-backend {result['moe_backend']}"
    # the scenario's API server count (absent: vLLM's default, as simulated): vllm serve lines only
    # (servetwin serve runs one; P/D scenarios refuse the key)
    api_flag = f" --api-server-count {result['api_server_count']}" if result.get("api_server_count") else ""

    def engine_args(limits: dict, tp: int, ranks: int, ep: bool) -> str:
        a = _serve_args(limits, util)
        if ranks > 1:
            a += f" --data-parallel-size {ranks}"
        if ep and tp * ranks > 1:
            a += " --enable-expert-parallel"
        return a + common

    args = engine_args(c, c["tp"], dp, bool(result.get("expert_parallel")))
    # the MoE kernel the plan was timed with (cost_model.moe_activations) is an environment switch
    env = "VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1 " if result.get("moe_activations") == "mxfp8" else ""
    out = []
    if c["policy"] == "shortest_prompt_first":
        out.append("# vLLM has no shortest-prompt-first policy: these servers schedule fcfs")
    if not pd:
        dps = f" x data parallel {dp}" if dp > 1 else ""
        out.append(f"# {n} replica(s) of {model}, tensor parallel {c['tp']}{dps} ({c['device']}), behind a "
                   f"{c['router']} load balancer on the ports below")
        out += _replica_lines(model, c["tp"], n, args + api_flag, 8000, env=env, dp=dp)
    else:
        kv = " --kv-transfer-config " + shlex.quote('{"kv_connector":"NixlConnector","kv_role":"kv_both"}')
        port = 8000
        for pool in ("prefill", "decode"):
            k = pd.get(f"{pool}_replicas", 1) * n
            tp, ranks = pd.get(f"{pool}_tp", c["tp"]), pd.get(f"{pool}_data_parallel", 1)
            ep = pd.get(f"{pool}_expert_parallel", bool(result.get("expert_parallel")))
            limits = {**c, **{key: pd[f"{pool}_{key}"] for key in ("max_num_seqs", "max_num_batched_tokens")
                              if pd.get(f"{pool}_{key}")}}
            shape = f"tensor parallel {tp}" + (f" x data parallel {ranks}" if ranks > 1 else "")
            out.append(f"# {pool} pool: {k} replica(s), {shape}")
            out += _replica_lines(model, tp, k, engine_args(limits, tp, ranks, ep), port, kv, env, dp=ranks)
            port += 100
        out.append("# a P/D proxy (e.g. vLLM's disaggregated prefill proxy) routes each request to a prefill "
                   "server, then a decode server")
    local = model.split("/")[-1]
    if model.startswith("<"):  # a placeholder for a 4-bit checkpoint (candidates.hf_checkpoint)
        out.append("# servetwin serve loads no 4-bit integer checkpoint: check this shape with vllm")
    elif not pd and c["tp"] == 1 and dp == 1:
        m = "default" if result["model"] == "smollm2-135m" else f"./{local}"
        note = "" if m == "default" else f"   # ./{local}: a local copy (HF folder) of {model}"
        sv = args.replace(" --scheduling-policy priority", "")
        out.append(f"servetwin serve --model {m} --port 8000 {sv} "
                   f"--policy {c['policy']} --max-waiting 100000{note}")
    else:
        out.append("# servetwin serve runs one GPU per server (no tensor parallelism, no P/D pools): "
                   "check this shape with vllm")
    wm = result.get("workload_means") or {}
    if result.get("target_rate") or c.get("capacity_rps"):
        rate = result.get("target_rate") or c["capacity_rps"]
        reqs = int(result["search"].get("confirm_requests", 8000))
        out.append(
            f"aiperf profile --model {shlex.quote(model)} --url http://localhost:8000 --endpoint-type completions "
            f"--streaming --request-rate {rate:g} --request-count {reqs} "
            f"--synthetic-input-tokens-mean {wm.get('prompt_tokens_mean', 0):.0f} "
            f"--synthetic-input-tokens-stddev {wm.get('prompt_tokens_std', 0):.0f} "
            f"--output-tokens-mean {wm.get('output_tokens_mean', 0):.0f} "
            f"--output-tokens-stddev {wm.get('output_tokens_std', 0):.0f} --extra-inputs ignore_eos:true"
            "   # checks the deployment at the planned rate (point --url at the load balancer)")
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
        return "No candidate met the SLOs in a cluster simulation."
    conf = w.get("confirmation") or {}
    runs = f"{conf.get('requests', 0)} requests x {len(conf.get('seeds', []))} seed(s)"
    unit = "P/D unit" if w.get("pd") else "replica"
    if result["mode"] == "gpus":
        more = conf.get("one_step_more")
        tail = (f"; at {more['rate']:.1f} req/s it fails" if more and not more["pass"] else "")
        return (f"{w['label']} serves the most traffic on {result['target_gpus']} GPUs: {w['replicas']} "
                f"{unit}(s) carry {w['capacity_rps']:.1f} req/s within {result['slo_text']} in a cluster "
                f"simulation ({runs}){tail}.")
    others = [c for c in result["candidates"] if c is not w and c["status"] in ("confirmed", "estimated")]
    ties = [c for c in others if c["cost_per_hour"] is not None and abs(c["cost_per_hour"] - w["cost_per_hour"]) < 1e-9]
    dearer = [c for c in others if c["cost_per_hour"] is not None and c["cost_per_hour"] > w["cost_per_hour"] + 1e-9]
    tail = ""
    fewer = conf.get("one_fewer")
    if fewer is not None:
        tail += f"; with {fewer['units']} {unit}(s) the cluster {'passes' if fewer['pass'] else 'fails'}"
    if w.get("headroom"):
        tail += f"; it sustains {w['capacity_rps']:.1f} req/s in all (headroom {w['headroom']:.2f}x)"
    if ties:
        tail += f"; {len(ties)} other candidate(s) cost the same and have no more headroom"
    if dearer:
        tail += f"; the next cheapest, {dearer[0]['label']}, costs ${dearer[0]['cost_per_hour']:.2f}/h"
    return (f"{w['label']} won: the cheapest configuration whose cluster meets {result['slo_text']} at "
            f"{result['target_rate']:g} req/s ({runs}): {w['replicas']} {unit}(s), {w['gpus']} GPU(s), "
            f"${w['cost_per_hour']:.2f}/h{tail}.")


def provenance_text(result: dict) -> list[str]:
    """One line per shown candidate: its cost model and the kernel-table fallbacks behind it."""
    out = []
    for c in result["candidates"][:3]:
        cm = c.get("cost_model")
        if not cm:
            continue
        fb = c.get("table_fallbacks") or {}
        n = sum(fb.get("fallbacks", {}).values())
        where = "; ".join(f"{k} x{v} (queries {fb['fallback_range'].get(k)})" for k, v in fb.get("fallbacks", {}).items())
        out.append(f"{c['label']}: cost model {cm.get('kind')} ({cm.get('source', '')}); "
                   f"{n} of {fb.get('lookups', 0)} table lookups fell back to the roofline" + (f": {where}" if where else ""))
    return out


# ----------------------------------------------------------------------------------- files
def winner_scenario(result: dict, data: dict) -> dict | None:
    """The scenario that reproduces the winner at the target (servetwin simulate DIR/winner.yaml)."""
    w = result["winner"]
    if w is None:
        return None
    from scenarios.compose import at_rate
    cand = {k: w[k] for k in ("device", "tp", "max_num_batched_tokens", "max_num_seqs", "policy", "router", "pd")}
    out = compose(data, cand, w["replicas"])
    rate = result["target_rate"] or w["capacity_rps"]
    return at_rate(out, rate, int(result["search"]["confirm_requests"]))


def write_outputs(result: dict, out: Path, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "plan.json", "w") as f:
        json.dump(_finite(result), f, indent=1, default=_json_default, allow_nan=False)
    import pandas as pd
    rows = []
    for c in result["candidates"]:
        pr = c.get("predicted") or {}
        iv = c.get("rate_interval") or [None, None]
        row = {k: c.get(k) for k in CSV_COLUMNS}
        row.update(rate_lo=iv[0], rate_hi=iv[1], confirm_requests=(c.get("confirmation") or {}).get("requests"),
                   **{k: pr.get(k) for k in CSV_COLUMNS if k in pr})
        rows.append(row)
    pd.DataFrame(rows, columns=list(CSV_COLUMNS)).to_csv(out / "plan.csv", index=False)
    ws = winner_scenario(result, data)
    if ws is not None:
        (out / "winner.yaml").write_text(
            "# The plan's winner at its target, as a scenario: servetwin simulate winner.yaml\n"
            + yaml.safe_dump(ws, sort_keys=False))
    plots = write_plots(result, out)
    (out / "report.html").write_text(report_html(result, plots))


def _finite(x):
    """JSON has no infinity or NaN: an unbounded value (a probe whose requests never finished)
    is written as null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
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
    pts = result["pareto"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    if pts:
        ok = [p for p in pts if p["meets_slo"]]
        bad = [p for p in pts if not p["meets_slo"]]
        ax.scatter([p["tokens_per_s_per_user"] for p in bad], [p["tokens_per_s_per_gpu"] for p in bad], s=12,
                   color="tab:gray", alpha=0.5, label="probe misses an SLO")
        ax.scatter([p["tokens_per_s_per_user"] for p in ok], [p["tokens_per_s_per_gpu"] for p in ok], s=16,
                   color="tab:green", alpha=0.7, label="probe meets the SLOs")
        front = sorted([p for p in pts if p["front"]], key=lambda p: p["tokens_per_s_per_user"])
        ax.plot([p["tokens_per_s_per_user"] for p in front], [p["tokens_per_s_per_gpu"] for p in front], "-",
                color="tab:blue", label="Pareto front")
        ax.legend(fontsize=8)
    ax.set_xlabel("throughput per user: output tokens/s (1 / mean TPOT)")
    ax.set_ylabel("throughput per GPU: output tokens/s")
    ax.set_title("Throughput per GPU vs per user (steady-state probes)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths["pareto"] = out / "pareto.png"
    fig.savefig(paths["pareto"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 5))
    shown = [c for c in result["candidates"] if c.get("cost_per_hour") is not None][:12]
    ax.barh([c["label"] for c in shown][::-1], [c["cost_per_hour"] for c in shown][::-1],
            color=["tab:green" if c["status"] == "confirmed" else "tab:gray" for c in shown][::-1])
    ax.set_xlabel("cost ($ per hour)")
    ax.set_title("Cost of the best candidates (green: cluster-confirmed)")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    paths["cost"] = out / "cost.png"
    fig.savefig(paths["cost"], dpi=110)
    plt.close(fig)
    return paths


# ----------------------------------------------------------------------------------- html
def report_html(result: dict, plots: dict[str, Path]) -> str:
    e = html.escape
    w = result["winner"]
    cmds = deploy_commands(result, w) if w else []
    head = ["#", "candidate", "status", "replicas", "GPUs", "$/h", "headroom", "req/s per replica",
            "interval", "binding SLO", "TTFT p99 (ms)", "TPOT p99 (ms)", "cost model", "table fallbacks",
            "requests behind it", "note"]
    trs = []
    for c in result["candidates"]:
        pr = c.get("predicted") or {}
        iv = c.get("rate_interval")
        fb = c.get("table_fallbacks") or {}
        conf = c.get("confirmation") or {}
        probes = c.get("probes") or []
        behind = (f"cluster {conf['requests']} x {len(conf['seeds'])} seeds; " if conf else "") + \
                 (f"{len(probes)} probes" if probes else "")
        cells = [c["rank"], c["label"], c["status"], _num(c["replicas"], "{}"), _num(c["gpus"], "{}"),
                 _num(c["cost_per_hour"], "{:.2f}"), _num(c.get("headroom"), "{:.2f}"),
                 _num(c["max_rate_per_replica"]),
                 f"[{_num(iv[0])}, {_num(iv[1])}]" if iv else "-",
                 pretty_slo(c.get("binding_slo")) if c.get("binding_slo") else "-",
                 _ms(pr.get("p99_ttft_s")), _ms(pr.get("p99_tpot_s")),
                 (c.get("cost_model") or {}).get("kind", "-"),
                 f"{sum(fb.get('fallbacks', {}).values())} / {fb.get('lookups', 0)}" if fb else "-",
                 behind or "-", c.get("reason") or ""]
        style = ' class="win"' if c is w else ""
        trs.append(f"<tr{style}>" + "".join(f"<td>{e(str(x))}</td>" for x in cells) + "</tr>")
    imgs = "".join(
        f'<figure><img alt="{e(k)}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        f"</figure>" for k, p in plots.items())
    front = [p for p in result["pareto"] if p["front"]]
    ptab = "".join(f"<tr><td>{e(p['label'])}</td><td>{p['units']}</td><td>{p['total_rate']:.2f}</td>"
                   f"<td>{p['tokens_per_s_per_gpu']:.0f}</td><td>{p['tokens_per_s_per_user']:.1f}</td>"
                   f"<td>{'yes' if p['meets_slo'] else 'no'}</td></tr>" for p in front)
    target = (f"{result['target_rate']:g} req/s" if result["mode"] == "rate"
              else f"the most traffic on {result['target_gpus']} GPUs")
    prov = "".join(f"<li>{e(x)}</li>" for x in provenance_text(result))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>ServeTwin plan: {e(result['scenario'])}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1400px; }}
table {{ border-collapse: collapse; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 6px; text-align: right; }}
td:nth-child(2), td:last-child {{ text-align: left; }}
tr.win {{ background: #e6f4e6; font-weight: bold; }}
pre {{ background: #f4f4f4; padding: 0.8em; white-space: pre-wrap; }}
img {{ max-width: 640px; margin-right: 1em; }} figure {{ display: inline-block; margin: 0; }}
</style></head><body>
<h1>Capacity plan: {e(result['model'])}, {e(target)}</h1>
<p>Scenario <code>{e(result['scenario'])}</code>. SLOs: {e(result['slo_text'])}. Ranking:
{e(result['ranking'])}. Probes are steady-state (warm-up excluded, at least
{e(str(result['search']['min_requests'] or 'the percentile-driven number of'))} measured requests);
the winner and the alternatives are confirmed by cluster simulations of
{result['search']['confirm_requests']} requests per seed (seeds {e(str(result['search']['seeds']))}).
Prices in USD per GPU-hour: {e(', '.join(f'{k} {v:g}' for k, v in result['prices'].items()))}.</p>
<h2>Winner</h2>
<p>{e(why(result))}</p>
<pre>{e(chr(10).join(cmds))}</pre>
<h2>What stands behind the numbers</h2><ul>{prov}</ul>
<h2>Plots</h2>{imgs}
<h2>Pareto front (throughput per GPU vs per user)</h2>
<table><tr><th>candidate</th><th>units</th><th>total req/s</th><th>tok/s/GPU</th><th>tok/s/user</th>
<th>meets SLOs</th></tr>{ptab}</table>
<h2>All candidates, best first</h2>
<table><tr>{''.join(f'<th>{e(h)}</th>' for h in head)}</tr>
{chr(10).join(trs)}
</table>
<p>Status: {e('; '.join(f'{k} = {v}' for k, v in STATUS_TEXT.items()))}. Simulated by ServeTwin: the step
times come from its cost models, not from measurements of these GPUs.</p>
</body></html>
"""
