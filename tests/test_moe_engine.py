"""The engine runs mixtures of experts: our Qwen3-MoE, Qwen2-MoE and Mixtral (and dense Qwen3) against
transformers' own implementation on the same random weights (tiny configs, no download): the MoE
layer's output within 1e-5, logits within 1e-4 through chunked prefill and decode steps, greedy tokens
equal; the Triton grouped-GEMM experts against the torch ones under TRITON_INTERPRET=1."""
from __future__ import annotations


import pytest

import torch
import transformers

from engine.llm_engine import LLMEngine
from engine.model.llama import LlamaForCausalLM, ModelConfig
from engine.model.loader import build_random_model, load_model
from engine.model.moe import fused_experts_torch, route
from engine.sampler import SamplingParams
from tests.test_model import TINY, PagedDriver, assert_logits_close, hf_logits
from tests.helpers import run_interpreted

FAMILIES = {
    # name: (config class, model class, config fields)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(TINY, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       norm_topk_prob=True, mlp_only_layers=[1])),  # layer 1 dense, as Qwen3-MoE allows
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(TINY, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                       shared_expert_intermediate_size=48, norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(TINY, head_dim=16)),
}


def make_hf(name: str, seed: int = 0):
    config_cls, model_cls, fields = FAMILIES[name]
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields)).float().eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.1)
            if pname.endswith("mlp.gate.weight"):  # a router that spreads tokens over the experts
                p.normal_(0.0, 0.5)
    return hf


@pytest.fixture(params=sorted(FAMILIES), scope="module")
def family(request, tmp_path_factory):
    hf = make_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    model, _, _ = load_model(str(path))
    return request.param, model, hf, path


def test_moe_config_fields(family):
    name, model, hf, _ = family
    c = model.config
    fields = FAMILIES[name][2]
    if name == "qwen3":
        assert not c.is_moe and c.qk_norm
        return
    assert c.is_moe and c.num_experts_per_tok == fields["num_experts_per_tok"]
    assert c.num_experts == fields.get("num_experts", fields.get("num_local_experts"))
    assert c.moe_layers == ((True, False) if name == "qwen3_moe" else (True, True))
    assert c.norm_topk_prob == (name != "qwen2_moe")  # Mixtral always renormalises
    assert c.qkv_bias == (name == "qwen2_moe") and c.qk_norm == (name == "qwen3_moe")
    assert (c.shared_expert_intermediate_size > 0) == (name == "qwen2_moe")


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
@torch.no_grad()
def test_moe_layer_equals_transformers(name):
    """The sparse MLP alone, on inputs spread enough that every expert gets tokens: within 1e-5."""
    hf = make_hf(name)
    model = build_random_model(hf.config, seed=9)
    model.load_weights(hf.state_dict().items())
    x = torch.randn(37, TINY["hidden_size"], generator=torch.Generator().manual_seed(3))
    ours, theirs = model.model.layers[0].mlp, hf.model.layers[0].mlp
    ref = theirs(x[None])[0]
    torch.testing.assert_close(ours(x), ref, atol=1e-5, rtol=1e-5)
    _, ids = route(ours.gate(x), ours.top_k, ours.renormalize)
    assert len(ids.unique()) == model.config.num_experts  # every expert took part


def test_moe_logits_match_transformers_through_chunks_and_decodes(family):
    _, model, hf, _ = family
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 101, (60,), generator=g).tolist()
    b = torch.randint(0, 101, (13,), generator=g).tolist()
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    driver = PagedDriver(model, block_size=4, num_blocks=64, seed=2)
    out = driver.step({0: a[:40], 1: b[:5]})
    assert_logits_close(out[0], ref_a[:40], atol=1e-4)
    assert_logits_close(out[1], ref_b[:5], atol=1e-4)
    out = driver.step({1: b[5:], 0: a[40:]})
    assert_logits_close(out[0], ref_a[40:], atol=1e-4)
    assert_logits_close(out[1], ref_b[5:], atol=1e-4)


def test_moe_engine_greedy_tokens_equal_transformers(family):
    """The whole engine (scheduler, paged KV, sampler) on the saved checkpoint: two requests
    batched, greedy, the same tokens as transformers' generate."""
    name, _, hf, path = family
    engine = LLMEngine(model=str(path), device="cpu", max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks=64)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 101, (n,), generator=g).tolist() for n in (23, 41)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          min_new_tokens=8, pad_token_id=0)[0, len(p):].tolist()
        assert got[str(i)] == ref, (name, i)


def _per_expert_checkpoint(hf, name: str):
    """transformers' stacked expert weights written out expert by expert, as hub checkpoints name
    them (Mixtral: block_sparse_moe.experts.E.w1/w3/w2; Qwen: mlp.experts.E.gate/up/down_proj)."""
    for key, t in hf.state_dict().items():
        if key.endswith("experts.gate_up_proj"):
            half = t.shape[1] // 2
            stem = key[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                g, u = ("w1", "w3") if name == "mixtral" else ("gate_proj", "up_proj")
                yield _hub(f"{stem}{e}.{g}.weight", name), t[e, :half]
                yield _hub(f"{stem}{e}.{u}.weight", name), t[e, half:]
        elif key.endswith("experts.down_proj"):
            stem = key[: -len("down_proj")]
            for e in range(t.shape[0]):
                yield _hub(f"{stem}{e}.{'w2' if name == 'mixtral' else 'down_proj'}.weight", name), t[e]
        else:
            yield _hub(key, name), t


def _hub(key: str, name: str) -> str:
    return key.replace(".mlp.", ".block_sparse_moe.") if name == "mixtral" else key


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_hub_checkpoints_naming_each_expert_load_the_same_weights(name):
    hf = make_hf(name)
    cfg = ModelConfig.from_hf(hf.config)
    a, b = build_random_model(hf.config, seed=1), build_random_model(hf.config, seed=2)
    a.load_weights(hf.state_dict().items())
    b.load_weights(_per_expert_checkpoint(hf, name))
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
    assert cfg.is_moe
    missing = [(k, v) for k, v in _per_expert_checkpoint(hf, name) if ".experts.1." not in k]
    with pytest.raises(ValueError, match=r"missing .*experts\.(gate_up_proj|down_proj)#1"):
        build_random_model(hf.config).load_weights(missing)


def test_unknown_or_incomplete_moe_configs_are_refused_naming_the_field():
    fields = dict(FAMILIES["qwen3_moe"][2], model_type="qwen3_moe")
    del fields["moe_intermediate_size"]
    with pytest.raises(NotImplementedError, match="lacks 'moe_intermediate_size'"):
        ModelConfig.from_hf(fields)
    with pytest.raises(NotImplementedError, match="model_type='deepseek_v3'"):
        ModelConfig.from_hf(dict(TINY, model_type="deepseek_v3"))


def test_torch_grouped_experts_equal_a_per_token_loop():
    """Against the definition, token by token and slot by slot (an independent loop)."""
    g = torch.Generator().manual_seed(0)
    e, h, i, t, k = 5, 16, 12, 9, 2
    w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    x = torch.randn(t, h, generator=g)
    weights, ids = route(torch.randn(t, e, generator=g), k, renormalize=True)
    ids[:, 0] = 3  # expert 3 gets every token, some experts none
    expected = torch.zeros(t, h)
    for tok in range(t):
        for j in range(k):
            ex = int(ids[tok, j])
            gate, up = (w13[ex] @ x[tok]).split(i)
            expected[tok] += weights[tok, j] * (w2[ex] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(fused_experts_torch(x, w13, w2, weights, ids), expected, atol=1e-4, rtol=1e-5)


def triton_moe_check() -> None:
    """Subprocess body (TRITON_INTERPRET=1): the Triton grouped-GEMM experts against the torch ones
    (T from 1 to 70, experts left empty, k up to 4), then a tiny Qwen3-MoE with Triton attention
    and experts against the torch path."""
    from engine.attention import get_attention_backend
    from engine.model import moe_triton

    g = torch.Generator().manual_seed(0)
    for t, e, k, h, i in ((1, 4, 2, 32, 16), (7, 8, 4, 48, 40), (70, 6, 2, 64, 24)):
        w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1
        x = torch.randn(t, h, generator=g)
        logits = torch.randn(t, e, generator=g).index_fill_(1, torch.tensor([1]), -1e4)  # expert 1 gets none
        weights, ids = route(logits, k, renormalize=False)
        sorted_ids, block_expert = moe_triton.align_block_size(ids, e, 16)
        assert sorted_ids.numel() % 16 == 0 and 1 not in block_expert.tolist()
        torch.testing.assert_close(moe_triton.fused_experts(x, w13, w2, weights, ids),
                                   fused_experts_torch(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    model = build_random_model(dict(FAMILIES["qwen3_moe"][2], model_type="qwen3_moe"), seed=5)
    for layer in model.model.layers:
        if layer.is_moe:
            layer.mlp.gate.weight.normal_(0.0, 0.5, generator=g)
    a = torch.randint(0, 101, (30,), generator=g).tolist()
    b = torch.randint(0, 101, (9,), generator=g).tolist()
    results = {}
    for backend in ("torch", "triton"):
        model.attn_backend = get_attention_backend("cpu", override=backend)
        driver = PagedDriver(model, block_size=4, seed=7)
        step1 = driver.step({0: a[:20], 1: b})
        step2 = driver.step({1: [3], 0: a[20:]})
        results[backend] = torch.cat([step1[0], step1[1], step2[0], step2[1]])
    torch.testing.assert_close(results["triton"], results["torch"], atol=1e-4, rtol=1e-4)
    print("TRITON_MOE_OK")


def test_align_block_size_pads_each_expert_run_without_host_sync():
    """Invariants of the device-side padding (the outputs sized for the worst case): every pair
    exactly once; each block holds one expert's pairs (or the sentinel) and names that expert;
    each expert's run starts on a block boundary, in the order of the pairs; blocks past the
    last run are -1 and hold only the sentinel."""
    from engine.model.moe_triton import align_block_size
    g = torch.Generator().manual_seed(1)
    for t, e, k, bm in ((1, 128, 8, 16), (7, 8, 4, 16), (70, 6, 2, 16), (33, 5, 1, 4), (64, 4, 2, 8)):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        sorted_ids, block_expert = align_block_size(ids, e, bm)
        pairs = t * k
        assert sorted_ids.numel() == block_expert.numel() * bm >= pairs + e * (bm - 1)
        real = sorted_ids[sorted_ids < pairs]
        assert sorted(real.tolist()) == list(range(pairs))
        flat = ids.reshape(-1)
        used = sorted(set(flat.tolist()))
        blocks = block_expert.tolist()
        assert [b for b in blocks if b >= 0] == sorted(b for b in blocks if b >= 0)  # runs in expert order
        assert blocks.count(-1) == len(blocks) - sum(-(-int((flat == x).sum()) // bm) for x in used)
        for b, ex in enumerate(blocks):
            rows = sorted_ids[b * bm:(b + 1) * bm]
            rows = rows[rows < pairs]
            if ex < 0:
                assert rows.numel() == 0
            else:
                assert rows.numel() > 0 and (flat[rows] == ex).all() and rows.tolist() == sorted(rows.tolist())


def test_triton_grouped_gemm_experts_interpreted():
    run_interpreted("from tests.test_moe_engine import triton_moe_check; triton_moe_check()", "TRITON_MOE_OK", timeout=600)


def test_dense_model_class_unchanged_for_llama():
    """A Llama config builds no MoE layer and no q/k norm (the dense path is the one it was)."""
    net = LlamaForCausalLM(ModelConfig.from_hf(dict(TINY, model_type="llama")))
    assert not any(layer.is_moe for layer in net.model.layers)
    assert net.model.layers[0].self_attn.q_norm is None
