"""Encode and apply sparse deltas between two checkpoint folders (format: protocol/delta.py).

Why bit patterns: after the cast to the run's dtype (bf16) most weights of an RL
step do not change at all, so "which elements changed and to what bits" is small
and exact, where a float difference would round. Encoding compares each tensor
of the two versions as unsigned integers of its element size (numpy, read
through ``np.memmap`` so a checkpoint is never held twice in memory); applying
copies the base files and writes the changed elements in place. Payloads are
compressed with zstandard (the format most delta-sync systems settled on: fast
at level 3, and its frame header carries the decompressed size, which we check
before decompressing, so a hostile payload cannot inflate past what its record
declares).

Blocking throughout (numpy, file I/O): call from ``trio.to_thread``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zstandard

from node.checkpoints import directio
from node.checkpoints.directio import DirectIOUnsupported
from protocol import ProtocolError
from protocol.delta import (
    ELEMENT_SIZE,
    ENC_BITMAP,
    ENC_DENSE,
    ENC_GAPS,
    MAX_GAPS_NUMEL,
    DeltaRecord,
    TensorSpan,
    pack_delta,
    parse_delta,
    parse_safetensors_header,
    payload_size,
    safetensors_header_size,
)

ZSTD_LEVEL = 3

_UINT: dict[int, np.dtype[Any]] = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


class DeltaIncompatible(Exception):
    """The two versions differ in structure (files, headers, shapes): publish an anchor."""


@dataclasses.dataclass
class DeltaStats:
    """What one encode did (bench/delta.py and the trainer's log line report it)."""

    elements: int = 0
    changed: int = 0
    tensors: int = 0
    tensors_changed: int = 0
    raw_bytes: int = 0  # payloads before compression
    delta_bytes: int = 0  # the delta file
    full_bytes: int = 0  # the new version's files
    seconds: float = 0.0

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


@dataclasses.dataclass(frozen=True)
class TensorChange:
    """The new bits of one tensor: ``positions`` None means every element (dense)."""

    path: str
    name: str
    dtype: str
    numel: int
    positions: np.ndarray | None
    values: np.ndarray  # unsigned ints of the element size, the new bit patterns


def _layout(path: Path) -> tuple[bytes, dict[str, TensorSpan]]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = safetensors_header_size(head)
        header = head + f.read(n - 8)
    return header, parse_safetensors_header(header, size)


def _tensor(path: Path, span: TensorSpan, mode: Literal["r", "r+"] = "r") -> np.ndarray:
    """The tensor's elements as unsigned ints of its element size, mapped from the file."""
    dt = _UINT[ELEMENT_SIZE[span.dtype]]
    if span.numel == 0:
        return np.zeros(0, dtype=dt)
    return np.memmap(path, dtype=dt, mode=mode, offset=span.start, shape=(span.numel,))


def _encode_tensor(
    path: str, name: str, span: TensorSpan, old: np.ndarray, new: np.ndarray, level: int
) -> tuple[DeltaRecord | None, int]:
    """The record of one tensor (None if nothing changed) and how many elements changed."""
    ne = old != new
    k = changed = int(np.count_nonzero(ne))
    if k == 0:
        return None, 0
    n = span.numel
    s = new.dtype.itemsize
    costs = {ENC_BITMAP: (n + 7) // 8 + k * s, ENC_DENSE: n * s}
    if n <= MAX_GAPS_NUMEL:
        costs[ENC_GAPS] = 4 * k + k * s
    enc = min(costs, key=lambda e: costs[e])
    if enc == ENC_DENSE:
        k, prefix, values = n, b"", np.asarray(new)
    else:
        positions = np.flatnonzero(ne)
        values = np.asarray(new)[positions]
        if enc == ENC_BITMAP:
            prefix = np.packbits(ne, bitorder="little").tobytes()
        else:
            prefix = np.diff(positions, prepend=0).astype("<u4").tobytes()
    planes = values.view(np.uint8).reshape(k, s).T.tobytes()  # byte-planed (protocol/delta.py)
    raw = prefix + planes
    payload = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(raw)
    return DeltaRecord(path, name, span.dtype, enc, n, k, payload), changed


def encode_delta(
    base: Mapping[str, Path], new: Mapping[str, Path], *, level: int = ZSTD_LEVEL, max_bytes: int | None = None
) -> tuple[bytes, DeltaStats]:
    """The delta file turning the files ``base`` into ``new`` ({manifest path: file}).

    Raises DeltaIncompatible when they differ in anything but tensor elements (a
    file added or removed, another safetensors header, a changed non-tensor file),
    or as soon as the payloads pass ``max_bytes`` (an fp32 export after an Adam
    step changes nearly every element: no point finishing)."""
    t0 = time.perf_counter()
    if sorted(base) != sorted(new):
        raise DeltaIncompatible(f"files differ: {sorted(set(base) ^ set(new))[:5]}")
    stats = DeltaStats()
    records: list[DeltaRecord] = []
    for rel in sorted(new):
        a, b = Path(base[rel]), Path(new[rel])
        stats.full_bytes += b.stat().st_size
        if not rel.endswith(".safetensors"):
            if a.read_bytes() != b.read_bytes():
                raise DeltaIncompatible(f"{rel} changed")
            continue
        if a.stat().st_size != b.stat().st_size:
            raise DeltaIncompatible(f"{rel}: size changed")
        try:
            ha, la = _layout(a)
            hb, _ = _layout(b)
        except ProtocolError as exc:
            raise DeltaIncompatible(f"{rel}: {exc}") from None
        if ha != hb:
            raise DeltaIncompatible(f"{rel}: safetensors header changed")
        for name in sorted(la):
            span = la[name]
            stats.tensors += 1
            stats.elements += span.numel
            if span.numel == 0:
                continue
            rec, changed = _encode_tensor(rel, name, span, _tensor(a, span), _tensor(b, span), level)
            if rec is not None:
                records.append(rec)
                stats.tensors_changed += 1
                stats.changed += changed
                stats.raw_bytes += rec.raw_size
                stats.delta_bytes += len(rec.payload)
                if max_bytes is not None and stats.delta_bytes >= max_bytes:
                    raise DeltaIncompatible(f"the delta passed {max_bytes} bytes at tensor {name}")
    data = pack_delta(records)
    stats.delta_bytes = len(data)
    stats.seconds = time.perf_counter() - t0
    return data, stats


def decode_record(rec: DeltaRecord) -> TensorChange:
    """Decompress and check one record (raises ProtocolError ``delta.format``)."""
    want = rec.raw_size
    size = zstandard.frame_content_size(rec.payload) if len(rec.payload) >= 4 else -1
    if size != want:
        raise ProtocolError("delta.format", f"{rec.name}: payload declares {size} bytes, the record {want}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(rec.payload, max_output_size=want, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise ProtocolError("delta.format", f"{rec.name}: bad zstandard frame: {exc}") from None
    if len(raw) != want:
        raise ProtocolError("delta.format", f"{rec.name}: payload is {len(raw)} bytes, expected {want}")
    s, n, k = rec.element_size, rec.numel, rec.changed
    buf = np.frombuffer(raw, dtype=np.uint8)
    positions: np.ndarray | None
    if rec.encoding == ENC_DENSE:
        positions, vbuf = None, buf
    elif rec.encoding == ENC_BITMAP:
        nb = (n + 7) // 8
        bits = np.unpackbits(buf[:nb], bitorder="little")
        if int(np.count_nonzero(bits[:n])) != k or np.count_nonzero(bits[n:]):
            raise ProtocolError("delta.format", f"{rec.name}: bitmap does not mark exactly {k} of {n} elements")
        positions, vbuf = np.flatnonzero(bits[:n]), buf[nb:]
    else:
        gaps = buf[: 4 * k].view("<u4").astype(np.int64)
        if k > 1 and int(gaps[1:].min()) < 1:
            raise ProtocolError("delta.format", f"{rec.name}: positions not strictly increasing")
        positions = np.cumsum(gaps)
        if int(positions[-1]) >= n:
            raise ProtocolError("delta.format", f"{rec.name}: position {int(positions[-1])} past {n} elements")
        vbuf = buf[4 * k :]
    values = vbuf.reshape(s, k).T.copy().view(_UINT[s]).reshape(k)
    return TensorChange(rec.path, rec.name, rec.dtype, n, positions, values)


def iter_changes(data: bytes | memoryview) -> Iterator[TensorChange]:
    """Every tensor the delta changes, decoded (the engines' in-place load reads this)."""
    for rec in parse_delta(data):
        yield decode_record(rec)


def check_against_base(records: list[DeltaRecord], base: Mapping[str, Path]) -> dict[str, dict[str, TensorSpan]]:
    """Every record must name a tensor of the base with the same dtype and size.

    Returns the base's safetensors layouts by path; raises ProtocolError ``delta.base``."""
    layouts: dict[str, dict[str, TensorSpan]] = {}
    for rec in records:
        if rec.path not in base or not rec.path.endswith(".safetensors"):
            raise ProtocolError("delta.base", f"the base has no safetensors file {rec.path!r}")
        if rec.path not in layouts:
            layouts[rec.path] = _layout(Path(base[rec.path]))[1]
        span = layouts[rec.path].get(rec.name)
        if span is None:
            raise ProtocolError("delta.base", f"{rec.path} of the base has no tensor {rec.name!r}")
        if (span.dtype, span.numel) != (rec.dtype, rec.numel):
            raise ProtocolError(
                "delta.base",
                f"{rec.name}: the base holds {span.dtype} x {span.numel}, the delta {rec.dtype} x {rec.numel}",
            )
    return layouts


@dataclasses.dataclass
class _Patch:
    """One record's changes as byte positions in its file: a contiguous range (dense) or
    sorted element offsets with the values split into byte planes (so an element that
    straddles a block border lands byte by byte)."""

    start: int
    end: int
    offsets: np.ndarray | None  # absolute byte offset of each changed element; None: dense
    planes: list[np.ndarray]  # planes[j][i]: byte j of value i (dense: one plane, the raw bytes)

    def apply(self, blk: np.ndarray, b0: int) -> None:
        b1 = b0 + len(blk)
        if self.end <= b0 or self.start >= b1:
            return
        if self.offsets is None:
            lo, hi = max(self.start, b0), min(self.end, b1)
            blk[lo - b0 : hi - b0] = self.planes[0][lo - self.start : hi - self.start]
            return
        for j, plane in enumerate(self.planes):
            i0, i1 = np.searchsorted(self.offsets, [b0 - j, b1 - j])
            if i1 > i0:
                blk[self.offsets[i0:i1] + (j - b0)] = plane[i0:i1]


def _patches(records: list[DeltaRecord], layouts: dict[str, dict[str, TensorSpan]]) -> dict[str, list[_Patch]]:
    out: dict[str, list[_Patch]] = {}
    for rec in records:
        change = decode_record(rec)
        span = layouts[rec.path][rec.name]
        s = rec.element_size
        if change.positions is None:
            patch = _Patch(span.start, span.end, None, [change.values.view(np.uint8).reshape(-1)])
        else:
            offsets = span.start + change.positions.astype(np.int64) * s
            planes = [((change.values >> (8 * j)) & 0xFF).astype(np.uint8) for j in range(s)]
            patch = _Patch(span.start, span.end, offsets, planes)
        out.setdefault(rec.path, []).append(patch)
    return out


class _BlockIO:
    """Reads the base and writes the result block by block, with O_DIRECT where the
    filesystem allows it (directio.py says why: fresh page-cache pages are what costs on a
    VM), buffered otherwise."""

    def __init__(self, direct: bool) -> None:
        self.direct = direct

    def open_in(self, path: Path) -> tuple[int, bool]:
        if self.direct:
            try:
                return directio.open_direct(path, os.O_RDONLY), True
            except DirectIOUnsupported:
                self.direct = False
        return os.open(path, os.O_RDONLY), False

    def open_out(self, path: Path) -> tuple[int, bool]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if self.direct:
            try:
                return directio.open_direct(path, flags), True
            except DirectIOUnsupported:
                self.direct = False
        return os.open(path, flags, 0o644), False

    def read(self, fd: int, direct: bool, offset: int, n: int, block: int) -> np.ndarray:
        want = -(-n // directio.ALIGN) * directio.ALIGN
        buf = directio.scratch(max(want, block), "delta-read")
        view = memoryview(buf)[:want]
        got = 0
        while got < n:
            r = os.preadv(fd, [view[got:]], offset + got)
            if r == 0:
                break
            got += r
            if direct and got < n and got % directio.ALIGN:
                break
        if got < n:
            raise OSError(f"base file short at {offset + got}")
        return np.frombuffer(view, dtype=np.uint8)[:n]


def apply_delta(
    base: Mapping[str, Path],
    data: bytes | memoryview,
    out_dir: Path,
    *,
    chunk_size: int,
    durable: bool = True,
    direct: bool = True,
    on_block: Callable[[str, int], None] | None = None,
) -> dict[str, list[bytes]]:
    """Write the new version's files into ``out_dir`` in one pass over the base: each block
    of ``chunk_size`` bytes is read, patched, hashed and written. Returns the sha256 of
    every ``chunk_size`` chunk of every rebuilt file (what the new version's anchor
    manifest would list), so the caller checks ``weights_root`` without reading the
    result again.

    Everything about the delta is checked (layout, against the base's headers, every
    payload decoded) before a byte is written; the caller writes into a temp folder and
    renames it only after checking the result. ``on_block(path, index)`` runs after each
    written block (tests kill the process there).
    """
    records = parse_delta(data)
    layouts = check_against_base(records, base)
    patches = _patches(records, layouts)
    io = _BlockIO(direct and chunk_size % directio.ALIGN == 0)
    out_dir.mkdir(parents=True, exist_ok=True)
    hashes: dict[str, list[bytes]] = {}
    for rel in sorted(base):
        src, dst = Path(base[rel]), out_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        size = src.stat().st_size
        fin, din = io.open_in(src)
        try:
            fout, _dout = io.open_out(dst)
            try:
                hs = hashes[rel] = []
                for b0 in range(0, size, chunk_size):
                    n = min(chunk_size, size - b0)
                    blk = io.read(fin, din, b0, n, chunk_size)
                    for patch in patches.get(rel, ()):
                        patch.apply(blk, b0)
                    raw = blk.data  # the patched block, as a buffer (no copy)
                    hs.append(hashlib.sha256(raw).digest())
                    if _dout:
                        directio.pwrite_direct(fout, raw, b0)
                    else:
                        done = 0
                        while done < n:
                            done += os.pwrite(fout, raw[done:], b0 + done)
                    del blk, raw
                    if on_block is not None:
                        on_block(rel, b0 // chunk_size)
                if durable:
                    os.fsync(fout)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
    return hashes


__all__ = [
    "ZSTD_LEVEL",
    "DeltaIncompatible",
    "DeltaStats",
    "TensorChange",
    "apply_delta",
    "check_against_base",
    "decode_record",
    "encode_delta",
    "iter_changes",
    "payload_size",
]
