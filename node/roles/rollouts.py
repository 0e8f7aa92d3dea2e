"""Producing and checking rollout batches: the CPU-heavy core of workers and validators.

Both functions are synchronous (run them with ``trio.to_thread.run_sync``) and
free of network I/O, so they are tested directly and reused by the roles.

A validator accepts a batch only if *all* of these hold, and otherwise names
the first rule that failed in its vote. The rules that need no model run first,
so a malformed batch costs no prefill:

1. ``run``, ``worker``, ``sampling``: run, worker and sampling parameters are the run's;
2. ``prompts``: the prompts are exactly the ones the deterministic assignment owed
   the worker at its batch counter, each ``group_size`` times;
3. ``tokens``: every completion is well-formed (token ids below the model's output
   rows, length within ``max_tokens``);
4. ``termination``: a completion ends at its first EOS or at ``max_tokens``;
5. ``proof``: each sample carries exactly the proof bytes its shape implies.

Then, one prompt's group at a time (a prefill of the group, stopping at the first
sample that fails):

6. ``toploc``: every TOPLOC proof verifies against the validator's own prefill of
   prompt + claimed tokens with the weights of the claimed policy version, under
   the run's thresholds (``RunContext.proof_config``);
7. ``sampling`` / ``termination``: every token is the seeded Gumbel-max sample
   (``proofs.sampling``) of the validator's own logits, with the seed the validator
   derives itself (``protocol.sample_seed``: never the batch's ``seed`` field), up to
   the run's ``max_tie_gap`` and near-tie budget (``RunContext.replay_config``); a
   mismatch at an EOS (claimed or owed) is a ``termination`` failure;
8. ``reward``: the rewards the worker claims equal the rules' rewards (a reward
   whose computation timed out is not deterministic and is not held against it).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from node.engines.base import InferenceEngine
from node.roles.context import RunContext
from node.util import now_ms
from proofs import ProofConfig, ProofError, build_many, verify_sequence
from proofs.sampling import ReplayResult, completion_logits, replay_many
from protocol import RolloutBatch, Sample, assign_prompts, expected_chunks, sample_seed, split_proofs

PROOF = ProofConfig()  # chunking (the wire format); the thresholds come from the run (ctx.proof_config)
REWARD_TOLERANCE = 1e-6
REASON_LIMIT = 250  # characters of a verdict's reason that may echo peer-controlled text


@dataclasses.dataclass(frozen=True)
class PolicyFacts:
    """What the rules need to know of the checkpoint version a batch claims, from the
    trainer-signed manifest: its ``root`` (an input of every sample seed) and when it
    was published (``created_ms``: the start of its production slots)."""

    version: int
    root: bytes
    published_ms: int

    @classmethod
    def of(cls, manifest: Any) -> PolicyFacts:
        return cls(int(manifest.version), bytes(manifest.root), int(manifest.created_ms))


def owed_prompts(ctx: RunContext, worker: str, counter: int) -> list[int]:
    """The prompt indices ``worker`` owes at batch ``counter`` (whatever version makes it)."""
    g = ctx.genesis
    return assign_prompts(g.run_id, worker, counter, g.dataset_size, g.prompts_per_batch)


def owed_seeds(ctx: RunContext, worker: str, counter: int, indices: Sequence[int]) -> list[list[int]]:
    """The seed of every completion a batch owes: ``[prompt][member]`` (whatever version makes it)."""
    g = ctx.genesis
    return [[sample_seed(g.run_id, worker, counter, i, m) for m in range(g.group_size)] for i in indices]


def produce_batch(
    ctx: RunContext,
    engine: InferenceEngine,
    worker: str,
    policy: PolicyFacts,
    counter: int,
    *,
    tamper: str | None = None,
) -> RolloutBatch:
    """Generate the owed prompts' groups with proofs, sampling with the owed seeds.
    ``tamper`` exists for the adversarial tests: "tokens" (claim other tokens), "prompts"
    (answer other prompts), "rewards" (claim one more than earned), "greedy" (decode at temperature 0
    and claim the run's temperature); "weights" is applied to the engine by the caller."""
    g = ctx.genesis
    indices = owed_prompts(ctx, worker, counter)
    seeds = owed_seeds(ctx, worker, counter, indices)
    if tamper == "prompts":  # answer prompts it was not assigned
        indices = [(i + 1) % g.dataset_size for i in indices]
    prompts = [ctx.prompt_tokens(i) for i in indices]
    sp = ctx.sampling
    run_params = dataclasses.replace(sp, temperature=0.0) if tamper == "greedy" else sp
    groups = engine.generate(prompts, g.group_size, run_params, seeds, capture_hidden=True)
    flat = [(i, c) for i, group in zip(indices, groups) for c in group]
    proofs = build_many([(c.hidden, len(c.prompt_tokens)) for _, c in flat], PROOF)
    samples = []
    for (i, c), pr in zip(flat, proofs):
        tokens = list(c.tokens)
        reward = ctx.reward(i, tokens)
        if tamper == "tokens":  # claim a continuation it did not generate (same length, same EOS)
            tokens = [t if t in engine.eos_token_ids else _other_token(t, engine) for t in tokens]
        if tamper == "rewards":
            # inflate the claim: "claim 1.0" was no lie at all where the sample had earned 1.0
            # (a batch whose samples all did passed as honest: the tiny model's weights depend on
            # what else ran in its process before)
            reward = reward + 1.0
        samples.append(
            Sample(
                prompt_index=i,
                completion=Sample.pack_tokens(tokens),
                seed=c.seed,
                proof=b"".join(pr),
                claimed_reward=float(reward),
            )
        )
    return RolloutBatch(
        run_id=g.run_id,
        worker=worker,
        policy_version=policy.version,
        batch_counter=counter,
        sampling=sp,
        samples=tuple(samples),
        created_ms=now_ms(),
    )


def _other_token(token: int, engine: Any) -> int:
    other = (token + 1) % engine.vocab_size
    while other in engine.eos_token_ids:
        other = (other + 1) % engine.vocab_size
    return other


@dataclasses.dataclass(frozen=True)
class BatchVerdict:
    """A validator's decision on one batch, as data from the point it is decided: accepted
    (with the rules' rewards), or the first rule the batch broke (``rule``: the metrics and
    strike label, e.g. "toploc") and what exactly broke it (``detail``)."""

    accept: bool
    rule: str = ""  # "" when accepted
    detail: str = ""
    rewards: tuple[float, ...] = ()
    seconds: float = 0.0

    @classmethod
    def reject(cls, rule: str, detail: str, seconds: float = 0.0, *, limit: int | None = None) -> BatchVerdict:
        """A rejection; ``limit`` caps the length of :attr:`reason` (the detail is cut to fit)."""
        if limit is not None:
            detail = detail[: max(0, limit - len(rule) - 2)]
        return cls(False, rule, detail, (), seconds)

    @property
    def reason(self) -> str:
        """The reason a Vote carries on the wire: ``"rule: detail"``, or "" when accepted."""
        return f"{self.rule}: {self.detail}" if not self.accept else ""


def check_termination(tokens: Sequence[int], eos_ids: Collection[int], max_tokens: int) -> str | None:
    """Why a completion's end is impossible for an honest sampler (or None): tokens after an
    EOS, or a stop short of ``max_tokens`` without one."""
    for k, t in enumerate(tokens[:-1]):
        if t in eos_ids:
            return f"EOS at position {k} is followed by {len(tokens) - k - 1} more tokens"
    if tokens and tokens[-1] not in eos_ids and len(tokens) < max_tokens:
        return f"stops after {len(tokens)} of {max_tokens} tokens without an EOS"
    return None


def check_batch_rules(
    ctx: RunContext,
    batch: RolloutBatch,
    announcer: str,
    policy: PolicyFacts,
    *,
    vocab_size: int,
    eos_ids: Collection[int],
    hidden_size: int | None = None,
) -> BatchVerdict | None:
    """The rules that need no model (1-5 of the module docstring). Returns None or the
    rejection. ``hidden_size`` None skips the proof-size rule (the caller has no model)."""
    g = ctx.genesis
    if batch.run_id != g.run_id:
        return BatchVerdict.reject("run", "batch belongs to another run")
    if batch.worker != announcer:
        return BatchVerdict.reject("worker", "batch signed for another worker than the one that announced it")
    if batch.sampling != ctx.sampling:
        return BatchVerdict.reject("sampling", f"parameters {batch.sampling} differ from the run's {ctx.sampling}")
    if batch.policy_version != policy.version:
        raise ValueError(f"policy facts of version {policy.version} for a batch of version {batch.policy_version}")
    owed = owed_prompts(ctx, batch.worker, batch.batch_counter)
    expected = [i for i in owed for _ in range(g.group_size)]
    got = [s.prompt_index for s in batch.samples]
    if got != expected:
        return BatchVerdict.reject("prompts", "not the prompts owed at this batch counter")
    max_tokens = ctx.sampling.max_tokens
    for k, s in enumerate(batch.samples):
        toks = s.token_ids()
        if len(toks) > max_tokens:
            return BatchVerdict.reject("tokens", f"sample {k} has {len(toks)} tokens, max {max_tokens}")
        if any(t >= vocab_size for t in toks):
            return BatchVerdict.reject("tokens", f"sample {k} has a token id outside the model's {vocab_size}")
        why = check_termination(toks, eos_ids, max_tokens)
        if why is not None:
            return BatchVerdict.reject("termination", f"sample {k}: {why}")
        if hidden_size is not None:
            prompt_len = len(ctx.prompt_tokens(s.prompt_index))
            if split_proofs(s.proof, prompt_len, len(toks), hidden_size) is None:
                return BatchVerdict.reject(
                    "proof",
                    f"sample {k} carries {len(s.proof)} proof bytes, expected "
                    f"{expected_chunks(prompt_len, len(toks), PROOF)} chunk proofs",
                )
    return None


def verify_batch(
    ctx: RunContext,
    engine: InferenceEngine,
    batch: RolloutBatch,
    announcer: str,
    policy: PolicyFacts,
    *,
    replay_sampling: bool = True,
    on_replay: Callable[[int, ReplayResult], None] | None = None,
) -> BatchVerdict:
    """All the rules. ``engine`` holds the weights of ``batch.policy_version``; ``policy``
    is that version's manifest facts. One prompt's group is prefilled at a time and the
    check stops at the first sample that fails, so a bad batch costs at most one group.
    ``replay_sampling`` False skips rule 7 (only bench/verify.py's baseline does);
    ``on_replay(sample index, result)`` sees every replay (the bench's gap statistics)."""
    t0 = time.perf_counter()

    def reject(rule: str, detail: str) -> BatchVerdict:
        return BatchVerdict.reject(rule, detail, time.perf_counter() - t0, limit=REASON_LIMIT)

    lm_head = engine.lm_head_weight()
    eos_ids = engine.eos_token_ids
    hidden_size = int(lm_head.shape[1])
    broken = check_batch_rules(
        ctx, batch, announcer, policy, vocab_size=engine.vocab_size, eos_ids=eos_ids, hidden_size=hidden_size
    )
    if broken is not None:
        return dataclasses.replace(broken, seconds=time.perf_counter() - t0)
    g = ctx.genesis
    config, replay_config, params = ctx.proof_config, ctx.replay_config, ctx.sampling
    indices = [s.prompt_index for s in batch.samples[:: g.group_size]]
    seeds = [seed for group in owed_seeds(ctx, batch.worker, batch.batch_counter, indices) for seed in group]
    for start in range(0, len(batch.samples), g.group_size):
        members = list(range(start, start + g.group_size))
        pairs = [(ctx.prompt_tokens(batch.samples[k].prompt_index), batch.samples[k].token_ids()) for k in members]
        hiddens = engine.prefill_hidden_batch(pairs)
        for k, (prompt, toks), hidden in zip(members, pairs, hiddens):
            proofs = split_proofs(batch.samples[k].proof, len(prompt), len(toks), hidden_size)
            assert proofs is not None  # sizes checked by check_batch_rules
            try:
                verdict = verify_sequence(hidden, len(prompt), proofs, config)
            except ProofError as exc:
                return reject("proof", f"sample {k}: {exc}")
            if not verdict.ok:
                return reject("toploc", f"sample {k}: {verdict.reason}")
        if not replay_sampling:
            continue
        head_rows = [completion_logits(h, len(p), lm_head) for h, (p, _) in zip(hiddens, pairs)]
        results = replay_many(
            head_rows,
            [t for _, t in pairs],
            [seeds[k] for k in members],
            params,
            replay_config.max_tie_gap,
            relative=replay_config.relative,
        )
        for k, (_, toks), result in zip(members, pairs, results):
            if on_replay is not None:
                on_replay(k, result)
            allowed = replay_config.allowed_near_ties(len(toks))
            if not result.ok(allowed):
                pos = result.first_bad
                if pos < 0:
                    return reject(
                        "sampling",
                        f"sample {k}: {result.near_ties} tokens are not the seeded sample "
                        f"(each within max_tie_gap {replay_config.max_tie_gap:g}; at most {allowed} tolerated)",
                    )
                gap = (
                    f"misses the seeded sample by {result.gaps[pos]:.3g} {replay_config.unit()} "
                    f"(max_tie_gap {replay_config.max_tie_gap:g})"
                )
                if toks[pos] in eos_ids:
                    return reject("termination", f"sample {k}: the EOS at position {pos} was not sampled: {gap}")
                if result.best_tokens[pos] in eos_ids:
                    return reject("termination", f"sample {k}: the model's sample at position {pos} is EOS; {gap}")
                return reject("sampling", f"sample {k}: the token at position {pos} {gap}")
    return dataclasses.replace(check_rewards(ctx, batch), seconds=time.perf_counter() - t0)


def check_rewards(ctx: RunContext, batch: RolloutBatch) -> BatchVerdict:
    """Rule 9: the rules' reward of every sample; a claim that differs is a lie, unless the
    validator's own computation was not deterministic (a code test that timed out may pass
    on a faster machine): then the validator's reward stands and nobody is struck (the
    trainer admits only rewards that a quorum of validators computed alike)."""
    rewards: list[float] = []
    for k, s in enumerate(batch.samples):
        reward, deterministic = ctx.reward_checked(s.prompt_index, s.token_ids())
        if deterministic and abs(s.claimed_reward - reward) > REWARD_TOLERANCE:
            return BatchVerdict.reject(
                "reward", f"sample {k} claims {s.claimed_reward:.4f}, the rules give {reward:.4f}", limit=REASON_LIMIT
            )
        rewards.append(reward)
    return BatchVerdict(True, rewards=tuple(rewards))
