"""The trainer's ledger with validator committees (real SQLite): it admits on a quorum of the
batch's committee, a silent member is replaced after the deadline (the ledger's clock), a lying
or disagreeing member calls on the next validator, and votes from validators the batch has
not reached do not count. Each beside the run it must not change."""

from __future__ import annotations

import sqlite3

from node.roles.ledger import Ledger
from node.util import now_ms

V = ["val-a", "val-b", "val-c", "val-d"]
ORDER = ("val-c", "val-a", "val-d", "val-b")  # the batch's order: committee (c, a), then d, then b
GOOD = [1.0, 0.0]


def ledger(tmp_path, order=ORDER, **kw):
    return Ledger(
        tmp_path / "node.db",
        V,
        2,
        2,
        committee_size=2,
        committee_deadline_s=60.0,
        order_of=lambda worker, version, counter: order,
        **kw,
    )


def batch(lg, batch_id=b"b1", counter=0):
    lg.record_batch(batch_id, "w", 0, counter, 2, b"env")


def test_an_honest_committee_admits_alone_control(tmp_path):
    lg = ledger(tmp_path)
    batch(lg)
    lg.record_vote(b"b1", "val-c", True, "", GOOD, worker="w")
    assert lg.try_admit(b"b1") == "pending"
    lg.record_vote(b"b1", "val-a", True, "", GOOD, worker="w")
    assert lg.try_admit(b"b1") == "admitted"
    assert lg.untrained()[0].rewards == GOOD


def test_a_silent_member_is_replaced_after_the_deadline_by_the_ledgers_clock(tmp_path):
    lg = ledger(tmp_path)
    batch(lg)
    t0 = now_ms()
    lg.record_vote(b"b1", "val-c", True, "", GOOD, worker="w")
    lg.record_vote(b"b1", "val-d", True, "", GOOD, worker="w")  # next in the order, voted early
    assert lg.try_admit(b"b1", now=t0 + 30_000) == "pending"  # d is not called on yet: its vote waits
    assert "committee: 1 accept" in lg.batch(b"b1").reason
    assert lg.try_admit(b"b1", now=t0 + 61_000) == "admitted"  # a's deadline passed: d counts


def test_a_lying_member_delays_an_honest_batch_but_cannot_reject_it(tmp_path):
    lg = ledger(tmp_path)
    batch(lg)
    lg.record_vote(b"b1", "val-c", True, "", GOOD, worker="w")
    lg.record_vote(b"b1", "val-a", False, "toploc: made up", [], worker="w")
    assert lg.try_admit(b"b1") == "pending"
    lg.record_vote(b"b1", "val-d", True, "", GOOD, worker="w")
    assert lg.try_admit(b"b1") == "admitted"


def test_a_lying_member_cannot_admit_a_bad_batch(tmp_path):
    lg = ledger(tmp_path)
    batch(lg)
    lg.record_vote(b"b1", "val-c", False, "toploc: exponent mismatches", [], worker="w")
    lg.record_vote(b"b1", "val-a", True, "", GOOD, worker="w")  # the liar
    assert lg.try_admit(b"b1") == "pending"
    lg.record_vote(b"b1", "val-d", False, "toploc: exponent mismatches", [], worker="w")
    assert lg.try_admit(b"b1") == "rejected"
    assert lg.batch(b"b1").reason == "rejected by validators: toploc: exponent mismatches"


def test_a_committee_whose_rewards_disagree_calls_the_next_and_takes_the_agreeing_pair(tmp_path):
    lg = ledger(tmp_path)
    batch(lg)
    lg.record_vote(b"b1", "val-c", True, "", GOOD, worker="w")
    lg.record_vote(b"b1", "val-a", True, "", [0.0, 0.0], worker="w")
    assert lg.try_admit(b"b1") == "pending"
    lg.record_vote(b"b1", "val-d", True, "", GOOD, worker="w")
    assert lg.try_admit(b"b1") == "admitted"
    assert lg.untrained()[0].rewards == GOOD


def test_colluders_off_the_committee_cannot_admit(tmp_path):
    """d and b accept a bad batch at once; the committee (c, a) rejects it. Control: the same
    votes without committees admit it (two accepts of four, quorum two)."""
    lg = ledger(tmp_path)
    batch(lg)
    for v in ("val-d", "val-b"):
        lg.record_vote(b"b1", v, True, "", GOOD, worker="w")
    assert lg.try_admit(b"b1") == "pending"
    for v in ("val-c", "val-a"):
        lg.record_vote(b"b1", v, False, "reward: claimed 1.0, computed 0.0", [], worker="w")
    assert lg.try_admit(b"b1") == "rejected"
    everyone = Ledger(tmp_path / "all.db", V, 2, 2)
    batch(everyone)
    for v in ("val-d", "val-b"):
        everyone.record_vote(b"b1", v, True, "", GOOD, worker="w")
    assert everyone.try_admit(b"b1") == "admitted"


def test_a_batch_whose_order_is_unknown_is_decided_by_every_validator(tmp_path):
    lg = ledger(tmp_path, order=None)
    batch(lg)
    for v in ("val-d", "val-b"):
        lg.record_vote(b"b1", v, True, "", GOOD, worker="w")
    assert lg.try_admit(b"b1") == "admitted"


def test_a_ledger_from_before_committees_gains_the_seen_column(tmp_path):
    lg = Ledger(tmp_path / "node.db", V, 2, 2)
    lg.db.execute("ALTER TABLE batches DROP COLUMN seen_ms")
    lg.close()
    old = sqlite3.connect(tmp_path / "node.db")
    assert "seen_ms" not in {r[1] for r in old.execute("PRAGMA table_info(batches)")}
    old.close()
    lg = ledger(tmp_path)
    batch(lg)
    lg.record_vote(b"b1", "val-c", True, "", GOOD, worker="w")
    lg.record_vote(b"b1", "val-a", True, "", GOOD, worker="w")
    assert lg.try_admit(b"b1") == "admitted"
