"""Inference engines: one interface, several backends (transformers, vLLM)."""

from .base import Completion, InferenceEngine, SamplingConfig

__all__ = ["Completion", "InferenceEngine", "SamplingConfig"]
