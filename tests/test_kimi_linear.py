"""Kimi Delta Attention hybrids (Kimi-Linear, Kimi-K3): weights against transformers' own model,
Kimi-K3's sizes and caches by hand from its config.json, its MXFP4 experts, and refusals."""

import warnings

import pytest
import torch

from sim.kernel_model import KernelCostModel
from sim.scenario import parse_scenario, run_scenario
from sim.specs import ModelSpec, get_model

# A tiny Kimi-Linear in the hub's field names (linear_attn_config numbers layers from 1)
TINY = {"model_type": "kimi_linear", "num_hidden_layers": 5, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 96, "vocab_size": 512, "q_lora_rank": None,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 24,
        "first_k_dense_replace": 1, "tie_word_embeddings": False,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4], "num_heads": 4,
                               "head_dim": 16, "short_conv_kernel_size": 4}}


def _transformers_count(fields: dict) -> int:
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    hf = {k: v for k, v in fields.items() if k != "model_type"}
    hf.setdefault("pad_token_id", 0)
    with torch.device("meta"):
        model = KimiLinearForCausalLM(KimiLinearConfig(**hf))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("q_lora_rank", [None, 32])
def test_kimi_linear_weights_equal_transformers(q_lora_rank):
    """Every parameter (projections, conv taps, decay and step biases, norms, router) of
    transformers' KimiLinearForCausalLM equals ServeTwin's count."""
    fields = {**TINY, "q_lora_rank": q_lora_rank}
    ours = ModelSpec.from_hf_config(fields)
    assert ours.num_params == _transformers_count(fields)
    assert (ours.num_linear_layers, ours.linear_kind, ours.linear_gate_rank) == (4, "kda", 16)
    assert (ours.num_full_attention_layers, ours.kv_lora_rank, ours.num_moe_layers) == (1, 16, 4)
    # mla_use_nope: no rotary embedding, so no cos/sin cache in the loaded model
    nope = ModelSpec.from_hf_config({**fields, "mla_use_nope": True})
    assert ours.rotary and not nope.rotary
    assert ours.loaded_bytes_per_gpu(1) - nope.loaded_bytes_per_gpu(1) == ours.max_position_embeddings * 4 * 2


def test_kimi_linear_48b_is_the_published_size():
    m = get_model("moonshotai/Kimi-Linear-48B-A3B-Instruct")
    fields = {"num_hidden_layers": 27, "hidden_size": 2304, "num_attention_heads": 32, "num_key_value_heads": 32,
              "intermediate_size": 9216, "q_lora_rank": None, "num_experts": 256, "num_experts_per_token": 8,
              "num_shared_experts": 1, "moe_intermediate_size": 1024, "kv_lora_rank": 512,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840,
              "tie_word_embeddings": False, "first_k_dense_replace": 1,
              "linear_attn_config": {"kda_layers": [i for i in range(1, 27) if i % 4],
                                     "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "num_heads": 32,
                                     "head_dim": 128, "short_conv_kernel_size": 4}}
    assert m.num_params == _transformers_count(fields)
    # active: 8 of 256 experts, without the input embedding (a row gather)
    active = m.num_params - m.expert_params * (1 - 8 / 256) - 163840 * 2304
    assert (m.num_params, active) == (pytest.approx(48e9, rel=0.03), pytest.approx(3e9, rel=0.05))
    # the cache: 7 latent layers x (512 + 64) x 2 bytes a token; per request and layer 32 fp32
    # states of 128 x 128 and the conv's last 3 inputs of q, k and v (3 x 4096 channels, bf16)
    assert m.kv_bytes_per_token_per_gpu(1) == 7 * 576 * 2
    assert m.linear_state_bytes_per_request_per_gpu(1) == 20 * (32 * 128 * 128 * 4 + 3 * 4096 * 3 * 2)


def test_kimi_k3_by_hand_from_its_config():
    """Kimi-K3 (93 layers: 69 KDA with a full-rank output gate, 24 MLA with an output gate; layer
    0 a dense MLP, then a latent MoE of 896 experts in 3,584 wide, top 16, two shared experts),
    counted by hand."""
    m = get_model("moonshotai/Kimi-K3")
    h, V, H, d = 7168, 163840, 96, 128
    kda = (4 * h * H * d              # q, k, v and the output gate
           + h * (H + d)              # the step sizes and the forget gate's down projection
           + d * H * d                # its up projection, a decay per key channel
           + H * d * h                # output
           + 3 * H * d * 4            # the short conv's taps over q, k and v
           + H + H * d + d)           # A_log, dt_bias, the gated norm
    mla = (h * 1536 + 1536 * H * 192  # q down and up (nope 128 + rope 64)
           + h * (512 + 64) + 512 * H * (128 + 128)  # the latent and its up projection to keys and values
           + H * 128 * h + h * H * 128               # o_proj and the output gate
           + 512 + 1536)                             # the latent's two norms
    moe = (896 * 3 * 3584 * 3072      # routed experts, in the latent width
           + 3 * h * 2 * 3072         # two shared experts
           + 896 * h                  # router
           + 2 * h * 3584)            # latent down and up
    total = 69 * kda + 24 * mla + 3 * h * 33792 + 92 * moe + 2 * 93 * h + h + 2 * V * h
    assert m.num_params == total
    assert m.num_params == pytest.approx(2.8e12, rel=0.01)
    assert (m.expert_dtype, m.weight_dtype, m.moe_latent_size) == ("mxfp4", "bfloat16", 3584)
    # MXFP4 experts: half a byte a weight and a byte of scale per 32; everything else bf16 (the
    # byte count leaves out the KDA layers' conv taps and biases: 11 M weights of 2.8 T)
    experts = 92 * 896 * 3 * 3584 * 3072
    assert m.weight_bytes == pytest.approx(experts * (0.5 + 1 / 32) + (total - experts) * 2, rel=2e-5)
    assert m.kv_bytes_per_token_per_gpu(8) == 24 * 576 * 2   # the latent is on every rank
    # fp32 states split by TP: 12 heads a GPU at TP 8
    assert m.linear_state_bytes_per_request_per_gpu(8) == 69 * (12 * d * d * 4 + 3 * 12 * d * 3 * 2)


def test_mxfp4_compressed_tensors_and_bad_layouts_are_named():
    base = dict(TINY)
    q = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
         "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}},
         "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}
    m = ModelSpec.from_hf_config({**base, "quantization_config": q})
    assert (m.weight_dtype, m.expert_dtype) == ("bfloat16", "mxfp4")
    for kept in ([], q["ignore"][:1], q["ignore"][:2]):  # an MXFP4 attention, shared expert or dense MLP
        with pytest.raises(ValueError, match="quantization_config.ignore"):
            ModelSpec.from_hf_config({**base, "quantization_config": {**q, "ignore": kept}})
    lac = dict(TINY["linear_attn_config"], full_attn_layers=[4, 5])
    with pytest.raises(ValueError, match="linear_attn_config: kda_layers"):
        ModelSpec.from_hf_config({**base, "linear_attn_config": lac})
    with pytest.raises(ValueError, match="lacks 'linear_attn_config'"):
        ModelSpec.from_hf_config({k: v for k, v in base.items() if k != "linear_attn_config"})
    with pytest.raises(ValueError, match="moe_layer_freq=2"):
        ModelSpec.from_hf_config({**base, "moe_layer_freq": 2})


def test_kda_layers_are_timed_and_scale_with_the_batch():
    """A decode step's attention reads every request's KDA state: on B300 at TP 8, each more request
    adds its 69 layers' fp32 states and conv windows, read and written, at the GPU's bandwidth (the
    roofline: no table holds KDA's kernels, so every lookup is a counted fallback)."""
    from engine.core.features import BatchFeatures
    cm = KernelCostModel("kimi-k3", "b300", tp=8)
    m = get_model("kimi-k3")
    att = [cm.breakdown(BatchFeatures(num_reqs=n, num_decode_reqs=n, decode_context_tokens=n * 2048))["attention"]
           for n in (8, 64)]
    state = m.linear_state_bytes_per_request_per_gpu(8)
    latent = 24 * 576 * 2 * 2048  # the MLA layers' latents of 2,048 tokens a request
    assert att[1] - att[0] == pytest.approx(56 * (2 * state + latent) / 7.75e12, rel=0.02)
    assert "linear_attention_generation" in cm.coverage and cm.coverage["linear_attention_generation"] is None
    assert cm.fallbacks.get("linear_attention", 0) > 0


def test_kimi_k3_serves_on_eight_b300s():
    """2.8 T parameters fit 8 B300s (1.56 TB of weights); every request is served, and a decode step
    takes at least the time to stream each GPU's non-expert weights once."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sc = parse_scenario({"name": "k3", "seed": 0, "deployment": {"model": "kimi-k3", "device": "b300", "tp": 8},
                             "workload": {"benchmark": {"concurrency": 8, "isl": 1024, "osl": 32, "num_prompts": 16}}})
        s = run_scenario(sc).summary
    m = get_model("kimi-k3")
    assert s["ttft_s"]["count"] == 16
    assert s["tpot_s"]["p50"] > m.dense_weight_bytes_per_gpu(8) / 7.75e12


def test_glm53_flash_equals_transformers_at_full_size():
    """GLM-5.3-Flash (glm5_next_text): every parameter of transformers' Glm5NextTextModel and the LM
    head, less the indexer's key LayerNorm (weight and bias of index_head_dim, not counted)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel
    from sim.specs import GLM53_FLASH
    hf = {k: v for k, v in GLM53_FLASH.items() if k not in ("model_type", "torch_dtype", "quantization_config")}
    with torch.device("meta"):
        model = Glm5NextTextModel(Glm5NextTextConfig(**hf))
    theirs = sum(p.numel() for p in model.parameters()) + 154880 * 4096   # and the LM head
    m = get_model("zai-org/GLM-5.3-Flash")
    assert theirs - m.num_params == m.index_layers * 2 * 128
    assert (m.num_linear_layers, m.index_layers, m.index_pool, m.residual_streams) == (34, 11, 4, 4)
    assert (m.weight_dtype, m.attn_weight_dtype, m.expert_dtype or m.weight_dtype) == ("fp8_block", "bfloat16", "fp8_block")
    # cache per token: 11 latent layers of 512 in bf16 (no RoPE part), and each one's pooled
    # indexer key, 128 fp8 and a 4-byte scale per 4 tokens (33 bytes)
    assert m.kv_bytes_per_token_per_gpu(4) == 11 * 512 * 2 + 11 * 33


def test_a_key_pool_divides_the_indexers_scoring_and_cache():
    """With a pool of 4 the indexer scores and reads what the same layout without one would for a
    quarter of the pairs and keys (its top-k indices are the same), and the step is shorter."""
    import dataclasses
    from engine.core.features import BatchFeatures
    pooled = get_model("glm-5.3-flash")
    plain = dataclasses.replace(pooled, index_pool=1)
    f = BatchFeatures(num_reqs=32, num_decode_reqs=32, decode_context_tokens=32 * 65536)
    a, b = (KernelCostModel(m, "h200", tp=4) for m in (pooled, plain))
    pairs = 32 * 65536
    assert a._indexer_roof(pairs, 32, pairs) == pytest.approx(b._indexer_roof(pairs / 4, 32, pairs / 4), rel=1e-12)
    assert b._indexer_roof(pairs, 32, pairs) > 3 * a._indexer_roof(pairs, 32, pairs)
    assert a.step_time(f) < b.step_time(f)
    assert plain.kv_bytes_per_token_per_gpu(1) - pooled.kv_bytes_per_token_per_gpu(1) == 11 * (132 - 33)


def test_glm53_flash_read_as_transformers_writes_it_and_with_its_defaults():
    """transformers names the sparse layers indexed_attention when it saves a config; a config
    without the pool, streams or dense-layer fields takes transformers' defaults (16, 4, 3)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from sim.specs import GLM53_FLASH
    hf = {k: v for k, v in GLM53_FLASH.items() if k not in ("model_type", "torch_dtype", "quantization_config")}
    saved = {**Glm5NextTextConfig(**hf).to_dict(), "model_type": "glm5_next_text"}
    assert "indexed_attention" in saved["layer_types"]
    assert ModelSpec.from_hf_config(saved).num_params == get_model("glm-5.3-flash").num_params
    bare = {k: v for k, v in GLM53_FLASH.items() if k not in ("index_kpool", "hc_mult", "mlp_layer_types",
                                                               "layer_types", "quantization_config")}
    m = ModelSpec.from_hf_config(bare)
    assert (m.index_pool, m.residual_streams, m.num_moe_layers, m.num_linear_layers) == (16, 4, 42, 34)
    with pytest.raises(ValueError, match="index_topk_pattern"):
        ModelSpec.from_hf_config({**bare, "indexer_types": None, "index_topk_pattern": "FS" * 22 + "F"})


def test_glm53_flash_decode_attention_counts_each_layer_kind_once():
    """A decode step's attention: the 34 KDA layers' state traffic, and in the 11 latent layers
    the attention over at most index_topk keys and the pooled indexer, each read from the model's
    own grids and rooflines."""
    from engine.core.features import BatchFeatures
    cm = KernelCostModel("glm-5.3-flash", "h200", tp=4)
    n, ctx = 32, 8192
    att = cm.breakdown(BatchFeatures(num_reqs=n, num_decode_reqs=n, decode_context_tokens=n * ctx))["attention"]
    kda = 34 * cm.g_gdn_gen(n)[0] * 1e-6          # (grids in microseconds)
    latent = 11 * (cm.g_gen(n, min(ctx, 2048))[0] * 1e-6 + cm._indexer_roof(n * ctx, n, n * ctx))
    assert att == pytest.approx(kda + latent, rel=0.02)
