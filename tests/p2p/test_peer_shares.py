"""What one peer can hold: a hostile peer at its per-peer bound while an honest peer proceeds.

Each test is one resource of docs/security.md's "What one peer can do" table whose bound
was global only before (one peer could take every other peer's share). Real libp2p hosts
on 127.0.0.1 in one trio process; the hostile peer is a primenode node whose host or
handlers the test drives by hand.
"""

from __future__ import annotations

import dataclasses
import os

import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode, to_proto_status
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

import protocol
from harness.messages import heartbeat_envelope
from node.p2p.gossip import GOSSIP_PROTOCOL, MAX_INBOUND_STREAMS_PER_PEER
from node.p2p.host import closing_host, make_host, parse_peer_addr
from node.p2p.nat import DialBackAutoNAT, NatConfig
from node.p2p.swarm import SwarmView
from node.p2p.testing import NodeFactory, tagged_announce, wait_until
from node.util import now_ms
from protocol import Envelope, HaveEntry, PeerAddr, PeerExchangeRequest, PeerExchangeResponse
from protocol import gossip as frames
from protocol.gossip import GRAFT, IHAVE, encode_control


async def test_one_peer_holds_at_most_its_gossip_streams_while_an_honest_peer_gossips():
    """Inbound gossip streams: each may buffer a partial frame (up to 1 MiB) for 30 s. A peer
    opening many and stalling each mid-frame holds MAX_INBOUND_STREAMS_PER_PEER of them; the
    rest are reset at once, and an honest peer's gossip still arrives."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery, target_peers=2)
            target = await net.start()
            honest = await net.start(target_peers=1)
            attacker = await net.start(target_peers=1)
            await net.wait_connected([target, honest], min_peers=1)
            await wait_until(lambda: target.gossip._inbound[attacker.peer_id] >= 1, 20, what="attacker's stream")
            tid = ID.from_base58(target.peer_id)
            held = []
            for _ in range(3 * MAX_INBOUND_STREAMS_PER_PEER):
                try:  # a frame that says 64 KiB and stops after 10 bytes: the reader must wait
                    s = await attacker.host.new_stream(tid, [GOSSIP_PROTOCOL])
                    await s.write(frames.frame_header(64 * 1024) + b"x" * 10)
                    held.append(s)
                except Exception:
                    pass  # reset by the target (over the cap)
            await wait_until(
                lambda: target.gossip.counters["streams_refused"] >= 2 * MAX_INBOUND_STREAMS_PER_PEER,
                20,
                what="the streams over the cap refused",
            )
            assert target.gossip._inbound[attacker.peer_id] == MAX_INBOUND_STREAMS_PER_PEER

            got: list[int] = []
            target.gossip.on("rollout", lambda env: got.append(_tag(env)))
            await honest.gossip.publish(tagged_announce(7))
            await wait_until(lambda: 7 in got, 20, what="the honest peer's message at the target")
            assert target.gossip._inbound[attacker.peer_id] == MAX_INBOUND_STREAMS_PER_PEER
            assert not target.standing.is_banned(honest.peer_id)
            nursery.cancel_scope.cancel()


def _tag(env: Envelope) -> int:
    return int.from_bytes(env.body.batch_id, "big")


async def test_ids_announced_and_never_served_take_only_the_announcers_share():
    """Missing ids (IHAVE of ids we lack, waiting for a GRAFT): an announcer of ids it never
    serves holds at most ``missing_per_peer`` of the table; an id an honest peer announced
    before the flood is still asked for, served and delivered."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery, target_peers=2)
            target = await net.start()
            honest = await net.start(target_peers=1)
            attacker = await net.start(target_peers=1)
            for n in (honest, attacker):
                await wait_until(lambda n=n: n.gossip.has_stream(target.peer_id), 20, what="gossip links")
            g = target.gossip
            g.tree.missing_capacity, g.tree.missing_per_peer = 200, 50
            g.tree.graft_timeout_s = 3.0  # time for the whole flood to land before the honest GRAFT

            # The honest peer holds a message the target lacks (it never pushed it) and announces it.
            data = protocol.seal(honest.key, honest.run_id, tagged_announce(9), now_ms(), honest.seq.next())
            msg_id = frames.message_id(data)
            honest.gossip.tree.remember(
                msg_id, frames.encode_message(honest.gossip.topic("rollout"), data), "", trio.current_time()
            )
            got: list[int] = []
            g.on("rollout", lambda env: got.append(_tag(env)))
            honest.gossip._send(target.peer_id, encode_control(IHAVE, [msg_id]))
            await wait_until(lambda: msg_id in g.tree.missing or 9 in got, 20, what="the honest IHAVE")

            # The attacker announces 3,000 ids it will never serve, in 10 frames.
            before = g.counters["ihave_received"]
            for _ in range(10):
                attacker.gossip._send(target.peer_id, encode_control(IHAVE, [os.urandom(32) for _ in range(300)]))
            await wait_until(lambda: g.counters["ihave_received"] >= before + 3000, 20, what="the flood")
            assert g.tree.missing_by[attacker.peer_id] == 50
            assert g.counters["ihave_over_share"] >= 2950

            await wait_until(lambda: 9 in got, 20, what="the honest message, grafted")
            assert not target.standing.is_banned(honest.peer_id)
            nursery.cancel_scope.cancel()


async def test_peer_exchange_answers_take_only_their_sources_share_of_the_address_book():
    """Address book: every peer-exchange answer may name 32 fresh identities. Entries learned
    from one peer's answers are capped (``max_book_per_source``), so a peer answering with
    fresh names in a loop cannot push out what the node learned from others."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery, target_peers=3, learn_addrs_from_heartbeats=False)
            target = await net.start()
            honest = await net.start(target_peers=1)
            attacker = await net.start(target_peers=1)
            await wait_until(
                lambda: {honest.peer_id, attacker.peer_id} <= set(target.conns.connected()), 20, what="connections"
            )
            book = target.conns
            book.max_book, book.max_book_per_source = 200, 50

            def fresh(n: int) -> tuple[PeerAddr, ...]:
                return tuple(
                    PeerAddr(peer_id=protocol.NodeKey.generate().peer_id, addrs=(f"/ip4/10.9.{i % 250}.1/tcp/4001",))
                    for i in range(n)
                )

            honest_peers = fresh(30)
            honest.reqresp.register(
                PeerExchangeRequest, lambda env, peer: PeerExchangeResponse(peers=honest_peers[: env.body.max_peers])
            )

            def hostile(env: Envelope, peer: str) -> PeerExchangeResponse:
                return PeerExchangeResponse(peers=fresh(env.body.max_peers))

            attacker.reqresp.register(PeerExchangeRequest, hostile)
            await book.exchange(honest.peer_id)
            assert all(p.peer_id in book.book for p in honest_peers)
            for _ in range(20):  # 640 fresh names
                await book.exchange(attacker.peer_id)
            from_attacker = [p for p, e in book.book.items() if e.source == attacker.peer_id]
            assert len(from_attacker) == 50
            assert all(p.peer_id in book.book for p in honest_peers), "honest entries were pushed out"
            assert len(book.book) < book.max_book
            # The honest source's next answer is still learned.
            honest_peers = fresh(10)
            await book.exchange(honest.peer_id)
            assert all(p.peer_id in book.book for p in honest_peers)
            nursery.cancel_scope.cancel()


async def test_a_relay_gives_each_peer_one_reservation_and_frees_those_of_peers_gone():
    """Relay reservations (a public node serving as relay): the library reserves for any peer
    id a request names, so one connection could take every slot under fresh names; and it keeps
    a slot for its whole TTL after its peer left. Here one peer naming fresh ids holds one slot
    (its own), a peer that reserved and left gives its slot up, and an honest NAT'd node gets a
    slot in a table of two."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery, target_peers=3)
            relay = await net.start(nat=NatConfig(mode="public", hole_punch=False, max_reservations=2))
            assert relay.nat is not None
            served = relay.nat.relay
            await wait_until(lambda: served.serving, 20, what="the relay serving")

            attacker = await net.start(target_peers=1)
            rid = ID.from_base58(relay.peer_id)
            for _ in range(4):
                stream = await attacker.host.new_stream(rid, [HOP_PROTOCOL_ID])
                fake = protocol.NodeKey.generate().peer_id
                await write_delimited_msg(
                    stream, HopMessage(type=HopMessage.RESERVE, peer=CircuitPeerId(id=ID.from_base58(fake).to_bytes()))
                )
                answer = await read_delimited_msg(stream, HopMessage)
                assert answer.status == to_proto_status(StatusCode.OK)
                await stream.close()
            assert served.reservations() == 1 and served.foreign_names_cleared == 4

            private = NatConfig(mode="private", relays=1, first_check_s=0.1, hole_punch=False)
            leaver = await net.start(target_peers=1, nat=private)
            assert leaver.nat is not None
            await wait_until(lambda: relay.peer_id in leaver.nat.relays, 20, what="the leaver's reservation")
            assert served.reservations() == 2
            net.kill(leaver)
            await wait_until(lambda: leaver.peer_id not in relay.conns.connected(), 20, what="the leaver gone")

            honest = await net.start(target_peers=1, nat=private)
            assert honest.nat is not None
            await wait_until(lambda: relay.peer_id in honest.nat.relays, 20, what="the honest reservation")
            assert served.reservations() == 2 and served.reservations_freed == 1
            assert any("p2p-circuit" in a for a in honest.addrs())
            nursery.cancel_scope.cancel()


async def test_a_neighbour_relaying_fresh_identities_gets_a_fair_share_of_the_swarm_view():
    """Swarm-view entries: a neighbour forwarding heartbeats of fresh identities filled the view
    (2048), and every later newcomer was refused until they went silent. Now each entry is
    charged to the neighbour that introduced it and, while full, a newcomer introduced by
    another neighbour takes the place of one of the biggest introducer's entries."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery, target_peers=3, forget_after_s=60.0)
            target = await net.start()
            honest = await net.start(target_peers=1)
            attacker = await net.start(target_peers=1)
            view = target.swarm
            await wait_until(lambda: view.knows(honest.peer_id) and view.knows(attacker.peer_id), 20, what="views")
            view.max_peers = 20
            topic = attacker.gossip.topic("heartbeat")
            for _ in range(40):
                key = protocol.NodeKey.generate()
                data = protocol.seal(key, attacker.run_id, attacker.make_heartbeat(), now_ms(), 1)
                attacker.gossip._send(target.peer_id, frames.encode_message(topic, data))
            await wait_until(lambda: view.introduced_by(attacker.peer_id) >= 17, 20, what="the flood in the view")
            await wait_until(lambda: view.refused > 0, 20, what="the view full")
            assert len(view.peers()) == 20

            # A newcomer that reaches the target only through the honest node.
            newcomer = await net.start(target_peers=1, bootstrap=honest.full_addrs())
            await wait_until(lambda: view.knows(newcomer.peer_id), 20, what="the newcomer in the full view")
            assert view.displaced >= 1 and len(view.peers()) <= 20
            assert view.knows(honest.peer_id)  # the displaced entry was one the attacker brought
            nursery.cancel_scope.cancel()


def test_the_swarm_view_shares_out_its_room_between_introducers():
    """The rule on its own: introducers end up with equal shares, never one of them all."""
    view = SwarmView("me", forget_after=1e9, max_peers=10, clock=lambda: 0.0)  # time stands still
    intro = {"via": "a"}
    view.introducer = lambda: intro["via"]
    keys = [protocol.NodeKey.generate() for _ in range(30)]

    def deliver(k: protocol.NodeKey) -> None:
        view.on_heartbeat(heartbeat_envelope(k, now_ms()))

    for k in keys[:15]:
        deliver(k)
    assert view.introduced_by("a") == 10 and view.refused == 5  # alone, "a" may fill it
    intro["via"] = "b"
    for k in keys[15:]:
        deliver(k)
    assert view.introduced_by("a") == 5 and view.introduced_by("b") == 5


async def test_a_forwarders_flood_cycles_only_its_share_of_the_graft_cache():
    """GRAFT cache (recent messages kept to repair lazy links): every message in it is valid,
    but a neighbour relaying valid messages at its full rate cycled the whole cache, so GRAFTs
    for everyone else's messages went unanswered. Each forwarder now holds at most
    ``cache_share`` of it and makes room from its own oldest; an honest message cached before
    the flood still answers a GRAFT."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery, target_peers=1)
            target = await net.start()
            honest = await net.start()
            attacker = await net.start()
            third = await net.start()
            g = target.gossip
            for n in (honest, attacker, third):
                await wait_until(lambda n=n: n.gossip.has_stream(target.peer_id), 20, what="gossip links")
            g.tree.cache_capacity = 40  # a share of 10
            data = await honest.gossip.publish(tagged_announce(1))
            honest_id = frames.message_id(data)
            await wait_until(lambda: honest_id in g.tree.cache, 20, what="the honest message cached")
            for tag in range(100, 160):
                await attacker.gossip.publish(tagged_announce(tag))
            await wait_until(lambda: g.counters["cache_over_share"] >= 50, 20, what="the flood")
            assert len(g.tree.cache_by[attacker.peer_id].ids) == 10
            assert honest_id in g.tree.cache

            third.gossip._send(target.peer_id, encode_control(GRAFT, [honest_id]))
            await wait_until(lambda: g.counters["graft_served"] >= 1, 20, what="the GRAFT answered")
            nursery.cancel_scope.cancel()


async def test_a_peer_that_never_reads_its_gossip_holds_one_send_queue_then_is_cut_loose():
    """Per-peer send queue: a peer that accepts our gossip stream and never reads fills the
    transport's window and then its own queue (``peer_queue_size`` frames), never anyone
    else's; at the bound it is disconnected, and an honest peer receives every message."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery, target_peers=2)
            target = await net.start()
            honest = await net.start(target_peers=1)
            await net.wait_connected([target, honest], min_peers=1)
            g = target.gossip
            g.peer_queue_size = 8

            async def hold(stream) -> None:  # accept, never read
                await trio.sleep_forever()

            key = protocol.NodeKey.generate()
            sink = make_host(key)
            sink.set_stream_handler(GOSSIP_PROTOCOL, hold)
            sink_done = trio.Event()

            async def run_sink(task_status=trio.TASK_STATUS_IGNORED) -> None:
                async with closing_host(sink, ["/ip4/127.0.0.1/tcp/0"]):
                    task_status.started()
                    await sink_done.wait()

            await nursery.start(run_sink)
            await sink.connect(parse_peer_addr(target.full_addrs()[0]))
            await wait_until(lambda: g.has_stream(key.peer_id), 20, what="the target's stream to the sink")

            got: list[int] = []
            honest.gossip.on("heartbeat", lambda env: env.sender == target.peer_id and got.append(env.body.step))
            for step in range(40):
                have = (HaveEntry(version=1, root=bytes(32), bitmap=os.urandom(60 * 1024)),)
                hb = dataclasses.replace(target.make_heartbeat(), have=have, step=step)
                await g.publish(hb)
                await trio.sleep(0.01)
            await wait_until(lambda: key.peer_id not in target.conns.connected(), 20, what="the sink cut loose")
            assert target.metrics.dropped["peer_queue_full"] >= 1
            await wait_until(lambda: set(range(40)) <= set(got), 30, what="every message at the honest peer")
            sink_done.set()
            nursery.cancel_scope.cancel()


async def test_dial_backs_are_one_per_peer_per_interval_and_others_are_still_served():
    """AutoNAT dial-backs (each a TCP connection and a Noise handshake from us): one per
    requesting peer every DIAL_BACK_EVERY_S, at most DIAL_BACK_MAX_ADDRS addresses each; a
    peer asking in a loop is refused while another peer is served."""
    server = DialBackAutoNAT(make_host(protocol.NodeKey.generate()), timeout=1.0)
    asker, other = (ID.from_base58(protocol.NodeKey.generate().peer_id) for _ in range(2))
    assert await server._try_dial(asker, []) is None  # served (nothing to dial)
    for _ in range(10):
        await server._try_dial(asker, [])
    assert (server.served, server.refused) == (1, 10)
    await server._try_dial(other, [])
    assert (server.served, server.refused) == (2, 10)


async def test_one_dialer_holds_a_quarter_of_the_circuits_to_a_relayed_peer():
    """Circuits through a relay to a NAT'd peer: the reservation allows ``max_circuits_per_peer``
    at once, shared by every dialer, and one dialer holding them all cut the peer off. Each
    dialer now holds at most a quarter; an honest dialer still reaches the peer."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            net = NodeFactory(nursery, target_peers=3)
            relay = await net.start(nat=NatConfig(mode="public", hole_punch=False, max_circuits_per_peer=8))
            assert relay.nat is not None
            served = relay.nat.relay
            await wait_until(lambda: served.serving, 20, what="the relay serving")
            private = NatConfig(mode="private", relays=1, first_check_s=0.1, hole_punch=False)
            hidden = await net.start(target_peers=1, nat=private)
            assert hidden.nat is not None
            await wait_until(lambda: relay.peer_id in hidden.nat.relays, 20, what="the reservation")
            circuit = hidden.nat.relays[relay.peer_id][0]

            attacker = await net.start(target_peers=1)
            rid = ID.from_base58(relay.peer_id)
            answers = []
            held = []
            for _ in range(8):  # CONNECTs that are never followed by a handshake
                stream = await attacker.host.new_stream(rid, [HOP_PROTOCOL_ID])
                dst = CircuitPeerId(id=ID.from_base58(hidden.peer_id).to_bytes())
                await write_delimited_msg(stream, HopMessage(type=HopMessage.CONNECT, peer=dst))
                try:
                    answers.append((await read_delimited_msg(stream, HopMessage)).status)
                except Exception:
                    answers.append(-1)  # reset
                held.append(stream)
            ok = to_proto_status(StatusCode.OK)
            assert answers.count(ok) == served.max_circuits_per_dialer == 2, answers
            assert served.circuits_refused == 6

            dialer = await net.start(target_peers=1, nat=NatConfig(mode="public", hole_punch=False))
            assert dialer.nat is not None
            with trio.fail_after(15):
                await dialer.nat.dial_via_relay(hidden.peer_id, [circuit])
            assert dialer.nat.relay_dials["ok"] == 1
            nursery.cancel_scope.cancel()
