"""An attacker who holds the policy weights: it builds signed-batch contents with
whatever tokens it likes and *honest* TOPLOC proofs for them (a prefill of those tokens
through the true policy), so only the seeded-sampling replay can tell the difference."""

from __future__ import annotations

from collections.abc import Callable

from node.roles.context import RunContext
from node.roles.rollouts import PolicyFacts, owed_prompts, owed_seeds
from node.util import now_ms
from proofs import build_many
from protocol import RolloutBatch, Sample

# (prompt index, member, prompt tokens, owed seed) -> the tokens the attacker claims
Chooser = Callable[[int, int, list[int], int], list[int]]


def forged_batch(
    ctx: RunContext,
    engine,
    worker: str,
    policy: PolicyFacts,
    counter: int,
    choose: Chooser,
    *,
    seed_field: Callable[[int], int] | None = None,
) -> RolloutBatch:
    """A batch for the owed prompts of (worker, counter) whose tokens ``choose``
    picks, with proofs computed honestly from ``engine`` (the true policy) and the rules'
    rewards; ``seed_field`` rewrites the diagnostic ``Sample.seed`` (default: the owed seed)."""
    g = ctx.genesis
    indices = owed_prompts(ctx, worker, counter)
    seeds = owed_seeds(ctx, worker, counter, indices)
    rows = []
    for i, group in zip(indices, seeds):
        prompt = ctx.prompt_tokens(i)
        for m, seed in enumerate(group):
            rows.append((i, prompt, seed, [int(t) for t in choose(i, m, prompt, seed)]))
    hidden = engine.prefill_hidden_batch([(p, t) for _, p, _, t in rows])
    proofs = build_many([(h, len(p)) for h, (_, p, _, _) in zip(hidden, rows)])
    samples = tuple(
        Sample(
            prompt_index=i,
            completion=Sample.pack_tokens(toks),
            seed=seed_field(seed) if seed_field else seed,
            proof=b"".join(pr),
            claimed_reward=ctx.reward(i, toks),
        )
        for (i, _, seed, toks), pr in zip(rows, proofs)
    )
    return RolloutBatch(
        run_id=g.run_id,
        worker=worker,
        policy_version=policy.version,
        batch_counter=counter,
        sampling=ctx.sampling,
        samples=samples,
        created_ms=now_ms(),
    )


def generated(engine, params, prompt: list[int], seed: int) -> list[int]:
    """What ``engine`` samples for ``prompt`` with ``seed`` under ``params``."""
    return list(engine.generate([prompt], 1, params, [[seed]])[0][0].tokens)
