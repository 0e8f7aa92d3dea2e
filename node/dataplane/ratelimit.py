"""A token bucket shared by every upload of a node (``--max-upload-mbps``)."""

from __future__ import annotations

import trio


class TokenBucket:
    """Caps throughput at ``rate`` bytes/s with bursts of at most ``burst`` bytes.

    Reservations are served in arrival order (virtual finishing times), so
    concurrent uploads share the cap fairly. ``rate <= 0`` means unlimited.
    """

    def __init__(self, rate: float, burst: int = 512 * 1024) -> None:
        self.rate = float(rate)
        self.burst = burst
        self._t = 0.0

    @classmethod
    def from_mbps(cls, mbps: float, burst: int = 512 * 1024) -> "TokenBucket":
        return cls(mbps * 1e6 / 8 if mbps and mbps > 0 else 0.0, burst)

    @property
    def limited(self) -> bool:
        return self.rate > 0

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        now = trio.current_time()
        start = max(self._t, now - self.burst / self.rate)
        self._t = start + n / self.rate
        delay = self._t - self.burst / self.rate - now
        if delay > 0:
            await trio.sleep(delay)
