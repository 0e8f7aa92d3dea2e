"""The content-addressed chunk store in the node home.

Layout (under ``HOME/chunks``)::

    objects/<h[:2]>/<sha256 hex>     one verified chunk, named by its hash
    tmp/                             writes in progress (emptied at open)
    versions/<version>-<root[:8]>/
        announce                     the trainer's signed CheckpointAnnounce, verbatim
        files/<path>                 the assembled safetensors files (once complete); for a
                                     delta version, the full files applying it rebuilt

Crash safety: a chunk is written to ``tmp/``, fsynced, then renamed into
``objects/`` - a name in ``objects/`` always holds a complete, verified chunk.
Chunk objects and assembled files are written with ``O_DIRECT`` where the
filesystem allows it (directio.py says why: fresh page-cache pages are the
dominant cost of receiving on a virtual machine), buffered elsewhere.
After a restart the store rebuilds every version's bitmap from the names in
``objects/`` (and their sizes) and re-checks each stored announce against the
trainer's key; nothing is downloaded again.  Assembled files are written the
same way (``files.tmp/`` then one rename).

Content addressing means a chunk shared by two versions (an unchanged tensor)
is stored and fetched once.

Delta versions (protocol/delta.py) hold one delta file as chunks; "assembling"
one applies it to its base's files and checks the result against the
manifest's ``weights_root`` before the rename into ``files/`` (so a crash or a
refusal never leaves a loadable wrong version). GC keeps the window's versions
and their base chain down to the newest anchor, for late joiners.

Thread model: the index (versions, bitmaps, pins) lives on the trio thread;
``*_blocking`` methods do disk work and hashing and are meant for
``trio.to_thread.run_sync``; they never touch the index.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import trio

from node.checkpoints import directio
from node.checkpoints.delta import DeltaIncompatible, DeltaStats, apply_delta, encode_delta
from node.checkpoints.directio import Buffer, DirectIOUnsupported
from node.checkpoints.manifest import (
    DEFAULT_CHUNK_SIZE,
    accept_announce,
    build_manifest,
    checkpoint_files,
    sign_announce,
    verify_announce,
)
from node.util import fsync_dir
from protocol import (
    CheckpointManifest,
    DeltaRef,
    Envelope,
    FileEntry,
    HaveEntry,
    NodeKey,
    ProtocolError,
    ReplayGuard,
)
from protocol.bitmap import Bitmap
from protocol.delta import DELTA_FILE
from protocol.rules import is_stale

log = logging.getLogger(__name__)


class BaseMissing(Exception):
    """A delta version cannot be materialized yet: its base is not here, or not assembled.

    Control flow for the service (fetch the base chain, then retry), never an error."""

    def __init__(self, version: int, base_version: int) -> None:
        super().__init__(f"delta version {version} needs version {base_version} first")
        self.version = version
        self.base_version = base_version


class ChunkRejected(Exception):
    """A chunk from a peer that does not match the manifest (size or hash).

    Control flow between the store and the fetcher (the sender gets a strike), never
    shown to an operator: not a :class:`node.errors.NodeError`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass
class VersionState:
    manifest: CheckpointManifest
    raw: bytes  # the trainer's announce envelope bytes
    dirname: str
    bitmap: Bitmap
    chunks: list[tuple[str, int, int, bytes]]  # (path, offset, length, sha256) per global index
    by_hash: dict[bytes, list[int]]
    pins: int = 0
    assembled: bool = False
    added_at: float = dataclasses.field(default_factory=time.time)

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def root(self) -> bytes:
        return self.manifest.root

    @property
    def complete(self) -> bool:
        return self.bitmap.complete

    @property
    def delta(self) -> DeltaRef | None:
        """Set for a delta version (its files are one delta file), None for an anchor."""
        return self.manifest.delta


def _version_dirname(m: CheckpointManifest) -> str:
    return f"{m.version:010d}-{m.root.hex()[:16]}"


class ChunkStore:
    """Chunks, manifests and assembled files of a run's checkpoint versions."""

    def __init__(
        self, root: Path | str, run_id: bytes, trainer: str, durable: bool = True, direct_io: bool = True
    ) -> None:
        self.root = Path(root)
        self.run_id = run_id
        self.trainer = trainer
        self.durable = durable
        # O_DIRECT writes; switched off for good the first time the filesystem refuses them
        self.direct_io = direct_io
        self.objects = self.root / "objects"
        self.tmp = self.root / "tmp"
        self.versions_dir = self.root / "versions"
        # versions GC never drops: version 0 of a run whose genesis pins the model, which
        # late joiners fetch whatever the newest version is (roles/common.py)
        self.keep: set[int] = set()
        for d in (self.objects, self.tmp, self.versions_dir):
            d.mkdir(parents=True, exist_ok=True)
        for p in self.tmp.iterdir():  # leftovers of a crash: never trusted
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        self.versions: dict[int, VersionState] = {}
        self._tmp_counter = itertools.count()
        self._tmp_lock = threading.Lock()
        self._load()

    # ------------------------------------------------------------ index
    def _load(self) -> None:
        for d in sorted(self.versions_dir.iterdir()):
            ann = d / "announce"
            try:
                manifest, _ = verify_announce(ann.read_bytes(), self.run_id, self.trainer, guard=None)
                if _version_dirname(manifest) != d.name:
                    raise ProtocolError("store", "directory name does not match the manifest")
            except (OSError, ProtocolError) as exc:
                log.warning("dropping stored version %s: %s", d.name, exc)
                shutil.rmtree(d, ignore_errors=True)
                continue
            st = self._index(manifest, ann.read_bytes())
            if (d / "files").is_dir():
                st.assembled = st.complete
            shutil.rmtree(d / "files.tmp", ignore_errors=True)

    def _index(self, manifest: CheckpointManifest, raw: bytes) -> VersionState:
        chunks = manifest.chunks()
        by_hash: dict[bytes, list[int]] = {}
        for i, (_, _, _, h) in enumerate(chunks):
            by_hash.setdefault(h, []).append(i)
        bm = Bitmap(len(chunks))
        for h, idxs in by_hash.items():
            try:
                size = self.object_path(h).stat().st_size
            except FileNotFoundError:
                continue
            if size == chunks[idxs[0]][2]:
                for i in idxs:
                    bm.set(i)
        st = VersionState(manifest, raw, _version_dirname(manifest), bm, chunks, by_hash)
        self.versions[manifest.version] = st
        return st

    def add_announce(
        self, raw: bytes, now_ms: int | None = None, guard: ReplayGuard | None = None
    ) -> tuple[VersionState, bool]:
        """Verify the trainer's announce bytes and remember the version. Returns (state, is_new).

        Raises ProtocolError for anything not signed by the run's trainer, or a
        second, different manifest for a version already known.
        """
        manifest, _ = verify_announce(raw, self.run_id, self.trainer, now_ms=now_ms, guard=guard)
        return self._add(manifest, raw)

    def add_envelope(self, env: Envelope[Any]) -> tuple[VersionState, bool]:
        """Same as :meth:`add_announce` for an envelope the P2P layer already opened."""
        return self._add(accept_announce(env, self.run_id, self.trainer), env.raw)

    def _add(self, manifest: CheckpointManifest, raw: bytes) -> tuple[VersionState, bool]:
        old = self.versions.get(manifest.version)
        if old is not None:
            if old.root != manifest.root:
                raise ProtocolError("manifest.conflict", f"version {manifest.version} already known with another root")
            return old, False
        d = self.versions_dir / _version_dirname(manifest)
        d.mkdir(parents=True, exist_ok=True)
        self._atomic_write(d / "announce", raw)
        return self._index(manifest, raw), True

    def get(self, version: int, root: bytes | None = None) -> VersionState | None:
        st = self.versions.get(version)
        if st is None or (root is not None and st.root != root):
            return None
        return st

    def newest(self, complete_only: bool = False) -> VersionState | None:
        vs = [v for v in self.versions.values() if v.complete or not complete_only]
        return max(vs, key=lambda v: v.version) if vs else None

    def have_entries(self, limit: int = 8) -> tuple[HaveEntry, ...]:
        """The newest ``limit`` versions as heartbeat have-entries."""
        vs = sorted(self.versions.values(), key=lambda v: -v.version)[:limit]
        return tuple(HaveEntry(version=v.version, root=v.root, bitmap=v.bitmap.to_bytes()) for v in vs)

    # ------------------------------------------------------------ chunks
    def object_path(self, h: bytes) -> Path:
        x = h.hex()
        return self.objects / x[:2] / x

    def mark_held(self, h: bytes) -> list[tuple[int, int]]:
        """Record that the object ``h`` exists; returns the (version, index) pairs that became held."""
        newly = []
        for st in self.versions.values():
            for i in st.by_hash.get(h, ()):
                if st.bitmap.set(i):
                    newly.append((st.version, i))
        return newly

    def check_chunk_blocking(self, st: VersionState, index: int, data: Buffer) -> bytes:
        """Size and hash check of a received chunk (blocking: hashes). Returns the hash."""
        _, _, length, h = st.chunks[index]
        if len(data) != length:
            raise ChunkRejected(f"chunk {index}: {len(data)} bytes, manifest says {length}")
        if hashlib.sha256(data).digest() != h:
            raise ChunkRejected(f"chunk {index}: sha256 does not match the manifest")
        return h

    def write_object_blocking(self, h: bytes, data: Buffer) -> None:
        """Atomically store a verified chunk (temp + fsync + rename). Idempotent."""
        final = self.object_path(h)
        if final.exists():
            return
        final.parent.mkdir(exist_ok=True)
        self._atomic_write(final, data)

    def put_chunk_blocking(self, st: VersionState, index: int, data: Buffer) -> bytes:
        """Check and store one chunk (blocking). Raise ChunkRejected if it is wrong."""
        h = self.check_chunk_blocking(st, index, data)
        self.write_object_blocking(h, data)
        return h

    def read_chunk_blocking(self, st: VersionState, index: int) -> bytes:
        return self.object_path(st.chunks[index][3]).read_bytes()

    def _direct_refused(self, exc: DirectIOUnsupported) -> None:
        if self.direct_io:
            self.direct_io = False
            log.info("chunk store %s: %s; using buffered writes", self.root, exc)

    def _atomic_write(self, final: Path, data: Buffer) -> None:
        with self._tmp_lock:
            n = next(self._tmp_counter)
        tmp = self.tmp / f"{final.name}.{os.getpid()}.{n}"
        if self.direct_io:
            try:
                directio.write_new_file(tmp, data, durable=self.durable)
            except DirectIOUnsupported as exc:
                self._direct_refused(exc)
            else:
                os.replace(tmp, final)
                return
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                w = os.write(fd, view)
                view = view[w:]
            if self.durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, final)

    # ------------------------------------------------------------ publishing
    def import_directory_blocking(
        self, key: NodeKey, version: int, src_dir: Path | str, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> tuple[CheckpointManifest, bytes]:
        """Trainer side: chunk, hash and store a directory of safetensors files; sign the manifest.

        Blocking (reads and writes every byte): run it in a thread. Call
        :meth:`add_announce` with the returned bytes on the trio thread.
        """
        if key.peer_id != self.trainer:
            raise ValueError("only the run's trainer can publish a checkpoint")
        manifest = build_manifest(
            self.run_id, version, src_dir, chunk_size, on_chunk=lambda h, data: self.write_object_blocking(h, data)
        )
        return manifest, sign_announce(key, manifest)

    def import_delta_blocking(
        self,
        key: NodeKey,
        version: int,
        src_dir: Path | str,
        base: VersionState,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        max_fraction: float = 0.5,
    ) -> tuple[CheckpointManifest, bytes, DeltaStats]:
        """Trainer side: publish ``src_dir`` as a delta against ``base`` (assembled here).

        Raises DeltaIncompatible when a delta cannot express the change or would not
        be smaller than ``max_fraction`` of the full checkpoint: publish an anchor.
        Blocking: run it in a thread, then :meth:`add_announce` the bytes."""
        if key.peer_id != self.trainer:
            raise ValueError("only the run's trainer can publish a checkpoint")
        if not base.assembled:
            raise DeltaIncompatible(f"base version {base.version} is not assembled here")
        src = dict(checkpoint_files(src_dir))
        full_bytes = sum(p.stat().st_size for p in src.values())
        data, stats = encode_delta(self.version_files(base), src, max_bytes=int(max_fraction * full_bytes))
        if stats.delta_bytes >= max_fraction * stats.full_bytes:
            raise DeltaIncompatible(
                f"the delta is {stats.delta_bytes} bytes, not under {max_fraction:g} of the full {stats.full_bytes}"
            )
        full = build_manifest(self.run_id, version, src_dir, chunk_size, created_ms=0)
        ref = DeltaRef(base_version=base.version, base_root=base.root, weights_root=full.root)
        with self._tmp_lock:
            n = next(self._tmp_counter)
        ddir = self.tmp / f"delta-{version}.{os.getpid()}.{n}"
        ddir.mkdir()
        try:
            (ddir / DELTA_FILE).write_bytes(data)
            manifest = build_manifest(
                self.run_id,
                version,
                ddir,
                chunk_size,
                on_chunk=lambda h, chunk: self.write_object_blocking(h, chunk),
                delta=ref,
            )
        finally:
            shutil.rmtree(ddir, ignore_errors=True)
        # Apply it here exactly as every receiver will, and check the result before signing:
        # a delta that does not rebuild the export is never announced (an anchor is).
        vdir = self.versions_dir / _version_dirname(manifest)
        vdir.mkdir(parents=True, exist_ok=True)
        tmp = vdir / "files.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        hashes = apply_delta(
            self.version_files(base), data, tmp, chunk_size=chunk_size, durable=self.durable, direct=self.direct_io
        )
        if self._rebuilt_root(version, chunk_size, tmp, hashes) != full.root:
            shutil.rmtree(vdir, ignore_errors=True)
            raise DeltaIncompatible("applying the delta did not rebuild the export (an encoder bug): anchor instead")
        os.replace(tmp, vdir / "files")  # the announce is written next; without it _load drops the folder
        return manifest, sign_announce(key, manifest), stats

    # ------------------------------------------------------------ assembly / loading
    def files_dir(self, version: int) -> Path:
        return self.versions_dir / self.versions[version].dirname / "files"

    def version_files(self, st: VersionState) -> dict[str, Path]:
        """``{path: file}`` of an assembled version's full weights. An anchor's are its
        manifest's files; a delta version's are the files applying it gave (the base's
        paths: a delta never adds or removes a file)."""
        d = self.versions_dir / st.dirname / "files"
        if st.delta is None:
            return {f.path: d / f.path for f in st.manifest.files}
        return dict(checkpoint_files(d))

    def delta_bytes_blocking(self, st: VersionState) -> bytes:
        """The delta file of a complete delta version, from its chunk objects."""
        names = [f.path for f in st.manifest.files]
        if names != [DELTA_FILE]:
            raise ProtocolError("delta.format", f"a delta version holds the one file {DELTA_FILE}, not {names[:4]}")
        data = b"".join(self.object_path(h).read_bytes() for h in st.manifest.files[0].chunk_hashes)
        if len(data) != st.manifest.files[0].size:
            raise ProtocolError("delta.format", "the delta file's chunks do not add up to its size")
        return data

    def assemble_blocking(
        self,
        st: VersionState,
        base: VersionState | None = None,
        on_block: Callable[[str, int], None] | None = None,
    ) -> Path:
        """Write the version's files: an anchor's from its chunks (byte-identical to the
        trainer's), a delta version's by applying it to ``base``'s files and checking the
        result against the manifest's ``weights_root`` (ProtocolError ``delta.*`` if
        anything is off: nothing is renamed into place, so nothing loads it)."""
        d = self.versions_dir / st.dirname
        final = d / "files"
        if final.is_dir():
            return final
        if not st.complete:
            raise RuntimeError(f"version {st.version} is incomplete ({st.bitmap.count}/{st.bitmap.n} chunks)")
        tmp = d / "files.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        if st.delta is not None:
            try:
                self._apply_blocking(st, base, tmp, on_block)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            os.replace(tmp, final)
            if self.durable:
                fsync_dir(d)
            return final
        if self.direct_io:
            try:
                self._write_files(st, tmp, direct=True)
            except DirectIOUnsupported as exc:
                self._direct_refused(exc)
                shutil.rmtree(tmp, ignore_errors=True)
        if not self.direct_io:
            self._write_files(st, tmp, direct=False)
        os.replace(tmp, final)
        if self.durable:
            fsync_dir(d)
        return final

    def _apply_blocking(
        self, st: VersionState, base: VersionState | None, out: Path, on_block: Callable[[str, int], None] | None
    ) -> None:
        ref = st.delta
        assert ref is not None
        if base is None or base.version != ref.base_version:
            raise BaseMissing(st.version, ref.base_version)
        if base.root != ref.base_root:
            raise ProtocolError(
                "delta.base",
                f"delta version {st.version} names base {ref.base_version} with root {ref.base_root.hex()[:16]}, "
                f"this node holds it with root {base.root.hex()[:16]}",
            )
        if not (self.versions_dir / base.dirname / "files").is_dir():
            raise BaseMissing(st.version, ref.base_version)
        data = self.delta_bytes_blocking(st)
        cs = st.manifest.chunk_size
        hashes = apply_delta(
            self.version_files(base),
            data,
            out,
            chunk_size=cs,
            durable=self.durable,
            direct=self.direct_io,
            on_block=on_block,
        )
        got = self._rebuilt_root(st.version, cs, out, hashes)
        if got != ref.weights_root:
            raise ProtocolError(
                "delta.result",
                f"version {st.version} rebuilt from {ref.base_version} hashes to {got.hex()[:16]}, "
                f"the manifest says {ref.weights_root.hex()[:16]}",
            )

    def _rebuilt_root(self, version: int, chunk_size: int, out: Path, hashes: dict[str, list[bytes]]) -> bytes:
        """The anchor root of files a delta rebuilt, from the chunk hashes applying it computed
        (files in ``checkpoint_files`` order, exactly as ``build_manifest`` lists them)."""
        entries = []
        for rel, path in checkpoint_files(out):
            if rel not in hashes:
                raise ProtocolError("delta.result", f"{rel} appeared while applying")
            entries.append(FileEntry(path=rel, size=path.stat().st_size, chunk_hashes=tuple(hashes[rel])))
        return CheckpointManifest.compute_root(self.run_id, version, chunk_size, tuple(entries))

    def _write_files(self, st: VersionState, tmp: Path, *, direct: bool) -> None:
        """The version's files under ``tmp``, chunk by chunk: O_DIRECT reads and writes, or
        ``copy_file_range`` through the page cache."""
        idx = 0
        for f in st.manifest.files:
            out = tmp / f.path
            out.parent.mkdir(parents=True, exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            fd = directio.open_direct(out, flags) if direct else os.open(out, flags, 0o644)
            try:
                pos = 0
                for h in f.chunk_hashes:
                    length = st.chunks[idx][2]
                    if direct:
                        with directio.read_file_into(self.object_path(h), length) as data:
                            directio.pwrite_direct(fd, data, pos)
                    else:
                        self._copy_object(h, fd, pos, length)
                    pos += length
                    idx += 1
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def _copy_object(self, h: bytes, fd: int, pos: int, length: int) -> None:
        src = os.open(self.object_path(h), os.O_RDONLY)
        try:
            copied = 0
            while copied < length:
                n = os.copy_file_range(src, fd, length - copied, copied, pos + copied)
                if n == 0:
                    raise OSError(f"chunk object {h.hex()} is short")
                copied += n
        finally:
            os.close(src)

    def base_of(self, st: VersionState) -> VersionState | None:
        """The version a delta applies to, if this store holds that version (any root)."""
        return None if st.delta is None else self.versions.get(st.delta.base_version)

    async def assemble(self, version: int) -> Path:
        """Assemble (anchor) or apply and check (delta) ``version``. A delta raises
        BaseMissing while its base is not assembled here, ProtocolError if it is refused."""
        st = self.versions[version]
        base = self.base_of(st)
        if st.delta is not None and (base is None or (base.root == st.delta.base_root and not base.assembled)):
            raise BaseMissing(version, st.delta.base_version)
        with self.pin(version), self.pin(base.version) if base is not None else contextlib.nullcontext():
            path = await trio.to_thread.run_sync(self.assemble_blocking, st, base)
        st.assembled = True
        return path

    @contextlib.contextmanager
    def pin(self, version: int) -> Iterator[VersionState]:
        """Keep ``version`` safe from GC while the block runs (serving, loading)."""
        st = self.versions.get(version)
        if st is None:
            raise KeyError(f"version {version} is not in the store")
        st.pins += 1
        try:
            yield st
        finally:
            st.pins -= 1

    @contextlib.contextmanager
    def open_version(self, version: int) -> Iterator[dict[str, Path]]:
        """Pin an assembled version and give its files: ``{manifest path: file on disk}``."""
        with self.pin(version) as st:
            if not st.assembled:
                raise RuntimeError(f"version {version} is not assembled yet")
            yield self.version_files(st)

    # ------------------------------------------------------------ garbage collection
    def gc(self, max_async: int) -> list[int]:
        """Drop versions behind the ``max_async`` window unless pinned; delete unreferenced chunks.

        The window is counted from the newest version known (complete or not).
        Returns the versions removed.
        """
        newest = self.newest()
        if newest is None:
            return []
        keep = {v for v, st in self.versions.items() if st.pins or not is_stale(v, newest.version, max_async)}
        keep |= {v for v in self.keep if v in self.versions}  # pinned for late joiners (a run's version 0)
        keep |= self.chain(keep)
        removed = []
        for v, st in sorted(self.versions.items()):
            if v not in keep:
                del self.versions[v]  # from now on nobody can pin it
                removed.append((v, st))
        for v in sorted(keep):
            st = self.versions[v]
            if is_stale(v, newest.version, max_async) and st.assembled and st.pins == 0 and v not in self.keep:
                self._drop_files_if_unneeded(st)
        for _v, st in removed:
            shutil.rmtree(self.versions_dir / st.dirname, ignore_errors=True)
        if removed:
            live: set[bytes] = set()
            for st in self.versions.values():
                live.update(st.by_hash)
            for sub in self.objects.iterdir():
                for obj in sub.iterdir():
                    try:
                        h = bytes.fromhex(obj.name)
                    except ValueError:
                        h = b""
                    if h not in live:
                        obj.unlink(missing_ok=True)
        return [v for v, _ in removed]

    def chain(self, versions: set[int]) -> set[int]:
        """The base chain of ``versions``: every earlier version held here that one of them
        (or one of those, and so on, down to an anchor) applies to. Kept by GC so a late
        joiner can fetch the newest anchor and every delta after it from any peer."""
        out: set[int] = set()
        stack = sorted(versions)
        while stack:
            st = self.versions.get(stack.pop())
            ref = st.delta if st is not None else None
            if ref is None:
                continue
            b = self.versions.get(ref.base_version)
            if b is not None and b.root == ref.base_root and b.version not in out and b.version not in versions:
                out.add(b.version)
                stack.append(b.version)
        return out

    def _drop_files_if_unneeded(self, st: VersionState) -> None:
        """A chain version behind the window keeps its chunks (to serve) but not its full
        files, once every delta applying to it has been applied."""
        users = [u for u in self.versions.values() if u.delta is not None and u.delta.base_version == st.version]
        if not users or not all(u.assembled for u in users):
            return
        st.assembled = False
        shutil.rmtree(self.versions_dir / st.dirname / "files", ignore_errors=True)

    # ------------------------------------------------------------ status
    def status(self) -> list[dict[str, Any]]:
        return [
            {
                "version": st.version,
                "root": st.root.hex(),
                "chunks_held": st.bitmap.count,
                "chunks_total": st.bitmap.n,
                "bytes_total": st.manifest.total_bytes,
                "complete": st.complete,
                "assembled": st.assembled,
                "anchor": st.delta is None,
                "base_version": st.delta.base_version if st.delta is not None else None,
                "pins": st.pins,
            }
            for st in sorted(self.versions.values(), key=lambda s: -s.version)
        ]
