"""A request whose stream cannot be opened on an existing (dead) connection closes that
connection and dials once more before the peer is called unreachable: under load a
connection can go dead ("handshake write failed") while the peer is alive, and the roles
charge an unreachable announcer for not serving its batch."""

from __future__ import annotations

import hashlib

import pytest
import trio
from libp2p.peer.id import ID

from node.p2p.metrics import NodeMetrics
from node.p2p.reqresp import ReqResp, RequestError
from node.p2p.standing import PeerStanding
from protocol import NodeKey, SequenceCounter

PEER = NodeKey(hashlib.sha256(b"redial-peer").digest()).peer_id


class _Network:
    def __init__(self, host) -> None:
        self.host = host

    def get_connections(self, pid):
        return ["conn"] if self.host.connected else []


class _Host:
    """new_stream fails while the old connection is up; after a disconnect a fresh dial works."""

    def __init__(self, fresh_dial_works: bool) -> None:
        self.connected = True
        self.fresh_dial_works = fresh_dial_works
        self.calls: list[str] = []

    def set_stream_handler(self, *a) -> None:
        pass

    def get_network(self):
        return _Network(self)

    async def new_stream(self, pid, protocols):
        await trio.lowlevel.checkpoint()
        if self.connected:
            self.calls.append("stream on old connection")
            raise ConnectionError("handshake write failed")
        self.calls.append("stream on fresh dial")
        if not self.fresh_dial_works:
            raise ConnectionError("connection refused")
        self.connected = True
        return "stream"

    async def disconnect(self, pid) -> None:
        assert isinstance(pid, ID)
        self.calls.append("disconnect")
        self.connected = False


def _rr(host) -> ReqResp:
    return ReqResp(
        host,
        NodeKey(b"\x01" * 32),
        b"\x00" * 32,
        standing=PeerStanding(),
        metrics=NodeMetrics(),
        seq=SequenceCounter(1),
    )


async def test_a_dead_connection_is_closed_and_redialled():
    host = _Host(fresh_dial_works=True)
    assert await _rr(host)._open_stream(PEER) == "stream"
    assert host.calls == ["stream on old connection", "disconnect", "stream on fresh dial"]


async def test_unreachable_only_after_the_fresh_dial_fails_too():
    host = _Host(fresh_dial_works=False)
    with pytest.raises(RequestError) as err:
        await _rr(host)._open_stream(PEER)
    assert err.value.code == "unreachable"
    assert host.calls == ["stream on old connection", "disconnect", "stream on fresh dial"]


async def test_no_redial_unless_asked_or_when_the_protocol_is_refused():
    host = _Host(fresh_dial_works=True)
    with pytest.raises(RequestError):
        await _rr(host)._open_stream(PEER, redial=False)
    assert host.calls == ["stream on old connection"]

    class _Refusing(_Host):
        async def new_stream(self, pid, protocols):
            self.calls.append("stream on old connection")
            raise ConnectionError("protocols not supported: tried [/primenode/rr/1.0.0]")

    host = _Refusing(fresh_dial_works=True)
    with pytest.raises(RequestError):
        await _rr(host)._open_stream(PEER)
    assert host.calls == ["stream on old connection"]  # a live peer that refuses: not disconnected


async def test_a_refusal_named_only_in_the_cause_is_unsupported_not_unreachable():
    """py-libp2p raises StreamFailure("failed to open a stream ...") *from* the multiselect
    error that says "protocol not supported": the peer is up but is not primenode."""

    class _Foreign(_Host):
        async def new_stream(self, pid, protocols):
            self.calls.append("stream on old connection")
            try:
                raise ConnectionError("protocols not supported: tried ['/primenode/rr/1.0.0']")
            except ConnectionError as exc:
                raise RuntimeError(f"failed to open a stream to peer {pid}") from exc

    host = _Foreign(fresh_dial_works=True)
    with pytest.raises(RequestError) as err:
        await _rr(host)._open_stream(PEER)
    assert err.value.code == "unsupported"
    assert (
        err.value.detail == f"{PEER} is a libp2p node but does not speak primenode (/primenode/rr/1.0.0 not supported)"
    )
    assert host.calls == ["stream on old connection"]  # not disconnected, not redialled
    # control: a failure that is not a refusal is still a redial, then "unreachable"
    host = _Host(fresh_dial_works=False)
    with pytest.raises(RequestError) as err:
        await _rr(host)._open_stream(PEER)
    assert err.value.code == "unreachable"
