"""Models added by name and config: GLM-4.5/4.6/4.7 (glm4_moe), DeepSeek-V2-Lite, Qwen2.5-VL,
Phi-3.5/4-mini and Granite against transformers' own models; Mistral Large 2 by hand; fine-tunes
read as their base shape; NVIDIA's -FP4 checkpoint names."""

import pytest
import torch

from sim.specs import GLM4_MOE_CONFIGS, ModelSpec, get_model


def _matrices(fields: dict) -> int:
    """Weights of transformers' Glm4MoeForCausalLM in its linear layers, experts and embeddings
    (2-D and up), built on the meta device: what ServeTwin counts exactly (biases and norm
    weights only approximately)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    hf = {k: v for k, v in fields.items() if k not in ("model_type", "torch_dtype")}
    hf.setdefault("pad_token_id", 0)
    with torch.device("meta"):
        model = Glm4MoeForCausalLM(Glm4MoeConfig(**hf))
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2)


def _our_matrices(m: ModelSpec) -> int:
    """ServeTwin's count less the norm weights it adds (one per sublayer, and the final one)."""
    return m.num_params - (m.num_sublayers + 1) * m.hidden_size


def test_tiny_glm4_moe_weights_equal_transformers():
    fields = {"model_type": "glm4_moe", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96, "vocab_size": 512,
              "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 24,
              "first_k_dense_replace": 1, "attention_bias": True, "use_qk_norm": True, "tie_word_embeddings": False}
    ours = ModelSpec.from_hf_config(fields)
    assert _our_matrices(ours) == _matrices(fields)
    assert (ours.num_moe_layers, ours.shared_intermediate_size, ours.qk_norm, ours.is_mla) == (3, 24, True, False)


@pytest.mark.parametrize("name", sorted(GLM4_MOE_CONFIGS))
def test_glm4_moe_catalog_at_full_size_equals_transformers(name):
    assert _our_matrices(get_model(name)) == _matrices(GLM4_MOE_CONFIGS[name])


def test_published_sizes_and_cache_by_hand():
    # GLM-4.5: 355B with its MTP layer, 32B active without the embedding and LM head; Air 106B and 12B
    for name, experts, total, active in (("zai-org/GLM-4.5", 160, 353e9, 32e9), ("zai-org/GLM-4.5-Air", 128, 106e9, 12e9)):
        m = get_model(name)
        act = m.num_params - m.expert_params * (1 - 8 / experts) - 2 * m.vocab_size * m.hidden_size
        assert (m.num_params, act) == (pytest.approx(total, rel=0.01), pytest.approx(active, rel=0.03))
    g = get_model("zai-org/GLM-4.7")
    assert g.name == "glm-4.6" and g.max_position_embeddings == 202752
    # 92 layers x 8 KV heads x (128 + 128) x 2 bytes a token; one KV head a GPU at TP 8
    assert g.kv_bytes_per_token_per_gpu(1) == 92 * 8 * 256 * 2
    assert g.kv_bytes_per_token_per_gpu(8) == 92 * 1 * 256 * 2
    assert get_model("zai-org/GLM-4.5-FP8").weight_dtype == "fp8_block"   # zai-org's fp8: 128x128 blocks


def test_mistral_large_2_by_hand():
    m = get_model("mistralai/Mistral-Large-Instruct-2411")
    h, L, inter, V = 12288, 88, 28672, 32768
    layer = h * 96 * 128 + 2 * h * 8 * 128 + 96 * 128 * h + 3 * h * inter + 2 * h
    assert m.num_params == L * layer + 2 * V * h + h
    assert m.num_params == pytest.approx(123e9, rel=0.01)
    assert get_model("mistralai/Mistral-Large-Instruct-2407").name == "mistral-large-2411"
    # a catalog name that ends in four digits is not a date to drop
    assert get_model("Mistral-Large-2411").name == "mistral-large-2411"
    assert get_model("neuralmagic/Mistral-Large-2411-FP8").weight_dtype == "fp8"


def test_a_dense_config_windowing_every_layer_is_refused():
    # Mistral-7B-v0.1 and Phi-3-mini-4k window every layer (vLLM's model-wide sliding window)
    base = {"model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
            "max_position_embeddings": 32768}
    with pytest.raises(ValueError, match="sliding_window=4096"):
        ModelSpec.from_hf_config({**base, "sliding_window": 4096})
    # none, one as long as the context, or one turned off (Qwen2's use_sliding_window false) is read
    for extra in ({"sliding_window": None}, {"sliding_window": 32768}, {"sliding_window": 4096, "use_sliding_window": False}):
        assert ModelSpec.from_hf_config({**base, **extra}).num_sliding_layers == 0


def test_nvidia_fp4_names_are_nvfp4_checkpoints():
    r1 = get_model("nvidia/DeepSeek-R1-0528-FP4-v2")
    assert (r1.name, r1.expert_dtype, r1.weight_dtype, r1.kv_dtype) == ("deepseek-v3", "nvfp4", "bfloat16", "fp8")
    assert get_model("nvidia/DeepSeek-R1-FP4").expert_dtype == "nvfp4"
    dense = get_model("nvidia/Llama-3.3-70B-Instruct-FP4")
    assert (dense.name, dense.weight_dtype) == ("llama-3.1-70b", "nvfp4")
    with pytest.raises(ValueError, match="unknown"):
        get_model("someone/gpt-oss-120b-mxfp4")   # not an NVFP4 name: refused, not misread


def test_fine_tunes_and_variants_read_as_their_base_shape():
    pairs = {"Qwen/Qwen2.5-Coder-32B-Instruct": "qwen2.5-32b", "Qwen/Qwen2.5-Coder-7B-Instruct": "qwen2.5-7b",
             "nvidia/Llama-3.1-Nemotron-70B-Instruct-HF": "llama-3.1-70b",
             "NousResearch/Hermes-3-Llama-3.1-8B": "llama-3.1-8b", "meta-llama/Llama-Guard-3-8B": "llama-3.1-8b",
             "mistralai/Devstral-Small-2505": "mistral-small-24b", "openai/gpt-oss-safeguard-20b": "gpt-oss-20b"}
    for repo, name in pairs.items():
        assert get_model(repo).name == name, repo
    # Mistral Small 3.1 serves 131,072 positions where 2501 served 32,768
    assert get_model("mistralai/Mistral-Small-3.1-24B-Instruct-2503").max_position_embeddings == 131072
    assert get_model("mistralai/Mistral-Small-24B-Instruct-2501").max_position_embeddings == 32768
    # Qwen2.5's small sizes, published 0.49B, 1.54B and 3.09B (tied embeddings)
    for repo, size in (("Qwen/Qwen2.5-0.5B-Instruct", 0.49e9), ("Qwen/Qwen2.5-1.5B-Instruct", 1.54e9),
                       ("Qwen/Qwen2.5-3B-Instruct", 3.09e9)):
        m = get_model(repo)
        assert m.tie_word_embeddings and m.num_params == pytest.approx(size, rel=0.01), repo


TINY_DENSE = {"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 96, "vocab_size": 512}


def _tiny_dense_matrices_equal(model_type: str, config_cls, model_cls, tie: bool) -> bool:
    """A tiny dense config of model_type: ServeTwin's weight matrices against transformers' model."""
    fields = {**TINY_DENSE, "tie_word_embeddings": tie}
    with torch.device("meta"):
        hf = model_cls(config_cls(**fields, pad_token_id=0))
    ours = ModelSpec.from_hf_config({"model_type": model_type, **fields})
    return _our_matrices(ours) == sum(p.numel() for p in hf.parameters() if p.dim() >= 2)


def test_phi3_weights_equal_transformers_and_the_minis_are_their_published_size():
    from transformers import Phi3Config, Phi3ForCausalLM
    assert _tiny_dense_matrices_equal("phi3", Phi3Config, Phi3ForCausalLM, tie=False)
    for repo, size in (("microsoft/Phi-3.5-mini-instruct", 3.82e9), ("microsoft/Phi-4-mini-instruct", 3.84e9)):
        assert get_model(repo).num_params == pytest.approx(size, rel=0.005), repo


def test_deepseek_v2_lite_equals_transformers_and_its_published_size():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    m = get_model("deepseek-ai/DeepSeek-V2-Lite-Chat")
    fields = dict(num_hidden_layers=27, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                  intermediate_size=10944, vocab_size=102400, q_lora_rank=None, kv_lora_rank=512,
                  qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64,
                  num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408, first_k_dense_replace=1,
                  tie_word_embeddings=False, pad_token_id=0)
    with torch.device("meta"):
        hf = DeepseekV2ForCausalLM(DeepseekV2Config(**fields))
    assert m.num_params == sum(p.numel() for p in hf.parameters())   # every parameter, norms included
    # published: 15.7B, 2.4B activated (6 of 64 experts; the input embedding is a gather)
    active = m.num_params - m.expert_params * (1 - 6 / 64) - 102400 * 2048
    assert (m.num_params, active) == (pytest.approx(15.7e9, rel=0.005), pytest.approx(2.4e9, rel=0.03))
    assert get_model("deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct").name == "deepseek-v2-lite"
    assert m.kv_bytes_per_token_per_gpu(4) == 27 * (512 + 64) * 2   # the latent on every rank


def test_qwen25_vl_vision_encoder_equals_transformers_and_the_hub_layout_reads_as_the_catalog():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    vision = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
              "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu"}
    # Qwen2.5-VL-7B-Instruct's config.json: the text model's fields at the top level
    hub = {"model_type": "qwen2_5_vl", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
           "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 128000,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vision_config": vision}
    with torch.device("meta"):
        hf = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**{k: v for k, v in hub.items() if k != "model_type"}))
    tower = sum(p.numel() for n, p in hf.named_parameters() if ".visual." in f".{n}")
    read, cat = ModelSpec.from_hf_config(hub), get_model("Qwen/Qwen2.5-VL-7B-Instruct")
    assert read.vision_params == cat.vision_params == tower
    assert (read.num_params, read.max_position_embeddings) == (cat.num_params, 128000)
    assert cat.num_params + cat.vision_params == pytest.approx(8.29e9, rel=0.005)   # published 8.29B


def test_granite_reads_as_llamas_weights_and_the_catalog_sizes_are_published():
    from transformers import GraniteConfig, GraniteForCausalLM
    assert _tiny_dense_matrices_equal("granite", GraniteConfig, GraniteForCausalLM, tie=True)
    for repo, size in (("ibm-granite/granite-3.3-8b-instruct", 8.17e9), ("ibm-granite/granite-3.3-2b-instruct", 2.53e9),
                       ("mistralai/Codestral-22B-v0.1", 22.2e9)):
        assert get_model(repo).num_params == pytest.approx(size, rel=0.005), repo


def test_qwen2_moe_catalog_equals_transformers_less_the_shared_expert_gates():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    for repo, total, active in (("Qwen/Qwen1.5-MoE-A2.7B-Chat", 14.3e9, 2.7e9), ("Qwen/Qwen2-57B-A14B-Instruct", 57.4e9, 14.2e9)):
        m = get_model(repo)
        fields = dict(num_hidden_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
                      num_key_value_heads=m.num_kv_heads, intermediate_size=m.intermediate_size,
                      moe_intermediate_size=m.moe_intermediate_size, num_experts=m.num_experts,
                      num_experts_per_tok=m.num_experts_per_tok,
                      shared_expert_intermediate_size=m.shared_intermediate_size, vocab_size=m.vocab_size,
                      tie_word_embeddings=False, pad_token_id=0)
        with torch.device("meta"):
            hf = Qwen2MoeForCausalLM(Qwen2MoeConfig(**fields))
        # transformers' shared_expert_gate: one column of hidden_size a layer, which ServeTwin leaves out
        assert sum(p.numel() for p in hf.parameters() if p.dim() >= 2) - _our_matrices(m) == m.num_layers * m.hidden_size
        act = m.num_params - m.expert_params * (1 - m.num_experts_per_tok / m.num_experts)
        assert (m.num_params, act) == (pytest.approx(total, rel=0.005), pytest.approx(active, rel=0.01)), repo
