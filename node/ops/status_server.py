"""A tiny local HTTP server: ``GET /status`` (JSON), ``GET /metrics`` (Prometheus) and
``GET /`` (the dashboard: ``dashboard.html`` beside this file, self-contained so that it
works offline, polling ``/status``).

Bound to 127.0.0.1 only: it tells whoever asks which peers this node talks to,
so it is for the operator on the machine, not for the network. Every read has
a timeout, requests are capped in size, each client gets its own task (bounded
in number), and every response closes its connection.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from node.errors import NetworkError

if TYPE_CHECKING:
    from trio_typing import TaskStatus

    from node.p2p.node import Node

log = logging.getLogger(__name__)

BIND_HOST = "127.0.0.1"
MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 10.0
MAX_CLIENTS = 32


class _BadRequest(Exception):
    pass


async def _read_head(stream: trio.abc.Stream) -> bytes:
    """Bytes up to the blank line ending the request head (body ignored: GET only)."""
    buf = bytearray()
    with trio.fail_after(READ_TIMEOUT_S):
        while b"\r\n\r\n" not in buf and b"\n\n" not in buf:
            chunk = await stream.receive_some(MAX_REQUEST_BYTES)
            if not chunk:
                if not buf:
                    raise _BadRequest("empty")
                break
            buf += chunk
            if len(buf) > MAX_REQUEST_BYTES:
                raise _BadRequest("request too large")
    return bytes(buf)


def _response(code: int, reason: str, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.1 {code} {reason}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


def status_json(node: Node) -> bytes:
    try:
        st: dict[str, Any] = node.status()
    except Exception as exc:  # a role's status() must never take the endpoint down
        log.warning("status() failed: %s", exc, exc_info=True)
        st = {
            "peer_id": node.peer_id,
            "role": node.role,
            "peers": [],
            "swarm": {},
            "gossip": {},
            "error": f"{type(exc).__name__}: {exc}",
        }
    try:  # the code-reward sandbox (issue 15): checked at start by nodes whose run has code tasks
        from node.rl.sandbox import sandbox_status

        st.setdefault("sandbox", sandbox_status())
    except Exception as exc:
        st.setdefault("sandbox", {"isolation": "unavailable", "error": f"{type(exc).__name__}: {exc}"})
    return json.dumps(st, default=str).encode()


def metrics_text(node: Node) -> bytes:
    from prometheus_client import generate_latest

    return generate_latest(node.metrics.registry)


@functools.cache
def dashboard_html() -> bytes:
    return (Path(__file__).with_name("dashboard.html")).read_bytes()


def route(node: Node, method: str, path: str) -> bytes:
    path = path.split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        return _response(405, "Method Not Allowed", b"GET only\n", "text/plain; charset=utf-8")
    if path in ("/", "/index.html"):
        out = _response(200, "OK", dashboard_html(), "text/html; charset=utf-8")
    elif path == "/status":
        out = _response(200, "OK", status_json(node), "application/json")
    elif path == "/metrics":
        from prometheus_client import CONTENT_TYPE_LATEST

        out = _response(200, "OK", metrics_text(node), CONTENT_TYPE_LATEST)
    else:
        return _response(404, "Not Found", b"try / (dashboard), /status or /metrics\n", "text/plain; charset=utf-8")
    if method == "HEAD":
        out = out.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
    return out


async def _handle(node: Node, stream: trio.SocketStream, limit: trio.CapacityLimiter) -> None:
    async with limit:
        try:
            try:
                head = await _read_head(stream)
                line = head.split(b"\n", 1)[0].decode("latin-1").strip()
                parts = line.split()
                if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                    raise _BadRequest(f"bad request line {line[:80]!r}")
                out = route(node, parts[0], parts[1])
            except _BadRequest as exc:
                if str(exc) == "empty":
                    return
                out = _response(400, "Bad Request", f"{exc}\n".encode(), "text/plain; charset=utf-8")
            except trio.TooSlowError:
                out = _response(408, "Request Timeout", b"", "text/plain; charset=utf-8")
            with trio.move_on_after(WRITE_TIMEOUT_S):
                await stream.send_all(out)
                await stream.send_eof()
            # Read what the client still sends (a little, briefly): closing with unread
            # bytes would reset the connection before the client reads our answer.
            with trio.move_on_after(1.0):
                drained = 0
                while drained < 4 * MAX_REQUEST_BYTES and (chunk := await stream.receive_some(MAX_REQUEST_BYTES)):
                    drained += len(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the client went away
        finally:
            with trio.move_on_after(1):
                await stream.aclose()


async def serve_status(node: Node, port: int = 0, *, task_status: TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; ``task_status.started(port)`` with the bound port."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=BIND_HOST)
    except OSError as exc:
        raise NetworkError(
            f"cannot serve status on {BIND_HOST}:{port}: {exc.strerror or exc}"
            f" (pick another --status-port, or 0 for a free one)"
        ) from None
    bound = listeners[0].socket.getsockname()[1]
    limit = trio.CapacityLimiter(MAX_CLIENTS)

    async def handler(stream: trio.SocketStream) -> None:
        await _handle(node, stream, limit)

    async with trio.open_nursery() as nursery:
        try:
            await nursery.start(trio.serve_listeners, handler, listeners)
        except BaseException:
            for lst in listeners:
                await lst.aclose()
            raise
        task_status.started(bound)
