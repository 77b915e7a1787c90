"""Block-sparse attention on grouped-query attention (MiniMax-M3): the indexer's weights and cached
keys counted against transformers' own model on a tiny random config and by hand from the public
config, NVIDIA's mixed-precision checkpoint read per layer kind, and the attention of a step timed
as the sparse layers read it (their top blocks) beside the dense ones (everything)."""
import dataclasses

import pytest
import torch

from engine.core.features import BatchFeatures
from sim.kernel_model import KernelCostModel
from sim.specs import ModelSpec, get_model

# MiniMax-M3's public config.json: the fields the reader takes, values as published
M3 = {"model_type": "minimax_m3", "num_hidden_layers": 60, "hidden_size": 6144, "num_attention_heads": 64,
      "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 3072, "dense_intermediate_size": 12288,
      "first_k_dense_replace": 3, "moe_layer_freq": [0] * 3 + [1] * 57, "num_local_experts": 128,
      "num_experts_per_tok": 4, "moe_intermediate_size": 3072, "n_shared_experts": 1,
      "shared_intermediate_size": 3072, "vocab_size": 200064, "tie_word_embeddings": False,
      "torch_dtype": "bfloat16", "use_qk_norm": True,
      "sparse_attention_config": {"use_sparse_attention": True, "sparse_attention_freq": [0] * 3 + [1] * 57,
                                  "sparse_block_size": 128, "sparse_topk_blocks": 16, "sparse_num_index_heads": 4,
                                  "sparse_index_dim": 128, "sparse_disable_index_value": [0] * 3 + [1] * 57}}


def test_weights_equal_transformers():
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM
    sparse = {"sparse_attention_freq": [0, 1, 1, 1], "sparse_num_index_heads": 2, "sparse_index_dim": 8,
              "sparse_block_size": 16, "sparse_topk_blocks": 2}
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, dense_intermediate_size=96, shared_intermediate_size=32,
                  num_local_experts=8, num_experts_per_tok=2, moe_layer_freq=[0, 1, 1, 1])
    torch.manual_seed(0)
    hf = MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**fields, sparse_attention_config=sparse,
                                                      bos_token_id=None, eos_token_id=None))
    ours = ModelSpec.from_hf_config({"model_type": "minimax_m3", **fields, "n_shared_experts": 1,
                                     "sparse_attention_config": {"use_sparse_attention": True, **sparse}})
    matrices = sum(p.numel() for p in hf.parameters() if p.dim() >= 2)
    assert ours.num_params - (ours.num_sublayers + 1) * ours.hidden_size == matrices
    assert (ours.index_layers, ours.sparse_attention_layers, ours.index_topk) == (3, 3, 32)


def test_size_and_kv_by_hand_from_the_public_config():
    m = ModelSpec.from_hf_config(M3)
    assert m.num_params == get_model("MiniMaxAI/MiniMax-M3").num_params
    # published: about 428B with its vision encoder (0.8B, not counted here), 23B active less the
    # embeddings and LM head
    assert m.num_params == pytest.approx(427e9, rel=0.005)
    active = m.num_params - m.expert_params * (1 - 4 / 128) - 2 * m.embedding_params
    assert active == pytest.approx(23e9, rel=0.03)
    # KV per token, bf16: 60 layers x 4 KV heads x (128 + 128) x 2 bytes, and the 57 indexers' key
    # of 128 x 2 bytes (one head, on every GPU)
    assert m.kv_bytes_per_token_per_gpu(1) == 60 * 4 * 256 * 2 + 57 * 128 * 2
    assert m.kv_bytes_per_token_per_gpu(4) == 60 * 1 * 256 * 2 + 57 * 128 * 2


def test_nvidia_mixed_precision_checkpoint_reads_per_layer_kind():
    layers = {f"language_model.model.layers.{i}.block_sparse_moe.experts.{e}.{w}": {"quant_algo": "NVFP4",
                                                                                     "group_size": 16}
              for i in range(3, 60) for e in range(2) for w in ("w1", "w2", "w3")}
    layers.update({f"language_model.model.layers.{i}.self_attn.q_proj": {"quant_algo": "MXFP8"} for i in range(60)})
    cfg = {"model_type": "minimax_m3_vl", "text_config": {k: v for k, v in M3.items() if k != "model_type"},
           "quantization_config": {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                                   "quantized_layers": layers}}
    m = ModelSpec.from_hf_config(cfg)
    assert (m.weight_dtype, m.expert_dtype) == ("fp8", "nvfp4")
    by_name = get_model("nvidia/MiniMax-M3-NVFP4")
    assert (by_name.weight_dtype, by_name.expert_dtype, by_name.kv_dtype) == ("fp8", "nvfp4", "bfloat16")
    bad = dict(cfg, quantization_config=dict(cfg["quantization_config"],
                                             quantized_layers={"x.self_attn.q_proj": {"quant_algo": "W4A8_AWQ"}}))
    with pytest.raises(ValueError, match="W4A8_AWQ"):
        ModelSpec.from_hf_config(bad)


def test_an_indexer_with_value_projections_is_refused():
    sp = dict(M3["sparse_attention_config"], sparse_disable_index_value=[0] * 60)
    with pytest.raises(ValueError, match="sparse_disable_index_value"):
        ModelSpec.from_hf_config(dict(M3, sparse_attention_config=sp))


def test_sparse_layers_read_their_top_blocks_and_dense_layers_everything():
    m = get_model("minimax-m3")
    km = KernelCostModel(m, "h200", tp=8)
    dense = dataclasses.replace(m, index_topk=0, index_n_heads=0, index_head_dim=0, num_index_layers=0)
    kd = KernelCostModel(dense, "h200", tp=8)
    n, ctx = 16, 20000.0
    indexer = km._indexer_roof(n * ctx, n, n * ctx)
    want = (3 * kd._look("generation_attention", kd.g_gen, n, ctx)
            + 57 * kd._look("generation_attention", kd.g_gen, n, 2048.0) + 57 * indexer)
    assert km._decode_attention(n, ctx) == pytest.approx(want, rel=1e-9)
    # the indexer reads every cached 16-bit key of 128 (256 bytes each) once per decode
    assert indexer >= n * ctx * 256 / km.device.mem_bandwidth
    # a prefill chunk of 8192 tokens: sparse layers see at most 2048 keys a query
    f = BatchFeatures(num_prefill_reqs=1, num_prefill_tokens=8192, prefill_attn_pairs=8192 * 8193 // 2)
    assert km._attention(f) < kd._attention(f)
