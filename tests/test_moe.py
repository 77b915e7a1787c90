"""Mixture-of-experts and latent-attention models: read from their config.json (or the catalog),
sized by hand calculation, refused when not understood, and timed by the experts a step touches."""
import dataclasses
import warnings

import numpy as np

import pytest

from engine.core.features import BatchFeatures
from sim.cost_model import AnalyticCostModel, Efficiency
from sim.kernel_model import KernelCostModel, Overheads, load_tables
from sim.specs import GiB, ModelSpec, get_device, get_model, hf_config_fields

# The fields of the public config.json files that the reader needs (values as published).
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "decoder_sparse_step": 1,
                 "head_dim": 128, "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
                 "mlp_only_layers": [], "moe_intermediate_size": 768, "num_attention_heads": 32, "num_experts": 128,
                 "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
                 "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936}
GPT_OSS_120B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "experts_per_token": 4,
                "head_dim": 64, "hidden_size": 2880, "intermediate_size": 2880,
                "layer_types": ["sliding_attention", "full_attention"] * 18, "num_attention_heads": 64,
                "num_experts_per_tok": 4, "num_hidden_layers": 36, "num_key_value_heads": 8, "num_local_experts": 128,
                "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
                "sliding_window": 128, "tie_word_embeddings": False, "vocab_size": 201088}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "first_k_dense_replace": 3,
               "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512, "moe_intermediate_size": 2048,
               "moe_layer_freq": 1, "n_routed_experts": 256, "n_shared_experts": 1, "num_attention_heads": 128,
               "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "q_lora_rank": 1536,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "torch_dtype": "bfloat16",
               "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
               "tie_word_embeddings": False, "vocab_size": 129280}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                "intermediate_size": 14336, "num_attention_heads": 32, "num_experts_per_tok": 2,
                "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "torch_dtype": "bfloat16",
                "vocab_size": 32000}


def _table_reading(tab: dict) -> dict:
    """A one-axis MoE table as the kernel model's Grid reads it at its measured points: each entry
    lowered to the least time measured at or above it (Grid's monotone suffix minimum)."""
    return dict(zip(tab["values"][0], np.minimum.accumulate(np.array(tab["us"])[::-1])[::-1]))


def test_qwen3_30b_a3b_weights_and_kv_by_hand():
    m = ModelSpec.from_hf_config(QWEN3_30B_A3B)
    assert m.weight_bytes == get_model("Qwen/Qwen3-30B-A3B-Instruct-2507").weight_bytes
    L, h = 48, 2048
    attn = h * 32 * 128 + 2 * h * 4 * 128 + 32 * 128 * h
    experts = 128 * 3 * h * 768
    router = h * 128
    norms = (2 * L + 1) * h
    emb = 2 * 151936 * h
    params = L * (attn + experts + router) + norms + emb
    assert m.weight_bytes == 2 * params                      # bf16: 61.1 GB ("about 61 GB")
    assert abs(m.num_params - params) <= L * 2 * h            # num_params also counts the two norms per layer
    assert 30.4e9 < params < 30.6e9                          # the published 30.5B
    assert m.kv_bytes_per_token == 2 * L * 4 * 128 * 2
    # TP2: every expert's slice, KV heads halved
    assert m.weight_bytes_per_gpu(2) == 2 * (L * (attn // 2 + experts // 2 + router) + norms + emb // 2)
    assert m.kv_bytes_per_token_per_gpu(2) == 2 * L * 2 * 128 * 2
    # fp8 in 128x128 blocks: linear layers and experts 1 byte, router, norms and embeddings 2
    q = ModelSpec.from_hf_config({**QWEN3_30B_A3B, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert q.weight_dtype == "fp8_block"
    assert q.weight_bytes == L * (attn + experts) + 2 * (L * router + norms + emb)


def test_gpt_oss_120b_weights_and_kv_by_hand():
    m = ModelSpec.from_hf_config(GPT_OSS_120B)
    assert (m.expert_dtype, m.attn_dtype, m.num_sliding_layers, m.sliding_window) == ("mxfp4", "bfloat16", 18, 128)
    L, h = 36, 2880
    attn = h * 64 * 64 + 2 * h * 8 * 64 + 64 * 64 * h
    experts = 128 * 3 * h * 2880
    mxfp4 = 0.5 + 1 / 32                                    # 4-bit values, an 8-bit scale per 32
    other = L * (attn + h * 128) + (2 * L + 1) * h + 2 * 201088 * h
    assert m.weight_bytes == int(L * experts * mxfp4 + 2 * other)
    assert 116e9 < m.num_params < 118e9                      # the published 117B (116.8B)
    assert 60e9 < m.weight_bytes < 66e9                      # the checkpoint: about 65 GB on disk
    # KV per token: the 18 full-attention layers; the sliding ones hold a window per request
    assert m.kv_bytes_per_token == 2 * 18 * 8 * 64 * 2
    assert m.sliding_kv_bytes_per_request_per_gpu(1, 16) == 2 * 18 * 8 * 64 * 2 * (128 + 16)


def test_deepseek_v3_weights_and_latent_kv_by_hand():
    m = ModelSpec.from_hf_config(DEEPSEEK_V3)
    assert m.is_mla and m.num_moe_layers == 58 and m.weight_dtype == "fp8_block"
    L, h, H = 61, 7168, 128
    attn = (h * 1536 + 1536 * H * 192 + h * (512 + 64) + 512 * H * (128 + 128) + H * 128 * h)
    dense_mlp = 3 * 3 * h * 18432                            # first_k_dense_replace = 3 layers
    shared = 58 * 3 * h * 2048
    experts = 58 * 256 * 3 * h * 2048
    router = 58 * h * 256
    norms = (2 * L + 1) * h + L * (512 + 1536)
    emb = 2 * 129280 * h
    assert m.weight_bytes == L * attn + dense_mlp + shared + experts + 2 * (router + norms + emb)
    assert 670e9 < m.num_params < 672e9                      # 671B (the MTP module is not served)
    # MLA: one latent of kv_lora_rank + qk_rope_head_dim per layer, the same on every TP rank
    assert m.kv_bytes_per_token == m.kv_bytes_per_token_per_gpu(8) == L * (512 + 64) * 2


def test_kimi_k2_5_int4_experts_in_groups_of_32_by_hand():
    # Kimi-K2.5 / K2-Thinking ship their routed experts as compressed-tensors int4 in groups of 32
    # (a 16-bit scale each) and everything else in bf16, which their ignore list names
    cfg = {**DEEPSEEK_V3, "model_type": "kimi_k2", "n_routed_experts": 384, "first_k_dense_replace": 1,
           "num_attention_heads": 64, "num_key_value_heads": 64, "vocab_size": 163840,
           "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
               "weights": {"num_bits": 4, "type": "int", "group_size": 32, "strategy": "group"}}},
               "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                          "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}}
    m = ModelSpec.from_hf_config(cfg)
    assert (m.weight_dtype, m.expert_dtype) == ("bfloat16", "int4_g32")
    assert m.weight_bytes == get_model("moonshotai/Kimi-K2.5").weight_bytes
    L, h, H = 61, 7168, 64
    attn = (h * 1536 + 1536 * H * 192 + h * (512 + 64) + 512 * H * (128 + 128) + H * 128 * h)
    experts = 60 * 384 * 3 * h * 2048
    other = L * attn + 3 * h * 18432 + 60 * 3 * h * 2048 + 60 * h * 384 + (2 * L + 1) * h + L * (512 + 1536) \
        + 2 * 163840 * h
    assert m.weight_bytes == int(experts * (0.5 + 2 / 32) + 2 * other)
    assert 590e9 < m.weight_bytes < 600e9                    # the published checkpoint: about 594 GB
    # groups of 128 (the other int4 checkpoints) carry a quarter of the scales
    g128 = {**cfg, "quantization_config": {**cfg["quantization_config"], "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int", "group_size": 128}}}}}
    assert ModelSpec.from_hf_config(g128).expert_dtype == "int4"
    # without an ignore list that keeps the attention in 16 bits, every linear layer is 4-bit
    every = {**cfg, "quantization_config": {k: v for k, v in cfg["quantization_config"].items() if k != "ignore"}}
    assert (ModelSpec.from_hf_config(every).weight_dtype, ModelSpec.from_hf_config(every).expert_dtype) == ("int4_g32", "")
    # ... or where its groups target the experts alone
    targeted = {**cfg, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["re:.*mlp.experts.*"], "weights": {"num_bits": 4, "type": "int", "group_size": 32}}}}}
    m2 = ModelSpec.from_hf_config(targeted)
    assert (m2.weight_dtype, m2.expert_dtype) == ("bfloat16", "int4_g32")


@pytest.mark.parametrize("name, family", [
    ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"), ("Qwen/Qwen3-235B-A22B-FP8", "qwen3-235b-a22b"),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"), ("mistralai/Mixtral-8x22B-v0.1", "mixtral-8x22b"),
    ("openai/gpt-oss-20b", "gpt-oss-20b"), ("openai/gpt-oss-120b", "gpt-oss-120b"),
    ("deepseek-ai/DeepSeek-V3", "deepseek-v3"), ("deepseek-ai/DeepSeek-R1", "deepseek-v3"),
    ("moonshotai/Kimi-K2-Instruct", "kimi-k2"), ("MiniMaxAI/MiniMax-M2", "minimax-m2"),
    ("moonshotai/Kimi-K2.5", "kimi-k2.5"), ("moonshotai/Kimi-K2-Thinking", "kimi-k2.5"),
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "llama-4-scout-17b-16e"),
    ("meta-llama/Llama-4-Maverick-17B-128E-Instruct", "llama-4-maverick-17b-128e"),
    ("meta-llama/Llama-4-Maverick-17B-128E-Instruct-FP8", "llama-4-maverick-17b-128e"),
    # later checkpoints of the same architectures
    ("MiniMaxAI/MiniMax-M2.7", "minimax-m2"), ("MiniMaxAI/MiniMax-M2.1", "minimax-m2"),
    ("deepseek-ai/DeepSeek-V3.1", "deepseek-v3"), ("Qwen/Qwen3-235B-A22B-Thinking-2507-FP8", "qwen3-235b-a22b"),
    ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "qwen3-30b-a3b"), ("Qwen/Qwen3-Coder-480B-A35B-Instruct", "qwen3-coder-480b-a35b"),
    ("Qwen/Qwen3.6-35B-A3B", "qwen3.5-35b-a3b"), ("zai-org/GLM-5.1-FP8", "glm-5"), ("deepseek-ai/DeepSeek-V3.2-Exp", "deepseek-v3.2"),
    ("moonshotai/Kimi-K2.6", "kimi-k2.5"), ("nvidia/Kimi-K2.7-Code-NVFP4", "kimi-k2.5"),
    ("Qwen/Qwen3-VL-30B-A3B-Instruct", "qwen3-vl-30b-a3b"), ("stepfun-ai/Step-3.7-Flash-FP8", "step-3.7-flash"),
    ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8", "nemotron-3-nano-30b-a3b")])
def test_moe_catalog_names(name, family):
    m = get_model(name)
    assert m.name == family and m.is_moe and m.num_experts_per_tok >= 1


@pytest.mark.parametrize("cfg", [QWEN3_30B_A3B, GPT_OSS_120B, DEEPSEEK_V3, MIXTRAL_8X7B])
def test_catalog_matches_the_config(cfg):
    m = ModelSpec.from_hf_config(cfg)
    by_name = {"qwen3_moe": "qwen3-30b-a3b", "gpt_oss": "gpt-oss-120b", "deepseek_v3": "deepseek-v3",
               "mixtral": "mixtral-8x7b"}[cfg["model_type"]]
    c = get_model(by_name)
    for f in ("num_layers", "hidden_size", "num_heads", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "shared_intermediate_size", "num_moe_layers", "kv_lora_rank",
              "num_sliding_layers", "expert_dtype", "weight_dtype"):
        assert getattr(m, f) == getattr(c, f), f
    assert m.weight_bytes == c.weight_bytes and m.kv_bytes_per_token == c.kv_bytes_per_token


def test_qwen3_coder_480b_from_its_config_is_the_catalog_entry_and_its_published_size():
    # Qwen3-Coder-480B-A35B-Instruct's public config.json (the fields the reader takes)
    cfg = {**QWEN3_30B_A3B, "hidden_size": 6144, "num_hidden_layers": 62, "num_attention_heads": 96,
           "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "moe_intermediate_size": 2560,
           "num_experts": 160, "num_experts_per_tok": 8, "max_position_embeddings": 262144, "mlp_only_layers": [],
           "decoder_sparse_step": 1, "tie_word_embeddings": False, "vocab_size": 151936}
    m, c = ModelSpec.from_hf_config(cfg), get_model("qwen3-coder-480b-a35b")
    for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "num_moe_layers", "qk_norm"):
        assert getattr(m, f) == getattr(c, f), f
    assert m.weight_bytes == c.weight_bytes
    assert c.weight_bytes / 2 == pytest.approx(480e9, rel=0.01)                 # 480B parameters
    # 35B active: all but the routed experts, and 8 of each layer's 160 experts
    active = (c.weight_bytes - c.expert_weight_bytes_per_gpu(1)) / 2 + c.expert_weight_bytes_per_gpu(1) / 2 * 8 / 160
    assert active == pytest.approx(35e9, rel=0.03)


def test_what_the_reader_does_not_understand_is_refused_by_field():
    with pytest.raises(ValueError, match="model_type='falcon'"):
        hf_config_fields({**MIXTRAL_8X7B, "model_type": "falcon"})
    with pytest.raises(ValueError, match="num_local_experts=8 in a model_type='gemma3'"):
        hf_config_fields({**MIXTRAL_8X7B, "model_type": "gemma3"})   # a dense family's config with experts
    with pytest.raises(ValueError, match="lacks 'model_type'"):
        hf_config_fields({k: v for k, v in MIXTRAL_8X7B.items() if k != "model_type"})
    with pytest.raises(ValueError, match="num_local_experts=8 in a model_type='llama'"):
        hf_config_fields({**MIXTRAL_8X7B, "model_type": "llama"})   # never timed as dense
    with pytest.raises(ValueError, match="lacks 'moe_intermediate_size'"):
        hf_config_fields({k: v for k, v in QWEN3_30B_A3B.items() if k != "moe_intermediate_size"})
    with pytest.raises(ValueError, match="quant_method='bitsandbytes'"):
        hf_config_fields({**QWEN3_30B_A3B, "quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(ValueError, match=r"quantization_config.bits=3"):
        hf_config_fields({**QWEN3_30B_A3B, "quantization_config": {"quant_method": "awq", "bits": 3,
                                                                   "group_size": 128}})


def test_a_scenario_reads_a_moe_config_json(tmp_path):
    import json

    from sim.scenario import ScenarioError, parse_scenario
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    base = {"workload": {"num_requests": 20, "arrival": {"type": "poisson", "rate": 5.0},
                         "prompt_len": {"type": "fixed", "value": 200}, "output_len": {"type": "fixed", "value": 20}}}
    sc = parse_scenario({**base, "deployment": {"model": "m/config.json", "device": "h100"}}, base_dir=tmp_path)
    assert sc.cost_model.describe()["experts"] == 128
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "model_type": "gemma3"}))
    with pytest.raises(ScenarioError, match="model_type='gemma3'"):
        parse_scenario({**base, "deployment": {"model": "g/config.json", "device": "h100"}}, base_dir=tmp_path)


def test_experts_touched_against_sampled_routing():
    m = get_model("mixtral-8x7b")                            # 8 experts, top-2
    assert m.experts_touched(1) == pytest.approx(2.0)
    assert m.experts_touched(10_000) == pytest.approx(8.0)
    rng = np.random.default_rng(0)
    for T in (2, 3, 5, 12):
        distinct = [len(set(np.concatenate([rng.choice(8, 2, replace=False) for _ in range(T)])))
                    for _ in range(4000)]
        assert m.experts_touched(T) == pytest.approx(np.mean(distinct), rel=0.02)
    assert all(np.diff([m.experts_touched(t) for t in range(1, 64)]) > 0)


def test_analytic_moe_decode_reads_the_touched_experts_by_hand():
    m, d = get_model("qwen3-30b-a3b"), get_device("h100")
    e = Efficiency()
    a = AnalyticCostModel(m, d, 1, e)
    bw = d.mem_bandwidth * e.bandwidth
    dense = m.weight_read_bytes_per_gpu(1) - m.expert_weight_bytes_per_gpu(1)
    one = BatchFeatures(num_reqs=1, num_decode_reqs=1, decode_context_tokens=0)
    # one token: its top-8 of 128 experts in each layer, a sixteenth of the experts' bytes
    want = e.step_overhead_s + e.per_req_overhead_s + dense / bw + m.expert_weight_bytes_per_gpu(1) * 8 / 128 / bw
    assert a.step_time(one) == pytest.approx(want, rel=1e-9)
    # a dense reading of the same model (intermediate 6144, no experts) reads far less than a batch
    big = BatchFeatures(num_reqs=256, num_decode_reqs=256, decode_context_tokens=0)
    assert a.step_time(big) - a.step_time(one) > 0.8 * m.expert_weight_bytes_per_gpu(1) * (1 - 8 / 128) / bw


def test_kernel_model_reads_the_fused_moe_table_of_the_shape():
    import json
    from pathlib import Path
    k = KernelCostModel("mixtral-8x7b", "h100", 2)
    key = "bf16/4096/14336/2/8/2/1"                      # dtype/hidden/inter/topk/experts/moe_tp/moe_ep
    assert k.describe()["table_coverage"]["moe"] == key
    moe = json.loads((Path(__file__).resolve().parents[1] / "calibration" / "kernels" / "h100_sxm.json")
                     .read_text())["moe"]
    # each table as the kernel model reads every table: no more tokens ever faster (a suffix
    # minimum); at 64 tokens all 8 experts are touched, so the uniform reading is the balanced table
    us = max(_table_reading(moe["tables"][key])[64], _table_reading(moe["skewed_tables"][key])[64])
    f = BatchFeatures(num_reqs=64, num_decode_reqs=64, decode_context_tokens=64 * 500)
    assert k.breakdown(f)["moe"] == pytest.approx(32 * us * 1e-6)    # 32 MoE layers x the slower table
    # H100's table was measured through vLLM's FusedMoE layer on router logits: routing included
    assert "moe_routing" not in k.breakdown(f)
    assert "moe_routing" not in KernelCostModel("llama-3.1-8b", "h100").breakdown(f)


def test_a_moe_layer_read_without_its_routing_adds_the_routing_kernel():
    # A100's table is the earlier collector's (fused_experts on precomputed top-k ids, kernel
    # vllm_fused_moe): each MoE layer adds its routing kernel, in every path of a step
    routing = Overheads().moe_routing_s
    assert routing == 4e-6
    f = BatchFeatures(num_reqs=64, num_decode_reqs=64, decode_context_tokens=64 * 500)
    mixed = BatchFeatures(num_reqs=2, num_prefill_reqs=1, num_prefill_tokens=300, prefill_attn_pairs=300 * 301 // 2,
                          num_decode_reqs=1, decode_context_tokens=500)
    k = KernelCostModel("mixtral-8x7b", "a100", 2)
    assert load_tables("a100_sxm")["moe"]["kernels"]["bf16"] == "vllm_fused_moe"
    k0 = KernelCostModel("mixtral-8x7b", "a100", 2, Overheads(moe_routing_s=0.0))
    assert k.breakdown(f)["moe_routing"] == pytest.approx(32 * routing)
    assert k.decode_gpu_time(64, 64 * 500) - k0.decode_gpu_time(64, 64 * 500) == pytest.approx(32 * routing)
    assert k.gpu_time(mixed) - k0.gpu_time(mixed) == pytest.approx(32 * routing)
    # a second model of the deployment shares the built grids, and a reduced profile keeps it too
    again = KernelCostModel("mixtral-8x7b", "a100", 2)
    assert again.breakdown(f)["moe_routing"] == pytest.approx(32 * routing)
    back = KernelCostModel("mixtral-8x7b", "a100", 2, reduced=k.to_reduced())
    assert back.breakdown(f)["moe_routing"] == pytest.approx(32 * routing)   # (the grids' us are rounded)
    # B200's Triton tables for fp8 blocks (cost_model.moe_backend: triton) are the earlier
    # collector's too; its default (FlashInfer's TRT-LLM kernel) was measured through the layer
    tri = KernelCostModel("minimax-m2", "b200", 2, moe_backend="triton")
    assert load_tables("b200_sxm")["moe_triton"]["kernels"]["fp8_block"] == "vllm_fused_moe"
    assert tri.breakdown(f)["moe_routing"] == pytest.approx(62 * routing)
    assert "moe_routing" not in KernelCostModel("minimax-m2", "b200", 2).breakdown(f)
    f1 = BatchFeatures(num_reqs=1, num_decode_reqs=1, decode_context_tokens=500)
    # 2 of 8 experts at one token, nearly all at 64: the measured kernel grows, but less than 4x
    assert 1.5 < k.breakdown(f)["moe"] / k.breakdown(f1)["moe"] < 4.5
    assert KernelCostModel("llama-3.1-8b", "h100").breakdown(f)["moe"] == 0.0


def test_l40s_reads_its_own_fused_moe_tables():
    # L40S has both routings, read as on H100
    import json
    from pathlib import Path
    k = KernelCostModel("mixtral-8x7b", "l40s", 4)
    key = "bf16/4096/14336/2/8/4/1"
    assert k.describe()["table_coverage"]["moe"] == key
    moe = json.loads((Path(__file__).resolve().parents[1] / "calibration" / "kernels" / "l40s.json")
                     .read_text())["moe"]
    assert moe["distribution"] == "balanced" and "routing_reference" not in moe
    # at 64 decodes all 8 experts are touched, so no routing correction: at each measured point the
    # slower routing (the skewed table as read), at the step's compute clocks (Overheads.
    # gemm_compute_slowdown: 1 at 64 tokens, more above), then read as every table is
    ts, us = moe["tables"][key]["values"][0], moe["tables"][key]["us"]
    sk = _table_reading(moe["skewed_tables"][key])
    us = [max(u, sk[t]) for t, u in zip(ts, us)]
    us = _table_reading({"values": [ts], "us": [u * k.ovh.gemm_factor(t) for t, u in zip(ts, us)]})[64]
    f = BatchFeatures(num_reqs=64, num_decode_reqs=64, decode_context_tokens=64 * 500)
    assert k.breakdown(f)["moe"] == pytest.approx(32 * us * 1e-6)    # 32 MoE layers
    # the roofline it replaces streams the experts at the card's full bandwidth: the kernel is slower
    assert k.breakdown(f)["moe"] > 32 * k._moe_roof(64)


def test_a100s_power_law_moe_table_takes_uniform_routing_from_l40s_and_is_vllms_triton_kernel():
    # A100's only table was timed with power-law routing, which at 8 decodes of Qwen3-30B-A3B (8 of
    # 128 experts each) touches fewer experts than uniform routing. L40S has both routings for the
    # same Triton kernel and shape: the A100 reading is its power-law table times L40S's
    # (slower of uniform and power-law) over L40S's power-law table alone, at each token count.
    import json
    from pathlib import Path
    from sim.kernel_model import _uniform_routing
    kernels = Path(__file__).resolve().parents[1] / "calibration" / "kernels"
    a100 = json.loads((kernels / "a100_sxm.json").read_text())["moe"]
    l40s = json.loads((kernels / "l40s.json").read_text())["moe"]
    assert a100["routing_reference"] == "l40s"
    key, spec = "bf16/2048/768/8/128/1/1", get_model("qwen3-30b-a3b")
    (axis,), uniform = _uniform_routing(l40s["tables"][key], spec, "balanced")
    uniform_8 = _table_reading({"values": [axis], "us": uniform})[8]
    skewed_8 = _table_reading(l40s["skewed_tables"][key])[8]
    ratio = max(uniform_8, skewed_8) / skewed_8
    assert ratio > 1.1                                    # uniform routing streams more experts here
    k = KernelCostModel("qwen3-30b-a3b", "a100-80g", 1)
    assert k.describe()["table_coverage"]["moe"] == key + " (uniform routing by l40s's ratio)"
    f = BatchFeatures(num_reqs=8, num_decode_reqs=8, decode_context_tokens=8 * 500)
    assert k.breakdown(f)["moe"] == pytest.approx(48 * _table_reading(a100["tables"][key])[8] * ratio * 1e-6,
                                                  rel=1e-6)  # 48 MoE layers
    tri = KernelCostModel("qwen3-30b-a3b", "a100-80g", 1, moe_backend="triton")
    assert tri.breakdown(f)["moe"] == k.breakdown(f)["moe"]


def test_the_routing_ratio_holds_its_value_past_the_shorter_token_axis():
    # a reference whose balanced table runs to 64 tokens and whose skewed one stops at 16: the
    # ratio past 16 is the one at 16, not the balanced table's own growth over a clamped skewed one
    from sim.kernel_model import _routing_ratio
    spec = ModelSpec("toy", 2, 64, 4, 4, 16, 128, 100, num_experts=4, num_experts_per_tok=1,
                     moe_intermediate_size=32, num_moe_layers=2)
    key = "bf16/64/32/1/4/1/1"
    ref = {"distribution": "balanced",
           "tables": {key: {"values": [[1, 4, 16, 64]], "us": [10.0, 20.0, 30.0, 90.0]}},
           "skewed_tables": {key: {"values": [[1, 4, 16]], "us": [10.0, 15.0, 20.0]}}}
    r = _routing_ratio(ref, key, spec)
    # at 16 tokens uniform routing touches e = 4 (1 - (3/4)^16) experts: the balanced time x e / 4
    e16 = 4 * (1 - 0.75 ** 16)
    assert r(16) == pytest.approx(30.0 * e16 / 4 / 20.0, rel=1e-6)
    assert r(64) == r(1000) == r(16)
    assert _routing_ratio({**ref, "distribution": "power_law_1.01"}, key, spec) is None


def test_a_balanced_moe_table_is_read_for_uniform_random_routing():
    # A table measured with balanced routing (AIConfigurator's balanced_logits: T tokens x k spread
    # over min(E, T k) experts), here one whose time is the weights of the experts it touches,
    # 10 us each. Random routing touches e(T) = E (1 - (1 - k/E)^T) of them: so 10 e(T) us.
    from sim.kernel_model import _uniform_routing
    spec = ModelSpec("toy", 2, 64, 4, 4, 16, 128, 100, num_experts=64, num_experts_per_tok=4,
                     moe_intermediate_size=32, num_moe_layers=2)
    ts = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    tab = {"values": [ts], "us": [10.0 * min(64, 4 * t) for t in ts]}
    (axis,), us = _uniform_routing(tab, spec, "balanced")
    got = dict(zip(axis, us))
    for T in (2, 4, 8, 16, 64, 256):
        assert got[T] == pytest.approx(10.0 * spec.experts_touched(T), rel=1e-9)
        assert got[T] <= 10.0 * min(64, 4 * T)              # never more than balanced routing
    assert got[256] == pytest.approx(640.0, rel=0.01)       # a big batch touches them all either way
    # a table measured with another routing is read as measured
    assert _uniform_routing(tab, spec, "power_law_1.01") == (tab["values"], tab["us"])


def test_a_moe_layer_takes_the_slower_of_uniform_and_skewed_routing():
    # Balanced table: 10 us per expert touched (T x k rows over min(E, T k) experts), so uniform
    # random routing, which touches e(T) = E (1 - (1 - k/E)^T) of them, reads 10 e(T) us (by hand).
    # Skewed table: half as many experts at small T, but from 512 tokens its busiest expert's
    # extra rows make it 40% slower than balanced.
    from sim.kernel_model import _moe_reading
    spec = ModelSpec("toy", 2, 64, 4, 4, 16, 128, 100, num_experts=64, num_experts_per_tok=4,
                     moe_intermediate_size=32, num_moe_layers=2)
    ts = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    bal = [10.0 * min(64, 4 * t) for t in ts]
    skew = [5.0 * min(64, 4 * t) * (2.8 if t >= 512 else 1.0) for t in ts]
    key = "bf16/64/32/4/64/1/1"
    (axis,), us = _moe_reading({key: {"values": [ts], "us": bal}}, {key: {"values": [ts], "us": skew}},
                               key, spec, "balanced")
    got = dict(zip(axis, us))
    for T in (2, 4, 16, 64):  # decode batches: uniform routing's experts, more than the skewed table's
        assert got[T] == pytest.approx(10.0 * spec.experts_touched(T), rel=1e-9)
        assert got[T] > skew[ts.index(T)]
    for T in (512, 1024, 2048):  # prefill-sized steps: the skewed table, 40% above balanced
        assert got[T] == pytest.approx(1.4 * 640.0, rel=1e-9)
    # without a skewed table of that key the reading is the uniform one alone
    (_,), only = _moe_reading({key: {"values": [ts], "us": bal}}, {}, key, spec, "balanced")
    assert dict(zip(axis, only))[2048] == pytest.approx(640.0, rel=0.01)
    assert all(u <= g for u, g in zip(only, us))


def test_minimax_norms_q_and_k_across_the_tp_group():
    # MiniMax-M2's q/k RMSNorm spans all heads: under TP each layer all-reduces the per-token sums
    # of squares (vLLM's MiniMaxText01RMSNormTP), one more small all-reduce per layer; none at TP 1
    import dataclasses
    m = get_model("MiniMaxAI/MiniMax-M2.5")
    assert m.qk_norm_across_heads
    assert ModelSpec.from_hf_config({"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
                                     "hidden_size": 3072, "intermediate_size": 1536, "num_attention_heads": 48,
                                     "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 62,
                                     "num_local_experts": 256, "num_experts_per_tok": 8,
                                     "vocab_size": 200064}).qk_norm_across_heads
    plain = dataclasses.replace(m, qk_norm_across_heads=False, name="minimax-plain")
    f = BatchFeatures(num_reqs=4, num_decode_reqs=4, decode_context_tokens=4 * 1000)
    for tp in (2, 4):
        k, p = KernelCostModel(m, "b200", tp), KernelCostModel(plain, "b200", tp)
        extra = k.breakdown(f)["allreduce"] - p.breakdown(f)["allreduce"]
        smallest = k.g_ar.us[0] * 1e-6                      # 16 bytes a token: the latency floor
        assert extra == pytest.approx(62 * smallest, rel=1e-6)
        assert k.breakdown(f)["elementwise"] - p.breakdown(f)["elementwise"] == pytest.approx(62 * 1.5e-6)
    assert KernelCostModel(m, "b200", 1, tables=None).breakdown(f) == KernelCostModel(plain, "b200", 1, tables=None).breakdown(f)


def test_an_unmeasured_moe_shape_is_scaled_from_the_nearest_and_counted():
    import dataclasses
    m = dataclasses.replace(get_model("qwen3-30b-a3b"), num_experts=96, moe_intermediate_size=1024, name="custom-moe")
    k = KernelCostModel(m, "h100", 1)
    assert k.describe()["table_coverage"]["moe"].startswith("scaled from bf16/")
    f = BatchFeatures(num_reqs=16, num_decode_reqs=16, decode_context_tokens=16 * 500)
    with pytest.warns(UserWarning, match="moe"):
        t = k.breakdown(f)["moe"]
    assert k.fallbacks["moe"] >= 1
    # near the measured shape it was scaled from (Qwen3-30B-A3B's; this one has the same expert
    # bytes in fewer, wider experts), and nothing like the dense layer it would be without experts
    q = KernelCostModel("qwen3-30b-a3b", "h100", 1).breakdown(f)["moe"]
    assert 0.5 * q < t < 2.0 * q


def test_an_expert_parallel_shape_measured_sliced_only_reads_the_sliced_table():
    # A format measured with the experts sliced (moe_tp 4) but not split whole (moe_ep 4): the EP
    # deployment reads the sliced table times the bf16 tables' whole/sliced ratio, each table read
    # as the kernel model reads MoE tables (kernel_model._moe_reading), at the clocks of a busy GPU
    # (Overheads.gemm_factor). H200's tables with fp8 blocks' EP shapes taken out stand for one.
    import copy
    from sim.kernel_model import Grid, _moe_reading
    m = dataclasses.replace(get_model("qwen3-235b-a22b"), weight_dtype="fp8_block")
    tabs = copy.deepcopy(load_tables("h200_sxm"))
    for part in ("tables", "skewed_tables"):
        t = tabs["moe"][part]
        for key in [k for k in t if k.startswith("fp8_block/") and not k.endswith("/1")]:
            del t[key]
    moe = tabs["moe"]
    assert "fp8_block/4096/1536/8/128/1/4" not in moe["tables"] and "fp8_block/4096/1536/8/128/4/1" in moe["tables"]
    k = KernelCostModel(m, "h200", 4, expert_parallel=True, tables=tabs)
    assert k.describe()["table_coverage"]["moe"].startswith("fp8_block/4096/1536/8/128/4/1 x bf16 EP/TP")

    def read(key):
        return Grid(*_moe_reading(moe["tables"], moe["skewed_tables"], key, m, moe["distribution"]), None)
    sliced, ep_b, tp_b = (read(f"{f}/4096/1536/8/128/{s}") for f, s in
                          (("fp8_block", "4/1"), ("bf16", "1/4"), ("bf16", "4/1")))
    for T in (64, 8192):
        f = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=T, prefill_chunks=[(T, 0)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the table read in place of this shape's is a counted fallback
            got = k.breakdown(f)["moe"]
        want = m.num_moe_layers * sliced(T)[0] * ep_b(T)[0] / tp_b(T)[0] * k.ovh.gemm_factor(T) * 1e-6
        assert got == pytest.approx(want, rel=1e-6)
    # sliced, the same deployment reads the fp8 table as measured; split whole it costs more (a hot
    # expert's rows all land on one rank), by the bf16 tables' ratio, not the 2.5x of the old estimate
    tp = KernelCostModel(m, "h200", 4, tables=tabs)
    assert tp.describe()["table_coverage"]["moe"] == "fp8_block/4096/1536/8/128/4/1"
    f = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=8192, prefill_chunks=[(8192, 0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert 1.0 < k.breakdown(f)["moe"] / tp.breakdown(f)["moe"] < 1.5
    assert k.fallbacks["moe"] >= 1


def test_hopper_fp8_block_experts_run_the_kernel_vllm_picks_for_their_sharding():
    """vLLM's fp8 MoE selection on Hopper (oracle/fp8.py) runs Triton with the experts sliced and
    FlashInfer's CUTLASS kernel with them split whole; the wheel measured exactly those, and the
    converter keeps each shape's (kernels_by_shape). An EP deployment of Qwen3-235B-FP8 on H200
    reads the CUTLASS table of its own shape, measured, with no fallback."""
    from sim.kernel_model import _moe_reading
    moe = load_tables("h200_sxm")["moe"]
    assert moe["kernels"]["fp8_block"] == "vllm_fp8moe_triton_tritonexperts"
    key = "fp8_block/4096/1536/8/128/1/4"
    assert moe["kernels_by_shape"][key] == "vllm_fp8moe_flashinfer_cutlass_flashinferexperts"
    assert "fp8_block/4096/1536/8/128/4/1" not in moe["kernels_by_shape"]       # sliced: Triton's
    m = dataclasses.replace(get_model("qwen3-235b-a22b"), weight_dtype="fp8_block")
    k = KernelCostModel(m, "h200", 4, expert_parallel=True)
    assert k.describe()["table_coverage"]["moe"] == key
    vals, us = _moe_reading(moe["tables"], moe["skewed_tables"], key, m, moe["distribution"])
    T = 8192
    f = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=T, prefill_chunks=[(T, 0)])
    assert k.breakdown(f)["moe"] == pytest.approx(
        m.num_moe_layers * dict(zip(vals[0], us))[T] * k.ovh.gemm_compute_slowdown * 1e-6, rel=1e-9)
    assert not k.fallbacks.get("moe")


def test_expert_parallel_is_a_deployment_key_and_a_serve_flag(tmp_path):
    from sim.scenario import ScenarioError, parse_scenario
    base = {"workload": {"num_requests": 20, "arrival": {"type": "poisson", "rate": 5.0},
                         "prompt_len": {"type": "fixed", "value": 200}, "output_len": {"type": "fixed", "value": 20}}}
    tp2 = parse_scenario({**base, "deployment": {"model": "qwen3-30b-a3b", "device": "h100", "tp": 2}})
    ep2 = parse_scenario({**base, "deployment": {"model": "qwen3-30b-a3b", "device": "h100", "tp": 2,
                                                 "expert_parallel": True}})
    assert ep2.deployment["expert_parallel"] is True and "expert_parallel" not in tp2.deployment
    # the same weight bytes per rank (memory as TP); the MoE layers from the kernels measured with
    # the experts split whole over the two ranks (moe_tp 1, moe_ep 2) instead of sliced (2, 1)
    assert ep2.scheduler_config.num_gpu_blocks == tp2.scheduler_config.num_gpu_blocks
    assert ep2.cost_model.describe()["table_coverage"]["moe"] == "bf16/2048/768/8/128/1/2"
    assert tp2.cost_model.describe()["table_coverage"]["moe"] == "bf16/2048/768/8/128/2/1"
    f = BatchFeatures(num_reqs=32, num_decode_reqs=32, decode_context_tokens=32 * 700)
    assert ep2.cost_model.step_time(f) != tp2.cost_model.step_time(f)
    with pytest.raises(ScenarioError, match="expert_parallel=true: llama-3.1-8b has no experts"):
        parse_scenario({**base, "deployment": {"model": "llama-3.1-8b", "device": "h100", "expert_parallel": True}})
    with pytest.raises(ScenarioError, match="deployment.data_parallel=2: attention data parallelism is for mix"):
        parse_scenario({**base, "deployment": {"model": "llama-3.1-8b", "device": "h100", "data_parallel": 2}})
    with pytest.raises(ScenarioError, match="deployment.tp=4 x data_parallel=4: spans more than one node of 8"):
        parse_scenario({**base, "deployment": {"model": "qwen3-30b-a3b", "device": "h100", "tp": 4, "data_parallel": 4}})
    with pytest.raises(ScenarioError, match="data_parallel=2: timed by cost_model.type kernels only"):
        parse_scenario({**base, "deployment": {"model": "qwen3-30b-a3b", "device": "h100", "data_parallel": 2},
                        "cost_model": {"type": "analytic"}})
    from scenarios.plan_report import deploy_commands
    c = {"replicas": 2, "tp": 2, "device": "h100-sxm", "router": "round_robin", "policy": "fcfs",
         "max_num_seqs": 256, "max_num_batched_tokens": 8192}
    lines = deploy_commands({"hf_model": "Qwen/Qwen3-30B-A3B-Instruct-2507", "gpu_memory_utilization": 0.9,
                             "expert_parallel": True, "target_rate": 10, "workload_means": {}, "model": "qwen3-30b-a3b",
                             "search": {"confirm_requests": 8000}}, c)
    serve = [x for x in lines if "vllm serve" in x]
    assert len(serve) == 2 and all("--tensor-parallel-size 2" in x and "--enable-expert-parallel" in x for x in serve)
    assert not any("MXFP8" in x for x in serve)
    # a plan timed with MXFP8 activations serves with the switch that selects that kernel
    mx = deploy_commands({"hf_model": "openai/gpt-oss-120b", "gpu_memory_utilization": 0.9, "moe_activations": "mxfp8",
                          "target_rate": 10, "workload_means": {}, "model": "gpt-oss-120b",
                          "search": {"confirm_requests": 8000}}, {**c, "device": "b200"})
    assert all(x.split()[1] == "VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1" for x in mx if "vllm serve" in x)
    assert not any("--moe-backend" in x for x in serve + mx)
    # a plan timed with vLLM's Triton MoE kernel serves with the flag that selects it
    tri = deploy_commands({"hf_model": "MiniMaxAI/MiniMax-M2.5", "gpu_memory_utilization": 0.9, "moe_backend": "triton",
                           "target_rate": 10, "workload_means": {}, "model": "minimax-m2",
                           "search": {"confirm_requests": 8000}}, {**c, "device": "b200"})
    assert [x for x in tri if "vllm serve" in x] and all("--moe-backend triton" in x for x in tri if "vllm serve" in x)


# ---------------------------------------------------------------- data-parallel attention
DP_BASE = {"scheduler": {"max_num_batched_tokens": 8192, "max_num_seqs": 64}}


def _dp_scenario(dp: int, requests: list[tuple[float, int, int]], **dep):
    """Qwen3-30B-A3B on H100, dp ranks of TP1, a trace of (arrival_s, prompt, output) requests."""
    from sim.scenario import parse_scenario
    from sim.workload import RequestSpec, Workload
    sc = parse_scenario({**DP_BASE, "deployment": {"model": "qwen3-30b-a3b", "device": "h100", "tp": 1,
                                                   "data_parallel": dp, **dep},
                         "workload": {"num_requests": 2, "arrival": {"type": "poisson", "rate": 1.0},
                                      "prompt_len": {"type": "fixed", "value": 10},
                                      "output_len": {"type": "fixed", "value": 2}}})
    import dataclasses
    wl = Workload.from_requests([RequestSpec(f"r{i}", a, p, o, ((1000 + i, p),))
                                 for i, (a, p, o) in enumerate(requests)])
    return dataclasses.replace(sc, workload=wl)


def test_data_parallel_memory_spreads_the_experts_by_hand():
    from sim.specs import memory_breakdown
    m, d = get_model("qwen3-30b-a3b"), get_device("h100")
    one, two = memory_breakdown(m, d, 1), memory_breakdown(m, d, 1, data_parallel=2)
    experts = 48 * 128 * 3 * 2048 * 768 * 2                 # bf16 routed experts, all layers
    assert one["weight_bytes_per_gpu"] - two["weight_bytes_per_gpu"] == experts // 2
    assert two["kv_blocks"] > one["kv_blocks"]               # the freed half goes to KV
    assert m.weight_bytes_per_gpu(2, 4) == m.dense_weight_bytes_per_gpu(2) + experts // 4


def test_data_parallel_moe_layers_take_every_ranks_tokens():
    k1 = KernelCostModel("qwen3-30b-a3b", "h100", 1, expert_parallel=True, data_parallel=2)
    f = BatchFeatures(num_reqs=8, num_decode_reqs=8, decode_context_tokens=8 * 500)
    g = BatchFeatures(num_reqs=24, num_decode_reqs=24, decode_context_tokens=24 * 500)
    assert k1.describe()["table_coverage"]["moe"] == "bf16/2048/768/8/128/1/2"   # experts over 2 GPUs
    alone = k1.breakdown(f)                       # no group given: ranks alike, 2 x 8 tokens
    k1.set_group_tokens(32)
    both = k1.breakdown(f)
    k1.set_group_tokens(None)
    assert both["moe"] == pytest.approx(48 * k1.g_moe(32)[0] * 1e-6)
    assert alone["moe"] == pytest.approx(48 * k1.g_moe(16)[0] * 1e-6)
    assert both["gemm"] == alone["gemm"]          # attention and dense layers: the rank's own 8 tokens
    # dispatch and combine per MoE layer: 32 tokens' hidden states over 2 GPUs plus latencies
    hand = 2 * (2 - 1) / 2 * 32 * 2048 * 2 / k1.device.interconnect_bandwidth
    hand += 2 * k1.device.interconnect_latency_s + k1.ovh.dp_dispatch_s
    assert both["moe_dispatch"] == pytest.approx(48 * hand)
    # a group step: the slower rank's (g's) terms plus its CPU work; the faster rank waits for
    # it. Both steps run in CUDA graphs, so vLLM pads rank 0's 8 tokens to rank 1's 24: the MoE
    # layers take 2 x 24 tokens, and the step costs what two ranks of g would
    assert k1.group_step_time([f, g]) == pytest.approx(sum(_with_group(k1, 48, g).values()) + k1.cpu_time(g))
    assert k1.group_step_time([f, g]) == pytest.approx(k1.group_step_time([g, g]))
    assert k1.group_step_time([f, g]) > k1.group_step_time([f, f])
    # an idle rank runs a dummy batch, padded as well: a group of 4 with two busy ranks
    assert k1.group_step_time([f, g], 4) == pytest.approx(sum(_with_group(k1, 96, g).values()) + k1.cpu_time(g))
    # a prefill chunk above the CUDA-graph limit (512 tokens) runs eagerly: no rank is padded,
    # the MoE layers take the ranks' own 8 + 4000 tokens, and the step costs less than two
    # ranks of that chunk would
    p = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=4000, prefill_attn_pairs=4000 * 4001 // 2)
    assert k1.group_step_time([f, p]) == pytest.approx(sum(_with_group(k1, 4008, p).values()) + k1.cpu_time(p))
    assert k1.group_step_time([f, p]) < 0.8 * k1.group_step_time([p, p])


def _with_group(k, n, f):
    k.set_group_tokens(n)
    try:
        return k.breakdown(f)
    finally:
        k.set_group_tokens(None)


def test_data_parallel_ranks_step_together_and_a_prefill_stalls_the_others():
    """Two ranks: A decodes on rank 0 while B's 4,000-token prompt arrives on rank 1. The ranks'
    steps share their boundaries, and A's token gap across B's prefill step is that whole step;
    as two independent replicas, A never waits for B."""
    from sim.scenario import run_scenario
    reqs = [(0.0, 100, 200), (0.5, 4000, 5)]
    dp = run_scenario(_dp_scenario(2, reqs))
    import pandas as pd
    steps = pd.DataFrame(dp.step_table).to_dict("records")
    by = {r: [(s["start_s"], s["end_s"]) for s in steps if s["replica"] == r] for r in (0, 1)}
    assert by[1] and set(by[1]) <= set(by[0])             # rank 1's steps are rank 0's steps
    prefill = [s for s in steps if s["replica"] == 1 and s["num_prefill_tokens"] >= 4000][0]
    a0 = [s for s in steps if s["replica"] == 0 and s["start_s"] == prefill["start_s"]][0]
    assert a0["end_s"] == prefill["end_s"] and a0["num_decode_reqs"] == 1
    decode_only = [s["end_s"] - s["start_s"] for s in steps if s["replica"] == 0 and s["end_s"] < 0.5]
    assert prefill["end_s"] - prefill["start_s"] > 3 * max(decode_only)
    # the same two requests on two independent replicas: A's longest gap is a decode step's
    from sim.simulation import Simulation
    sc = _dp_scenario(2, reqs)
    indep = Simulation(sc.workload, sc.scheduler_config, sc.cost_model, num_replicas=2,
                       use_steady=False, keep_token_times=True).run()
    dp_t = _dp_scenario(2, reqs)
    dp_t = Simulation(dp_t.workload, dp_t.scheduler_config, dp_t.cost_model, data_parallel=2,
                      keep_token_times=True).run()
    gap = lambda res: max(np.diff(res.records[0].token_times_s))   # noqa: E731
    assert gap(dp_t) > 3 * gap(indep)


def test_data_parallel_idle_ranks_run_padded_dummy_batches_in_a_scenario():
    """A lone 400-token prompt on four ranks: three ranks are idle and run dummy batches, which vLLM
    pads to the busy rank's 400 tokens (the step runs in CUDA graphs: 400 <= 512), so the MoE
    layers take 4 x 400 tokens. The scenario's cost model (CPU work around the kernel model)
    passes the padding rule on; the step's recorded time is the group's, longer than the busy
    rank's step with the idle ranks left out."""
    from sim.scenario import run_scenario
    import pandas as pd
    sc = _dp_scenario(4, [(0.0, 400, 3)], expert_parallel=True)
    cm = sc.cost_model
    assert cm.dp_pads(400) and not cm.dp_pads(4000)
    steps = pd.DataFrame(run_scenario(sc).step_table)
    prefill = steps[steps.num_prefill_tokens > 0].iloc[0]
    f = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=400, prefill_attn_pairs=400 * 401 // 2)
    fresh = _dp_scenario(4, [(0.0, 400, 3)], expert_parallel=True).cost_model
    assert prefill.end_s - prefill.start_s == pytest.approx(fresh.group_step_time([f], 4))
    assert prefill.end_s - prefill.start_s > 1.2 * fresh.group_step_time([f], 1)


def test_before_vllm_016_data_parallel_ranks_are_padded_in_every_step():
    """vLLM before 0.16 padded every rank to the largest whenever CUDA graphs were on, a long
    prefill chunk included (vllm-project/vllm#34102 limited it to graph steps): one rank's
    4,000-token chunk then makes the MoE layers take 4 x 4,000 tokens, not 4,000 plus three idle
    ranks' nothing."""
    from sim.kernel_model import KernelCostModel
    old = KernelCostModel("qwen3-30b-a3b", "h100", 1, data_parallel=4, expert_parallel=True, vllm_version="0.15.1")
    new = KernelCostModel("qwen3-30b-a3b", "h100", 1, data_parallel=4, expert_parallel=True, vllm_version="0.16.0")
    assert old.dp_pads(4000) and not new.dp_pads(4000) and new.dp_pads(400)
    f = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=4000, prefill_attn_pairs=4000 * 4001 // 2)
    tk_old, tk_new = old.group_step_time([f], 4), new.group_step_time([f], 4)
    old.set_group_tokens(4 * 4000)
    padded = old.step_time(f)
    new.set_group_tokens(4000)
    alone = new.step_time(f)
    assert tk_old == pytest.approx(padded, rel=1e-9) and tk_new == pytest.approx(alone, rel=1e-9)
    assert tk_old > 1.5 * tk_new


def test_the_planner_grid_takes_data_parallel_and_prints_its_flags():
    from scenarios.candidates import candidates, compose, gpus_per_unit, label
    from scenarios.plan import prune_reason
    from scenarios.plan_report import deploy_commands
    from sim.scenario import parse_scenario

    class Spec:
        grid = {"tp": [1], "data_parallel": [1, 2]}
    data = {"deployment": {"model": "qwen3-30b-a3b", "device": "h100", "expert_parallel": True},
            "workload": {"num_requests": 10, "arrival": {"type": "poisson", "rate": 5.0},
                         "prompt_len": {"type": "fixed", "value": 200}, "output_len": {"type": "fixed", "value": 20}}}
    one, two = candidates(data, Spec)
    assert (gpus_per_unit(one), gpus_per_unit(two)) == (1, 2) and label(two).startswith("h100 tp1 dp2 ")
    sc = parse_scenario(compose(data, two, units=3))
    assert (sc.replicas, sc.data_parallel) == (3, 2)
    assert "data_parallel" not in compose(data, one)["deployment"]
    assert prune_reason(data, two, 220) is None
    dense = {**data, "deployment": {"model": "llama-3.1-8b", "device": "h100"}}
    assert "attention data parallelism is for mixtures of experts" in prune_reason(dense, two, 220)
    c = {**two, "replicas": 2, "capacity_rps": None}
    lines = deploy_commands({"hf_model": "Qwen/Qwen3-30B-A3B-Instruct-2507", "gpu_memory_utilization": 0.9,
                             "expert_parallel": True, "target_rate": 10, "workload_means": {},
                             "model": "qwen3-30b-a3b", "search": {"confirm_requests": 8000}}, c)
    serve = [x for x in lines if "vllm serve" in x]
    assert [x.split()[0] for x in serve] == ["CUDA_VISIBLE_DEVICES=0,1", "CUDA_VISIBLE_DEVICES=2,3"]
    assert all("--tensor-parallel-size 1" in x and "--data-parallel-size 2" in x
               and "--enable-expert-parallel" in x for x in serve)


def test_sliding_window_layers_attend_to_their_window_only():
    """gpt-oss: half its layers attend to the last 128 tokens. Their attention time at any
    context equals a full layer's at the window, so a step's attention is the full layers' at
    the context plus the sliding layers' at the window (the same model with every layer full
    gives both numbers)."""
    import dataclasses
    from engine.core.features import BatchFeatures
    m = get_model("gpt-oss-120b")
    assert (m.num_sliding_layers, m.sliding_window) == (18, 128)
    full = dataclasses.replace(m, num_sliding_layers=0, sliding_window=0)
    k, kf = KernelCostModel(m, "h200", 2), KernelCostModel(full, "h200", 2)

    def att(model, **kw):
        return model.breakdown(BatchFeatures(**kw))["attention"]
    n, ctx = 32, 8000
    decode = dict(num_reqs=n, num_decode_reqs=n, decode_context_tokens=n * ctx)
    window = dict(num_reqs=n, num_decode_reqs=n, decode_context_tokens=n * 128)
    assert att(k, **decode) == pytest.approx(0.5 * att(kf, **decode) + 0.5 * att(kf, **window), rel=1e-9)
    assert att(k, **decode) < 0.75 * att(kf, **decode)
    # decode-only steps take the simulator's fast path: the same time as the features' path
    assert k.decode_gpu_time(n, n * ctx) == pytest.approx(k.gpu_time(BatchFeatures(**decode)), rel=1e-9)
    # a 2048-token prompt from scratch: a sliding layer sees at most 2048 x 128 query-key pairs
    pairs = 2048 * 2049 // 2
    chunk = dict(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=2048, prefill_attn_pairs=pairs)
    banded = dict(chunk, prefill_attn_pairs=2048 * 128)
    assert att(k, **chunk) == pytest.approx(0.5 * att(kf, **chunk) + 0.5 * att(kf, **banded), rel=1e-9)
    # shorter than the window: nothing changes
    short = dict(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=100, prefill_attn_pairs=100 * 101 // 2)
    assert att(k, **short) == pytest.approx(att(kf, **short), rel=1e-12)


@pytest.mark.parametrize("name, tp, logged_gib", [
    # vLLM's "Model loading took X GiB" on H100s, from public startup logs: llm-d-planner's v0.19.0
    # accuracy logs (Llama-4-Scout bf16 TP4), llm-d-benchmark's empirical memory results
    # (gpt-oss-20b, gpt-oss-120b, Llama-3.1-8B, Qwen3-32B: one H100), vLLM PR #21429 (Qwen3-235B-FP8 TP4)
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", 4, 53.12),
    ("openai/gpt-oss-20b", 1, 13.47),
    ("openai/gpt-oss-120b", 1, 64.38),
    ("meta-llama/Llama-3.1-8B-Instruct", 1, 14.99),
    ("Qwen/Qwen3-32B", 1, 61.03),
    ("Qwen/Qwen3-235B-A22B-FP8", 4, 55.13),
])
def test_loaded_model_matches_what_vllm_logs(name, tp, logged_gib):
    """What a GPU holds once the model is loaded, within 1% of vLLM's own figure: the weights, and
    for Llama-4 its vision encoder (0.87 B parameters) and the rotary cache of 10M positions
    (2.5 GiB on every rank), for gpt-oss the MXFP4 experts padded to a hidden size of 3072."""
    loaded = get_model(name).loaded_bytes_per_gpu(tp) / GiB
    assert loaded == pytest.approx(logged_gib, rel=0.01)


def test_llama4_fp8_dynamic_keeps_attention_in_16_bits_and_loads_its_vision_encoder():
    """RedHat's FP8-dynamic Llama-4 leaves self_attn unquantized (its ignore list), by catalog
    name or from its config.json; the vision encoder is counted from vision_config and is not read
    by a text step."""
    from sim.specs import LLAMA4_VISION_CONFIG, llama4_vision_params
    by_name = get_model("RedHatAI/Llama-4-Scout-17B-16E-Instruct-FP8-dynamic")
    assert by_name.weight_dtype == "fp8" and by_name.attn_dtype == "bfloat16"
    cfg = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"], "torch_dtype": "bfloat16",
           "text_config": {"model_type": "llama4_text", "num_hidden_layers": 48, "hidden_size": 5120,
                           "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                           "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_local_experts": 16,
                           "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "vocab_size": 202048,
                           "max_position_embeddings": 10485760, "use_qk_norm": True},
           "vision_config": LLAMA4_VISION_CONFIG,
           "quantization_config": {"quant_method": "compressed-tensors", "ignore": [
               "re:.*self_attn", "re:.*router", "re:.*vision_model", "re:.*multi_modal_projector", "re:.*lm_head"],
               "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}}}}
    m = ModelSpec.from_hf_config(cfg)
    assert m.weight_dtype == "fp8" and m.attn_dtype == "bfloat16"
    assert m.vision_params == llama4_vision_params(LLAMA4_VISION_CONFIG, 5120) == by_name.vision_params
    # ViT: 34 x (q/k/v/o with biases, fc1/fc2 with biases, two LayerNorms), patch and position
    # embeddings, two LayerNorms, the pixel-shuffle adapter and the projector, counted by hand
    h, i = 1408, 5632
    vit = 34 * (4 * (h * h + h) + 2 * h * i + i + h + 4 * h) + 3 * 14 * 14 * h + 577 * h + h + 4 * h
    assert m.vision_params == vit + 4 * h * 4096 + 4096 * 4096 + 4096 * 5120 == 871_932_416
    assert m.weight_read_bytes_per_gpu(2) + m.vision_bytes_per_gpu(2) + 202048 // 2 * 5120 * 2 == \
        m.weight_bytes_per_gpu(2)


def test_llama4_maverick_by_name_equals_its_config_and_a_hand_count():
    """Maverick's public config.json (text part; vision_config as Scout's) read by the loader is the
    catalog entry, and its weights are a hand count: 400B parameters."""
    text = {"model_type": "llama4_text", "num_hidden_layers": 48, "hidden_size": 5120, "num_attention_heads": 40,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
            "vocab_size": 202048, "max_position_embeddings": 1048576, "num_local_experts": 128,
            "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "use_qk_norm": False,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    from sim.specs import LLAMA4_VISION_CONFIG
    cfg = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"], "text_config": text,
           "vision_config": LLAMA4_VISION_CONFIG, "torch_dtype": "bfloat16"}
    m, c = ModelSpec.from_hf_config(cfg), get_model("llama-4-maverick")
    for f in ("num_layers", "hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_intermediate_size", "num_moe_layers", "intermediate_size", "qk_norm", "vision_params"):
        assert getattr(m, f) == getattr(c, f), f
    h, L = 5120, 48
    attn = h * (40 + 2 * 8) * 128 + 40 * 128 * h
    moe = 128 * 3 * h * 8192 + 3 * h * 8192 + h * 128       # routed experts, the shared one, the router
    dense = 3 * h * 16384
    params = L * (attn + 2 * h) + 24 * moe + 24 * dense + 2 * 202048 * h + h
    assert c.weight_bytes - 2 * c.vision_params == 2 * params
    assert 398e9 < params + c.vision_params < 402e9               # "400B total parameters"


def test_mxfp8_activations_read_their_own_kernels_table():
    """cost_model.moe_activations: mxfp8 (vLLM's VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1 on Blackwell)
    reads the MXFP4 x MXFP8 kernel's table: at a shape it was measured at, the table itself."""
    import json
    from pathlib import Path
    from sim.scenario import ScenarioError, parse_scenario
    shape = dataclasses.replace(get_model("gpt-oss-120b"), name="mxfp4-probe", hidden_size=4096,
                                moe_intermediate_size=2048, num_experts=256, num_experts_per_tok=6)
    k = KernelCostModel(shape, "b200", 1, moe_activations="mxfp8")
    key = "mxfp4_mxfp8/4096/2048/6/256/1/1"
    assert k.describe()["table_coverage"]["moe"] == key
    moe = json.loads((Path(__file__).resolve().parents[1] / "calibration" / "kernels" / "b200_sxm.json")
                     .read_text())["moe"]
    assert moe["kernels"]["mxfp4_mxfp8"].endswith("mxfp4_mxfp8_trtllmmxfp4expertsmodular")

    # 8192 tokens touch every expert under either routing: the slower of the two tables, per MoE
    # layer, at the clocks of a busy GPU (Overheads.gemm_compute_slowdown: the full factor here)
    us = max(_table_reading(moe["tables"][key])[8192], _table_reading(moe["skewed_tables"][key])[8192])
    f = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=8192, prefill_attn_pairs=8192 * 8193 // 2)
    assert k.breakdown(f)["moe"] == pytest.approx(shape.num_moe_layers * us * k.ovh.gemm_compute_slowdown * 1e-6)
    # gpt-oss's own shape is scaled from it; FP8 math beats the bf16-activation kernel at a prefill
    oss8, oss16 = KernelCostModel("gpt-oss-120b", "b200", 1, moe_activations="mxfp8"), KernelCostModel("gpt-oss-120b", "b200", 1)
    assert oss8.describe()["table_coverage"]["moe"] == f"scaled from {key}"
    assert oss8.breakdown(f)["moe"] < 0.5 * oss16.breakdown(f)["moe"]
    # refused, naming the field: a GPU with no such kernel, experts that are not MXFP4
    with pytest.raises(ValueError, match="moe_activations='mxfp8'.*h100"):
        KernelCostModel("gpt-oss-120b", "h100", 1, moe_activations="mxfp8")
    with pytest.raises(ValueError, match="moe_activations='mxfp8'.*MXFP4 experts only"):
        KernelCostModel("qwen3-30b-a3b", "b200", 1, moe_activations="mxfp8")
    base = {"workload": {"num_requests": 4, "arrival": {"type": "poisson", "rate": 1.0},
                         "prompt_len": {"type": "fixed", "value": 64}, "output_len": {"type": "fixed", "value": 4}},
            "deployment": {"model": "gpt-oss-120b", "device": "b200"}}
    sc = parse_scenario({**base, "cost_model": {"type": "kernels", "moe_activations": "mxfp8"}})
    assert sc.cost_model.describe()["moe_activations"] == "mxfp8"
    with pytest.raises(ScenarioError, match="cost_model.moe_activations"):
        parse_scenario({**base, "cost_model": {"type": "kernels", "moe_activations": "fp4"}})


def test_b300_reads_its_own_measured_tables():
    """B300 (Blackwell Ultra) has kernel tables of its own (the wheel's b300_sxm database): MiniMax-M2's
    fused MoE at TP2 is read at its exact shape there, and differs from B200's reading of the same step."""
    k3, k2 = KernelCostModel("minimax-m2", "b300", 2), KernelCostModel("minimax-m2", "b200", 2)
    assert k3.source["moe"].startswith("aisimulate_core/systems/data/b300_sxm/")
    assert k3.describe()["table_coverage"]["moe"] == k2.describe()["table_coverage"]["moe"]  # exact shape
    assert k3.describe()["table_coverage"]["gemm"] is True
    f = BatchFeatures(num_reqs=64, num_decode_reqs=64, decode_context_tokens=64 * 1500)
    assert k3.breakdown(f)["moe"] != k2.breakdown(f)["moe"]
    assert 0.5 < k3.gpu_time(f) / k2.gpu_time(f) < 2.0


def test_mxfp4_experts_are_timed_at_the_shape_vllm_pads_them_to():
    """vLLM pads MXFP4 experts to its kernels' tiles (Mxfp4MoEMethod.create_weights): for
    FlashInfer's TRT-LLM kernels the hidden size and each rank's intermediate slice to multiples
    of 256, for the OAI Triton kernel the slice to a multiple of 64. gpt-oss-120b (2880 x 2880) on
    8 GPUs: slices of 360 become 512, so its MoE layer scaled from another shape's table is timed
    as a 3072 x (8 x 512) model's, not 42% x 1.07 less."""
    from sim.kernel_model import _kernel_shape
    oss = get_model("gpt-oss-120b")
    fi = "vllm_mxfp4moe_flashinfer_trtllm_mxfp4_mxfp8_trtllmmxfp4expertsmodular"
    tri = "vllm_gptossmxfp4moe_triton_oaitritonmxfp4expertsmonolithic"
    for slices, per_rank in ((1, 3072), (2, 1536), (4, 768), (8, 512)):
        k = _kernel_shape(oss, fi, "mxfp4_mxfp8", slices)
        assert (k.hidden_size, k.moe_intermediate_size // slices) == (3072, per_rank)
    assert _kernel_shape(oss, tri, "mxfp4", 2).moe_intermediate_size == 2 * 1472   # 1440 -> 23 x 64
    assert _kernel_shape(oss, tri, "mxfp4", 2).hidden_size == 2880
    assert _kernel_shape(oss, fi, "fp8_block", 8) is oss                       # other formats: as given
    padded = dataclasses.replace(oss, name="gpt-oss-padded", hidden_size=3072, moe_intermediate_size=8 * 512)
    a = KernelCostModel(oss, "b200", 8, moe_activations="mxfp8")
    b = KernelCostModel(padded, "b200", 8, moe_activations="mxfp8")
    assert a.coverage["moe"] == b.coverage["moe"] and a.coverage["moe"].startswith("scaled from")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for T in (4, 64, 8192):
            f = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=T, prefill_chunks=[(T, 0)])
            assert a.breakdown(f)["moe"] == pytest.approx(b.breakdown(f)["moe"], rel=1e-12)


def test_the_triton_moe_backend_reads_vllms_triton_kernel_where_another_is_the_default():
    """cost_model.moe_backend: triton (vLLM's --moe-backend triton, or FlashInfer's and DeepGEMM's
    MoE turned off) reads vLLM's Triton fused-MoE tables: on B200, where vLLM's own choice for fp8
    blocks is FlashInfer's TRT-LLM kernel, the moe_triton section; on H200, where it is Triton
    already, what auto reads. A GPU without them is refused, naming the field."""
    import json
    from pathlib import Path
    from sim.scenario import ScenarioError, parse_scenario
    doc = json.loads((Path(__file__).resolve().parents[1] / "calibration" / "kernels" / "b200_sxm.json").read_text())
    assert "triton" not in doc["moe"]["kernels"]["fp8_block"] and doc["moe_triton"]["kernels"]["fp8_block"] == "vllm_fused_moe"
    key = "fp8_block/3072/1536/8/256/2/1"
    tri, auto = KernelCostModel("minimax-m2", "b200", 2, moe_backend="triton"), KernelCostModel("minimax-m2", "b200", 2)
    assert tri.coverage["moe"] == auto.coverage["moe"] == key

    # 8192 tokens touch every expert: the slower routing of the Triton table, at a busy GPU's clocks
    us = max(_table_reading(doc["moe_triton"]["tables"][key])[8192], _table_reading(doc["moe_triton"]["skewed_tables"][key])[8192])
    f = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=8192, prefill_attn_pairs=8192 * 8193 // 2)
    m = get_model("minimax-m2")
    assert tri.breakdown(f)["moe"] == pytest.approx(m.num_moe_layers * us * tri.ovh.gemm_compute_slowdown * 1e-6)
    assert tri.breakdown(f)["moe"] > 1.5 * auto.breakdown(f)["moe"]   # FlashInfer's kernel: ~1.8x faster there
    q = dataclasses.replace(get_model("qwen3-235b-a22b"), weight_dtype="fp8_block")
    assert (KernelCostModel(q, "h200", 4, moe_backend="triton").breakdown(f)["moe"]
            == KernelCostModel(q, "h200", 4).breakdown(f)["moe"])
    with pytest.raises(ValueError, match="moe_backend='triton'.*b300"):
        KernelCostModel("minimax-m2", "b300", 2, moe_backend="triton")
    base = {"workload": {"num_requests": 4, "arrival": {"type": "poisson", "rate": 1.0},
                         "prompt_len": {"type": "fixed", "value": 100}, "output_len": {"type": "fixed", "value": 8}},
            "deployment": {"model": "minimax-m2", "device": "b200", "tp": 2}}
    sc = parse_scenario({**base, "cost_model": {"type": "kernels", "moe_backend": "triton"}})
    assert sc.cost_model.base.moe_backend == "triton"
    with pytest.raises(ScenarioError, match="moe_backend.*cutlass"):
        parse_scenario({**base, "cost_model": {"type": "kernels", "moe_backend": "cutlass"}})


def test_qwen3_vl_reads_as_its_qwen3_text_decoder_with_a_deepstack_vision_encoder():
    """Qwen3-VL's config.json (text_config of Qwen3 or Qwen3-MoE, a vision_config with DeepStack
    mergers) reads as the catalog entry; the vision encoder is a hand count; and the totals are the
    published sizes (8.77B, 236B)."""
    from sim.specs import qwen_vision_params
    vc = {"deepstack_visual_indexes": [8, 16, 24], "depth": 27, "hidden_size": 1152, "in_channels": 3,
          "intermediate_size": 4304, "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
          "spatial_merge_size": 2, "temporal_patch_size": 2}
    text = {"model_type": "qwen3_vl_moe_text", "num_hidden_layers": 94, "hidden_size": 4096,
            "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288,
            "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 262144, "dtype": "bfloat16"}
    cfg = {"model_type": "qwen3_vl_moe", "architectures": ["Qwen3VLMoeForConditionalGeneration"],
           "tie_word_embeddings": False, "text_config": text, "vision_config": vc}
    m, c = ModelSpec.from_hf_config(cfg), get_model("Qwen/Qwen3-VL-235B-A22B-Instruct")
    for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
              "vocab_size", "tie_word_embeddings", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "num_moe_layers", "qk_norm", "vision_params", "max_position_embeddings"):
        assert getattr(m, f) == getattr(c, f), f
    assert c.name == "qwen3-vl-235b-a22b" and m.num_params == c.num_params
    h, i, m4 = 1152, 4304, 4 * 1152
    block = 3 * (h * h + h) + h * h + h + h * i + i + i * h + h + 2 * 2 * h   # qkv, proj, fc1, fc2, two norms
    merger = m4 * m4 + m4 + m4 * 4096 + 4096                                  # fc1, fc2
    vit = 27 * block + 3 * 2 * 16 * 16 * h + h + 2304 * h + (2 * h + merger) + 3 * (2 * m4 + merger)
    assert qwen_vision_params(vc) == c.vision_params == vit
    assert (c.num_params + c.vision_params) / 1e9 == pytest.approx(236, abs=1)
    small = get_model("Qwen/Qwen3-VL-8B-Instruct")
    assert (small.num_params + small.vision_params) / 1e9 == pytest.approx(8.77, abs=0.01)
    # the vision encoder is loaded (memory) but a text step reads the text decoder's weights only
    assert small.weight_read_bytes_per_gpu(1) == get_model("qwen3-8b").weight_read_bytes_per_gpu(1)
    assert small.loaded_bytes_per_gpu(1) > get_model("qwen3-8b").loaded_bytes_per_gpu(1) + 2 * small.vision_params - 1
    assert get_model("Qwen/Qwen3-VL-32B-Thinking").name == "qwen3-vl-32b"
    assert get_model("Qwen/Qwen3-VL-235B-A22B-Instruct-FP8").weight_dtype == "fp8_block"


def test_step_flash_reads_its_sliding_and_full_layers_and_its_experts_counted_by_hand():
    """Step-3.7-Flash's config.json: 33 sliding-window (512) and 12 full-attention layers, MoE after
    the first 3 dense layers (288 experts, top 8, one shared); weights counted by hand (196B, as
    Step-3.5-Flash is published), KV per token in the full layers only; its -FP8 checkpoint is
    128x128 blocks (its quantization_config)."""
    c = get_model("stepfun-ai/Step-3.7-Flash")
    assert (c.num_sliding_layers, c.sliding_window, c.num_moe_layers) == (33, 512, 42)
    h = 4096
    attn = h * 64 * 128 + 2 * h * 8 * 128 + 64 * 128 * h
    dense = 3 * h * 11264
    moe = 288 * 3 * h * 1280 + 3 * h * 1280 + 288 * h
    params = 2 * 128896 * h + 45 * attn + 3 * dense + 42 * moe + 2 * 45 * h + h
    assert c.num_params == pytest.approx(params, abs=3 * 45)
    assert c.num_params / 1e9 == pytest.approx(196, abs=0.5)
    assert c.kv_bytes_per_token == 12 * 2 * 8 * 128 * 2
    assert get_model("stepfun-ai/Step-3.7-Flash-FP8").weight_dtype == "fp8_block"
    from sim.specs import ModelSpec as Spec
    cfg = {"model_type": "step3p7", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
           "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000, "intermediate_size": 512,
           "sliding_window": 64, "first_k_dense_replace": 1, "num_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 128, "share_expert_dim": 128,
           "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]}
    assert Spec.from_hf_config(cfg).shared_intermediate_size == 128   # one shared expert unless told
    with pytest.raises(ValueError, match="num_sliding_attention_heads=16"):
        Spec.from_hf_config({**cfg, "attention_other_setting": {"num_attention_heads": 16}})
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        Spec.from_hf_config({k: v for k, v in cfg.items() if k != "first_k_dense_replace"})
    assert get_model("XiaomiMiMo/MiMo-7B-Base").num_params == pytest.approx(
        2 * 151680 * h + 36 * (h * 32 * 128 + 2 * h * 8 * 128 + 32 * 128 * h + 3 * h * 11008 + 2 * h) + h)
