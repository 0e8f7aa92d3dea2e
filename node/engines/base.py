"""The inference-engine interface every backend implements.

Workers generate groups of completions with seeded Gumbel-max sampling
(``proofs.sampling``: a completion's tokens follow from its seed, the weights and
the prompt alone, so a validator can replay them) and keep the final
hidden states (after the model's final norm) for TOPLOC proofs; validators
prefill prompt + claimed tokens once to get the same hidden states back; the
trainer and workers reload weights in place when a new policy version lands.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
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
    """Everything roles call on a backend, in one place: both engines implement it (mypy checks
    that where ``node.roles.engines.build_engine`` returns them) and the conformance suite
    (tests/roles/test_engines.py) runs each. Implementations are synchronous and CPU/GPU
    heavy: call them from ``trio.to_thread.run_sync``."""

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a completion (a model may have several)."""
        ...

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer: the bound on token ids the model can emit."""
        ...

    def lm_head_weight(self) -> Any:
        """The (V, H) output matrix: logits = final hidden states @ lm_head.T."""
        ...

    @property
    def numerics(self) -> str:
        """The numerics stack as a run genesis names it ("transformers-fp32-cpu"): a run that
        declares one refuses engines on another (``RunContext.check_engine``)."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        seeds: Sequence[Sequence[int]],
        capture_hidden: bool = False,
    ) -> list[list[Completion]]:
        """``n`` completions per prompt; ``seeds[i][j]`` seeds completion j of prompt i
        (``protocol.sample_seed``), so a (prompt, seed, weights) triple gives the same
        tokens on any engine, device and batch shape (up to numerics near-ties)."""
        ...

    def prefill_hidden(self, prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> Any:
        """Final-norm hidden states (fp32, CPU) for prompt + completion in one forward pass,
        shape (len(prompt) + len(completion), hidden_size)."""
        ...

    def prefill_hidden_batch(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[Any]:
        """:meth:`prefill_hidden` for many (prompt, completion) pairs at once, in order: what a
        validator replays a batch with (a group's shared prompt is computed once)."""
        ...

    def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Replace the weights in place (hot reload of a new policy version)."""
        ...

    @property
    def delta_values(self) -> bool:
        """Whether :meth:`load_delta` needs each change's values (True) or only the changed
        tensors' names, reading them whole from the version's files (False)."""
        ...

    def load_delta(self, changes: Iterable[Any], files: Mapping[str, Any] | None = None) -> list[str]:
        """Apply a sparse delta in place on the loaded version (``Checkpoints.delta_changes``;
        ``files``: the new version's verified files, for engines that reload tensors whole).
        Returns the names of the tensors written."""
        ...


def check_seeds(prompts: Sequence[Sequence[int]], n: int, seeds: Sequence[Sequence[int]]) -> None:
    """One seed per completion: ``seeds[i]`` has ``n`` entries for each prompt ``i``."""
    if len(seeds) != len(prompts) or any(len(s) != n for s in seeds):
        raise ValueError(f"{len(prompts)} prompts x {n} completions need as many seeds, got {[len(s) for s in seeds]}")


def group_seeds(seeds: Sequence[int], n: int) -> list[list[int]]:
    """Per-completion seeds from one seed per prompt, for callers outside the protocol
    (the GRPO demo, dataset filtering, tests): member j of prompt i gets its own stream,
    so a completion does not depend on how many siblings were sampled with it."""
    out = []
    for seed in seeds:
        row = []
        for j in range(n):
            digest = hashlib.blake2b(f"{int(seed)}:{j}".encode(), digest_size=8).digest()
            row.append(int.from_bytes(digest, "big") >> 1)
        out.append(row)
    return out


def read_tensors(names: Iterable[str], files: Mapping[str, Any] | None) -> dict[str, Any]:
    """The named tensors, read whole from a version's ``{path: file}`` (its safetensors
    files, already checked against the signed root): what an engine reloads for the
    tensors a delta changes. Raises ValueError naming any the files do not hold."""
    from safetensors import safe_open

    if files is None:
        raise ValueError("loading a delta by tensor needs the new version's files")
    where: dict[str, Path] = {}
    for path, file in sorted(files.items()):
        if str(path).endswith(".safetensors"):
            with safe_open(str(file), framework="pt") as h:
                where.update({k: Path(file) for k in h.keys()})  # noqa: SIM118 (not a dict)
    wanted = sorted(set(names))
    unknown = [n for n in wanted if n not in where]
    if unknown:
        raise ValueError(f"delta names {unknown[:5]}, which the new version's files do not have")
    out: dict[str, Any] = {}
    for file in sorted({where[n] for n in wanted}):
        with safe_open(str(file), framework="pt") as h:
            out.update({n: h.get_tensor(n) for n in wanted if where[n] == file})
    return out
