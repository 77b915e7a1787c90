"""Paged attention: metadata and KV layout, a torch reference (CPU), Triton kernels (CUDA).

Importing this package does not import triton; `get_attention_backend` does, on demand.
"""
from engine.attention.backend import AttentionBackend, get_attention_backend
from engine.attention.metadata import (
    AttentionMetadata,
    allocate_kv_cache,
    build_metadata,
    build_positions,
    kv_cache_bytes_per_block,
)

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "allocate_kv_cache",
    "build_metadata",
    "build_positions",
    "get_attention_backend",
    "kv_cache_bytes_per_block",
]
