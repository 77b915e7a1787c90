"""bench/silicon_check.py: the held-out rows never leave the CSV reader, a row becomes the case its
source measured, and the peer (AISimulate) is given the very requests and server ServeTwin runs.
No AISimulate install is needed: these check what the bench writes for it."""
import csv
import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import silicon_check as sc  # noqa: E402
from sim.scenario import parse_scenario  # noqa: E402
from sim.specs import get_model  # noqa: E402

COLUMNS = ["backend", "system", "model_path", "mode", "gemm_quant_mode", "pp_size", "attention_dp_size",
           "batch_size", "tp_size", "moe_tp_size", "moe_ep_size", "isl", "osl", "silicon_ttft_ms", "silicon_tpot_ms", "silicon_data_source"]


def row(**kw) -> dict:
    base = {"backend": "vllm", "system": "b200_sxm", "model_path": "meta-llama/Llama-3.1-70B", "mode": "agg",
            "gemm_quant_mode": "fp8", "pp_size": "1", "attention_dp_size": "1", "batch_size": "8",
            "tp_size": "4", "isl": "1024", "osl": "1024", "silicon_ttft_ms": "110", "silicon_tpot_ms": "8.2",
            "silicon_data_source": "inferencemax-db"}
    return {**base, **kw}


def write_csv(path: Path, rows: list[dict]) -> str:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    return str(path)


def test_held_out_rows_are_dropped_while_reading(tmp_path):
    rows = [row(), row(system="h100_sxm"), row(system="h200_sxm"), row(backend="trtllm", system="h100_sxm"),
            row(backend=" VLLM ", system="h200_sxm")]
    kept = sc.allowed_rows(write_csv(tmp_path / "s.csv", rows))
    assert [(r["backend"].strip().lower(), r["system"]) for r in kept] == [("vllm", "b200_sxm"),
                                                                           ("trtllm", "h100_sxm")]


def test_a_row_becomes_its_case_and_unsupported_rows_are_skipped():
    case = sc.usable(row())
    assert case == {"backend": "vllm", "system": "b200_sxm", "model": "llama-3.1-70b", "weight_dtype": "fp8",
                    "tp": 4, "concurrency": 8, "isl": 1024, "osl": 1024, "ttft_ms": 110.0, "tpot_ms": 8.2,
                    "source": "inferencemax"}
    # AIConfigurator's own collection runs are gap-analysis rows; a <model>-gap-analysis.csv file
    # repeats InferenceMAX's measurements, so its rows are InferenceMAX's
    aic = "source_file=/x/aic-auto-gap-analysis/data/h100_sxm/vllm/0.10.1/Qwen_Qwen3-32B.csv; silicon_concurrency=8"
    assert sc.usable(row(silicon_data_source=aic))["source"] == "gap-analysis"
    copied = "source_file=kimi-k2.5-gap-analysis.csv; silicon_concurrency=64"
    assert sc.usable(row(silicon_data_source=copied))["source"] == "inferencemax"
    assert sc.usable(row(model_path="deepseek-ai/DeepSeek-R1"))["model"] == "deepseek-v3"  # MoE: modelled
    ep = sc.usable(row(model_path="MiniMaxAI/MiniMax-M2.5", moe_ep_size="4", moe_tp_size="1"))
    assert ep["model"] == "minimax-m2" and ep["expert_parallel"] is True
    assert sc.scenario_data(ep)["deployment"]["expert_parallel"] is True
    assert "expert_parallel" not in sc.scenario_data(sc.usable(row()))["deployment"]
    assert sc.usable(row(model_path="tiiuae/falcon-40b")) is None      # not in the catalog
    assert sc.usable(row(mode="disagg")) is None  # pools of unrecorded shape
    # an NVFP4 row runs NVIDIA's -NVFP4 checkpoint on a GPU with FP4 tensor cores, not on Hopper
    fp4 = sc.usable(row(gemm_quant_mode="nvfp4"))
    assert fp4["weight_dtype"] == "nvfp4"
    dep = sc.scenario_data(fp4)["deployment"]
    assert dep["model"] == "llama-3.1-70b-nvfp4" and "weight_dtype" not in dep
    assert get_model(dep["model"]).weight_dtype == "nvfp4"
    assert sc.usable(row(gemm_quant_mode="nvfp4", backend="trtllm", system="h100_sxm")) is None
    # a checkpoint that ships 4-bit experts runs as it ships: gpt-oss (MXFP4; the sample labels
    # its rows nvfp4) and Kimi-K2.5 (int4 groups of 32); an NVFP4 row of another model runs its
    # -NVFP4 checkpoint
    oss = sc.usable(row(model_path="openai/gpt-oss-120b", gemm_quant_mode="nvfp4"))
    assert oss["model"] == "gpt-oss-120b" and oss["weight_dtype"] is None
    assert "weight_dtype" not in sc.scenario_data(oss)["deployment"]
    kimi = sc.usable(row(model_path="moonshotai/Kimi-K2.5", gemm_quant_mode="int4_wo", tp_size="8"))
    assert kimi["model"] == "kimi-k2.5" and kimi["weight_dtype"] is None
    assert sc.usable(row(model_path="moonshotai/Kimi-K2.5", gemm_quant_mode="nvfp4"))["weight_dtype"] == "nvfp4"
    # GLM-5's and Qwen3.5's only fp8 checkpoints are 128x128 blocks: their fp8 rows run those
    assert sc.usable(row(model_path="zhipuai/GLM-5", tp_size="8"))["weight_dtype"] == "fp8_block"
    mm = sc.usable(row(model_path="MiniMaxAI/MiniMax-M2.5", gemm_quant_mode="nvfp4"))
    assert get_model(sc.scenario_data(mm)["deployment"]["model"]).expert_dtype == "nvfp4"
    # block-fp8 checkpoints labelled fp8 (MiniMax-M2.5, DeepSeek-R1) run their 128x128 blocks; a
    # per-channel fp8 checkpoint labelled fp8 (Llama-3.1-70B above) keeps the label
    for path in ("MiniMaxAI/MiniMax-M2.5", "deepseek-ai/DeepSeek-R1"):
        case = sc.usable(row(model_path=path, tp_size="8"))
        assert case["weight_dtype"] is None
        assert parse_scenario(sc.scenario_data(case)).deployment["weight_dtype"] == "fp8_block"
    # a dense model's DP: dp engines of tp_size / dp GPUs behind vLLM's balancer, the client's
    # batch_size x dp requests over them
    dense = sc.usable(row(attention_dp_size="2"))
    assert (dense["tp"], dense["replicas"], dense["concurrency"]) == (2, 2, 16) and "data_parallel" not in dense
    assert sc.scenario_data(dense)["deployment"]["replicas"] == 2
    assert sc.scenario_data(dense)["deployment"]["router"] == "least_outstanding"
    dp = sc.usable(row(model_path="MiniMaxAI/MiniMax-M2.5", tp_size="4", attention_dp_size="4",
                       moe_ep_size="16", moe_tp_size="1"))
    assert (dp["tp"], dp["data_parallel"]) == (1, 4)          # InferenceMAX's tp 4 + dp-attn: 4 GPUs
    assert sc.scenario_data(dp)["deployment"]["data_parallel"] == 4
    # batch_size is per DP rank: the client ran 8 x 4 (as the source's silicon_concurrency says)
    assert dp["concurrency"] == 32 and sc.scenario_data(dp)["workload"]["benchmark"]["concurrency"] == 32
    # TensorRT-LLM writes tp 1 with dp 8: eight ranks of one GPU (moe_tp x moe_ep = 8)
    trt = sc.usable(row(backend="trtllm", system="h200_sxm", model_path="deepseek-ai/DeepSeek-R1", tp_size="1",
                        attention_dp_size="8", moe_ep_size="8", moe_tp_size="1"))
    assert (trt["tp"], trt["data_parallel"], trt["concurrency"]) == (1, 8, 64)
    assert sc.usable(row(silicon_ttft_ms="")) is None


def test_a_row_that_writes_its_gpus_squared_is_read_as_one_node():
    # SGLang/TensorRT-LLM exports write TP8 with 8-way EP as tp_size 64, moe 8 x 8 (and DP8 as dp 64):
    # 8 GPUs, the experts over all of them; the client's concurrency as recorded (batch_size x dp)
    sq = sc.usable(row(backend="sglang", system="h200_sxm", model_path="Qwen/Qwen3.5-397B-A17B",
                       tp_size="64", moe_tp_size="8", moe_ep_size="8"))
    assert (sq["tp"], sq.get("data_parallel"), sq["expert_parallel"], sq["concurrency"]) == (8, None, True, 8)
    assert parse_scenario(sc.scenario_data(sq)).deployment["tp"] == 8
    dp = sc.usable(row(backend="trtllm", system="b200_sxm", model_path="deepseek-ai/DeepSeek-R1", tp_size="1",
                       attention_dp_size="64", moe_tp_size="8", moe_ep_size="8", batch_size="4"))
    assert (dp["tp"], dp["data_parallel"], dp["expert_parallel"], dp["concurrency"]) == (1, 8, True, 256)
    assert sq["squared"] and dp["squared"] and "squared" not in sc.usable(row())
    # a client that recorded fewer clients than batch_size x the written dp: its own count
    few = sc.usable(row(backend="trtllm", system="b200_sxm", model_path="deepseek-ai/DeepSeek-R1", tp_size="1",
                        attention_dp_size="64", moe_tp_size="8", moe_ep_size="8", batch_size="32",
                        silicon_data_source="db-dump; silicon_concurrency=32"))
    assert (few["data_parallel"], few["concurrency"]) == (8, 32)
    four = sc.usable(row(backend="sglang", model_path="deepseek-ai/DeepSeek-R1", tp_size="16",
                         moe_tp_size="4", moe_ep_size="4"))
    assert (four["tp"], four["expert_parallel"]) == (4, True)
    # within a node the columns are read as written: tp 4 with moe 2 x 2 is four GPUs
    assert sc.usable(row(backend="sglang", model_path="deepseek-ai/DeepSeek-R1", tp_size="4",
                         moe_tp_size="2", moe_ep_size="2"))["tp"] == 4


def test_a_row_wider_than_a_node_runs_over_the_nodes_link():
    # 16 H200s are two nodes of 8: the row declares the link between them (one 400 Gb/s NDR port per
    # GPU, 50 GB/s) rather than being refused; within a node nothing is declared
    wide = sc.usable(row(backend="trtllm", system="h200_sxm", model_path="openai/gpt-oss-120b",
                         gemm_quant_mode="nvfp4", tp_size="16"))
    data = sc.scenario_data(wide)
    assert data["deployment"]["interconnect"] == {"bandwidth_gb_s": 50.0, "latency_s": 1e-5}
    scenario = parse_scenario(data)
    assert scenario.deployment["tp"] == 16
    assert "interconnect" not in sc.scenario_data(sc.usable(row(tp_size="8")))["deployment"]
    no_link = {**data, "deployment": {k: v for k, v in data["deployment"].items() if k != "interconnect"}}
    with pytest.raises(Exception, match="spans more than one node"):
        parse_scenario(no_link)


def test_the_peer_gets_the_same_requests_and_the_published_server(tmp_path):
    case = sc.usable(row(batch_size="16"))
    data = sc.scenario_data(case, protocol="auto")
    wl = parse_scenario(data).workload
    config = yaml.safe_load(sc.aisimulate_config(case, data, tmp_path).read_text())
    trace = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    # InferenceMAX's client: 10 x CONC prompts, lengths uniform in [0.8 L, L]
    assert len(trace) == 10 * 16
    assert [t["input_length"] for t in trace] == wl.prompt_len.tolist()
    assert [t["output_length"] for t in trace] == wl.output_len.tolist()
    assert min(t["input_length"] for t in trace) >= int(0.8 * 1024) and max(t["input_length"] for t in trace) <= 1024
    ids = [i for t in trace for i in t["hash_ids"]]
    assert len(ids) == len(set(ids))                                      # nothing shared: no prefix hits
    assert all(len(t["hash_ids"]) == -(-t["input_length"] // sc.AIS_BLOCK) for t in trace)
    assert config["traffic"]["load"] == {"type": "concurrency", "concurrency": 16}
    eng = config["engine"]
    assert (eng["model"], eng["hardware"], eng["backend"]) == ("meta-llama/Meta-Llama-3.1-70B", "b200_sxm", "vllm")
    w = eng["workers"]["aggregated"]
    assert w["parallelism"] == {"tensor": 4}
    # InferenceMAX's vLLM B200 recipe: --max-num-seqs CONC --max-num-batched-tokens 8192, fp8 KV
    assert w["scheduler"] == {"max_batched_tokens": 8192, "max_sequences": 16}
    assert w["timing"] == {"gemm_quant_mode": "fp8", "kvcache_quant_mode": "fp8"}


def test_the_peer_gets_a_mixture_of_experts_split_as_the_row_ran_it(tmp_path):
    """A MoE row tells AISimulate how its experts are split over the engine's GPUs: sliced over
    all of them (moe_tensor) without expert parallelism, whole (moe_expert) with it, and attention
    data parallelism as attention_data; tensor x attention_data GPUs in all, as its checker wants."""
    def parallelism(**kw):
        case = sc.usable(row(model_path="MiniMaxAI/MiniMax-M2.5", gemm_quant_mode="fp8", **kw))
        data = sc.scenario_data(case, protocol="auto")
        config = yaml.safe_load(sc.aisimulate_config(case, data, tmp_path).read_text())
        assert config["engine"]["model"] == "MiniMaxAI/MiniMax-M2.5"
        return config["engine"]["workers"]["aggregated"]["parallelism"]
    assert parallelism(tp_size="4") == {"tensor": 4, "attention_data": 1, "moe_tensor": 4}
    assert parallelism(tp_size="4", moe_ep_size="4") == {"tensor": 4, "attention_data": 1, "moe_expert": 4}
    # InferenceMAX's `tp: 4, dp-attn: true`: four ranks of one GPU, the experts over all four
    assert parallelism(tp_size="4", attention_dp_size="4", moe_ep_size="4") == {
        "tensor": 1, "attention_data": 4, "moe_expert": 4}


def test_a_bf16_gap_analysis_row_runs_aiconfigurators_collection_client_and_server(tmp_path):
    """AIConfigurator's own collection: aiperf with fixed lengths, 50 requests per slot after 2 per
    slot of warm-up; its generator's server (benchmark mode): a budget of concurrency + ISL + 1500
    tokens, as many sequences as the concurrency, no prefix caching."""
    case = sc.usable(row(backend="trtllm", system="h100_sxm", model_path="meta-llama/Llama-3.1-8B-Instruct",
                         gemm_quant_mode="", tp_size="2", isl="2048", osl="128",
                         silicon_data_source="source_file=/x/aic-auto-gap-analysis/y.csv"))
    data = sc.scenario_data(case, protocol="auto")
    assert data["scheduler"] == {"max_num_batched_tokens": 8 + 2048 + 1500, "max_num_seqs": 8,
                                 "enable_prefix_caching": False}
    assert data["workload"]["benchmark"]["warmup"] == 2 * 8
    config = yaml.safe_load(sc.aisimulate_config(case, data, tmp_path).read_text())
    trace = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert {(t["input_length"], t["output_length"]) for t in trace} == {(2048, 128)}
    assert len(trace) == 50 * 8 + 2 * 8                                   # 50 per slot, and the warm-up
    w = config["engine"]["workers"]["aggregated"]
    assert "timing" not in w                                              # bf16 weights and KV
    cfg = parse_scenario(data).scheduler_config
    assert w["scheduler"] == {"max_batched_tokens": cfg.max_num_batched_tokens, "max_sequences": cfg.max_num_seqs}


def test_a_models_own_inferencemax_script_overrides_the_generic_recipe():
    def settings(model_path, quant, system, conc=16):
        case = sc.usable(row(model_path=model_path, gemm_quant_mode=quant, system=system, batch_size=str(conc)))
        data = sc.scenario_data(case, protocol="auto")
        return (data["deployment"].get("kv_dtype"), data["scheduler"],
                data.get("cost_model", {}).get("overheads", {}))
    # the generic recipe: $CONC sequences, budget 8192, no prefix caching, fp8 KV on B200 only
    kv, sched, ovh = settings("meta-llama/Llama-3.1-70B", "fp8", "b200_sxm")
    assert (kv, sched, ovh) == ("fp8", {"max_num_seqs": 16, "max_num_batched_tokens": 8192,
                                        "enable_prefix_caching": False}, {})
    # 70b_fp8_h200_slurm.sh asks for fp8 KV on Hopper as well
    assert settings("meta-llama/Llama-3.1-70B", "fp8", "h200_sxm")[0] == "fp8"
    # gpt-oss: CUDA graphs up to 2048 tokens on every GPU, in the kernel cost model's overheads
    kv, sched, ovh = settings("openai/gpt-oss-120b", "nvfp4", "b200_sxm")
    assert (kv, sched["max_num_seqs"], ovh) == ("fp8", 512, {"cudagraph_max_tokens": 2048})
    # gptoss_fp4_b200.sh's VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1: the MXFP8-activation kernel
    oss = sc.scenario_data(sc.usable(row(model_path="openai/gpt-oss-120b", gemm_quant_mode="nvfp4")), protocol="auto")
    assert oss["cost_model"]["moe_activations"] == "mxfp8"
    assert parse_scenario(oss).cost_model.base.moe_activations == "mxfp8"
    hopper = sc.scenario_data(sc.usable(row(model_path="openai/gpt-oss-120b", gemm_quant_mode="nvfp4",
                                            system="h200_sxm")), protocol="auto")
    assert "moe_activations" not in hopper["cost_model"]
    kv, sched, ovh = settings("openai/gpt-oss-120b", "nvfp4", "h100_sxm")
    assert (kv, sched["max_num_seqs"], ovh) == (None, 16, {"cudagraph_max_tokens": 2048})
    scenario = parse_scenario(sc.scenario_data(sc.usable(row(model_path="openai/gpt-oss-120b",
                                                             gemm_quant_mode="nvfp4", tp_size="2")),
                                               protocol="auto"))
    assert scenario.cost_model.base.ovh.cudagraph_max_tokens == 2048
    # Kimi-K2.5 on B200: vLLM's defaults (the checkpoint's KV dtype, prefix caching on)
    kv, sched, _ = settings("moonshotai/Kimi-K2.5", "int4_wo", "b200_sxm")
    assert kv is None and sched["enable_prefix_caching"] is True and sched["max_num_seqs"] == 1024


def test_a_dense_data_parallel_row_is_its_engines_side_by_side():
    """Two engines each given half the client's requests decode as one engine at half the
    concurrency: the same TPOT. (TTFT is not compared: the two engines' requests share one
    client and API server, whose first wave is twice as large.)"""
    small = dict(model_path="meta-llama/Llama-3.1-8B", isl="256", osl="64", tp_size="1")
    two = sc.simulate(sc.usable(row(**small, attention_dp_size="2", batch_size="8")), protocol="auto")
    one = sc.simulate(sc.usable(row(**small, batch_size="8")), protocol="auto")
    assert two["tpot_ms"] == pytest.approx(one["tpot_ms"], rel=0.05)
    # and not as one engine at the full concurrency, which decodes slower
    full = sc.simulate(sc.usable(row(**small, batch_size="16")), protocol="auto")
    assert full["tpot_ms"] > 1.1 * two["tpot_ms"]


def test_minimax_rows_of_vllm_0_17_run_the_script_of_their_image():
    """minimaxm2.5_fp8_b200.sh before InferenceX#947 (v0.17.0 -> v0.19.0) turned FlashInfer's and
    DeepGEMM's MoE off (vLLM's Triton fused MoE), passed --enable-expert-parallel on every row and
    left the rest to vLLM's defaults (the checkpoint's KV dtype, budget 8192, 1024 sequences) at
    memory utilisation 0.95; rows of v0.19.0 and of nightly builds run #947's script: fp8 KV, a
    budget of twice the ISL, CUDA graphs up to 2048 tokens, blocks of 32, 1024 sequences; the B300
    script is the same, and so is its image's release for rows that name none."""
    def data(version, model="MiniMaxAI/MiniMax-M2.5", quant="fp8", system="b200_sxm", isl="1024"):
        r = row(model_path=model, gemm_quant_mode=quant, tp_size="2", backend_version=version, system=system,
                isl=isl)
        return sc.scenario_data(sc.usable(r), protocol="auto")
    old = data("0.17.0")
    assert old["cost_model"]["moe_backend"] == "triton" and old["deployment"]["expert_parallel"] is True
    assert "kv_dtype" not in old["deployment"] and old["deployment"]["gpu_memory_utilization"] == 0.95
    assert old["scheduler"]["max_num_batched_tokens"] == 8192 and old["scheduler"]["max_num_seqs"] == 1024
    assert old["scheduler"]["block_size"] == 32
    assert "overheads" not in old["cost_model"]
    k = parse_scenario(old).cost_model.base
    assert k.moe_backend == "triton" and k.expert_parallel and k.ovh.cudagraph_max_tokens == 512
    for version in ("0.19.0", "nightly-5b8c30d62b754b57", ""):
        new = data(version)
        assert "moe_backend" not in new.get("cost_model", {}) and "expert_parallel" not in new["deployment"]
        assert new["deployment"]["kv_dtype"] == "fp8" and "gpu_memory_utilization" not in new["deployment"]
        assert new["scheduler"] == {"max_num_seqs": 1024, "max_num_batched_tokens": 2048, "block_size": 32,
                                    "enable_prefix_caching": False}
        assert new["cost_model"]["overheads"] == {"cudagraph_max_tokens": 2048}
    assert data("0.19.0", isl="8192")["scheduler"]["max_num_batched_tokens"] == 16384
    # a row that names no release (none, or a nightly build) is priced as the release of #947's image
    for version in ("", "nightly-5b8c30d62b754b57", "0.19.0"):
        assert data(version)["deployment"]["vllm_version"] == "0.19.0"
    assert data("0.17.0")["deployment"]["vllm_version"] == "0.17.0"
    assert data("0.19.0", system="b300_sxm")["scheduler"]["max_num_batched_tokens"] == 2048
    cfg = parse_scenario(data("0.19.0")).scheduler_config
    assert (cfg.max_num_batched_tokens, cfg.block_size, cfg.max_num_seqs) == (2048, 32, 1024)
    assert "moe_backend" not in data("0.17.0", "meta-llama/Llama-3.1-70B", "fp8").get("cost_model", {})


def test_minimax_h200_rows_of_the_ep_flag_bug_serve_with_expert_parallelism():
    """minimaxm2.5_fp8_h200.sh passed --enable-expert-parallel on every row from InferenceX#869
    (2026-03-05) until its v0.20 script: such rows serve with EP whatever EP size they record."""
    def dep(version, measured):
        src = f"source_file=x.csv; model=MiniMax-M2.5; silicon_concurrency=8; measured={measured}T10:00:00Z"
        r = row(model_path="MiniMaxAI/MiniMax-M2.5", system="h200_sxm", tp_size="8", backend_version=version,
                silicon_data_source=src)
        return sc.scenario_data(sc.usable(r), protocol="auto")["deployment"]
    assert dep("0.18.0", "2026-03-27").get("expert_parallel") is True
    assert "expert_parallel" not in dep("0.16.0", "2026-03-02")        # before the flag's script
    assert "expert_parallel" not in dep("0.20.1", "2026-05-20")        # its script fixed


def pools(**kw) -> dict:
    """A disaggregated row: the aggregated columns blank, each pool's own."""
    base = {"mode": "disagg", "tp_size": "", "pp_size": "", "attention_dp_size": "", "batch_size": "",
            "model_path": "deepseek-ai/DeepSeek-V3", "system": "h200_sxm", "backend": "trtllm",
            "prefill_batch_size": "1", "prefill_num_workers": "2", "prefill_tp_size": "8", "prefill_pp_size": "1",
            "prefill_attention_dp_size": "1", "prefill_moe_tp_size": "1", "prefill_moe_ep_size": "8",
            "decode_batch_size": "32", "decode_num_workers": "3", "decode_tp_size": "1", "decode_pp_size": "1",
            "decode_attention_dp_size": "8", "decode_moe_tp_size": "1", "decode_moe_ep_size": "8",
            "silicon_data_source": "db-dump/2026-04-27; config_id=1; silicon_concurrency=768"}
    return row(**{**base, **kw})


def test_a_disaggregated_row_runs_as_its_pools():
    case = sc.usable(pools())
    # the client: decode_batch_size x decode workers x decode DP ranks (32 x 3 x 8), which the
    # source's silicon_concurrency records
    assert case["concurrency"] == 768
    pd = case["pd"]
    assert (pd["prefill_replicas"], pd["prefill_tp"], pd.get("prefill_data_parallel")) == (2, 8, None)
    assert (pd["decode_replicas"], pd["decode_tp"], pd["decode_data_parallel"]) == (3, 1, 8)
    assert pd["prefill_expert_parallel"] and pd["decode_expert_parallel"] and case["pd_workers_recorded"]
    data = sc.scenario_data(case)
    dep = data["deployment"]
    # decode engines run decode_batch_size sequences per rank; the KV moves over the narrower
    # engine's NICs (8 GPUs x 50 GB/s)
    assert dep["pd"]["decode_max_num_seqs"] == 32 and dep["pd"]["link_bandwidth_gb_s"] == 400.0
    assert not any(k.endswith("_batch_size") for k in dep["pd"])
    assert data["workload"]["benchmark"]["concurrency"] == 768
    parsed = parse_scenario(data)
    assert parsed.pd["decode"][0].max_num_seqs == 32
    assert parsed.pd["decode"][1].describe()["data_parallel"] == 8
    assert parsed.pd["prefill"][1].describe()["tp"] == 8
    # a dense model's pool DP is that many more engines
    q = sc.usable(pools(model_path="Qwen/Qwen3-32B", gemm_quant_mode="fp8_block", decode_moe_ep_size="1",
                        prefill_moe_ep_size="1", decode_tp_size="2", decode_attention_dp_size="2"))
    assert (q["pd"]["decode_replicas"], q["pd"]["decode_tp"]) == (6, 1) and "decode_data_parallel" not in q["pd"]
    # without worker counts (InferenceMAX's CSV exports): the recorded concurrency, one engine per pool
    bare = sc.usable(pools(prefill_num_workers="", decode_num_workers="", decode_batch_size="",
                           silicon_data_source="source_file=2026-04-06.csv; silicon_concurrency=60"))
    assert bare["concurrency"] == 60 and not bare["pd_workers_recorded"]
    assert (bare["pd"]["prefill_replicas"], bare["pd"]["decode_replicas"]) == (1, 1)
    assert sc.usable(pools(prefill_pp_size="2")) is None  # pipeline parallel: not modelled


def test_a_disaggregated_gap_analysis_row_runs_aiconfigurators_pool_servers():
    # AIConfigurator's benchmark rules: a prefill worker of prefill_batch_size sequences and a budget
    # of ISL + 1500; its collection rows record no concurrency, and their decode_batch_size is it
    src = "source_file=/x/aic-auto-gap-analysis/data/h100_sxm/sglang/0.5.6/qwen3_32b.csv; measured=2026-01-23"
    case = sc.usable(pools(backend="sglang", system="h100_sxm", model_path="Qwen/Qwen3-32B",
                           gemm_quant_mode="fp8_block", isl="4000", osl="1000", prefill_num_workers="5",
                           prefill_tp_size="1", prefill_moe_ep_size="1", decode_batch_size="48",
                           decode_num_workers="11", decode_tp_size="1", decode_attention_dp_size="1",
                           decode_moe_ep_size="1", silicon_data_source=src))
    assert case["source"] == "gap-analysis" and case["concurrency"] == 48
    data = sc.scenario_data(case, protocol="auto")
    pd = data["deployment"]["pd"]
    assert (pd["prefill_replicas"], pd["decode_replicas"]) == (5, 11)
    assert (pd["prefill_max_num_seqs"], pd["prefill_max_num_batched_tokens"], pd["decode_max_num_seqs"]) == (1, 5500, 48)
    assert data["scheduler"] == {"enable_prefix_caching": False}
    assert data["workload"]["benchmark"]["warmup"] == 2 * 48  # aiperf's warm-up per slot
    parsed = parse_scenario(data)
    assert parsed.pd["prefill"][0].max_num_seqs == 1 and parsed.pd["decode"][0].max_num_seqs == 48
    # a recorded concurrency wins
    rec = sc.usable(pools(backend="sglang", system="h100_sxm", model_path="Qwen/Qwen3-32B", gemm_quant_mode="fp8_block",
                          silicon_data_source=src + "; silicon_concurrency=64", decode_moe_ep_size="1",
                          prefill_moe_ep_size="1", decode_attention_dp_size="1"))
    assert rec["concurrency"] == 64


def test_grace_blackwell_rows_run_on_their_own_tables_within_the_racks_nvlink():
    # GB200's 14 vLLM rows are disaggregated pools of 4 and 16 GPUs: an NVL72 rack keeps a TP group
    # of 16 on NVLink (no link between nodes to declare), timed by GB200's own kernel tables
    case = sc.usable(pools(backend="vllm", system="gb200", model_path="moonshotai/Kimi-K2.5", gemm_quant_mode="nvfp4",
                           prefill_tp_size="4", prefill_moe_ep_size="4", prefill_attention_dp_size="1",
                           decode_tp_size="16", decode_moe_ep_size="16", decode_attention_dp_size="1",
                           decode_batch_size="256", decode_num_workers="1",
                           silicon_data_source="db-dump/2026-04-27; silicon_concurrency=256"))
    assert case["concurrency"] == 256 and case["pd"]["decode_tp"] == 16
    data = sc.scenario_data(case)
    assert "interconnect" not in data["deployment"] and data["deployment"]["device"] == "gb200"
    parsed = parse_scenario(data)
    meta = parsed.pd["decode"][1].describe()
    assert meta["device"] == "gb200" and meta["tp"] == 16
    assert sc.usable(row(system="gb300", tp_size="8"))["system"] == "gb300"
