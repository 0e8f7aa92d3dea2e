"""Gossip topic names: one topic per run and message type."""

from __future__ import annotations

from .messages import BanNotice, CheckpointAnnounce, Heartbeat, RolloutAnnounce, Vote

TOPIC_TYPES = {
    "heartbeat": Heartbeat.TYPE_ID,
    "checkpoint": CheckpointAnnounce.TYPE_ID,
    "rollout": RolloutAnnounce.TYPE_ID,
    "vote": Vote.TYPE_ID,
    "ban": BanNotice.TYPE_ID,
}


def topic(run_id: bytes, kind: str) -> str:
    """``/primenode/<first 16 hex of run id>/<kind>/1``."""
    if kind not in TOPIC_TYPES:
        raise ValueError(f"unknown topic kind {kind!r}")
    return f"/primenode/{run_id.hex()[:16]}/{kind}/1"


def all_topics(run_id: bytes) -> dict[str, int]:
    """topic name -> the one envelope type allowed on it."""
    return {topic(run_id, k): t for k, t in TOPIC_TYPES.items()}
