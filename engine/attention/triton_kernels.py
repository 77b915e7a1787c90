"""Triton kernels for the CUDA path: KV write by slot, and one paged-attention kernel for every step.

`paged_attention` is a single "unified" kernel for decodes and prefill chunks alike (as in vLLM's
Triton unified attention): one program per (sequence, query tile, KV head). A query tile packs
`BLOCK_Q` tokens x the `GROUP` query heads that share the KV head into `BLOCK_M` rows, so each K/V
tile loaded from the cache serves the whole GQA group. The program walks the sequence's KV in tiles
of `BLOCK_N` tokens; each token's physical row is found through the block table
(`block_table[pos // block_size] * block_size + pos % block_size`), so tiles may straddle pages and
`block_size` may be smaller than the tile (tl.dot needs tiles of at least 16). Online softmax in
fp32; the causal mask is `key_pos <= context_len + query_offset`.

Tested on the CPU under `TRITON_INTERPRET=1` (the flag must be set before triton is imported).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cslot, stride_chead,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    dst = slot * stride_cslot + h[:, None] * stride_chead + d[None, :]
    k = tl.load(key_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr, o_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel uses exp2
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # the grid is sized for the longest chunk in the batch
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Row r of the tile: query token q_block*BLOCK_Q + r // GROUP, query head kv_head*GROUP + r % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + offs_m // GROUP
    q_head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_tok < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    q_pos = context_len + q_tok

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The last query of this tile sees keys up to its own position; nothing later is loaded.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    for start in range(0, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        block_id = tl.load(block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
        kv_off = block_id.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        # The first tile always holds key 0, visible to every row, so m_i is finite after it (no NaN).
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise ValueError(
            "kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, head_dim] tensor, "
            f"got shape {tuple(kv_cache.shape)} contiguous={kv_cache.is_contiguous()}"
        )


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter the new tokens' K/V ([T, Hkv, D], last dim contiguous) into their slots (< 0: skip)."""
    _check_cache(kv_cache)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Same contract as `reference.paged_attention`: [T, Hq, D] (last dim contiguous) -> [T, Hq, D]."""
    _check_cache(kv_cache)
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_tokens, num_q_heads, head_dim = query.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    if k_cache.shape[1] != metadata.block_size:
        raise ValueError(f"kv_cache block_size={k_cache.shape[1]} != metadata.block_size={metadata.block_size}")
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    # tl.dot needs every tile dimension >= 16 on GPUs.
    block_m = max(16 if metadata.max_query_len == 1 else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (metadata.num_seqs, triton.cdiv(metadata.max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        query, out, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc, metadata.seq_lens,
        scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), metadata.block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), GROUP=group,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=32,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
