"""The delta chain's decisions as plain functions (node/checkpoints/chain.py): what GC keeps,
removes and releases, with no store or files. ``test_checkpoints_gc.py`` checks the same
through a real ChunkStore on disk."""

from __future__ import annotations

from node.checkpoints.chain import Link, base_chain, gc_plan
from protocol import DeltaRef


def root(v: int) -> bytes:
    return bytes([v]) * 32


def anchor(v: int, **kw) -> Link:
    return Link(version=v, root=root(v), delta=None, **kw)


def delta(v: int, base: int, base_root: bytes | None = None, **kw) -> Link:
    ref = DeltaRef(base_version=base, base_root=base_root or root(base), weights_root=b"w" * 32)
    return Link(version=v, root=root(v), delta=ref, **kw)


def links(*ls: Link) -> dict[int, Link]:
    return {link.version: link for link in ls}


def test_the_chain_under_a_delta_runs_down_to_its_anchor():
    held = links(anchor(0), delta(1, 0), delta(2, 1), anchor(3), delta(4, 3))
    assert base_chain(held, {2}) == {0, 1}
    assert base_chain(held, {4}) == {3}
    assert base_chain(held, {3}) == set()  # an anchor applies to nothing
    assert base_chain(held, {1, 2}) == {0}  # the versions asked about are not their own chain


def test_a_base_held_under_another_root_is_not_the_deltas_base():
    held = links(anchor(0), delta(1, 0, base_root=b"x" * 32))
    assert base_chain(held, {1}) == set()


def test_a_missing_link_ends_the_chain():
    held = links(anchor(0), delta(2, 1))  # version 1 never arrived
    assert base_chain(held, {2}) == set()


def test_gc_keeps_the_window_and_its_chain_and_removes_the_rest_control():
    held = links(anchor(0), delta(1, 0), delta(2, 1), delta(3, 2), anchor(4), delta(5, 4), delta(6, 5))
    plan = gc_plan(held, newest=6, max_async=1, pinned_forever=set())
    assert plan.remove == (0, 1, 2, 3)  # the window (5, 6) stands on anchor 4 alone
    assert plan.release == ()  # nothing assembled yet


def test_gc_keeps_a_pinned_version_its_chain_and_version_0_for_late_joiners():
    held = links(anchor(0), delta(1, 0), anchor(2), delta(3, 2, pinned=True), anchor(4), delta(5, 4))
    plan = gc_plan(held, newest=5, max_async=0, pinned_forever={0})
    assert plan.remove == (1,)  # 3 is pinned (so is its base 2), 0 is kept for joiners


def test_a_kept_base_is_released_once_every_delta_on_it_is_assembled():
    held = links(anchor(0, assembled=True), delta(1, 0, assembled=True), delta(2, 1, assembled=False))
    plan = gc_plan(held, newest=2, max_async=0, pinned_forever=set())
    assert plan.remove == ()
    assert plan.release == (0,)  # 1 is applied; 1 itself waits until 2 is


def test_nothing_in_the_window_pinned_or_kept_forever_is_released():
    held = links(anchor(0, assembled=True), delta(1, 0, assembled=True, pinned=True), delta(2, 1, assembled=True))
    assert gc_plan(held, newest=2, max_async=0, pinned_forever=set()).release == (0,)  # 1 is pinned
    assert gc_plan(held, newest=2, max_async=0, pinned_forever={0}).release == ()  # and 0 kept for joiners
    assert gc_plan(held, newest=2, max_async=2, pinned_forever=set()).release == ()  # all in the window


def test_a_removed_delta_does_not_hold_its_base_assembled():
    # version 2 is a delta on 1 (under another root than 1 has here): not 1's chain, so it is
    # removed with everything else behind the window; 1 stays as the chain of 3
    held = links(
        anchor(0, assembled=True),
        delta(1, 0, assembled=True),
        delta(2, 1, base_root=b"x" * 32, assembled=False),
        delta(3, 1, assembled=True),
    )
    plan = gc_plan(held, newest=3, max_async=0, pinned_forever=set())
    assert plan.remove == (2,)
    assert plan.release == (0, 1)  # 2 (not assembled, removed) does not keep 1 offered
