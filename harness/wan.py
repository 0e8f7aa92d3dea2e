"""A whole primenode network spread over namespace hosts (harness/netns.py).

:class:`WanDevnet` takes what ``primenode devnet`` prepares (homes, a signed genesis,
the command line of every node) and runs each node as a real ``primenode`` process in
its own host: public, or behind its own NAT router, each with its own bandwidth caps.
Used by tests/system/test_nat_devnet.py and bench/wan.py.

Each node listens on its host's address; ``advertise_host`` in its ``config.toml`` is
that address too (the data plane's tickets name it). Status is read inside the node's
namespace (its status endpoint listens on that namespace's 127.0.0.1).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

from harness.netns import Host, Testbed
from node.ops.devnet import Devnet, DevnetOptions, NodeProc, primenode_cmd

PORT = 4001

# argv: runtime.json, output file, period (s). Waits for the node's status port, then copies
# its status JSON (atomically, with the time it was read) until killed.
_POLLER = """
import json, os, sys, time, urllib.request
runtime, out, period = sys.argv[1], sys.argv[2], float(sys.argv[3])
while True:
    try:
        port = json.load(open(runtime))["status_port"]
        body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5).read())
        body["polled_at"] = time.time()
        with open(out + ".tmp", "w") as f:
            json.dump(body, f)
        os.replace(out + ".tmp", out)
    except Exception:
        pass
    time.sleep(period)
"""


@dataclasses.dataclass
class Placement:
    """Where a node runs: ``nat`` or public, and its caps in Mbit/s (None: uncapped)."""

    nat: bool = False
    up_mbit: float | None = None
    down_mbit: float | None = None


class WanDevnet:
    """A :class:`Devnet` whose nodes run in namespace hosts. Use as a context manager."""

    def __init__(
        self, opts: DevnetOptions, placement: dict[str, Placement], testbed: Testbed, poll_s: float = 1.0
    ) -> None:
        self.devnet = Devnet(opts)
        self.placement = placement
        self.tb = testbed
        self.hosts: dict[str, Host] = {}
        self.poll_s = poll_s
        self.status_dir = self.devnet.out / "status"

    @property
    def nodes(self) -> list[NodeProc]:
        return self.devnet.nodes

    def node(self, name: str) -> NodeProc:
        return self.devnet.node(name)

    def prepare(self) -> None:
        d = self.devnet
        d.prepare()
        for n in d.nodes:
            p = self.placement.get(n.name, Placement())
            add = self.tb.add_nat if p.nat else self.tb.add_public
            self.hosts[n.name] = host = add(n.name, up_mbit=p.up_mbit, down_mbit=p.down_mbit)
            cfg = n.home.config_path
            text = cfg.read_text()
            cfg.write_text(re.sub(r'(?m)^advertise_host = ".*"$', f'advertise_host = "{host.ip}"', text))
        boot = d.node("bootstrap")
        boot_addr = f"/ip4/{self.hosts['bootstrap'].ip}/tcp/{PORT}/p2p/{boot.home.load_key().peer_id}"
        d.bootstrap_addr = boot_addr
        for n in d.nodes:
            args = list(n.args)
            for i, a in enumerate(args[:-1]):
                if a == "--listen":
                    args[i + 1] = f"/ip4/{self.hosts[n.name].ip}/tcp/{PORT}"
                elif a == "--bootstrap":
                    args[i + 1] = boot_addr
            n.args = args

    def start_all(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        for n in self.devnet.nodes:
            n.log = open(self.devnet.out / "logs" / f"{n.name}.log", "ab")  # noqa: SIM115  (closed by stop_all)
            n.proc = self.hosts[n.name].popen(primenode_cmd() + n.args, stdout=n.log, stderr=subprocess.STDOUT, env=env)
            if n.role == "bootstrap":
                self._wait_listening(n)
        self._start_pollers()

    def _wait_listening(self, n: NodeProc, guard_s: float = 120.0) -> None:
        """Until ``n`` wrote its runtime file (it does once it listens): the others dial it
        first thing. A hang guard, not a threshold."""
        deadline = time.monotonic() + guard_s
        while not n.home.runtime_path.exists():
            if n.proc is not None and n.proc.poll() is not None:
                raise RuntimeError(f"{n.name} exited before it listened{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n.name} did not listen within {guard_s:g} s{self.logs()}")
            time.sleep(0.1)

    def status(self, name: str) -> dict[str, Any] | None:
        """The node's newest status object (written by its poller; None until it answers)."""
        try:
            st: dict[str, Any] = json.loads((self.status_dir / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None
        return st

    def _start_pollers(self) -> None:
        """One small process per host copies the node's status (its endpoint listens on that
        namespace's 127.0.0.1) into ``status/<name>.json`` every ``poll_s`` seconds."""
        self.status_dir.mkdir(parents=True, exist_ok=True)
        for n in self.devnet.nodes:
            out = self.status_dir / f"{n.name}.json"
            self.hosts[n.name].popen(
                [sys.executable, "-c", _POLLER, str(n.home.runtime_path), str(out), str(self.poll_s)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

    def cli_status(self, name: str) -> subprocess.CompletedProcess:
        """``primenode status --home H`` as a user runs it on that host."""
        return self.hosts[name].run(*primenode_cmd(), "status", "--home", str(self.node(name).home.path), timeout=60)

    def logs(self, tail: int = 3000) -> str:
        out = ""
        for p in sorted((self.devnet.out / "logs").glob("*.log")):
            out += f"\n--- {p.name}\n" + p.read_text(errors="replace")[-tail:]
        return out

    def __enter__(self) -> WanDevnet:
        self.prepare()
        self.start_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.devnet.stop_all()
