"""What an attention implementation is: a KV writer and an attention function, by name."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from engine.attention.metadata import AttentionMetadata

WriteKVFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


class AttentionBackend(NamedTuple):
    """Unpacks as `(write_kv_fn, attention_fn)`; `name` says which one for logs and profiles."""

    write_kv: WriteKVFn
    attention: AttentionFn
    name: str
