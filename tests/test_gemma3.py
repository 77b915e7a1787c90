"""Gemma-3 (gemma3, gemma3_text) against transformers' own models: the text decoder's weight
matrices, the SigLIP vision tower and projector parameter for parameter, and its windows."""

import pytest
import torch

from sim.specs import GEMMA3_CONFIGS, ModelSpec, get_model


def _text_matrices(fields: dict) -> int:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    hf = {k: v for k, v in fields.items() if k not in ("model_type", "torch_dtype")}
    with torch.device("meta"):
        model = Gemma3ForCausalLM(Gemma3TextConfig(**hf))
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2)


def _our_matrices(m: ModelSpec) -> int:
    """ServeTwin's count less the norm weights it adds (one per sublayer, and the final one)."""
    return m.num_params - (m.num_sublayers + 1) * m.hidden_size


@pytest.mark.parametrize("name", sorted(GEMMA3_CONFIGS))
def test_text_decoders_at_full_size_equal_transformers(name):
    m = get_model(name)
    assert _our_matrices(m) == _text_matrices(GEMMA3_CONFIGS[name])
    # every sixth layer full, the rest sliding, as transformers lays them out
    from transformers import Gemma3TextConfig
    hf = Gemma3TextConfig(**{k: v for k, v in GEMMA3_CONFIGS[name].items() if k not in ("model_type", "torch_dtype")})
    assert m.num_sliding_layers == hf.layer_types.count("sliding_attention")


def test_vision_tower_and_projector_equal_transformers():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    text = {k: v for k, v in GEMMA3_CONFIGS["gemma-3-27b"].items() if k not in ("model_type", "torch_dtype")}
    vision = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "patch_size": 14,
              "image_size": 896, "num_attention_heads": 16, "vision_use_head": False}
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision))
    tower = sum(p.numel() for n, p in model.named_parameters() if "language_model" not in n and "lm_head" not in n)
    m = get_model("google/gemma-3-27b-it")
    assert m.vision_params == tower
    assert m.num_params + m.vision_params == pytest.approx(27.4e9, rel=0.005)   # published 27B: 27.4B in all


def test_windows_and_cache_by_hand():
    m = get_model("google/gemma-3-27b-it")
    # 10 full layers x 16 KV heads x (128 + 128) x 2 bytes a token; 52 sliding layers hold 1,024 tokens
    assert m.kv_bytes_per_token_per_gpu(1) == 10 * 16 * 256 * 2
    assert m.sliding_kv_bytes_per_token_per_gpu(1) == 52 * 16 * 256 * 2
    one = get_model("google/gemma-3-1b-it")
    assert (one.sliding_window, one.vision_params, one.max_position_embeddings) == (512, 0, 32768)
    listed = ModelSpec.from_hf_config({**GEMMA3_CONFIGS["gemma-3-4b"], "layer_types": ["full_attention"] * 34})
    assert listed.num_sliding_layers == 0    # layer_types, where given, decide
    with pytest.raises(ValueError, match="layer_types"):
        ModelSpec.from_hf_config({**GEMMA3_CONFIGS["gemma-3-4b"], "layer_types": ["chunked_attention"] * 34})


def _gemma2_matrices(fields: dict) -> int:
    from transformers import Gemma2Config, Gemma2ForCausalLM
    hf = {k: v for k, v in fields.items() if k not in ("model_type", "torch_dtype")}
    with torch.device("meta"):
        model = Gemma2ForCausalLM(Gemma2Config(**hf))
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2)


@pytest.mark.parametrize("name", ["gemma-2-2b", "gemma-2-9b", "gemma-2-27b"])
def test_gemma2_at_full_size_equals_transformers_and_alternates_windows(name):
    from sim.specs import GEMMA2_CONFIGS
    m = get_model(f"google/{name}-it")
    assert _our_matrices(m) == _gemma2_matrices(GEMMA2_CONFIGS[name])
    # layers alternate, the first sliding (transformers' rule); no q or k norm; 4,096-token windows
    assert (m.num_sliding_layers, m.qk_norm, m.sliding_window) == (m.num_layers // 2, False, 4096)
    published = {"gemma-2-2b": 2.61e9, "gemma-2-9b": 9.24e9, "gemma-2-27b": 27.2e9}[name]
    assert m.num_params == pytest.approx(published, rel=0.005)


def test_googles_sparse_config_files_read_as_the_catalog():
    """google/gemma-3-4b-it's config.json gives its text_config only the fields that differ from
    transformers' defaults (no vocabulary, heads or head_dim), and no Gemma config says
    tie_word_embeddings: read with those defaults, they are the catalog's models."""
    four = {"model_type": "gemma3", "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
        "sliding_window": 1024, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                          "patch_size": 14, "vision_use_head": False}}
    two = {"model_type": "gemma2", "num_hidden_layers": 26, "hidden_size": 2304, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216, "vocab_size": 256000,
           "sliding_window": 4096, "max_position_embeddings": 8192}
    for cfg, name in ((four, "gemma-3-4b"), (two, "gemma-2-2b")):
        read, cat = ModelSpec.from_hf_config(cfg), get_model(name)
        assert (read.num_params, read.vision_params, read.tie_word_embeddings) == (
            cat.num_params, cat.vision_params, True), name


def test_a_float32_checkpoint_is_served_in_16_bits_and_base_names_read():
    # google/gemma-2-2b (the base checkpoint) ships float32; vLLM's --dtype auto serves it in bf16
    from sim.specs import GEMMA2_CONFIGS
    m = ModelSpec.from_hf_config({**GEMMA2_CONFIGS["gemma-2-2b"], "torch_dtype": "float32"})
    assert (m.weight_dtype, m.weight_bytes) == ("bfloat16", get_model("gemma-2-2b").weight_bytes)
    assert get_model("google/gemma-3-27b-pt").name == "gemma-3-27b"


def test_the_pool_holds_windows_in_whole_groups_of_layers_as_vllm_groups_them():
    """vLLM's hybrid KV cache manager groups same-page-size layers by the smaller kind's count and
    pads each kind to whole groups: Gemma-3-27B's 52 sliding layers beside 10 full ones are held
    as 6 groups of 10, its attention still reads 52; MiMo-V2-Flash's 39 beside 9 (two page sizes,
    made one by longer full-layer blocks) as 5 groups of 9; gpt-oss (18 and 18) and Gemma-4-31B
    (50 beside 10) as counted."""
    import warnings
    from sim.scenario import parse_scenario
    m = get_model("gemma-3-27b")
    layer = 16 * 256 * 2                    # 16 KV heads x (128 + 128) x 2 bytes
    assert (m.sliding_pool_layers, m.sliding_kv_bytes_per_token_per_gpu(1)) == (60, 52 * layer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sc = parse_scenario({"name": "g", "deployment": {"model": "gemma-3-27b", "device": "h100", "tp": 1},
                             "workload": {"benchmark": {"concurrency": 4, "isl": 512, "osl": 16, "num_prompts": 8}}})
    cfg = sc.scheduler_config
    assert (cfg.sliding_window, cfg.sliding_kv_bytes, cfg.kv_bytes) == (1024, 60 * layer, 10 * layer)
    assert get_model("gpt-oss-120b").sliding_pool_layers == 18
    g4 = get_model("gemma-4-31b")
    assert g4.sliding_pool_layers == g4.num_sliding_layers == 50
    assert get_model("mimo-v2-flash").sliding_pool_layers == 45
