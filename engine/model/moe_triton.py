"""The experts of a MoE layer as Triton grouped GEMMs (the CUDA path; on the CPU under `TRITON_INTERPRET=1`).

As in vLLM's fused-MoE kernel: the (token, slot) pairs are sorted by expert and each expert's run is
padded to a multiple of `BLOCK_M` with a sentinel id (`align_block_size`), so every row tile of the
grid belongs to one expert. A program computes one [BLOCK_M, BLOCK_N] tile of `A[rows] @ W[e].T`,
gathering its A rows through the sorted ids (the token's row for the first projection, the pair's row
for the second) and scattering the result to the pairs' rows; the second projection multiplies each
row by its routing weight. SiLU-and-multiply between the two and the sum over the k slots are torch.

The flag must be set before triton is imported to run on the CPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl



@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, weight_ptr, sorted_ids_ptr, block_expert_ptr,
    num_pairs, N, K,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a block past the last expert's run (align_block_size sizes for the worst case)
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    valid = pair < num_pairs  # padding rows carry the sentinel num_pairs
    a_row = pair // A_ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N] of W[e].T
        acc += tl.dot(a, w, input_precision=PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pair, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids, each expert's run padded to a multiple of block_m with the sentinel T*k;
    the expert of each block of block_m rows, -1 for the blocks past the last run).

    All on the device, without reading the counts back to the host (no sync per layer): the
    outputs have the size of the worst case, T*k + E*(block_m - 1) rows rounded up to block_m, as
    vLLM's moe_align_block_size allocates them, and the kernel returns at once on a block of
    expert -1."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    end_padded = torch.cumsum(padded, 0)
    start_padded = end_padded - padded
    start_raw = torch.cumsum(counts, 0) - counts
    expert_of = flat[order]                                   # the sorted pairs' experts
    dest = start_padded[expert_of] + torch.arange(pairs, device=dev) - start_raw[expert_of]
    capacity = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int64, device=dev)
    sorted_ids[dest] = order
    block_start = torch.arange(0, capacity, block_m, device=dev)
    block_expert = torch.searchsorted(end_padded, block_start, right=True)
    block_expert = torch.where(block_start < end_padded[-1], block_expert, torch.full_like(block_expert, -1))
    return sorted_ids, block_expert


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                 num_pairs: int, a_row_div: int, weights: torch.Tensor | None = None,
                 block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """C [num_pairs, N]: row p = A[p // a_row_div] @ W[expert of p].T (times weights[p] if given)."""
    n, k = w.shape[1], w.shape[2]
    c = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, c, weights if weights is not None else c, sorted_ids, block_expert,
        num_pairs, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )
    return c


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, block_m: int = 16) -> torch.Tensor:
    """Same contract as `engine.model.moe.fused_experts_torch`: [T, H] -> [T, H]."""
    t, k = topk_ids.shape
    sorted_ids, block_expert = align_block_size(topk_ids, w13.shape[0], block_m)
    gate_up = grouped_gemm(x, w13, sorted_ids, block_expert, t * k, a_row_div=k, block_m=block_m)
    inter = w2.shape[2]
    act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).contiguous()
    out = grouped_gemm(act, w2, sorted_ids, block_expert, t * k, a_row_div=1,
                       weights=topk_weights.reshape(-1).to(torch.float32).contiguous(), block_m=block_m)
    return out.view(t, k, -1).sum(dim=1)
