"""Coverage-guided fuzzing (atheris, i.e. libFuzzer for Python) of every decoder and handler
that reads bytes from a peer (issue 8). Optional and not part of CI: ``pip install atheris``.
The bounded CI fuzzing is the hypothesis suites (tests/{protocol,p2p}/test_fuzz_*.py); this runs the same
targets for as long as asked, guided by the coverage of ``protocol``, ``proofs`` and ``node``.

    python bench/fuzz_atheris.py --list
    python bench/fuzz_atheris.py --target envelope --seconds 600 [--corpus DIR] [--runs N]
    python bench/fuzz_atheris.py --target dataplane_client --reproduce crash-1234abcd

The only outcome allowed for any input is the project's own error (``ProtocolError``,
``ProofError``, ``NodeError``, ``RequestError``, ``DataPlaneError``, network errors on the
sockets), and the handlers' ``internal`` counters stay 0. Anything else is a crash:
libFuzzer stops, prints the traceback and writes the input to
``<artifacts>/crash-<sha1>`` (default ``fuzz-artifacts/``); ``--reproduce FILE`` replays
it without atheris. A crash found becomes a regression test in tests/{protocol,p2p}/test_fuzz_*.py.

Targets (``--list``): envelope, message, signed_body, manifest, proof, genesis,
reqresp_server, reqresp_client, gossip_frame, dataplane_server, dataplane_client. Each
starts from seed inputs built here (valid encodings), written to the corpus directory
(default: a temporary one) so libFuzzer mutates from inside the valid space.

libFuzzer prints its progress and final statistics ("Done N runs in S second(s)") and exits
0 when the time is up; on a crash it exits non-zero after printing one JSON line (target,
seconds, exit status) and writing the crash file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RUN = b"R" * 32
NOW = 1_800_000_000_000
TARGETS: dict[str, tuple[Callable[[bytes], None], Callable[[], list[bytes]]]] = {}


def target(name: str, seeds: Callable[[], list[bytes]]):
    def deco(fn):
        TARGETS[name] = (fn, seeds)
        return fn

    return deco


def load(instrument: bool) -> None:
    """Import the project (instrumented for coverage when fuzzing) and define the targets."""
    ctx = contextlib.nullcontext()
    if instrument:
        import atheris

        ctx = atheris.instrument_imports(include=["protocol", "proofs", "node"])
    with ctx:
        import node.checkpoints
        import node.checkpoints.client
        import node.checkpoints.fetcher
        import node.checkpoints.server
        import node.genesis_file
        import node.p2p.gossip
        import node.p2p.reqresp  # noqa: F401
        import proofs  # noqa: F401
        import protocol  # noqa: F401
    _define_targets()


def _define_targets() -> None:
    import functools
    import random
    import types

    import torch
    import trio

    from node.checkpoints import ChunkStore
    from node.checkpoints.fetcher import VersionFetcher
    from node.checkpoints.manifest import verify_announce
    from node.checkpoints.server import ChunkServer, Ticket
    from node.checkpoints.testing import RecordingPeer
    from node.errors import NodeError
    from node.genesis_file import read_genesis
    from node.p2p import reqresp as rr_mod
    from node.p2p.gossip import Gossip
    from node.p2p.metrics import NodeMetrics
    from node.p2p.reqresp import ReqResp, RequestError
    from node.p2p.standing import PeerStanding
    from proofs import ProofConfig, ProofError, decode_proof, verify_sequence
    from protocol import (
        ZERO_RUN_ID,
        CheckpointAnnounce,
        NodeKey,
        ProtocolError,
        ReplayGuard,
        SequenceCounter,
        open_envelope,
        seal,
    )
    from protocol import chunk_frames as F
    from protocol import gossip as gossip_frames
    from protocol import (
        messages as m,
    )
    from protocol import reqresp as rr_frames
    from protocol.schema import Message
    from protocol.testing import resign
    from protocol.topics import TOPIC_TYPES, topic

    key, trainer, peer = NodeKey(b"\x07" * 32), NodeKey(b"\x08" * 32), NodeKey(b"\x09" * 32)
    classes = sorted(
        (v for v in vars(m).values() if isinstance(v, type) and issubclass(v, Message) and v is not Message),
        key=lambda c: c.__name__,
    )
    env_types = sorted(m.ENVELOPE_TYPES)
    rr_mod.now_ms = lambda: NOW  # request/response clocks fixed, so seeds never go stale

    # a few valid messages of every kind the network carries: the seeds
    files = (m.FileEntry(path="model.safetensors", size=5000, chunk_hashes=(bytes(32), b"\x01" * 32)),)
    manifest = m.CheckpointManifest(RUN, 1, 4096, files, NOW, m.CheckpointManifest.compute_root(RUN, 1, 4096, files))
    samples = (
        m.Sample(prompt_index=0, completion=b"\x01\x00\x00\x00", seed=1, proof=b"\x00" * 10, claimed_reward=0.5),
    )
    examples: list[Message] = [
        m.GenesisRequest(want=0),
        m.PeerExchangeRequest(max_peers=8),
        m.BatchRequest(batch_id=bytes(32)),
        m.ChunkTicketRequest(version=1, root=bytes(32), chunk_indices=(0, 1)),
        m.ErrorResponse(code="bad_request", detail="x"),
        m.PeerExchangeResponse(peers=(m.PeerAddr(peer_id=peer.peer_id, addrs=("/ip4/127.0.0.1/tcp/4001",)),)),
        m.ChunkTicket(ok=True, reason="", ticket=b"T" * 32, host="127.0.0.1", port=1, expires_ms=NOW),
        m.BatchResponse(found=True, envelope=b"x" * 40),
        m.RolloutAnnounce(batch_id=bytes(32), policy_version=0, batch_counter=0, num_samples=1, size_bytes=10),
        m.Vote(batch_id=bytes(32), worker=peer.peer_id, policy_version=0, accept=True, reason="", rewards=(1.0,)),
        m.Vote(batch_id=bytes(32), worker=peer.peer_id, policy_version=0, accept=False, reason="toploc", rewards=()),
        m.BanNotice(peer_id=peer.peer_id, reason="x", until_ms=NOW + 1000),
        m.CheckpointAnnounce(manifest=manifest),
        m.RolloutBatch(
            run_id=RUN,
            worker=key.peer_id,
            policy_version=0,
            batch_counter=0,
            sampling=m.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8),
            samples=samples,
            created_ms=NOW,
        ),
    ]

    def sealed(k: NodeKey = key) -> list[bytes]:
        out = []
        for i, msg in enumerate(examples):
            run = ZERO_RUN_ID if type(msg).TYPE_ID in m.PRE_RUN_TYPES else RUN
            if type(msg).TYPE_ID in m.ENVELOPE_TYPES:
                out.append(seal(k, run, msg, NOW, 100 + i))
        return out

    # ---------------------------------------------------------------- pure decoders
    @target("envelope", seeds=sealed)
    def _envelope(data: bytes) -> None:
        try:
            env = open_envelope(data, run_id=RUN, now_ms=NOW, guard=ReplayGuard())
        except ProtocolError:
            return
        assert env.raw == data

    @target("message", seeds=lambda: [bytes([classes.index(type(x))]) + x.encode() for x in examples])
    def _message(data: bytes) -> None:
        if not data:
            return
        cls = classes[data[0] % len(classes)]
        try:
            obj = cls.decode(data[1:])
        except ProtocolError:
            return
        assert obj.encode() == data[1:], "decoded but not canonical"

    @target(
        "signed_body",
        seeds=lambda: [
            bytes([env_types.index(type(x).TYPE_ID)]) + x.encode()
            for x in examples
            if type(x).TYPE_ID in m.ENVELOPE_TYPES
        ],
    )
    def _signed_body(data: bytes) -> None:
        """A correctly signed envelope around the fuzzed body: the body checks run."""
        if not data:
            return
        type_id = env_types[data[0] % len(env_types)]
        run = ZERO_RUN_ID if type_id in m.PRE_RUN_TYPES else RUN
        try:
            env = open_envelope(
                resign(key, run, type_id, data[1:], timestamp_ms=NOW, seq=9), run_id=RUN, now_ms=NOW, guard=None
            )
        except ProtocolError:
            return
        assert env.body.encode() == data[1:]

    @target("manifest", seeds=lambda: [CheckpointAnnounce(manifest=manifest).encode()])
    def _manifest(data: bytes) -> None:
        """The trainer's key signs the fuzzed CheckpointAnnounce body (worst case: a hostile trainer)."""
        try:
            got, _ = verify_announce(
                resign(trainer, RUN, CheckpointAnnounce.TYPE_ID, data, timestamp_ms=NOW, seq=9),
                RUN,
                trainer.peer_id,
                now_ms=NOW,
                guard=None,
            )
        except ProtocolError:
            return
        assert got.root == m.CheckpointManifest.compute_root(got.run_id, got.version, got.chunk_size, got.files)
        for f in got.files:
            assert f.path and not f.path.startswith("/") and ".." not in f.path.split("/") and "\\" not in f.path
            assert len(f.chunk_hashes) == -(-f.size // got.chunk_size)
        assert len(got.chunks()) == got.num_chunks

    hidden = torch.randn(6, 16)

    @target("proof", seeds=lambda: [bytes([4]) + b"\x01\x00" + b"\x00" * 8, bytes([16]) + b"\x00" * 34])
    def _proof(data: bytes) -> None:
        """TOPLOC proof bytes: decode_proof, then a verification against fixed hidden states."""
        if not data:
            return
        topk = [1, 4, 16, 128, None][data[0] % 5]
        try:
            decode_proof(data[1:], topk)
        except ProofError:
            pass
        try:
            verify_sequence(hidden, 2, [data[1:], data[1:]], ProofConfig(chunk_size=2, topk=topk or 4))
        except ProofError:
            pass

    genesis_dir = Path(tempfile.mkdtemp(prefix="fuzz-genesis-"))

    def genesis_seed() -> list[bytes]:
        from harness.genesis import fuzz_genesis_toml

        return [fuzz_genesis_toml().encode()]

    @target("genesis", seeds=genesis_seed)
    def _genesis(data: bytes) -> None:
        path = genesis_dir / "g.toml"
        path.write_bytes(data)
        try:
            read_genesis(path)
        except NodeError:
            pass

    # ---------------------------------------------------------------- request/response (fake streams)
    class FakeStream:
        """A libp2p stream stand-in: reads serve ``data`` in small pieces, writes are collected."""

        def __init__(self, data: bytes, peer_id: str) -> None:
            self.data, self.pos, self.written = data, 0, bytearray()
            self.muxed_conn = types.SimpleNamespace(peer_id=types.SimpleNamespace(to_base58=lambda: peer_id))

        async def read(self, n: int) -> bytes:
            await trio.lowlevel.checkpoint()
            part = self.data[self.pos : self.pos + min(n, 1 + self.pos % 7 * 100)]
            self.pos += len(part)
            return part

        async def write(self, b: bytes) -> None:
            self.written += b

        async def close(self) -> None:
            pass

        async def reset(self) -> None:
            pass

    def reqresp(host=None) -> ReqResp:
        host = host or types.SimpleNamespace(set_stream_handler=lambda *a: None)
        return ReqResp(
            host,
            trainer,
            RUN,
            standing=PeerStanding(budget=1e12),
            metrics=NodeMetrics(),
            seq=SequenceCounter(1),
            io_timeout=5,
            handler_timeout=5,
        )

    @target("reqresp_server", seeds=lambda: [rr_frames.encode_frame(x) for x in sealed()])
    def _reqresp_server(data: bytes) -> None:
        async def run() -> None:
            node = reqresp()
            node.register(m.GenesisRequest, lambda env, p: m.ErrorResponse(code="no_genesis", detail=""))
            node.register(m.PeerExchangeRequest, lambda env, p: m.PeerExchangeResponse(peers=()))
            node.register(m.BatchRequest, lambda env, p: m.BatchResponse(found=False, envelope=b""))
            node.register(
                m.ChunkTicketRequest,
                lambda env, p: m.ChunkTicket(ok=False, reason="no", ticket=b"", host="", port=0, expires_ms=0),
            )
            stream = FakeStream(data, key.peer_id)
            try:
                adm = node.streams.open(key.peer_id)  # through the per-peer accounting, as _serve does
                assert adm.ticket is not None
                node._live[adm.ticket] = (trio.CancelScope(), trio.Event())
                await node._serve_one(stream, key.peer_id, adm.ticket)
            except RequestError:
                return  # a short or oversized frame: nothing answered
            assert not any(c["internal"] for c in node.metrics.req.values())
            reply = bytes(stream.written)
            env = open_envelope(reply[4:], run_id=RUN, now_ms=NOW, guard=None)  # always a valid answer
            assert env.sender == trainer.peer_id and int.from_bytes(reply[:4], "big") == len(reply) - 4

        trio.run(run)

    expects = [m.PeerExchangeResponse, m.BatchResponse, m.ChunkTicket, m.GenesisResponse]

    @target(
        "reqresp_client",
        seeds=lambda: [bytes([i]) + rr_frames.encode_frame(x) for i in range(len(expects)) for x in sealed(peer)],
    )
    def _reqresp_client(data: bytes) -> None:
        if not data:
            return
        expect = expects[data[0] % len(expects)]
        stream = FakeStream(data[1:], peer.peer_id)

        async def new_stream(peer_id, protocols):
            return stream

        async def run() -> None:
            node = reqresp(types.SimpleNamespace(set_stream_handler=lambda *a: None, new_stream=new_stream))
            try:
                env = await node.request(peer.peer_id, m.PeerExchangeRequest(max_peers=8), expect, timeout=5)
            except RequestError as exc:
                assert exc.code != "timeout"  # a fake stream never stalls
                return
            assert env.sender == peer.peer_id and isinstance(env.body, expect)

        trio.run(run)

    # ---------------------------------------------------------------- gossip frames
    def gossip_seeds() -> list[bytes]:
        out = [
            gossip_frames.encode_message(topic(RUN, k), x)
            for x in sealed(peer)
            for k in TOPIC_TYPES
            if unpack_type(x) == TOPIC_TYPES[k]
        ]
        return out + [
            gossip_frames.encode_control(gossip_frames.IHAVE, [bytes(32)]),
            gossip_frames.encode_control(gossip_frames.GRAFT, [bytes(32)]),
            gossip_frames.encode_control(gossip_frames.PRUNE),
        ]

    def unpack_type(raw: bytes) -> int:
        from protocol.schema import unpack

        return unpack(raw)[2]

    @target("gossip_frame", seeds=gossip_seeds)
    def _gossip_frame(data: bytes) -> None:
        async def run() -> None:
            host = types.SimpleNamespace(set_stream_handler=lambda *a: None, get_connected_peers=lambda: [])
            g = Gossip(
                host, trainer, RUN, standing=PeerStanding(budget=1e12), metrics=NodeMetrics(), seq=SequenceCounter(1)
            )
            import node.p2p.gossip as gossip_mod

            gossip_mod.now_ms = lambda: NOW
            g._on_frame(peer.peer_id, data)
            assert g.metrics.dropped["internal"] == 0, "gossip validation failed internally"

        trio.run(run)

    # ---------------------------------------------------------------- the chunk data plane
    store_dir = Path(tempfile.mkdtemp(prefix="fuzz-dataplane-"))
    src = store_dir / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(random.Random(1).randbytes(2 * 4096 + 100))
    seed_store = ChunkStore(store_dir / "seed", RUN, trainer.peer_id, durable=False)
    _, announce = seed_store.import_directory_blocking(trainer, 1, src, chunk_size=4096)
    st, _ = seed_store.add_announce(announce, now_ms=NOW)
    nchunks = st.bitmap.n
    tok = b"K" * 32

    def dataplane_server_seeds() -> list[bytes]:
        reqs = F.REQUEST.pack(F.OP_HAVE, 0, 0) + F.REQUEST.pack(F.OP_GET, 1, 0) + F.REQUEST.pack(F.OP_BYE, 0, 0)
        return [b"\x01" + reqs, b"\x03" + reqs, b"\x00" + F.HELLO.pack(F.MAGIC, 1, 0, tok) + reqs]

    @target("dataplane_server", seeds=dataplane_server_seeds)
    def _dataplane_server(data: bytes) -> None:
        """A chunk server's connection handler, fed over a socket pair. First byte: bit 0 puts a
        valid HELLO (flags: bit 1) in front of the rest, so the serving loop is reached."""
        if not data:
            return
        rest = data[1:]
        data = F.HELLO.pack(F.MAGIC, F.WIRE_VERSION, (data[0] >> 1) & 1, tok) + rest if data[0] & 1 else rest

        async def run() -> None:
            server = ChunkServer(seed_store, idle_timeout_s=0.5, stall_timeout_s=0.5)
            server.tickets[tok] = Ticket("fetcher", 1, st.root, float("inf"), NOW)
            a, b = trio.socket.socketpair()
            out = bytearray()
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(server._handle, trio.SocketStream(a))
                    client = trio.SocketStream(b)
                    try:
                        await client.send_all(data)
                        await client.send_eof()
                        while chunk := await client.receive_some(1 << 16):
                            out += chunk
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
                    await client.aclose()
            assert server.connections == 0
            assert not out or out[:4] == F.MAGIC

        trio.run(run)

    class Overlay:
        def __init__(self, port: int) -> None:
            self.port, self.penalties, self.bans = port, [], []

        async def request_ticket(self, peer_id, req, timeout):
            return m.ChunkTicket(ok=True, reason="", ticket=tok, host="127.0.0.1", port=self.port, expires_ms=NOW)

        def penalise(self, peer_id, reason):
            self.penalties.append(reason)

        def ban(self, peer_id, reason):
            self.bans.append(peer_id)

    chunks = [seed_store.read_chunk_blocking(st, i) for i in range(nchunks)]
    bitmap_len = (nchunks + 7) // 8

    def dataplane_client_seeds() -> list[bytes]:
        welcome = F.WELCOME.pack(F.MAGIC, F.OK, nchunks, 0)
        have = F.REPLY.pack(F.OP_HAVE, F.OK, 0, bitmap_len) + bytes([0xFF] * bitmap_len)
        gets = b"".join(F.REPLY.pack(F.OP_GET, F.OK, i, len(c)) + c for i, c in enumerate(chunks))
        return [welcome + have + gets, welcome + have, welcome]

    fetch_errors = {"DataPlaneError", "TooSlowError", "BrokenResourceError", "ClosedResourceError", "TicketError"}

    @target("dataplane_client", seeds=dataplane_client_seeds)
    def _dataplane_client(data: bytes) -> None:
        """The swarm fetcher's session with a seed that writes the fuzzed bytes after the HELLO."""
        import builtins
        import socket as socket_mod

        async def seed(stream) -> None:
            try:
                await stream.receive_some(F.HELLO.size)
                await stream.send_all(data)
                with trio.move_on_after(2):
                    while await stream.receive_some(1 << 16):
                        pass
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            finally:
                await stream.aclose()

        async def run() -> None:
            fetch_dir = Path(tempfile.mkdtemp(dir=store_dir))
            store = ChunkStore(fetch_dir, RUN, trainer.peer_id, durable=False)
            store.add_announce(announce, now_ms=NOW)
            async with trio.open_nursery() as nursery:
                listeners = await nursery.start(functools.partial(trio.serve_tcp, seed, 0, host="127.0.0.1"))
                overlay = Overlay(listeners[0].socket.getsockname()[1])
                f = VersionFetcher(store, 1, overlay, stall_timeout=0.05, have_poll_s=0.01, rng=random.Random(0))
                p = f.peers["seed"] = RecordingPeer("seed")
                with trio.fail_after(20):
                    async with trio.open_nursery() as inner:
                        f._nursery = inner
                        await f._peer_worker(p)
                nursery.cancel_scope.cancel()
            for err in p.errors:  # its own errors, network errors, or strike reasons ("chunk N: ...")
                name = err.split(":")[0]
                cls = getattr(builtins, name, None) or getattr(socket_mod, name, None)
                assert (
                    name in fetch_errors
                    or (isinstance(cls, type) and issubclass(cls, OSError))
                    or (p.strikes and err.startswith("chunk "))
                ), err
            assert p.errors or p.banned or f.complete
            assert not p.inflight and not f.schedule.inflight and not f.schedule.verifying
            assert all(i in f.st.bitmap or i in f.schedule.missing for i in range(nchunks))
            for i in f.st.bitmap.indices():
                assert store.read_chunk_blocking(f.st, i) == chunks[i]
            import shutil

            shutil.rmtree(fetch_dir, ignore_errors=True)

        trio.run(run)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="what to fuzz (--list)")
    ap.add_argument("--seconds", type=int, default=60, help="libFuzzer -max_total_time (default 60)")
    ap.add_argument("--runs", type=int, default=-1, help="stop after this many inputs (libFuzzer -runs)")
    ap.add_argument("--corpus", type=Path, help="corpus directory kept between runs (default: a temporary one)")
    ap.add_argument("--artifacts", type=Path, default=Path("fuzz-artifacts"), help="where crash files go")
    ap.add_argument("--reproduce", type=Path, help="run one input file through the target, without atheris")
    ap.add_argument(
        "--seeds-only",
        action="store_true",
        help="run the seed inputs once, without atheris, of --target or of every target (a smoke test of the driver)",
    )
    ap.add_argument("--list", action="store_true", help="list the targets")
    a = ap.parse_args(argv)
    if a.list:
        load(instrument=False)
        print("\n".join(TARGETS))
        return 0
    if a.seeds_only and not a.target:  # every target's seeds (tests/ops/test_fuzz_atheris_driver.py)
        load(instrument=False)
        counts = {}
        for name, (fn, seeds) in TARGETS.items():
            inputs = seeds()
            for data in inputs:
                fn(data)
            counts[name] = len(inputs)
        print(json.dumps({"seeds": counts, "result": "no crash"}))
        return 0
    if not a.target:
        ap.error("--target is required (see --list)")
    if a.reproduce or a.seeds_only:
        load(instrument=False)
        fn, seeds = TARGETS[a.target]
        inputs = [a.reproduce.read_bytes()] if a.reproduce else seeds()
        for data in inputs:
            fn(data)
        print(json.dumps({"target": a.target, "inputs": len(inputs), "result": "no crash"}))
        return 0
    try:
        import atheris
    except ImportError:
        print("atheris is not installed: pip install atheris", file=sys.stderr)
        return 2
    load(instrument=True)
    if a.target not in TARGETS:
        ap.error(f"unknown target {a.target!r}; one of {', '.join(TARGETS)}")
    fn, seeds = TARGETS[a.target]
    corpus = a.corpus or Path(tempfile.mkdtemp(prefix=f"fuzz-{a.target}-"))
    corpus.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(seeds()):
        (corpus / f"seed-{i}").write_bytes(s)
    a.artifacts.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.argv[0],
        str(corpus),
        f"-max_total_time={a.seconds}",
        f"-artifact_prefix={a.artifacts}/",
        "-print_final_stats=1",
    ] + ([f"-runs={a.runs}"] if a.runs >= 0 else [])
    t0 = time.monotonic()
    atheris.Setup(argv, fn)
    try:
        atheris.Fuzz()
    except SystemExit as exc:  # libFuzzer exits when the time is up (0) or on a crash (non-zero)
        code = exc.code if isinstance(exc.code, int) else 1
        print(json.dumps({"target": a.target, "seconds": round(time.monotonic() - t0, 1), "exit": code}))
        return code
    print(json.dumps({"target": a.target, "seconds": round(time.monotonic() - t0, 1), "exit": 0}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
