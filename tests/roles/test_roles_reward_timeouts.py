"""Issue 14 point 5: a reward whose computation is not deterministic is not a cheating strike.

A code task's unit tests run in the sandbox with a timeout; a test that timed out on the
validator may pass on the worker's faster machine, so the worker's different claim is no
proof of a lie: the validator's own reward stands (the trainer then admits only rewards
that a quorum of validators computed alike). A claim that differs from a *deterministic*
reward (a test that fails) is still a lie, named by the rule ``reward``.
"""

from __future__ import annotations

import json

import torch

from harness.genesis import WORKERS, tiny_genesis
from node.roles.context import RunContext
from node.roles.rollouts import check_rewards
from node.util import now_ms
from protocol import RolloutBatch, Sample

W = WORKERS[0].peer_id
CODE = "```python\ndef f():\n    return 1\n```"


def _byte_level_model(path):
    """A tokenizer that can spell any text (bytes, no merges) and a tiny Llama for it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    tok.add_special_tokens({"eos_token": "<|end|>"})
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return tok


def _context(tmp_path, tests: str) -> RunContext:
    tok = _byte_level_model(tmp_path / "model")
    assert tok.decode(tok.encode(CODE)) == CODE
    data = tmp_path / "code.jsonl"
    data.write_text(json.dumps({"id": "p0", "prompt": "Write f.", "task": "code", "tests": tests}) + "\n")
    genesis = tiny_genesis(
        fields={
            "model": str(tmp_path / "model"),
            "dataset": str(data),
            "dataset_size": 1,
            "prompts_per_batch": 1,
            "group_size": 1,
        }
    )
    return RunContext.from_genesis(genesis.genesis, tmp_path / "cache")


def _batch(ctx: RunContext, claimed: float) -> RolloutBatch:
    tokens = ctx.tokenizer.encode(CODE) + [ctx.eos_token_id]
    sample = Sample(prompt_index=0, completion=Sample.pack_tokens(tokens), seed=0, proof=b"", claimed_reward=claimed)
    return RolloutBatch(
        run_id=ctx.genesis.run_id,
        worker=W,
        policy_version=0,
        batch_counter=0,
        sampling=ctx.sampling,
        samples=(sample,),
        created_ms=now_ms(),
    )


def test_a_timed_out_code_test_is_not_held_against_the_worker(tmp_path):
    ctx = _context(tmp_path, "import time\ntime.sleep(60)\n")  # never finishes within the 5 s timeout
    reward, deterministic = ctx.reward_checked(0, _batch(ctx, 1.0).samples[0].token_ids())
    assert (reward, deterministic) == (0.0, False)
    v = check_rewards(ctx, _batch(ctx, 1.0))  # the worker says its run passed
    assert v.accept and v.rewards == (0.0,), v.reason  # the validator's own reward stands


def test_a_claim_against_a_deterministic_failure_is_a_lie(tmp_path):
    ctx = _context(tmp_path, "assert f() == 2\n")  # fails on every machine
    assert ctx.reward_checked(0, _batch(ctx, 1.0).samples[0].token_ids()) == (0.0, True)
    v = check_rewards(ctx, _batch(ctx, 1.0))
    assert not v.accept and v.rule == "reward", v.reason
    honest = check_rewards(ctx, _batch(ctx, 0.0))  # the control: the true claim
    assert honest.accept and honest.rewards == (0.0,)
