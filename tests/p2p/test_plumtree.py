"""Plumtree's rules as plain calls with explicit times (node/p2p/plumtree.py): links, pruning,
IHAVE, GRAFT, the bounded tables. ``test_p2p_gossip_tree.py`` and ``test_peer_shares.py``
check the same through real hosts; these pin each rule alone, with no sockets or clock."""

from __future__ import annotations

from node.p2p.plumtree import MIN_EAGER, PRUNE_AFTER, Plumtree, Send
from protocol import gossip as frames
from protocol.gossip import GRAFT, IHAVE, PRUNE, Control


def mid(i: int) -> bytes:
    return i.to_bytes(32, "big")


def frame(i: int) -> bytes:
    return frames.encode_message("t", b"message %d" % i)


def control(send: Send) -> Control:
    decoded = frames.decode_frame(send.frame)
    assert isinstance(decoded, Control), decoded
    return decoded


def tree_with(*peers: str, **kw) -> Plumtree:
    t = Plumtree(**kw)
    for p in peers:
        t.add_link(p)
    return t


def test_a_new_message_goes_to_eager_peers_and_its_id_to_lazy_ones():
    t = tree_with("a", "b", "c")
    t.make_lazy("c")
    sends = t.publish(mid(1), frame(1), now=0.0)
    assert sorted(s.peer for s in sends) == ["a", "b"] and all(s.frame == frame(1) for s in sends)
    assert t.ihave_out == {"c": [mid(1)]}
    (ihave,) = t.flush_ihave()
    assert ihave.peer == "c" and control(ihave) == (IHAVE, [mid(1)])
    assert t.flush_ihave() == []  # sent once


def test_a_relayed_message_skips_its_forwarder_and_its_origin_and_keeps_the_forwarder_eager():
    t = tree_with("fwd", "origin", "x")
    t.make_lazy("fwd")
    t.mark_seen(mid(1), 0.0)
    sends = t.deliver("fwd", "origin", mid(1), frame(1), now=0.0)
    assert [s.peer for s in sends] == ["x"]
    assert "fwd" in t.eager  # the path that delivered first stays in the tree


def test_duplicates_prune_an_eager_link_only_after_a_streak_and_never_below_min_eager():
    t = tree_with("a", "b", "c")
    for _ in range(PRUNE_AFTER - 1):
        assert t.duplicate("a") == []
    (prune,) = t.duplicate("a")
    assert prune.peer == "a" and control(prune) == (PRUNE, [])
    assert "a" in t.lazy and t.counters["prune_sent"] == 1
    assert len(t.eager) == MIN_EAGER
    for _ in range(3 * PRUNE_AFTER):  # at the floor: duplicates are counted, nothing is pruned
        assert t.duplicate("b") == []
    assert t.eager == {"b", "c"} and t.duplicates == PRUNE_AFTER + 3 * PRUNE_AFTER


def test_a_delivery_between_duplicates_resets_the_streak():
    t = tree_with("a", "b", "c")
    t.duplicate("a")
    t.duplicate("a")
    t.mark_seen(mid(1), 0.0)
    t.deliver("a", "o", mid(1), frame(1), 0.0)
    t.duplicate("a")
    t.duplicate("a")
    assert "a" in t.eager  # two in a row, not three


def test_prune_and_graft_received_move_the_link():
    t = tree_with("a")
    t.on_prune("a")
    assert "a" in t.lazy
    t.on_graft("a", [])
    assert "a" in t.eager


def test_a_missing_id_is_grafted_after_the_timeout_then_from_the_next_announcer():
    t = tree_with("a", "b", graft_timeout_s=0.25)
    t.make_lazy("a")
    t.make_lazy("b")
    t.on_ihave("a", [mid(7)], now=10.0)
    t.on_ihave("b", [mid(7)], now=10.1)
    assert t.due_grafts(10.2) == []  # not yet
    (g1,) = t.due_grafts(10.25)
    assert g1.peer == "a" and control(g1) == (GRAFT, [mid(7)]) and "a" in t.eager
    assert t.due_grafts(10.4) == []
    (g2,) = t.due_grafts(10.5)
    assert g2.peer == "b"
    assert t.due_grafts(10.75) == [] and mid(7) not in t.missing  # nobody left to ask


def test_an_id_that_arrives_before_its_graft_is_not_asked_for():
    t = tree_with("a")
    t.on_ihave("a", [mid(1)], now=0.0)
    t.mark_seen(mid(1), 0.1)
    t.deliver("b", "o", mid(1), frame(1), 0.1)
    assert t.due_grafts(5.0) == [] and not t.missing


def test_an_announcer_whose_link_went_is_skipped():
    t = tree_with("a", "b")
    t.on_ihave("a", [mid(1)], 0.0)
    t.on_ihave("b", [mid(1)], 0.0)
    t.remove_link("a")
    (g,) = t.due_grafts(1.0)
    assert g.peer == "b"


def test_a_graft_is_answered_from_the_cache():
    t = tree_with("a", "b")
    t.publish(mid(1), frame(1), 0.0)
    sends = t.on_graft("b", [mid(1), mid(2)])
    assert sends == [Send("b", frame(1))] and t.counters["graft_served"] == 1


def test_ihave_of_an_id_already_seen_is_ignored():
    t = tree_with("a")
    t.mark_seen(mid(1), 0.0)
    t.on_ihave("a", [mid(1)], 0.0)
    assert not t.missing


def test_one_announcer_holds_at_most_its_share_of_the_missing_ids():
    t = tree_with("liar", "honest", missing_capacity=200, missing_per_peer=50)
    t.on_ihave("liar", [mid(i) for i in range(1000)], 0.0)
    assert t.missing_by["liar"] == 50 and t.counters["ihave_over_share"] == 950
    t.on_ihave("honest", [mid(5000)], 0.0)
    assert mid(5000) in t.missing  # the honest id still gets in
    t.on_ihave("honest", [mid(3)], 0.0)
    assert t.missing[mid(3)].announcers == ["liar", "honest"]  # a second announcer of a held id


def test_the_missing_table_is_bounded_oldest_first():
    t = tree_with(*[f"p{i}" for i in range(10)], missing_capacity=20, missing_per_peer=5)
    for i in range(10):
        t.on_ihave(f"p{i}", [mid(100 * i + j) for j in range(5)], 0.0)
    assert len(t.missing) == 20 and mid(0) not in t.missing and mid(904) in t.missing
    assert sum(t.missing_by.values()) == 20


def test_a_forwarders_flood_cycles_only_its_share_of_the_cache():
    t = tree_with("flood", "honest", cache_capacity=40)  # a share of 10
    t.mark_seen(mid(0), 0.0)
    t.deliver("honest", "o", mid(0), frame(0), 0.0)
    for i in range(1, 200):
        t.mark_seen(mid(i), 0.0)
        t.deliver("flood", "o", mid(i), frame(i), 0.0)
    assert len(t.cache_by["flood"].ids) == 10
    assert mid(0) in t.cache and t.counters["cache_over_share"] == 189


def test_the_cache_is_bounded_by_bytes_and_age():
    t = tree_with("a", cache_max_bytes=4000, cache_ttl_s=120.0)
    for i in range(100):
        t.publish(mid(i), frame(i) + b"x" * 100, float(i))
    assert 0 < t.cache_bytes <= 4000
    t.publish(mid(500), frame(500), 1000.0)  # everything older than 120 s goes
    assert list(t.cache) == [mid(500)]


def test_ids_seen_are_forgotten_by_count_and_age():
    t = Plumtree(seen_capacity=3, seen_ttl_s=10.0)
    for i in range(5):
        t.mark_seen(mid(i), float(i))
    assert list(t.seen) == [mid(2), mid(3), mid(4)]
    t.mark_seen(mid(9), 13.5)  # 2 and 3 are older than 10 s by now
    assert list(t.seen) == [mid(4), mid(9)]


def test_a_muted_peer_gets_no_ids_and_a_removed_link_is_forgotten():
    t = tree_with("foreign", "b")
    t.publish(mid(1), frame(1), 0.0)
    t.make_lazy("b")
    t.publish(mid(2), frame(2), 0.0)
    t.mute("foreign")
    assert "foreign" in t.lazy and "foreign" not in t.ihave_out
    t.remove_link("b")
    assert not t.linked("b") and "b" not in t.ihave_out
    t.make_eager("b")  # no link, no state
    assert not t.linked("b")
