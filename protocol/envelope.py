"""Signed envelopes: the only way an application message crosses the network.

Wire form (canonical msgpack array)::

    [1, run_id(32 bytes), type(int), sender(peer id str), timestamp_ms, seq, body(bytes), signature(64 bytes)]

The signature is ed25519 by ``sender``'s key over
``pack([b"primenode/envelope/v1", run_id, type, sender, timestamp_ms, seq, body])``.

:func:`open_envelope` checks, cheapest first and before any body parsing: the
global size cap, msgpack shape, known type, the type's own size cap, run id,
timestamp window, signature, and finally the replay guard (only after the
signature, so forged traffic cannot poison the replay cache).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Generic, TypeVar

from .errors import ProtocolError
from .identity import NodeKey, verify_signature
from .messages import ENVELOPE_TYPES, PRE_RUN_TYPES
from .schema import Message, pack, unpack

WIRE_VERSION = 1
_DOMAIN = b"primenode/envelope/v1"
ENVELOPE_OVERHEAD = 256  # header + signature bytes beyond the body, generously
ZERO_RUN_ID = b"\x00" * 32
MAX_ENVELOPE_BYTES = max(c.MAX_BYTES for c in ENVELOPE_TYPES.values()) + ENVELOPE_OVERHEAD

M = TypeVar("M", bound=Message)


@dataclasses.dataclass(frozen=True)
class Envelope(Generic[M]):
    """A verified envelope: who sent what, when, in which run."""

    run_id: bytes
    type_id: int
    sender: str
    timestamp_ms: int
    seq: int
    body: M
    raw: bytes  # the exact bytes received; hash these to name the message

    @property
    def message_id(self) -> bytes:
        from .messages import sha256

        return sha256(self.raw)


def _signed_part(run_id: bytes, type_id: int, sender: str, ts: int, seq: int, body: bytes) -> bytes:
    return pack([_DOMAIN, run_id, type_id, sender, ts, seq, body])


def seal(key: NodeKey, run_id: bytes, message: Message, timestamp_ms: int, seq: int) -> bytes:
    """Sign ``message`` as ``key`` and return the envelope bytes."""
    type_id = type(message).TYPE_ID
    if type_id not in ENVELOPE_TYPES:
        raise ValueError(f"{type(message).__name__} cannot be sent in an envelope")
    body = message.encode()
    if len(body) > type(message).MAX_BYTES:
        raise ValueError(f"{type(message).__name__} body is {len(body)} bytes, cap {type(message).MAX_BYTES}")
    return _sign(key, run_id, type_id, body, timestamp_ms, seq)


def _sign(key: NodeKey, run_id: bytes, type_id: int, body: bytes, timestamp_ms: int, seq: int) -> bytes:
    """The envelope bytes around ``body``, unchecked (``seal`` checks; ``protocol.testing`` does not)."""
    sig = key.sign(_signed_part(run_id, type_id, key.peer_id, timestamp_ms, seq, body))
    return pack([WIRE_VERSION, run_id, type_id, key.peer_id, timestamp_ms, seq, body, sig])


class ReplayGuard:
    """Remembers recent (sender, seq) pairs and enforces a timestamp window.

    A message is a replay if its sequence number was already seen from that
    sender, or if it falls below the sender's floor (raised when the per-sender
    memory is full). Timestamps outside ``[now - max_age_ms, now + max_future_ms]``
    are refused, so nothing older than the window needs remembering.
    Memory is bounded: ``max_senders`` x ``max_per_sender`` entries.
    """

    def __init__(
        self,
        max_age_ms: int = 120_000,
        max_future_ms: int = 15_000,
        max_senders: int = 10_000,
        max_per_sender: int = 4096,
    ) -> None:
        self.max_age_ms = max_age_ms
        self.max_future_ms = max_future_ms
        self.max_senders = max_senders
        self.max_per_sender = max_per_sender
        self._seen: OrderedDict[str, tuple[int, dict[int, int]]] = OrderedDict()

    def check_time(self, timestamp_ms: int, now_ms: int) -> None:
        if timestamp_ms < now_ms - self.max_age_ms:
            raise ProtocolError("timestamp", f"stale: {now_ms - timestamp_ms} ms old, window {self.max_age_ms} ms")
        if timestamp_ms > now_ms + self.max_future_ms:
            raise ProtocolError("timestamp", f"from the future: {timestamp_ms - now_ms} ms ahead")

    def check_and_record(self, sender: str, seq: int, timestamp_ms: int, now_ms: int) -> None:
        floor, seqs = self._seen.pop(sender, (-1, {}))
        try:
            if seq <= floor or seq in seqs:
                raise ProtocolError("replay", f"sequence {seq} from {sender} already seen")
            horizon = now_ms - self.max_age_ms
            if len(seqs) >= self.max_per_sender:
                for s, ts in list(seqs.items()):
                    if ts < horizon:
                        del seqs[s]
            if len(seqs) >= self.max_per_sender:
                lowest = min(seqs)
                del seqs[lowest]
                floor = max(floor, lowest)
                if seq <= floor:
                    raise ProtocolError("replay", f"sequence {seq} from {sender} below the replay floor")
            seqs[seq] = timestamp_ms
        finally:
            self._seen[sender] = (floor, seqs)
            while len(self._seen) > self.max_senders:
                self._seen.popitem(last=False)


class SequenceCounter:
    """Per-node sequence numbers: start from the wall clock so restarts never reuse one."""

    def __init__(self, start: int) -> None:
        self._next = start

    def next(self) -> int:
        n = self._next
        self._next += 1
        return n


def open_envelope(
    data: Any,
    *,
    run_id: bytes,
    now_ms: int,
    guard: ReplayGuard | None,
    allowed_types: Iterable[int] | None = None,
) -> Envelope[Message]:
    """Verify envelope bytes from a peer; return the decoded message or raise ProtocolError.

    ``guard=None`` skips the replay check (only for re-verifying stored bytes,
    e.g. a rollout batch fetched on behalf of its announced hash).
    Nothing but ProtocolError ever escapes, whatever ``data`` holds.
    """
    try:
        return _open(data, run_id, now_ms, guard, allowed_types)
    except ProtocolError:
        raise
    except Exception as exc:  # defence in depth: a decoder bug must not kill a node
        raise ProtocolError("internal", f"{type(exc).__name__}: {exc}") from None


def _open(
    data: Any, run_id: bytes, now_ms: int, guard: ReplayGuard | None, allowed_types: Iterable[int] | None
) -> Envelope[Message]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("type", "envelope must be bytes")
    data = bytes(data)
    if len(data) > MAX_ENVELOPE_BYTES:
        raise ProtocolError("size", f"envelope is {len(data)} bytes, cap {MAX_ENVELOPE_BYTES}")
    items = unpack(data)
    if not isinstance(items, list) or len(items) != 8:
        raise ProtocolError("envelope", "expected an 8-element array")
    version, env_run, type_id, sender, ts, seq, body, sig = items
    if version != WIRE_VERSION or isinstance(version, bool):
        raise ProtocolError("envelope.version", f"unsupported wire version {version!r}")
    if not isinstance(type_id, int) or isinstance(type_id, bool) or type_id not in ENVELOPE_TYPES:
        raise ProtocolError("envelope.type", f"unknown message type {type_id!r}")
    cls = ENVELOPE_TYPES[type_id]
    if allowed_types is not None and type_id not in allowed_types:
        raise ProtocolError("envelope.type", f"{cls.__name__} not allowed here")
    if not isinstance(body, bytes):
        raise ProtocolError("envelope.body", "body must be bytes")
    if len(body) > cls.MAX_BYTES or len(data) > cls.MAX_BYTES + ENVELOPE_OVERHEAD:
        raise ProtocolError("size", f"{cls.__name__} is {len(body)} bytes, cap {cls.MAX_BYTES}")
    if not isinstance(env_run, bytes) or len(env_run) != 32:
        raise ProtocolError("envelope.run_id", "run id must be 32 bytes")
    if env_run != run_id and not (env_run == ZERO_RUN_ID and type_id in PRE_RUN_TYPES):
        raise ProtocolError("run_id", "message belongs to another run")
    if not isinstance(sender, str) or not 40 <= len(sender) <= 64:
        raise ProtocolError("envelope.sender", "malformed sender peer id")
    for name, v in (("timestamp_ms", ts), ("seq", seq)):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**63:
            raise ProtocolError(f"envelope.{name}", "must be a non-negative 63-bit integer")
    if not isinstance(sig, bytes) or len(sig) != 64:
        raise ProtocolError("envelope.signature", "signature must be 64 bytes")
    if guard is not None:
        guard.check_time(ts, now_ms)
    verify_signature(sender, _signed_part(env_run, type_id, sender, ts, seq, body), sig)
    message = cls.decode(body)
    if pack(items) != data:
        raise ProtocolError("canonical", "envelope bytes are not in canonical form")
    if guard is not None:
        guard.check_and_record(sender, seq, ts, now_ms)
    return Envelope(env_run, type_id, sender, ts, seq, message, data)
