"""The pace of every upload of a node (``--max-upload-mbps``), on the node's one token bucket."""

from __future__ import annotations

import trio

from node.util import TokenBucket


class UploadLimiter:
    """Caps throughput at ``rate`` bytes/s with bursts of at most ``burst`` bytes.

    Each upload reserves its bytes on a :class:`~node.util.TokenBucket` on trio's clock and
    sleeps off the debt, so reservations are served in arrival order and concurrent uploads
    share the cap fairly; over any interval of length T at most ``burst + rate * T`` bytes are
    granted (tested in tests/checkpoints/test_checkpoints_ratelimit.py). ``rate <= 0`` means
    unlimited. The bucket is made on first use: trio's clock exists only inside ``trio.run``.
    """

    def __init__(self, rate: float, burst: int = 512 * 1024) -> None:
        self.rate = float(rate)
        self.burst = burst
        self._bucket: TokenBucket | None = None

    @classmethod
    def from_mbps(cls, mbps: float, burst: int = 512 * 1024) -> UploadLimiter:
        return cls(mbps * 1e6 / 8 if mbps and mbps > 0 else 0.0, burst)

    @property
    def limited(self) -> bool:
        return self.rate > 0

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        if self._bucket is None:
            self._bucket = TokenBucket(self.rate, self.burst, clock=trio.current_time)
        delay = self._bucket.reserve(n)
        if delay > 0:
            await trio.sleep(delay)
