"""Connection manager and peer exchange.

Keeps ``target_peers`` connections to distinct peers: dials peers from an
address book (fed by bootstrap addresses, heartbeats and our peer-exchange
protocol), replaces lost ones, backs off on failures (exponential, capped),
never dials or keeps a banned peer, and asks connected peers for more
addresses: every new connection at once, then the least recently asked peers
every ``px_interval`` seconds. Each exchange's round trip is the peer's
latency (``latency_ms``), so every connected peer has one within a loop
interval or two of connecting.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from node.errors import NetworkError
from node.p2p.connlimits import peer_ip
from node.p2p.host import is_circuit, parse_peer_addr, peer_info, strip_peer_id
from node.p2p.metrics import NodeMetrics
from node.p2p.reqresp import ReqResp, RequestError
from node.p2p.standing import PeerStanding
from node.p2p.swarm import PeerState, SwarmView
from protocol import Envelope, PeerAddr, PeerExchangeRequest, PeerExchangeResponse

PX_PEERS_PER_ROUND = 2
PX_TIMEOUT_S = 5.0
LATENCY_EWMA = 0.3  # weight of a new round trip in latency_ms

log = logging.getLogger(__name__)

# circuit relay v2's hop protocol (the relay side); a foreign bootstrap offering it is kept
RELAY_HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
# A bootstrap that refuses our request protocol is judged (relay kept, or closed and backed
# off) only once identify has listed its protocols, or after this long without them: the
# refusal can arrive first, and closing a generic relay then killed the NAT service's
# reservation in flight (its next try is RELAY_RETRY_S later).
IDENTIFY_WAIT_S = 3.0


class DialError(Exception):
    """One dial failed; the message names the peer, its addresses and the reason. The manager
    retries with back-off, so this is control flow; :meth:`ConnectionManager.connect_bootstrap`
    turns the failure of every bootstrap node into a :class:`NetworkError` for the operator."""


def backoff_delay(fails: int, base: float, cap: float) -> float:
    """Seconds to wait before the next dial of a peer after ``fails`` failures in a row
    (before jitter): ``base``, ``2 base``, ``4 base``... capped at ``cap``."""
    if fails <= 0:
        return 0.0
    return min(cap, base * 2 ** min(fails - 1, 62))


@dataclasses.dataclass
class BookEntry:
    addrs: list[str]
    updated: float
    fails: int = 0
    next_try: float = 0.0
    last_error: str = ""
    # The peer whose peer-exchange answer named this entry; "" once the entry came from the
    # bootstrap list or a heartbeat of the peer itself (its own signed word).
    source: str = ""
    foreign: int = 0  # connections in a row that answered "not primenode" (a bootstrap only)


class ConnectionManager:
    def __init__(
        self,
        host: IHost,
        my_id: str,
        reqresp: ReqResp,
        swarm: SwarmView,
        standing: PeerStanding,
        metrics: NodeMetrics,
        *,
        bootstrap: list[str],
        target_peers: int = 6,
        interval: float = 1.0,
        px_interval: float = 5.0,
        dial_timeout: float = 5.0,
        backoff_base: float = 1.0,
        backoff_max: float = 60.0,
        forget_after: float = 600.0,
        my_addrs: Callable[[], list[str]] = lambda: [],
        has_gossip_stream: Callable[[str], bool] = lambda peer_id: True,
        gossip_grace: float = 5.0,
        keep_without_gossip: Callable[[str], bool] = lambda peer_id: False,
        clock: Callable[[], float] = trio.current_time,
        max_connections: int | None = None,
        probe_interval: float = 30.0,
        learn_from_heartbeats: bool = True,
    ) -> None:
        self.host = host
        self.my_id = my_id
        self.reqresp = reqresp
        self.swarm = swarm
        self.standing = standing
        self.metrics = metrics
        self.target_peers = target_peers
        self.interval = interval
        self.px_interval = px_interval
        self.dial_timeout = dial_timeout
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.forget_after = forget_after
        self.my_addrs = my_addrs
        self.has_gossip_stream = has_gossip_stream
        self.gossip_grace = gossip_grace
        # Peers kept although they carry no gossip: a relay we hold a reservation on (a generic
        # libp2p relay speaks no primenode gossip; dropping it would drop the reservation and,
        # with it, the only address a NAT'd node can advertise). Set by the node from NatService.
        self.keep_without_gossip = keep_without_gossip
        self._kept_as_relay: set[str] = set()  # foreign bootstraps kept as relays (said once each)
        # The manager's one clock (trio's): book ages, dial back-offs, peer-exchange and probe
        # rounds and the gossip watchdog (tests drive it past several grace periods by hand).
        self.clock = clock
        self._no_stream_since: dict[str, float] = {}
        self.dropped_no_gossip = 0
        self.rounds = 0  # loop iterations done (tests wait on it)
        self.book: dict[str, BookEntry] = {}
        self.max_book = 2048  # bounded: heartbeats and peer exchange from free identities feed it
        # Entries one peer's exchange answers may hold: a peer answering with fresh names in a
        # loop (32 per answer) would otherwise fill the book and push out what others told us.
        self.max_book_per_source = 256
        self._by_source: dict[str, int] = {}
        # Inbound connections are accepted by libp2p without limit; beyond this many the
        # newest unprotected ones are closed (protected: bootstrap, and the genesis roles
        # the node puts in ``protected``).
        self.max_connections = max_connections or max(4 * target_peers, 32)
        self.protected: set[str] = set()
        self._conn_since: dict[str, float] = {}
        self.trimmed = 0
        # At target, a node still dials one peer it has an address for but hears nothing
        # from (no heartbeat) every ``probe_interval`` s: after a partition heals, two halves
        # that are each at target would otherwise never reconnect (nobody is below target).
        self.probe_interval = probe_interval
        self.probes = 0
        # False: the address book is fed only by bootstrap addresses and peer exchange
        # (tests use it to show that peer exchange alone finds peers).
        self.learn_from_heartbeats = learn_from_heartbeats
        # Peer-exchange round trip per connected peer (ms, EWMA) and when we last asked it.
        self.latency_ms: dict[str, float] = {}
        self._px_asked: dict[str, float] = {}
        self.bootstrap_ids: list[str] = []
        for text in bootstrap:
            info = parse_peer_addr(text)
            pid = info.peer_id.to_base58()
            if pid == my_id:
                continue
            self.bootstrap_ids.append(pid)
            addr = text.split("/p2p/")[0]
            self._learn(pid, [addr])
        self._dialing: set[str] = set()
        self._nursery: trio.Nursery | None = None
        # Dials a peer known only by relay circuit addresses (a NAT'd peer): py-libp2p's
        # swarm skips /p2p-circuit addresses, the node's NatService opens the circuit.
        self.relay_dialer: Callable[[str, list[str]], Awaitable[None]] | None = None
        reqresp.register(PeerExchangeRequest, self._serve_px)
        swarm.listeners.append(self._on_peer_state)
        standing.ban_listeners.append(self._on_ban)

    # ------------------------------------------------------------- queries
    def connected(self) -> list[str]:
        return [p.to_base58() for p in self.host.get_connected_peers()]

    def peer_addr(self, peer_id: str) -> str | None:
        try:
            conns = self.host.get_network().get_connections(ID.from_base58(peer_id))
        except Exception:
            return None
        for c in conns:
            try:
                addrs = c.get_transport_addresses()
                if addrs:
                    return str(addrs[0])
            except Exception:
                pass
        e = self.book.get(peer_id)
        return e.addrs[0] if e and e.addrs else None

    # ---------------------------------------------------------- learning
    def _learn(self, peer_id: str, addrs: list[str], source: str = "") -> None:
        """Record ``addrs`` for ``peer_id``; ``source``: the peer whose exchange answer said so
        ("" for the bootstrap list and heartbeats)."""
        if peer_id == self.my_id or not addrs:
            return
        addrs = [strip_peer_id(a) for a in addrs][:8]
        e = self.book.get(peer_id)
        if e is None:
            if source and self._by_source.get(source, 0) >= self.max_book_per_source:
                return
            if len(self.book) >= self.max_book:
                self._trim_book()
                if len(self.book) >= self.max_book:
                    return
            self.book[peer_id] = BookEntry(list(addrs), self.clock(), source=source)
            if source:
                self._by_source[source] = self._by_source.get(source, 0) + 1
        else:
            if source and e.source != source and e.fails == 0:
                # Another peer's word does not move a working entry (a hostile answer could
                # otherwise point an honest peer's entry anywhere); a failing one it may repair.
                return
            if e.addrs != addrs:
                e.addrs = list(addrs)
            e.updated = self.clock()
            if not source and e.source:
                self._release_source(e)  # the peer's own heartbeat or the bootstrap list: ours now

    def _release_source(self, e: BookEntry) -> None:
        left = self._by_source.get(e.source, 0) - 1
        if left > 0:
            self._by_source[e.source] = left
        else:
            self._by_source.pop(e.source, None)
        e.source = ""

    def _forget(self, peer_id: str) -> None:
        e = self.book.pop(peer_id, None)
        if e is not None and e.source:
            self._release_source(e)

    def _relay_only(self, peer_id: str) -> bool:
        e = self.book.get(peer_id)
        return e is not None and bool(e.addrs) and all(is_circuit(a) for a in e.addrs)

    def _trim_book(self) -> None:
        """Make room: forget failing entries first, then the least recently refreshed quarter
        (never bootstrap or connected peers)."""
        keep = set(self.bootstrap_ids) | set(self.connected())
        cands = [p for p in self.book if p not in keep]
        cands.sort(key=lambda p: (-self.book[p].fails, self.book[p].updated))
        for pid in cands[: max(1, len(self.book) // 4)]:
            self._forget(pid)

    def _on_peer_state(self, st: PeerState) -> None:
        e = self.book.get(st.peer_id)
        if self.learn_from_heartbeats:
            self._learn(st.peer_id, list(st.heartbeat.addrs))
        if e is not None and e.fails:
            # a fresh heartbeat means it is alive: allow a sooner retry
            e.next_try = min(e.next_try, self.clock() + self.backoff_base)

    def _serve_px(self, env: Envelope, peer: str) -> PeerExchangeResponse:
        live = self.swarm.peers()
        cands: list[PeerAddr] = []
        mine = self.my_addrs()
        if mine:
            cands.append(PeerAddr(peer_id=self.my_id, addrs=tuple(mine[:8])))
        order = list(live.items())
        random.shuffle(order)
        for pid, st in order:
            if pid == peer or self.standing.is_banned(pid) or not st.heartbeat.addrs:
                continue
            cands.append(PeerAddr(peer_id=pid, addrs=tuple(st.heartbeat.addrs[:8])))
        return PeerExchangeResponse(peers=tuple(cands[: env.body.max_peers]))

    def _on_ban(self, peer_id: str, reason: str) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(self._disconnect, peer_id)

    async def _disconnect(self, peer_id: str) -> None:
        with trio.move_on_after(5):
            try:
                await self.host.disconnect(ID.from_base58(peer_id))
            except Exception:
                log.debug("disconnect %s failed", peer_id, exc_info=True)

    # ------------------------------------------------------------- dialing
    async def dial(self, peer_id: str) -> None:
        """Dial one peer from the book; raises DialError with the reason on failure."""
        e = self.book.get(peer_id)
        if e is None:
            raise DialError(f"no address known for {peer_id}")
        if not self.standing.reachable(peer_id):  # fault layer (tests): fails like a dead link
            self._failed(peer_id, "link cut (fault layer)")
            raise DialError(f"{peer_id} at {', '.join(e.addrs)}: unreachable (link cut by the fault layer)")
        self._dialing.add(peer_id)
        try:
            with trio.fail_after(self.dial_timeout):
                if self.relay_dialer is not None and all(is_circuit(a) for a in e.addrs):
                    await self.relay_dialer(peer_id, e.addrs)
                else:
                    await self.host.connect(peer_info(peer_id, [a for a in e.addrs if not is_circuit(a)]))
        except trio.TooSlowError:
            self._failed(peer_id, f"no answer within {self.dial_timeout:g} s")
            raise DialError(f"{peer_id} at {', '.join(e.addrs)}: no answer within {self.dial_timeout:g} s") from None
        except Exception as exc:
            self._failed(peer_id, f"{type(exc).__name__}: {exc}")
            raise DialError(f"{peer_id} at {', '.join(e.addrs)}: {type(exc).__name__}: {exc}") from None
        finally:
            self._dialing.discard(peer_id)
        e.fails, e.next_try, e.last_error = 0, 0.0, ""
        self.metrics.dials.labels("ok").inc()

    def _failed(self, peer_id: str, why: str) -> None:
        self.metrics.dials.labels("failed").inc()
        e = self.book.get(peer_id)
        if e is None:
            return
        e.fails += 1
        e.last_error = why
        delay = backoff_delay(e.fails, self.backoff_base, self.backoff_max)
        e.next_try = self.clock() + delay * random.uniform(0.8, 1.2)

    def _trim_connections(self, live: set[str], nursery: trio.Nursery, now: float) -> set[str]:
        for pid in live:
            self._conn_since.setdefault(pid, now)
        for pid in list(self._conn_since):
            if pid not in live:
                del self._conn_since[pid]
        excess = len(live) - self.max_connections
        if excess <= 0:
            return set()
        keep = set(self.bootstrap_ids) | self.protected | {p for p in live if self.keep_without_gossip(p)}
        # Newest first, but from the busiest IP address first: one host holding many identities
        # cannot push everyone else's (newer) connections out of the table.
        ips = {p: peer_ip(self.host, p) for p in live if p not in keep}
        per_ip = Counter(ip for ip in ips.values() if ip is not None)
        order = sorted(ips, key=lambda p: (per_ip.get(ips[p] or "", 1), self._conn_since[p]), reverse=True)
        drop = set(order[:excess])
        for pid in drop:
            self.trimmed += 1
            self.metrics.dials.labels("trimmed").inc()
            nursery.start_soon(self._disconnect, pid)
        return drop

    def check_gossip_grace(self, live: set[str]) -> list[str]:
        """The connected peers to drop because gossip cannot flow to them: no gossip stream for
        ``gossip_grace`` seconds (by :attr:`clock`).

        Two kinds of peer end up here: a primenode peer whose stream py-libp2p lost when it
        trimmed a duplicate connection (dropping it makes a fresh connection), and a peer that
        does not speak primenode gossip at all (a generic libp2p node: it would hold a
        connection slot and give us nothing). Each drop is one INFO line with the reason. A peer
        in :attr:`keep_without_gossip` (a relay we hold a reservation on) is never dropped here:
        its connection *is* the reservation.
        """
        now = self.clock()
        drop = []
        for pid in live:
            if self.has_gossip_stream(pid) or self.keep_without_gossip(pid):
                self._no_stream_since.pop(pid, None)
            elif now - self._no_stream_since.setdefault(pid, now) > self.gossip_grace:
                self._no_stream_since.pop(pid, None)
                self.dropped_no_gossip += 1
                self.metrics.dials.labels("dropped_no_gossip").inc()
                log.info("dropping %s: %s", pid, self._no_gossip_reason(pid))
                drop.append(pid)
        for pid in list(self._no_stream_since):
            if pid not in live:
                del self._no_stream_since[pid]
        return drop

    def _no_gossip_reason(self, peer_id: str) -> str:
        """Why a peer carries no gossip, in words: what identify says it offers, if it said."""
        grace = f"no primenode gossip stream after {self.gossip_grace:g} s"
        try:
            protos = [str(p) for p in self.host.get_peerstore().get_protocols(ID.from_base58(peer_id))]
        except Exception:
            protos = []
        if not protos:
            return grace
        if any(p.startswith("/primenode/") for p in protos):
            return grace + " (a primenode peer: a fresh connection will be made)"
        return grace + " (not a primenode node: it offers only " + ", ".join(sorted(protos)[:6]) + ")"

    async def _try_dial(self, peer_id: str) -> None:
        try:
            await self.dial(peer_id)
        except DialError as exc:
            log.debug("dial failed: %s", exc)

    async def connect_bootstrap(self, attempts: int = 3) -> None:
        """Dial the bootstrap nodes; NetworkError naming each failure if none answers."""
        if not self.bootstrap_ids:
            return
        errors: dict[str, str] = {}
        for attempt in range(attempts):
            for pid in self.bootstrap_ids:
                try:
                    await self.dial(pid)
                    return
                except DialError as exc:
                    errors[pid] = str(exc)
            if attempt + 1 < attempts:
                await trio.sleep(self.backoff_base * 2**attempt)
        raise NetworkError(
            "cannot reach any bootstrap node ("
            + "; ".join(errors.values())
            + "): is it running, and is the address right?"
        )

    async def exchange(self, peer_id: str, max_peers: int = 32) -> int:
        """Ask ``peer_id`` for peer addresses; returns how many were new. The round trip
        (a small signed request and answer) updates ``latency_ms[peer_id]``."""
        self._px_asked[peer_id] = self.clock()
        t0 = trio.current_time()  # a round trip: measured on trio's clock, never a test's
        env = await self.reqresp.request(
            peer_id, PeerExchangeRequest(max_peers=max_peers), PeerExchangeResponse, timeout=PX_TIMEOUT_S
        )
        rtt = (trio.current_time() - t0) * 1000
        prev = self.latency_ms.get(peer_id)
        self.latency_ms[peer_id] = rtt if prev is None else (1 - LATENCY_EWMA) * prev + LATENCY_EWMA * rtt
        new = 0
        for pa in env.body.peers:
            if pa.peer_id not in self.book and pa.peer_id != self.my_id:
                new += 1
            self._learn(pa.peer_id, list(pa.addrs), source=peer_id)
        return new

    async def _px_one(self, peer_id: str) -> None:
        try:
            await self.exchange(peer_id)
        except RequestError as exc:
            if exc.code == "unsupported" and peer_id in self.bootstrap_ids:
                await self._foreign_bootstrap(peer_id, exc.detail)
            else:
                log.debug("peer exchange with %s failed: %s", peer_id, exc)
        else:
            e = self.book.get(peer_id)
            if e is not None:
                e.foreign = 0

    def _protocols(self, peer_id: str) -> list[str]:
        """The protocols identify listed for ``peer_id`` (empty until identify has answered)."""
        try:
            return [str(p) for p in self.host.get_peerstore().get_protocols(ID.from_base58(peer_id))]
        except Exception:
            return []

    def _offers_relay(self, peer_id: str) -> bool:
        """Whether identify lists the circuit relay v2 hop protocol for ``peer_id``."""
        return RELAY_HOP_PROTOCOL in self._protocols(peer_id)

    async def _identified(self, peer_id: str) -> None:
        """Until identify has listed ``peer_id``'s protocols, at most ``IDENTIFY_WAIT_S``
        (py-libp2p's identify sets no event to wait on: a short poll on trio's clock)."""
        with trio.move_on_after(IDENTIFY_WAIT_S):
            while not self._protocols(peer_id):  # noqa: ASYNC110 (no event to wait on: the docstring)
                await trio.sleep(0.05)

    async def _foreign_bootstrap(self, peer_id: str, detail: str) -> None:
        """A bootstrap address that leads to a libp2p node which is not primenode (a wrong
        address, a generic relay): say so in one line, close the connection and dial it again
        only after an exponential back-off (capped), instead of redialling it every few seconds
        as a peer that merely lost its gossip stream."""
        await self._identified(peer_id)
        if self.keep_without_gossip(peer_id) or self._offers_relay(peer_id):
            # A generic libp2p relay given as a bootstrap is still worth a reservation (a NAT'd
            # node's only way in); closing the connection would end it. Said once, kept.
            if peer_id not in self._kept_as_relay:
                self._kept_as_relay.add(peer_id)
                log.info("bootstrap %s; kept as a relay only", detail)
            return
        e = self.book.get(peer_id)
        if e is not None and e.next_try <= self.clock():  # once per connection (px may be asked twice)
            e.foreign += 1
            delay = backoff_delay(e.foreign, max(self.backoff_base, 1.0), self.backoff_max)
            e.next_try = self.clock() + delay
            log.warning("bootstrap %s; next try in %.0f s", detail, delay)
        await self._disconnect(peer_id)

    # ---------------------------------------------------------------- loop
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            last_px = 0.0
            last_probe = self.clock()
            while True:
                now = self.clock()
                connected = set(self.connected())
                for pid in connected:
                    if self.standing.refuses(pid):  # banned, or cut by the fault layer
                        nursery.start_soon(self._disconnect, pid)
                live = {p for p in connected if not self.standing.refuses(p)}
                live -= self._trim_connections(live, nursery, now)
                self.metrics.peers_connected.set(len(live))
                need = self.target_peers - len(live) - len(self._dialing)
                if need > 0:
                    cands = [
                        pid
                        for pid, e in self.book.items()
                        if pid not in connected
                        and pid not in self._dialing
                        and not self.standing.is_banned(pid)
                        and e.next_try <= now
                    ]
                    random.shuffle(cands)
                    # Prefer non-bootstrap peers (the bootstrap must not be everyone's
                    # only link), then peers with a higher id than ours: two peers
                    # dialling each other at once end up with two connections, and
                    # py-libp2p later trims one, which can orphan the pubsub stream.
                    # Peers reachable only through a relay come last (they take relay capacity).
                    cands.sort(key=lambda p: (self._relay_only(p), p in self.bootstrap_ids, p < self.my_id))
                    for pid in cands[:need]:
                        nursery.start_soon(self._try_dial, pid)
                elif self.probe_interval > 0 and now - last_probe >= self.probe_interval:
                    last_probe = now
                    unheard = [
                        pid
                        for pid, e in self.book.items()
                        if pid not in connected
                        and pid not in self._dialing
                        and e.next_try <= now
                        and not self.standing.is_banned(pid)
                        and not self.swarm.knows(pid)
                    ]
                    if unheard:
                        self.probes += 1
                        self.metrics.dials.labels("probe").inc()
                        nursery.start_soon(self._try_dial, random.choice(unheard))
                # A new connection (either direction) is asked at once: its addresses, and a
                # first latency measurement for status.
                for pid in live:
                    if pid not in self._px_asked:
                        self._px_asked[pid] = now
                        nursery.start_soon(self._px_one, pid)
                if live and (now - last_px >= self.px_interval or (need > 0 and now - last_px >= self.interval * 2)):
                    last_px = now
                    # Below target: ask everyone (we need addresses now). Otherwise the two
                    # peers asked longest ago: heartbeats already carry addresses, an exchange
                    # with every peer every round cost 20 nodes ~0.4 CPU-s/s (bench/gossip.py),
                    # and taking turns keeps every peer's latency fresh.
                    if need > 0:
                        ask = sorted(live)
                    else:
                        order = sorted(live, key=lambda p: (self._px_asked.get(p, 0.0), random.random()))
                        ask = order[:PX_PEERS_PER_ROUND]
                    for pid in ask:
                        nursery.start_soon(self._px_one, pid)
                for gone in (set(self._px_asked) | set(self.latency_ms)) - live:
                    self._px_asked.pop(gone, None)
                    self.latency_ms.pop(gone, None)
                for pid in self.check_gossip_grace(live):
                    nursery.start_soon(self._disconnect, pid)
                # forget long-dead, never-reached entries (not bootstrap)
                for pid, e in list(self.book.items()):
                    if pid not in self.bootstrap_ids and e.fails >= 8 and now - e.updated > self.forget_after:
                        self._forget(pid)
                self.rounds += 1
                await trio.sleep(self.interval)
