"""Token log-probs without the full logits: same numbers and gradients as the full path, the
head only ever sees completion rows in bounded chunks, token-budget micro-batches, and
gradient checkpointing that changes memory, not results."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.rl import char_llama, fake_groups
from node.rl.grpo import GRPOConfig, GRPOTrainer, Rollout
from node.rl.logprobs import (
    CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    chunk_bytes_for,
    default_chunk_tokens,
    micro_batches,
    token_logprobs_and_entropy,
)

torch.set_num_threads(1)
CPU = torch.device("cpu")


def _rollouts() -> list[Rollout]:
    return [r for g in fake_groups(0, n_groups=3, group_size=3) for r in g] + [Rollout([1, 5], [], 0.0)]


@pytest.mark.parametrize("chunk", [1, 3, 7, None])
def test_chunked_values_and_gradients_equal_the_full_logits(chunk):
    rollouts = _rollouts()
    full_model, chunked_model = char_llama(seed=3), char_llama(seed=3)
    lp0, ent0, mask0 = token_logprobs_and_entropy(full_model, rollouts, 0.7, 0, CPU, chunk_tokens=0)
    lp1, ent1, mask1 = token_logprobs_and_entropy(chunked_model, rollouts, 0.7, 0, CPU, chunk_tokens=chunk)
    assert torch.equal(mask0, mask1)
    assert mask1.sum() == sum(len(r.completion_tokens) for r in rollouts)
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-5)
    ((lp0 * mask0).sum() + 0.1 * (ent0 * mask0).sum()).backward()
    ((lp1 * mask1).sum() + 0.1 * (ent1 * mask1).sum()).backward()
    for (name, a), (_, b) in zip(full_model.named_parameters(), chunked_model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_head_sees_only_completion_rows_in_bounded_chunks():
    """The point of the module: no [batch, length, vocab] logits. The LM head is called on
    completion positions only (never a prompt row), at most ``chunk`` rows at a time, and
    in the backward pass it recomputes one chunk at a time."""
    model = char_llama(seed=4)
    rollouts = _rollouts()
    seen: list[tuple[int, ...]] = []
    model.get_output_embeddings().register_forward_hook(lambda _m, args, _o: seen.append(tuple(args[0].shape)))
    lp, _, mask = token_logprobs_and_entropy(model, rollouts, 1.0, 0, CPU, chunk_tokens=4)
    n = sum(len(r.completion_tokens) for r in rollouts)
    assert all(len(s) == 2 and s[0] <= 4 for s in seen)
    assert sum(s[0] for s in seen) == n
    seen.clear()
    (lp * mask).sum().backward()
    assert seen and all(s[0] <= 4 for s in seen)  # recomputed per chunk under checkpointing
    assert sum(s[0] for s in seen) == n


def test_default_chunk_is_sized_by_the_vocabulary():
    assert default_chunk_tokens(151_936) == 110
    assert default_chunk_tokens(49_152) == 341
    assert default_chunk_tokens(10**9) == 16


def test_the_trainers_chunk_is_sized_by_the_model():
    # a quarter of a byte of logits per parameter, within 16-64 MiB: SmolLM2-135M ~32 MiB (64 MiB
    # chunks put its peak 10 % of its state higher; 16 MiB saved 1 % more and cost 15 % more
    # seconds), Qwen2.5-0.5B and larger the ceiling, the size before
    assert chunk_bytes_for(134_515_008) == 134_515_008 // 4
    assert default_chunk_tokens(49_152, 134_515_008) == 171
    assert default_chunk_tokens(151_936, 494_032_768) == default_chunk_tokens(151_936) == 110
    assert chunk_bytes_for(1_000_000) == MIN_CHUNK_BYTES
    assert chunk_bytes_for(7_000_000_000) == CHUNK_BYTES
    assert chunk_bytes_for(None) == CHUNK_BYTES
    model = char_llama(seed=1)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0]
    base = GRPOConfig(lr=1e-3, warmup_steps=0, max_tokens=16)
    assert GRPOTrainer(model, base).chunk_tokens == default_chunk_tokens(vocab, params)
    assert default_chunk_tokens(vocab, params) == MIN_CHUNK_BYTES // (4 * vocab)  # a tiny model: the floor
    # a configured size is kept, 0 (full logits) included
    assert GRPOTrainer(char_llama(seed=1), dataclasses.replace(base, logprob_chunk_tokens=5)).chunk_tokens == 5
    assert GRPOTrainer(char_llama(seed=1), dataclasses.replace(base, logprob_chunk_tokens=0)).chunk_tokens == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), max_size=30), st.integers(1, 120), st.integers(0, 6))
def test_micro_batches_cover_in_order_and_keep_the_budget(lengths, budget, max_rows):
    spans = micro_batches(lengths, budget, max_rows)
    assert [i for a, b in spans for i in range(a, b)] == list(range(len(lengths)))
    for a, b in spans:
        assert b > a
        if b - a > 1:
            assert max(lengths[a:b]) * (b - a) <= budget
            assert not max_rows or b - a <= max_rows


def _step(cfg: GRPOConfig, seed: int = 5) -> tuple[GRPOTrainer, float]:
    trainer = GRPOTrainer(char_llama(seed=seed), cfg)
    m = trainer.step(fake_groups(0, n_groups=4, group_size=4))
    assert not m.skipped
    return trainer, m.loss


def test_token_budget_micro_batches_and_checkpointing_do_not_change_the_step():
    base = GRPOConfig(lr=1e-3, warmup_steps=0, max_tokens=16, temperature=1.0, micro_batch_size=16)
    ref, ref_loss = _step(dataclasses.replace(base, logprob_chunk_tokens=0))
    variants = [
        dataclasses.replace(base, micro_batch_tokens=20),
        dataclasses.replace(base, micro_batch_size=3, logprob_chunk_tokens=5),
        dataclasses.replace(base, gradient_checkpointing=True, micro_batch_tokens=40),
    ]
    for cfg in variants:
        trainer, loss = _step(cfg)
        assert trainer.micro_batches([r for g in fake_groups(0, 4, 4) for r in g]) != [(0, 16)] or (
            cfg.micro_batch_tokens == 0 and cfg.micro_batch_size >= 16
        )
        assert loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
        for (name, a), (_, b) in zip(ref.model.named_parameters(), trainer.model.named_parameters()):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)
        assert not trainer.model.training  # back in eval mode after the step


def test_gradient_checkpointing_keeps_fewer_activations_for_backward():
    """Checkpointing is on, not just accepted: the tensors autograd saves for backward during
    a training step shrink to a fraction (the layers are recomputed in backward instead)."""

    def saved_bytes(checkpointing: bool) -> int:
        cfg = GRPOConfig(lr=1e-3, warmup_steps=0, max_tokens=16, temperature=1.0, micro_batch_size=16)
        trainer = GRPOTrainer(
            char_llama(seed=5, layers=4), dataclasses.replace(cfg, gradient_checkpointing=checkpointing)
        )
        total = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer.step(fake_groups(0, n_groups=4, group_size=4))
        return total[0]

    assert saved_bytes(True) < 0.5 * saved_bytes(False)


def test_gradient_checkpointing_refuses_a_model_with_dropout():
    model = char_llama(seed=6)
    model.config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="dropout"):
        GRPOTrainer(model, GRPOConfig(gradient_checkpointing=True))
