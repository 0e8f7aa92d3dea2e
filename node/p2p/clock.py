"""How far this node's wall clock is from its peers', and one line telling the operator.

Every envelope carries its signer's wall-clock timestamp and a receiver refuses one
outside ``[now - 120 s, now + 15 s]`` (``protocol.ReplayGuard``). A node whose clock is
15 s ahead had every message refused as ``timestamp`` and was never told why. So each
signed timestamp a node verifies becomes a sample of "how far my clock is ahead of that
peer's" (``ahead_ms``):

* a heartbeat a peer sent us directly: our clock at arrival minus its timestamp (the
  network delay, milliseconds, is counted as clock offset; far below the warning);
* a message we refused for its timestamp, once its signature verified (gossip and
  request/response): the same difference, which is how a node whose clock is *behind*
  learns it (its peers' messages all look to come from the future);
* a peer's ``clock_skew`` answer to our request (``protocol.reqresp``): the offset that
  peer saw, which is how a node whose clock is *ahead* learns that peers refuse it.

The verdict is the median over peers (the newest sample of each, for ``max_age_s``), and
it warns only when most peers sampled are past ``warn_ms`` on the median's side: one peer
with a wrong clock, or one lying, moves nothing. Past ``warn_ms`` the node logs one
line ("your clock is 23 s ahead of 5 peers; enable NTP") when the verdict appears and
again at most every ``repeat_s``, and ``status()`` carries it for ``primenode status``
and ``primenode doctor``.
"""

from __future__ import annotations

import logging
import statistics
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

WARN_MS = 5_000  # a third of the 15 s future window: warn before the refusals start
NTP_HINT = "enable NTP (e.g. `timedatectl set-ntp true`)"


def describe(ahead_ms: float, peers: int) -> str:
    """``your clock is 23 s ahead of 5 peers; enable NTP ...``"""
    side = "ahead of" if ahead_ms > 0 else "behind"
    noun = "peer" if peers == 1 else "peers"
    return f"your clock is {abs(ahead_ms) / 1000:.0f} s {side} {peers} {noun}; {NTP_HINT}"


class ClockSkew:
    """Newest ``ahead_ms`` sample per peer (bounded), their median, and the warning."""

    def __init__(
        self,
        *,
        warn_ms: int = WARN_MS,
        max_age_s: float = 600.0,
        repeat_s: float = 600.0,
        max_peers: int = 1024,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.warn_ms = warn_ms
        self.max_age_s = max_age_s
        self.repeat_s = repeat_s
        self.max_peers = max_peers
        self.clock = clock
        self._samples: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._warned_at: float | None = None
        self.warnings = 0  # lines logged

    def sample(self, peer_id: str, ahead_ms: int) -> None:
        """Record that our clock is ``ahead_ms`` ahead of ``peer_id``'s (negative: behind)."""
        now = self.clock()
        self._samples.pop(peer_id, None)
        self._samples[peer_id] = (int(ahead_ms), now)
        while len(self._samples) > self.max_peers:
            self._samples.popitem(last=False)
        warning = self.warning()
        if warning is None:
            self._warned_at = None  # back in agreement: warn at once if it drifts again
        elif self._warned_at is None or now - self._warned_at >= self.repeat_s:
            self._warned_at = now
            self.warnings += 1
            log.warning("%s", warning)

    def _fresh(self) -> list[int]:
        cutoff = self.clock() - self.max_age_s
        for pid, (_, at) in list(self._samples.items()):
            if at < cutoff:
                del self._samples[pid]
        return [ahead for ahead, _ in self._samples.values()]

    def estimate(self) -> tuple[float, int, int] | None:
        """(median ahead_ms, peers sampled, peers beyond ``warn_ms`` on the median's side),
        or None without a sample."""
        values = self._fresh()
        if not values:
            return None
        median = statistics.median(values)
        agreeing = sum(1 for v in values if abs(v) >= self.warn_ms and (v > 0) == (median > 0))
        return median, len(values), agreeing

    def warning(self) -> str | None:
        """The line to show, when the median is past ``warn_ms`` and most peers sampled agree
        (of two peers one wrong one is not a majority: the median alone would be their mean)."""
        est = self.estimate()
        if est is None or abs(est[0]) < self.warn_ms or 2 * est[2] <= est[1]:
            return None
        return describe(est[0], est[2])

    def status(self) -> dict[str, Any]:
        est = self.estimate()
        if est is None:
            return {"ahead_ms": None, "peers": 0, "agreeing": 0, "warning": None}
        return {"ahead_ms": round(est[0]), "peers": est[1], "agreeing": est[2], "warning": self.warning()}
