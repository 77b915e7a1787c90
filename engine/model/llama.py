"""A Llama-family decoder (Llama, SmolLM, Qwen2, Qwen3, Mistral, and the mixtures of experts
Qwen2-MoE, Qwen3-MoE and Mixtral: engine/model/moe.py) over a flattened, paged batch.

One forward takes every scheduled token of every sequence as a single `[T]` stream with its
positions; attention reads and writes the paged KV cache through `AttentionMetadata`, so decodes and
prefill chunks mix freely in one step. q/k/v and gate/up projections are fused (one matmul each);
`load_weights` slices the HF checkpoint's separate tensors into them.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import cpu_kernel
from engine.attention.backend import AttentionBackend, get_attention_backend
from engine.attention.metadata import AttentionMetadata
from engine.model.moe import Experts, fused_experts_torch, route

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")


@dataclass(slots=True)
class ModelConfig:
    """The handful of HF config fields this model needs, normalised across families and versions."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    # Mixture of experts (0 experts: dense). moe_layers[i]: layer i has the sparse MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """From a transformers config or its dict; raises NotImplementedError naming what is unsupported."""
        c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        model_type = c.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(f"model_type={model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act={act!r} is not supported (only 'silu')")
        heads = c["num_attention_heads"]
        max_pos = c.get("max_position_embeddings", 2048)
        sliding = c.get("sliding_window")
        uses_sliding = c.get("use_sliding_window", model_type in ("mistral", "mixtral"))
        if uses_sliding and sliding is not None and sliding < max_pos:
            raise NotImplementedError(
                f"sliding_window={sliding} < max_position_embeddings={max_pos}: sliding-window attention is not supported"
            )
        # transformers >= 5 keeps rope_theta and the scaling inside `rope_parameters`; older configs
        # have top-level `rope_theta` and `rope_scaling`.
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", c.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
            raise NotImplementedError(f"partial_rotary_factor={rope.get('partial_rotary_factor')} is not supported")
        attention_bias = bool(c.get("attention_bias", False))
        qkv_bias = (model_type == "qwen2" or (model_type == "qwen2_moe" and bool(c.get("qkv_bias", True)))
                    or attention_bias)  # Qwen2 always has q/k/v bias (Qwen2-MoE by its qkv_bias), no o bias
        moe = _moe_fields(c, model_type) if model_type in MOE_MODEL_TYPES else {}
        return cls(
            model_type=model_type,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=attention_bias and model_type not in ("qwen2", "qwen2_moe"),
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            **moe,
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _moe_fields(c: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields of a Qwen2-MoE, Qwen3-MoE or Mixtral config; a missing one is named."""
    def need(key: str) -> Any:
        if c.get(key) is None:
            raise NotImplementedError(f"model_type={model_type!r} config lacks {key!r}")
        return c[key]

    layers = c["num_hidden_layers"]
    if model_type == "mixtral":
        return dict(num_experts=need("num_local_experts"), num_experts_per_tok=need("num_experts_per_tok"),
                    moe_intermediate_size=need("intermediate_size"), norm_topk_prob=True,
                    moe_layers=(True,) * layers)
    step = int(c.get("decoder_sparse_step") or 1)
    dense = set(c.get("mlp_only_layers") or ())
    # hub configs name it num_experts; transformers 5 saves num_local_experts
    experts = c.get("num_experts") if c.get("num_experts") is not None else need("num_local_experts")
    return dict(
        num_experts=experts, num_experts_per_tok=need("num_experts_per_tok"),
        moe_intermediate_size=need("moe_intermediate_size"), norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(c.get("shared_expert_intermediate_size") or 0)
        if model_type == "qwen2_moe" else 0,
        moe_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)),
    )


# One expert's projection in a hub checkpoint: Qwen-MoE's gate/up/down_proj, Mixtral's w1/w3/w2.
_EXPERT_WEIGHT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] (fp32, CPU); 'llama3' and 'linear' scaling as in transformers."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope_scaling type={kind!r} is not supported (supported: None, 'linear', 'llama3')")


def _fused(x: torch.Tensor):
    """The compiled CPU library's fused elementwise ops (engine/attention/paged_decode_cpu.cpp:
    rms_norm, add_rms_norm, silu_mul, rope) where they apply to x (fp32 on the CPU, no autograd),
    else None (the torch ops below, the reference)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
        return None
    return cpu_kernel.load()


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE, the HF Llama convention, computed per step from positions.

    `inv_freq` is a plain attribute, not a buffer, so meta-device construction + `to_empty` leaves it intact.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, 1, D] of the positions: the same for every layer, so the model computes
        them once per forward."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions, q.dtype)
        ops = _fused(q)
        if ops is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            qo, ko = torch.empty(q.shape), torch.empty(k.shape)
            ops.rope(qo, q, cos, sin)
            ops.rope(ko, k, cos, sin)
            return qo, ko
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm in fp32 (as HF does); with `residual`, adds it first and returns the new residual too."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, it is updated in place by the fused CPU op (the caller passes the
        layer stack's own residual stream) and returned; the torch path returns a new tensor."""
        ops = _fused(x)
        if ops is not None and x.dim() == 2 and x.stride(-1) == 1:
            out = torch.empty(x.shape)
            if residual is None:
                ops.rms_norm(out, x, self.weight, self.eps)
                return out
            if residual.dtype == torch.float32 and residual.dim() == 2 and residual.stride(-1) == 1:
                ops.add_rms_norm(out, residual, x, self.weight, self.eps)
                return out, residual
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)


class Linear(nn.Linear):
    """`nn.Linear` that can run from a oneDNN-prepacked copy of its weight (`pack`, CPU fp32).

    On this project's CPU, oneDNN's prepacked GEMM was up to 4x faster than `F.linear` at 8-64
    rows (most for the wide MLP and LM head), 10-15% at 2,048 rows and about even at one row;
    `bench/engine_throughput.py` measures the engine with it. The packed copy is a snapshot: `unpack()` before changing the
    weight (`load_weights` does), `pack()` again after.
    """

    _packed: torch.Tensor | None = None

    def pack(self) -> None:
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())

    def unpack(self) -> None:
        self._packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def can_pack_linears(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether `Linear.pack` applies: fp32 on the CPU, with oneDNN in this torch build."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
        md: AttentionMetadata, backend: AttentionBackend, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k, cos_sin)
        backend.write_kv(k, v.view(t, self.num_kv_heads, self.head_dim), kv_cache, md.slot_mapping)
        o = backend.attention(q, kv_cache, md, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = _fused(gate_up)
        if ops is not None and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            act = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2))
            ops.silu_mul(act, gate_up)
            return self.down_proj(act)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ the gated shared expert of Qwen2-MoE)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if use_triton:
            from engine.model import moe_triton

            out = moe_triton.fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        else:
            out = fused_experts_torch(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.is_moe = bool(cfg.moe_layers) and cfg.moe_layers[index]
        self.mlp = SparseMoeBlock(cfg) if self.is_moe else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, kv_cache, md, backend, cos_sin=None):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, md, backend, cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if self.is_moe:
            return self.mlp(hidden, use_triton=backend.name == "triton"), residual
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """`forward` returns final hidden states [T, H]; the runner picks rows and calls `compute_logits`."""

    # HF checkpoint name -> (our fused parameter, shard index): shards are laid out in this order.
    packed = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = backend  # None: chosen from the input device on the first forward
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def pack_linears(self) -> int:
        """Run every projection and the LM head from oneDNN-prepacked weights when
        `can_pack_linears` holds for this model's device and dtype (else nothing changes).
        Returns how many were packed. The packed copies take as much memory again as the weights."""
        w = self.lm_head.weight
        if not can_pack_linears(w.device, w.dtype):
            return 0
        mods = [m for m in self.modules() if isinstance(m, Linear)]
        for m in mods:
            m.pack()
        return len(mods)

    def tie_weights(self) -> None:
        """Share lm_head with the embeddings if the config says so (again after `to_empty`, which unties)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata, given_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`given_embeds` (rows, vectors): these rows of the batch take the vectors as their input
        instead of their token's embedding (prompt embeddings)."""
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, model has num_layers={self.config.num_layers}")
        if self.attn_backend is None:
            self.attn_backend = get_attention_backend(input_ids.device)
        hidden, residual = self.model.embed_tokens(input_ids), None
        if given_embeds is not None:
            hidden = hidden.index_copy(0, given_embeds[0], given_embeds[1].to(hidden.dtype))
        cos_sin = self.model.layers[0].self_attn.rotary_emb.cos_sin(positions, hidden.dtype) if len(kv_caches) else None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata, self.attn_backend, cos_sin)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> fp32 [N, vocab] (sampling and logprobs want fp32)."""
        return self.lm_head(hidden).float()

    def shard_range(self, fused: str, index: int, rows: int | None = None) -> tuple[int, int]:
        """(start, size) of shard `index` in the output rows of fused parameter `fused` (a
        gate_up_proj of `rows` rows: its two halves)."""
        c = self.config
        if fused == "qkv_proj":
            sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        else:
            half = (rows if rows is not None else 2 * c.intermediate_size) // 2
            sizes = [half, half]
        return sum(sizes[:index]), sizes[index]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (casting to each parameter's dtype/device); every parameter must be set.

        A missing `lm_head.weight` ties the head to the embeddings, as HF does for tied checkpoints.
        """
        for m in self.modules():  # a packed copy would go stale
            if isinstance(m, Linear):
                m.unpack()
        params = dict(self.named_parameters(remove_duplicate=False))
        # Tied: the checkpoint may still carry lm_head.weight; it is the same matrix, load it once.
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                continue
            name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's hub checkpoints
            expert = _EXPERT_WEIGHT.match(name)
            if expert:  # one expert's projection in a hub checkpoint -> its slice of the stacked weights
                prefix, e, proj = expert.group(1), int(expert.group(2)), expert.group(3)
                target = f"{prefix}.experts.{'down_proj' if proj in ('down_proj', 'w2') else 'gate_up_proj'}"
                param = params.get(target)
                if param is None or e >= param.shape[0]:
                    raise ValueError(f"checkpoint tensor {name} {tuple(tensor.shape)} has no matching expert weight")
                rows = param.shape[1]
                part = param.data[e] if proj in ("down_proj", "w2") else (
                    param.data[e, : rows // 2] if proj in ("gate_proj", "w1") else param.data[e, rows // 2 :])
                if part.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name} {tuple(tensor.shape)} does not fit {target}[{e}]")
                part.copy_(tensor)
                loaded.add(f"{target}#{e}.{_EXPERT_PART[proj]}")
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self.packed:
                fused, shard = self.packed[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
                param = params.get(target)
                start, size = self.shard_range(fused, shard, None if param is None else param.shape[0])
                if param is None or tensor.shape[0] != size:
                    raise ValueError(f"checkpoint tensor {name} {tuple(tensor.shape)} does not fit {target}")
                param.data[start : start + size].copy_(tensor)
                loaded.add(f"{target}#{shard}")
                continue
            param = params.get(name)
            if param is None or param.shape != tensor.shape:
                got = None if param is None else tuple(param.shape)
                raise ValueError(f"checkpoint tensor {name} {tuple(tensor.shape)} has no matching parameter (ours: {got})")
            param.data.copy_(tensor)
            loaded.add(name)
        if "lm_head.weight" not in loaded and not tied:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.config.tie_word_embeddings = True
            loaded.add("lm_head.weight")
        expected = set()
        for name, param in self.named_parameters():
            fused = name.split(".")[-2]
            if fused in ("qkv_proj", "gate_up_proj"):
                expected |= {f"{name}#{i}" for i in range(3 if fused == "qkv_proj" else 2)}
            else:
                expected.add(name)
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # loaded whole (transformers' stacked layout) or expert by expert (a hub checkpoint)
                parts = ("down",) if name.endswith("down_proj") else ("gate", "up")
                if name in loaded:
                    loaded |= {f"{name}#{e}.{p}" for e in range(param.shape[0]) for p in parts}
                loaded.discard(name)
                expected.discard(name)
                expected |= {f"{name}#{e}.{p}" for e in range(param.shape[0]) for p in parts}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:5]}")
