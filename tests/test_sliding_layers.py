"""Sliding-window layers of their own attention shape (Gemma-4, MiMo-V2-Flash) and the window each
running request keeps in the KV pool (vLLM's hybrid KV cache manager): counted against
transformers' own models on tiny random configs, against hand counts from the public configs,
and through the shared scheduler's block books."""
import dataclasses
import math

import pytest
import torch

from engine.core.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from sim.kernel_model import KernelCostModel
from sim.specs import ModelSpec, get_model

# Gemma-4-31B's public config.json (text_config): the fields the reader takes, values as published
GEMMA4_31B = {"model_type": "gemma4", "text_config": {
    "model_type": "gemma4_text", "num_hidden_layers": 60, "hidden_size": 5376, "num_attention_heads": 32,
    "num_key_value_heads": 16, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4,
    "attention_k_eq_v": True, "intermediate_size": 21504, "sliding_window": 1024, "vocab_size": 262144,
    "tie_word_embeddings": True, "enable_moe_block": False, "hidden_size_per_layer_input": 0,
    "num_kv_shared_layers": 0, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10}}


def _matrices(model: torch.nn.Module) -> int:
    """Weights of a transformers model in its linear layers, experts and embeddings (2-D and up):
    what ServeTwin counts exactly (it counts norms only approximately)."""
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2)


def _our_matrices(m: ModelSpec) -> int:
    """ServeTwin's count less the norm weights it adds (one per sublayer, and the final one)."""
    return m.num_params - (m.num_sublayers + 1) * m.hidden_size


def test_gemma4_weights_equal_transformers_plus_the_value_projection_vllm_loads():
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForCausalLM
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                  attention_k_eq_v=True, sliding_window=32, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                  layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2, tie_word_embeddings=True)
    for moe in ({}, dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)):
        torch.manual_seed(0)
        hf = Gemma4ForCausalLM(Gemma4TextConfig(**fields, **moe))
        ours = ModelSpec.from_hf_config({"model_type": "gemma4_text", **fields, **moe})
        # transformers' full layers have no v_proj (the keys are the values); vLLM loads k_proj
        # a second time as the v projection: 2 full layers x hidden x 1 KV head x 32
        assert _our_matrices(ours) == _matrices(hf) + 2 * 64 * 1 * 32
        assert (ours.num_sliding_layers, ours.sliding_num_kv_heads, ours.sliding_head_dim) == (4, 2, 16)
        assert (ours.num_kv_heads, ours.head_dim, ours.is_moe) == (1, 32, bool(moe))


def test_mimo_v2_weights_equal_transformers():
    from transformers.models.mimo_v2_flash.configuration_mimo_v2_flash import MiMoV2FlashConfig
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashForCausalLM
    torch.manual_seed(0)
    hf = MiMoV2FlashForCausalLM(MiMoV2FlashConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, v_head_dim=16, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False))
    # the hub's fields for the same shape: layer 0 and every 6th full, the rest sliding with twice
    # the KV heads (transformers' own rule); layer 0 dense
    ours = ModelSpec.from_hf_config({
        "model_type": "mimo_v2_flash", "num_hidden_layers": 7, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 24, "v_head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4, "swa_head_dim": 24, "swa_v_head_dim": 16,
        "sliding_window_size": 128, "hybrid_layer_pattern": [0, 1, 1, 1, 1, 0, 1],
        "moe_layer_freq": [0] + [1] * 6, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2})
    assert _our_matrices(ours) == _matrices(hf)
    assert (ours.num_sliding_layers, ours.sliding_num_kv_heads, ours.v_head_dim, ours.num_moe_layers) == (5, 4, 16, 6)


def test_catalog_sizes_and_kv_by_hand_from_the_public_configs():
    g = get_model("google/gemma-4-31B-it")
    assert ModelSpec.from_hf_config(GEMMA4_31B).num_params == g.num_params
    # published: 30.7B in the text model, plus vLLM's copy of k_proj in the 10 full layers
    assert g.num_params == pytest.approx(30.7e9 + 10 * 5376 * 4 * 512, rel=0.003)
    # KV per token: 10 full layers x 4 KV heads x (512 + 512) x 2 bytes; the 50 sliding layers 16 x (256 + 256) x 2
    assert g.kv_bytes_per_token_per_gpu(1) == 10 * 4 * 1024 * 2
    assert g.sliding_kv_bytes_per_token_per_gpu(1) == 50 * 16 * 512 * 2
    assert g.sliding_kv_bytes_per_token_per_gpu(8) == 50 * 2 * 512 * 2   # 16 KV heads over 8 GPUs
    assert g.kv_bytes_per_token_per_gpu(8) == 10 * 1 * 1024 * 2          # 4 KV heads: one replicated per GPU
    moe = get_model("google/gemma-4-26B-A4B-it")
    active = moe.num_params - moe.expert_params * (1 - 8 / 128)
    assert (moe.num_params, active) == (pytest.approx(25.2e9, rel=0.005), pytest.approx(3.8e9, rel=0.02))
    mimo = get_model("XiaomiMiMo/MiMo-V2-Flash")
    assert mimo.weight_dtype == "fp8_block" and mimo.num_sliding_layers == 39
    active = mimo.num_params - mimo.expert_params * (1 - 8 / 256)
    assert (mimo.num_params, active) == (pytest.approx(309e9, rel=0.005), pytest.approx(15e9, rel=0.04))
    # 9 full layers x 4 KV heads x (192 + 128) x 2 bytes
    assert mimo.kv_bytes_per_token_per_gpu(1) == 9 * 4 * 320 * 2


def test_nvidia_nvfp4_gemma4_keeps_16bit_attention():
    cfg = {**GEMMA4_31B, "quantization_config": {
        "quant_method": "modelopt", "quant_algo": "NVFP4",
        "ignore": ["lm_head"] + [f"model.language_model.layers.{i}.self_attn*" for i in range(60)]}}
    m = ModelSpec.from_hf_config(cfg)
    assert (m.weight_dtype, m.attn_weight_dtype, m.expert_dtype) == ("nvfp4", "bfloat16", "")
    c = get_model("nvidia/Gemma-4-31B-IT-NVFP4")
    assert (c.weight_dtype, c.attn_weight_dtype, c.kv_dtype) == ("nvfp4", "bfloat16", "fp8")
    assert c.weight_bytes - c.vision_bytes_per_gpu(1) == m.weight_bytes  # (its vision encoder in bf16)


def test_layouts_it_cannot_time_are_refused_naming_the_field():
    text = dict(GEMMA4_31B["text_config"], hidden_size_per_layer_input=256)
    with pytest.raises(ValueError, match="hidden_size_per_layer_input=256"):
        ModelSpec.from_hf_config(text)
    text = dict(GEMMA4_31B["text_config"], layer_types=["sliding_attention", "chunked_attention"] * 30)
    with pytest.raises(ValueError, match="chunked_attention"):
        ModelSpec.from_hf_config(text)


def test_sliding_layers_are_timed_from_their_own_shape():
    """The kernel model's sliding-layer attention is the attention of a model whose layers all have
    the sliding shape, read at the window: built from the same tables, independently."""
    g = get_model("gemma-4-31b")
    km = KernelCostModel(g, "h100-sxm", tp=2)
    # a model of the sliding layers' shape alone, and one of the full layers' alone
    sliding = dataclasses.replace(g, num_kv_heads=16, head_dim=256, num_sliding_layers=0, sliding_window=0,
                                  sliding_num_kv_heads=0, sliding_head_dim=0)
    full = dataclasses.replace(g, num_sliding_layers=0, sliding_window=0, sliding_num_kv_heads=0, sliding_head_dim=0)
    ks, kf = KernelCostModel(sliding, "h100-sxm", tp=2), KernelCostModel(full, "h100-sxm", tp=2)
    n, ctx = 32, 4000.0
    want = (10 * kf._look("generation_attention", kf.g_gen, n, ctx)
            + 50 * ks._look("generation_attention", ks.g_gen, n, 1024.0))
    assert km._decode_attention(n, ctx) == pytest.approx(want, rel=1e-9)
    # the sliding layers' qkv projection is their own width: (16 + 2 x 8) x 256 on each of 2 GPUs
    gemms = {name: (n_, k, layers) for name, n_, k, layers, _dt in g.step_gemms(2)}
    assert gemms["sliding_qkv"] == ((16 + 2 * 8) * 256, 5376, 50)
    assert gemms["qkv"] == ((16 + 2 * 2) * 512, 5376, 10)


def _req(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@pytest.mark.parametrize("track", [True, False])
def test_a_request_holds_the_blocks_its_window_weighs(track):
    # window 32 tokens; a window token weighs 3 pool tokens (sliding layers 3x the pool's bytes)
    kvm = KVCacheManager(num_gpu_blocks=101, block_size=16, max_model_len=4096, enable_caching=False,
                         track_block_ids=track, sliding_window=32, sliding_kv_bytes=300, kv_bytes=100)
    r = _req("a", 100)
    assert kvm.allocate_slots(r, 100) is not None
    # its 7 blocks of 100 tokens, and the window's layers for all 100 scheduled tokens: 7 x 3
    assert kvm.num_free_blocks == 100 - 7 - 21
    r.num_computed_tokens = 100
    # decoding token 100: the window covers tokens 69..100, blocks 4..6: 3 x 3 pool blocks
    assert kvm.append_slots([r]) is not None
    assert kvm.num_free_blocks == 100 - 7 - 9
    kvm.check_integrity()
    kvm.free(r)
    assert kvm.num_free_blocks == 100
    kvm.check_integrity()


def test_windows_bound_how_many_requests_run():
    # 400 usable blocks of 16 tokens; sliding layers 5x the pool's bytes per token, window 64
    cfg = SchedulerConfig(max_num_batched_tokens=100_000, max_num_seqs=64, max_model_len=4096, block_size=16,
                          num_gpu_blocks=401, enable_prefix_caching=False, sliding_window=64,
                          sliding_kv_bytes=500, kv_bytes=100)
    s = Scheduler(cfg)
    for i in range(20):
        s.add_request(_req(f"r{i}", 160))
    s.schedule()
    # each prompt: 10 blocks of its own and 10 x 5 for its window's layers = 60 blocks: 6 fit in 400
    assert len(s.running) == math.floor(400 / (10 + 10 * 5)) == 6
    plain = Scheduler(dataclasses.replace(cfg, sliding_window=0, sliding_kv_bytes=0, kv_bytes=0))
    for i in range(20):
        plain.add_request(_req(f"r{i}", 160))
    plain.schedule()
    assert len(plain.running) == 20


def test_a_prefix_hit_is_never_taken_for_a_window_block():
    # A and F are cached and freed (A's blocks first in the free queue's cached part); E takes
    # every unhashed block; B, with A's prompt, hits A's first two blocks, which are still free:
    # its window's blocks must come from the others (A's third, F's), not from its own hits.
    kvm = KVCacheManager(num_gpu_blocks=17, block_size=16, max_model_len=4096, enable_caching=True,
                         sliding_window=32, sliding_kv_bytes=100, kv_bytes=100)
    a, f = _req("a", 48), Request("f", list(range(1000, 1048)), SamplingParams(max_tokens=8))
    for r in (a, f):  # 3 blocks each and a window of 3
        assert kvm.allocate_slots(r, 48) is not None
        r.num_computed_tokens = 48
    kvm.free(a)
    kvm.free(f)
    e = Request("e", list(range(2000, 2080)), SamplingParams(max_tokens=8))
    assert kvm.allocate_slots(e, 80) is not None  # 5 blocks and a window of 5: the 10 unhashed
    b = _req("b", 48)
    hits, num_hit = kvm.get_computed_blocks(b)
    assert num_hit == 32  # two full blocks (the last one is never a hit)
    assert kvm.allocate_slots(b, 48 - num_hit, num_hit, hits) is not None
    assert not {x.block_id for x in hits} & {x.block_id for x in kvm.req_to_window["b"]}
    assert all(x.ref_cnt == 1 and x.block_hash is not None for x in hits)
    kvm.check_integrity()
    assert kvm.num_free_blocks == 16 - 10 - 3 - 3  # E's 10; B's 3 blocks and its window's 3


def test_a_request_whose_window_cannot_fit_is_refused_not_left_waiting():
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=4096, block_size=16,
                          num_gpu_blocks=101, enable_prefix_caching=False, sliding_window=64,
                          sliding_kv_bytes=300, kv_bytes=100)
    s = Scheduler(cfg)
    # 320 tokens: 20 blocks of its own; a 320-token chunk's window at worst (320 + 63) / 16 -> 24
    # blocks, + 1 for the alignment: 25 x 3 = 75; 95 <= 100
    assert s.fit_problem(320, 1) is None
    # 480 tokens: 30 + ((480 + 63) / 16 -> 34, + 1) x 3 = 135 > 100
    assert "needs 135 KV blocks" in s.fit_problem(480, 1)


def test_a_preempted_request_fits_again_with_its_outputs_as_its_prompt():
    # A request preempted after its outputs comes back with prompt + outputs as one prompt, whose
    # chunk's window must fit too: 16 + 400 - 1 = 415 tokens, 26 blocks, and the window of a
    # 415-token chunk, ((415 + 31) / 16 -> 28, + 1) x 3 = 87: 113 blocks, more than 39
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=4096, block_size=16,
                          num_gpu_blocks=40, enable_prefix_caching=True, sliding_window=32,
                          sliding_kv_bytes=300, kv_bytes=100)
    s = Scheduler(cfg)
    assert "needs 113 KV blocks" in s.fit_problem(16, 400)
    assert s.fit_problem(16, 8) is None   # 2 blocks and ((23 + 31) / 16 -> 4, + 1) x 3 = 15


def test_decodes_give_back_the_block_that_leaves_the_window():
    # window 32, ratio 1, no prefix caching (the decode path that skips append_slots between block
    # boundaries): the window holds 2-3 blocks whatever the length
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8, max_model_len=4096, block_size=16,
                          num_gpu_blocks=200, enable_prefix_caching=False, sliding_window=32,
                          sliding_kv_bytes=100, kv_bytes=100)
    s = Scheduler(cfg)
    r = _req("a", 40, max_tokens=100)
    s.add_request(r)
    held = []
    while s.has_unfinished_requests():
        out = s.schedule()
        kvm = s.kv_cache_manager
        if r.request_id in kvm.req_to_window:
            # blocks covering tokens computed - 31 .. computed (this step's token included)
            c = r.num_computed_tokens - 1
            first = max(c - 31, 0) // 16
            assert len(kvm.req_to_window["a"]) == -(-(c + 1) // 16) - first
            held.append(len(kvm.req_to_window["a"]))
        s.update_from_output(out, {rid: [7] for rid in out.sampling_req_ids})
        kvm.check_integrity()
    assert max(held[1:]) == 3 and min(held[1:]) == 2
    assert s.kv_cache_manager.num_free_blocks == 199
