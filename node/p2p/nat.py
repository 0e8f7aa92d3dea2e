"""Nodes behind NAT: reachability (AutoNAT), relay addresses (circuit relay v2), hole punching (DCUtR).

Home machines are mostly behind NAT: they can dial out but nobody can dial in. This module
uses py-libp2p 0.8.1's own implementations of the three libp2p answers to that, wrapped
where our measurements showed a gap:

* **AutoNAT** (``libp2p.host.autonat``): a node asks the peers it is directly connected to
  to dial it back on the addresses it advertises; a success means *public*, refusals and
  failures mean *private* (behind NAT). The library's server dials back with
  ``host.connect()``, which returns the connection the request arrived on, so it answers
  "reachable" to everyone already connected, NAT'd or not (reproduced next to ours in
  ``tests/system/test_nat_netns.py``). :class:`DialBackAutoNAT` dials a *fresh* TCP
  connection and runs the Noise handshake on it (which proves the peer id), then closes it.
* **Circuit relay v2** (``libp2p.relay.circuit_v2``): a private node reserves a slot on
  relays (public peers it is connected to, the bootstrap first) and advertises
  ``<relay addr>/p2p/<relay>/p2p-circuit`` instead of its unreachable addresses, so peers can
  still open a connection to it (control traffic: gossip, votes, batch requests). Public
  nodes serve as relays, with the library's limits on circuit duration and bytes and our own
  per-circuit bandwidth cap (:class:`LimitedRelay`, which also counts relayed bytes).
  py-libp2p's swarm never dials ``/p2p-circuit`` addresses itself, so the connection manager
  and request/response call :meth:`NatService.dial_via_relay` for peers that have only those.
* **DCUtR** (``dcutr.py``): once two peers share a relayed connection, the library tries a
  direct one: first a plain dial (a NAT'd node can always dial a public peer), then a TCP
  simultaneous open from the listen port towards the other side's observed address.

Bulk checkpoint bytes never cross a relay: they travel over the raw-TCP data plane, and a
private node advertises data port 0, so nobody dials its data plane; it fetches from reachable
peers over connections it opens itself, and serves reachable peers over connections it opens
to their data ports when they ask (reverse connections, node/checkpoints/server.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.connection_types import ConnectionType
from libp2p.host.autonat import AutoNATService
from libp2p.host.autonat.pb.autonat_pb2 import Message as AutoNATMessage
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from node.p2p.host import CIRCUIT, conn_is_relayed, is_circuit

log = logging.getLogger(__name__)

UNKNOWN = "unknown"
PUBLIC = "public"
PRIVATE = "private"

# AutoNAT server: at most this many addresses per request, one request per peer this often.
DIAL_BACK_MAX_ADDRS = 4
DIAL_BACK_EVERY_S = 5.0
# A peer that refused a reservation (not a relay, full) is asked again after this long.
RELAY_RETRY_S = 30.0
# One relayed dial, when the caller set no deadline.
RELAY_DIAL_S = 10.0


@dataclasses.dataclass
class NatConfig:
    """Reachability knobs. ``mode``: ``auto`` (ask peers), or force ``public`` / ``private``."""

    mode: str = "auto"
    # A public node serves as a relay for NAT'd peers (circuit relay v2 "hop").
    relay_service: bool = True
    # Relays a private node keeps a reservation with.
    relays: int = 2
    # AutoNAT: first check this long after start, then every interval (sooner while unknown).
    first_check_s: float = 2.0
    check_interval_s: float = 60.0
    dial_back_timeout_s: float = 5.0
    # A public node is called private only after this many checks in a row without one
    # successful dial-back (checks come every ``first_check_s`` while in doubt): on a loaded
    # machine every dial-back of one round can time out, and one such round used to stop the
    # relay service and swap every advertised address for circuit ones.
    demote_after: int = 3
    # Relay limits (per circuit): control traffic only, so modest.
    circuit_max_s: int = 3600
    circuit_max_bytes: int = 256 << 20
    circuit_rate_bytes_s: float = float(1 << 20)
    max_reservations: int = 64
    max_circuits_per_peer: int = 16
    reservation_ttl_s: int = 3600
    # DCUtR: upgrade relayed connections to direct ones. The library gives a peer 3 attempts and
    # then never tries again; a TCP simultaneous open fails when the two sides' dials are far
    # apart (a loaded machine), so the budget is renewed this often while a peer stays relayed.
    hole_punch: bool = True
    hole_punch_retry_s: float = 30.0
    # Only one side of a pair starts DCUtR (the smaller peer id); the other waits this long for
    # it before starting its own (a foreign peer may only ever answer). See drives_hole_punch.
    hole_punch_defer_s: float = 20.0


def next_reachability(current: str, verdicts: dict[str, str], misses: int, demote_after: int) -> tuple[str, int]:
    """The reachability after one round of dial-back ``verdicts``, and the count of rounds in a
    row without a success. Any success: public. No verdict: nothing learnt. Only refusals and
    failures: private, except that a public node needs ``demote_after`` such rounds in a row."""
    if any(v == "ok" for v in verdicts.values()):
        return PUBLIC, 0
    if not verdicts:
        return current, misses
    misses += 1
    if current == PUBLIC and misses < demote_after:
        return PUBLIC, misses
    return PRIVATE, misses


def drives_hole_punch(ours: bytes, theirs: bytes, relayed_for_s: float, defer_s: float) -> bool:
    """Whether we start DCUtR towards a peer we reach only over a relay, or leave it to them.

    Why: py-libp2p 0.8.1 lets both sides of a relayed pair start a session, and runs both.
    Each session dials the other side from the listen port, so the two sessions of one node
    dial the same address from the same port at once: the second ``connect`` fails with
    EADDRNOTAVAIL (errno 99), and the simultaneous opens pair dials of different sessions
    whose handshake roles do not match. On a loaded machine both sides started together and
    no attempt ever succeeded (tests/system/test_nat_netns.py: one CI run in two, and beside two busy
    cores; 4 of 4 passed there after this).
    So one side starts, chosen by the peer ids' byte order (both sides agree without a
    message); the other answers its session, and starts its own only after ``defer_s`` still
    relayed, for a peer that never starts one (libp2p allows answer-only peers)."""
    return ours < theirs or relayed_for_s >= defer_s


class _OrderedDCUtR(DCUtRProtocol):
    """The library's DCUtR with :func:`drives_hole_punch` deciding who starts a session."""

    def __init__(self, host: IHost, defer_s: float) -> None:
        super().__init__(host)
        self.defer_s = defer_s
        self._relayed_since: dict[ID, float] = {}  # peers its loop found relayed, first seen

    async def initiate_hole_punch(self, peer_id: ID) -> bool:
        now = trio.current_time()
        since = self._relayed_since.setdefault(peer_id, now)
        if not drives_hole_punch(self.host.get_id().to_bytes(), peer_id.to_bytes(), now - since, self.defer_s):
            return False
        return await super().initiate_hole_punch(peer_id)

    def on_peer_disconnected(self, peer_id: ID) -> None:
        super().on_peer_disconnected(peer_id)
        self._relayed_since.pop(peer_id, None)


class DialBackAutoNAT(AutoNATService):
    """py-libp2p's AutoNAT, dialling back on a *fresh* connection.

    ``AutoNATService._try_dial`` calls ``host.connect()``, which returns at once when the
    requester is already connected (it always is: the request came over that connection),
    so every requester was told it is reachable. Here the server opens a new TCP
    connection to the advertised address and completes the Noise handshake (which
    authenticates the peer id), then closes it without registering it in the swarm.
    """

    def __init__(self, host: IHost, *, timeout: float = 5.0) -> None:
        super().__init__(host, serve=True, confirmations=1)  # type: ignore[arg-type]  # BasicHost at run time
        self.timeout = timeout
        self.served = 0
        self.refused = 0
        self._last: dict[ID, float] = {}

    async def _try_dial(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        # The library already dials only addresses on the requester's own IP; a requester
        # could still list many ports of it (a port scan from us) or ask in a loop.
        now = trio.current_time()
        if now - self._last.get(peer_id, -DIAL_BACK_EVERY_S) < DIAL_BACK_EVERY_S:
            self.refused += 1
            return None
        if len(self._last) > 4096:
            self._last = {p: t for p, t in self._last.items() if now - t < DIAL_BACK_EVERY_S}
        self._last[peer_id] = now
        self.served += 1
        network = self.host.get_network()
        for raw_addr in addrs[:DIAL_BACK_MAX_ADDRS]:
            try:
                ma = multiaddr.Multiaddr(raw_addr)
                transport = network.transport_manager.transport_for_dialing(ma)  # type: ignore[attr-defined]
                if transport is None:
                    continue
                with trio.fail_after(self.timeout):
                    raw = await transport.dial(ma)
                    try:
                        secured = await network.upgrader.upgrade_security(raw, True, peer_id)  # type: ignore[attr-defined]
                    except BaseException:
                        with trio.CancelScope(shield=True):
                            with trio.move_on_after(1):
                                await raw.close()
                        raise
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(1):
                        await secured.close()
                return bytes(raw_addr)
            except Exception as exc:
                log.debug("dial-back to %s at %r failed: %s", peer_id, raw_addr, exc)
        return None


class LimitedRelay(CircuitV2Protocol):
    """The library's relay (hop + stop), with a per-circuit bandwidth cap and a byte count.

    ``serving`` is switched on only while this node is public: a NAT'd node's reservations
    would be useless to others. The library enforces duration and byte limits per circuit;
    the bandwidth cap sleeps after each relayed read so each direction of a circuit moves
    at most ``rate_bytes_s``.
    """

    def __init__(self, host: IHost, limits: RelayLimits, *, allow_hop: bool, rate_bytes_s: float) -> None:
        super().__init__(host, limits=limits, allow_hop=allow_hop)
        self.serving = False
        self.rate_bytes_s = rate_bytes_s
        self.bytes_relayed = 0
        self.reservations_refused = 0
        self.reservations_freed = 0  # slots of disconnected peers given to newcomers
        self.foreign_names_cleared = 0  # reservation requests naming a peer other than the asker
        # Circuits one dialer holds open to one reserved peer: a quarter of the reservation's
        # ``max_circuit_conns``, so one dialer cannot hold every circuit to a NAT'd peer.
        self.max_circuits_per_dialer = max(1, limits.max_circuit_conns // 4)
        self._circuits: dict[tuple[str, bytes], int] = {}
        self.circuits_refused = 0

    async def _read_stream_with_retry(self, stream: INetStream, max_retries: int = 3) -> bytes | None:
        data = await super()._read_stream_with_retry(stream, max_retries)
        if data:
            self.bytes_relayed += len(data)
            if self.rate_bytes_s > 0:
                await trio.sleep(len(data) / self.rate_bytes_s)
        return data

    async def _handle_reserve(self, stream: INetStream, msg: Any) -> None:
        """A reservation is for the peer that asks, one per peer, while it stays connected.

        py-libp2p 0.8.1 reserves for whatever peer id the request's optional ``peer`` field
        names, so one connection could take every slot under fresh names: the field is
        cleared, and the library falls back to the connection's authenticated peer. When the
        table is full, slots of peers no longer connected (a reservation is useless without
        its connection, but the library keeps it for its whole TTL) are freed first.
        """
        if not self.serving:
            self.reservations_refused += 1
            await self._send_status(stream, StatusCode.RESERVATION_REFUSED, "not serving as a relay (not public)")
            return
        with contextlib.suppress(Exception):
            if msg.HasField("peer"):
                if msg.peer.id != stream.muxed_conn.peer_id.to_bytes():
                    self.foreign_names_cleared += 1
                msg.ClearField("peer")
        self._free_slots_of_gone_peers()
        await super()._handle_reserve(stream, msg)

    async def _handle_connect(self, stream: INetStream, msg: Any) -> None:
        """The library's CONNECT (it returns when the circuit ends), with a cap per dialer and
        destination: the reservation's circuits are shared by every peer that dials it."""
        try:
            key = (stream.muxed_conn.peer_id.to_base58(), bytes(msg.peer.id))
        except Exception:
            await super()._handle_connect(stream, msg)
            return
        if self._circuits.get(key, 0) >= self.max_circuits_per_dialer:
            self.circuits_refused += 1
            await self._send_status(
                stream, StatusCode.RESOURCE_LIMIT_EXCEEDED, "too many circuits from you to this peer"
            )
            await trio.sleep(0.5)  # as the library does: let the status reach the dialer first
            with contextlib.suppress(Exception):
                await stream.reset()
            return
        self._circuits[key] = self._circuits.get(key, 0) + 1
        try:
            await super()._handle_connect(stream, msg)
        finally:
            left = self._circuits.get(key, 1) - 1
            if left > 0:
                self._circuits[key] = left
            else:
                self._circuits.pop(key, None)

    def _free_slots_of_gone_peers(self) -> None:
        table = getattr(self.resource_manager, "_reservations", None)
        if not isinstance(table, dict) or len(table) < self.resource_manager.limits.max_reservations:
            return
        network = self.host.get_network()
        for pid in list(table):
            if not network.get_connections(pid):
                del table[pid]
                self.reservations_freed += 1

    def reservations(self) -> int:
        return len(getattr(self.resource_manager, "_reservations", {}) or {})


class _ConnWatch(INotifee):
    """Network events :class:`NatService` keeps its own records from (see there)."""

    def __init__(self, service: NatService) -> None:
        self.service = service

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        self.service._stream_closed(stream)

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self.service._note_upgrade(conn.muxed_conn.peer_id)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self.service._conn_closed(conn)

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        pass


class NatService:
    """Reachability of one node, its relay reservations, and the relay it serves.

    ``reachability``: ``unknown`` -> ``public`` or ``private`` (AutoNAT verdicts, or forced
    by ``NatConfig.mode``). A private node holds reservations on up to ``config.relays``
    public peers and :meth:`advertised` returns its circuit addresses instead of its own.
    """

    def __init__(
        self,
        host: IHost,
        config: NatConfig,
        *,
        my_addrs: Callable[[], list[str]],
        bootstrap_ids: Callable[[], list[str]] = lambda: [],
    ) -> None:
        if config.mode not in ("auto", PUBLIC, PRIVATE):
            raise ValueError(f"nat mode {config.mode!r}: expected auto, public or private")
        self.host = host
        self.config = config
        self.my_addrs = my_addrs
        self.bootstrap_ids = bootstrap_ids
        self.reachability = config.mode if config.mode != "auto" else UNKNOWN
        self.verdicts: dict[str, str] = {}  # server peer id -> ok / refused / error
        self.checked_at = 0.0
        self.misses = 0  # checks in a row without a successful dial-back
        self.relays: dict[str, list[str]] = {}  # relay peer id -> our circuit addrs through it
        self.relay_errors: dict[str, str] = {}
        self._relay_retry_at: dict[str, float] = {}
        self._reserving: set[str] = set()  # relays a reservation request is under way with
        limits = RelayLimits(
            duration=config.circuit_max_s,
            data=config.circuit_max_bytes,
            max_circuit_conns=config.max_circuits_per_peer,
            max_reservations=config.max_reservations,
            reservation_ttl=config.reservation_ttl_s,
        )
        self.relay = LimitedRelay(
            host, limits, allow_hop=config.relay_service, rate_bytes_s=config.circuit_rate_bytes_s
        )
        # Dialling only (our own loop makes the reservations): the STOP role lets the
        # transport accept circuits, no CLIENT role so a dial does not reserve on the way.
        self.transport = CircuitV2Transport(host, self.relay, RelayConfig(roles=RelayRole.STOP, limits=limits))
        self.autonat = DialBackAutoNAT(host, timeout=config.dial_back_timeout_s)
        self.dcutr = _OrderedDCUtR(host, config.hole_punch_defer_s) if config.hole_punch else None
        self.relay_dials = {"ok": 0, "failed": 0}
        # Peers whose relayed connection was joined by a direct one (a hole punch, or the
        # NAT'd side dialling a public peer). Kept here, not read from DCUtR: the library
        # records only the side whose own dial completed (in a simultaneous open the other
        # side's listener may accept instead), and forgets the peer when *any* connection
        # to it closes, which happens at once when the relayed leg is trimmed.
        self._upgraded: set[str] = set()
        # Streams that ran over relayed connections, by protocol (closed ones: a finished
        # request/response, a gossip stream that ended). Proves what crossed relays.
        self.relayed_streams: dict[str, int] = {}
        self._watch = _ConnWatch(self)
        self._nursery: trio.Nursery | None = None

    # ------------------------------------------------------------------ queries
    @property
    def behind_nat(self) -> bool:
        return self.reachability == PRIVATE

    def advertised(self, direct: list[str]) -> list[str]:
        """The addresses to give peers: circuit addresses while private (own ones are useless)."""
        if self.behind_nat:
            return [a for addrs in self.relays.values() for a in addrs]
        return direct

    def holds_reservation(self, peer_id: str) -> bool:
        """Whether we hold (or are asking for) a relay slot on ``peer_id``. The connection
        manager keeps such a peer although it speaks no primenode gossip: a generic libp2p
        relay never will, and closing the connection would end the reservation."""
        return peer_id in self.relays or peer_id in self._reserving

    def relayed_peers(self) -> list[str]:
        """Peers whose every connection to us runs over a relay."""
        out = []
        for pid, conns in self.host.get_network().connections.items():
            conns = conns if isinstance(conns, list) else [conns]
            if conns and all(conn_is_relayed(c) for c in conns):
                out.append(pid.to_base58())
        return out

    def hole_punched(self) -> list[str]:
        """Peers we now reach directly after a relayed connection (DCUtR's upgrade)."""
        if self.dcutr is None:
            return []
        peers = self._upgraded | {p.to_base58() for p in self.dcutr._direct_connections}
        return sorted(p for p in peers if self._has_direct(ID.from_base58(p)))

    def _conns(self, pid: ID) -> list[Any]:
        conns = self.host.get_network().connections.get(pid) or []
        return conns if isinstance(conns, list) else [conns]

    def _has_direct(self, pid: ID) -> bool:
        return any(not conn_is_relayed(c) and not getattr(c, "is_closed", False) for c in self._conns(pid))

    def _note_upgrade(self, pid: ID) -> None:
        """A peer holding a relayed and a direct connection at once has been upgraded."""
        conns = self._conns(pid)
        if any(conn_is_relayed(c) for c in conns) and self._has_direct(pid):
            self._upgraded.add(pid.to_base58())

    def _conn_closed(self, conn: Any) -> None:
        pid = conn.muxed_conn.peer_id
        if conn_is_relayed(conn) and self._has_direct(pid):
            self._upgraded.add(pid.to_base58())  # the relayed leg went, the direct one stays
        elif not self._has_direct(pid):
            self._upgraded.discard(pid.to_base58())

    def _stream_closed(self, stream: Any) -> None:
        conn = getattr(stream, "swarm_conn", None)
        if conn is not None and conn_is_relayed(conn):
            proto = str(stream.get_protocol() or "unnegotiated")
            self.relayed_streams[proto] = self.relayed_streams.get(proto, 0) + 1

    def summary(self) -> str:
        """One line for ``primenode status``."""
        if self.reachability == PUBLIC:
            text = "public (peers dialled us back)"
            if self.config.mode == PUBLIC:
                text = "public (forced)"
            if self.relay.serving:
                text += f"; relay for {self.relay.reservations()} NAT'd peer(s)"
            return text
        if self.reachability == PRIVATE:
            if self.relays:
                text = "behind NAT via relay " + ", ".join(sorted(self.relays))
            else:
                text = "behind NAT, no relay yet (reachable only over connections it opens)"
            punched = self.hole_punched()
            if punched:
                text += f"; direct after hole punch with {len(punched)} peer(s)"
            return text
        return "unknown (not checked yet)"

    def status(self) -> dict[str, Any]:
        return {
            "reachability": self.reachability,
            "summary": self.summary(),
            "mode": self.config.mode,
            "verdicts": dict(self.verdicts),
            "misses": self.misses,
            "checked_s_ago": round(trio.current_time() - self.checked_at, 1) if self.checked_at else None,
            "relays": {k: list(v) for k, v in self.relays.items()},
            "relay_errors": dict(self.relay_errors),
            "relayed_peers": self.relayed_peers(),
            "hole_punched": self.hole_punched(),
            "relay_dials": dict(self.relay_dials),
            "relayed_streams": dict(self.relayed_streams),
            "relay_service": {
                "serving": self.relay.serving,
                "reservations": self.relay.reservations(),
                "bytes_relayed": self.relay.bytes_relayed,
                "refused": self.relay.reservations_refused,
            },
            "dial_backs_served": self.autonat.served,
        }

    # ------------------------------------------------------------------ dialling
    async def dial_via_relay(self, peer_id: str, addrs: list[str]) -> None:
        """Open a relayed connection to ``peer_id`` through one of its circuit addresses.

        The caller's deadline is shared out between the addresses still to try: a relay that
        swallows the dial (one behind a NAT that wrongly thinks itself public, one that went
        away) costs its share, not the whole budget, so the next relay still gets a turn.
        """
        circuits = [a for a in addrs if is_circuit(a)]
        errors = []
        for i, a in enumerate(circuits):
            text = a if a.endswith(f"/p2p/{peer_id}") else f"{a}/p2p/{peer_id}"
            left = trio.current_effective_deadline() - trio.current_time()
            share = left / (len(circuits) - i) if left != float("inf") else RELAY_DIAL_S
            try:
                ma = multiaddr.Multiaddr(text)
                with trio.fail_after(max(share, 0.0)):
                    conn = await self.transport.dial(ma)
                self.relay_dials["ok"] += 1
                if not conn_is_relayed(conn):  # the outbound upgrade path leaves it untagged
                    with contextlib.suppress(Exception):
                        conn.set_transport_info([ma], ConnectionType.RELAYED)  # type: ignore[attr-defined]
                return
            except trio.TooSlowError:
                errors.append(f"{a}: no answer within {share:.1f} s")
            except Exception as exc:
                errors.append(f"{a}: {type(exc).__name__}: {exc}")
        self.relay_dials["failed"] += 1
        raise ConnectionError("no relay reached " + peer_id + ("; " + "; ".join(errors) if errors else ""))

    async def ensure_connected(self, peer_id: str) -> None:
        """Before a request: if we hold no connection to ``peer_id`` and know it only by circuit
        addresses (a NAT'd peer), connect through its relay. Errors are left to the caller's
        own dial (which then reports the peer unreachable)."""
        pid = ID.from_base58(peer_id)
        if self.host.get_network().get_connections(pid):
            return
        try:
            addrs = [str(a) for a in self.host.get_peerstore().addrs(pid)]
        except Exception:
            return
        circuits = [a for a in addrs if is_circuit(a)]
        if circuits:
            with contextlib.suppress(Exception):
                await self.dial_via_relay(peer_id, circuits)

    # ------------------------------------------------------------------ loop
    def _direct_peers(self) -> list[str]:
        """Connected peers over a direct (not relayed) connection, bootstrap first."""
        out = []
        for pid, conns in self.host.get_network().connections.items():
            conns = conns if isinstance(conns, list) else [conns]
            if any(not conn_is_relayed(c) and not getattr(c, "is_closed", False) for c in conns):
                out.append(pid.to_base58())
        boot = set(self.bootstrap_ids())
        out.sort(key=lambda p: p not in boot)
        return out

    async def _ask(self, server: str, addrs: list[bytes], verdicts: dict[str, str]) -> None:
        try:
            status, _ = await self.autonat.query_server(
                ID.from_base58(server), addrs, timeout=self.config.dial_back_timeout_s * 3
            )
        except Exception as exc:  # no AutoNAT there, or the peer went away: no verdict
            log.debug("AutoNAT query to %s failed: %s", server, exc)
            return
        if status == int(AutoNATMessage.OK):
            verdicts[server] = "ok"
        elif status == int(AutoNATMessage.E_DIAL_REFUSED):
            verdicts[server] = "refused"
        else:
            verdicts[server] = "failed"

    async def check(self) -> str:
        """Ask up to four directly connected peers to dial us back; update ``reachability``.

        Any success means reachable (the dial-back authenticated us on a fresh connection);
        only verdicts (no success) mean private (for a public node: ``demote_after`` rounds in
        a row, see :func:`next_reachability`); no verdict at all leaves it unchanged.
        """
        if self.config.mode != "auto":
            return self.reachability
        direct = [a for a in self.my_addrs() if not is_circuit(a)]
        addrs = []
        for a in direct:
            with contextlib.suppress(Exception):
                addrs.append(multiaddr.Multiaddr(a).to_bytes())
        servers = self._direct_peers()[:4]
        verdicts: dict[str, str] = {}
        async with trio.open_nursery() as nursery:
            for s in servers:
                nursery.start_soon(self._ask, s, addrs, verdicts)
        if verdicts:
            self.verdicts = verdicts
        self.checked_at = trio.current_time()
        before = self.reachability
        self.reachability, self.misses = next_reachability(before, verdicts, self.misses, self.config.demote_after)
        if self.reachability != before:
            log.info("reachability: %s -> %s (%s)", before, self.reachability, verdicts)
        return self.reachability

    async def ensure_relays(self) -> None:
        """While private: keep reservations on up to ``config.relays`` directly connected peers."""
        direct = set(self._direct_peers())
        for rid in list(self.relays):
            if rid not in direct:  # the connection to the relay is gone: so is the reservation
                del self.relays[rid]
        if len(self.relays) >= self.config.relays or self._nursery is None:
            return
        for rid in self._direct_peers():
            if len(self.relays) >= self.config.relays:
                break
            if rid in self.relays or self._relay_retry_at.get(rid, 0.0) > trio.current_time():
                continue
            self._reserving.add(rid)
            try:
                addrs = await self._reserve(rid)
            finally:
                self._reserving.discard(rid)
            if not addrs:
                self._relay_retry_at[rid] = trio.current_time() + RELAY_RETRY_S
            if addrs:
                self.relays[rid] = addrs
                self.relay_errors.pop(rid, None)
                log.info("reserved a relay slot on %s: reachable at %s", rid, addrs[0])

    async def _reserve(self, rid: str) -> list[str]:
        pid = ID.from_base58(rid)
        stream = None
        try:
            with trio.fail_after(10):
                stream = await self.host.new_stream(pid, [HOP_PROTOCOL_ID])
                assert self._nursery is not None
                ok = await self.transport.reserve(stream, pid, self._nursery)
        except Exception as exc:
            self.relay_errors[rid] = f"{type(exc).__name__}: {exc}"
            return []
        finally:
            if stream is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    with contextlib.suppress(Exception):
                        await stream.close()
        if not ok:
            self.relay_errors[rid] = "reservation refused"
            return []
        out = []
        for conn in self.host.get_network().get_connections(pid):
            if conn_is_relayed(conn):
                continue
            for a in conn.get_transport_addresses() or []:
                text = str(a).split("/p2p/")[0]
                out.append(f"{text}/p2p/{rid}{CIRCUIT}")
        return out

    @contextlib.asynccontextmanager
    async def _services(self) -> AsyncIterator[None]:
        async with background_trio_service(self.relay):
            await self.relay.event_started.wait()
            if self.dcutr is None:
                yield
                return
            async with background_trio_service(self.dcutr), trio.open_nursery() as nursery:
                await self.dcutr.event_started.wait()
                nursery.start_soon(self._renew_hole_punch_budget)
                yield
                nursery.cancel_scope.cancel()

    async def _renew_hole_punch_budget(self) -> None:
        """Give relayed peers fresh DCUtR attempts every ``hole_punch_retry_s`` (the library's
        own loop then tries again; it skips peers already direct or in a session)."""
        assert self.dcutr is not None
        while True:
            await trio.sleep(self.config.hole_punch_retry_s)
            attempts: dict[Any, int] = self.dcutr._hole_punch_attempts
            for peer in list(attempts):
                if peer not in self.dcutr._direct_connections:
                    attempts.pop(peer, None)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        network = self.host.get_network()
        network.register_notifee(self._watch)
        try:
            await self._run(task_status)
        finally:
            network.remove_notifee(self._watch)

    async def _run(self, task_status: Any) -> None:
        cfg = self.config
        async with self._services(), trio.open_nursery() as nursery:
            self._nursery = nursery
            self.relay.serving = cfg.relay_service and self.reachability == PUBLIC
            task_status.started()
            await trio.sleep(cfg.first_check_s)
            next_check = 0.0
            while True:
                now = trio.current_time()
                if now >= next_check:
                    await self.check()
                    in_doubt = self.reachability == UNKNOWN or (self.reachability == PUBLIC and self.misses > 0)
                    next_check = now + (cfg.first_check_s if in_doubt else cfg.check_interval_s)
                self.relay.serving = cfg.relay_service and self.reachability == PUBLIC
                if self.reachability == PRIVATE:
                    await self.ensure_relays()
                await trio.sleep(cfg.first_check_s)
