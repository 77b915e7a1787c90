"""The model runner: per-request state, one forward per step, sampling."""
from engine.runner.model_runner import ModelRunner, RequestState, StepTimes

__all__ = ["ModelRunner", "RequestState", "StepTimes"]
