"""Issue 14: a validator replays seeded sampling, so tokens the model did not sample are
refused even when their TOPLOC proofs are honest.

Every attacker here holds the true weights and proves its tokens honestly (a prefill
through the true policy, harness/attacks.py): each test names the rule that refuses
the attack, next to an honest control at the same slot that is accepted.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from harness.attacks import forged_batch, generated
from harness.genesis import WORKERS
from harness.roles import engine_for, tiny_context
from node.roles.context import REPLAY_PRESETS
from node.roles.rollouts import PolicyFacts, owed_prompts, owed_seeds, produce_batch, verify_batch
from node.util import now_ms

W, THIEF = WORKERS[0].peer_id, WORKERS[1].peer_id
# The replay's two rules: "termination" when the first token that is not the seeded sample
# is an EOS (claimed, or the seeded sample there), else "sampling". Which one an attack
# meets first depends on the run id, so token-source attacks accept either; the termination
# tests below pin their own.
REPLAY = {"sampling", "termination"}
ROOT = b"\x5a" * 32
# The run id (it hashes the genesis timestamp) picks every prompt and seed, so it is pinned:
# a test's slot is then the same on every machine and every day. Unpinned, a rare run id puts
# the forged token within the "mixed" tolerance of the seeded sample at the slot a test
# picks, where a near tie is accepted by design (docs/proofs.md): test_a_forged_eos[mixed]
# failed in one CI run (2026-11-28) and passed for 60 other run ids tried here.
CREATED_MS = 1_700_000_000_000


@pytest.fixture(scope="module", params=["same", "mixed"])
def setup(request, tmp_path_factory):
    """Each attack under both replay tolerances: "same" (a run declaring one numerics
    stack: max_tie_gap 1e-3) and "mixed" (mixed hardware: max_tie_gap 0.3 of the row's logit scale plus a near-tie budget)."""
    stack = {"numerics": "transformers-fp32-cpu"} if request.param == "same" else {}
    ctx = tiny_context(tmp_path_factory.mktemp("ctx"), fields={"created_ms": CREATED_MS}, max_tokens=20, **stack)
    assert ctx.replay_config == REPLAY_PRESETS[request.param]
    engine = engine_for(ctx)
    return ctx, engine


def policy(**kw) -> PolicyFacts:
    return PolicyFacts(kw.get("version", 0), kw.get("root", ROOT), kw.get("published_ms", now_ms()))


def honest(ctx, engine):
    """The honest sampler: the run's parameters and the owed seed."""
    return lambda i, m, prompt, seed: generated(engine, ctx.sampling, prompt, seed)


def check(ctx, engine, batch, worker=W, pol=None):
    return verify_batch(ctx, engine, batch, worker, pol or policy())


def test_honest_control_forged_by_the_attack_helper_is_accepted(setup):
    """The attack helper itself is honest when it chooses the seeded sample: its proofs and
    rewards are right, so every rejection below is the replay's."""
    ctx, engine = setup
    for counter in range(2):
        v = check(ctx, engine, forged_batch(ctx, engine, W, policy(), counter, honest(ctx, engine)))
        assert v.accept, v.reason
        assert v.accept == check(ctx, engine, produce_batch(ctx, engine, W, policy(), counter)).accept


def _other_model(ctx):
    """A cheaper stand-in: another model of the same shape (a different initialisation)."""
    from node.models import tiny_llama

    size = ctx.initial_model().config
    other = tiny_llama(
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        layers=size.num_hidden_layers,
        heads=size.num_attention_heads,
        seed=7,
        eos_token_id=ctx.eos_token_id,
    )
    return engine_for(ctx, other)


def test_prefill_attack_from_another_model(setup):
    ctx, engine = setup
    cheap = _other_model(ctx)
    batch = forged_batch(ctx, engine, W, policy(), 0, lambda i, m, p, seed: generated(cheap, ctx.sampling, p, seed))
    v = check(ctx, engine, batch)
    assert not v.accept and v.rule in REPLAY, v.reason
    assert check(ctx, engine, forged_batch(ctx, engine, W, policy(), 0, honest(ctx, engine))).accept


def test_prefill_attack_with_random_tokens(setup):
    ctx, engine = setup
    rng = random.Random(0)
    n = ctx.sampling.max_tokens
    vocab = [t for t in range(engine.vocab_size) if t not in engine.eos_token_ids]
    batch = forged_batch(ctx, engine, W, policy(), 0, lambda *_: [rng.choice(vocab) for _ in range(n)])
    v = check(ctx, engine, batch)
    assert not v.accept and v.rule in REPLAY, v.reason


def test_prefill_attack_with_a_fixed_string(setup):
    """Attacker text aimed at the reward, ended with a proper EOS."""
    ctx, engine = setup
    text = ctx.tokenizer.encode("aaaaaaaa")[:8] + [ctx.eos_token_id]
    v = check(ctx, engine, forged_batch(ctx, engine, W, policy(), 0, lambda *_: text))
    assert not v.accept and v.rule in REPLAY, v.reason


@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_greedy_and_low_temperature_decoding_claimed_as_the_runs_temperature(setup, temperature):
    ctx, engine = setup
    cold = dataclasses.replace(ctx.sampling, temperature=temperature)
    batch = forged_batch(ctx, engine, W, policy(), 0, lambda i, m, p, seed: generated(engine, cold, p, seed))
    assert batch.sampling == ctx.sampling  # the claim is the run's temperature
    v = check(ctx, engine, batch)
    assert not v.accept and v.rule in REPLAY, v.reason
    greedy = produce_batch(ctx, engine, W, policy(), 1, tamper="greedy")
    assert check(ctx, engine, greedy).rule in REPLAY
    assert check(ctx, engine, produce_batch(ctx, engine, W, policy(), 1)).accept


def test_best_of_n_groups(setup):
    """Generate each completion eight more times (other seeds) and submit the best-rewarded."""
    ctx, engine = setup

    def best(i, m, prompt, seed):
        tries = [generated(engine, ctx.sampling, prompt, seed + k) for k in range(1, 9)]
        return max(tries, key=lambda toks: ctx.reward(i, toks))

    batch = forged_batch(ctx, engine, W, policy(), 0, best)
    honest_batch = forged_batch(ctx, engine, W, policy(), 0, honest(ctx, engine))
    v = check(ctx, engine, batch)
    assert not v.accept and v.rule in REPLAY, v.reason
    assert check(ctx, engine, honest_batch).accept


def _find_slot(ctx, engine, want):
    """A (counter, prompt index, member, honest tokens) whose honest tokens satisfy ``want``."""
    for counter in range(3):
        indices = owed_prompts(ctx, W, counter)
        for i, group in zip(indices, owed_seeds(ctx, W, counter, indices)):
            for m, seed in enumerate(group):
                toks = generated(engine, ctx.sampling, ctx.prompt_tokens(i), seed)
                if want(toks):
                    return counter, i, m, toks
    pytest.skip("no honest completion of the wanted shape in the first slots")


def test_truncation_without_eos(setup):
    ctx, engine = setup
    eos = engine.eos_token_ids
    counter, i0, m0, _ = _find_slot(ctx, engine, lambda t: len(t) >= 8 and not set(t[:8]) & eos)

    def cut(i, m, prompt, seed):
        full = generated(engine, ctx.sampling, prompt, seed)
        return full[:6] if (i, m) == (i0, m0) else full

    v = check(ctx, engine, forged_batch(ctx, engine, W, policy(), counter, cut))
    assert not v.accept and v.rule == "termination" and "without an EOS" in v.detail, v.reason


def test_a_forged_eos(setup):
    """Cut where the reward likes it and append an EOS the model did not sample there."""
    ctx, engine = setup
    eos = engine.eos_token_ids
    counter, i0, m0, _ = _find_slot(ctx, engine, lambda t: len(t) >= 8 and not set(t[:8]) & eos)

    def forged_end(i, m, prompt, seed):
        full = generated(engine, ctx.sampling, prompt, seed)
        return [*full[:5], ctx.eos_token_id] if (i, m) == (i0, m0) else full

    v = check(ctx, engine, forged_batch(ctx, engine, W, policy(), counter, forged_end))
    assert not v.accept and v.rule == "termination" and "was not sampled" in v.detail, v.reason


def test_running_past_the_sampled_eos(setup):
    """The model sampled EOS; the worker keeps writing (to reach a reward-friendly length)."""
    ctx, engine = setup
    eos = engine.eos_token_ids
    counter, i0, m0, _ = _find_slot(ctx, engine, lambda t: t[-1] in eos and len(t) < ctx.sampling.max_tokens - 2)

    def longer(i, m, prompt, seed):
        full = generated(engine, ctx.sampling, prompt, seed)
        n = ctx.sampling.max_tokens  # ... up to max_tokens, a legal end without EOS
        return [*full[:-1], *[5] * (n - len(full) + 1)] if (i, m) == (i0, m0) else full

    v = check(ctx, engine, forged_batch(ctx, engine, W, policy(), counter, longer))
    assert not v.accept and v.rule == "termination" and "is EOS" in v.detail, v.reason


def test_one_counter_made_with_two_versions_draws_the_same_prompts_and_noise(setup):
    """Protocol 4: a counter's prompts and seeds do not depend on the version that makes it
    (nor on its manifest root), so computing one counter with two versions draws the same
    noise twice: with equal weights the two batches are the same tokens, and each verifies
    as its own version. What a chooser can pick between is only where the policies differ."""
    ctx, engine = setup
    old, new = policy(version=0, root=ROOT), policy(version=1, root=b"\x01" * 32)
    a, b = produce_batch(ctx, engine, W, old, 3), produce_batch(ctx, engine, W, new, 3)
    assert [s.prompt_index for s in a.samples] == [s.prompt_index for s in b.samples]
    assert [s.completion for s in a.samples] == [s.completion for s in b.samples]
    assert check(ctx, engine, a, pol=old).accept and check(ctx, engine, b, pol=new).accept
    other = produce_batch(ctx, engine, W, old, 4)  # the next counter: other prompts, other noise
    assert [s.prompt_index for s in other.samples] != [s.prompt_index for s in a.samples]


def test_relabelled_theft_of_another_workers_completions(setup):
    """THIEF claims W's honest completions of the same prompt (W's seeds) as its own."""
    ctx, engine = setup

    def stolen(i, m, prompt, seed):
        w_seed = owed_seeds(ctx, W, 0, [i])[0][m]  # what W owed for this prompt and member
        return generated(engine, ctx.sampling, prompt, w_seed)

    v = check(ctx, engine, forged_batch(ctx, engine, THIEF, policy(), 0, stolen), worker=THIEF)
    assert not v.accept and v.rule in REPLAY, v.reason
    assert check(ctx, engine, forged_batch(ctx, engine, THIEF, policy(), 0, honest(ctx, engine)), worker=THIEF).accept


def test_self_replay_of_earlier_completions(setup):
    """W resubmits its own completions of a prompt from an earlier counter (whatever version)."""
    ctx, engine = setup

    def replayed(i, m, prompt, seed):
        old_seed = owed_seeds(ctx, W, 0, [i])[0][m]
        return generated(engine, ctx.sampling, prompt, old_seed)

    for now in (policy(), policy(version=1, root=b"\x01" * 32)):
        v = check(ctx, engine, forged_batch(ctx, engine, W, now, 1, replayed), pol=now)
        assert not v.accept and v.rule in REPLAY, v.reason


def test_a_seed_field_that_lies(setup):
    """The validator derives the seed itself: sampling with a seed of one's choosing and
    recording it is refused; an honest batch with a garbage seed field is accepted."""
    ctx, engine = setup
    chosen = lambda i, m, prompt, seed: generated(engine, ctx.sampling, prompt, 12345 + m)  # noqa: E731
    lie = forged_batch(ctx, engine, W, policy(), 0, chosen, seed_field=lambda seed: 12345)
    v = check(ctx, engine, lie)
    assert not v.accept and v.rule in REPLAY, v.reason
    garbage_field = forged_batch(ctx, engine, W, policy(), 0, honest(ctx, engine), seed_field=lambda seed: 0)
    assert check(ctx, engine, garbage_field).accept
