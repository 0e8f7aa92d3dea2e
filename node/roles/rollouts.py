"""Producing and checking rollout batches: the CPU-heavy core of workers and validators.

Both functions are synchronous (run them with ``trio.to_thread.run_sync``) and
free of network I/O, so they are tested directly and reused by the roles.

A validator accepts a batch only if *all* of these hold, and otherwise names
the first rule that failed in its vote:

1. run, worker and sampling parameters are the run's;
2. the prompts are exactly the ones the deterministic assignment owed the
   worker at (policy version, batch counter), each ``group_size`` times;
3. every completion is well-formed (token ids in the vocabulary, length within
   ``max_tokens``);
4. every TOPLOC proof verifies against the validator's own prefill of prompt +
   claimed tokens with the weights of the claimed policy version, under the
   run's thresholds (``RunContext.proof_config``: the genesis picks them);
5. the rewards the worker claims equal the rules' rewards.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from node.roles.context import RunContext
from node.util import now_ms
from proofs import ProofConfig, ProofError, build_many, verify_sequence
from protocol import RolloutBatch, Sample, assign_prompts, expected_chunks, sample_seed, split_proofs

PROOF = ProofConfig()  # chunking (the wire format); the thresholds come from the run (ctx.proof_config)
REWARD_TOLERANCE = 1e-6
REASON_LIMIT = 250  # characters of a verdict's reason that may echo peer-controlled text


def owed_prompts(ctx: RunContext, worker: str, version: int, counter: int) -> list[int]:
    g = ctx.genesis
    return assign_prompts(g.run_id, worker, version, counter, g.dataset_size, g.prompts_per_batch)


def produce_batch(
    ctx: RunContext,
    engine: Any,
    worker: str,
    version: int,
    counter: int,
    *,
    tamper: str | None = None,
) -> RolloutBatch:
    """Generate the owed prompts' groups with proofs. ``tamper`` exists for the
    adversarial tests: "tokens" (claim other tokens), "prompts" (answer other
    prompts), "rewards" (claim reward 1); "weights" is applied to the engine by the caller."""
    g = ctx.genesis
    indices = owed_prompts(ctx, worker, version, counter)
    if tamper == "prompts":  # answer prompts it was not assigned
        indices = [(i + 1) % g.dataset_size for i in indices]
    prompts = [ctx.prompt_tokens(i) for i in indices]
    seeds = [sample_seed(g.run_id, worker, version, counter, i) for i in indices]
    sp = ctx.sampling
    groups = engine.generate(prompts, g.group_size, sp, seeds, capture_hidden=True)
    flat = [(i, seed, c) for i, seed, group in zip(indices, seeds, groups) for c in group]
    proofs = build_many([(c.hidden, len(c.prompt_tokens)) for _, _, c in flat], PROOF)
    samples = []
    for (i, seed, c), pr in zip(flat, proofs):
        tokens = list(c.tokens)
        reward = ctx.reward(i, tokens)
        if tamper == "tokens":  # claim a continuation it did not generate
            tokens = [(t + 1) % _vocab(ctx) for t in tokens]
        if tamper == "rewards":
            reward = 1.0
        samples.append(
            Sample(
                prompt_index=i,
                completion=Sample.pack_tokens(tokens),
                seed=seed,
                proof=b"".join(pr),
                claimed_reward=float(reward),
            )
        )
    return RolloutBatch(
        run_id=g.run_id,
        worker=worker,
        policy_version=version,
        batch_counter=counter,
        sampling=sp,
        samples=tuple(samples),
        created_ms=now_ms(),
    )


def _vocab(ctx: RunContext) -> int:
    tok = ctx.tokenizer
    return int(getattr(tok, "vocab_size", None) or len(tok))


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


def check_batch_rules(ctx: RunContext, batch: RolloutBatch, announcer: str) -> BatchVerdict | None:
    """Rules 1-3 (cheap, no model). Returns None or the rejection."""
    g = ctx.genesis
    if batch.run_id != g.run_id:
        return BatchVerdict.reject("run", "batch belongs to another run")
    if batch.worker != announcer:
        return BatchVerdict.reject("worker", "batch signed for another worker than the one that announced it")
    if batch.sampling != ctx.sampling:
        return BatchVerdict.reject("sampling", f"parameters {batch.sampling} differ from the run's {ctx.sampling}")
    owed = owed_prompts(ctx, batch.worker, batch.policy_version, batch.batch_counter)
    expected = [i for i in owed for _ in range(g.group_size)]
    got = [s.prompt_index for s in batch.samples]
    if got != expected:
        return BatchVerdict.reject("prompts", "not the prompts owed at this version and counter")
    vocab = _vocab(ctx)
    for k, s in enumerate(batch.samples):
        toks = s.token_ids()
        if len(toks) > ctx.sampling.max_tokens:
            return BatchVerdict.reject("tokens", f"sample {k} has {len(toks)} tokens, max {ctx.sampling.max_tokens}")
        if any(t >= vocab for t in toks):
            return BatchVerdict.reject("tokens", f"sample {k} has a token id outside the vocabulary")
    return None


def verify_batch(
    ctx: RunContext,
    prefill: Callable[[list[tuple[list[int], list[int]]]], list[torch.Tensor]],
    batch: RolloutBatch,
    announcer: str,
) -> BatchVerdict:
    """All five rules. ``prefill`` maps (prompt, completion) pairs to the validator's own
    final hidden states with the weights of ``batch.policy_version``."""
    t0 = time.perf_counter()
    broken = check_batch_rules(ctx, batch, announcer)
    if broken is not None:
        return dataclasses.replace(broken, seconds=time.perf_counter() - t0)
    pairs = [(ctx.prompt_tokens(s.prompt_index), s.token_ids()) for s in batch.samples]
    hiddens = prefill(pairs)
    config = ctx.proof_config
    for k, (s, (prompt, comp), hidden) in enumerate(zip(batch.samples, pairs, hiddens)):
        proofs = split_proofs(s.proof, len(prompt), len(comp), int(hidden.shape[-1]))
        if proofs is None:
            return BatchVerdict.reject(
                "proof",
                f"sample {k} carries {len(s.proof)} proof bytes, expected "
                f"{expected_chunks(len(prompt), len(comp), PROOF)} chunk proofs",
                time.perf_counter() - t0,
            )
        try:
            verdict = verify_sequence(hidden, len(prompt), proofs, config)
        except ProofError as exc:
            return BatchVerdict.reject("proof", f"sample {k}: {exc}", time.perf_counter() - t0)
        if not verdict.ok:
            return BatchVerdict.reject(
                "toploc", f"sample {k}: {verdict.reason}", time.perf_counter() - t0, limit=REASON_LIMIT
            )
    rewards = [ctx.reward(s.prompt_index, toks) for s, (_, toks) in zip(batch.samples, pairs)]
    for k, (s, r) in enumerate(zip(batch.samples, rewards)):
        if abs(s.claimed_reward - r) > REWARD_TOLERANCE:
            return BatchVerdict.reject(
                "reward",
                f"sample {k} claims {s.claimed_reward:.4f}, the rules give {r:.4f}",
                time.perf_counter() - t0,
            )
    return BatchVerdict(True, rewards=tuple(rewards), seconds=time.perf_counter() - t0)
