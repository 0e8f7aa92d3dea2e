"""Inference engines: one interface, several backends (transformers, vLLM).

``TransformersEngine`` runs anywhere torch does; ``VLLMEngine`` needs the
optional ``vllm`` extra and is imported lazily so the rest works without it.
"""

from typing import Any

from node.engines.base import Completion, InferenceEngine, SamplingParams

__all__ = ["Completion", "InferenceEngine", "SamplingParams", "TransformersEngine", "VLLMEngine"]


def __getattr__(name: str) -> Any:
    if name == "TransformersEngine":
        from node.engines.transformers_engine import TransformersEngine

        return TransformersEngine
    if name == "VLLMEngine":
        from node.engines.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
