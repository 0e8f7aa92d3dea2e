"""``Checkpoints``: the one object the roles use for checkpoints.

    checkpoints = Checkpoints(store, control, max_async=genesis.max_async, max_upload_mbps=...)
    async with trio.open_nursery() as n:
        await n.start(checkpoints.run)                    # chunk server + fetch manager
        # wiring from the P2P layer (node.roles.checkpoint_wiring.serve_checkpoints does this):
        reqresp.register(ChunkTicketRequest, lambda env, peer: checkpoints.grant_ticket(peer, env.body))
        checkpoints.on_announce_envelope(env)             # gossip: CheckpointAnnounce (already opened)
        checkpoints.on_heartbeat(peer_id, heartbeat)      # gossip: Heartbeat (have-sets)
        heartbeat(have=checkpoints.have_entries(), data_port=checkpoints.data_port,
                  policy_version=checkpoints.newest_version())
        # trainer:
        raw = await checkpoints.import_version(key, version, "ckpt/dir")   # gossip ``raw`` as the announce
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

Delta versions (protocol/delta.py) are fetched like any version (their one file
is small) and then applied to their base: a node that holds the base assembled
applies at once; one that does not (a late joiner, a node that fell behind)
walks the base chain down to an anchor, asks any peer for the trainer's signed
announce of each version it has not seen (``ManifestRequest``), fetches them
all from the swarm and applies them in order. A delta that is malformed, names
a base other than the one held, or does not rebuild the manifest's
``weights_root`` is refused with one log line and never loaded (``refused`` in
the status); the node keeps its last good version and takes the next anchor.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from node.checkpoints.control import ControlPlane
from node.checkpoints.delta import DeltaIncompatible, TensorChange, iter_changes
from node.checkpoints.fetcher import FetchProgress, VersionFetcher
from node.checkpoints.manifest import DEFAULT_CHUNK_SIZE, verify_announce
from node.checkpoints.server import ChunkServer
from node.checkpoints.store import BaseMissing, ChunkStore, VersionState
from protocol import (
    ChunkTicket,
    ChunkTicketRequest,
    Envelope,
    HaveEntry,
    Heartbeat,
    ManifestRequest,
    ManifestResponse,
    NodeKey,
    ProtocolError,
    ReplayGuard,
    ReverseChunkAnswer,
    ReverseChunkRequest,
)
from protocol.delta import parse_delta
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
MAX_REFUSED = 64  # refused versions remembered (status, not re-tried)
MANIFEST_TIMEOUT_S = 5.0  # one ManifestRequest
MANIFEST_RETRY_MAX_S = 5.0  # back-off between rounds over every known peer
CLAIM_GRACE_S = 15.0  # a version a heartbeat lists but no announce brought: ask peers after this
CLAIM_RETRY_S = 30.0  # a heartbeat's claim of a version nobody could back: not asked again before
MAX_UNRESOLVED = 256


class Checkpoints:
    """A node's checkpoints: its chunk store, the chunk server and the fetches of new versions."""

    def __init__(
        self,
        store: ChunkStore,
        control: ControlPlane,
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
        self.control = control
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
        self._reverse: set[str] = set()  # peers in ``_have`` behind NAT (they dial us)
        self._nursery: trio.Nursery | None = None
        self._fetch_scopes: dict[int, trio.CancelScope] = {}
        self._wanted: set[int] = set()  # older versions a role needs (bounded by the window)
        self._finishing: set[int] = set()  # versions being assembled
        self._changed = trio.Event()
        self._announced = trio.Event()  # set (and replaced) whenever a new version's manifest arrives
        # deltas: bases to fetch though older than the newest, deltas waiting for their
        # base (version -> base version), manifests being asked of peers, refusals
        self._chain: set[int] = set()
        self._waiting: dict[int, int] = {}
        self._resolving: set[tuple[int, bytes]] = set()
        self._unresolved: dict[tuple[int, bytes], float] = {}  # heartbeat claims nobody backed
        self._claims: dict[tuple[int, bytes], float] = {}  # heartbeat claims: first seen
        self.refused: dict[int, str] = {}
        self.deltas_applied = 0

    # ------------------------------------------------------------ lifecycle
    @property
    def data_port(self) -> int:
        return self.server.port

    async def run(self, task_status: TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.server.run)
            newest = self.store.newest()
            for st in self.store.versions.values():  # resume after a restart (the window's versions)
                if newest is not None and is_stale(st.version, newest.version, self.max_async):
                    continue
                if st.complete and not st.assembled:
                    self._finishing.add(st.version)
                    nursery.start_soon(self._finish, st.version)
            self._maybe_fetch()
            task_status.started(self.server.port)

    # ------------------------------------------------------------ inputs from the network
    def grant_ticket(self, peer_id: str, req: ChunkTicketRequest) -> ChunkTicket:
        if peer_id in self.banned:
            return ChunkTicket(ok=False, reason="banned", ticket=b"", host="", port=0, expires_ms=0)
        return self.server.grant_ticket(peer_id, req)

    def grant_reverse(
        self, peer_id: str, req: ReverseChunkRequest, allowed_hosts: Collection[str] | None = None
    ) -> ReverseChunkAnswer:
        """A reachable fetcher asks us (behind NAT) to dial its data port: see ChunkServer."""
        if peer_id in self.banned:
            return ReverseChunkAnswer(ok=False, reason="banned")
        return self.server.grant_reverse(peer_id, req, allowed_hosts)

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
        # Data port 0 with chunks listed: a holder behind NAT. It serves us only over a
        # connection it opens to our data port (reverse), so only while ours is reachable; a
        # NAT'd node ignores it, else rarest-first and super-seeding would count chunks it
        # cannot get.
        reverse = hb.data_port == 0
        if reverse and not (hb.have and self.server.reachable()):
            self._reverse.discard(peer_id)
            return
        if peer_id not in self._have and len(self._have) >= 2048:
            # bounded: drop have-sets not refreshed for a minute, else the oldest quarter
            now = trio.current_time()
            stale = [p for p, (t, _h) in self._have.items() if now - t > 60]
            for p in stale or sorted(self._have, key=lambda p: self._have[p][0])[: len(self._have) // 4]:
                del self._have[p]
                self._reverse.discard(p)
        self._have[peer_id] = (trio.current_time(), hb.have)
        if reverse:
            self._reverse.add(peer_id)
        else:
            self._reverse.discard(peer_id)
        for f in self.fetchers.values():
            # a peer that serves chunks but does not list this version yet probably
            # just heard of it too: try it (its HAVE replies tell us what it holds)
            f.add_peer(peer_id, reverse=reverse)
        newest = self.store.newest()
        for e in hb.have:
            fetcher = self.fetchers.get(e.version)
            if fetcher is not None and fetcher.st.root == e.root:
                fetcher.update_have(peer_id, e.bitmap)
            elif (newest is None or e.version > newest.version) and e.version not in self.store.versions:
                self._on_claim(e.version, e.root)

    def _on_claim(self, version: int, root: bytes) -> None:
        """A peer's heartbeat lists a version this node never heard announced. Usually the
        announce is on its way by gossip; if it has not come ``CLAIM_GRACE_S`` after the
        first such heartbeat (the node joined late, or the trainer is gone), ask the peers
        that list it for the trainer's announce."""
        key = (version, root)
        now = trio.current_time()
        first = self._claims.setdefault(key, now)
        if len(self._claims) > MAX_UNRESOLVED:
            newest = self.store.newest()
            for k in [k for k in self._claims if k[0] in self.store.versions or (newest and k[0] <= newest.version)]:
                del self._claims[k]
            while len(self._claims) > MAX_UNRESOLVED:
                del self._claims[next(iter(self._claims))]
        if now - first >= CLAIM_GRACE_S:
            self._resolve(version, root, claimed=True)

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
        self._plan_chain(self._wanted | {newest.version})
        for v, scope in list(self._fetch_scopes.items()):
            if v < newest.version and v not in self._wanted and v not in self._chain:
                scope.cancel()
        for v in sorted(self._wanted | self._chain | {newest.version}):
            self._ensure_fetch(v)

    def _plan_chain(self, versions: Iterable[int]) -> None:
        """The bases ``versions`` need before they can be applied, down to something
        assembled or an anchor: fetched though older than the newest (``_chain``);
        a base this node has never heard of is asked of the peers."""
        self._chain = {v for v in self._chain if v in self.store.versions and not self.store.versions[v].assembled}
        for v in versions:
            st = self.store.versions.get(v)
            while st is not None and st.delta is not None and not st.assembled and st.version not in self.refused:
                ref = st.delta
                base = self.store.versions.get(ref.base_version)
                if base is None:
                    self._resolve(ref.base_version, ref.base_root)
                    break
                if base.root != ref.base_root or base.assembled:
                    break  # a wrong base is refused when the delta is applied
                self._chain.add(base.version)
                st = base

    def _resolve(self, version: int, root: bytes, claimed: bool = False) -> None:
        """Get the trainer's announce of ``version`` from peers, in a task. ``claimed``: only a
        heartbeat says it exists (free to forge), so only the peers listing it are asked, once,
        and a claim nobody could back is not chased again for ``CLAIM_RETRY_S``."""
        key = (version, root)
        if key in self._resolving or self._nursery is None:
            return
        if claimed and trio.current_time() - self._unresolved.get(key, -1e9) < CLAIM_RETRY_S:
            return
        self._resolving.add(key)
        self._nursery.start_soon(self._resolve_manifest, version, root, claimed)

    def _is_base(self, version: int, root: bytes) -> bool:
        return any(
            st.delta is not None and (st.delta.base_version, st.delta.base_root) == (version, root)
            for st in self.store.versions.values()
        )

    def _needs_manifest(self, version: int, root: bytes) -> bool:
        """Not held, and either a delta's base or newer than anything held."""
        if version in self.store.versions:
            return False
        newest = self.store.newest()
        return newest is None or version > newest.version or self._is_base(version, root)

    async def _resolve_manifest(self, version: int, root: bytes, claimed: bool) -> None:
        """Ask peers (those listing the version first) for the trainer's announce of
        ``version`` until one gives it or nothing needs it any more (a version only a
        heartbeat claimed: one round over the peers listing it). A peer answering with
        anything but that exact, trainer-signed announce is charged ``bad_manifest``."""
        delay = 0.25
        try:
            while self._needs_manifest(version, root):
                holders = [
                    p
                    for p, (_t, have) in self._have.items()
                    if any(e.version == version and e.root == root for e in have)
                ]
                others = (
                    [] if claimed else [p for p in list(self._have) + sorted(self._static_peers) if p not in holders]
                )
                for pid in dict.fromkeys(holders + others):
                    if pid in self.banned or not self._needs_manifest(version, root):
                        continue
                    try:
                        resp = await self.control.request_manifest(
                            pid, ManifestRequest(version=version, root=root), MANIFEST_TIMEOUT_S
                        )
                    except Exception as exc:  # unreachable, timeout, error answer: try the next peer
                        log.debug("manifest %d from %s: %s", version, pid[:12], exc)
                        continue
                    if not resp.found:
                        continue
                    try:
                        m, _env = verify_announce(resp.envelope, self.store.run_id, self.store.trainer, guard=None)
                        if (m.version, m.root) != (version, root):
                            raise ProtocolError("manifest.mismatch", f"asked for version {version}, got {m.version}")
                        self.store.add_announce(resp.envelope, guard=None)
                    except ProtocolError as exc:
                        log.warning(
                            "peer %s answered the manifest of version %d with bad bytes: %s", pid[:12], version, exc
                        )
                        self.control.penalise(pid, "bad_manifest")
                        continue
                    log.info("got the manifest of version %d from peer %s (base chain of a delta)", version, pid[:12])
                    self._maybe_fetch()
                    return
                if claimed and not self._is_base(version, root):
                    self._unresolved[(version, root)] = trio.current_time()
                    while len(self._unresolved) > MAX_UNRESOLVED:
                        del self._unresolved[next(iter(self._unresolved))]
                    return
                await trio.sleep(delay)
                delay = min(MANIFEST_RETRY_MAX_S, delay * 2)
        finally:
            self._resolving.discard((version, root))

    def _ensure_fetch(self, version: int) -> None:
        """Fetch (or assemble) ``version`` unless that is done or under way."""
        st = self.store.versions.get(version)
        if st is None or version in self.fetchers or st.assembled or version in self.refused:
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
            self.store,
            version,
            self.control,
            banned=self.banned,
            on_progress=self._on_progress,
            reverse=self.server,
            **self.fetcher_options,
        )
        self.fetchers[version] = f
        st = f.st
        for pid, (_, have) in self._have.items():
            f.add_peer(pid, reverse=pid in self._reverse)
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
            st = self.store.versions.get(version)
            if st is None or version in self.refused:
                return
            try:
                await self.store.assemble(version)
            except BaseMissing as exc:
                if exc.base_version in self.refused:
                    self._refuse(
                        version, ProtocolError("delta.base", f"its base, version {exc.base_version}, was refused")
                    )
                    return
                self._waiting[version] = exc.base_version  # applied once the base is
                self._maybe_fetch()
                return
            except ProtocolError as exc:
                self._refuse(version, exc)
                return
        finally:
            self._finishing.discard(version)
        if st.delta is not None:
            self.deltas_applied += 1
            log.info("version %d: applied the delta on version %d, result hash checked", version, st.delta.base_version)
        self._wanted.discard(version)
        self._chain.discard(version)
        for v, base in sorted(self._waiting.items()):
            if base == version:
                del self._waiting[v]
                self._ensure_fetch(v)  # complete: applies it now
        self.gc()
        self._changed.set()
        self._changed = trio.Event()

    def _refuse(self, version: int, exc: ProtocolError) -> None:
        """Never load ``version``; deltas waiting on it go with it. The chunks matched the
        trainer-signed hashes, so no peer relayed anything but what the trainer signed:
        nobody is charged here (a bad chunk was charged to its sender when it arrived)."""
        self.refused[version] = f"{exc.rule}: {exc.detail}"
        while len(self.refused) > MAX_REFUSED:
            del self.refused[min(self.refused)]
        log.warning(
            "refused checkpoint version %d (%s: %s); it is never loaded, the node keeps version %d and waits for an anchor",
            version,
            exc.rule,
            exc.detail,
            self.newest_version(),
        )
        for v, base in sorted(self._waiting.items()):
            if base == version:
                del self._waiting[v]
                self._refuse(v, ProtocolError("delta.base", f"its base, version {version}, was refused"))
        self._changed.set()
        self._changed = trio.Event()

    def _on_progress(self, p: FetchProgress) -> None:
        for cb in list(self.progress_callbacks):
            cb(p)

    # ------------------------------------------------------------ roles' API
    async def import_version(
        self,
        key: NodeKey,
        version: int,
        src_dir: Path | str,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        *,
        delta_base: int | None = None,
        max_delta_fraction: float = 0.5,
    ) -> bytes:
        """Trainer: import a directory of safetensors files as ``version``, chunked and signed;
        return the signed announce (gossiping it is publishing: ``publish_checkpoint`` in
        node/roles/checkpoint_wiring.py does both). With ``delta_base`` (an assembled earlier
        version) it is stored as a delta against that version, unless the delta cannot express the change or is not
        smaller than ``max_delta_fraction`` of the full checkpoint: then as a full anchor."""
        raw = None
        base = self.store.versions.get(delta_base) if delta_base is not None else None
        if base is not None:
            try:
                with self.store.pin(base.version):
                    _, raw, stats = await trio.to_thread.run_sync(
                        self.store.import_delta_blocking, key, version, src_dir, base, chunk_size, max_delta_fraction
                    )
                log.info(
                    "version %d: delta on version %d, %d bytes (%.2f%% of %d; %.3f%% of elements changed; encoded in %.2f s)",
                    version,
                    base.version,
                    stats.delta_bytes,
                    100 * stats.delta_bytes / max(1, stats.full_bytes),
                    stats.full_bytes,
                    100 * stats.changed_fraction,
                    stats.seconds,
                )
            except DeltaIncompatible as exc:
                log.info("version %d: publishing a full anchor (%s)", version, exc)
        if raw is None:
            _, raw = await trio.to_thread.run_sync(
                self.store.import_directory_blocking, key, version, src_dir, chunk_size
            )
        assert raw is not None
        self.store.add_announce(raw, guard=None)
        await self._finish(version)
        return raw

    def serve_manifest(self, req: ManifestRequest) -> ManifestResponse:
        """Answer a peer's ``ManifestRequest`` with the trainer's announce, byte for byte."""
        st = self.store.get(req.version, req.root)
        return ManifestResponse(found=st is not None, envelope=st.raw if st is not None else b"")

    def delta_chain(self, version: int, loaded: int, *, base_files: bool = True) -> list[VersionState] | None:
        """The versions after ``loaded`` up to ``version``, oldest first, when each is a delta
        on the one before that was applied here and checked, and ``loaded`` is held under the
        root the first names; else None. ``base_files``: every link's base must still have
        its full files (decoding a link needs its base's bits).

        A validator on a committee replays only some versions' batches, so the version in
        its engine is often a few behind the one it needs; while no anchor (a full version)
        lies between them it can still move there in place, link by link. Links behind the
        window whose full files GC released (``chain.gc_plan``) still count when no base
        files are needed: reading whole tensors from the newest files needs only each link's
        records, and its delta file stays."""
        chain: list[VersionState] = []
        v = version
        while v != loaded:
            st = self.store.versions.get(v)
            if st is None or st.delta is None or not st.applied or st.delta.base_version < loaded:
                return None
            base = self.store.base_of(st)
            if base is None or base.root != st.delta.base_root or (base_files and not base.assembled):
                return None
            chain.append(st)
            v = base.version
        return chain[::-1] or None

    async def delta_changes(self, version: int, loaded: int, *, values: bool = True) -> list[Any] | None:
        """The tensors to write to move an engine holding ``loaded`` to ``version`` in place,
        when ``version`` is reached from ``loaded`` by applied deltas only
        (:meth:`delta_chain`), else None (the role does a full load).

        Decoded ``TensorChange`` objects, each link's in order (a later link's elements
        overwrite an earlier one's); or with ``values=False`` the links' records, one per
        tensor, for an engine that reloads whole tensors from ``version``'s files: a tensor
        no link names is the same in ``loaded`` and ``version`` (each link was applied to its
        base and the result checked against the trainer's signed ``weights_root``, so its
        records need no second check against the base)."""
        chain = self.delta_chain(version, loaded, base_files=values)
        if chain is None:
            return None
        out: list[Any] = []
        named: set[tuple[str, str]] = set()
        with contextlib.ExitStack() as pins:
            for st in chain:
                pins.enter_context(self.store.pin(st.version))
            pins.enter_context(self.store.pin(loaded))
            for st in chain:
                data = await trio.to_thread.run_sync(self.store.delta_bytes_blocking, st)
                if not values:
                    for r in await trio.to_thread.run_sync(parse_delta, data):
                        if (r.path, r.name) not in named:
                            named.add((r.path, r.name))
                            out.append(r)
                    continue
                base = self.store.base_of(st)
                assert base is not None  # delta_chain checked it
                out += await trio.to_thread.run_sync(_decoded, data, self.store.version_files(base))
        return out

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

    async def wait_outcome(self, version: int) -> str | None:
        """Wait until ``version`` is assembled (None) or refused (the reason)."""
        while True:
            if version in self.refused:
                return self.refused[version]
            st = self.store.versions.get(version)
            if st is not None and st.assembled:
                return None
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
        if len(srv.reverse_served_to) > SERVED_TO_PEERS:  # fetcher hosts we dialled, likewise
            keep = dict(srv.reverse_served_to.most_common(SERVED_TO_PEERS // 2))
            srv.reverse_served_to.clear()
            srv.reverse_served_to.update(keep)

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
                    # where the fetch's time went (VersionFetcher.phases), and its hashing/writing
                    "phases": fs.get("phases", {}),
                    "verify_s": fs.get("verify_s", 0.0),
                }
            )
        return {
            "versions": out,
            "refused": {str(v): why for v, why in sorted(self.refused.items())},
            "deltas_applied": self.deltas_applied,
            "data_port": self.server.port,
            "bytes_served": self.server.bytes_served,
            "bytes_served_to": dict(self.server.bytes_served_to),
            # over connections this node opened (behind NAT) / counters of reverse connections
            "bytes_served_reverse": self.server.bytes_served_reverse,
            "reverse": dict(self.server.reverse),
            "max_upload_mbps": self.server.bucket.rate * 8 / 1e6,
            "banned": sorted(self.banned),
        }


def _decoded(data: bytes | memoryview, files: dict[str, Path]) -> list[TensorChange]:
    """Every changed element of one delta, decoded against its base's files (worker thread)."""
    return list(iter_changes(data, files))
