"""Replay published vLLM runs through `servetwin simulate` and compare with what they measured.

    python bench/gpu_runs.py [--runs CSV ...] [--only EXP_ID ...] [--seeds 1] [--workers 2]
                             [--write-scenarios DIR] [--json OUT]

--runs: CSV files with the columns of ../shared/gpu-runs/vllm-h100-runs.csv (default: that file,
or $SERVETWIN_GPU_RUNS/vllm-h100-runs.csv). Each row becomes a scenario (`scenario_for`) that
does what the run did: the server's settings (max_num_seqs, max_num_batched_tokens,
max_model_len, block size, the KV blocks vLLM logged, prefix caching), inference-perf's
`constant` load stages (exactly rate x duration requests per stage, exponential gaps rescaled to
the stage, stages back to back), a shuffled pool of 100 prompts (10 system prompts x 10
questions) reused in turn, fixed lengths (the measured input length where the run logged it,
else the nominal one + 5%: the server re-tokenizes decoded random tokens), and the streaming
HTTP client path. Prints one JSON line per run (predicted and measured TTFT, E2E and ITL means,
TTFT and E2E p90/p99, signed and absolute errors) and a JSON summary: the mean absolute
percentage error and the signed mean error of each metric.

The cost model, the CPU work and the request path are the simulator's defaults, the same for
every run, with one setting of the runs' server build: the tracing build's TP groups' per-step
coordination (TRACED_BUILD_TP_STEP_S; runs on a stock vLLM image pay none, `traced_build`). That
and the request path's share of the HTTP client's http_s (sim.clients.REQUEST_PATH_FITTED_S, a
default for every HTTP client) were fitted on these runs; --loro refits both without each run in turn and reports that run's error, the honest measure.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEVICES = {"H100": "h100-sxm", "H200": "h200", "A100": "a100-80g", "L40S": "l40s", "B200": "b200"}
METRICS = (("ttft_mean", "ttft_s", "mean"), ("ttft_p90", "ttft_s", "p90"), ("ttft_p99", "ttft_s", "p99"),
           ("e2e_mean", "e2e_s", "mean"), ("e2e_p90", "e2e_s", "p90"), ("e2e_p99", "e2e_s", "p99"),
           ("itl_mean", "itl_s", "mean"))
TOKENIZE_OVERHEAD = 1.05  # decoded random tokens re-tokenize a few % longer (the runs' README)
# The runs' server: a vLLM build with per-step ("journey") tracing, whose TP groups pay a
# per-step coordination the kernel tables do not hold (sim.kernel_model.Overheads.tp_step_s;
# stock vLLM pays none). Fitted on these runs: --loro refits it without each run. 0.3 ms since the
# all-reduce is read from the tables of the runs' vLLM release (0.14.0's for 0.15.1; it was 0.6 ms
# on 0.31.0's, which read 1.4x less for small messages at TP 4 and 2.1x less at 256 K elements).
TRACED_BUILD_TP_STEP_S = 3.0e-4


def device_of(row: dict) -> str:
    """The device spec of a run: its `gpu_product` (nvidia-smi's name, e.g. "NVIDIA A100-SXM4-80GB"),
    else its `hardware` column as the runs write it ("H100", "A100-SXM", "L40S", ...; sim.specs'
    names and aliases, or DEVICES by its first word before a space, dash or underscore, with the
    memory size it names). A product sim.specs does not name (a PCIe
    card) is read as the SXM part of its family and memory size ("NVIDIA A100-PCIE-40GB": a100-40g;
    its kernel tables and NVLink). ValueError naming both columns when neither is known."""
    from sim.specs import get_device
    hw = (row.get("hardware") or "").strip()
    product = (row.get("gpu_product") or "").split("(")[0].strip()
    family = next((w.upper() for w in (re.split(r"[\s_-]+", hw)[:1] + product.replace("-", " ").split())
                   if w.upper() in DEVICES), None)
    size = re.search(r"(\d+)\s*GB", product or hw, re.IGNORECASE)
    for value in (product, f"{family}-{size.group(1)}GB" if family and size else "", hw):
        if value:
            try:
                return get_device(value).name
            except ValueError:
                pass
    if family:
        return DEVICES[family]
    raise ValueError(f"hardware={row.get('hardware')!r}, gpu_product={row.get('gpu_product')!r}: no device "
                     f"spec for it; known: {sorted(DEVICES)} and sim.specs' device names")


def default_runs() -> list[Path]:
    base = os.environ.get("SERVETWIN_GPU_RUNS") or str(REPO.parent / "shared" / "gpu-runs")
    return [Path(base) / "vllm-h100-runs.csv"]


def _num(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if v == v else None


def vllm_release(row: dict) -> str | None:
    """The vLLM release a run served with: its `vllm_version` where that starts with one
    ("0.15.1 (per ...)"), else the one its `vllm_image` note names ("... captions say vLLM v0.15.1
    ..."; a fork's own version is not vLLM's), else None."""
    m = re.match(r"v?(\d+\.\d+(?:\.\d+)?)\b", (row.get("vllm_version") or "").strip())
    m = m or re.search(r"vLLM v(\d+\.\d+(?:\.\d+)?)\b", row.get("vllm_image") or "")
    return m.group(1) if m else None


def scenario_for(row: dict, overheads: dict | None = None, client: dict | None = None) -> dict:
    """The scenario of one published run (a row of the runs CSV); `overheads` / `client`: kernel
    cost-model overheads and client fields to try instead of the defaults."""
    stages = []
    for s in ("s0", "s1"):
        rate, dur = _num(row.get(f"{s}_rate_rps")), _num(row.get(f"{s}_duration_s"))
        if rate and dur:
            stages.append({"rate": rate, "duration_s": dur})
    sys_len = int(_num(row["system_prompt_len_tok"]) or 0)
    nominal = int(_num(row["nominal_input_len_tok"]))
    measured = _num(row.get("all_measured_input_len_mean")) or _num(row.get("s0_measured_input_len_mean"))
    prompt = int(round(measured)) if measured else int(round(nominal * TOKENIZE_OVERHEAD))
    prefix = int(round(sys_len * prompt / nominal)) if nominal else sys_len
    out_len = int(_num(row["output_len_tok"]))  # ignore_eos + max_tokens: the engine generates all of them
    blocks = _num(row.get("gpu_kv_blocks_total"))
    dep = {"model": row["model"], "device": device_of(row), "tp": int(_num(row["tp"])),
           "gpu_memory_utilization": _num(row.get("gpu_memory_utilization")) or 0.9}
    if blocks:
        dep["num_gpu_blocks"] = int(blocks)
    version = vllm_release(row)
    if version:  # sizes the pool where no blocks were logged
        dep["vllm_version"] = version
    prec = (row.get("precision") or "").lower()
    if "fp8" in prec:
        dep["weight_dtype"] = "fp8"
    dep.update(parallel_of(row))
    return {
        "name": f"gpu-run-{row['exp_id']}",
        "seed": 0,
        "deployment": dep,
        "scheduler": {"max_num_batched_tokens": int(_num(row["max_num_batched_tokens"])),
                      "max_num_seqs": int(_num(row["max_num_seqs"])),
                      "max_model_len": int(_num(row["max_model_len"])),
                      "block_size": int(_num(row.get("kv_block_size")) or 16),
                      "enable_prefix_caching": True},
        "workload": {"arrival": {"type": "stages", "stages": stages, "gap_s": 1.0},
                     "prompt_len": {"type": "fixed", "value": prompt},
                     "output_len": {"type": "fixed", "value": out_len},
                     "prompt_pool": {"num_prompts": 100, "num_prefixes": 10, "prefix_len": prefix},
                     "client": {"type": "http", **(client or {})},
                     # inference-perf sends no sampling parameters: vLLM applies the checkpoint's
                     # generation_config.json (its top-k/top-p priced by sim.sampling)
                     "sampling": "model_default"},
        "output": {"plots": False},
        "cost_model": {"type": "kernels",
                       "overheads": overheads or {"tp_step_s": TRACED_BUILD_TP_STEP_S if traced_build(row) else 0.0}},
    }


def traced_build(row: dict) -> bool:
    """Whether a run's server was the tracing build (its `observability_build` column; where that
    is empty, its `vllm_image`), which pays TRACED_BUILD_TP_STEP_S per step with TP > 1. A stock
    vLLM image (`vllm/vllm-openai:...`) pays none. A row that names neither is read as the
    tracing build, the one every run of the study's H100 CSV used."""
    flag = _flag(row.get("observability_build"))
    if flag is not None:
        return flag
    image = str(row.get("vllm_image") or "").strip().lower()
    return not image or "inference-sim" in image


def parallel_of(row: dict) -> dict:
    """Deployment keys for a run's `dp` and `expert_parallel` columns (the MoE runs' CSV has them):
    vLLM's --data-parallel-size is data-parallel attention for a mixture of experts (one engine
    of dp ranks, deployment.data_parallel) and dp engines behind vLLM's own balancer for a dense
    model (replicas routed to the least loaded); --enable-expert-parallel is
    deployment.expert_parallel. ValueError naming the column for a value that is neither."""
    from sim.specs import get_model
    out = {}
    raw = str(row.get("dp") or "1").strip()
    dp = _num(raw)
    if dp is None or dp < 1 or dp != int(dp):
        raise ValueError(f"dp={row.get('dp')!r}: expected a whole number >= 1")
    if dp > 1:
        if get_model(row["model"]).is_moe:
            out["data_parallel"] = int(dp)
        else:
            out.update(replicas=int(dp), router="least_outstanding")
    ep = _flag(row.get("expert_parallel") or "false")
    if ep is None:
        raise ValueError(f"expert_parallel={row.get('expert_parallel')!r}: expected True or False")
    if ep:
        out["expert_parallel"] = True
    return out


def _flag(value) -> bool | None:
    """A True/False column as the runs write it (True, false, 1, no, ...); None when empty or not
    one of those."""
    text = str(value or "").strip().lower()
    return True if text in ("true", "1", "yes") else False if text in ("false", "0", "no") else None


def measured(row: dict) -> dict:
    out = {}
    for key, metric, stat in METRICS:
        v = _num(row.get(f"all_{metric[:-2]}_{stat}_ms"))
        out[key] = v / 1e3 if v is not None else None
    return out


def client_tokens(row: dict) -> float | None:
    """Output tokens per request as the run's client counted them. The runs' ITL mean is
    (E2E - TTFT) / (that count - 1). inference-perf counts by re-tokenizing the streamed text,
    which can count fewer tokens than the engine generates: Llama-2-7b-hf's runs with
    per-request data count about 0.8 of max_tokens, although every request took as long as a full
    one (the engine generates all max_tokens with ignore_eos; tokens that decode to no text, an
    end-of-sequence ignored, are not counted).

    The logged mean where the run has one (`all_measured_output_len_mean`); else the count the
    run's own published means imply by that definition, (E2E - TTFT) / ITL + 1 (exact on the
    runs that log both: 195.09 and 195.09). None when neither is known."""
    logged = _num(row.get("all_measured_output_len_mean"))
    if logged:
        return logged
    e2e, ttft, itl = (_num(row.get(f"all_{m}_mean_ms")) for m in ("e2e", "ttft", "itl"))
    if e2e and ttft is not None and itl and e2e > ttft:
        return (e2e - ttft) / itl + 1
    return None


def simulate(task: tuple) -> dict:
    row, seeds, overheads, client = task
    import warnings

    from sim.scenario import parse_scenario, run_scenario
    data = scenario_for(row, overheads, client)
    preds, stages = [], []
    for seed in seeds:
        with warnings.catch_warnings():  # table fallbacks: counted in the summary, not warned
            warnings.simplefilter("ignore", UserWarning)
            sc = parse_scenario(data, seed=seed)
            res = run_scenario(sc)
        allm = res.summary["stages"][-1]
        stages.append(res.summary["stages"][:-1])
        p = {k: allm[m][st] for k, m, st in METRICS}
        seen = client_tokens(row)
        if seen:  # the mean ITL as the run computed it, from the client's token count
            p["itl_mean"] = (allm["e2e_s"]["mean"] - allm["ttft_s"]["mean"]) / (seen - 1)
        preds.append(p)
    pred = {k: float(np.mean([p[k] for p in preds])) for k, _m, _s in METRICS}
    meas = measured(row)
    err = {k: (pred[k] / meas[k] - 1) if meas[k] else None for k in pred}
    by_stage = []
    for i, st in enumerate(stages[0]):
        got = {f"{m[:-2]}_{x}": float(np.mean([s[i][m][x] for s in stages])) for m in ("ttft_s", "e2e_s")
               for x in ("mean", "p90", "p99") if stages[0][i][m][x] is not None}
        want = {f"{m}_{x}": (_num(row.get(f"s{i}_{m}_{x}_ms")) or 0) / 1e3 or None for m in ("ttft", "e2e")
                for x in ("mean", "p90", "p99")}
        by_stage.append({"stage": i, "rate": st.get("rate"), "predicted_s": got, "measured_s": want})
    return {"exp_id": row["exp_id"], "model": row["model"], "tp": row["tp"], "workload": row["workload"],
            "predicted_s": pred, "measured_s": meas, "rel_error": err, "stages": by_stage}


def summarize(results: list[dict], keys=None) -> dict:
    out = {"runs": len(results)}
    for k in keys or [m[0] for m in METRICS]:
        e = np.array([r["rel_error"][k] for r in results if r["rel_error"][k] is not None])
        if e.size:
            out[k] = {"mape": float(np.mean(np.abs(e))), "signed_mean": float(np.mean(e)),
                      "min": float(e.min()), "max": float(e.max()), "runs": int(e.size)}
    return out


# What --loro refits: the TP group's per-step coordination (Overheads.tp_step_s, on this grid)
# and the request path's fixed time outside the engine (added to the client's http_s, fitted in
# closed form for each tp_step_s: the least-squares shift of the TTFT means, relative).
TP_STEP_GRID = (0.0, 3e-4, 6e-4, 9e-4, 1.2e-3, 1.5e-3)
UNFITTED_HTTP_S = 1e-3  # the request path from component costs alone (sim.clients)


def loro(rows: list[dict], workers: int) -> dict:
    """Leave-one-run-out: for each run, tp_step_s and the request-path shift fitted on the other
    runs (least squares of log errors of the TTFT, E2E and ITL means), then that run predicted."""
    import math
    base_client = {"http_s": UNFITTED_HTTP_S}
    reached = [int(_num(r["tp"])) > 1 and traced_build(r) for r in rows]  # the runs tp_step_s reaches
    wide = [r for r, x in zip(rows, reached) if x]
    tp1 = [r for r, x in zip(rows, reached) if not x]  # TP 1 or a stock build: tp_step_s has no effect
    grid: dict[float, dict] = {}
    with ProcessPoolExecutor(workers) as ex:
        flat = {r["exp_id"]: x for r, x in zip(tp1, ex.map(simulate, [(r, [0], {"tp_step_s": 0.0}, base_client)
                                                                       for r in tp1]))}
        for v in TP_STEP_GRID:
            got = dict(flat)
            got.update({r["exp_id"]: x for r, x in zip(wide, ex.map(simulate, [(r, [0], {"tp_step_s": v}, base_client)
                                                                              for r in wide]))})
            grid[v] = got
    ids = [r["exp_id"] for r in rows]
    keys = ("ttft_mean", "e2e_mean", "itl_mean")

    def shifted(v, d, i):
        p, m = dict(grid[v][i]["predicted_s"]), grid[v][i]["measured_s"]
        p["ttft_mean"] += d
        p["e2e_mean"] += d
        return p, m

    def fit(use):
        best = None
        for v in grid:
            num = sum((grid[v][i]["measured_s"]["ttft_mean"] - grid[v][i]["predicted_s"]["ttft_mean"])
                      / grid[v][i]["measured_s"]["ttft_mean"] ** 2 for i in use)
            den = sum(1 / grid[v][i]["measured_s"]["ttft_mean"] ** 2 for i in use)
            d = num / den
            loss = sum(math.log(p[k] / m[k]) ** 2 for i in use for p, m in [shifted(v, d, i)] for k in keys if m[k])
            if best is None or loss < best[0]:
                best = (loss, v, d)
        return best[1], best[2]

    v_all, d_all = fit(ids)
    held = []
    for i in ids:
        v, d = fit([j for j in ids if j != i])
        p, m = shifted(v, d, i)
        held.append({"exp_id": i, "tp_step_s": v, "request_path_shift_s": d,
                     "rel_error": {k: (p[k] / m[k] - 1) if m[k] else None for k in keys}})
        print(json.dumps(held[-1]), flush=True)
    return {"fit_on_all": {"tp_step_s": v_all, "request_path_shift_s": d_all},
            "held_out": held, "summary": summarize([{"rel_error": h["rel_error"]} for h in held], keys)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="*", type=Path, default=None)
    ap.add_argument("--only", nargs="*", default=None, help="exp_id values to replay")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--write-scenarios", type=Path, default=None, help="write each run's scenario YAML here")
    ap.add_argument("--json", type=Path, default=None, help="write the per-run results and the summary here")
    ap.add_argument("--loro", action="store_true",
                    help="leave-one-run-out: refit what the defaults fitted on these runs (tp_step_s, the "
                         "request path's shift) without each run, and predict it")
    ap.add_argument("--overheads", type=json.loads, default=None,
                    help='kernel cost-model overheads to try, JSON (e.g. \'{"tp_step_s": 5e-4}\')')
    ap.add_argument("--client", type=json.loads, default=None,
                    help='client fields to try, JSON (e.g. \'{"http_s": 0.003}\')')
    a = ap.parse_args()
    rows = []
    for path in a.runs or default_runs():
        if not path.exists():
            sys.exit(f"--runs {path}: no such file (set --runs or SERVETWIN_GPU_RUNS)")
        with open(path, newline="") as f:
            rows += [r for r in csv.DictReader(f) if not a.only or r["exp_id"] in a.only]
    if a.write_scenarios:
        import yaml
        a.write_scenarios.mkdir(parents=True, exist_ok=True)
        for r in rows:
            (a.write_scenarios / f"{scenario_for(r)['name']}.yaml").write_text(yaml.safe_dump(scenario_for(r), sort_keys=False))
    if a.loro:
        res = loro(rows, a.workers)
        print(json.dumps({"loro": {"fit_on_all": res["fit_on_all"], "summary": res["summary"]}}), flush=True)
        if a.json:
            a.json.write_text(json.dumps(res, indent=1))
        return
    tasks = [(r, list(range(a.seeds)), a.overheads, a.client) for r in rows]
    results = []
    with ProcessPoolExecutor(a.workers) as ex:
        for res in ex.map(simulate, tasks):
            results.append(res)
            print(json.dumps(res), flush=True)
    summary = summarize(results)
    print(json.dumps({"summary": summary}), flush=True)
    if a.json:
        a.json.write_text(json.dumps({"results": results, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
