"""Hostile-network benchmark (issue 8): honest gossip, batches and checkpoints while attackers flood.

    python bench/hostile.py [--seconds 12] [--attackers 5] [--rate 2000]
                            [--scenarios invalid,invalid_noban,replay,useless,connections,chunks,unserved,garbage,slowstreams]
                            [--honest 6] [--honest-procs 0] [--quiet-seconds 6] [--drain-s 10]
                            [--garbage-rate 2] [--garbage-per-identity 2] [--batch-interval-s 4]
                            [--verify-queue fair|fifo] [--attacker-nice 0] [--slow-streams 100]

Per scenario, a **fresh honest network** (nothing carries over from the previous
scenario): ``--honest`` real primenode nodes (libp2p hosts, our validated Plumtree
gossip, peer standing), by default **one OS process per node** (``--honest-procs 0``;
``--honest-procs 1`` puts them all in one process as before, then memory is the
process's for all of them). Node 0 is the bootstrap, the run's trainer and the
publisher: it publishes ``--honest-rate`` announcements per second, each of a real,
signed rollout batch it serves on request; every other node records when each
arrives (harness/hostile_nodes.py has the protocol between the processes).

Timeline of a scenario: network up; 2 s warm-up (not counted); a **quiet** window of
``--quiet-seconds`` (the baseline: same network, no attacker); the attacker process
starts; ``--ramp-s`` later an **attack** window of ``--seconds``; then a drain window
of up to ``--drain-s`` (it ends as soon as everything honest has arrived).

Attackers (one separate OS process, ``--attacker-child``): ``--attackers`` concurrent
attackers against the honest nodes other than the publisher (``chunks``: every node,
the trainer included), each on fresh identities (new ed25519 key, new libp2p host),
replacing an identity that is banned or cut off. Scenarios:

* ``invalid``: gossip frames with bad signatures, wrong run ids, garbage msgpack,
  wrong topics, ``--rate`` frames/s per attacker;
* ``invalid_noban``: the same with the honest nodes' misbehaviour budget set to
  infinity: nobody is banned, every attacker keeps its one connection and pushes the
  full rate (the validation cost at full rate, the worst case for latency);
* ``replay``: one valid message re-sent and sequence numbers reused with new content;
* ``useless``: valid, signed announcements of batches that do not exist;
* ``connections``: each attacker holds ``--conn-identities`` fresh-identity
  connections to its node (a connection that is closed is re-opened with a new key);
* ``chunks``: every node runs the checkpoint distribution and holds v0 (512 KiB,
  32 chunks); each attacker makes ``--hoard-rate`` fresh identities a second, each gets a chunk
  ticket from a seed and opens 10 data-plane connections that ask for 4 chunks and
  never read them, held to the end; at the start of the attack window the trainer
  publishes v1, which every honest node must fetch from the honest seeds;
* ``unserved``: ``--fetchers`` nodes run the validator's real announce intake and fetch
  loops (per-announcer cap, bounded queue, 30 s fetch deadline, ``charge_unserved``);
  attackers heartbeat (so they are dialable) and announce ``--unserved-rate`` batches/s
  each, 4 per identity (the per-announcer cap), and hold every batch request open
  without answering; the fetchers must still fetch every honest batch;
* ``garbage``: the run is a tiny Llama's (384 wide, 6 layers, 96 tokens; see
  ``harness.genesis.GARBAGE_RUN``); node 0 publishes v0 and, as the one honest worker,
  produces a real batch (seeded sampling, TOPLOC proofs) every ``--batch-interval-s``
  and announces it; node 1 is a real validator (``ValidatorRole``: fetch, model-free
  rules, verify queue, prefill, vote). Each attacker makes ``--garbage-rate`` fresh
  identities a second, each connected to the validator; each heartbeats, takes the
  validator's gossip link, announces ``--garbage-per-identity`` batches and *serves* them
  (staying until they are fetched, ``GARBAGE_LINGER_S`` at most): signed, well-formed, owed prompts, a valid counter, random tokens that
  run to ``max_tokens`` without an EOS, proofs of exactly the right length, garbage content
  (``hostile_nodes.garbage_batch``), so each passes every rule that needs no model and
  costs the validator a prefill to reject. Measured: honest batch verification latency
  (node 0's announce to node 1's vote) in the quiet and the attack window, and how many
  garbage batches the validator prefilled, dropped from its verify queue and banned. The
  quiet and attack windows should hold several batches each (e.g. ``--quiet-seconds 40
  --seconds 60``); ``--verify-queue fifo`` runs the validator with the first-come channel
  the verify queue replaced (a baseline);
* ``slowstreams``: every attacker holds one identity per honest node (node 0 included), each
  with ``--slow-streams`` request/response streams open that never finish their request
  (half write nothing, half announce a 200-byte request and dribble a byte every 0.5 s),
  re-opened as the node ends them; a banned identity is replaced. The coordinator's prober
  asks every node for the genesis and for peer addresses once a second in the quiet window
  and in the attack window (the honest requests a joiner makes); reported: their p50/p99 per
  window, failures, and the ratio (issue 30: at most 2 x quiet). ``--slow-streams 16`` is
  exactly one peer's allowance (node/p2p/rrlimits.py), 100 the issue's attack;
* ``quiet``: no attacker at all (a control: how much the attack window differs from
  the quiet window by chance).

Reported per scenario: attack rate (offered and written per second; the unit per
scenario is ``attack_unit``: gossip frames, connections, data-plane connections or
announcements), identities used, honest delivery ratio ((message, receiver) pairs
that arrived by the end of the drain, over those published in the attack window) and
p50/p99 latency (publish to arrival, wall clock shared by the processes) in the attack
window and in the quiet window, the p99 ratio, peak RSS per node (per process, with its node count, when
``--honest-procs`` puts several nodes in one), bad inputs tried (by the attackers)
and dropped (counted by honest nodes: gossip drops by reason, connections refused at
accept or trimmed, announces shed, fetches failed, data-plane connections refused),
crashes (an honest process that died, an exception that escaped a handler: the
``internal`` drop and request counters and every ``log.exception`` of the project's
loggers, a node that did not answer a request/response round trip after the drain)
and data lost (honest messages some honest node never got by the end of the drain;
``unserved``: honest batches a fetcher never fetched; ``chunks``: nodes without v1).
A table goes to stderr; the last line of stdout is one JSON object with ``goal_met``
(the issue's goal under ``invalid``: delivery 100 % and p99 <= 2 x quiet; under
``garbage``: honest verification p50 and p99 <= 2 x quiet; and 0 crashes and 0
data lost in every scenario run; ``garbage``'s data lost: honest batches never
voted on, or rejected).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import trio  # noqa: E402

from harness.hostile_report import ATTACK_UNITS, pct, summarise, summarise_requests  # noqa: E402,F401
from node.util import now_ms  # noqa: E402
from protocol import Heartbeat, NodeKey, RolloutAnnounce, seal  # noqa: E402
from protocol.gossip import PRUNE, encode_control, encode_frame, encode_message  # noqa: E402
from protocol.testing import with_signature  # noqa: E402

SCENARIOS = (
    "invalid",
    "invalid_noban",
    "replay",
    "useless",
    "connections",
    "chunks",
    "unserved",
    "garbage",
    "slowstreams",
)
ALL_SCENARIOS = ("quiet",) + SCENARIOS
LISTEN = ["/ip4/127.0.0.1/tcp/0"]
TICK = 0.02  # attackers write every 20 ms
HOARD_CONNS = 10  # chunks: data connections per identity (the server allows 8 per identity)
HOARD_GETS = 4  # chunks: GETs per connection, never read
# what "offered" and "written" count, per scenario
UNSERVED_PER_IDENTITY = 4  # node.roles.intake.MAX_PENDING_PER_ANNOUNCER: what one identity can queue


# ===================================================================== attacker process


class Attack:
    def __init__(self, args) -> None:
        from protocol.topics import topic

        self.args = args
        self.run_id = bytes.fromhex(args.run_id)
        self.topics = {k: topic(self.run_id, k) for k in ("rollout", "vote", "heartbeat")}
        self.targets = args.targets.split(",")
        self.stats = {"written": 0, "identities": 0, "resets": 0, "last_error": ""}
        self.first = trio.Event()
        self._garbage: tuple | None = None

    def garbage_run(self) -> tuple:
        """garbage: (run context, model width) of the run (the model is public)."""
        if self._garbage is None:
            import torch

            from node.genesis_file import read_genesis
            from node.roles.context import RunContext

            torch.set_num_threads(1)
            ctx = RunContext.from_genesis(read_genesis(Path(self.args.genesis)).genesis, Path(tempfile.mkdtemp()))
            self._garbage = (ctx, int(ctx.initial_model().config.hidden_size))
        return self._garbage

    def count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    def failed(self, exc: BaseException) -> None:
        self.count("resets")
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        self.stats["last_error"] = f"{type(exc).__name__}: {exc}"[:160]


def _announce(rnd: random.Random, i: int) -> RolloutAnnounce:
    return RolloutAnnounce(
        batch_id=rnd.randbytes(32), policy_version=0, batch_counter=i % 2**31, num_samples=1, size_bytes=1000
    )


def _gossip_pool(mode: str, key: NodeKey, run_id: bytes, topics: dict[str, str], rnd: random.Random) -> list[bytes]:
    """Length-prefixed gossip frames for one identity (``invalid``, ``replay``)."""
    out = []
    if mode == "invalid":
        for i in range(64):
            env = seal(key, run_id, _announce(rnd, i), now_ms(), time.time_ns())
            k = i % 4
            if k == 0:
                frame = encode_message(topics["rollout"], with_signature(env, rnd.randbytes(64)))  # bad signature
            elif k == 1:
                frame = encode_message(
                    topics["rollout"], seal(key, b"X" * 32, _announce(rnd, i), now_ms(), time.time_ns())
                )
            elif k == 2:
                frame = rnd.randbytes(rnd.randint(1, 200))  # garbage
            else:
                frame = encode_message(topics["vote"], env)  # wrong topic for the type
            out.append(encode_frame(frame))
    elif mode == "replay":
        same = encode_message(topics["rollout"], seal(key, run_id, _announce(rnd, 0), now_ms(), 1))
        for i in range(64):
            # odd: an exact duplicate; even: sequence number 1 reused
            frame = (
                same if i % 2 else encode_message(topics["rollout"], seal(key, run_id, _announce(rnd, i), now_ms(), 1))
            )
            out.append(encode_frame(frame))
    return out


async def attack_gossip(a: Attack, idx: int) -> None:
    """``invalid``, ``replay``, ``useless``: one gossip stream per identity at ``--rate`` frames/s."""
    from node.p2p.gossip import GOSSIP_PROTOCOL
    from node.p2p.host import closing_host, make_host, parse_peer_addr

    rnd = random.Random(idx)
    info = parse_peer_addr(a.targets[idx % len(a.targets)])
    per_tick = max(1, round(a.args.rate * TICK))
    i = 0
    while True:
        key = NodeKey.generate()
        a.count("identities")
        host = make_host(key)
        try:
            async with closing_host(host, LISTEN):
                with trio.fail_after(10):
                    await host.connect(info)
                    stream = await host.new_stream(info.peer_id, [GOSSIP_PROTOCOL])
                pool = _gossip_pool(a.args.mode, key, a.run_id, a.topics, rnd)
                next_t = time.monotonic()
                while True:
                    if a.args.mode == "useless":  # valid, signed, fresh each time (not duplicates)
                        batch = [
                            encode_frame(
                                encode_message(
                                    a.topics["rollout"],
                                    seal(key, a.run_id, _announce(rnd, i + j), now_ms(), time.time_ns()),
                                )
                            )
                            for j in range(per_tick)
                        ]
                    else:
                        batch = [pool[(i + j) % len(pool)] for j in range(per_tick)]
                    i += per_tick
                    with trio.fail_after(5):
                        await stream.write(b"".join(batch))
                    a.count("written", len(batch))
                    a.first.set()
                    next_t = max(next_t + TICK, time.monotonic() - 0.1)
                    await trio.sleep(max(0.0, next_t - time.monotonic()))
        except trio.Cancelled:
            raise
        except Exception as exc:  # banned / reset: a fresh identity takes over
            a.failed(exc)
            await trio.sleep(0.05)


async def attack_connections(a: Attack, idx: int) -> None:
    """``connections``: ``--conn-identities`` fresh-identity connections held open, re-opened when cut."""
    from node.p2p.host import closing_host, make_host, parse_peer_addr

    info = parse_peer_addr(a.targets[idx % len(a.targets)])

    async def hold() -> None:
        while True:
            host = make_host(NodeKey.generate())
            a.count("identities")
            a.count("offered")
            try:
                async with closing_host(host, LISTEN):
                    with trio.fail_after(10):
                        await host.connect(info)
                    a.count("written")
                    a.first.set()
                    while host.get_connected_peers():
                        await trio.sleep(0.5)
                    a.count("cut")
            except trio.Cancelled:
                raise
            except Exception as exc:
                a.failed(exc)
            await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        for _ in range(a.args.conn_identities):
            nursery.start_soon(hold)


async def attack_chunks(a: Attack, idx: int) -> None:
    """``chunks``: fresh identities get chunk tickets and hoard data-plane connections."""
    async with trio.open_nursery() as nursery:
        k = 0
        while True:
            nursery.start_soon(_hoard_identity, a, a.targets[(idx + k) % len(a.targets)])
            k += 1
            await trio.sleep(1.0 / a.args.hoard_rate)


async def _hoard_identity(a: Attack, target: str) -> None:
    from node.p2p.host import closing_host, make_host, parse_peer_addr
    from node.p2p.metrics import NodeMetrics
    from node.p2p.reqresp import ReqResp
    from node.p2p.standing import PeerStanding
    from protocol import ChunkTicket, ChunkTicketRequest, SequenceCounter
    from protocol import chunk_frames as F

    version, root = a.args.ckpt.split(":")
    info = parse_peer_addr(target)
    key = NodeKey.generate()
    a.count("identities")
    host = make_host(key)
    try:
        async with closing_host(host, LISTEN):
            rr = ReqResp(
                host,
                key,
                a.run_id,
                standing=PeerStanding(),
                metrics=NodeMetrics(),
                seq=SequenceCounter(time.time_ns() // 1000),
            )
            with trio.fail_after(10):
                await host.connect(info)
            env = await rr.request(
                info.peer_id.to_base58(),
                ChunkTicketRequest(version=int(version), root=bytes.fromhex(root), chunk_indices=(0,)),
                ChunkTicket,
                timeout=10,
            )
            t = env.body
            if not t.ok:
                a.count("tickets_refused")
                return
            a.count("tickets")
            hello = F.HELLO.pack(F.MAGIC, F.WIRE_VERSION, 0, t.ticket)
            gets = b"".join(F.REQUEST.pack(F.OP_GET, i, 0) for i in range(HOARD_GETS))

            async def hoard() -> None:
                a.count("offered")
                try:
                    s = await trio.open_tcp_stream(t.host, t.port)
                except OSError:
                    a.count("dp_refused")
                    return
                try:
                    s.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                    await s.send_all(hello + gets)
                    welcome = b""
                    with trio.move_on_after(10):
                        while len(welcome) < F.WELCOME.size:
                            part = await s.receive_some(F.WELCOME.size - len(welcome))
                            if not part:
                                break
                            welcome += part
                    if len(welcome) < F.WELCOME.size:
                        a.count("dp_refused")  # closed at the server's connection cap
                        return
                    status = F.WELCOME.unpack(welcome)[1]
                    if status != F.OK:
                        a.count(f"dp_{F.STATUS_NAMES.get(status, status)}".replace(" ", "_"))
                        return
                    a.count("written")
                    a.count("gets_written", HOARD_GETS)
                    a.first.set()
                    await trio.sleep_forever()  # never read the chunks
                except (OSError, trio.BrokenResourceError) as exc:
                    a.failed(exc)
                finally:
                    with trio.CancelScope(shield=True):
                        await s.aclose()

            async with trio.open_nursery() as nursery:
                for _ in range(HOARD_CONNS):
                    nursery.start_soon(hoard)
    except trio.Cancelled:
        raise
    except Exception as exc:
        a.failed(exc)


async def attack_unserved(a: Attack, idx: int) -> None:
    """``unserved``: dialable identities that announce batches and hold every request for them."""
    async with trio.open_nursery() as nursery:
        k = 0
        while True:
            nursery.start_soon(_unserved_identity, a, a.targets[(idx + k) % len(a.targets)])
            k += 1
            await trio.sleep(UNSERVED_PER_IDENTITY / a.args.unserved_rate)


async def _unserved_identity(a: Attack, target: str) -> None:
    from node.p2p.gossip import GOSSIP_PROTOCOL
    from node.p2p.host import closing_host, listen_addrs, make_host, parse_peer_addr
    from node.p2p.reqresp import RR_PROTOCOL

    rnd = random.Random()
    info = parse_peer_addr(target)
    key = NodeKey.generate()
    a.count("identities")
    host = make_host(key)

    async def hold(stream) -> None:  # a batch request: read nothing, answer nothing, keep it open
        a.count("requests_held")
        await trio.sleep_forever()

    host.set_stream_handler(RR_PROTOCOL, hold)
    try:
        async with closing_host(host, LISTEN):
            with trio.fail_after(10):
                await host.connect(info)
                stream = await host.new_stream(info.peer_id, [GOSSIP_PROTOCOL])

            def heartbeat() -> bytes:
                hb = Heartbeat(
                    role="worker",
                    policy_version=0,
                    addrs=tuple(listen_addrs(host, "127.0.0.1")[:8]),
                    data_port=0,
                    have=(),
                    uptime_s=1.0,
                    step=-1,
                    batches=0,
                )
                return encode_frame(
                    encode_message(a.topics["heartbeat"], seal(key, a.run_id, hb, now_ms(), time.time_ns()))
                )

            await stream.write(heartbeat())
            for j in range(UNSERVED_PER_IDENTITY):
                a.count("offered")
                await trio.sleep(1.0 / a.args.unserved_rate)
                await stream.write(
                    encode_frame(
                        encode_message(
                            a.topics["rollout"], seal(key, a.run_id, _announce(rnd, j), now_ms(), time.time_ns())
                        )
                    )
                )
                a.count("written")
                a.first.set()
            while True:  # stay known (heartbeats) and dialable, holding every request
                await trio.sleep(1.0)
                with trio.fail_after(5):
                    await stream.write(heartbeat())
    except trio.Cancelled:
        raise
    except Exception as exc:
        a.failed(exc)
        await trio.sleep_forever()  # requests already held stay held until the end


async def attack_garbage(a: Attack, idx: int) -> None:
    """``garbage``: fresh identities that announce well-formed garbage batches and serve them."""
    a.garbage_run()
    async with trio.open_nursery() as nursery:
        k = 0
        while True:
            nursery.start_soon(_garbage_identity, a, a.targets[(idx + k) % len(a.targets)])
            k += 1
            await trio.sleep(1.0 / a.args.garbage_rate)


GARBAGE_LINGER_S = 20.0  # a garbage identity stays (heartbeating, serving) until fetched, this long at most


async def _garbage_identity(a: Attack, target: str) -> None:
    from harness.hostile_nodes import garbage_batch
    from node.p2p.gossip import GOSSIP_PROTOCOL
    from node.p2p.host import closing_host, listen_addrs, make_host, parse_peer_addr
    from node.p2p.metrics import NodeMetrics
    from node.p2p.reqresp import ReqResp
    from node.p2p.standing import PeerStanding
    from node.roles.rollouts import PolicyFacts
    from protocol import BatchRequest, BatchResponse, SequenceCounter, sha256

    ctx, hidden = a.garbage_run()
    rnd = random.Random()
    info = parse_peer_addr(target)
    key = NodeKey.generate()
    seq = SequenceCounter(time.time_ns())
    a.count("identities")
    host = make_host(key)
    batches: dict[bytes, bytes] = {}
    served: set[bytes] = set()

    def serve(env, peer: str) -> BatchResponse:
        raw = batches.get(env.body.batch_id)
        if raw is not None:
            a.count("served")
            served.add(env.body.batch_id)
        return BatchResponse(found=raw is not None, envelope=raw or b"")

    async def drain_gossip(stream) -> None:  # take the node's gossip link (a connection without one is closed)
        try:
            while await stream.read(65536):
                pass
        except Exception:
            pass

    host.set_stream_handler(GOSSIP_PROTOCOL, drain_gossip)
    try:
        async with closing_host(host, LISTEN):
            rr = ReqResp(host, key, a.run_id, standing=PeerStanding(), metrics=NodeMetrics(), seq=seq)
            rr.register(BatchRequest, serve)
            with trio.fail_after(10):
                await host.connect(info)
                stream = await host.new_stream(info.peer_id, [GOSSIP_PROTOCOL])

            def frame(kind: str, msg) -> bytes:
                return encode_frame(encode_message(a.topics[kind], seal(key, a.run_id, msg, now_ms(), seq.next())))

            def heartbeat() -> Heartbeat:
                addrs = tuple(listen_addrs(host, "127.0.0.1")[:8])
                return Heartbeat(
                    role="worker", policy_version=0, addrs=addrs, data_port=0, have=(), uptime_s=1.0, step=-1, batches=0
                )

            await stream.write(frame("heartbeat", heartbeat()))
            policy = PolicyFacts(0, b"", 0)  # garbage needs only the version (counters 0, 1, ... are in every window)
            for counter in range(a.args.garbage_per_identity):
                batch = garbage_batch(ctx, key.peer_id, policy, counter, hidden, rnd)
                raw = seal(key, a.run_id, batch, now_ms(), seq.next())
                batches[sha256(raw)] = raw
                a.count("offered")
                ann = RolloutAnnounce(
                    batch_id=sha256(raw),
                    policy_version=0,
                    batch_counter=counter,
                    num_samples=len(batch.samples),
                    size_bytes=len(raw),
                )
                with trio.fail_after(5):
                    await stream.write(frame("rollout", ann))
                a.count("written")
                a.first.set()
            with trio.move_on_after(GARBAGE_LINGER_S):
                while len(served) < len(batches):  # stay known (heartbeats) and connected until fetched
                    await trio.sleep(1.0)
                    with trio.fail_after(5):
                        await stream.write(frame("heartbeat", heartbeat()))
            await trio.sleep(1.0)  # the last response on its way
    except trio.Cancelled:
        raise
    except Exception as exc:  # banned and cut off (the validator rejected its batches): expected
        a.failed(exc)


async def attack_slowstreams(a: Attack, idx: int) -> None:
    """``slowstreams``: per target, one identity holding ``--slow-streams`` unfinished request streams."""
    async with trio.open_nursery() as nursery:
        for target in a.targets:
            nursery.start_soon(_slow_identity, a, target)


async def _slow_identity(a: Attack, target: str) -> None:
    from node.p2p.gossip import GOSSIP_PROTOCOL
    from node.p2p.host import closing_host, make_host, parse_peer_addr

    info = parse_peer_addr(target)

    async def drain_gossip(stream) -> None:  # take the node's gossip link (a connection without one is closed)
        try:
            while await stream.read(65536):
                pass
        except Exception:
            pass

    while True:
        key = NodeKey.generate()
        a.count("identities")
        host = make_host(key)
        host.set_stream_handler(GOSSIP_PROTOCOL, drain_gossip)
        try:
            async with closing_host(host, LISTEN):
                with trio.fail_after(10):
                    await host.connect(info)
                    await host.new_stream(info.peer_id, [GOSSIP_PROTOCOL])  # held open, never written

                async with trio.open_nursery() as nursery:
                    for k in range(a.args.slow_streams):
                        nursery.start_soon(_hold_slow_stream, a, host, info.peer_id, k)
                a.count("cut")
        except trio.Cancelled:
            raise
        except Exception as exc:
            a.failed(exc)
        await trio.sleep(0.5)


async def _hold_slow_stream(a: Attack, host, peer_id, k: int) -> None:
    """One request stream that never finishes its request, re-opened while connected."""
    from node.p2p.reqresp import RR_PROTOCOL

    while host.get_network().get_connections(peer_id):
        a.count("offered")
        try:
            with trio.fail_after(10):
                s = await host.new_stream(peer_id, [RR_PROTOCOL])
            a.count("written")
            a.first.set()
            if k % 2:  # announce a 200-byte request, then dribble it
                await s.write((200).to_bytes(4, "big"))
                while True:
                    await s.write(b"x")
                    await trio.sleep(0.5)
            else:  # write nothing; wait for the node to end it
                await s.read(1)
        except trio.Cancelled:
            raise
        except Exception:
            a.count("ended_by_node")
        await trio.sleep(0.05)


ATTACKS = {
    "invalid": attack_gossip,
    "replay": attack_gossip,
    "useless": attack_gossip,
    "connections": attack_connections,
    "chunks": attack_chunks,
    "unserved": attack_unserved,
    "garbage": attack_garbage,
    "slowstreams": attack_slowstreams,
}


async def attacker_main(args) -> None:
    if args.attacker_nice:
        os.nice(args.attacker_nice)
    a = Attack(args)
    stop = Path(args.stop_file)
    t0 = time.time()
    started: list[float] = []

    async def report_started() -> None:
        with trio.move_on_after(60):
            await a.first.wait()
        started.append(time.time())
        print(json.dumps({"started": started[0]}), flush=True)

    async with trio.open_nursery() as nursery:

        async def watch_stop() -> None:
            while not stop.exists() and time.time() - t0 < args.max_s:
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

        nursery.start_soon(report_started)
        nursery.start_soon(watch_stop)
        for i in range(args.attackers):
            nursery.start_soon(ATTACKS[args.mode], a, i)
    end = time.time()
    begin = started[0] if started else t0
    a.stats["seconds"] = round(end - begin, 2)
    if args.mode in ("invalid", "replay", "useless"):
        a.stats["offered"] = round(args.rate * args.attackers * (end - begin))
    print(json.dumps(a.stats), flush=True)


# ===================================================================== liveness probe (coordinator)


class Prober:
    """A neutral libp2p peer that asks every honest node for a request/response round trip
    (``PeerExchangeRequest``): connected once before the attack, so the accept-rate cap the
    attackers exhaust does not hide a live node."""

    def __init__(self, run_id: bytes, nodes: dict[int, dict]) -> None:
        self.run_id = run_id
        self.nodes = nodes

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from node.p2p.gossip import GOSSIP_PROTOCOL
        from node.p2p.host import closing_host, make_host
        from node.p2p.metrics import NodeMetrics
        from node.p2p.reqresp import ReqResp
        from node.p2p.standing import PeerStanding
        from protocol import SequenceCounter

        key = NodeKey.generate()
        self.host = make_host(key)
        self.host.set_stream_handler(GOSSIP_PROTOCOL, self._gossip)
        async with closing_host(self.host, LISTEN):
            self.rr = ReqResp(
                self.host,
                key,
                self.run_id,
                standing=PeerStanding(),
                metrics=NodeMetrics(),
                seq=SequenceCounter(time.time_ns() // 1000),
            )
            async with trio.open_nursery() as nursery:
                for i in self.nodes:
                    nursery.start_soon(self._connect, i)
            task_status.started()
            await trio.sleep_forever()

    async def _gossip(self, stream) -> None:
        from node.p2p.gossip import GOSSIP_PROTOCOL

        """The honest nodes link to every connected peer: tell each PRUNE (we relay nothing, so
        they send us ids once a second rather than every message), then discard what comes."""
        peer = stream.muxed_conn.peer_id
        out = None
        try:
            with trio.fail_after(5):
                out = await self.host.new_stream(peer, [GOSSIP_PROTOCOL])
                await out.write(encode_frame(encode_control(PRUNE)))
            while await stream.read(65536):
                pass
        except Exception:
            pass
        finally:
            for s in (out, stream):
                if s is not None:
                    with trio.CancelScope(shield=True), trio.move_on_after(1):
                        try:
                            await s.close()
                        except Exception:
                            pass

    async def _connect(self, i: int) -> None:
        from node.p2p.host import parse_peer_addr

        try:
            with trio.fail_after(5):
                await self.host.connect(parse_peer_addr(self.nodes[i]["addrs"][0]))
        except Exception:
            pass

    async def ping(self, i: int, timeout: float = 5.0) -> float | None:
        from protocol import PeerExchangeRequest, PeerExchangeResponse

        t0 = time.monotonic()
        try:
            await self.rr.request(
                self.nodes[i]["peer_id"], PeerExchangeRequest(max_peers=1), PeerExchangeResponse, timeout=timeout
            )
        except Exception:
            return None
        return (time.monotonic() - t0) * 1000

    async def asked(self, i: int, kind: str, timeout: float = 10.0) -> float | None:
        """One honest request a joiner makes (``genesis`` or ``px``) to node ``i``: ms, or None."""
        from protocol import GenesisRequest, GenesisResponse, PeerExchangeRequest, PeerExchangeResponse

        t0 = time.monotonic()
        try:
            if kind == "genesis":
                await self.rr.request(
                    self.nodes[i]["peer_id"], GenesisRequest(want=0), GenesisResponse, timeout=timeout
                )
            else:
                await self.rr.request(
                    self.nodes[i]["peer_id"], PeerExchangeRequest(max_peers=8), PeerExchangeResponse, timeout=timeout
                )
        except Exception:
            return None
        return (time.monotonic() - t0) * 1000

    async def request_rounds(self, until: float, out: dict[str, list[float | None]]) -> None:
        """``slowstreams``: genesis and peer-exchange requests to every node, a round a second."""
        while time.time() < until - 0.5:
            t_round = time.monotonic()

            async def one(i: int, kind: str) -> None:
                out.setdefault(kind, []).append(await self.asked(i, kind))

            async with trio.open_nursery() as nursery:
                for i in self.nodes:
                    for kind in ("genesis", "px"):
                        nursery.start_soon(one, i, kind)
            await trio.sleep(max(0.0, 1.0 - (time.monotonic() - t_round)))

    async def ping_all(self, timeout: float = 5.0) -> dict[int, float | None]:
        out: dict[int, float | None] = {}

        async def one(i):
            out[i] = await self.ping(i, timeout)

        async with trio.open_nursery() as nursery:
            for i in self.nodes:
                nursery.start_soon(one, i)
        return out


# ===================================================================== coordinator


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.rename(path)


async def _wait_all(paths: list[Path], procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait until every shard wrote its file; returns the shards that exited (or hung past
    ``timeout``) without writing it."""
    with trio.move_on_after(timeout):
        while not all(p.exists() or procs[i].poll() is not None for i, p in enumerate(paths)):
            await trio.sleep(0.1)
    return [i for i, p in enumerate(paths) if not p.exists()]


async def run_scenario(args, scen: str, seed: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"hostile-{scen}-"))
    procs_n = min(args.honest_procs or args.honest, args.honest)
    cfg = {
        "scenario": scen,
        "honest": args.honest,
        "procs": procs_n,
        "seed": seed,
        "created_ms": now_ms(),
        "target_peers": args.target_peers,
        "honest_rate": args.honest_rate,
        "drain_s": args.drain_s,
        "connect_timeout": args.connect_timeout,
        "fetchers": args.fetchers,
        "batch_interval_s": args.batch_interval_s,
        "verify_queue": args.verify_queue,
    }
    (work / "config.json").write_text(json.dumps(cfg))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    logs = [open(work / f"shard-{i}.log", "wb") for i in range(procs_n)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--honest-child", "--workdir", str(work), "--shard", str(i)],
            stdout=logs[i],
            stderr=subprocess.STDOUT,
            env=env,
        )
        for i in range(procs_n)
    ]
    attacker = None
    res: dict = {"scenario": scen, "honest_nodes": args.honest, "honest_processes": procs_n}
    t_scen = time.monotonic()
    try:
        missing = await _wait_all([work / f"ready-{i}.json" for i in range(procs_n)], procs, args.connect_timeout + 60)
        if missing:
            raise RuntimeError(f"honest shard(s) {missing} died or hung before the overlay formed")
        ready = [json.loads((work / f"ready-{i}.json").read_text()) for i in range(procs_n)]
        nodes = {int(i): v for r in ready for i, v in r["nodes"].items()}
        res["overlay_formed"] = all(r["formed"] for r in ready)
        res["setup_s"] = round(time.monotonic() - t_scen, 1)
        run_id = bytes.fromhex(ready[0]["run_id"])
        prober = Prober(run_id, nodes)
        probe_fail_attack, probe_rtts = 0, []
        async with trio.open_nursery() as nursery:
            await nursery.start(prober.run)
            t = time.time() + 0.5
            plan = {"warm": [t, t + args.warm_s], "quiet": [t + args.warm_s, t + args.warm_s + args.quiet_seconds]}
            write_json(work / "plan.json", plan)  # atomically: the shards poll for it
            requests: dict[str, dict[str, list[float | None]]] = {"quiet": {}, "attack": {}}
            if scen == "slowstreams":
                await trio.sleep(max(0.0, plan["quiet"][0] - time.time()))
                await prober.request_rounds(plan["quiet"][1], requests["quiet"])
            await trio.sleep(max(0.0, plan["quiet"][1] + 1.0 - time.time()))
            stats = None
            if scen != "quiet":
                mode = "invalid" if scen == "invalid_noban" else scen
                targets = [nodes[i]["addrs"][0] for i in sorted(nodes) if i != 0 or scen == "chunks"]
                if scen == "garbage":  # straight at the validator (the genesis names it)
                    targets = [nodes[1]["addrs"][0]]
                if scen == "slowstreams":  # every node serves the genesis: node 0 too
                    targets = [nodes[i]["addrs"][0] for i in sorted(nodes)]
                ckpt = ready[0].get("ckpt")
                cmd = [
                    sys.executable,
                    __file__,
                    "--attacker-child",
                    "--mode",
                    mode,
                    "--run-id",
                    run_id.hex(),
                    "--targets",
                    ",".join(targets),
                    "--attackers",
                    str(args.attackers),
                    "--rate",
                    str(args.rate),
                    "--conn-identities",
                    str(args.conn_identities),
                    "--unserved-rate",
                    str(args.unserved_rate),
                    "--hoard-rate",
                    str(args.hoard_rate),
                    "--stop-file",
                    str(work / "attack-stop"),
                    "--attacker-nice",
                    str(args.attacker_nice),
                    "--max-s",
                    str(args.ramp_s + args.seconds + 120),
                    "--slow-streams",
                    str(args.slow_streams),
                ]
                if ckpt:
                    cmd += ["--ckpt", f"{ckpt['version']}:{ckpt['root']}"]
                if scen == "garbage":
                    cmd += [
                        "--genesis",
                        str(work / "genesis.toml"),
                        "--garbage-rate",
                        str(args.garbage_rate),
                        "--garbage-per-identity",
                        str(args.garbage_per_identity),
                    ]
                attacker_log = open(work / "attacker.log", "wb")
                logs.append(attacker_log)
                attacker = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, stderr=attacker_log, env=env)
                reader = _Lines(attacker.stdout)
                with trio.move_on_after(90):
                    await reader.next()  # {"started": ...}: the first bad input is out
            ta = time.time() + args.ramp_s
            tb = ta + args.seconds
            write_json(work / "attack.json", {"start": ta, "end": tb})
            if scen == "slowstreams":
                await trio.sleep(max(0.0, ta - time.time()))
                await prober.request_rounds(tb, requests["attack"])
            while time.time() < tb:  # round trips during the attack (an overloaded node may miss some)
                await trio.sleep(min(2.0, max(0.0, tb - time.time())))
                if time.time() < tb - 0.5:
                    rtts = await prober.ping_all(timeout=5.0)
                    probe_fail_attack += sum(1 for v in rtts.values() if v is None)
                    probe_rtts += [v for v in rtts.values() if v is not None]
            (work / "attack-stop").write_text("")
            if attacker is not None:
                with trio.move_on_after(60):
                    line = await reader.next()
                    stats = json.loads(line) if line else None
                    await attacker.wait()
            lost_shards = await _wait_all([work / f"result-{i}.json" for i in range(procs_n)], procs, args.drain_s + 90)
            if 0 in lost_shards:
                raise RuntimeError("shard 0 (the publisher) died or hung before reporting")
            res["t_results_s"] = round(time.time() - tb, 1)
            final = {}
            for _ in range(3):  # after the drain every node must answer (a few tries)
                final = {i: v for i, v in (await prober.ping_all(timeout=5.0)).items()}
                if all(v is not None for v in final.values()):
                    break
                await trio.sleep(2.0)
            nursery.cancel_scope.cancel()
        results = [json.loads((work / f"result-{i}.json").read_text()) for i in range(procs_n) if i not in lost_shards]
        dead = sorted(i for i in range(args.honest) if i % procs_n in lost_shards)
        res.update(summarise(args, scen, results, stats, final, probe_fail_attack, probe_rtts, dead))
        if scen == "slowstreams":
            res["requests"] = summarise_requests(requests)
            res["notes"] = "; ".join(x for x in (res.get("notes"), res["requests"]["note"]) if x)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["crashed_nodes"] = [i for i in range(args.honest) if procs[i % procs_n].poll() is not None]
        res["crashes"] = len(res["crashed_nodes"])
        res.setdefault("data_lost", None)
    finally:
        t_stop = time.monotonic()
        (work / "attack-stop").write_text("")
        (work / "stop").write_text("")
        if attacker is not None and attacker.returncode is None:
            with trio.move_on_after(10):
                await attacker.wait()
            if attacker.returncode is None:
                attacker.kill()
        for p in procs:
            for _ in range(100):
                if p.poll() is not None:
                    break
                await trio.sleep(0.1)
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
        res["teardown_s"] = round(time.monotonic() - t_stop, 1)
        bad = range(procs_n) if "error" in res else sorted({i % procs_n for i in res.get("crashed_nodes", [])})
        if bad:  # what a dead or failing shard printed last
            res["shard_log_tail"] = {i: (work / f"shard-{i}.log").read_text(errors="replace")[-3000:] for i in bad}
        res["shard_exit_codes"] = [p.returncode for p in procs]
        if attacker is not None and (attacker.returncode or not res.get("attack")):
            res["attacker_log_tail"] = (work / "attacker.log").read_text(errors="replace")[-2000:]
        if args.keep:
            res["workdir"] = str(work)
        else:
            shutil.rmtree(work, ignore_errors=True)
    res["seconds"] = round(time.monotonic() - t_scen, 1)
    return res


class _Lines:
    """Line reader over a trio receive stream."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.buf = b""

    async def next(self) -> str | None:
        while b"\n" not in self.buf:
            part = await self.stream.receive_some(65536)
            if not part:
                line, self.buf = self.buf, b""
                return line.decode().strip() or None
            self.buf += part
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode().strip()


def render(out: dict, args) -> None:
    rows = [r for r in out["scenarios"].values()]
    cols = [
        "scenario",
        "offered/s",
        "written/s",
        "ids",
        "delivery",
        "p50 quiet>attack ms",
        "p99 quiet>attack ms",
        "p99 x",
        "peak RSS MiB/node",
        "bad tried",
        "dropped",
        "crashes",
        "data lost",
        "notes",
    ]

    def f(v, fmt="{}"):
        return "-" if v is None else fmt.format(v)

    table = []
    for r in rows:
        if "error" in r and "quiet" not in r:
            table.append(
                [
                    r["scenario"],
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    "-",
                    f(r.get("crashes")),
                    "-",
                    r["error"][:60],
                ]
            )
            continue
        at = r.get("attack") or {}
        table.append(
            [
                r["scenario"],
                f(at.get("offered_per_s"), "{:,.0f}"),
                f(at.get("written_per_s"), "{:,.0f}"),
                f(r.get("identities")),
                f(r["delivery"], "{:.2%}"),
                f"{f(r['quiet']['p50_ms'])} > {f(r['attack_window']['p50_ms'])}",
                f"{f(r['quiet']['p99_ms'])} > {f(r['attack_window']['p99_ms'])}",
                f(r["p99_over_quiet"], "{:.2f}"),
                f"{r['peak_rss_mib_max']:.0f} (+{r['rss_growth_mib_max']:.0f})",
                f"{r['bad_inputs_tried']:,}",
                f"{r['bad_inputs_dropped']:,}",
                str(r["crashes"]),
                str(r["data_lost"]),
                r.get("notes", ""),
            ]
        )
    per = (
        "one process per node"
        if out["nodes_per_process"] == 1
        else f"up to {out['nodes_per_process']} nodes per process, RSS per process"
    )
    title = (
        f"hostile.py: {args.honest} honest nodes ({per}), {args.attackers} attackers x {args.rate:g}/s, "
        f"quiet {args.quiet_seconds:g} s, attack {args.seconds:g} s"
    )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title, file=sys.stderr)
        print(" | ".join(cols), file=sys.stderr)
        for row in table:
            print(" | ".join(row), file=sys.stderr)
        return
    t = Table(title=title)
    for c in cols:
        t.add_column(c)
    for row in table:
        t.add_row(*row)
    Console(stderr=True, width=220).print(t)


async def coordinator(args) -> dict:
    out = {}
    seed = f"{args.seed}"
    for k, scen in enumerate(args.scenarios):
        res = await run_scenario(args, scen, f"{seed}/{k}/{scen}")
        out[scen] = res
        print(json.dumps(res), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=12.0, help="attack window per scenario")
    ap.add_argument("--quiet-seconds", type=float, default=6.0, help="quiet (baseline) window per scenario")
    ap.add_argument("--attackers", type=int, default=5)
    ap.add_argument("--rate", type=float, default=2000.0, help="gossip frames per second per attacker")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {','.join(ALL_SCENARIOS)}")
    ap.add_argument("--honest", type=int, default=6)
    ap.add_argument(
        "--honest-procs", type=int, default=0, help="OS processes for the honest nodes (0: one per node; 1: all in one)"
    )
    ap.add_argument("--honest-rate", type=float, default=20.0, help="honest announcements per second (node 0)")
    ap.add_argument("--target-peers", type=int, default=4)
    ap.add_argument("--conn-identities", type=int, default=20, help="connections: held per attacker")
    ap.add_argument("--hoard-rate", type=float, default=4.0, help="chunks: fresh identities per second per attacker")
    ap.add_argument("--unserved-rate", type=float, default=8.0, help="unserved: announces per second per attacker")
    ap.add_argument("--fetchers", type=int, default=2, help="unserved: nodes running the validator's fetch path")
    ap.add_argument("--garbage-rate", type=float, default=2.0, help="garbage: fresh identities per second per attacker")
    ap.add_argument("--garbage-per-identity", type=int, default=2, help="garbage: batches each identity serves")
    ap.add_argument("--batch-interval-s", type=float, default=4.0, help="garbage: seconds between honest batches")
    ap.add_argument(
        "--slow-streams", type=int, default=100, help="slowstreams: unfinished request streams per identity and node"
    )
    ap.add_argument(
        "--verify-queue",
        choices=("fair", "fifo"),
        default="fair",
        help="garbage: the validator's verify queue, or (baseline) the first-come channel it replaced",
    )
    ap.add_argument("--warm-s", type=float, default=2.0)
    ap.add_argument("--ramp-s", type=float, default=2.0, help="attackers run this long before the attack window")
    ap.add_argument("--drain-s", type=float, default=10.0, help="at most this long after the attack for stragglers")
    ap.add_argument("--connect-timeout", type=float, default=60.0)
    ap.add_argument(
        "--attacker-nice",
        type=int,
        default=0,
        help="niceness of the attacker process (its CPU is the attacker's cost; on one box it is the honest nodes' too)",
    )
    ap.add_argument("--seed", default="hostile")
    ap.add_argument("--keep", action="store_true", help="keep each scenario's work directory (logs)")
    # children
    ap.add_argument("--attacker-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--honest-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="invalid", help=argparse.SUPPRESS)
    ap.add_argument("--run-id", default="", help=argparse.SUPPRESS)
    ap.add_argument("--targets", default="", help=argparse.SUPPRESS)
    ap.add_argument("--stop-file", default="", help=argparse.SUPPRESS)
    ap.add_argument("--max-s", type=float, default=120.0, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default="", help=argparse.SUPPRESS)
    ap.add_argument("--genesis", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR)
    for name in ("libp2p", "node", "multiaddr", "trio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if args.honest_child:
        from harness.hostile_nodes import shard_main

        shard_main(args.workdir, args.shard)
        return
    if args.attacker_child:
        trio.run(attacker_main, args)
        return
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(args.scenarios) - set(ALL_SCENARIOS)
    if unknown:
        ap.error(f"unknown scenario(s) {sorted(unknown)}; choose from {','.join(ALL_SCENARIOS)}")
    t0 = time.monotonic()
    results = trio.run(coordinator, args)
    ok = [r for r in results.values() if "error" not in r or "quiet" in r]
    final = {
        "honest_nodes": args.honest,
        "honest_processes": min(args.honest_procs or args.honest, args.honest),
        "nodes_per_process": max((r.get("nodes_per_process", 1) for r in ok), default=None),
        "attackers": args.attackers,
        "rate_per_attacker": args.rate,
        "attack_s": args.seconds,
        "quiet_s": args.quiet_seconds,
        "seconds": round(time.monotonic() - t0, 1),
        "crashes": sum(r.get("crashes") or 0 for r in results.values()),
        "data_lost": sum(r.get("data_lost") or 0 for r in results.values()),
        "errors": {s: r["error"] for s, r in results.items() if "error" in r},
        "scenarios": {s: _brief(r) for s, r in results.items()},
    }
    goal = {}
    inv = results.get("invalid")
    if inv and "quiet" in inv:
        goal["invalid_delivery_100"] = inv["delivery"] == 1.0
        goal["invalid_p99_within_2x_quiet"] = inv["p99_over_quiet"] is not None and inv["p99_over_quiet"] <= 2.0
    garbage = results.get("garbage")
    if garbage and "verification" in garbage:
        ver = garbage["verification"]
        for k in ("p50", "p99"):
            ratio = ver[f"{k}_over_quiet"]
            goal[f"garbage_verify_{k}_within_2x_quiet"] = ratio is not None and ratio <= 2.0
    slow = results.get("slowstreams")
    if slow and "requests" in slow:
        for kind in ("genesis", "px"):
            w = slow["requests"].get(kind, {})
            ratio = w.get("p99_over_quiet")
            failed = w.get("attack", {}).get("failed")
            goal[f"slowstreams_{kind}_p99_within_2x_quiet"] = ratio is not None and ratio <= 2.0 and failed == 0
    goal["no_crashes"] = final["crashes"] == 0 and not final["errors"]
    goal["no_data_lost"] = final["data_lost"] == 0 and all(r.get("data_lost") is not None for r in results.values())
    final["goal"] = goal
    judged = (
        bool(inv and "quiet" in inv) or bool(garbage and "verification" in garbage) or bool(slow and "requests" in slow)
    )
    final["goal_met"] = judged and all(goal.values())
    render({"scenarios": results, "nodes_per_process": final["nodes_per_process"] or 1}, args)
    print(json.dumps(final))


def _brief(r: dict) -> dict:
    """The per-scenario fields of the final JSON line (the full record is the scenario's own line)."""
    if "quiet" not in r:
        return {k: r.get(k) for k in ("error", "crashes", "crashed_nodes", "data_lost", "seconds")}
    at = r.get("attack") or {}
    mem = r["memory"]
    if r["nodes_per_process"] == 1:
        peak = {f"node{v['nodes'][0]}": v["peak_mib"] for v in mem.values()}
    else:
        peak = {f"proc{k[4:]}(nodes {','.join(map(str, v['nodes']))})": v["peak_mib"] for k, v in mem.items()}
    return {
        "offered_per_s": at.get("offered_per_s"),
        "written_per_s": at.get("written_per_s"),
        "attack_unit": r.get("attack_unit"),
        "identities": r.get("identities"),
        "delivery": r["delivery"],
        "quiet_delivery": r["quiet"]["delivery"],
        "p50_ms": r["attack_window"]["p50_ms"],
        "p99_ms": r["attack_window"]["p99_ms"],
        "quiet_p50_ms": r["quiet"]["p50_ms"],
        "quiet_p99_ms": r["quiet"]["p99_ms"],
        "p99_over_quiet": r["p99_over_quiet"],
        "peak_rss_mib": peak,
        "rss_growth_mib_max": r["rss_growth_mib_max"],
        "bad_inputs_tried": r["bad_inputs_tried"],
        "bad_inputs_dropped": r["bad_inputs_dropped"],
        "bans": r["bans"],
        "crashes": r["crashes"],
        "data_lost": r["data_lost"],
        "notes": r.get("notes", ""),
        **({"verification": _brief_verification(r["verification"])} if "verification" in r else {}),
        **({"requests": {k: v for k, v in r["requests"].items() if k != "note"}} if "requests" in r else {}),
    }


def _brief_verification(v: dict) -> dict:
    """garbage: honest verification latency per window and what the flood cost."""
    return {
        "quiet": v["quiet"],
        "attack": v["attack_window"],
        "p50_over_quiet": v["p50_over_quiet"],
        "p99_over_quiet": v["p99_over_quiet"],
        "garbage_prefilled": v["garbage_prefilled"],
        "garbage_dropped_from_verify_queue": v["garbage_dropped_from_verify_queue"],
        "banned_at_end": v["validator"].get("banned_at_end"),
        "verify_queue": v.get("verify_queue", "fair"),
    }


if __name__ == "__main__":
    main()
