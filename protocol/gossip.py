"""Gossip frames: the bytes our Plumtree gossip puts on its libp2p streams.

Sans-I/O: encoding and decoding only; ``node/p2p/gossip.py`` owns the streams,
the queues and the eager/lazy state machine, and calls this codec.

Each peer gets one long-lived stream (protocol id ``PROTOCOL_ID``) carrying any
number of frames, each ``len(4 bytes, big-endian) || msgpack(x)`` with ``x`` one of:

* ``[topic, envelope]``: a message (``topic`` a str, ``envelope`` the signed
  envelope's bytes); the receiver checks the topic is one of its run's and
  allows exactly the envelope's type;
* ``[IHAVE, [id, ...]]`` (1): "I have these messages", sent to lazy links;
* ``[GRAFT, [id, ...]]`` (2): "send me these, and push to me again";
* ``[PRUNE, []]`` (3): "stop pushing to me, send ids instead".

An id is ``sha256(envelope)`` (``ID_BYTES``); a control frame carries at most
``MAX_IDS_PER_FRAME`` of them.  A frame longer than ``FRAME_CAP`` is refused from
its length prefix alone, and an envelope larger than ``MAX_GOSSIP_ENVELOPE_BYTES`` is
never published: gossip stays under 1 MiB, bulk data is fetched by request.

Decoding raises :class:`ProtocolError` whose ``rule`` is the drop reason the
node counts and charges: ``"size"`` (length prefix over the cap),
``"encoding"`` (not msgpack) or ``"frame"`` (anything else malformed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

from .errors import ProtocolError
from .schema import pack, unpack

PROTOCOL_ID = "/primenode/gossip/1.1.0"
LEN_BYTES = 4
MAX_GOSSIP_ENVELOPE_BYTES = 1024 * 1024 - 4096  # largest envelope published by gossip
FRAME_CAP = MAX_GOSSIP_ENVELOPE_BYTES + 1024  # largest frame accepted (envelope + topic + msgpack framing)
IHAVE, GRAFT, PRUNE = 1, 2, 3  # control frame kinds: [kind, [ids]]
CONTROL_KINDS = (IHAVE, GRAFT, PRUNE)
MAX_IDS_PER_FRAME = 4096
ID_BYTES = 32


class GossipMessage(NamedTuple):
    """A decoded ``[topic, envelope]`` frame (the envelope is still unopened bytes)."""

    topic: str
    envelope: bytes


class Control(NamedTuple):
    """A decoded control frame: ``kind`` is IHAVE, GRAFT or PRUNE; ``ids`` are ``ID_BYTES`` each."""

    kind: int
    ids: list[bytes]


def message_id(envelope: bytes) -> bytes:
    """The id of a gossiped message: sha256 of its envelope bytes."""
    return hashlib.sha256(envelope).digest()


def frame_header(size: int) -> bytes:
    """The length prefix of a frame of ``size`` bytes."""
    return size.to_bytes(LEN_BYTES, "big")


def frame_size(header: bytes) -> int:
    """The size announced by a length prefix; over ``FRAME_CAP`` raises ProtocolError("size")."""
    n = int.from_bytes(header[:LEN_BYTES], "big")
    if n > FRAME_CAP:
        raise ProtocolError("size", f"gossip frame of {n} bytes, cap {FRAME_CAP}")
    return n


def encode_frame(body: bytes) -> bytes:
    """One frame on its own: length prefix and body (the node coalesces queued frames with
    ``frame_header``; tests and attackers write single frames)."""
    return frame_header(len(body)) + body


def encode_message(topic: str, envelope: bytes) -> bytes:
    """The body of a message frame (without its length prefix)."""
    return pack([topic, envelope])


def encode_control(kind: int, ids: Sequence[bytes] = ()) -> bytes:
    """The body of an IHAVE / GRAFT / PRUNE frame (without its length prefix)."""
    return pack([kind, list(ids)])


def decode_frame(body: bytes) -> GossipMessage | Control:
    """Parse one frame body (the bytes after its length prefix)."""
    items = unpack(body)  # ProtocolError("encoding")
    if not (isinstance(items, list) and len(items) == 2):
        raise ProtocolError("frame", "a gossip frame is a 2-element array")
    head, tail = items
    if isinstance(head, int) and not isinstance(head, bool):
        if head not in CONTROL_KINDS or not isinstance(tail, list) or len(tail) > MAX_IDS_PER_FRAME:
            raise ProtocolError("frame", "bad control frame kind or id list")
        if not all(isinstance(i, bytes) and len(i) == ID_BYTES for i in tail):
            raise ProtocolError("frame", f"control frame ids must be {ID_BYTES} bytes")
        return Control(head, tail)
    if not (isinstance(head, str) and isinstance(tail, bytes)):
        raise ProtocolError("frame", "a message frame is [topic, envelope]")
    return GossipMessage(head, tail)
