"""Inference engines: one interface, several backends (transformers, vLLM).

``TransformersEngine`` runs anywhere torch does; ``VLLMEngine`` needs the
optional ``vllm`` extra and is imported lazily so the rest works without it.
"""

from typing import Any

from .base import Completion, InferenceEngine, SamplingConfig

__all__ = ["Completion", "InferenceEngine", "SamplingConfig", "TransformersEngine", "VLLMEngine"]


def __getattr__(name: str) -> Any:
    if name == "TransformersEngine":
        from .transformers_engine import TransformersEngine

        return TransformersEngine
    if name == "VLLMEngine":
        from .vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
