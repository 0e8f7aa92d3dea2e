"""The vLLM engine: the same contract as the transformers engine (skipped without vLLM)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node.engines.vllm_engine import vllm_available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vllm not installed")]


def test_vllm_capture_verifies_against_transformers_prefill() -> None:
    from node.engines.base import SamplingConfig
    from node.engines.transformers_engine import TransformersEngine
    from node.engines.vllm_engine import VLLMEngine
    from node.models import SMOLLM2_DIRNAME, load_smollm2
    from proofs import build_sequence_proofs, verify_sequence

    cache = Path(os.environ.get("PRIMENODE_MODEL_CACHE", Path.home() / ".cache" / "primenode"))
    model, tok = load_smollm2(cache)
    engine = VLLMEngine(str(cache / SMOLLM2_DIRNAME))
    prompt = tok.encode("The capital of France is")
    out = engine.generate([prompt], 2, SamplingConfig(temperature=0.6, max_tokens=40), [3], capture_hidden=True)
    validator = TransformersEngine(model)
    for c in out[0]:
        assert c.hidden.shape[0] == len(prompt) + len(c.tokens)
        proofs = build_sequence_proofs(c.hidden, len(prompt))
        assert verify_sequence(validator.prefill_hidden(prompt, c.tokens), len(prompt), proofs).ok
        assert verify_sequence(engine.prefill_hidden(prompt, c.tokens), len(prompt), proofs).ok
    again = engine.generate([prompt], 2, SamplingConfig(temperature=0.6, max_tokens=40), [3])
    assert [c.tokens for c in again[0]] == [c.tokens for c in out[0]]
    engine.load_weights(model.state_dict())
