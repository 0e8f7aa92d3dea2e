"""Fetcher side of one data-plane connection (``protocol.chunk_frames`` has the format)."""

from __future__ import annotations

import contextlib

import trio

from node.checkpoints.wire import recv_exactly, recv_exactly_into, send_all, tune
from node.util import aclose_shielded
from protocol import chunk_frames as F


class DataPlaneError(Exception):
    """A data-plane exchange with one peer failed (refused ticket, bad frame, status not OK).

    Control flow inside the fetcher (the peer cools down and its chunks go back to the
    pool), never shown to an operator: not a :class:`node.errors.NodeError`."""

    def __init__(self, status: int, detail: str = "") -> None:
        self.status = status
        super().__init__(f"{F.STATUS_NAMES.get(status, status)}{': ' + detail if detail else ''}")


class DataConnection:
    """One TCP connection to a peer's chunk server, opened with a ticket.

    Requests may be pipelined: call :meth:`send` several times, then read the
    replies in the same order with :meth:`read_reply`.
    """

    def __init__(self, stream: trio.SocketStream, num_chunks: int, stall_timeout: float) -> None:
        self.stream = stream
        self.sock = stream.socket
        self.num_chunks = num_chunks
        self.stall_timeout = stall_timeout

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        ticket: bytes,
        *,
        connect_timeout: float = 10.0,
        stall_timeout: float = 10.0,
        flags: int = 0,
    ) -> DataConnection:
        with trio.fail_after(connect_timeout):
            try:
                stream = await trio.open_tcp_stream(host, port)
            except ValueError as exc:
                # the host comes from a peer's ticket: a name the resolver cannot even encode (a
                # UnicodeError from the idna codec, found by tests/p2p/test_fuzz_clients.py) is the
                # peer's bad ticket, not an exception of ours
                raise DataPlaneError(F.BAD_TICKET, f"unusable address in the ticket: {exc}") from None
        return await cls.over(stream, ticket, stall_timeout=stall_timeout, flags=flags)

    @classmethod
    async def over(
        cls, stream: trio.SocketStream, ticket: bytes, *, stall_timeout: float = 10.0, flags: int = 0
    ) -> DataConnection:
        """Say HELLO with ``ticket`` on an open ``stream`` and read the WELCOME: a connection we
        dialled, or one a holder behind NAT dialled to us (reverse; its HELLO already read).
        The stream is closed on failure."""
        try:
            tune(stream.socket)
            await send_all(stream.socket, F.pack_hello(flags & ~F.FLAG_REVERSE, ticket), stall_timeout)
            welcome = await recv_exactly(stream.socket, F.WELCOME.size, stall_timeout)
            magic, status, n = F.WELCOME.unpack(welcome)[:3]
            if magic != F.MAGIC:
                raise DataPlaneError(F.BAD_REQUEST, "not a primenode data plane")
            if status != F.OK:
                raise DataPlaneError(status)
        except BaseException:
            await aclose_shielded(stream.aclose)
            raise
        return cls(stream, n, stall_timeout)

    async def send(self, op: int, index: int = 0) -> None:
        await send_all(self.sock, F.REQUEST.pack(op, index, 0), self.stall_timeout)

    async def read_header(self) -> tuple[int, int, int, int]:
        """(op, status, index, length) of the next reply."""
        hdr = await recv_exactly(self.sock, F.REPLY.size, self.stall_timeout)
        return F.REPLY.unpack(hdr)

    async def read_payload_into(self, view: memoryview) -> None:
        await recv_exactly_into(self.sock, view, self.stall_timeout)

    async def aclose(self) -> None:
        """Say BYE (best effort) and close, within a second, even while being cancelled."""
        await aclose_shielded(self._bye_and_close, timeout=1.0)

    async def _bye_and_close(self) -> None:
        with contextlib.suppress(Exception):
            await send_all(self.sock, F.REQUEST.pack(F.OP_BYE, 0, 0), 1)
        await self.stream.aclose()
