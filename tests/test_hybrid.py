"""Linear-attention hybrids (Qwen3.5, Qwen3-Next): Gated DeltaNet layers read from config.json,
sized by hand (weights, KV of the attention layers only, a fixed state per request), refused
when not understood, and timed from the measured GDN kernel tables."""
import dataclasses
import warnings

import numpy as np
import pytest

from engine.core.features import BatchFeatures
from sim.kernel_model import KernelCostModel, load_tables
from sim.specs import GiB, ModelSpec, get_device, get_model, memory_breakdown

# Qwen3.5-397B-A17B's public config.json: the text_config fields the reader takes, and its
# vision_config (values as published)
QWEN35_397B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen3_5_moe_text", "attn_output_gate": True, "dtype": "bfloat16",
                    "full_attention_interval": 4, "head_dim": 256, "hidden_size": 4096,
                    "layer_types": [t for _ in range(15) for t in ("linear_attention",) * 3 + ("full_attention",)],
                    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
                    "linear_num_value_heads": 64, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
                    "mlp_only_layers": [], "moe_intermediate_size": 1024, "num_attention_heads": 32,
                    "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 60, "num_key_value_heads": 2,
                    "shared_expert_intermediate_size": 1024, "vocab_size": 248320, "mamba_ssm_dtype": "float32"},
    "vision_config": {"depth": 27, "hidden_size": 1152, "in_channels": 3, "intermediate_size": 4304,
                      "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2}}


def test_qwen35_397b_from_its_config_is_the_catalog_entry_and_its_published_size():
    m, c = ModelSpec.from_hf_config(QWEN35_397B), get_model("Qwen/Qwen3.5-397B-A17B")
    for f in ("num_layers", "num_linear_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_intermediate_size", "linear_num_v_heads", "linear_state_dtype", "attn_output_gate",
              "vision_params", "qk_norm"):
        assert getattr(m, f) == getattr(c, f), f
    assert m.weight_bytes == c.weight_bytes and m.num_linear_layers == 45 and m.num_full_attention_layers == 15
    # 397B parameters in all (text and vision), 17B active: all but the routed experts, and 10 of
    # each layer's 512
    assert (c.num_params + c.vision_params) == pytest.approx(397e9, rel=0.01)
    active = c.num_params - c.expert_params * (1 - 10 / 512)
    assert active == pytest.approx(17e9, rel=0.03)


def test_qwen35_layers_by_hand():
    m = get_model("qwen3.5-397b-a17b")
    h = 4096
    # a full-attention layer: q and its gate (2 x 32 x 256), k and v (2 x 2 x 256), o_proj
    assert m.attention_params_per_layer == 2 * h * 32 * 256 + 2 * h * 2 * 256 + 32 * 256 * h
    # a linear-attention layer: q, k (16 heads x 128 each), v and z (64 x 128 each) in one projection,
    # b and a (64 each), out_proj, the conv1d's 4 taps over q, k and v, A_log and dt_bias, the norm
    conv = 2 * 16 * 128 + 64 * 128
    assert m.linear_attention_params_per_layer == (h * (conv + 64 * 128) + h * 2 * 64 + 64 * 128 * h
                                                   + conv * 4 + 2 * 64 + 128)
    # KV: the 15 attention layers' 2 KV heads of 256, bf16
    assert m.kv_bytes_per_token == 15 * 2 * 2 * 256 * 2
    # per request and GPU at TP 8: each linear layer's conv window (3 inputs of conv / 8 channels,
    # bf16) and 8 value heads' 128 x 128 fp32 matrices
    assert m.linear_state_bytes_per_request_per_gpu(8) == 45 * (conv // 8 * 3 * 2 + 8 * 128 * 128 * 4)
    # GEMMs at TP 8: the gated q projection is twice as wide; the linear layers' projections split
    shapes = {name: (n, k, layers) for name, n, k, layers, _dt in m.step_gemms(8)}
    assert shapes["qkv"] == ((2 * 4 + 2 * 1) * 256, h, 15)
    assert shapes["in_proj_qkvz"] == ((conv + 64 * 128) // 8, h, 45)
    assert shapes["out_proj"] == (h, 64 * 128 // 8, 45)


def test_the_pool_holds_the_state_of_max_num_seqs_requests():
    m = get_model("qwen3.5-397b-a17b").with_dtypes(weight_dtype="fp8_block")
    d = get_device("h200")
    kw = dict(tp=8, gpu_memory_utilization=0.9, block_size=16, max_num_batched_tokens=8192)
    few, many = memory_breakdown(m, d, max_num_seqs=64, **kw), memory_breakdown(m, d, max_num_seqs=256, **kw)
    st = m.linear_state_bytes_per_request_per_gpu(8)
    assert few["linear_state_requests"] == 64 and many["linear_state_requests"] == 256
    # usable - loaded = reserve + the states + KV, at either max_num_seqs (the reserve's sampler
    # rows differ too)
    for b, n in ((few, 64), (many, 256)):
        assert b["usable_bytes"] - b["loaded_bytes_per_gpu"] == pytest.approx(
            b["reserve_bytes"] + n * st + b["kv_bytes_per_gpu"], rel=1e-12)
        assert b["kv_blocks"] == int(b["kv_bytes_per_gpu"] // (m.kv_bytes_per_token_per_gpu(8) * 16))
    # never more than half the pool: a deployment that holds fewer states still runs
    tight = memory_breakdown(m, d, max_num_seqs=100000, **kw)
    assert 0 < tight["linear_state_requests"] < 100000 and tight["kv_blocks"] > 0


@pytest.mark.parametrize("field, value, message", [
    ("layer_types", ["linear_attention", "sliding_attention"] * 30, "layer_types=['sliding_attention']"),
    ("layer_types", ["linear_attention"] * 10, "layer_types lists 10 layers"),
    ("linear_num_value_heads", None, "lacks 'linear_num_value_heads'")])
def test_a_hybrid_config_it_does_not_understand_is_refused_naming_the_field(field, value, message):
    cfg = {**QWEN35_397B, "text_config": dict(QWEN35_397B["text_config"])}
    cfg["text_config"][field] = value
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ModelSpec.from_hf_config(cfg)


def test_tp_must_divide_the_linear_heads():
    # 16 key heads: TP 32 would split a head (32 query heads allow it); the planner prunes it
    from scenarios.plan import prune_reason
    with pytest.raises(ValueError, match="deployment.tp=32: must divide the linear-attention heads"):
        KernelCostModel("qwen3.5-397b-a17b", "h200", 32)
    base = {"deployment": {"model": "qwen3.5-397b-a17b", "interconnect": {"bandwidth_gb_s": 50}},
            "workload": {"num_requests": 10, "arrival": {"type": "poisson", "rate": 1},
                         "prompt_len": {"type": "fixed", "value": 100}, "output_len": {"type": "fixed", "value": 10}}}
    cand = {"device": "h200", "tp": 32, "max_num_batched_tokens": 8192, "max_num_seqs": 64,
            "policy": "fcfs", "router": "round_robin", "pd": None}
    assert "does not divide the 16 linear-attention key heads" in prune_reason(base, cand, 110)


def _gdn(phase, key, device="h200_sxm"):
    tab = load_tables(device)["linear_attention"][phase][key]
    return tab


def test_linear_layers_read_the_measured_gdn_kernels():
    """A decode-only step's and a one-sequence prefill's token mixing: the 15 attention layers
    from the attention tables plus the 45 linear layers' GDN kernels read at a measured point of
    their tables (Grid's monotone suffix minimum, as the kernel model keeps it)."""
    m = get_model("qwen3.5-397b-a17b").with_dtypes(weight_dtype="fp8_block")
    k = KernelCostModel(m, "h200", 8)
    assert k.coverage["linear_attention_context"] == k.coverage["linear_attention_generation"] == "2/8/128/128"
    gen = _gdn("generation", "2/8/128/128")
    reading = dict(zip(gen["values"][0], np.minimum.accumulate(np.array(gen["us"])[::-1])[::-1]))
    n, y = 64, 1024
    f = BatchFeatures(num_reqs=n, num_decode_reqs=n, decode_context_tokens=n * y)
    att = k.breakdown(f)["attention"]
    full = 15 * k.g_gen(n, y)[0] * 1e-6
    assert att - full == pytest.approx(45 * reading[64] * 1e-6, rel=1e-9)
    # the decode fast path (memoised per batch) and the breakdown agree
    assert k.decode_gpu_time(n, n * y) == pytest.approx(sum(k.breakdown(f).values()), rel=1e-9)
    ctx = _gdn("context", "2/8/128/128")
    b_i, s_i = ctx["values"][0].index(1), ctx["values"][1].index(8192)
    us = np.array(ctx["us"], dtype=float)
    cell = np.nanmin(us[b_i:, s_i:])  # the suffix minimum at (1, 8192)
    f = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=8192, prefill_attn_pairs=8192 * 8193 // 2)
    att = k.breakdown(f)["attention"]
    full = 15 * k.g_ctx(1, np.sqrt(2.0 * (8192 * 8193 // 2)))[0] * 1e-6
    assert att - full == pytest.approx(45 * cell * 1e-6, rel=1e-9)
    assert not k.fallbacks.get("linear_attention")


def test_without_a_gdn_table_the_roofline_is_counted():
    m = get_model("qwen3.5-35b-a3b")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = KernelCostModel(m, "a100-80g", 1)
        assert k.coverage["linear_attention_generation"] is None
        f = BatchFeatures(num_reqs=8, num_decode_reqs=8, decode_context_tokens=8 * 512)
        k.breakdown(f)
    assert k.fallbacks["linear_attention"] >= 1
    # the roofline streams each request's state in and out once per layer
    st = m.linear_state_bytes_per_request_per_gpu(1) / m.num_linear_layers
    assert k._gdn_gen_roof(8) == pytest.approx(2 * 8 * st / get_device("a100-80g").mem_bandwidth + 5e-6)


def test_a_hybrid_runs_no_more_requests_than_the_pool_holds_states_for():
    """Qwen3.5-35B-A3B in bf16 on one H100: 70 GB of weights leave room for the 64 MB state of a
    few requests only; the scenario caps max_num_seqs there (saying so) and every request
    still finishes, never more of them running than that. (50 req/s of 100 output tokens keep
    about 50 in flight without the cap: it binds.)"""
    import pandas as pd
    from sim.scenario import parse_scenario, run_scenario
    m, d = get_model("qwen3.5-35b-a3b"), get_device("h100")
    held = memory_breakdown(m, d, 1, 0.9, 16, max_num_batched_tokens=2048, max_num_seqs=256)["linear_state_requests"]
    assert 1 <= held < 256
    data = {"deployment": {"model": "Qwen/Qwen3.5-35B-A3B", "device": "h100", "tp": 1},
            "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "block_size": 16},
            "workload": {"num_requests": 60, "arrival": {"type": "poisson", "rate": 50},
                         "prompt_len": {"type": "fixed", "value": 200}, "output_len": {"type": "fixed", "value": 100},
                         "client": {"type": "engine_direct"}}}  # the burst reaches the engine as sent
    sc = parse_scenario(data)
    assert sc.scheduler_config.max_num_seqs == held
    assert any(f"at most {held} run at once" in w for w in sc.warnings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = run_scenario(sc)
    assert res.summary["requests"]["completed"] == 60
    steps = pd.DataFrame(res.step_table)
    assert steps.num_running.max() == held  # (requests do queue: num_waiting > 0 meanwhile)
    assert steps.num_waiting.max() > 0


# GLM-5's public config.json (the fields the reader takes, values as published)
GLM_5 = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "dtype": "bfloat16",
         "first_k_dense_replace": 3, "hidden_size": 6144, "index_head_dim": 128, "index_n_heads": 32,
         "index_topk": 2048, "intermediate_size": 12288, "kv_lora_rank": 512, "max_position_embeddings": 202752,
         "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_routed_experts": 256, "n_shared_experts": 1,
         "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 78, "num_key_value_heads": 64,
         "q_lora_rank": 2048, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
         "tie_word_embeddings": False, "vocab_size": 154880}


def test_glm5_from_its_config_is_the_catalog_entry_and_its_published_size():
    m, c = ModelSpec.from_hf_config(GLM_5), get_model("zai-org/GLM-5")
    for f in ("num_layers", "num_moe_layers", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "q_lora_rank",
              "index_topk", "index_n_heads", "index_head_dim", "num_experts", "num_experts_per_tok"):
        assert getattr(m, f) == getattr(c, f), f
    assert m.weight_bytes == c.weight_bytes and c.num_moe_layers == 75
    assert c.num_params == pytest.approx(744e9, rel=0.01)                      # 744B parameters
    assert get_model("deepseek-ai/DeepSeek-V3.2").num_params == pytest.approx(671e9, rel=0.01)
    # KV per token and layer: the latent (512 + 64) in bf16 and the indexer's fp8 key with its
    # scale; with an fp8 cache vLLM's fp8_ds_mla layout (512 fp8, 4 fp32 scales, 64 bf16)
    assert c.kv_bytes_per_token == 78 * ((512 + 64) * 2 + 128 + 4)
    assert c.with_dtypes(kv_dtype="fp8").kv_bytes_per_token == 78 * (512 + 16 + 128 + 128 + 4)


# GLM-5.2's indexer_types (its public config.json): 21 of 78 layers with an indexer of their own,
# the others reusing the last one's top-k
GLM_52_INDEXERS = ["full"] * 3 + (["shared"] * 3 + ["full"]) * 18 + ["shared"] * 3


def test_shared_indexers_count_only_the_layers_with_their_own():
    """GLM-5.2: the layers whose indexer is 'shared' hold no indexer weights and cache no indexer
    keys (hand counts against GLM-5, which differs in nothing else); an unknown kind or a list of
    the wrong length is refused, naming the field."""
    g5 = ModelSpec.from_hf_config(GLM_5)
    g52 = ModelSpec.from_hf_config({**GLM_5, "indexer_types": GLM_52_INDEXERS})
    assert (g5.index_layers, g52.index_layers, g52.num_index_layers) == (78, 21, 21)
    assert g52 == dataclasses.replace(get_model("zai-org/GLM-5.2-FP8").with_dtypes(weight_dtype="bfloat16"),
                                      name=g52.name, max_position_embeddings=g52.max_position_embeddings)
    assert get_model("nvidia/GLM-5.3-NVFP4").num_index_layers == 21
    assert g52.kv_bytes_per_token == 78 * (512 + 64) * 2 + 21 * (128 + 4)
    index_params = 32 * 128 * 2048 + 128 * 6144 + 32 * 6144        # query (from the q latent), key, head weights
    assert g5.num_params - g52.num_params == pytest.approx(57 * index_params, abs=78)
    assert g5.weight_bytes - g52.weight_bytes == 57 * index_params * 2
    with pytest.raises(ValueError, match=r"indexer_types=\['partial'\]"):
        ModelSpec.from_hf_config({**GLM_5, "indexer_types": ["full", "partial"] * 39})
    with pytest.raises(ValueError, match=r"indexer_types=77"):
        ModelSpec.from_hf_config({**GLM_5, "indexer_types": ["full"] * 77})
    with pytest.raises(ValueError, match=r"indexer_types\[0\]='shared'"):
        ModelSpec.from_hf_config({**GLM_5, "indexer_types": ["shared"] * 78})


def test_shared_indexers_score_only_in_their_own_layers():
    """A decode's indexer streams the cached keys in the layers with an indexer only (21 of GLM-5.2's
    78); a fresh prefill read from vLLM's DSA layer table (measured with an indexer in every layer)
    gives back the indexer's roofline, its projections' and its scoring's, in each layer that
    shares one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g52 = ModelSpec.from_hf_config({**GLM_5, "indexer_types": GLM_52_INDEXERS})
        k5, k52 = KernelCostModel("glm-5", "h200", 8), KernelCostModel(g52, "h200", 8)
        n = 32

        def att(k, y):
            return k.breakdown(BatchFeatures(num_reqs=n, num_decode_reqs=n, decode_context_tokens=n * y))["attention"]
        extra_bytes = n * (16384 - 4096) * (128 + 4 + 8)
        assert att(k52, 16384) - att(k52, 4096) == pytest.approx(21 * extra_bytes / get_device("h200").mem_bandwidth,
                                                                 rel=1e-6)
        T = 8192
        f = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=T, prefill_attn_pairs=T * T // 2)
        roof = k52._indexer_roof(T * T // 2, T, T)
        assert k52.coverage["context_attention"] == k5.coverage["context_attention"]
        # the chunk's projections count the indexer's in 21 layers of 78; the table's reading is
        # what it was measured as (an indexer in every layer), so 57 layers give back the
        # indexer's projections and scoring, each by its roofline
        assert k52.g_mla_proj(T)[0] < k5.g_mla_proj(T)[0]
        proj = sum(k52._gemm_roof(g52.attn_dtype)(T, *g52.attention_gemm_shapes(8)[x])
                   for x in ("index_q", "index_k", "index_weights"))
        assert proj > 0 and k52.breakdown(f)["attention"] == pytest.approx(
            k5.breakdown(f)["attention"] - 57 * (roof + proj), rel=1e-6)


def test_sparse_attention_reads_the_top_k_and_its_indexer_every_token():
    """Past index_topk tokens of context a decode's latent attention reads no more; what grows is
    the indexer, which streams every cached fp8 key (128 bytes + a 4-byte scale) and writes and
    reads back an fp32 score for each: memory-bound at these sizes, so per layer the difference of
    two context lengths is their extra bytes over the bandwidth."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = KernelCostModel("glm-5", "h200", 8)
        n = 32

        def att(y):
            return k.breakdown(BatchFeatures(num_reqs=n, num_decode_reqs=n, decode_context_tokens=n * y))["attention"]
        extra_bytes = n * (16384 - 4096) * (128 + 4 + 8)
        assert att(16384) - att(4096) == pytest.approx(78 * extra_bytes / get_device("h200").mem_bandwidth, rel=1e-6)
        assert k.decode_gpu_time(n, n * 16384) == pytest.approx(
            sum(k.breakdown(BatchFeatures(num_reqs=n, num_decode_reqs=n, decode_context_tokens=n * 16384)).values()),
            rel=1e-9)
    assert k.fallbacks["indexer"] >= 2 and k.coverage["sparse_attention_indexer"] is None


def test_an_mla_prefill_reads_vllms_measured_mla_layer_and_its_decode_the_projections_apart():
    """DeepSeek-V3 at TP 8 on H200: a prefill's whole MLA layer (projections, RoPE, cache write,
    attention) is the `mla_module` table's reading, so the layer's GEMM term leaves the attention
    projections out; a decode's attention stays the latent-attention reading plus its tokens'
    projections from the GEMM tables by themselves."""
    k = KernelCostModel("deepseek-v3", "h200", 8)
    assert k.coverage["context_attention"].startswith("mla_module bf16/fp8_block/16")
    tab = load_tables("h200_sxm")["mla_module"]["context"]["bf16/fp8_block/16"]
    us = np.array(tab["us"], dtype=float)
    b_i, s_i = tab["values"][0].index(1), tab["values"][1].index(8192)
    cell = np.nanmin(us[b_i:, s_i:])  # the table's suffix minimum at (1, 8192), as Grid keeps it
    T = 8192
    # (the table's causal length is s = sqrt(2 pairs / b): pairs T^2 / 2 make it T)
    f = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=T, prefill_attn_pairs=T * T // 2)
    assert k.breakdown(f)["attention"] == pytest.approx(61 * cell * k.ovh.gemm_factor(T) * 1e-6, rel=1e-9)
    proj = set(get_model("deepseek-v3").attention_gemm_shapes(8))
    assert proj and not proj & {g[0] for g in k._step_gemms()}
    n, y = 32, 2048
    d = BatchFeatures(num_reqs=n, num_decode_reqs=n, decode_context_tokens=n * y)
    assert k.breakdown(d)["attention"] == pytest.approx(
        61 * (k.g_gen(n, y)[0] + k.g_mla_proj(n)[0]) * 1e-6, rel=1e-9)
    assert k.decode_gpu_time(n, n * y) == pytest.approx(sum(k.breakdown(d).values()), rel=1e-9)
    # an MLA shape the tables do not hold (Kimi-K2's at 64 heads does; DeepSeek-V2-Lite's 16 heads
    # of hidden 2048 not): the GEMM tables and the roofline as before
    import dataclasses
    lite = dataclasses.replace(get_model("deepseek-v3"), name="mla-other", hidden_size=2048, num_heads=16,
                               num_kv_heads=16, q_lora_rank=0)
    assert KernelCostModel(lite, "h200", 1).g_mla_proj is None


def test_an_mla_chunk_after_context_pays_its_own_projections_not_the_causal_lengths():
    """The MLA layer table is read at the chunks' causal length; its projections are those of
    b x s tokens, so the reading keeps the attention above them and adds the chunk's own tokens'
    projections: a 512-token chunk after 65,536 tokens of context costs the same attention as a
    fresh prefill of that causal length, less the projections of the tokens it does not have."""
    k = KernelCostModel("deepseek-v3", "h200", 8)
    T, ctx = 512, 65536
    pairs = T * ctx + T * (T + 1) // 2
    chunk = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=T, prefill_context_tokens=ctx,
                          prefill_attn_pairs=pairs)
    s = np.sqrt(2.0 * pairs)
    fresh_layer = k.g_ctx(1, s)[0]
    expected = 61 * (max(fresh_layer - k.g_mla_proj(s)[0], k._mla_flash_floor(1, s) * 1e6) + k.g_mla_proj(T)[0])
    assert k.breakdown(chunk)["attention"] == pytest.approx(expected * 1e-6, rel=1e-9)
    assert k.breakdown(chunk)["attention"] < 61 * fresh_layer * 1e-6 - 61 * 0.5 * k.g_mla_proj(s)[0] * 1e-6


def test_nvidia_nvfp4_checkpoints_by_name_and_their_bytes():
    """NVIDIA's -NVFP4 checkpoints: a dense model's linear layers in NVFP4 (4-bit values and an fp8
    scale per 16: 0.5625 bytes a weight), a mixture of experts' routed experts only (attention,
    router and shared experts stay 16-bit), and an fp8 KV cache."""
    dense = get_model("nvidia/Llama-3.1-70B-Instruct-NVFP4")
    assert (dense.name, dense.weight_dtype, dense.kv_dtype) == ("llama-3.1-70b", "nvfp4", "fp8")
    bf16 = get_model("llama-3.1-70b")
    linear = sum(layers * n * k for _nm, n, k, layers, _dt in bf16.step_gemms(1))
    # linear layers at 0.5625 bytes instead of 2; embeddings, LM head and norms stay 16-bit
    assert bf16.weight_bytes - dense.weight_bytes == pytest.approx(linear * (2 - 0.5625), rel=1e-9)
    moe = get_model("nvidia/MiniMax-M2.5-NVFP4")
    assert (moe.weight_dtype, moe.attn_dtype, moe.expert_dtype, moe.kv_dtype) == ("bfloat16", "bfloat16", "nvfp4", "fp8")
    assert moe.expert_weight_bytes_per_gpu(1) == pytest.approx(moe.expert_params * 0.5625, rel=1e-9)


def test_nvfp4_reads_blackwells_fp4_tables_and_runs_weight_only_elsewhere():
    """On B200 the NVFP4 GEMMs and experts read the measured FP4 kernels (gemm.nvfp4, moe nvfp4
    tables); on H200, which has no FP4 tensor cores, the roofline of a weight-only kernel (bf16
    math on 0.5625-byte weights), counted as a fallback."""
    k = KernelCostModel("nvidia/MiniMax-M2.5-NVFP4", "b200", 2)
    assert k.coverage["moe"].startswith("nvfp4/3072/1536/8/256/2/1")
    tab = load_tables("b200_sxm")["gemm"]["nvfp4"]
    assert "FlashInferCuteDsl" in tab["kernel"]
    d = KernelCostModel("nvidia/Llama-3.1-70B-Instruct-NVFP4", "b200", 2)
    assert d.coverage["gemm"] is True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = KernelCostModel("nvidia/Llama-3.1-70B-Instruct-NVFP4", "h200", 2)
        assert h.coverage["gemm"] is False
        roof = h._gemm_roof("nvfp4")
        M, N, K = 8192, 8192, 8192
        dev = get_device("h200")
        assert roof(M, N, K) == pytest.approx(max(2 * M * N * K / dev.flops,
                                                  (M * K * 2 + N * K * 0.5625 + M * N * 2) / dev.mem_bandwidth) + 2e-6)


def test_nvfp4_configs_are_read_as_the_checkpoints_quantize():
    from tests.test_moe import QWEN3_30B_A3B
    # compressed-tensors NVFP4 (4-bit float weights in groups of 16) that leaves attention in 16 bits
    ct = {"quant_method": "compressed-tensors", "ignore": ["lm_head", "model.layers.0.self_attn*"],
          "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16},
                                        "input_activations": {"num_bits": 4, "type": "float", "group_size": 16}}}}
    m = ModelSpec.from_hf_config({**QWEN3_30B_A3B, "quantization_config": ct})
    assert (m.weight_dtype, m.attn_dtype, m.expert_dtype) == ("bfloat16", "bfloat16", "nvfp4")
    # ModelOpt NVFP4 of a dense model: every linear layer but the LM head
    dense = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256, "torch_dtype": "bfloat16",
             "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}}
    assert ModelSpec.from_hf_config(dense).weight_dtype == "nvfp4"
    with pytest.raises(ValueError, match="quant_method='modelopt'"):
        ModelSpec.from_hf_config({**dense, "quantization_config": {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}})


def test_a_sparse_attention_prefill_reads_vllms_measured_dsa_layer():
    """GLM-5 at TP 8 on H200: a fresh prefill's whole sparse-attention layer (projections, the
    indexer, FlashMLA's sparse prefill) is the `dsa_module` table's reading at its measured points;
    the indexer's roofline is then not added, and its projections leave the layer's GEMM term."""
    k = KernelCostModel("glm-5", "h200", 8)
    assert k.coverage["context_attention"] == "dsa_module glm-5/bf16/bf16/8 (FLASHMLA_SPARSE)"
    tab = load_tables("h200_sxm")["dsa_module"]["context"]["glm-5/bf16/bf16/8"]
    us = np.array(tab["us"], dtype=float)
    b_i, s_i = tab["values"][0].index(1), tab["values"][1].index(8192)
    cell = np.nanmin(us[b_i:, s_i:])
    T = 8192
    f = BatchFeatures(num_reqs=1, num_prefill_reqs=1, num_prefill_tokens=T, prefill_attn_pairs=T * T // 2)
    before = dict(k.fallbacks)
    assert k.breakdown(f)["attention"] == pytest.approx(78 * cell * k.ovh.gemm_factor(T) * 1e-6, rel=1e-9)
    assert k.fallbacks.get("indexer", 0) == before.get("indexer", 0)
    assert not {"index_q", "q_a", "kv_b", "o_proj"} & {g[0] for g in k._step_gemms()}


def test_the_analytic_model_prices_a_gdn_layer_by_its_state_traffic_and_delta_rule():
    """Qwen3.5-27B on one H100 under the analytic roofline: one more decode request (no KV read)
    adds its per-request overhead, its linear-attention state read and written once in each of the
    48 GDN layers (conv window of 10,240 channels x 3 in bf16, 48 value heads of 128 x 128 in
    fp32), and its token's delta rule (2 x 128 x 128 multiply-adds per head and the 64-token
    chunk terms), counted by hand; the weights' time is the same (memory-bound either way)."""
    from sim.cost_model import AnalyticCostModel, Efficiency
    a = AnalyticCostModel("qwen3.5-27b", "h100-sxm", 1)
    e, d = Efficiency(), get_device("h100-sxm")
    state = 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4)
    per_token = 48 * 48 * (4 * 128 * 128 + 2 * 64 * 256) / (d.flops * e.attention_flops)

    def t(n):
        return a.step_time(BatchFeatures(num_reqs=n, num_decode_reqs=n))
    assert t(9) - t(8) == pytest.approx(e.per_req_overhead_s + 2 * state / (d.mem_bandwidth * e.bandwidth)
                                        + per_token, rel=1e-9)
    assert AnalyticCostModel("llama-3.1-8b", "h100-sxm", 1)._state_time_per_req == 0.0


def test_nemotron_h_blocks_read_from_the_pattern_and_counted_by_hand():
    """Nemotron-3 Nano's config.json: its 52 blocks (23 Mamba-2, 6 attention, 23 MoE) read from
    hybrid_override_pattern, every weight counted by hand (31.6B as published), KV in the 6
    attention blocks only, and each request's Mamba-2 state (conv window of x, B and C; a head_dim
    x state matrix per head in fp32) in the 23 others."""
    from sim.specs import NEMOTRON_H_CONFIGS
    cfg = NEMOTRON_H_CONFIGS["nemotron-3-nano-30b-a3b"]
    m = ModelSpec.from_hf_config(cfg)
    assert get_model("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16") == dataclasses.replace(
        m, name="nemotron-3-nano-30b-a3b")
    assert (m.num_layers, m.num_linear_layers, m.num_attention_layers, m.mlp_layers, m.num_moe_layers) == (29, 23, 6, 23, 23)
    h, d_inner, conv = 2688, 64 * 64, 64 * 64 + 2 * 8 * 128
    mamba = h * (2 * d_inner + 2 * 8 * 128 + 64) + conv * 4 + conv + 3 * 64 + d_inner + d_inner * h
    attn = h * 32 * 128 + 2 * h * 2 * 128 + 32 * 128 * h
    moe = 128 * 2 * h * 1856 + 2 * h * 3712 + 128 * h                 # routed (up, down), shared, router
    params = 2 * 131072 * h + 23 * mamba + 6 * attn + 23 * moe + 52 * h + h  # embeddings, head, block norms, final
    assert m.num_params == pytest.approx(params, abs=3 * 29)            # (per-layer averages truncate)
    assert m.num_params / 1e9 == pytest.approx(31.6, abs=0.05)
    assert m.kv_bytes_per_token == 6 * 2 * 2 * 128 * 2
    assert m.linear_state_bytes_per_request_per_gpu(1) == 23 * (conv * 3 * 2 + 64 * 64 * 128 * 4)
    big = get_model("nvidia/Nemotron-H-56B-Base-8K")
    assert big.num_params / 1e9 == pytest.approx(56.3, abs=0.1)
    # its config names no SSM cache dtype: vLLM keeps Nemotron-H's state in float32
    assert big.linear_state_bytes_per_request_per_gpu(1) == 54 * ((256 * 64 + 2 * 8 * 256) * 3 * 2
                                                                  + 256 * 64 * 256 * 4)
    # no rotary embedding: nothing loaded beside the weights
    assert m.loaded_bytes_per_gpu(1) == m.weight_bytes_per_gpu(1) and big.intermediate_size == 32768
    assert m.intermediate_size == 0  # (Nano has no dense MLP block)
    for bad, field in (({"mlp_hidden_act": "silu"}, "mlp_hidden_act='silu'"),
                       ({"hybrid_override_pattern": "X" + cfg["hybrid_override_pattern"][1:]}, "hybrid_override_pattern="),
                       ({"hybrid_override_pattern": "M*" * 26}, r"an MLP or MoE block")):
        with pytest.raises(ValueError, match=field):
            ModelSpec.from_hf_config({**cfg, **bad})


def test_nemotron_h_times_mamba_by_the_roofline_and_its_squared_relu_experts_from_the_gated_table():
    """No kernel table holds Mamba-2's kernels: its layers are the linear-attention roofline,
    counted as fallbacks. The fused-MoE table measured at Nano's shape timed gated (SwiGLU) experts:
    a squared-ReLU model reads it scaled by its own grouped-GEMM estimate over the gated one's, so
    a one-token step streams about two thirds of the measured bytes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = KernelCostModel("nemotron-3-nano-30b-a3b", "h100-sxm", 1)
        assert k.coverage["linear_attention_generation"] is None and k.coverage["linear_attention_context"] is None
        k.breakdown(BatchFeatures(num_reqs=4, num_decode_reqs=4, decode_context_tokens=4 * 512))
        assert k.fallbacks["linear_attention"] >= 1
    key = "bf16/2688/1856/6/128/1/1"
    assert k.coverage["moe"] == f"scaled from {key}"
    tab = load_tables("h100_sxm")["moe"]["tables"][key]
    measured_1 = tab["us"][tab["values"][0].index(1)]
    assert 0.55 < k.g_moe(1)[0] / measured_1 < 0.75


def test_nemotron_3_super_experts_work_in_their_latent_width():
    """Nemotron-3 Super (moe_latent_size 1024): each MoE block projects the hidden state (4096) down
    to the latent and back up, and its 512 routed experts (top 22) read and write the latent: their
    GEMMs are 1024 wide and the fused-MoE table is looked up at that width. Weights by hand: 120.7B
    in all, 12.8B active (published 120B-A12B); Ultra's block list (layers_block_type) 549B-A56B."""
    from sim.specs import NEMOTRON_H_CONFIGS
    cfg = NEMOTRON_H_CONFIGS["nemotron-3-super-120b-a12b"]
    m = get_model("nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16")
    assert m == dataclasses.replace(ModelSpec.from_hf_config(cfg), name=m.name)
    assert m.expert_gemms(1) == {"gate_up": (2688, 1024), "down": (1024, 2688)}
    assert {g[0]: g[1:3] for g in m.step_gemms(1)}["moe_latent_down"] == (1024, 4096)
    h, d_inner, conv = 4096, 128 * 64, 128 * 64 + 2 * 8 * 128
    mamba = h * (2 * d_inner + 2 * 8 * 128 + 128) + conv * 5 + 3 * 128 + d_inner + d_inner * h
    attn = 2 * h * 32 * 128 + 2 * h * 2 * 128
    routed = 512 * 2 * 1024 * 2688
    moe = routed + 2 * h * 5376 + 512 * h + 2 * h * 1024        # routed, shared, router, latent down and up
    params = 2 * 131072 * h + 40 * mamba + 8 * attn + 40 * moe + 88 * h + h
    assert m.num_params == pytest.approx(params, abs=3 * 48)
    active = params - 40 * routed + 40 * 22 * 2 * 1024 * 2688
    assert (m.num_params / 1e9, active / 1e9) == (pytest.approx(120.7, abs=0.05), pytest.approx(12.8, abs=0.05))
    blocks = {"M": "mamba", "*": "attention", "E": "moe"}
    ultra_cfg = {**NEMOTRON_H_CONFIGS["nemotron-3-ultra-550b-a55b"]}
    ultra_cfg["layers_block_type"] = [blocks[c] for c in ultra_cfg.pop("hybrid_override_pattern")]
    ultra = ModelSpec.from_hf_config({k: v for k, v in ultra_cfg.items() if k != "num_hidden_layers"})
    assert ultra == dataclasses.replace(get_model("nemotron-3-ultra-550b-a55b"), name=ultra.name)
    assert ultra.num_params / 1e9 == pytest.approx(549.3, abs=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = KernelCostModel(m, "h200", 2)
        wide = KernelCostModel(dataclasses.replace(m, moe_latent_size=0), "h200", 2)
    # read from a measured shape, scaled to the latent width: a one-token step streams 22 experts of
    # 2 x 1024 x 2688 weights, not of 2 x 4096 x 2688 as they would be without the latent
    assert k.coverage["moe"].startswith("scaled from bf16/2048/5120/22/512/2/1")  # Ultra's latent shape, measured
    assert k.g_moe(1)[0] < 0.4 * wide.g_moe(1)[0]
    assert k._dispatch_roof(1024) < wide._dispatch_roof(1024)
    with pytest.raises(ValueError, match="moe_latent_size=4096"):
        dataclasses.replace(m, moe_latent_size=4096)
    with pytest.raises(ValueError, match=r"layers_block_type=\['conv'\]"):
        ModelSpec.from_hf_config({**ultra_cfg, "layers_block_type": ["conv"] + ultra_cfg["layers_block_type"][1:]})
