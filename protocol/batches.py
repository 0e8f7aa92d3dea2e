"""Whose batch is it: the identity of a rollout batch and the check of fetched bytes.

A batch is named by ``(worker, batch_id)``: ``batch_id`` is sha256 of the worker's
signed ``RolloutBatch`` envelope (so it binds the content *and* the signer, whose
peer id and signature are in those bytes), and ``worker`` is the peer that signed
it, which must also be the peer that announced it and the batch's ``worker`` field.

Why the pair and not the id alone: an announce is signed by whoever sends it, and
anyone who sees an id on the rollout topic can announce it under their own key.
Fetchers, votes, the ledger and the worker's own tally key on the pair, so such an
announce is about ``(thief, id)``: a batch that does not exist. Fetching it yields
bytes signed by someone else (or nothing) and costs the thief; the signer's
``(worker, id)`` is untouched whatever was announced around it. The slot a batch
fills is ``(worker, policy_version, batch_counter)``, keyed on the same worker, so
rules about a worker's slots (the order counters are used in) read only that
worker's own announces.
"""

from __future__ import annotations

from .envelope import Envelope, open_envelope
from .errors import ProtocolError
from .messages import RolloutAnnounce, RolloutBatch, sha256
from .schema import Message

# (worker = signer = announcer, batch_id = sha256 of the signed batch envelope)
BatchKey = tuple[str, bytes]


def batch_key(announcer: str, announce: RolloutAnnounce) -> BatchKey:
    """The batch an announce is about: the announcer's, never anyone else's."""
    return (announcer, announce.batch_id)


def open_announced_batch(raw: bytes, *, announcer: str, announce: RolloutAnnounce, run_id: bytes) -> RolloutBatch:
    """Check batch bytes fetched from ``announcer`` for its ``announce`` and return the batch.

    Raises ProtocolError, the announcer's fault in every case (it served these bytes
    for its own announce): ``batch_hash`` (not the announced id), the envelope's own
    rules (signature, run, type), ``batch_sender`` (signed by another peer than the
    announcer: someone else's batch announced as one's own), ``batch_worker`` (the
    ``worker`` field names another peer than the signer), ``batch_mismatch``
    (version, counter or sample count differ from the announce). No clock: stored
    bytes are checked the same way whenever they are read back."""
    if sha256(raw) != announce.batch_id:
        raise ProtocolError("batch_hash", "batch bytes do not match the announced hash")
    inner: Envelope[Message] = open_envelope(
        raw, run_id=run_id, now_ms=0, guard=None, allowed_types={RolloutBatch.TYPE_ID}
    )
    if inner.sender != announcer:
        raise ProtocolError("batch_sender", "batch signed by another peer than its announcer")
    batch = inner.body
    assert isinstance(batch, RolloutBatch)
    if batch.worker != inner.sender:
        raise ProtocolError("batch_worker", "the batch's worker field is not its signer")
    if (batch.policy_version, batch.batch_counter, len(batch.samples)) != (
        announce.policy_version,
        announce.batch_counter,
        announce.num_samples,
    ):
        raise ProtocolError("batch_mismatch", "batch does not match its announcement")
    return batch
