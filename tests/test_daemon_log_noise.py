"""The daemon's filters on py-libp2p's log lines (node/ops/daemon.py): routine events go,
real failures stay."""

from __future__ import annotations

import logging

import trio

from node.ops.daemon import _StreamOpenNoise


def _addconn_fail(exc: BaseException) -> logging.LogRecord:
    """py-libp2p's swarm logs this, the traceback formatted into the message."""
    return logging.LogRecord(
        "libp2p.network.swarm",
        logging.WARNING,
        __file__,
        1,
        "[ADDCONN_FAIL] add_conn failed for peer %s: %r\n%s",
        ("12D3KooW...", exc, "Traceback (most recent call last): ..."),
        None,
    )


def test_a_connection_add_cancelled_by_us_is_not_logged_but_a_failed_one_is():
    """Seen in CI: a join against a foreign bootstrap cancels the gossip link's task while
    the swarm still adds the connection, and py-libp2p logged the cancellation's whole
    traceback as a WARNING (test_join_foreign found it in the log)."""
    noise = _StreamOpenNoise()

    async def cancelled() -> BaseException:
        with trio.CancelScope() as scope:
            scope.cancel()
            try:
                await trio.sleep(1)
            except trio.Cancelled as exc:
                return exc
        raise AssertionError("not cancelled")

    assert not noise.filter(_addconn_fail(trio.run(cancelled)))
    assert noise.filter(_addconn_fail(OSError("connection reset")))  # a real failure stays
