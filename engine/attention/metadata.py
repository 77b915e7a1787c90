"""What one attention step needs to know about the flattened batch, and the paged KV layout.

The runner flattens a step's sequences into one token stream: sequence i contributes `q_len_i >= 1`
new tokens (1 for a decode, several for a prefill chunk) whose positions are
`context_len_i .. context_len_i + q_len_i - 1`. Every new token's K/V goes to a *slot*
(`block_id * block_size + offset`), and attention reads each sequence's whole context back through its
block table. Layout of one layer's cache:

    kv_cache[layer] : [2, num_blocks, block_size, num_kv_heads, head_dim]
                       ^ 0 = K, 1 = V

so `kv_cache[0].view(-1, num_kv_heads, head_dim)[slot]` is the K row of one token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors shared by every layer (built once per step by the runner).

    The `*_host` lists mirror the tensors on the host so the torch reference path can loop over
    sequences without a device sync; `build_metadata` fills them, other builders may leave them None.
    """

    slot_mapping: torch.Tensor  # int64 [T]: write target of each new token; < 0 means "skip" (padding)
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0
    query_start_loc: torch.Tensor  # int32 [B + 1]: cumulative new-token counts
    seq_lens: torch.Tensor  # int32 [B]: context_len + q_len (tokens in KV after this step)
    context_lens: torch.Tensor  # int32 [B]: tokens already in KV before this step
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    context_lens_host: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_pure_decode(self) -> bool:
        """Every sequence contributes exactly one token (the batched decode fast path applies)."""
        return self.max_query_len == 1

    def host_lists(self) -> tuple[list[int], list[int], list[int]]:
        """(query_start_loc, seq_lens, context_lens) as Python lists; syncs only if not prebuilt."""
        qsl = self.query_start_loc_host
        if qsl is None:
            qsl = self.query_start_loc.tolist()
        sl = self.seq_lens_host if self.seq_lens_host is not None else self.seq_lens.tolist()
        cl = self.context_lens_host if self.context_lens_host is not None else self.context_lens.tolist()
        return qsl, sl, cl

    def num_decode_tokens(self) -> int:
        """Sequences with q_len == 1 (decodes; a 1-token prefill chunk counts too)."""
        qsl, _, _ = self.host_lists()
        return sum(1 for a, b in zip(qsl, qsl[1:]) if b - a == 1)


def build_metadata(
    block_ids: list[list[int]],
    num_computed_tokens: list[int],
    num_new_tokens: list[int],
    block_size: int,
    device: torch.device | str = "cpu",
    max_blocks_per_seq: int | None = None,
) -> AttentionMetadata:
    """Build metadata from the runner's per-sequence lists (block ids, tokens in KV, new tokens).

    Computed vectorised on the host, then copied once to `device`. `max_blocks_per_seq` fixes the
    block-table width (e.g. for CUDA graphs); by default it is the longest table in the batch.
    """
    n = len(block_ids)
    if not (len(num_computed_tokens) == len(num_new_tokens) == n) or n == 0:
        raise ValueError(
            f"build_metadata: need equal, non-empty lists; got {n} block lists, "
            f"{len(num_computed_tokens)} num_computed_tokens, {len(num_new_tokens)} num_new_tokens"
        )
    if block_size <= 0:
        raise ValueError(f"build_metadata: block_size must be > 0, got {block_size}")
    seq_lens = [c + q for c, q in zip(num_computed_tokens, num_new_tokens)]
    for i, (blocks, q, s) in enumerate(zip(block_ids, num_new_tokens, seq_lens)):
        if q < 1:
            raise ValueError(f"build_metadata: num_new_tokens[{i}] must be >= 1, got {q}")
        if len(blocks) * block_size < s:
            raise ValueError(
                f"build_metadata: sequence {i} needs {s} KV slots but block_ids[{i}] has "
                f"{len(blocks)} blocks of {block_size}"
            )
    width = max(len(b) for b in block_ids)
    if max_blocks_per_seq is not None:
        if max_blocks_per_seq < width:
            raise ValueError(f"build_metadata: max_blocks_per_seq={max_blocks_per_seq} < longest table {width}")
        width = max_blocks_per_seq
    table = torch.zeros((n, width), dtype=torch.int64)
    for i, blocks in enumerate(block_ids):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
    q_lens = torch.tensor(num_new_tokens, dtype=torch.int64)
    ctx = torch.tensor(num_computed_tokens, dtype=torch.int64)
    qsl = [0]
    for q in num_new_tokens:
        qsl.append(qsl[-1] + q)
    # Per token: its sequence, and its position = context_len + offset inside the chunk.
    seq_idx = torch.repeat_interleave(torch.arange(n), q_lens)
    offset = torch.arange(qsl[-1]) - torch.tensor(qsl[:-1], dtype=torch.int64)[seq_idx]
    pos = ctx[seq_idx] + offset
    slots = table[seq_idx, pos // block_size] * block_size + pos % block_size
    return AttentionMetadata(
        slot_mapping=slots.to(device),
        block_tables=table.to(torch.int32).to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        context_lens=ctx.to(torch.int32).to(device),
        max_query_len=max(num_new_tokens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_host=qsl,
        seq_lens_host=seq_lens,
        context_lens_host=list(num_computed_tokens),
    )


def build_positions(
    num_computed_tokens: list[int], num_new_tokens: list[int], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Positions of the flattened new tokens (int64 [T]): context_len_i + j, for RoPE."""
    pos = [c + j for c, q in zip(num_computed_tokens, num_new_tokens) for j in range(q)]
    return torch.tensor(pos, dtype=torch.int64).to(device)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One zeroed `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per layer.

    Zeroed rather than empty so a padded block table (which points at block 0) never reads NaNs.
    """
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block id costs across *all* layers (K and V): divide the KV budget by this."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem
