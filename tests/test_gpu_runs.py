"""Reproducing published vLLM runs: load stages, prompt pools, per-stage metrics, models by their
Hugging Face ids, attention tables for head shapes the measurements lack, A100/L40S tables, the
TP group's per-step cost, and the bench's scenario for a run."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.core.features import BatchFeatures
from sim.kernel_model import KernelCostModel, Overheads, derive_head_table
from sim.metrics import request_table, stage_metrics
from sim.scenario import parse_scenario, run_scenario
from sim.specs import get_device, get_model, kv_cache_blocks
from sim.workload import WorkloadError, build_workload

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_constant_load_stages_send_exactly_rate_x_duration_back_to_back():
    spec = {"arrival": {"type": "stages", "stages": [{"rate": 5, "duration_s": 10}, {"rate": 8, "duration_s": 5}],
                        "gap_s": 2.0},
            "prompt_len": {"type": "fixed", "value": 100}, "output_len": {"type": "fixed", "value": 10}}
    w = build_workload(spec, seed=3)
    assert len(w) == 50 + 40
    s0, s1 = w.stages
    a = w.arrival_s
    assert (np.diff(a) >= 0).all() and a[0] == 0.0
    # inference-perf's constant load: the stage's gaps are rescaled to sum to its duration
    assert a[49] == pytest.approx(s0["end_s"]) and a[0] == s0["start_s"]
    assert s1["start_s"] - s0["end_s"] >= 2.0 and a[50] == pytest.approx(s1["start_s"])
    assert s1["end_s"] - s0["end_s"] - 2.0 == pytest.approx(5.0)  # its gaps sum to its duration
    assert (s0["requests"], s1["requests"]) == (50, 40)
    with pytest.raises(WorkloadError, match="workload.num_requests=10: the stages send 90"):
        build_workload({**spec, "num_requests": 10}, seed=0)
    with pytest.raises(WorkloadError, match=r"stages\[0\].rate"):
        build_workload({**spec, "arrival": {"type": "stages", "stages": [{"rate": -1, "duration_s": 1}]}}, seed=0)


def test_a_prompt_pool_is_reused_in_turn_and_hits_the_prefix_cache():
    spec = {"num_requests": 30, "arrival": {"type": "poisson", "rate": 2},
            "prompt_len": {"type": "fixed", "value": 80}, "output_len": {"type": "fixed", "value": 4},
            "prompt_pool": {"num_prompts": 10, "num_prefixes": 2, "prefix_len": 32}}
    w = build_workload(spec, seed=1)
    ids = [w[i].token_ids() for i in range(30)]
    for i in range(30):
        assert ids[i] == ids[i % 10] and len(ids[i]) == 80
    assert len({tuple(x) for x in ids}) == 10              # ten distinct prompts
    assert len({tuple(x[:32]) for x in ids}) == 2           # two system prompts
    assert all(ids[i][32:] != ids[j][32:] for i in range(10) for j in range(i))
    # Through the simulator, every repeat hits the cache for all its full blocks.
    data = {"deployment": {"model": "llama-3.1-8b", "num_gpu_blocks": 500}, "cost_model": {"type": "analytic"},
            "workload": spec}
    res = run_scenario(parse_scenario(data))
    t = res.request_table
    hits = np.asarray(t["num_cached_tokens"])
    assert (hits[10:] == 64).all()  # 80 tokens: four full blocks of 16 hit, the last block is recomputed


def test_stage_metrics_by_hand():
    from engine.core.records import RequestRecord
    recs = []
    for i, (arr, first, fin, n) in enumerate([(0.0, 0.1, 1.1, 11), (1.0, 1.2, 3.2, 21), (5.0, 5.3, 6.3, 11)]):
        r = RequestRecord(f"r{i}", arr, 10)
        r.first_scheduled_s, r.first_token_s, r.last_token_s, r.finish_s = arr, first, fin, fin
        r.num_output_tokens, r.finish_reason = n, "length"
        recs.append(r)
    t = request_table(recs)
    out = stage_metrics(t, [{"rate": 1, "duration_s": 2, "start_s": 0.0, "end_s": 1.0},
                            {"rate": 1, "duration_s": 1, "start_s": 5.0, "end_s": 5.0}])
    s0, s1, whole = out
    assert s0["completed"] == 2 and s0["ttft_s"]["mean"] == pytest.approx(0.15)
    assert s0["e2e_s"]["mean"] == pytest.approx((1.1 + 2.2) / 2)
    # ITL as load tests report it: (E2E mean - TTFT mean) / (mean output - 1)
    assert s0["itl_s"]["mean"] == pytest.approx((1.65 - 0.15) / (16 - 1))
    assert s1["completed"] == 1 and whole["stage"] == "all" and whole["completed"] == 3


@pytest.mark.parametrize("hf_id, name, dtype", [
    ("mistralai/Mistral-Nemo-Instruct-2407", "mistral-nemo", "bfloat16"), ("01-ai/Yi-34B", "yi-34b", "bfloat16"),
    ("meta-llama/Llama-2-7b-hf", "llama-2-7b", "bfloat16"), ("meta-llama/Llama-2-70b-hf", "llama-2-70b", "bfloat16"),
    ("codellama/CodeLlama-34b-Instruct-hf", "codellama-34b", "bfloat16"), ("Qwen/Qwen3-14B", "qwen3-14b", "bfloat16"),
    ("nvidia/Llama-3.1-8B-Instruct-FP8", "llama-3.1-8b", "fp8")])
def test_models_by_hugging_face_id(hf_id, name, dtype):
    m = get_model(hf_id)
    assert (m.name, m.weight_dtype) == (name, dtype)


@pytest.mark.parametrize("hf_id, name, params_b", [
    # parameter counts as their model cards state them (Qwen2.5: 14.7B and 32.5B; QwQ-32B is
    # Qwen2.5-32B's architecture; Qwen3: 0.6B, 1.7B and 4.0B, tied embeddings; Mistral-7B-v0.3: 7.25B;
    # DeepSeek-R1's distillations: their base's, 70.6B and 32.8B)
    ("Qwen/Qwen2.5-14B-Instruct", "qwen2.5-14b", 14.7), ("Qwen/Qwen2.5-32B-Instruct", "qwen2.5-32b", 32.5),
    ("Qwen/QwQ-32B", "qwen2.5-32b", 32.5), ("Qwen/Qwen3-0.6B", "qwen3-0.6b", 0.6), ("Qwen/Qwen3-1.7B", "qwen3-1.7b", 1.7),
    ("Qwen/Qwen3-4B", "qwen3-4b", 4.0), ("Qwen/Qwen3-4B-Instruct-2507", "qwen3-4b", 4.0),
    ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-7b", 7.25),
    ("deepseek-ai/DeepSeek-R1-Distill-Llama-70B", "llama-3.1-70b", 70.6),
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "qwen2.5-32b", 32.8),
    # their model cards: Mistral-Small-24B-Instruct-2501 23.6B, Phi-4 14.7B
    ("mistralai/Mistral-Small-24B-Instruct-2501", "mistral-small-24b", 23.6), ("microsoft/phi-4", "phi-4", 14.7)])
def test_popular_dense_models_load_by_hugging_face_id_with_their_published_size(hf_id, name, params_b):
    m = get_model(hf_id)
    assert m.name == name and m.weight_dtype == "bfloat16"
    assert m.weight_bytes / 2 / 1e9 == pytest.approx(params_b, rel=0.03)


def test_checkpoints_read_as_a_catalog_architecture_keep_their_own_context_and_sampling():
    # Qwen3's 2507 releases and Qwen3-Coder: 262,144 positions (Qwen3-4B itself: 40,960);
    # DeepSeek-R1's distillations: 131,072 and top-p sampling, whatever their base's
    assert get_model("Qwen/Qwen3-4B").max_position_embeddings == 40960
    assert get_model("Qwen/Qwen3-4B-Instruct-2507").max_position_embeddings == 262144
    assert get_model("Qwen/Qwen3-Coder-30B-A3B-Instruct").max_position_embeddings == 262144
    r1 = get_model("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B")
    assert (r1.max_position_embeddings, r1.generation_filter) == (131072, "top_p")
    assert get_model("Qwen/QwQ-32B").generation_filter == "top_k_top_p"
    # with a dtype suffix too: Qwen's own fp8 checkpoints are 128x128 blocks (their config.json's
    # weight_block_size), NVIDIA's per tensor
    assert get_model("Qwen/Qwen3-30B-A3B-Instruct-2507-FP8").weight_dtype == "fp8_block"
    assert get_model("nvidia/Llama-3.1-8B-Instruct-FP8").weight_dtype == "fp8"
    assert get_model("qwen3_30b_a3b_instruct_2507").max_position_embeddings == 262144  # underscores as dashes


def test_an_unknown_hugging_face_id_is_refused_naming_it():
    with pytest.raises(ValueError, match="some-org/NoSuchModel-9B"):
        get_model("some-org/NoSuchModel-9B")


def _power_table(q: int, kv: int, exp_q: float, exp_kv: float) -> dict:
    bs, ss = [1, 4, 16], [128, 1024]
    return {"values": [bs, ss], "us": [[b * s * q ** exp_q * kv ** exp_kv * 1e-3 for s in ss] for b in bs]}


def test_a_missing_head_shape_is_interpolated_between_measured_neighbours():
    """Tables that follow a power law in the heads are reproduced exactly by geometric
    interpolation: in query heads at the same KV heads, in KV heads at the same group size."""
    tabs = {f"bf16/{q}/{kv}/128": _power_table(q, kv, 0.5, 1.0) for q, kv in ((24, 4), (32, 4), (24, 24), (48, 48))}
    values, us, note = derive_head_table(tabs, "bf16", 28, 4, 128, "generation")
    assert "query heads between bf16/24/4/128 and bf16/32/4/128" in note
    want = _power_table(28, 4, 0.5, 1.0)["us"]
    assert np.allclose(us, want, rtol=1e-9)
    values, us, note = derive_head_table(tabs, "bf16", 32, 32, 128, "context")
    assert "KV heads between bf16/24/24/128 and bf16/48/48/128" in note
    assert np.allclose(us, _power_table(32, 32, 0.5, 1.0)["us"], rtol=1e-9)
    # Nothing to bracket: the nearest shape, scaled by KV heads (decode) or query heads (prefill).
    values, us, note = derive_head_table({"bf16/32/8/128": _power_table(32, 8, 1, 1)}, "bf16", 32, 32, 128, "generation")
    assert note == "bf16/32/8/128 scaled by 4" and np.allclose(us, np.array(_power_table(32, 8, 1, 1)["us"]) * 4)
    assert derive_head_table(tabs, "bf16", 32, 8, 64, "generation") is None  # no head_dim 64 at all


def test_decode_attention_of_a_missing_head_shape_is_read_at_the_same_batch_x_kv_heads():
    """Decode attention's work (and its kernels' parallelism) is batch x KV heads at a given
    number of queries per KV head: tables that depend on that product alone, however non-linearly,
    give the missing shape exactly; interpolating in KV heads at the same batch would not. (KV
    heads 8-128 read 32's batches on their own power-of-two batch axes: no interpolation error.)"""
    def f(n, s):  # microseconds for n = batch x KV heads: a launch floor, then a rise
        return 5.0 + (n * s) ** 0.8 * 1e-2
    bs, ss = [2 ** i for i in range(12)], [128, 1024, 8192]
    tabs = {f"bf16/{h}/{h}/128": {"values": [bs, ss], "us": [[f(b * h, s) for s in ss] for b in bs]}
            for h in (8, 16, 64, 128)}
    values, us, note = derive_head_table(tabs, "bf16", 32, 32, 128, "generation")
    assert note.startswith("mean of 4 tables of 1 queries per KV head")
    for i, b in enumerate(values[0]):  # each batch from the tables whose axis holds b x 32 / h
        for j, s in enumerate(values[1]):
            assert us[i][j] == pytest.approx(f(b * 32, s), rel=1e-9)
    w = np.log(32 / 16) / np.log(64 / 16)  # what interpolating between 16 and 64 KV heads gives
    assert not all(f(b * 16, s) ** (1 - w) * f(b * 64, s) ** w == pytest.approx(f(b * 32, s), rel=0.01)
                   for b in bs for s in ss)


def test_llama2_decode_attention_comes_from_measured_mha_tables_not_the_roofline():
    k = KernelCostModel("llama-2-7b", "h100-sxm", 1)
    assert "bf16/24/24/128" in k.coverage["generation_attention"]
    assert "bf16/48/48/128" in k.coverage["generation_attention"]
    k.gpu_time(BatchFeatures(num_reqs=32, num_decode_reqs=32, decode_context_tokens=32 * 700))
    assert "generation_attention" not in k.fallbacks


@pytest.mark.parametrize("device, tables", [("a100-80g", "a100_sxm"), ("l40s", "l40s")])
def test_a100_and_l40s_are_timed_from_measured_kernel_tables(device, tables):
    d = get_device(device)
    assert d.kernel_tables == tables
    sc = parse_scenario({"deployment": {"model": "llama-3.1-8b", "device": device},
                         "workload": {"num_requests": 1, "arrival": {"type": "poisson", "rate": 1},
                                      "prompt_len": {"type": "fixed", "value": 10},
                                      "output_len": {"type": "fixed", "value": 2}}})
    assert sc.cost_model.kind == "kernels"
    k = KernelCostModel("llama-3.1-8b", device, 1)
    assert k.coverage["gemm"] and k.coverage["generation_attention"] == "bf16/32/8/128"
    # slower than an H100 on the same step
    f = BatchFeatures(num_reqs=16, num_decode_reqs=16, decode_context_tokens=16 * 1000)
    assert k.gpu_time(f) > KernelCostModel("llama-3.1-8b", "h100-sxm", 1).gpu_time(f)


def test_the_tp_group_pays_its_coordination_once_per_step():
    f = BatchFeatures(num_reqs=8, num_decode_reqs=8, decode_context_tokens=8000)
    plain = KernelCostModel("llama-3.1-70b", "h100-sxm", 4, Overheads(tp_step_s=0.0))
    paid = KernelCostModel("llama-3.1-70b", "h100-sxm", 4, Overheads(tp_step_s=5e-4))
    assert paid.gpu_time(f) == pytest.approx(plain.gpu_time(f) + 3 * 5e-4)
    assert paid.decode_gpu_time(8, 8000) == pytest.approx(paid.gpu_time(f))
    assert sum(paid.breakdown(f).values()) == pytest.approx(paid.gpu_time(f)) and paid.breakdown(f)["tp_step"] == 1.5e-3
    slow = KernelCostModel("llama-3.1-70b", "h100-sxm", 4, Overheads(tp_step_s=0.0, serving_slowdown=1.1))
    assert slow.gpu_time(f) == pytest.approx(1.1 * plain.gpu_time(f))
    one = KernelCostModel("llama-3.1-8b", "h100-sxm", 1, Overheads(tp_step_s=5e-4))
    assert one.gpu_time(f) == KernelCostModel("llama-3.1-8b", "h100-sxm", 1).gpu_time(f)  # TP 1: nothing to pay
    assert KernelCostModel("llama-3.1-70b", "h100-sxm", 4).gpu_time(f) == plain.gpu_time(f)  # stock vLLM: 0


def _row(**kw):
    row = {"exp_id": "t1", "model": "meta-llama/Llama-2-7b-hf", "hardware": "H100", "tp": "1", "precision": "FP16",
           "max_num_batched_tokens": "2048", "max_num_seqs": "128", "max_model_len": "4096",
           "gpu_memory_utilization": "0.9", "kv_block_size": "16", "gpu_kv_blocks_total": "7462",
           "workload": "general", "s0_rate_rps": "2", "s0_duration_s": "20", "s1_rate_rps": "4",
           "s1_duration_s": "10", "system_prompt_len_tok": "100", "nominal_input_len_tok": "547",
           "output_len_tok": "248", "all_measured_input_len_mean": "575.45",
           "all_measured_output_len_mean": "209.0", "all_ttft_mean_ms": "30", "all_e2e_mean_ms": "2000",
           "all_itl_mean_ms": "9.5", "observability_build": "True"}
    row.update(kw)
    return row


def test_a_published_run_becomes_a_scenario_that_does_what_it_did():
    from gpu_runs import scenario_for
    data = scenario_for(_row())
    sc = parse_scenario(data)
    assert sc.scheduler_config.num_gpu_blocks == 7462 and sc.scheduler_config.max_num_seqs == 128
    assert sc.deployment["model"] == "llama-2-7b" and sc.deployment["device"] == "h100-sxm"
    w = sc.workload
    assert len(w) == 2 * 20 + 4 * 10 and [s["requests"] for s in w.stages] == [40, 40]
    assert (w.prompt_len == 575).all() and (w.output_len == 248).all()  # the measured input, max_tokens out
    assert w.client.http_s > 0 and w.client.output_s > 0  # the streaming HTTP path
    assert data["cost_model"]["overheads"]["tp_step_s"] > 0  # the runs' traced server build
    for flag, image, paid in (("False", "", False), ("", "vllm/vllm-openai:v0.15.1", False),
                              ("", "ghcr.io/inference-sim/vllm:0.6.8", True), ("True", "", True),
                              ("", "", True)):  # neither named: the study's tracing build
        got = scenario_for(_row(observability_build=flag, vllm_image=image))["cost_model"]["overheads"]
        assert (got["tp_step_s"] > 0) is paid  # a stock vLLM image pays no tracing coordination
    a100 = parse_scenario(scenario_for(_row(hardware="A100", gpu_kv_blocks_total="")))
    assert a100.deployment["device"] == "a100-80g" and "vllm_version" not in a100.deployment
    # Without logged blocks the pool is sized as the run's vLLM release profiles memory: the
    # release its notes name (a fork's own version is not vLLM's).
    fork = {"vllm_version": "inference-sim fork 0.6.8 (base not stated)",
            "vllm_image": "ghcr.io/inference-sim/vllm:0.6.8; sim-to-real captions say vLLM v0.15.1 for all runs"}
    for notes in (fork, {"vllm_version": "0.15.1 (per results/figure_captions.md)"}):
        run = parse_scenario(scenario_for(_row(hardware="A100", gpu_kv_blocks_total="", **notes)))
        assert run.deployment["vllm_version"] == "0.15.1"
        assert run.scheduler_config.num_gpu_blocks == kv_cache_blocks(
            get_model("llama-2-7b"), get_device("a100-80g"), 1, 16, 0.9, max_num_batched_tokens=2048,
            max_num_seqs=128, vllm_version="0.15.1") != a100.scheduler_config.num_gpu_blocks
    with pytest.raises(ValueError, match="hardware='TPU'"):
        scenario_for(_row(hardware="TPU"))


@pytest.mark.parametrize("hardware,product,device", [
    ("A100-SXM", "", "a100-80g"),                      # the hardware column as other studies write it
    ("A100", "NVIDIA A100-SXM4-40GB", "a100-40g"),     # nvidia-smi's product tells 40 from 80 GB
    ("", "NVIDIA A100-SXM4-80GB", "a100-80g"),
    ("L40S", "NVIDIA L40S", "l40s"),
    ("H100", "NVIDIA H100 80GB HBM3 (SXM)", "h100-sxm"),
    ("A100 80GB", "NVIDIA A100 80GB PCIe", "a100-80g"),  # a PCIe card sim.specs lacks: its SXM part
    ("A100", "NVIDIA A100-PCIE-40GB", "a100-40g"),        # ... of its memory size
    ("H100-PCIe", "", "h100-sxm"), ("L40S_48GB", "", "l40s"),  # a hardware column alone, family first
    ("A100-PCIe-40GB", "", "a100-40g"),                        # ... and the memory size it names
])
def test_a_runs_gpu_is_read_from_its_hardware_or_product_name(hardware, product, device):
    from gpu_runs import scenario_for
    data = scenario_for(_row(hardware=hardware, gpu_product=product, gpu_kv_blocks_total=""))
    assert parse_scenario(data).deployment["device"] == device


def test_the_bench_reports_the_runs_itl_from_the_clients_token_count():
    """The runs' ITL mean is (E2E - TTFT) / (tokens the client counted - 1); the engine generates
    max_tokens. The bench computes the prediction the same way."""
    from gpu_runs import simulate
    res = simulate((_row(s0_rate_rps="1", s0_duration_s="8", s1_rate_rps="", s1_duration_s=""), [0], None, None))
    p = res["predicted_s"]
    assert p["itl_mean"] == pytest.approx((p["e2e_mean"] - p["ttft_mean"]) / (209.0 - 1))
    assert res["rel_error"]["ttft_mean"] == pytest.approx(p["ttft_mean"] / 0.030 - 1)
    assert math.isfinite(res["rel_error"]["e2e_mean"]) and res["stages"][0]["rate"] == 1
    # A run that logged no count: the one its published means imply by that definition,
    # (2000 - 30) / 9.5 + 1 tokens, so the ITL is compared as the run computed it.
    from gpu_runs import client_tokens
    unlogged = _row(s0_rate_rps="1", s0_duration_s="8", s1_rate_rps="", s1_duration_s="",
                    all_measured_output_len_mean="")
    assert client_tokens(unlogged) == pytest.approx((2000 - 30) / 9.5 + 1)
    p = simulate((unlogged, [0], None, None))["predicted_s"]
    assert p["itl_mean"] == pytest.approx((p["e2e_mean"] - p["ttft_mean"]) / ((2000 - 30) / 9.5))
    assert client_tokens(_row(all_measured_output_len_mean="", all_itl_mean_ms="")) is None


def test_a_runs_data_and_expert_parallel_columns_reach_its_deployment():
    """vLLM's --data-parallel-size: data-parallel attention for a mixture of experts, replicas for
    a dense model; --enable-expert-parallel: deployment.expert_parallel."""
    from gpu_runs import scenario_for
    moe = parse_scenario(scenario_for(_row(model="mistralai/Mixtral-8x7B-Instruct-v0.1", tp="2", dp="2",
                                           expert_parallel="True", gpu_kv_blocks_total="")))
    assert moe.deployment["data_parallel"] == 2 and moe.deployment["expert_parallel"] is True
    assert moe.replicas == 1
    dense = parse_scenario(scenario_for(_row(dp="2", expert_parallel="False")))
    assert dense.replicas == 2 and "data_parallel" not in dense.deployment
    assert "expert_parallel" not in dense.deployment
    one = scenario_for(_row(model="mistralai/Mixtral-8x7B-Instruct-v0.1", tp="2", dp="1", expert_parallel="False"))
    assert "data_parallel" not in one["deployment"] and "expert_parallel" not in one["deployment"]
    with pytest.raises(ValueError, match="dp='2.5'"):
        scenario_for(_row(dp="2.5"))
    with pytest.raises(ValueError, match="expert_parallel='on'"):
        scenario_for(_row(expert_parallel="on"))
