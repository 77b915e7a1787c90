"""ServeTwin against published serving measurements (AIConfigurator's silicon_sample.csv).

    nice -n 19 .venv/bin/python bench/silicon_check.py [--csv PATH] [--max-rows N] [--out FILE]

For each allowed row (a model of the catalog on a GPU with kernel tables; aggregated serving, or
disaggregated prefill/decode pools shaped as the row records them: `disagg_case`) it simulates the
benchmark the row reports: a closed loop at the row's concurrency (workload.benchmark) with the
client of the row's source (--protocol auto, the default: InferenceMAX's benchmark_serving.py
with --random-range-ratio 0.8 and 10 x CONC prompts for its rows, fixed lengths after warm-up for
AIConfigurator's own gap-analysis collection rows; see source_family and PROTOCOLS), on the row's
GPU and TP, with the scenario defaults (kernel-table cost model, async scheduling, benchmark
clients), and compares mean TTFT
and TPOT. Prints JSON:
median |error| and signed bias (median of (sim - silicon) / silicon), overall and by backend,
system, model, TP, concurrency and mode, and how many rows of the file it cannot express
(`not_expressible`: e.g. GB200/GB300, which have no kernel tables here).

With `--aisimulate PATH` (NVIDIA's AISimulate, in its own venv: see bench/sim_speed.py), every row
also runs through AISimulate's `predict` with the very requests ServeTwin's scenario draws (a
Mooncake trace replayed at the row's concurrency), the same server settings and quantisation, and
the summaries carry its errors under `aisimulate`, side by side.

HELD OUT: rows of the `vllm` backend on h100_sxm and h200_sxm are dropped as the file is read,
before anything looks at them; they are kept for independent checks and never used here.
The rows used are other frameworks on H100/H200 (TensorRT-LLM, SGLang: faster or slower engines
than vLLM, so a bias there is expected) and vLLM on B200.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

from sim.scenario import parse_scenario, run_scenario  # noqa: E402
from sim.specs import get_device, get_model, vllm_version_tuple  # noqa: E402
from sim_speed import MOONCAKE_BLOCK as AIS_BLOCK, write_mooncake_trace  # noqa: E402  (bench/)

HELD_OUT_BACKEND = "vllm"
HELD_OUT_SYSTEMS = {"h100_sxm", "h200_sxm"}
MODELS = {"meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b", "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
          "meta-llama/Llama-3.1-70B": "llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
          "Qwen/Qwen3-32B": "qwen3-32b"}
DEVICES = {"h100_sxm": "h100-sxm", "h200_sxm": "h200", "b200_sxm": "b200", "b300_sxm": "b300", "gb200": "gb200",
           "gb300": "gb300"}
QUANT = {"": "bfloat16", "fp8": "fp8", "fp8_block": "fp8_block"}
# Rows that ran a model's own checkpoint in its own format, by the label the sample gives it: OpenAI's
# gpt-oss checkpoints hold only MXFP4 experts (the sample labels every 4-bit row nvfp4), Kimi-K2.5's
# its int4 experts (int4_wo), MiniMax-M2.5's and DeepSeek-V3/R1's 128x128-block fp8 (labelled fp8).
# These run as the checkpoint ships (weight_dtype None: the catalog's dtypes); other 4-bit rows
# (nvfp4) run NVIDIA's -NVFP4 checkpoint of the model (sim.specs: a dense model's linear layers, a
# mixture of experts' routed experts, and an fp8 KV cache), on the GPUs with FP4 tensor cores.
# Models whose only published fp8 checkpoints are 128x128 blocks (zai-org/GLM-5-FP8,
# Qwen/Qwen3.5-*-FP8, DeepSeek-V3.2's own): their rows labelled fp8 run those blocks.
FP8_AS_BLOCK = ("glm-5", "deepseek-v3.2", "qwen3.5-397b-a17b", "qwen3.5-122b-a10b", "qwen3.5-35b-a3b", "qwen3.5-27b")
NATIVE = {"gpt-oss-120b": "nvfp4", "gpt-oss-20b": "nvfp4", "kimi-k2.5": "int4_wo", "minimax-m2": "fp8",
          "deepseek-v3": "fp8"}


def default_csv() -> str | None:
    """$SILICON_SAMPLE, else the one in the site-packages of the $AISIMULATE executable's venv."""
    if os.environ.get("SILICON_SAMPLE"):
        return os.environ["SILICON_SAMPLE"]
    exe = shutil.which(os.environ.get("AISIMULATE", "aisimulate"))
    if not exe:
        return None
    venv = Path(exe).resolve().parent.parent
    hits = glob.glob(str(venv / "lib" / "python3*" / "site-packages" / "aisimulate_core" / "systems" / "silicon_sample.csv"))
    return hits[0] if hits else None


def allowed_rows(path: str) -> list[dict]:
    """Rows we may use: the held-out rows are dropped while reading, before any other use."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["backend"].strip().lower() == HELD_OUT_BACKEND and r["system"].strip() in HELD_OUT_SYSTEMS:
                continue
            out.append(r)
    return out


def model_name(path: str) -> str | None:
    """The catalog model a row's Hugging Face id names (any of its spellings: -Instruct, -FP8,
    an org prefix), or None."""
    if path in MODELS:
        return MODELS[path]
    try:
        return get_model(path).name
    except ValueError:
        return None


def client_concurrency(r: dict) -> int:
    """The benchmark client's concurrency for one engine: batch_size x attention_dp_size. The
    sample's batch_size is per data-parallel rank: every allowed row with attention DP (82 vLLM, 71
    TensorRT-LLM) records a client concurrency (`silicon_concurrency=` in its source) of batch_size
    x dp, every other aggregated vLLM row batch_size itself. (Rows whose recorded concurrency is a
    multiple of that ran several engines; one engine sees batch_size x dp.)"""
    return int(float(r["batch_size"])) * max(1, int(float(r.get("attention_dp_size") or 1)))


def recorded_concurrency(r: dict) -> int | None:
    """The client's concurrency as the row's source recorded it (`silicon_concurrency=`), or None."""
    m = re.search(r"silicon_concurrency=(\d+)", r.get("silicon_data_source", ""))
    return int(m.group(1)) if m else None


def _num(r: dict, key: str, default: float | None = None) -> float | None:
    """A numeric column (the CSV leaves a column blank where the row has none)."""
    v = str(r.get(key) or "").strip()
    try:
        x = float(v)
    except ValueError:
        return default
    return default if x != x else x  # NaN: blank


def squared_shape(r: dict, tp_size: int, dp: int) -> tuple[int, int, int]:
    """(tp_size, dp, moe_ep) of one engine where a row wrote its GPUs squared.

    Some SGLang and TensorRT-LLM rows of InferenceMAX's exports write an engine of k GPUs with k-way
    expert parallelism as tp_size (or attention_dp_size) k x k with moe_tp x moe_ep k x k: 16 or 64
    GPUs, two or eight nodes' worth, in a single-node benchmark. Of the 295 allowed rows written so
    on 8-GPU systems, 139 repeat within 1% the TTFT of a row of the same lengths written as k GPUs
    with moe_ep k (all 43 of Qwen3.5-397B; 20 of DeepSeek-R1's 21 on H200; docs/reports). Every
    such row is read as k GPUs, the 156 without a twin by that assumption (a 16-GPU run of moe 4 x 4
    would write the same columns); their cases carry `squared`. A row within one NVLink domain (tp 4
    with moe 2 x 2; GB200's 72) is read as written.
    """
    mt, me = int(_num(r, "moe_tp_size", 1) or 1), int(_num(r, "moe_ep_size", 1) or 1)
    gpus = tp_size * dp
    if mt == me > 1 and gpus == mt * me > get_device(DEVICES[r["system"]]).gpus_per_node:
        if dp == 1:
            return mt, 1, me
        if tp_size == 1:
            return 1, mt, me
    return tp_size, dp, me


def engine_shape(tp_size: int, dp: int, moe: bool) -> dict:
    """One engine of the sample's parallelism columns as vLLM's flags run it: {tp, data_parallel
    (MoE: ranks stepping together), replicas (dense: dp engines behind vLLM's balancer)}. Where
    tp_size is a multiple of dp it is read as InferenceMAX's recipes run it: tp_size GPUs in all,
    dp ranks of tp_size / dp each (its `tp: 4, dp-attn: true` is vLLM's -dp 4 -tp 1 on 4 GPUs), not
    dp x tp_size GPUs as moe_tp x moe_ep would say (tp 4 x dp 4 with moe_ep 16): so read,
    MiniMax-M2.5's DP rows have the errors of its non-DP rows (docs/reports). Otherwise (tp_size 1
    with dp 8, as TensorRT-LLM's rows write it) dp ranks of tp_size GPUs each, dp x tp_size in all,
    which is moe_tp x moe_ep there."""
    if dp <= 1:
        return {"tp": tp_size}
    t = tp_size // dp if tp_size % dp == 0 else tp_size
    return {"tp": t, "data_parallel": dp} if moe else {"tp": t, "replicas": dp}


def disagg_case(r: dict, case: dict) -> dict | None:
    """A disaggregated row's pools (deployment.pd), or None where its shape is not recorded.

    Each pool is `{prefill,decode}_num_workers` engines of the pool's parallelism columns
    (engine_shape, per pool); experts in parallel where the pool's moe_ep_size > 1.

    The client's concurrency: the source's `silicon_concurrency=` where it records one; on every
    allowed row that records it and the worker counts (267) it is decode_batch_size x
    decode_num_workers x decode_attention_dp_size, decode_batch_size being per decode rank. Rows of
    AIConfigurator's own collection record none: there decode_batch_size is read as the
    benchmark's concurrency, as batch_size is for its aggregated rows. On the 7 allowed ones (SGLang
    and TensorRT-LLM) that reading gives a median |error| of mean TTFT of 59% (-97% to -15%), the
    per-worker one (decode_batch_size x workers, 5.5-11x more clients) 408% (-97% to +2179%): it
    drives their prefill engines far past capacity where 4 of the 7 measured 0.6-1.4 s. TPOT
    favours neither (median |error| 59% and 52%). Rows that record
    no worker counts (InferenceMAX's CSV exports) run at their recorded concurrency as one prefill
    and one decode engine (`pd_workers_recorded` False: an assumption, reported apart)."""
    moe = get_model(case["model"]).is_moe
    pools, recorded = {}, _num(r, "decode_num_workers") is not None and _num(r, "prefill_num_workers") is not None
    for pool in ("prefill", "decode"):
        tp_size = _num(r, f"{pool}_tp_size")
        if tp_size is None or (_num(r, f"{pool}_pp_size", 1) or 1) != 1:
            return None
        shape = engine_shape(int(tp_size), int(_num(r, f"{pool}_attention_dp_size", 1) or 1), moe)
        workers = int(_num(r, f"{pool}_num_workers", 1) or 1) * shape.get("replicas", 1)
        pools.update({f"{pool}_replicas": workers, f"{pool}_tp": shape["tp"]})
        if shape.get("data_parallel"):
            pools[f"{pool}_data_parallel"] = shape["data_parallel"]
        if moe and (_num(r, f"{pool}_moe_ep_size", 1) or 1) > 1:
            pools[f"{pool}_expert_parallel"] = True
        bs = _num(r, f"{pool}_batch_size")
        if bs is not None:  # max_num_seqs per engine rank (AIConfigurator's max_batch_size)
            pools[f"{pool}_batch_size"] = int(bs)
    conc = recorded_concurrency(r)  # the client's concurrency as the source recorded it
    if conc is None and case["source"] == "gap-analysis":
        # AIConfigurator's collection rows record no concurrency: their decode_batch_size is the
        # benchmark's concurrency, as batch_size is for its aggregated rows (see the docstring)
        conc = int(_num(r, "decode_batch_size", 0) or 0)
    elif conc is None and recorded:
        conc = int(_num(r, "decode_batch_size", 0) or 0) * int(_num(r, "decode_num_workers")) \
            * int(_num(r, "decode_attention_dp_size", 1) or 1)
    elif conc is None:
        conc = 0
    if conc < 1:
        return None
    # The KV moves from each prefill GPU to its decode peer over one 400 Gb/s NIC per GPU
    # (INTER_NODE), in parallel over the narrower engine's GPUs.
    width = min(pools[f"{p}_tp"] * pools.get(f"{p}_data_parallel", 1) for p in ("prefill", "decode"))
    pools["link_bandwidth_gb_s"] = INTER_NODE["bandwidth_gb_s"] * width
    return {**case, "tp": pools["decode_tp"], "concurrency": conc, "pd": pools,
            "pd_workers_recorded": recorded}


def usable(r: dict) -> dict | None:
    """The simulator's case for a row, or None (pipeline parallel, fp4/int4 other than a
    checkpoint's native experts, an unknown model or GPU, a disaggregated row without its pools'
    shape)."""
    if r["mode"] not in ("agg", "disagg") or model_name(r["model_path"]) is None or r["system"] not in DEVICES:
        return None
    q = r["gemm_quant_mode"].strip()
    native = NATIVE.get(model_name(r["model_path"])) == q
    nvfp4 = q == "nvfp4" and not native and get_device(DEVICES[r["system"]]).fp4_flops is not None
    if q not in QUANT and not native and not nvfp4:
        return None
    ttft, tpot = _num(r, "silicon_ttft_ms"), _num(r, "silicon_tpot_ms")
    if not (ttft and tpot and ttft > 0 and tpot > 0):
        return None
    if r["mode"] == "agg":
        if (_num(r, "pp_size", 1) or 1) != 1:
            return None
        try:
            conc, tp = client_concurrency(r), int(float(r["tp_size"]))
        except ValueError:
            return None
    else:
        conc, tp = 0, 0  # disagg_case fills them in
    case = {"backend": r["backend"], "system": r["system"], "model": model_name(r["model_path"]),
            "weight_dtype": None if native else "nvfp4" if nvfp4 else
            "fp8_block" if QUANT[q] == "fp8" and model_name(r["model_path"]) in FP8_AS_BLOCK else QUANT[q], "tp": tp, "concurrency": conc, "isl": int(r["isl"]),
            "osl": int(r["osl"]), "ttft_ms": ttft, "tpot_ms": tpot, "source": source_family(r)}
    when = re.search(r"measured=(\d{4}-\d\d-\d\d)", r.get("silicon_data_source", ""))
    if when:
        case["measured"] = when.group(1)
    if r["backend"] == "vllm" and re.fullmatch(r"\d+\.\d+(\.\d+)?", str(r.get("backend_version", "")).strip()):
        case["vllm_version"] = str(r["backend_version"]).strip()  # its memory profiling sizes the pool
    if r["mode"] == "disagg":
        return disagg_case(r, case)
    written = (tp, int(_num(r, "attention_dp_size", 1) or 1))
    tp, dp, moe_ep = squared_shape(r, *written)
    case["tp"] = tp
    if (tp, dp) != written:  # read as k GPUs (squared_shape): an assumption where no twin row shows it
        case["squared"] = True
        rec = recorded_concurrency(r)
        if rec and rec < case["concurrency"]:
            # the client's own count bounds what the engine saw (one such row: batch_size 32 at dp 64
            # written, 32 clients recorded)
            case["concurrency"] = rec
    if moe_ep > 1:  # vLLM's --enable-expert-parallel
        case["expert_parallel"] = True
    # Data-parallel attention (a dense model's data parallelism: dp engines behind vLLM's balancer)
    case.update(engine_shape(tp, dp, get_model(case["model"]).is_moe))
    return case


def source_family(r: dict) -> str:
    """How a row was measured, from its silicon_data_source: 'inferencemax' (the nightly
    dashboard's database dumps and CSV exports: ISL/OSL 1024/1024, 1024/8192, 8192/1024) or
    'gap-analysis' (AIConfigurator's own collection runs, `aic-auto-gap-analysis/data/<gpu>/
    <backend>/<version>/<model>.csv`). A `<model>-gap-analysis.csv` file (kimi-k2.5, qwen3.5-397b)
    carries InferenceMAX's measurements instead: 30 of its 32 Kimi-K2.5 B200 rows and 72 of its 76
    Qwen3.5-397B rows repeat an InferenceMAX row's TTFT to the rounding (AIConfigurator's own
    collection files: 2-26%), so those rows are InferenceMAX rows, run with its client and server."""
    src = r.get("silicon_data_source", "")
    if "gap-analysis" not in src or re.search(r"source_file=[\w.-]+-gap-analysis\.csv", src):
        return "inferencemax"
    return "gap-analysis"


# The client each source ran. InferenceMAX (its README's benchmark client configuration):
# benchmark_serving.py --dataset-name random --random-range-ratio 0.8 --num-prompts 10 x CONC
# --max-concurrency CONC --request-rate inf --ignore-eos: prompt and output lengths uniform in
# [0.8 L, L], nothing excluded from the means. AIConfigurator's own collection runs (its
# bench_run.sh.j2): aiperf with fixed lengths, --num-requests 50 x CONC after
# --warmup-request-count 2 x CONC (`warmup` is per slot), every profiling request in the means.
# Sampling: InferenceMAX's benchmark_serving.py sends temperature 0 (greedy); aiperf sends no
# sampling parameters, so vLLM applies the checkpoint's generation_config.json (workload.sampling
# model_default; sim.sampling prices its top-k/top-p filtering).
FIXED = {"min_ratio": 1.0, "prompts_per_slot": 50, "warmup": 2, "sampling": "model_default"}
PROTOCOLS = {"inferencemax": {"min_ratio": 0.8, "prompts_per_slot": 10, "warmup": 0, "sampling": "greedy"},
             "gap-analysis": FIXED, "fixed": FIXED}


# The server each source ran, where its recipe is public. InferenceMAX's generic vLLM recipe (its
# README, "Server Configurations"): `vllm serve ... --max-num-seqs $CONC --max-num-batched-tokens
# 8192 --async-scheduling --no-enable-prefix-caching`, and on B200 also `--kv-cache-dtype fp8`.
# Other rows: vLLM's defaults (the scenario's).
GENERIC = {"max_num_seqs": None, "max_num_batched_tokens": 8192, "enable_prefix_caching": False,
           "kv_dtype": {"b200_sxm": "fp8", "b300_sxm": "fp8"}}
# Per model, weights and GPU, where InferenceMAX's own script for it (benchmarks/<model>_<precision>_
# <gpu>*.sh in the InferenceX repository) departs from the generic recipe. Keys as above, plus
# `cudagraph_max_tokens` (its --max-cudagraph-capture-size; None or absent: vLLM's default 512),
# `budget_per_isl` (a --max-num-batched-tokens of that many times the row's ISL, over
# `max_num_batched_tokens`), `gpu_memory_utilization` (absent: the scenario's 0.9) and `block_size`
# (its --block-size; absent: 16), `image` (the vLLM release of the script's image, for rows that name
# no release: it prices what changed between releases, e.g. the all-reduce; the sample's nightly
# rows, build 5b8c30d, were measured on 2026-04-03, the day #947 moved the script to v0.19.0);
# `max_num_seqs` None is $CONC; a `kv_dtype` of None is the checkpoint's (vLLM's default).
# gptoss_fp4_{b200,h100,h200}*.sh: capture size 2048 on every GPU; B200 fp8 KV and 512 sequences.
# Their MoE kernels are not all in the tables at gpt-oss's shape: Hopper's Marlin MXFP4 is timed
# by the tables' MXFP4 kernel with bf16 activations (the two are within 7-30% on H200, where both
# were measured); B200's MXFP8-activation kernel by its own table at the nearest measured shape
# (4096 x 2048, 256 experts, top 6: experts of gpt-oss's size), scaled to gpt-oss's.
_GPT_OSS = {"cudagraph_max_tokens": 2048, "kv_dtype": None}
_MINIMAX_947 = {"max_num_seqs": 1024, "budget_per_isl": 2, "cudagraph_max_tokens": 2048, "kv_dtype": "fp8",
                "block_size": 32, "image": "0.19.0"}
RECIPES = {
    # gptoss_fp4_b200.sh also sets VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1: MXFP8 activations
    ("gpt-oss-120b", None, "b200_sxm"): {"max_num_seqs": 512, "cudagraph_max_tokens": 2048, "kv_dtype": "fp8",
                                         "moe_activations": "mxfp8"},
    ("gpt-oss-120b", None, "h100_sxm"): _GPT_OSS,
    ("gpt-oss-120b", None, "h200_sxm"): _GPT_OSS,
    # 70b_fp8_{h100,h200}_slurm.sh: kv-cache-dtype fp8 on Hopper too.
    ("llama-3.1-70b", "fp8", "h100_sxm"): {"kv_dtype": "fp8"},
    ("llama-3.1-70b", "fp8", "h200_sxm"): {"kv_dtype": "fp8"},
    # minimaxm2.5_fp8_b200.sh from InferenceX#947 (its v0.19.0 image, merged 2026-04-03) on: fp8
    # KV, --max-cudagraph-capture-size 2048, --max-num-batched-tokens $((ISL * 2)), --block-size 32,
    # --stream-interval 20 (the first token and then every 20th leave at once: mean TTFT and TPOT
    # unchanged, not modelled), vLLM's default max_num_seqs (1024), memory utilisation 0.90; its
    # data-parallel rows pass --data-parallel-size with the same settings per rank.
    # minimaxm2.5_fp8_b300.sh reuses it as-is.
    ("minimax-m2", None, "b200_sxm"): _MINIMAX_947,
    ("minimax-m2", None, "b300_sxm"): _MINIMAX_947,
    # kimik2.5_int4_{b200,h200}.sh: vLLM's defaults (B200: max_num_seqs too).
    ("kimi-k2.5", None, "b200_sxm"): {"max_num_seqs": 1024, "kv_dtype": None, "enable_prefix_caching": True},
    ("kimi-k2.5", None, "h200_sxm"): {"kv_dtype": None, "enable_prefix_caching": True},
}


# Where InferenceMAX's script for a model changed with its vLLM image, what the rows measured on
# the earlier images ran: (model, weight dtype, GPU) -> [(the first release of the new script,
# the date the old one began (None: always) or None, recipe keys for rows of a release before
# it and measured on or after that date)]. The rows record neither.
# - minimaxm2.5_fp8_b200.sh before InferenceX#947 (v0.17.0 -> v0.19.0, 2026-04-03) exported
#   VLLM_USE_FLASHINFER_MOE_FP8=0 and VLLM_MOE_USE_DEEP_GEMM=0 (vLLM's Triton fused MoE,
#   `moe_backend: triton`) and passed --enable-expert-parallel whenever EP_SIZE >= 1, on every row
#   (#947 made it EP_SIZE > 1); otherwise vLLM's defaults (the checkpoint's KV dtype, budget 8192,
#   1024 sequences, capture size 512) with --gpu-memory-utilization 0.95 and --block-size 32. The
#   keys below undo what #947's recipe sets; its 1024 sequences and blocks of 32 stay.
# - minimaxm2.5_fp8_h200.sh had the same `-ge 1` from InferenceX#869 (2026-03-05, v0.16.0) through
#   its v0.18.0 image, until #1354 (2026-05-12; image v0.20.1) made it `-gt 1`: rows of releases
#   before 0.20 measured from 2026-03-05 served with expert parallelism.
BEFORE = {("minimax-m2", None, "b200_sxm"): [("0.19", None, {
              "moe_backend": "triton", "expert_parallel": True, "kv_dtype": None, "budget_per_isl": None,
              "cudagraph_max_tokens": None, "gpu_memory_utilization": 0.95})],
          ("minimax-m2", None, "h200_sxm"): [("0.20", "2026-03-05", {"expert_parallel": True})]}


def _before(case: dict) -> dict:
    """The recipe keys of BEFORE that apply to the row's vLLM release and measurement date."""
    out = {}
    v = case.get("vllm_version")
    if not v:
        return out
    try:
        mine = vllm_version_tuple(v)
    except ValueError:  # a nightly build: newer than every release named here
        return out
    for first, since, keys in BEFORE.get((case["model"], case["weight_dtype"], case["system"]), []):
        if mine < vllm_version_tuple(first) and (since is None or case.get("measured", since) >= since):
            out.update(keys)
    return out


# AIConfigurator's own collection runs (its generator's benchmark-mode rules,
# rule_plugin/benchmark/{vllm,trtllm}.rule, and bench_run.sh.j2): an aggregated worker's token
# budget is max_batch_size + ISL + 1500 (about one prompt per step at ISL 1024 and 4096) with
# max_batch_size the row's concurrency, and no prefix caching unless the workload has a shared
# prefix (none here). With so few prompts per step a wave of equal requests is prefilled over
# several steps, so it finishes over several steps and drifts out of phase.
def aic_collection_server(case: dict) -> dict:
    return {"max_num_batched_tokens": case["concurrency"] + case["isl"] + 1500,
            "max_num_seqs": case["concurrency"], "enable_prefix_caching": False}


# A disaggregated config in the same benchmark mode (the same rule files): a prefill worker runs
# max_batch_size sequences (the row's prefill_batch_size, 1 where unset) with a budget of ISL + 1500;
# no prefix caching.
def aic_collection_pd_server(case: dict) -> tuple[dict, dict]:
    """(pool keys, scheduler settings) of a disaggregated row of AIConfigurator's collection. Its
    decode_batch_size is the client's concurrency (disagg_case), not the decode engines' limit,
    which the row does not record: they run up to all the clients' requests."""
    pd = case["pd"]
    pools = {"prefill_max_num_seqs": pd.get("prefill_batch_size", 1),
             "prefill_max_num_batched_tokens": case["isl"] + 1500,
             "decode_max_num_seqs": case["concurrency"]}
    return pools, {"enable_prefix_caching": False}


def server(case: dict) -> tuple[dict, dict, dict]:
    """(deployment extras, scheduler settings, kernel cost-model keys) of the row's server: the last
    as a scenario's cost_model takes them (`overheads`; `moe_activations` where the recipe selects
    a MoE kernel). A disaggregated row's pool keys come with the deployment extras (`pd`): its
    decode engines run the row's decode_batch_size sequences per rank where it is recorded."""
    if case.get("pd"):
        if case["source"] == "gap-analysis":
            pools, sched = aic_collection_pd_server(case)
            return {"pd": pools}, sched, {}
        dep, sched, cm = server({k: v for k, v in case.items() if k != "pd"})
        pools = {"decode_max_num_seqs": case["pd"]["decode_batch_size"]} if case["pd"].get("decode_batch_size") else {}
        return {**dep, "pd": pools}, sched, cm
    if case["source"] == "gap-analysis" and case["backend"] in ("vllm", "trtllm"):
        return {}, aic_collection_server(case), {}
    if case["source"] != "inferencemax" or case["backend"] != "vllm":
        return {}, {}, {}
    r = {**GENERIC, **RECIPES.get((case["model"], case["weight_dtype"], case["system"]), {}), **_before(case)}
    kv = r["kv_dtype"].get(case["system"]) if isinstance(r["kv_dtype"], dict) else r["kv_dtype"]
    budget = r["budget_per_isl"] * case["isl"] if r.get("budget_per_isl") else r["max_num_batched_tokens"]
    sched = {"max_num_seqs": r["max_num_seqs"] or case["concurrency"],
             "max_num_batched_tokens": budget,
             "enable_prefix_caching": r["enable_prefix_caching"]}
    if r.get("block_size"):
        sched["block_size"] = r["block_size"]
    graphs = r.get("cudagraph_max_tokens")
    cm = {"overheads": {"cudagraph_max_tokens": graphs}} if graphs is not None else {}
    for key in ("moe_activations", "moe_backend"):
        if key in r:
            cm[key] = r[key]
    dep = {"kv_dtype": kv} if kv else {}
    if r.get("image") and not case.get("vllm_version"):
        dep["vllm_version"] = r["image"]
    if r.get("gpu_memory_utilization"):
        dep["gpu_memory_utilization"] = r["gpu_memory_utilization"]
    if r.get("expert_parallel"):
        dep["expert_parallel"] = True
    return dep, sched, cm


# A row whose GPUs span more than one node ran on a cluster of DGX-class nodes: one 400 Gb/s
# InfiniBand NDR adapter per GPU (50 GB/s each way; AIConfigurator's h100/h200/b200 systems say the
# same), so the scenario declares that link (deployment.interconnect) instead of being refused.
INTER_NODE = {"bandwidth_gb_s": 50.0, "latency_s": 1e-5}


def scenario_data(case: dict, prompts_per_slot: int | None = None, cost_model: dict | None = None,
                  range_ratio: float = 0.0, protocol: str = "fixed", recipe: bool = True) -> dict:
    """The ServeTwin scenario (as YAML data) of a row: its benchmark client and server."""
    c = case["concurrency"]
    proto = PROTOCOLS[case["source"] if protocol == "auto" else protocol]
    num = max((prompts_per_slot or proto["prompts_per_slot"]) * c, 16)
    bench = {"concurrency": c, "isl": case["isl"], "osl": case["osl"], "num_prompts": num,
             "warmup": proto["warmup"] * c}
    if proto["min_ratio"] < 1:
        bench["min_ratio"] = proto["min_ratio"]
    elif range_ratio:
        bench["range_ratio"] = range_ratio
    dep, sched, kern = server(case) if recipe else ({}, {}, {})
    pd_server = dep.pop("pd", {})
    data = {"name": "silicon-check", "seed": 0,
            "deployment": {"model": case["model"] + ("-nvfp4" if case["weight_dtype"] == "nvfp4" else ""),
                           "device": DEVICES[case["system"]], "tp": case["tp"],
                           **({"weight_dtype": case["weight_dtype"]} if case["weight_dtype"] not in (None, "nvfp4")
                              else {}), **dep,
                           **({"expert_parallel": True} if case.get("expert_parallel") else {}),
                           **({"data_parallel": case["data_parallel"]} if case.get("data_parallel") else {}),
                           # vLLM's data-parallel balancer sends each request to the least loaded engine
                           **({"replicas": case["replicas"], "router": "least_outstanding"}
                              if case.get("replicas") else {}),
                           **({"vllm_version": case["vllm_version"]} if case.get("vllm_version") else {})},
            "workload": {"benchmark": bench, "sampling": proto["sampling"]}}
    widest = case["tp"] * case.get("data_parallel", 1)  # one engine's GPUs
    if case.get("pd"):  # disaggregated pools: the row's engines, their server's limits
        pd = {k: v for k, v in case["pd"].items() if not k.endswith("_batch_size")}
        data["deployment"]["pd"] = {**pd, **pd_server}
        widest = max(pd[f"{p}_tp"] * pd.get(f"{p}_data_parallel", 1) for p in ("prefill", "decode"))
    if widest > get_device(DEVICES[case["system"]]).gpus_per_node:
        data["deployment"]["interconnect"] = dict(INTER_NODE)
    if sched:
        data["scheduler"] = sched
    if cost_model:
        data["cost_model"] = cost_model
    if kern and data.get("cost_model", {}).get("type", "kernels") == "kernels":
        cm = data.setdefault("cost_model", {"type": "kernels"})  # what the caller gave wins
        for key, value in kern.items():
            cm[key] = {**value, **cm.get(key, {})} if key == "overheads" else cm.get(key, value)
    return data


def simulate(case: dict, prompts_per_slot: int | None = None, cost_model: dict | None = None,
             range_ratio: float = 0.0, protocol: str = "fixed", recipe: bool = True) -> dict:
    return simulate_data(scenario_data(case, prompts_per_slot, cost_model, range_ratio, protocol, recipe))


def simulate_data(data: dict) -> dict:
    """Mean TTFT and TPOT (ms) and preemptions of a scenario_data() scenario."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sc = parse_scenario(data)
        res = run_scenario(sc)
    s = res.summary
    return {"ttft_ms": s["ttft_s"]["mean"] * 1e3, "tpot_ms": s["tpot_s"]["mean"] * 1e3,
            "preemptions": s.get("preemptions", 0)}


# ------------------------------------------------------------------ the peer: AISimulate
# The same rows through NVIDIA's AISimulate (its own venv; see bench/sim_speed.py), as its
# `predict` takes them: the very request lengths ServeTwin's scenario draws (warm-up requests
# included: AISimulate has no warm-up phase), as a Mooncake trace replayed at the row's
# concurrency, on the row's backend, GPU and TP, with the same server settings (token budget,
# max_num_seqs, fp8 KV where the recipe has it) and the row's GEMM quantisation; a mixture of
# experts with its experts split as the row ran them (sliced, or whole with expert parallelism,
# and its attention data parallelism) and its checkpoint's own weight formats. AISimulate's config
# has no key for the rest of a model's script (gpt-oss's MXFP8 activations on B200, the Triton MoE
# kernel of MiniMax-M2.5's scripts before InferenceX#947, the CUDA-graph capture size).
AIS_MODELS = {"llama-3.1-8b": "meta-llama/Meta-Llama-3.1-8B", "llama-3.1-70b": "meta-llama/Meta-Llama-3.1-70B",
              "qwen3-32b": "Qwen/Qwen3-32B", "gpt-oss-120b": "openai/gpt-oss-120b",
              "minimax-m2": "MiniMaxAI/MiniMax-M2.5", "kimi-k2.5": "moonshotai/Kimi-K2.5"}
AIS_QUANT = {"bfloat16": None, "fp8": "fp8", "fp8_block": "fp8_block"}


def aisimulate_config(case: dict, data: dict, tmp: Path) -> Path:
    """An AISimulate prediction config for the row, with the workload of ServeTwin's scenario
    `data` written as a Mooncake trace beside it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sc = parse_scenario(data)
    wl, cfg = sc.workload, sc.scheduler_config
    trace = tmp / "trace.jsonl"
    write_mooncake_trace(trace, wl, timestamps=False)  # replayed at the row's concurrency
    timing = {}
    if AIS_QUANT.get(case["weight_dtype"]):
        timing["gemm_quant_mode"] = AIS_QUANT[case["weight_dtype"]]
    if data["deployment"].get("kv_dtype") == "fp8":
        timing["kvcache_quant_mode"] = "fp8"
    par = {"tensor": case["tp"]}
    if get_model(case["model"]).is_moe:  # the experts' split over the engine's GPUs, as the row ran it
        dp = case.get("data_parallel", 1)
        par.update({"attention_data": dp}, **({"moe_expert": case["tp"] * dp} if case.get("expert_parallel")
                                               else {"moe_tensor": case["tp"] * dp}))
    worker = {"parallelism": par,
              "scheduler": {"max_batched_tokens": cfg.max_num_batched_tokens, "max_sequences": cfg.max_num_seqs}}
    if timing:
        worker["timing"] = timing
    config = {"traffic": {"source": {"type": "trace", "paths": [str(trace)], "format": "mooncake",
                                     "block_size": AIS_BLOCK},
                          "load": {"type": "concurrency", "concurrency": case["concurrency"]}},
              "engine": {"mode": "aggregated", "model": AIS_MODELS[case["model"]], "hardware": case["system"],
                         "backend": case["backend"], "workers": {"aggregated": worker}}}
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def aisimulate(exe: str, case: dict, data: dict) -> dict:
    """AISimulate's mean TTFT and TPOT (ms) for the row."""
    with tempfile.TemporaryDirectory(prefix="silicon-ais-") as d:
        tmp = Path(d)
        config = aisimulate_config(case, data, tmp)
        p = subprocess.run([exe, "predict", "--config", str(config), "--output-dir", str(tmp / "out"),
                            "--overwrite"], capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"aisimulate predict failed ({p.returncode}): {p.stderr[-300:]}")
        s = json.loads((tmp / "out" / "prediction.json").read_text())
    return {"ttft_ms": s["mean_ttft_ms"], "tpot_ms": s["mean_tpot_ms"]}


def summarize_errors(rows: list[dict], keys: tuple[str, ...]) -> dict:
    groups = defaultdict(list)
    for r in rows:
        groups[" ".join(f"{k}={r[k]}" for k in keys) if keys else "all"].append(r)
    out = {}
    for g, rs in sorted(groups.items()):
        out[g] = _errors(rs, "err_")
        peer = [r for r in rs if "ais_err_ttft" in r]
        if peer:  # AISimulate on the same rows (those it ran)
            out[g]["aisimulate"] = _errors(peer, "ais_err_")
    return out


def _errors(rs: list[dict], key: str) -> dict:
    """n, median |error| and bias (median signed error) of TTFT and TPOT under rows' key + metric."""
    e = {m: np.array([r[key + m] for r in rs]) for m in ("ttft", "tpot")}
    return {"n": len(rs), **{f"{m}_median_abs_err": round(float(np.median(np.abs(v))), 3) for m, v in e.items()},
            **{f"{m}_bias": round(float(np.median(v)), 3) for m, v in e.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=default_csv())
    ap.add_argument("--max-rows", type=int, default=0, help="every k-th usable row to stay under N (0: all)")
    ap.add_argument("--backend", action="append", help="only these backends (repeatable)")
    ap.add_argument("--system", action="append", help="only these systems (repeatable)")
    ap.add_argument("--model", action="append", help="only these models, by catalog name (repeatable)")
    ap.add_argument("--mode", action="append", choices=("agg", "disagg"),
                    help="only aggregated or disaggregated (prefill/decode pools) rows (repeatable)")
    ap.add_argument("--max-osl", type=int, default=0, help="skip rows with a longer OSL (speed)")
    ap.add_argument("--prompts-per-slot", type=int, default=None,
                    help="requests per concurrency slot, instead of the protocol's (InferenceMAX 10, "
                         "AIConfigurator's collection 50)")
    ap.add_argument("--out", help="also write the per-row results (JSON)")
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="benchmark lengths uniform in [L(1-r), L(1+r)] (vllm bench serve --random-range-ratio); "
                         "0: fixed, as aiperf/AIConfigurator's own collection ran (with --protocol fixed)")
    ap.add_argument("--protocol", choices=("auto", "fixed"), default="auto",
                    help="the benchmark client per row: auto (from the row's data source: InferenceMAX's "
                         "client for its rows, fixed lengths for AIConfigurator's gap analysis) or fixed "
                         "lengths for every row")
    ap.add_argument("--aisimulate", metavar="PATH",
                    help="also run the rows through AISimulate (its `aisimulate` executable, in its own venv, "
                         "e.g. AISIM_VENV/bin/aisimulate) with the same request lengths, concurrency and "
                         "server settings, and report its errors beside ServeTwin's (`aisimulate` keys)")
    ap.add_argument("--no-recipe", dest="recipe", action="store_false",
                    help="simulate every row with vLLM's default server settings instead of the "
                         "source's published server recipe (see server())")
    a = ap.parse_args(argv)
    if not a.csv or not Path(a.csv).exists():
        sys.exit("silicon_check: no silicon_sample.csv (install the aisimulate wheel or give --csv)")
    allowed = [(r, usable(r)) for r in allowed_rows(a.csv)]
    cases = [c for _r, c in allowed if c is not None]
    for c in cases:
        c["mode"] = "disagg" if c.get("pd") else "agg"
    if a.mode:
        cases = [c for c in cases if c["mode"] in a.mode]
    if a.backend:
        cases = [c for c in cases if c["backend"] in a.backend]
    if a.system:
        cases = [c for c in cases if c["system"] in a.system]
    if a.model:
        cases = [c for c in cases if c["model"] in a.model]
    if a.max_osl:
        cases = [c for c in cases if c["osl"] <= a.max_osl]
    cases.sort(key=lambda c: (c["backend"], c["system"], c["model"], c["weight_dtype"] or "", c["tp"],
                              c["concurrency"], c["isl"], c["osl"]))
    if a.max_rows and len(cases) > a.max_rows:
        step = len(cases) / a.max_rows
        cases = [cases[int(i * step)] for i in range(a.max_rows)]
    rows, skipped = [], []
    t0 = time.perf_counter()
    for c in cases:
        data = scenario_data(c, a.prompts_per_slot, range_ratio=a.range_ratio, protocol=a.protocol,
                             recipe=a.recipe)
        try:
            sim = simulate_data(data)
        except Exception as e:  # a deployment that does not fit, say: report, do not hide
            skipped.append({**c, "error": str(e)[:200]})
            continue
        r = {**c, "sim_ttft_ms": round(sim["ttft_ms"], 2), "sim_tpot_ms": round(sim["tpot_ms"], 3),
             "preemptions": sim["preemptions"]}
        r["err_ttft"] = (sim["ttft_ms"] - c["ttft_ms"]) / c["ttft_ms"]
        r["err_tpot"] = (sim["tpot_ms"] - c["tpot_ms"]) / c["tpot_ms"]
        if a.aisimulate and c.get("pd"):
            r["ais_error"] = "disaggregated row: not run through AISimulate here (aggregated configs only)"
        elif a.aisimulate:
            try:
                peer = aisimulate(a.aisimulate, c, data)
            except (RuntimeError, KeyError) as e:  # a model or system it does not have: say so
                r["ais_error"] = str(e)[:200]
            else:
                r["ais_ttft_ms"], r["ais_tpot_ms"] = round(peer["ttft_ms"], 2), round(peer["tpot_ms"], 3)
                r["ais_err_ttft"] = (peer["ttft_ms"] - c["ttft_ms"]) / c["ttft_ms"]
                r["ais_err_tpot"] = (peer["tpot_ms"] - c["tpot_ms"]) / c["tpot_ms"]
        rows.append(r)
    report = {
        "source": a.csv, "held_out": f"backend={HELD_OUT_BACKEND} on {sorted(HELD_OUT_SYSTEMS)} (dropped unread)",
        "rows": len(rows), "skipped": len(skipped), "wall_s": round(time.perf_counter() - t0, 1),
        # rows of the file this script cannot express at all (an unknown model or GPU, pipeline
        # parallelism, a quantisation the GPU lacks, pools of unrecorded shape), by backend/system
        "not_expressible": dict(sorted(Counter(f"{r['backend']} {r['system']} {r['mode']}" for r, c in allowed
                                               if c is None).items())),
        "error_definition": "(sim - silicon) / silicon of the mean TTFT / TPOT; bias = median signed error",
        "overall": summarize_errors(rows, ()),
        # the setting of the held-out check: concurrency 4-144, ISL 1k-8k, OSL 100-8k
        "in_check_range": summarize_errors([r for r in rows if 4 <= r["concurrency"] <= 144 and
                                            1000 <= r["isl"] <= 8192 and 100 <= r["osl"] <= 8192], ()),
        "in_check_range_by_backend_system": summarize_errors(
            [r for r in rows if 4 <= r["concurrency"] <= 144 and 1000 <= r["isl"] <= 8192
             and 100 <= r["osl"] <= 8192], ("backend", "system")),
        "by_backend_system": summarize_errors(rows, ("backend", "system")),
        "by_model": summarize_errors(rows, ("backend", "system", "model", "weight_dtype")),
        # aggregated rows only: a disaggregated row's engines are in `pd` (by_mode)
        "by_tp": summarize_errors([r for r in rows if r["mode"] == "agg"], ("backend", "system", "tp")),
        # data-parallel attention ranks (1: none)
        "by_data_parallel": summarize_errors([{**r, "data_parallel": r.get("data_parallel", 1)} for r in rows
                                              if r["mode"] == "agg"],
                                             ("backend", "system", "model", "data_parallel")),
        "by_concurrency": summarize_errors(rows, ("backend", "concurrency")),
        "by_source": summarize_errors(rows, ("backend", "system", "source")),
        "by_mode": summarize_errors(rows, ("backend", "system", "mode")),
        # aggregated rows that wrote their GPUs squared, read as k GPUs (squared_shape), apart
        "by_squared_shape": summarize_errors([{**r, "squared": r.get("squared", False)} for r in rows
                                              if r["mode"] == "agg"], ("backend", "system", "squared")),
        # disaggregated rows, by whether they record their pools' worker counts (else one of each)
        "disagg_by_workers_recorded": summarize_errors([r for r in rows if r["mode"] == "disagg"],
                                                       ("backend", "system", "pd_workers_recorded")),
    }
    if skipped:
        report["skipped_examples"] = skipped[:5]
    print(json.dumps(report, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"report": report, "rows": rows, "skipped": skipped}, f, indent=1)


if __name__ == "__main__":
    main()
