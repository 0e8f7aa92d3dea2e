"""primenode wire protocol: every byte a wire carries and the rules every role applies alike.

Pure data and rules: no I/O, no torch, nothing else of ours (``tests/system/test_layout.py``).
Read it to learn the whole protocol, in this order (docs/protocol.md follows it):

* values: ``schema`` (typed messages, one canonical msgpack form, exact validation),
  ``messages`` (every message class), ``errors`` (``ProtocolError``: a rule name as data);
* trust: ``identity`` (ed25519 keys, peer ids), ``envelope`` (signed envelopes,
  replay protection), ``genesis`` (the signed run document; the run id is its hash),
  ``batches`` (a rollout batch is its signer's: ``(worker, batch_id)``, and the check
  of fetched batch bytes against an announce);
* the run's derived facts: ``topics`` (gossip topic names), ``assignment`` (owed
  prompts), ``seeds`` (the per-sample seed), ``rules`` (the ``max_async`` window,
  the quorum outcome), ``proof_layout`` (how a sample's TOPLOC proofs are cut),
  ``bitmap`` (have-bitmaps);
* frames, one module per wire: ``gossip`` (gossip frames, IHAVE/GRAFT/PRUNE),
  ``reqresp`` (request/response frames, error codes), ``chunk_frames`` (the raw-TCP
  chunk data plane);
* ``testing``: re-signing helpers for tests, fuzzers and attackers (never used by a node).

The frame modules are imported by name (``from protocol import gossip``); their
constants would collide if re-exported here.
"""

from .assignment import assign_prompts, assignment_seed
from .batches import BatchKey, batch_key, open_announced_batch
from .bitmap import Bitmap
from .envelope import (
    MAX_ENVELOPE_BYTES,
    ZERO_RUN_ID,
    Envelope,
    ReplayGuard,
    SequenceCounter,
    open_envelope,
    seal,
)
from .errors import ProtocolError
from .genesis import check_initial_manifest, model_content_root, sign_genesis, verify_genesis
from .identity import NodeKey, peer_id_from_public_bytes, public_bytes_from_peer_id, verify_signature
from .messages import *  # noqa: F403  (every message class is public API)
from .messages import ENVELOPE_TYPES, GOSSIP_TYPES, PRE_RUN_TYPES, sha256
from .proof_layout import ProofLayout, chunk_rows, expected_chunks, proof_size, split_proofs
from .rules import Quorum, is_stale, quorum_outcome, window_floor, within_window
from .schema import Message
from .seeds import sample_seed
from .topics import PROTOCOL_VERSION, all_topics, topic

__all__ = [
    "ENVELOPE_TYPES",
    "GOSSIP_TYPES",
    "MAX_ENVELOPE_BYTES",
    "PRE_RUN_TYPES",
    "PROTOCOL_VERSION",
    "ZERO_RUN_ID",
    "BatchKey",
    "Bitmap",
    "Envelope",
    "Message",
    "NodeKey",
    "ProofLayout",
    "ProtocolError",
    "Quorum",
    "ReplayGuard",
    "SequenceCounter",
    "all_topics",
    "assign_prompts",
    "assignment_seed",
    "batch_key",
    "check_initial_manifest",
    "chunk_rows",
    "expected_chunks",
    "is_stale",
    "model_content_root",
    "open_announced_batch",
    "open_envelope",
    "peer_id_from_public_bytes",
    "proof_size",
    "public_bytes_from_peer_id",
    "quorum_outcome",
    "sample_seed",
    "seal",
    "sha256",
    "sign_genesis",
    "split_proofs",
    "topic",
    "verify_genesis",
    "verify_signature",
    "window_floor",
    "within_window",
]

from . import messages as _messages

__all__ += [
    n for n, v in vars(_messages).items() if isinstance(v, type) and issubclass(v, Message) and v is not Message
]
