"""Connection slots that come back when a connection closes, and per-IP / per-peer caps.

**The defect (py-libp2p 0.8.1, ``libp2p/network/swarm.py``).** ``Swarm._handle_inbound_connection``
takes a token from ``_inbound_limiter`` (a ``trio.CapacityLimiter`` of
``max_connections - min_connections``: 300 - 50 = 250 with the default ``ConnectionConfig``) and
gives it back in a ``finally`` when ``_do_handle_inbound_connection`` returns. After a successful
upgrade that function parks on ``await self.manager.wait_finished()`` ("intentional barrier: keep
handler alive"), i.e. until the *whole swarm* stops, not until the connection closes. So every
inbound connection ever accepted keeps a token (and a trio task) for the life of the node: after
250 of them, however briefly each was open, every later inbound connection is closed at once
(only a DEBUG line, "Inbound connection cap (250) reached"), joins fail and the node's AutoNAT
sees itself unreachable. Outbound connections hold no such token: the dial path counts live
connections (``len(get_connections())``), which ``SwarmConn`` removes on close, so outbound
slots already come back.

**What we do: a patch, not configuration.** No ``ConnectionConfig`` field moves the barrier, and a
larger cap only postpones the wall. :func:`install_connection_slot_fixes` (called once from
``node.p2p.host.install_libp2p_fixes``) replaces ``Swarm._do_handle_inbound_connection`` with
:func:`_serve_inbound` , the library's own steps (connection gate, upgrade, ``add_conn``) followed
by a wait on *this* connection's ``SwarmConn.event_closed``. The library's limiter (still 250 live
inbound connections) and our per-IP count are released when the connection closes, and the
handler task ends with it.

**Per-IP and per-peer caps** (go-libp2p's resource manager bounds connections per IP subnet and per
peer the same way), so one host cannot fill the table:

* ``MAX_INBOUND_PER_IP`` inbound connections (handshaking or open) from one IP address. Checked
  on the raw TCP socket, before the accept-rate bucket and before any Noise work: a refused
  socket is closed unread and costs the node no handshake.
* ``MAX_CONNECTIONS_PER_PEER`` open connections with one peer id. A peer id is only known after
  the handshake, so this is checked in ``Swarm.add_conn`` for inbound connections, before the
  connection is registered, announced or handed to any protocol.

Refusals are counted per reason on the swarm (``primenode_refused``; the accept-rate refusals
stay in ``primenode_inbound_refused``) and reported by :func:`connection_stats` in the node's
status (``connections``, with the node's trio task count) and on ``/metrics`` as
``primenode_connections_refused{reason}`` (:func:`register_connection_metrics`).
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from typing import Any

import trio

log = logging.getLogger(__name__)

# Inbound connections (in the handshake or open) one IP address may hold. A NAT'd office or a
# devnet on one machine puts several nodes behind one address, and every node of a devnet comes
# from 127.0.0.1 (a 30-node devnet and bench/soak.py's churn stay well under it), while the
# library's table holds 250 inbound connections: one address takes at most a quarter of it.
MAX_INBOUND_PER_IP = 64

# Open connections with one peer id. One is normal; two happen when both sides dial at once or
# a restarted peer reconnects before its old connection is seen to be dead (the library trims
# the extra one later, ``max_connections_per_peer=1``). Beyond that a peer is only hoarding slots.
MAX_CONNECTIONS_PER_PEER = 2

_installed = False


def install_connection_slot_fixes() -> None:
    """Patch ``Swarm`` once per process (idempotent); see the module docstring."""
    global _installed
    if _installed:
        return
    _release_inbound_slot_on_close()
    _limit_inbound_per_ip()
    _limit_connections_per_peer()
    _installed = True


def _refuse(swarm: Any, reason: str) -> None:
    refused = getattr(swarm, "primenode_refused", None)
    if refused is None:
        refused = swarm.primenode_refused = Counter()
    refused[reason] += 1


def _release_inbound_slot_on_close() -> None:
    """Let an inbound connection's handler (and the slot it holds) end with the connection."""
    from libp2p.abc import IMuxedConn
    from libp2p.network.connection.raw_connection import RawConnection
    from libp2p.network.swarm import Swarm

    async def _serve_inbound(self, read_write_closer, maddr, failure_event) -> None:
        remote = self._build_remote_multiaddr(read_write_closer)
        if remote is not None and not await self.connection_gate.is_allowed(remote):
            await _close_quietly(read_write_closer)
            return
        raw_conn = None
        try:
            if isinstance(read_write_closer, IMuxedConn):  # QUIC and the like: already muxed
                await self.add_conn(read_write_closer, direction="inbound")
                muxed = read_write_closer
            else:
                raw_conn = RawConnection(read_write_closer, False)
                muxed = await self.upgrade_inbound_raw_conn(raw_conn, maddr)
        except Exception as exc:
            log.debug("inbound connection failed: %s", exc)
            await _close_quietly(raw_conn if raw_conn is not None else read_write_closer)
            return
        # The library waits here for the whole swarm to stop; we wait for this connection.
        conn = next((c for c in self.connections.get(muxed.peer_id, ()) if c.muxed_conn is muxed), None)
        if conn is not None:
            await conn.event_closed.wait()

    Swarm._do_handle_inbound_connection = _serve_inbound  # type: ignore[method-assign]  # a deliberate patch


def remote_ip(read_write_closer: Any) -> str | None:
    """The peer's IP address of a raw inbound stream (None when the transport has none)."""
    try:
        addr = read_write_closer.get_remote_address()
    except Exception:
        return None
    if not addr:
        return None
    try:
        return str(ipaddress.ip_address(addr[0]))
    except ValueError:
        return None


def _limit_inbound_per_ip() -> None:
    """Close an inbound socket, unread, when its IP already holds ``MAX_INBOUND_PER_IP``."""
    from libp2p.network.swarm import Swarm

    inner = Swarm._handle_inbound_connection

    async def _per_ip(self, read_write_closer, maddr) -> None:
        ip = remote_ip(read_write_closer)
        if ip is None:
            await inner(self, read_write_closer, maddr)
            return
        per_ip: Counter[str] | None = getattr(self, "primenode_inbound_per_ip", None)
        if per_ip is None:
            per_ip = self.primenode_inbound_per_ip = Counter()
        limit = getattr(self, "primenode_max_inbound_per_ip", MAX_INBOUND_PER_IP)
        if per_ip[ip] >= limit:
            _refuse(self, "per_ip")
            await _close_quietly(read_write_closer)
            return
        per_ip[ip] += 1
        try:
            await inner(self, read_write_closer, maddr)
        finally:
            per_ip[ip] -= 1
            if per_ip[ip] <= 0:
                del per_ip[ip]

    Swarm._handle_inbound_connection = _per_ip  # type: ignore[method-assign]  # a deliberate patch


def _limit_connections_per_peer() -> None:
    """Refuse an inbound connection from a peer that already has ``MAX_CONNECTIONS_PER_PEER``."""
    from libp2p.network.swarm import Swarm, SwarmException

    inner = Swarm.add_conn

    async def _per_peer(self, muxed_conn, direction: str = "unknown"):
        if direction != "inbound":
            return await inner(self, muxed_conn, direction)
        # add_conn awaits before it registers the connection: count those in flight too, or
        # concurrent handshakes under one peer id would all pass the check.
        pending: Counter[Any] | None = getattr(self, "_primenode_pending_per_peer", None)
        if pending is None:
            pending = self._primenode_pending_per_peer = Counter()
        peer = muxed_conn.peer_id
        limit = getattr(self, "primenode_max_connections_per_peer", MAX_CONNECTIONS_PER_PEER)
        live = sum(1 for c in self.connections.get(peer, ()) if not c.is_closed) + pending[peer]
        if live >= limit:
            _refuse(self, "per_peer")
            # the library gave the connection a resource-manager scope during the upgrade;
            # add_conn would release it with the SwarmConn it never gets
            scope = getattr(muxed_conn, "_resource_scope", None)
            if scope is not None:
                try:
                    scope.close()
                except Exception:
                    pass
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await _close_quietly(muxed_conn)
            raise SwarmException(f"peer {peer} already holds {live} connections")
        pending[peer] += 1
        try:
            return await inner(self, muxed_conn, direction)
        finally:
            pending[peer] -= 1
            if pending[peer] <= 0:
                del pending[peer]

    Swarm.add_conn = _per_peer  # type: ignore[method-assign]  # a deliberate patch


async def _close_quietly(conn: Any) -> None:
    try:
        await conn.close()
    except Exception:
        pass


def connection_stats(host: Any) -> dict[str, Any]:
    """Live connections by direction, inbound slots held, refusals by reason (for ``status``)."""
    swarm = host.get_network()
    inbound = outbound = 0
    for conns in getattr(swarm, "connections", {}).values():
        for c in conns:
            d = getattr(getattr(c, "direction", None), "name", "")
            if d == "INBOUND":
                inbound += 1
            elif d == "OUTBOUND":
                outbound += 1
    limiter = getattr(swarm, "_inbound_limiter", None)
    refused = dict(getattr(swarm, "primenode_refused", {}))
    refused["rate"] = getattr(swarm, "primenode_inbound_refused", 0)
    per_ip = Counter(getattr(swarm, "primenode_inbound_per_ip", {}))
    return {
        "inbound": inbound,
        "outbound": outbound,
        "inbound_slots_held": int(limiter.borrowed_tokens) if limiter is not None else None,
        "inbound_slots": int(limiter.total_tokens) if limiter is not None else None,
        "busiest_ip": max(per_ip.values(), default=0),
        "refused": refused,
    }


def trio_task_count() -> int:
    """Tasks alive in the current trio run (for benchmarks watching for leaked handlers)."""
    stack = [trio.lowlevel.current_root_task()]
    n = 0
    while stack:
        task = stack.pop()
        n += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return n


def register_connection_metrics(registry: Any, host: Any) -> None:
    """Expose :func:`connection_stats` on ``/metrics``: live connections by direction and
    refused inbound connections by reason (rate, per_ip, per_peer)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _Collector:
        def collect(self):
            st = connection_stats(host)
            live = GaugeMetricFamily("primenode_connections", "Open libp2p connections", labels=["direction"])
            live.add_metric(["inbound"], st["inbound"])
            live.add_metric(["outbound"], st["outbound"])
            yield live
            refused = CounterMetricFamily(
                "primenode_connections_refused", "Inbound connections refused, by reason", labels=["reason"]
            )
            for reason in ("rate", "per_ip", "per_peer"):
                refused.add_metric([reason], st["refused"].get(reason, 0))
            yield refused

    registry.register(_Collector())


def peer_ip(host: Any, peer_id: str) -> str | None:
    """The remote IP address of our (first) connection with ``peer_id``; None if unknown."""
    from libp2p.peer.id import ID

    try:
        conns = host.get_network().connections.get(ID.from_base58(peer_id), ())
    except Exception:
        return None
    for c in conns:
        try:
            addr = c.muxed_conn.get_remote_address()
        except Exception:
            continue
        if addr:
            return str(addr[0])
    return None
