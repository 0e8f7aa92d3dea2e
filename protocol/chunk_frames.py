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

The payload is checked against the signed manifest's sha256 by the fetcher;
the frames themselves carry no hash or MAC: integrity comes from the manifest,
and nothing in a checkpoint is secret within the run.
"""

from __future__ import annotations

import struct

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
