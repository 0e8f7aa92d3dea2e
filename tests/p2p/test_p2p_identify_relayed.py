"""Identify's observed address: the socket's on a direct connection, none on a relayed one.

py-libp2p 0.8.1 reported ``/p2p/<self>/p2p-circuit/p2p/<remote>`` as the observed address on
a relayed connection; js-libp2p rejects that message, so identify over a relay failed with it
(tests/interop/ shows it against js-libp2p; ``node/p2p/host.py`` has the fix). This test
needs no Node.js: real primenode nodes on loopback, a relay (public), a target holding a
reservation on it (forced private) and a dialer that reaches the target through the relay.
The honest control is the direct connection beside it, which keeps reporting the socket.
"""

from __future__ import annotations

import multiaddr
import trio
from libp2p.identity.identify.identify import ID as IDENTIFY_ID
from libp2p.identity.identify.identify import parse_identify_response
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID

from node.p2p.host import conn_is_relayed
from node.p2p.nat import NatConfig
from node.p2p.node import Node
from node.p2p.testing import NodeFactory, wait_until


def _nat(mode: str) -> NatConfig:
    return NatConfig(mode=mode, hole_punch=False, first_check_s=0.1)


async def identify(asker: Node, peer_id: str, timeout: float = 10.0):
    assert asker.host is not None
    with trio.fail_after(timeout):
        stream = await asker.host.new_stream(ID.from_base58(peer_id), [IDENTIFY_ID])
        data = b""
        try:
            while True:
                data += await stream.read()
        except StreamEOF:
            pass
        await stream.close()
    return parse_identify_response(data)


async def test_identify_sends_no_observed_address_on_a_relayed_connection(net: NodeFactory):
    relay = await net.start(nat=_nat("public"))
    target = await net.start(nat=_nat("private"), target_peers=1)
    dialer = await net.start(nat=_nat("public"), target_peers=1)
    assert target.nat is not None and dialer.nat is not None and dialer.host is not None
    await wait_until(lambda: relay.peer_id in target.nat.relays, what="the target's reservation")
    with trio.fail_after(10):
        await dialer.nat.dial_via_relay(target.peer_id, target.nat.relays[relay.peer_id])
    conns = dialer.host.get_network().get_connections(ID.from_base58(target.peer_id))
    assert conns and all(conn_is_relayed(c) for c in conns)

    relayed = await identify(dialer, target.peer_id)
    assert relayed.public_key  # a real answer...
    assert not relayed.HasField("observed_addr")  # ...with no (and no empty) observed address

    # Honest control: on the dialer's direct connection to the relay, the socket's address.
    direct = await identify(dialer, relay.peer_id)
    seen = str(multiaddr.Multiaddr(direct.observed_addr))
    assert seen.startswith("/ip4/127.0.0.1/tcp/") and "/p2p-circuit" not in seen
