"""The chunk store in the node home: every verified chunk written once, in place.

Layout (under ``HOME/chunks``)::

    tmp/                             imports in progress (emptied at open)
    versions/<version>-<root[:16]>/
        announce                     the trainer's signed CheckpointAnnounce, verbatim
        parts/<path>                 the manifest's files while they are fetched: created at
                                     their full size from the manifest (fallocate), each
                                     verified chunk written once at its offset
        held                         journal of the chunk indices written to parts/ (uint32 LE
                                     each), appended only after the chunk's bytes are on disk
        files/<path>                 anchor: parts/ renamed once the last chunk landed: the
                                     loadable checkpoint, and what the node serves chunks from;
                                     delta: the full files applying the delta rebuilt
        delta/<path>                 delta: parts/ renamed once complete (the delta file)

Why in place: the store used to keep each chunk as its own object and then make an
assembly pass that read every chunk back to write the checkpoint files, so a
version was loadable only about twice the fetch time after its announce
(docs/benchmarks.md, "Checkpoint distribution"). Now the last verified chunk's
write is the last write: completing a version is an fsync and one rename. The
node serves a chunk by reading its range of the version's file (the manifest
gives path, offset and length); there is no second copy.

Crash safety: a version is loadable only under ``files/``, and ``parts/`` becomes
``files/`` only after every chunk was verified and written (one rename, then a
directory fsync), so a crash never leaves a partial file under that name. A chunk
index is appended to ``held`` only after its bytes were written (and, when
``durable``, fdatasync'ed), so after a kill -9 or a power loss the journal names
only chunks whose bytes are on disk; the node resumes from it and fetches only the
rest. A torn last record is ignored. Writes use ``O_DIRECT`` where the filesystem
allows it (directio.py says why), buffered elsewhere.

Chunks shared between versions (an unchanged tensor) are fetched once: a chunk
written for one version is written into every other version being fetched that
lists its hash, and a version announced later copies the chunks it shares with
versions held here before its fetch asks peers (:meth:`ChunkStore.adopt_blocking`).

Delta versions (protocol/delta.py) hold one delta file; "assembling" one applies it
to its base's files and checks the result against the manifest's ``weights_root``
before the rename of ``files.tmp/`` into ``files/`` (so a crash or a refusal never
leaves a loadable wrong version). GC keeps the window's versions and their base
chain down to the newest anchor, for late joiners.

Thread model: the index (versions, bitmaps, pins) lives on the trio thread;
``*_blocking`` methods do disk work and hashing and are meant for
``trio.to_thread.run_sync``; they read the index but only change a version's
``written`` set (under the version's lock); bitmaps are set on the trio thread
(:meth:`ChunkStore.mark_held`) from what was written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import logging
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import trio

from node.checkpoints import directio
from node.checkpoints.chain import Link, gc_plan
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
    assembled: bool = False  # its full files are on disk and offered for loading
    # checked once: an anchor's files assembled, or a delta applied and the result checked
    # against the signed weights_root (stays true when GC releases the full files: the delta
    # file stays, and what it changes is still known to be right)
    applied: bool = False
    added_at: float = dataclasses.field(default_factory=time.time)
    # chunk indices whose bytes are in the version's file (set by writer threads under
    # ``lock``; the bitmap follows on the trio thread, see ChunkStore.mark_held)
    written: set[int] = dataclasses.field(default_factory=set)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    final: bool = False  # parts/ renamed to files/ (anchor) or delta/ (delta): every chunk written
    parts_ready: bool = False  # parts/ created at full size
    dropped: bool = False  # removed by GC: writers skip it

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


PARTS = "parts"  # a version's files while they are fetched
JOURNAL = "held"  # chunk indices written to parts/, uint32 little-endian each


def _final_name(st: VersionState) -> str:
    """Where a complete version's fetched files live: an anchor's are the checkpoint
    (``files/``), a delta's are the delta file (``delta/``; ``files/`` is what applying it gives)."""
    return "files" if st.delta is None else "delta"


# a delta is cut into at least this many chunks where the floor below allows
DELTA_MIN_CHUNKS = 16
# the smallest delta chunk: per chunk a request, a HAVE bit and a sha256 (below ~256 KiB the
# per-chunk round trips start to cost more than pipelining wins on a 100 Mbit/s link)
DELTA_MIN_CHUNK = 256 * 1024


def delta_chunk_size(delta_bytes: int, chunk_size: int) -> int:
    """The chunk size a delta version is published with: the largest power of two at most
    ``chunk_size`` that cuts ``delta_bytes`` into at least ``DELTA_MIN_CHUNKS`` chunks, and not
    under ``DELTA_MIN_CHUNK``.

    Why smaller than an anchor's: a receiver re-serves only chunks it holds whole, so a
    5 MB delta in 4 MiB chunks is two pieces, and the swarm can only copy a piece onward
    after a whole 4 MiB (0.34 s at 100 Mbit/s) arrived; in 256 KiB chunks every fetcher
    starts serving after 21 ms and the delta reaches 8 fetchers in little more than the
    seeder's own upload time (docs/benchmarks.md, "Sparse deltas")."""
    cs = 1 << max(0, (max(1, delta_bytes // DELTA_MIN_CHUNKS)).bit_length() - 1)
    return max(min(cs, chunk_size), min(DELTA_MIN_CHUNK, chunk_size))


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
        self.tmp = self.root / "tmp"
        self.versions_dir = self.root / "versions"
        # versions GC never drops: version 0 of a run whose genesis pins the model, which
        # late joiners fetch whatever the newest version is (roles/learning.py)
        self.keep: set[int] = set()
        for d in (self.tmp, self.versions_dir):
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
            shutil.rmtree(d / "files.tmp", ignore_errors=True)
            self._index(manifest, ann.read_bytes())

    def _index(self, manifest: CheckpointManifest, raw: bytes) -> VersionState:
        """Remember a version and what of it is on disk: everything once its fetched files
        were renamed into place, else the journal's chunks (parts/ of the wrong size, from
        another layout or a damaged disk, is started over)."""
        chunks = manifest.chunks()
        by_hash: dict[bytes, list[int]] = {}
        for i, (_, _, _, h) in enumerate(chunks):
            by_hash.setdefault(h, []).append(i)
        st = VersionState(manifest, raw, _version_dirname(manifest), Bitmap(len(chunks)), chunks, by_hash)
        d = self.versions_dir / st.dirname
        if (d / _final_name(st)).is_dir():
            st.final = True
            st.written = set(range(len(chunks)))
        elif (d / PARTS).is_dir():
            if all(self._size_or_none(d / PARTS / f.path) == f.size for f in manifest.files):
                st.parts_ready = True
                st.written = self._read_journal(d / JOURNAL, len(chunks))
            else:
                shutil.rmtree(d / PARTS, ignore_errors=True)
                (d / JOURNAL).unlink(missing_ok=True)
        for i in st.written:
            st.bitmap.set(i)
        st.assembled = st.applied = st.final and (d / "files").is_dir()
        self.versions[manifest.version] = st
        return st

    @staticmethod
    def _size_or_none(path: Path) -> int | None:
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return None

    @staticmethod
    def _read_journal(path: Path, n: int) -> set[int]:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return set()
        raw = raw[: len(raw) - len(raw) % 4]  # a record torn by a crash: that chunk is fetched again
        return {i for (i,) in struct.iter_unpack("<I", raw) if i < n}

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
    def version_dir(self, st: VersionState) -> Path:
        return self.versions_dir / st.dirname

    def open_chunk(self, st: VersionState, index: int) -> tuple[int, int, int]:
        """An open read-only descriptor on the file holding chunk ``index`` of ``st`` (a held
        one), with the chunk's offset in it and its length. The caller closes the descriptor.

        Tries the final folder, then parts/, then the final folder again: a version that
        completes meanwhile renames parts/ away, and an open descriptor outlives the rename."""
        path, offset, length, _ = st.chunks[index]
        d = self.version_dir(st)
        for sub in (_final_name(st), PARTS, _final_name(st)):
            try:
                return os.open(d / sub / path, os.O_RDONLY), offset, length
            except FileNotFoundError:
                continue
        raise FileNotFoundError(f"chunk {index} of version {st.version} is not on disk")

    def read_chunk_blocking(self, st: VersionState, index: int) -> bytes:
        """The bytes of held chunk ``index`` of ``st``, read from the version's file."""
        fd, offset, length = self.open_chunk(st, index)
        try:
            out = bytearray(length)
            view = memoryview(out)
            got = 0
            while got < length:
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    raise OSError(f"chunk {index} of version {st.version} is short on disk")
                got += n
            return bytes(out)
        finally:
            os.close(fd)

    def read_object_blocking(self, h: bytes) -> bytes:
        """The bytes of the chunk with hash ``h``, from any version that holds it."""
        for st in list(self.versions.values()):
            for i in st.by_hash.get(h, ()):
                if i in st.written:
                    return self.read_chunk_blocking(st, i)
        raise FileNotFoundError(f"no version here holds chunk {h.hex()[:16]}")

    def mark_held(self, h: bytes) -> list[tuple[int, int]]:
        """Set the bitmap bits of every chunk with hash ``h`` whose bytes were written to its
        version's file; returns the (version, index) pairs that became held."""
        newly = []
        for st in self.versions.values():
            for i in st.by_hash.get(h, ()):
                if i in st.written and st.bitmap.set(i):
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
        """Write a verified chunk (``data`` hashes to ``h``) at its offset in every version
        being fetched that lists ``h`` and lacks it. Idempotent. Call :meth:`mark_held` after."""
        for st in list(self.versions.values()):
            idxs = st.by_hash.get(h)
            if not idxs or st.final or st.dropped:
                continue
            todo = [i for i in idxs if i not in st.written]
            if not todo:
                continue
            try:
                self._write_in_place(st, todo, data)
            except FileNotFoundError:
                if not st.dropped:  # GC removed it meanwhile: nothing to write into
                    raise

    def put_chunk_blocking(self, st: VersionState, index: int, data: Buffer) -> bytes:
        """Check one chunk and write it in place (blocking). Raise ChunkRejected if it is
        wrong: then not a byte of it reaches the disk."""
        h = self.check_chunk_blocking(st, index, data)
        self.write_object_blocking(h, data)
        return h

    def adopt_blocking(self, st: VersionState) -> list[bytes]:
        """Copy into ``st``'s file the chunks it shares with versions held here (an unchanged
        tensor), so its fetch asks peers only for the rest. Returns the hashes written
        (:meth:`mark_held` each on the trio thread). Each copy is hashed again first."""
        missing = {h for h, idxs in st.by_hash.items() if any(i not in st.written for i in idxs)}
        adopted: list[bytes] = []
        for other in list(self.versions.values()):
            if not missing:
                break
            if other is st or other.dropped:
                continue
            for h in [h for h in missing if h in other.by_hash]:
                src = next((i for i in other.by_hash[h] if i in other.written), None)
                if src is None:
                    continue
                try:
                    data = self.read_chunk_blocking(other, src)
                except FileNotFoundError:
                    continue
                if hashlib.sha256(data).digest() != h:
                    log.warning("version %d: chunk %d on disk does not match its hash", other.version, src)
                    continue
                self.write_object_blocking(h, data)
                missing.discard(h)
                adopted.append(h)
        return adopted

    def _ensure_parts(self, st: VersionState) -> None:
        """Create ``parts/`` with every manifest file at its full size (blocking, once)."""
        with st.lock:
            if st.parts_ready:
                return
            parts = self.version_dir(st) / PARTS
            for f in st.manifest.files:
                path = parts / f.path
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    if os.fstat(fd).st_size != f.size:
                        directio.preallocate(fd, f.size)
                    if self.durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            if self.durable:
                for d in sorted({(parts / f.path).parent for f in st.manifest.files}, key=lambda p: -len(p.parts)):
                    fsync_dir(d)
                fsync_dir(parts.parent)
            st.parts_ready = True

    def _write_in_place(self, st: VersionState, indices: list[int], data: Buffer) -> None:
        """Write ``data`` as chunks ``indices`` of ``st`` (all with the same hash), then journal
        them: the journal never names a chunk whose bytes are not on disk."""
        self._ensure_parts(st)
        parts = self.version_dir(st) / PARTS
        for i in indices:
            path, offset, _, _ = st.chunks[i]
            self._pwrite(parts / path, data, offset)
        with st.lock:
            new = [i for i in indices if i not in st.written]
            if not new:
                return
            fd = os.open(self.version_dir(st) / JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, struct.pack(f"<{len(new)}I", *new))
            finally:
                os.close(fd)
            st.written.update(new)

    def _pwrite(self, path: Path, data: Buffer, offset: int) -> None:
        """``data`` at ``offset`` of the existing file ``path``; O_DIRECT where the filesystem
        takes it; fdatasync'ed when durable."""
        if self.direct_io:
            try:
                fd = directio.open_direct(path, os.O_WRONLY)
            except DirectIOUnsupported as exc:
                self._direct_refused(exc)
            else:
                try:
                    directio.pwrite_direct(fd, data, offset)
                    if self.durable:
                        os.fdatasync(fd)
                    return
                except DirectIOUnsupported as exc:
                    self._direct_refused(exc)
                finally:
                    os.close(fd)
        fd = os.open(path, os.O_WRONLY)
        try:
            view = memoryview(data).cast("B")
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
            if self.durable:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def finish_blocking(self, st: VersionState) -> Path:
        """Every chunk of ``st`` is written: fsync its files and rename ``parts/`` into place
        (``files/`` for an anchor: from here on it is loadable). Idempotent. No byte is read."""
        d = self.version_dir(st)
        final = d / _final_name(st)
        if st.final or final.is_dir():
            st.final = True
            return final
        if len(st.written) != len(st.chunks):
            raise RuntimeError(f"version {st.version} is incomplete ({len(st.written)}/{len(st.chunks)} chunks)")
        self._ensure_parts(st)  # a version of empty files has no chunk to have created them
        parts = d / PARTS
        if self.durable:
            for f in st.manifest.files:
                fd = os.open(parts / f.path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        os.replace(parts, final)
        if self.durable:
            fsync_dir(d)
        (d / JOURNAL).unlink(missing_ok=True)
        st.final = True
        return final

    def _direct_refused(self, exc: DirectIOUnsupported) -> None:
        if self.direct_io:
            self.direct_io = False
            log.info("chunk store %s: %s; using buffered writes", self.root, exc)

    def _atomic_write(self, final: Path, data: Buffer) -> None:
        """Small files (the announce): temp + fsync + rename."""
        with self._tmp_lock:
            n = next(self._tmp_counter)
        tmp = self.tmp / f"{final.name}.{os.getpid()}.{n}"
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
        with self._tmp_lock:
            n = next(self._tmp_counter)
        out = self.tmp / f"import-{version}.{os.getpid()}.{n}"
        try:
            sizes = []
            for rel, path in checkpoint_files(src_dir):
                size = path.stat().st_size
                (out / rel).parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(out / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    directio.preallocate(fd, size)
                finally:
                    os.close(fd)
                sizes.append((out / rel, size))
            pos = [0, 0]  # (file index, offset): build_manifest reads the files in this order

            def copy(_h: bytes, data: memoryview) -> None:
                while pos[1] == sizes[pos[0]][1]:
                    pos[0], pos[1] = pos[0] + 1, 0
                self._pwrite(sizes[pos[0]][0], data, pos[1])
                pos[1] += len(data)

            manifest = build_manifest(self.run_id, version, src_dir, chunk_size, on_chunk=copy)
            if self.durable:
                for path, _ in sizes:
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            vdir = self.versions_dir / _version_dirname(manifest)
            vdir.mkdir(parents=True, exist_ok=True)
            if not (vdir / "files").is_dir():  # the announce is written next; without it _load drops the folder
                os.replace(out, vdir / "files")
                if self.durable:
                    fsync_dir(vdir)
        finally:
            shutil.rmtree(out, ignore_errors=True)
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
        # the delta version's chunk size (its delta file's chunks and the chunks its result
        # is hashed in for ``weights_root``): small enough that the delta spreads through the
        # swarm in pieces (``delta_chunk_size``)
        chunk_size = delta_chunk_size(len(data), chunk_size)
        full = build_manifest(self.run_id, version, src_dir, chunk_size, created_ms=0)
        ref = DeltaRef(base_version=base.version, base_root=base.root, weights_root=full.root)
        with self._tmp_lock:
            n = next(self._tmp_counter)
        ddir = self.tmp / f"delta-{version}.{os.getpid()}.{n}"
        ddir.mkdir()
        try:
            (ddir / DELTA_FILE).write_bytes(data)
            manifest = build_manifest(self.run_id, version, ddir, chunk_size, delta=ref)
            vdir = self.versions_dir / _version_dirname(manifest)
            vdir.mkdir(parents=True, exist_ok=True)
            if not (vdir / "delta").is_dir():
                os.replace(ddir, vdir / "delta")  # the delta's chunks, served from here
        finally:
            shutil.rmtree(ddir, ignore_errors=True)
        # Apply it here exactly as every receiver will, and check the result before signing:
        # a delta that does not rebuild the export is never announced (an anchor is).
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
        """The delta file of a complete delta version (every chunk of it verified)."""
        names = [f.path for f in st.manifest.files]
        if names != [DELTA_FILE]:
            raise ProtocolError("delta.format", f"a delta version holds the one file {DELTA_FILE}, not {names[:4]}")
        data = (self.finish_blocking(st) / DELTA_FILE).read_bytes()
        if len(data) != st.manifest.files[0].size:
            raise ProtocolError("delta.format", "the delta file's chunks do not add up to its size")
        return data

    def assemble_blocking(
        self,
        st: VersionState,
        base: VersionState | None = None,
        on_block: Callable[[str, int], None] | None = None,
    ) -> Path:
        """Make the version loadable: an anchor's chunks were written in place, so this only
        fsyncs and renames its files into ``files/`` (byte-identical to the trainer's); a
        delta version's files come from applying it to ``base``'s files and checking the
        result against the manifest's ``weights_root`` (ProtocolError ``delta.*`` if
        anything is off: nothing is renamed into place, so nothing loads it)."""
        d = self.versions_dir / st.dirname
        final = d / "files"
        if st.delta is None:
            return self.finish_blocking(st)  # no byte is read or copied: the chunks are the files
        if final.is_dir():
            return final
        self.finish_blocking(st)  # the delta file, complete (RuntimeError if not)
        tmp = d / "files.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            self._apply_blocking(st, base, tmp, on_block)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
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
        st.assembled = st.applied = True
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
        """Drop versions behind the ``max_async`` window unless pinned or on the base chain of
        a kept version, with their files (the decisions: ``chain.gc_plan``).

        The window is counted from the newest version known (complete or not).
        Returns the versions removed.
        """
        newest = self.newest()
        if newest is None:
            return []
        plan = gc_plan(self.links(), newest.version, max_async, self.keep)
        removed = []
        for v in plan.remove:
            st = self.versions.pop(v)  # from now on nobody can pin it
            st.dropped = True  # a writer thread still holding it skips it
            removed.append(st)
        for v in plan.release:
            st = self.versions[v]
            st.assembled = False  # its chunks stay, to serve; it is no longer offered for loading
            if st.delta is not None:  # a delta version's full files go (its chunks are the delta file)
                shutil.rmtree(self.versions_dir / st.dirname / "files", ignore_errors=True)
        for st in removed:
            shutil.rmtree(self.versions_dir / st.dirname, ignore_errors=True)
        return [st.version for st in removed]

    def links(self) -> dict[int, Link]:
        """The chain's view of every version held (``chain.py``)."""
        return {
            v: Link(version=v, root=st.root, delta=st.delta, pinned=st.pins > 0, assembled=st.assembled)
            for v, st in self.versions.items()
        }

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
