"""primenode wire protocol: pure data and rules, no I/O, no torch.

Read this package to learn the whole protocol: messages (``messages``),
their canonical encoding and validation (``schema``), signed envelopes and
replay protection (``envelope``), identities (``identity``), run genesis
(``genesis``), gossip topics (``topics``) and prompt assignment
(``assignment``).
"""

from .assignment import assign_prompts, assignment_seed
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
from .genesis import sign_genesis, verify_genesis
from .identity import NodeKey, peer_id_from_public_bytes, public_bytes_from_peer_id, verify_signature
from .messages import *  # noqa: F403  (every message class is public API)
from .messages import ENVELOPE_TYPES, GOSSIP_TYPES, PRE_RUN_TYPES, sha256
from .schema import Message
from .topics import all_topics, topic

__all__ = [
    "ENVELOPE_TYPES",
    "GOSSIP_TYPES",
    "MAX_ENVELOPE_BYTES",
    "PRE_RUN_TYPES",
    "ZERO_RUN_ID",
    "Envelope",
    "Message",
    "NodeKey",
    "ProtocolError",
    "ReplayGuard",
    "SequenceCounter",
    "all_topics",
    "assign_prompts",
    "assignment_seed",
    "open_envelope",
    "peer_id_from_public_bytes",
    "public_bytes_from_peer_id",
    "seal",
    "sha256",
    "sign_genesis",
    "topic",
    "verify_genesis",
    "verify_signature",
]

from . import messages as _messages

__all__ += [
    n for n, v in vars(_messages).items() if isinstance(v, type) and issubclass(v, Message) and v is not Message
]
