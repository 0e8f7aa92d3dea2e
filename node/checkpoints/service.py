"""``Checkpoints``: the one object the roles use for checkpoints.

    checkpoints = Checkpoints(store, overlay, max_async=genesis.max_async, max_upload_mbps=...)
    async with trio.open_nursery() as n:
        await n.start(checkpoints.run)                    # chunk server + fetch manager
        # wiring from the P2P layer (p2p_overlay.serve_checkpoints does this):
        reqresp.register(ChunkTicketRequest, lambda env, peer: checkpoints.grant_ticket(peer, env.body))
        checkpoints.on_announce_envelope(env)             # gossip: CheckpointAnnounce (already opened)
        checkpoints.on_heartbeat(peer_id, heartbeat)      # gossip: Heartbeat (have-sets)
        heartbeat(have=checkpoints.have_entries(), data_port=checkpoints.data_port,
                  policy_version=checkpoints.newest_version())
        # trainer:
        raw = await checkpoints.publish(key, version, "ckpt/dir")   # gossip ``raw`` as the announce
        # worker / validator:
        v = await checkpoints.wait_version(min_version)   # newest complete, assembled version >= min_version
        with checkpoints.open_version(v) as files: ...    # pinned: GC will not touch it while loading
        checkpoints.status()                              # for ``primenode status``

A node fetches the newest version it knows of; an older incomplete fetch is
abandoned when a newer version is announced (its chunks stay in the store
while the version is within the ``max_async`` window, and are served), unless
a role asked for that version with ``want_version`` (a validator checking a
batch that claims it): wanted versions inside the window are fetched alongside
the newest and never abandoned for it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from node.checkpoints.fetcher import FetchProgress, VersionFetcher
from node.checkpoints.manifest import DEFAULT_CHUNK_SIZE
from node.checkpoints.overlay import ChunkOverlay
from node.checkpoints.server import ChunkServer
from node.checkpoints.store import ChunkStore
from protocol import ChunkTicket, ChunkTicketRequest, Envelope, HaveEntry, Heartbeat, NodeKey, ReplayGuard
from protocol.rules import is_stale, window_floor

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)


# Bounds (docs/security.md): finished fetches whose status is kept (the status JSON shows
# only versions still in the store); peers in the chunk server's bytes-served-to table;
# banned peers remembered here (the policy's own ban table is bounded and expires).
FETCH_HISTORY_VERSIONS = 16
SERVED_TO_PEERS = 1024
MAX_BANNED = 10_000


class Checkpoints:
    """A node's checkpoints: its chunk store, the chunk server and the fetches of new versions."""

    def __init__(
        self,
        store: ChunkStore,
        overlay: ChunkOverlay,
        *,
        max_async: int = 2,
        listen_host: str = "127.0.0.1",
        data_port: int = 0,
        advertise_host: str | None = None,
        max_upload_mbps: float = 0.0,
        auto_fetch: bool = True,
        fetcher_options: dict[str, Any] | None = None,
    ) -> None:
        self.store = store
        self.overlay = overlay
        self.max_async = max_async
        self.server = ChunkServer(
            store,
            listen_host=listen_host,
            port=data_port,
            advertise_host=advertise_host,
            max_upload_mbps=max_upload_mbps,
        )
        self.auto_fetch = auto_fetch
        self.fetcher_options = fetcher_options or {}
        self.fetchers: dict[int, VersionFetcher] = {}
        self.fetch_history: dict[int, dict[str, Any]] = {}
        self.banned: set[str] = set()
        self.progress_callbacks: list[Callable[[FetchProgress], None]] = []
        self._have: dict[str, tuple[float, tuple[HaveEntry, ...]]] = {}  # peer -> (time, have entries)
        self._static_peers: set[str] = set()
        self._nursery: trio.Nursery | None = None
        self._fetch_scopes: dict[int, trio.CancelScope] = {}
        self._wanted: set[int] = set()  # older versions a role needs (bounded by the window)
        self._finishing: set[int] = set()  # versions being assembled
        self._changed = trio.Event()
        self._announced = trio.Event()  # set (and replaced) whenever a new version's manifest arrives

    # ------------------------------------------------------------ lifecycle
    @property
    def data_port(self) -> int:
        return self.server.port

    async def run(self, task_status: TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.server.run)
            for st in self.store.versions.values():  # resume after a restart
                if st.complete and not st.assembled:
                    self._finishing.add(st.version)
                    nursery.start_soon(self._finish, st.version)
            self._maybe_fetch()
            task_status.started(self.server.port)

    # ------------------------------------------------------------ inputs from the overlay
    def grant_ticket(self, peer_id: str, req: ChunkTicketRequest) -> ChunkTicket:
        if peer_id in self.banned:
            return ChunkTicket(ok=False, reason="banned", ticket=b"", host="", port=0, expires_ms=0)
        return self.server.grant_ticket(peer_id, req)

    def on_announce(self, raw: bytes, guard: ReplayGuard | None = None) -> int:
        """Announce envelope bytes (verified here). Returns the version; raises ProtocolError."""
        st, new = self.store.add_announce(raw, guard=guard)
        if new:
            self._on_new_version()
        return st.version

    def on_announce_envelope(self, env: Envelope[Any]) -> int:
        """An announce the gossip layer already opened; raises ProtocolError if not from the trainer."""
        st, new = self.store.add_envelope(env)
        if new:
            self._on_new_version()
        return st.version

    def _on_new_version(self) -> None:
        self._announced.set()
        self._announced = trio.Event()
        self._maybe_fetch()

    async def wait_announced(self, version: int) -> None:
        """Wait until the trainer's manifest of ``version`` is known (announced, or restored from disk)."""
        while version not in self.store.versions:
            await self._announced.wait()

    def on_heartbeat(self, peer_id: str, hb: Heartbeat) -> None:
        if hb.data_port == 0:
            return
        if peer_id not in self._have and len(self._have) >= 2048:
            # bounded: drop have-sets not refreshed for a minute, else the oldest quarter
            now = time.monotonic()
            stale = [p for p, (t, _h) in self._have.items() if now - t > 60]
            for p in stale or sorted(self._have, key=lambda p: self._have[p][0])[: len(self._have) // 4]:
                del self._have[p]
        self._have[peer_id] = (time.monotonic(), hb.have)
        for f in self.fetchers.values():
            # a peer that serves chunks but does not list this version yet probably
            # just heard of it too: try it (its HAVE replies tell us what it holds)
            f.add_peer(peer_id)
        for e in hb.have:
            fetcher = self.fetchers.get(e.version)
            if fetcher is not None and fetcher.st.root == e.root:
                fetcher.update_have(peer_id, e.bitmap)

    def add_peer(self, peer_id: str) -> None:
        """A peer to try even without a heartbeat (static peer lists, benchmarks)."""
        self._static_peers.add(peer_id)
        for f in self.fetchers.values():
            f.add_peer(peer_id)

    # ------------------------------------------------------------ fetching
    def _maybe_fetch(self) -> None:
        if not self.auto_fetch or self._nursery is None:
            return
        newest = self.store.newest()
        if newest is None:
            return
        floor = window_floor(newest.version, self.max_async)
        self._wanted = {v for v in self._wanted if v >= floor or v in self.store.keep}
        for v, scope in list(self._fetch_scopes.items()):
            if v < newest.version and v not in self._wanted:
                scope.cancel()
        for v in sorted(self._wanted | {newest.version}):
            self._ensure_fetch(v)

    def _ensure_fetch(self, version: int) -> None:
        """Fetch (or assemble) ``version`` unless that is done or under way."""
        st = self.store.versions.get(version)
        if st is None or version in self.fetchers or st.assembled:
            return
        if st.complete:
            if version not in self._finishing:
                self._finishing.add(version)
                self._started_nursery().start_soon(self._finish, version)
            return
        self._start_fetch(version)

    def want_version(self, version: int) -> bool:
        """Fetch ``version`` even when a newer one exists, as long as it is inside the
        ``max_async`` window of the newest (or kept: ``ChunkStore.keep``). A validator calls
        this for the version a batch claims, so it never waits for a checkpoint nobody is
        fetching. Returns False if the version is outside the window (the caller should not
        wait for it)."""
        newest = self.store.newest()
        if newest is not None and is_stale(version, newest.version, self.max_async) and version not in self.store.keep:
            return False
        if version in self.store.versions:  # a version not announced yet is fetched as the newest once it is
            self._wanted.add(version)
            self._maybe_fetch()
        return True

    def _started_nursery(self) -> trio.Nursery:
        if self._nursery is None:
            raise RuntimeError("Checkpoints.run() has not started")
        return self._nursery

    def _start_fetch(self, version: int) -> VersionFetcher:
        f = VersionFetcher(
            self.store, version, self.overlay, banned=self.banned, on_progress=self._on_progress, **self.fetcher_options
        )
        self.fetchers[version] = f
        st = f.st
        for pid, (_, have) in self._have.items():
            f.add_peer(pid)
            for e in have:
                if e.version == version and e.root == st.root:
                    f.update_have(pid, e.bitmap)
        for pid in self._static_peers:
            f.add_peer(pid)
        # the scope exists before the task runs, so a newer announce can cancel it at once
        scope = self._fetch_scopes[version] = trio.CancelScope()
        self._started_nursery().start_soon(self._fetch, f, scope)
        return f

    async def _fetch(self, f: VersionFetcher, scope: trio.CancelScope) -> None:
        with scope:
            try:
                await f.run()
            finally:
                self._fetch_scopes.pop(f.version, None)
                self._remember_fetch(f.version, f.status())
        if f.complete:
            await self._finish(f.version)
        self.fetchers.pop(f.version, None)

    async def _finish(self, version: int) -> None:
        try:
            if version not in self.store.versions:
                return
            await self.store.assemble(version)
        finally:
            self._finishing.discard(version)
        self._wanted.discard(version)
        self.gc()
        self._changed.set()
        self._changed = trio.Event()

    def _on_progress(self, p: FetchProgress) -> None:
        for cb in list(self.progress_callbacks):
            cb(p)

    # ------------------------------------------------------------ roles' API
    async def publish(
        self, key: NodeKey, version: int, src_dir: Path | str, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> bytes:
        """Trainer: import a directory of safetensors files as ``version``; return the signed announce."""
        _, raw = await trio.to_thread.run_sync(self.store.import_directory_blocking, key, version, src_dir, chunk_size)
        self.store.add_announce(raw, guard=None)
        await self._finish(version)
        return raw

    def newest_version(self) -> int:
        """Newest complete, assembled version, or -1 (``Heartbeat.policy_version``)."""
        vs = [st.version for st in self.store.versions.values() if st.assembled]
        return max(vs) if vs else -1

    async def wait_version(self, min_version: int = 0, timeout: float | None = None) -> int:
        """Wait until a complete, assembled version >= ``min_version`` is here; return the newest."""
        with trio.fail_after(timeout) if timeout else contextlib.nullcontext():
            while self.newest_version() < min_version:
                await self._changed.wait()
        return self.newest_version()

    async def wait_assembled(self, version: int) -> None:
        """Wait until exactly ``version`` is complete and assembled (see ``want_version``)."""
        while True:
            st = self.store.versions.get(version)
            if st is not None and st.assembled:
                return
            await self._changed.wait()

    def open_version(self, version: int) -> contextlib.AbstractContextManager[dict[str, Path]]:
        """Context manager: ``{path: file}`` of an assembled version, pinned against GC."""
        return self.store.open_version(version)

    def gc(self) -> list[int]:
        removed = self.store.gc(self.max_async)
        for v in removed:
            log.info("garbage-collected checkpoint version %d", v)
        self._trim_tables()
        return removed

    def _remember_fetch(self, version: int, status: dict[str, Any]) -> None:
        self.fetch_history[version] = status
        while len(self.fetch_history) > FETCH_HISTORY_VERSIONS:  # one entry per version ever fetched otherwise
            del self.fetch_history[min(self.fetch_history)]

    def _trim_tables(self) -> None:
        """Per-version and per-peer counters of the chunk server, bounded at every GC."""
        srv = self.server
        held = set(self.store.versions)
        for v in [v for v in srv.bytes_served_by_version if v not in held]:
            del srv.bytes_served_by_version[v]
        if len(srv.bytes_served_to) > SERVED_TO_PEERS:  # free identities: keep the biggest consumers
            keep = dict(srv.bytes_served_to.most_common(SERVED_TO_PEERS // 2))
            srv.bytes_served_to.clear()
            srv.bytes_served_to.update(keep)

    def note_banned(self, peer_id: str, still_banned: Callable[[], Iterable[str]] = lambda: ()) -> None:
        """A peer the node banned: refused tickets, skipped by fetchers. Bounded: when full,
        only the peers ``still_banned()`` lists are kept (in place: fetchers share the set)."""
        if peer_id not in self.banned and len(self.banned) >= MAX_BANNED:
            self.banned.intersection_update(set(still_banned()))
            while len(self.banned) >= MAX_BANNED:
                self.banned.pop()
        self.banned.add(peer_id)

    def have_entries(self) -> tuple[HaveEntry, ...]:
        return self.store.have_entries()

    def status(self) -> dict[str, Any]:
        out = []
        for v in self.store.status():
            ver = v["version"]
            f = self.fetchers.get(ver)
            fs = f.status() if f is not None else self.fetch_history.get(ver, {})
            out.append(
                {
                    **v,
                    "bytes_served": self.server.bytes_served_by_version.get(ver, 0),
                    "bytes_fetched": fs.get("bytes_fetched", 0),
                    "fed_from": fs.get("fed_from", []),
                    "fed_from_bytes": {pid: p["bytes"] for pid, p in (fs.get("peers") or {}).items() if p.get("bytes")},
                    "fetching": f is not None,
                    "mib_per_s": round(f.mib_per_s(), 1) if f is not None else 0.0,
                }
            )
        return {
            "versions": out,
            "data_port": self.server.port,
            "bytes_served": self.server.bytes_served,
            "bytes_served_to": dict(self.server.bytes_served_to),
            "max_upload_mbps": self.server.bucket.rate * 8 / 1e6,
            "banned": sorted(self.banned),
        }
