"""Fuzzing the handlers that read bytes from peers (the server side), on real sockets:

* request/response frames over real libp2p streams (``/primenode/rr/1.0.0``): the
  node answers ``ErrorResponse`` or closes, well-formed requests get a real answer,
  and it keeps answering honest requests;
* gossip frames over real libp2p streams (``/primenode/gossip/1.0.0``): every frame
  is checked on its own (a marker frame behind it on the same stream proves it was
  processed): nothing delivered that an independent check would not accept, and the
  node keeps relaying honest gossip;
* the chunk data plane's raw TCP port: whatever the server writes back is well-formed
  (a WELCOME, then one reply per request in order), every connection is released, and
  an honest fetcher is served afterwards.

Inputs are hypothesis strategies (property-based; shrunk on failure). The nodes live
in the test's trio loop and are started once; hypothesis runs in a worker thread and
sends each example through them (harness/fuzz.py: ``run_given``/``on_loop``).
No handler may fail internally (``internal`` counters stay 0). The target's
misbehaviour budget is huge so the attacker is not banned half-way and every input
reaches the deep code; bans are tested in tests/p2p/test_hostile_floods.py.
The client side (hostile responders and seeds) is in tests/p2p/test_fuzz_clients.py.
Budgets: ``FUZZ_EXAMPLES`` (see harness/fuzz.py).
"""

from __future__ import annotations

import itertools
import random
import time
import types
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from libp2p.peer.id import ID

from harness.fuzz import (
    apply_mutations,
    byte_mutations,
    examples,
    fuzz_settings,
    mutate_bytes,
    mutate_tree,
    on_loop,
    run_given,
    try_pack,
)
from harness.genesis import overlay_genesis
from harness.strategies import message_strategy
from node.checkpoints import Checkpoints, ChunkStore
from node.checkpoints.client import DataConnection
from node.p2p.gossip import GOSSIP_PROTOCOL
from node.p2p.node import RoleHook
from node.p2p.reqresp import RR_PROTOCOL, read_frame
from node.p2p.testing import NodeFactory, tagged_announce, wait_until
from node.roles.checkpoint_wiring import P2PControlPlane, checkpoint_heartbeat_fields, serve_checkpoints
from node.roles.worker import WorkerRole
from node.util import now_ms
from protocol import (
    ZERO_RUN_ID,
    BatchRequest,
    ChunkTicket,
    ChunkTicketRequest,
    ErrorResponse,
    GenesisRequest,
    NodeKey,
    PeerExchangeRequest,
    PeerExchangeResponse,
    RolloutAnnounce,
    open_envelope,
    seal,
    sha256,
)
from protocol import chunk_frames as F
from protocol import messages as m
from protocol import reqresp as rr_frames
from protocol.gossip import GRAFT, IHAVE, PRUNE, encode_message, frame_header
from protocol.schema import pack, unpack
from protocol.testing import resign
from protocol.topics import TOPIC_TYPES

TARGET_KEY = NodeKey(b"\x51" * 32)
SIGNER_KEY = NodeKey(b"\x52" * 32)  # signs the gossip fuzz content; forwarded by the attacker node

# The nodes' loop runs beside hypothesis (another thread) and uses the random module.
pytestmark = pytest.mark.filterwarnings("ignore:Do not use the `random` module")
_SEQ = itertools.count(time.time_ns())


def fresh_resign(key: NodeKey, run_id: bytes, type_id: int, body: bytes) -> bytes:
    """A correctly signed, fresh envelope around arbitrary body bytes (what a malicious peer can send)."""
    return resign(key, run_id, type_id, body, timestamp_ms=now_ms(), seq=next(_SEQ))


def fresh_seal(key: NodeKey, run_id: bytes, msg, ts: int | None = None) -> bytes:
    return seal(key, run_id, msg, now_ms() if ts is None else ts, next(_SEQ))


u8 = st.integers(0, 255)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


# ------------------------------------------------------------------ a target serving every request type


class TargetRole(RoleHook):
    """Serves tickets (a real Checkpoints with a published version), batches and the
    node's own genesis/peer-exchange handlers."""

    role = "trainer"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.checkpoints: Checkpoints | None = None
        self.ready = trio.Event()
        self.worker = types.SimpleNamespace(batches={}, stats={"batches_served": 0})

    async def run(self, node) -> None:
        store = ChunkStore(self.root / "chunks", node.run_id, node.genesis.trainer)
        self.checkpoints = Checkpoints(store, P2PControlPlane(node), max_async=2, auto_fetch=False)
        src = self.root / "ckpt"
        src.mkdir(parents=True, exist_ok=True)
        (src / "model.safetensors").write_bytes(random.Random(1).randbytes(200_000))
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_checkpoints, node, self.checkpoints)
            await self.checkpoints.import_version(node.key, 0, src, chunk_size=65536)
            node.reqresp.register(BatchRequest, lambda env, peer: WorkerRole._serve_batch(self.worker, env, peer))
            self.ready.set()
            await trio.sleep_forever()

    def heartbeat_fields(self):
        return checkpoint_heartbeat_fields(self.checkpoints) if self.checkpoints is not None else {}


async def start_target(nursery, tmp_path, **overrides):
    genesis = overlay_genesis(owner=TARGET_KEY)  # the target is the trainer
    net = NodeFactory(nursery, genesis=genesis, budget=1e12, rate_per_s=1e6, rate_burst=1e6, **overrides)
    role = TargetRole(tmp_path)
    target = await net.start(hook=role, key=TARGET_KEY)
    with trio.fail_after(30):
        await role.ready.wait()
    return net, target, role


def internal_failures(node) -> int:
    return node.metrics.dropped["internal"] + sum(c["internal"] for c in node.metrics.req.values())


# ------------------------------------------------------------------ request/response

REQUEST_CLASSES = [GenesisRequest, PeerExchangeRequest, BatchRequest, ChunkTicketRequest]
RR_KINDS = [
    "random",
    "mutated_envelope",
    "mutated_body",
    "other_signer",
    "odd_type",
    "lying_prefix",
    "well_formed",
    "stale_or_replayed",
]


@st.composite
def rr_inputs(draw, attacker: NodeKey, other: NodeKey, run_id: bytes):
    """(how, bytes, well_formed) for one exchange a hostile requester may start. ``how``:
    "frame" (the bytes get a correct length prefix) or "raw" (written as they are, then the
    stream is closed)."""
    kind = draw(st.sampled_from(RR_KINDS))
    cls = draw(st.sampled_from(REQUEST_CLASSES))
    msg = draw(message_strategy(cls))
    rid = ZERO_RUN_ID if cls.TYPE_ID in m.PRE_RUN_TYPES else run_id
    if kind == "random":
        return "frame", draw(st.binary(max_size=400)), False
    if kind == "mutated_envelope":
        return "frame", apply_mutations(fresh_seal(attacker, rid, msg), draw(byte_mutations())), False
    if kind == "mutated_body":  # correctly signed, mutated body: the body decoder and the handlers run
        body = try_pack(draw(mutate_tree(unpack(msg.encode()))))
        return "frame", fresh_resign(attacker, rid, cls.TYPE_ID, body if body is not None else b""), False
    if kind == "other_signer":  # signed by someone else than the connection's peer
        return "frame", fresh_seal(other, rid, msg), False
    if kind == "odd_type":  # a type nobody serves, or a response type as a request
        t = draw(st.sampled_from(sorted(m.ENVELOPE_TYPES) + [0, 255]))
        return (
            "frame",
            fresh_resign(attacker, draw(st.sampled_from([rid, ZERO_RUN_ID])), t, draw(st.binary(max_size=40))),
            False,
        )
    if kind == "lying_prefix":  # a length prefix, then silence or a short write
        n = draw(st.one_of(u32, st.integers(1, 64)))
        return "raw", n.to_bytes(4, "big") + draw(st.binary(max_size=64)), False
    if kind == "well_formed":  # well-formed requests with odd values: the handlers must answer them
        return "frame", fresh_seal(attacker, rid, msg), True
    ts = now_ms() + draw(st.sampled_from([-10 * 60_000, 60_000, 0]))
    return "frame", seal(attacker, rid, msg, ts, 12345), False  # stale, future, or a replayed sequence number


async def test_fuzz_request_response_frames(tmp_path):
    n = examples(100)
    with trio.fail_after(90 + n * 1.0):
        async with trio.open_nursery() as nursery:
            net, target, _role = await start_target(nursery, tmp_path)
            attacker = await net.start()
            honest = await net.start()
            await wait_until(lambda: target.peer_id in attacker.conns.connected(), 20, what="attacker connected")
            other = NodeKey.generate()
            outcomes = {"error_response": 0, "closed": 0, "response": 0}

            async def exchange(how: str, data: bytes):
                """One stream: write, read the answer. None if the target closed without one."""
                with trio.fail_after(20):  # a hang is a failure
                    stream = await attacker.host.new_stream(ID.from_base58(target.peer_id), [RR_PROTOCOL])
                    try:
                        await stream.write(data if how == "raw" else rr_frames.encode_frame(data))
                        if how == "raw":
                            await stream.close()  # half-done frame: the server must give up, not hang
                        raw = await read_frame(stream, 1 << 20)
                    except Exception:
                        return None
                    finally:
                        with trio.move_on_after(1):
                            try:
                                await stream.close()
                            except Exception:
                                pass
                return raw

            @fuzz_settings(n)
            @given(inp=rr_inputs(attacker.key, other, target.run_id))
            def one(inp):
                how, data, well_formed = inp
                raw = on_loop(exchange, how, data)
                if raw is None:
                    outcomes["closed"] += 1
                    assert not well_formed, "a well-formed request got no answer"
                else:
                    # whatever the target answers is a valid envelope signed by the target itself
                    env = open_envelope(raw, run_id=target.run_id, now_ms=now_ms(), guard=None)
                    assert env.sender == target.peer_id
                    bad = isinstance(env.body, ErrorResponse)
                    outcomes["error_response" if bad else "response"] += 1
                    if well_formed and bad:
                        assert env.body.code != "bad_request", env.body.detail
                assert internal_failures(target) == 0, dict(target.metrics.req)

            await run_given(one)
            assert outcomes["error_response"] > n // 4 and outcomes["response"] > 0, outcomes
            # the target still answers an honest peer
            env = await honest.reqresp.request(target.peer_id, PeerExchangeRequest(max_peers=8), PeerExchangeResponse)
            assert isinstance(env.body, PeerExchangeResponse)
            ticket = await honest.reqresp.request(
                target.peer_id,
                ChunkTicketRequest(version=0, root=target.hook.checkpoints.store.get(0).root, chunk_indices=(0,)),
                ChunkTicket,
            )
            assert ticket.body.ok
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ gossip

GOSSIP_KINDS = [
    "random",
    "mutated_envelope",
    "mutated_body",
    "wrong_topic",
    "mutated_frame",
    "non_gossip_type",
    "restricted_kind",
    "stale",
    "control",
    "generated",
]
MARKER_BASE = 1 << 200


@st.composite
def gossip_frames(draw, attacker: NodeKey, run_id: bytes, topics: dict[str, str]):
    """The payload of one gossip frame (the length prefix is added when sent)."""
    kind = draw(st.sampled_from(GOSSIP_KINDS))
    ann = draw(message_strategy(RolloutAnnounce))
    good = fresh_seal(attacker, run_id, ann)
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "mutated_envelope":
        return encode_message(topics["rollout"], apply_mutations(good, draw(byte_mutations())))
    if kind == "mutated_body":  # correctly signed, mutated body
        body = try_pack(draw(mutate_tree(unpack(ann.encode())))) or b""
        return encode_message(topics["rollout"], fresh_resign(attacker, run_id, RolloutAnnounce.TYPE_ID, body))
    if kind == "wrong_topic":  # a valid envelope on the wrong topic, or an unknown one
        t = draw(
            st.one_of(
                st.sampled_from(
                    [topics["vote"], topics["heartbeat"], topics["checkpoint"], "/primenode/x/rollout/1", ""]
                ),
                st.text(max_size=30),
            )
        )
        return encode_message(t, good)
    if kind == "mutated_frame":
        return try_pack(draw(mutate_tree([topics["rollout"], good]))) or b""
    if kind == "non_gossip_type":  # requests, batches, responses on a topic
        t = draw(st.sampled_from(sorted(set(m.ENVELOPE_TYPES) - set(m.GOSSIP_TYPES))))
        return encode_message(topics["rollout"], fresh_resign(attacker, run_id, t, draw(st.binary(max_size=30))))
    if kind == "restricted_kind":  # votes, bans, checkpoints from a sender the genesis does not authorise
        k = draw(st.sampled_from(["vote", "ban", "checkpoint"]))
        cls = m.ENVELOPE_TYPES[TOPIC_TYPES[k]]
        return encode_message(topics[k], fresh_seal(attacker, run_id, draw(message_strategy(cls))))
    if kind == "stale":
        return encode_message(topics["rollout"], fresh_seal(attacker, run_id, ann, ts=now_ms() - 10 * 60_000))
    if kind == "control":  # IHAVE / GRAFT / PRUNE with odd kinds and ids
        ctl = draw(st.one_of(st.sampled_from([IHAVE, GRAFT, PRUNE]), st.integers(-5, 300)))
        ids = draw(
            st.one_of(
                st.lists(st.binary(min_size=32, max_size=32), max_size=8),
                st.lists(st.one_of(st.binary(max_size=40), st.integers(), st.none()), max_size=4),
                st.none(),
                st.text(max_size=5),
            )
        )
        return pack([ctl, ids])
    # generated: any gossip message the attacker may legitimately sign (some are valid)
    k = draw(st.sampled_from(["rollout", "heartbeat"]))
    cls = m.ENVELOPE_TYPES[TOPIC_TYPES[k]]
    try:
        return encode_message(topics[k], fresh_seal(attacker, run_id, draw(message_strategy(cls))))
    except ValueError:  # over the type's size cap: seal refuses it
        return encode_message(topics[k], good)


def acceptable(genesis, kind: str, raw: bytes) -> bool:
    """An independent check of what gossip may deliver: a valid envelope of the topic's type
    (no replay memory: a replay is merely not delivered twice), from a sender the genesis
    authorises for restricted kinds."""
    try:
        env = open_envelope(raw, run_id=genesis.run_id, now_ms=now_ms(), guard=None, allowed_types={TOPIC_TYPES[kind]})
    except Exception:
        return False
    restricted = {
        "checkpoint": {genesis.trainer},
        "vote": set(genesis.validators),
        "ban": {genesis.trainer, *genesis.validators},
    }
    return kind not in restricted or env.sender in restricted[kind]


async def test_fuzz_gossip_frames(tmp_path):
    n = examples(150)
    with trio.fail_after(90 + n * 1.0):
        async with trio.open_nursery() as nursery:
            net, target, _role = await start_target(nursery, tmp_path)
            honest = await net.start()
            attacker = await net.start(bootstrap=target.full_addrs(), target_peers=1)
            await net.wait_connected([target, honest], min_peers=1)
            await wait_until(lambda: target.swarm.knows(attacker.peer_id), 20, what="the attacker's heartbeat")
            delivered: list[tuple[str, bytes]] = []  # (kind, envelope bytes) delivered at the target
            markers: set[int] = set()
            honest_got: list[int] = []
            for kind in TOPIC_TYPES:
                target.gossip.on(kind, lambda env, kind=kind: delivered.append((kind, env.raw)))
            target.gossip.on("rollout", lambda env: markers.add(int.from_bytes(env.body.batch_id, "big")))
            honest.gossip.on("rollout", lambda env: honest_got.append(int.from_bytes(env.body.batch_id, "big")))
            topics = {k: target.gossip.topic(k) for k in TOPIC_TYPES}
            genesis = target.genesis
            state = {"stream": None, "sent": 0}
            tags = itertools.count(MARKER_BASE)

            async def send_and_sync(payload: bytes, marker: bytes, tag: int) -> None:
                """Write the fuzz frame and a marker frame behind it on one stream; wait until the
                marker is delivered, so the fuzz frame has been fully processed."""
                data = frame_header(len(payload)) + payload
                mark = frame_header(len(marker)) + marker
                with trio.fail_after(30):  # a hang is a failure
                    for _attempt in range(3):
                        try:
                            if state["stream"] is None:
                                state["stream"] = await attacker.host.new_stream(
                                    ID.from_base58(target.peer_id), [GOSSIP_PROTOCOL]
                                )
                            await state["stream"].write(data + mark)
                            state["sent"] += 1
                            break
                        except Exception:
                            state["stream"] = None  # the target closed it: open another
                    await wait_until(lambda: tag in markers, 25, poll=0.005, what="the marker behind a fuzz frame")

            @fuzz_settings(n)
            @given(payload=gossip_frames(SIGNER_KEY, target.run_id, topics))
            def one(payload):
                tag = next(tags)
                marker_env = fresh_seal(attacker.key, target.run_id, tagged_announce(tag))
                before = len(delivered)
                on_loop(send_and_sync, payload, encode_message(topics["rollout"], marker_env), tag)
                # the fuzz content is signed by SIGNER_KEY (no node runs it), so the nodes' own
                # traffic (heartbeats) is told apart from what this frame delivered
                new = [(k, raw) for k, raw in delivered[before:] if unpack(raw)[3] == SIGNER_KEY.peer_id]
                try:
                    items = unpack(payload)
                except Exception:
                    items = None
                inner = (
                    items[1] if isinstance(items, list) and len(items) == 2 and isinstance(items[1], bytes) else None
                )
                for kind, raw in new:
                    assert raw == inner, "delivered something that was not in the frame"
                    assert acceptable(genesis, kind, raw), f"delivered an invalid {kind} message"
                assert internal_failures(target) == 0

            await run_given(one)
            # a lying length prefix: the target must drop the stream, not wait forever or buffer 4 GiB
            with trio.fail_after(10):
                s2 = await attacker.host.new_stream(ID.from_base58(target.peer_id), [GOSSIP_PROTOCOL])
                await s2.write((2**32 - 1).to_bytes(4, "big") + b"x" * 100)
            await wait_until(lambda: target.metrics.dropped["size"] >= 1, 20, what="the oversized frame dropped")
            # Honest gossip still flows through the target to the honest node.
            await target.gossip.publish(tagged_announce(7))
            await wait_until(lambda: 7 in honest_got, 20, what="honest delivery after the fuzz")
            assert internal_failures(target) == 0
            assert state["sent"] >= n, state
            assert sum(target.metrics.dropped.values()) >= n * 0.4, dict(target.metrics.dropped)
            nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ chunk data plane


async def _honest_fetch(node, target, role) -> bytes:
    st = role.checkpoints.store.get(0)
    env = await node.reqresp.request(
        target.peer_id, ChunkTicketRequest(version=0, root=st.root, chunk_indices=(0,)), ChunkTicket
    )
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


@st.composite
def data_plane_inputs(draw, ticket: bytes):
    """(bytes to send, HELLO flags if the HELLO is intact else None, half-close, read)."""
    kind = draw(st.sampled_from(["random", "mutated_hello", "forged_ticket", "requests", "mutated_requests"]))
    flags = draw(st.one_of(st.sampled_from([0, F.FLAG_PUSH_HAVE]), st.integers(0, 2**16 - 1)))
    hello = F.HELLO.pack(F.MAGIC, F.WIRE_VERSION, flags, ticket)
    half_close, read = draw(st.booleans()), draw(st.booleans())
    if kind == "random":
        return draw(st.binary(max_size=200)), None, half_close, read
    if kind == "mutated_hello":
        return draw(mutate_bytes(hello)), None, half_close, read
    if kind == "forged_ticket":
        return (
            F.HELLO.pack(F.MAGIC, F.WIRE_VERSION, flags, draw(st.binary(min_size=32, max_size=32))),
            None,
            half_close,
            read,
        )
    reqs = b"".join(
        F.REQUEST.pack(op, idx, pad)
        for op, idx, pad in draw(
            st.lists(
                st.tuples(
                    st.one_of(st.sampled_from([F.OP_GET, F.OP_HAVE, F.OP_BYE, 0, 4, 255]), u8),
                    st.one_of(st.sampled_from([0, 1, 3, 4, 2**32 - 1]), u32),
                    st.one_of(st.just(0), u64),
                ),
                min_size=1,
                max_size=12,
            )
        )
    )
    if kind == "mutated_requests":
        reqs = draw(mutate_bytes(reqs))
    return hello + reqs, flags, half_close, read


def check_server_output(out: bytes, sent: bytes, flags: int | None, st_) -> None:
    """What a chunk server writes is a WELCOME, then for each complete request, in order, its
    reply (a GET may be preceded by a pushed HAVE when asked for pushes); BYE or a bad op ends it."""
    if not out:
        return
    assert len(out) >= 4 and out[:4] == F.MAGIC, out[:16]
    if len(out) < F.WELCOME.size:
        return
    _magic, status, nchunks = F.WELCOME.unpack(out[: F.WELCOME.size])[:3]
    assert status in F.STATUS_NAMES
    pos = F.WELCOME.size
    if status != F.OK or flags is None:
        assert pos == len(out) or status == F.OK, "bytes after a refusing WELCOME"
        return
    assert nchunks == st_.bitmap.n
    bitmap_len = (nchunks + 7) // 8
    reqs = sent[F.HELLO.size :]
    for k in range(len(reqs) // F.REQUEST.size):
        op, idx, _ = F.REQUEST.unpack(reqs[k * F.REQUEST.size : (k + 1) * F.REQUEST.size])
        if op == F.OP_BYE:
            break
        while True:
            if pos + F.REPLY.size > len(out):
                return  # the rest was not read (or the connection was cut): nothing more to check
            rop, rstatus, ridx, length = F.REPLY.unpack(out[pos : pos + F.REPLY.size])
            pos += F.REPLY.size
            if rop == F.OP_HAVE and ridx == F.PUSH_INDEX and op == F.OP_GET:
                assert flags & F.FLAG_PUSH_HAVE and rstatus == F.OK and length == bitmap_len
                pos += length
                continue
            break
        assert rop == op, (rop, op)
        if op == F.OP_HAVE:
            assert (rstatus, ridx, length) == (F.OK, 0, bitmap_len)
        elif op == F.OP_GET:
            assert ridx == idx
            if idx >= nchunks:
                assert (rstatus, length) == (F.BAD_INDEX, 0)
            elif rstatus == F.OK:
                assert length == st_.chunks[idx][2]
            else:
                assert rstatus in (F.ELSEWHERE, F.NOT_HELD) and length == 0
        else:
            assert (rstatus, ridx, length) == (F.BAD_REQUEST, idx, 0)
            assert pos == len(out), "bytes after a BAD_REQUEST reply"
            return
        pos += length
    assert pos <= len(out)


async def test_fuzz_chunk_data_plane(tmp_path):
    n = examples(120)
    with trio.fail_after(90 + n * 1.0):
        async with trio.open_nursery() as nursery:
            net, target, role = await start_target(nursery, tmp_path)
            server = role.checkpoints.server
            server.stall_timeout_s = 1.0  # a silent attacker is cut quickly (keeps the test short)
            client = await net.start()
            st_ = role.checkpoints.store.get(0)
            # a real ticket for the attacker, so requests after HELLO reach the serving loop too
            env = await client.reqresp.request(
                target.peer_id, ChunkTicketRequest(version=0, root=st_.root, chunk_indices=(0,)), ChunkTicket
            )
            ticket = env.body.ticket
            port = server.port

            async def connect_and_send(data: bytes, half_close: bool, read: bool) -> bytes:
                out = bytearray()
                with trio.fail_after(20):  # a hang is a failure
                    s = await trio.open_tcp_stream("127.0.0.1", port)
                    try:
                        await s.send_all(data)
                        if half_close:
                            await s.send_eof()  # the server sees EOF, maybe mid-frame
                        if read:  # read what comes within a moment (or nothing: requesting chunks one never reads)
                            with trio.move_on_after(0.3):
                                while chunk := await s.receive_some(1 << 20):
                                    out += chunk
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
                    finally:
                        await s.aclose()
                return bytes(out)

            @fuzz_settings(n)
            @given(inp=data_plane_inputs(ticket))
            def one(inp):
                data, flags, half_close, read = inp
                out = on_loop(connect_and_send, data, half_close, read)
                check_server_output(out, data, flags, st_)

            await run_given(one)
            # The server is alive and serves an honest fetcher correctly.
            await _honest_fetch(client, target, role)
            # Every attacker connection is eventually released (no leaked slots).
            await wait_until(lambda: server.connections == 0, 30, what="data-plane connections released")
            assert server.chunks_served >= 1
            nursery.cancel_scope.cancel()
