"""One suite for every :class:`~node.checkpoints.control.ControlPlane`: what the fetcher may
rely on, whichever network carries its ticket requests.

Each implementation is wired for real: :class:`LocalControlPlane` over chunk servers in this
process, :class:`P2PControlPlane` over libp2p nodes (the ``net`` fixture) whose ``Checkpoints``
are hooked in with ``serve_checkpoints``. Three peers: ``serving`` holds version 1,
``bare`` runs a chunk server without it, ``unknown`` does not exist.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import trio

from harness.checkpoints import RUN_ID, keys, make_checkpoint
from harness.genesis import overlay_genesis
from node.checkpoints import Checkpoints, ChunkStore, ControlPlane, DataConnection, LocalControlPlane, VersionState
from node.checkpoints.server import ChunkServer
from node.p2p.node import Node, RoleHook
from node.p2p.testing import NodeFactory
from node.roles.checkpoint_wiring import P2PControlPlane, checkpoint_heartbeat_fields, serve_checkpoints
from protocol import ChunkTicketRequest, NodeKey, ReverseChunkRequest
from protocol import chunk_frames as F

TIMEOUT = 10.0


@dataclasses.dataclass
class Wired:
    control: ControlPlane
    me: str
    serving: Checkpoints
    serving_id: str
    bare_id: str
    unknown_id: str
    st: VersionState
    penalised: Callable[[str], bool]  # the control plane's owner has charged this peer
    banned: Callable[[str], bool]  # the control plane's owner has banned this peer

    def request(self, peer_id: str) -> ChunkTicketRequest:
        return ChunkTicketRequest(version=1, root=self.st.root, chunk_indices=(0,))


async def _publish(checkpoints: Checkpoints, trainer: NodeKey, tmp_path: Path) -> VersionState:
    src = make_checkpoint(tmp_path / "ckpt", 1, seed=5)
    await checkpoints.import_version(trainer, 1, src, chunk_size=256 * 1024)
    st = checkpoints.store.get(1)
    assert st is not None
    return st


async def _local(tmp_path: Path) -> AsyncIterator[Wired]:
    trainer, me, bare = keys(3)
    servers: dict = {}
    serving = Checkpoints(
        ChunkStore(tmp_path / "serving", RUN_ID, trainer.peer_id), LocalControlPlane(trainer.peer_id, {})
    )
    empty = Checkpoints(ChunkStore(tmp_path / "bare", RUN_ID, trainer.peer_id), LocalControlPlane(bare.peer_id, {}))
    control = LocalControlPlane(me.peer_id, servers)
    async with trio.open_nursery() as nursery:
        for cp, key in ((serving, trainer), (empty, bare)):
            await nursery.start(cp.run)
            servers[key.peer_id] = cp.server
        st = await _publish(serving, trainer, tmp_path)
        yield Wired(
            control,
            me.peer_id,
            serving,
            trainer.peer_id,
            bare.peer_id,
            NodeKey.generate().peer_id,
            st,
            penalised=lambda p: any(peer == p for peer, _ in control.penalties),
            banned=lambda p: p in control.banned,
        )
        nursery.cancel_scope.cancel()


class CheckpointsHook(RoleHook):
    """A role that only serves its checkpoints (what the learning roles do besides learning)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.checkpoints: Checkpoints | None = None
        self.started = trio.Event()

    async def run(self, node: Node) -> None:
        assert node.genesis is not None
        store = ChunkStore(self.home, node.run_id, node.genesis.trainer)
        self.checkpoints = Checkpoints(store, P2PControlPlane(node), max_async=node.genesis.max_async)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_checkpoints, node, self.checkpoints)
            self.started.set()

    def heartbeat_fields(self) -> dict:
        return checkpoint_heartbeat_fields(self.checkpoints) if self.checkpoints is not None else {}


async def _p2p(tmp_path: Path, net: NodeFactory) -> AsyncIterator[Wired]:
    trainer = keys(1)[0]
    net.genesis = overlay_genesis(owner=trainer, trainer=trainer)
    await net.start()  # the bootstrap
    hooks = [CheckpointsHook(tmp_path / name) for name in ("serving", "bare", "me")]
    serving_node = await net.start(hook=hooks[0], key=trainer)
    bare_node = await net.start(hook=hooks[1])
    me = await net.start(hook=hooks[2])
    await net.wait_connected(min_peers=2)
    for h in hooks:
        await h.started.wait()
    serving = hooks[0].checkpoints
    assert serving is not None
    st = await _publish(serving, trainer, tmp_path)
    yield Wired(
        P2PControlPlane(me),
        me.peer_id,
        serving,
        serving_node.peer_id,
        bare_node.peer_id,
        NodeKey.generate().peer_id,
        st,
        penalised=lambda p: me.standing.points(p) > 0,
        banned=me.standing.is_banned,
    )


@pytest.fixture(params=["local", "p2p"])
async def wired(request: pytest.FixtureRequest, tmp_path: Path, net: NodeFactory) -> AsyncIterator[Wired]:
    # ``net`` starts no node until asked: the local control plane leaves it empty
    wiring = _local(tmp_path) if request.param == "local" else _p2p(tmp_path, net)
    async for w in wiring:
        yield w


async def test_a_peer_holding_the_version_grants_a_ticket_bound_to_the_requester(wired: Wired):
    ticket = await wired.control.request_ticket(wired.serving_id, wired.request(wired.serving_id), TIMEOUT)
    assert ticket.ok and ticket.port == wired.serving.data_port
    assert wired.serving.server.tickets[ticket.ticket].peer_id == wired.me
    conn = await DataConnection.open(ticket.host, ticket.port, ticket.ticket)
    try:
        assert conn.num_chunks == wired.st.bitmap.n
        await conn.send(F.OP_GET, 0)
        op, status, idx, length = await conn.read_header()
        assert (op, status, idx, length) == (F.OP_GET, F.OK, 0, wired.st.chunks[0][2])
    finally:
        await conn.aclose()


async def test_a_peer_without_the_version_refuses_with_a_reason(wired: Wired):
    ticket = await wired.control.request_ticket(wired.bare_id, wired.request(wired.bare_id), TIMEOUT)
    assert not ticket.ok and ticket.reason == "version not held"


async def test_an_unknown_peer_makes_the_request_raise(wired: Wired):
    with pytest.raises(Exception):  # noqa: B017 - each control plane raises its own kind; the fetcher catches any
        await wired.control.request_ticket(wired.unknown_id, wired.request(wired.unknown_id), TIMEOUT)


async def test_penalties_are_charged_to_the_peer_named(wired: Wired):
    assert not wired.penalised(wired.bare_id)
    wired.control.penalise(wired.bare_id, "chunk_stall")
    assert wired.penalised(wired.bare_id)
    assert not wired.penalised(wired.serving_id) and not wired.banned(wired.bare_id)


async def test_a_banned_peer_is_reported_and_never_asked_again(wired: Wired):
    assert (await wired.control.request_ticket(wired.serving_id, wired.request(wired.serving_id), TIMEOUT)).ok
    granted = wired.serving.server.tickets_granted
    wired.control.ban(wired.serving_id, "3 bad chunks")
    assert wired.banned(wired.serving_id) and not wired.banned(wired.bare_id)
    with pytest.raises(Exception):  # noqa: B017 - see above
        await wired.control.request_ticket(wired.serving_id, wired.request(wired.serving_id), TIMEOUT)
    assert wired.serving.server.tickets_granted == granted


async def test_a_holder_asked_for_a_reverse_connection_dials_the_askers_data_port(wired: Wired, tmp_path: Path):
    """A holder behind NAT is asked to dial us (``request_reverse``): it connects to our data
    port with our ticket and serves there; one without the version refuses with a reason."""
    mine = ChunkServer(ChunkStore(tmp_path / "asker", RUN_ID, wired.serving_id), listen_host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        await nursery.start(mine.run)

        def request(ticket: bytes) -> ReverseChunkRequest:
            return ReverseChunkRequest(
                version=1, root=wired.st.root, chunk_indices=(0,), ticket=ticket, host="127.0.0.1", port=mine.port
            )

        refused = await wired.control.request_reverse(wired.bare_id, request(bytes(32)), TIMEOUT)
        assert not refused.ok and refused.reason == "version not held"
        tok = mine.expect_reverse(wired.serving_id, 1, wired.st.root)
        answer = await wired.control.request_reverse(wired.serving_id, request(tok), TIMEOUT)
        assert answer.ok, answer.reason
        conn = await DataConnection.over(await mine.accept_reverse(tok, TIMEOUT), tok)
        try:
            assert conn.num_chunks == wired.st.bitmap.n
            await conn.send(F.OP_GET, 0)
            assert await conn.read_header() == (F.OP_GET, F.OK, 0, wired.st.chunks[0][2])
        finally:
            await conn.aclose()
        nursery.cancel_scope.cancel()
    assert wired.serving.server.reverse["served_connections"] == 1
