"""Paged attention vs naive dense causal attention; Triton kernels (interpreted on CPU) vs the reference."""
from __future__ import annotations

import os

import pytest

import torch  # noqa: E402  (make test installs it)

from engine.attention import (  # noqa: E402
    allocate_kv_cache,
    build_metadata,
    get_attention_backend,
    kv_cache_bytes_per_block,
)
from engine.attention import reference  # noqa: E402
from tests.helpers import run_interpreted

# (context_len, q_len) per sequence: decodes, a fresh prefill, prefill chunks on cached context
# (prefix hit / chunked prefill), chunks that start and end mid-block and on block boundaries.
MIXED = [(13, 1), (0, 7), (20, 9), (5, 1), (31, 1), (16, 16), (3, 2), (0, 1)]
DECODES = [(40, 1), (1, 1), (15, 1), (16, 1), (0, 1)]


def make_case(seqs, block_size, hq, hkv, d, seed=0, dtype=torch.float32, spare_blocks=5):
    """Random logical K/V/Q per sequence, scattered over shuffled block ids; context pre-written by hand."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + q) // block_size) for c, q in seqs]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    block_ids, at = [], 0
    for n in need:
        block_ids.append(perm[at : at + n])
        at += n
    keys = [torch.randn(c + q, hkv, d, generator=g, dtype=dtype) for c, q in seqs]
    values = [torch.randn(c + q, hkv, d, generator=g, dtype=dtype) for c, q in seqs]
    queries = [torch.randn(q, hq, d, generator=g, dtype=dtype) for c, q in seqs]
    (cache,) = allocate_kv_cache(1, num_blocks, block_size, hkv, d, dtype, "cpu")
    for (c, _), blocks, k, v in zip(seqs, block_ids, keys, values):
        for pos in range(c):
            cache[0, blocks[pos // block_size], pos % block_size] = k[pos]
            cache[1, blocks[pos // block_size], pos % block_size] = v[pos]
    md = build_metadata(block_ids, [c for c, _ in seqs], [q for _, q in seqs], block_size)
    new_k = torch.cat([k[c:] for (c, _), k in zip(seqs, keys)])
    new_v = torch.cat([v[c:] for (c, _), v in zip(seqs, values)])
    return dict(
        seqs=seqs, block_ids=block_ids, keys=keys, values=values, queries=queries, cache=cache, md=md,
        new_k=new_k, new_v=new_v, query=torch.cat(queries), scale=d**-0.5, block_size=block_size,
    )


def naive_attention(case) -> torch.Tensor:
    """Dense causal attention per sequence and head in float64, from the logical (unpaged) K/V."""
    outs = []
    for (c, q_len), q, k, v in zip(case["seqs"], case["queries"], case["keys"], case["values"]):
        hq, hkv = q.shape[1], k.shape[1]
        o = torch.empty(q_len, hq, q.shape[2], dtype=torch.float64)
        for h in range(hq):
            kv = h // (hq // hkv)
            scores = q[:, h].double() @ k[:, kv].double().T * case["scale"]
            allowed = torch.arange(c + q_len)[None, :] <= (c + torch.arange(q_len))[:, None]
            scores = scores.masked_fill(~allowed, float("-inf"))
            o[:, h] = torch.softmax(scores, dim=-1) @ v[:, kv].double()
        outs.append(o)
    return torch.cat(outs)


def check_cache_holds_all_tokens(case) -> None:
    bs = case["block_size"]
    for blocks, k, v in zip(case["block_ids"], case["keys"], case["values"]):
        for pos in range(k.shape[0]):
            assert torch.equal(case["cache"][0, blocks[pos // bs], pos % bs], k[pos])
            assert torch.equal(case["cache"][1, blocks[pos // bs], pos % bs], v[pos])


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("seqs", [MIXED, DECODES, [(0, 23)], [(37, 11)]], ids=["mixed", "decodes", "prefill", "chunk"])
@pytest.mark.parametrize("heads", [(6, 2, 8), (4, 4, 32), (9, 3, 16)], ids=["gqa6-2", "mha4", "gqa9-3"])
def test_reference_matches_naive(block_size, seqs, heads):
    hq, hkv, d = heads
    case = make_case(seqs, block_size, hq, hkv, d)
    reference.write_kv(case["new_k"], case["new_v"], case["cache"], case["md"].slot_mapping)
    check_cache_holds_all_tokens(case)
    out = reference.paged_attention(case["query"], case["cache"], case["md"], case["scale"])
    torch.testing.assert_close(out.double(), naive_attention(case), atol=1e-5, rtol=1e-5)


def test_metadata_fields():
    case = make_case(MIXED, 4, 6, 2, 8)
    md = case["md"]
    assert md.query_start_loc.tolist() == [0, 1, 8, 17, 18, 19, 35, 37, 38]
    assert md.seq_lens.tolist() == [c + q for c, q in MIXED]
    assert md.context_lens.tolist() == [c for c, _ in MIXED]
    assert (md.max_query_len, md.max_seq_len, md.num_decode_tokens()) == (16, 32, 4)
    expected = [
        blocks[pos // 4] * 4 + pos % 4
        for (c, q), blocks in zip(MIXED, case["block_ids"])
        for pos in range(c, c + q)
    ]
    assert md.slot_mapping.tolist() == expected
    assert md.slot_mapping.dtype == torch.int64 and md.block_tables.dtype == torch.int32
    with pytest.raises(ValueError, match="block_ids\\[0\\]"):
        build_metadata([[0]], [4], [1], 4)


def test_write_kv_skips_padding_slots():
    (cache,) = allocate_kv_cache(1, 2, 4, 2, 8, torch.float32, "cpu")
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    reference.write_kv(k, v, cache, torch.tensor([5, -1, 0]))
    flat = cache[0].view(-1, 2, 8)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[0], k[2])
    assert int((cache.view(2, 8, -1).abs().sum(-1) > 0).sum()) == 4  # 2 slots x (K, V), nothing else


def test_kv_cache_bytes_per_block():
    (cache,) = allocate_kv_cache(1, 1, 16, 3, 64, torch.bfloat16, "cpu")
    assert kv_cache_bytes_per_block(30, 16, 3, 64, torch.bfloat16) == 30 * cache.numel() * cache.element_size()


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("SERVETWIN_ATTN_BACKEND", raising=False)
    assert get_attention_backend("cpu").name == "torch-cpu"
    assert get_attention_backend("cpu", override="torch").name == "torch"
    monkeypatch.setenv("SERVETWIN_ATTN_BACKEND", "bogus")
    with pytest.raises(ValueError, match="SERVETWIN_ATTN_BACKEND"):
        get_attention_backend("cpu")


def triton_check() -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: Triton write + attention vs the torch reference."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    backend = get_attention_backend("cpu", override="triton")
    assert backend.name == "triton"
    cases = [
        (MIXED, 16, (6, 2, 8)),
        (MIXED, 4, (6, 2, 8)),
        (MIXED, 4, (9, 3, 16)),
        (DECODES, 16, (4, 4, 32)),
        ([(37, 70)], 16, (6, 2, 8)),  # a chunk longer than one query tile, on cached context
    ]
    for seqs, block_size, (hq, hkv, d) in cases:
        case = make_case(seqs, block_size, hq, hkv, d, seed=block_size + hq)
        ref_cache = case["cache"].clone()
        # K/V and Q as strided views of one fused projection, as the model produces them.
        t = case["query"].shape[0]
        fused = torch.cat([case["query"].view(t, -1), case["new_k"].view(t, -1), case["new_v"].view(t, -1)], dim=1)
        q = fused[:, : hq * d].view(t, hq, d)
        k = fused[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        v = fused[:, (hq + hkv) * d :].view(t, hkv, d)
        backend.write_kv(k, v, case["cache"], case["md"].slot_mapping)
        reference.write_kv(case["new_k"], case["new_v"], ref_cache, case["md"].slot_mapping)
        assert torch.equal(case["cache"], ref_cache), f"KV write differs for {seqs} bs={block_size}"
        out = backend.attention(q, case["cache"], case["md"], case["scale"])
        ref = reference.paged_attention(case["query"], ref_cache, case["md"], case["scale"])
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, msg=lambda m: f"{seqs} bs={block_size}: {m}")
        torch.testing.assert_close(out.double(), naive_attention(case), atol=1e-4, rtol=1e-4)
    print("TRITON_OK")


def test_triton_kernels_match_reference_interpreted():
    run_interpreted("from tests.test_attention import triton_check; triton_check()", "TRITON_OK", timeout=300)
