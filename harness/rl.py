"""Helpers for the RL tests: a tiny seeded Llama and deterministic fake rollout groups."""

from __future__ import annotations

import random

import torch

from node.rl.grpo import Rollout
from node.rl.tasks import CharTokenizer


def char_llama(seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4, vocab: int | None = None):
    """A random-init LlamaForCausalLM small enough for unit tests (fp32, eager attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = CharTokenizer()
    cfg = LlamaConfig(
        vocab_size=vocab or tok.vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
        bos_token_id=tok.BOS,
        eos_token_id=tok.EOS,
        pad_token_id=tok.PAD,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.eval()
    return model


def fake_groups(
    step: int, n_groups: int = 3, group_size: int = 4, vocab: int = 70, version: int | None = None
) -> list[list[Rollout]]:
    """Deterministic random groups for step ``step`` (token ids in [3, vocab))."""
    rng = random.Random(1000 + step)
    groups = []
    for _ in range(n_groups):
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randint(2, 5))]
        g = []
        for _ in range(group_size):
            comp = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 7))]
            g.append(
                Rollout(
                    prompt,
                    comp,
                    float(rng.random() < 0.5) + rng.random() * 0.1,
                    policy_version=version if version is not None else step,
                )
            )
        groups.append(g)
    return groups
