"""Model and device specs, and the memory accounting that sizes a replica's KV pool.

Catalog numbers: model shapes from the models' config.json; device numbers from vendor data
sheets (dense tensor-core FLOP/s per dtype, HBM bandwidth, per-direction NVLink bandwidth) and
the memory torch reports (nvidia-smi MiB), not the marketing GB.

Dtypes are three, as vLLM keeps them: the weights of the linear layers (`weight_dtype`; fp8 for an
fp8 checkpoint), the KV cache (`kv_dtype`; bf16 unless `--kv-cache-dtype fp8`) and activations,
all-reduce, embeddings and LM head (`act_dtype`; bf16, also with fp8 weights).

Names are forgiving: `meta-llama/Llama-3.1-8B-Instruct`, `Llama-3.1-8B`, `llama-3.1-8b` are one
model (a `-FP8` suffix sets fp8 weights); `h100`, `h100-sxm`, `h100_sxm`, `H100-SXM5` one device.
A model may also be a local HF `config.json` (a path), or a mapping `{base: NAME, key: value}`.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_block": 1}
FP8 = ("fp8", "fp8_block")  # fp8_block: weights in 128x128 blocks with their own scales (Qwen's -FP8)
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16", "float8": "fp8", "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8",
                  "e4m3": "fp8", "fp8_e5m2": "fp8", "auto": "bfloat16"}
GiB = 1024 ** 3
MiB = 1024 ** 2


def canonical_dtype(name: str, what: str = "dtype") -> str:
    d = str(name).lower().replace("torch.", "")
    d = _DTYPE_ALIASES.get(d, d)
    if d not in DTYPE_BYTES:
        raise ValueError(f"{what}={name!r}: unknown dtype; known: bf16, fp16, fp32, fp8, fp8_block")
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

    def __post_init__(self) -> None:
        for key in ("weight_dtype", "kv_dtype", "act_dtype"):
            object.__setattr__(self, key, canonical_dtype(getattr(self, key), key))
        if self.kv_dtype == "fp8_block" or self.act_dtype in FP8:
            raise ValueError(f"kv_dtype={self.kv_dtype!r}, act_dtype={self.act_dtype!r}: fp8_block is a weight format")

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
    def dense_dtype_bytes(self) -> int:
        """Embeddings, LM head and norms: unquantized (act dtype) when the linear layers are fp8."""
        return self.act_dtype_bytes if self.weight_dtype in FP8 else self.weight_dtype_bytes

    # ------------------------------------------------------------ shapes
    def kv_heads_per_gpu(self, tp: int = 1) -> int:
        """KV heads each GPU holds: a share of them, or one replicated head when TP > KV heads
        (vLLM: max(1, num_kv_heads // tp)). Used by memory accounting and every cost model."""
        return max(1, self.num_kv_heads // tp)

    def gemm_shapes(self, tp: int = 1) -> dict[str, tuple[int, int]]:
        """(N, K) of the four GEMMs of one layer on one GPU (y[M, N] = x[M, K] @ W[K, N])."""
        h, d = self.hidden_size, self.head_dim
        q = self.num_heads // tp
        return {"qkv": ((q + 2 * self.kv_heads_per_gpu(tp)) * d, h), "o_proj": (h, q * d),
                "gate_up": (2 * self.intermediate_size // tp, h), "down": (h, self.intermediate_size // tp)}

    @property
    def params_per_layer(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h  # + two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.embedding_params

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.lm_head_params + self.num_layers * self.params_per_layer + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """All weights, as a checkpoint holds them (fp8 linear layers; bf16 embeddings, head, norms)."""
        return self.weight_bytes_per_gpu(1)

    def weight_bytes_per_gpu(self, tp: int = 1) -> int:
        """One GPU's weights at TP: linear layers sharded (k/v projections replicated when TP > KV
        heads), embeddings and LM head sharded by vocabulary, norms replicated."""
        lin = self.num_layers * sum(n * k for n, k in self.gemm_shapes(tp).values())
        norms = (2 * self.num_layers + 1) * self.hidden_size
        vocab = -(-self.vocab_size // tp) * self.hidden_size
        dense = vocab * (1 if self.tie_word_embeddings else 2)
        return lin * self.weight_dtype_bytes + (norms + dense) * self.dense_dtype_bytes

    def weight_read_bytes_per_gpu(self, tp: int = 1) -> int:
        """Weights one forward streams from HBM: all but the input embedding, which is a gather of
        a few rows (a tied LM head still reads the whole table)."""
        emb = 0 if self.tie_word_embeddings else -(-self.vocab_size // tp) * self.hidden_size * self.dense_dtype_bytes
        return self.weight_bytes_per_gpu(tp) - emb

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token (all KV heads)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    def kv_bytes_per_token_per_gpu(self, tp: int = 1) -> int:
        return 2 * self.num_layers * self.kv_heads_per_gpu(tp) * self.head_dim * self.kv_dtype_bytes

    def with_dtypes(self, weight_dtype: str | None = None, kv_dtype: str | None = None,
                    act_dtype: str | None = None) -> "ModelSpec":
        return replace(self, **{k: v for k, v in (("weight_dtype", weight_dtype), ("kv_dtype", kv_dtype),
                                                  ("act_dtype", act_dtype)) if v is not None})

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "custom", dtype: str | None = None,
                       kv_dtype: str = "bfloat16") -> "ModelSpec":
        """From a HF config.json mapping. Weight dtype: `dtype`, else fp8 when the config carries an
        fp8 quantization_config, else the config's torch_dtype (bf16 when absent)."""
        cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
        heads = cfg["num_attention_heads"]
        if dtype is None:
            q = cfg.get("quantization_config") or {}
            fp8 = "fp8" in json.dumps(q).lower() or "float8" in json.dumps(q).lower()
            block = fp8 and bool(q.get("weight_block_size"))
            dtype = ("fp8_block" if block else "fp8") if fp8 else cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        act = cfg.get("torch_dtype") or "bfloat16"
        act = "bfloat16" if canonical_dtype(act) in FP8 else act
        arch = " ".join(cfg.get("architectures") or []) + " " + str(cfg.get("model_type", ""))
        return cls(
            name=name, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 131072), weight_dtype=dtype,
            kv_dtype=kv_dtype, act_dtype=act, qk_norm="qwen3" in arch.lower())


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    mem_bandwidth: float          # bytes/s
    flops: float                  # dense bf16 tensor-core FLOP/s
    interconnect_bandwidth: float  # bytes/s per direction between GPUs of one TP group
    interconnect_latency_s: float = 5e-6
    fp8_flops: float | None = None  # dense fp8 FLOP/s; None: no fp8 tensor cores (bf16 math)
    kernel_tables: str | None = None  # calibration/kernels/<name>.json measured on this GPU
    gpus_per_node: int = 8            # GPUs one interconnect_bandwidth joins (a TP group within a node)

    def peak_flops(self, dtype: str) -> float:
        dtype = canonical_dtype(dtype)
        if dtype in FP8:
            return self.fp8_flops or self.flops
        if dtype == "float32":
            return self.flops / 2  # TF32 tensor cores
        return self.flops


MODELS: dict[str, ModelSpec] = {m.name: m for m in [
    ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, False, 131072),
    ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, False, 131072),
    ModelSpec("llama-3.1-405b", 126, 16384, 128, 8, 128, 53248, 128256, False, 131072),
    ModelSpec("llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, True, 131072),
    ModelSpec("llama-3.2-3b", 28, 3072, 24, 8, 128, 8192, 128256, True, 131072),
    ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, False, 32768),
    ModelSpec("qwen2.5-72b", 80, 8192, 64, 8, 128, 29568, 152064, False, 32768),
    ModelSpec("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936, False, 40960, qk_norm=True),
    ModelSpec("qwen3-14b", 40, 5120, 40, 8, 128, 17408, 151936, False, 40960, qk_norm=True),
    ModelSpec("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936, False, 40960, qk_norm=True),
    ModelSpec("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32768, False, 32768),
    ModelSpec("mistral-nemo", 40, 5120, 32, 8, 128, 14336, 131072, False, 1024000),
    ModelSpec("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, False, 4096),
    ModelSpec("llama-2-13b", 40, 5120, 40, 40, 128, 13824, 32000, False, 4096),
    ModelSpec("llama-2-70b", 80, 8192, 64, 8, 128, 28672, 32000, False, 4096),
    ModelSpec("codellama-34b", 48, 8192, 64, 8, 128, 22016, 32000, False, 16384),
    ModelSpec("yi-34b", 60, 7168, 56, 8, 128, 20480, 64000, False, 4096),
    ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, True, 8192, "float32", "float32", "float32"),
]}
_MODEL_ALIASES = {"llama-3.3-70b": "llama-3.1-70b", "meta-llama-3.1-8b": "llama-3.1-8b",
                  "meta-llama-3.1-70b": "llama-3.1-70b", "meta-llama-3.1-405b": "llama-3.1-405b",
                  "llama-3-8b": "llama-3.1-8b", "llama-3-70b": "llama-3.1-70b",
                  "meta-llama-3-8b": "llama-3.1-8b", "meta-llama-3-70b": "llama-3.1-70b",
                  "mistral-7b-v0.3": "mistral-7b", "smollm2-135m": "smollm2-135m",
                  "mistral-nemo-instruct": "mistral-nemo", "mistral-nemo-base": "mistral-nemo",
                  "llama-2-7b-chat": "llama-2-7b", "llama-2-70b-chat": "llama-2-70b",
                  "codellama-34b-instruct": "codellama-34b", "codellama-34b-python": "codellama-34b"}

DEVICES: dict[str, DeviceSpec] = {d.name: d for d in [
    DeviceSpec("h100-sxm", 81559 * MiB, 3.35e12, 989e12, 450e9, fp8_flops=1979e12, kernel_tables="h100_sxm"),
    DeviceSpec("h200", 143771 * MiB, 4.8e12, 989e12, 450e9, fp8_flops=1979e12, kernel_tables="h200_sxm"),
    DeviceSpec("b200", 183359 * MiB, 8.0e12, 2250e12, 900e9, fp8_flops=4500e12, kernel_tables="b200_sxm"),
    DeviceSpec("a100-80g", 80 * GiB, 2.039e12, 312e12, 300e9, kernel_tables="a100_sxm"),
    DeviceSpec("a100-40g", 40 * GiB, 1.555e12, 312e12, 300e9),
    DeviceSpec("l40s", 48 * GiB, 0.864e12, 362e12, 32e9, 10e-6, fp8_flops=733e12, kernel_tables="l40s"),
    DeviceSpec("a10g", 24 * GiB, 0.6e12, 125e12, 16e9, 10e-6),
    DeviceSpec("cpu-2core", 24 * GiB, 20e9, 100e9, 10e9, 20e-6),
]}
_DEVICE_ALIASES = {"h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h100-80gb": "h100-sxm",
                   "h200-sxm": "h200", "h200-141gb": "h200", "b200-sxm": "b200", "b200-180gb": "b200",
                   "a100": "a100-80g", "a100-sxm": "a100-80g", "a100-80gb": "a100-80g",
                   "a100-40gb": "a100-40g"}
_MODEL_SUFFIXES = ("-instruct", "-chat", "-hf", "-base", "-it")


def _model_key(name: str) -> tuple[str, bool]:
    """Normalized catalog key of a model name, and whether it names an fp8 checkpoint."""
    k = name.strip().lower().split("/")[-1].replace("_", "-")
    fp8 = False
    if re.search(r"-fp8(-dynamic|-static)?$", k):
        fp8, k = True, re.sub(r"-fp8(-dynamic|-static)?$", "", k)
    changed = True
    while changed:
        changed = False
        for suf in _MODEL_SUFFIXES:
            if k.endswith(suf):
                k, changed = k[: -len(suf)], True
    k = re.sub(r"-(\d{4})$", "", k)  # date suffixes, e.g. -2507
    return _MODEL_ALIASES.get(k, k), fp8


def _device_key(name: str) -> str:
    k = name.strip().lower().replace("_", "-").replace(" ", "-")
    k = k.removeprefix("nvidia-")
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
        return ModelSpec.from_hf_config(cfg, name=name or (p.parent.name or p.stem).lower(), dtype=dtype)
    except KeyError as e:
        raise ValueError(f"deployment.model={str(path)!r}: config.json lacks {e}") from None


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
    return m.with_dtypes(weight_dtype="fp8") if fp8 else m


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
def activation_reserve_bytes(model: ModelSpec, device: DeviceSpec, tp: int = 1,
                             max_num_batched_tokens: int = 8192, max_num_seqs: int = 1024) -> int:
    """What vLLM's profiling run leaves outside the KV pool on each GPU: the peak of a dummy
    forward over max_num_batched_tokens (MLP intermediate and attention activations) and of the
    sampler over max_num_seqs rows of fp32 logits, plus non-torch memory (CUDA context share, NCCL
    and custom all-reduce buffers, cuBLAS workspaces) and the CUDA graphs captured after it.
    A CPU device keeps the old fixed half GiB."""
    if device.name.startswith("cpu"):
        return GiB // 2
    a = model.act_dtype_bytes
    t = max_num_batched_tokens
    mlp = t * (2 * model.intermediate_size // tp) * a * 2           # gate_up output + activation
    attn = t * (model.num_heads // tp + 2 * model.kv_heads_per_gpu(tp)) * model.head_dim * a * 2
    hidden = 4 * t * model.hidden_size * a
    sampler = max_num_seqs * model.vocab_size * 4 * 2                # fp32 logits + probs
    non_torch = int(0.6 * GiB) + (int(0.4 * GiB) if tp > 1 else 0)
    cuda_graphs = int(0.5 * GiB)
    return int(max(mlp, attn) + hidden + sampler) + non_torch + cuda_graphs


def memory_breakdown(model: ModelSpec, device: DeviceSpec, tp: int = 1, gpu_memory_utilization: float = 0.9,
                     block_size: int = 16, activation_reserve: int | None = None,
                     max_num_batched_tokens: int = 8192, max_num_seqs: int = 1024) -> dict:
    """Per-GPU memory of one replica as vLLM sizes its pool: memory x utilisation - weight shard
    - activation/graph reserve = KV bytes; KV per token per GPU from that GPU's KV heads."""
    reserve = activation_reserve if activation_reserve is not None else activation_reserve_bytes(
        model, device, tp, max_num_batched_tokens, max_num_seqs)
    usable = device.memory_bytes * gpu_memory_utilization
    weights = model.weight_bytes_per_gpu(tp)
    kv = usable - weights - reserve
    per_token = model.kv_bytes_per_token_per_gpu(tp)
    blocks = int(kv // (per_token * block_size)) if kv > 0 else 0
    return {"model": model.name, "device": device.name, "tp": tp, "weight_dtype": model.weight_dtype,
            "kv_dtype": model.kv_dtype, "gpu_memory_bytes": device.memory_bytes, "usable_bytes": usable,
            "weight_bytes_per_gpu": weights, "reserve_bytes": reserve,
            "kv_bytes_per_gpu": max(kv, 0.0), "kv_bytes_per_token": model.kv_bytes_per_token,
            "kv_heads_per_gpu": model.kv_heads_per_gpu(tp), "kv_bytes_per_token_per_gpu": per_token,
            "kv_blocks": blocks, "kv_tokens": blocks * block_size, "fits": blocks >= 2}


def kv_cache_blocks(model: ModelSpec, device: DeviceSpec, tp: int = 1, block_size: int = 16,
                    gpu_memory_utilization: float = 0.9, activation_reserve_bytes: int | None = None,
                    max_num_batched_tokens: int = 8192, max_num_seqs: int = 1024) -> int:
    """KV blocks per replica, as the engine sizes its pool (memory_breakdown). Returns
    num_gpu_blocks counting the null block, as vLLM does."""
    m = memory_breakdown(model, device, tp, gpu_memory_utilization, block_size, activation_reserve_bytes,
                         max_num_batched_tokens, max_num_seqs)
    if m["kv_blocks"] < 2:
        raise ValueError(
            f"deployment: {model.name} ({m['weight_bytes_per_gpu'] / GiB:.1f} GiB of weights per GPU) at tp={tp} "
            f"does not fit on {device.name} ({device.memory_bytes / GiB:.0f} GiB x {gpu_memory_utilization}): "
            f"no memory left for KV cache")
    return m["kv_blocks"] + 1
