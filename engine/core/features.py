"""Batch features of one step: the single place the profiler, the fitter and the simulator's cost
model get their inputs from.

A scheduled request with one new token is a decode (one query row reading its context's KV);
anything else is a prefill chunk of `n` tokens on top of `c` already-computed tokens, whose
attention work grows with n * (c + n / 2).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BatchFeatures:
    num_reqs: int = 0
    num_prefill_reqs: int = 0
    num_prefill_tokens: int = 0
    prefill_context_tokens: int = 0      # sum over chunks of tokens already in KV before the chunk
    prefill_attn_pairs: int = 0          # sum over chunks of n * c + n * (n + 1) / 2 (query-key pairs)
    num_decode_reqs: int = 0
    decode_context_tokens: int = 0       # sum over decodes of KV tokens read (context incl. itself)
    num_preempted: int = 0
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)  # (n, c) per chunk

    def add(self, n: int, c: int, sign: int = 1) -> None:
        """Count a request scheduled for n tokens on c computed ones (sign=-1 takes it back):
        one token is a decode reading c + 1 KV tokens, more is a prefill chunk."""
        if n == 1:
            self.num_decode_reqs += sign
            self.decode_context_tokens += sign * (c + 1)
            return
        if sign > 0:
            self.prefill_chunks.append((n, c))
        else:
            self.prefill_chunks.remove((n, c))
        self.num_prefill_reqs += sign
        self.num_prefill_tokens += sign * n
        self.prefill_context_tokens += sign * c
        self.prefill_attn_pairs += sign * (n * c + n * (n + 1) // 2)

    def merge(self, other: "BatchFeatures") -> None:
        """Add another step's features (a run of steps is described by their sums)."""
        self.num_reqs += other.num_reqs
        self.num_prefill_reqs += other.num_prefill_reqs
        self.num_prefill_tokens += other.num_prefill_tokens
        self.prefill_context_tokens += other.prefill_context_tokens
        self.prefill_attn_pairs += other.prefill_attn_pairs
        self.num_decode_reqs += other.num_decode_reqs
        self.decode_context_tokens += other.decode_context_tokens
        self.num_preempted += other.num_preempted
        self.prefill_chunks += other.prefill_chunks

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_reqs

    def as_dict(self) -> dict:
        return {
            "num_reqs": self.num_reqs,
            "num_prefill_reqs": self.num_prefill_reqs,
            "num_prefill_tokens": self.num_prefill_tokens,
            "prefill_context_tokens": self.prefill_context_tokens,
            "prefill_attn_pairs": self.prefill_attn_pairs,
            "num_decode_reqs": self.num_decode_reqs,
            "decode_context_tokens": self.decode_context_tokens,
            "num_tokens": self.num_tokens,
            "num_preempted": self.num_preempted,
        }
