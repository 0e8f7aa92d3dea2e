"""The trainer's ledger: quorum admission, staleness, no duplicates, crash recovery (real SQLite files)."""

from __future__ import annotations

from node.roles.ledger import Ledger

V = ["val-a", "val-b", "val-c"]


def ledger(tmp_path, quorum=2, max_async=2):
    return Ledger(tmp_path / "node.db", V, quorum, max_async)


def test_admits_only_with_quorum_of_genesis_validators(tmp_path):
    lg = ledger(tmp_path)
    lg.record_batch(b"b1", "w", 0, 0, 2, b"env")
    assert lg.record_vote(b"b1", "val-a", True, "", [1.0, 0.0])
    assert not lg.record_vote(b"b1", "impostor", True, "", [1.0, 0.0])
    assert lg.try_admit(b"b1") == "pending"
    lg.record_vote(b"b1", "val-a", True, "", [1.0, 0.0])  # the same validator twice counts once
    assert lg.try_admit(b"b1") == "pending"
    lg.record_vote(b"b1", "val-b", True, "", [0.0, 0.0])
    assert lg.try_admit(b"b1") == "admitted"
    [batch] = lg.untrained()
    assert batch.rewards == [0.5, 0.0]
    assert lg.accept_voters(b"b1") == {"val-a", "val-b"}


def test_needs_the_batch_bytes(tmp_path):
    lg = ledger(tmp_path)
    lg.record_batch(b"b1", "w", 0, 0, 1, None)
    for v in V[:2]:
        lg.record_vote(b"b1", v, True, "", [1.0])
    assert lg.try_admit(b"b1") == "pending"
    lg.record_batch(b"b1", "w", 0, 0, 1, b"env")
    assert lg.try_admit(b"b1") == "admitted"


def test_rejected_when_quorum_becomes_impossible(tmp_path):
    lg = ledger(tmp_path)
    lg.record_batch(b"b1", "w", 0, 0, 1, b"env")
    lg.record_vote(b"b1", "val-a", False, "toploc: exponent mismatches", [])
    assert lg.try_admit(b"b1") == "pending"
    lg.record_vote(b"b1", "val-b", False, "toploc", [])
    assert lg.try_admit(b"b1") == "rejected"
    lg.record_vote(b"b1", "val-c", True, "", [1.0])
    assert lg.try_admit(b"b1") == "rejected"
    assert lg.untrained() == []


def test_stale_batches_are_refused(tmp_path):
    lg = ledger(tmp_path, max_async=2)
    lg.commit_checkpoint(step=5, policy_version=5)
    lg.record_batch(b"old", "w", 2, 0, 1, b"env")
    lg.record_batch(b"ok", "w", 3, 0, 1, b"env")
    for b in (b"old", b"ok"):
        for v in V[:2]:
            lg.record_vote(b, v, True, "", [1.0])
    assert lg.try_admit(b"old") == "rejected"
    assert lg.try_admit(b"ok") == "admitted"


def test_one_admission_per_slot(tmp_path):
    lg = ledger(tmp_path)
    for b in (b"x", b"y"):
        lg.record_batch(b, "w", 0, 7, 1, b"env-" + b)
        for v in V[:2]:
            lg.record_vote(b, v, True, "", [1.0])
    assert lg.try_admit(b"x") == "admitted"
    assert lg.try_admit(b"y") == "rejected"


def test_crash_recovery_loses_nothing_admitted(tmp_path):
    lg = ledger(tmp_path)
    for i in range(4):
        b = bytes([i])
        lg.record_batch(b, "w", 0, i, 1, b"env")
        for v in V[:2]:
            lg.record_vote(b, v, True, "", [float(i)])
        assert lg.try_admit(b) == "admitted"
    lg.mark_trained([b"\x00", b"\x01"], step=1)
    lg.commit_checkpoint(step=1, policy_version=1)
    lg.mark_trained([b"\x02", b"\x03"], step=2)  # step 2 trained but its checkpoint never landed
    lg.db.close()  # "kill -9": nothing more is written

    again = ledger(tmp_path)
    assert again.admitted_ids() == {bytes([i]) for i in range(4)}
    assert again.recover() == 2
    assert {b.batch_id for b in again.untrained()} == {b"\x02", b"\x03"}
    assert again.policy_version == 1
