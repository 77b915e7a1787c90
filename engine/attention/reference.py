"""Paged attention in plain torch: the CPU path, and the ground truth the Triton kernels are tested against.

Pure-decode sequences (q_len == 1) are batched: their block tables gather K/V into a padded
`[B, L, Hkv, D]` tensor and one SDPA call runs with a length mask. Sequences with several new tokens
(prefill chunks, possibly on top of cached context) run one SDPA each with an explicit causal mask
offset by their context length. GQA is handled by folding the query heads of one KV head into the
query-length axis, so K/V are never repeated.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter the new tokens' K/V ([T, Hkv, D]) into their slots; slots < 0 (padding) are skipped."""
    num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
    k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
    v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
    slots = slot_mapping
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    k_flat[slots] = key.to(kv_cache.dtype)
    v_flat[slots] = value.to(kv_cache.dtype)


def _gqa_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Q, Hq, D], k/v [B, L, Hkv, D], mask bool [B, Q, L] (True = attend) -> [B, Q, Hq, D]."""
    b, nq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    # [B, Q, Hkv, G, D] -> [B, Hkv, Q*G, D]: row r is query token r // G, head (kv_head*G + r % G).
    qg = q.reshape(b, nq, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, nq * g, d)
    m = mask.repeat_interleave(g, dim=1).unsqueeze(1)  # [B, 1, Q*G, L]
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=m, scale=scale)
    return out.view(b, hkv, nq, g, d).permute(0, 2, 1, 3, 4).reshape(b, nq, hq, d)


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of the first `length` tokens through block tables: [B, nblk] -> [B, length, Hkv, D]."""
    blocks = cache[table.long()]  # [B, nblk, bs, Hkv, D]
    b, nblk, bs, h, d = blocks.shape
    return blocks.view(b, nblk * bs, h, d)[:, :length]


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention of every new token over its own sequence's paged context: [T, Hq, D] -> [T, Hq, D].

    New token j of sequence i sits at position context_len_i + j and sees keys 0..context_len_i + j,
    which must already be in the cache (call `write_kv` first).
    """
    bs = metadata.block_size
    if kv_cache.shape[2] != bs:
        raise ValueError(f"kv_cache block_size={kv_cache.shape[2]} != metadata.block_size={bs}")
    qsl, seq_lens, _ = metadata.host_lists()
    out = torch.empty_like(query)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
    decodes = [i for i, q in enumerate(q_lens) if q == 1]
    if decodes:
        idx = torch.tensor(decodes, device=query.device)
        lens = torch.tensor([seq_lens[i] for i in decodes], device=query.device)
        length = max(seq_lens[i] for i in decodes)
        table = metadata.block_tables[idx, : -(-length // bs)]
        k = _gather(k_cache, table, length)
        v = _gather(v_cache, table, length)
        mask = (torch.arange(length, device=query.device)[None, :] < lens[:, None]).unsqueeze(1)  # [B, 1, L]
        tok = torch.tensor([qsl[i] for i in decodes], device=query.device)
        out[tok] = _gqa_sdpa(query[tok].unsqueeze(1), k, v, mask, scale).squeeze(1).to(out.dtype)
    for i, q_len in enumerate(q_lens):
        if q_len == 1:
            continue
        s = seq_lens[i]
        c = s - q_len  # == context_lens[i]; derived the same way as in the Triton kernel
        table = metadata.block_tables[i : i + 1, : -(-s // bs)]
        k = _gather(k_cache, table, s)
        v = _gather(v_cache, table, s)
        q_pos = torch.arange(c, c + q_len, device=query.device)
        mask = (torch.arange(s, device=query.device)[None, :] <= q_pos[:, None]).unsqueeze(0)  # [1, Q, L]
        q = query[qsl[i] : qsl[i + 1]].unsqueeze(0)
        out[qsl[i] : qsl[i + 1]] = _gqa_sdpa(q, k, v, mask, scale).squeeze(0).to(out.dtype)
    return out
