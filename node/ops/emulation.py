"""Nodes that share one machine, run as if each had cores of its own (benchmarks only).

On the internet every node of a run has its own hardware; a devnet's six processes share
this machine's cores, so a phase that runs alone (lock-step's trainer step) takes every
core while overlapping phases (the asynchronous pipeline) share them, and neither is what
a real swarm sees. Two tools undo that, together:

* **a CPU quota per node process** (``NodeCores``): the kernel's CFS bandwidth control
  (cgroup ``cpu`` controller, v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``) caps each node at
  its CPUs whether the others are busy or idle, as its own machine would;
* **time dilation** (``DilatedClock``): every trio timer, timeout and token bucket of a
  node runs ``dilation`` times slower than real time, while its CPU work takes real time
  (Gupta et al., "To Infinity and Beyond: Time-Warped Network Emulation", NSDI 2006). With
  ``dilation`` = the nodes' CPUs together / this machine's cores, each node's quota is
  its CPUs / ``dilation`` real CPUs: the quotas fill the machine, and per emulated second
  each node gets its own CPUs' worth of work, never more (a lone phase cannot borrow an
  idle neighbour's share, as it could not on the internet), beside a 100 Mbit/s upload
  cap that passes 100 Mbit per emulated second.

Child processes learn the dilation from ``PRIMENODE_TIME_DILATION`` (the daemon's trio
clock). Wall-clock message timestamps stay real: freshness checks only get stricter.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import trio

from node.errors import ConfigError

DILATION_ENV = "PRIMENODE_TIME_DILATION"


class DilatedClock(trio.abc.Clock):
    """A trio clock running ``dilation`` times slower than real time (module docstring)."""

    def __init__(self, dilation: float) -> None:
        self.dilation = dilation
        self.t0 = time.perf_counter()

    def start_clock(self) -> None:
        self.t0 = time.perf_counter()

    def current_time(self) -> float:
        return (time.perf_counter() - self.t0) / self.dilation

    def deadline_to_sleep_time(self, deadline: float) -> float:
        return max(0.0, (deadline - self.current_time()) * self.dilation)


def clock_from_env() -> DilatedClock | None:
    """The daemon's trio clock: dilated when ``PRIMENODE_TIME_DILATION`` is above 1."""
    raw = os.environ.get(DILATION_ENV, "")
    if not raw:
        return None
    try:
        dilation = float(raw)
    except ValueError:
        raise ConfigError(f"{DILATION_ENV}={raw!r} is not a number (a time dilation >= 1)") from None
    if not dilation >= 1.0:
        raise ConfigError(f"{DILATION_ENV}={raw!r}: a time dilation is >= 1 (1: real time)")
    return DilatedClock(dilation) if dilation > 1.0 else None


def own_cores_dilation(total_cores: float, machine_cores: int | None = None) -> float:
    """The dilation that fits busy nodes holding ``total_cores`` CPUs together onto this
    machine, each getting its own per emulated second (1: it has them already)."""
    return max(1.0, total_cores / (machine_cores or os.cpu_count() or 1))


ROLES = ("trainer", "worker", "validator", "bootstrap")


def parse_node_cores(spec: str) -> dict[str, float]:
    """``--node-cores``: one number for every role ("1"), or per role
    ("trainer=2,worker=0.5,validator=1"; a role left out gets the smallest named, the
    bootstrap too). ``{}``: no quotas ("0" or "")."""
    spec = spec.strip()
    if not spec:
        return {}
    try:
        if "=" not in spec:
            cores = float(spec)
            return {} if cores == 0 else dict.fromkeys(ROLES, _positive(cores))
        named: dict[str, float] = {}
        for part in spec.split(","):
            role, _, value = part.partition("=")
            role = role.strip()
            if role not in ROLES:
                raise ConfigError(f"--node-cores: unknown role {role!r} (one of {', '.join(ROLES)})")
            named[role] = _positive(float(value))
    except ValueError:
        raise ConfigError(
            f"--node-cores {spec!r}: a number of CPUs, or ROLE=CPUS,... (e.g. trainer=2,worker=0.5)"
        ) from None
    least = min(named.values())
    return {role: named.get(role, least) for role in ROLES}


def _positive(cores: float) -> float:
    if not cores > 0:
        raise ConfigError(f"--node-cores: a node's CPU quota must be > 0 CPUs, got {cores}")
    return cores


class NodeCores:
    """CPU quotas for a devnet's node processes: one cgroup per node under the ``cpu``
    controller, capped at its CPUs (CFS bandwidth control, period 100 ms). Needs root and a
    writable cgroup ``cpu`` controller (v1 or v2); ``ConfigError`` says so otherwise.
    ``close`` removes the groups once their processes are gone."""

    PERIOD_US = 100_000

    def __init__(self, tag: str) -> None:
        self.tag = tag
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        if (v1 / "cpu.cfs_quota_us").exists():
            self.root, self.v2 = v1, False
        elif "cpu" in _read(v2 / "cgroup.controllers").split():
            self.root, self.v2 = v2, True
        else:
            raise ConfigError(
                "per-node CPU quotas need the cgroup cpu controller (/sys/fs/cgroup/cpu or cgroup v2 with cpu); "
                "run without --node-cores"
            )
        self.groups: list[Path] = []

    def place(self, name: str, pid: int, cores: float) -> None:
        """Move process ``pid`` (and the threads it starts later) into ``name``'s group,
        capped at ``cores`` CPUs."""
        group = self.root / f"primenode-{self.tag}-{name}"
        quota = max(1000, int(_positive(cores) * self.PERIOD_US))
        try:
            group.mkdir(exist_ok=True)
            if self.v2:
                (self.root / "cgroup.subtree_control").write_text("+cpu")
                (group / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
            (group / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            raise ConfigError(
                f"cannot set a CPU quota in {group}: {exc} (needs root); run without --node-cores"
            ) from None
        if group not in self.groups:
            self.groups.append(group)

    def close(self) -> None:
        for group in self.groups:
            try:
                group.rmdir()
            except OSError:
                pass  # a process still in it (the kernel removes nothing while one is)
        self.groups.clear()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
