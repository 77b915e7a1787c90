"""The torch model layer: a Llama-family decoder over a flattened, paged batch, and its loader."""
from engine.model.llama import LlamaForCausalLM, ModelConfig
from engine.model.loader import build_random_model, cache_dir, load_model, resolve_model

__all__ = ["LlamaForCausalLM", "ModelConfig", "build_random_model", "cache_dir", "load_model", "resolve_model"]
