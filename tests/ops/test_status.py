"""The local status server (in one trio process) and the status CLI's rendering."""

from __future__ import annotations

import io
import json

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from node.ops.status_cli import render
from node.ops.status_server import MAX_REQUEST_BYTES, serve_status
from node.p2p.testing import NodeFactory


async def http(port: int, request: bytes, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(request)
            buf = bytearray()
            while chunk := await stream.receive_some(65536):
                buf += chunk
    head, _, body = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    code = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return code, headers, body


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()


async def with_two_nodes(body):
    async with trio.open_nursery() as nursery:
        net = NodeFactory(nursery)
        boot = await net.start()
        other = await net.start()
        await net.wait_connected(min_peers=1, timeout=60)
        listeners_port = await nursery.start(serve_status, other, 0)
        await body(other, boot, listeners_port)
        nursery.cancel_scope.cancel()


def test_status_and_metrics_endpoints():
    async def body(node, boot, port):
        code, headers, raw = await http(port, get("/status"))
        assert code == 200 and headers["content-type"] == "application/json"
        st = json.loads(raw)
        assert st["peer_id"] == node.peer_id and st["role"] == "worker"
        assert boot.peer_id in {p["peer_id"] for p in st["peers"]}
        assert {"swarm", "gossip", "run_id", "uptime_s", "role_state"} <= set(st)
        assert st["gossip"]["tree"]["links"] >= 1 and {"eager", "lazy"} <= set(st["gossip"]["tree"])
        assert int(headers["content-length"]) == len(raw)

        code, headers, raw = await http(port, get("/metrics"))
        assert code == 200 and headers["content-type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(raw.decode())}
        assert "primenode_peers_connected" in families and "primenode_gossip_published" in families
        published = sum(s.value for s in families["primenode_gossip_published"].samples if s.name.endswith("_total"))
        assert published >= 1  # heartbeats

        assert (await http(port, get("/nope")))[0] == 404
        assert (await http(port, get("/status?x=1")))[0] == 200
        assert (await http(port, b"POST /status HTTP/1.1\r\n\r\n"))[0] == 405
        assert (await http(port, b"garbage\r\n\r\n"))[0] == 400
        code, _, _ = await http(port, b"GET /" + b"a" * (2 * MAX_REQUEST_BYTES) + b" HTTP/1.1\r\n\r\n")
        assert code == 400

    trio.run(with_two_nodes, body)


def test_binds_loopback_only_and_slow_clients_do_not_block_others():
    async def body(node, boot, port):
        # the listening socket is 127.0.0.1, not 0.0.0.0
        import socket

        ip_any_refused = True
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect(("10.255.255.255", 1))
                ip = s.getsockname()[0]
        except OSError:
            ip = None
        if ip and not ip.startswith("127."):
            try:
                with trio.fail_after(5):
                    st = await trio.open_tcp_stream(ip, port)
                await st.aclose()
                ip_any_refused = False
            except (OSError, trio.TooSlowError):
                pass
        assert ip_any_refused

        # clients that connect and send nothing (or half a request) hold no one else up
        idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(5)]
        await idle[0].send_all(b"GET /sta")
        results = []

        async def one():
            results.append((await http(port, get("/status")))[0])

        async with trio.open_nursery() as n:
            for _ in range(10):
                n.start_soon(one)
        assert results == [200] * 10
        # and the server closes idle ones eventually (read timeout), answering 408 or nothing
        with trio.fail_after(30):
            data = await idle[0].receive_some(1024)
        assert data == b"" or b" 408 " in data.split(b"\r\n")[0]
        for s in idle:
            await s.aclose()

    trio.run(with_two_nodes, body)


def test_port_in_use_is_a_clear_error():
    from node.errors import NodeError

    async def main():
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]

        class Fake:
            peer_id, role = "x", "worker"

        try:
            async with trio.open_nursery() as n:
                with pytest.raises(NodeError, match="status-port"):
                    await n.start(serve_status, Fake(), port)
        finally:
            for lst in listeners:
                await lst.aclose()

    trio.run(main)


def _render_text(st: dict) -> str:
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=160)
    for r in render(st):
        console.print(r)
    return buf.getvalue()


BASE = {
    "peer_id": "12D3KooWAAAA",
    "run_id": "ab" * 32,
    "run_name": "r",
    "uptime_s": 3725.0,
    "addrs": ["/ip4/1.2.3.4/tcp/1/p2p/x"],
    "target_peers": 6,
    "peers": [
        {
            "peer_id": "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBB",
            "role": "validator",
            "addr": "/ip4/1.2.3.5/tcp/2",
            "latency_ms": 1.25,
            "banned": False,
        }
    ],
    "swarm": {
        "size": 2,
        "by_role": {"validator": 1, "worker": 1},
        "peers": [
            {"peer_id": "p1", "role": "validator", "policy_version": 3, "batches": 4},
            {"peer_id": "p2", "role": "worker", "policy_version": -1, "batches": 0},
        ],
    },
    "gossip": {
        "received": 10,
        "relayed": 9,
        "published": 2,
        "dropped": 1,
        "received_by_topic": {"vote": 10},
        "relayed_by_topic": {"vote": 9},
        "published_by_topic": {"heartbeat": 2},
        "dropped_by_reason": {"bad_signature": 1},
    },
    "bans": {"12D3KooWCCCCCCCCCCCCCCCCCCCCCCCCC": {"seconds_left": 100.0, "reason": "forged tokens"}},
}
DIST = {
    "versions": [
        {
            "version": 3,
            "chunks_held": 5,
            "chunks_total": 8,
            "complete": False,
            "fetching": True,
            "bytes_served": 2**20,
            "bytes_fetched": 5 * 2**20,
            "fed_from": ["a", "b"],
            "mib_per_s": 12.5,
        }
    ],
    "data_port": 9000,
    "bytes_served": 2**20,
}


@pytest.mark.parametrize(
    "role,state,expect",
    [
        (
            "trainer",
            {
                "step": 7,
                "reward_mean": 0.5,
                "admitted": 11,
                "rejected": 2,
                "pending": 1,
                "buffer": 3,
                "last_step": {"loss": 0.1},
                "distribution": DIST,
            },
            ["trainer", "admitted", "11", "5/8"],
        ),
        (
            "worker",
            {
                "policy_version": 3,
                "batches_produced": 4,
                "batches_accepted": 3,
                "batches_rejected": 1,
                "tamper": None,
                "distribution": DIST,
            },
            ["batches_accepted", "fetching", "2 peers"],
        ),
        (
            "validator",
            {
                "policy_version": 3,
                "verdicts": {"accept": 5, "reject": 2},
                "reasons": {"toploc": 2},
                "recent_rejections": ["12D3KooW: toploc mismatch"],
                "distribution": DIST,
            },
            ["accept 5", "reason: toploc", "recent rejections", "toploc mismatch"],
        ),
        ("bootstrap", {}, ["bootstrap"]),
    ],
)
def test_render_every_role(role, state, expect):
    text = _render_text({**BASE, "role": role, "role_state": state})
    for word in ["connected peers", "1.2 ms", "bad_signature", "forged tokens", "swarm view", "1h02m05s", *expect]:
        assert word in text, (word, text)


def test_fetch_progress_logs_without_a_terminal(caplog):
    from node.checkpoints.fetcher import FetchProgress
    from node.ops.daemon import _FetchReporter

    rep = _FetchReporter(tty=False, every_s=3600)
    with caplog.at_level("INFO", logger="node.ops.daemon"):
        rep.update(
            FetchProgress(version=2, held=1, total=8, bytes_fetched=2**20, mib_per_s=5.0, elapsed_s=0.2, done=False)
        )
        rep.update(
            FetchProgress(version=2, held=2, total=8, bytes_fetched=2**21, mib_per_s=5.0, elapsed_s=0.4, done=False)
        )
        rep.update(
            FetchProgress(version=2, held=8, total=8, bytes_fetched=2**23, mib_per_s=5.0, elapsed_s=1.0, done=True)
        )
        rep.update(
            FetchProgress(version=2, held=8, total=8, bytes_fetched=2**23, mib_per_s=5.0, elapsed_s=1.0, done=True)
        )
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [
        "checkpoint v2: 1/8 chunks, 5.0 MiB/s",  # then rate-limited
        "checkpoint v2: all 8 chunks held (8.0 MiB fetched in 1.0 s)",
    ]


def test_libp2p_tracebacks_are_shortened():
    import logging

    from node.ops.daemon import _QuietTracebacks

    try:
        raise ConnectionResetError("peer hung up")
    except ConnectionResetError:
        import sys

        rec = logging.LogRecord("libp2p.x", logging.WARNING, __file__, 1, "stream %s failed", ("s1",), sys.exc_info())
    assert _QuietTracebacks().filter(rec)
    assert rec.exc_info is None and rec.getMessage() == "stream s1 failed (ConnectionResetError: peer hung up)"
