"""A plan's candidates: the grid's points, the scenario of n units of one, their labels and GPU
counts, and how candidates rank (plan.py searches them, plan_report.py reports them)."""
from __future__ import annotations

import itertools
import math

from scenarios.compose import set_field, strip
from sim.specs import INT4, QWEN3_VL_SIZES, canonical_dtype

# The Hugging Face repository a catalog model is served from (for the printed vllm command).
HF_NAMES = {"llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
            "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
            "llama-3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
            "llama-3.2-3b": "meta-llama/Llama-3.2-3B-Instruct",
            "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct", "qwen2.5-72b": "Qwen/Qwen2.5-72B-Instruct",
            "qwen3-8b": "Qwen/Qwen3-8B", "qwen3-14b": "Qwen/Qwen3-14B", "qwen3-32b": "Qwen/Qwen3-32B",
            "mistral-7b": "mistralai/Mistral-7B-Instruct-v0.3",
            "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B-Instruct-2507",
            "mixtral-8x7b": "mistralai/Mixtral-8x7B-Instruct-v0.1",
            "mixtral-8x22b": "mistralai/Mixtral-8x22B-Instruct-v0.1",
            "gpt-oss-20b": "openai/gpt-oss-20b", "gpt-oss-120b": "openai/gpt-oss-120b",
            "deepseek-v3": "deepseek-ai/DeepSeek-V3", "kimi-k2": "moonshotai/Kimi-K2-Instruct",
            "minimax-m2": "MiniMaxAI/MiniMax-M2",
            "llama-4-scout-17b-16e": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
            "llama-3.1-405b": "meta-llama/Llama-3.1-405B-Instruct",
            "llama-2-7b": "meta-llama/Llama-2-7b-chat-hf", "llama-2-13b": "meta-llama/Llama-2-13b-chat-hf",
            "llama-2-70b": "meta-llama/Llama-2-70b-chat-hf", "codellama-34b": "codellama/CodeLlama-34b-Instruct-hf",
            "qwen2.5-14b": "Qwen/Qwen2.5-14B-Instruct", "qwen2.5-32b": "Qwen/Qwen2.5-32B-Instruct",
            "qwen3-0.6b": "Qwen/Qwen3-0.6B", "qwen3-1.7b": "Qwen/Qwen3-1.7B", "qwen3-4b": "Qwen/Qwen3-4B",
            "qwen3-coder-480b-a35b": "Qwen/Qwen3-Coder-480B-A35B-Instruct",
            "mistral-nemo": "mistralai/Mistral-Nemo-Instruct-2407",
            "mistral-small-24b": "mistralai/Mistral-Small-24B-Instruct-2501", "phi-4": "microsoft/phi-4",
            "yi-34b": "01-ai/Yi-34B-Chat", "kimi-k2.5": "moonshotai/Kimi-K2.5",
            "llama-4-maverick-17b-128e": "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
            "qwen3.5-397b-a17b": "Qwen/Qwen3.5-397B-A17B", "qwen3.5-122b-a10b": "Qwen/Qwen3.5-122B-A10B",
            "qwen3.5-35b-a3b": "Qwen/Qwen3.5-35B-A3B", "qwen3.5-27b": "Qwen/Qwen3.5-27B",
            "qwen3-next-80b-a3b": "Qwen/Qwen3-Next-80B-A3B-Instruct",
            "deepseek-v3.2": "deepseek-ai/DeepSeek-V3.2", "glm-5": "zai-org/GLM-5", "glm-5.2": "zai-org/GLM-5.2",
            "nemotron-3-nano-30b-a3b": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
            "nemotron-3-super-120b-a12b": "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",
            "nemotron-3-ultra-550b-a55b": "nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16",
            "nemotron-h-56b": "nvidia/Nemotron-H-56B-Base-8K", "step-3.7-flash": "stepfun-ai/Step-3.7-Flash",
            "mimo-7b": "XiaomiMiMo/MiMo-7B-Base", "mimo-v2-flash": "XiaomiMiMo/MiMo-V2-Flash",
            "gemma-4-26b-a4b": "google/gemma-4-26B-A4B-it", "gemma-4-31b": "google/gemma-4-31B-it",
            "minimax-m3": "MiniMaxAI/MiniMax-M3", "deepseek-v4-flash": "deepseek-ai/DeepSeek-V4-Flash",
            "deepseek-v4-pro": "deepseek-ai/DeepSeek-V4-Pro",
            "kimi-linear-48b-a3b": "moonshotai/Kimi-Linear-48B-A3B-Instruct", "kimi-k3": "moonshotai/Kimi-K3",
            "glm-4.5": "zai-org/GLM-4.5", "glm-4.5-air": "zai-org/GLM-4.5-Air", "glm-4.6": "zai-org/GLM-4.6",
            "mistral-large-2411": "mistralai/Mistral-Large-Instruct-2411",
            **{f"gemma-3-{s}": f"google/gemma-3-{s}-it" for s in ("1b", "4b", "12b", "27b")},
            **{f"gemma-2-{s}": f"google/gemma-2-{s}-it" for s in ("2b", "9b", "27b")},
            "phi-3.5-mini": "microsoft/Phi-3.5-mini-instruct", "phi-4-mini": "microsoft/Phi-4-mini-instruct",
            "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite-Chat", "codestral-22b": "mistralai/Codestral-22B-v0.1",
            "qwen1.5-moe-a2.7b": "Qwen/Qwen1.5-MoE-A2.7B-Chat", "qwen2-57b-a14b": "Qwen/Qwen2-57B-A14B-Instruct",
            "glm-5.3-flash": "zai-org/GLM-5.3-Flash",
            **{f"granite-3.3-{s}": f"ibm-granite/granite-3.3-{s}-instruct" for s in ("2b", "8b")},
            **{f"qwen2.5-vl-{s}": f"Qwen/Qwen2.5-VL-{s.upper()}-Instruct" for s in ("3b", "7b", "32b", "72b")},
            **{f"qwen2.5-{s}": f"Qwen/Qwen2.5-{s.upper()}-Instruct" for s in ("0.5b", "1.5b", "3b")},
            **{f"qwen3-vl-{s}": f"Qwen/Qwen3-VL-{s.upper()}-Instruct" for s in QWEN3_VL_SIZES}}

# Checkpoints published with fp8 weights for catalog models whose own checkpoint is bf16: what a
# plan timed with `deployment.weight_dtype: fp8` (or fp8_block) is served from.
FP8_HF_NAMES = {"llama-3.1-8b": "nvidia/Llama-3.1-8B-Instruct-FP8",
                "llama-3.1-70b": "nvidia/Llama-3.1-70B-Instruct-FP8",
                "qwen3-8b": "Qwen/Qwen3-8B-FP8", "qwen3-14b": "Qwen/Qwen3-14B-FP8", "qwen3-32b": "Qwen/Qwen3-32B-FP8",
                "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B-Instruct-2507-FP8",
                "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8",
                "qwen3-4b": "Qwen/Qwen3-4B-FP8", "llama-3.1-405b": "meta-llama/Llama-3.1-405B-Instruct-FP8",
                "qwen3-coder-480b-a35b": "Qwen/Qwen3-Coder-480B-A35B-Instruct-FP8",
                "llama-4-maverick-17b-128e": "meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8",
                "qwen3.5-397b-a17b": "Qwen/Qwen3.5-397B-A17B-FP8", "qwen3.5-122b-a10b": "Qwen/Qwen3.5-122B-A10B-FP8",
                "qwen3.5-35b-a3b": "Qwen/Qwen3.5-35B-A3B-FP8", "qwen3.5-27b": "Qwen/Qwen3.5-27B-FP8",
                "qwen3-next-80b-a3b": "Qwen/Qwen3-Next-80B-A3B-Instruct-FP8", "glm-5": "zai-org/GLM-5-FP8",
                "glm-5.2": "zai-org/GLM-5.2-FP8",
                "nemotron-3-nano-30b-a3b": "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8",
                "nemotron-3-super-120b-a12b": "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-FP8",
                "nemotron-3-ultra-550b-a55b": "nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-FP8",
                "step-3.7-flash": "stepfun-ai/Step-3.7-Flash-FP8",
                **{f"qwen3-vl-{s}": f"Qwen/Qwen3-VL-{s.upper()}-Instruct-FP8" for s in QWEN3_VL_SIZES}}
FP8_DTYPES = ("fp8", "fp8_block")


def hf_checkpoint(model: str, weight_dtype: str | None, catalog_dtype: str | None) -> tuple[str, str | None]:
    """(the Hugging Face repository a plan's vllm serve line names, the --quantization it needs or
    None). Weights timed as fp8 where the catalog's checkpoint is not: its published fp8 checkpoint
    (FP8_HF_NAMES), else the bf16 one with vLLM's online fp8 quantization (--quantization fp8).
    Weights timed as 4-bit integers (int4) of a catalog model: a placeholder that asks for a 4-bit
    checkpoint of it (vLLM does not quantize to them as it loads); a Hugging Face name is kept."""
    name = HF_NAMES.get(model, model)
    try:
        weight_dtype = canonical_dtype(weight_dtype) if weight_dtype else None
    except ValueError:
        pass  # the scenario's own validation names it
    if weight_dtype in INT4 and name == HF_NAMES.get(model):
        # vLLM quantizes no checkpoint to 4-bit integers as it loads: the plan names a 4-bit one
        # (AWQ, GPTQ, w4a16) of the model, which the user picks
        return f"<a 4-bit AWQ/GPTQ checkpoint of {name}>", None
    if weight_dtype in FP8_DTYPES and catalog_dtype not in FP8_DTYPES:
        if model in FP8_HF_NAMES:
            return FP8_HF_NAMES[model], None
        return name, "fp8"
    return name, None


GRID_KEYS = ("device", "tp", "data_parallel", "max_num_batched_tokens", "max_num_seqs", "policy", "router", "pd")


def candidates(data: dict, spec) -> list[dict]:
    """The grid's points, in grid order; keys missing from the grid keep the scenario's values."""
    dep = data.get("deployment") or {}
    sch = data.get("scheduler") or {}
    base = {"device": dep.get("device", "h100-sxm"), "tp": dep.get("tp", 1),
            "data_parallel": dep.get("data_parallel", 1),
            "max_num_batched_tokens": sch.get("max_num_batched_tokens", 8192),
            "max_num_seqs": sch.get("max_num_seqs", 1024), "policy": sch.get("policy", "fcfs"),
            "router": dep.get("router", "round_robin"), "pd": dep.get("pd")}
    axes = [spec.grid.get(k, [base[k]]) for k in GRID_KEYS]
    return [dict(zip(GRID_KEYS, combo)) for combo in itertools.product(*axes)]


def compose(data: dict, cand: dict, units: int = 1) -> dict:
    """The scenario of `units` units of a candidate (a unit: one replica, or one P/D group)."""
    out = strip(data)
    for key, path in (("device", "deployment.device"), ("tp", "deployment.tp"),
                      ("router", "deployment.router"), ("policy", "scheduler.policy"),
                      ("max_num_batched_tokens", "scheduler.max_num_batched_tokens"),
                      ("max_num_seqs", "scheduler.max_num_seqs")):
        out = set_field(out, path, cand[key])
    dp = cand.get("data_parallel", 1)
    out = set_field(out, "deployment.data_parallel", dp if dp > 1 else None)
    pd = cand.get("pd")
    if pd:
        pd = dict(pd)
        pd["prefill_replicas"] = pd.get("prefill_replicas", 1) * units
        pd["decode_replicas"] = pd.get("decode_replicas", 1) * units
        out = set_field(out, "deployment.pd", pd)
        out = set_field(out, "deployment.replicas", 1)
    else:
        out = set_field(out, "deployment.pd", None)
        out = set_field(out, "deployment.replicas", units)
    return out


def gpus_per_unit(cand: dict) -> int:
    pd = cand.get("pd")
    if not pd:
        return int(cand["tp"]) * int(cand.get("data_parallel", 1))
    return sum(pd.get(f"{pool}_replicas", 1) * pd.get(f"{pool}_tp", cand["tp"]) * pd.get(f"{pool}_data_parallel", 1)
               for pool in ("prefill", "decode"))


def label(cand: dict) -> str:
    pd = cand.get("pd")
    dp = cand.get("data_parallel", 1)
    shape = (f"tp{cand['tp']}" + (f" dp{dp}" if dp > 1 else "") if not pd else
             "+".join(f"{pool[0].upper()}{pd.get(f'{pool}_replicas', 1)}xtp{pd.get(f'{pool}_tp', cand['tp'])}"
                      + (f"dp{pd[f'{pool}_data_parallel']}" if pd.get(f"{pool}_data_parallel", 1) > 1 else "")
                      for pool in ("prefill", "decode")))
    return (f"{cand['device']} {shape} B{cand['max_num_batched_tokens']} S{cand['max_num_seqs']} "
            f"{cand['policy']}" + (f" {cand['router']}" if cand["router"] != "round_robin" else ""))


def rank_key(s) -> tuple:
    """Cost first, then headroom (the total rate sustained over the target: more is better)."""
    return (s.cost if s.cost is not None else math.inf, -(s.lo or 0.0), s.key)


def budget_rank_key(s, units: int) -> tuple:
    """Fixed GPU budget: the most traffic first, then cost."""
    return (-(s.lo or 0.0), s.unit_cost * units, s.key)


__all__ = ["HF_NAMES", "FP8_HF_NAMES", "GRID_KEYS", "candidates", "compose", "hf_checkpoint", "gpus_per_unit", "label", "rank_key", "budget_rank_key"]
