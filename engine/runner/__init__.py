"""The model runner (per-request state, one forward per step, sampling) and its CPU attention path."""
from engine.runner.cpu_attention import CPUPagedAttention, cpu_attention_backend
from engine.runner.model_runner import ModelRunner, RequestState, StepTimes

__all__ = ["CPUPagedAttention", "ModelRunner", "RequestState", "StepTimes", "cpu_attention_backend"]
