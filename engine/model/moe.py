"""The sparse mixture-of-experts MLP's computation (Qwen2-MoE, Qwen3-MoE, Mixtral layouts); the layer
that holds router, experts and shared expert is `engine.model.llama.SparseMoeBlock`.

Routing, as each family's transformers code does it: router logits `x @ gate.T`, softmax in fp32 over
all experts, the top-k probabilities, renormalised to sum to 1 when the family does (Mixtral always;
Qwen by `norm_topk_prob`). Qwen2-MoE adds a shared expert scaled by `sigmoid(shared_expert_gate(x))`.

The experts are one grouped computation: every (token, expert) pair is sorted by expert, each expert's
run of rows goes through its gate/up projection, SiLU-and-multiply and down projection in one matmul
each, and the rows are weighted and summed back per token. `fused_experts_torch` does that with torch
matmuls (the CPU path); `engine.model.moe_triton.fused_experts` does the same with one Triton
grouped-GEMM kernel per projection (the CUDA path; tested on the CPU under `TRITON_INTERPRET=1`).

Weights are stored as transformers 5 stores them: `experts.gate_up_proj` [E, 2I, H] (gate rows first)
and `experts.down_proj` [E, H, I]; `LlamaForCausalLM.load_weights` also takes hub checkpoints that
name each expert (`experts.{e}.gate_proj` / `w1`, `up_proj` / `w3`, `down_proj` / `w2`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64): softmax in fp32 over all experts, top-k,
    divided by their sum when `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(pair order [T*k]: indices of the flattened (token, slot) pairs sorted by expert, stable;
    rows per expert [E])."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j]: [T, H].

    One matmul per projection per expert that has rows, over that expert's contiguous run of the
    expert-sorted rows (a grouped GEMM written as a loop over the groups)."""
    t, k = topk_ids.shape
    order, counts = sort_by_expert(topk_ids, w13.shape[0])
    token_of = order // k
    rows = x[token_of]  # [T*k, H], grouped by expert
    inter = w2.shape[2]
    out = torch.empty((t * k, x.shape[1]), dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        gate_up = rows[start:start + n] @ w13[e].t()
        out[start:start + n] = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2[e].t()
        start += n
    out *= topk_weights.reshape(-1)[order, None].to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, out)


class Experts(nn.Module):
    """The routed experts' weights, stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
