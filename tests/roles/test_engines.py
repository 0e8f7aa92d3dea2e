"""The conformance suite of ``InferenceEngine`` (node/engines/base.py): every backend runs
these same checks, against a plain transformers forward of the same weights as the reference.

The model is a tiny random Llama (harness/engines.py) whose EOS makes greedy
generation from PROMPTS[0] stop after a few tokens, which exercises a completion that
ends on EOS (for vLLM: the hidden row it never computes itself).
Backend-specific checks live in tests/roles/test_engines_transformers.py and
tests/roles/test_engines_vllm.py. The vLLM backend is skipped without vLLM (CI never installs
it; docs/proofs.md says how it was run); starting it takes 30-60 s on a CPU, so one engine
serves the module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.engines import HIDDEN, PROMPTS, greedy_reference, reference_model
from node.engines.base import InferenceEngine, group_seeds
from node.engines.vllm_engine import vllm_available
from node.models import tiny_llama
from proofs import build_many, build_sequence_proofs, verify_sequence
from protocol.messages import SamplingParams


def _transformers(tmp: Path) -> tuple[Any, float]:
    from node.engines.transformers_engine import TransformersEngine

    return TransformersEngine(reference_model(), max_batch=64), 1e-4


def _vllm(tmp: Path) -> tuple[Any, float]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from node.engines.vllm_engine import VLLMEngine

    reference_model().save_pretrained(tmp)
    return VLLMEngine(tmp), 1e-3  # EOS read from the folder, like the transformers engine


BACKENDS = [
    pytest.param(_transformers, id="transformers"),
    pytest.param(
        _vllm,
        id="vllm",
        marks=[pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vllm not installed")],
    ),
]


@pytest.fixture(scope="module", params=BACKENDS)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The engine under test, the reference model (its own copy of the same weights), the EOS,
    and the tolerance on hidden states the backend meets against the reference."""
    engine, atol = request.param(tmp_path_factory.mktemp("tiny-llama"))
    model = reference_model()
    yield {"engine": engine, "model": model, "eos": model.config.eos_token_id, "atol": atol}


def test_the_engine_has_every_member_of_the_interface(setup: dict[str, Any]) -> None:
    """Roles call only what ``InferenceEngine`` declares (mypy holds them to it) and probe for
    nothing, so a backend must have all of it: here at run time, for each backend."""
    engine = setup["engine"]
    members = {n for n in vars(InferenceEngine) if not n.startswith("_")}
    assert {"generate", "prefill_hidden_batch", "load_weights", "load_delta", "delta_values", "numerics"} <= members
    assert sorted(n for n in members if not hasattr(engine, n)) == []
    assert isinstance(engine.delta_values, bool) and isinstance(engine.numerics, str)


def test_shapes_and_group_layout(setup: dict[str, Any]) -> None:
    engine, eos = setup["engine"], setup["eos"]
    assert engine.eos_token_id == eos
    out = engine.generate(
        PROMPTS, 3, SamplingParams(temperature=1.0, max_tokens=20), group_seeds([1, 2], 3), capture_hidden=True
    )
    assert [len(g) for g in out] == [3, 3]
    for prompt, seeds, group in zip(PROMPTS, group_seeds([1, 2], 3), out):
        assert [c.seed for c in group] == seeds
        for c in group:
            assert c.prompt_tokens == prompt and 1 <= len(c.tokens) <= 20
            assert len(c.logprobs) == len(c.tokens) and all(lp <= 0 for lp in c.logprobs)
            assert tuple(c.hidden.shape) == (len(prompt) + len(c.tokens), HIDDEN) and c.hidden.dtype == torch.float32
            assert c.finish_reason == ("stop" if c.tokens[-1] == eos else "length")
            assert eos not in c.tokens[:-1]
            assert c.finish_reason == "stop" or len(c.tokens) == 20


def test_seeded_sampling_is_reproducible_and_batch_independent(setup: dict[str, Any]) -> None:
    engine = setup["engine"]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24)
    a = engine.generate(PROMPTS, 2, params, group_seeds([7, 8], 2))
    b = engine.generate(PROMPTS, 2, params, group_seeds([7, 8], 2))
    alone = engine.generate(PROMPTS[1:], 2, params, group_seeds([8], 2))
    assert [c.tokens for g in a for c in g] == [c.tokens for g in b for c in g]
    assert [c.tokens for c in a[1]] == [c.tokens for c in alone[0]]
    assert a[0][0].tokens != a[0][1].tokens  # siblings draw from independent streams
    other = engine.generate(PROMPTS, 2, params, group_seeds([70, 80], 2))
    assert [c.tokens for g in a for c in g] != [c.tokens for g in other for c in g]
    assert group_seeds([7], 2)[0][0] != group_seeds([7], 2)[0][1]
    # capturing hidden states must not change the tokens drawn
    captured = engine.generate(PROMPTS, 2, params, group_seeds([7, 8], 2), capture_hidden=True)
    assert [c.tokens for g in a for c in g] == [c.tokens for g in captured for c in g]


@pytest.mark.parametrize("temp,top_p", [(0.7, 1.0), (1.0, 0.5)])
def test_logprobs_match_a_full_forward_with_temperature(setup: dict[str, Any], temp: float, top_p: float) -> None:
    """log p(token) under the temperature-scaled distribution, before top-p truncation."""
    params = SamplingParams(temperature=temp, top_p=top_p, max_tokens=16)
    for g in setup["engine"].generate(PROMPTS, 1, params, group_seeds([3, 4], 1)):
        c = g[0]
        with torch.no_grad():
            logits = setup["model"](torch.tensor([c.prompt_tokens + c.tokens])).logits[0]
        logp = torch.log_softmax(logits / temp, dim=-1)
        p = len(c.prompt_tokens)
        want = [logp[p - 1 + i, t].item() for i, t in enumerate(c.tokens)]
        assert c.logprobs == pytest.approx(want, abs=1e-4)


def test_greedy_is_argmax_and_stops_on_eos(setup: dict[str, Any]) -> None:
    out = setup["engine"].generate([PROMPTS[0]], 2, SamplingParams(temperature=0.0, max_tokens=12), group_seeds([0], 2))
    want = greedy_reference(setup["model"], PROMPTS[0], 12)
    want = want[: want.index(setup["eos"]) + 1]
    for c in out[0]:
        assert c.tokens == want and c.finish_reason == "stop"


def test_captured_hidden_equals_prefill_and_proofs_verify(setup: dict[str, Any]) -> None:
    """What a worker captures while generating is what a validator's prefill computes, and
    the proofs built from it verify; includes a completion ending on EOS and one of length 1."""
    engine, atol = setup["engine"], setup["atol"]
    sampled = engine.generate(
        PROMPTS, 2, SamplingParams(temperature=1.0, max_tokens=40), group_seeds([5, 6], 2), capture_hidden=True
    )
    greedy = engine.generate(
        [PROMPTS[0]], 1, SamplingParams(temperature=0.0, max_tokens=40), [[0]], capture_hidden=True
    )
    single = engine.generate([PROMPTS[1]], 1, SamplingParams(temperature=1.0, max_tokens=1), [[9]], capture_hidden=True)
    assert greedy[0][0].finish_reason == "stop" and len(single[0][0].tokens) == 1
    completions = [c for g in sampled + greedy + single for c in g]
    proofs = build_many([(c.hidden, len(c.prompt_tokens)) for c in completions])
    prefills = engine.prefill_hidden_batch([(c.prompt_tokens, c.tokens) for c in completions])
    with torch.no_grad():
        refs = [
            setup["model"].model(input_ids=torch.tensor([c.prompt_tokens + c.tokens])).last_hidden_state[0]
            for c in completions
        ]
    for c, pr, h, ref in zip(completions, proofs, prefills, refs):
        assert h.shape == c.hidden.shape == ref.shape
        assert torch.allclose(h, c.hidden, atol=atol)
        assert torch.allclose(c.hidden, ref, atol=atol), float((c.hidden - ref).abs().max())
        assert torch.allclose(engine.prefill_hidden(c.prompt_tokens, c.tokens), h, atol=1e-4)
        assert pr == build_sequence_proofs(c.hidden, len(c.prompt_tokens))
        assert verify_sequence(h, len(c.prompt_tokens), pr).ok
    assert len(build_sequence_proofs(single[0][0].hidden, len(PROMPTS[1]))) == 2  # prompt chunk + one token


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_tokens=32),
        SamplingParams(temperature=0.6, top_p=0.8, max_tokens=32),
        SamplingParams(temperature=1.3, top_k=20, max_tokens=32),
    ],
    ids=["t1", "t0.6-top_p", "t1.3-top_k"],
)
def test_every_token_is_the_seeded_gumbel_sample_a_validator_replays(setup: dict[str, Any], params) -> None:
    """Seeded sampling (proofs.sampling): each token is the argmax of logits / T + the seeded
    noise, so replaying it from the reference model's logits finds every token, with no gap;
    the output matrix and EOS ids the engine reports are the model's."""
    from proofs.sampling import completion_logits, replay

    engine, model = setup["engine"], setup["model"]
    seeds = [[101, 102, 103], [201, 202, 203]]
    head = model.get_output_embeddings().weight.detach()
    assert torch.equal(engine.lm_head_weight().float().cpu(), head)
    assert engine.vocab_size == head.shape[0] and setup["eos"] in engine.eos_token_ids
    for group, row in zip(engine.generate(PROMPTS, 3, params, seeds), seeds):
        for c, seed in zip(group, row):
            assert c.seed == seed
            with torch.no_grad():
                hidden = model.model(input_ids=torch.tensor([c.prompt_tokens + c.tokens])).last_hidden_state[0]
            result = replay(completion_logits(hidden, len(c.prompt_tokens), head), c.tokens, seed, params, 1e-3)
            assert result.first_bad < 0 and result.near_ties == 0 and result.max_gap < 1e-4, result
    # another seed replays to other tokens: the seed, not the engine, chooses
    c = engine.generate([PROMPTS[0]], 1, params, [[999]])[0][0]
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([c.prompt_tokens + c.tokens])).last_hidden_state[0]
    assert replay(completion_logits(hidden, len(c.prompt_tokens), head), c.tokens, 101, params, 1e-3).first_bad >= 0


def test_prefill_hidden_batch_keeps_the_input_order(setup: dict[str, Any]) -> None:
    engine, atol = setup["engine"], setup["atol"]
    long = list(range(20, 60))
    pairs = [(PROMPTS[0], [12, 13, 14]), (PROMPTS[1], []), (PROMPTS[1], long), ([4], long[:30]), ([7], [])]
    got = engine.prefill_hidden_batch(pairs)
    with torch.no_grad():
        want = [
            setup["model"].model(input_ids=torch.tensor([list(p) + list(c)])).last_hidden_state[0] for p, c in pairs
        ]
    assert [tuple(h.shape) for h in got] == [(len(p) + len(c), HIDDEN) for p, c in pairs]
    for h, w in zip(got, want):
        assert torch.allclose(h, w, atol=atol)
    assert engine.prefill_hidden_batch([]) == []
    with pytest.raises(ValueError, match="empty"):
        engine.prefill_hidden_batch([([], [])])


def test_empty_prompt_and_bad_arguments_are_rejected(setup: dict[str, Any]) -> None:
    engine = setup["engine"]
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 1, SamplingParams(), [[0]])
    with pytest.raises(ValueError):
        engine.generate(PROMPTS, 1, SamplingParams(), group_seeds([0], 1))
    with pytest.raises(ValueError):
        engine.generate(PROMPTS, 1, SamplingParams(top_p=0.0), group_seeds([0, 1], 1))


def test_load_weights_hot_reload(setup: dict[str, Any]) -> None:
    """Other weights, loaded in place, are what the engine then computes with (proofs from
    them fail against the original weights); loading the originals back gives the first run
    back (the module's engine ends on its original weights)."""
    engine, atol = setup["engine"], setup["atol"]
    original = {k: v.clone() for k, v in setup["model"].state_dict().items()}
    other = tiny_llama(seed=1)
    params = SamplingParams(temperature=1.0, max_tokens=24)

    def run() -> list[Any]:
        return [
            c for g in engine.generate(PROMPTS, 2, params, group_seeds([11, 12], 2), capture_hidden=True) for c in g
        ]

    first = run()
    engine.load_weights(other.state_dict())
    moved = run()  # the hidden-state capture survives the reload
    assert any(a.tokens != b.tokens for a, b in zip(first, moved)) or not all(
        torch.allclose(a.hidden, b.hidden, atol=atol) for a, b in zip(first, moved)
    )
    with torch.no_grad():
        for c in moved:
            ids = torch.tensor([c.prompt_tokens + c.tokens])
            theirs = other.model(input_ids=ids).last_hidden_state[0]
            ours = setup["model"].model(input_ids=ids).last_hidden_state[0]
            assert torch.allclose(c.hidden, theirs, atol=atol)
            proofs = build_sequence_proofs(c.hidden, len(c.prompt_tokens))
            assert verify_sequence(theirs, len(c.prompt_tokens), proofs).ok
            assert not verify_sequence(ours, len(c.prompt_tokens), proofs).ok
    engine.load_weights(original)
    back = run()
    assert [c.tokens for c in back] == [c.tokens for c in first]
    for a, b in zip(first, back):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert torch.allclose(a.hidden, b.hidden, atol=1e-5)
