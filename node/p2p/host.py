"""libp2p host factory with the fixes we measured on py-libp2p 0.8.1.

* :func:`make_host` offers and accepts **Noise only** (``sec_opt``): without it
  ``new_host()`` also offers ``/plaintext/2.0.0``, secio and TLS, and over plaintext a
  peer claims any peer id without proving it holds the key (issue 30: garbage sent under a
  worker's id got the *worker* banned). Every charge, strike and ban in
  :class:`~node.p2p.standing.PeerStanding` is keyed by the connection's peer id, so that id
  must be one the remote proved in the handshake. Noise does (the static key is signed by
  the libp2p identity key); secio is deprecated everywhere; py-libp2p's TLS is not needed
  (every libp2p stack speaks Noise, and go-/rust-libp2p offer only Noise and TLS).
  Relayed connections and AutoNAT dial-backs go through the same upgrader.
* ``ConnectionConfig(max_connections_per_peer=1)``: removes the ~250 ms dial delay.
* :func:`closing_host` closes the host *before* leaving ``host.run()`` (otherwise
  3 fds leak per cycle).
* :func:`install_libp2p_fixes` switches off the library's AutoConnector
  (it would dial the whole peerstore); :class:`ConnectionManager` decides.
* :func:`install_libp2p_fixes` caps new inbound connections per second
  (closed before the Noise handshake): fresh identities are free, handshakes
  are not.
* :func:`install_libp2p_fixes` makes yamux return receive credit in
  half-window batches: the library sends a WINDOW_UPDATE frame after
  practically *every* read, which doubled the frames a gossip flood costs.
* :func:`install_libp2p_fixes` makes a connection's close run to the end even
  when the task closing it is cancelled: stopping a node by cancellation (SIGTERM,
  a killed in-process node) otherwise left every connection's socket open.
* :func:`make_host` switches off the swarm's negative dial cache: after one failed dial
  the library refuses every dial to that peer for 60 s without trying, so our own
  back-off (``ConnectionManager``, ``connect_bootstrap``'s retries) never got a second
  try: a node started a moment before its bootstrap listened gave up and exited.
* :func:`install_libp2p_fixes` makes identify leave out the observed address on a
  relayed connection (and send none rather than an empty one): the library reported
  ``/p2p/<self>/p2p-circuit/p2p/<remote>`` there, which js-libp2p rejects, so identify over
  a relay failed with it (tests/interop/). A peer reached through a relay has no address of
  ours worth reporting (what we see is the relay), and the field is optional. On a direct
  connection the socket's remote address is sent, as before (the library also sent the
  circuit address there whenever the peer had *another*, relayed, connection).
* :func:`install_libp2p_fixes` releases inbound connection slots when a connection closes and
  caps connections per IP and per peer (``node/p2p/connlimits.py``).
* The ``libp2p`` logger does not propagate; :func:`attach_libp2p_logging` hooks it up.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, ISecureTransport
from libp2p.connection_types import ConnectionType
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

from node.errors import NetworkError
from node.p2p.connlimits import install_connection_slot_fixes
from node.util import aclose_shielded
from protocol import NodeKey

log = logging.getLogger(__name__)

_fixes_installed = False


def install_libp2p_fixes() -> None:
    """Patch py-libp2p 0.8.1 where its defaults cost us (idempotent, process-wide)."""
    global _fixes_installed
    if _fixes_installed:
        return
    # py-libp2p's AutoConnector dials every peer in the peerstore until the node has
    # ~200 connections. Our ConnectionManager keeps `target_peers` on purpose (and we
    # put heartbeat addresses in the peerstore), so the library's dialler must not run:
    # with it, nodes held 7-17 connections and logged thousands of dial errors.
    from libp2p.network.auto_connector import AutoConnector

    async def _no_auto_connect(self) -> None:
        return None

    AutoConnector.maybe_connect = _no_auto_connect  # type: ignore[method-assign]  # a deliberate patch
    _batch_yamux_window_updates()
    _limit_inbound_connection_rate()
    install_connection_slot_fixes()  # inbound slots come back on close; per-IP/per-peer caps
    _shield_connection_close()
    _identify_observed_addr_on_relays()
    _fixes_installed = True


CONNECTION_CLOSE_TIMEOUT_S = 3.0


def _shield_connection_close() -> None:
    """Let ``SwarmConn.close`` finish under cancellation (no leaked sockets).

    When a node is stopped by cancelling its scope, the library's own service task
    closes every connection from inside the cancelled scope: ``SwarmConn.close`` marks
    the connection closed, then its first await (the yamux GO_AWAY) is cancelled, so
    the socket is never closed, and the later ``host.close()`` skips it as already
    closed. The remote peer then sees a silent, open connection. Shielded here, with a
    deadline; if the polite close hangs, the secured transport is closed directly.
    """
    from libp2p.network.connection.swarm_connection import SwarmConn

    original = SwarmConn.close

    async def _close(self) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(CONNECTION_CLOSE_TIMEOUT_S):
                await original(self)
                return
            if not getattr(self, "_shared_muxed_conn", False):
                await aclose_shielded(self.muxed_conn.secured_conn.close, 1)

    SwarmConn.close = _close  # type: ignore[method-assign]  # a deliberate patch


def _identify_observed_addr_on_relays() -> None:
    """No observed address in identify on relayed connections, none empty (module docstring).

    The library's handler asks ``_prefer_circuit_addr(host, peer, socket_addr)`` for the
    address to report, per *peer*; it cannot tell which connection the stream is on. The
    handler is wrapped to note, for the task answering, whether this stream's connection is
    relayed, and the lookup answers from that note.
    """
    import contextvars

    from libp2p.host import defaults
    from libp2p.identity.identify import identify as ident
    from libp2p.identity.identify.pb.identify_pb2 import Identify
    from libp2p.identity.identify_push import identify_push as push

    on_relay: contextvars.ContextVar[bool] = contextvars.ContextVar("primenode_identify_on_relay", default=False)
    make_handler = ident.identify_handler_for
    make_message = ident._mk_identify_protobuf

    def handler_for(host: IHost, use_varint_format: bool = True) -> Any:
        handle = make_handler(host, use_varint_format)

        async def _handle(stream: Any) -> None:
            conn = getattr(stream, "swarm_conn", None)
            token = on_relay.set(conn is None or conn_is_relayed(conn))
            try:
                await handle(stream)
            finally:
                on_relay.reset(token)

        return _handle

    def observed(host: IHost, peer_id: ID, fallback: multiaddr.Multiaddr | None) -> multiaddr.Multiaddr | None:
        return None if on_relay.get() else fallback  # fallback: the stream's socket address

    def message(host: IHost, observed_multiaddr: multiaddr.Multiaddr | None) -> Identify:
        msg = make_message(host, observed_multiaddr)
        if observed_multiaddr is None:
            msg.ClearField("observed_addr")
        return msg

    ident._prefer_circuit_addr = observed  # a deliberate patch
    ident._mk_identify_protobuf = message  # a deliberate patch
    push._mk_identify_protobuf = message  # a deliberate patch
    ident.identify_handler_for = handler_for  # a deliberate patch
    defaults.identify_handler_for = handler_for  # a deliberate patch


# New inbound connections a node accepts per second (burst: at once). Joins are rare;
# a flood of fresh identities is not: each costs a Noise handshake and identify
# (bench/hostile.py burnt ~30 identities/s against one node).
INBOUND_CONNECTIONS_PER_S = 10.0
INBOUND_CONNECTIONS_BURST = 40.0


def _limit_inbound_connection_rate() -> None:
    """Close inbound TCP connections beyond a per-swarm rate *before* the handshake."""
    from libp2p.network.swarm import Swarm

    from node.util import TokenBucket

    original = Swarm._handle_inbound_connection

    async def _rate_limited(self, read_write_closer, maddr) -> None:
        bucket = getattr(self, "_primenode_accept_bucket", None)
        if bucket is None:
            bucket = self._primenode_accept_bucket = TokenBucket(INBOUND_CONNECTIONS_PER_S, INBOUND_CONNECTIONS_BURST)
        if not bucket.take():
            self.primenode_inbound_refused = getattr(self, "primenode_inbound_refused", 0) + 1
            try:
                await read_write_closer.close()
            except Exception:
                pass
            return
        await original(self, read_write_closer, maddr)

    Swarm._handle_inbound_connection = _rate_limited  # type: ignore[method-assign]  # a deliberate patch


def _batch_yamux_window_updates() -> None:
    """Give yamux receive credit back in half-window batches, as go-yamux does.

    py-libp2p 0.8.1 sends a WINDOW_UPDATE after every read that leaves the window
    below its target, i.e. after practically every read: one extra yamux + Noise
    frame per gossip message per hop (measured in bench/gossip.py: 16k window
    updates for 21k data frames). Credit is returned once half the target window
    has been consumed, so a sender never stalls (it still holds half a window).
    """
    from libp2p.stream_muxer.yamux.yamux import YamuxStream

    async def _release_in_batches(self: YamuxStream, *, bytes_read: int = 0) -> None:
        async with self.window_lock:
            self._pending_recv_release += bytes_read
            pending = self._pending_recv_release
            if pending <= 0 or pending < self.target_recv_window // 2:
                return
            self._pending_recv_release = 0
            self.recv_window += pending
        await self.send_window_update(pending, skip_lock=True)

    YamuxStream._auto_tune_and_send_window_update = _release_in_batches  # type: ignore[method-assign]  # a deliberate patch


def attach_libp2p_logging(level: int = logging.WARNING) -> None:
    """Route the (non-propagating) ``libp2p`` logger to stderr at ``level``."""
    lg = logging.getLogger("libp2p")
    if not any(getattr(h, "_primenode", False) for h in lg.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s libp2p %(levelname)s %(name)s: %(message)s"))
        h._primenode = True  # type: ignore[attr-defined]
        lg.addHandler(h)
    lg.setLevel(level)


def libp2p_key_pair(key: NodeKey):
    return create_new_key_pair(key.seed)


def authenticated_security(key_pair: KeyPair) -> dict[TProtocol, ISecureTransport]:
    """The only security transport a host offers or accepts: Noise (see the module docstring).

    A remote that proposes anything else (``/plaintext/2.0.0``, secio, TLS) fails
    multistream-select before any byte of ours is exchanged, so no frame can ever be
    attributed to a peer id that was not proven."""
    return {NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)}


def make_host(key: NodeKey, *, dial_timeout: float = 5.0) -> IHost:
    install_libp2p_fixes()
    cfg = ConnectionConfig(max_connections_per_peer=1, dial_timeout=dial_timeout)
    key_pair = libp2p_key_pair(key)
    host = new_host(key_pair=key_pair, connection_config=cfg, sec_opt=authenticated_security(key_pair))
    _no_negative_dial_cache(host)
    return host


def _no_negative_dial_cache(host: IHost) -> None:
    """Give the swarm a negative-dial cache that forgets at once (see the module docstring)."""
    from libp2p.network.swarm import _NegativePeerCache

    network = host.get_network()
    if hasattr(network, "_negative_peer_cache"):
        network._negative_peer_cache = _NegativePeerCache(ttl=0.0)


@contextlib.asynccontextmanager
async def closing_host(host: IHost, listen: Sequence[str]) -> AsyncIterator[IHost]:
    """``async with host.run(...)`` that closes connections first (no fd leak)."""
    try:
        addrs = [multiaddr.Multiaddr(a) for a in listen]
    except Exception as exc:
        raise NetworkError(f"bad listen address {listen!r}: {exc}") from None
    try:
        async with host.run(listen_addrs=addrs):
            try:
                yield host
            finally:
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(5):
                        await host.close()
    except OSError as exc:
        raise NetworkError(f"cannot listen on {', '.join(listen)}: {exc}") from None


CIRCUIT = "/p2p-circuit"


def is_circuit(addr: str) -> bool:
    """A relay circuit address (``<relay addr>/p2p/<relay>/p2p-circuit[/p2p/<peer>]``)."""
    return CIRCUIT in addr


def conn_is_relayed(conn: Any) -> bool:
    """A swarm connection that runs over a relay circuit.

    The connection type, or the transport addresses recorded at upgrade; not
    ``get_transport_addresses()``, which falls back to the peerstore's addresses of the
    peer when none were recorded (and those list circuit addresses for any NAT'd peer).
    """
    try:
        if conn.get_connection_type() == ConnectionType.RELAYED:
            return True
    except Exception:
        pass
    addrs = getattr(conn, "_actual_transport_addresses", None) or []
    return any(is_circuit(str(a)) for a in addrs)


def peer_ips(host: IHost, peer_id: str) -> set[str]:
    """The IP addresses ``peer_id`` advertises as its own (its signed heartbeats put them in
    the peerstore) or connects to us from directly: where we may dial its data port.
    Circuit addresses name the relay's IP, not the peer's, and are left out."""
    out: set[str] = set()
    try:
        pid = ID.from_base58(peer_id)
        addrs = list(host.get_peerstore().addrs(pid))
        for conn in host.get_network().get_connections(pid):
            addrs += list(getattr(conn, "_actual_transport_addresses", None) or [])
    except Exception:
        return out
    for a in addrs:
        ma = a if isinstance(a, multiaddr.Multiaddr) else multiaddr.Multiaddr(str(a))
        if "p2p-circuit" in str(ma):
            continue
        for proto in ("ip4", "ip6"):
            try:
                out.add(ma.value_for_protocol(proto))
            except Exception:
                continue
    return out


def strip_peer_id(addr: str) -> str:
    """Drop a trailing ``/p2p/<peer id>``; a circuit address keeps its relay's ``/p2p/<relay>``."""
    if CIRCUIT in addr:
        return addr.partition(CIRCUIT)[0] + CIRCUIT
    return addr.split("/p2p/")[0]


def listen_addrs(host: IHost, advertise_host: str | None = None) -> list[str]:
    """The host's transport addresses, without /p2p/, with 0.0.0.0 replaced."""
    out: list[str] = []
    for a in host.get_transport_addrs():
        s = str(a)
        if "/p2p/" in s:
            s = s.split("/p2p/")[0]
        if s.startswith("/ip4/0.0.0.0/"):
            rest = s[len("/ip4/0.0.0.0/") :]
            hosts = ["127.0.0.1"]
            if advertise_host and advertise_host not in hosts:
                hosts.insert(0, advertise_host)
            out.extend(f"/ip4/{h}/{rest}" for h in hosts)
        else:
            out.append(s)
    seen: list[str] = []
    for s in out:
        if s not in seen:
            seen.append(s)
    return seen


def full_addrs(host: IHost, advertise_host: str | None = None) -> list[str]:
    """Dialable multiaddrs with ``/p2p/<peer id>`` appended."""
    pid = host.get_id().to_base58()
    return [f"{a}/p2p/{pid}" for a in listen_addrs(host, advertise_host)]


def parse_peer_addr(text: str) -> PeerInfo:
    """A ``.../p2p/<peer id>`` multiaddr -> PeerInfo, or a NetworkError saying what is wrong."""
    try:
        ma = multiaddr.Multiaddr(text)
    except Exception as exc:
        raise NetworkError(f"not a multiaddr: {text!r} ({exc})") from None
    if "/p2p/" not in text:
        raise NetworkError(f"{text!r} lacks /p2p/<peer id>: copy the full address the bootstrap node printed")
    try:
        return info_from_p2p_addr(ma)
    except Exception as exc:
        raise NetworkError(f"bad peer address {text!r}: {exc}") from None


def peer_info(peer_id: str, addrs: Sequence[str]) -> PeerInfo:
    return PeerInfo(ID.from_base58(peer_id), [multiaddr.Multiaddr(a) for a in addrs])
