"""A node whose wall clock is wrong is told so (node/p2p/clock.py).

Before this, a node 15 s ahead had every message refused as ``timestamp`` and nobody said
why. Here real libp2p nodes run in one process; one of them seals and judges envelopes by
a wall clock shifted 23 s (``P2PConfig.wall_ms``; the system clock is not touched). It
must log one line naming the offset and the peers, show it in its status, and get a
``clock_skew`` answer carrying the offset when a peer refuses its request; the honest
nodes beside it, which see one odd peer, must not warn.
"""

from __future__ import annotations

import logging
import re

import pytest
import trio

from node.ops.status_cli import render
from node.p2p.clock import ClockSkew, describe
from node.p2p.reqresp import RequestError
from node.p2p.testing import NodeFactory, wait_until
from node.util import now_ms
from protocol import ErrorResponse, PeerExchangeRequest, PeerExchangeResponse
from protocol import reqresp as frames

SHIFT_MS = 23_000
HONEST = 3


@pytest.mark.parametrize("shift_ms", [SHIFT_MS, -SHIFT_MS], ids=["ahead", "behind"])
async def test_a_node_with_a_shifted_clock_is_told_and_says_so_once(shift_ms, caplog):
    caplog.set_level(logging.WARNING, logger="node.p2p.clock")
    async with trio.open_nursery() as nursery:
        net = NodeFactory(nursery)
        boot = await net.start()
        honest = [boot, *[await net.start() for _ in range(HONEST - 1)]]
        skewed = await net.start(wall_ms=lambda: now_ms() + shift_ms)
        await wait_until(
            lambda: skewed.clock_skew.status()["agreeing"] >= HONEST, 60, what="the skewed node to hear every peer"
        )
        clock = skewed.status()["clock"]
        side = "ahead of" if shift_ms > 0 else "behind"
        # "your clock is 23 s ahead of 3 peers; enable NTP": a sample is the shift plus the
        # delay it carried (a request's seal to its arrival), so on a loaded machine a clock
        # ahead reads a few seconds more and one behind a few seconds less
        said = re.fullmatch(rf"your clock is (\d+) s {side} {HONEST} peers; enable NTP .*", clock["warning"] or "")
        low, high = (23, 26) if shift_ms > 0 else (20, 23)
        assert said and low <= int(said[1]) <= high, clock
        assert abs(clock["ahead_ms"] - shift_ms) < 5_000, clock  # sign and size (network delay aside)
        # one line (with the peers heard by then), not one per refused message; the honest
        # nodes in this process log none
        warned = [r.getMessage() for r in caplog.records if "your clock is" in r.getMessage()]
        assert len(warned) == 1 and re.match(rf"your clock is 2\d s {side} ", warned[0]), warned

        if shift_ms > 0:
            # a peer refuses our request for its timestamp and answers with the offset it saw
            assert skewed.reqresp is not None
            with pytest.raises(RequestError) as err:
                await skewed.reqresp.request(
                    honest[1].peer_id, PeerExchangeRequest(max_peers=4), PeerExchangeResponse, timeout=10
                )
            assert err.value.code == frames.CLOCK_SKEW, err.value
            said = re.search(r"says our clock is ([0-9.]+) s ahead of its", err.value.detail)
            assert said and abs(float(said[1]) * 1000 - shift_ms) < 5_000, err.value.detail
            assert re.search(r"\b2[3-6] s ahead of", skewed.clock_skew.warning() or ""), skewed.clock_skew.warning()

        # the control: honest nodes see one odd peer among several and do not warn
        for n in honest:
            st = n.status()["clock"]
            assert st["warning"] is None and st["agreeing"] <= 1, st  # at most the skewed peer
        nursery.cancel_scope.cancel()


def test_primenode_status_shows_the_clock_line():
    from rich.console import Console

    console = Console(width=200, record=True, color_system=None)
    st = {
        "peer_id": "12D3KooWx",
        "clock": {"ahead_ms": 23_000, "peers": 5, "agreeing": 5, "warning": describe(23_000, 5)},
    }
    for r in render(st):
        console.print(r)
    assert "your clock is 23 s ahead of 5 peers; enable NTP" in console.export_text()
    st["clock"] = {"ahead_ms": 12, "peers": 4, "agreeing": 0, "warning": None}
    console = Console(width=200, record=True, color_system=None)
    for r in render(st):
        console.print(r)
    assert "+0.0 s against 4 peers" in console.export_text()


# ------------------------------------------------------------------ the pure parts
class Tick:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_median_ignores_one_wrong_peer_and_the_warning_repeats_only_after_a_while(caplog):
    caplog.set_level(logging.WARNING, logger="node.p2p.clock")
    t = Tick()
    c = ClockSkew(clock=t, repeat_s=600, max_age_s=900)
    for i in range(4):
        c.sample(f"p{i}", 30)
    c.sample("liar", -100_000)  # one peer with a wrong clock (or lying) moves nothing
    assert c.warning() is None and c.status()["ahead_ms"] == 30
    for i in range(4):
        c.sample(f"p{i}", 23_400)  # now we are 23 s ahead of the honest ones
    assert c.warning() == describe(23_400, 4)
    # once, when most peers first agreed (3 of the 5 sampled)
    assert [r.getMessage() for r in caplog.records] == [describe(23_400, 3)]
    t.now = 599
    c.sample("p0", 23_400)
    assert len(caplog.records) == 1
    t.now = 601
    c.sample("p0", 23_400)
    assert len(caplog.records) == 2  # again after repeat_s
    t.now = 2_000  # every sample older than max_age_s: nothing to judge
    assert c.estimate() is None and c.status()["warning"] is None


def test_clock_skew_answers_round_trip_and_garbage_is_no_offset():
    for offset in (23_000, -23_000, 0):
        assert frames.clock_skew_offset(frames.clock_skew(offset)) == offset
    assert frames.clock_skew_offset(ErrorResponse(code="bad_request", detail="23000")) is None
    for detail in ("", "-", "12a", "1e9", "+5", "9" * 17, "١٢"):
        assert frames.clock_skew_offset(ErrorResponse(code=frames.CLOCK_SKEW, detail=detail)) is None, detail
