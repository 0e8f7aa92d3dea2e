"""Rules every role applies alike, as pure functions of genesis values.

A worker, a validator, the trainer and the checkpoint store must agree exactly
on which policy versions are still usable, on when validators' votes decide
a batch and on how many batch slots a worker has; writing the comparison once keeps them from drifting apart by one.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Collection, Mapping, Sequence


def window_floor(newest: int, max_async: int) -> int:
    """The oldest policy version still inside the ``max_async`` window of ``newest``."""
    return newest - max_async


def within_window(version: int, newest: int, max_async: int) -> bool:
    """True when rollouts of policy ``version`` may still be used while ``newest`` is current:
    at most ``max_async`` versions behind, never ahead (INTELLECT-2's two-step asynchrony)."""
    return window_floor(newest, max_async) <= version <= newest


def is_stale(version: int, newest: int, max_async: int) -> bool:
    """True when ``version`` fell behind the window (a version *ahead* of ``newest`` is not stale:
    the node may simply not have seen that checkpoint yet)."""
    return version < window_floor(newest, max_async)


class Quorum(enum.Enum):
    """Where the genesis validators' votes on one batch stand."""

    PENDING = "pending"  # neither outcome is decided yet
    ACCEPTED = "accepted"  # at least ``quorum`` distinct genesis validators accept
    REJECTED = "rejected"  # so many reject that ``quorum`` accepts can no longer happen


def quorum_outcome(
    accepts: Collection[str], rejects: Collection[str], validators: Collection[str], quorum: int
) -> Quorum:
    """The outcome of the votes of ``accepts`` and ``rejects`` (peer ids); votes of peers that are
    not genesis ``validators`` do not count. With ``quorum == len(validators)`` one reject decides."""
    members = set(validators)
    yes = len(set(accepts) & members)
    no = len(set(rejects) & members)
    if yes >= quorum:
        return Quorum.ACCEPTED
    if no > len(members) - quorum:
        return Quorum.REJECTED
    return Quorum.PENDING


def counter_gap(counter: int, head: int) -> int | None:
    """The counter batch ``counter`` waits for, or None. ``head`` is the length of the run of
    the worker's counters the ledger holds a batch for from 0 (0 .. head-1 all held, whatever
    each batch's version or outcome).

    A worker's batches form one chain over the run: counters 0, 1, 2, ... in order, each made
    with any policy version inside the window, none skipped. A batch is trained only once
    every lower counter was announced and fetched, so a worker that computes several batches
    and announces only the best cannot have anything trained after the one it dropped, ever
    (docs/security.md, "Choosing among slots"). Its prompts and seeds hash the counter alone
    (``protocol.assign_prompts``, ``protocol.sample_seed``): computing one counter with two
    versions is the only choice left, and it is between two policies on the same noise."""
    return head if counter > head else None


def version_regression(previous: int, version: int) -> bool:
    """Whether a batch at ``version`` goes back behind the version of the worker's previous
    counter (``previous``): a chain never does (the worker swaps a newer version in between
    batches and never an older one), so a worker that holds several versions cannot go back
    to an older one for a batch that looks better with it."""
    return version < previous


def agreeing_validators(rewards: Mapping[str, Sequence[float]], tolerance: float) -> frozenset[str]:
    """The largest set of validators (keys of ``rewards``) whose reward vectors agree: every two
    members' vectors have the same length and differ by at most ``tolerance`` (absolute) on every
    sample. Empty when ``rewards`` is. Among equally large sets, the one whose sorted member list
    sorts first (so every caller picks the same). A vector holding a NaN or an infinity agrees
    with nothing.

    Pairwise, not "near the median": any two members are at most ``tolerance`` apart, so no
    outlier drags the agreed rewards. With a majority quorum two agreeing quorums share a
    member, so their rewards are within ``2 * tolerance`` of each other. The search is exact
    (maximal cliques, with pivoting); identical vectors (validators that computed the same
    rewards) are compared once, so the usual case costs one pass over each distinct vector."""
    if not tolerance >= 0:  # refuses NaN too
        raise ValueError(f"reward agreement tolerance must be >= 0, got {tolerance!r}")
    within = float(tolerance).__ge__
    holders: dict[tuple[float, ...], list[str]] = {}  # distinct finite vector -> its validators
    for validator, vector in rewards.items():
        values = tuple(vector)
        if all(map(math.isfinite, values)):
            holders.setdefault(values, []).append(validator)
    distinct = list(holders)
    near = {v: set(holders[x]) - {v} for x in distinct for v in holders[x]}  # whom each one agrees with
    for i, x in enumerate(distinct):
        for y in distinct[i + 1 :]:
            if len(x) == len(y) and all(map(within, map(abs, map(operator.sub, x, y)))):
                for v in holders[x]:
                    near[v].update(holders[y])
                for v in holders[y]:
                    near[v].update(holders[x])
    best: list[str] = []

    def expand(chosen: list[str], candidates: frozenset[str], excluded: frozenset[str]) -> None:
        nonlocal best
        if len(chosen) + len(candidates) < len(best):
            return  # cannot reach the size of the best set found so far
        if not candidates:
            found = sorted(chosen)
            if not excluded and (len(found), best) > (len(best), found):  # larger, or as large and sorts first
                best = found
            return
        pivot = max(sorted(candidates | excluded), key=lambda u: len(near[u] & candidates))
        for v in sorted(candidates - near[pivot]):
            expand([*chosen, v], candidates & near[v], excluded & near[v])
            candidates = candidates - {v}
            excluded = excluded | {v}

    expand([], frozenset(near), frozenset())
    return frozenset(best)
