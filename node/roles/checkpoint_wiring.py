"""Wiring of the checkpoints into the libp2p overlay (a running ``node.p2p.Node``).

* tickets: ``ChunkTicketRequest`` -> ``ChunkTicket`` over the overlay's
  request/response (both ends authenticated by Noise; the ticket is bound to
  the requester's peer id);
* announces: the "checkpoint" gossip kind feeds :meth:`Checkpoints.on_announce_envelope`
  (which refuses any manifest not signed by the run's trainer and charges the signer);
* have-sets: the "heartbeat" gossip kind feeds :meth:`Checkpoints.on_heartbeat`;
* penalties and bans go to the node's :class:`PeerStanding`; a peer it
  bans is refused tickets and skipped by fetchers.

A role uses it from its ``RoleHook.run(node)``::

    checkpoints = Checkpoints(store, P2PControlPlane(node), max_async=node.genesis.max_async)
    await nursery.start(serve_checkpoints, node, checkpoints)
    # and in heartbeat_fields(): return checkpoint_heartbeat_fields(checkpoints)

It lives in the roles layer, the lowest that may import both packages (tests/system/test_layout.py):
``node.checkpoints`` and ``node.p2p`` do not know each other. The node comes in as
:class:`node.p2p.services.NodeServices` (what a role receives), so everything libp2p-specific
(the peerstore, connections, the NAT service) stays behind it.
"""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from node.checkpoints.service import Checkpoints
from node.p2p.reqresp import ReqResp
from node.p2p.services import NodeServices
from protocol import (
    CheckpointAnnounce,
    ChunkTicket,
    ChunkTicketRequest,
    Envelope,
    ManifestRequest,
    ManifestResponse,
    ProtocolError,
    ReverseChunkAnswer,
    ReverseChunkRequest,
)
from protocol.run_config import RunConfig

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)


# Misbehaviour points per data-plane reason (the peer standing's budget is ~20).
POINTS = {
    "bad_chunk": 5.0,
    "bad_bitmap": 5.0,
    "bad_frame": 5.0,
    "bad_chunk_count": 5.0,
    "chunk_stall": 1.0,
    "bad_manifest": 5.0,
}


class P2PControlPlane:
    """:class:`~node.checkpoints.control.ControlPlane` on top of a running ``node.p2p.Node``."""

    def __init__(self, node: NodeServices) -> None:
        self.node = node

    @property
    def _reqresp(self) -> ReqResp:
        return self.node.reqresp

    async def request_ticket(self, peer_id: str, req: ChunkTicketRequest, timeout: float) -> ChunkTicket:
        env = await self._reqresp.request(peer_id, req, expect=ChunkTicket, timeout=timeout, redial=True)
        ticket: ChunkTicket = env.body
        return ticket

    async def request_manifest(self, peer_id: str, req: ManifestRequest, timeout: float) -> ManifestResponse:
        env = await self._reqresp.request(peer_id, req, expect=ManifestResponse, timeout=timeout, redial=True)
        resp: ManifestResponse = env.body
        return resp

    async def request_reverse(self, peer_id: str, req: ReverseChunkRequest, timeout: float) -> ReverseChunkAnswer:
        # to a NAT'd holder: over its relay circuit, or a direct connection (hole punch, or it
        # dialled us); only this small request crosses a relay, never the chunks
        env = await self._reqresp.request(peer_id, req, expect=ReverseChunkAnswer, timeout=timeout, redial=True)
        answer: ReverseChunkAnswer = env.body
        return answer

    def penalise(self, peer_id: str, reason: str) -> None:
        self.node.standing.penalise(peer_id, reason, POINTS.get(reason))

    def ban(self, peer_id: str, reason: str) -> None:
        self.node.standing.ban(peer_id, reason)


def checkpoint_heartbeat_fields(checkpoints: Checkpoints) -> dict[str, Any]:
    """What a role puts into its heartbeat so peers can fetch from it."""
    return {
        "have": checkpoints.have_entries(),
        "data_port": checkpoints.data_port,
        "policy_version": checkpoints.newest_version(),
    }


async def serve_checkpoints(
    node: NodeServices, checkpoints: Checkpoints, task_status: TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Hook ``checkpoints`` into ``node`` (already running) and run it until cancelled."""

    def on_ticket(env: Envelope[ChunkTicketRequest], peer: str) -> ChunkTicket:
        if node.standing.is_banned(peer):
            return ChunkTicket(ok=False, reason="banned", ticket=b"", host="", port=0, expires_ms=0)
        return checkpoints.grant_ticket(peer, env.body)

    def on_announce(env: Envelope[Any]) -> None:
        try:
            checkpoints.on_announce_envelope(env)
        except ProtocolError as exc:
            log.warning("refused checkpoint announce from %s: %s", env.sender, exc)
            node.standing.penalise(env.sender, exc.rule)

    def on_heartbeat(env: Envelope[Any]) -> None:
        if not node.standing.is_banned(env.sender):
            checkpoints.on_heartbeat(env.sender, env.body)

    def on_ban(peer_id: str, reason: str) -> None:
        checkpoints.note_banned(peer_id, node.standing.banned)

    def on_manifest(env: Envelope[ManifestRequest], peer: str) -> ManifestResponse:
        return checkpoints.serve_manifest(env.body)

    def on_reverse(env: Envelope[ReverseChunkRequest], peer: str) -> ReverseChunkAnswer:
        if node.standing.is_banned(peer):
            return ReverseChunkAnswer(ok=False, reason="banned")
        return checkpoints.grant_reverse(peer, env.body, node.peer_ips(peer))

    checkpoints.server.reachable = node.reachable
    reqresp, gossip = node.reqresp, node.gossip

    reqresp.register(ChunkTicketRequest, on_ticket)
    reqresp.register(ManifestRequest, on_manifest)
    reqresp.register(ReverseChunkRequest, on_reverse)
    gossip.on("checkpoint", on_announce)
    gossip.on("heartbeat", on_heartbeat)
    node.standing.ban_listeners.append(on_ban)
    checkpoints.banned.update(node.standing.banned())
    await checkpoints.run(task_status=task_status)


def delta_settings(config_toml: str) -> tuple[int, float]:
    """The genesis ``[config]`` keys of delta publishing: ``anchor_every`` (a full anchor
    every K versions; 0 or 1: every version is an anchor) and ``delta_max_fraction``
    (publish an anchor when the delta is not smaller than this share of the full files)."""
    cfg = RunConfig.decode(tomllib.loads(config_toml) if config_toml else {})
    return cfg.anchor_every, cfg.delta_max_fraction


def delta_base_for(checkpoints: Checkpoints, version: int, anchor_every: int) -> int | None:
    """The version to publish ``version`` as a delta against (the newest assembled one
    before it), or None for an anchor (every ``anchor_every``-th version, or nothing to
    apply to)."""
    if anchor_every <= 1 or version % anchor_every == 0:
        return None
    older = [v for v, st in checkpoints.store.versions.items() if v < version and st.assembled]
    return max(older) if older else None


async def publish_checkpoint(
    node: NodeServices, checkpoints: Checkpoints, version: int, src_dir: Path | str, chunk_size: int | None = None
) -> bytes:
    """Trainer: import ``src_dir`` as ``version`` (a delta against the previous published
    version, or an anchor: ``delta_settings``), then gossip the signed announce."""
    cs = chunk_size or (node.genesis.chunk_size if node.genesis is not None else None)
    anchor_every, max_fraction = delta_settings(node.genesis.config_toml if node.genesis is not None else "")
    raw = await checkpoints.import_version(
        node.key,
        version,
        src_dir,
        **({"chunk_size": cs} if cs else {}),
        delta_base=delta_base_for(checkpoints, version, anchor_every),
        max_delta_fraction=max_fraction,
    )
    st = checkpoints.store.get(version)
    assert st is not None  # import_version() stored it
    await node.gossip.publish(CheckpointAnnounce(manifest=st.manifest))
    return raw
