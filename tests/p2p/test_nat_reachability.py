"""How one round of AutoNAT dial-back verdicts moves a node's reachability.

A NAT'd node must be called private at once (it needs relay reservations to be reachable at
all), but a public node must not be demoted by one round whose dial-backs all timed out on a
loaded machine: that stopped its relay service, dropped the reservations of every NAT'd peer
on it and swapped its addresses for circuit ones (seen in tests/system/test_nat_netns.py under a
load average of 19). The netns test runs the whole exchange between real processes.
"""

from __future__ import annotations

from node.p2p.nat import PRIVATE, PUBLIC, UNKNOWN, next_reachability

FAILED = {"a": "failed", "b": "failed"}


def test_first_verdicts_decide_at_once():
    assert next_reachability(UNKNOWN, {"a": "refused", "b": "failed"}, 0, 3) == (PRIVATE, 1)
    assert next_reachability(UNKNOWN, {"a": "refused", "b": "ok"}, 0, 3) == (PUBLIC, 0)
    assert next_reachability(UNKNOWN, {}, 0, 3) == (UNKNOWN, 0)


def test_a_public_node_is_demoted_only_after_rounds_in_a_row_without_success():
    state, misses = PUBLIC, 0
    for _ in range(2):
        state, misses = next_reachability(state, FAILED, misses, 3)
        assert state == PUBLIC
    assert next_reachability(state, FAILED, misses, 3) == (PRIVATE, 3)


def test_a_success_or_silence_between_bad_rounds():
    state, misses = next_reachability(PUBLIC, FAILED, 0, 3)
    state, misses = next_reachability(state, {}, misses, 3)  # nobody answered: nothing learnt
    assert (state, misses) == (PUBLIC, 1)
    state, misses = next_reachability(state, {"a": "ok", "b": "failed"}, misses, 3)
    assert (state, misses) == (PUBLIC, 0)  # the count starts again
    for _ in range(2):
        state, misses = next_reachability(state, FAILED, misses, 3)
    assert state == PUBLIC


def test_a_private_node_becomes_public_on_one_success():
    assert next_reachability(PRIVATE, {"a": "ok"}, 5, 3) == (PUBLIC, 0)
    assert next_reachability(PRIVATE, FAILED, 5, 3) == (PRIVATE, 6)


def test_one_side_of_a_relayed_pair_starts_the_hole_punch_and_the_other_answers():
    """Both sides starting DCUtR at once made their dials collide (errno 99) and no attempt
    succeeded on a loaded machine; the peer ids' order picks one, the other only answers
    until it has waited ``defer_s`` (the peer may be one that never starts)."""
    from node.p2p.nat import drives_hole_punch

    low, high = b"\x00\x24\x08\x01" + b"\x01" * 32, b"\x00\x24\x08\x01" + b"\x02" * 32
    assert drives_hole_punch(low, high, 0.0, 20.0)
    assert not drives_hole_punch(high, low, 0.0, 20.0)  # exactly one of the pair, no message needed
    assert not drives_hole_punch(high, low, 19.9, 20.0)
    assert drives_hole_punch(high, low, 20.0, 20.0)  # the other never started: go ahead
