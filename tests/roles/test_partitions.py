"""Network partitions (issue 8): the in-process transport fault layer (node/p2p/faults.py)
cuts real libp2p nodes into two halves; after the heal the network converges."""

from __future__ import annotations

import json

import pytest
import trio

from harness.genesis import TRAINER, tiny_genesis
from harness.roles import homes
from node.p2p.faults import Partition
from node.p2p.reqresp import RequestError
from node.p2p.testing import NodeFactory, collect_tags, tagged_announce, wait_until
from node.roles.context import RunContext
from node.roles.trainer import TrainerRole
from node.roles.validator import ValidatorRole
from node.roles.worker import WorkerRole
from protocol import NodeKey, PeerExchangeRequest, PeerExchangeResponse, RolloutBatch, open_envelope, sha256

VALIDATORS = [NodeKey(bytes([0x31 + i]) * 32) for i in range(3)]
WORKERS = [NodeKey(bytes([0x35 + i]) * 32) for i in range(3)]


def crossing_links(a, b) -> list[tuple[str, str]]:
    """Connections (either direction) between a node of ``a`` and a node of ``b``."""
    ids_b = {n.peer_id for n in b}
    return [(n.peer_id, p) for n in a for p in n.conns.connected() if p in ids_b]


async def test_a_cut_stops_dials_requests_and_gossip_and_a_heal_reconnects_even_at_target(nursery):
    # target_peers=2: after the cut each half is a complete graph of 3 at target, so nobody
    # is below target when the links come back; only the probe of unheard peers rejoins them.
    net = NodeFactory(nursery, heartbeat_interval_s=1.0, forget_after_s=4.0, target_peers=2, probe_interval_s=2.0)
    nodes = [await net.start() for _ in range(6)]
    await net.wait_connected(min_peers=2)
    part = Partition()
    for n in nodes:
        part.install(n)
    a, b = nodes[:3], nodes[3:]
    part.cut([n.peer_id for n in a], [n.peer_id for n in b])

    await wait_until(
        lambda: not crossing_links(a, b) and not crossing_links(b, a),
        15,
        poll=0.2,
        what="every connection across the cut closed",
    )
    # each half forgets the other (no heartbeat crosses) and stays connected inside
    await wait_until(
        lambda: all(not ({m.peer_id for m in b} & set(n.swarm.peers())) for n in a),
        20,
        poll=0.2,
        what="the first half to forget the second",
    )
    await wait_until(
        lambda: all(len(n.conns.connected()) >= 2 for n in nodes), 20, poll=0.2, what="each half connected inside"
    )
    with_tags = collect_tags(nodes)
    await a[1].gossip.publish(tagged_announce(1))
    await wait_until(
        lambda: all(1 in with_tags[n.peer_id] for n in a if n is not a[1]), 10, what="gossip inside the first half"
    )
    try:
        await a[0].reqresp.request(b[0].peer_id, PeerExchangeRequest(max_peers=4), PeerExchangeResponse, timeout=5)
    except RequestError as exc:
        assert exc.code == "unreachable"
    else:
        raise AssertionError("a request crossed the cut")
    await trio.sleep(2.0)
    assert not any(1 in with_tags[n.peer_id] for n in b), "gossip crossed the cut"
    assert not crossing_links(a, b) and not crossing_links(b, a), "a connection was re-made across the cut"

    part.heal()
    await wait_until(
        lambda: crossing_links(a, b) or crossing_links(b, a),
        30,
        poll=0.2,
        what="a connection across the healed cut (probe of unheard peers)",
    )
    await wait_until(
        lambda: all({m.peer_id for m in nodes} - {n.peer_id} <= set(n.swarm.peers()) for n in nodes),
        30,
        poll=0.2,
        what="every node to hear every other again",
    )
    await b[2].gossip.publish(tagged_announce(2))
    await wait_until(
        lambda: all(2 in with_tags[n.peer_id] for n in nodes if n is not b[2]), 15, what="gossip across the healed cut"
    )
    assert sum(n.conns.probes for n in nodes) >= 1
    nursery.cancel_scope.cancel()


def genesis_3x3(steps: int):
    return tiny_genesis(fields={"name": "partition", "validators": VALIDATORS}, steps=steps, batches_per_step=1)


def newest(role) -> int:
    return role.checkpoints.newest_version() if role.checkpoints is not None else -1


@pytest.mark.slow  # ~20 s on two quiet cores: the slow tier (README)
async def test_a_network_cut_in_two_halves_converges_after_the_heal(tmp_path):
    """Half A (bootstrap, trainer, two validators, one worker) keeps training through the cut
    and finishes its steps; half B (a validator, two workers) is stranded on old versions.
    After the heal every node holds the final version and the ledger has no duplicate."""
    final = 4
    genesis = genesis_3x3(steps=final)
    ctx = RunContext.from_genesis(genesis.genesis, tmp_path / "cache")
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            # production heartbeat interval (see test_roles_network.py); probes every 3 s so
            # the heal does not wait for the production 30 s
            net = NodeFactory(
                nursery,
                genesis=genesis,
                heartbeat_interval_s=2.0,
                forget_after_s=10.0,
                target_peers=3,
                probe_interval_s=3.0,
            )
            boot = await net.start()
            trainer = TrainerRole(homes(tmp_path, "trainer"), ctx)
            await net.start(hook=trainer, key=TRAINER)
            validators = []
            for i, k in enumerate(VALIDATORS):
                validators.append(ValidatorRole(homes(tmp_path, f"validator-{i}"), ctx))
                await net.start(hook=validators[-1], key=k)
            workers = []
            for i, k in enumerate(WORKERS):
                workers.append(WorkerRole(homes(tmp_path, f"worker-{i}"), ctx))
                await net.start(hook=workers[-1], key=k)
            roles = [trainer, *validators, *workers]
            # everyone in one network first: the first version reached every node
            await wait_until(
                lambda: all(newest(r) >= 0 for r in roles), 120, poll=0.2, what="version 0 everywhere before the cut"
            )

            # the Nodes behind the roles' services (the partition reaches into their hosts)
            half_a = [boot, *map(net.node_of, (trainer.node, validators[0].node, validators[1].node, workers[0].node))]
            half_b = [net.node_of(r.node) for r in (validators[2], workers[1], workers[2])]
            part = Partition()
            for n in half_a + half_b:
                part.install(n)
            part.cut([n.peer_id for n in half_a], [n.peer_id for n in half_b])
            at_cut = trainer.version
            await wait_until(
                lambda: not crossing_links(half_a, half_b) and not crossing_links(half_b, half_a),
                15,
                poll=0.2,
                what="the cut",
            )
            # A has a quorum (2 of 3 validators) and a worker: it trains to the end alone
            await wait_until(lambda: trainer.version >= final, 180, poll=0.2, what="half A to finish training")
            assert at_cut <= final - 2, "half A made fewer than two versions alone"
            stranded = [validators[2], workers[1], workers[2]]
            assert all(newest(r) < final for r in stranded), "the final version crossed the cut"
            assert not crossing_links(half_a, half_b) and not crossing_links(half_b, half_a)

            part.heal()
            # the trainer re-announces its newest version; B's nodes fetch it from whoever holds it
            await wait_until(
                lambda: all(newest(r) == final for r in roles),
                90,
                poll=0.2,
                what="the final version on every node after the heal",
            )
            await wait_until(
                lambda: all(w.loaded_version == final for w in workers),
                30,
                poll=0.2,
                what="every worker on the final version",
            )
            assert trainer.version == final

            # No duplicate admission. The ledger's unique index covers only its own columns of the
            # rows admitted now, so judge from the bytes instead: open every batch ever admitted
            # (aged-out ones too; the ledger keeps their bytes) and read the slot its worker signed.
            admitted = trainer.ledger.records(ever_admitted=True)
            assert admitted
            signed_slots = []
            for rec in admitted:
                assert rec.envelope is not None and sha256(rec.envelope) == rec.batch_id, (
                    "an admitted batch lost its bytes"
                )
                env = open_envelope(
                    rec.envelope,
                    run_id=genesis.genesis.run_id,
                    now_ms=0,
                    guard=None,
                    allowed_types={RolloutBatch.TYPE_ID},
                )
                batch = env.body
                slot = (env.sender, batch.policy_version, batch.batch_counter)
                assert slot == (rec.worker, rec.policy_version, rec.batch_counter), (
                    "the ledger's slot is not the one the worker signed"
                )
                signed_slots.append(slot)
                assert len(trainer.ledger.accept_voters(rec.batch_id)) >= genesis.genesis.quorum
            assert len(signed_slots) == len(set(signed_slots)), "the same owed prompts were admitted twice"
            # every refusal as a duplicate names a slot that is admitted exactly once
            for rec in trainer.ledger.records(status="rejected"):
                if rec.reason.startswith("duplicate slot"):
                    assert signed_slots.count((rec.worker, rec.policy_version, rec.batch_counter)) == 1
            # every step trained once, in order
            rows = [json.loads(line) for line in (trainer.home.metrics_path).read_text().splitlines()]
            steps = [r["step"] for r in rows if not r.get("skipped")]
            assert steps == sorted(set(steps))
            nursery.cancel_scope.cancel()
