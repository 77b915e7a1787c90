"""The runner's CPU attention path against the torch reference (the ground truth)."""
from __future__ import annotations

import random

import pytest

import torch  # noqa: E402  (make test installs it)

from engine.attention import build_metadata, reference  # noqa: E402
from engine.attention import cpu as cpu_attention  # noqa: E402
from engine.attention import cpu_kernel  # noqa: E402
from engine.attention.cpu import CPUPagedAttention, write_kv  # noqa: E402


def random_batch(seed: int, hq: int, hkv: int, specs: list[tuple[int, int]], bs: int = 16, d: int = 32):
    """specs: (context_len, q_len) per sequence; shuffled, non-contiguous block ids."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-(c + q) // bs) for c, q in specs)
    ids = list(range(1, need + 5))
    rng.shuffle(ids)
    blocks, at = [], 0
    for c, q in specs:
        k = -(-(c + q) // bs)
        blocks.append(ids[at:at + k])
        at += k
    kv = torch.randn(2, need + 5, bs, hkv, d, generator=g)
    md = build_metadata(blocks, [c for c, _ in specs], [q for _, q in specs], bs)
    t = sum(q for _, q in specs)
    query = torch.randn(t, hq, d, generator=g)
    key = torch.randn(t, hkv, d, generator=g)
    value = torch.randn(t, hkv, d, generator=g)
    return kv, md, query, key, value


@pytest.mark.parametrize("kernel", [False, True], ids=["torch-path", "compiled-kernel"])
@pytest.mark.parametrize("min_bucket", [2, cpu_attention.MIN_BUCKET_SIZE])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("specs", [
    [(0, 1)],                                            # a one-token prompt
    [(5, 1), (40, 1), (17, 1), (100, 1)] * 5,            # decodes of mixed lengths: several buckets
    [(31, 1)] * 9,                                       # equal lengths: no mask
    [(0, 37), (16, 20), (3, 1), (50, 1), (0, 2)],        # mixed: prefill, chunk on cache, decodes
    [(64, 64), (0, 200)],                                # chunk on exactly full blocks; long prompt
])
def test_matches_reference(hq, hkv, specs, min_bucket, kernel, monkeypatch):
    monkeypatch.setattr(cpu_attention, "MIN_BUCKET_SIZE", min_bucket)  # 2: several decode buckets
    if kernel:  # make test installs what the build needs: a missing kernel is a failure here
        assert cpu_kernel.load() is not None, "the CPU decode kernel did not build"
    else:
        monkeypatch.setattr(CPUPagedAttention, "_kernel", staticmethod(lambda q, kv: None))
    kv, md, query, key, value = random_batch(len(specs) + hq, hq, hkv, specs)
    kv_ref = kv.clone()
    reference.write_kv(key, value, kv_ref, md.slot_mapping)
    write_kv(key, value, kv, md.slot_mapping)
    assert torch.equal(kv, kv_ref)
    ref = reference.paged_attention(query, kv_ref, md, 0.2)
    attn = CPUPagedAttention()
    got = attn.attention(query, kv, md, 0.2)
    num_decodes = sum(q == 1 for _, q in specs)
    assert (attn._plan.kernel_decodes is not None) == (kernel and num_decodes > 0)
    if min_bucket == 2 and num_decodes >= 8 and not kernel:
        assert len(attn._plan.decodes) > 1
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # second "layer" with the same metadata reuses the plan
    kv2 = torch.randn_like(kv)
    torch.testing.assert_close(attn.attention(query, kv2, md, 0.2),
                               reference.paged_attention(query, kv2, md, 0.2), atol=1e-5, rtol=1e-5)


def test_negative_slots_are_skipped():
    kv, md, query, key, value = random_batch(0, 4, 2, [(3, 2)])
    slots = md.slot_mapping.clone()
    slots[0] = -1
    a, b = kv.clone(), kv.clone()
    write_kv(key, value, a, slots)
    reference.write_kv(key, value, b, slots)
    assert torch.equal(a, b)


@pytest.mark.parametrize("d", [64, 128, 80])  # the kernel's vector path (64-float chunks) and its tail
@pytest.mark.parametrize("hq,hkv", [(12, 4), (2, 2)])
def test_kernel_head_dims_match_reference(d, hq, hkv):
    assert cpu_kernel.load() is not None, "the CPU decode kernel did not build"
    specs = [(1, 1), (15, 1), (16, 1), (33, 1), (300, 1), (0, 9), (7, 1)]
    kv, md, query, key, value = random_batch(d + hq, hq, hkv, specs, d=d)
    write_kv(key, value, kv, md.slot_mapping)
    got = CPUPagedAttention().attention(query, kv, md, d**-0.5)
    torch.testing.assert_close(got, reference.paged_attention(query, kv, md, d**-0.5), atol=1e-5, rtol=1e-5)


def test_kernel_refuses_a_context_longer_than_its_block_table():
    ops = cpu_kernel.load()
    assert ops is not None, "the CPU decode kernel did not build"
    kv = torch.zeros(2, 4, 16, 1, 8)
    q = torch.zeros(1, 1, 8)
    tables = torch.tensor([[1, 2]])
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\]=33"):
        ops.paged_decode(torch.empty_like(q), q, kv[0], kv[1], torch.tensor([0]), tables, torch.tensor([33]), 1.0)
