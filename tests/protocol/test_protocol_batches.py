"""protocol.open_announced_batch: fetched bytes count only as the announcer's own batch."""

from __future__ import annotations

import dataclasses

import pytest

from protocol import (
    NodeKey,
    ProtocolError,
    RolloutAnnounce,
    RolloutBatch,
    Sample,
    SamplingParams,
    batch_key,
    open_announced_batch,
    seal,
    sha256,
)

RUN = b"R" * 32
OWNER, THIEF = NodeKey(b"\x31" * 32), NodeKey(b"\x32" * 32)


def _batch(worker: str) -> RolloutBatch:
    return RolloutBatch(
        run_id=RUN,
        worker=worker,
        policy_version=3,
        batch_counter=5,
        sampling=SamplingParams(),
        samples=(Sample(prompt_index=0, completion=b"\x01\x00\x00\x00", seed=1, proof=b"", claimed_reward=0.0),),
        created_ms=1,
    )


def _announce(raw: bytes) -> RolloutAnnounce:
    return RolloutAnnounce(batch_id=sha256(raw), policy_version=3, batch_counter=5, num_samples=1, size_bytes=len(raw))


def test_the_signers_own_announce_opens_and_everyone_elses_is_refused():
    raw = seal(OWNER, RUN, _batch(OWNER.peer_id), 1000, 1)
    ann = _announce(raw)
    batch = open_announced_batch(raw, announcer=OWNER.peer_id, announce=ann, run_id=RUN)  # control
    assert batch.worker == OWNER.peer_id
    assert batch_key(OWNER.peer_id, ann) != batch_key(THIEF.peer_id, ann)  # the same id, two batches
    cases = {
        "batch_sender": (raw, THIEF.peer_id, ann),  # the owner's bytes served for a thief's announce
        "batch_hash": (raw, OWNER.peer_id, dataclasses.replace(ann, batch_id=bytes(32))),
        "batch_mismatch": (raw, OWNER.peer_id, dataclasses.replace(ann, batch_counter=6)),
        "run_id": (seal(OWNER, b"X" * 32, _batch(OWNER.peer_id), 1000, 1), OWNER.peer_id, None),
    }
    for rule, (data, announcer, announce) in cases.items():
        with pytest.raises(ProtocolError) as err:
            open_announced_batch(data, announcer=announcer, announce=announce or _announce(data), run_id=RUN)
        assert err.value.rule == rule


def test_a_batch_whose_worker_field_names_another_peer_than_its_signer_is_refused():
    raw = seal(THIEF, RUN, _batch(OWNER.peer_id), 1000, 1)  # signed by the thief, "worker" = the owner
    with pytest.raises(ProtocolError) as err:
        open_announced_batch(raw, announcer=THIEF.peer_id, announce=_announce(raw), run_id=RUN)
    assert err.value.rule == "batch_worker"
