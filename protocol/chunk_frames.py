"""The chunk data plane's binary frames (raw TCP, little-endian, fixed-size headers).

A fetcher first obtains a ticket over libp2p (``ChunkTicketRequest`` ->
``ChunkTicket``); libp2p authenticated both peers, the ticket binds the grant
to the fetcher's peer id, one (version, root) and an expiry.  Then:

    fetcher -> server   HELLO  40 bytes: magic "PNDP", u16 wire version (1),
                               u16 flags, ticket (32 bytes)
    server  -> fetcher  WELCOME 16 bytes: magic "PNDP", u8 status, 3 zero bytes,
                               u32 number of chunks in the version, u32 zero

then any number of requests, which may be pipelined (answered in order):

    fetcher -> server   REQUEST 16 bytes: u8 op, 3 zero bytes, u32 chunk index, u64 zero
    server  -> fetcher  REPLY   16 bytes: u8 op (echo), u8 status, 2 zero bytes,
                               u32 chunk index, u64 payload length; then the payload

ops: GET (1) - payload is the chunk's bytes; HAVE (2) - payload is the
server's current have-bitmap of the version (see protocol.bitmap), so a
fetcher learns of freshly verified chunks without waiting for a heartbeat;
BYE (3) - no reply, the server closes.

HELLO flags: bit 0 (``FLAG_PUSH_HAVE``) asks the server to push its bitmap
unasked: before a GET reply, whenever the bitmap changed since it last sent
one on this connection, the server first writes a HAVE reply with index
``PUSH_INDEX`` (0xFFFFFFFF; an answer to a HAVE request carries index 0).
Such a push is not an answer to any request; the fetcher reads it, updates
its view of the peer, and reads on. Without the flag nothing is pushed.

Status ``ELSEWHERE`` (7) on a GET: the server holds the chunk, but it is
super-seeding (it holds the whole version) and sent that chunk to another
peer moments ago: get it from the peers instead (it is served again once the
hold-off has passed, so a recipient that vanishes cannot starve anyone).

Reverse connections (a holder behind NAT, which nobody can dial): the fetcher, whose
data port is reachable, makes a ticket itself, registers it as expected from that
holder, and sends it over libp2p (``ReverseChunkRequest`` -> ``ReverseChunkAnswer``,
on the holder's authenticated stream, so only the holder learns it). The holder then
dials the fetcher's data port and the roles of the first frames swap once:

    holder  -> fetcher  HELLO  with ``FLAG_REVERSE`` (bit 1) and the ticket
    fetcher -> holder   HELLO  (its own flags, the same ticket), or WELCOME
                               BAD_TICKET and close when the ticket is unknown,
                               expired, already used or issued to another holder
    holder  -> fetcher  WELCOME, then REQUEST / REPLY exactly as above, the
                               fetcher asking and the holder serving

A reverse ticket is good for one connection (the fetcher forgets it on first use)
and for seconds. The holder checks the echoed ticket too: it serves only the
fetcher that asked.

The payload is checked against the signed manifest's sha256 by the fetcher;
the frames themselves carry no hash or MAC: integrity comes from the manifest,
and nothing in a checkpoint is secret within the run.
"""

from __future__ import annotations

import dataclasses
import struct

from .errors import ProtocolError

MAGIC = b"PNDP"
WIRE_VERSION = 1

HELLO = struct.Struct("<4sHH32s")  # 40 bytes
WELCOME = struct.Struct("<4sB3xII")  # 16 bytes
REQUEST = struct.Struct("<B3xIQ")  # 16 bytes
REPLY = struct.Struct("<BB2xIQ")  # 16 bytes

OP_GET = 1
OP_HAVE = 2
OP_BYE = 3

FLAG_PUSH_HAVE = 1  # HELLO flags
FLAG_REVERSE = 2  # HELLO flags: sent by a holder that dialled the fetcher (reverse connection)
TICKET_LEN = 32
PUSH_INDEX = 0xFFFFFFFF  # index of a HAVE reply the server pushed unasked

# statuses (WELCOME and REPLY)
OK = 0
NOT_HELD = 1
BAD_INDEX = 2
BAD_TICKET = 3  # unknown or expired ticket
BAD_REQUEST = 4
BUSY = 5
GONE = 6  # version no longer served (garbage-collected)
ELSEWHERE = 7  # a super-seeding server sent this chunk to another peer moments ago

STATUS_NAMES = {
    OK: "ok",
    NOT_HELD: "not held",
    BAD_INDEX: "bad index",
    BAD_TICKET: "bad ticket",
    BAD_REQUEST: "bad request",
    BUSY: "busy",
    GONE: "version gone",
    ELSEWHERE: "ask other peers",
}

assert HELLO.size == 40 and WELCOME.size == 16 and REQUEST.size == 16 and REPLY.size == 16


@dataclasses.dataclass(frozen=True)
class Hello:
    """A parsed HELLO: its flags and the 32-byte ticket."""

    flags: int
    ticket: bytes

    @property
    def reverse(self) -> bool:
        return bool(self.flags & FLAG_REVERSE)

    @property
    def push_have(self) -> bool:
        return bool(self.flags & FLAG_PUSH_HAVE)


def pack_hello(flags: int, ticket: bytes) -> bytes:
    """HELLO bytes; a ticket shorter than 32 bytes is zero-padded (a peer's ticket may be)."""
    if not 0 <= flags <= 0xFFFF:
        raise ProtocolError("frame:hello", f"flags {flags} do not fit in 16 bits")
    if len(ticket) > TICKET_LEN:
        raise ProtocolError("frame:hello", f"ticket of {len(ticket)} bytes, at most {TICKET_LEN}")
    return HELLO.pack(MAGIC, WIRE_VERSION, flags, ticket.ljust(TICKET_LEN, b"\0"))


def parse_hello(data: bytes) -> Hello:
    """A HELLO from the wire; ``ProtocolError("frame:hello")`` if it is not one we speak."""
    if len(data) != HELLO.size:
        raise ProtocolError("frame:hello", f"{len(data)} bytes, a HELLO is {HELLO.size}")
    magic, version, flags, ticket = HELLO.unpack(data)
    if magic != MAGIC:
        raise ProtocolError("frame:hello", f"magic {magic!r}, not a primenode data plane")
    if version != WIRE_VERSION:
        raise ProtocolError("frame:hello", f"wire version {version}, this node speaks {WIRE_VERSION}")
    return Hello(flags, ticket)
