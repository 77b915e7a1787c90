"""Pick the attention implementation for a device: Triton kernels on CUDA, the bucketed torch path
(engine/attention/cpu.py) on the CPU, the plain torch reference on request.

`SERVETWIN_ATTN_BACKEND=torch|torch-cpu|triton` overrides the choice (e.g. the reference on a GPU
to compare, or the Triton kernels on the CPU under `TRITON_INTERPRET=1`).
"""
from __future__ import annotations

import os

import torch

from engine.attention.base import AttentionBackend

BACKEND_ENV = "SERVETWIN_ATTN_BACKEND"


def get_attention_backend(device: torch.device | str, override: str | None = None) -> AttentionBackend:
    """Backend for `device`; `override` (or the env var) forces "torch", "torch-cpu" or "triton"."""
    device = torch.device(device)
    choice = (override or os.environ.get(BACKEND_ENV) or "").strip().lower()
    if choice not in ("", "auto", "torch", "torch-cpu", "triton"):
        raise ValueError(f"{BACKEND_ENV}={choice!r}: expected 'torch', 'torch-cpu' or 'triton'")
    if choice in ("", "auto"):
        choice = "triton" if device.type == "cuda" else "torch-cpu"
    if choice == "torch-cpu":
        from engine.attention.cpu import cpu_attention_backend

        return cpu_attention_backend()
    if choice == "torch":
        from engine.attention import reference

        return AttentionBackend(reference.write_kv, reference.paged_attention, "torch")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{BACKEND_ENV}=triton on device {device.type!r} needs TRITON_INTERPRET=1 set before triton is imported"
        )
    from engine.attention import triton_kernels

    return AttentionBackend(triton_kernels.write_kv, triton_kernels.paged_attention, "triton")
