"""Gossip topic names: one topic per run and message type, suffixed with the protocol
version, so nodes that disagree on what a message means never share a topic.

Version history: 1, the first network; 2, seeded Gumbel-max sampling (the sample
seed hashes the member and the manifest root; ``SamplingParams.top_k``; the rules
``sampling``, ``termination``, ``counter``, ``slot``); 3, content-pinned runs and sparse
deltas (``RunGenesis.model_root`` / ``dataset_hash``, ``CheckpointManifest.delta``,
``ManifestRequest`` / ``ManifestResponse``); 4, one batch chain per worker (the batch
counter numbers a worker's batches across the run; prompts and sample seeds hash the
counter, not the version or its manifest root)."""

from __future__ import annotations

from .messages import BanNotice, CheckpointAnnounce, Heartbeat, RolloutAnnounce, Vote

PROTOCOL_VERSION = 4

TOPIC_TYPES = {
    "heartbeat": Heartbeat.TYPE_ID,
    "checkpoint": CheckpointAnnounce.TYPE_ID,
    "rollout": RolloutAnnounce.TYPE_ID,
    "vote": Vote.TYPE_ID,
    "ban": BanNotice.TYPE_ID,
}


def topic(run_id: bytes, kind: str) -> str:
    """``/primenode/<first 16 hex of run id>/<kind>/<PROTOCOL_VERSION>``."""
    if kind not in TOPIC_TYPES:
        raise ValueError(f"unknown topic kind {kind!r}")
    return f"/primenode/{run_id.hex()[:16]}/{kind}/{PROTOCOL_VERSION}"


def all_topics(run_id: bytes) -> dict[str, int]:
    """topic name -> the one envelope type allowed on it."""
    return {topic(run_id, k): t for k, t in TOPIC_TYPES.items()}
