"""The content-addressed chunk store in the node home.

Layout (under ``HOME/chunks``)::

    objects/<h[:2]>/<sha256 hex>     one verified chunk, named by its hash
    tmp/                             writes in progress (emptied at open)
    versions/<version>-<root[:8]>/
        announce                     the trainer's signed CheckpointAnnounce, verbatim
        files/<path>                 the assembled safetensors files (once complete)

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from node.checkpoints import directio
from node.checkpoints.directio import Buffer, DirectIOUnsupported
from node.checkpoints.manifest import (
    DEFAULT_CHUNK_SIZE,
    accept_announce,
    build_manifest,
    sign_announce,
    verify_announce,
)
from node.util import fsync_dir
from protocol import CheckpointManifest, Envelope, HaveEntry, NodeKey, ProtocolError, ReplayGuard
from protocol.bitmap import Bitmap
from protocol.rules import is_stale

log = logging.getLogger(__name__)


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

    # ------------------------------------------------------------ assembly / loading
    def files_dir(self, version: int) -> Path:
        return self.versions_dir / self.versions[version].dirname / "files"

    def assemble_blocking(self, st: VersionState) -> Path:
        """Write the version's files from its chunks (byte-identical to the trainer's)."""
        d = self.versions_dir / st.dirname
        final = d / "files"
        if final.is_dir():
            return final
        if not st.complete:
            raise RuntimeError(f"version {st.version} is incomplete ({st.bitmap.count}/{st.bitmap.n} chunks)")
        tmp = d / "files.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
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

    async def assemble(self, version: int) -> Path:
        st = self.versions[version]
        with self.pin(version):
            path = await trio.to_thread.run_sync(self.assemble_blocking, st)
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
            d = self.files_dir(version)
            yield {f.path: d / f.path for f in st.manifest.files}

    # ------------------------------------------------------------ garbage collection
    def gc(self, max_async: int) -> list[int]:
        """Drop versions behind the ``max_async`` window unless pinned; delete unreferenced chunks.

        The window is counted from the newest version known (complete or not).
        Returns the versions removed.
        """
        newest = self.newest()
        if newest is None:
            return []
        removed = []
        for v, st in sorted(self.versions.items()):
            if is_stale(v, newest.version, max_async) and st.pins == 0 and v not in self.keep:
                del self.versions[v]  # from now on nobody can pin it
                removed.append((v, st))
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
                "pins": st.pins,
            }
            for st in sorted(self.versions.values(), key=lambda s: -s.version)
        ]
