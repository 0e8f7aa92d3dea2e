"""Worker batch production and validator checks, in one process with a tiny model."""

from __future__ import annotations

import pytest
import torch

from harness.genesis import WORKERS
from harness.roles import engine_for, tiny_context
from node.roles.rollouts import PolicyFacts, produce_batch, verify_batch
from node.util import now_ms
from protocol import RolloutBatch

W = WORKERS[0].peer_id


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ctx = tiny_context(tmp_path_factory.mktemp("ctx"))
    engine = engine_for(ctx)
    return ctx, engine


# The checkpoint facts the batches claim: version 0, some manifest root, published just now.
POLICY = PolicyFacts(0, b"\x07" * 32, now_ms())


class OneByOne:
    """The engine, prefilling each sequence alone (no shared-prompt batching)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill_hidden_batch(self, pairs):
        return [h for p in pairs for h in self.engine.prefill_hidden_batch([p])]


def test_honest_batch_is_accepted_with_rule_rewards(setup):
    ctx, engine = setup
    batch = produce_batch(ctx, engine, W, POLICY, 0)
    assert RolloutBatch.decode(batch.encode()) == batch
    assert len(batch.samples) == ctx.genesis.prompts_per_batch * ctx.genesis.group_size
    v = verify_batch(ctx, engine, batch, W, POLICY)
    assert v.accept, v.reason
    assert list(v.rewards) == [s.claimed_reward for s in batch.samples]


@pytest.mark.parametrize("tamper,rule", [("tokens", "toploc"), ("prompts", "prompts"), ("rewards", "reward")])
def test_tampered_batches_are_rejected(setup, tamper, rule):
    ctx, engine = setup
    batch = produce_batch(ctx, engine, W, POLICY, 1, tamper=tamper)
    v = verify_batch(ctx, engine, batch, W, POLICY)
    assert not v.accept and v.rule == rule, v.reason


def test_other_weights_are_rejected(setup):
    ctx, engine = setup
    other = ctx.initial_model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * p.std() * 0.1)
    batch = produce_batch(ctx, engine_for(ctx, other), W, POLICY, 2)
    v = verify_batch(ctx, engine, batch, W, POLICY)
    assert not v.accept and v.rule == "toploc", v.reason


def test_batch_announced_by_someone_else_is_rejected(setup):
    ctx, engine = setup
    batch = produce_batch(ctx, engine, W, POLICY, 3)
    v = verify_batch(ctx, engine, batch, WORKERS[1].peer_id, POLICY)
    assert not v.accept and v.rule == "worker"


def test_one_token_completions_with_a_narrow_model_verify(tmp_path):
    """A chunk with fewer than topk values carries a shorter proof: splitting must follow the shape."""
    from node.roles.rollouts import split_proofs

    ctx = tiny_context(tmp_path, max_tokens=1, tiny_hidden_size=32)
    engine = engine_for(ctx)
    batch = produce_batch(ctx, engine, W, POLICY, 0)
    assert all(len(s.token_ids()) == 1 for s in batch.samples)
    v = verify_batch(ctx, engine, batch, W, POLICY)
    assert v.accept, v.reason
    assert split_proofs(b"\0" * 7, 3, 1, 32) is None


def test_genesis_picks_the_toploc_thresholds(tmp_path):
    from node.errors import NodeError
    from node.roles.context import proof_config_for
    from proofs import ProofConfig
    from protocol import ProtocolError
    from protocol.run_config import RunConfig

    def thresholds(table):
        return proof_config_for(RunConfig.decode(table))

    assert thresholds({}) == ProofConfig()  # mixed hardware: the paper's thresholds
    assert thresholds({"numerics": "transformers-fp32-cpu"}) == ProofConfig.tight()
    assert thresholds({"numerics": "transformers-fp32-cpu", "toploc_thresholds": "paper"}) == ProofConfig()
    assert thresholds({"toploc_thresholds": "tight", "toploc_max_exp_mismatches": 5}) == ProofConfig.tight(
        max_exp_mismatches=5
    )
    for bad in (
        {"toploc_thresholds": "loose"},
        {"toploc_max_exp_mismatches": 2.5},
        {"toploc_max_mant_err_mean": -1},
        {"toploc_max_mant_err_median": "8"},
    ):
        with pytest.raises(ProtocolError):  # refused when the [config] table is decoded
            thresholds(bad)
    with pytest.raises(NodeError):
        tiny_context(tmp_path, toploc_thresholds="loose")  # refused when the node joins


def test_declared_numerics_stack_tight_thresholds_and_engine_check(tmp_path):
    """A genesis declaring one numerics stack: honest batches still pass the tight
    thresholds (worker batch of 8 rows vs the validator's own micro-batches), tampered
    tokens fail, and a node on another stack (bf16) refuses to take part."""
    from node.errors import NodeError
    from proofs import ProofConfig

    ctx = tiny_context(tmp_path, numerics="transformers-fp32-cpu")
    assert ctx.proof_config == ProofConfig.tight()
    engine = engine_for(ctx)
    ctx.check_engine(engine)
    for counter in range(3):
        batch = produce_batch(ctx, engine, W, POLICY, counter)
        v = verify_batch(ctx, engine, batch, W, POLICY)
        assert v.accept, v.reason
        assert verify_batch(ctx, OneByOne(engine), batch, W, POLICY).accept
    bad = produce_batch(ctx, engine, W, POLICY, 2, tamper="tokens")
    assert verify_batch(ctx, engine, bad, W, POLICY).rule == "toploc"
    low = engine_for(ctx, ctx.initial_model().to(torch.bfloat16))
    assert low.numerics == "transformers-bf16-cpu"
    with pytest.raises(NodeError, match="numerics"):
        ctx.check_engine(low)
    tiny_context(tmp_path).check_engine(low)  # no stack declared: anything goes
