"""The compiled library's fused elementwise ops (RMSNorm, residual add + RMSNorm, SiLU * up,
rotate-half RoPE) against the torch formulas they replace (HF Llama's), and the model with them
against the model without them."""
from __future__ import annotations

import pytest

import torch  # noqa: E402  (make test installs it)
import torch.nn.functional as F  # noqa: E402

from engine.attention import cpu_kernel  # noqa: E402
from engine.model import llama  # noqa: E402


@pytest.fixture(scope="module")
def ops():
    o = cpu_kernel.load()
    assert o is not None, "the CPU kernel library did not build"
    return o


def hf_rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("t,h", [(1, 576), (37, 576), (5, 37), (130, 64)])
def test_rms_norm_and_residual_add(ops, t, h):
    g = torch.Generator().manual_seed(t * 1000 + h)
    wide = torch.randn(t, h + 9, generator=g) * 3
    x = wide[:, 3:3 + h]  # rows with a stride: the op reads any row stride
    w = torch.randn(h, generator=g)
    out = torch.empty(t, h)
    ops.rms_norm(out, x, w, 1e-5)
    torch.testing.assert_close(out, hf_rms(x, w, 1e-5), atol=1e-5, rtol=1e-5)
    res = torch.randn(t, h, generator=g)
    want_res = res + x
    ops.add_rms_norm(out, res, x, w, 1e-5)
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)  # the residual stream, updated in place
    torch.testing.assert_close(out, hf_rms(want_res, w, 1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t,n", [(1, 1536), (9, 1536), (3, 13)])
def test_silu_mul(ops, t, n):
    g = torch.Generator().manual_seed(t + n)
    gate_up = torch.randn(t, 2 * n, generator=g) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])  # exp's clamps and zero
    out = torch.empty(t, n)
    ops.silu_mul(out, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_rope_on_split_views(ops):
    t, hq, hk, d = 11, 9, 3, 64
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hk, d)
    rot = llama.RotaryEmbedding(d, 10000.0, None)
    cos, sin = rot.cos_sin(torch.arange(100, 100 + t), torch.float32)
    for x in (q, k):
        out = torch.empty(x.shape)
        ops.rope(out, x, cos, sin)
        torch.testing.assert_close(out, x * cos + llama._rotate_half(x) * sin, atol=1e-6, rtol=1e-6)


def test_ops_refuse_bad_shapes_naming_them(ops):
    with pytest.raises(RuntimeError, match="silu_mul: out"):
        ops.silu_mul(torch.empty(2, 5), torch.empty(2, 12))
    with pytest.raises(RuntimeError, match="rms_norm: x"):
        ops.rms_norm(torch.empty(2, 4), torch.empty(2, 4, dtype=torch.float64), torch.ones(4), 1e-5)


def test_model_with_fused_ops_matches_the_torch_path(ops, monkeypatch):
    """A mixed step (a prompt and decodes) of a random SmolLM2-shaped model: the same logits with
    and without the fused ops, to fp32 rounding; and the fused ops are what ran."""
    from tests.test_model import PagedDriver
    from engine.model.loader import build_random_model

    cfg = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=2048,
               max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
    model = build_random_model(cfg, seed=0, dtype=torch.float32)
    calls = []
    real = llama._fused
    monkeypatch.setattr(llama, "_fused", lambda x: calls.append(1) or real(x))
    fused_driver = PagedDriver(model, seed=3)
    fused = fused_driver.step({0: list(range(100, 160)), 1: list(range(300, 341))})
    fused2 = fused_driver.step({0: [7], 1: [9]})
    assert len(calls) >= 4 * 4  # two norms, RoPE and the MLP per layer
    monkeypatch.setattr(llama, "_fused", lambda x: None)
    plain_driver = PagedDriver(model, seed=3)
    plain = plain_driver.step({0: list(range(100, 160)), 1: list(range(300, 341))})
    plain2 = plain_driver.step({0: [7], 1: [9]})
    for a, b in ((fused, plain), (fused2, plain2)):
        for sid in (0, 1):
            torch.testing.assert_close(a[sid], b[sid], atol=1e-4, rtol=1e-4)
