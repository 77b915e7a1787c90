"""Model and device specs, and the memory accounting that sizes a replica's KV pool.

Catalog numbers: model shapes from the models' config.json; device numbers from vendor data
sheets (dense tensor-core FLOP/s per dtype, HBM bandwidth, per-direction NVLink bandwidth) and
the memory torch reports (nvidia-smi MiB), not the marketing GB.

Dtypes are three, as vLLM keeps them: the weights of the linear layers (`weight_dtype`; fp8 for an
fp8 checkpoint), the KV cache (`kv_dtype`; bf16 unless `--kv-cache-dtype fp8`) and activations,
all-reduce, embeddings and LM head (`act_dtype`; bf16, also with fp8 weights).

Names are forgiving: `meta-llama/Llama-3.1-8B-Instruct`, `Llama-3.1-8B`, `llama-3.1-8b` are one
model (a `-FP8` suffix sets fp8 weights: in 128x128 blocks from publishers whose own fp8
checkpoints use them, FP8_BLOCK_PUBLISHERS, else per channel); `h100`, `h100-sxm`, `h100_sxm`, `H100-SXM5` one device.
A model may also be a local HF `config.json` (a path), or a mapping `{base: NAME, key: value}`.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from sim.sampling import SAMPLER_SORT_UNTIL, check_generation_filter

# nvfp4: 4-bit e2m1 weights with an fp8 scale per 16 (NVIDIA's -NVFP4 checkpoints: W4A4 on
# Blackwell's FP4 tensor cores), for linear-layer weights only. int4 and int4_g32: 4-bit integer
# weights in groups of 128 (32) with a 16-bit scale each, 16-bit activations (W4A16: AWQ, GPTQ,
# compressed-tensors w4a16; vLLM runs them with its Marlin or Machete kernels). An asymmetric
# checkpoint's 4-bit zero points (AWQ's) add 0.5/128 bytes a weight, left out (0.4%).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_block": 1, "nvfp4": 0.5 + 1 / 16,
               "int4": 0.5 + 2 / 128, "int4_g32": 0.5 + 2 / 32}
FP8 = ("fp8", "fp8_block")  # fp8_block: weights in 128x128 blocks with their own scales (Qwen's -FP8)
INT4 = ("int4", "int4_g32")
QUANTIZED_WEIGHTS = FP8 + ("nvfp4",) + INT4  # weight-only formats: never a KV or activation dtype
# Routed experts' formats (expert_dtype): every weight format, and MXFP4 (4-bit e2m1 values and
# one 8-bit e8m0 scale per 32, gpt-oss: 0.5 + 1/32), for experts only. int4_g32 as Kimi-K2-Thinking
# and Kimi-K2.5 ship their experts.
EXPERT_DTYPE_BYTES = {**DTYPE_BYTES, "mxfp4": 0.5 + 1 / 32}
WEIGHT_ONLY_4BIT = ("mxfp4",) + INT4  # 4-bit weights, 16-bit math
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16", "float8": "fp8", "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8",
                  "e4m3": "fp8", "fp8_e5m2": "fp8", "auto": "bfloat16", "fp4": "nvfp4",
                  "awq": "int4", "gptq": "int4", "w4a16": "int4"}
GiB = 1024 ** 3
MiB = 1024 ** 2


def canonical_dtype(name: str, what: str = "dtype") -> str:
    d = str(name).lower().replace("torch.", "")
    d = _DTYPE_ALIASES.get(d, d)
    if d not in DTYPE_BYTES:
        raise ValueError(f"{what}={name!r}: unknown dtype; known: bf16, fp16, fp32, fp8, fp8_block, nvfp4, "
                         "int4 (W4A16 in groups of 128), int4_g32")
    return d


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    weight_dtype: str = "bfloat16"   # linear layers (q/k/v/o, gate/up/down)
    kv_dtype: str = "bfloat16"       # KV cache
    act_dtype: str = "bfloat16"      # activations, all-reduce, embeddings, LM head, norms
    qk_norm: bool = False            # Qwen3: RMSNorm on q and k per head
    # MiniMax-M2: the q and k RMSNorms run over all heads together, so under TP every layer
    # all-reduces each token's partial sums of squares (two fp32 per token) between two kernels
    qk_norm_across_heads: bool = False
    # Mixture of experts (all 0: a dense model). A MoE layer's MLP is a router over num_experts
    # routed experts of moe_intermediate_size, num_experts_per_tok of them per token, plus shared
    # experts that every token runs (shared_intermediate_size: all of them together); the other
    # mlp_layers - num_moe_layers MLP blocks (every layer's but Nemotron-H's) have a dense MLP of
    # intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    num_moe_layers: int = 0
    expert_dtype: str = ""           # routed experts' weights ("": weight_dtype; mxfp4, int4, int4_g32)
    attn_weight_dtype: str = ""      # attention projections ("": weight_dtype; bf16 in some fp8 checkpoints)
    # Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; kv_lora_rank 0: none): the KV cache
    # holds one latent of kv_lora_rank + qk_rope_head_dim per token and layer, on every TP rank.
    # (v_head_dim without MLA: the value heads' width where it is not head_dim, MiMo-V2's 128
    # against query and key heads of 192.)
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5; index_topk 0: none), on top of MLA: a
    # lightning indexer (index_n_heads heads of index_head_dim, its keys cached per token and layer
    # in fp8 with a 4-byte scale) scores every earlier token for each query, and the latent attention
    # reads only the index_topk best. The indexer's projections are replicated on every TP rank.
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    # Layers with an indexer of their own (GLM-5.2's indexer_types "full"); the others ("shared")
    # reuse the top-k of the last one and have no indexer weights, keys or scoring. 0: every layer.
    num_index_layers: int = 0
    # Block-sparse attention on grouped-query attention (MiniMax-M3; kv_lora_rank 0): in the
    # num_index_layers layers with an indexer (its query heads of index_head_dim, one key head,
    # replicated), each KV head reads the index_topk tokens of its best blocks; the other layers
    # attend to everything. index_key_dtype: the indexer's cached key, "fp8" with a 4-byte scale
    # (DeepSeek's) or a 16-bit one.
    index_key_dtype: str = "fp8"
    # The indexer's key pool (GLM-5.3-Flash's index_kpool; 1: none): it scores one pooled key, a
    # gated sum of index_pool tokens' keys (its gate a projection of the hidden state), per
    # index_pool tokens, caches those, and its top-k picks index_topk / index_pool pools of tokens
    index_pool: int = 1
    # DeepSeek-V4's compressed attention (compressed_mqa): one KV head of head_dim that is both key
    # and value (multi-query over a shared latent), q through q_lora_rank, the output through
    # o_groups block-diagonal groups of o_lora_rank; every layer attends to its last sliding_window
    # raw tokens, and num_csa_layers also to one compressed entry per csa_ratio tokens (the
    # indexer picks index_topk of them; index_* fields), num_hca_layers to one per hca_ratio
    # tokens (all of them). residual_streams: the hyper-connections' parallel residual streams.
    compressed_mqa: bool = False
    num_csa_layers: int = 0
    num_hca_layers: int = 0
    csa_ratio: int = 4
    hca_ratio: int = 128
    o_groups: int = 0
    o_lora_rank: int = 0
    residual_streams: int = 1
    # Sliding-window attention layers (gpt-oss: every other layer, window 128): their KV holds at
    # most sliding_window tokens per request, so the per-token KV counts the other layers only.
    sliding_window: int = 0
    num_sliding_layers: int = 0
    # Sliding layers whose KV heads or head width differ from the full layers' (Gemma-4: 8 KV heads
    # of 256 where its full layers have 2 of 512; MiMo-V2: 8 where its full layers have 4); 0: the
    # same as the full layers'. The query heads are the same in both kinds.
    sliding_num_kv_heads: int = 0
    sliding_head_dim: int = 0
    # Gated DeltaNet linear-attention layers (Qwen3.5, Qwen3-Next; 0: none). num_linear_layers of
    # the num_layers mix tokens with a gated delta rule instead of attention: linear_num_k_heads key
    # heads of linear_k_head_dim and linear_num_v_heads value heads of linear_v_head_dim, after a
    # causal conv1d of linear_conv_kernel taps. Such a layer keeps no KV: each request holds a
    # fixed state per layer (the conv window and a k x v matrix per value head, in
    # linear_state_dtype) whatever its length.
    num_linear_layers: int = 0
    linear_num_k_heads: int = 0
    linear_num_v_heads: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    linear_conv_kernel: int = 0
    linear_state_dtype: str = "bfloat16"
    # What the linear layers run: "" the gated delta rule; "mamba2" a Mamba-2 mixer (Nemotron-H:
    # n_groups B/C heads of ssm_state_size as the key heads, its heads of mamba_head_dim as the
    # value heads; one dt per head where the delta rule has a decay and a step size); "kda" Kimi
    # Delta Attention (Kimi-Linear, Kimi-K3): the delta rule with a decay per key channel from a
    # low-rank forget gate (down to linear_k_head_dim, replicated, and up to every key channel), a
    # step size per head, and an output gate that is either full-rank in the input projection
    # (linear_gate_rank 0) or low-rank (down to linear_gate_rank, replicated, and up). No kernel
    # table holds Mamba-2's or KDA's: their layers are the roofline, counted.
    linear_kind: str = ""
    linear_gate_rank: int = 0
    # Blocks with an MLP or MoE of their own (0: every layer). Nemotron-H's blocks are each one
    # of a mixer (Mamba-2 or attention: num_layers of them), an MLP or a MoE, so it has fewer MLP
    # blocks than mixers. mlp_gated False: up and down projections only (squared ReLU), in the
    # dense MLPs and the experts alike, where SwiGLU's gate and up make the first one twice as wide.
    num_mlp_layers: int = 0
    mlp_gated: bool = True
    # Latent MoE (Nemotron-3 Super, Ultra; 0: none): each MoE block projects the hidden state down
    # to moe_latent_size (replicated on every rank), its routed experts work in that width, and it
    # projects their sum back up; the router and the shared experts see the hidden state.
    moe_latent_size: int = 0
    # Whether attention rotates q and k (RoPE; vLLM keeps a cos/sin cache). Nemotron-H's has no
    # positional encoding: its Mamba-2 blocks carry order.
    rotary: bool = True
    # Full-attention layers with a sigmoid output gate per head: in the q projection, whose width
    # doubles (Qwen3.5, Qwen3-Next); in a latent-attention layer a GEMM of its own from the hidden
    # state (Kimi-K3: o_gate)
    attn_output_gate: bool = False
    # A vision encoder and projector loaded with the model (Llama-4's checkpoints are multimodal):
    # its weights, in the activation dtype, split by TP; no text step reads them
    vision_params: int = 0
    # The top-k/top-p filtering vLLM applies to a request that sets no sampling parameters: the
    # checkpoint's generation_config.json ("" none: a temperature or greedy only; "top_p",
    # "top_k", "top_k_top_p"). It prices the sampler (sim.sampling).
    generation_filter: str = ""

    def __post_init__(self) -> None:
        for key in ("weight_dtype", "kv_dtype", "act_dtype"):
            object.__setattr__(self, key, canonical_dtype(getattr(self, key), key))
        if self.kv_dtype in ("fp8_block", "nvfp4") + INT4 or self.act_dtype in QUANTIZED_WEIGHTS:
            raise ValueError(f"kv_dtype={self.kv_dtype!r}, act_dtype={self.act_dtype!r}: fp8_block, nvfp4 and int4 "
                             "are weight formats")
        if self.attn_weight_dtype:
            object.__setattr__(self, "attn_weight_dtype", canonical_dtype(self.attn_weight_dtype, "attn_weight_dtype"))
        check_generation_filter(self.generation_filter)
        if self.expert_dtype:
            e = str(self.expert_dtype).lower()
            e = e if e in EXPERT_DTYPE_BYTES else canonical_dtype(e, "expert_dtype")
            object.__setattr__(self, "expert_dtype", e)
        if self.num_experts:
            k = self.num_experts_per_tok
            if not 0 < k <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(f"num_experts_per_tok={k!r}, moe_intermediate_size={self.moe_intermediate_size!r}: "
                                 f"a MoE model needs 1 <= num_experts_per_tok <= num_experts={self.num_experts} "
                                 "and moe_intermediate_size > 0")
            if not 0 < self.num_moe_layers <= self.num_layers:
                raise ValueError(f"num_moe_layers={self.num_moe_layers!r}: must be in 1..num_layers={self.num_layers}")
        if not 0 <= self.num_sliding_layers <= self.num_layers:
            raise ValueError(f"num_sliding_layers={self.num_sliding_layers!r}: must be in 0..num_layers={self.num_layers}")
        for key in ("sliding_num_kv_heads", "sliding_head_dim"):
            if getattr(self, key) < 0 or (getattr(self, key) and not self.num_sliding_layers):
                raise ValueError(f"{key}={getattr(self, key)!r}: a shape of the sliding-window layers, >= 0, "
                                 "for a model with num_sliding_layers > 0")
        if self.index_topk and not (self.index_n_heads > 0 and self.index_head_dim > 0):
            raise ValueError(f"index_topk={self.index_topk!r}: sparse attention needs an indexer "
                             "(index_n_heads, index_head_dim > 0)")
        object.__setattr__(self, "index_key_dtype", canonical_dtype(self.index_key_dtype, "index_key_dtype"))
        if self.linear_kind not in ("", "mamba2", "kda"):
            raise ValueError(f"linear_kind={self.linear_kind!r}: expected '' (gated delta rule), 'mamba2' or 'kda'")
        if self.linear_gate_rank < 0 or (self.linear_gate_rank and self.linear_kind != "kda"):
            raise ValueError(f"linear_gate_rank={self.linear_gate_rank!r}: a KDA layer's low-rank output gate "
                             "(linear_kind 'kda'), >= 0")
        if not 0 <= self.num_mlp_layers or self.num_moe_layers > self.mlp_layers:
            raise ValueError(f"num_mlp_layers={self.num_mlp_layers!r}, num_moe_layers={self.num_moe_layers!r}: "
                             "the MoE blocks are some of the MLP blocks")
        if self.moe_latent_size and not (self.is_moe and 0 < self.moe_latent_size < self.hidden_size):
            raise ValueError(f"moe_latent_size={self.moe_latent_size!r}: a MoE model's latent width, below "
                             f"hidden_size={self.hidden_size}")
        if self.index_pool < 1 or (self.index_pool > 1 and not (
                self.is_mla and self.index_topk and self.index_topk % self.index_pool == 0)):
            raise ValueError(f"index_pool={self.index_pool!r}: a latent-attention indexer's key pool, >= 1, "
                             f"dividing index_topk={self.index_topk}")
        if not 0 <= self.num_index_layers <= self.num_layers:
            raise ValueError(f"num_index_layers={self.num_index_layers!r}: must be in 0..num_layers={self.num_layers}")
        if not 0 <= self.num_linear_layers < self.num_layers - self.num_sliding_layers:
            raise ValueError(f"num_linear_layers={self.num_linear_layers!r}: must be in 0..num_layers - 1 "
                             f"({self.num_layers - 1}; a model keeps at least one attention layer)")
        if self.num_linear_layers:
            for key in ("linear_num_k_heads", "linear_num_v_heads", "linear_k_head_dim", "linear_v_head_dim",
                        "linear_conv_kernel"):
                if getattr(self, key) <= 0:
                    raise ValueError(f"{key}={getattr(self, key)!r}: a model with linear-attention layers needs it > 0")
            if self.linear_num_v_heads % self.linear_num_k_heads:
                raise ValueError(f"linear_num_v_heads={self.linear_num_v_heads}: must be a multiple of "
                                 f"linear_num_k_heads={self.linear_num_k_heads}")
            object.__setattr__(self, "linear_state_dtype", canonical_dtype(self.linear_state_dtype, "linear_state_dtype"))

    # ------------------------------------------------------------ dtypes
    @property
    def dtype(self) -> str:
        """The weight dtype (the old single `dtype`)."""
        return self.weight_dtype

    @property
    def weight_dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def kv_dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def act_dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.act_dtype]

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one KV element (kept for callers that size KV with it)."""
        return self.kv_dtype_bytes

    @property
    def attn_dtype(self) -> str:
        return self.attn_weight_dtype or self.weight_dtype

    @property
    def expert_dtype_bytes(self) -> float:
        return EXPERT_DTYPE_BYTES[self.expert_dtype or self.weight_dtype]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are linear attention (Gated DeltaNet, Mamba-2) rather than attention."""
        return self.num_linear_layers > 0

    @property
    def num_attention_layers(self) -> int:
        """Layers with softmax attention (full or sliding-window): all but the linear ones."""
        return self.num_layers - self.num_linear_layers

    @property
    def mlp_layers(self) -> int:
        """Blocks with an MLP or a MoE (every layer unless num_mlp_layers says fewer)."""
        return self.num_mlp_layers or self.num_layers

    @property
    def num_sublayers(self) -> int:
        """Mixers and MLPs, each behind a fused add + RMSNorm and (under TP) an all-reduce: two a
        layer, or one a Nemotron-H block."""
        return self.num_layers + self.mlp_layers

    @property
    def expert_hidden(self) -> int:
        """The width the routed experts read and write: the latent's, else the hidden size."""
        return self.moe_latent_size or self.hidden_size

    @property
    def up_factor(self) -> int:
        """The first MLP projection's width over the intermediate size: 2 (gate and up) or 1."""
        return 2 if self.mlp_gated else 1

    @property
    def ba_width(self) -> int:
        """Per value head, the columns of a linear layer's small projection: the delta rule's decay
        and step size (2), Mamba-2's dt (1)."""
        return 1 if self.linear_kind == "mamba2" else 2

    @property
    def index_layers(self) -> int:
        """Layers that run a sparse-attention indexer (0 without sparse attention)."""
        return (self.num_index_layers or self.num_layers) if self.index_topk else 0

    @property
    def sparse_attention_layers(self) -> int:
        """Layers whose attention reads only index_topk keys: every full-attention layer of a
        latent-attention model (DeepSeek-V3.2, GLM-5), the layers with an indexer of a
        grouped-query one (MiniMax-M3); 0 without sparse attention."""
        if not self.index_topk:
            return 0
        return self.num_full_attention_layers if self.is_mla else self.index_layers

    @property
    def index_key_bytes(self) -> float:
        """Bytes of one token's cached indexer key: fp8 with its 4-byte scale, or 16-bit."""
        if self.index_key_dtype == "fp8":
            return self.index_head_dim + 4
        return self.index_head_dim * DTYPE_BYTES[self.index_key_dtype]

    @property
    def num_full_attention_layers(self) -> int:
        """Layers whose KV grows with the context: all but sliding-window and linear ones."""
        return self.num_layers - self.num_sliding_layers - self.num_linear_layers

    @property
    def dense_dtype_bytes(self) -> int:
        """Embeddings, LM head and norms: unquantized (act dtype) when the linear layers are fp8."""
        return self.act_dtype_bytes if self.weight_dtype in QUANTIZED_WEIGHTS else self.weight_dtype_bytes

    # ------------------------------------------------------------ shapes
    def kv_heads_per_gpu(self, tp: int = 1, sliding: bool = False) -> int:
        """KV heads each GPU holds in a full (or sliding-window) layer: a share of them, or one
        replicated head when TP > KV heads (vLLM: max(1, num_kv_heads // tp)). Used by memory
        accounting and every cost model."""
        return max(1, self.attention_shape(sliding)[0] // tp)

    def attention_shape(self, sliding: bool = False) -> tuple[int, int, int]:
        """(KV heads, query and key head width, value head width) of a full attention layer, or of
        a sliding-window one (its own KV heads and width where the config gives them). MLA: the
        model's heads, qk_nope + qk_rope and v_head_dim."""
        if sliding and not self.is_mla:
            d = self.sliding_head_dim or self.head_dim
            return self.sliding_num_kv_heads or self.num_kv_heads, d, self.v_head_dim or d
        return self.num_kv_heads, self.head_dim, self.v_head_dim or self.head_dim

    @property
    def has_sliding_shape(self) -> bool:
        """Whether the sliding-window layers' attention has another shape than the full layers'."""
        return bool(self.num_sliding_layers) and self.attention_shape(True) != self.attention_shape(False)

    def attention_gemm_shapes(self, tp: int = 1) -> dict[str, tuple[int, int]]:
        """(N, K) of one layer's attention GEMMs on one GPU. MLA (DeepSeek): q down/up (or one q
        projection), the KV latent's down projection (replicated on every rank, as vLLM runs it),
        its up projection to per-head keys and values, and o_proj; with sparse attention the
        indexer's query, key and head-weight projections (replicated)."""
        h, d = self.hidden_size, self.head_dim
        q = self.num_heads // tp
        if self.compressed_mqa:  # every layer's own projections (the compressors': step_gemms)
            return {name: (n, k) for name, n, k, layers, _dt in self.compressed_attention_gemms(tp)
                    if layers == self.num_layers}
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            out = {}
            if self.q_lora_rank:
                out["q_a"] = (self.q_lora_rank, h)
                out["q_b"] = (q * qk, self.q_lora_rank)
            else:
                out["q"] = (q * qk, h)
            out["kv_a"] = (self.kv_lora_rank + self.qk_rope_head_dim, h)
            out["kv_b"] = (q * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
            out["o_proj"] = (h, q * self.v_head_dim)
            if self.attn_output_gate:  # (Kimi-K3) a sigmoid gate per head and value dim, from the hidden state
                out["o_gate"] = (q * self.v_head_dim, h)
            if self.index_topk:  # the indexer's query (from the q latent), key and head weights
                out["index_q"] = (self.index_n_heads * self.index_head_dim, self.q_lora_rank or h)
                out["index_k"] = (self.index_head_dim, h)
                out["index_weights"] = (self.index_n_heads, h)
                if self.index_pool > 1:  # the key pool's gate scores
                    out["index_gate"] = (self.index_head_dim, h)
            return out
        out = self.gqa_gemm_shapes(tp)
        if self.index_topk:  # a block-sparse indexer's query and key projections (replicated)
            out.update(index_q=(self.index_n_heads * self.index_head_dim, h), index_k=(self.index_head_dim, h))
        return out

    def compressed_attention_gemms(self, tp: int = 1) -> list[tuple[str, int, int, int, str]]:
        """DeepSeek-V4's attention GEMMs on one GPU, (name, N, K, layers, weight dtype): q down
        (replicated) and up, the shared latent's projection (one KV head: replicated), the grouped
        output projection (its groups split over the ranks: one block-diagonal GEMM) and the mix
        back to the hidden size, in every layer; the compressors' key and gate projections (two
        overlapping series in the CSA layers) and the indexer's query, head weights and own
        compressor in the CSA layers, all replicated, in 16 bits as the checkpoints keep them."""
        h, d, L, a = self.hidden_size, self.head_dim, self.num_layers, self.act_dtype
        q, qr, dt = self.num_heads // tp, self.q_lora_rank, self.attn_dtype
        g = max(self.o_groups // tp, 1)
        c4, c128, di, ni = self.num_csa_layers, self.num_hca_layers, self.index_head_dim, self.index_n_heads
        rows = [("q_a", qr, h, L, dt), ("q_b", q * d, qr, L, dt), ("kv", d, h, L, dt),
                ("o_a", g * self.o_lora_rank, self.num_heads * d // self.o_groups, L, dt),
                ("o_b", h, g * self.o_lora_rank, L, dt)]
        if c4:
            rows += [("csa_compress", 4 * d, h, c4, a), ("index_q", ni * di, qr, c4, dt),
                     ("index_weights", ni, h, c4, a), ("index_compress", 4 * di, h, c4, a)]
        if c128:
            rows += [("hca_compress", 2 * d, h, c128, a)]
        return rows

    @property
    def latent_entry_bytes(self) -> int:
        """One cached entry of DeepSeek-V4's latent (a raw token's or a compressed one): in fp8,
        vLLM's layout of the non-rotary dims in fp8 with a scale per 64 and a pad byte, and the
        rotary ones in 16 bits (584 bytes for 448 + 64); else every dim in the KV dtype."""
        if self.kv_dtype_bytes == 1:
            nope = self.head_dim - self.qk_rope_head_dim
            return nope + nope // 64 + 1 + 2 * self.qk_rope_head_dim
        return self.head_dim * self.kv_dtype_bytes

    def gqa_gemm_shapes(self, tp: int = 1, sliding: bool = False) -> dict[str, tuple[int, int]]:
        """(N, K) of a (grouped-query) attention layer's q/k/v and output projections on one GPU,
        full or sliding-window (attention_shape)."""
        kv, d, v = self.attention_shape(sliding)
        kv = max(1, kv // tp)
        q = self.num_heads // tp
        gate = 2 if self.attn_output_gate else 1  # q and its output gate in one projection
        return {"qkv": ((gate * q + kv) * d + kv * v, self.hidden_size), "o_proj": (self.hidden_size, q * v)}

    def linear_conv_dim(self, tp: int = 1) -> int:
        """Channels of a linear-attention layer's causal conv1d on one GPU (q, k and v)."""
        return (2 * self.linear_num_k_heads * self.linear_k_head_dim
                + self.linear_num_v_heads * self.linear_v_head_dim) // tp

    def linear_attention_gemm_shapes(self, tp: int = 1) -> dict[str, tuple[int, int]]:
        """(N, K) of one linear-attention layer's GEMMs on one GPU: the projection to q, k, v and
        the output gate z, the one to the decay and step sizes (b, a: one each per value head),
        and the output projection. KDA: q, k, v (and a full-rank output gate); the step sizes
        with the forget gate's (and a low-rank output gate's) replicated down projections; their up
        projections (kda_f_b to every key channel, kda_g_b to every value channel); the output."""
        if not self.num_linear_layers:
            return {}
        h, vd = self.hidden_size, self.linear_num_v_heads * self.linear_v_head_dim
        if self.linear_kind == "kda":
            dk, r = self.linear_k_head_dim, self.linear_gate_rank
            out = {"in_proj_qkvz": ((self.linear_conv_dim(1) + (0 if r else vd)) // tp, h),
                   "in_proj_ba": (self.linear_num_v_heads // tp + dk + r, h),
                   "kda_f_b": (self.linear_num_k_heads * dk // tp, dk)}
            if r:
                out["kda_g_b"] = (vd // tp, r)
            out["out_proj"] = (h, vd // tp)
            return out
        return {"in_proj_qkvz": ((self.linear_conv_dim(1) + vd) // tp, h),
                "in_proj_ba": (self.ba_width * self.linear_num_v_heads // tp, h),
                "out_proj": (h, vd // tp)}

    def gemm_shapes(self, tp: int = 1) -> dict[str, tuple[int, int]]:
        """(N, K) of one dense layer's GEMMs on one GPU (y[M, N] = x[M, K] @ W[K, N])."""
        return {**self.attention_gemm_shapes(tp), "gate_up": (self.up_factor * self.intermediate_size // tp, self.hidden_size),
                "down": (self.hidden_size, self.intermediate_size // tp)}

    def step_gemms(self, tp: int = 1) -> list[tuple[str, int, int, int, str]]:
        """Every dense GEMM of a forward, per layer kind: (name, N, K, layers, weight dtype).
        Routed experts are not here (their work depends on the tokens: expert_gemms)."""
        L, h = self.num_layers, self.hidden_size
        A = self.num_attention_layers
        if self.compressed_mqa:
            out = self.compressed_attention_gemms(tp)
        elif self.has_sliding_shape and not self.is_mla:
            S = self.num_sliding_layers  # sliding-window layers of their own shape (sliding_*)
            out = [(k, n, kk, A - S, self.attn_dtype) for k, (n, kk) in self.gqa_gemm_shapes(tp).items()]
            out += [("sliding_" + k, n, kk, S, self.attn_dtype) for k, (n, kk) in self.gqa_gemm_shapes(tp, True).items()]
        else:
            out = [(k, n, kk, self.index_layers if k in INDEXER_GEMMS else A, self.attn_dtype)
                   for k, (n, kk) in self.attention_gemm_shapes(tp).items()]
        # (in_proj_ba: a few columns per GPU, in the activation dtype, as vLLM keeps them)
        out += [(k, n, kk, self.num_linear_layers, self.act_dtype if k == "in_proj_ba" else self.attn_dtype)
                for k, (n, kk) in self.linear_attention_gemm_shapes(tp).items()]
        dense = self.mlp_layers - self.num_moe_layers
        if dense:
            out += [("gate_up", self.up_factor * self.intermediate_size // tp, h, dense, self.weight_dtype),
                    ("down", h, self.intermediate_size // tp, dense, self.weight_dtype)]
        if self.num_moe_layers and self.shared_intermediate_size:
            s = self.shared_intermediate_size
            out += [("shared_gate_up", self.up_factor * s // tp, h, self.num_moe_layers, self.weight_dtype),
                    ("shared_down", h, s // tp, self.num_moe_layers, self.weight_dtype)]
        if self.num_moe_layers:
            out += [("router", self.num_experts, h, self.num_moe_layers, self.act_dtype)]
        if self.moe_latent_size:  # the latent MoE's projections, replicated
            out += [("moe_latent_down", self.moe_latent_size, h, self.num_moe_layers, self.weight_dtype),
                    ("moe_latent_up", h, self.moe_latent_size, self.num_moe_layers, self.weight_dtype)]
        return out

    def expert_gemms(self, tp: int = 1) -> dict[str, tuple[int, int]]:
        """(N, K) of one routed expert's GEMMs on one GPU (each rank holds a 1/tp slice of every
        expert; with expert parallelism instead 1/ep of the experts whole: the same bytes)."""
        mi = self.moe_intermediate_size
        eh = self.expert_hidden
        return {"gate_up": (self.up_factor * mi // tp, eh), "down": (eh, mi // tp)}

    def experts_touched(self, num_tokens: float) -> float:
        """Expected distinct routed experts one MoE layer runs for num_tokens tokens, each routed
        to num_experts_per_tok distinct experts, uniformly: E * (1 - (1 - k/E)^T). One token reads
        k experts' weights; a batch of a few hundred reads nearly all E."""
        if not self.num_experts or num_tokens <= 0:
            return 0.0
        E, k = self.num_experts, self.num_experts_per_tok
        return E * (1.0 - (1.0 - k / E) ** num_tokens)

    @property
    def linear_attention_params_per_layer(self) -> int:
        """A linear-attention layer's weights: its projections, the conv1d's taps, the decay and
        step-size biases (A_log, dt_bias: one per value head) and the gated RMSNorm's weight."""
        if not self.num_linear_layers:
            return 0
        proj = sum(n * k for n, k in self.linear_attention_gemm_shapes(1).values())
        if self.linear_kind == "mamba2":
            # conv1d taps and biases; dt_bias, A_log and D per head; the gated RMSNorm over all heads
            return (proj + self.linear_conv_dim(1) * (self.linear_conv_kernel + 1) + 3 * self.linear_num_v_heads
                    + self.linear_num_v_heads * self.linear_v_head_dim)
        if self.linear_kind == "kda":  # conv taps; A_log per head, dt_bias per key channel; the norm
            return (proj + self.linear_conv_dim(1) * self.linear_conv_kernel + self.linear_num_v_heads
                    + self.linear_num_k_heads * self.linear_k_head_dim + self.linear_v_head_dim)
        return (proj + self.linear_conv_dim(1) * self.linear_conv_kernel + 2 * self.linear_num_v_heads
                + self.linear_v_head_dim)

    @property
    def attention_params(self) -> int:
        """The weights of every attention layer (full and sliding-window, each of its own shape;
        DeepSeek-V4's with its compressors and their position biases; an indexer's key pool with
        its position biases)."""
        if self.compressed_mqa:
            d, di = self.head_dim, self.index_head_dim
            proj = sum(n * k * layers for _name, n, k, layers, _dt in self.compressed_attention_gemms(1))
            return proj + (self.num_csa_layers * self.csa_ratio * 2 * (d + di) + self.num_hca_layers * self.hca_ratio * d)
        index = sum(n * k for name, (n, k) in self.attention_gemm_shapes(1).items() if name in INDEXER_GEMMS)
        own = self.attention_params_per_layer - (index * self.index_layers // self.num_layers if self.is_mla else 0)
        out = self.num_attention_layers * own + self.index_layers * index
        if self.index_pool > 1:  # the key pool's position biases
            out += self.index_layers * self.index_pool * self.index_head_dim
        if self.num_sliding_layers and not self.is_mla:
            out += self.num_sliding_layers * (sum(n * k for n, k in self.gqa_gemm_shapes(1, True).values()) - own)
        return out

    @property
    def attention_params_per_layer(self) -> int:
        """One (full) attention layer's weights (q/k/v/o, or MLA's projections and norms)."""
        if self.is_mla:
            # the full projections, kept whole: sum of N*K at tp=1, plus the latent's two norms;
            # the indexer's (INDEXER_GEMMS) averaged over the layers, in index_layers of them
            shapes = self.attention_gemm_shapes(1)
            own = sum(n * k for name, (n, k) in shapes.items() if name not in INDEXER_GEMMS)
            index = sum(n * k for name, (n, k) in shapes.items() if name in INDEXER_GEMMS)
            return own + self.kv_lora_rank + self.q_lora_rank + index * self.index_layers // self.num_layers
        return sum(n * k for n, k in self.gqa_gemm_shapes(1).values())

    @property
    def expert_params(self) -> int:
        """Routed experts' weights of the whole model."""
        return self.num_moe_layers * self.num_experts * (self.up_factor + 1) * self.expert_hidden * self.moe_intermediate_size

    @property
    def layer_params(self) -> int:
        """The weights of every layer (mixers, MLPs and MoEs, their norms): num_params less the
        embeddings and the final norm."""
        h, w = self.hidden_size, self.up_factor + 1
        dense = (self.mlp_layers - self.num_moe_layers) * w * h * self.intermediate_size
        moe = self.num_moe_layers * (w * h * self.shared_intermediate_size + h * self.num_experts
                                     + 2 * h * self.moe_latent_size)
        mix = (self.attention_params + self.num_linear_layers * self.linear_attention_params_per_layer
               + self.hyper_connection_params)
        return mix + dense + moe + self.expert_params + self.num_sublayers * h  # + an RMSNorm per mixer and MLP

    @property
    def hyper_connection_params(self) -> int:
        """The hyper-connections' weights (residual_streams r > 1; 0 without): each sublayer's
        (2 + r) x r mixing maps of the r streams' hidden states; DeepSeek-V4's head mixes the
        streams with r maps of its own, GLM-5.3-Flash's with a mean, and GLM's checkpoints add
        each sublayer's (2 + r) x r biases and 3 scales."""
        r, h = self.residual_streams, self.hidden_size
        if r <= 1:
            return 0
        if self.compressed_mqa:
            return (self.num_sublayers * (2 + r) * r + r) * r * h
        return self.num_sublayers * ((2 + r) * r * (r * h + 1) + 3)

    @property
    def params_per_layer(self) -> int:
        """Per layer, averaged over layer kinds (layer_params / num_layers, rounded down)."""
        return self.layer_params // self.num_layers

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.embedding_params

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.lm_head_params + self.layer_params + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """All weights, as a checkpoint holds them (fp8 linear layers; bf16 embeddings, head, norms)."""
        return self.weight_bytes_per_gpu(1)

    def weight_bytes_per_gpu(self, tp: int = 1, expert_ranks: int | None = None) -> int:
        """One GPU's weights at TP: linear layers sharded (k/v projections replicated when TP > KV
        heads; MLA's latent down projection replicated), routed experts sharded (by TP or EP)
        over `expert_ranks` GPUs (default tp; tp x dp with data-parallel attention), embeddings
        and LM head sharded by vocabulary, norms and the router replicated."""
        return (self.dense_weight_bytes_per_gpu(tp) + self.expert_weight_bytes_per_gpu(expert_ranks or tp)
                + self.vision_bytes_per_gpu(tp))

    def vision_bytes_per_gpu(self, tp: int = 1) -> int:
        """A vision encoder's weights on one GPU (split by TP); no text step reads them."""
        return -(-self.vision_params // tp) * self.act_dtype_bytes

    def loaded_bytes_per_gpu(self, tp: int = 1, expert_ranks: int | None = None) -> int:
        """One GPU's memory once the model is loaded, as vLLM logs it ("Model loading took"): the
        weights; MXFP4 experts as vLLM's MoE kernels hold them, the hidden size padded to a
        multiple of 256 (gpt-oss: 2880 -> 3072); and the rotary embedding's cos/sin cache, which
        vLLM precomputes for max_position_embeddings positions in the activation dtype on every
        rank (2.5 GiB for Llama-4's 10M positions)."""
        pad = 0
        if (self.expert_dtype or self.weight_dtype) == "mxfp4":
            eh = self.expert_hidden
            pad = self.expert_weight_bytes_per_gpu(expert_ranks or tp) * (-(-eh // 256) * 256 / eh - 1)
        rotary = (self.qk_rope_head_dim if self.is_mla or self.compressed_mqa else self.head_dim) if self.rotary else 0
        rope = self.max_position_embeddings * rotary * self.act_dtype_bytes
        return int(self.weight_bytes_per_gpu(tp, expert_ranks) + pad + rope)

    def dense_weight_bytes_per_gpu(self, tp: int = 1) -> int:
        """All weights but the routed experts, on one GPU."""
        # (MLA's q_a and kv_a have the same shape at every TP: replicated)
        lin = sum(layers * n * k * DTYPE_BYTES[dtype] for _name, n, k, layers, dtype in self.step_gemms(tp))
        norms = (self.num_sublayers + 1) * self.hidden_size
        if self.is_mla:
            norms += self.num_attention_layers * (self.kv_lora_rank + self.q_lora_rank)
        vocab = -(-self.vocab_size // tp) * self.hidden_size
        dense = vocab * (1 if self.tie_word_embeddings else 2)
        return int(lin + (norms + dense) * self.dense_dtype_bytes)

    def expert_weight_bytes_per_gpu(self, tp: int = 1) -> int:
        """Routed experts' weights on one GPU (1/tp of them, whether split by TP or EP)."""
        per = sum(n * k for n, k in self.expert_gemms(tp).values())
        return int(self.num_moe_layers * self.num_experts * per * self.expert_dtype_bytes)

    def weight_read_bytes_per_gpu(self, tp: int = 1) -> int:
        """Weights one forward streams from HBM: all but the input embedding, which is a gather of
        a few rows (a tied LM head still reads the whole table), and a vision encoder; every
        routed expert (a step reads those its tokens touch: experts_touched)."""
        emb = 0 if self.tie_word_embeddings else -(-self.vocab_size // tp) * self.hidden_size * self.dense_dtype_bytes
        return self.weight_bytes_per_gpu(tp) - emb - self.vision_bytes_per_gpu(tp)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every full-attention layer for one token (all KV heads); MLA: the latent."""
        return self.kv_bytes_per_token_per_gpu(0)

    def kv_bytes_per_token_per_gpu(self, tp: int = 1) -> int:
        """One GPU's KV bytes per token (tp=0: all KV heads). MLA keeps the whole latent on every
        rank; sliding-window layers are left out (at most sliding_window tokens per request), and
        so are linear-attention layers (a fixed state per request: linear_state_bytes_per_request_per_gpu)."""
        layers = self.num_full_attention_layers
        if self.compressed_mqa:  # compressed entries (and the indexer's keys) per token; windows apart
            e = self.latent_entry_bytes
            return math.ceil(self.num_csa_layers * (e + self.index_key_bytes) / self.csa_ratio
                             + self.num_hca_layers * e / self.hca_ratio)
        if self.is_mla:
            latent = (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_dtype_bytes
            if self.index_topk:
                if self.kv_dtype_bytes == 1:  # vLLM's fp8_ds_mla: fp8 latent, 4 fp32 scales, bf16 rope
                    latent = self.kv_lora_rank + 16 + 2 * self.qk_rope_head_dim
                # the indexer's fp8 key and its scale, in the layers with an indexer (one per pool)
                return layers * latent + math.ceil(self.index_layers * self.index_key_bytes / self.index_pool)
            return layers * latent
        # (a block-sparse indexer's key: one head, on every rank)
        return layers * self._kv_bytes_per_token_layer(tp) + self.index_layers * int(self.index_key_bytes)

    def _kv_bytes_per_token_layer(self, tp: int, sliding: bool = False) -> int:
        """One token's K and V in one GQA layer (full or sliding-window) on one GPU (tp=0: all KV heads)."""
        kv, d, v = self.attention_shape(sliding)
        heads = kv if tp == 0 else max(1, kv // tp)
        return heads * (d + v) * self.kv_dtype_bytes

    def sliding_kv_bytes_per_request_per_gpu(self, tp: int = 1, block_size: int = 16) -> int:
        """KV of the sliding-window layers for one running request: the window (and the block it
        starts in) of each such layer, as the pool holds them (sliding_pool_layers)."""
        per_token = self.sliding_kv_pool_bytes_per_token_per_gpu(tp)
        if not per_token:
            return 0
        return per_token * (-(-self.sliding_window // block_size) * block_size + block_size)

    @property
    def sliding_pool_layers(self) -> int:
        """The sliding-window layers as vLLM's hybrid KV cache manager charges the pool for them.
        It gives both kinds one page size (a kind with smaller pages gets longer blocks), puts the
        layers into groups of the smaller kind's count (the larger's where the two are within 25%),
        and pads a kind's last group to a whole one: Gemma-3-27B's 52 sliding layers beside its 10
        full ones are held as 60, MiMo-V2-Flash's 39 beside 9 as 45. Beside latent or linear layers:
        as counted (vLLM groups those otherwise)."""
        S, F = self.num_sliding_layers, self.num_full_attention_layers
        if not S or not F or self.is_mla or self.compressed_mqa or self.num_linear_layers:
            return S
        g = min(S, F) if max(S, F) >= 1.25 * min(S, F) else max(S, F)
        return -(-S // g) * g

    def sliding_kv_pool_bytes_per_token_per_gpu(self, tp: int = 1) -> int:
        """sliding_kv_bytes_per_token_per_gpu as the pool holds it (sliding_pool_layers): what a
        request's window charges the KV pool; its attention reads the real layers only."""
        real = self.sliding_kv_bytes_per_token_per_gpu(tp)
        S = self.num_sliding_layers
        return real * self.sliding_pool_layers // S if real and S else real

    def sliding_kv_bytes_per_token_per_gpu(self, tp: int = 1) -> int:
        """One token's K and V in every sliding-window layer, on one GPU (0 without such layers;
        DeepSeek-V4: every layer's raw-token latent)."""
        if self.compressed_mqa and self.sliding_window:
            return self.num_layers * self.latent_entry_bytes
        if not self.num_sliding_layers or not self.sliding_window:
            return 0
        return self.num_sliding_layers * self._kv_bytes_per_token_layer(tp, sliding=True)

    def linear_state_bytes_per_request_per_gpu(self, tp: int = 1) -> int:
        """One request's state in the linear-attention layers on one GPU: per layer, the conv1d's
        last linear_conv_kernel - 1 inputs (activation dtype) and a k x v matrix per value head
        (linear_state_dtype), each split by TP."""
        if not self.num_linear_layers:
            return 0
        conv = self.linear_conv_dim(tp) * (self.linear_conv_kernel - 1) * self.act_dtype_bytes
        ssm = (self.linear_num_v_heads // tp * self.linear_k_head_dim * self.linear_v_head_dim
               * DTYPE_BYTES[self.linear_state_dtype])
        return self.num_linear_layers * (conv + ssm)

    def with_dtypes(self, weight_dtype: str | None = None, kv_dtype: str | None = None,
                    act_dtype: str | None = None) -> "ModelSpec":
        return replace(self, **{k: v for k, v in (("weight_dtype", weight_dtype), ("kv_dtype", kv_dtype),
                                                  ("act_dtype", act_dtype)) if v is not None})

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "custom", dtype: str | None = None,
                       kv_dtype: str = "bfloat16") -> "ModelSpec":
        """From a HF config.json mapping (hf_config_fields says which families and fields it
        reads; anything else is refused with ValueError naming the field). Weight dtype: `dtype`,
        else what the config's quantization_config says (fp8 per channel or in 128x128 blocks;
        mxfp4 or int4 routed experts), else the config's torch_dtype (bf16 when absent)."""
        kw = hf_config_fields(cfg)
        if dtype is not None:
            kw["weight_dtype"] = dtype
        # (a family whose cache is fp8 whatever is asked: DeepSeek-V4's latents)
        return cls(name=name, **{"kv_dtype": kv_dtype, **kw})


# The sparse-attention indexer's GEMMs (ModelSpec.attention_gemm_shapes): in index_layers layers only
INDEXER_GEMMS = ("index_q", "index_k", "index_weights", "index_gate")

# HF model_type -> family. Dense families are read as Llama-like decoders.
# (MiMo: Qwen2's decoder; its multi-token-prediction layer is not loaded without speculative decoding;
# Phi-3/Phi-4: Llama's weights, with q/k/v and gate/up each fused into one matrix; Granite: Llama's
# weights with scalar multipliers)
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_vl", "qwen3_vl_text", "mimo", "phi3",
                     "qwen2_5_vl", "qwen2_5_vl_text", "granite")
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "kimi_k2",
                   "deepseek_v32", "glm_moe_dsa", "gpt_oss", "minimax_m2", "llama4", "llama4_text",
                   "qwen3_vl_moe", "qwen3_vl_moe_text", "step3p7", "minimax_m3", "minimax_m3_vl", "deepseek_v4",
                   "glm4_moe")
# Nemotron-H (Nemotron-H, Nemotron-3): blocks of Mamba-2 ("M"), attention ("*"), a squared-ReLU MLP
# ("-") or a MoE ("E") each, as hybrid_override_pattern lists them
NEMOTRON_H_MODEL_TYPES = ("nemotron_h",)
# (its config.json's names for them, as layers_block_type lists them)
NEMOTRON_H_BLOCKS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
# Qwen3-VL: Qwen3's and Qwen3-MoE's text decoders (text_config) with a vision encoder
QWEN3_VL_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe", "qwen3_vl_moe_text")
# Hybrids of Gated DeltaNet linear attention and gated full attention (every
# full_attention_interval-th layer, or as layer_types lists them): Qwen3-Next and Qwen3.5, dense or
# MoE (Qwen3.5's checkpoints are multimodal: their text_config, and a vision encoder)
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_text")
# Kimi-Linear (and Kimi-K3's text_config): Kimi Delta Attention layers and latent attention (MLA)
# layers as linear_attn_config lists them, a MoE after the first dense layers
KIMI_LINEAR_MODEL_TYPES = ("kimi_linear",)
# GLM-5.3-Flash (glm5_next, its text_config glm5_next_text): Kimi Delta Attention layers and
# sparse latent-attention layers (layer_types), hyper-connections, a MoE after dense layers
GLM5_NEXT_MODEL_TYPES = ("glm5_next", "glm5_next_text")
# Gemma-4 (dense or MoE: enable_moe_block) and MiMo-V2-Flash: sliding-window and full layers of two
# attention shapes (ModelSpec.sliding_num_kv_heads, sliding_head_dim)
GEMMA4_MODEL_TYPES = ("gemma4", "gemma4_text")
SLIDING_SHAPE_MODEL_TYPES = GEMMA4_MODEL_TYPES + ("mimo_v2_flash",)
# Gemma-3: sliding-window and full layers of one shape (sliding_window_pattern: every n-th layer
# full), q and k norms; 4B, 12B and 27B are multimodal (text_config, a SigLIP vision tower)
GEMMA3_MODEL_TYPES = ("gemma3", "gemma3_text", "gemma2")
# transformers' Gemma3TextConfig and Gemma2Config defaults for the fields Google's config.json files
# leave out (the multimodal Gemma-3 text_config has no vocabulary, heads or head_dim of its own)
GEMMA_DEFAULTS = {"gemma3": {"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                             "tie_word_embeddings": True, "max_position_embeddings": 131072, "sliding_window": 4096},
                  "gemma2": {"vocab_size": 256000, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                             "tie_word_embeddings": True, "max_position_embeddings": 8192, "sliding_window": 4096}}
# Keys that make a config a mixture of experts (or MLA): a dense family carrying one is refused.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
             "kv_lora_rank")


def _served_dtype(torch_dtype: str) -> str:
    """The 16-bit dtype vLLM serves a checkpoint in (`--dtype auto`): its own, or bfloat16 for a
    float32 one (google/gemma-2-2b ships float32; vLLM does not serve a generative model in it)."""
    return "bfloat16" if canonical_dtype(str(torch_dtype)) == "float32" else torch_dtype


def _need(cfg: dict, key: str, where: str):
    if cfg.get(key) is None:
        raise ValueError(f"config.json ({where}) lacks {key!r}")
    return cfg[key]


def _quantization(cfg: dict) -> tuple[str | None, str]:
    """(weight dtype or None for the checkpoint's torch_dtype, routed experts' dtype or "")."""
    q = cfg.get("quantization_config") or {}
    if not q:
        return None, ""
    method = str(q.get("quant_method", "")).lower()
    text = json.dumps(q).lower()
    if method == "mxfp4":
        return None, "mxfp4"
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
        # AutoAWQ's and GPTQ's 4-bit integer weights in groups, every linear layer (experts too)
        return _int4_format(q.get("bits", q.get("w_bit")), q.get("group_size", q.get("q_group_size")),
                            "quantization_config"), ""
    if str(q.get("quant_algo", "")).upper() == "MIXED_PRECISION":
        # ModelOpt's per-layer formats (NVIDIA's MiniMax-M3-NVFP4: NVFP4 experts, MXFP8 elsewhere;
        # its DeepSeek-V4-Flash-NVFP4: NVFP4 experts listed, the rest the fp8 blocks it names)
        names = {"NVFP4": "nvfp4", "FP8": "fp8", "MXFP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8"}
        layers = q.get("quantized_layers") or {}
        kinds = {}
        for name, v in layers.items():
            algo = str((v or {}).get("quant_algo", "")).upper()
            if algo not in names:
                raise ValueError(f"config.json quantization_config.quantized_layers[{name!r}].quant_algo={algo!r}: "
                                 f"a weight format ServeTwin does not know (known: {', '.join(names)})")
            kinds.setdefault(re.search(r"\.experts(\.|$)", name) is not None, set()).add(names[algo])
        if any(len(v) > 1 for v in kinds.values()):
            raise ValueError(f"config.json quantization_config.quantized_layers: formats {kinds} mixed within "
                             "the experts or within the other layers")
        rest = ("fp8_block" if q.get("weight_block_size") else "fp8") if method == "fp8" else None
        other, experts = kinds.get(False, {rest}), kinds.get(True, {""})
        return next(iter(other)), next(iter(experts))
    groups = q.get("config_groups") or {}
    weights = [(g.get("weights") or {}) for g in groups.values() if isinstance(g, dict)]
    if method == "compressed-tensors" and weights and (
            "mxfp4" in str(q.get("format", "")).lower()
            or all(w.get("num_bits") == 4 and w.get("type") == "float" and w.get("group_size") == 32 for w in weights)):
        # MXFP4 in groups of 32 (Kimi-K3's routed experts): the attention, shared experts and dense
        # MLPs must be in its ignore list, kept in 16 bits
        listed = q.get("ignore") or q.get("exclude_modules") or []
        skipped = json.dumps(listed).lower()
        if not all(part in skipped for part in ("self_attn", "shared_experts", "mlp")):
            raise ValueError(f"config.json quantization_config.ignore={listed!r}: an MXFP4 compressed-tensors "
                             "checkpoint is known with its attention, shared experts and dense MLPs kept in "
                             "16 bits only (routed experts in MXFP4)")
        return None, "mxfp4"
    if (method == "modelopt" and str(q.get("quant_algo", "")).upper() == "NVFP4") or (
            method == "compressed-tensors" and weights
            and all(w.get("num_bits") == 4 and w.get("type") == "float" for w in weights)):
        # NVFP4 (NVIDIA's checkpoints): the experts, and every other linear layer unless the
        # ignore list keeps the attention in 16 bits, as NVIDIA's mixtures of experts do
        skipped = json.dumps(q.get("ignore") or q.get("exclude_modules") or []).lower()
        return (None if "self_attn" in skipped else "nvfp4"), "nvfp4"
    if method == "fp8" or (method != "compressed-tensors" and ("fp8" in text or "float8" in text)):
        return ("fp8_block" if q.get("weight_block_size") else "fp8"), ""
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        bits = {(g.get("weights") or {}).get("num_bits") for g in groups.values() if isinstance(g, dict)}
        types = {(g.get("weights") or {}).get("type") for g in groups.values() if isinstance(g, dict)}
        if bits == {8} and "float" in types:
            return "fp8", ""
        if bits == {4} and types <= {"int", None}:
            sizes = {(g.get("weights") or {}).get("group_size") for g in groups.values() if isinstance(g, dict)}
            fmt = _int4_format(4, sizes.pop() if len(sizes) == 1 else None, "quantization_config")
            # a mixture of experts' routed experts only, where the ignore list keeps the attention
            # in 16 bits (Kimi-K2's) or the groups target experts alone; else every linear layer
            # (W4A16 of a dense model: RedHatAI's quantized.w4a16)
            skipped = json.dumps(q.get("ignore") or []).lower()
            targets = [str(t).lower() for g in groups.values() if isinstance(g, dict) for t in g.get("targets") or []]
            experts_only = _has_experts(cfg) and ("self_attn" in skipped
                                                  or bool(targets) and all("expert" in t for t in targets))
            return (None, fmt) if experts_only else (fmt, "")
    raise ValueError(f"config.json quantization_config.quant_method={q.get('quant_method')!r}: "
                     "a weight format ServeTwin does not know (known: fp8 per channel or 128x128 "
                     "blocks, mxfp4 experts, compressed-tensors fp8 or 4-bit integer, AWQ, GPTQ, NVFP4)")


def _int4_format(bits, group_size, where: str) -> str:
    """int4_g32 for a 4-bit integer checkpoint in groups of 32, else int4 (groups of 128; another
    group size or per-channel scales are within 3% of its bytes); ValueError naming the field for
    another width."""
    if bits != 4:
        raise ValueError(f"config.json {where}.bits={bits!r}: only 4-bit integer weights are known")
    return "int4_g32" if group_size == 32 else "int4"


def _has_experts(cfg: dict) -> bool:
    """Whether a config.json (or its text_config) has routed experts."""
    return any((c or {}).get(k) for c in (cfg, cfg.get("text_config")) for k in
               ("num_experts", "num_local_experts", "n_routed_experts"))


def _keeps_attention_unquantized(q: dict | None) -> bool:
    """A compressed-tensors checkpoint whose `ignore` list leaves the attention projections in 16
    bits (RedHat's FP8-dynamic Llama-4 ignores "re:.*self_attn")."""
    ignore = (q or {}).get("ignore") or []
    return any("self_attn" in str(x) for x in ignore)


def llama4_vision_params(vc: dict | None, text_hidden: int) -> int:
    """Weights of Llama-4's vision encoder (ViT layers with biases, patch and position
    embeddings), its pixel-shuffle adapter and the projector into the text model, counted from
    vision_config (Scout and Maverick: about 0.87 B)."""
    if not vc or not vc.get("num_hidden_layers"):
        return 0
    h, i, L = vc["hidden_size"], vc["intermediate_size"], vc["num_hidden_layers"]
    layer = 4 * (h * h + h) + 2 * h * i + i + h + 4 * h          # q/k/v/o, fc1/fc2, two LayerNorms
    patches = (vc.get("image_size", 336) // vc["patch_size"]) ** 2 + 1
    embed = vc.get("num_channels", 3) * vc["patch_size"] ** 2 * h + patches * h + h + 4 * h
    shuffled = int(h / vc.get("pixel_shuffle_ratio", 0.5) ** 2)
    adapter = shuffled * vc["projector_input_dim"] + vc["projector_input_dim"] * vc["projector_output_dim"]
    return L * layer + embed + adapter + vc["vision_output_dim"] * text_hidden


def qwen_vision_params(vc: dict | None) -> int:
    """Weights of a Qwen3-VL / Qwen3.5 vision encoder: ViT blocks (fused qkv and output projection
    with biases, a two-layer MLP with biases, two LayerNorms), the patch embedding (a 3-D conv over
    temporal_patch_size x patch_size^2 pixels of in_channels), the learned position embedding, and
    the merger that folds spatial_merge_size^2 patches into one token of out_hidden_size."""
    if not vc or not vc.get("depth"):
        return 0
    h, i, L = vc["hidden_size"], vc["intermediate_size"], vc["depth"]
    block = 4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h
    patch = vc.get("in_channels", 3) * vc.get("temporal_patch_size", 2) * vc["patch_size"] ** 2 * h + h
    pos = vc.get("num_position_embeddings", 0) * h
    m = h * vc.get("spatial_merge_size", 2) ** 2
    merger = 2 * h + m * m + m + m * vc["out_hidden_size"] + vc["out_hidden_size"]
    # Qwen3-VL's DeepStack: one more merger per deepstack_visual_indexes entry, its LayerNorm over
    # the merged width (use_postshuffle_norm); Qwen3.5 lists none
    deepstack = len(vc.get("deepstack_visual_indexes") or []) * (merger - 2 * h + 2 * m)
    return L * block + patch + pos + merger + deepstack


def qwen25_vision_params(vc: dict | None) -> int:
    """Weights of Qwen2.5-VL's vision encoder: ViT blocks (fused qkv and output projection with
    biases, a SwiGLU MLP with biases, two RMSNorms), the patch embedding (a 3-D conv without bias
    over temporal_patch_size x patch_size^2 pixels of in_chans), and the merger (an RMSNorm, then
    a two-layer MLP with biases from spatial_merge_size^2 patches to one token of out_hidden_size)."""
    if not vc or not vc.get("depth"):
        return 0
    h, i, L = vc["hidden_size"], vc["intermediate_size"], vc["depth"]
    block = 3 * h * h + 3 * h + h * h + h + 3 * h * i + 2 * i + h + 2 * h
    patch = vc.get("in_chans", vc.get("in_channels", 3)) * vc.get("temporal_patch_size", 2) * vc["patch_size"] ** 2 * h
    m = h * vc.get("spatial_merge_size", 2) ** 2
    return L * block + patch + h + m * m + m + m * vc["out_hidden_size"] + vc["out_hidden_size"]


def _hybrid_layers(cfg: dict, L: int, where: str) -> int:
    """How many of L layers are linear attention: layer_types where the config lists them, else
    all but every full_attention_interval-th layer."""
    types = cfg.get("layer_types")
    if types:
        if len(types) != L:
            raise ValueError(f"config.json ({where}) layer_types lists {len(types)} layers, num_hidden_layers={L}")
        unknown = sorted(set(types) - {"linear_attention", "full_attention"})
        if unknown:
            raise ValueError(f"config.json ({where}) layer_types={unknown}: only linear_attention and "
                             "full_attention layers are known")
        return sum(t == "linear_attention" for t in types)
    every = _need(cfg, "full_attention_interval", where)
    return L - L // every


def hf_config_fields(cfg: dict) -> dict:
    """ModelSpec fields from a HF config.json (_hf_config_fields). A dense model's NVFP4 checkpoint
    that keeps its attention in 16 bits (NVIDIA's Gemma-4-31B: the MLPs in NVFP4) reads as NVFP4
    linear layers with 16-bit attention, not as NVFP4 experts it does not have."""
    kw = _hf_config_fields(cfg)
    if kw.get("expert_dtype") == "nvfp4" and not kw.get("num_experts"):
        kw.update(attn_weight_dtype=kw["weight_dtype"], weight_dtype="nvfp4", expert_dtype="")
    return kw


def _hf_config_fields(cfg: dict) -> dict:
    """ModelSpec fields from a HF config.json: dense Llama, Mistral, Qwen2 and Qwen3 decoders, the
    mixtures of experts Mixtral, Qwen2-MoE/Qwen3-MoE, DeepSeek-V2/V3 and Kimi-K2 (MLA),
    DeepSeek-V3.2 and GLM-5 (MLA with sparse attention), gpt-oss,
    MiniMax-M2 and Llama-4 (its text_config), Qwen3-VL (Qwen3 / Qwen3-MoE in its text_config, and
    its vision encoder), Step-3.7-Flash, MiMo (Qwen2's decoder), the linear-attention hybrids
    Qwen3-Next and Qwen3.5 (dense or MoE; its text_config), and the Mamba-2 hybrids Nemotron-H
    and Nemotron-3. Anything else (another model_type, a
    dense family with expert fields, a quantization it does not know) is a ValueError naming the
    field: never timed as something else."""
    outer = cfg
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = cfg["text_config"]
    mt = str(cfg.get("model_type") or outer.get("model_type") or "").lower()
    known = (DENSE_MODEL_TYPES + MOE_MODEL_TYPES + HYBRID_MODEL_TYPES + NEMOTRON_H_MODEL_TYPES
             + SLIDING_SHAPE_MODEL_TYPES + KIMI_LINEAR_MODEL_TYPES + GEMMA3_MODEL_TYPES + GLM5_NEXT_MODEL_TYPES)
    if not mt:
        raise ValueError(f"config.json lacks 'model_type' (known: {', '.join(known)})")
    if mt not in known:
        raise ValueError(f"config.json model_type={mt!r}: not a model ServeTwin can time (known: "
                         f"{', '.join(known)})")
    if mt in GEMMA3_MODEL_TYPES:  # Google's config.json leaves transformers' defaults out
        cfg = {**GEMMA_DEFAULTS["gemma2" if mt == "gemma2" else "gemma3"], **cfg}
    if mt in DENSE_MODEL_TYPES + GEMMA3_MODEL_TYPES:
        for k in _MOE_KEYS:
            if cfg.get(k):
                raise ValueError(f"config.json {k}={cfg[k]!r} in a model_type={mt!r} config: "
                                 "expert or latent-attention fields of a family ServeTwin reads as dense")
    w = f"model_type={mt!r}"
    if mt in NEMOTRON_H_MODEL_TYPES:
        return _nemotron_h_fields(cfg, outer, w)
    L = _need(cfg, "num_hidden_layers", w)
    h = _need(cfg, "hidden_size", w)
    heads = _need(cfg, "num_attention_heads", w)
    wdtype, edtype = _quantization(outer if outer.get("quantization_config") else cfg)
    torch_dtype = _served_dtype(cfg.get("torch_dtype") or outer.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    act = "bfloat16" if canonical_dtype(torch_dtype) in FP8 else torch_dtype
    kw = dict(num_layers=L, hidden_size=h, num_heads=heads,
              num_kv_heads=cfg.get("num_key_value_heads") or heads,
              head_dim=cfg.get("head_dim") or h // heads,
              intermediate_size=cfg.get("intermediate_size") or 0,
              vocab_size=_need(cfg, "vocab_size", w),
              tie_word_embeddings=bool(cfg.get("tie_word_embeddings", outer.get("tie_word_embeddings", False))),
              max_position_embeddings=cfg.get("max_position_embeddings", 131072),
              weight_dtype=wdtype or torch_dtype, act_dtype=act,
              qk_norm=mt in ("qwen3", "qwen3_moe") + HYBRID_MODEL_TYPES + QWEN3_VL_MODEL_TYPES
              or bool(cfg.get("use_qk_norm")),
              expert_dtype=edtype)
    if mt in QWEN3_VL_MODEL_TYPES:
        kw["vision_params"] = qwen_vision_params(outer.get("vision_config"))
    if mt in ("qwen2_5_vl", "qwen2_5_vl_text"):
        kw["vision_params"] = qwen25_vision_params(outer.get("vision_config"))
    if mt in HYBRID_MODEL_TYPES:
        kw.update(num_linear_layers=_hybrid_layers(cfg, L, w),
                  linear_num_k_heads=_need(cfg, "linear_num_key_heads", w),
                  linear_num_v_heads=_need(cfg, "linear_num_value_heads", w),
                  linear_k_head_dim=_need(cfg, "linear_key_head_dim", w),
                  linear_v_head_dim=_need(cfg, "linear_value_head_dim", w),
                  linear_conv_kernel=_need(cfg, "linear_conv_kernel_dim", w),
                  # the delta rule's state: the config's mamba_ssm_dtype (Qwen3.5: float32), else
                  # the model's dtype (vLLM's mamba_ssm_cache_dtype "auto")
                  linear_state_dtype=cfg.get("mamba_ssm_dtype") or torch_dtype,
                  attn_output_gate=bool(cfg.get("attn_output_gate", True)),
                  vision_params=qwen_vision_params(outer.get("vision_config")))
        if not cfg.get("num_experts"):  # Qwen3.5's dense models
            _need(cfg, "intermediate_size", w)
            return kw
    if mt in DENSE_MODEL_TYPES:
        _need(cfg, "intermediate_size", w)
        window = cfg.get("sliding_window")
        if window and cfg.get("use_sliding_window", True) and window < kw["max_position_embeddings"]:
            # (Mistral-7B-v0.1, Phi-3-mini-4k: vLLM windows every layer; Qwen2's configs turn it off)
            raise ValueError(f"config.json ({w}) sliding_window={window!r}: every layer attending to a window "
                             f"shorter than max_position_embeddings={kw['max_position_embeddings']} is not a "
                             "layout ServeTwin can time")
        return kw
    if mt in GEMMA4_MODEL_TYPES:
        return _gemma4_fields(cfg, outer, kw, w)
    if mt in GEMMA3_MODEL_TYPES:
        return _gemma3_fields(cfg, outer, kw, w)
    if mt == "mimo_v2_flash":
        return _mimo_v2_fields(cfg, kw, w)
    if mt in KIMI_LINEAR_MODEL_TYPES:
        return _kimi_linear_fields(cfg, kw, w)
    if mt in GLM5_NEXT_MODEL_TYPES:
        return _glm5_next_fields(cfg, outer, kw, w)
    k = _need(cfg, "num_experts_per_tok" if mt != "gpt_oss" or "num_experts_per_tok" in cfg else "experts_per_token", w)
    if mt == "mixtral":
        kw.update(num_experts=_need(cfg, "num_local_experts", w), moe_intermediate_size=_need(cfg, "intermediate_size", w),
                  num_moe_layers=L)
    elif mt in ("qwen2_moe", "qwen3_moe", "qwen3_vl_moe", "qwen3_vl_moe_text") + HYBRID_MODEL_TYPES:
        step = cfg.get("decoder_sparse_step") or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        moe = sum(1 for i in range(L) if i not in dense and (i + 1) % step == 0)
        kw.update(num_experts=_need(cfg, "num_experts", w), moe_intermediate_size=_need(cfg, "moe_intermediate_size", w),
                  shared_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0, num_moe_layers=moe)
    elif mt in ("deepseek_v2", "deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa"):
        first = cfg.get("first_k_dense_replace") or 0
        freq = cfg.get("moe_layer_freq") or 1
        moe = sum(1 for i in range(L) if i >= first and i % freq == 0)
        mi = _need(cfg, "moe_intermediate_size", w)
        kw.update(num_experts=_need(cfg, "n_routed_experts", w), moe_intermediate_size=mi,
                  shared_intermediate_size=(cfg.get("n_shared_experts") or 0) * mi, num_moe_layers=moe,
                  **_mla_fields(cfg, w, heads))
        if mt in ("deepseek_v32", "glm_moe_dsa"):  # sparse attention: the indexer
            types = cfg.get("indexer_types") or ["full"] * L
            kinds = sorted(set(types) - {"full", "shared"})
            if kinds or len(types) != L:
                raise ValueError(f"config.json ({w}) indexer_types={kinds or len(types)}: one entry per layer, "
                                 "'full' (an indexer of its own) or 'shared' (GLM-5.2: the last one's top-k), "
                                 f"for num_hidden_layers={L}")
            own = sum(t == "full" for t in types)
            if types[0] != "full":
                raise ValueError(f"config.json ({w}) indexer_types[0]={types[0]!r}: the first layer needs an "
                                 "indexer of its own ('full') for the others to share")
            kw.update(index_topk=_need(cfg, "index_topk", w), index_n_heads=_need(cfg, "index_n_heads", w),
                      index_head_dim=_need(cfg, "index_head_dim", w), num_index_layers=0 if own == L else own)
    elif mt == "step3p7":  # Step-3.7-Flash: sliding-window and full layers, MoE after the first dense ones
        num_sliding = _layer_kinds(cfg, L, w)
        sliding_heads = cfg.get("num_sliding_attention_heads",
                                (cfg.get("attention_other_setting") or {}).get("num_attention_heads", heads))
        if sliding_heads != heads:
            raise ValueError(f"config.json ({w}) num_sliding_attention_heads={sliding_heads!r}: sliding layers with "
                             f"another head count than num_attention_heads={heads} are not a layout ServeTwin can time")
        kw.update(num_experts=_need(cfg, "num_experts", w), moe_intermediate_size=_need(cfg, "moe_intermediate_size", w),
                  # (one shared expert of share_expert_dim unless n_shared_experts says otherwise)
                  shared_intermediate_size=(cfg.get("n_shared_experts", 1) or 0) * (cfg.get("share_expert_dim") or 0),
                  num_moe_layers=L - _need(cfg, "first_k_dense_replace", w),
                  sliding_window=_need(cfg, "sliding_window", w), num_sliding_layers=num_sliding)
    elif mt == "glm4_moe":  # GLM-4.5/4.6/4.7: grouped-query attention, DeepSeek's MoE layout
        mi = _need(cfg, "moe_intermediate_size", w)
        kw.update(num_experts=_need(cfg, "n_routed_experts", w), moe_intermediate_size=mi,
                  shared_intermediate_size=(cfg.get("n_shared_experts") or 0) * mi,
                  num_moe_layers=L - (cfg.get("first_k_dense_replace") or 0))
        _need(cfg, "intermediate_size", w)
    elif mt == "gpt_oss":
        types = cfg.get("layer_types") or []
        kw.update(num_experts=_need(cfg, "num_local_experts", w), moe_intermediate_size=_need(cfg, "intermediate_size", w),
                  num_moe_layers=L, sliding_window=cfg.get("sliding_window") or 0,
                  num_sliding_layers=sum(t == "sliding_attention" for t in types),
                  attn_weight_dtype=torch_dtype if edtype else "")
    elif mt == "deepseek_v4":
        _deepseek_v4_fields(cfg, kw, w)
    elif mt in ("minimax_m3", "minimax_m3_vl"):  # (the VL checkpoints' text_config; the vision tower not counted)
        _minimax_m3_fields(cfg, kw, w)
    elif mt == "minimax_m2":
        kw.update(qk_norm=True, qk_norm_across_heads=True,
                  num_experts=_need(cfg, "num_local_experts", w), moe_intermediate_size=_need(cfg, "intermediate_size", w),
                  shared_intermediate_size=cfg.get("shared_intermediate_size") or 0, num_moe_layers=L)
    else:  # llama4 / llama4_text: MoE every interleave_moe_layer_step layers, one shared expert
        step = cfg.get("interleave_moe_layer_step") or 1
        moe_layers = cfg.get("moe_layers")
        moe = len(moe_layers) if moe_layers is not None else sum(1 for i in range(L) if (i + 1) % step == 0)
        mi = _need(cfg, "intermediate_size", w)
        kw.update(num_experts=_need(cfg, "num_local_experts", w), moe_intermediate_size=mi,
                  shared_intermediate_size=mi, num_moe_layers=moe,
                  intermediate_size=cfg.get("intermediate_size_mlp") or mi,
                  vision_params=llama4_vision_params(outer.get("vision_config"), h))
        if _keeps_attention_unquantized(outer.get("quantization_config") or cfg.get("quantization_config")):
            kw["attn_weight_dtype"] = act
    kw["num_experts_per_tok"] = k
    return kw


def _layer_flags(values, L: int, key: str, w: str) -> list:
    """A config's per-layer list of 0 and 1 (moe_layer_freq, hybrid_layer_pattern, ...), checked."""
    if not isinstance(values, list) or len(values) != L or not set(values) <= {0, 1}:
        raise ValueError(f"config.json ({w}) {key}: one 0 or 1 per layer for num_hidden_layers={L}")
    return values


def _layer_kinds(cfg: dict, L: int, w: str) -> int:
    """How many of L layers layer_types lists as sliding_attention (the rest full_attention)."""
    types = _need(cfg, "layer_types", w)
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != L:
        raise ValueError(f"config.json ({w}) layer_types={unknown or len(types)}: one of sliding_attention, "
                         f"full_attention per layer for num_hidden_layers={L}")
    return sum(t == "sliding_attention" for t in types)


def gemma4_vision_params(vc: dict | None, text_hidden: int) -> int:
    """Weights of Gemma-4's vision encoder: ViT layers (q/k/v/o without biases, a gated MLP, four
    RMSNorms), the patch embedding, the two-axis position table and the projection into the text
    model (embed_vision), counted from vision_config (about 0.57 B)."""
    if not vc or not vc.get("num_hidden_layers"):
        return 0
    h, i, L = vc["hidden_size"], vc["intermediate_size"], vc["num_hidden_layers"]
    layer = 4 * h * h + 3 * h * i + 4 * h
    patch = 3 * vc["patch_size"] ** 2 * h
    return L * layer + patch + 2 * vc.get("position_embedding_size", 0) * h + h * text_hidden


def _gemma4_fields(cfg: dict, outer: dict, kw: dict, w: str) -> dict:
    """Gemma-4's text decoder (text_config): sliding-window layers of num_key_value_heads x
    head_dim, full layers of global_head_dim (with attention_k_eq_v, num_global_key_value_heads
    of them, whose keys are also the values: vLLM loads k_proj a second time as the v projection
    and caches K and V, so they are counted as a v projection and a V cache of their own); a
    gated GELU MLP in every layer, and with enable_moe_block a MoE beside it (top_k_experts of
    num_experts, summed with the MLP: read as a shared expert of intermediate_size)."""
    L = kw["num_layers"]
    for key in ("hidden_size_per_layer_input", "num_kv_shared_layers"):
        if cfg.get(key):
            raise ValueError(f"config.json ({w}) {key}={cfg[key]!r}: Gemma-4's per-layer embeddings and "
                             "KV-sharing layers (E2B, E4B) are not a layout ServeTwin can time")
    sliding = _layer_kinds(cfg, L, w)
    hd, kv = kw["head_dim"], kw["num_kv_heads"]
    full_hd = cfg.get("global_head_dim") or hd
    full_kv = (cfg.get("num_global_key_value_heads") or kv) if cfg.get("attention_k_eq_v") else kv
    kw.update(head_dim=full_hd, num_kv_heads=full_kv, qk_norm=True,
              sliding_window=_need(cfg, "sliding_window", w), num_sliding_layers=sliding,
              sliding_head_dim=hd if hd != full_hd else 0, sliding_num_kv_heads=kv if kv != full_kv else 0,
              vision_params=gemma4_vision_params(outer.get("vision_config"), kw["hidden_size"]))
    inter = _need(cfg, "intermediate_size", w)
    if cfg.get("enable_moe_block"):
        kw.update(num_experts=_need(cfg, "num_experts", w), num_experts_per_tok=_need(cfg, "top_k_experts", w),
                  moe_intermediate_size=_need(cfg, "moe_intermediate_size", w), shared_intermediate_size=inter,
                  num_moe_layers=L)
    return kw


def siglip_vision_params(vc: dict | None, text_hidden: int) -> int:
    """Weights of Gemma-3's SigLIP vision tower and its projector: ViT layers (q, k, v, o and a
    two-layer MLP, all with biases; two LayerNorms), the patch embedding (a conv with bias), one
    learned position per patch of the image, the post LayerNorm, and the projector (an RMSNorm
    over the vision width and its projection into the text model)."""
    if not vc or not vc.get("num_hidden_layers"):
        return 0
    h, i, L, p = vc["hidden_size"], vc["intermediate_size"], vc["num_hidden_layers"], vc["patch_size"]
    layer = 4 * h * h + 4 * h + 2 * h * i + i + h + 4 * h
    patch = vc.get("num_channels", 3) * p * p * h + h
    pos = (vc.get("image_size", 224) // p) ** 2 * h
    return L * layer + patch + pos + 2 * h + h + h * text_hidden


def _gemma3_fields(cfg: dict, outer: dict, kw: dict, w: str) -> dict:
    """Gemma-3 and Gemma-2: layer_types where the config lists them, else every
    sliding_window_pattern-th layer (Gemma-3's default 6; Gemma-2 alternates, 2) full and the
    others sliding-window, all of one attention shape; Gemma-3's q and k norms; a gated GELU MLP;
    the vision tower of Gemma-3's multimodal checkpoints (vision_config)."""
    L = kw["num_layers"]
    gemma2 = str(cfg.get("model_type")) == "gemma2"
    if cfg.get("layer_types") is not None:
        sliding = _layer_kinds(cfg, L, w)
    else:
        n = cfg.get("sliding_window_pattern") or (2 if gemma2 else 6)
        sliding = sum(1 for i in range(L) if (i + 1) % n)
    _need(cfg, "intermediate_size", w)
    kw.update(qk_norm=not gemma2, sliding_window=_need(cfg, "sliding_window", w), num_sliding_layers=sliding,
              vision_params=siglip_vision_params(outer.get("vision_config"), kw["hidden_size"]))
    return kw


def _mimo_v2_fields(cfg: dict, kw: dict, w: str) -> dict:
    """MiMo-V2-Flash: hybrid_layer_pattern 1 for a sliding-window layer (swa_num_key_value_heads of
    swa_head_dim), 0 for a full one; query and key heads of head_dim, value heads of v_head_dim
    in both; a dense MLP where moe_layer_freq is 0, n_routed_experts elsewhere. Its multi-token
    prediction layers are not loaded without speculative decoding."""
    L, heads = kw["num_layers"], kw["num_heads"]
    pattern = _layer_flags(_need(cfg, "hybrid_layer_pattern", w), L, "hybrid_layer_pattern", w)
    freq = _layer_flags(cfg.get("moe_layer_freq") or [1] * L, L, "moe_layer_freq", w)
    v = cfg.get("v_head_dim") or kw["head_dim"]
    for key, want in (("swa_num_attention_heads", heads), ("swa_v_head_dim", v)):
        if cfg.get(key, want) != want:
            raise ValueError(f"config.json ({w}) {key}={cfg[key]!r}: sliding-window layers with another "
                             f"value than the full layers' ({want}) are not a layout ServeTwin can time")
    swa_kv, swa_hd = cfg.get("swa_num_key_value_heads") or kw["num_kv_heads"], cfg.get("swa_head_dim") or kw["head_dim"]
    mi = _need(cfg, "moe_intermediate_size", w)
    kw.update(v_head_dim=v if v != kw["head_dim"] else 0,
              sliding_window=cfg.get("sliding_window_size") or _need(cfg, "sliding_window", w),
              num_sliding_layers=sum(pattern),
              sliding_num_kv_heads=swa_kv if swa_kv != kw["num_kv_heads"] else 0,
              sliding_head_dim=swa_hd if swa_hd != kw["head_dim"] else 0,
              num_experts=_need(cfg, "n_routed_experts", w), num_experts_per_tok=_need(cfg, "num_experts_per_tok", w),
              moe_intermediate_size=mi, shared_intermediate_size=(cfg.get("n_shared_experts") or 0) * mi,
              num_moe_layers=sum(freq))
    return kw


def _mla_fields(cfg: dict, w: str, heads: int, rope_default: int | None = None) -> dict:
    """ModelSpec fields of latent attention (MLA) from a config: the latent, its RoPE and NoPE
    widths (qk_rope_head_dim required unless rope_default is given), the value width, the q LoRA,
    every head a KV head."""
    rope = _need(cfg, "qk_rope_head_dim", w) if rope_default is None else (cfg.get("qk_rope_head_dim") or rope_default)
    kw = dict(kv_lora_rank=_need(cfg, "kv_lora_rank", w), qk_rope_head_dim=rope,
              qk_nope_head_dim=_need(cfg, "qk_nope_head_dim", w), v_head_dim=_need(cfg, "v_head_dim", w),
              q_lora_rank=cfg.get("q_lora_rank") or 0, num_kv_heads=heads)
    kw["head_dim"] = kw["qk_nope_head_dim"] + rope
    return kw


def _kda_fields(layers: int, heads: int, head_dim: int, conv_kernel: int, full_rank_gate: bool) -> dict:
    """ModelSpec fields of Kimi Delta Attention layers: heads of head_dim for keys and values alike,
    fp32 states as vLLM keeps them, the output gate full-rank or down to head_dim and up."""
    return dict(num_linear_layers=layers, linear_kind="kda", linear_num_k_heads=heads, linear_num_v_heads=heads,
                linear_k_head_dim=head_dim, linear_v_head_dim=head_dim, linear_conv_kernel=conv_kernel,
                linear_state_dtype="float32", linear_gate_rank=0 if full_rank_gate else head_dim)


def _kimi_linear_fields(cfg: dict, kw: dict, w: str) -> dict:
    """Kimi-Linear and Kimi-K3 (its text_config): linear_attn_config's kda_layers are Kimi Delta
    Attention (num_heads of head_dim for keys and values alike, a short conv of
    short_conv_kernel_size, fp32 states as vLLM keeps them; use_full_rank_gate: the output gate
    in the input projection, else down to head_dim and up), its full_attn_layers latent attention
    (MLA, with mla_use_output_gate a sigmoid gate per head); numbered from 1 unless
    kda_layer_index_base says 0. MoE layers after first_k_dense_replace dense ones: num_experts,
    num_experts_per_token, num_shared_experts of moe_intermediate_size; K3's routed experts work
    in routed_expert_hidden_size (a latent MoE). K3's vision tower, its attention-residual mixing
    (elementwise) and its norms in the latent are not counted."""
    L, heads = kw["num_layers"], kw["num_heads"]
    lac = _need(cfg, "linear_attn_config", w)
    base = lac.get("kda_layer_index_base", 1)
    kda = [int(i) - base for i in _need(lac, "kda_layers", w + " linear_attn_config")]
    full = [int(i) - base for i in _need(lac, "full_attn_layers", w + " linear_attn_config")]
    if sorted(kda + full) != list(range(L)):
        raise ValueError(f"config.json ({w}) linear_attn_config: kda_layers ({len(kda)}) and full_attn_layers "
                         f"({len(full)}) must number each of num_hidden_layers={L} once (from {base})")
    if (cfg.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"config.json ({w}) moe_layer_freq={cfg['moe_layer_freq']!r}: only a MoE in every "
                         "layer after the first dense ones is known")
    hd = _need(lac, "head_dim", w + " linear_attn_config")
    lh = _need(lac, "num_heads", w + " linear_attn_config")
    mi = _need(cfg, "moe_intermediate_size", w)
    latent = cfg.get("routed_expert_hidden_size") or 0
    kw.update(**_kda_fields(len(kda), lh, hd, _need(lac, "short_conv_kernel_size", w + " linear_attn_config"),
                            bool(lac.get("use_full_rank_gate"))),
              **_mla_fields(cfg, w, heads),
              attn_output_gate=bool(cfg.get("mla_use_output_gate")),
              # (mla_use_nope: vLLM's Kimi MLA rotates nothing and keeps no cos/sin cache)
              rotary=not cfg.get("mla_use_nope", False),
              num_experts=_need(cfg, "num_experts", w),
              num_experts_per_tok=_need(cfg, "num_experts_per_token", w), moe_intermediate_size=mi,
              shared_intermediate_size=(cfg.get("num_shared_experts") or 0) * mi,
              num_moe_layers=L - (cfg.get("first_k_dense_replace") or 0),
              moe_latent_size=latent if latent and latent != kw["hidden_size"] else 0)
    _need(cfg, "intermediate_size", w)
    return kw


def _glm5_next_fields(cfg: dict, outer: dict, kw: dict, w: str) -> dict:
    """GLM-5.3-Flash: layer_types' linear_attention layers are Kimi Delta Attention
    (linear_attn_config's num_heads of head_dim, or linear_num_heads / linear_head_dim; its output
    gate low-rank, fp32 states), its deepseek_sparse_attention layers latent attention without RoPE
    behind a sparse-attention indexer whose keys are pooled by index_kpool (indexer_types: an
    indexer of its own, "full", or the last one's top-k, "shared"); hc_mult hyper-connection
    streams (mhc); a MoE after the mlp_layer_types' dense layers. Its fp8 checkpoint keeps
    attention in 16 bits (modules_to_not_convert; the latent layers' q, kv-down and output
    projections, fp8 in it, are read as 16-bit too); its vision tower is not counted, nor its MTP
    layer (not loaded without speculative decoding)."""
    L, heads = kw["num_layers"], kw["num_heads"]
    # (transformers' defaults where a field is missing: three KDA layers to each sparse one, the
    # first 3 layers dense, a pool of 16, 4 streams; it names the sparse layers indexed_attention)
    sparse_names = {"deepseek_sparse_attention", "indexed_attention", "full_attention"}
    types = cfg.get("layer_types") or ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(L)]
    unknown = sorted(set(types) - sparse_names - {"linear_attention"})
    if unknown or len(types) != L:
        raise ValueError(f"config.json ({w}) layer_types={unknown or len(types)}: one of linear_attention, "
                         f"deepseek_sparse_attention (indexed_attention) per layer for num_hidden_layers={L}")
    if cfg.get("indexer_types") is None:
        for key in ("index_topk_pattern", "index_topk_freq"):
            if cfg.get(key) is not None:
                raise ValueError(f"config.json ({w}) {key}={cfg[key]!r}: give indexer_types ('full' or 'shared' "
                                 "per layer) instead")
    itypes = cfg.get("indexer_types") or ["full"] * L
    if len(itypes) != L or not set(itypes) <= {"full", "shared"}:
        raise ValueError(f"config.json ({w}) indexer_types: 'full' or 'shared' per layer for num_hidden_layers={L}")
    sparse = [i for i, t in enumerate(types) if t in sparse_names]
    if not sparse or itypes[sparse[0]] != "full":
        raise ValueError(f"config.json ({w}) indexer_types: the first sparse-attention layer needs an indexer "
                         "of its own ('full')")
    lac = cfg.get("linear_attn_config") or {}
    hd = lac.get("head_dim") or _need(cfg, "linear_head_dim", w)
    lh = lac.get("num_heads") or _need(cfg, "linear_num_heads", w)
    mlp = cfg.get("mlp_layer_types") or ["dense"] * min(3, L) + ["sparse"] * (L - min(3, L))
    if len(mlp) != L or not set(mlp) <= {"dense", "sparse"}:
        raise ValueError(f"config.json ({w}) mlp_layer_types: 'dense' or 'sparse' per layer for num_hidden_layers={L}")
    dense = mlp.count("dense")
    mi = _need(cfg, "moe_intermediate_size", w)
    q = outer.get("quantization_config") or cfg.get("quantization_config") or {}
    kept = json.dumps(q.get("modules_to_not_convert") or q.get("ignore") or []).lower()
    kw.update(**_kda_fields(L - len(sparse), lh, hd,
                            lac.get("short_conv_kernel_size") or cfg.get("linear_conv_kernel_dim") or 4,
                            bool(lac.get("use_full_rank_gate"))),
              **_mla_fields(cfg, w, heads, rope_default=0), rotary=bool(cfg.get("qk_rope_head_dim")),
              index_topk=_need(cfg, "index_topk", w), index_n_heads=_need(cfg, "index_n_heads", w),
              index_head_dim=_need(cfg, "index_head_dim", w), index_pool=cfg.get("index_kpool", 16) or 1,
              num_index_layers=sum(itypes[i] == "full" for i in sparse),
              residual_streams=cfg.get("hc_mult", 4) if cfg.get("mhc", True) else 1,
              num_experts=_need(cfg, "n_routed_experts", w), num_experts_per_tok=_need(cfg, "num_experts_per_tok", w),
              moe_intermediate_size=mi, shared_intermediate_size=(cfg.get("n_shared_experts") or 0) * mi,
              num_moe_layers=L - dense)
    if "self_attn" in kept or "q_proj" in kept:
        kw["attn_weight_dtype"] = kw["act_dtype"]
    _need(cfg, "intermediate_size", w)
    return kw


def _deepseek_v4_fields(cfg: dict, kw: dict, w: str) -> None:
    """DeepSeek-V4 (Flash, Pro): compressed multi-query attention (ModelSpec.compressed_mqa) with
    compress_ratios per layer (0: the sliding window only; the smaller ratio: compressed sparse
    attention with the indexer; the larger: heavily compressed, all entries read; a last entry for
    the MTP layer, which is not loaded), a MoE in every layer with one shared expert, routed
    experts in expert_dtype ("fp4": MXFP4; NVIDIA's NVFP4 checkpoint's quantizes them alone), the
    other linear layers as quantization_config says (fp8 128x128 blocks), hc_mult residual streams. Its cache holds
    fp8 latents (vLLM's layout), so the KV dtype is fp8."""
    L = kw["num_layers"]
    ratios = list(_need(cfg, "compress_ratios", w))[:L]
    if len(ratios) != L or not set(ratios) <= {0, 4, 128}:
        raise ValueError(f"config.json ({w}) compress_ratios={sorted(set(ratios))}: one per layer for "
                         f"num_hidden_layers={L}, each 0 (the window only), 4 (compressed sparse attention, "
                         "with the indexer) or 128 (heavily compressed)")
    csa, hca = (4 if 4 in ratios else 0), (128 if 128 in ratios else 0)
    mi = _need(cfg, "moe_intermediate_size", w)
    experts = str(cfg.get("expert_dtype") or "").lower()
    quantized = kw["expert_dtype"]  # NVIDIA's NVFP4 experts, from its quantization_config
    kw.update(compressed_mqa=True, kv_dtype="fp8", num_kv_heads=1, qk_rope_head_dim=_need(cfg, "qk_rope_head_dim", w),
              q_lora_rank=_need(cfg, "q_lora_rank", w), o_groups=_need(cfg, "o_groups", w),
              o_lora_rank=_need(cfg, "o_lora_rank", w), sliding_window=_need(cfg, "sliding_window", w),
              num_csa_layers=ratios.count(csa) if csa else 0, num_hca_layers=ratios.count(hca) if hca else 0,
              csa_ratio=csa or 4, hca_ratio=hca or 128, residual_streams=cfg.get("hc_mult") or 1,
              num_experts=_need(cfg, "n_routed_experts", w), moe_intermediate_size=mi,
              shared_intermediate_size=(cfg.get("n_shared_experts") or 0) * mi, num_moe_layers=L,
              expert_dtype=quantized if quantized == "nvfp4" else "mxfp4" if experts == "fp4" else quantized or experts)
    if csa:
        kw.update(index_topk=_need(cfg, "index_topk", w), index_n_heads=_need(cfg, "index_n_heads", w),
                  index_head_dim=_need(cfg, "index_head_dim", w), num_index_layers=ratios.count(csa),
                  index_key_dtype="fp8")


def _minimax_m3_fields(cfg: dict, kw: dict, w: str) -> None:
    """MiniMax-M3: grouped-query attention with q and k norms per head; in the layers whose
    sparse_attention_config.sparse_attention_freq is 1, block-sparse attention (an indexer of
    sparse_num_index_heads query heads and one key head of sparse_index_dim, 16-bit keys; each KV
    head reads its sparse_topk_blocks best blocks of sparse_block_size tokens, the current one
    among them); first_k_dense_replace dense layers of dense_intermediate_size, then MoE layers
    (moe_layer_freq) of num_local_experts with one shared expert. Its MTP modules are not loaded."""
    L = kw["num_layers"]
    freq = cfg.get("moe_layer_freq")
    first = cfg.get("first_k_dense_replace") or 0
    moe = [int(i >= first) for i in range(L)] if not isinstance(freq, list) else freq
    sp = cfg.get("sparse_attention_config") or {}
    sparse = (sp.get("sparse_attention_freq") or [1] * L) if sp.get("use_sparse_attention") else [0] * L
    moe = _layer_flags(moe, L, "moe_layer_freq", w)
    sparse = _layer_flags(sparse, L, "sparse_attention_config.sparse_attention_freq", w)
    no_value = sp.get("sparse_disable_index_value", [1] * L)
    if any(s_ and not nv for s_, nv in zip(sparse, no_value if isinstance(no_value, list) else [no_value] * L)):
        raise ValueError(f"config.json ({w}) sparse_attention_config.sparse_disable_index_value={no_value!r}: an "
                         "indexer with value and output projections is not a layout ServeTwin can time")
    mi = cfg.get("moe_intermediate_size") or _need(cfg, "intermediate_size", w)  # (the VL configs' name for it)
    kw.update(qk_norm=True, intermediate_size=cfg.get("dense_intermediate_size") or kw["intermediate_size"],
              num_experts=_need(cfg, "num_local_experts", w), moe_intermediate_size=mi,
              shared_intermediate_size=(cfg.get("n_shared_experts") or 0) * (cfg.get("shared_intermediate_size") or mi),
              num_moe_layers=sum(moe))
    if sum(sparse):
        kw.update(index_topk=_need(sp, "sparse_topk_blocks", w) * _need(sp, "sparse_block_size", w),
                  index_n_heads=_need(sp, "sparse_num_index_heads", w), index_head_dim=_need(sp, "sparse_index_dim", w),
                  num_index_layers=sum(sparse) if sum(sparse) < L else 0,
                  index_key_dtype=kw["act_dtype"])


def _nemotron_h_fields(cfg: dict, outer: dict, w: str) -> dict:
    """ModelSpec fields of a Nemotron-H config.json: its blocks from hybrid_override_pattern or
    layers_block_type (the mixers, Mamba-2 and attention, are num_layers; the MLP and MoE blocks
    num_mlp_layers), Mamba-2 as linear layers (linear_kind "mamba2"), squared-ReLU MLPs and experts
    (two projections), a latent MoE's width (moe_latent_size)."""
    names = {name: c for c, name in NEMOTRON_H_BLOCKS.items()}
    listed = cfg.get("layers_block_type")
    if listed is not None:  # (newer configs list the blocks by name: Nemotron-3 Ultra)
        unknown = sorted({str(b) for b in listed} - set(names)) if isinstance(listed, list) else [listed]
        if unknown:
            raise ValueError(f"config.json ({w}) layers_block_type={unknown}: a list of the block kinds "
                             f"{sorted(names)}")
        from_list = "".join(names[b] for b in listed)
        if cfg.get("hybrid_override_pattern") not in (None, from_list):
            raise ValueError(f"config.json ({w}) hybrid_override_pattern={cfg['hybrid_override_pattern']!r} "
                             f"and layers_block_type disagree")
    field = "hybrid_override_pattern" if listed is None else "layers_block_type"
    pattern = str(_need(cfg, "hybrid_override_pattern", w)) if listed is None else from_list
    blocks = cfg.get("num_hidden_layers") if listed is not None else _need(cfg, "num_hidden_layers", w)
    unknown = sorted(set(pattern) - set(NEMOTRON_H_BLOCKS))
    if unknown or (blocks is not None and len(pattern) != blocks):
        raise ValueError(f"config.json ({w}) {field}={pattern!r}: one of {''.join(NEMOTRON_H_BLOCKS)} per "
                         f"block for num_hidden_layers={blocks}" + (f" (unknown: {unknown})" if unknown else ""))
    act = str(cfg.get("mlp_hidden_act", "relu2"))
    if act != "relu2":
        raise ValueError(f"config.json ({w}) mlp_hidden_act={act!r}: only Nemotron-H's squared ReLU ('relu2') is known")
    count = {k: pattern.count(c) for c, k in NEMOTRON_H_BLOCKS.items()}
    if not count["attention"] or not count["mlp"] + count["moe"]:
        raise ValueError(f"config.json ({w}) {field}={pattern!r}: needs an attention block ('*') "
                         "and an MLP or MoE block ('-', 'E')")
    h, heads = _need(cfg, "hidden_size", w), _need(cfg, "num_attention_heads", w)
    wdtype, edtype = _quantization(cfg)
    torch_dtype = _served_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    kw = dict(num_layers=count["mamba"] + count["attention"], hidden_size=h, num_heads=heads,
              num_kv_heads=cfg.get("num_key_value_heads") or heads,
              head_dim=cfg.get("head_dim") or cfg.get("attention_head_dim") or h // heads,
              intermediate_size=(cfg.get("intermediate_size") or 0) if count["mlp"] else 0,
              vocab_size=_need(cfg, "vocab_size", w),
              tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
              max_position_embeddings=cfg.get("max_position_embeddings", 131072),
              weight_dtype=wdtype or torch_dtype,
              act_dtype="bfloat16" if canonical_dtype(torch_dtype) in FP8 else torch_dtype, expert_dtype=edtype,
              num_linear_layers=count["mamba"], linear_kind="mamba2",
              linear_num_k_heads=_need(cfg, "n_groups", w), linear_k_head_dim=_need(cfg, "ssm_state_size", w),
              linear_num_v_heads=_need(cfg, "mamba_num_heads", w), linear_v_head_dim=_need(cfg, "mamba_head_dim", w),
              linear_conv_kernel=_need(cfg, "conv_kernel", w),
              # (vLLM keeps Nemotron-H's SSM state in float32 unless the config says otherwise)
              linear_state_dtype=cfg.get("mamba_ssm_cache_dtype") or "float32",
              num_mlp_layers=count["mlp"] + count["moe"], mlp_gated=False, rotary=False)
    if count["mlp"]:
        _need(cfg, "intermediate_size", w)
    if count["moe"]:
        kw.update(num_experts=_need(cfg, "n_routed_experts", w), num_experts_per_tok=_need(cfg, "num_experts_per_tok", w),
                  moe_intermediate_size=_need(cfg, "moe_intermediate_size", w), num_moe_layers=count["moe"],
                  moe_latent_size=cfg.get("moe_latent_size") or 0,
                  shared_intermediate_size=(cfg.get("n_shared_experts") or 0)
                  * (cfg.get("moe_shared_expert_intermediate_size") or 0))
    return kw


def _gib(x: float) -> int:
    return int(round(x * GiB))


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str
    memory_bytes: int             # total as CUDA reports it (what vLLM multiplies by gpu_memory_utilization)
    mem_bandwidth: float          # bytes/s
    flops: float                  # dense bf16 tensor-core FLOP/s
    interconnect_bandwidth: float  # bytes/s per direction between GPUs of one TP group
    interconnect_latency_s: float = 5e-6
    fp8_flops: float | None = None  # dense fp8 FLOP/s; None: no fp8 tensor cores (bf16 math)
    fp4_flops: float | None = None  # dense FP4 FLOP/s (Blackwell); None: NVFP4 weights run weight-only (bf16 math)
    kernel_tables: str | None = None  # calibration/kernels/<name>.json measured on this GPU
    gpus_per_node: int = 8            # GPUs one interconnect_bandwidth joins (a TP group within a node)
    # compute-bound kernels of a large step over their kernel-table time on this GPU, where it
    # differs from the kernel model's default (sim.kernel_model.Overheads.gemm_compute_slowdown)
    gemm_compute_slowdown: float | None = None

    def serve_defaults(self) -> tuple[int, int]:
        """`vllm serve`'s max_num_batched_tokens and max_num_seqs on this GPU when the command
        line sets none: 8192 and 1024 on a GPU of 70 GiB or more that is not an A100 (H100, H200,
        B200), else 2048 and 256 (vLLM's EngineArgs defaults by device)."""
        if self.memory_bytes >= 70 * GiB and not self.name.startswith("a100"):
            return 8192, 1024
        return 2048, 256

    def peak_flops(self, dtype: str) -> float:
        dtype = canonical_dtype(dtype)
        if dtype == "nvfp4":
            return self.fp4_flops or self.flops
        if dtype in FP8:
            return self.fp8_flops or self.flops
        if dtype == "float32":
            return self.flops / 2  # TF32 tensor cores
        return self.flops


# Llama-4 Scout's and Maverick's vision_config (the fields llama4_vision_params reads)
LLAMA4_VISION_CONFIG = {"hidden_size": 1408, "image_size": 336, "intermediate_size": 5632, "num_channels": 3,
                        "num_hidden_layers": 34, "patch_size": 14, "pixel_shuffle_ratio": 0.5,
                        "projector_input_dim": 4096, "projector_output_dim": 4096, "vision_output_dim": 4096}
# Qwen3.5's vision encoder (the same in every size; its merger projects to the text model's width)
QWEN35_VISION_CONFIG = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "in_channels": 3,
                        "num_position_embeddings": 2304, "patch_size": 16, "spatial_merge_size": 2,
                        "temporal_patch_size": 2}


def _qwen35(name: str, layers: int, hidden: int, heads: int, kv_heads: int, v_heads: int, **moe) -> "ModelSpec":
    """A Qwen3.5 model from its config.json's numbers: a full-attention layer (gated, head dim 256)
    every fourth layer, Gated DeltaNet (16 key heads, v_heads value heads, dims 128, 4 conv taps,
    float32 state) in the others, 248,320 tokens, 262,144 positions, and its vision encoder."""
    return ModelSpec(name, layers, hidden, heads, kv_heads, 256, moe.pop("intermediate_size", 0), 248320, False,
                     262144, qk_norm=True, num_linear_layers=layers - layers // 4, linear_num_k_heads=16,
                     linear_num_v_heads=v_heads, linear_k_head_dim=128, linear_v_head_dim=128, linear_conv_kernel=4,
                     linear_state_dtype="float32", attn_output_gate=True,
                     vision_params=qwen_vision_params({**QWEN35_VISION_CONFIG, "out_hidden_size": hidden}), **moe)


# Catalog models whose fp8 checkpoints keep the attention projections in 16 bits (RedHat's
# FP8-dynamic Llama-4 recipe ignores self_attn; _keeps_attention_unquantized reads it from a config)
FP8_KEEPS_16BIT_ATTENTION = ("llama-4-scout-17b-16e",)
# Dense catalog models whose NVIDIA NVFP4 checkpoint leaves the attention in 16 bits (its
# quantization_config's ignore list: Gemma-4-31B-IT-NVFP4)
NVFP4_KEEPS_16BIT_ATTENTION = ("gemma-4-31b",)
# Mixtures of experts whose NVIDIA NVFP4 checkpoint keeps the layers beside the experts in fp8
# (ModelOpt's MIXED_PRECISION: MiniMax-M3-NVFP4's MXFP8, read as fp8; DeepSeek-V4's own 128x128
# blocks), and the KV cache as the model keeps it (kv_cache_quant_algo null)
NVFP4_FP8_ELSEWHERE = {"minimax-m3": "fp8", "deepseek-v4-flash": "fp8_block", "deepseek-v4-pro": "fp8_block"}

MODELS: dict[str, ModelSpec] = {m.name: m for m in [
    ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, False, 131072),
    ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, False, 131072),
    ModelSpec("llama-3.1-405b", 126, 16384, 128, 8, 128, 53248, 128256, False, 131072),
    ModelSpec("llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, True, 131072),
    ModelSpec("llama-3.2-3b", 28, 3072, 24, 8, 128, 8192, 128256, True, 131072),
    # Qwen2.5-0.5B, 1.5B and 3B (tied embeddings), from their config.json
    ModelSpec("qwen2.5-0.5b", 24, 896, 14, 2, 64, 4864, 151936, True, 32768),
    ModelSpec("qwen2.5-1.5b", 28, 1536, 12, 2, 128, 8960, 151936, True, 32768),
    ModelSpec("qwen2.5-3b", 36, 2048, 16, 2, 128, 11008, 151936, True, 32768),
    ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, False, 32768),
    ModelSpec("qwen2.5-14b", 48, 5120, 40, 8, 128, 13824, 152064, False, 32768),
    ModelSpec("qwen2.5-32b", 64, 5120, 40, 8, 128, 27648, 152064, False, 32768),
    ModelSpec("qwen2.5-72b", 80, 8192, 64, 8, 128, 29568, 152064, False, 32768),
    ModelSpec("qwen3-0.6b", 28, 1024, 16, 8, 128, 3072, 151936, True, 40960, qk_norm=True),
    ModelSpec("qwen3-1.7b", 28, 2048, 16, 8, 128, 6144, 151936, True, 40960, qk_norm=True),
    # Qwen3-4B: the text model of the aisimulate wheel's Qwen3-VL-4B config (the same LLM), its
    # own context length
    ModelSpec("qwen3-4b", 36, 2560, 32, 8, 128, 9728, 151936, True, 40960, qk_norm=True),
    ModelSpec("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, False, 40960, qk_norm=True),
    ModelSpec("qwen3-14b", 40, 5120, 40, 8, 128, 17408, 151936, False, 40960, qk_norm=True),
    ModelSpec("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936, False, 40960, qk_norm=True),
    ModelSpec("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32768, False, 32768),
    ModelSpec("mistral-nemo", 40, 5120, 32, 8, 128, 14336, 131072, False, 1024000),
    # Mistral-Small-24B-2501 and Phi-4, from their config.json
    ModelSpec("mistral-small-24b", 40, 5120, 32, 8, 128, 32768, 131072, False, 32768),
    ModelSpec("phi-4", 40, 5120, 40, 10, 128, 17920, 100352, False, 16384),
    # Phi-3.5-mini and Phi-4-mini (phi3: fused q/k/v and gate/up, the same weights), from their config.json
    ModelSpec("phi-3.5-mini", 32, 3072, 32, 32, 96, 8192, 32064, False, 131072),
    ModelSpec("phi-4-mini", 32, 3072, 24, 8, 128, 8192, 200064, True, 131072),
    ModelSpec("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, False, 4096),
    ModelSpec("llama-2-13b", 40, 5120, 40, 40, 128, 13824, 32000, False, 4096),
    ModelSpec("llama-2-70b", 80, 8192, 64, 8, 128, 28672, 32000, False, 4096),
    ModelSpec("codellama-34b", 48, 8192, 64, 8, 128, 22016, 32000, False, 16384),
    ModelSpec("yi-34b", 60, 7168, 56, 8, 128, 20480, 64000, False, 4096),
    # Codestral-22B-v0.1 and IBM Granite 3.3 (tied embeddings), from their config.json
    ModelSpec("codestral-22b", 56, 6144, 48, 8, 128, 16384, 32768, False, 32768),
    ModelSpec("granite-3.3-8b", 40, 4096, 32, 8, 128, 12800, 49159, True, 131072),
    ModelSpec("granite-3.3-2b", 40, 2048, 32, 8, 64, 8192, 49159, True, 131072),
    # Mistral-Large-Instruct-2411 (and 2407), from its config.json
    ModelSpec("mistral-large-2411", 88, 12288, 96, 8, 128, 28672, 32768, False, 131072),
    ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, True, 8192, "float32", "float32", "float32"),
    # Mixtures of experts, from their public config.json (sim.specs.hf_config_fields reads the same).
    ModelSpec("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 6144, 151936, False, 40960, qk_norm=True, num_experts=128,
              num_experts_per_tok=8, moe_intermediate_size=768, num_moe_layers=48),
    ModelSpec("qwen3-235b-a22b", 94, 4096, 64, 4, 128, 12288, 151936, False, 40960, qk_norm=True, num_experts=128,
              num_experts_per_tok=8, moe_intermediate_size=1536, num_moe_layers=94),
    ModelSpec("qwen3-coder-480b-a35b", 62, 6144, 96, 8, 128, 8192, 151936, False, 262144, qk_norm=True,
              num_experts=160, num_experts_per_tok=8, moe_intermediate_size=2560, num_moe_layers=62),
    ModelSpec("mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000, False, 32768, num_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=14336, num_moe_layers=32),
    ModelSpec("mixtral-8x22b", 56, 6144, 48, 8, 128, 16384, 32000, False, 65536, num_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=16384, num_moe_layers=56),
    ModelSpec("gpt-oss-20b", 24, 2880, 64, 8, 64, 2880, 201088, False, 131072, num_experts=32, num_experts_per_tok=4,
              moe_intermediate_size=2880, num_moe_layers=24, expert_dtype="mxfp4", attn_weight_dtype="bfloat16",
              sliding_window=128, num_sliding_layers=12),
    ModelSpec("gpt-oss-120b", 36, 2880, 64, 8, 64, 2880, 201088, False, 131072, num_experts=128, num_experts_per_tok=4,
              moe_intermediate_size=2880, num_moe_layers=36, expert_dtype="mxfp4", attn_weight_dtype="bfloat16",
              sliding_window=128, num_sliding_layers=18),
    ModelSpec("deepseek-v3", 61, 7168, 128, 128, 192, 18432, 129280, False, 163840, weight_dtype="fp8_block",
              num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, shared_intermediate_size=2048,
              num_moe_layers=58, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
              q_lora_rank=1536),
    # DeepSeek-V3.2: V3 with the sparse attention's indexer (64 heads of 128, top 2048 tokens)
    ModelSpec("deepseek-v3.2", 61, 7168, 128, 128, 192, 18432, 129280, False, 163840, weight_dtype="fp8_block",
              num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, shared_intermediate_size=2048,
              num_moe_layers=58, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
              q_lora_rank=1536, index_topk=2048, index_n_heads=64, index_head_dim=128),
    # GLM-5 (and 5.1): MLA with sparse attention (indexer 32 heads of 128, top 2048), 78 layers,
    # the first 3 dense, from its config.json
    ModelSpec("glm-5", 78, 6144, 64, 64, 256, 12288, 154880, False, 202752,
              num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, shared_intermediate_size=2048,
              num_moe_layers=75, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256,
              q_lora_rank=2048, index_topk=2048, index_n_heads=32, index_head_dim=128),
    ModelSpec("kimi-k2", 61, 7168, 64, 64, 192, 18432, 163840, False, 131072, weight_dtype="fp8_block",
              num_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048, shared_intermediate_size=2048,
              num_moe_layers=60, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
              q_lora_rank=1536),
    # Kimi-K2.5 (and K2-Thinking): K2's text model as its checkpoint ships it, the routed experts
    # int4 weight-only (compressed-tensors, groups of 32), everything else 16-bit
    ModelSpec("kimi-k2.5", 61, 7168, 64, 64, 192, 18432, 163840, False, 262144, expert_dtype="int4_g32",
              num_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048, shared_intermediate_size=2048,
              num_moe_layers=60, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
              q_lora_rank=1536),
    ModelSpec("minimax-m2", 62, 3072, 48, 8, 128, 1536, 200064, False, 196608, weight_dtype="fp8_block",
              qk_norm=True, qk_norm_across_heads=True, num_experts=256, num_experts_per_tok=8,
              moe_intermediate_size=1536, num_moe_layers=62),
    ModelSpec("llama-4-scout-17b-16e", 48, 5120, 40, 8, 128, 16384, 202048, False, 10485760, qk_norm=True,
              num_experts=16, num_experts_per_tok=1, moe_intermediate_size=8192, shared_intermediate_size=8192,
              num_moe_layers=48, vision_params=llama4_vision_params(LLAMA4_VISION_CONFIG, 5120)),
    # Maverick: 128 experts in every other layer (interleave_moe_layer_step 2), dense MLPs of
    # intermediate_size_mlp 16384 in the others, no QK norm
    ModelSpec("llama-4-maverick-17b-128e", 48, 5120, 40, 8, 128, 16384, 202048, False, 1048576,
              num_experts=128, num_experts_per_tok=1, moe_intermediate_size=8192, shared_intermediate_size=8192,
              num_moe_layers=24, vision_params=llama4_vision_params(LLAMA4_VISION_CONFIG, 5120)),
    # Linear-attention hybrids (Gated DeltaNet + gated full attention every fourth layer), from
    # their config.json: Qwen3.5 (the aisimulate wheel's configs) and Qwen3-Next-80B-A3B (no vision
    # encoder; 151,936 tokens; its state in the model's dtype)
    _qwen35("qwen3.5-397b-a17b", 60, 4096, 32, 2, 64, num_experts=512, num_experts_per_tok=10,
            moe_intermediate_size=1024, shared_intermediate_size=1024, num_moe_layers=60),
    _qwen35("qwen3.5-122b-a10b", 48, 3072, 32, 2, 64, num_experts=256, num_experts_per_tok=8,
            moe_intermediate_size=1024, shared_intermediate_size=1024, num_moe_layers=48),
    _qwen35("qwen3.5-35b-a3b", 40, 2048, 16, 2, 32, num_experts=256, num_experts_per_tok=8,
            moe_intermediate_size=512, shared_intermediate_size=512, num_moe_layers=40),
    _qwen35("qwen3.5-27b", 64, 5120, 24, 4, 48, intermediate_size=17408),
    ModelSpec("qwen3-next-80b-a3b", 48, 2048, 16, 2, 256, 5120, 151936, False, 262144, qk_norm=True,
              num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_intermediate_size=512,
              num_moe_layers=48, num_linear_layers=36, linear_num_k_heads=16, linear_num_v_heads=32,
              linear_k_head_dim=128, linear_v_head_dim=128, linear_conv_kernel=4, attn_output_gate=True),
]}
# Qwen3-VL: each size's text decoder is a Qwen3 / Qwen3-MoE catalog model's (their config.json's
# text_config, the aisimulate wheel's), with 262,144 positions and a vision encoder with three DeepStack
# mergers (2B and 4B: 24 blocks of width 1024; the others: Qwen3.5's 27 of 1152)
QWEN3_VL_SIZES = {"2b": "qwen3-1.7b", "4b": "qwen3-4b", "8b": "qwen3-8b", "32b": "qwen3-32b",
                  "30b-a3b": "qwen3-30b-a3b", "235b-a22b": "qwen3-235b-a22b"}
_QWEN3_VL_SMALL_VISION = {**QWEN35_VISION_CONFIG, "depth": 24, "hidden_size": 1024, "intermediate_size": 4096,
                          "deepstack_visual_indexes": [5, 11, 17]}
_QWEN3_VL_VISION = {**QWEN35_VISION_CONFIG, "deepstack_visual_indexes": [8, 16, 24]}
# Nemotron-H: NVIDIA's Mamba-2 hybrids, from their config.json (the aisimulate wheel's; the fields the
# reader takes): Nemotron-3 Nano 30B-A3B (23 Mamba-2, 6 attention and 23 MoE blocks) and
# Nemotron-H 56B (54 Mamba-2, 10 attention, 54 MLP blocks)
_NEMOTRON_H = {"model_type": "nemotron_h", "conv_kernel": 4, "head_dim": 128, "mamba_head_dim": 64,
               "mlp_hidden_act": "relu2", "n_groups": 8, "vocab_size": 131072, "tie_word_embeddings": False,
               "torch_dtype": "bfloat16"}


def _nemotron_3(hidden: int, heads: int, mamba_heads: int, experts: int, top_k: int, expert_inter: int,
                shared_inter: int, pattern: str, latent: int = 0) -> dict:
    """A Nemotron-3 config.json's fields (2 KV heads, SSM state 128 in float32, 262,144 positions,
    one shared expert; latent: moe_latent_size)."""
    cfg = {**_NEMOTRON_H, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": 2,
           "num_hidden_layers": len(pattern), "intermediate_size": expert_inter, "mamba_num_heads": mamba_heads,
           "ssm_state_size": 128, "mamba_ssm_cache_dtype": "float32", "max_position_embeddings": 262144,
           "n_routed_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": expert_inter,
           "n_shared_experts": 1, "moe_shared_expert_intermediate_size": shared_inter,
           "hybrid_override_pattern": pattern}
    return {**cfg, "moe_latent_size": latent} if latent else cfg


NEMOTRON_H_CONFIGS = {
    "nemotron-3-nano-30b-a3b": _nemotron_3(2688, 32, 64, 128, 6, 1856, 3712,
                                           "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"),
    # Super and Ultra: latent MoE (their experts in moe_latent_size), 512 experts, top 22
    "nemotron-3-super-120b-a12b": _nemotron_3(
        4096, 32, 128, 512, 22, 2688, 5376,
        "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME", latent=1024),
    "nemotron-3-ultra-550b-a55b": _nemotron_3(
        8192, 64, 256, 512, 22, 5120, 10240,
        "MEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        latent=2048),
    "nemotron-h-56b": {**_NEMOTRON_H, "hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
                       "num_hidden_layers": 118, "intermediate_size": 32768, "mamba_num_heads": 256,
                       "ssm_state_size": 256, "max_position_embeddings": 8192,
                       "hybrid_override_pattern": "M-M-M-M*-" + "M-M-M-M-M*-" * 9 + "M-M-M-M-M-"},
}
MODELS.update({name: ModelSpec.from_hf_config(cfg, name=name) for name, cfg in NEMOTRON_H_CONFIGS.items()})
# Step-3.7-Flash and MiMo-7B from their config.json (the aisimulate wheel's; the fields the reader takes)
MODELS["step-3.7-flash"] = ModelSpec.from_hf_config(
    {"model_type": "step3p7", "num_hidden_layers": 45, "hidden_size": 4096, "num_attention_heads": 64,
     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128896, "max_position_embeddings": 65536,
     "torch_dtype": "bfloat16", "intermediate_size": 11264, "sliding_window": 512, "first_k_dense_replace": 3,
     "num_experts": 288, "num_experts_per_tok": 8, "moe_intermediate_size": 1280, "share_expert_dim": 1280,
     "n_shared_experts": 1, "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                                            "sliding_attention"] * 11 + ["full_attention"]}, name="step-3.7-flash")
MODELS["mimo-7b"] = ModelSpec.from_hf_config(
    {"model_type": "mimo", "num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32,
     "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 11008, "vocab_size": 151680,
     "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}, name="mimo-7b")
# Gemma-4 (google/gemma-4-26B-A4B and -31B: their config.json's text_config and vision_config, the
# fields the reader takes; five sliding-window layers to each full one) and MiMo-V2-Flash (its
# fp8 checkpoint, XiaomiMiMo/MiMo-V2-Flash: 9 full layers, 39 sliding-window ones)
_GEMMA4 = {"model_type": "gemma4_text", "head_dim": 256, "global_head_dim": 512, "attention_k_eq_v": True,
           "sliding_window": 1024, "vocab_size": 262144, "tie_word_embeddings": True,
           "max_position_embeddings": 262144, "torch_dtype": "bfloat16"}
_GEMMA4_VISION = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "patch_size": 16,
                  "position_embedding_size": 10240}
GEMMA4_CONFIGS = {
    "gemma-4-26b-a4b": {**_GEMMA4, "num_hidden_layers": 30, "hidden_size": 2816, "num_attention_heads": 16,
                        "num_key_value_heads": 8, "num_global_key_value_heads": 2, "intermediate_size": 2112,
                        "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
                        "moe_intermediate_size": 704, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5},
    "gemma-4-31b": {**_GEMMA4, "num_hidden_layers": 60, "hidden_size": 5376, "num_attention_heads": 32,
                    "num_key_value_heads": 16, "num_global_key_value_heads": 4, "intermediate_size": 21504,
                    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10},
}
MODELS.update({name: ModelSpec.from_hf_config({"model_type": "gemma4", "text_config": cfg,
                                               "vision_config": _GEMMA4_VISION}, name=name)
               for name, cfg in GEMMA4_CONFIGS.items()})
# DeepSeek-V4 Flash and Pro (their config.json: the fields the reader takes; compress_ratios: two
# window-only layers then CSA and HCA alternating (Flash), HCA first (Pro), one more for the MTP layer)
_DSV4 = {"model_type": "deepseek_v4", "head_dim": 512, "qk_rope_head_dim": 64, "num_key_value_heads": 1,
         "o_lora_rank": 1024, "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128, "hc_mult": 4,
         "n_shared_experts": 1, "num_experts_per_tok": 6, "vocab_size": 129280, "expert_dtype": "fp4",
         "max_position_embeddings": 1048576, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
DSV4_CONFIGS = {
    "deepseek-v4-flash": {**_DSV4, "num_hidden_layers": 43, "hidden_size": 4096, "num_attention_heads": 64,
                          "q_lora_rank": 1024, "o_groups": 8, "n_routed_experts": 256, "moe_intermediate_size": 2048,
                          "index_topk": 512, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0]},
    "deepseek-v4-pro": {**_DSV4, "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
                        "q_lora_rank": 1536, "o_groups": 16, "n_routed_experts": 384, "moe_intermediate_size": 3072,
                        "index_topk": 1024, "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0]},
}
MODELS.update({name: ModelSpec.from_hf_config(cfg, name=name) for name, cfg in DSV4_CONFIGS.items()})
# MiniMax-M3 (MiniMaxAI/MiniMax-M3's config.json: the fields the reader takes)
MODELS["minimax-m3"] = ModelSpec.from_hf_config(
    {"model_type": "minimax_m3", "num_hidden_layers": 60, "hidden_size": 6144, "num_attention_heads": 64,
     "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 3072, "dense_intermediate_size": 12288,
     "first_k_dense_replace": 3, "moe_layer_freq": [0] * 3 + [1] * 57, "num_local_experts": 128,
     "num_experts_per_tok": 4, "moe_intermediate_size": 3072, "n_shared_experts": 1, "shared_intermediate_size": 3072,
     "vocab_size": 200064, "max_position_embeddings": 1048576, "tie_word_embeddings": False,
     "torch_dtype": "bfloat16", "use_qk_norm": True,
     "sparse_attention_config": {"use_sparse_attention": True, "sparse_attention_freq": [0] * 3 + [1] * 57,
                                 "sparse_block_size": 128, "sparse_topk_blocks": 16, "sparse_num_index_heads": 4,
                                 "sparse_index_dim": 128, "sparse_disable_index_value": [0] * 3 + [1] * 57}},
    name="minimax-m3")
MODELS["mimo-v2-flash"] = ModelSpec.from_hf_config(
    {"model_type": "mimo_v2_flash", "num_hidden_layers": 48, "hidden_size": 4096, "num_attention_heads": 64,
     "num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128, "intermediate_size": 16384,
     "vocab_size": 152576, "max_position_embeddings": 262144, "sliding_window_size": 128,
     "swa_num_attention_heads": 64, "swa_num_key_value_heads": 8, "swa_head_dim": 192, "swa_v_head_dim": 128,
     "hybrid_layer_pattern": [0] + ([1] * 5 + [0]) * 7 + [1] * 4 + [0],
     "moe_layer_freq": [0] + [1] * 47, "moe_intermediate_size": 2048, "n_routed_experts": 256,
     "num_experts_per_tok": 8, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
     "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, name="mimo-v2-flash")
# Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B (qwen2_moe, their config.json): routed experts and one shared
# expert in every layer (its sigmoid gate, a column per layer, is not counted)
MODELS.update({name: ModelSpec.from_hf_config({"model_type": "qwen2_moe", "vocab_size": 151936,
                                               "tie_word_embeddings": False, "torch_dtype": "bfloat16", **cfg}, name=name)
               for name, cfg in {
    "qwen1.5-moe-a2.7b": {"num_hidden_layers": 24, "hidden_size": 2048, "num_attention_heads": 16,
                          "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
                          "num_experts": 60, "num_experts_per_tok": 4, "shared_expert_intermediate_size": 5632,
                          "max_position_embeddings": 8192},
    "qwen2-57b-a14b": {"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
                       "num_key_value_heads": 4, "intermediate_size": 18944, "moe_intermediate_size": 2560,
                       "num_experts": 64, "num_experts_per_tok": 8, "shared_expert_intermediate_size": 20480,
                       "max_position_embeddings": 32768}}.items()})
# DeepSeek-V2-Lite (and DeepSeek-Coder-V2-Lite, the same shape; their config.json): MLA without a q
# LoRA, 64 routed experts (top 6) and 2 shared after one dense layer
MODELS["deepseek-v2-lite"] = ModelSpec.from_hf_config(
    {"model_type": "deepseek_v2", "num_hidden_layers": 27, "hidden_size": 2048, "num_attention_heads": 16,
     "num_key_value_heads": 16, "intermediate_size": 10944, "vocab_size": 102400, "q_lora_rank": None,
     "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
     "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2, "moe_intermediate_size": 1408,
     "first_k_dense_replace": 1, "moe_layer_freq": 1, "max_position_embeddings": 163840,
     "tie_word_embeddings": False, "torch_dtype": "bfloat16"}, name="deepseek-v2-lite")
# Gemma-3 (google/gemma-3-1b-it, -4b-it, -12b-it, -27b-it: their config.json's text_config and
# vision_config, the fields the reader takes; five sliding-window layers to each full one)
_GEMMA3 = {"model_type": "gemma3_text", "sliding_window": 1024, "sliding_window_pattern": 6, "vocab_size": 262208,
           "tie_word_embeddings": True, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}
_SIGLIP = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "patch_size": 14,
           "image_size": 896}
GEMMA3_CONFIGS = {
    "gemma-3-1b": {**_GEMMA3, "num_hidden_layers": 26, "hidden_size": 1152, "num_attention_heads": 4,
                   "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912, "sliding_window": 512,
                   "vocab_size": 262144, "max_position_embeddings": 32768},
    "gemma-3-4b": {**_GEMMA3, "num_hidden_layers": 34, "hidden_size": 2560, "num_attention_heads": 8,
                   "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 10240},
    "gemma-3-12b": {**_GEMMA3, "num_hidden_layers": 48, "hidden_size": 3840, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 15360},
    "gemma-3-27b": {**_GEMMA3, "num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32,
                    "num_key_value_heads": 16, "head_dim": 128, "intermediate_size": 21504},
}
MODELS.update({name: ModelSpec.from_hf_config(
    cfg if name == "gemma-3-1b" else {"model_type": "gemma3", "text_config": cfg, "vision_config": _SIGLIP}, name=name)
    for name, cfg in GEMMA3_CONFIGS.items()})
# Gemma-2 (google/gemma-2-2b-it, -9b-it, -27b-it: their config.json): sliding-window (4,096) and
# full layers alternating, 8,192 positions
_GEMMA2 = {"model_type": "gemma2", "sliding_window": 4096, "vocab_size": 256000, "tie_word_embeddings": True,
           "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
GEMMA2_CONFIGS = {
    "gemma-2-2b": {**_GEMMA2, "num_hidden_layers": 26, "hidden_size": 2304, "num_attention_heads": 8,
                   "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216},
    "gemma-2-9b": {**_GEMMA2, "num_hidden_layers": 42, "hidden_size": 3584, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 14336},
    "gemma-2-27b": {**_GEMMA2, "num_hidden_layers": 46, "hidden_size": 4608, "num_attention_heads": 32,
                    "num_key_value_heads": 16, "head_dim": 128, "intermediate_size": 36864},
}
MODELS.update({name: ModelSpec.from_hf_config(cfg, name=name) for name, cfg in GEMMA2_CONFIGS.items()})
# Kimi-Linear-48B-A3B and Kimi-K3 (moonshotai's config.json: the fields the reader takes): Kimi Delta
# Attention with latent-attention layers between (1-numbered), a MoE after the first dense layer;
# K3's routed experts in MXFP4 groups of 32 in a latent MoE of 3,584, its KDA output gate full-rank
_KIMI_LINEAR = {"model_type": "kimi_linear", "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128, "mla_use_nope": True, "first_k_dense_replace": 1, "moe_layer_freq": 1, "vocab_size": 163840,
                "tie_word_embeddings": False, "max_position_embeddings": 1048576, "torch_dtype": "bfloat16"}
MODELS["kimi-linear-48b-a3b"] = ModelSpec.from_hf_config(
    {**_KIMI_LINEAR, "num_hidden_layers": 27, "hidden_size": 2304, "num_attention_heads": 32,
     "num_key_value_heads": 32, "intermediate_size": 9216, "q_lora_rank": None, "num_experts": 256,
     "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
     "linear_attn_config": {"kda_layers": [i for i in range(1, 27) if i % 4], "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                            "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4}},
    name="kimi-linear-48b-a3b")
MODELS["kimi-k3"] = ModelSpec.from_hf_config(
    {"model_type": "kimi_k3", "text_config": {
        **_KIMI_LINEAR, "num_hidden_layers": 93, "hidden_size": 7168, "num_attention_heads": 96,
        "num_key_value_heads": 96, "intermediate_size": 33792, "q_lora_rank": 1536, "num_experts": 896,
        "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584, "mla_use_output_gate": True,
        "linear_attn_config": {"kda_layers": [i for i in range(1, 92) if i % 4],
                               "full_attn_layers": list(range(4, 93, 4)) + [93], "num_heads": 96, "head_dim": 128,
                               "short_conv_kernel_size": 4, "use_full_rank_gate": True},
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                                "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float",
                                                                          "group_size": 32}}},
                                "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*",
                                           "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*"]}}},
    name="kimi-k3")
# GLM-4.5 (355B-A32B; 4.6 and 4.7 the same with a longer context) and GLM-4.5-Air (106B-A12B), from
# their config.json: grouped-query attention (q, k, v biases; 4.5's q and k norms), MoE after the
# first dense layers; their MTP layer is not loaded without speculative decoding
_GLM4_MOE = {"model_type": "glm4_moe", "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
             "vocab_size": 151552, "n_shared_experts": 1, "num_experts_per_tok": 8, "attention_bias": True,
             "partial_rotary_factor": 0.5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
GLM4_MOE_CONFIGS = {
    "glm-4.5": {**_GLM4_MOE, "num_hidden_layers": 92, "hidden_size": 5120, "intermediate_size": 12288,
                "n_routed_experts": 160, "moe_intermediate_size": 1536, "first_k_dense_replace": 3,
                "use_qk_norm": True, "max_position_embeddings": 131072},
    "glm-4.5-air": {**_GLM4_MOE, "num_hidden_layers": 46, "hidden_size": 4096, "intermediate_size": 10944,
                    "n_routed_experts": 128, "moe_intermediate_size": 1408, "first_k_dense_replace": 1,
                    "use_qk_norm": False, "max_position_embeddings": 131072},
}
GLM4_MOE_CONFIGS["glm-4.6"] = {**GLM4_MOE_CONFIGS["glm-4.5"], "max_position_embeddings": 202752}
MODELS.update({name: ModelSpec.from_hf_config(cfg, name=name) for name, cfg in GLM4_MOE_CONFIGS.items()})
# GLM-5.3-Flash (zai-org's config.json, an fp8 checkpoint keeping attention in 16 bits: the fields the
# reader takes): Kimi Delta Attention in three of every four layers, sparse latent attention in the
# fourth (its indexer's keys pooled by 4), 4 hyper-connection streams, 288 experts after 3 dense layers
GLM53_FLASH = {
    "model_type": "glm5_next_text", "num_hidden_layers": 45, "hidden_size": 4096, "num_attention_heads": 64,
    "num_key_value_heads": 64, "intermediate_size": 12288, "vocab_size": 154880, "tie_word_embeddings": False,
    "max_position_embeddings": 1048576, "torch_dtype": "bfloat16", "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_rope_head_dim": 0, "qk_nope_head_dim": 256, "v_head_dim": 256, "mla_use_nope": True,
    "index_topk": 2048, "index_n_heads": 32, "index_head_dim": 128, "index_kpool": 4, "hc_mult": 4, "mhc": True,
    "n_routed_experts": 288, "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 2048,
    "layer_types": ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(45)],
    "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 42, "indexer_types": ["full"] * 45,
    "linear_attn_config": {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4},
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["model.layers.0.self_attn.q_proj"]}}
MODELS["glm-5.3-flash"] = ModelSpec.from_hf_config(GLM53_FLASH, name="glm-5.3-flash")
# GLM-5.2 (and 5.3, whose config.json is the same): GLM-5 with 21 of its 78 layers keeping an indexer
# of their own (indexer_types), 1,048,576 positions
MODELS["glm-5.2"] = replace(MODELS["glm-5"], name="glm-5.2", num_index_layers=21, max_position_embeddings=1048576)
MODELS.update({f"qwen3-vl-{size}": replace(
    MODELS[text], name=f"qwen3-vl-{size}", max_position_embeddings=262144,
    vision_params=qwen_vision_params({**(_QWEN3_VL_SMALL_VISION if size in ("2b", "4b") else _QWEN3_VL_VISION),
                                      "out_hidden_size": MODELS[text].hidden_size}))
    for size, text in QWEN3_VL_SIZES.items()})
# Qwen2.5-VL (3B, 7B, 32B, 72B): Qwen2.5's text decoders of the same size (their config.json) with
# 128,000 positions, and the vision encoder (loaded, not timed)
_QWEN25_VISION = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "patch_size": 14, "in_chans": 3,
                  "spatial_merge_size": 2, "temporal_patch_size": 2}
MODELS.update({f"qwen2.5-vl-{s}": replace(
    MODELS[f"qwen2.5-{s}"], name=f"qwen2.5-vl-{s}", max_position_embeddings=128000,
    vision_params=qwen25_vision_params({**_QWEN25_VISION, "out_hidden_size": MODELS[f"qwen2.5-{s}"].hidden_size}))
    for s in ("3b", "7b", "32b", "72b")})
# generation_config.json's sampling defaults of the checkpoints a catalog name serves (the instruct
# ones where base and instruct differ), as their public files read (written from them, not
# re-read offline): Llama 2, 3.1, 3.2 and 4: top_p 0.9 (an early Llama-2 revision 0.6); Qwen2.5
# instruct: top_p 0.8, top_k 20 (and repetition_penalty 1.05, not priced); Gemma-3: top_k 64,
# top_p 0.95; Qwen3 (dense and MoE),
# Qwen3-Next and Qwen3.5: top_p 0.95 (Qwen3-Next instruct 0.8), top_k 20; Qwen3-VL instruct: top_p 0.8, top_k 20. The others set none that filters, or are not known here ("").
GENERATION_FILTERS = {**dict.fromkeys(("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "llama-3.2-1b",
                                       "llama-3.2-3b", "llama-2-7b", "llama-2-13b", "llama-2-70b",
                                       "llama-4-scout-17b-16e", "llama-4-maverick-17b-128e"), "top_p"),
                      **dict.fromkeys(("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", *GEMMA3_CONFIGS,
                                       "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b", "qwen3-0.6b",
                                       "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b",
                                       "qwen3-30b-a3b", "qwen3-235b-a22b", "qwen3-coder-480b-a35b",
                                       "qwen3.5-397b-a17b", "qwen3.5-122b-a10b", "qwen3.5-35b-a3b", "qwen3.5-27b",
                                       "qwen3-next-80b-a3b", *(f"qwen3-vl-{x}" for x in QWEN3_VL_SIZES)),
                                      "top_k_top_p")}
MODELS = {k: replace(m, generation_filter=GENERATION_FILTERS.get(k, "")) for k, m in MODELS.items()}
_MODEL_ALIASES = {"llama-3.3-70b": "llama-3.1-70b", "meta-llama-3.1-8b": "llama-3.1-8b",
                  "meta-llama-3.1-70b": "llama-3.1-70b", "meta-llama-3.1-405b": "llama-3.1-405b",
                  "llama-3-8b": "llama-3.1-8b", "llama-3-70b": "llama-3.1-70b",
                  "meta-llama-3-8b": "llama-3.1-8b", "meta-llama-3-70b": "llama-3.1-70b",
                  "mistral-7b-v0.3": "mistral-7b", "mistral-7b-instruct-v0.3": "mistral-7b",
                  "qwq-32b": "qwen2.5-32b", "smollm2-135m": "smollm2-135m",
                  "mistral-nemo-instruct": "mistral-nemo", "mistral-nemo-base": "mistral-nemo",
                  "llama-2-7b-chat": "llama-2-7b", "llama-2-70b-chat": "llama-2-70b",
                  "codellama-34b-instruct": "codellama-34b", "codellama-34b-python": "codellama-34b",
                  "mixtral-8x7b-v0.1": "mixtral-8x7b", "mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
                  "mixtral-8x22b-v0.1": "mixtral-8x22b", "mixtral-8x22b-instruct-v0.1": "mixtral-8x22b",
                  "deepseek-r1": "deepseek-v3", "deepseek-v3-0324": "deepseek-v3", "minimax-m2.5": "minimax-m2",
                  "llama-4-scout": "llama-4-scout-17b-16e", "llama-4-maverick": "llama-4-maverick-17b-128e", "kimi-k2-thinking": "kimi-k2.5", "qwen3-30b-a3b-thinking": "qwen3-30b-a3b",
                  # later checkpoints of the same architecture (their config.json: the aisimulate
                  # wheel's MiniMax-M2.7 and DeepSeek-V3.1 configs read as M2.5's and V3's)
                  "minimax-m2.1": "minimax-m2", "minimax-m2.7": "minimax-m2", "deepseek-v3.1": "deepseek-v3",
                  "deepseek-v3.1-terminus": "deepseek-v3", "qwen3-235b-a22b-thinking": "qwen3-235b-a22b",
                  "qwen3-coder-30b-a3b": "qwen3-30b-a3b", "deepseek-v3.2-exp": "deepseek-v3.2", "glm-5.1": "glm-5", "glm-5.3": "glm-5.2",
                  # Qwen3.6: Qwen3.5's architecture and sizes (the wheel's Qwen3.6 configs)
                  "qwen3.6-27b": "qwen3.5-27b", "qwen3.6-35b-a3b": "qwen3.5-35b-a3b",
                  # DeepSeek-R1's distillations keep their base model's architecture
                  "deepseek-r1-distill-llama-70b": "llama-3.1-70b", "deepseek-r1-distill-llama-8b": "llama-3.1-8b",
                  "deepseek-r1-distill-qwen-32b": "qwen2.5-32b", "deepseek-r1-distill-qwen-14b": "qwen2.5-14b",
                  "deepseek-r1-distill-qwen-7b": "qwen2.5-7b",
                  # Kimi-K2.6 and K2.7-Code: K2.5's architecture and sizes (the wheel's configs)
                  "kimi-k2.6": "kimi-k2.5", "kimi-k2.7-code": "kimi-k2.5",
                  # GLM-4.7: GLM-4.6's architecture and context (its config.json); Mistral Large 2407
                  # and Yi-1.5-34B: the shapes of Mistral Large 2411 and Yi-34B
                  "glm-4.7": "glm-4.6", "mistral-large-instruct-2411": "mistral-large-2411",
                  "mistral-large-instruct-2407": "mistral-large-2411", "mistral-large-2407": "mistral-large-2411",
                  "yi-1.5-34b": "yi-34b",
                  # fine-tunes and variants of a catalog architecture (their config.json: the same
                  # shape): Qwen2.5-Coder, Llama-3.1's Nemotron-70B, Hermes-3 and Llama-Guard-3,
                  # Mistral Small 3.1/3.2 (the vision tower of their multimodal checkpoints not
                  # counted), Devstral and Magistral Small, gpt-oss-safeguard
                  "qwen2.5-coder-7b": "qwen2.5-7b", "qwen2.5-coder-14b": "qwen2.5-14b",
                  "qwen2.5-coder-32b": "qwen2.5-32b", "qwen2.5-coder-1.5b": "qwen2.5-1.5b",
                  "qwen2.5-coder-3b": "qwen2.5-3b", "qwen2.5-coder-0.5b": "qwen2.5-0.5b",
                  "llama-3.1-nemotron-70b": "llama-3.1-70b", "hermes-3-llama-3.1-8b": "llama-3.1-8b",
                  "hermes-3-llama-3.1-70b": "llama-3.1-70b", "llama-guard-3-8b": "llama-3.1-8b",
                  "mistral-small-3.1-24b": "mistral-small-24b", "mistral-small-3.2-24b": "mistral-small-24b",
                  "devstral-small": "mistral-small-24b", "magistral-small": "mistral-small-24b",
                  "gpt-oss-safeguard-20b": "gpt-oss-20b", "gpt-oss-safeguard-120b": "gpt-oss-120b",
                  "deepseek-coder-v2-lite": "deepseek-v2-lite", "codestral-22b-v0.1": "codestral-22b",
                  # Nemotron-H's repository names (-BF16, -Base-BF16, -Base-8K)
                  "nvidia-nemotron-3-nano-30b-a3b": "nemotron-3-nano-30b-a3b",
                  "nvidia-nemotron-3-nano-30b-a3b-bf16": "nemotron-3-nano-30b-a3b",
                  "nvidia-nemotron-3-nano-30b-a3b-base-bf16": "nemotron-3-nano-30b-a3b",
                  "nemotron-h-56b-base-8k": "nemotron-h-56b",
                  **{f"nvidia-nemotron-3-{x}{suffix}": f"nemotron-3-{x}" for x in ("super-120b-a12b", "ultra-550b-a55b")
                     for suffix in ("", "-bf16")},
                  **{f"qwen3-vl-{s}-thinking": f"qwen3-vl-{s}" for s in QWEN3_VL_SIZES}}

DEVICES: dict[str, DeviceSpec] = {d.name: d for d in [
    # memory_bytes: the total CUDA reports (torch.cuda.mem_get_info), which vLLM multiplies by
    # gpu_memory_utilization; it is nvidia-smi's memory.total less what the driver keeps (0.4-0.7
    # GiB). H100: vLLM's own startup logs print 79.18-79.19 GiB (nvidia-smi: 81559 MiB); the
    # others as torch's out-of-memory messages print it (H200 139.80, B200 178.35, A100 79.15 and
    # 39.59, L40S 44.39 of nvidia-smi's 46068 MiB, A10G 22.03 of 23028 MiB).
    DeviceSpec("h100-sxm", _gib(79.19), 3.35e12, 989e12, 450e9, fp8_flops=1979e12, kernel_tables="h100_sxm"),
    DeviceSpec("h200", _gib(139.80), 4.8e12, 989e12, 450e9, fp8_flops=1979e12, kernel_tables="h200_sxm"),
    # B200: compute-bound kernels 1.25x their table time, not 1.13 (gemm_compute_slowdown): chosen
    # on the allowed vLLM rows of one dense model (Llama-3.1-70B fp8, 60 rows of
    # bench/silicon_check.py: 1.18 / 1.21 / 1.25 / 1.30 read median TTFT bias -3.4% / -2.0% / -0.2%
    # / +2.7%) and checked on the mixtures of experts' rows, which it was not chosen on
    # (docs/reports/2026-12-06-eager-allreduce.md). Why is not measured here; a 1,000 W card that
    # holds less of its tables' clocks through a long compute-bound step than the 700 W H200 would
    # read so.
    DeviceSpec("b200", _gib(178.35), 8.0e12, 2250e12, 900e9, fp8_flops=4500e12, kernel_tables="b200_sxm",
               gemm_compute_slowdown=1.25, fp4_flops=9000e12),
    # B300 SXM6 (Blackwell Ultra): 267.69 GiB as torch reports it (nvidia-smi: 275040 MiB), 7.75 TB/s,
    # the same dense bf16 / fp8 tensor-core rates and NVLink 5 as B200, FP4 1.5x (HGX B300: 108 dense
    # FP4 PFLOPS for 8 GPUs, HGX B200 72)
    DeviceSpec("b300", _gib(267.69), 7.75e12, 2250e12, 900e9, fp8_flops=4500e12, kernel_tables="b300_sxm",
               fp4_flops=13500e12),
    # GB200 and GB300: the GPUs of the Grace-Blackwell NVL72 racks (the aisimulate wheel's gb200.yaml
    # and gb300.yaml: 8 TB/s, dense bf16 2.5 PFLOPS, fp8 5, FP4 10 and 15; NVLink 5 through the
    # rack's NVSwitches, so a TP group of up to 72 GPUs stays on NVLink). Memory: nvidia-smi's
    # 189471 and 284208 MiB less what B200 and B300 lose to the driver (0.71 and 0.90 GiB), an
    # estimate. Compute-bound kernels: B200's slowdown (the same die; not checked on GB200 itself).
    # Kernel tables: measured on each (calibration/kernels/PROVENANCE.md).
    DeviceSpec("gb200", _gib(184.32), 8.0e12, 2500e12, 900e9, fp8_flops=5000e12, kernel_tables="gb200",
               gemm_compute_slowdown=1.25, fp4_flops=10000e12, gpus_per_node=72),
    DeviceSpec("gb300", _gib(276.65), 8.0e12, 2500e12, 900e9, fp8_flops=5000e12, kernel_tables="gb300",
               fp4_flops=15000e12, gpus_per_node=72),
    DeviceSpec("a100-80g", _gib(79.15), 2.039e12, 312e12, 300e9, kernel_tables="a100_sxm"),
    DeviceSpec("a100-40g", _gib(39.59), 1.555e12, 312e12, 300e9),
    DeviceSpec("l40s", _gib(44.39), 0.864e12, 362e12, 32e9, 10e-6, fp8_flops=733e12, kernel_tables="l40s"),
    DeviceSpec("a10g", _gib(22.03), 0.6e12, 125e12, 16e9, 10e-6),
    DeviceSpec("cpu-2core", 24 * GiB, 20e9, 100e9, 10e9, 20e-6),
]}
_DEVICE_ALIASES = {"h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h100-80gb": "h100-sxm",
                   "h200-sxm": "h200", "h200-141gb": "h200", "b200-sxm": "b200", "b200-180gb": "b200",
                   "b300-sxm": "b300", "b300-sxm6": "b300", "b300-sxm6-ac": "b300", "b300-288gb": "b300",
                   "gb200-nvl72": "gb200", "gb300-nvl72": "gb300",
                   "a100": "a100-80g", "a100-sxm": "a100-80g", "a100-80gb": "a100-80g",
                   "a100-40gb": "a100-40g",
                   # nvidia-smi's product names (NVIDIA dropped by _device_key)
                   "h100-80gb-hbm3": "h100-sxm", "h100-sxm5-80gb": "h100-sxm", "h200-141gb-hbm3e": "h200",
                   "a100-sxm4-80gb": "a100-80g", "a100-sxm4-40gb": "a100-40g"}
_MODEL_SUFFIXES = ("-instruct", "-chat", "-hf", "-base", "-it", "-pt")
# Where a checkpoint read as a catalog architecture differs from the catalog entry in fields that do
# not change its shape, by a pattern on its Hugging Face name (lower case): Qwen3's 2507 releases and
# Qwen3-Coder serve 262,144-token contexts; Mistral Small 3.1/3.2 and Devstral Small 131,072;
# DeepSeek-R1's distillations 131,072, with generation
# defaults of temperature 0.6 and top-p 0.95 (their generation_config.json).
CHECKPOINT_FIELDS = ((r"^qwen3-.*-2507", {"max_position_embeddings": 262144}),
                     (r"^(mistral-small-3\.[12]-|devstral-small)", {"max_position_embeddings": 131072}),
                     (r"^qwen3-coder-", {"max_position_embeddings": 262144}),
                     (r"^deepseek-r1-distill-", {"max_position_embeddings": 131072, "generation_filter": "top_p"}))


# Publishers whose own -FP8 checkpoints quantize in 128x128 blocks (their config.json's
# quantization_config has weight_block_size [128, 128]: Qwen3, Qwen3.5, GLM-5, ...); an -FP8 name from
# anyone else (nvidia/, RedHatAI/, neuralmagic/) reads per-channel or per-tensor fp8.
FP8_BLOCK_PUBLISHERS = ("qwen", "zai-org", "deepseek-ai", "moonshotai", "minimaxai", "stepfun-ai", "xiaomimimo")
# An fp8 checkpoint's name ending (lower case): -FP8, -FP8-dynamic, -FP8-Static, and a per-tensor
# one (-FP8-Static-PerTensor: ModelOpt's static per-tensor scales, whoever publishes it)
FP8_NAME = r"-fp8(-dynamic|-static)?(-per-?tensor)?$"
# A 4-bit integer (W4A16) checkpoint's name ending (lower case): -AWQ, -AWQ-INT4, -GPTQ-Int4,
# -quantized.w4a16, -w4a16, -Int4: every linear layer in 4 bits, groups of 128
INT4_NAME = r"-(awq|gptq)(-int4)?$|-(quantized\.)?w4a16$|-int4$"


def _repo_name(name: str) -> str:
    """A model name's last path part, lower case, underscores as dashes (what its keys match)."""
    return name.strip().lower().split("/")[-1].replace("_", "-")


def _model_key(name: str) -> tuple[str, bool | str]:
    """Normalized catalog key of a model name, and whether it names an fp8 checkpoint (True), an
    NVFP4 one ("nvfp4") or a 4-bit integer one ("int4")."""
    k = _repo_name(name)
    fp8 = False
    if re.search(FP8_NAME, k):
        fp8, k = True, re.sub(FP8_NAME, "", k)
    elif re.search(INT4_NAME, k):
        fp8, k = "int4", re.sub(INT4_NAME, "", k)
    elif re.search(r"(-nv|-)fp4(-v\d+)?$", k):
        # -NVFP4, and NVIDIA's -FP4 names (DeepSeek-R1-0528-FP4-v2, Llama-3.3-70B-Instruct-FP4)
        fp8, k = "nvfp4", re.sub(r"(-nv|-)fp4(-v\d+)?$", "", k)
    changed = True
    while changed:
        changed = False
        for suf in _MODEL_SUFFIXES:
            if k.endswith(suf):
                k, changed = k[: -len(suf)], True
        dated = re.sub(r"-(\d{4})$", "", k)  # date suffixes, e.g. -2507 (-Instruct-2507)
        if dated != k and k not in _MODEL_ALIASES and k not in MODELS:
            k, changed = dated, True
    return _MODEL_ALIASES.get(k, k), fp8


def _device_key(name: str) -> str:
    k = name.strip().lower().replace("(", "").replace(")", "").replace("_", "-").replace(" ", "-")
    k = k.removeprefix("nvidia-").removesuffix("-sxm") if k.startswith("nvidia-") else k
    return _DEVICE_ALIASES.get(k, k)


def load_hf_config(path: str | Path, name: str | None = None, dtype: str | None = None) -> ModelSpec:
    """A ModelSpec from a local HF config.json (or a folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        with open(p) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"deployment.model={str(path)!r}: no such config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"deployment.model={str(path)!r}: not valid JSON ({e})") from None
    try:
        spec = ModelSpec.from_hf_config(cfg, name=name or (p.parent.name or p.stem).lower(), dtype=dtype)
    except KeyError as e:
        raise ValueError(f"deployment.model={str(path)!r}: config.json lacks {e}") from None
    gen = p.parent / "generation_config.json"
    if gen.exists():
        try:
            with open(gen) as f:
                spec = replace(spec, generation_filter=generation_filter_of(json.load(f)))
        except json.JSONDecodeError as e:
            raise ValueError(f"deployment.model={str(path)!r}: {gen.name} is not valid JSON ({e})") from None
    return spec


def generation_filter_of(gen: dict) -> str:
    """ModelSpec.generation_filter from a generation_config.json mapping: the top-k/top-p filtering
    vLLM applies by default (top_p below 1, top_k above 0; at temperature 0 none)."""
    if not isinstance(gen, dict) or gen.get("temperature") == 0:
        return ""
    top_p, top_k = gen.get("top_p"), gen.get("top_k")
    p = isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and 0 < top_p < 1
    k = isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0
    return "top_k_top_p" if p and k else "top_p" if p else "top_k" if k else ""


def _from_mapping(cls, value, lookup, what: str):
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        return lookup(value)
    if isinstance(value, dict):
        names = {f.name for f in fields(cls)}
        value = dict(value)
        if "dtype" in value and cls is ModelSpec:  # the old single dtype: the weights'
            value.setdefault("weight_dtype", value.pop("dtype"))
        base = dict(asdict(lookup(value["base"]))) if "base" in value else {}
        unknown = set(value) - names - {"base"}
        if unknown:
            raise ValueError(f"{what}: unknown key(s) {sorted(unknown)}; known: {sorted(names)}")
        base.update({k: v for k, v in value.items() if k != "base"})
        base.setdefault("name", "custom")
        try:
            return cls(**base)
        except TypeError as e:
            raise ValueError(f"{what}: {e}") from None
    raise ValueError(f"{what}={value!r}: expected a catalog name or a mapping")


def _lookup_model(value: str, base_dir: Path | None = None) -> ModelSpec:
    if value in MODELS:
        return MODELS[value]
    if value.endswith(".json") or "/" in value and not re.fullmatch(r"[\w.-]+/[\w.-]+", value):
        p = Path(value)
        if not p.is_absolute() and base_dir is not None:
            p = base_dir / p
        return load_hf_config(p)
    key, fp8 = _model_key(value)
    if key not in MODELS:
        p = Path(value) if base_dir is None or Path(value).is_absolute() else base_dir / value
        if (p / "config.json").exists() or (p.suffix == ".json" and p.exists()):
            return load_hf_config(p)
        raise ValueError(f"deployment.model={value!r}: unknown; known: {sorted(MODELS)} "
                         "(or a path to a HF config.json)")
    m = MODELS[key]
    raw = _repo_name(value)
    over = {k: v for pattern, fields in CHECKPOINT_FIELDS for k, v in fields.items() if re.search(pattern, raw)}
    if over:
        m = replace(m, **over)
    if not fp8:
        return m
    if fp8 == "int4":
        # AWQ / GPTQ / w4a16 checkpoints: every linear layer (experts too) in 4-bit integers, in
        # groups of 128; embeddings, LM head and norms in 16 bits
        return replace(m.with_dtypes(weight_dtype="int4"), attn_weight_dtype="", expert_dtype="")
    if fp8 == "nvfp4":
        # NVIDIA's NVFP4 checkpoints (ModelOpt): every linear layer of a dense model in NVFP4, a
        # mixture of experts' routed experts only (attention, router and shared experts left in
        # 16 bits), and an fp8 KV cache (kv_cache_quant_algo FP8)
        if m.is_moe:
            if key in NVFP4_FP8_ELSEWHERE:
                return replace(m, weight_dtype=NVFP4_FP8_ELSEWHERE[key], attn_weight_dtype="", expert_dtype="nvfp4")
            return replace(m, weight_dtype=m.act_dtype, attn_weight_dtype="", expert_dtype="nvfp4", kv_dtype="fp8")
        m = m.with_dtypes(weight_dtype="nvfp4", kv_dtype="fp8")
        return replace(m, attn_weight_dtype=m.act_dtype) if key in NVFP4_KEEPS_16BIT_ATTENTION else m
    if m.weight_dtype in FP8:  # an fp8 catalog model keeps its own format, its 4-bit experts in fp8 too
        # (an -FP8 repository of DeepSeek-V4, whose own experts are MXFP4: sgl-project's)
        return replace(m, expert_dtype="") if m.expert_dtype in WEIGHT_ONLY_4BIT else m
    owner = value.strip().lower().split("/")[0] if "/" in value else ""
    per_tensor = re.search(r"-per-?tensor$", raw) is not None
    m = m.with_dtypes(weight_dtype="fp8_block" if owner in FP8_BLOCK_PUBLISHERS and not per_tensor else "fp8")
    return replace(m, attn_weight_dtype=m.act_dtype) if key in FP8_KEEPS_16BIT_ATTENTION else m


def _lookup_device(value: str) -> DeviceSpec:
    if value in DEVICES:
        return DEVICES[value]
    key = _device_key(value)
    if key not in DEVICES:
        raise ValueError(f"deployment.device={value!r}: unknown; known: {sorted(DEVICES)}")
    return DEVICES[key]


def get_model(value, base_dir: Path | None = None) -> ModelSpec:
    return _from_mapping(ModelSpec, value, lambda v: _lookup_model(v, base_dir), "deployment.model")


def get_device(value) -> DeviceSpec:
    return _from_mapping(DeviceSpec, value, _lookup_device, "deployment.device")


# ----------------------------------------------------------------- memory accounting
# The vLLM release whose memory profiling ServeTwin follows when a deployment names none
# (deployment.vllm_version): the release its scheduler is checked against.
DEFAULT_VLLM_VERSION = "0.33"


def vllm_version_tuple(version: str | None) -> tuple[int, int]:
    """(major, minor) of a vLLM release written "0.15.1", "v0.19" or "0.10"; None: the default.
    ValueError naming deployment.vllm_version for anything else."""
    v = DEFAULT_VLLM_VERSION if version is None else str(version)
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.\d+)?(?:[.+-]?\w*)?", v.strip())
    if not m:
        raise ValueError(f"deployment.vllm_version={version!r}: expected a release such as '0.15.1' or '0.19'")
    return int(m.group(1)), int(m.group(2))


# The forward's torch peak per scheduled token of a mixture of experts in vLLM's profiling run
# (routing, the fused-MoE kernels' workspaces, and what torch.compile keeps alive around them):
# vLLM 0.19's startup logs give a torch peak of 2.87 GiB for gpt-oss-20b at TP2 and 2.47 GiB for
# Qwen1.5-MoE-A2.7B at TP1 (8192 tokens, 1024 sequences; llm-d-planner accuracy/results/v0.19.0),
# of which the sampler's 8 B x 1024 rows x vocabulary leaves 1.34 and 1.31 GiB for the forward:
# 175 and 172 KB per token, where the dense estimate gives about a third. An empirical figure from
# two logs, not a count of buffers; Llama-4-Scout TP4 (1.65 GiB on the same release) was kept out
# of it to check it.
MOE_FORWARD_BYTES_PER_TOKEN = 173_000


def activation_reserve_bytes(model: ModelSpec, device: DeviceSpec, tp: int = 1,
                             max_num_batched_tokens: int = 8192, max_num_seqs: int = 1024,
                             vllm_version: str | None = None) -> int:
    """What vLLM's profiling run leaves outside the KV pool on each GPU, as the given release
    (default DEFAULT_VLLM_VERSION) profiles it:

    - torch peak: a dummy forward over max_num_batched_tokens (MLP intermediate or attention
      activations, plus hidden states; for a mixture of experts at least MOE_FORWARD_BYTES_PER_TOKEN
      per token) and the sampler warm-up over min(max_num_seqs,
      max_num_batched_tokens) rows of the vocabulary. Before 0.17 the warm-up ran the sort-based
      top-k/top-p at about 38.5 bytes per row and vocabulary entry, and it alone sets the peak when
      larger (the forward's activations are freed by then; five startup logs of 0.10-0.16 give
      38.4-38.9 B). From 0.17 (Triton top-k/top-p) it adds about 8 bytes per entry (fp32 logits
      and probabilities) to the forward's peak.
    - non-torch memory (CUDA context share, NCCL and custom all-reduce buffers, cuBLAS
      workspaces), per GPU. From 0.17: 0.25 GiB on one GPU, 2.1 GiB with TP >= 2 (v0.19 startup
      logs: 0.24-0.27 and 2.07-2.17). Before: 0.13 GiB on one GPU (v0.16 logs: 0.13-0.14); with
      TP >= 2, 0.55 GiB for a dense model (v0.16's Llama-3.3-70B FP8 TP2 log; the pools the
      0.15.1 runs of ../shared/gpu-runs logged at TP2 and TP4 imply about as much) and 2.1 GiB for
      a mixture of experts (Qwen3-235B FP8 TP4's 0.10 log: 2.04; Llama-4-Scout FP8 TP2's 0.15.1
      pool implies about 2.1).
    - CUDA graphs: not subtracted before 0.21; from 0.21 vLLM subtracts its estimate, 1.1 GiB
      here: the median of the estimates five v0.19 startup logs print for their models (0.82-1.82
      GiB: "Estimated CUDA graph memory", 51 capture sizes of PIECEWISE and FULL graphs; the same
      logs say how much utilisation to add when that estimate is subtracted), within the 0.5-2.2
      GiB that logs of 0.24-0.27 print.

    A CPU device keeps the old fixed half GiB."""
    if device.name.startswith("cpu"):
        return GiB // 2
    version = vllm_version_tuple(vllm_version)
    a = model.act_dtype_bytes
    t = max_num_batched_tokens
    mlp = t * (model.up_factor * model.intermediate_size // tp) * a * 2  # gate_up (or up) output + activation
    attn = t * (model.num_heads // tp + 2 * model.kv_heads_per_gpu(tp)) * model.head_dim * a * 2
    hidden = 4 * t * model.hidden_size * a
    forward = max(mlp, attn) + hidden
    if model.is_moe:
        forward = max(forward, MOE_FORWARD_BYTES_PER_TOKEN * t)
    rows = min(max_num_seqs, t)
    if version < SAMPLER_SORT_UNTIL:  # the warm-up's top-k/top-p sorted (sim.sampling)
        torch_peak = max(forward, rows * model.vocab_size * 38.5)
    else:
        torch_peak = forward + rows * model.vocab_size * 8
    if version >= (0, 17):
        non_torch = 2.1 if tp > 1 else 0.25
    else:
        non_torch = (2.1 if model.is_moe else 0.55) if tp > 1 else 0.13
    non_torch = int(non_torch * GiB)
    cuda_graphs = int(1.1 * GiB) if version >= (0, 21) else 0
    return int(torch_peak) + non_torch + cuda_graphs


def memory_breakdown(model: ModelSpec, device: DeviceSpec, tp: int = 1, gpu_memory_utilization: float = 0.9,
                     block_size: int = 16, activation_reserve: int | None = None,
                     max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                     data_parallel: int = 1, vllm_version: str | None = None) -> dict:
    """Per-GPU memory of one replica (one data-parallel rank) as vLLM sizes its pool: memory x
    utilisation - the loaded model (weight shard, ModelSpec.loaded_bytes_per_gpu) -
    activation/graph reserve = KV bytes (less, for a linear-attention hybrid, the per-request
    state of up to max_num_seqs requests); KV per token per GPU from that GPU's KV heads. With data-parallel attention the routed experts spread over tp x dp GPUs.
    The reserve is profiled at the server's max_num_batched_tokens and max_num_seqs (None: vLLM's
    defaults on this GPU, DeviceSpec.serve_defaults), as vllm_version profiles it
    (activation_reserve_bytes)."""
    budget, seqs = device.serve_defaults()
    max_num_batched_tokens = max_num_batched_tokens or budget
    max_num_seqs = max_num_seqs or seqs
    reserve = activation_reserve if activation_reserve is not None else activation_reserve_bytes(
        model, device, tp, max_num_batched_tokens, max_num_seqs, vllm_version)
    usable = device.memory_bytes * gpu_memory_utilization
    weights = model.weight_bytes_per_gpu(tp, tp * data_parallel)
    loaded = model.loaded_bytes_per_gpu(tp, tp * data_parallel)
    kv = usable - loaded - reserve
    # A linear-attention hybrid's per-request state comes from the same pool (vLLM's hybrid KV
    # cache manager gives each running request one state block per group of linear layers): set
    # aside here for max_num_seqs requests, or as many as half the pool holds when fewer fit, so
    # that the pool left counts tokens of the attention layers only.
    state = model.linear_state_bytes_per_request_per_gpu(tp)
    state_requests = min(max_num_seqs, int(max(kv, 0.0) / 2 // state)) if state else 0
    kv -= state_requests * state
    per_token = model.kv_bytes_per_token_per_gpu(tp)
    blocks = int(kv // (per_token * block_size)) if kv > 0 else 0
    return {"model": model.name, "device": device.name, "tp": tp, "weight_dtype": model.weight_dtype,
            "kv_dtype": model.kv_dtype, "gpu_memory_bytes": device.memory_bytes, "usable_bytes": usable,
            "weight_bytes_per_gpu": weights, "loaded_bytes_per_gpu": loaded, "reserve_bytes": reserve,
            "kv_bytes_per_gpu": max(kv, 0.0), "kv_bytes_per_token": model.kv_bytes_per_token,
            "kv_heads_per_gpu": model.kv_heads_per_gpu(tp), "kv_bytes_per_token_per_gpu": per_token,
            **({"linear_state_bytes_per_request": state, "linear_state_requests": state_requests} if state else {}),
            "kv_blocks": blocks, "kv_tokens": blocks * block_size, "fits": blocks >= 2 and (state_requests >= 1 or not state)}


def kv_cache_blocks(model: ModelSpec, device: DeviceSpec, tp: int = 1, block_size: int = 16,
                    gpu_memory_utilization: float = 0.9, activation_reserve_bytes: int | None = None,
                    max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                    data_parallel: int = 1, vllm_version: str | None = None) -> int:
    """KV blocks per replica (per data-parallel rank), as the engine sizes its pool
    (memory_breakdown). Returns num_gpu_blocks counting the null block, as vLLM does."""
    m = memory_breakdown(model, device, tp, gpu_memory_utilization, block_size, activation_reserve_bytes,
                         max_num_batched_tokens, max_num_seqs, data_parallel, vllm_version)
    if not m["fits"]:
        raise ValueError(
            f"deployment: {model.name} ({m['loaded_bytes_per_gpu'] / GiB:.1f} GiB loaded per GPU) at tp={tp} "
            f"does not fit on {device.name} ({device.memory_bytes / GiB:.0f} GiB x {gpu_memory_utilization}): "
            f"no memory left for KV cache" + (" or one request's linear-attention state" if model.is_hybrid else ""))
    return m["kv_blocks"] + 1
