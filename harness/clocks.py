"""Clocks a test moves by hand, and the hooks that put a host's accept-rate bucket on one."""

from __future__ import annotations

from node.p2p import host as host_mod
from node.util import TokenBucket


class StepClock:
    """A clock the test moves by hand (for the accept-rate bucket only)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pace_accepts_of(host, clock: StepClock, step: bool = False) -> None:
    """Put a bare host's accept-rate bucket on ``clock``; ``step``: the clock moves 1/rate at each
    look (where the rate is not under test)."""
    rate = host_mod.INBOUND_CONNECTIONS_PER_S

    def stepping() -> float:
        clock.now += 1.0 / rate
        return clock.now

    host.get_network()._primenode_accept_bucket = TokenBucket(
        rate, host_mod.INBOUND_CONNECTIONS_BURST, clock=stepping if step else clock
    )
