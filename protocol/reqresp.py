"""Request/response framing: the bytes of one "ask peer X for object H" exchange.

Sans-I/O: ``node/p2p/reqresp.py`` owns the streams, deadlines and handlers and
calls these functions.

One libp2p stream per exchange (protocol id ``PROTOCOL_ID``): the requester
writes one frame, the responder writes one frame and closes.  A frame is a
4-byte big-endian length followed by a signed envelope (``protocol.envelope``).
Both sides require the envelope's signer to be the peer at the other end of
the authenticated connection.  A frame over the reader's cap is refused from
its length prefix, before its body is read: a responder's cap is its largest
registered request type, a requester's the largest type it expects (never
below an ``ErrorResponse``), each plus ``ENVELOPE_OVERHEAD``.

Any request may be answered with an ``ErrorResponse(code, detail)`` instead of
its response type.  The responder itself sends ``bad_request`` (the request
broke a protocol rule; the detail names it), ``timeout`` (the handler ran out
of time) and ``internal`` (the handler failed; the detail is the exception's
class name); handlers add their own codes (``no_genesis``, ``busy``, ...).
Details are cut to ``MAX_ERROR_DETAIL`` characters.

A request refused for its envelope timestamp (outside the responder's window)
is answered ``clock_skew`` instead of ``bad_request``, its detail the decimal
integer offset the responder saw: the request's signed timestamp minus the
responder's clock at receipt, in milliseconds (positive: the requester's clock
is ahead). It is sent only when the request's signature verified, so the
offset is the named requester's own. The requester counts it as one peer's
view of its clock (``node/p2p/clock.py``); one peer alone cannot make it warn.

A request whose type is pre-run (``GenesisRequest``) travels with the zero run
id and so does its answer, so a joiner can ask before it knows the run.
"""

from __future__ import annotations

from collections.abc import Iterable

from .envelope import ENVELOPE_OVERHEAD, ZERO_RUN_ID
from .errors import ProtocolError
from .messages import PRE_RUN_TYPES, ErrorResponse
from .schema import Message

PROTOCOL_ID = "/primenode/rr/1.0.0"
LEN_BYTES = 4
MAX_ERROR_DETAIL = 256

# ErrorResponse codes the responder sends on its own account.
BAD_REQUEST = "bad_request"
TIMEOUT = "timeout"
INTERNAL = "internal"
CLOCK_SKEW = "clock_skew"
MAX_CLOCK_OFFSET_MS = 10**15  # ~31,000 years: any real offset; a bound on what is parsed


def encode_frame(envelope: bytes) -> bytes:
    """One frame: the length prefix, then the envelope."""
    return len(envelope).to_bytes(LEN_BYTES, "big") + envelope


def frame_size(header: bytes, cap: int) -> int:
    """The size a length prefix announces; over ``cap`` raises ProtocolError("size")."""
    n = int.from_bytes(header, "big")
    if n > cap:
        raise ProtocolError("size", f"frame of {n} bytes, cap {cap}")
    return n


def request_cap(request_types: Iterable[type[Message]]) -> int:
    """The largest request frame a responder serving ``request_types`` reads (0: none)."""
    sizes = [c.MAX_BYTES for c in request_types]
    return max(sizes) + ENVELOPE_OVERHEAD if sizes else 0


def response_cap(expected: Iterable[type[Message]], max_bytes: int | None = None) -> int:
    """The largest response frame a requester expecting ``expected`` reads: ``max_bytes`` when
    given, else the largest expected type; never less than an ``ErrorResponse``."""
    cap = max_bytes or max(c.MAX_BYTES for c in expected) + ENVELOPE_OVERHEAD
    return max(cap, ErrorResponse.MAX_BYTES + ENVELOPE_OVERHEAD)


def exchange_run_id(request_type: type[Message], run_id: bytes) -> bytes:
    """The run id a request of ``request_type`` is sealed with: zero for pre-run types."""
    return ZERO_RUN_ID if request_type.TYPE_ID in PRE_RUN_TYPES else run_id


def bad_request(exc: ProtocolError) -> ErrorResponse:
    """The answer to a request that broke a protocol rule."""
    return ErrorResponse(code=BAD_REQUEST, detail=f"{exc.rule}: {exc.detail}"[:MAX_ERROR_DETAIL])


def handler_timeout() -> ErrorResponse:
    """The answer when the handler ran out of time."""
    return ErrorResponse(code=TIMEOUT, detail="handler timed out")


def internal_error(exc: BaseException) -> ErrorResponse:
    """The answer when the handler failed: only the exception's class name leaves the node."""
    return ErrorResponse(code=INTERNAL, detail=f"{type(exc).__name__}"[:MAX_ERROR_DETAIL])


def clock_skew(offset_ms: int) -> ErrorResponse:
    """The answer to a request refused for its timestamp: the offset the responder saw
    (request timestamp minus the responder's clock, ms; positive: the requester is ahead)."""
    offset_ms = max(-MAX_CLOCK_OFFSET_MS, min(MAX_CLOCK_OFFSET_MS, int(offset_ms)))
    return ErrorResponse(code=CLOCK_SKEW, detail=str(offset_ms))


def clock_skew_offset(response: ErrorResponse) -> int | None:
    """The offset a ``clock_skew`` answer carries; None for any other answer or a detail that
    is not a decimal integer within ``MAX_CLOCK_OFFSET_MS``."""
    if response.code != CLOCK_SKEW:
        return None
    text = response.detail
    digits = text[1:] if text.startswith("-") else text
    if not digits.isascii() or not digits.isdigit() or len(digits) > 16:
        return None
    value = int(text)
    return value if abs(value) <= MAX_CLOCK_OFFSET_MS else None
