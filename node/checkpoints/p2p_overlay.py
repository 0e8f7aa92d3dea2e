"""Wiring of the checkpoints into the libp2p overlay (a running ``node.p2p.Node``).

* tickets: ``ChunkTicketRequest`` -> ``ChunkTicket`` over the overlay's
  request/response (both ends authenticated by Noise; the ticket is bound to
  the requester's peer id);
* announces: the "checkpoint" gossip kind feeds :meth:`Checkpoints.on_announce_envelope`
  (which refuses any manifest not signed by the run's trainer and charges the signer);
* have-sets: the "heartbeat" gossip kind feeds :meth:`Checkpoints.on_heartbeat`;
* penalties and bans go to the node's :class:`PeerPolicy`; a peer the policy
  bans is refused tickets and skipped by fetchers.

A role uses it from its ``RoleHook.run(node)``::

    checkpoints = Checkpoints(store, P2POverlay(node), max_async=node.genesis.max_async)
    await nursery.start(serve_checkpoints, node, checkpoints)
    # and in heartbeat_fields(): return checkpoint_heartbeat_fields(checkpoints)

The node is typed loosely (``Any``): checkpoint code never imports the networking
package (tests/test_layout.py), it only calls the node's public attributes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from node.checkpoints.service import Checkpoints
from protocol import CheckpointAnnounce, ChunkTicket, ChunkTicketRequest, Envelope, ProtocolError

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)

# Misbehaviour points per data-plane reason (the policy's budget is ~20).
POINTS = {"bad_chunk": 5.0, "bad_bitmap": 5.0, "bad_frame": 5.0, "bad_chunk_count": 5.0, "chunk_stall": 1.0}


class P2POverlay:
    """:class:`~node.checkpoints.overlay.ChunkOverlay` on top of a running ``node.p2p.Node``."""

    def __init__(self, node: Any) -> None:
        self.node = node

    async def request_ticket(self, peer_id: str, req: ChunkTicketRequest, timeout: float) -> ChunkTicket:
        env = await self.node.reqresp.request(peer_id, req, expect=ChunkTicket, timeout=timeout, redial=True)
        ticket: ChunkTicket = env.body
        return ticket

    def penalise(self, peer_id: str, reason: str) -> None:
        self.node.policy.penalise(peer_id, reason, POINTS.get(reason))

    def ban(self, peer_id: str, reason: str) -> None:
        self.node.policy.ban(peer_id, reason)


def checkpoint_heartbeat_fields(checkpoints: Checkpoints) -> dict[str, Any]:
    """What a role puts into its heartbeat so peers can fetch from it."""
    return {
        "have": checkpoints.have_entries(),
        "data_port": checkpoints.data_port,
        "policy_version": checkpoints.newest_version(),
    }


async def serve_checkpoints(
    node: Any, checkpoints: Checkpoints, task_status: TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Hook ``checkpoints`` into ``node`` (already running) and run it until cancelled."""

    def on_ticket(env: Envelope[ChunkTicketRequest], peer: str) -> ChunkTicket:
        if node.policy.is_banned(peer):
            return ChunkTicket(ok=False, reason="banned", ticket=b"", host="", port=0, expires_ms=0)
        return checkpoints.grant_ticket(peer, env.body)

    def on_announce(env: Envelope[Any]) -> None:
        try:
            checkpoints.on_announce_envelope(env)
        except ProtocolError as exc:
            log.warning("refused checkpoint announce from %s: %s", env.sender, exc)
            node.policy.penalise(env.sender, exc.rule)

    def on_heartbeat(env: Envelope[Any]) -> None:
        if not node.policy.is_banned(env.sender):
            checkpoints.on_heartbeat(env.sender, env.body)

    def on_ban(peer_id: str, reason: str) -> None:
        checkpoints.note_banned(peer_id, node.policy.banned)

    node.reqresp.register(ChunkTicketRequest, on_ticket)
    node.gossip.on("checkpoint", on_announce)
    node.gossip.on("heartbeat", on_heartbeat)
    node.policy.ban_listeners.append(on_ban)
    checkpoints.banned.update(node.policy.banned())
    await checkpoints.run(task_status=task_status)


async def publish_checkpoint(
    node: Any, checkpoints: Checkpoints, version: int, src_dir: Path | str, chunk_size: int | None = None
) -> bytes:
    """Trainer: import ``src_dir`` as ``version``, then gossip the signed announce."""
    cs = chunk_size or (node.genesis.chunk_size if node.genesis is not None else None)
    raw = await checkpoints.publish(node.key, version, src_dir, **({"chunk_size": cs} if cs else {}))
    st = checkpoints.store.get(version)
    assert st is not None  # publish() stored it
    await node.gossip.publish(CheckpointAnnounce(manifest=st.manifest))
    return raw
