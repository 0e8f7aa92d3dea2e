"""The trainer's ledger: quorum admission, staleness, no duplicates, crash recovery (real SQLite files)."""

from __future__ import annotations

import trio
import trio.lowlevel
import trio.testing

from harness.messages import signed_batch
from node.roles import ledger as ledger_module
from node.roles.ledger import Ledger
from node.util import now_ms

V = ["val-a", "val-b", "val-c"]


def ledger(tmp_path, quorum=2, max_async=2, **kw):
    return Ledger(tmp_path / "node.db", V, quorum, max_async, **kw)


def test_admits_only_with_quorum_of_genesis_validators(tmp_path):
    lg = ledger(tmp_path)
    lg.record_batch(b"b1", "w", 0, 0, 2, b"env")
    assert lg.record_vote(b"b1", "val-a", True, "", [1.0, 0.0], worker="w")
    assert not lg.record_vote(b"b1", "impostor", True, "", [1.0, 0.0], worker="w")
    assert lg.try_admit(b"b1") == "pending"
    lg.record_vote(b"b1", "val-a", True, "", [1.0, 0.0], worker="w")  # the same validator twice counts once
    assert lg.try_admit(b"b1") == "pending"
    lg.record_vote(b"b1", "val-b", True, "", [1.0, 0.0], worker="w")  # the same rewards (see the agreement tests)
    assert lg.try_admit(b"b1") == "admitted"
    [batch] = lg.untrained()
    assert batch.rewards == [1.0, 0.0]
    assert lg.accept_voters(b"b1") == {"val-a", "val-b"}


def test_needs_the_batch_bytes(tmp_path):
    lg = ledger(tmp_path)
    lg.record_batch(b"b1", "w", 0, 0, 1, None)
    for v in V[:2]:
        lg.record_vote(b"b1", v, True, "", [1.0], worker="w")
    assert lg.try_admit(b"b1") == "pending"
    lg.record_batch(b"b1", "w", 0, 0, 1, b"env")
    assert lg.try_admit(b"b1") == "admitted"


def test_rejected_when_quorum_becomes_impossible(tmp_path):
    lg = ledger(tmp_path)
    lg.record_batch(b"b1", "w", 0, 0, 1, b"env")
    lg.record_vote(b"b1", "val-a", False, "toploc: exponent mismatches", [], worker="w")
    assert lg.try_admit(b"b1") == "pending"
    lg.record_vote(b"b1", "val-b", False, "toploc", [], worker="w")
    assert lg.try_admit(b"b1") == "rejected"
    lg.record_vote(b"b1", "val-c", True, "", [1.0], worker="w")
    assert lg.try_admit(b"b1") == "rejected"
    assert lg.untrained() == []


def test_stale_batches_are_refused(tmp_path):
    lg = ledger(tmp_path, max_async=2)
    lg.commit_checkpoint(step=5, policy_version=5)
    lg.record_batch(b"old", "w", 2, 0, 1, b"env")
    lg.record_batch(b"ok", "w", 3, 0, 1, b"env")
    for b in (b"old", b"ok"):
        for v in V[:2]:
            lg.record_vote(b, v, True, "", [1.0], worker="w")
    assert lg.try_admit(b"old") == "rejected"
    assert lg.try_admit(b"ok") == "admitted"


def test_one_admission_per_slot(tmp_path):
    lg = ledger(tmp_path)
    for b in (b"x", b"y"):
        lg.record_batch(b, "w", 0, 0, 1, b"env-" + b)
        for v in V[:2]:
            lg.record_vote(b, v, True, "", [1.0], worker="w")
    assert lg.try_admit(b"x") == "admitted"
    assert lg.try_admit(b"y") == "rejected"


def test_crash_recovery_loses_nothing_admitted(tmp_path):
    lg = ledger(tmp_path)
    for i in range(4):
        b = bytes([i])
        lg.record_batch(b, "w", 0, i, 1, b"env")
        for v in V[:2]:
            lg.record_vote(b, v, True, "", [float(i)], worker="w")
        assert lg.try_admit(b) == "admitted"
    lg.mark_trained([b"\x00", b"\x01"], step=1)
    lg.commit_checkpoint(step=1, policy_version=1)
    lg.mark_trained([b"\x02", b"\x03"], step=2)  # step 2 trained but its checkpoint never landed
    lg.close()  # "kill -9": nothing more is written

    again = ledger(tmp_path)
    assert again.admitted_ids() == {bytes([i]) for i in range(4)}
    assert again.recover() == 2
    assert {b.batch_id for b in again.untrained()} == {b"\x02", b"\x03"}
    assert again.policy_version == 1


# ------------------------------------------------------------------ retention


def stored_bytes(lg, batch_ids) -> int:
    """Envelope bytes the ledger holds for ``batch_ids`` (the test's every batch)."""
    records = [lg.batch(b) for b in batch_ids]
    return sum(len(r.envelope) for r in records if r is not None and r.envelope is not None)


def rows_total(lg) -> int:
    """Batches the ledger holds a row for, whatever their status."""
    c = lg.counts()
    return c["pending"] + c["admitted"] + c["rejected"]


def test_rejected_batches_lose_their_bytes_but_keep_their_record(tmp_path):
    lg = ledger(tmp_path)
    lg.record_batch(b"bad", "w", 0, 0, 1, b"x" * 1000)
    for v in V[:2]:
        lg.record_vote(b"bad", v, False, "toploc: exponent mismatches", [], worker="w")
    assert lg.try_admit(b"bad") == "rejected"
    rec = lg.batch(b"bad")
    assert (rec.worker, rec.status, rec.envelope) == ("w", "rejected", None) and "toploc" in rec.reason
    assert len(lg.votes(b"bad")) == 2
    # fetched and recorded again (re-announced): a decided batch takes no bytes
    lg.record_batch(b"bad", "w", 0, 0, 1, b"x" * 1000)
    assert stored_bytes(lg, [b"bad"]) == 0 and not lg.needs_fetch(b"bad")
    # a duplicate slot: the second batch's bytes go too; the admitted one keeps its bytes
    for b in (b"x", b"y"):
        lg.record_batch(b, "w", 1, 0, 1, b"env-" + b)
        for v in V[:2]:
            lg.record_vote(b, v, True, "", [1.0], worker="w")
    assert [lg.try_admit(b) for b in (b"x", b"y")] == ["admitted", "rejected"]
    assert lg.batch(b"y").envelope is None
    assert [b.envelope for b in lg.untrained()] == [b"env-x"]


def test_pending_bytes_are_capped_unvouched_oldest_first_and_an_evicted_batch_is_wanted_again(tmp_path):
    lg = Ledger(tmp_path / "node.db", V, 2, 2, max_pending=3, max_pending_bytes=10_000)
    lg.record_batch(b"old", "honest", 0, 0, 1, b"o" * 100)
    lg.record_batch(b"vouched", "honest", 0, 1, 1, b"v" * 100)
    lg.record_vote(b"vouched", "val-a", True, "", [1.0], worker="honest")  # one accept: not yet a quorum
    for i in range(20):  # fresh identities, batches nobody votes for
        lg.record_batch(b"flood%d" % i, f"fresh-{i}", 0, 0, 1, b"f" * 100)
        s = lg.storage()
        assert s["pending_with_bytes"] <= 3 and s["pending_bytes"] <= 10_000
    ids = [b"old", b"vouched", *(b"flood%d" % i for i in range(20))]
    held = {b for b in ids if lg.batch(b).envelope is not None}
    assert held == {b"vouched", b"flood18", b"flood19"}  # the vouched one outlived every unvouched one
    assert lg.evicted == 20 - 2 + 1
    # the byte cap, too
    small = Ledger(tmp_path / "small.db", V, 2, 2, max_pending=100, max_pending_bytes=250)
    for i in range(10):
        small.record_batch(b"b%d" % i, "w", 0, i, 1, b"z" * 100)
        assert small.storage()["pending_bytes"] <= 250
    # an evicted batch stays pending; once a quorum accepts it, its bytes are wanted again
    assert lg.bytes_wanted(b"old") is None
    assert lg.needs_fetch(b"old")
    for v in V[:2]:
        lg.record_vote(b"old", v, True, "", [0.5], worker="honest")
    assert lg.try_admit(b"old") == "pending"
    assert lg.bytes_wanted(b"old") == ("honest", 0, 0, 1)
    lg.record_batch(b"old", "honest", 0, 0, 1, b"o" * 100)  # fetched again
    assert lg.try_admit(b"old") == "admitted"
    assert [b.envelope for b in lg.untrained()] == [b"o" * 100]


def test_prune_rejects_stale_pending_caps_metadata_and_never_touches_admitted(tmp_path, monkeypatch):
    lg = Ledger(tmp_path / "node.db", V, 2, 1, max_unadmitted_rows=10, orphan_vote_ttl_s=60)
    for i in range(6):  # admitted batches at versions 0..5: one trained, one aged out, the rest waiting
        b = b"adm%d" % i
        lg.record_batch(b, "w", i, i, 1, b"A" * 50)
        for v in V[:2]:
            lg.record_vote(b, v, True, "", [1.0], worker="w")
        assert lg.try_admit(b) == "admitted"
    lg.mark_trained([b"adm5"], step=1)
    for i in range(30):  # rejected batches (their votes kept), then pending ones, old and new
        b = b"rej%02d" % i
        lg.record_batch(b, f"fresh-{i}", 5, 0, 1, b"R" * 50)
        for v in V[:2]:
            lg.record_vote(b, v, False, "assignment", [], worker=f"fresh-{i}")
        assert lg.try_admit(b) == "rejected"
    lg.record_batch(b"pend-old", "w", 1, 6, 1, b"P" * 50)
    lg.record_batch(b"pend-new", "w", 5, 7, 1, b"P" * 50)
    lg.commit_checkpoint(step=5, policy_version=5)  # max_async 1: versions below 4 are stale
    assert lg.drop_stale() == 4  # adm0..adm3 admitted but never trained: aged out (they keep their bytes)
    now = now_ms()
    with monkeypatch.context() as m:  # a vote received two minutes ago, for a batch never recorded
        m.setattr(ledger_module, "now_ms", lambda: now - 120_000)
        lg.record_vote(b"never-recorded", "val-a", True, "", [1.0], worker="w")
    lg.record_vote(b"not-yet-fetched", "val-a", True, "", [1.0], worker="w")  # recent: may still be fetched

    out = lg.prune(now=now)
    assert out["stale"] == 1 and out["orphan_votes_deleted"] == 1
    ids = [b"adm%d" % i for i in range(6)] + [b"rej%02d" % i for i in range(30)] + [b"pend-old", b"pend-new"]
    records = {b: lg.batch(b) for b in ids}
    rows = {b: (r.status, r.envelope) for b, r in records.items() if r is not None}
    assert rows[b"pend-old"] == ("rejected", None)
    assert rows[b"pend-new"] == ("pending", b"P" * 50)
    # every batch ever admitted is still there with its bytes (aged-out ones included)
    for i in range(6):
        assert rows[b"adm%d" % i][1] == b"A" * 50
    assert lg.admitted_ids() == {b"adm4", b"adm5"}
    # at most 10 rows of batches never admitted, the newest kept; their votes went with them
    unadmitted = sorted(b for b in rows if b.startswith((b"rej", b"pend-old")))
    assert len(unadmitted) == 10 and b"rej29" in unadmitted and b"rej00" not in unadmitted
    assert len(lg.votes(b"rej00")) == 0
    assert len(lg.votes(b"rej29")) == 2
    assert len(lg.votes(b"not-yet-fetched")) == 1
    assert len(lg.votes(b"never-recorded")) == 0
    assert rows_total(lg) == len(rows)  # nothing the test did not name
    assert stored_bytes(lg, ids) == 7 * 50  # six admitted batches and the one pending: nothing else
    assert lg.prune(now=now) == {"stale": 0, "bytes_dropped": 0, "rows_deleted": 0, "orphan_votes_deleted": 0}


def test_a_flood_of_fresh_identities_cannot_fill_the_disk(tmp_path):
    """Batches from free identities, fetched and stored, never voted for: the bytes the ledger
    holds stay under its cap however many arrive, and they age out as versions advance."""
    lg = Ledger(tmp_path / "node.db", V, 2, 1, max_pending=8, max_pending_bytes=64 * 1024, max_unadmitted_rows=50)
    envelope = b"E" * 16 * 1024
    ids = [i.to_bytes(32, "big") for i in range(400)]
    for i, b in enumerate(ids):
        lg.record_batch(b, f"fresh-{i}", i // 100, 0, 1, envelope)
        assert stored_bytes(lg, ids[: i + 1]) <= 64 * 1024
        if i % 100 == 99:
            lg.commit_checkpoint(step=i // 100 + 1, policy_version=i // 100 + 1)
            lg.prune()
    assert rows_total(lg) <= 50 + 8


class _ServingNode:
    """What the trainer's fetch path needs from a node: a policy and request/response that
    serves the batches in ``batches`` (batch id -> signed RolloutBatch envelope)."""

    def __init__(self) -> None:
        import types

        from node.p2p.standing import PeerStanding

        self.standing = PeerStanding()
        self.batches: dict[bytes, bytes] = {}
        self.requests: list[bytes] = []
        self.reqresp = types.SimpleNamespace(request=self._request)

    async def _request(self, peer_id, msg, expect, timeout=10.0, redial=False):
        from protocol import BatchResponse, Envelope

        await trio.lowlevel.checkpoint()
        self.requests.append(msg.batch_id)
        raw = self.batches.get(msg.batch_id)
        body = BatchResponse(found=raw is not None, envelope=raw or b"")
        return Envelope(b"", BatchResponse.TYPE_ID, peer_id, 0, 0, body, b"")


async def test_the_trainer_keeps_a_flood_under_the_cap_and_fetches_an_evicted_batch_again(tmp_path):
    """Fresh identities serve batches nobody votes for; an honest batch fetched before them
    loses its bytes to the cap, and once a quorum of validators accepts it the trainer fetches
    it again and admits it: the cap costs an honest batch a second fetch, not its admission."""
    from harness.genesis import VALIDATORS
    from harness.roles import tiny_context
    from node.home import NodeHome
    from node.roles.trainer import TrainerRole
    from protocol import Envelope, NodeKey, RolloutAnnounce, Vote

    ctx = tiny_context(tmp_path / "ctx", ledger_max_pending=4, ledger_max_pending_bytes=1 << 20)
    home = NodeHome(tmp_path / "home")
    home.path.mkdir(parents=True)
    role = TrainerRole(home, ctx)
    node = role.node = _ServingNode()
    run_id = ctx.genesis.run_id
    honest = NodeKey(b"\x71" * 32)

    def announce(key, ann) -> Envelope:
        return Envelope(run_id, RolloutAnnounce.TYPE_ID, key.peer_id, now_ms(), 0, ann, b"")

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(role._fetch_loop)
            raw, ann = signed_batch(honest, run_id, 0)
            node.batches[ann.batch_id] = raw
            role._on_announce(announce(honest, ann))
            await trio.testing.wait_all_tasks_blocked()  # every fetch task idle again: the batch is stored
            assert not role.ledger.needs_fetch(ann.batch_id)
            for _ in range(30):  # the flood: each from a fresh identity, each served
                key = NodeKey.generate()
                fraw, fann = signed_batch(key, run_id, 0)
                node.batches[fann.batch_id] = fraw
                role._on_announce(announce(key, fann))
                await trio.lowlevel.checkpoint()
            await trio.testing.wait_all_tasks_blocked()
            assert rows_total(role.ledger) == 31  # every flood batch fetched
            s = role.ledger.storage()
            assert s["pending_with_bytes"] <= 4 and s["pending_bytes"] <= 1 << 20
            assert role.ledger.needs_fetch(ann.batch_id), "the honest batch's bytes were not evicted"
            fetched = node.requests.count(ann.batch_id)
            for v in VALIDATORS:  # the genesis's two validators (quorum 2) accept the honest batch
                role._on_vote(
                    Envelope(
                        run_id,
                        Vote.TYPE_ID,
                        v.peer_id,
                        0,
                        0,
                        Vote(
                            batch_id=ann.batch_id,
                            worker=honest.peer_id,
                            policy_version=0,
                            accept=True,
                            reason="",
                            rewards=(0.5,),
                        ),
                        b"",
                    )
                )
            await trio.testing.wait_all_tasks_blocked()  # the second fetch, queued by the votes
            assert ann.batch_id in role.ledger.admitted_ids()
            assert node.requests.count(ann.batch_id) == fetched + 1 and role.refetches == 1
            assert [b.envelope for b in role.ledger.untrained()] == [raw]
            assert role.status()["ledger"]["refetches"] == 1
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ reward agreement and slots


def test_admits_when_the_accepting_validators_rewards_agree(tmp_path):
    lg = ledger(tmp_path)
    lg.record_batch(b"b1", "w", 0, 0, 2, b"env")
    lg.record_vote(b"b1", "val-a", True, "", [1.0, 0.25], worker="w")
    lg.record_vote(b"b1", "val-b", True, "", [1.0 + 1e-9, 0.25], worker="w")  # float rounding: within 1e-6
    assert lg.try_admit(b"b1") == "admitted"
    assert lg.untrained()[0].rewards == [1.0 + 0.5e-9, 0.25]
    # a run with a looser [config] reward_agreement: the agreeing validators' median
    loose = Ledger(tmp_path / "loose.db", V, 2, 2, reward_agreement=0.2)
    loose.record_batch(b"b1", "w", 0, 0, 1, b"env")
    loose.record_vote(b"b1", "val-a", True, "", [1.0], worker="w")
    loose.record_vote(b"b1", "val-b", True, "", [0.9], worker="w")
    assert loose.try_admit(b"b1") == "admitted"
    assert loose.untrained()[0].rewards == [0.95]


def test_disagreeing_rewards_wait_for_more_votes_then_are_refused_once_all_voted(tmp_path, caplog):
    lg = ledger(tmp_path)
    for b in (b"split", b"settled"):  # the same two first votes on both batches
        lg.record_batch(b, "w", 0, int(b == b"settled"), 2, b"env")
        lg.record_vote(b, "val-a", True, "", [1.0, 0.0], worker="w")
        lg.record_vote(b, "val-b", True, "", [0.0, 0.0], worker="w")  # a quorum accepts, on other rewards
        with caplog.at_level("WARNING", logger="node.roles.ledger"):
            assert lg.try_admit(b) == "pending"
        assert b.hex()[:12] in caplog.text and "val-a" in caplog.text and "val-b" in caplog.text
        assert "disagree" in caplog.text
    # the last validator sides with neither: no two agree and nobody is left to vote
    lg.record_vote(b"split", "val-c", True, "", [0.5, 0.0], worker="w")
    assert lg.try_admit(b"split") == "rejected"
    rec = lg.batch(b"split")
    assert rec.reason.startswith("validators' rewards disagree") and rec.envelope is None
    assert all(v in rec.reason for v in V)
    # control: the last validator agrees with one of them; that pair's rewards are admitted
    lg.record_vote(b"settled", "val-c", True, "", [1.0, 0.0], worker="w")
    assert lg.try_admit(b"settled") == "admitted"
    assert lg.untrained()[0].rewards == [1.0, 0.0]  # val-b's 0.0 is not in the median


def test_refused_as_soon_as_the_missing_votes_could_not_complete_an_agreeing_quorum(tmp_path):
    five = [f"val-{i}" for i in range(5)]
    lg = Ledger(tmp_path / "node.db", five, 3, 2)
    for b in (b"hopeless", b"open"):
        lg.record_batch(b, "w", 0, int(b == b"open"), 1, b"env")
        lg.record_vote(b, "val-0", True, "", [1.0], worker="w")
        lg.record_vote(b, "val-1", True, "", [0.0], worker="w")
        lg.record_vote(b, "val-2", False, "toploc", [], worker="w")
    # one more reject: a best agreeing set of 1 plus one validator left cannot make 3
    lg.record_vote(b"hopeless", "val-3", False, "toploc", [], worker="w")
    assert lg.try_admit(b"hopeless") == "rejected"
    assert lg.batch(b"hopeless").reason.startswith("validators' rewards disagree")
    # control: two validators left could still join val-0
    assert lg.try_admit(b"open") == "pending"
    for v in ("val-3", "val-4"):
        lg.record_vote(b"open", v, True, "", [1.0], worker="w")
    assert lg.try_admit(b"open") == "admitted"


def test_a_disagreeing_minority_does_not_block_an_agreeing_quorum(tmp_path):
    five = [f"val-{i}" for i in range(5)]
    honest = [1.0, 0.0, 1.0]
    results = {}
    for case, outliers in (("control", {}), ("outliers", {"val-3": [0.0, 0.0, 0.0], "val-4": [1.0, 1.0, 1.0]})):
        lg = Ledger(tmp_path / f"{case}.db", five, 3, 2)
        lg.record_batch(b"b", "w", 0, 0, 3, b"env")
        for v, rewards in outliers.items():  # the outliers vote first
            lg.record_vote(b"b", v, True, "", rewards, worker="w")
            assert lg.try_admit(b"b") == "pending"
        for v in five[:3]:
            lg.record_vote(b"b", v, True, "", honest, worker="w")
        assert lg.try_admit(b"b") == "admitted", case
        results[case] = lg.untrained()[0].rewards
    assert results == {"control": honest, "outliers": honest}  # the outliers moved nothing


def test_reward_lists_of_the_wrong_size_never_agree(tmp_path):
    lg = ledger(tmp_path)
    for b in (b"short", b"ok"):
        lg.record_batch(b, "w", 0, int(b == b"ok"), 2, b"env")
        lg.record_vote(b, "val-a", True, "", [1.0, 1.0], worker="w")
        lg.record_vote(b, "val-b", True, "", [1.0], worker="w")  # one reward for a batch of two
        assert lg.try_admit(b) == "pending"
    lg.record_vote(b"short", "val-c", True, "", [1.0, 1.0, 1.0], worker="w")
    assert lg.try_admit(b"short") == "rejected"
    assert "do not match the batch size (2 samples)" in lg.batch(b"short").reason
    lg.record_vote(b"ok", "val-c", True, "", [1.0, 1.0], worker="w")  # control
    assert lg.try_admit(b"ok") == "admitted"


def test_an_evicted_batch_is_fetched_again_only_for_an_agreeing_quorum(tmp_path):
    lg = ledger(tmp_path)
    for b, second in ((b"split", [0.0]), (b"agreed", [1.0])):
        lg.record_batch(b, "w", 0, int(b == b"agreed"), 1, None)  # bytes evicted (or not fetched yet)
        lg.record_vote(b, "val-a", True, "", [1.0], worker="w")
        lg.record_vote(b, "val-b", True, "", second, worker="w")
        assert lg.try_admit(b) == "pending"
    assert lg.bytes_wanted(b"split") is None  # its bytes could not get it admitted
    assert lg.bytes_wanted(b"agreed") == ("w", 0, 1, 1)


def test_a_slot_is_admitted_once_and_the_refusal_names_the_batch_that_holds_it(tmp_path):
    lg = ledger(tmp_path)
    slots = {b"first": ("w", 0, 0), b"next-counter": ("w", 0, 1), b"other-worker": ("w2", 0, 0), b"again": ("w", 0, 0)}
    for b, (worker, version, counter) in slots.items():
        lg.record_batch(b, worker, version, counter, 1, b"env-" + b)
        for v in V[:2]:
            lg.record_vote(b, v, True, "", [1.0], worker=worker)
    # controls: different slots (another counter, another worker's) are each admitted
    assert [lg.try_admit(b) for b in (b"first", b"next-counter", b"other-worker")] == ["admitted"] * 3
    assert lg.try_admit(b"again") == "rejected"
    reason = lg.batch(b"again").reason
    assert reason.startswith("duplicate slot") and b"first".hex() in reason
    # the rule holds across a restart of the trainer (the same ledger file, reopened)
    lg.close()
    lg = ledger(tmp_path)
    lg.record_batch(b"third", "w", 0, 0, 1, b"env-third")
    for v in V[:2]:
        lg.record_vote(b"third", v, True, "", [1.0], worker="w")
    assert lg.try_admit(b"third") == "rejected" and b"first".hex() in lg.batch(b"third").reason
    assert lg.admitted_ids() == {b"first", b"next-counter", b"other-worker"}


def test_the_trainer_reads_reward_agreement_from_the_genesis_config(tmp_path):
    from harness.roles import tiny_context
    from node.home import NodeHome
    from node.roles.trainer import TrainerRole

    for name, config, expected in (
        ("default", {}, ledger_module.REWARD_AGREEMENT),
        ("set", {"reward_agreement": 0.25}, 0.25),
    ):
        home = NodeHome(tmp_path / name / "home")
        home.path.mkdir(parents=True)
        role = TrainerRole(home, tiny_context(tmp_path / name / "ctx", **config))
        assert role.ledger.reward_agreement == expected
        role.ledger.close()


# ------------------------------------------------------------------ a batch belongs to its signer


def test_votes_on_another_announcers_copy_of_an_id_never_touch_the_signers_batch(tmp_path):
    """A thief announced an honest batch's id first and every validator rejected *its*
    announce (the bytes it served were signed by someone else): those votes name the thief
    as the worker and count for nothing. The signer's batch is admitted on the votes on its
    own announce, beside a control batch nobody copied."""
    lg = ledger(tmp_path, quorum=2)
    for v in V:  # every validator rejects the thief's announce of b"stolen", before the batch is fetched
        lg.record_vote(b"stolen", v, False, "batch: batch_sender: signed by another peer", [], worker="thief")
    lg.record_batch(b"stolen", "honest", 0, 0, 1, b"env-stolen")
    lg.record_batch(b"control", "honest", 0, 1, 1, b"env-control")
    assert lg.try_admit(b"stolen") == "pending"  # the thief's rejections are not on this batch
    assert lg.accept_voters(b"stolen") == set()
    for b in (b"stolen", b"control"):
        for v in V[:2]:
            lg.record_vote(b, v, True, "", [1.0], worker="honest")
    assert [lg.try_admit(b) for b in (b"stolen", b"control")] == ["admitted", "admitted"]
    assert lg.accept_voters(b"stolen") == set(V[:2])
    assert {(r.worker, r.accept) for r in lg.votes(b"stolen")} == {("thief", False), ("honest", True)}
    assert len(lg.votes(b"stolen", worker="honest")) == 2
    assert lg.owner(b"stolen") == "honest" and lg.owner(b"never") is None
    # a row never changes hands: bytes offered under another worker are ignored
    lg.record_batch(b"pending-one", "honest", 0, 2, 1, None)
    lg.record_batch(b"pending-one", "thief", 0, 2, 1, b"thief-bytes")
    assert lg.batch(b"pending-one").worker == "honest" and lg.batch(b"pending-one").envelope is None
    # the thief's votes are orphans: retention deletes them once their TTL passed; the signer's stay
    lg.orphan_vote_ttl_s = 0.0
    lg.prune(now=now_ms() + 1000)
    assert {r.worker for r in lg.votes(b"stolen")} == {"honest"}


def test_a_ledger_from_before_votes_named_their_worker_is_migrated(tmp_path):
    """Votes of an old ledger take the worker of the row they are on (the only announcer whose
    votes were ever acted on), so a pending batch is decided the same way after the upgrade."""
    import sqlite3

    path = tmp_path / "old.db"
    db = sqlite3.connect(str(path))
    db.executescript(
        ledger_module.SCHEMA.split("CREATE TABLE IF NOT EXISTS votes")[0]
        + "CREATE TABLE votes (batch_id BLOB NOT NULL, validator TEXT NOT NULL, accept INTEGER NOT NULL, "
        "reason TEXT NOT NULL, rewards BLOB NOT NULL, received_ms INTEGER NOT NULL, PRIMARY KEY (batch_id, validator));"
        "CREATE INDEX votes_by_time ON votes(received_ms);"
    )
    db.execute(
        "INSERT INTO batches(batch_id, worker, policy_version, batch_counter, num_samples, envelope) "
        "VALUES(?, 'w', 0, 0, 1, ?)",
        (b"b1", b"env"),
    )
    for v in ("val-a", "val-b"):
        db.execute(
            "INSERT INTO votes VALUES(?, ?, 1, '', ?, ?)",
            (b"b1", v, b"\x91\xcb?\xf0\x00\x00\x00\x00\x00\x00", now_ms()),
        )
    db.execute("INSERT INTO votes VALUES(?, 'val-a', 1, '', ?, ?)", (b"orphan", b"\x90", now_ms()))
    db.commit()
    db.close()
    lg = Ledger(path, V, 2, 2)
    assert {(r.validator, r.worker) for r in lg.votes(b"b1")} == {("val-a", "w"), ("val-b", "w")}
    assert [r.worker for r in lg.votes(b"orphan")] == [""]
    assert lg.try_admit(b"b1") == "admitted"
    lg.close()
    assert Ledger(path, V, 2, 2).try_admit(b"b1") == "admitted"  # reopening migrates nothing twice


def _accept(lg, batch_id, worker="w", n=1, reward=1.0):
    for v in V[:2]:
        lg.record_vote(batch_id, v, True, "", [reward] * n, worker=worker)


def test_counters_are_admitted_in_order_and_a_later_one_waits_for_the_gap(tmp_path):
    """A worker's counters form one chain over the run (protocol.rules.counter_gap): counter c
    is admitted only once the ledger holds a batch at every lower counter of that worker,
    whatever their versions. A worker that computes counters 0 and 1 and announces only 1
    (its better one) gets nothing trained; announcing 0 unblocks 1."""
    lg = ledger(tmp_path)
    lg.record_batch(b"c1", "w", 0, 1, 1, b"env1")
    _accept(lg, b"c1")
    assert lg.try_admit(b"c1") == "pending"
    assert lg.batch(b"c1").reason == "waiting for the worker's batch counter 0"
    assert lg.untrained() == []
    # another worker's counter 0 is not the gap
    lg.record_batch(b"o0", "other", 0, 0, 1, b"envo")
    assert lg.try_admit(b"c1") == "pending"
    assert lg.waiting_after("w", 0) == [b"c1"]
    assert (lg.chain_head("w"), lg.chain_head("other")) == (0, 1)
    # the gap is filled by a batch that is then rejected: used is used, in order is all the rule asks
    lg.record_batch(b"c0", "w", 0, 0, 1, b"env0")
    assert lg.chain_head("w") == 2
    lg.record_vote(b"c0", "val-a", False, "reward", [], worker="w")
    lg.record_vote(b"c0", "val-b", False, "reward", [], worker="w")
    assert lg.try_admit(b"c0") == "rejected"
    assert lg.try_admit(b"c1") == "admitted"
    assert [b.batch_id for b in lg.untrained()] == [b"c1"]


def test_the_chain_crosses_versions_and_a_skipped_counter_strands_it_for_good(tmp_path):
    """One chain per worker, not per version: counter 2 at version 1 follows counter 1 at
    version 0. Skipping counter 3 strands every later counter, also at newer versions, also
    once the skipped one would have been stale: a version change is no way out. Control: the
    worker's counter 3 arrives late (stale, rejected) and the chain moves on."""
    lg = ledger(tmp_path, max_async=1)
    for c, v in ((0, 0), (1, 0), (2, 1), (4, 1)):
        lg.record_batch(b"c%d" % c, "w", v, c, 1, b"env")
        _accept(lg, b"c%d" % c)
    assert [lg.try_admit(b"c%d" % c) for c in (0, 1, 2, 4)] == ["admitted"] * 3 + ["pending"]
    assert lg.batch(b"c4").reason == "waiting for the worker's batch counter 3"
    lg.commit_checkpoint(step=1, policy_version=2)
    for c, v in ((5, 2), (6, 2)):
        lg.record_batch(b"c%d" % c, "w", v, c, 1, b"env")
        _accept(lg, b"c%d" % c)
        assert lg.try_admit(b"c%d" % c) == "pending"
    assert lg.batch(b"c6").reason == "waiting for the worker's batch counter 3"
    # counter 3 (version 0) arrives now: stale, rejected, but held: 4, 5 and 6 are admitted
    lg.record_batch(b"c3", "w", 0, 3, 1, b"env")
    _accept(lg, b"c3")
    assert lg.try_admit(b"c3") == "rejected" and "stale" in lg.batch(b"c3").reason
    assert lg.waiting_after("w", 3) == [b"c4", b"c5", b"c6"]
    assert [lg.try_admit(b"c%d" % c) for c in (4, 5, 6)] == ["admitted"] * 3
    assert lg.chain_head("w") == 7


def test_a_chain_never_goes_back_to_an_older_version(tmp_path):
    """A worker holding versions 1 and 2 that made counter 4 with 2 cannot make counter 5
    with 1 (a batch that looked better with the older policy): rejected, and the chain goes
    on (the rejected batch is held). A second batch for a used counter, with another
    version, is a duplicate slot."""
    lg = ledger(tmp_path, max_async=2)
    lg.commit_checkpoint(step=2, policy_version=2)
    for bid, v, c in ((b"a", 1, 0), (b"b", 2, 1), (b"back", 1, 2), (b"next", 2, 3)):
        lg.record_batch(bid, "w", v, c, 1, b"env")
        _accept(lg, bid)
    assert lg.try_admit(b"a") == "admitted" and lg.try_admit(b"b") == "admitted"
    assert lg.try_admit(b"back") == "rejected"
    assert "version regression" in lg.batch(b"back").reason
    assert lg.try_admit(b"next") == "admitted"
    lg.record_batch(b"again", "w", 1, 0, 1, b"env")  # counter 0 once more, another version
    _accept(lg, b"again")
    assert lg.try_admit(b"again") == "rejected" and "duplicate slot" in lg.batch(b"again").reason


def test_the_chain_head_survives_retention_deleting_old_rows(tmp_path):
    """Retention may delete rejected rows; the chain keeps its head, so later counters are
    not stranded by a deleted row."""
    lg = ledger(tmp_path, max_unadmitted_rows=1)
    for c in range(3):
        lg.record_batch(b"r%d" % c, "w", 0, c, 1, b"env")
        lg.record_vote(b"r%d" % c, "val-a", False, "reward", [], worker="w")
        lg.record_vote(b"r%d" % c, "val-b", False, "reward", [], worker="w")
        assert lg.try_admit(b"r%d" % c) == "rejected"
    assert lg.prune()["rows_deleted"] == 2
    assert lg.chain_head("w") == 3
    lg.record_batch(b"ok", "w", 0, 3, 1, b"env")
    _accept(lg, b"ok")
    assert lg.try_admit(b"ok") == "admitted"
