"""Small helpers for trio sockets: exact reads into caller buffers, socket tuning."""

from __future__ import annotations

import socket

import trio

SOCK_BUF = 4 * 1024 * 1024
# Unsent bytes the kernel queues before a write blocks (TCP_NOTSENT_LOWAT; bytes in flight
# do not count, so a long fat link still fills). Without it a 4 MiB chunk "sent" the moment
# it was copied into the (up to 8 MiB) send buffer, even to a 20 Mbit/s recipient: the chunk
# server's super-seeding then took that recipient for a fast one and held the chunk off
# (ELSEWHERE) for everyone else while it trickled out, and the 1000 Mbit/s fetchers of
# bench/distribution.py --link-caps waited ~0.5 s on such chunks (docs/benchmarks.md).
NOTSENT_LOWAT = 256 * 1024
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # Linux's number where Python lacks the name


def tune(sock: trio.socket.SocketType) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass
    for level, opt, value in (
        (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
        (socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, NOTSENT_LOWAT),
    ):
        try:
            sock.setsockopt(level, opt, value)
        except OSError:  # not TCP (tests use socketpairs), or a kernel without the option
            pass


async def recv_exactly_into(sock: trio.socket.SocketType, view: memoryview, stall_timeout: float) -> None:
    """Fill ``view`` from ``sock``; raise TooSlowError if no byte arrives for ``stall_timeout`` s."""
    got = 0
    n = len(view)
    while got < n:
        with trio.fail_after(stall_timeout):
            r = await sock.recv_into(view[got:], n - got)
        if r == 0:
            raise trio.BrokenResourceError("connection closed by peer")
        got += r


async def recv_exactly(sock: trio.socket.SocketType, n: int, stall_timeout: float) -> bytes:
    buf = bytearray(n)
    await recv_exactly_into(sock, memoryview(buf), stall_timeout)
    return bytes(buf)


async def send_all(sock: trio.socket.SocketType, data: bytes, stall_timeout: float) -> None:
    view = memoryview(data)
    while view:
        with trio.fail_after(stall_timeout):
            w = await sock.send(view)
        view = view[w:]
