"""Validator committees: which genesis validators verify a batch, and when its votes decide (pure).

Why: with every validator replaying every batch, a run with four validators does four
times the work of a run with one and verifies no more batches per second. A committee of
``size`` validators, drawn for each batch, makes capacity grow with the number of
validators: each admitted batch costs ``size`` replays, not ``len(validators)``.

Who: :func:`committee_order` ranks *every* genesis validator for one batch slot by a hash
of the slot (run, worker, policy version, batch counter) and the version's manifest root.
The first ``size`` of the order are the batch's committee; the rest are its escalation
order. A worker cannot steer the draw: its counters are used in order (one chain per
worker, ``protocol.rules.counter_gap``), the root of a version is not known before the
trainer publishes it, and its only choice is which version inside the ``max_async`` window
it generates a counter with (docs/security.md, "Committees").

When: :meth:`CommitteeRule.reach` says how many validators of the order are called on.
It starts at ``size`` and grows by one

* for every ``deadline_s`` the batch stays undecided (a dead or slow member is replaced
  by the next validator in the order), and
* whenever every validator called on has voted and their votes still decide nothing (a
  lying member, or members whose rewards disagree: the next validator breaks the tie).

:meth:`CommitteeRule.outcome` decides on the votes of the validators in reach only: a
batch is accepted once ``quorum`` of them accept with rewards that agree
(``protocol.rules.agreeing_validators``), rejected once ``quorum`` of them reject (or
once the validators left could no longer make an agreeing quorum). With ``quorum >= 2``
one validator, dead or lying, delays a batch but can neither admit nor lose it. A vote
from a validator the batch has not reached yet is kept and counts once the batch reaches
it, so colluders outside a committee cannot decide a batch its committee is deciding.

The trainer's ledger and every validator apply the same rule to the votes they have seen;
only the elapsed time differs between them by the gossip delay, which moves *when* a
validator is called on, never what the ledger counts.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Collection, Mapping, Sequence

from protocol.errors import ProtocolError
from protocol.rules import Quorum, agreeing_validators

_DOMAIN = b"primenode/committee/v1"


def committee_seed(run_id: bytes, worker: str, policy_version: int, batch_counter: int, manifest_root: bytes) -> bytes:
    """The value a batch slot's committee is drawn by: every field the slot is named by, and
    the root of the policy version's signed manifest (unknown until the trainer publishes
    the version, so no identity can be ground offline for friendly committees)."""
    h = hashlib.sha256(_DOMAIN)
    for part in (run_id, worker.encode(), manifest_root):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    h.update(policy_version.to_bytes(8, "big"))
    h.update(batch_counter.to_bytes(8, "big"))
    return h.digest()


def committee_order(validators: Collection[str], seed: bytes) -> tuple[str, ...]:
    """Every validator of ``validators``, in the order ``seed`` ranks them: the committee is
    the first ``size``, escalation goes on down the list. Ties cannot occur (distinct ids
    hash apart); the id breaks them anyway, so the order is total."""
    return tuple(sorted(set(validators), key=lambda v: (hashlib.sha256(seed + v.encode()).digest(), v)))


@dataclasses.dataclass(frozen=True)
class Ballot:
    """One validator's vote on one announce, as the committee rule reads it."""

    accept: bool
    rewards: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class Decision:
    """Where a batch's votes stand under :class:`CommitteeRule`."""

    outcome: Quorum
    reach: int  # validators of the order called on
    agreeing: frozenset[str]  # the largest set of accepting validators in reach whose rewards agree
    accepts: frozenset[str]  # validators in reach that accept
    rejects: frozenset[str]  # validators in reach that reject
    unvoted: frozenset[str]  # validators in reach that have not voted


@dataclasses.dataclass(frozen=True)
class CommitteeRule:
    """The committee rule of a run: ``size`` validators per batch (0, or at least the number
    of validators: every validator, the rule of runs before committees), ``quorum`` agreeing
    votes decide, a silent member is replaced after ``deadline_s``, rewards agree within
    ``tolerance`` per sample."""

    size: int
    quorum: int
    deadline_s: float
    tolerance: float

    def everyone(self, validators: int) -> bool:
        """Whether every validator is on every committee (no escalation, the all-validators rule)."""
        return self.size == 0 or self.size >= validators

    def reach(self, order: Sequence[str], votes: Mapping[str, Ballot], elapsed_s: float, num_samples: int) -> int:
        """How many validators of ``order`` are called on, ``elapsed_s`` after the batch was
        announced, given ``votes`` (module docstring)."""
        n = len(order)
        if self.everyone(n):
            return n
        late = int(elapsed_s // self.deadline_s) if self.deadline_s > 0 and elapsed_s > 0 else 0
        r = min(n, self.size + late)
        while r < n:
            called = order[:r]
            if self._decide(called, votes, n, num_samples)[0] is not Quorum.PENDING:
                break
            if any(v not in votes for v in called):
                break  # someone called on has not voted: wait for them (or for the deadline)
            r += 1  # everyone called on voted and nothing is decided: call the next
        return r

    def outcome(
        self, order: Sequence[str], votes: Mapping[str, Ballot], elapsed_s: float, num_samples: int
    ) -> Decision:
        """The decision on ``votes`` of the validators in reach (others' votes wait)."""
        r = self.reach(order, votes, elapsed_s, num_samples)
        called = order[:r]
        outcome, agreeing = self._decide(called, votes, len(order), num_samples)
        return Decision(
            outcome=outcome,
            reach=r,
            agreeing=agreeing,
            accepts=frozenset(v for v in called if v in votes and votes[v].accept),
            rejects=frozenset(v for v in called if v in votes and not votes[v].accept),
            unvoted=frozenset(v for v in called if v not in votes),
        )

    def _decide(
        self, called: Sequence[str], votes: Mapping[str, Ballot], validators: int, num_samples: int
    ) -> tuple[Quorum, frozenset[str]]:
        voted = [v for v in called if v in votes]
        accepted = {v: votes[v].rewards for v in voted if votes[v].accept}
        rejects = len(voted) - len(accepted)
        sized = {v: r for v, r in accepted.items() if len(r) == num_samples}
        agreeing = agreeing_validators(sized, self.tolerance)
        if len(agreeing) >= self.quorum:
            return Quorum.ACCEPTED, agreeing
        if self.rejected_by_votes(rejects, validators):
            return Quorum.REJECTED, agreeing
        if len(agreeing) + validators - len(voted) < self.quorum:
            return Quorum.REJECTED, agreeing  # the validators left could not make an agreeing quorum
        return Quorum.PENDING, agreeing

    def rejected_by_votes(self, rejects: int, validators: int) -> bool:
        """Whether ``rejects`` reject votes (of validators in reach) reject a batch: so many that
        no quorum of accepts is possible (the all-validators rule), or, on a committee, a quorum
        of rejects (with ``quorum >= 2`` no single validator rejects alone)."""
        return rejects > validators - self.quorum or (not self.everyone(validators) and rejects >= self.quorum)


def check_committee(size: int, quorum: int, validators: int) -> None:
    """``ProtocolError("config:committee_size", ...)`` unless a committee of ``size`` can
    reach ``quorum`` (a committee smaller than the quorum could never admit anything)."""
    if size and size < validators and quorum > size:
        raise ProtocolError(
            "config:committee_size",
            f"[config] committee_size {size} is smaller than the quorum {quorum}: a committee could never "
            f"admit a batch; use a committee of at least {quorum} validators or a smaller quorum (run init --quorum)",
        )


def default_committee(validators: int) -> tuple[int, int]:
    """(committee size, quorum) ``run init`` writes when the operator names neither: three
    validators per batch, two of which must agree, once the run has more than three
    validators; every validator and a majority of them otherwise (the same thing). Three is
    the smallest committee where one dead member does not even delay a batch and one lying
    member can neither admit nor reject alone."""
    if validators > 3:
        return 3, 2
    return 0, validators // 2 + 1
