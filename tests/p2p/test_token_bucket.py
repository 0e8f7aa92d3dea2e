"""The node's one token bucket (node/util.py), on a clock the test moves: ``take`` refuses when
empty (admission), ``reserve`` grants in debt and says how long to wait (pacing)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from harness.clocks import StepClock
from node.util import TokenBucket


def test_take_spends_the_burst_then_refuses_until_the_rate_refills_it():
    clock = StepClock()
    b = TokenBucket(rate=2.0, burst=3.0, clock=clock)
    assert [b.take() for _ in range(4)] == [True, True, True, False]
    clock.now += 0.5  # one token back at 2/s
    assert b.take() and not b.take()
    clock.now += 100.0  # an idle bucket holds at most its burst
    assert [b.take() for _ in range(4)] == [True, True, True, False]


def test_a_refused_take_spends_nothing():
    clock = StepClock()
    b = TokenBucket(rate=1.0, burst=2.0, clock=clock)
    assert not b.take(3.0)
    assert b.take(2.0)


def test_reserve_grants_in_debt_and_later_callers_wait_behind_earlier_ones():
    clock = StepClock()
    b = TokenBucket(rate=10.0, burst=5.0, clock=clock)
    assert b.reserve(5.0) == 0.0  # the burst: at once
    assert b.reserve(10.0) == 1.0  # 10 more at 10/s
    assert b.reserve(10.0) == 2.0  # behind the first, in arrival order
    clock.now += 2.0
    assert b.reserve(0.0) == 0.0  # debt paid
    assert not b.take(1.0)  # and nothing left over


@settings(max_examples=300, deadline=None)
@given(st.data(), st.floats(1.0, 50.0), st.integers(1, 60))
def test_over_any_interval_reserve_grants_at_most_burst_plus_rate_times_its_length(data, rate, burst):
    """Each reservation (at most a burst) counts at the time its wait ends: no window of length T
    holds more than burst + rate * T of them, whatever the arrival pattern."""
    calls = data.draw(st.lists(st.tuples(st.floats(0.0, 2.0), st.integers(1, burst)), min_size=1, max_size=30))
    clock = StepClock()
    b = TokenBucket(rate=rate, burst=float(burst), clock=clock)
    grants: list[tuple[float, int]] = []
    for gap, n in calls:
        clock.now += gap
        grants.append((clock.now + b.reserve(n), n))
    times = sorted(t for t, _ in grants)
    for i, start in enumerate(times):
        for end in times[i:]:
            granted = sum(n for t, n in grants if start <= t <= end)
            assert granted <= burst + rate * (end - start) + 1e-6 * granted
