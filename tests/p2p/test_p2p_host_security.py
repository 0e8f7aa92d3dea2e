"""Only authenticated security (issue 30 point 1): a node speaks Noise and nothing else.

Over ``/plaintext/2.0.0`` a peer names any peer id without proving it holds the key, so
whatever it sent would be charged to the id it claimed (tests/interop/ shows the attack with
js-libp2p). These tests use py-libp2p's own plaintext, secio and TLS transports against a
host from :func:`node.p2p.host.make_host`, in both directions, beside the honest control
(Noise, from a default py-libp2p host too, so any libp2p stack that speaks Noise gets in).
"""

from __future__ import annotations

import pytest
import trio
from libp2p import new_host
from libp2p.abc import IHost, ISecureTransport
from libp2p.custom_types import TProtocol
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.security.secio import transport as secio
from libp2p.security.tls.transport import PROTOCOL_ID as TLS_PROTOCOL_ID
from libp2p.security.tls.transport import TLSTransport

from node.p2p.host import closing_host, full_addrs, libp2p_key_pair, make_host, parse_peer_addr
from protocol import NodeKey

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def foreign_host(kind: str) -> IHost:
    """A py-libp2p host offering only ``kind`` as its security transport (None: the library's default)."""
    kp = libp2p_key_pair(NodeKey.generate())
    sec: dict[TProtocol, ISecureTransport]
    if kind == "plaintext":
        sec = {TProtocol(PLAINTEXT_PROTOCOL_ID): InsecureTransport(kp)}
    elif kind == "secio":
        sec = {TProtocol(secio.ID): secio.Transport(kp)}
    elif kind == "tls":
        sec = {TLS_PROTOCOL_ID: TLSTransport(kp)}
    else:
        return new_host(key_pair=kp)  # Noise, TLS, secio and plaintext: the library's default
    return new_host(key_pair=kp, sec_opt=sec)


def security_protocols(host: IHost) -> list[str]:
    upgrader = host.get_network().upgrader  # type: ignore[attr-defined]
    return [str(p) for p in upgrader.security_multistream.transports]


def test_make_host_offers_noise_only() -> None:
    assert security_protocols(make_host(NodeKey.generate())) == ["/noise"]


async def connects(dialer: IHost, listener: IHost, timeout: float = 5.0) -> bool:
    async with closing_host(dialer, LOOPBACK), closing_host(listener, LOOPBACK):
        try:
            with trio.fail_after(timeout):
                await dialer.connect(parse_peer_addr(full_addrs(listener)[0]))
        except trio.TooSlowError:
            raise
        except Exception:
            return False
        return bool(listener.get_network().get_connections(dialer.get_id()))


@pytest.mark.parametrize("kind", ["plaintext", "secio", "tls"])
async def test_unauthenticated_or_unoffered_security_is_refused_inbound(kind: str) -> None:
    assert not await connects(foreign_host(kind), make_host(NodeKey.generate()))


@pytest.mark.parametrize("kind", ["plaintext", "secio", "tls"])
async def test_a_node_never_dials_out_with_anything_but_noise(kind: str) -> None:
    assert not await connects(make_host(NodeKey.generate()), foreign_host(kind))


async def test_honest_control_noise_connects_both_ways() -> None:
    assert await connects(foreign_host("default"), make_host(NodeKey.generate()))
    assert await connects(make_host(NodeKey.generate()), foreign_host("default"))
    assert await connects(make_host(NodeKey.generate()), make_host(NodeKey.generate()))
