"""Fuzzing the handlers that read bytes from peers, on real sockets in one trio process:

* request/response frames over real libp2p streams (``/primenode/rr/1.0.0``): the
  node answers ``ErrorResponse`` or closes, and keeps answering honest requests;
* gossip frames over real libp2p streams (``/primenode/gossip/1.0.0``): only
  drops, nothing invalid delivered, the node keeps relaying honest gossip;
* the chunk data plane's raw TCP port: the server keeps serving an honest client.

No handler may fail internally (``internal`` counters stay 0). The target's
misbehaviour budget is huge so the attacker is not banned half-way and every
input reaches the deep code; bans are tested in tests/test_hostile_floods.py.
Budgets: ``FUZZ_EXAMPLES`` (see tests/fuzz_support.py).
"""

from __future__ import annotations

import random
import time
import types
from pathlib import Path

import trio
from libp2p.peer.id import ID

from node.dataplane import Distribution
from node.dataplane import frames as F
from node.dataplane.client import DataConnection, DataPlaneError
from node.dataplane.p2p_overlay import P2POverlay, distribution_heartbeat_fields, serve_distribution
from node.p2p.gossip import GOSSIP_PROTOCOL
from node.p2p.node import RoleHook
from node.p2p.reqresp import RR_PROTOCOL, RequestError, read_frame
from node.p2p.testing import NodeFactory, make_genesis, wait_until
from node.roles.worker import WorkerRole
from node.store import ChunkStore
from protocol import (
    ZERO_RUN_ID,
    BatchRequest,
    BatchResponse,
    ChunkTicket,
    ChunkTicketRequest,
    ErrorResponse,
    GenesisRequest,
    NodeKey,
    PeerExchangeRequest,
    PeerExchangeResponse,
    ProtocolError,
    RolloutAnnounce,
    open_envelope,
    seal,
    sha256,
)
from protocol import messages as m
from protocol.envelope import _signed_part
from protocol.schema import pack, unpack

from .fuzz_support import examples

TARGET_KEY = NodeKey(b"\x51" * 32)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# ------------------------------------------------------------------ random mutations (plain random: async tests)


def mutate(rnd: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        if not b:
            b += rnd.randbytes(rnd.randint(1, 8))
            continue
        i = rnd.randrange(len(b))
        op = rnd.randrange(6)
        if op == 0:
            b[i] ^= 1 << rnd.randrange(8)
        elif op == 1:
            b[i:i] = rnd.randbytes(rnd.randint(1, 8))
        elif op == 2:
            del b[i : i + rnd.randint(1, 8)]
        elif op == 3:
            del b[i:]
        elif op == 4:
            b += rnd.randbytes(rnd.randint(1, 16))
        else:
            b[i] = rnd.choice([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xC4, 0xCC, 0xCF, 0xD9, 0xDC, 0xDD, 0xFF])
    return bytes(b)


ODD = [None, True, 0, -1, 2**63 - 1, 2**64 - 1, -(2**63), 1.5, float("nan"), "", "x" * 300, b"", b"\x00" * 32, [], [0] * 70]


def mutate_tree(rnd: random.Random, tree):
    """Replace one node of a msgpack tree by an odd value, or drop/duplicate an item."""
    tree = unpack(pack(tree))
    paths = [()]
    stack = [((), tree)]
    while stack:
        p, node = stack.pop()
        if isinstance(node, list):
            for i, v in enumerate(node):
                paths.append(p + (i,))
                stack.append((p + (i,), v))
    path = rnd.choice(paths)
    if not path:
        return rnd.choice(ODD)
    parent = tree
    for i in path[:-1]:
        parent = parent[i]
    op = rnd.randrange(3)
    if op == 0:
        parent[path[-1]] = rnd.choice(ODD)
    elif op == 1:
        del parent[path[-1]]
    else:
        parent.append(parent[path[-1]])
    return tree


def resign(key: NodeKey, run_id: bytes, type_id: int, body: bytes, ts: int | None = None, seq: int | None = None) -> bytes:
    ts = now_ms() if ts is None else ts
    seq = time.time_ns() if seq is None else seq
    sig = key.sign(_signed_part(run_id, type_id, key.peer_id, ts, seq, body))
    return pack([1, run_id, type_id, key.peer_id, ts, seq, body, sig])


# ------------------------------------------------------------------ a target serving every request type


class TargetRole(RoleHook):
    """Serves tickets (a real Distribution with a published version), batches and the
    node's own genesis/peer-exchange handlers."""

    role = "trainer"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dist: Distribution | None = None
        self.ready = trio.Event()
        self.worker = types.SimpleNamespace(batches={}, stats={"batches_served": 0})

    async def run(self, node) -> None:
        store = ChunkStore(self.root / "chunks", node.run_id, node.genesis.trainer)
        self.dist = Distribution(store, P2POverlay(node), max_async=2, auto_fetch=False)
        src = self.root / "ckpt"
        src.mkdir(parents=True, exist_ok=True)
        (src / "model.safetensors").write_bytes(random.Random(1).randbytes(200_000))
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_distribution, node, self.dist)
            await self.dist.publish(node.key, 0, src, chunk_size=65536)
            node.reqresp.register(BatchRequest, lambda env, peer: WorkerRole._serve_batch(self.worker, env, peer))
            self.ready.set()
            await trio.sleep_forever()

    def heartbeat_fields(self):
        return distribution_heartbeat_fields(self.dist) if self.dist is not None else {}


async def start_target(nursery, tmp_path, **overrides):
    genesis = make_genesis(owner=TARGET_KEY)  # the target is the trainer
    net = NodeFactory(nursery, genesis=genesis, budget=1e12, rate_per_s=1e6, rate_burst=1e6, **overrides)
    role = TargetRole(tmp_path)
    target = await net.start(hook=role, key=TARGET_KEY)
    with trio.fail_after(30):
        await role.ready.wait()
    return net, target, role


def internal_failures(node) -> int:
    return node.metrics.dropped["internal"] + sum(c["internal"] for c in node.metrics.req.values())


# ------------------------------------------------------------------ request/response


def rr_inputs(rnd: random.Random, attacker: NodeKey, run_id: bytes, n: int):
    """Frames (without the length prefix unless noted) a hostile requester may send."""
    valid = [
        (GenesisRequest(want=0), ZERO_RUN_ID), (PeerExchangeRequest(max_peers=64), run_id),
        (BatchRequest(batch_id=bytes(32)), run_id),
        (ChunkTicketRequest(version=0, root=bytes(32), chunk_indices=(0,)), run_id),
    ]
    other = NodeKey.generate()
    for i in range(n):
        msg, rid = rnd.choice(valid)
        kind = i % 8
        if kind == 0:
            yield "frame", rnd.randbytes(rnd.randint(0, 400))
        elif kind == 1:
            yield "frame", mutate(rnd, seal(attacker, rid, msg, now_ms(), time.time_ns()))
        elif kind == 2:  # correctly signed, mutated body: the body decoder and the handlers run
            body = pack(mutate_tree(rnd, unpack(msg.encode())))
            yield "frame", resign(attacker, rid, type(msg).TYPE_ID, body)
        elif kind == 3:  # signed by someone else than the connection's peer
            yield "frame", seal(other, rid, msg, now_ms(), time.time_ns())
        elif kind == 4:  # a type nobody serves, or a response type as a request
            t = rnd.choice(sorted(m.ENVELOPE_TYPES))
            yield "frame", resign(attacker, rnd.choice([rid, ZERO_RUN_ID]), t, rnd.randbytes(rnd.randint(0, 40)))
        elif kind == 5:  # raw: a lying length prefix, then silence or a short write
            yield "raw", rnd.randint(0, 2**32 - 1).to_bytes(4, "big") + rnd.randbytes(rnd.randint(0, 64))
        elif kind == 6:  # odd but well-formed requests the handlers must answer
            odd = rnd.choice([
                ChunkTicketRequest(version=rnd.randrange(2**31), root=rnd.randbytes(32),
                                   chunk_indices=tuple(rnd.randrange(2**32) for _ in range(rnd.randint(1, 5)))),
                ChunkTicketRequest(version=0, root=bytes(32), chunk_indices=(2**32 - 1,)),
                BatchRequest(batch_id=rnd.randbytes(32)), PeerExchangeRequest(max_peers=rnd.randint(1, 64)),
            ])
            yield "frame", seal(attacker, run_id, odd, now_ms(), time.time_ns())
        else:  # stale, future and replayed envelopes
            ts = now_ms() + rnd.choice([-10 * 60_000, 60_000, 0])
            yield "frame", seal(attacker, rid, msg, ts, 12345)


async def test_fuzz_request_response_frames(tmp_path):
    n = examples(400)
    with trio.fail_after(60 + n * 0.2):
        async with trio.open_nursery() as nursery:
            net, target, _role = await start_target(nursery, tmp_path)
            attacker = await net.start()
            honest = await net.start()
            await wait_until(lambda: target.peer_id in attacker.conns.connected(), 20, what="attacker connected")
            rnd = random.Random(1234)
            outcomes = {"error_response": 0, "closed": 0, "response": 0}
            for how, data in rr_inputs(rnd, attacker.key, target.run_id, n):
                with trio.move_on_after(5) as cs:
                    stream = await attacker.host.new_stream(ID.from_base58(target.peer_id), [RR_PROTOCOL])
                    try:
                        await stream.write(data if how == "raw" else len(data).to_bytes(4, "big") + data)
                        if how == "raw":
                            await stream.close()  # half-done frame: the server must give up, not hang
                        raw = await read_frame(stream, 1 << 20)
                    except Exception:
                        outcomes["closed"] += 1
                        continue
                    finally:
                        with trio.move_on_after(1):
                            try:
                                await stream.close()
                            except Exception:
                                pass
                    env = open_envelope(raw, run_id=target.run_id, now_ms=now_ms(), guard=None)
                    assert env.sender == target.peer_id
                    outcomes["error_response" if isinstance(env.body, ErrorResponse) else "response"] += 1
                if cs.cancelled_caught:
                    outcomes["closed"] += 1
            assert outcomes["error_response"] > n // 4, outcomes
            assert internal_failures(target) == 0, dict(target.metrics.req)
            # the target still answers an honest peer, quickly
            env = await honest.reqresp.request(target.peer_id, PeerExchangeRequest(max_peers=8), PeerExchangeResponse)
            assert isinstance(env.body, PeerExchangeResponse)
            ticket = await honest.reqresp.request(target.peer_id, ChunkTicketRequest(
                version=0, root=target.hook.dist.store.get(0).root, chunk_indices=(0,)), ChunkTicket)
            assert ticket.body.ok
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ gossip


def gossip_frames(rnd: random.Random, attacker: NodeKey, run_id: bytes, topics: dict[str, str], n: int):
    """(raw bytes to write on a gossip stream, tag of a message that must never be delivered or None)."""
    ann = lambda tag: RolloutAnnounce(batch_id=tag.to_bytes(32, "big"), policy_version=0, batch_counter=0,
                                      num_samples=1, size_bytes=1)
    for i in range(n):
        tag = 1_000_000 + i
        good = seal(attacker, run_id, ann(tag), now_ms(), time.time_ns())
        kind = i % 8
        if kind == 0:
            frame = rnd.randbytes(rnd.randint(0, 300))
        elif kind == 1:
            frame = pack([topics["rollout"], mutate(rnd, good)])
        elif kind == 2:  # correctly signed, mutated body
            body = pack(mutate_tree(rnd, unpack(ann(tag).encode())))
            frame = pack([topics["rollout"], resign(attacker, run_id, RolloutAnnounce.TYPE_ID, body)])
            try:  # the mutation may have produced another valid message: that one may be delivered
                tag = -1 - int.from_bytes(RolloutAnnounce.decode(body).batch_id, "big")
            except ProtocolError:
                pass
        elif kind == 3:  # valid envelope on the wrong topic, or an unknown topic
            frame = pack([rnd.choice([topics["vote"], topics["heartbeat"], "/primenode/x/rollout/1", ""]), good])
        elif kind == 4:  # frame structure mutated
            frame = pack(mutate_tree(rnd, [topics["rollout"], good]))
        elif kind == 5:  # non-gossip types (requests, batches) on a topic
            t = rnd.choice(sorted(set(m.ENVELOPE_TYPES) - set(m.GOSSIP_TYPES)))
            frame = pack([topics["rollout"], resign(attacker, run_id, t, rnd.randbytes(rnd.randint(0, 30)))])
        elif kind == 6:  # restricted kinds from a non-authorised sender
            frame = pack([topics["vote"], seal(attacker, run_id, m.Vote(batch_id=tag.to_bytes(32, "big"),
                                                                        worker=attacker.peer_id, policy_version=0,
                                                                        accept=True, reason="", rewards=()),
                                               now_ms(), time.time_ns())])
        else:  # stale or replayed
            frame = pack([topics["rollout"], seal(attacker, run_id, ann(tag), now_ms() - 10 * 60_000, 77)])
        yield len(frame).to_bytes(4, "big") + frame, tag


async def test_fuzz_gossip_frames(tmp_path):
    n = examples(600)
    with trio.fail_after(90 + n * 0.1):
        async with trio.open_nursery() as nursery:
            net, target, _role = await start_target(nursery, tmp_path)
            honest = await net.start()
            attacker = await net.start(bootstrap=target.full_addrs(), target_peers=1)
            await net.wait_connected([target, honest], min_peers=1)
            got: list[int] = []
            for node in (target, honest):
                node.gossip.on("rollout", lambda env: got.append(int.from_bytes(env.body.batch_id, "big")))
                node.gossip.on("vote", lambda env: got.append(int.from_bytes(env.body.batch_id, "big")))
            topics = {k: target.gossip.topic(k) for k in ("rollout", "vote", "heartbeat")}
            rnd = random.Random(99)
            tags = set()
            stream = None
            sent = 0
            valid_ids = set()
            for data, tag in gossip_frames(rnd, attacker.key, target.run_id, topics, n):
                if tag < 0:
                    valid_ids.add(-1 - tag)
                else:
                    tags.add(tag)
                for _attempt in range(3):
                    try:
                        if stream is None:
                            with trio.fail_after(5):
                                stream = await attacker.host.new_stream(ID.from_base58(target.peer_id), [GOSSIP_PROTOCOL])
                        with trio.fail_after(5):
                            await stream.write(data)
                        sent += 1
                        break
                    except Exception:
                        stream = None  # the target closed it (e.g. an oversized length): open another
            # a lying length prefix: the target must drop the stream, not wait forever or buffer 4 GiB
            with trio.fail_after(10):
                s2 = await attacker.host.new_stream(ID.from_base58(target.peer_id), [GOSSIP_PROTOCOL])
                await s2.write((2**32 - 1).to_bytes(4, "big") + b"x" * 100)
            await wait_until(lambda: target.metrics.dropped["size"] >= 1, 20, what="the oversized frame dropped")
            # Honest gossip still flows through the target, and nothing the attacker sent was delivered.
            await target.gossip.publish(RolloutAnnounce(batch_id=(7).to_bytes(32, "big"), policy_version=0,
                                                        batch_counter=0, num_samples=1, size_bytes=1))
            await wait_until(lambda: 7 in got, 20, what="honest delivery after the fuzz")
            assert not (tags & set(got)) - valid_ids, sorted(tags & set(got))[:5]
            assert internal_failures(target) == 0
            assert sent >= n * 0.9, sent
            assert sum(target.metrics.dropped.values()) >= n * 0.5, dict(target.metrics.dropped)
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ chunk data plane


async def _honest_fetch(node, target, role) -> bytes:
    st = role.dist.store.get(0)
    env = await node.reqresp.request(target.peer_id, ChunkTicketRequest(version=0, root=st.root, chunk_indices=(0,)),
                                     ChunkTicket)
    t = env.body
    assert t.ok, t.reason
    conn = await DataConnection.open(t.host, t.port, t.ticket, stall_timeout=5)
    try:
        # as a real fetcher does: a super-seeding server may answer ELSEWHERE for a chunk it
        # just sent to another peer; ask again after a pause (the hold-off is bounded)
        with trio.fail_after(60):
            while True:
                await conn.send(F.OP_GET, 1)
                op, status, idx, length = await conn.read_header()
                if status != F.ELSEWHERE:
                    break
                await trio.sleep(0.25)
        assert (op, status, idx) == (F.OP_GET, F.OK, 1)
        buf = bytearray(length)
        await conn.read_payload_into(memoryview(buf))
    finally:
        await conn.aclose()
    assert sha256(bytes(buf)) == st.manifest.files[0].chunk_hashes[1]
    return bytes(buf)


async def test_fuzz_chunk_data_plane(tmp_path):
    n = examples(300)
    with trio.fail_after(90 + n * 0.2):
        async with trio.open_nursery() as nursery:
            net, target, role = await start_target(nursery, tmp_path)
            server = role.dist.server
            server.stall_timeout_s = 1.0  # a silent attacker is cut quickly (keeps the test short)
            client = await net.start()
            st = role.dist.store.get(0)
            # a real ticket for the attacker, so requests after HELLO reach the serving loop too
            env = await client.reqresp.request(target.peer_id, ChunkTicketRequest(version=0, root=st.root,
                                                                                   chunk_indices=(0,)), ChunkTicket)
            ticket = env.body.ticket
            rnd = random.Random(5)
            port = server.port
            for i in range(n):
                kind = i % 6
                if kind == 0:
                    data = rnd.randbytes(rnd.randint(0, 200))
                elif kind == 1:  # a mutated HELLO
                    data = mutate(rnd, F.HELLO.pack(F.MAGIC, F.WIRE_VERSION, 0, ticket))
                elif kind == 2:  # forged or expired ticket
                    data = F.HELLO.pack(F.MAGIC, F.WIRE_VERSION, 0, rnd.randbytes(32))
                else:  # valid HELLO, then random / odd / pipelined requests
                    reqs = b"".join(
                        F.REQUEST.pack(rnd.choice([0, 1, 2, 4, 255]), rnd.choice([0, 1, 3, 4, 2**32 - 1, rnd.randrange(2**32)]),
                                       rnd.choice([0, rnd.randrange(2**64)]))
                        for _ in range(rnd.randint(1, 20)))
                    if kind == 4:
                        reqs = mutate(rnd, reqs)
                    data = F.HELLO.pack(F.MAGIC, F.WIRE_VERSION, 0, ticket) + reqs
                with trio.move_on_after(5):
                    try:
                        s = await trio.open_tcp_stream("127.0.0.1", port)
                    except OSError:
                        continue
                    try:
                        await s.send_all(data)
                        if rnd.random() < 0.5:
                            await s.send_eof()  # half-close: the server sees EOF mid-frame
                        # read a little (or nothing: requesting chunks one never reads)
                        if rnd.random() < 0.3:
                            with trio.move_on_after(0.2):
                                await s.receive_some(65536)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
                    finally:
                        await s.aclose()
            # The server is alive and serves an honest fetcher correctly.
            await _honest_fetch(client, target, role)
            # Every attacker connection is eventually released (no leaked slots).
            await wait_until(lambda: server.connections == 0, 30, what="data-plane connections released")
            assert server.chunks_served >= 1
            nursery.cancel_scope.cancel()
