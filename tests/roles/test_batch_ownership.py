"""A batch belongs to its signer (issue 30, point 4; protocol/batches.py).

Anyone on the rollout topic sees every batch id and may announce it under its own key.
Such an announce is about (announcer, id), a batch that does not exist: fetching it costs
the announcer, and the signer's batch is fetched, voted on and admitted as if nothing had
been announced around it. On real libp2p nodes with the real roles (tiny model), and on a
validator's intake for the flood that fills its fetch lane.
"""

from __future__ import annotations

import collections
import time

import trio
import trio.testing

from harness.genesis import tiny_genesis
from harness.network import record_charges, start_network
from node.p2p.reqresp import RequestError
from node.p2p.standing import PeerStanding
from node.p2p.testing import wait_until
from protocol import BatchRequest, BatchResponse, Envelope, NodeKey, RolloutAnnounce, Vote


async def test_thieves_announcing_an_honest_batch_first_or_later_pay_and_the_batch_is_admitted(tmp_path):
    """Two thieves announce the honest worker's first batch before it does, at every validator
    and the trainer: one serves the worker's signed bytes as its own (it fetched them from the
    worker), one serves nothing. Both are charged; the worker's batch is fetched from it,
    accepted by both validators and admitted under its name, and its worker hears no reject.
    After the admission a third thief announces the same id: refused without a fetch and
    charged. Control: the worker's next batch, which nobody copied, is admitted too."""
    genesis = tiny_genesis(steps=2, batches_per_step=1)
    with trio.fail_after(480):
        async with trio.open_nursery() as nursery:
            net, trainer, validators, workers = await start_network(nursery, tmp_path, genesis, worker_tamper=(None,))
            (honest,) = workers
            relay = await net.start(key=NodeKey(b"\x51" * 32))  # serves the worker's bytes as its own
            mute = await net.start(key=NodeKey(b"\x52" * 32))  # announces what it cannot serve
            late = await net.start(key=NodeKey(b"\x53" * 32))  # announces the id after the admission
            thieves = (relay, mute)
            relayed: dict[bytes, bytes] = {}
            asked: collections.Counter[str] = collections.Counter()

            def serve(name: str, table: dict[bytes, bytes]):
                def handler(env: Envelope, peer: str) -> BatchResponse:
                    asked[name] += 1
                    raw = table.get(env.body.batch_id)
                    return BatchResponse(found=raw is not None, envelope=raw or b"")

                return handler

            relay.reqresp.register(BatchRequest, serve("relay", relayed))
            mute.reqresp.register(BatchRequest, serve("mute", {}))
            late.reqresp.register(BatchRequest, serve("late", {}))
            deciders = [trainer.node, *(v.node for v in validators)]
            charges = record_charges(deciders)
            # which announces each deciding node has handled (registered after the roles' own
            # handlers, so a key here means the role already acted on that announce)
            handled: dict[str, set[tuple[str, bytes]]] = collections.defaultdict(set)
            for n in deciders:
                n.gossip.on("rollout", lambda env, _me=n.peer_id: handled[_me].add((env.sender, env.body.batch_id)))

            def everywhere(sender: str, batch_id: bytes) -> bool:
                return all((sender, batch_id) in handled[n.peer_id] for n in deciders)

            front_run: list[bytes] = []
            real_publish = honest.node.gossip.publish

            async def publish(msg):
                if isinstance(msg, RolloutAnnounce) and not front_run:
                    front_run.append(msg.batch_id)
                    relayed[msg.batch_id] = honest.batches[msg.batch_id]  # what a BatchRequest to it returns
                    for _ in range(30):  # (a thief just started may not be in the gossip tree yet)
                        for t in thieves:
                            if not everywhere(t.peer_id, msg.batch_id):
                                await t.gossip.publish(msg)
                        with trio.move_on_after(2):
                            await wait_until(
                                lambda: all(everywhere(t.peer_id, msg.batch_id) for t in thieves), 3, poll=0.05
                            )
                        if all(everywhere(t.peer_id, msg.batch_id) for t in thieves):
                            break
                    else:
                        raise AssertionError("the thieves' announces never reached every deciding node")
                await real_publish(msg)

            honest.node.gossip.publish = publish
            me = honest.node.peer_id

            def admitted_of(worker: str) -> list[bytes]:
                return [b for b in trainer.ledger.admitted_ids() if trainer.ledger.batch(b).worker == worker]

            def state() -> str:
                """What each node holds, for a failure message."""
                lines = [f"front-run {[b.hex()[:12] for b in front_run]}; worker {honest.stats}"]
                for r in trainer.ledger.records():
                    lines.append(
                        f"ledger {r.batch_id.hex()[:12]} ..{r.worker[-6:]} v{r.policy_version} {r.status} {r.reason}"
                    )
                for v in validators:
                    lines.append(
                        f"validator {dict(v.verdicts)} {dict(v.reasons)} queued {len(v.intake)} {v.last_reasons}"
                    )
                lines.append(
                    f"trainer v{trainer.version} queued {len(trainer.intake)} dropped {trainer.dropped_announces}"
                )
                return "\n".join(lines)

            try:
                await wait_until(lambda: front_run and front_run[0] in admitted_of(me), 300, poll=0.5, what="copied")
                stolen = front_run[0]
                await wait_until(lambda: len(admitted_of(me)) >= 2, 180, poll=0.5, what="a control batch")
            except trio.TooSlowError as exc:
                raise AssertionError(f"{exc}\n{state()}") from None

            # the copied batch: its worker's, accepted by both validators on the worker's own announce
            rec = trainer.ledger.batch(stolen)
            assert (rec.worker, rec.status) == (me, "admitted")
            assert trainer.ledger.accept_voters(stolen) == {v.node.peer_id for v in validators}
            assert {r.accept for r in trainer.ledger.votes(stolen, worker=me)} == {True}

            # Both thieves are charged at every deciding node (a fetch from a thief may still be
            # under way when the worker's batch is admitted: wait). The relay served the worker's
            # signed bytes as its own ("batch signed by another peer than its announcer", or,
            # where a dial to it failed under load, as unserved); every vote on its announce is a
            # rejection that names the relay, never the worker.
            def charged(peer: str, reasons: set[str]) -> bool:
                return all(any(c[:2] == (n.peer_id, peer) and c[2] in reasons for c in charges) for n in deciders)

            await wait_until(
                lambda: (
                    charged(relay.peer_id, {"batch_sender", "batch_unserved"})
                    and charged(mute.peer_id, {"batch_unserved"})
                ),
                60,
                poll=0.2,
                what="both thieves charged at every deciding node",
            )
            assert any(c[1:] == (relay.peer_id, "batch_sender") for c in charges)
            assert asked["relay"] >= 1 and asked["mute"] >= 1
            relay_votes = [r for r in trainer.ledger.votes(stolen) if r.worker == relay.peer_id]
            assert not any(r.accept for r in relay_votes)
            assert all("batch_sender" in r.reason for r in relay_votes), relay_votes

            # a third thief announces the admitted batch later: refused unfetched, charged
            await late.gossip.publish(
                RolloutAnnounce(
                    batch_id=stolen,
                    policy_version=rec.policy_version,
                    batch_counter=rec.batch_counter,
                    num_samples=genesis.genesis.prompts_per_batch * genesis.genesis.group_size,
                    size_bytes=len(relayed[stolen]),
                )
            )
            await wait_until(lambda: everywhere(late.peer_id, stolen), 30, poll=0.05, what="the late announce handled")
            assert asked["late"] == 0
            for n in deciders:
                assert (n.peer_id, late.peer_id, "batch_stolen") in charges, n.peer_id
            assert trainer.stolen_announces >= 1 and all(v.stolen_announces >= 1 for v in validators)
            assert trainer.ledger.batch(stolen).status == "admitted"

            # the owner pays nothing: no charge, no strike, no reject vote, no ban anywhere
            assert not [c for c in charges if c[1] == me], charges
            for v in validators:
                assert v.strikes[me] == 0 and not v.node.standing.is_banned(me)
            assert honest.stats["reject_votes"] == 0 and honest.stats["batches_rejected"] == 0
            assert honest.stats["batches_accepted"] >= 1
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ a flood fills the fetch lane


class _LaneNode:
    """What a validator's intake and fetch path need from a node: a policy, gossip that
    records votes, and request/response where flooders' fetches hang until ``release``
    and then fail (never served), while the honest worker serves its signed batch."""

    def __init__(self, batches: dict[tuple[str, bytes], bytes]) -> None:
        import types

        self.standing = PeerStanding()
        self.peer_id = "validator"
        self.batches = batches
        self.requests: list[tuple[str, bytes]] = []
        self.release = trio.Event()
        self.reqresp = types.SimpleNamespace(request=self._request)
        self.gossip = types.SimpleNamespace(publish=self._publish)
        self.published: list[object] = []

    async def _request(self, peer_id, msg, expect, timeout=10.0, redial=False):
        self.requests.append((peer_id, msg.batch_id))
        raw = self.batches.get((peer_id, msg.batch_id))
        if raw is None:
            await self.release.wait()
            raise RequestError("timeout", "never served")
        await trio.lowlevel.checkpoint()
        return Envelope(b"", BatchResponse.TYPE_ID, peer_id, 0, 0, BatchResponse(found=True, envelope=raw), b"")

    async def _publish(self, msg) -> None:
        self.published.append(msg)


def _announce_env(sender: str, ann: RolloutAnnounce, seq: int, run_id: bytes) -> Envelope:
    return Envelope(run_id, RolloutAnnounce.TYPE_ID, sender, int(time.time() * 1000), seq, ann, b"")


async def test_a_flood_that_fills_the_fetch_lane_sheds_an_honest_announce_without_forgetting_it(tmp_path):
    """Fresh identities fill a validator's unproven fetch lane (one announce each, fetches that
    hang). A one-identity flooder holding its whole share gives a newcomer a place at once; an
    honest announce arriving while every place is held by a different identity is shed, but not
    remembered as seen, so the worker's re-announce gets in once the flood's fetches fail and is
    fetched from it. Every flooder fetched is charged, the worker never; a thief announcing the
    worker's batch once it was fetched is charged and struck without a fetch."""
    from harness.messages import signed_batch
    from harness.roles import tiny_context
    from node.home import NodeHome
    from node.roles.intake import MAX_PENDING_PER_ANNOUNCER
    from node.roles.validator import ValidatorRole

    ctx = tiny_context(tmp_path / "ctx")
    run_id = ctx.genesis.run_id
    home = NodeHome(tmp_path / "home")
    home.path.mkdir(parents=True)
    role = ValidatorRole(home, ctx, fetchers=2, queue=8)  # unproven lane: 4 places, 1 fetch task on it
    honest = NodeKey(b"\x71" * 32)
    raw, ann = signed_batch(honest, run_id, 0)
    raw2, ann2 = signed_batch(honest, run_id, 1)
    node = role.node = _LaneNode({(honest.peer_id, ann.batch_id): raw, (honest.peer_id, ann2.batch_id): raw2})
    # a fetched batch waits for a prefill in the verify queue, whose loop this test does not run
    # (the lane and the fetch are under test, not the model checks)
    role.weights.held = lambda version: True
    seq = iter(range(1, 10_000))

    def fake(i: int) -> RolloutAnnounce:
        return RolloutAnnounce(
            batch_id=(10_000 + i).to_bytes(32, "big"), policy_version=0, batch_counter=i, num_samples=1, size_bytes=1
        )

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            role._nursery = nursery
            for _ in range(role.n_fetchers):
                nursery.start_soon(role._fetch_loop)
            # one identity with many announces holds at most its share ...
            flooder = NodeKey.generate().peer_id
            for i in range(20):
                role._on_announce(_announce_env(flooder, fake(i), next(seq), run_id))
            await trio.testing.wait_all_tasks_blocked()
            assert role.intake.queue.held(flooder) == MAX_PENDING_PER_ANNOUNCER - 1  # one is being fetched
            # ... and gives a newcomer a place from it: the worker's second batch gets in at once
            role._on_announce(_announce_env(honest.peer_id, ann2, next(seq), run_id))
            assert role.intake.queue.held(honest.peer_id) == 1 and role.intake.displaced == 0
            # fresh identities, one announce each, take every other place
            for i in range(8):
                role._on_announce(_announce_env(NodeKey.generate().peer_id, fake(100 + i), next(seq), run_id))
            assert role.intake.displaced >= 2  # the flooder's extra announces gave way, not the worker's
            assert role.intake.queue.held(honest.peer_id) == 1 and role.intake.queue.held(flooder) <= 1
            # the worker's first batch now arrives at a lane whose every place is held by another
            # identity holding one: shed, and not remembered
            dropped = role.dropped_announces
            role._on_announce(_announce_env(honest.peer_id, ann, next(seq), run_id))
            assert role.intake.queue.held(honest.peer_id) == 1
            assert role.dropped_announces == dropped + 1
            assert (honest.peer_id, ann.batch_id) not in role._seen
            # the flood's fetches fail (each flooder charged); the lane drains
            node.release.set()
            await wait_until(lambda: len(role.intake) == 0, 20, poll=0.05, what="the lane drained")
            assert (honest.peer_id, ann2.batch_id) in node.requests  # the newcomer's place was fetched
            fetched_flooders = {p for p, _ in node.requests if p != honest.peer_id}
            assert len(fetched_flooders) >= 3
            assert all(node.standing.points(p) > 0 for p in fetched_flooders)
            # the worker announces its first batch again: queued and fetched from the worker
            role._on_announce(_announce_env(honest.peer_id, ann, next(seq), run_id))
            await wait_until(
                lambda: (honest.peer_id, ann.batch_id) in node.requests, 20, poll=0.05, what="the re-announce fetched"
            )
            assert node.standing.points(honest.peer_id) == 0
            # a thief announcing the worker's batch now is charged without a fetch
            thief = NodeKey.generate().peer_id
            before = len(node.requests)
            role._on_announce(_announce_env(thief, ann, next(seq), run_id))
            await trio.testing.wait_all_tasks_blocked()
            assert len(node.requests) == before and node.standing.points(thief) > 0
            assert role.strikes[thief] == 1 and role.stolen_announces == 1
            assert not any(isinstance(m, Vote) and not m.accept and m.worker == honest.peer_id for m in node.published)
            nursery.cancel_scope.cancel()


async def test_the_trainer_sheds_a_flooded_announce_without_forgetting_it_and_refuses_copies(tmp_path, monkeypatch):
    """The trainer's intake, the same way: fresh identities fill its unproven lane with batches
    they never serve; the worker's announce is shed (not remembered), its re-announce is
    fetched once the flood's fetches fail and its batch is recorded as the worker's. Then a
    thief announcing that id is charged without a fetch; the worker is never charged."""
    from harness.messages import signed_batch
    from harness.roles import tiny_context
    from node.home import NodeHome
    from node.roles import trainer as trainer_mod
    from node.roles.intake import AnnounceIntake

    real_sleep = trio.sleep

    async def fast_sleep(s):  # the trainer waits 1 s before its second attempt; keep the test short
        await real_sleep(min(s, 0.01))

    monkeypatch.setattr(trainer_mod.trio, "sleep", fast_sleep)
    ctx = tiny_context(tmp_path / "ctx")
    run_id = ctx.genesis.run_id
    home = NodeHome(tmp_path / "home")
    home.path.mkdir(parents=True)
    role = trainer_mod.TrainerRole(home, ctx)
    # a small lane (4 unproven places, one fetch on them), built as the trainer builds its own
    role.intake = AnnounceIntake(8, 1, hold_while_fetching=True, on_evicted=role._unqueue)
    honest = NodeKey(b"\x71" * 32)
    raw, ann = signed_batch(honest, run_id, 0)
    node = role.node = _LaneNode({(honest.peer_id, ann.batch_id): raw})
    seq = iter(range(1, 10_000))
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(trainer_mod.FETCH_TASKS):
                nursery.start_soon(role._fetch_loop)
            flood = [NodeKey.generate().peer_id for _ in range(5)]
            for i, s in enumerate(flood):
                bogus = RolloutAnnounce(
                    batch_id=(20_000 + i).to_bytes(32, "big"),
                    policy_version=0,
                    batch_counter=0,
                    num_samples=1,
                    size_bytes=1,
                )
                role._on_announce(_announce_env(s, bogus, next(seq), run_id))
                await trio.testing.wait_all_tasks_blocked()
            assert len(role.intake) == 4  # one being fetched (hanging), four places held
            dropped = role.dropped_announces
            role._on_announce(_announce_env(honest.peer_id, ann, next(seq), run_id))
            assert role.dropped_announces == dropped + 1 and (honest.peer_id, ann.batch_id) not in role._queued
            node.release.set()
            await wait_until(lambda: len(role.intake) == 0 and not role._queued, 20, poll=0.05, what="the lane drained")
            assert all(node.standing.points(s) > 0 for s in flood)  # every flooder charged
            role._on_announce(_announce_env(honest.peer_id, ann, next(seq), run_id))  # the re-announce
            await wait_until(lambda: role.ledger.owner(ann.batch_id) is not None, 20, poll=0.05, what="recorded")
            assert role.ledger.batch(ann.batch_id).worker == honest.peer_id
            thief = NodeKey.generate().peer_id
            before = len(node.requests)
            role._on_announce(_announce_env(thief, ann, next(seq), run_id))
            assert len(node.requests) == before and node.standing.points(thief) > 0 and role.stolen_announces == 1
            assert node.standing.points(honest.peer_id) == 0
            nursery.cancel_scope.cancel()


async def test_a_fetch_that_failed_is_retried_on_the_workers_next_announce(tmp_path):
    """A validator's fetch of an honest batch times out (a loaded link): the worker is charged
    for it, and its re-announce of the undecided batch is fetched again (the announce was kept
    as seen, and the batch stayed pending at the trainer for good: a quorum needs this vote).
    Control: a batch whose fetch succeeded is not fetched again when announced again."""
    from harness.messages import signed_batch
    from harness.roles import tiny_context
    from node.home import NodeHome
    from node.roles.validator import ValidatorRole

    ctx = tiny_context(tmp_path / "ctx")
    run_id = ctx.genesis.run_id
    home = NodeHome(tmp_path / "home")
    home.path.mkdir(parents=True)
    role = ValidatorRole(home, ctx, fetchers=2, queue=8)
    honest = NodeKey(b"\x72" * 32)
    raw, ann = signed_batch(honest, run_id, 0)
    raw2, ann2 = signed_batch(honest, run_id, 1)
    node = role.node = _LaneNode({(honest.peer_id, ann2.batch_id): raw2})  # the first: not served yet
    node.release.set()  # a request for what the worker does not serve fails at once ("timeout")
    role.weights.held = lambda version: True  # the verify loop is not under test (see above)
    seq = iter(range(1, 10_000))

    def fetches(batch_id: bytes) -> int:
        return sum(1 for p, b in node.requests if (p, b) == (honest.peer_id, batch_id))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            role._nursery = nursery
            for _ in range(role.n_fetchers):
                nursery.start_soon(role._fetch_loop)
            role._on_announce(_announce_env(honest.peer_id, ann, next(seq), run_id))
            role._on_announce(_announce_env(honest.peer_id, ann2, next(seq), run_id))
            await wait_until(lambda: fetches(ann.batch_id) == 1 and fetches(ann2.batch_id) == 1, 20, poll=0.05)
            await wait_until(lambda: role.fetch_failures == 1, 20, poll=0.05, what="the failed fetch")
            assert node.standing.points(honest.peer_id) > 0  # unserved is charged, as ever
            # the worker now serves it (the link recovered) and announces it again: fetched
            node.batches[(honest.peer_id, ann.batch_id)] = raw
            role._on_announce(_announce_env(honest.peer_id, ann, next(seq), run_id))
            await wait_until(lambda: fetches(ann.batch_id) == 2, 20, poll=0.05, what="the re-announce fetched")
            await wait_until(lambda: len(role.intake) == 0, 20, poll=0.05, what="the lane drained")
            assert role.fetch_failures == 1
            # control: the batch fetched the first time is not fetched again on a repeat announce
            role._on_announce(_announce_env(honest.peer_id, ann2, next(seq), run_id))
            await trio.testing.wait_all_tasks_blocked()
            assert fetches(ann2.batch_id) == 1
            nursery.cancel_scope.cancel()
