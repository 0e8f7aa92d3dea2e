"""What only the transformers engine promises, beyond the conformance suite (tests/roles/test_engines.py):
the validator's batched prefill paths, strict weight checks on reload, and its numerics name."""

from __future__ import annotations

import pytest
import torch

from node.engines.transformers_engine import TransformersEngine
from node.models import tiny_llama

EOS = 3
PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]


@pytest.fixture(scope="module")
def engine() -> TransformersEngine:
    return TransformersEngine(tiny_llama(eos_token_id=EOS), max_batch=64)


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


def test_weights_that_do_not_fit_are_refused() -> None:
    eng = TransformersEngine(tiny_llama(eos_token_id=EOS, seed=0))
    with pytest.raises(ValueError, match="does not fit"):
        eng.load_weights({"nope": torch.zeros(1)})
    bad = dict(tiny_llama(eos_token_id=EOS, seed=1).state_dict())
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        eng.load_weights(bad)


def test_numerics_names_the_dtype_and_device(engine: TransformersEngine) -> None:
    assert engine.numerics == "transformers-fp32-cpu"
    assert TransformersEngine(tiny_llama(seed=0).to(torch.bfloat16)).numerics == "transformers-bf16-cpu"


def test_a_bf16_engine_proves_what_a_bf16_validator_and_an_fp32_validator_recompute() -> None:
    """A bf16 policy's engines compute in bf16 (issue 16, point 2): a bf16 worker's TOPLOC
    proofs pass a bf16 validator under the same-stack (tight) thresholds, and an fp32
    validator of the same weights under the cross-stack (paper) ones; a completion the
    worker did not generate fails both (the control that the check can fail)."""
    from node.engines.base import group_seeds
    from node.roles.context import TOPLOC_PRESETS
    from proofs import build_sequence_proofs, verify_sequence
    from protocol.messages import SamplingParams

    weights = tiny_llama(eos_token_id=EOS, seed=4)
    bf16 = TransformersEngine(tiny_llama(eos_token_id=EOS, seed=4).to(torch.bfloat16))
    bf16.load_weights(weights.state_dict())  # fp32 weights cast on load, as a published version is
    fp32 = TransformersEngine(weights)
    assert bf16.model.model.norm.weight.dtype == torch.bfloat16
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=40)
    comps = bf16.generate(PROMPTS, 2, params, group_seeds([7, 8], 2), capture_hidden=True)
    tight, cross = TOPLOC_PRESETS["tight"], TOPLOC_PRESETS["cross-stack"]
    for group in comps:
        for c in group:
            proofs = build_sequence_proofs(c.hidden, len(c.prompt_tokens), tight)
            same = bf16.prefill_hidden(c.prompt_tokens, c.tokens)
            other = fp32.prefill_hidden(c.prompt_tokens, c.tokens)
            assert verify_sequence(same, len(c.prompt_tokens), proofs, tight).ok
            assert verify_sequence(other, len(c.prompt_tokens), proofs, cross).ok
            forged = [(t + 17) % bf16.vocab_size for t in c.tokens]
            assert not verify_sequence(
                bf16.prefill_hidden(c.prompt_tokens, forged), len(c.prompt_tokens), proofs, tight
            ).ok
            assert not verify_sequence(
                fp32.prefill_hidden(c.prompt_tokens, forged), len(c.prompt_tokens), proofs, cross
            ).ok
