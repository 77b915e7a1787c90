"""Model and device specs, and the memory accounting that sizes a replica's KV pool.

Catalog numbers: model shapes from the models' config.json; device numbers from vendor data
sheets (dense bf16 tensor-core FLOP/s, HBM bandwidth, per-direction NVLink/PCIe bandwidth).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "fp8": 1, "float8": 1}


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
    dtype: str = "bfloat16"

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def params_per_layer(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h  # + two RMSNorm weights

    @property
    def num_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else emb
        return emb + head + self.num_layers * self.params_per_layer + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "custom", dtype: str = "bfloat16") -> "ModelSpec":
        heads = cfg["num_attention_heads"]
        return cls(
            name=name, num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 131072), dtype=dtype)


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    mem_bandwidth: float          # bytes/s
    flops: float                  # dense bf16 FLOP/s
    interconnect_bandwidth: float  # bytes/s per direction between GPUs of one TP group
    interconnect_latency_s: float = 5e-6


GiB = 1024 ** 3

MODELS: dict[str, ModelSpec] = {m.name: m for m in [
    ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256, False, 131072),
    ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256, False, 131072),
    ModelSpec("llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, True, 131072),
    ModelSpec("llama-3.2-3b", 28, 3072, 24, 8, 128, 8192, 128256, True, 131072),
    ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, False, 32768),
    ModelSpec("qwen2.5-72b", 80, 8192, 64, 8, 128, 29568, 152064, False, 32768),
    ModelSpec("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32768, False, 32768),
    ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, True, 8192, "float32"),
]}

DEVICES: dict[str, DeviceSpec] = {d.name: d for d in [
    DeviceSpec("h100-sxm", 80 * GiB, 3.35e12, 989e12, 450e9),
    DeviceSpec("h200", 141 * GiB, 4.8e12, 989e12, 450e9),
    DeviceSpec("a100-80g", 80 * GiB, 2.039e12, 312e12, 300e9),
    DeviceSpec("a100-40g", 40 * GiB, 1.555e12, 312e12, 300e9),
    DeviceSpec("l40s", 48 * GiB, 0.864e12, 362e12, 32e9, 10e-6),
    DeviceSpec("a10g", 24 * GiB, 0.6e12, 125e12, 16e9, 10e-6),
    DeviceSpec("cpu-2core", 24 * GiB, 20e9, 100e9, 10e9, 20e-6),
]}


def _from_mapping(cls, value, catalog: dict, what: str):
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        if value not in catalog:
            raise ValueError(f"{what}={value!r}: unknown; known: {sorted(catalog)}")
        return catalog[value]
    if isinstance(value, dict):
        names = {f.name for f in fields(cls)}
        base = dict(asdict(catalog[value["base"]])) if "base" in value else {}
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


def get_model(value) -> ModelSpec:
    return _from_mapping(ModelSpec, value, MODELS, "deployment.model")


def get_device(value) -> DeviceSpec:
    return _from_mapping(DeviceSpec, value, DEVICES, "deployment.device")


def kv_cache_blocks(model: ModelSpec, device: DeviceSpec, tp: int = 1, block_size: int = 16,
                    gpu_memory_utilization: float = 0.9, activation_reserve_bytes: int | None = None) -> int:
    """KV blocks per replica, as the engine sizes its pool: per GPU, memory x utilisation minus
    the weight shard and an activation/workspace reserve, divided by one block's K/V bytes
    (its share of KV heads). Returns num_gpu_blocks counting the null block, as vLLM does."""
    if activation_reserve_bytes is None:
        activation_reserve_bytes = int(1.5 * GiB) if device.memory_bytes > 16 * GiB else GiB // 2
    per_gpu = device.memory_bytes * gpu_memory_utilization - model.weight_bytes / tp - activation_reserve_bytes
    kv_heads_per_gpu = max(1, model.num_kv_heads // tp)
    block_bytes = 2 * model.num_layers * kv_heads_per_gpu * model.head_dim * model.dtype_bytes * block_size
    blocks = int(per_gpu // block_bytes)
    if blocks < 2:
        raise ValueError(
            f"deployment: {model.name} ({model.weight_bytes / GiB:.1f} GiB of weights) at tp={tp} does not "
            f"fit on {device.name} ({device.memory_bytes / GiB:.0f} GiB x {gpu_memory_utilization}): "
            f"no memory left for KV cache")
    return blocks + 1
