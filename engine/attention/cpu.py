"""A faster torch paged-attention path for the CPU (same contract and results as
`engine.attention.reference`, which stays the simple ground truth).

On the CPU a decode step is memory-bound: the reference gathers every decode's KV, padded to the
longest context in the batch, with advanced indexing, in every layer. Here:

- the per-step plan (which rows are decodes, their block lists, masks) is built once for the
  first layer and reused by the other layers (the runner builds one metadata object per step);
- decodes are sorted by context length and split into a few buckets, each padded only to its own
  longest context, so mixed lengths do not gather (and attend over) mostly padding;
- blocks are gathered with `F.embedding` on a [num_blocks, block_size * heads * dim] view (one
  parallel row copy per block), several times faster than advanced indexing;
- prefill chunks with no cached context use SDPA's causal kernel with native GQA (half the work
  of an explicit mask); chunks on top of cached context use an explicit mask;
- KV writes use index_copy_;
- with the compiled kernel (engine/attention/cpu_kernel.py, built on first use; fp32), decodes
  skip all of the above: each (sequence, KV head) reads its rows once, in place, through the
  block table, instead of the gather's read, write and read again.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import cpu_kernel, reference
from engine.attention.base import AttentionBackend
from engine.attention.metadata import AttentionMetadata

MAX_DECODE_BUCKETS = 4
MIN_BUCKET_SIZE = 16


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter [T, Hkv, D] K/V into their slots (slots < 0 fall back to the reference, which skips them)."""
    nkv, d = kv_cache.shape[-2], kv_cache.shape[-1]
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        reference.write_kv(key, value, kv_cache, slot_mapping)
        return
    kv_cache[0].view(-1, nkv, d).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, nkv, d).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


class _Plan:
    """Everything about one step's batch that does not depend on the layer."""

    __slots__ = ("decodes", "prefills", "kernel", "kernel_decodes")

    def __init__(self, md: AttentionMetadata, kernel: bool = False) -> None:
        qsl, seq_lens, _ = md.host_lists()
        bs = md.block_size
        tables = md.block_tables.to(torch.int64)
        n = len(seq_lens)
        dec = [i for i in range(n) if qsl[i + 1] - qsl[i] == 1]
        # For the compiled kernel: (token rows, block tables, context lengths) of every decode.
        self.kernel = kernel
        self.kernel_decodes = None
        if dec and kernel:
            idx = torch.tensor(dec)
            self.kernel_decodes = (torch.tensor([qsl[i] for i in dec]), tables.index_select(0, idx).contiguous(),
                                   torch.tensor([seq_lens[i] for i in dec], dtype=torch.int64))
        # Decode buckets: (token rows, flat block ids, batch, blocks per seq, length, mask or None).
        self.decodes = []
        if dec and not kernel:
            dec.sort(key=lambda i: seq_lens[i])
            k = max(1, min(MAX_DECODE_BUCKETS, len(dec) // MIN_BUCKET_SIZE))
            size = -(-len(dec) // k)
            for j in range(0, len(dec), size):
                idx = dec[j:j + size]
                lens = [seq_lens[i] for i in idx]
                length = max(lens)
                nblk = -(-length // bs)
                flat = tables[torch.tensor(idx), :nblk].reshape(-1)
                mask = None
                if min(lens) != length:
                    mask = (torch.arange(length)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
                rows = torch.tensor([qsl[i] for i in idx])
                self.decodes.append((rows, flat, len(idx), nblk, length, mask))
        # Prefill chunks: (first row, last row + 1, flat block ids, blocks, seq len, mask or None).
        self.prefills = []
        for i in range(n):
            q_len = qsl[i + 1] - qsl[i]
            if q_len == 1:
                continue
            s = seq_lens[i]
            c = s - q_len
            nblk = -(-s // bs)
            mask = None
            if c > 0:
                mask = torch.arange(s)[None, :] <= torch.arange(c, s)[:, None]
            self.prefills.append((qsl[i], qsl[i + 1], tables[i, :nblk], nblk, s, mask))


class CPUPagedAttention:
    """Callable attention backend; caches the plan of the metadata it last saw."""

    def __init__(self) -> None:
        self._md: AttentionMetadata | None = None  # kept alive, so identity is a safe cache key
        self._plan: _Plan | None = None

    @staticmethod
    def _kernel(query: torch.Tensor, kv_cache: torch.Tensor):
        """The compiled decode kernel's ops, if it applies to these tensors (else None)."""
        if (query.dtype != torch.float32 or kv_cache.dtype != torch.float32 or query.device.type != "cpu"
                or not query.is_contiguous() or not kv_cache.is_contiguous()):
            return None
        return cpu_kernel.load()

    def backend(self) -> AttentionBackend:
        return AttentionBackend(write_kv, self.attention, "torch-cpu")

    def attention(self, query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                  scale: float) -> torch.Tensor:
        """[T, Hq, D] -> [T, Hq, D]; every new token attends over its sequence's paged context."""
        bs = md.block_size
        if kv_cache.shape[2] != bs:
            raise ValueError(f"kv_cache block_size={kv_cache.shape[2]} != metadata.block_size={bs}")
        kernel = self._kernel(query, kv_cache)
        if md is not self._md or self._plan.kernel != (kernel is not None):
            self._plan = _Plan(md, kernel is not None)
            self._md = md
        plan = self._plan
        num_blocks, _, hkv, d = kv_cache.shape[1:]
        hq = query.shape[1]
        g = hq // hkv
        k_rows = kv_cache[0].view(num_blocks, -1)
        v_rows = kv_cache[1].view(num_blocks, -1)
        out = torch.empty_like(query)
        if plan.kernel_decodes is not None:
            rows, tables, lens = plan.kernel_decodes
            kernel.paged_decode(out, query, kv_cache[0], kv_cache[1], rows, tables, lens, scale)
        for rows, flat, b, nblk, length, mask in plan.decodes:
            k = k_rows.index_select(0, flat).view(b, nblk * bs, hkv, d)[:, :length].transpose(1, 2)
            v = v_rows.index_select(0, flat).view(b, nblk * bs, hkv, d)[:, :length].transpose(1, 2)
            q = query.index_select(0, rows).view(b, hkv, g, d)
            # One query token: its g heads per KV head form the query axis (exact GQA, no repeat).
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            out.index_copy_(0, rows, o.reshape(b, hq, d).to(out.dtype))
        for a, e, flat, nblk, s, mask in plan.prefills:
            k = k_rows.index_select(0, flat).view(1, nblk * bs, hkv, d)[:, :s].transpose(1, 2)
            v = v_rows.index_select(0, flat).view(1, nblk * bs, hkv, d)[:, :s].transpose(1, 2)
            q = query[a:e].unsqueeze(0).transpose(1, 2)  # [1, Hq, Q, D]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               scale=scale, enable_gqa=g > 1)
            out[a:e] = o.transpose(1, 2)[0].to(out.dtype)
        return out


def cpu_attention_backend() -> AttentionBackend:
    return CPUPagedAttention().backend()
