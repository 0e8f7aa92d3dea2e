"""The checkpoints' control plane: what the fetcher asks of the network besides chunk bytes
(tickets, manifests, reverse connections) and where it charges misbehaviour, as a small
interface. The chunk bytes themselves travel on the data plane (raw TCP, ``server`` and
``client``).

The real implementation (:class:`node.roles.checkpoint_wiring.P2PControlPlane`) sends the
requests over the overlay's request/response (``node.p2p``) and charges misbehaviour to its
peer standing (bans and penalties); :class:`LocalControlPlane` connects chunk servers living in
the same process (unit tests, benchmarks of the data plane alone).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Protocol

import trio

from protocol import (
    ChunkTicket,
    ChunkTicketRequest,
    ManifestRequest,
    ManifestResponse,
    ReverseChunkAnswer,
    ReverseChunkRequest,
)

if TYPE_CHECKING:
    from node.checkpoints.server import ChunkServer


class ControlPlane(Protocol):
    """What every implementation promises (tests/checkpoints/test_checkpoints_control_conformance.py):

    * a peer that serves the version answers a ticket with ``ok`` (host, port, token);
      one that does not hold it answers ``ok=False`` with the chunk server's reason;
    * a peer the network cannot reach, or one it banned, makes ``request_ticket`` raise;
    * ``penalise`` and ``ban`` are charged to the peer named, and a banned peer is not
      asked for tickets again.
    """

    async def request_ticket(self, peer_id: str, req: ChunkTicketRequest, timeout: float) -> ChunkTicket:
        """Ask ``peer_id`` for a data-plane ticket; raise on timeout or when the peer cannot be asked."""

    async def request_manifest(self, peer_id: str, req: ManifestRequest, timeout: float) -> ManifestResponse:
        """Ask ``peer_id`` for the trainer's announce of a version (a delta's base chain)."""

    async def request_reverse(self, peer_id: str, req: ReverseChunkRequest, timeout: float) -> ReverseChunkAnswer:
        """Ask ``peer_id`` (behind NAT) to dial our data port with ``req.ticket``; raise like
        ``request_ticket``."""

    def penalise(self, peer_id: str, reason: str) -> None:
        """Misbehaviour points for ``peer_id`` (a bad chunk, a stall)."""

    def ban(self, peer_id: str, reason: str) -> None:
        """Stop talking to ``peer_id`` (the fetcher saw too many bad chunks)."""


class LocalControlPlane:
    """In-process control plane: ``servers`` maps peer id -> ChunkServer. For tests and benches."""

    def __init__(self, my_id: str, servers: dict[str, ChunkServer]) -> None:
        self.my_id = my_id
        self.servers = servers
        self.penalties: collections.Counter[tuple[str, str]] = collections.Counter()
        self.banned: dict[str, str] = {}

    async def request_ticket(self, peer_id: str, req: ChunkTicketRequest, timeout: float) -> ChunkTicket:
        await trio.lowlevel.checkpoint()
        if peer_id in self.banned:
            raise ConnectionRefusedError(f"{peer_id} is banned")
        server = self.servers.get(peer_id)
        if server is None:
            raise ConnectionRefusedError(f"unknown peer {peer_id}")
        return server.grant_ticket(self.my_id, req)

    async def request_reverse(self, peer_id: str, req: ReverseChunkRequest, timeout: float) -> ReverseChunkAnswer:
        await trio.lowlevel.checkpoint()
        if peer_id in self.banned:
            raise ConnectionRefusedError(f"{peer_id} is banned")
        server = self.servers.get(peer_id)
        if server is None:
            raise ConnectionRefusedError(f"unknown peer {peer_id}")
        return server.grant_reverse(self.my_id, req)

    async def request_manifest(self, peer_id: str, req: ManifestRequest, timeout: float) -> ManifestResponse:
        await trio.lowlevel.checkpoint()
        if peer_id in self.banned:
            raise ConnectionRefusedError(f"{peer_id} is banned")
        server = self.servers.get(peer_id)
        if server is None:
            raise ConnectionRefusedError(f"unknown peer {peer_id}")
        st = server.store.get(req.version, req.root)
        return ManifestResponse(found=st is not None, envelope=st.raw if st is not None else b"")

    def penalise(self, peer_id: str, reason: str) -> None:
        self.penalties[(peer_id, reason)] += 1

    def ban(self, peer_id: str, reason: str) -> None:
        self.banned[peer_id] = reason
