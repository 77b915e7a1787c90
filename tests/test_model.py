"""Our paged, flattened-batch model vs transformers on the same weights (SmolLM2 and tiny random configs)."""
from __future__ import annotations

import random

import pytest

import torch  # noqa: E402  (make test installs it)
import transformers  # noqa: E402  (make test installs it)

from engine.attention import allocate_kv_cache, build_metadata, build_positions  # noqa: E402
from engine.model.llama import LlamaForCausalLM, ModelConfig  # noqa: E402
from engine.model.loader import build_random_model, load_model, resolve_model  # noqa: E402
from tests.helpers import run_interpreted


class PagedDriver:
    """A minimal runner: per-sequence shuffled block ids, tokens in KV, one flattened forward per step."""

    def __init__(self, model: LlamaForCausalLM, block_size: int = 16, num_blocks: int = 64, seed: int = 0) -> None:
        c = model.config
        self.model, self.block_size = model, block_size
        dtype = next(model.parameters()).dtype
        self.kv = allocate_kv_cache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype, "cpu")
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous block ids
        self.blocks: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """chunks: seq id -> new token ids. Returns seq id -> fp32 logits [n_new, vocab]."""
        ids, block_ids, computed, new = [], [], [], []
        for sid, toks in chunks.items():
            done = self.computed.setdefault(sid, 0)
            table = self.blocks.setdefault(sid, [])
            while len(table) * self.block_size < done + len(toks):
                table.append(self.free.pop())
            ids += toks
            block_ids.append(table)
            computed.append(done)
            new.append(len(toks))
        md = build_metadata(block_ids, computed, new, self.block_size)
        hidden = self.model(torch.tensor(ids), build_positions(computed, new), self.kv, md)
        logits = self.model.compute_logits(hidden)
        out, at = {}, 0
        for sid, toks in chunks.items():
            out[sid] = logits[at : at + len(toks)]
            at += len(toks)
            self.computed[sid] += len(toks)
        return out


@torch.no_grad()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff < atol, f"max |logit diff| = {diff}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


# ---------------------------------------------------------------- SmolLM2-135M (default weights)


@pytest.fixture(scope="module")
def smol():
    model, tokenizer, hf_config = load_model("default", device="cpu", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(resolve_model("default")), dtype=torch.float32, local_files_only=True
    ).eval()
    return model, tokenizer, hf


def _prompt(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


def test_default_model_config_and_tokenizer(smol):
    model, tokenizer, _ = smol
    c = model.config
    assert (c.model_type, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 30, 9, 3, 64)
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert tokenizer.chat_template
    assert len(_prompt(tokenizer, "Hello")) > 5


def test_default_full_prompt_matches_transformers(smol):
    model, tokenizer, hf = smol
    ids = _prompt(tokenizer, "Explain paged attention in one short paragraph.")
    ours = PagedDriver(model).step({0: ids})[0]
    assert_logits_close(ours, hf_logits(hf, ids), atol=2e-3)


def test_default_chunked_prefill_matches_transformers(smol):
    model, tokenizer, hf = smol
    ids = _prompt(tokenizer, "Write a haiku about the sea, then explain its imagery.")
    ref = hf_logits(hf, ids)
    driver = PagedDriver(model, block_size=16)
    cuts = [0, 13, 30, len(ids)]  # chunks end mid-block; later chunks attend to cached context
    for a, b in zip(cuts, cuts[1:]):
        ours = driver.step({0: ids[a:b]})[0]
        assert_logits_close(ours, ref[a:b], atol=2e-3)


def test_default_mixed_batch_matches_single_runs(smol):
    model, tokenizer, hf = smol
    a = _prompt(tokenizer, "What is 2 + 2?")
    b = _prompt(tokenizer, "List three colours of the rainbow and one fact about each colour.")
    # Alone: each sequence through its own cache in one chunk.
    alone_a = PagedDriver(model).step({0: a})[0]
    alone_b = PagedDriver(model).step({1: b[:20]})[1]
    # Together: step 1 = A's whole prompt + B's first chunk; step 2 = A's decode + B's rest.
    driver = PagedDriver(model, block_size=16, seed=1)
    out = driver.step({0: a, 1: b[:20]})
    torch.testing.assert_close(out[0], alone_a, atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], alone_b, atol=1e-4, rtol=0)
    nxt = int(out[0][-1].argmax())
    out2 = driver.step({0: [nxt], 1: b[20:]})
    assert_logits_close(out2[0], hf_logits(hf, a + [nxt])[-1:], atol=2e-3)
    assert_logits_close(out2[1], hf_logits(hf, b)[20:], atol=2e-3)


def test_default_packed_linears_match_transformers(smol):
    """The engine's CPU path (oneDNN-prepacked projections and LM head) on a mixed step: same
    logits as transformers, and as the plain F.linear path to fp32 rounding."""
    from engine.model.llama import Linear, can_pack_linears

    model, tokenizer, hf = smol
    assert can_pack_linears("cpu", torch.float32) and not can_pack_linears("cpu", torch.bfloat16)
    a = _prompt(tokenizer, "Name a prime number larger than ten.")
    b = _prompt(tokenizer, "Describe a cat in two sentences.")
    plain = PagedDriver(model, seed=2).step({0: a, 1: b[:17]})
    try:
        assert model.pack_linears() == 4 * model.config.num_layers + 1  # qkv, o, gate_up, down + head
        packed_driver = PagedDriver(model, seed=2)
        packed = packed_driver.step({0: a, 1: b[:17]})
        nxt = int(packed[0][-1].argmax())
        step2 = packed_driver.step({0: [nxt], 1: b[17:]})
    finally:
        for m in model.modules():
            if isinstance(m, Linear):
                m.unpack()
    for sid in (0, 1):
        torch.testing.assert_close(packed[sid], plain[sid], atol=5e-4, rtol=0)
    assert_logits_close(packed[0], hf_logits(hf, a), atol=2e-3)
    assert_logits_close(step2[0], hf_logits(hf, a + [nxt])[-1:], atol=2e-3)
    assert_logits_close(step2[1], hf_logits(hf, b)[17:], atol=2e-3)


def test_load_weights_drops_packed_copies():
    """A packed copy is a snapshot: loading new weights must not leave the old one in use."""
    from engine.model.llama import Linear

    net = build_random_model(dict(TINY, model_type="llama"), seed=0)
    assert net.pack_linears() == 2 * 4 + 1
    x = torch.randn(3, TINY["hidden_size"])
    head = net.lm_head
    before = head(x)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).float()
    net.load_weights(hf.state_dict().items())
    assert all(m._packed is None for m in net.modules() if isinstance(m, Linear))
    after = head(x)
    torch.testing.assert_close(after, torch.nn.functional.linear(x, head.weight), atol=1e-5, rtol=0)
    assert not torch.allclose(after, before)


# ---------------------------------------------------------------- tiny random configs

TINY = dict(
    vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
)
TINY_CONFIGS = {
    "qwen2-bias-untied": ("Qwen2Config", "Qwen2ForCausalLM", dict(TINY, tie_word_embeddings=False, rope_theta=10000.0)),
    "llama3-rope-tied": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(TINY, tie_word_embeddings=True, attention_bias=True, rope_theta=500000.0, max_position_embeddings=512,
             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=64)),
    ),
    "mistral-mha": ("MistralConfig", "MistralForCausalLM", dict(TINY, num_key_value_heads=4, sliding_window=None)),
}


@pytest.fixture(params=sorted(TINY_CONFIGS), scope="module")
def tiny(request, tmp_path_factory):
    """A transformers model with random weights (biases made non-zero), saved and loaded back as ours."""
    config_cls, model_cls, kwargs = TINY_CONFIGS[request.param]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    model, tokenizer, _ = load_model(str(path))
    assert tokenizer is None
    return request.param, model, hf


def test_tiny_config_fields(tiny):
    name, model, hf = tiny
    c = model.config
    assert c.qkv_bias == (name != "mistral-mha") and c.o_bias == name.startswith("llama3")
    assert c.tie_word_embeddings == (model.lm_head.weight is model.model.embed_tokens.weight)
    assert (c.rope_scaling is not None) == name.startswith("llama3")


def test_tiny_matches_transformers(tiny):
    _, model, hf = tiny
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 101, (150,), generator=g).tolist()  # long enough for llama3's scaled frequencies
    b = torch.randint(0, 101, (37,), generator=g).tolist()
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    assert_logits_close(PagedDriver(model, block_size=4).step({0: a})[0], ref_a, atol=1e-4)
    driver = PagedDriver(model, block_size=4, num_blocks=128, seed=2)
    out = driver.step({0: a[:100], 1: b[:5]})
    assert_logits_close(out[0], ref_a[:100], atol=1e-4)
    assert_logits_close(out[1], ref_b[:5], atol=1e-4)
    out = driver.step({1: b[5:], 0: a[100:]})  # order in the batch need not follow arrival
    assert_logits_close(out[0], ref_a[100:], atol=1e-4)
    assert_logits_close(out[1], ref_b[5:], atol=1e-4)


def test_unsupported_configs_raise_clearly():
    with pytest.raises(NotImplementedError, match="model_type='gpt2'"):
        ModelConfig.from_hf(dict(TINY, model_type="gpt2"))
    with pytest.raises(NotImplementedError, match="sliding_window=64"):
        ModelConfig.from_hf(dict(TINY, model_type="mistral", sliding_window=64))
    cfg = ModelConfig.from_hf(dict(TINY, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(NotImplementedError, match="rope_scaling type='yarn'"):
        LlamaForCausalLM(cfg)
    with pytest.raises(FileNotFoundError, match="model='/nonexistent'"):
        resolve_model("/nonexistent")


def test_build_random_model_is_seeded_and_finite():
    m1 = build_random_model(dict(TINY, model_type="qwen2"), seed=3)
    m2 = build_random_model(dict(TINY, model_type="qwen2"), seed=3)
    ids = list(range(20))
    l1, l2 = PagedDriver(m1).step({0: ids})[0], PagedDriver(m2).step({0: ids})[0]
    assert torch.equal(l1, l2) and torch.isfinite(l1).all()
    assert m1.model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0


def triton_model_check() -> None:
    """Subprocess body (TRITON_INTERPRET=1): the tiny model with Triton kernels vs the torch reference."""
    from engine.attention import get_attention_backend

    model = build_random_model(dict(TINY, model_type="qwen2"), seed=5)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 101, (30,), generator=g).tolist()
    b = torch.randint(0, 101, (9,), generator=g).tolist()
    results = {}
    for name in ("torch", "triton"):
        model.attn_backend = get_attention_backend("cpu", override=name)
        driver = PagedDriver(model, block_size=4, seed=7)
        step1 = driver.step({0: a[:20], 1: b})
        step2 = driver.step({1: [3], 0: a[20:]})  # B decodes, A's second chunk reads cached context
        results[name] = torch.cat([step1[0], step1[1], step2[0], step2[1]])
    torch.testing.assert_close(results["triton"], results["torch"], atol=1e-4, rtol=1e-4)
    print("TRITON_MODEL_OK")


def test_tiny_model_with_triton_backend_interpreted():
    run_interpreted("from tests.test_model import triton_model_check; triton_model_check()", "TRITON_MODEL_OK", timeout=300)
