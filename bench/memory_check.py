"""ServeTwin's per-GPU memory accounting against vLLM's own startup logs.

For each public vLLM log below (H100 80GB; model, TP, gpu_memory_utilization, token budget and
max_num_seqs as the run had them, vLLM's defaults where it set none), the loaded model
(ModelSpec.loaded_bytes_per_gpu against vLLM's "Model loading took X GiB") and the KV pool
(memory_breakdown's kv_bytes_per_gpu against "Available KV cache memory: Y GiB"), signed
relative errors. Each row's pool is sized as its vLLM release profiles memory (memory_breakdown's
vllm_version; the llm-d-benchmark logs are of a release before 0.17, written 0.16, as their
sampler warm-up shows). Then, where ../shared/gpu-runs (or $SERVETWIN_GPU_RUNS) is present, each
published run there that logged its KV blocks, sized through the run's own scenario
(bench/gpu_runs.scenario_for, without the logged blocks) against vLLM's count. Prints JSON: every
row, and the median |error| of each.

    python bench/memory_check.py

The logs come from several vLLM versions; what ServeTwin's reserve leaves out for each is written
beside the rows in docs/reports/2026-12-05-loaded-model-memory.md.
"""
from __future__ import annotations

import csv
import json
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpu_runs import _num, default_runs, scenario_for  # noqa: E402
from sim.scenario import parse_scenario  # noqa: E402
from sim.specs import GiB, get_device, get_model, memory_breakdown, vllm_version_tuple  # noqa: E402

# (model, tp, util, max_num_batched_tokens, max_num_seqs, vLLM version, logged "Model loading
# took" GiB or None, logged "Available KV cache memory" GiB or None, where the log is)
LOGS = [
    ("meta-llama/Llama-3.1-8B-Instruct", 1, 0.9, 8192, 1024, "0.16", 14.99, 51.38,
     "llm-d/llm-d-benchmark config_explorer/empirical-vllm-memory-results.md"),
    ("Qwen/Qwen3-32B", 1, 0.9, 8192, 1024, "0.16", 61.03, 4.45, "llm-d-benchmark, same file"),
    ("RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic", 2, 0.9, 8192, 1024, "0.16", 33.88, 32.0,
     "llm-d-benchmark, same file"),
    ("openai/gpt-oss-20b", 1, 0.9, 8192, 1024, "0.16", 13.47, 50.28, "llm-d-benchmark, same file"),
    ("openai/gpt-oss-120b", 1, 0.95, 8192, 1024, "0.16", 64.38, 3.33, "llm-d-benchmark, same file"),
    ("meta-llama/Llama-3.1-8B-Instruct", 1, 0.95, 8192, 1024, "0.19.0", 14.99, 58.11,
     "llm-d-incubation/llm-d-planner accuracy/results/v0.19.0"),
    ("RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic", 2, 0.95, 8192, 1024, "0.19.0", 33.88, 37.28,
     "llm-d-planner v0.19.0 logs"),
    ("openai/gpt-oss-20b", 2, 0.9, 8192, 1024, "0.19.0", 7.01, 59.32, "llm-d-planner v0.19.0 logs"),
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", 4, 0.95, 8192, 1024, "0.19.0", 53.12, 16.75,
     "llm-d-planner v0.19.0 logs"),
    ("Qwen/Qwen3-235B-A22B-FP8", 4, 0.9, 8192, 1024, "0.10", 55.13, 8.11,
     "vllm-project/vllm #21348 (KV; served with an LMCache KV connector) and #21429 (weights, same model and TP)"),
    # llm-d-planner's v0.19.0 accuracy report, "Sensitivity: Tensor Parallelism": the actual weights,
    # activation peak and non-torch memory of each run; its pool is 0.95 x 79.19 GiB less their sum,
    # the identity every v0.19 log above follows (its TP1 rows: 58.11 and 58.53 GiB as logged)
    ("meta-llama/Llama-3.1-8B-Instruct", 2, 0.95, 8192, 1024, "0.19.0", 7.51, 0.95 * 79.19 - 7.51 - 1.89 - 2.07,
     "llm-d-planner accuracy/results/v0.19.0/accuracy_report.md"),
    ("meta-llama/Llama-3.1-8B-Instruct", 4, 0.95, 8192, 1024, "0.19.0", 3.77, 0.95 * 79.19 - 3.77 - 1.89 - 2.13,
     "llm-d-planner v0.19.0 accuracy report"),
    ("Qwen/Qwen2.5-7B-Instruct", 1, 0.95, 8192, 1024, "0.19.0", 14.25, 58.53, "llm-d-planner v0.19.0 accuracy report"),
    ("Qwen/Qwen2.5-7B-Instruct", 2, 0.95, 8192, 1024, "0.19.0", 7.12, 0.95 * 79.19 - 7.12 - 2.21 - 2.06,
     "llm-d-planner v0.19.0 accuracy report"),
    ("Qwen/Qwen2.5-7B-Instruct", 4, 0.95, 8192, 1024, "0.19.0", 3.55, 0.95 * 79.19 - 3.55 - 2.21 - 2.13,
     "llm-d-planner v0.19.0 accuracy report"),
    ("RedHatAI/Llama-4-Scout-17B-16E-Instruct-FP8-dynamic", 2, 0.9, 2048, 128, "0.15.1", None,
     8253 * 16 * 98304 / GiB, "../shared/gpu-runs/vllm-h100-moe-runs.csv (8,253 blocks of 16 tokens)"),
]


def gpu_run_rows() -> list[dict]:
    """The published runs' logged KV blocks against the pool their scenario sizes (vLLM's count,
    null block included, is the scheduler's num_gpu_blocks less the one the simulator adds)."""
    folder = default_runs()[0].parent
    rows = []
    for name in ("vllm-h100-runs.csv", "vllm-h100-moe-runs.csv"):
        path = folder / name
        if not path.exists():
            continue
        with open(path) as f:
            for row in csv.DictReader(f):
                logged = _num(row.get("gpu_kv_blocks_total"))
                if not logged:
                    continue
                sc = scenario_for(row)
                del sc["deployment"]["num_gpu_blocks"]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ours = parse_scenario(sc).scheduler_config.num_gpu_blocks - 1
                rows.append({"run": row["exp_id"], "model": row["model"], "tp": int(_num(row["tp"])),
                             "max_num_batched_tokens": int(_num(row["max_num_batched_tokens"])),
                             "vllm": sc["deployment"].get("vllm_version"), "kv_blocks": ours,
                             "vllm_kv_blocks": int(logged), "kv_err": round(ours / logged - 1, 4)})
    return rows


def main() -> None:
    dev = get_device("h100-sxm")
    rows = []
    for name, tp, util, budget, seqs, version, loaded, kv, source in LOGS:
        m = get_model(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            b = memory_breakdown(m, dev, tp, util, max_num_batched_tokens=budget, max_num_seqs=seqs,
                                 vllm_version=version)
        ours_loaded, ours_kv = b["loaded_bytes_per_gpu"] / GiB, b["kv_bytes_per_gpu"] / GiB
        rows.append({"model": name, "tp": tp, "gpu_memory_utilization": util, "max_num_batched_tokens": budget,
                     "max_num_seqs": seqs, "vllm": version, "source": source,
                     "loaded_gib": round(ours_loaded, 2), "vllm_loaded_gib": loaded,
                     "loaded_err": None if loaded is None else round(ours_loaded / loaded - 1, 4),
                     "kv_gib": round(ours_kv, 2), "vllm_kv_gib": round(kv, 2), "kv_err": round(ours_kv / kv - 1, 4),
                     "reserve_gib": round(b["reserve_bytes"] / GiB, 2)})

    def med(key, pick=lambda r: True):
        vals = [abs(r[key]) for r in rows if r[key] is not None and pick(r)]
        return round(statistics.median(vals), 4) if vals else None

    runs = gpu_run_rows()
    print(json.dumps({"rows": rows, "gpu_runs": runs, "median_abs_err": {
        "loaded": med("loaded_err"), "kv": med("kv_err"),
        "kv_vllm_0.17_or_later": med("kv_err", lambda r: vllm_version_tuple(r["vllm"]) >= (0, 17)),
        "kv_before_0.17": med("kv_err", lambda r: vllm_version_tuple(r["vllm"]) < (0, 17)),
        "gpu_runs_kv": round(statistics.median(abs(r["kv_err"]) for r in runs), 4) if runs else None},
        "max_abs_err": {"kv": max(abs(r["kv_err"]) for r in rows),
                        "gpu_runs_kv": max((abs(r["kv_err"]) for r in runs), default=None)}}, indent=1))


if __name__ == "__main__":
    main()
