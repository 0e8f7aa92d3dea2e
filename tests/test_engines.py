"""The transformers engine on a tiny random Llama: seeded sampling, log-probabilities,
hidden-state capture during generation matching a validator prefill, hot reload."""

from __future__ import annotations

import pytest
import torch

from node.engines.transformers_engine import TransformersEngine, completion_seed
from node.models import tiny_llama
from proofs import build_many, build_sequence_proofs, verify_sequence
from protocol.messages import SamplingParams

EOS = 3
PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]


@pytest.fixture(scope="module")
def engine() -> TransformersEngine:
    return TransformersEngine(tiny_llama(eos_token_id=EOS), max_batch=64)


def test_shapes_and_group_layout(engine: TransformersEngine) -> None:
    out = engine.generate(PROMPTS, 3, SamplingParams(temperature=1.0, max_tokens=20), [1, 2], capture_hidden=True)
    assert [len(g) for g in out] == [3, 3]
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            assert c.prompt_tokens == prompt and 1 <= len(c.tokens) <= 20
            assert len(c.logprobs) == len(c.tokens) and all(lp <= 0 for lp in c.logprobs)
            assert c.hidden.shape == (len(prompt) + len(c.tokens), 256) and c.hidden.dtype == torch.float32
            assert c.finish_reason == ("stop" if c.tokens[-1] == EOS else "length")
            assert EOS not in c.tokens[:-1]


def test_seeded_sampling_is_reproducible_and_batch_independent(engine: TransformersEngine) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24)
    a = engine.generate(PROMPTS, 2, params, [7, 8])
    b = engine.generate(PROMPTS, 2, params, [7, 8])
    alone = engine.generate(PROMPTS[1:], 2, params, [8])
    assert [c.tokens for g in a for c in g] == [c.tokens for g in b for c in g]
    assert [c.tokens for c in a[1]] == [c.tokens for c in alone[0]]
    assert a[0][0].tokens != a[0][1].tokens  # siblings draw from independent streams
    other = engine.generate(PROMPTS, 2, params, [70, 80])
    assert [c.tokens for g in a for c in g] != [c.tokens for g in other for c in g]
    assert completion_seed(7, 0) != completion_seed(7, 1)


def test_logprobs_match_a_full_forward_with_temperature(engine: TransformersEngine) -> None:
    temp = 0.7
    out = engine.generate(PROMPTS, 1, SamplingParams(temperature=temp, max_tokens=16), [3, 4])
    for g in out:
        c = g[0]
        with torch.no_grad():
            logits = engine.model(torch.tensor([c.prompt_tokens + c.tokens])).logits[0]
        logp = torch.log_softmax(logits / temp, dim=-1)
        p = len(c.prompt_tokens)
        want = [logp[p - 1 + i, t].item() for i, t in enumerate(c.tokens)]
        assert c.logprobs == pytest.approx(want, abs=1e-4)


def test_greedy_is_argmax(engine: TransformersEngine) -> None:
    out = engine.generate([PROMPTS[0]], 2, SamplingParams(temperature=0.0, max_tokens=8), [0])
    c = out[0][0]
    assert c.tokens == out[0][1].tokens
    seq = list(c.prompt_tokens)
    for t in c.tokens:
        with torch.no_grad():
            assert engine.model(torch.tensor([seq])).logits[0, -1].argmax().item() == t
        seq.append(t)


def test_captured_hidden_equals_validator_prefill_and_proofs_verify(engine: TransformersEngine) -> None:
    out = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_tokens=40), [5, 6], capture_hidden=True)
    completions = [c for g in out for c in g]
    proofs = build_many([(c.hidden, len(c.prompt_tokens)) for c in completions])
    prefills = engine.prefill_hidden_batch([(c.prompt_tokens, c.tokens) for c in completions])
    for c, pr, h in zip(completions, proofs, prefills):
        assert torch.allclose(h, c.hidden, atol=1e-4)
        assert torch.allclose(engine.prefill_hidden(c.prompt_tokens, c.tokens), h, atol=1e-4)
        assert pr == build_sequence_proofs(c.hidden, len(c.prompt_tokens))
        assert verify_sequence(h, len(c.prompt_tokens), pr).ok


def test_batched_prefill_paths_equal_one_plain_forward_each(engine: TransformersEngine) -> None:
    """Shared-prompt groups, length-sorted right-padded micro-batches, an empty
    completion, tiny budgets: every row equals a lone unpadded forward, in input order."""
    long = list(range(20, 60))
    pairs = [
        (PROMPTS[0], [12, 13, 14]),
        (PROMPTS[1], []),
        (PROMPTS[0], [15]),
        (PROMPTS[1], long),
        ([4], long[:30]),
        (PROMPTS[0], []),
        ([4, 5], [6]),
        ([7], []),
    ]
    with torch.no_grad():
        want = [engine.model.model(input_ids=torch.tensor([list(p) + list(c)])).last_hidden_state[0] for p, c in pairs]
    for budget, pad in ((None, 0.25), (8, 0.0), (1000, 1.0)):
        got = engine.prefill_hidden_batch(pairs, token_budget=budget, max_pad=pad)
        assert [h.shape for h in got] == [w.shape for w in want]
        for h, w in zip(got, want):
            assert torch.allclose(h, w, atol=1e-4)
    assert engine.prefill_hidden_batch([]) == []
    with pytest.raises(ValueError, match="empty"):
        engine.prefill_hidden_batch([([], [])])


def test_single_token_generation_is_provable(engine: TransformersEngine) -> None:
    out = engine.generate([PROMPTS[1]], 1, SamplingParams(temperature=1.0, max_tokens=1), [9], capture_hidden=True)
    c = out[0][0]
    assert len(c.tokens) == 1 and c.hidden.shape[0] == len(PROMPTS[1]) + 1
    proofs = build_sequence_proofs(c.hidden, len(c.prompt_tokens))
    assert len(proofs) == 2
    assert verify_sequence(engine.prefill_hidden(c.prompt_tokens, c.tokens), len(c.prompt_tokens), proofs).ok


def test_empty_prompt_and_bad_arguments_are_rejected(engine: TransformersEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 1, SamplingParams(), [0])
    with pytest.raises(ValueError):
        engine.generate(PROMPTS, 1, SamplingParams(), [0])
    with pytest.raises(ValueError):
        engine.generate(PROMPTS, 1, SamplingParams(top_p=0.0), [0, 1])


def test_load_weights_hot_reload() -> None:
    eng = TransformersEngine(tiny_llama(eos_token_id=EOS, seed=0))
    other = tiny_llama(eos_token_id=EOS, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    before = eng.generate(PROMPTS, 1, params, [0, 1], capture_hidden=True)
    eng.load_weights(other.state_dict())
    after = eng.generate(PROMPTS, 1, params, [0, 1], capture_hidden=True)  # the hook survives reload
    ref = TransformersEngine(other).generate(PROMPTS, 1, params, [0, 1])
    assert [g[0].tokens for g in after] == [g[0].tokens for g in ref]
    assert [g[0].tokens for g in after] != [g[0].tokens for g in before] or not torch.allclose(
        after[0][0].hidden, before[0][0].hidden
    )
    with pytest.raises(ValueError, match="does not fit"):
        eng.load_weights({"nope": torch.zeros(1)})
    bad = dict(other.state_dict())
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        eng.load_weights(bad)


def test_weights_from_another_model_fail_verification() -> None:
    worker = TransformersEngine(tiny_llama(eos_token_id=EOS, seed=2))
    validator = TransformersEngine(tiny_llama(eos_token_id=EOS, seed=0))
    out = worker.generate(PROMPTS, 1, SamplingParams(temperature=1.0, max_tokens=40), [1, 2], capture_hidden=True)
    for g in out:
        c = g[0]
        proofs = build_sequence_proofs(c.hidden, len(c.prompt_tokens))
        h = validator.prefill_hidden(c.prompt_tokens, c.tokens)
        assert not verify_sequence(h, len(c.prompt_tokens), proofs).ok
