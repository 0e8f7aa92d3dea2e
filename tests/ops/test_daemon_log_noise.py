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


def test_a_connection_dialled_in_while_we_stop_is_not_logged():
    """Seen in the churn soak (bench/soak.py): every peer that dialled a worker during its
    SIGTERM shutdown got a 10-line WARNING, LifecycleError('Cannot schedule task after
    service has stopped'), a dozen per leaving worker. Another LifecycleError stays."""
    from libp2p.tools.anyio_service.exceptions import LifecycleError

    noise = _StreamOpenNoise()
    assert not noise.filter(_addconn_fail(LifecycleError("Cannot schedule task after service has stopped")))
    assert noise.filter(_addconn_fail(LifecycleError("Cannot start a service twice")))


def _yamux(msg: str) -> logging.LogRecord:
    return logging.LogRecord("libp2p.stream_muxer.yamux.yamux", logging.ERROR, __file__, 1, msg, (), None)


def test_a_connection_closed_under_the_muxer_is_not_logged_but_a_protocol_error_is():
    """Seen in CI: a join that finds its bootstrap foreign hangs up, and py-libp2p's yamux read
    loop logged "Error in handle_incoming ...: ClosedResourceError: " as an ERROR."""
    noise = _StreamOpenNoise()
    assert not noise.filter(_yamux("Error in handle_incoming for peer 12D3KooW...: ClosedResourceError: "))
    assert not noise.filter(_yamux("Error in handle_incoming for peer 12D3KooW...: BrokenResourceError: "))
    assert noise.filter(_yamux("Error in handle_incoming for peer 12D3KooW...: YamuxError: bad frame"))
    assert noise.filter(_yamux("some other yamux ERROR"))
