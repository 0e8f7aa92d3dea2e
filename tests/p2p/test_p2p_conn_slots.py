"""A node outlives its connections (issue 30, point 2): inbound slots come back when a
connection closes, and one IP address or one peer id cannot fill the connection table.

py-libp2p 0.8.1 kept an inbound slot until the whole swarm stopped: after 250 connections,
however short-lived, every inbound connection was refused and joins failed
(node/p2p/connlimits.py has the mechanism and the patch). Every connection here is real TCP
with a Noise handshake and yamux on top; only the accept-rate bucket runs on a simulated clock,
advanced by 1/rate per connection, so 2,000 connections arrive at exactly the documented rate
without 200 s of waiting.
"""

from __future__ import annotations

import pytest
import trio
from libp2p.peer.id import ID

from harness.clocks import StepClock, pace_accepts_of
from node.p2p import connlimits
from node.p2p import host as host_mod
from node.p2p.connlimits import connection_stats, trio_task_count
from node.p2p.host import closing_host, make_host, parse_peer_addr
from node.p2p.node import fetch_genesis
from node.p2p.testing import NodeFactory, wait_until
from protocol import NodeKey

CYCLES = 2000
CLIENTS = 8  # concurrent dialers, each with its own identity (one connection each at a time)


def pace_accepts(node, clock: StepClock) -> None:
    """Give ``node``'s accept-rate bucket the simulated clock (same rate and burst as ever)."""
    pace_accepts_of(node.host, clock)


async def open_close_cycles(target_addr: str, cycles: int, clock: StepClock) -> int:
    """Open and close ``cycles`` Noise connections to ``target_addr`` at the accept rate."""
    info = parse_peer_addr(target_addr)
    done = 0
    counter = iter(range(cycles))

    async def dialer(client) -> None:
        nonlocal done
        net = client.get_network()
        for _ in counter:
            clock.now += 1.0 / host_mod.INBOUND_CONNECTIONS_PER_S
            with trio.fail_after(15):
                await client.connect(info)
                assert net.get_connections(info.peer_id), "connect returned without a connection"
                await net.close_peer(info.peer_id)
            done += 1

    clients = [make_host(NodeKey.generate()) for _ in range(CLIENTS)]
    async with trio.open_nursery() as nursery:
        for client in clients:

            async def run_one(client=client) -> None:
                async with closing_host(client, ["/ip4/127.0.0.1/tcp/0"]):
                    await dialer(client)

            nursery.start_soon(run_one)
    return done


@pytest.mark.slow  # ~60 s on two quiet cores: the slow tier (README)
async def test_2000_connections_come_and_go_at_the_accept_rate_then_a_real_node_joins():
    with trio.fail_after(900):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery)
            boot = await net.start()
            clock = StepClock()
            pace_accepts(boot, clock)
            tasks_before = trio_task_count()

            assert await open_close_cycles(boot.full_addrs()[0], CYCLES, clock) == CYCLES

            # every slot came back, nothing was refused, and no handler task stayed behind
            await wait_until(
                lambda: connection_stats(boot.host)["inbound_slots_held"] == 0, 30, what="inbound slots released"
            )
            stats = connection_stats(boot.host)
            assert stats["inbound"] == 0 and stats["busiest_ip"] == 0, stats
            assert sum(stats["refused"].values()) == 0, stats
            assert trio_task_count() <= tasks_before + 20, (tasks_before, trio_task_count())

            # the normal join path: fetch the genesis from the bootstrap, then start a node on it
            signed = await fetch_genesis(NodeKey.generate(), boot.full_addrs(), timeout=10)
            assert signed == boot.signed_genesis
            joiner = await net.start()
            await wait_until(
                lambda: boot.peer_id in joiner.conns.connected() and boot.swarm.knows(joiner.peer_id),
                30,
                what="the joiner connected and heard by the bootstrap",
            )
            nursery.cancel_scope.cancel()


async def test_outbound_slots_come_back_too():
    """A host dials out and hangs up more often than the library's 300-connection table holds
    (8 targets, 40 each); every dial works (outbound slots are counted live, not held). Bare
    hosts from make_host: a node's own managers would dial the same peers concurrently."""
    dialer = make_host(NodeKey.generate())
    targets = [make_host(NodeKey.generate()) for _ in range(8)]
    swarm = dialer.get_network()

    async def cycles(target, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with closing_host(target, ["/ip4/127.0.0.1/tcp/0"]):
            pace_accepts_of(target, StepClock(), step=True)
            task_status.started()
            info = parse_peer_addr(f"{target.get_addrs()[0]}")
            for _ in range(40):
                with trio.fail_after(15):
                    await dialer.connect(info)
                    await swarm.close_peer(info.peer_id)

    with trio.fail_after(300):
        async with closing_host(dialer, ["/ip4/127.0.0.1/tcp/0"]):
            async with trio.open_nursery() as nursery:
                for t in targets:
                    nursery.start_soon(cycles, t)
            assert not swarm.get_connections()
            last = make_host(NodeKey.generate())
            async with closing_host(last, ["/ip4/127.0.0.1/tcp/0"]):
                with trio.fail_after(15):
                    await dialer.connect(parse_peer_addr(f"{last.get_addrs()[0]}"))
                assert len(swarm.get_connections()) == 1


async def _raw_socket_from(ip: str, port: int) -> trio.SocketStream:
    sock = trio.socket.socket()
    await sock.bind((ip, 0))
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


async def test_one_ip_address_holds_at_most_its_share_and_an_honest_node_still_joins():
    """127.0.0.2 opens sockets and never handshakes: beyond MAX_INBOUND_PER_IP each is closed
    unread (no Noise work); a node dialling from 127.0.0.1 joins meanwhile."""
    limit = connlimits.MAX_INBOUND_PER_IP
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery)
            boot = await net.start()
            clock = StepClock()
            pace_accepts(boot, clock)  # the accept rate is not under test here
            port = int(boot.full_addrs()[0].split("/tcp/")[1].split("/")[0])
            held = []
            for _ in range(limit):
                clock.now += 1.0
                held.append(await _raw_socket_from("127.0.0.2", port))
            await wait_until(lambda: connection_stats(boot.host)["busiest_ip"] == limit, 20, what="slots taken")
            extra = []
            for _ in range(5):
                clock.now += 1.0
                extra.append(await _raw_socket_from("127.0.0.2", port))
            for s in extra:  # closed by the node without a byte: EOF
                with trio.fail_after(10):
                    assert await s.receive_some(1) == b""
            stats = connection_stats(boot.host)
            assert stats["refused"].get("per_ip") == 5 and stats["refused"]["rate"] == 0, stats
            assert stats["busiest_ip"] == limit, stats
            # the operator sees it: status and /metrics
            assert boot.status()["connections"]["refused"]["per_ip"] == 5
            from prometheus_client import generate_latest

            assert b'primenode_connections_refused_total{reason="per_ip"} 5.0' in generate_latest(boot.metrics.registry)

            # honest control, from another address, while the hoarder still holds its share
            joiner = await net.start()
            await wait_until(lambda: boot.peer_id in joiner.conns.connected(), 30, what="the honest node connected")
            assert connection_stats(boot.host)["refused"].get("per_ip") == 5
            for s in held + extra:
                await s.aclose()
            await wait_until(
                lambda: connection_stats(boot.host)["busiest_ip"] <= 1, 20, what="the hoarder's slots released"
            )
            nursery.cancel_scope.cancel()


async def test_one_peer_id_holds_at_most_max_connections_per_peer():
    """Three swarms under one key dial the node: the third connection is refused after the
    handshake (the id is not known before it) and never registered; another peer gets in."""
    limit = connlimits.MAX_CONNECTIONS_PER_PEER
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery)
            boot = await net.start()
            pace_accepts(boot, StepClock())
            info = parse_peer_addr(boot.full_addrs()[0])
            swarm = boot.host.get_network()
            key = NodeKey.generate()
            attacker = ID.from_base58(key.peer_id)
            async with trio.open_nursery() as hosts:
                clones = [make_host(key) for _ in range(limit + 1)]
                started = trio.Event()
                count = 0

                async def run_clone(h) -> None:
                    nonlocal count
                    async with closing_host(h, ["/ip4/127.0.0.1/tcp/0"]):
                        count += 1
                        if count == len(clones):
                            started.set()
                        await trio.sleep_forever()

                for h in clones:
                    hosts.start_soon(run_clone, h)
                await started.wait()
                for h in clones[:limit]:
                    with trio.fail_after(15):
                        await h.connect(info)
                await wait_until(lambda: len(swarm.get_connections(attacker)) == limit, 10, what="both accepted")
                try:
                    with trio.fail_after(15):
                        await clones[limit].connect(info)
                except Exception:
                    pass  # refused during or right after the handshake: either way it must not register
                await wait_until(
                    lambda: connection_stats(boot.host)["refused"].get("per_peer") == 1, 10, what="the third refused"
                )
                assert len(swarm.get_connections(attacker)) == limit
                rcmgr = swarm._resource_manager  # the refused one gave its resource scope back
                assert rcmgr is None or rcmgr._current_connections == limit, rcmgr._current_connections

                # honest control: a different peer id connects while the attacker holds its two
                honest = make_host(NodeKey.generate())
                async with closing_host(honest, ["/ip4/127.0.0.1/tcp/0"]):
                    with trio.fail_after(15):
                        await honest.connect(info)
                    assert swarm.get_connections(honest.get_id())
                hosts.cancel_scope.cancel()
            nursery.cancel_scope.cancel()


async def test_a_full_table_is_trimmed_from_the_busiest_address_first():
    """Four identities from 127.0.0.2, then an honest node from 127.0.0.1, in a table of 4:
    the connection manager trims one of the hoarder's (it used to drop the newest: the honest
    node, so one host holding old connections kept every newcomer out)."""
    from multiaddr import Multiaddr

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery)
            boot = await net.start()
            pace_accepts_of(boot.host, StepClock(), step=True)
            boot.conns.max_connections = 4
            dropped: list[str] = []
            disconnect = boot.conns._disconnect

            async def recording(pid: str) -> None:
                dropped.append(pid)
                await disconnect(pid)

            boot.conns._disconnect = recording
            addr = boot.full_addrs()[0]
            info = parse_peer_addr(addr)
            hoarders = [make_host(NodeKey.generate()) for _ in range(4)]
            async with trio.open_nursery() as hosts:
                for h in hoarders:
                    await hosts.start(_serve_host, h)
                for h in hoarders:
                    with trio.fail_after(15):
                        await h.get_network()._dial_addr_single_attempt(
                            Multiaddr(addr.split("/p2p/")[0]), info.peer_id, source=("127.0.0.2", 0)
                        )
                await wait_until(lambda: len(boot.conns.connected()) == 4, 10, what="the hoarder's four connected")
                joiner = await net.start()
                await wait_until(lambda: dropped, 20, what="a trim")
                assert joiner.peer_id not in dropped
                assert set(dropped) <= {h.get_id().to_base58() for h in hoarders}
                assert joiner.peer_id in boot.conns.connected()
                hosts.cancel_scope.cancel()
            nursery.cancel_scope.cancel()


async def _serve_host(host, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with closing_host(host, ["/ip4/127.0.0.1/tcp/0"]):
        task_status.started()
        await trio.sleep_forever()
