"""A token bucket shared by every upload of a node (``--max-upload-mbps``)."""

from __future__ import annotations

import trio


class UploadLimiter:
    """Caps throughput at ``rate`` bytes/s with bursts of at most ``burst`` bytes.

    Reservations are served in arrival order (virtual finishing times), so
    concurrent uploads share the cap fairly. ``rate <= 0`` means unlimited.

    ``_t`` is the virtual time at which everything granted so far has drained at
    ``rate``; a reservation may start once that lies at most ``burst / rate`` ahead
    of now. Over any interval of length T at most ``burst + rate * T`` bytes are
    granted (tested in tests/checkpoints/test_checkpoints_ratelimit.py).
    """

    def __init__(self, rate: float, burst: int = 512 * 1024) -> None:
        self.rate = float(rate)
        self.burst = burst
        self._t = 0.0

    @classmethod
    def from_mbps(cls, mbps: float, burst: int = 512 * 1024) -> UploadLimiter:
        return cls(mbps * 1e6 / 8 if mbps and mbps > 0 else 0.0, burst)

    @property
    def limited(self) -> bool:
        return self.rate > 0

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        now = trio.current_time()
        # an idle bucket holds at most ``burst`` tokens: its drain time never lags behind now
        # (it started at ``now - burst / rate`` here before, which allowed bursts of 2 x burst)
        start = max(self._t, now)
        self._t = start + n / self.rate
        delay = self._t - self.burst / self.rate - now
        if delay > 0:
            await trio.sleep(delay)
