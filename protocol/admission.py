"""Admission: whether the trainer learns from a batch, as one pure function of what is known
about it (no database, no clock: the trainer's ledger gathers the facts and applies the
ruling, node/roles/ledger.py).

The order of the checks is the rule:

1. **staleness**: a batch more than ``max_async`` versions behind the trainer is refused,
   whatever its votes (``rules.is_stale``);
2. **the votes**, under the run's committee rule (``committee.CommitteeRule``): refused by a
   quorum of rejects (or so many that no quorum of accepts remains), refused when the
   validators left could not make a quorum whose rewards agree, pending while votes are
   missing or disagree;
3. **the worker's chain** (``rules.counter_gap``): a later counter waits for the worker's batch
   at the gap, so a worker that drops a batch it computed has nothing after it trained;
4. **no going back** (``rules.version_regression``): a counter made with an older version than
   the worker's previous counter is refused;
5. **the bytes**: a batch accepted while its bytes were evicted waits for them (the trainer
   fetches them again);
6. **one batch per slot**: a batch whose (worker, counter) slot was admitted before, under
   another id, is refused;
7. otherwise admitted, with the median of the agreeing validators' rewards per sample.

Then which admitted batches a trainer step takes (:func:`select_for_step`): oldest policy first,
up to the step's token budget and batch cap, setting aside those whose generating weights are
gone.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence

from .committee import CommitteeRule, Decision
from .rules import Quorum, counter_gap, is_stale, version_regression


@dataclasses.dataclass(frozen=True)
class Ruling:
    """What admission decided. ``status``: pending, admitted or rejected; ``why``: one word
    for the rule that decided (stale, votes, disagreement, disagreeing, committee, chain,
    regression, bytes, slot, admitted); ``reason``: words for the operator (``primenode
    status``), or for a pending batch the note of why it waits; ``rewards``: the admitted
    batch's rewards per sample."""

    status: str
    why: str
    reason: str = ""
    rewards: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class BatchFacts:
    """One pending batch as the ledger holds it, and the trainer's state around it."""

    worker: str
    version: int
    counter: int
    num_samples: int
    policy_version: int  # the trainer's
    max_async: int
    chain_head: int  # the worker's counters 0 .. chain_head - 1 are all recorded
    previous_version: int | None  # newest version of the worker's batches at counter - 1
    have_bytes: bool  # the batch's envelope is held (not evicted)
    slot_holder: bytes | None  # another batch admitted at this worker's counter, if any


def admission(
    facts: BatchFacts,
    decision: Decision,
    rule: CommitteeRule,
    validators: int,
    accept_rewards: Mapping[str, Sequence[float]],
    first_reject_reason: str = "",
    committees: bool = False,
) -> Ruling:
    """The ruling on one pending batch (module docstring). ``decision``: its votes under
    ``rule``; ``accept_rewards``: each accepting validator's rewards; ``first_reject_reason``:
    the reason of the earliest reject vote of a validator in reach (quoted when the votes
    refuse the batch); ``committees``: the run draws committees (a pending batch says how far
    its committee got)."""
    if is_stale(facts.version, facts.policy_version, facts.max_async):
        return Ruling(
            "rejected",
            "stale",
            f"stale: policy version {facts.version}, trainer at {facts.policy_version}, max_async {facts.max_async}",
        )
    if decision.outcome is Quorum.REJECTED:
        if rule.rejected_by_votes(len(decision.rejects), validators):
            return Ruling("rejected", "votes", f"rejected by validators: {first_reject_reason}")
        return Ruling("rejected", "disagreement")
    if decision.outcome is Quorum.PENDING:
        if len(decision.accepts) >= rule.quorum:  # a quorum accepts, but on different rewards
            return Ruling("pending", "disagreeing")
        if committees:
            return Ruling(
                "pending",
                "committee",
                f"committee: {len(decision.accepts)} accept, {len(decision.rejects)} reject "
                f"of {decision.reach} called on",
            )
        return Ruling("pending", "votes")
    gap = counter_gap(facts.counter, facts.chain_head)
    if gap is not None:
        return Ruling("pending", "chain", f"waiting for the worker's batch counter {gap}")
    if facts.previous_version is not None and version_regression(facts.previous_version, facts.version):
        return Ruling(
            "rejected",
            "regression",
            f"version regression: batch counter {facts.counter} at policy version {facts.version}, "
            f"counter {facts.counter - 1} at {facts.previous_version} (a worker's chain never goes back "
            "to an older version)",
        )
    if not facts.have_bytes:
        return Ruling("pending", "bytes")
    if facts.slot_holder is not None:
        return Ruling(
            "rejected",
            "slot",
            f"duplicate slot: batch {facts.slot_holder.hex()} holds this worker's batch counter "
            f"{facts.counter} and was admitted",
        )
    agreeing = sorted(decision.agreeing)
    rewards = tuple(statistics.median(col) for col in zip(*(accept_rewards[v] for v in agreeing), strict=True))
    return Ruling("admitted", "admitted", rewards=rewards)


@dataclasses.dataclass(frozen=True)
class StepCandidate:
    """An admitted, untrained batch as the trainer's step sees it: its id, the policy version
    that generated it, its tokens (prompts and completions), and whether that version's
    weights are still held (needed for the importance ratios)."""

    batch_id: bytes
    policy_version: int
    tokens: int
    weights_held: bool


@dataclasses.dataclass(frozen=True)
class StepSelection:
    """What one trainer step trains on (``chosen``, in order, with their ``tokens``) and which
    batches can never be trained (``unusable``: their generating weights are gone)."""

    chosen: tuple[bytes, ...]
    tokens: int
    unusable: tuple[bytes, ...]


def select_for_step(candidates: Iterable[StepCandidate], token_budget: int, max_batches: int = 0) -> StepSelection:
    """The step's batches from the admitted, untrained ones, taken in the order given (the
    ledger's: oldest policy first): every one that fits in ``token_budget`` (the first always
    does, however large, so a big batch cannot stall training), at most ``max_batches`` (0: no
    cap). The step stops at the first batch that does not fit rather than skipping ahead: a
    later small batch must not overtake an older one forever. A batch whose weights are gone
    is set aside (``unusable``) and does not count. ``candidates`` is read lazily, up to the
    first batch that does not fit, so a caller may compute tokens as it goes."""
    chosen: list[bytes] = []
    unusable: list[bytes] = []
    tokens = 0
    for c in candidates:
        if not c.weights_held:
            unusable.append(c.batch_id)
            continue
        if chosen and tokens + c.tokens > token_budget:
            break
        if max_batches and len(chosen) >= max_batches:
            break
        chosen.append(c.batch_id)
        tokens += c.tokens
    return StepSelection(tuple(chosen), tokens, tuple(unusable))
