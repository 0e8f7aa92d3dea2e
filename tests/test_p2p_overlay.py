"""12 nodes in one trio process: exactly-once delivery, healing after 4 deaths, restart identity."""

from __future__ import annotations

import pytest
import trio

from node.p2p.testing import NodeFactory, collect_tags as collect, tagged_announce, wait_until
from protocol import NodeKey, RolloutAnnounce


def vote(tag: int, worker: str) -> RolloutAnnounce:
    return tagged_announce(tag)


async def publish_round(nodes, base: int) -> set[int]:
    tags = set()
    for i, n in enumerate(nodes):
        tag = base + i
        tags.add(tag)
        await n.gossip.publish(vote(tag, n.peer_id))
    return tags


def delivered(got, nodes, tags_by_publisher) -> bool:
    for n in nodes:
        want = set().union(*(t for pid, t in tags_by_publisher.items() if pid != n.peer_id))
        if not want <= set(got[n.peer_id]):
            return False
    return True


async def test_twelve_nodes_exactly_once_then_heal_after_four_die():
    with trio.fail_after(150):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery)
            nodes = [await net.start() for _ in range(12)]
            boot = nodes[0]
            await net.wait_connected(min_peers=3)
            got = collect(nodes)

            by_pub = {}
            for i, n in enumerate(nodes):
                by_pub[n.peer_id] = {1000 + i}
                await n.gossip.publish(vote(1000 + i, n.peer_id))
            await wait_until(lambda: delivered(got, nodes, by_pub), 30, what="every message at every node")
            await trio.sleep(1.5)  # late duplicates would show up here
            for n in nodes:
                assert sorted(got[n.peer_id]) == sorted(1000 + i for i, m in enumerate(nodes) if m is not n), n.peer_id

            # kill 4 nodes, the bootstrap among them
            dead = [boot, nodes[3], nodes[6], nodes[9]]
            for d in dead:
                net.kill(d)
            survivors = [n for n in nodes if n not in dead]
            dead_ids = {d.peer_id for d in dead}
            # bounded time: survivors forget the dead and re-mesh among themselves
            await wait_until(
                lambda: all(not (dead_ids & set(n.conns.connected())) for n in survivors), 30, what="dead peers dropped"
            )
            await net.wait_connected(survivors, min_peers=2, timeout=60)
            for pid in got:
                got[pid].clear()
            by_pub = {n.peer_id: {5000 + i} for i, n in enumerate(survivors)}
            for i, n in enumerate(survivors):
                await n.gossip.publish(vote(5000 + i, n.peer_id))
            await wait_until(lambda: delivered(got, survivors, by_pub), 30, what="delivery after healing")
            await trio.sleep(1.0)
            for n in survivors:
                assert len(got[n.peer_id]) == len(set(got[n.peer_id])) == len(survivors) - 1
            nursery.cancel_scope.cancel()


async def test_restart_with_same_key_keeps_peer_id_and_rejoins():
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery)
            nodes = [await net.start() for _ in range(4)]
            key = NodeKey(nodes[2].key.seed)
            old_id = nodes[2].peer_id
            net.kill(nodes[2])
            await wait_until(lambda: all(old_id not in n.conns.connected() for n in net.nodes), 20, what="the old node gone")
            again = await net.start(key=key)
            assert again.peer_id == old_id
            await net.wait_connected(min_peers=2)
            got = collect(net.nodes)
            await net.nodes[0].gossip.publish(vote(7, net.nodes[0].peer_id))
            await wait_until(lambda: got[old_id] == [7], 20, what="the restarted node to receive")
            # and its own messages are not mistaken for old ones
            await again.gossip.publish(vote(8, old_id))
            await wait_until(lambda: all(8 in got[n.peer_id] for n in net.nodes if n is not again), 20, what="others to hear it")
            nursery.cancel_scope.cancel()


async def test_restart_same_home_same_peer_id(tmp_path):
    from node.home import NodeHome

    home = NodeHome(tmp_path / "h")
    k1 = home.init()
    k2 = NodeHome(tmp_path / "h").load_key()
    assert k1.peer_id == k2.peer_id
    from node.p2p.host import make_host

    assert make_host(k2).get_id().to_base58() == k1.peer_id
