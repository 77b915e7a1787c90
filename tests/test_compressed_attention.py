"""DeepSeek-V4's compressed multi-query attention: its weights counted against transformers' own
model on a tiny random config, its sizes and cache by hand from the public configs, NVIDIA's
NVFP4 checkpoint read per layer kind, and a decode's attention composed per layer kind."""
import pytest
import torch

from sim.kernel_model import KernelCostModel
from sim.specs import ModelSpec, get_model

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
            head_dim=32, qk_rope_head_dim=8, q_lora_rank=48, o_groups=2, o_lora_rank=16, moe_intermediate_size=24,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, index_n_heads=2, index_head_dim=16,
            index_topk=4, sliding_window=8, hc_mult=4, compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1)


def test_weights_equal_transformers():
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4ForCausalLM
    torch.manual_seed(0)
    hf = DeepseekV4ForCausalLM(DeepseekV4Config(**TINY))
    ours = ModelSpec.from_hf_config({"model_type": "deepseek_v4", **TINY})
    # every matrix: projections, compressors and their position biases, experts, hyper-connections
    matrices = sum(p.numel() for p in hf.parameters() if p.dim() >= 2)
    assert ours.num_params - (ours.num_sublayers + 1) * ours.hidden_size == matrices
    assert (ours.num_csa_layers, ours.num_hca_layers, ours.index_layers) == (2, 1, 2)


def test_sizes_and_cache_by_hand_from_the_public_configs():
    flash, pro = get_model("deepseek-ai/DeepSeek-V4-Flash"), get_model("deepseek-ai/DeepSeek-V4-Pro")
    # published: 284B in all and 13B active (Flash), 1.6T and 49B (Pro), the MTP layer and the
    # input embedding left out
    for m, total, active in ((flash, 284e9, 13e9), (pro, 1.6e12, 49e9)):
        act = m.num_params - m.expert_params * (1 - 6 / m.num_experts) - m.embedding_params
        assert (m.num_params, act) == (pytest.approx(total, rel=0.02), pytest.approx(active, rel=0.03))
    # Flash: 2 window-only layers, 21 CSA, 20 HCA; an fp8 latent of 448 + 7 scales + a pad + 64 x 2
    assert (flash.num_csa_layers, flash.num_hca_layers, flash.latent_entry_bytes) == (21, 20, 584)
    # per token: a CSA layer's entry and indexer key (128 + a 4-byte scale) per 4 tokens, an HCA
    # layer's entry per 128; every layer's window of raw latents beside it
    assert flash.kv_bytes_per_token_per_gpu(8) == -(-(21 * (584 + 132) * 32 + 20 * 584) // 128)
    assert flash.sliding_kv_bytes_per_token_per_gpu(8) == 43 * 584
    # the experts MXFP4, the rest fp8 blocks; NVIDIA's NVFP4 checkpoint quantizes the experts alone
    assert (flash.weight_dtype, flash.expert_dtype, flash.kv_dtype) == ("fp8_block", "mxfp4", "fp8")
    nv = get_model("nvidia/DeepSeek-V4-Flash-NVFP4")
    assert (nv.weight_dtype, nv.expert_dtype) == ("fp8_block", "nvfp4")
    mixed = ModelSpec.from_hf_config({"model_type": "deepseek_v4", **TINY, "expert_dtype": "fp4",
                                      "quantization_config": {
                                          "quant_method": "fp8", "quant_algo": "MIXED_PRECISION",
                                          "weight_block_size": [128, 128], "quantized_layers": {
                                              f"layers.{i}.ffn.experts": {"quant_algo": "NVFP4"} for i in range(4)}}})
    assert (mixed.weight_dtype, mixed.expert_dtype) == ("fp8_block", "nvfp4")


def test_three_compression_ratios_are_refused():
    with pytest.raises(ValueError, match="compress_ratios"):
        ModelSpec.from_hf_config({"model_type": "deepseek_v4", **dict(TINY, compress_ratios=[0, 4, 16, 128, 0])})


def test_a_decode_reads_each_layer_kind_its_keys():
    m = get_model("deepseek-v4-flash")
    km = KernelCostModel(m, "h200", tp=8)
    n, y = 16, 40000.0
    look = lambda keys: km._look("generation_attention", km.g_gen, n, keys)  # noqa: E731
    # window 128; CSA: 128 + min(40000 / 4, 512) picked entries, after the indexer scored 10,000
    # entries of each sequence; HCA: 128 + 40000 / 128 entries
    want = (2 * look(128.0) + 21 * (look(128.0 + 512.0) + km._indexer_roof(n * y / 4, n, n * y / 4))
            + 20 * look(128.0 + y / 128))
    assert km._decode_attention(n, y) == pytest.approx(want, rel=1e-9)
    # a short context: the window holds all of it
    assert km._decode_attention(n, 100.0) < km._decode_attention(n, 1000.0) < km._decode_attention(n, y)


def test_a_prefill_chunk_reads_each_layer_kind_its_keys():
    """A 2,048-token chunk on 100k tokens of context: its queries see 128 raw tokens each, 512
    picked entries (CSA) or every one of (context + position) / 128 (HCA); the indexer scores the
    chunk's pairs over 4 and reads the cached entries once."""
    from engine.core.features import BatchFeatures
    m = get_model("deepseek-v4-flash")
    km = KernelCostModel(m, "h200", tp=8)
    f = BatchFeatures(num_reqs=1)
    f.add(2048, 100_000)
    T, pairs = f.num_prefill_tokens, f.prefill_attn_pairs
    ctx = pairs / T
    look = lambda keys: km._look("context_attention", km.g_ctx, 1, (2.0 * T * keys) ** 0.5)  # noqa: E731
    want = (2 * look(128.0) + 21 * (look(128.0 + 512.0) + km._indexer_roof(pairs / 4, T, (100_000 + T) / 4))
            + 20 * look(128.0 + ctx / 128))
    assert km._compressed_attention(1, pairs, 128.0, ctx, 100_000 + T, prefill=True) == pytest.approx(want, rel=1e-9)
    assert km._attention(f) == pytest.approx(want, rel=1e-9)


def test_an_fp8_repository_holds_fp8_experts():
    own, fp8 = get_model("deepseek-ai/DeepSeek-V4-Flash"), get_model("sgl-project/DeepSeek-V4-Flash-FP8")
    assert (own.expert_dtype, fp8.expert_dtype, fp8.weight_dtype) == ("mxfp4", "", "fp8_block")
    # the experts at one byte a weight (and a block scale) instead of 0.53
    assert fp8.expert_weight_bytes_per_gpu(1) == pytest.approx(own.expert_weight_bytes_per_gpu(1) / (0.5 + 1 / 32),
                                                              rel=0.001)
