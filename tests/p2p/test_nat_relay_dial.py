"""A relayed dial shares the caller's deadline between the peer's relays.

A NAT'd peer advertises one circuit address per relay it holds a reservation on. A relay
that swallows the dial (it went away behind a silent firewall, or it sits behind a NAT it
does not know about) used to take the caller's whole deadline, so the next, working relay
never got a turn and the peer looked unreachable. Real libp2p nodes on loopback: a relay
(public), a target that holds a reservation on it (forced private), a dialer; the first
circuit address leads to a TCP listener that accepts and never answers.
"""

from __future__ import annotations

import trio
from libp2p.peer.id import ID

from node.p2p.nat import NatConfig
from node.p2p.testing import NodeFactory, wait_until
from protocol import NodeKey

DEADLINE_S = 10.0  # the caller's (the connection manager passes its dial timeout)


async def _black_hole(task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A TCP listener that accepts connections and never sends a byte."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    held = []
    async with listeners[0]:
        while True:
            held.append(await listeners[0].accept())


def _nat(mode: str) -> NatConfig:
    return NatConfig(mode=mode, hole_punch=False, first_check_s=0.1)


async def test_a_silent_relay_does_not_take_the_whole_deadline(net: NodeFactory):
    relay = await net.start(nat=_nat("public"))
    # The hosts' own dial timeout is long: only the shared deadline can move the dial on.
    target = await net.start(nat=_nat("private"), target_peers=1, dial_timeout_s=60.0)
    dialer = await net.start(nat=_nat("public"), target_peers=1, dial_timeout_s=60.0)
    assert target.nat is not None and dialer.nat is not None
    await wait_until(lambda: relay.peer_id in target.nat.relays, what="the target's reservation")
    good = target.nat.relays[relay.peer_id][0]
    port = await net.nursery.start(_black_hole)
    silent = f"/ip4/127.0.0.1/tcp/{port}/p2p/{NodeKey.generate().peer_id}/p2p-circuit"

    with trio.fail_after(DEADLINE_S):
        await dialer.nat.dial_via_relay(target.peer_id, [silent, good])
    assert dialer.host is not None
    assert dialer.host.get_network().get_connections(ID.from_base58(target.peer_id))
    assert dialer.peer_id in target.nat.relayed_peers() or target.peer_id in dialer.nat.relayed_peers()
    assert dialer.nat.relay_dials == {"ok": 1, "failed": 0}
