"""Signed protocol messages built for tests: a rollout batch with its announce, a heartbeat."""

from __future__ import annotations

from node.util import now_ms
from protocol import Envelope, Heartbeat, NodeKey, RolloutAnnounce, seal


def signed_batch(key, run_id: bytes, counter: int, size: int = 1000):
    from protocol import RolloutBatch, Sample, SamplingParams, sha256

    batch = RolloutBatch(
        run_id=run_id,
        worker=key.peer_id,
        policy_version=0,
        batch_counter=counter,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=24),
        samples=(
            Sample(prompt_index=0, completion=b"\x01\x00\x00\x00", seed=1, proof=b"p" * size, claimed_reward=0.0),
        ),
        created_ms=1,
    )
    raw = seal(key, run_id, batch, now_ms(), counter + 1)
    ann = RolloutAnnounce(
        batch_id=sha256(raw), policy_version=0, batch_counter=counter, num_samples=1, size_bytes=len(raw)
    )
    return raw, ann


def heartbeat_envelope(key: NodeKey, ts: int) -> Envelope:
    hb = Heartbeat(role="worker", policy_version=0, addrs=(), data_port=0, have=(), uptime_s=0.0, step=-1, batches=0)
    return Envelope(
        run_id=b"R" * 32, type_id=Heartbeat.TYPE_ID, sender=key.peer_id, timestamp_ms=ts, seq=1, body=hb, raw=b""
    )
