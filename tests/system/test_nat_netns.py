"""NAT'd nodes across separate hosts: network namespaces, NAT routers (iptables MASQUERADE), real processes.

The testbed (harness/netns.py) is checked first: a home host dials out and is seen
from its router's address, nobody dials in. Then overlay nodes run as processes in it
(harness/nat_child.py): public nodes learn they are public from dial-backs, NAT'd
ones that they are not, reserve relay slots and advertise circuit addresses only (and
data port 0), two NAT'd nodes reach each other through a relay and the library's DCUtR
makes it direct (a real TCP hole punch through two MASQUERADE routers). An adversarial case: a NAT'd node advertising its router's
address as its own is told "reachable" by py-libp2p's stock AutoNAT server (which answers
over the requester's own connection) and "not reachable" by ours (a fresh dial).

Skipped, with one line saying why, where namespaces cannot be built (not root, no
iproute2/iptables); CI runs as root and .ci/run installs both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.netns import Testbed, leftover_namespaces, skip_reason
from protocol import NodeKey
from protocol.reqresp import PROTOCOL_ID as RR_PROTOCOL

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))

REPO = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 120  # hang guards, not performance thresholds
PORT = 4001
DATA_PORT = 9000  # advertised only: these nodes run no chunk server


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_testbed_nat_is_outbound_only_and_torn_down():
    with Testbed() as tb:
        pub = tb.add_public("pub")
        home = tb.add_nat("home")
        tag = tb.tag
        server = pub.popen(
            _py(
                "import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
                "s.bind(('0.0.0.0',5000));s.listen();print('ready',flush=True);c,a=s.accept();print(a[0],flush=True)"
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout.readline().strip() == "ready"
        out = home.run(*_py(f"import socket;socket.create_connection(('{pub.ip}',5000),timeout=5);print('ok')"))
        assert out.stdout.strip() == "ok", out.stderr
        assert server.stdout.readline().strip() == home.wan_ip  # masqueraded: the router's address
        home.popen(_py("import socket;s=socket.socket();s.bind(('0.0.0.0',5001));s.listen();s.accept()"))
        for target in (home.ip, home.wan_ip):  # neither the private address nor the router lets us in
            code = f"import socket;socket.create_connection(('{target}',5001),timeout=2)"
            res = pub.run(*_py(code))
            assert res.returncode != 0 and ("unreachable" in res.stderr or "timed out" in res.stderr), res.stderr
        assert leftover_namespaces(tag)
    assert leftover_namespaces(tag) == []


def test_lossy_switch_delays_and_drops_frames():
    """The emulated link: a TCP connect takes at least the configured round trip
    (2 x (20 + 20) ms), and frames are dropped at the configured rate, yet TCP gets through."""
    with Testbed(emulate=True) as tb:
        a, b = tb.add_public("a", delay_ms=20), tb.add_public("b", delay_ms=20)
        tb.start_switch(loss=0.1, seed=3)
        server = b.popen(
            _py(
                "import socket;s=socket.socket();s.bind(('0.0.0.0',5000));s.listen();print('ready',flush=True)\n"
                "while True:\n c,_=s.accept();c.sendall(c.recv(100));c.close()"
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout.readline().strip() == "ready"
        code = (
            "import socket,time\nfor i in range(10):\n t=time.monotonic()\n"
            f" s=socket.create_connection(('{b.ip}',5000),timeout=30)\n print(time.monotonic()-t)\n"
            " s.sendall(b'x');assert s.recv(100)==b'x';s.close()"
        )
        res = a.run(*_py(code), timeout=300)
        assert res.returncode == 0, res.stderr
        connects = [float(x) for x in res.stdout.split()]
        assert len(connects) == 10 and min(connects) >= 0.080, connects
        stats = tb.switch_stats()
        assert stats["dropped"] > 0 and stats["forwarded"] > 0, stats


def test_lossy_switch_loses_ip_frames_but_never_arp():
    """Loss stands for the internet path, not a host's own first hop: at 100 % loss no IP
    packet crosses, yet ARP still resolves the peer's MAC (dropping ARP too made connects fail
    with EHOSTUNREACH when the kernel's three probes were all lost, a CI failure at 10 %).
    Control: the TCP connect's SYNs, IP packets, are all lost."""
    with Testbed(emulate=True) as tb:
        a, b = tb.add_public("a", delay_ms=1), tb.add_public("b", delay_ms=1)
        tb.start_switch(loss=1.0, seed=1)
        syn = a.run(*_py(f"import socket;socket.create_connection(('{b.ip}',5000),timeout=2)"))
        assert syn.returncode != 0 and "timed out" in syn.stderr, syn.stderr  # every SYN is dropped
        neigh = a.run("ip", "neigh", "show", b.ip)
        assert "lladdr" in neigh.stdout, neigh.stdout  # ARP got through both ways


class Net:
    """Overlay processes in a testbed; each writes its status JSON to a file we poll."""

    def __init__(self, tb: Testbed, tmp: Path) -> None:
        self.tb, self.tmp = tb, tmp
        self.keys: dict[str, NodeKey] = {}
        self.hosts: dict[str, object] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, host, *extra: str) -> str:
        key = NodeKey(os.urandom(32))
        self.keys[name], self.hosts[name] = key, host
        log = self.tmp / f"{name}.log"
        self.logs[name] = log
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        args = [
            sys.executable,
            "-m",
            "harness.nat_child",
            "--seed",
            key.seed.hex(),
            "--data-port",
            str(DATA_PORT),
        ]
        args += ["--status", str(self.tmp / f"{name}.json"), *extra]
        with open(log, "wb") as f:
            host.popen(args, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        return key.peer_id

    def addr(self, name: str) -> str:
        return f"/ip4/{self.hosts[name].ip}/tcp/{PORT}/p2p/{self.keys[name].peer_id}"

    def status(self, name: str) -> dict:
        try:
            return json.loads((self.tmp / f"{name}.json").read_text())
        except (OSError, ValueError):
            return {}

    def wait(self, pred, what: str, timeout: float = HANG_GUARD_S):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            dead = [p for p in self.tb.procs if p.poll() is not None]
            if dead:
                break
            time.sleep(0.5)
        logs = "".join(f"\n--- {n}\n{p.read_text()[-2500:]}" for n, p in self.logs.items() if p.exists())
        states = {n: (self.status(n).get("nat") or {}) for n in self.keys}
        pytest.fail(f"waiting for {what}: gave up\nnat states: {json.dumps(states, indent=1)}{logs}")

    def nat(self, name: str) -> dict:
        return self.status(name).get("nat") or {}


@pytest.mark.slow  # ~30-65 s on two quiet cores: the slow tier (README)
def test_nat_nodes_learn_reachability_reserve_relays_and_reach_each_other(tmp_path):
    with Testbed() as tb:
        boot_h, pub_h = tb.add_public("boot"), tb.add_public("pub")
        n1_h, n2_h, liar_h = tb.add_nat("n1"), tb.add_nat("n2"), tb.add_nat("liar")
        net = Net(tb, tmp_path)
        listen = lambda h: ["--listen", f"/ip4/{h.ip}/tcp/{PORT}"]  # noqa: E731
        net.start("boot", boot_h, *listen(boot_h))
        net.wait(lambda: net.status("boot"), "boot to listen")  # its first status: after it listens
        boot = ["--bootstrap", net.addr("boot")]
        # The public peer runs py-libp2p's stock AutoNAT server (the adversarial control below).
        net.start("pub", pub_h, *listen(pub_h), *boot, "--stock-autonat")
        n1 = net.start("n1", n1_h, *listen(n1_h), *boot)
        n2 = net.start("n2", n2_h, *listen(n2_h), *boot)
        # Claims its router's address as its own (as if it had a port forward it does not have).
        net.start("liar", liar_h, "--listen", f"/ip4/0.0.0.0/tcp/{PORT}", "--advertise", liar_h.wan_ip, *boot)

        # Public nodes: dial-backs succeed.
        for name in ("boot", "pub"):
            net.wait(lambda n=name: net.nat(n).get("reachability") == "public", f"{name} to find itself public")
        # NAT'd nodes: the servers refuse (their addresses are not the one the server sees).
        for name in ("n1", "n2"):
            st = net.wait(lambda n=name: net.nat(n).get("reachability") == "private" and net.nat(n), f"{name} private")
            assert set(st["verdicts"].values()) <= {"refused", "failed"}, st
        # They reserve slots on public relays and advertise only circuit addresses, data port 0.
        for name in ("n1", "n2"):
            net.wait(lambda n=name: net.nat(n).get("relays"), f"{name} to hold a relay reservation")
            addrs = net.wait(lambda n=name: net.status(n).get("addrs"), f"{name}'s addresses")
            net.wait(
                lambda n=name: all("/p2p-circuit/p2p/" in a for a in net.status(n).get("addrs") or ["x"]),
                f"{name} to advertise circuit addresses only",
            )
            assert "behind NAT via relay" in net.nat(name)["summary"], net.nat(name)
        assert addrs

        # Peers see data port 0 for NAT'd nodes (nobody tries to fetch chunks from them) once
        # they know they are behind NAT (earlier heartbeats carried their own addresses); every
        # node here is configured with data port DATA_PORT, and public ones advertise it.
        def seen_by_pub(pid: str) -> dict | None:
            return {p["peer_id"]: p for p in (net.status("pub").get("swarm") or {}).get("peers", [])}.get(pid)

        net.wait(
            lambda: (p := seen_by_pub(n1)) and p["addrs"] and all("/p2p-circuit" in a for a in p["addrs"]),
            "pub to hear n1's heartbeat with circuit addresses",
        )
        assert seen_by_pub(n1)["data_port"] == 0, seen_by_pub(n1)
        boot_id = net.keys["boot"].peer_id
        net.wait(lambda: (p := seen_by_pub(boot_id)) and p["data_port"] == DATA_PORT, "boot's data port (control)")
        # The relay counts what it carried.
        net.wait(lambda: net.nat("boot")["relay_service"]["reservations"] >= 1, "boot to hold reservations")

        # The two NAT'd nodes reach each other (neither can dial the other's address): first
        # through a relay (request/response streams run over it: peer exchange at least), then
        # directly after DCUtR's hole punch (TCP simultaneous open through both NATs).
        def pair() -> dict | None:
            return next((p for p in net.status("n1").get("peers") or [] if p["peer_id"] == n2), None)

        net.wait(lambda: pair() is not None, "n1 and n2 to connect")
        relayed_bytes = lambda: sum(  # noqa: E731
            (net.nat(r).get("relay_service") or {}).get("bytes_relayed", 0) for r in ("boot", "pub", "liar")
        )
        net.wait(lambda: relayed_bytes() > 0, "bytes to cross a relay")
        net.wait(
            lambda: any(net.nat(n).get("relayed_streams", {}).get(RR_PROTOCOL) for n in ("n1", "n2")),
            "a request/response stream over the relayed n1-n2 connection",
        )
        for name, other in (("n1", n2), ("n2", n1)):
            net.wait(
                lambda n=name, o=other: o in net.nat(n)["hole_punched"],
                f"{name}: a direct connection after hole punching",
            )
        assert not pair()["relayed"], pair()
        assert "direct after hole punch" in net.nat("n1")["summary"], net.nat("n1")

        # Adversarial: the liar is told "reachable" only by the stock AutoNAT server (it answers
        # with the connection the request came on); our fresh dial-back says it is not.
        pub_id = net.keys["pub"].peer_id
        verdicts = net.wait(
            lambda: (v := net.nat("liar").get("verdicts") or {}) and pub_id in v and boot_id in v and v,
            "the liar's verdicts from both servers",
        )
        assert verdicts[pub_id] == "ok", verdicts  # py-libp2p 0.8.1's AutoNAT: wrong
        assert verdicts[boot_id] == "failed", verdicts  # ours: the fresh dial never got through
        tag = tb.tag
    assert leftover_namespaces(tag) == []


def _holder_stores(tmp: Path, trainer: NodeKey, names: list[str]) -> tuple[bytes, int, int]:
    """Version 1 of a small checkpoint, signed by ``trainer`` (not a node here), in the chunk
    store of each of ``names`` (under ``tmp``); its announce bytes, size and chunk count."""
    import trio

    from harness.checkpoints import make_checkpoint
    from harness.nat_child import RUN_ID
    from node.checkpoints import Checkpoints, ChunkStore, LocalControlPlane

    src = make_checkpoint(tmp / "ckpt", 8, seed=7)

    async def build() -> tuple[bytes, int, int]:
        first = ChunkStore(tmp / names[0], RUN_ID, trainer.peer_id, direct_io=False)
        cp = Checkpoints(first, LocalControlPlane(trainer.peer_id, {}))
        async with trio.open_nursery() as nursery:
            await nursery.start(cp.run)
            raw = await cp.import_version(trainer, 1, src, chunk_size=256 * 1024)
            nursery.cancel_scope.cancel()
        st = first.get(1)
        for name in names[1:]:
            other = ChunkStore(tmp / name, RUN_ID, trainer.peer_id, direct_io=False)
            other.add_announce(raw)
            for h in st.by_hash:
                other.write_object_blocking(h, first.read_object_blocking(h))
                other.mark_held(h)
        return raw, sum(c[2] for c in st.chunks), len(st.chunks)

    return trio.run(build)


def test_nat_holders_serve_chunks_over_connections_they_open(tmp_path):
    """Holders behind NAT serve a public fetcher over TCP connections they open to its data
    port (reverse), with single-use tickets the fetcher sent them over libp2p; the relay
    carries none of the bulk. Beside the honest holder a dishonest one serves corrupt chunks
    (charged, banned; the fetch completes from the honest one) and presents each ticket a
    second time (refused)."""
    trainer = NodeKey(os.urandom(32))
    raw, size, chunks = _holder_stores(tmp_path, trainer, ["h1", "h2"])
    announce = tmp_path / "announce"
    with Testbed() as tb:
        boot_h, f_h = tb.add_public("boot"), tb.add_public("fetch")
        # the honest holder's uplink is capped, so the fetcher meets the dishonest one too
        h1_h, h2_h = tb.add_nat("h1", up_mbit=40), tb.add_nat("h2")
        net = Net(tb, tmp_path)
        listen = lambda h: ["--listen", f"/ip4/{h.ip}/tcp/{PORT}"]  # noqa: E731
        ckpt = lambda name: ["--store", str(tmp_path / name), "--trainer", trainer.peer_id]  # noqa: E731
        net.start("boot", boot_h, *listen(boot_h))
        net.wait(lambda: net.status("boot"), "boot to listen")
        boot = ["--bootstrap", net.addr("boot")]
        net.start("fetch", f_h, *listen(f_h), *boot, *ckpt("fetch"), "--announce", str(announce), "--advertise", f_h.ip)
        h1 = net.start("h1", h1_h, *listen(h1_h), *boot, *ckpt("h1"))
        h2 = net.start("h2", h2_h, *listen(h2_h), *boot, *ckpt("h2"), "--corrupt", "--replay")

        # Both holders know they are behind NAT, and the fetcher hears them say so: data port
        # 0, every chunk held. Only then does the version reach the fetcher.
        def seen(pid: str) -> dict | None:
            return {p["peer_id"]: p for p in (net.status("fetch").get("swarm") or {}).get("peers", [])}.get(pid)

        for name, pid in (("h1", h1), ("h2", h2)):
            # AutoNAT's verdict waits on dial-backs that time out: slow on a loaded machine
            net.wait(lambda n=name: net.nat(n).get("reachability") == "private", f"{name} private", 3 * HANG_GUARD_S)
            net.wait(
                lambda p=pid: (s := seen(p)) and s["data_port"] == 0 and s["have"] and s["have"][0]["chunks"] == chunks,
                f"the fetcher to hear {name}'s data-port-0 heartbeat with its chunks",
            )
        tmp = announce.with_suffix(".tmp")
        tmp.write_bytes(raw)
        os.replace(tmp, announce)

        def role(name: str) -> dict:
            return net.status(name).get("role_state") or {}

        def complete() -> bool:
            versions = (role("fetch").get("checkpoints") or {}).get("versions") or []
            return any(v["version"] == 1 and v.get("complete") for v in versions)

        net.wait(complete, "the fetcher to hold version 1 (every chunk hash-checked)")
        net.wait(lambda: role("h2").get("evil", {}).get("replay_refused"), "h2's replayed ticket to be refused")
        net.wait(
            lambda: (role("h1").get("server") or {}).get("bytes_served_reverse", 0) >= size,
            "h1's status to show what it served (written twice a second)",
        )
        # the fetch's record is written when its task ends, a moment after the last chunk made
        # the version complete (a status read in between had no record: KeyError on a loaded run)
        net.wait(lambda: "1" in (role("fetch").get("fetch") or {}), "the fetcher's record of the fetch")
        evil = role("h2")["evil"]
        fetch = role("fetch")["fetch"]["1"]
        srv = {n: role(n)["server"] for n in ("fetch", "h1", "h2")}
        relay = (net.nat("boot").get("relay_service") or {}).get("bytes_relayed", 0)
        bans = net.status("fetch").get("bans") or {}

    # Every byte the fetcher kept came from the honest NAT'd holder, over connections that
    # holder opened to the fetcher's own address (not the relay's).
    assert fetch["fed_from"] == [h1], fetch
    assert fetch["peers"][h1]["reverse"] and fetch["peers"][h1]["bytes"] == size, fetch["peers"][h1]
    assert srv["h1"]["bytes_served_reverse"] >= size, srv["h1"]
    assert set(srv["h1"]["reverse_served_to"]) == {f_h.ip}, srv["h1"]
    assert srv["fetch"]["reverse"]["accepted"] >= 2, srv["fetch"]  # control: honest tickets taken
    # The relay carried control traffic only (tickets, heartbeats): far less than the checkpoint.
    assert relay < size / 8, (relay, size)
    # The dishonest holder: its corrupt chunks were thrown away and charged, it was banned.
    assert fetch["chunks_rejected"] >= 1 and fetch["peers"][h2]["strikes"] >= 1, fetch
    assert h2 in bans and h1 not in bans, bans
    # ... and every ticket it presented a second time was refused (its first use was taken).
    assert srv["h2"]["reverse"].get("served_connections", 0) >= 1, srv["h2"]
    assert evil["replay_refused"] >= 1 and not evil.get("replay_accepted"), evil
    assert srv["fetch"]["reverse"]["bad_tickets"] >= evil["replay_refused"], srv["fetch"]
