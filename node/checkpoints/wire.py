"""Small helpers for trio sockets: exact reads into caller buffers, socket tuning."""

from __future__ import annotations

import socket

import trio

SOCK_BUF = 4 * 1024 * 1024


def tune(sock: trio.socket.SocketType) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        except OSError:
            pass
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
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
