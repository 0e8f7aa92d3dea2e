"""Benchmarks' emulation of nodes with cores of their own (node/ops/emulation.py): the
dilated trio clock the daemon takes from its environment, and per-node CPU quotas."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

from node.errors import ConfigError
from node.ops.emulation import (
    DILATION_ENV,
    ROLES,
    DilatedClock,
    NodeCores,
    clock_from_env,
    own_cores_dilation,
    parse_node_cores,
)


def test_the_daemon_clock_is_real_time_unless_the_environment_dilates_it(monkeypatch):
    monkeypatch.delenv(DILATION_ENV, raising=False)
    assert clock_from_env() is None
    monkeypatch.setenv(DILATION_ENV, "1")
    assert clock_from_env() is None
    monkeypatch.setenv(DILATION_ENV, "2.5")
    clock = clock_from_env()
    assert isinstance(clock, DilatedClock) and clock.dilation == 2.5
    for bad in ("fast", "0.5", "nan"):
        monkeypatch.setenv(DILATION_ENV, bad)
        with pytest.raises(ConfigError, match=DILATION_ENV):
            clock_from_env()


def test_a_dilated_clock_stretches_every_timer_by_its_dilation():
    """An emulated second lasts ``dilation`` real seconds: trio sleeps that long for a
    deadline one emulated second away, and reads emulated time back."""
    clock = DilatedClock(4.0)
    clock.start_clock()
    now = clock.current_time()
    assert clock.deadline_to_sleep_time(now + 1.0) == pytest.approx(4.0, abs=0.01)
    assert clock.deadline_to_sleep_time(now - 1.0) == 0.0

    async def main() -> tuple[float, float]:
        t0 = trio.current_time()
        await trio.sleep(0.01)
        return t0, trio.current_time()

    t0, t1 = trio.run(main, clock=clock)
    assert t1 - t0 >= 0.01  # emulated time passed as asked


def test_own_cores_dilation_fits_the_quotas_to_the_machine():
    assert own_cores_dilation(5.0, machine_cores=2) == 2.5
    assert own_cores_dilation(1.0, machine_cores=2) == 1.0  # it has them already


def test_node_cores_are_one_number_for_all_or_per_role():
    assert parse_node_cores("0") == {} and parse_node_cores("") == {}
    assert parse_node_cores("1.5") == dict.fromkeys(ROLES, 1.5)
    cores = parse_node_cores("trainer=2,worker=0.5,validator=1")
    assert cores == {"trainer": 2.0, "worker": 0.5, "validator": 1.0, "bootstrap": 0.5}
    for bad, why in (("gpu=1", "unknown role"), ("trainer=fast", "ROLE=CPUS"), ("worker=0", "> 0")):
        with pytest.raises(ConfigError, match=why):
            parse_node_cores(bad)


def _cgroup_cpu() -> bool:
    try:
        NodeCores("probe")
    except ConfigError:
        return False
    return True


@pytest.mark.skipif(not _cgroup_cpu(), reason="no cgroup cpu controller here")
def test_a_node_process_is_placed_in_a_cpu_quota_group_that_goes_with_it(tmp_path: Path):
    """A process placed by NodeCores runs in its own group capped at the quota; once the
    process is gone, close() removes the group."""
    cores = NodeCores(f"test-{tmp_path.name}")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cores.place("worker-0", proc.pid, 0.5)
        (group,) = cores.groups
        assert group.name in Path(f"/proc/{proc.pid}/cgroup").read_text()
        quota = (
            (group / "cpu.max").read_text().split()[0] if cores.v2 else (group / "cpu.cfs_quota_us").read_text().strip()
        )
        assert int(quota) == NodeCores.PERIOD_US // 2
    finally:
        proc.kill()
        proc.wait()
    cores.close()
    assert not group.exists()
