"""A dial that failed can be tried again at once: our own back-off decides, not the library's.

py-libp2p 0.8.1 remembers a peer whose every address failed and refuses to dial it again for
60 s without trying ("negative cache"). A node started a moment before its bootstrap listened
then failed all of ``connect_bootstrap``'s retries and exited (seen in the NAT namespace test
on a loaded machine). ``make_host`` switches that cache off; real hosts on loopback here.
"""

from __future__ import annotations

import hashlib

import pytest
import trio
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID

from node.p2p.host import closing_host, make_host, peer_info
from protocol import NodeKey

KEY_A = NodeKey(hashlib.sha256(b"redial-a").digest())
KEY_B = NodeKey(hashlib.sha256(b"redial-b").digest())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_peer_that_was_not_listening_yet_is_dialled_again_at_once():
    port = _free_port()
    addr = f"/ip4/127.0.0.1/tcp/{port}"
    a = make_host(KEY_A, dial_timeout=3.0)
    async with closing_host(a, ["/ip4/127.0.0.1/tcp/0"]):
        with trio.fail_after(10):  # hang guard
            with pytest.raises(SwarmException):  # nothing listens there yet
                await a.connect(peer_info(KEY_B.peer_id, [addr]))
            b = make_host(KEY_B, dial_timeout=3.0)
            async with closing_host(b, [addr]):
                await a.connect(peer_info(KEY_B.peer_id, [addr]))
                assert a.get_network().get_connections(ID.from_base58(KEY_B.peer_id))
