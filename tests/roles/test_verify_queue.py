"""The validator's verify queue (node/roles/intake.py verify_queue, a fair queue): announcers whose batches this
validator accepted go first, strangers share a bounded, round-robin slice, and a flood of
well-formed garbage from fresh identities cannot starve an honest batch (through the real
validator role on real libp2p hosts)."""

from __future__ import annotations

import collections
import dataclasses
import random
import sys
import threading
from pathlib import Path

import pytest
import trio
import trio.testing

from node.p2p.node import RoleHook
from node.p2p.testing import NodeFactory, wait_until
from node.roles.fair_queue import FairQueue
from node.roles.intake import verify_queue
from node.util import now_ms
from protocol import BatchRequest, BatchResponse, RolloutAnnounce, RolloutBatch, seal, sha256

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


async def _drain(q: FairQueue, n: int) -> list:
    return [(await q.get()).item for _ in range(n)]


async def _put(q: FairQueue, sender: str, item) -> bool:
    """Queue ``item`` (waiting for room where the lane says so); whether it was queued."""
    return (await q.put(sender, item)).queued


async def _get(q: FairQueue) -> tuple:
    t = await q.get()
    return t.sender, t.item


# ------------------------------------------------------------------ the queue alone


async def test_proven_announcers_are_served_first_come_before_strangers():
    q: FairQueue[str] = verify_queue(every=4)
    q.mark_proven("honest")
    for i in range(3):
        assert await _put(q, f"sybil-{i}", f"g{i}")
    await _put(q, "honest", "h1")
    await _put(q, "honest", "h2")
    assert await _drain(q, 5) == ["h1", "h2", "g0", "g1", "g2"]


async def test_strangers_get_at_most_one_verification_in_every_k_while_proven_batches_wait():
    k = 4
    q: FairQueue[str] = verify_queue(every=k, max_unproven=100)
    q.mark_proven("honest")
    for i in range(6):
        await _put(q, f"sybil-{i}", "U")
    for _ in range(12):
        await _put(q, "honest", "P")
    order = "".join(await _drain(q, 18))
    assert order == "PPPU" * 4 + "UU"  # a bounded share, never starved, and work-conserving at the end
    assert q.status()["served"] == {"proven": 12, "unproven": 6}


async def test_unproven_announcers_take_turns_round_robin():
    q: FairQueue[str] = verify_queue(per_announcer=3)
    for item in ("a1", "a2", "a3", "b1", "b2", "c1"):
        await _put(q, item[0], item)
    assert await _drain(q, 6) == ["a1", "b1", "c1", "a2", "b2", "a3"]


async def test_the_unproven_lane_is_bounded_per_announcer_and_in_total_and_drops_are_counted():
    q: FairQueue[int] = verify_queue(max_unproven=4, per_announcer=2)
    assert [await _put(q, "sybil", i) for i in range(3)] == [True, True, False]
    assert [await _put(q, f"fresh-{i}", i) for i in range(3)] == [True, True, False]
    q.mark_proven("honest")
    assert await _put(q, "honest", 99)  # the proven lane is not the strangers' to fill
    st = q.status()
    assert st["dropped"] == {"announcer_cap": 1, "unproven_full": 1}
    assert (st["proven_queued"], st["unproven_queued"], st["unproven_announcers"]) == (1, 4, 3)
    assert len(q) == 5


async def test_batches_queued_before_their_announcer_proved_itself_move_to_the_proven_lane():
    q: FairQueue[str] = verify_queue(every=2)
    await _put(q, "sybil", "g1")
    await _put(q, "newcomer", "n1")
    await _put(q, "newcomer", "n2")
    q.mark_proven("newcomer")  # one of its batches was just accepted
    assert q.status()["unproven_queued"] == 1
    assert await _drain(q, 3) == ["n1", "g1", "n2"]


async def test_forgotten_and_banned_announcers():
    q: FairQueue[str] = verify_queue(per_announcer=2)
    q.mark_proven("turncoat")
    await _put(q, "turncoat", "t1")
    q.forget("turncoat")  # a batch of it broke a rule: its next ones queue as a stranger's
    assert not q.proven("turncoat")
    await _put(q, "turncoat", "t2")
    await _put(q, "turncoat", "t3")
    assert not await _put(q, "turncoat", "t4")
    assert len(q.discard("turncoat")) == 3  # banned: nothing of it is verified
    assert len(q) == 0 and q.status()["dropped"] == {"announcer_cap": 1, "banned": 3}
    q.mark_proven("x")
    for i in range(q.remember + 1):
        q.mark_proven(f"p{i}")
    assert not q.proven("x") and q.proven(f"p{q.remember}")  # standing is remembered for a bounded set


class _Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.steps: collections.Counter[str] = collections.Counter()

    def before_task_step(self, task) -> None:
        self.steps[task.name] += 1


async def test_get_and_a_full_proven_lane_wait_on_events_not_by_polling(autojump_clock):
    q: FairQueue[int] = verify_queue(proven_capacity=1)
    q.mark_proven("honest")
    got: list = []
    done: list = []
    counter = _Steps()
    trio.lowlevel.add_instrument(counter)
    try:
        async with trio.open_nursery() as nursery:

            async def consumer() -> None:
                got.append(await _get(q))

            nursery.start_soon(consumer, name="consumer")
            await trio.testing.wait_all_tasks_blocked()
            before = counter.steps["consumer"]
            await trio.sleep(3600)  # an hour of (virtual) idle time
            assert counter.steps["consumer"] == before and got == []  # it slept: no polling
            await _put(q, "honest", 1)
            await trio.testing.wait_all_tasks_blocked()
            assert got == [("honest", 1)]

            await _put(q, "honest", 2)  # the lane holds one: the next put waits for room

            async def producer() -> None:
                await _put(q, "honest", 3)
                done.append(3)

            nursery.start_soon(producer, name="producer")
            await trio.testing.wait_all_tasks_blocked()
            before = counter.steps["producer"]
            await trio.sleep(3600)
            assert counter.steps["producer"] == before and not done
            assert await _get(q) == ("honest", 2)
            await trio.testing.wait_all_tasks_blocked()
            assert done == [3] and len(q) == 1
    finally:
        trio.lowlevel.remove_instrument(counter)


async def test_a_cancelled_get_loses_no_item():
    q: FairQueue[str] = verify_queue()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(q.get)  # waits on the empty queue ...
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()  # ... and is cancelled there
    await _put(q, "a", "x")
    with trio.CancelScope() as cs:
        cs.cancel()
        with pytest.raises(trio.Cancelled):
            await q.get()  # cancelled before it takes anything
    assert len(q) == 1 and await _get(q) == ("a", "x")


# ------------------------------------------------------------------ through the real validator


class _Serving(RoleHook):
    """A worker identity that announces the batches it is given and serves them when fetched."""

    def __init__(self) -> None:
        self.node = None
        self.batches: dict[bytes, bytes] = {}

    async def run(self, node) -> None:
        self.node = node
        node.reqresp.register(BatchRequest, self._serve)
        await trio.sleep_forever()

    def _serve(self, env, peer: str) -> BatchResponse:
        raw = self.batches.get(env.body.batch_id)
        return BatchResponse(found=raw is not None, envelope=raw or b"")

    async def announce(self, batch: RolloutBatch) -> bytes:
        node = self.node
        raw = seal(node.key, node.run_id, batch, now_ms(), node.seq.next())
        batch_id = sha256(raw)
        self.batches[batch_id] = raw
        await node.gossip.publish(
            RolloutAnnounce(
                batch_id=batch_id,
                policy_version=batch.policy_version,
                batch_counter=batch.batch_counter,
                num_samples=len(batch.samples),
                size_bytes=len(raw),
            )
        )
        return batch_id


async def test_a_flood_of_served_garbage_does_not_starve_an_honest_batch(tmp_path, monkeypatch):
    """Fresh identities announce and serve well-formed, signed batches that only a prefill can
    reject. Verification is held at a gate while the flood queues up in front; an honest batch
    from a worker this validator accepted before is announced behind it; once the gate opens,
    the honest batch is verified after at most the one garbage batch already in progress. A
    batch that breaks a model-free rule is rejected while the gate is still shut (it never
    waits for a prefill), and what the bounded queue dropped shows in ``status()``."""
    from harness.genesis import VALIDATORS, tiny_genesis
    from node.roles import validator as validator_mod
    from node.roles.context import RunContext
    from node.roles.intake import MAX_UNPROVEN_PER_ANNOUNCER

    genesis = tiny_genesis(fields={"validators": [VALIDATORS[0]], "quorum": 1}, batches_per_step=1_000_000)
    ctx = RunContext.from_genesis(genesis.genesis, tmp_path / "cache")
    gate = threading.Event()  # verification runs only while it is set
    gate.set()
    real_verify = validator_mod.verify_batch

    def gated_verify(*args, **kwargs):
        gate.wait(timeout=240)
        return real_verify(*args, **kwargs)

    monkeypatch.setattr(validator_mod, "verify_batch", gated_verify)
    n_flooders, per_flooder = 4, MAX_UNPROVEN_PER_ANNOUNCER + 1
    try:
        await _flood_behind_a_gate(tmp_path, genesis, ctx, gate, n_flooders, per_flooder)
    finally:
        gate.set()  # a failing test must not leave a verification thread parked at the gate


async def _flood_behind_a_gate(tmp_path, genesis, ctx, gate, n_flooders, per_flooder) -> None:
    from harness.genesis import TRAINER, VALIDATORS, WORKERS
    from harness.hostile_nodes import garbage_batch
    from harness.roles import engine_for, homes
    from node.roles.intake import MAX_UNPROVEN_PER_ANNOUNCER
    from node.roles.rollouts import PolicyFacts, produce_batch
    from node.roles.trainer import TrainerRole
    from node.roles.validator import ValidatorRole

    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(
                nursery, genesis=genesis, heartbeat_interval_s=2.0, forget_after_s=15.0, dial_timeout_s=10.0
            )
            await net.start()  # bootstrap
            trainer = TrainerRole(homes(tmp_path, "trainer"), ctx)  # publishes v0, never steps
            await net.start(hook=trainer, key=TRAINER)
            validator = ValidatorRole(homes(tmp_path, "validator"), ctx)
            await net.start(hook=validator, key=VALIDATORS[0])
            votes: list[tuple[str, bytes, bool, str]] = []
            real_vote = validator._vote

            async def recording_vote(env, verdict) -> None:
                votes.append((env.sender, env.body.batch_id, verdict.accept, verdict.rule))
                await real_vote(env, verdict)

            validator._vote = recording_vote
            honest = _Serving()
            await net.start(hook=honest, key=WORKERS[0])
            flooders = [_Serving() for _ in range(n_flooders)]
            cheat = _Serving()
            for hook in [*flooders, cheat]:
                await net.start(hook=hook)
            await net.wait_connected(min_peers=2, timeout=120)
            await wait_until(lambda: 0 in trainer.store.versions, 60, what="the trainer's v0")
            policy = PolicyFacts.of(trainer.store.versions[0].manifest)
            engine = await trio.to_thread.run_sync(engine_for, ctx)
            worker = WORKERS[0].peer_id

            # 1. the honest worker proves itself: one batch accepted by this validator
            first = await trio.to_thread.run_sync(produce_batch, ctx, engine, worker, policy, 0)
            first_id = await honest.announce(first)
            await wait_until(lambda: (worker, first_id, True, "") in votes, 120, what="the first honest batch accepted")
            assert validator._verify.proven(worker)
            served_before = validator._verify.status()["served"].get("unproven", 0)

            # 2. verification held; the flood fetched, checked and queued in front
            gate.clear()
            rnd = random.Random(7)
            hidden = int(validator.engine.lm_head_weight().shape[1])
            for f in flooders:
                for counter in range(per_flooder):
                    await f.announce(garbage_batch(ctx, f.node.peer_id, policy, counter, hidden, rnd))
            bad = garbage_batch(ctx, cheat.node.peer_id, policy, 0, hidden, rnd)
            size = ctx.genesis.dataset_size
            wrong = tuple(dataclasses.replace(s, prompt_index=(s.prompt_index + 1) % size) for s in bad.samples)
            await cheat.announce(dataclasses.replace(bad, samples=wrong))  # not the prompts it owes

            def flood_settled() -> bool:
                st = validator._verify.status()
                in_flight = st["served"].get("unproven", 0) - served_before
                return st["unproven_queued"] + sum(st["dropped"].values()) + in_flight == n_flooders * per_flooder

            await wait_until(flood_settled, 60, what="every garbage batch fetched and queued or dropped")
            # a model-free rule is enforced before the queue: voted while no prefill can run
            await wait_until(lambda: validator.reasons["prompts"] == 1, 30, what="the cheat's 'prompts' rejection")
            st = validator.status()["verify_queue"]
            assert st["served"].get("unproven", 0) - served_before == 1  # one garbage batch held at the gate
            assert st["unproven_queued"] >= n_flooders * MAX_UNPROVEN_PER_ANNOUNCER - 1
            assert st["dropped"].get("announcer_cap", 0) >= n_flooders - 1  # the per-announcer cap bit
            assert validator.status()["dropped_batches"] == sum(st["dropped"].values())

            # 3. the honest batch, announced behind the whole flood
            second = await trio.to_thread.run_sync(produce_batch, ctx, engine, worker, policy, 1)
            second_id = await honest.announce(second)
            await wait_until(
                lambda: validator._verify.status()["proven_queued"] == 1, 60, what="the honest batch queued"
            )
            queued_garbage = validator._verify.status()["unproven_queued"]
            opened_at = len(votes)
            gate.set()
            await wait_until(lambda: (worker, second_id, True, "") in votes, 120, what="the second honest batch")
            after = votes[opened_at:]
            ahead = [v for v in after[: [v[1] for v in after].index(second_id)] if v[0] != worker]
            assert len(ahead) <= 1, ahead  # only the garbage batch already being verified went first
            assert queued_garbage >= n_flooders * MAX_UNPROVEN_PER_ANNOUNCER - 1  # ... of all that was queued

            # 4. the flood is rejected at the model stage, every flooder banned, nothing left queued
            flooder_ids = {f.node.peer_id for f in flooders}
            await wait_until(
                lambda: len(validator._verify) == 0 and all(validator.node.standing.is_banned(p) for p in flooder_ids),
                120,
                what="the flood rejected and its identities banned",
            )
            flood_votes = [v for v in votes if v[0] in flooder_ids]
            assert flood_votes and not any(v[2] for v in flood_votes)
            assert {v[3] for v in flood_votes} <= {"toploc", "proof", "sampling", "termination"}
            assert validator.verdicts["accept"] == 2
            nursery.cancel_scope.cancel()
