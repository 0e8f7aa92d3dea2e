"""The inference-engine interface every backend implements.

Workers generate groups of completions with seeded sampling and keep the final
hidden states (after the model's final norm) for TOPLOC proofs; validators
prefill prompt + claimed tokens once to get the same hidden states back; the
trainer and workers reload weights in place when a new policy version lands.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from protocol.messages import SamplingParams


@dataclasses.dataclass
class Completion:
    """One generated completion.

    ``hidden`` is the final-norm hidden states, fp32 on CPU, shape
    (len(prompt_tokens) + len(tokens), hidden_size) when the generation ran with
    ``capture_hidden=True`` (prefill rows first, then one row per generated token),
    else None. ``logprobs[i]`` is log p(tokens[i]) under the sampling distribution
    (temperature applied).
    """

    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float]
    seed: int
    finish_reason: str  # "stop" (EOS) or "length"
    hidden: Any = None


class InferenceEngine(Protocol):
    """What roles need from a backend. Implementations are synchronous and CPU/GPU heavy:
    call them from ``trio.to_thread.run_sync``."""

    @property
    def eos_token_id(self) -> int | None: ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        seeds: Sequence[int],
        capture_hidden: bool = False,
    ) -> list[list[Completion]]:
        """``n`` completions per prompt; ``seeds[i]`` seeds prompt i's group, so a
        (prompt, seed, weights) triple reproduces the same tokens."""
        ...

    def prefill_hidden(self, prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> Any:
        """Final-norm hidden states (fp32, CPU) for prompt + completion in one forward pass,
        shape (len(prompt) + len(completion), hidden_size)."""
        ...

    def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Replace the weights in place (hot reload of a new policy version)."""
        ...
