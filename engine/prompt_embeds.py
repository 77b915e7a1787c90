"""Prompt embeddings (vLLM's `prompt_embeds`): prompt positions whose input vector is given by
the client instead of looked up from a token id.

A prompt with embeddings is still a list of token ids for the scheduler and the KV cache: each
embedded position holds PLACEHOLDER_ID, and the request's cache salt carries a digest of the
vectors, so its prefix-cache blocks are shared only with requests that gave the same vectors at
the same positions. The runner puts the vectors in place of the placeholders' embeddings (rows of
the forward's first hidden state); everything after the embedding layer is unchanged.

Wire format (vLLM's): base64 of `torch.save` of a [num_tokens, hidden_size] floating-point
tensor (a leading batch dimension of 1 is dropped).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass

import torch

PLACEHOLDER_ID = 0  # the token id an embedded position holds in the scheduler's token list


@dataclass(frozen=True, slots=True)
class PromptEmbeds:
    """The given vectors of one prompt: `values[j]` is the input of prompt position
    `positions[j]` (ascending)."""

    positions: torch.Tensor  # int64 [k]
    values: torch.Tensor     # [k, hidden_size]

    @classmethod
    def from_spans(cls, spans: list[tuple[int, torch.Tensor]]) -> "PromptEmbeds":
        """From (first position, [rows, hidden] tensor) spans in prompt order."""
        pos = [torch.arange(p, p + t.shape[0], dtype=torch.int64) for p, t in spans]
        return cls(torch.cat(pos), torch.cat([t for _, t in spans]))

    def __len__(self) -> int:
        return int(self.positions.numel())

    def digest(self) -> str:
        """sha256 of the positions and the vectors' bytes: equal prompts with equal digests share
        prefix-cache blocks."""
        h = hashlib.sha256(self.positions.numpy().tobytes())
        h.update(str(self.values.dtype).encode())
        h.update(self.values.contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def window(self, start: int, stop: int) -> "PromptEmbeds | None":
        """The embeddings of prompt positions [start, stop), renumbered from 0 (a prompt cut by
        truncate_prompt_tokens), or None if none is left."""
        keep = (self.positions >= start) & (self.positions < stop)
        if not bool(keep.any()):
            return None
        return PromptEmbeds(self.positions[keep] - start, self.values[keep])

    def row_index(self, prompt_len: int) -> torch.Tensor:
        """[prompt_len] int64: the row of `values` each position takes, -1 for a token id."""
        idx = torch.full((prompt_len,), -1, dtype=torch.int64)
        idx[self.positions] = torch.arange(len(self), dtype=torch.int64)
        return idx


def salted(cache_salt: str | None, embeds: PromptEmbeds | None) -> str | None:
    """The cache salt of a request with these embeddings (its own salt kept in it)."""
    if embeds is None:
        return cache_salt
    return f"{cache_salt or ''}\x00prompt_embeds:{embeds.digest()}"


def load_prompt_embeds(data: object, hidden_size: int, dtype: torch.dtype, field: str) -> torch.Tensor:
    """vLLM's wire format -> a [num_tokens, hidden_size] tensor of `dtype` on the CPU, or a
    ValueError that names `field` and what is wrong with it."""
    if not isinstance(data, str) or not data:
        raise ValueError(f"{field}: must be a non-empty base64 string of a torch.save'd tensor, "
                         f"got {type(data).__name__} {str(data)[:40]!r}")
    try:
        payload = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{field}: not valid base64 ({e})") from None
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            t = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
            if isinstance(t, torch.Tensor) and t.layout != torch.strided:
                t = t.to_dense()
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # torch raises many types for bytes that are not a tensor file
        raise ValueError(f"{field}: could not be read as a torch tensor: {str(e)[:200]}") from None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{field}: holds a {type(t).__name__}, not a tensor")
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2:
        raise ValueError(f"{field}: must be a 2D tensor of shape (num_tokens, hidden_size); got shape "
                         f"{tuple(t.shape)}")
    if t.shape[1] != hidden_size:
        raise ValueError(f"{field}: hidden_size {t.shape[1]} does not match the model's hidden_size "
                         f"{hidden_size}")
    if t.shape[0] == 0:
        raise ValueError(f"{field}: has no rows (shape {tuple(t.shape)})")
    if not t.is_floating_point():
        raise ValueError(f"{field}: dtype {t.dtype} is not a floating-point type")
    t = t.to(dtype)
    if not bool(torch.isfinite(t).all()):  # NaN would reach the sampler and fail the whole step
        raise ValueError(f"{field}: holds NaN or infinite values")
    return t.contiguous()
