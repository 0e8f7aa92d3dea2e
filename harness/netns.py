"""A multi-host testbed on one Linux machine: network namespaces as hosts.

Layout (all names carry a per-testbed tag, so parallel runs do not collide)::

    <tag>i   "the internet": one bridge, 198.18.0.0/15 (RFC 2544 benchmark range)
      |-- public host  <tag>p<n>: eth0 198.18.0.<n>/15, no default route
      |-- router       <tag>r<n>: wan 198.18.1.<n>/15, lan 10.<n>.0.1/24, iptables MASQUERADE
            |-- home host <tag>h<n>: eth0 10.<n>.0.2/24, default route via its router

A router forwards only what its home host started (conntrack ESTABLISHED/RELATED) and
silently drops everything else arriving on its WAN side, like a home router: the home
host can dial out, nobody can dial in. Public hosts have no route to 10.0.0.0/8 at all.

Each host may get a bandwidth cap in each direction (``tc`` ``tbf`` on the egress of the
two ends of its link). The kernel here has tbf/htb but no netem: for delay and loss,
``Testbed(emulate=True)`` puts a userspace switch (harness/lossy_switch.py) where
the bridge was, with a one-way delay per host and a loss rate.
:meth:`Testbed.close` kills every process started through :meth:`Host.popen` and deletes
every namespace (veth pairs go with them), also after a failed test.

Needs root, ``ip`` (iproute2) and ``iptables``; :func:`skip_reason` says in one line
what is missing (tests skip with it).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

_counter = itertools.count()


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


@functools.lru_cache(maxsize=1)
def skip_reason() -> str | None:
    """None if namespaces, veth, bridges and iptables NAT work here; otherwise why not (one line)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 iptables; .ci/run does)"
    name = f"pnprobe{os.getpid()}"
    try:
        _sh("ip", "netns", "add", name)
        try:
            _sh("ip", "netns", "exec", name, "ip", "link", "add", "b0", "type", "bridge")
            _sh("ip", "netns", "exec", name, "iptables", "-t", "nat", "-A", "POSTROUTING", "-j", "MASQUERADE")
        finally:
            _sh("ip", "netns", "del", name, check=False)
    except Exception as exc:
        return f"cannot build a namespace testbed here: {exc}"
    return None


@dataclasses.dataclass
class Host:
    """One namespace. ``ip``: its own address; ``wan_ip``: the address the internet sees."""

    ns: str
    ip: str
    wan_ip: str
    behind_nat: bool
    testbed: Testbed

    def cmd(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *args]

    def run(self, *args: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(*args), capture_output=True, text=True, timeout=timeout, check=check)

    def popen(self, args: Sequence[str], **kw) -> subprocess.Popen:
        """Start a process inside this host (killed by :meth:`Testbed.close`)."""
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.cmd(*args), **kw)
        self.testbed.procs.append(proc)
        return proc


class Testbed:
    """Namespaces as hosts on a bridge "internet", some behind NAT routers. Use as a context manager."""

    __test__ = False  # not a pytest class, despite the name

    def __init__(self, tag: str | None = None, *, emulate: bool = False) -> None:
        """``emulate``: links go through harness/lossy_switch.py (delay and loss per
        host, :meth:`start_switch`) instead of the kernel bridge."""
        # Interface and namespace names stay short (interface names: at most 15 bytes).
        self.tag = tag or f"pn{os.getpid() % 100000}x{next(_counter)}"
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.hosts: dict[str, Host] = {}
        self._n_public = 0
        self._n_nat = 0
        self.inet = f"{self.tag}i"
        self.emulate = emulate
        self.switch_ports: list[tuple[str, float]] = []  # (tap, one-way delay ms)
        self.switch: subprocess.Popen | None = None

    # -------------------------------------------------------------- building
    def _ns(self, name: str) -> str:
        _sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def __enter__(self) -> Testbed:
        try:
            self._ns(self.inet)
            _sh("ip", "-n", self.inet, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.inet, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wire(self, ns: str, dev: str, port: str, addr: str, delay_ms: float = 0.0) -> None:
        """A veth from ``ns`` (as ``dev`` with ``addr``) to the internet bridge (as ``port``);
        with ``emulate``, to its own tap (through a two-port bridge) that the switch serves."""
        _sh("ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", port, "netns", self.inet)
        if self.emulate:
            tap, br = f"t{port}", f"b{port}"
            _sh("ip", "-n", self.inet, "tuntap", "add", "dev", tap, "mode", "tap")
            _sh("ip", "-n", self.inet, "link", "add", br, "type", "bridge")
            for d in (tap, port):
                _sh("ip", "-n", self.inet, "link", "set", d, "master", br)
                _sh("ip", "-n", self.inet, "link", "set", d, "up")
            _sh("ip", "-n", self.inet, "link", "set", br, "up")
            self.switch_ports.append((tap, delay_ms))
        else:
            _sh("ip", "-n", self.inet, "link", "set", port, "master", "br0")
        _sh("ip", "-n", self.inet, "link", "set", port, "up")
        _sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")

    def add_public(
        self, name: str, *, up_mbit: float | None = None, down_mbit: float | None = None, delay_ms: float = 0.0
    ) -> Host:
        """A host with its own address on the internet (``delay_ms``: one way, with ``emulate``)."""
        self._n_public += 1
        n = self._n_public
        ns = self._ns(f"{self.tag}p{n}")
        ip = f"198.18.0.{n}"
        self._wire(ns, "eth0", f"p{n}", f"{ip}/15", delay_ms)
        host = Host(ns, ip, ip, False, self)
        self.hosts[name] = host
        self._cap(ns, "eth0", up_mbit)
        self._cap(self.inet, f"p{n}", down_mbit)
        return host

    def add_nat(
        self, name: str, *, up_mbit: float | None = None, down_mbit: float | None = None, delay_ms: float = 0.0
    ) -> Host:
        """A home host behind its own NAT router (outbound only)."""
        self._n_nat += 1
        n = self._n_nat
        rns = self._ns(f"{self.tag}r{n}")
        hns = self._ns(f"{self.tag}h{n}")
        wan = f"198.18.1.{n}"
        self._wire(rns, "wan", f"r{n}", f"{wan}/15", delay_ms)
        _sh("ip", "-n", rns, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", hns)
        _sh("ip", "-n", rns, "addr", "add", f"10.{n}.0.1/24", "dev", "lan")
        _sh("ip", "-n", rns, "link", "set", "lan", "up")
        _sh("ip", "-n", hns, "addr", "add", f"10.{n}.0.2/24", "dev", "eth0")
        _sh("ip", "-n", hns, "link", "set", "eth0", "up")
        _sh("ip", "-n", hns, "route", "add", "default", "via", f"10.{n}.0.1")
        ipt = ["ip", "netns", "exec", rns, "iptables"]
        _sh("ip", "netns", "exec", rns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        _sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
        est = ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]
        _sh(*ipt, "-A", "FORWARD", "-i", "wan", "-o", "lan", *est)
        _sh(*ipt, "-A", "FORWARD", "-i", "wan", "-j", "DROP")
        _sh(*ipt, "-A", "INPUT", "-i", "wan", *est)
        _sh(*ipt, "-A", "INPUT", "-i", "wan", "-j", "DROP")
        host = Host(hns, f"10.{n}.0.2", wan, True, self)
        self.hosts[name] = host
        self._cap(hns, "eth0", up_mbit)
        self._cap(rns, "lan", down_mbit)
        return host

    @staticmethod
    def _cap(ns: str, dev: str, mbit: float | None) -> None:
        """Token-bucket cap on ``dev``'s egress (burst: 10 ms at the rate, at least 32 KiB)."""
        if not mbit:
            return
        burst = max(32 * 1024, int(mbit * 1e6 / 8 / 100))
        _sh(
            "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
            "tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms",
        )  # fmt: skip

    def start_switch(self, loss: float = 0.0, seed: int = 0) -> None:
        """Start the delaying, dropping switch (``emulate``), after every host is added."""
        assert self.emulate and self.switch is None, "start_switch needs Testbed(emulate=True), once"
        ports = [f"{tap}:{ms}" for tap, ms in self.switch_ports]
        args = [sys.executable, "-m", "harness.lossy_switch", "--loss", str(loss), "--seed", str(seed), *ports]
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        self.switch = Host(self.inet, "", "", False, self).popen(args, stdout=subprocess.PIPE, text=True, env=env)
        line = self.switch.stdout.readline().strip() if self.switch.stdout else ""
        if line != "ready":
            raise RuntimeError(f"the lossy switch did not start: {line!r}")

    def switch_stats(self) -> dict:
        """Stop the switch and return its counters (frames forwarded, dropped)."""
        if self.switch is None or self.switch.poll() is not None:
            return {}
        self.switch.send_signal(signal.SIGTERM)
        out, _ = self.switch.communicate(timeout=10)
        try:
            return json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {}

    # -------------------------------------------------------------- teardown
    def close(self) -> None:
        """Kill what runs inside, then delete every namespace (idempotent)."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + 20
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        self.procs.clear()
        for ns in reversed(self.namespaces):
            _sh("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()


def leftover_namespaces(tag: str) -> list[str]:
    """Namespaces whose name starts with ``tag`` (a teardown check)."""
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(tag)]
