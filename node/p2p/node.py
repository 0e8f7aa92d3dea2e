"""A running primenode: host + gossip + request/response + connections + swarm view.

Roles plug in through :class:`RoleHook` (see ``docs/operating.md``)::

    class MyRole(RoleHook):
        role = "worker"
        async def run(self, node): ...          # lives as long as the node
        def heartbeat_fields(self): return {"policy_version": 3, "have": (...), "data_port": 9000}
        def status(self): return {...}          # shown under "role_state" in status

The node publishes heartbeats, serves ``GenesisRequest`` (when it holds the
genesis) and ``PeerExchangeRequest``, and exposes ``node.gossip``,
``node.reqresp``, ``node.swarm``, ``node.conns`` and ``node.standing``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import trio
from libp2p.abc import IHost

from node.errors import ConfigError, NetworkError
from node.p2p.clock import ClockSkew
from node.p2p.connlimits import connection_stats, register_connection_metrics, trio_task_count
from node.p2p.connmgr import ConnectionManager
from node.p2p.gossip import Gossip
from node.p2p.host import closing_host, full_addrs, listen_addrs, make_host, peer_ips
from node.p2p.metrics import NodeMetrics
from node.p2p.nat import NatConfig, NatService
from node.p2p.reqresp import ReqResp, RequestError
from node.p2p.services import NodeServices, RunningNode
from node.p2p.standing import PeerStanding
from node.p2p.swarm import SwarmView
from node.util import now_ms
from protocol import (
    ZERO_RUN_ID,
    Envelope,
    ErrorResponse,
    GenesisRequest,
    GenesisResponse,
    Heartbeat,
    NodeKey,
    RunGenesis,
    SequenceCounter,
    SignedGenesis,
    verify_genesis,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class P2PConfig:
    """Overlay knobs. Defaults suit a real deployment; tests shrink the intervals."""

    listen: list[str] = dataclasses.field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    bootstrap: list[str] = dataclasses.field(default_factory=list)
    advertise_host: str = "127.0.0.1"
    target_peers: int = 6
    heartbeat_interval_s: float = 2.0
    forget_after_s: float = 0.0  # 0: 5 heartbeat intervals, at least 10 s
    conn_interval_s: float = 1.0
    px_interval_s: float = 5.0
    dial_timeout_s: float = 5.0
    # At target, dial one address-book peer we hear no heartbeat from this often (heals
    # partitions whose halves are each at target; 0: never).
    probe_interval_s: float = 30.0
    # Dial back-off after failures in a row: base, 2 base, 4 base... capped (+-20% jitter).
    dial_backoff_base_s: float = 1.0
    dial_backoff_max_s: float = 60.0
    # False: the connection manager ignores the addresses in heartbeats and learns peers
    # only from the bootstrap list and peer exchange (tests).
    learn_addrs_from_heartbeats: bool = True
    budget: float = 20.0
    ban_seconds: float = 600.0
    rate_per_s: float = 1000.0
    rate_burst: float = 5000.0
    data_port: int = 0
    # Reachability: AutoNAT, relay reservations while behind NAT, relay service while public.
    nat: NatConfig = dataclasses.field(default_factory=NatConfig)
    # The wall clock (ms) envelopes are sealed and judged by; tests shift it to play a node
    # whose clock is wrong (node/p2p/clock.py).
    wall_ms: Callable[[], int] = now_ms


class RoleHook:
    """Base role: does nothing. Subclass and pass to :class:`Node`."""

    role = "worker"

    async def run(self, node: NodeServices) -> None:
        await trio.sleep_forever()

    def heartbeat_fields(self) -> dict[str, Any]:
        return {}

    def status(self) -> dict[str, Any]:
        return {}


class BootstrapRole(RoleHook):
    role = "bootstrap"


class Node:
    def __init__(
        self,
        key: NodeKey,
        *,
        genesis: SignedGenesis | None = None,
        run_id: bytes | None = None,
        config: P2PConfig | None = None,
        hook: RoleHook | None = None,
    ) -> None:
        self.key = key
        self.peer_id = key.peer_id
        self.config = config or P2PConfig()
        self.hook = hook or RoleHook()
        self.signed_genesis = genesis
        self.genesis: RunGenesis | None = verify_genesis(genesis) if genesis is not None else None
        if self.genesis is not None:
            if run_id is not None and run_id != self.genesis.run_id:
                raise ConfigError("the genesis does not hash to the given run id")
            run_id = self.genesis.run_id
        if run_id is None:
            raise ConfigError("a node needs a run: give a genesis or a run id")
        self.run_id = run_id
        self.metrics = NodeMetrics()
        self.standing = PeerStanding(
            budget=self.config.budget,
            ban_seconds=self.config.ban_seconds,
            rate_per_s=self.config.rate_per_s,
            rate_burst=self.config.rate_burst,
        )
        self.standing.metrics = self.metrics
        self.seq = SequenceCounter(time.time_ns() // 1000)
        self.started = time.monotonic()  # wall time: uptime as an operator reads it
        self.host: IHost | None = None
        self.gossip: Gossip | None = None
        self.reqresp: ReqResp | None = None
        self.swarm = SwarmView(
            self.peer_id, forget_after=self.config.forget_after_s or max(10.0, 5 * self.config.heartbeat_interval_s)
        )
        self.conns: ConnectionManager | None = None
        self.nat: NatService | None = None
        self.clock_skew = ClockSkew()
        self.ready = trio.Event()
        self._cancel = trio.CancelScope()

    @property
    def role(self) -> str:
        return self.hook.role

    # ---------------------------------------------------------------- addresses
    def addrs(self) -> list[str]:
        """Dialable multiaddrs (without our /p2p/): relay circuit addresses while behind NAT."""
        direct = self.direct_addrs()
        return self.nat.advertised(direct) if self.nat is not None else direct

    def direct_addrs(self) -> list[str]:
        """Our own transport addresses (without /p2p/)."""
        return listen_addrs(self.host, self.config.advertise_host) if self.host else []

    def full_addrs(self) -> list[str]:
        if self.nat is not None and self.nat.behind_nat:
            return [f"{a}/p2p/{self.peer_id}" for a in self.addrs()]
        return full_addrs(self.host, self.config.advertise_host) if self.host else []

    def peer_ips(self, peer_id: str) -> set[str]:
        """The IP addresses ``peer_id`` advertises or connects to us from directly (no relay's):
        where we may dial its data port. Empty before the host runs."""
        return peer_ips(self.host, peer_id) if self.host is not None else set()

    def reachable(self) -> bool:
        """Peers can dial us directly: AutoNAT has not found us behind NAT (a node behind NAT
        asks no holder behind NAT to dial it: two NAT'd nodes exchange no bulk)."""
        return self.nat is None or not self.nat.behind_nat

    # ---------------------------------------------------------------- lifecycle
    def stop(self) -> None:
        self._cancel.cancel()

    def _is_known_origin(self, peer_id: str) -> bool:
        """A signer we have a heartbeat from, or one the genesis names."""
        if self.swarm.knows(peer_id):
            return True
        g = self.genesis
        return g is not None and (peer_id == g.trainer or peer_id in g.validators or peer_id == g.owner)

    async def run(self, *, connect_bootstrap: bool = True, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled or :meth:`stop`. ``task_status.started()`` once listening
        and (if bootstrap addresses were given) connected to one of them."""
        cfg = self.config
        with self._cancel:
            self.host = host = make_host(self.key, dial_timeout=cfg.dial_timeout_s)
            register_connection_metrics(self.metrics.registry, host)
            async with closing_host(host, cfg.listen):
                self.reqresp = ReqResp(
                    host,
                    self.key,
                    self.run_id,
                    standing=self.standing,
                    metrics=self.metrics,
                    seq=self.seq,
                    wall_ms=cfg.wall_ms,
                )
                self.reqresp.clock_skew = self.clock_skew
                self.gossip = Gossip(
                    host,
                    self.key,
                    self.run_id,
                    standing=self.standing,
                    metrics=self.metrics,
                    seq=self.seq,
                    authorised=self._authorised_senders(),
                    is_known_origin=self._is_known_origin,
                    wall_ms=cfg.wall_ms,
                )
                self.gossip.clock_skew = self.clock_skew
                self.conns = ConnectionManager(
                    host,
                    self.peer_id,
                    self.reqresp,
                    self.swarm,
                    self.standing,
                    self.metrics,
                    bootstrap=cfg.bootstrap,
                    target_peers=cfg.target_peers,
                    interval=cfg.conn_interval_s,
                    px_interval=cfg.px_interval_s,
                    dial_timeout=cfg.dial_timeout_s,
                    my_addrs=self.addrs,
                    has_gossip_stream=self.gossip.has_stream,
                    probe_interval=cfg.probe_interval_s,
                    backoff_base=cfg.dial_backoff_base_s,
                    backoff_max=cfg.dial_backoff_max_s,
                    learn_from_heartbeats=cfg.learn_addrs_from_heartbeats,
                )
                self.nat = NatService(
                    host,
                    cfg.nat,
                    my_addrs=self.direct_addrs,
                    bootstrap_ids=lambda: self.conns.bootstrap_ids if self.conns else [],
                )
                self.conns.relay_dialer = self.nat.dial_via_relay
                self.conns.keep_without_gossip = self.nat.holds_reservation
                self.reqresp.before_dial = self.nat.ensure_connected
                if self.genesis is not None:
                    self.conns.protected = {self.genesis.trainer, *self.genesis.validators}
                self.reqresp.register(GenesisRequest, self._serve_genesis)
                self.gossip.on("heartbeat", self.swarm.on_heartbeat)
                self.gossip.on("heartbeat", self._clock_from_heartbeat)
                gossip = self.gossip
                self.swarm.introducer = lambda: gossip.delivered_from.get("heartbeat")
                if cfg.learn_addrs_from_heartbeats:
                    self.swarm.listeners.append(self._remember_addrs)
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.gossip.run)
                    if connect_bootstrap:
                        await self.conns.connect_bootstrap()
                    await nursery.start(self.conns.run)
                    await nursery.start(self.nat.run)
                    nursery.start_soon(self._heartbeat_loop)
                    nursery.start_soon(self._run_hook)
                    self.ready.set()
                    task_status.started()
                    await trio.sleep_forever()

    def _authorised_senders(self) -> dict[str, frozenset[str]]:
        g = self.genesis
        if g is None:
            return {}
        validators = frozenset(g.validators)
        return {"checkpoint": frozenset({g.trainer}), "vote": validators, "ban": validators | {g.trainer}}

    def _remember_addrs(self, st) -> None:
        """Heartbeat addresses go to the peerstore, so a request to a peer we are not
        connected to yet (a chunk ticket, a batch fetch) can dial it."""
        try:
            import multiaddr
            from libp2p.peer.id import ID

            addrs = [multiaddr.Multiaddr(a) for a in st.heartbeat.addrs]
            if addrs and self.host is not None:
                self.host.get_peerstore().add_addrs(ID.from_base58(st.peer_id), addrs, 600)
        except Exception:
            log.debug("could not record addresses of %s", st.peer_id, exc_info=True)

    def _clock_from_heartbeat(self, env: Envelope) -> None:
        """A heartbeat its signer sent us itself (not relayed: relaying adds queueing delay)
        is a clock sample: our clock at arrival minus its signed timestamp."""
        if self.gossip is not None and self.gossip.delivered_from.get("heartbeat") == env.sender:
            self.clock_skew.sample(env.sender, self.config.wall_ms() - env.timestamp_ms)

    def services(self) -> RunningNode:
        """What the role receives (:mod:`node.p2p.services`): the node's services once gossip and
        request/response run."""
        if self.gossip is None or self.reqresp is None:
            raise RuntimeError("the node's services exist once Node.run has started them")
        return RunningNode(
            peer_id=self.peer_id,
            key=self.key,
            seq=self.seq,
            run_id=self.run_id,
            genesis=self.genesis,
            gossip=self.gossip,
            reqresp=self.reqresp,
            standing=self.standing,
            metrics=self.metrics,
            _peer_ips=self.peer_ips,
            _reachable=self.reachable,
        )

    async def _run_hook(self) -> None:
        await self.hook.run(self.services())

    # ---------------------------------------------------------------- heartbeats
    def make_heartbeat(self) -> Heartbeat:
        fields: dict[str, Any] = dict(
            role=self.role,
            policy_version=-1,
            addrs=tuple(self.addrs()[:8]),
            data_port=self.config.data_port,
            have=(),
            uptime_s=time.monotonic() - self.started,
            step=-1,
            batches=0,
        )
        fields.update(self.hook.heartbeat_fields())
        if self.nat is not None and self.nat.behind_nat:
            # nobody can dial our data plane: reachable peers ask us to dial theirs instead
            # (reverse connections); bulk never goes through a relay
            fields["data_port"] = 0
        fields["have"] = tuple(fields["have"])
        fields["addrs"] = tuple(fields["addrs"])
        return Heartbeat(**fields)

    async def _heartbeat_loop(self) -> None:
        gossip = self.gossip
        assert gossip is not None, "started by run() once gossip exists"
        while True:
            try:
                await gossip.publish(self.make_heartbeat())
            except Exception:
                log.exception("heartbeat failed")
            self.metrics.uptime.set(time.monotonic() - self.started)
            roles = self.swarm.by_role()
            for r in ("bootstrap", "trainer", "worker", "validator"):
                self.metrics.swarm_peers.labels(r).set(len(roles.get(r, [])))
            await trio.sleep(self.config.heartbeat_interval_s)

    # ---------------------------------------------------------------- genesis
    def _connection_status(self) -> dict[str, Any] | None:
        """Connections, refusals and the trio task count (bench/soak.py watches it for leaks)."""
        if self.host is None:
            return None
        st = connection_stats(self.host)
        try:
            st["tasks"] = trio_task_count()
        except RuntimeError:  # status() called outside the node's trio run
            st["tasks"] = None
        return st

    def _serve_genesis(self, env: Envelope, peer: str):
        if self.signed_genesis is None:
            return ErrorResponse(code="no_genesis", detail="this node holds no run genesis")
        return GenesisResponse(genesis=self.signed_genesis)

    # ---------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        conns = self.conns
        peers = []
        relayed = set(self.nat.relayed_peers()) if self.nat is not None else set()
        if conns is not None:
            for pid in conns.connected():
                st = self.swarm.get(pid)
                # peer-exchange round trip: every connection is asked on arrival, then in turns
                rtt = conns.latency_ms.get(pid)
                peers.append(
                    {
                        "peer_id": pid,
                        "role": st.heartbeat.role if st else None,
                        "addr": conns.peer_addr(pid),
                        "latency_ms": round(rtt, 2) if rtt is not None else None,
                        "banned": self.standing.is_banned(pid),
                        "relayed": pid in relayed,
                    }
                )
        g = self.genesis
        return {
            "peer_id": self.peer_id,
            "role": self.role,
            "run_id": self.run_id.hex(),
            "run_name": g.name if g else None,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "addrs": self.full_addrs(),
            "target_peers": self.config.target_peers,
            "peers": peers,
            "swarm": self.swarm.to_json(),
            "gossip": {
                **self.metrics.gossip_summary(),
                "mesh": {
                    k: len(self.gossip.mesh_peers(k)) for k in ("heartbeat", "checkpoint", "rollout", "vote", "ban")
                }
                if self.gossip
                else {},
                # Plumtree state: eager/lazy links, IHAVE/GRAFT/PRUNE counters, caches.
                "tree": self.gossip.status() if self.gossip else {},
            },
            "nat": self.nat.status() if self.nat is not None else None,
            "connections": self._connection_status(),
            "bans": self.standing.banned(),
            # how far our wall clock is from our peers' (node/p2p/clock.py)
            "clock": self.clock_skew.status(),
            "requests": {k: dict(v) for k, v in self.metrics.req.items()},
            # inbound request streams and handler slots held, and what the per-peer caps refused
            "request_streams": {**self.reqresp.streams.sizes(), **self.reqresp.streams.counters}
            if self.reqresp
            else {},
            "role_state": self.hook.status(),
        }


async def fetch_genesis(
    key: NodeKey, bootstrap: list[str], *, timeout: float = 10.0, expected_run_id: bytes | None = None
) -> SignedGenesis:
    """Ask the bootstrap node(s) for the run genesis and verify it (NetworkError if none works)."""
    from node.p2p.host import parse_peer_addr

    errors = []
    host = make_host(key, dial_timeout=timeout)
    async with closing_host(host, ["/ip4/127.0.0.1/tcp/0"]):
        rr = ReqResp(
            host,
            key,
            ZERO_RUN_ID,
            standing=PeerStanding(),
            metrics=NodeMetrics(),
            seq=SequenceCounter(time.time_ns() // 1000),
        )
        for text in bootstrap:
            info = parse_peer_addr(text)
            pid = info.peer_id.to_base58()
            try:
                with trio.fail_after(timeout):
                    await host.connect(info)
                env = await rr.request(pid, GenesisRequest(want=0), GenesisResponse, timeout=timeout)
                g = verify_genesis(env.body.genesis, expected_run_id)
                log.info("genesis of run %s (%s) from %s", g.run_id.hex()[:16], g.name, pid)
                return env.body.genesis
            except trio.TooSlowError:
                errors.append(f"{text}: no answer within {timeout:g} s")
            except RequestError as exc:
                # "unsupported": the one line names what is missing (a libp2p node, not primenode)
                errors.append(f"{text}: {exc.detail if exc.code == 'unsupported' else exc}")
            except Exception as exc:
                errors.append(f"{text}: {type(exc).__name__}: {exc}")
    raise NetworkError("could not get the run genesis from any bootstrap node: " + "; ".join(errors))
