"""A generic libp2p relay is kept while we hold a reservation on it; a generic peer is not.

The connection manager drops a peer that carries no primenode gossip after a grace period
(``gossip_grace``, 5 s). A NAT'd node that reserved a slot on a plain libp2p relay (circuit
relay v2 hop, no primenode protocols) used to lose that relay every grace period: the
reservation flapped and the node advertised no address in between. Real hosts on loopback:
a plain py-libp2p relay, a primenode node forced private that reserves on it, and a plain
py-libp2p peer that connects to the node and speaks nothing of ours. The watchdog's clock is
injected and moved past several grace periods (no sleeping through them).
"""

from __future__ import annotations

import logging

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.secp256k1 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.tools.anyio_service import background_trio_service

from node.p2p.nat import NatConfig
from node.p2p.node import RoleHook
from node.p2p.testing import NodeFactory, wait_until

GRACE_PERIODS = 4


class StepClock:
    """A clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.t = trio.current_time()  # where the real clock left the watchdog

    def __call__(self) -> float:
        return self.t


async def _plain_host(nursery: trio.Nursery, *, relay: bool):
    """A py-libp2p host with only the library's own protocols (a relay hop if asked)."""
    host = new_host(key_pair=create_new_key_pair())
    ready = trio.Event()
    done = trio.Event()

    async def _run() -> None:
        async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            if relay:
                limits = RelayLimits(duration=3600, data=1 << 24, max_circuit_conns=8, max_reservations=8)
                proto = CircuitV2Protocol(host, limits=limits, allow_hop=True)
                async with background_trio_service(proto):
                    await proto.event_started.wait()
                    ready.set()
                    await done.wait()
            else:
                ready.set()
                await done.wait()
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await host.close()

    nursery.start_soon(_run)
    await ready.wait()
    return host, done


async def _rounds(conns, n: int = 2) -> None:
    """Until the connection manager's loop has gone round ``n`` more times."""
    start = conns.rounds
    await wait_until(lambda: conns.rounds >= start + n, what=f"{n} connection-manager rounds")


async def test_a_relay_we_reserved_on_is_kept_a_generic_peer_is_dropped(net: NodeFactory, caplog):
    caplog.set_level(logging.INFO, logger="node.p2p.connmgr")
    relay, relay_done = await _plain_host(net.nursery, relay=True)
    relay_addr = f"{relay.get_addrs()[0]}"
    if "/p2p/" not in relay_addr:
        relay_addr += f"/p2p/{relay.get_id().to_base58()}"
    relay_id = relay.get_id().to_base58()

    node = await net.start(
        hook=RoleHook(),
        bootstrap=[relay_addr],
        target_peers=1,
        nat=NatConfig(mode="private", relays=1, first_check_s=0.1, hole_punch=False),
    )
    assert node.conns is not None and node.nat is not None and node.gossip is not None
    clock = StepClock()
    node.conns.clock = clock
    await wait_until(lambda: relay_id in node.nat.relays, what="the reservation on the plain relay")
    circuit = node.addrs()
    assert circuit and all(f"/p2p/{relay_id}/p2p-circuit" in a for a in circuit), circuit

    # The honest control's opposite: a plain peer that speaks no primenode protocol.
    generic, generic_done = await _plain_host(net.nursery, relay=False)
    generic_id = generic.get_id().to_base58()
    direct = node.direct_addrs()[0]
    await generic.connect(info_from_p2p_addr(multiaddr.Multiaddr(f"{direct}/p2p/{node.peer_id}")))
    await wait_until(lambda: generic_id in node.conns.connected(), what="the generic peer's connection")
    await _rounds(node.conns)

    for period in range(GRACE_PERIODS):
        clock.t += node.conns.gossip_grace + 1
        await _rounds(node.conns)
        assert relay_id in node.conns.connected(), f"the relay was dropped after {period + 1} grace period(s)"
        assert relay_id in node.nat.relays, "the reservation was lost"
        assert node.addrs() == circuit, "the node stopped advertising its circuit address"
        assert node.make_heartbeat().addrs == tuple(circuit[:8])
        if period == 0:
            await wait_until(lambda: generic_id not in node.conns.connected(), what="the generic peer's drop")

    drops = [r for r in caplog.records if r.name == "node.p2p.connmgr" and "dropping" in r.getMessage()]
    assert len(drops) == 1, [r.getMessage() for r in drops]
    line = drops[0].getMessage()
    assert drops[0].levelno == logging.INFO and "\n" not in line
    assert generic_id in line and "no primenode gossip" in line and "not a primenode node" in line, line
    assert node.conns.dropped_no_gossip == 1
    # Gossip stopped trying to open streams to the relay (identify lists no gossip protocol).
    link = node.gossip._links.get(relay_id)
    assert link is not None and link.foreign
    relay_done.set()
    generic_done.set()
