"""Checkpoint distribution benchmark: one seeder, N fetcher processes, and two baselines.

    python bench/distribution.py [--size-mib 1024] [--fetchers 8] [--max-upload-mbps 0]

Reports, in one run:
* ``loadable_seconds`` (the headline): from the announce until every fetcher has the
  checkpoint *loadable*: every chunk verified against the signed manifest and
  written in place, the files renamed into ``files/`` and every safetensors
  header parsed; per fetcher in ``loadable_by_index``;
* ``seconds``: until every fetcher holds every chunk (the fetch alone);
* ``seeder_bytes``: bytes the seeder uploaded;
* ``bound_seconds``: size / cap (the seeder's uplink bound), when capped;
* ``raw_fanout_seconds``: a plain TCP copy of the same bytes from one sender to the
  same number of receiver processes at once (sendfile -> recv_into -> file, no
  hashing, no fsync): what the wire and the disks allow, the baseline the goal is
  stated against (loadable within 2x of it);
* ``raw_copy_seconds``: the same to one receiver;
* ``shardcast_seconds``: PyPI ``shardcast`` (origin + the same number of clients,
  each downloading every file; it has no upload cap, so it always runs uncapped):
  until every client's files are ready (reassembled and hash-checked by shardcast),
  per client in ``shardcast_by_client``.

Every node is its own OS process (seeder, fetchers, shardcast origin and clients).
Tickets: each node answers signed ``ChunkTicketRequest`` envelopes on a small TCP
port (the sender is authenticated by its signature) instead of going through
libp2p request/response, whose stream set-up on a fresh overlay costs 1-5 s here
and would measure the overlay, not the data plane. The bytes path is the real one.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from node.ops.devnet import free_port  # noqa: E402

RUN_ID = hashlib.sha256(b"bench-distribution").digest()


def node_key(i: int):
    from protocol import NodeKey

    return NodeKey(hashlib.sha256(b"bench-node-%d" % i).digest())


def make_checkpoint(d: Path, size_mib: int) -> list[Path]:
    import numpy as np
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_file = 256  # MiB per safetensors file, like sharded HF checkpoints
    files, left, k = [], size_mib, 0
    while left > 0:
        m = min(per_file, left)
        n = m * 2**20 // 4
        tensors = {f"layers.{k}.{j}.weight": rng.standard_normal(n // 4, dtype=np.float32) for j in range(4)}
        p = d / f"model-{k:05d}-of-xxxxx.safetensors"
        save_file(tensors, str(p))
        files.append(p)
        left -= m
        k += 1
    return files


# --------------------------------------------------------------------------- our node process
async def _wait_for_file(path: Path, poll_s: float) -> None:
    """Until another process creates ``path``: the node processes of this benchmark share no
    event, a file in the work folder is their signal."""
    import trio

    # a stat every few ms is what the poll costs; no trio event crosses processes
    while not path.exists():
        await trio.sleep(poll_s)


def run_node(a) -> None:
    import trio
    from safetensors import safe_open

    from node.checkpoints import Checkpoints, ChunkStore
    from node.util import atomic_write_text, now_ms
    from protocol import ChunkTicket, ChunkTicketRequest, ReplayGuard, SequenceCounter, open_envelope, seal

    key = node_key(a.index)
    trainer = node_key(0).peer_id
    # peer id -> ticket port, or [host, port] when the nodes run in namespace hosts (--link-caps)
    peers = {
        pid: v if isinstance(v, list) else ["127.0.0.1", v] for pid, v in json.loads(Path(a.peers).read_text()).items()
    }
    seq = SequenceCounter(time.time_ns())
    work = Path(a.work)

    class TcpTicketOverlay:
        async def request_ticket(self, peer_id, req, timeout):
            with trio.fail_after(timeout):
                s = await trio.open_tcp_stream(*peers[peer_id])
                async with s:
                    data = seal(key, RUN_ID, req, now_ms(), seq.next())
                    await s.send_all(len(data).to_bytes(4, "big") + data)
                    buf = b""
                    while True:
                        part = await s.receive_some(65536)
                        if not part:
                            break
                        buf += part
            return ChunkTicket.decode(buf[4 : 4 + int.from_bytes(buf[:4], "big")])

        def penalise(self, peer_id, reason):
            pass

        def ban(self, peer_id, reason):
            pass

    store = ChunkStore(Path(a.home), RUN_ID, trainer, durable=not a.no_fsync, direct_io=not a.buffered_io)
    where = {"listen_host": "0.0.0.0", "advertise_host": a.host} if a.host else {}
    checkpoints = Checkpoints(
        store, TcpTicketOverlay(), max_upload_mbps=a.max_upload_mbps, fetcher_options={"trace": a.trace}, **where
    )
    guard = ReplayGuard()
    result = {"index": a.index}

    async def serve_tickets(stream):
        async with stream:
            try:
                with trio.fail_after(10):
                    buf = b""
                    while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
                        part = await stream.receive_some(65536)
                        if not part:
                            return
                        buf += part
                env = open_envelope(
                    buf[4:],
                    run_id=RUN_ID,
                    now_ms=now_ms(),
                    guard=guard,
                    allowed_types={ChunkTicketRequest.TYPE_ID},
                )
                t = checkpoints.grant_ticket(env.sender, env.body).encode()
                await stream.send_all(len(t).to_bytes(4, "big") + t)
            except Exception:
                return

    timeline = []  # (seconds since go, bytes served so far), every 0.5 s

    async def sample():
        await _wait_for_file(work / "go", 0.005)
        t0 = time.time()
        while True:
            timeline.append((round(time.time() - t0, 2), checkpoints.server.bytes_served))
            await trio.sleep(0.5)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(checkpoints.run)
            n.start_soon(sample)
            n.start_soon(trio.serve_tcp, serve_tickets, peers[key.peer_id][1])
            if a.index == 0:
                raw = await checkpoints.import_version(key, 1, a.src, chunk_size=a.chunk_mib * 2**20)
                (work / "announce").write_bytes(raw)
                (work / "ready-0").write_text("")
            else:
                (work / f"ready-{a.index}").write_text("")
                await _wait_for_file(work / "go", 0.005)

                def on_progress(p):
                    if p.done and "fetched_at" not in result:
                        result["fetched_at"] = time.time()

                checkpoints.progress_callbacks.append(on_progress)
                for pid in peers:
                    if pid != key.peer_id:
                        checkpoints.add_peer(pid)
                checkpoints.on_announce((work / "announce").read_bytes(), guard=None)
                result["announced_at"] = time.time()  # the fetch starts here (its phases count from it)
                await checkpoints.wait_version(1)
                with checkpoints.open_version(1) as files:  # what an engine load starts with
                    for path in files.values():
                        with safe_open(str(path), framework="numpy") as st:
                            st.keys()
                result["assembled_at"] = time.time()
                result["fetch"] = checkpoints.fetch_history.get(1, {})
                result["fetch"].pop("peers", None)
                # atomic: the parent reads the file as soon as it exists
                atomic_write_text(work / f"done-{a.index}.json", json.dumps(result), durable=False)
            await _wait_for_file(work / "stop", 0.05)
            ru = resource.getrusage(resource.RUSAGE_SELF)
            result["cpu_user_s"], result["cpu_sys_s"] = round(ru.ru_utime, 2), round(ru.ru_stime, 2)
            result["bytes_served"] = checkpoints.server.bytes_served
            result["chunks_elsewhere"] = checkpoints.server.chunks_elsewhere
            result["served_timeline"] = timeline
            atomic_write_text(work / f"final-{a.index}.json", json.dumps(result), durable=False)
            n.cancel_scope.cancel()

    trio.run(main)


def bench_ours(args, src: Path, work: Path, total: int, caps: list[float] | None = None) -> dict:
    """One seeder and ``args.fetchers`` fetcher processes; with ``caps`` (Mbit/s, seeder first),
    each node runs in its own network-namespace host with that cap up and down."""
    n = len(caps) if caps else args.fetchers + 1
    testbed = None
    hosts: list = []
    if caps:
        from harness.netns import Testbed

        testbed = Testbed().__enter__()
        hosts = [testbed.add_public(f"n{i}", up_mbit=c, down_mbit=c) for i, c in enumerate(caps)]
        peers: dict = {node_key(i).peer_id: [hosts[i].ip, 4100] for i in range(n)}
    else:
        peers = {node_key(i).peer_id: free_port() for i in range(n)}
    (work / "peers.json").write_text(json.dumps(peers))
    procs = []
    common = (
        [
            "--work",
            str(work),
            "--peers",
            str(work / "peers.json"),
            "--max-upload-mbps",
            str(args.max_upload_mbps),
            "--chunk-mib",
            str(args.chunk_mib),
            "--src",
            str(src),
        ]
        + (["--no-fsync"] if args.no_fsync else [])
        + (["--buffered-io"] if args.buffered_io else [])
        + (["--trace"] if args.trace else [])
    )
    for i in range(n):
        cmd = [sys.executable, __file__, "_node", "--index", str(i), "--home", str(work / f"home{i}")] + common
        if hosts:
            procs.append(hosts[i].popen(cmd + ["--host", hosts[i].ip]))
        else:
            procs.append(subprocess.Popen(cmd))
    try:
        deadline = time.time() + 600
        while not all((work / f"ready-{i}").exists() for i in range(n)):
            if any(p.poll() is not None for p in procs) or time.time() > deadline:
                raise RuntimeError("a node failed to start")
            time.sleep(0.05)
        t0 = time.time()
        (work / "go").write_text("")
        while not all((work / f"done-{i}.json").exists() for i in range(1, n)):
            if any(p.poll() is not None for p in procs) or time.time() > t0 + 1800:
                raise RuntimeError("a fetcher died or the fetch took over 30 minutes")
            time.sleep(0.05)
        done = [json.loads((work / f"done-{i}.json").read_text()) for i in range(1, n)]
        (work / "stop").write_text("")
        for p in procs:
            p.wait(timeout=60)
        final = {i: json.loads((work / f"final-{i}.json").read_text()) for i in range(n)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        if testbed is not None:
            testbed.close()
    per = sorted(d["fetched_at"] - t0 for d in done)
    # where each fetcher's seconds went: phases of its fetch (seconds after the announce
    # reached it; see VersionFetcher.phases), the hashing and writing time, its CPU
    phases = {
        d["index"]: {
            "announced": round(d["announced_at"] - t0, 3),
            **d["fetch"].get("phases", {}),
            "held_all": round(d["fetched_at"] - d["announced_at"], 3),
            "loadable": round(d["assembled_at"] - d["announced_at"], 3),
            "verify_s": d["fetch"].get("verify_s"),
            "cpu_s": round(final[d["index"]]["cpu_user_s"] + final[d["index"]]["cpu_sys_s"], 2),
        }
        for d in done
    }
    out = {
        "seconds": round(per[-1], 3),
        "loadable_seconds": round(max(d["assembled_at"] for d in done) - t0, 3),
        "fetcher_seconds": [round(x, 2) for x in per],
        "loadable_by_index": {d["index"]: round(d["assembled_at"] - t0, 2) for d in done},
        # by fetcher index (1..n-1): when it held every chunk
        "fetched_by_index": {d["index"]: round(d["fetched_at"] - t0, 2) for d in done},
        "phases_by_index": phases,
        "seeder_cpu_s": round(final[0]["cpu_user_s"] + final[0]["cpu_sys_s"], 2),
        "seeder_bytes": final[0]["bytes_served"],
        "seeder_copies": round(final[0]["bytes_served"] / total, 2),
        "fetcher_bytes_served": [final[i]["bytes_served"] for i in range(1, n)],
        "seeder_chunks_elsewhere": final[0]["chunks_elsewhere"],
        "cpu_s": {
            "user": round(sum(f["cpu_user_s"] for f in final.values()), 1),
            "sys": round(sum(f["cpu_sys_s"] for f in final.values()), 1),
        },
    }
    for i, ph in sorted(phases.items()):
        print(f"fetcher {i} phases (s after its announce): " + json.dumps(ph), file=sys.stderr)
    index_of = {node_key(i).peer_id: i for i in range(n)}
    for d in done:
        tr = d["fetch"].pop("trace", None)
        if tr:
            print(
                f"fetcher {d['index']} schedule (s, event, chunk, from node): "
                + " ".join(f"{t:.3f}:{ev}:{c}:n{index_of.get(pid, '?')}" for t, ev, c, pid in tr),
                file=sys.stderr,
            )
    tl = final[0]["served_timeline"]
    print(
        "seeder copies uploaded by t (s): " + " ".join(f"{t:.0f}:{b / total:.2f}" for t, b in tl[1::4]), file=sys.stderr
    )
    print(
        "fetch stats: "
        + json.dumps(
            [
                {
                    k: d["fetch"].get(k)
                    for k in ("seconds", "chunks_elsewhere", "chunks_endgame", "chunks_duplicate", "bytes_from_seeds")
                }
                for d in done
            ]
        ),
        file=sys.stderr,
    )
    return out


# --------------------------------------------------------------------------- raw TCP copy
def run_raw_client(a) -> None:
    s = socket.create_connection((a.host, a.port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    got = 0
    with open(a.out, "wb", buffering=0) as f:
        while got < a.size:
            n = s.recv_into(view)
            if not n:
                break
            f.write(view[:n])
            got += n
    assert got == a.size, (got, a.size)
    if a.done:
        Path(a.done).write_text(repr(time.time()))


def bench_raw(files: list[Path], work: Path, total: int) -> float:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def serve():
        c, _ = srv.accept()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        for p in files:
            with open(p, "rb") as f:
                c.sendfile(f)
        c.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    t0 = time.time()
    subprocess.run(
        [
            sys.executable,
            __file__,
            "_rawclient",
            "--port",
            str(port),
            "--out",
            str(work / "raw.bin"),
            "--size",
            str(total),
        ],
        check=True,
    )
    dt = time.time() - t0
    th.join()
    srv.close()
    (work / "raw.bin").unlink()
    return round(dt, 3)


def bench_raw_fanout(files: list[Path], work: Path, total: int, receivers: int) -> dict:
    """One sender, ``receivers`` receiver processes at once, each getting every byte over its
    own TCP connection into a file: the floor for moving the checkpoint to the same receivers
    on this machine (no verification, no fsync, no swarm: the sender uploads N copies)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(receivers)
    port = srv.getsockname()[1]

    def send_to(c: socket.socket) -> None:
        with c:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            for p in files:
                with open(p, "rb") as f:
                    c.sendfile(f)

    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "_rawclient",
                "--port",
                str(port),
                "--out",
                str(work / f"raw{i}.bin"),
                "--size",
                str(total),
                "--done",
                str(work / f"raw{i}.done"),
            ]
        )
        for i in range(receivers)
    ]
    # every receiver is started and connected before the clock starts, as our nodes are
    conns = [srv.accept()[0] for _ in range(receivers)]
    t0 = time.time()
    threads = [threading.Thread(target=send_to, args=(c,), daemon=True) for c in conns]
    for th in threads:
        th.start()
    for i, pr in enumerate(procs):
        if pr.wait(timeout=1800):
            raise RuntimeError(f"raw receiver {i} failed")
    for th in threads:
        th.join()
    srv.close()
    done = {i: float((work / f"raw{i}.done").read_text()) - t0 for i in range(receivers)}
    for i in range(receivers):
        (work / f"raw{i}.bin").unlink()
        (work / f"raw{i}.done").unlink()
    return {"seconds": round(max(done.values()), 3), "by_receiver": [round(done[i], 2) for i in range(receivers)]}


def run_raw_sender(a) -> None:
    """The raw baseline's sender inside the seeder's host (--link-caps): accept every receiver,
    then send the files with sendfile to all at once (``--together``) or to one after another;
    write each receiver's start time (the clock is the machine's, shared by every namespace)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((a.host, a.port))
    srv.listen(a.receivers)
    work = Path(a.work)
    (work / "raw-listening").write_text("")
    conns = []
    for _ in range(a.receivers):
        c, addr = srv.accept()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        conns.append((addr[0], c))
    started: dict[str, float] = {}

    def send_to(ip: str, c: socket.socket) -> None:
        started[ip] = time.time()
        with c:
            for p in a.files:
                with open(p, "rb") as f:
                    c.sendfile(f)

    if a.together:
        threads = [threading.Thread(target=send_to, args=ac) for ac in conns]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    else:
        for ip, c in conns:
            send_to(ip, c)
    (work / "raw-started.json").write_text(json.dumps(started))


def bench_raw_links(files: list[Path], work: Path, total: int, caps: list[float], together: bool) -> dict[str, float]:
    """A plain TCP copy of the checkpoint from the seeder's host to every fetcher's host (same
    caps, no hashing, no fsync, no swarm), ``together`` (one copy per receiver at once over
    the seeder's uplink) or one receiver after another (each alone on its link): what the
    links and this box allow. Returns seconds per receiver index (1..n-1)."""
    from harness.netns import Testbed

    n = len(caps)
    with Testbed() as tb:
        hosts = [tb.add_public(f"n{i}", up_mbit=c, down_mbit=c) for i, c in enumerate(caps)]
        for f in ("raw-listening", "raw-started.json"):
            (work / f).unlink(missing_ok=True)
        sender = hosts[0].popen(
            [sys.executable, __file__, "_rawsend", "--host", hosts[0].ip, "--port", "4200"]
            + ["--receivers", str(n - 1), "--work", str(work), "--files"]
            + [str(f) for f in files]
            + (["--together"] if together else [])
        )
        while not (work / "raw-listening").exists():
            if sender.poll() is not None:
                raise RuntimeError("raw sender failed")
            time.sleep(0.02)
        procs = []
        for i in range(1, n):
            cmd = [sys.executable, __file__, "_rawclient", "--host", hosts[0].ip, "--port", "4200"]
            cmd += ["--out", str(work / f"raw{i}.bin"), "--size", str(total), "--done", str(work / f"raw{i}.done")]
            procs.append(hosts[i].popen(cmd))
        for i, pr in enumerate(procs, start=1):
            if pr.wait(timeout=1800):
                raise RuntimeError(f"raw receiver {i} failed")
        if sender.wait(timeout=60):
            raise RuntimeError("raw sender failed")
        started = json.loads((work / "raw-started.json").read_text())
        out = {}
        for i in range(1, n):
            out[i] = round(float((work / f"raw{i}.done").read_text()) - started[hosts[i].ip], 3)
            (work / f"raw{i}.bin").unlink()
            (work / f"raw{i}.done").unlink()
    return out


# --------------------------------------------------------------------------- SHARDCAST
def run_shardcast_origin(a) -> None:
    import logging

    from shardcast import OriginServer

    logging.getLogger("shardcast").setLevel(logging.WARNING)
    origin = OriginServer(a.data_dir, a.port)
    # shardcast clients probe every server by fetching "data1.bin" before anything else
    Path(a.data_dir, "data1.bin").write_bytes(os.urandom(1 << 20))
    for f in a.files:
        origin.broadcast(f)
    Path(a.ready).write_text("")
    while True:
        time.sleep(1)


def run_shardcast_client(a) -> None:
    import logging

    # Each client imports its own copy of the package (see bench_shardcast): shardcast
    # downloads the version listing to a fixed path next to its package directory
    # (``<site-packages>/temp_distribution.txt``, then renames and deletes it), so
    # clients sharing one installation on one machine race on that file.
    sys.path.insert(0, a.pkg)
    from shardcast import ClientNode

    assert os.path.dirname(os.path.dirname(sys.modules["shardcast"].__file__)) == a.pkg

    logging.getLogger("shardcast").setLevel(logging.WARNING)
    import fcntl

    # the probe download goes to a hard-coded /tmp/dummy.bin: serialise it between clients
    with open(os.path.join(os.path.dirname(a.out), "sc-probe.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        c = ClientNode([f"http://127.0.0.1:{a.port}"], a.out)
        fcntl.flock(lock, fcntl.LOCK_UN)
    for i, name in enumerate(a.names):
        # with a private package copy the listing no longer fails; keep a bounded retry
        # (an operator would retry too), count it, and let the time include it
        for attempt in range(10):
            out = c.download_version(f"v{i + 1}", os.path.join(a.out, name))
            if out is not None:
                break
            print(f"shardcast client {a.out}: v{i + 1} attempt {attempt + 1} failed, retrying", file=sys.stderr)
            time.sleep(1)
        else:
            raise SystemExit(f"shardcast client failed on v{i + 1}")


def bench_shardcast(files: list[Path], work: Path, fetchers: int) -> dict | None:
    if shutil.which("wget") is None:
        print("shardcast baseline skipped: wget missing (apt-get install wget)", file=sys.stderr)
        return None
    try:
        import shardcast
    except ImportError:
        print("shardcast baseline skipped: pip install shardcast", file=sys.stderr)
        return None
    import shardcast

    port = free_port()
    ready = work / "sc-ready"
    # one copy of the package per client, as if each client were its own machine: the
    # listing's temp file lives next to the package (see run_shardcast_client). Without
    # this, clients on one machine clobber each other's listing ("No versions available
    # for download"), and a client whose second listing fails falls back to shard
    # discovery, asks for shards 7..10 of a 6-shard file and retries those 404s forever.
    pkg_src = Path(shardcast.__file__).resolve().parent
    for i in range(fetchers):
        shutil.copytree(pkg_src, work / f"sc-pkg{i}" / "shardcast", ignore=shutil.ignore_patterns("__pycache__"))
    origin = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "_sc_origin",
            "--data-dir",
            str(work / "sc-origin"),
            "--port",
            str(port),
            "--ready",
            str(ready),
            "--files",
        ]
        + [str(f) for f in files]
    )
    try:
        while not ready.exists():
            if origin.poll() is not None:
                raise RuntimeError("shardcast origin died")
            time.sleep(0.05)
        t0 = time.time()
        clients = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "_sc_client",
                    "--port",
                    str(port),
                    "--out",
                    str(work / f"sc{i}"),
                    "--pkg",
                    str(work / f"sc-pkg{i}"),
                    "--names",
                ]
                + [f.name for f in files]
            )
            for i in range(fetchers)
        ]
        ready_at: dict[int, float] = {}  # each client's files ready (it exits once they are)
        while len(ready_at) < fetchers:
            for i, c in enumerate(clients):
                if i not in ready_at and c.poll() is not None:
                    ready_at[i] = time.time() - t0
            if time.time() - t0 > 3600:
                raise RuntimeError("shardcast clients took over an hour")
            time.sleep(0.01)
        dt = max(ready_at.values())
        rcs = [c.returncode for c in clients]
        if any(rcs):
            raise RuntimeError(f"shardcast clients failed: {rcs}")
        for i in range(fetchers):
            for f in files:
                if (work / f"sc{i}" / f.name).stat().st_size != f.stat().st_size:
                    raise RuntimeError("shardcast produced a wrong file")
        return {"seconds": round(dt, 3), "by_client": [round(ready_at[i], 2) for i in range(fetchers)]}
    finally:
        origin.kill()
        origin.wait()


# --------------------------------------------------------------------------- main
def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        cmd = sys.argv[1]
        p = argparse.ArgumentParser()
        if cmd == "_node":
            for o in ("--work", "--peers", "--home", "--src"):
                p.add_argument(o)
            p.add_argument("--index", type=int)
            p.add_argument("--max-upload-mbps", type=float)
            p.add_argument("--chunk-mib", type=int)
            p.add_argument("--no-fsync", action="store_true")
            p.add_argument("--buffered-io", action="store_true")
            p.add_argument("--host", default="")
            p.add_argument("--trace", action="store_true")
            return run_node(p.parse_args(sys.argv[2:]))
        if cmd == "_rawclient":
            p.add_argument("--port", type=int)
            p.add_argument("--out")
            p.add_argument("--size", type=int)
            p.add_argument("--done", default=None)
            p.add_argument("--host", default="127.0.0.1")
            return run_raw_client(p.parse_args(sys.argv[2:]))
        if cmd == "_rawsend":
            p.add_argument("--host")
            p.add_argument("--port", type=int)
            p.add_argument("--receivers", type=int)
            p.add_argument("--together", action="store_true")
            p.add_argument("--work")
            p.add_argument("--files", nargs="+")
            return run_raw_sender(p.parse_args(sys.argv[2:]))
        if cmd == "_sc_origin":
            p.add_argument("--data-dir")
            p.add_argument("--port", type=int)
            p.add_argument("--ready")
            p.add_argument("--files", nargs="+")
            return run_shardcast_origin(p.parse_args(sys.argv[2:]))
        if cmd == "_sc_client":
            p.add_argument("--port", type=int)
            p.add_argument("--out")
            p.add_argument("--pkg")
            p.add_argument("--names", nargs="+")
            return run_shardcast_client(p.parse_args(sys.argv[2:]))
        raise SystemExit(f"unknown internal command {cmd}")

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--fetchers", type=int, default=8)
    p.add_argument("--max-upload-mbps", type=float, default=0.0, help="cap on every node's upload (Mbit/s); 0 = none")
    p.add_argument("--chunk-mib", type=int, default=4)
    p.add_argument("--no-shardcast", action="store_true")
    p.add_argument("--no-raw", action="store_true", help="skip both raw TCP baselines")
    p.add_argument("--no-ours", action="store_true", help="baselines only")
    p.add_argument(
        "--no-fsync",
        action="store_true",
        help="diagnostic only: our stores skip fsync (not crash-safe), to measure what durability costs",
    )
    p.add_argument(
        "--buffered-io",
        action="store_true",
        help="diagnostic: our stores write through the page cache instead of O_DIRECT (the pre-2026-11-23 path)",
    )
    p.add_argument(
        "--link-caps",
        default="",
        help="comma list of Mbit/s, seeder first: run every node in its own network-namespace host (root) "
        "with that cap up and down (tc tbf), report each fetcher against its bound, and repeat without the "
        "slowest fetcher to see how much it delays the others",
    )
    p.add_argument("--no-ab", action="store_true", help="--link-caps: skip the second run without the slowest fetcher")
    p.add_argument(
        "--trace", action="store_true", help="print every fetcher's schedule (GETs, refusals, payloads by peer)"
    )
    p.add_argument("--workdir", default=None)
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="repeat every method this many times on the same checkpoint; report each run, the median and the spread",
    )
    args = p.parse_args()
    if args.link_caps:
        return main_links(args)

    work = Path(tempfile.mkdtemp(prefix="pn-bench-", dir=args.workdir))
    try:
        src = work / "ckpt"
        files = make_checkpoint(src, args.size_mib)
        total = sum(f.stat().st_size for f in files)
        print(
            f"checkpoint: {len(files)} files, {total / 2**20:.0f} MiB; {args.fetchers} fetchers; "
            f"cap {args.max_upload_mbps or 'none'} Mbit/s; {args.runs} run(s)",
            file=sys.stderr,
        )
        runs = []
        for r in range(args.runs):
            if args.runs > 1:
                print(f"--- run {r + 1} of {args.runs}", file=sys.stderr)
            run_work = work / f"run{r}"  # every method leaves files behind: each run its own folder
            run_work.mkdir()
            out = one_run(args, src, files, run_work, total)
            shutil.rmtree(run_work, ignore_errors=True)
            _table(out)
            runs.append(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.runs == 1:
        print(json.dumps(runs[0]))
        return
    summary = summarise_runs(runs)
    print(
        "median of {n} runs (min-max): loadable {loadable_seconds}, raw TCP fan-out {raw_fanout_seconds}, "
        "SHARDCAST {shardcast_seconds} s; loadable {loadable_over_raw_fanout} x the raw fan-out (goal <= 1.25), "
        "{loadable_speedup_vs_shardcast} x faster than SHARDCAST (goal >= 2.5)".format(
            n=len(runs), **{k: _median_cell(v) for k, v in summary.items()}
        ),
        file=sys.stderr,
    )
    print(json.dumps({"runs": runs, "median": {k: v["median"] for k, v in summary.items()}, "spread": summary}))


SUMMARISED = (
    "seconds",
    "loadable_seconds",
    "raw_fanout_seconds",
    "shardcast_seconds",
    "loadable_over_raw_fanout",
    "loadable_speedup_vs_shardcast",
    "seeder_copies",
)


def summarise_runs(runs: list[dict]) -> dict[str, dict]:
    """Median, min and max over the runs of each headline number (each run's own ratios, so a
    ratio's median compares like with like: the same run's two methods)."""
    out = {}
    for k in SUMMARISED:
        xs = sorted(r[k] for r in runs if r.get(k) is not None)
        out[k] = {"median": round(statistics.median(xs), 3), "min": xs[0], "max": xs[-1]} if xs else {"median": None}
    return out


def _median_cell(v: dict) -> str:
    return "-" if v.get("median") is None else f"{v['median']} ({v['min']}-{v['max']})"


def one_run(args, src: Path, files: list[Path], work: Path, total: int) -> dict:
    """One run of every method on the same checkpoint: raw copy, ours, raw fan-out, SHARDCAST."""
    out: dict = {
        "size_mib": round(total / 2**20, 1),
        "fetchers": args.fetchers,
        "max_upload_mbps": args.max_upload_mbps,
    }
    if args.no_fsync:
        out["no_fsync"] = True
    if args.buffered_io:
        out["buffered_io"] = True
    os.sync()  # each stage starts with no dirty pages left by the one before
    out["raw_copy_seconds"] = None if args.no_raw else bench_raw(files, work, total)
    print(f"raw copy: {out['raw_copy_seconds']} s", file=sys.stderr)
    out["bound_seconds"] = round(total * 8 / (args.max_upload_mbps * 1e6), 3) if args.max_upload_mbps else None
    out["seconds"] = out["loadable_seconds"] = out["seeder_bytes"] = None
    if not args.no_ours:
        os.sync()
        shutil.rmtree(work / "ours", ignore_errors=True)
        (work / "ours").mkdir()
        ours = bench_ours(args, src, work / "ours", total)
        out.update(ours)
        shutil.rmtree(work / "ours", ignore_errors=True)
        print(f"primenode: {ours['seconds']} s, seeder uploaded {ours['seeder_copies']} copies", file=sys.stderr)
    os.sync()
    fan = None if args.no_raw else bench_raw_fanout(files, work, total, args.fetchers)
    out["raw_fanout_seconds"] = fan["seconds"] if fan else None
    out["raw_fanout_by_receiver"] = fan["by_receiver"] if fan else None
    print(f"raw fan-out to {args.fetchers}: {out['raw_fanout_seconds']} s", file=sys.stderr)
    os.sync()
    sc = None if args.no_shardcast else bench_shardcast(files, work, args.fetchers)
    out["shardcast_seconds"] = sc["seconds"] if sc else None
    out["shardcast_by_client"] = sc["by_client"] if sc else None
    print(f"shardcast: {out['shardcast_seconds']} s", file=sys.stderr)
    if out["bound_seconds"] and out["seconds"]:
        out["seconds_over_bound"] = round(out["seconds"] / out["bound_seconds"], 3)
    if out["shardcast_seconds"] and out["seconds"]:
        out["speedup_vs_shardcast"] = round(out["shardcast_seconds"] / out["seconds"], 2)
    if out["shardcast_seconds"] and out["loadable_seconds"]:
        out["loadable_speedup_vs_shardcast"] = round(out["shardcast_seconds"] / out["loadable_seconds"], 2)
    if out["raw_fanout_seconds"] and out["loadable_seconds"]:
        out["loadable_over_raw_fanout"] = round(out["loadable_seconds"] / out["raw_fanout_seconds"], 2)
    return out


def _table(out: dict) -> None:
    """The human table: per receiver, when the checkpoint was usable, for each method."""
    n = out["fetchers"]
    loadable = out.get("loadable_by_index") or {}
    held = out.get("fetched_by_index") or {}
    fan = out.get("raw_fanout_by_receiver") or []
    sc = out.get("shardcast_by_client") or []

    def cell(xs, i):
        return f"{xs[i]:>8.2f}" if i < len(xs) and xs[i] is not None else f"{'-':>8}"

    print(
        f"{'receiver':>8} {'held':>8} {'loadable':>8} {'raw TCP':>8} {'SHARDCAST':>9}  (seconds from the announce)",
        file=sys.stderr,
    )
    lo = [loadable.get(i + 1) for i in range(n)]
    he = [held.get(i + 1) for i in range(n)]
    for i in range(n):
        print(f"{i + 1:>8} {cell(he, i)} {cell(lo, i)} {cell(fan, i)} {cell(sc, i):>9}", file=sys.stderr)
    print(
        f"{'all':>8} {out.get('seconds') or '-':>8} {out.get('loadable_seconds') or '-':>8} "
        f"{out.get('raw_fanout_seconds') or '-':>8} {out.get('shardcast_seconds') or '-':>9}",
        file=sys.stderr,
    )
    print(
        f"loadable: {out.get('loadable_speedup_vs_shardcast')}x faster than SHARDCAST (goal >= 2.5x, issue 32), "
        f"{out.get('loadable_over_raw_fanout')}x the raw TCP fan-out (goal <= 1.25x, issue 32)",
        file=sys.stderr,
    )


def main_links(args) -> None:
    """Links of every speed: per-host caps, each fetcher against the bound set by the seeder's
    uplink and its own downlink, and the same swarm without its slowest fetcher (A/B in one run)."""
    from harness.netns import skip_reason

    why = skip_reason()
    if why:
        raise SystemExit(f"--link-caps: {why}")
    caps = [float(c) for c in args.link_caps.split(",")]
    if len(caps) < 3:
        raise SystemExit("--link-caps needs the seeder's cap and at least two fetchers'")
    work = Path(tempfile.mkdtemp(prefix="pn-bench-", dir=args.workdir))
    try:
        src = work / "ckpt"
        files = make_checkpoint(src, args.size_mib)
        total = sum(f.stat().st_size for f in files)

        def bound(i: int, cs: list[float]) -> float:
            """Fetcher i cannot finish before the seeder's uplink carried one copy, nor before its
            own downlink did: max(size / seeder up, size / own down). The swarm's bound is the
            largest of these (every byte of the checkpoint leaves the seeder at least once)."""
            return max(total * 8 / (cs[0] * 1e6), total * 8 / (cs[i] * 1e6))

        runs = {}
        slowest = min(range(1, len(caps)), key=lambda i: caps[i])
        without = [c for i, c in enumerate(caps) if i != slowest]
        raw: dict[str, dict[int, float]] = {}
        if not args.no_raw:
            # the same bytes over the same links, no swarm, nothing hashed or written durably
            os.sync()
            raw["alone"] = bench_raw_links(files, work, total, caps, together=False)
            os.sync()
            raw["together"] = bench_raw_links(files, work, total, caps, together=True)
            for i in range(1, len(caps)):
                print(
                    f"raw TCP to the {caps[i]:g} Mbit/s host: {raw['alone'][i]:.2f} s alone, "
                    f"{raw['together'][i]:.2f} s beside the others (bound {bound(i, caps):.2f} s)",
                    file=sys.stderr,
                )
        plan = [("all", caps)] if args.no_ab else [("all", caps), ("without_slowest", without)]
        for label, cs in plan:
            (work / label).mkdir()
            r = bench_ours(args, src, work / label, total, caps=cs)
            shutil.rmtree(work / label, ignore_errors=True)
            per = {int(i): t for i, t in r["fetched_by_index"].items()}
            runs[label] = {
                "caps_mbit": cs,
                "seconds": r["seconds"],
                "bound_seconds": round(max(bound(i, cs) for i in range(1, len(cs))), 3),
                "fetchers": [
                    {
                        "cap_mbit": cs[i],
                        "seconds": per[i],
                        "bound_s": round(bound(i, cs), 3),
                        "over_bound": round(per[i] / bound(i, cs), 3),
                        **(
                            {"raw_alone_s": raw["alone"][i], "raw_together_s": raw["together"][i]}
                            if raw and label == "all"
                            else {}
                        ),
                        "phases": r["phases_by_index"][i],
                    }
                    for i in sorted(per)
                ],
                "seeder_cpu_s": r["seeder_cpu_s"],
                "seeder_copies": r["seeder_copies"],
            }
            print(f"{label}: caps {cs}", file=sys.stderr)
            for f in runs[label]["fetchers"]:
                rawcol = f"  raw TCP alone {f['raw_alone_s']:>6.2f} s" if "raw_alone_s" in f else ""
                print(
                    f"  {f['cap_mbit']:>7g} Mbit/s  {f['seconds']:>7.2f} s  bound {f['bound_s']:>7.2f} s"
                    f"  x{f['over_bound']:.2f}{rawcol}",
                    file=sys.stderr,
                )
        # the others' completion with and without the slowest host (indices shift past it)
        a = runs["all"]["fetchers"]
        others_all = [f["seconds"] for i, f in enumerate(a, start=1) if i != slowest]
        others_without = [f["seconds"] for f in runs["without_slowest"]["fetchers"]] if not args.no_ab else []
        out = {
            "size_mib": round(total / 2**20, 1),
            "runs": runs,
            # the swarm: its last fetcher against the largest bound (the goal: within 1.25x)
            "swarm_over_bound": round(runs["all"]["seconds"] / runs["all"]["bound_seconds"], 3),
            "worst_over_bound": max(f["over_bound"] for f in a),
            "slowest_cap_mbit": caps[slowest],
            "others_delay_by_slowest": round(max(others_all) / max(others_without), 3) if others_without else None,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
