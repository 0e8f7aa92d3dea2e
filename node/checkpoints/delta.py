"""Encode and apply sparse deltas between two checkpoint folders (format: protocol/delta.py).

Why bit patterns: after the cast to the run's dtype (bf16) most weights of an RL
step do not change at all, so "which elements changed and to what bits" is small
and exact, where a float difference would round. Encoding compares each tensor
of the two versions as unsigned integers of its element size (numpy, read
through ``np.memmap`` so a checkpoint is never held twice in memory). What is
sent is coded against the base, which every receiver holds: the values as
differences of bit patterns (a changed bf16 weight moves by a unit or two in the
last place), the positions grouped by the base element's exponent, merged into a few
bins of similar change rate (whether a weight's bits change depends on its unit in
the last place). So decoding needs
the base tensor (``decode_record(rec, old)``). Applying copies the base files and
writes the changed elements in place. Payloads are compressed with zstandard
(fast at level 3, and its frame header carries the decompressed size, which we
check against the record's bound before decompressing, so a hostile payload
cannot inflate past it).

Blocking throughout (numpy, file I/O): call from ``trio.to_thread``.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zstandard

from node.checkpoints import directio
from node.checkpoints.directio import DirectIOUnsupported
from protocol import ProtocolError
from protocol.delta import (
    BINS,
    CLASS_FIELD,
    ELEMENT_SIZE,
    ENC_DENSE,
    ENC_SPARSE,
    MAX_RICE,
    SEGMENT,
    DeltaRecord,
    TensorSpan,
    class_count,
    pack_delta,
    parse_delta,
    parse_safetensors_header,
    safetensors_header_size,
)

ZSTD_LEVEL = 3
# threads that read and decode segments of one apply (segments are independent; numpy,
# zstandard and the reads release the GIL): one per core, up to this many
DECODE_THREADS = 4
# threads hashing and writing the result's chunks (each chunk: sha256, then its write)
WRITE_THREADS = 2
# pieces read and patched ahead of the one being fed on (each in its own buffer, at most a
# segment: 8 MiB of bf16, 16 MiB of f32): pieces differ in cost (an unchanged run is a read,
# a segment a decode), and with only workers + 1 of them a decoding thread often waited for
# the feeding one; 10: one apply 0.49-0.62 s against 0.59-0.74 s (SmolLM2, base cached)
PIECES_AHEAD = 10


_POOLS: dict[int, tuple[ThreadPoolExecutor, ThreadPoolExecutor, int]] = {}
_POOLS_LOCK = threading.Lock()


def _shared_pools() -> tuple[ThreadPoolExecutor, ThreadPoolExecutor, int]:
    """(decoding pool, writing pool, decoding threads), one of each per process, shared by
    every apply: a node applying several deltas at once (or a bench with 8 fetchers in one
    process) then runs one decoding thread per core in all, not per apply (per-apply pools
    on 2 cores made 8 concurrent applies 10-30 % slower: 32 threads thrashing the caches).
    No job waits on another job, so sharing cannot deadlock. Keyed by process id: a forked
    child holds the parent's pool objects but not their threads."""
    pid = os.getpid()
    with _POOLS_LOCK:
        pools = _POOLS.get(pid)
        if pools is None:
            workers = max(1, min(DECODE_THREADS, os.cpu_count() or 1))
            pools = _POOLS[pid] = (
                ThreadPoolExecutor(workers, thread_name_prefix="delta-decode"),
                ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="delta-write"),
                workers,
            )
        return pools


# bins the encoder uses (the format allows up to BINS): the receiver makes one pass over a
# segment per bin, and on SmolLM2 (lr 3e-6) 4 bins cost 1.8 % more bytes than 8 and 30 %
# less decoding (docs/benchmarks.md, "Sparse deltas")
ENCODE_BINS = 4

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
    positions: np.ndarray | None  # distinct, in the record's decode order (not sorted)
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


def _classes(dtype: str, old: np.ndarray) -> np.ndarray | None:
    """The position class of every element (protocol/delta.py: the exponent field of
    its old bits), or None for a one-class dtype."""
    field = CLASS_FIELD.get(dtype)
    if field is None:
        return None
    shift, bits = field
    return ((np.asarray(old) >> shift) & ((1 << bits) - 1)).astype(np.uint8 if bits <= 8 else np.uint16)


def _segments(n: int) -> range:
    return range(0, n, SEGMENT)


def _entropy_bits(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Bits to code k changed of n elements at their own rate (binary entropy x n)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        p = k / n
        h = -(k * np.log2(p) + (n - k) * np.log2(1 - p))
    return np.nan_to_num(h, nan=0.0)


def _choose_bins(classes: np.ndarray | None, mask: np.ndarray, count: int) -> np.ndarray:
    """The bin of every class (u8, < BINS): the classes present, ordered by their change
    rate in this tensor, cut into at most BINS runs so that coding each run at its own
    rate costs the fewest bits (an exact dynamic programme over the cut points; a few
    dozen classes are present in practice)."""
    table = np.zeros(count, dtype=np.uint8)
    if classes is None:
        return table
    total = np.bincount(classes, minlength=count)
    hit = np.bincount(classes[mask], minlength=count)
    used = np.flatnonzero(total)
    used = used[np.argsort(hit[used] / total[used], kind="stable")]
    m = len(used)
    if m <= ENCODE_BINS:
        table[used] = np.arange(m, dtype=np.uint8)
        return _fill_absent(table, used)
    ck = np.concatenate([[0], np.cumsum(hit[used])]).astype(np.float64)
    cn = np.concatenate([[0], np.cumsum(total[used])]).astype(np.float64)
    # cost[i, j]: one bin holding the sorted classes i..j-1
    cost = _entropy_bits(ck[None, :] - ck[:, None], cn[None, :] - cn[:, None])
    cost[np.tril_indices(m + 1)] = np.inf
    best = np.full(m + 1, np.inf)
    best[0] = 0.0
    cuts = []
    for _ in range(ENCODE_BINS):
        cand = best[:, None] + cost  # [i, j]: the best of the bins before i, then one bin i..j-1
        arg = np.argmin(cand, axis=0)
        best = cand[arg, np.arange(m + 1)]
        best[0] = 0.0
        cuts.append(arg)
    j, b = m, ENCODE_BINS - 1
    while j > 0:
        i = int(cuts[b][j])
        table[used[i:j]] = b
        j, b = i, b - 1
    return _fill_absent(table, used)


def _fill_absent(table: np.ndarray, used: np.ndarray) -> np.ndarray:
    """``table`` with each class absent from the tensor given the bin of the nearest present
    class below it (above it, below the lowest): no element has such a class, so this
    changes no position, only the runs of equal bins (the receiver tests a bin with one
    comparison per run of classes, ``_BinMasks``)."""
    present = np.sort(used)
    nearest = np.searchsorted(present, np.arange(len(table)), side="right") - 1
    return table[present[np.maximum(nearest, 0)]]


def _bin_members(q: np.ndarray | None, n: int, b: int) -> np.ndarray:
    """Indices (in the segment) of bin ``b``'s elements, in index order (the encoder's view)."""
    return np.arange(n, dtype=np.int64) if q is None else np.flatnonzero(q == b)


# most ranges a bin may span for the range test; more and one gather through the table is cheaper
MAX_RANGES = 3


class _BinMasks:
    """Which elements of a base segment are in bin ``e``: ``table[class] == e``, computed from
    the class field of the old bits without a gather where the bin is a few ranges of classes
    (a shifted, narrowed copy of the segment, then per range one subtraction and one unsigned
    comparison on one byte an element: ~10x cheaper than indexing a table with 4M indices).
    The encoder gives absent classes the bin of a neighbour, so a bin is usually one or two
    ranges; any table still decodes, through the gather."""

    def __init__(self, dtype: str, table: np.ndarray) -> None:
        self.table = table
        field = CLASS_FIELD.get(dtype)
        self.field = field
        self.cdt = np.dtype(np.uint8) if field is None or field[1] <= 8 else np.dtype("<u2")
        self.ranges: list[list[tuple[Any, Any]] | None] = []
        edges = np.flatnonzero(np.diff(table.astype(np.int16), prepend=-1, append=-1))
        starts, ends = edges[:-1], edges[1:]  # runs of equal bins: classes starts[j]..ends[j]-1
        for e in range(BINS):
            runs = [(self.cdt.type(a), self.cdt.type(b - a - 1)) for a, b in zip(starts, ends) if table[a] == e]
            self.ranges.append(runs if len(runs) <= MAX_RANGES else None)

    def classes(self, old: np.ndarray) -> np.ndarray | None:
        """The class of every element (protocol/delta.py), narrowed to u8 (u16 for f64); None
        for a one-class dtype. bf16 and f32: the exponent is the top 8 bits under the sign, so
        the narrowing cast drops the sign and no mask is needed."""
        if self.field is None:
            return None
        shift, bits = self.field
        c = (old >> old.dtype.type(shift)).astype(self.cdt)
        if bits < 8 * self.cdt.itemsize:
            c &= self.cdt.type((1 << bits) - 1)
        return c

    def mask(self, cls: np.ndarray, e: int) -> np.ndarray:
        """Booleans: which of the elements of classes ``cls`` are in bin ``e``."""
        runs = self.ranges[e]
        if runs is None:
            return self.table[cls] == e
        if not runs:
            return np.zeros(len(cls), dtype=np.bool_)
        out: np.ndarray | None = None
        for lo, width in runs:
            m = (cls - lo) <= width  # unsigned: wraps below lo
            out = m if out is None else np.logical_or(out, m, out=out)
        assert out is not None
        return out


def _sign_magnitude(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(new - old) mod 2**bits as a sign (True: moved down) and an unsigned magnitude."""
    s = new.dtype.itemsize
    d = (new - old).view(f"<i{s}")
    neg = d < 0
    return neg, np.where(neg, -d, d).view(_UINT[s])


def _apply_sign_magnitude(old: np.ndarray, neg: np.ndarray, mag: np.ndarray) -> np.ndarray:
    return np.where(neg, old - mag, old + mag)


def _values(neg: np.ndarray, mag: np.ndarray) -> bytes:
    """Signs bit-packed LSB first, then the magnitudes byte-planed."""
    k, s = len(mag), mag.dtype.itemsize
    return np.packbits(neg, bitorder="little").tobytes() + mag.view(np.uint8).reshape(k, s).T.tobytes()


def _rice_param(gaps: np.ndarray) -> int:
    """The Rice parameter giving the fewest bits for ``gaps`` (near log2 of their mean)."""
    mean = float(gaps.mean()) if len(gaps) else 0.0
    r0 = max(0, int(np.log2(mean + 1.0)))
    best, best_r = None, 0
    for r in range(max(0, r0 - 2), min(MAX_RICE, r0 + 1) + 1):
        cost = int((gaps >> np.uint64(r)).sum()) + r * len(gaps)
        if best is None or cost < best:
            best, best_r = cost, r
    return best_r


def _encode_sparse(mask: np.ndarray, classes: np.ndarray | None, count: int) -> tuple[bytes, bytes, bytes, np.ndarray]:
    """(bin table + Rice tables, remainder stream, unary stream, changed positions in
    decode order) of the changed elements ``mask``."""
    n = len(mask)
    table = _choose_bins(classes, mask, count)
    live = np.flatnonzero(np.bincount(table[classes[mask]], minlength=BINS)) if classes is not None else [0]
    tables: list[bytes] = [table.tobytes()]
    rem_bits: list[np.ndarray] = []
    quotients: list[np.ndarray] = []
    order: list[np.ndarray] = []
    for s0 in _segments(n):
        s1 = min(n, s0 + SEGMENT)
        q = None if classes is None else table[classes[s0:s1]]
        seg = mask[s0:s1]
        rparams = np.zeros(BINS, dtype=np.uint8)
        counts = np.zeros(BINS, dtype="<u4")
        for b in live:
            members = _bin_members(q, s1 - s0, int(b))
            ranks = np.flatnonzero(seg[members])
            if not len(ranks):
                continue
            gaps = np.diff(ranks, prepend=-1).astype(np.uint64) - np.uint64(1)
            r = _rice_param(gaps)
            rparams[b], counts[b] = r, len(gaps)
            if r:
                bits = (gaps[:, None] >> np.arange(r, dtype=np.uint64)) & np.uint64(1)
                rem_bits.append(bits.astype(np.uint8).ravel())
            quotients.append(gaps >> np.uint64(r))
            order.append(s0 + members[ranks])
        tables.append(rparams.tobytes() + counts.tobytes())
    rem = np.packbits(np.concatenate(rem_bits), bitorder="little").tobytes() if rem_bits else b""
    qs = np.concatenate(quotients).astype(np.int64)
    ones = np.cumsum(qs + 1) - 1
    unary_bits = np.zeros(int(ones[-1]) + 1, dtype=np.uint8)
    unary_bits[ones] = 1
    unary = np.packbits(unary_bits, bitorder="little").tobytes()
    return b"".join(tables), rem, unary, np.concatenate(order)


def _encode_tensor(
    path: str, name: str, span: TensorSpan, old: np.ndarray, new: np.ndarray, level: int
) -> tuple[DeltaRecord | None, int, int]:
    """The record of one tensor (None if nothing changed), how many elements changed and
    the payload's raw (uncompressed) size."""
    old, new = np.asarray(old), np.asarray(new)
    ne = old != new
    k = int(np.count_nonzero(ne))
    if k == 0:
        return None, 0, 0
    n = span.numel
    s = new.dtype.itemsize
    enc, raw = ENC_DENSE, b""
    if k < n:
        classes = _classes(span.dtype, old)
        tables, rem, unary, positions = _encode_sparse(ne, classes, class_count(span.dtype))
        # the Rice tables are mostly zeros (compressed to little): count the used entries
        used = 5 * int(np.count_nonzero(np.frombuffer(tables, dtype=np.uint8)))
        if used + len(rem) + len(unary) + k * s + k // 8 < n * s + n // 8:
            enc = ENC_SPARSE
            raw = tables + rem + _values(*_sign_magnitude(old[positions], new[positions])) + unary
    if enc == ENC_DENSE:
        raw = _values(*_sign_magnitude(old, new))
    payload = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(raw)
    return DeltaRecord(path, name, span.dtype, enc, n, n if enc == ENC_DENSE else k, payload), k, len(raw)


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
            rec, changed, raw_size = _encode_tensor(rel, name, span, _tensor(a, span), _tensor(b, span), level)
            if rec is not None:
                records.append(rec)
                stats.tensors_changed += 1
                stats.changed += changed
                stats.raw_bytes += raw_size
                stats.delta_bytes += len(rec.payload)
                if max_bytes is not None and stats.delta_bytes >= max_bytes:
                    raise DeltaIncompatible(f"the delta passed {max_bytes} bytes at tensor {name}")
    data = pack_delta(records)
    stats.delta_bytes = len(data)
    stats.seconds = time.perf_counter() - t0
    return data, stats


def _bad(rec: DeltaRecord, detail: str) -> ProtocolError:
    return ProtocolError("delta.format", f"{rec.name}: {detail}")


def _decompress(rec: DeltaRecord) -> np.ndarray:
    bound = rec.raw_bound
    size = zstandard.frame_content_size(rec.payload) if len(rec.payload) >= 4 else -1
    if not 0 <= size <= bound or (rec.encoding == ENC_DENSE and size != bound):
        raise _bad(rec, f"payload declares {size} bytes, the record allows {bound}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(rec.payload, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise _bad(rec, f"bad zstandard frame: {exc}") from None
    if len(raw) != size:
        raise _bad(rec, f"payload is {len(raw)} bytes, it declares {size}")
    return np.frombuffer(raw, dtype=np.uint8)


def _unplane(buf: np.ndarray, k: int, s: int) -> np.ndarray:
    """``k`` values of ``s`` bytes from their byte planes: one strided copy per plane (a
    transposing copy of the whole was 6x slower)."""
    out = np.empty((k, s), dtype=np.uint8)
    for j in range(s):
        out[:, j] = buf[j * k : (j + 1) * k]
    return out.view(_UINT[s]).reshape(k)


def _decode_values(rec: DeltaRecord, buf: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(signs, magnitudes) of ``k`` values from the start of ``buf`` (exactly that long)."""
    sbytes = (k + 7) // 8
    neg = np.unpackbits(buf[:sbytes], bitorder="little")
    if np.count_nonzero(neg[k:]):
        raise _bad(rec, "sign padding is not zero")
    return neg[:k].view(np.bool_), _unplane(buf[sbytes:], k, rec.element_size)


class _RecordDecoder:
    """One record, decompressed and its tables checked up front, then decoded segment by
    segment against the base segment's old bits (``segment``), in order. Why per segment:
    applying streams the base once (read a segment, patch it, hash and write it), so the
    decoder never needs a whole tensor of the base in memory, nor a second read of it.

    Every count, parameter and gap is checked against the population it indexes before it
    is used; what depends on the base (the bins' populations) is checked when its segment
    is decoded, so a refusal may come after earlier segments were written (the caller
    writes into a temp folder it discards)."""

    def __init__(self, rec: DeltaRecord) -> None:
        self.rec = rec
        buf = _decompress(rec)
        n, k, s = rec.numel, rec.changed, rec.element_size
        self.segs = _segments(n)
        self.dense = rec.encoding == ENC_DENSE
        if self.dense:
            self.neg, self.mag = _decode_values(rec, buf, n)
            return
        count = class_count(rec.dtype)
        tsize = count + 5 * BINS * len(self.segs)
        if len(buf) < tsize:
            raise _bad(rec, "payload shorter than its bin and Rice tables")
        table = buf[:count]
        if int(table.max()) >= BINS:
            raise _bad(rec, f"bin table names bin {int(table.max())}, there are {BINS}")
        tables = buf[count:tsize].reshape(len(self.segs), 5 * BINS)
        self.rparams = tables[:, :BINS].astype(np.int64)
        self.counts = tables[:, BINS:].copy().view("<u4").astype(np.int64)
        if int(self.rparams.max()) > MAX_RICE:
            raise _bad(rec, f"Rice parameter {int(self.rparams.max())} over {MAX_RICE}")
        if int(self.counts.sum()) != k:
            raise _bad(rec, f"bin counts add up to {int(self.counts.sum())} changed elements, not {k}")
        rem_total = int((self.rparams * self.counts).sum())
        rem_end = tsize + (rem_total + 7) // 8
        val_end = rem_end + (k + 7) // 8 + k * s
        if len(buf) < val_end:
            raise _bad(rec, "payload shorter than its remainders and values")
        self.rem_bits = np.unpackbits(buf[tsize:rem_end], bitorder="little")
        if np.count_nonzero(self.rem_bits[rem_total:]):
            raise _bad(rec, "remainder padding is not zero")
        # the quotients from the 0 bits (most quotients are 0, so the zeros are the fewer):
        # the code a 0 bit belongs to is the count of 1 bits before it; zeros after the
        # last 1 (code k) are padding
        unary = np.unpackbits(buf[val_end:], bitorder="little")
        zeros = np.flatnonzero(unary == 0)
        owner = zeros - np.arange(len(zeros))
        per_code = np.bincount(owner, minlength=k + 1)
        if len(unary) - len(zeros) != k or len(per_code) != k + 1 or per_code[k] >= 8:
            raise _bad(
                rec, f"unary stream holds {len(unary) - len(zeros)} codes for {k} changed elements, or stray bytes"
            )
        self.quotients = per_code[:k]
        self.neg, self.mag = _decode_values(rec, buf[rem_end:val_end], k)
        self.bins = _BinMasks(rec.dtype, table)
        # where each segment starts in the value and unary streams and in the remainder bits
        self.seg_i = np.concatenate([[0], np.cumsum(self.counts.sum(axis=1))])
        self.seg_b = np.concatenate([[0], np.cumsum((self.rparams * self.counts).sum(axis=1))])

    def segment(self, si: int, old: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """(changed indices within segment ``si``, in decode order; None: every element)
        and their new bits, given the segment's old bits. Segments decode independently
        (each one's offsets into the streams are summed up front), so threads may decode
        several at once."""
        s0 = self.segs[si]
        n = len(old)
        if self.dense:
            return None, _apply_sign_magnitude(old, self.neg[s0 : s0 + n], self.mag[s0 : s0 + n])
        rec, counts, rparams = self.rec, self.counts[si], self.rparams[si]
        i0, b = int(self.seg_i[si]), int(self.seg_b[si])
        live = [int(e) for e in np.flatnonzero(counts)]
        if not live:
            return np.zeros(0, dtype=np.int64), old[:0]
        # per bin: the gaps' steps (rank of each changed member + 1, as differences)
        steps: dict[int, np.ndarray] = {}
        i = i0
        for e in live:
            ke, r = int(counts[e]), int(rparams[e])
            rem = np.zeros(ke, dtype=np.int64)
            if r:
                weights = np.int64(1) << np.arange(r, dtype=np.int64)
                rem = self.rem_bits[b : b + ke * r].reshape(ke, r).astype(np.int64) @ weights
            b += ke * r
            qe = self.quotients[i : i + ke]
            i += ke
            # bound every term before summing, so a hostile stream cannot overflow int64
            if r > max(1, n.bit_length()) or int(qe.max()) > n >> r:
                raise _bad(rec, f"segment {si}, bin {e}: a gap past its {n} elements")
            steps[e] = (qe << r) + rem + 1
        ranks = {e: np.cumsum(st) - 1 for e, st in steps.items()}
        located = self._locate(si, old, ranks)
        positions = located[0] if len(located) == 1 else np.concatenate(located)
        new = _apply_sign_magnitude(old[positions], self.neg[i0:i], self.mag[i0:i])
        return positions, new

    def _locate(self, si: int, old: np.ndarray, ranks: dict[int, np.ndarray]) -> list[np.ndarray]:
        """The segment indices of each bin's ranked members (bins in order), checking every
        rank against its bin's population: per bin, one range test of the class byte and one
        ``flatnonzero``. (Tried and dropped: locating the biggest bin through its complement,
        a binary search over the other bins' indices: twice as slow on SmolLM2's segments,
        docs/benchmarks.md "Sparse deltas".)"""
        n = len(old)
        cls = self.bins.classes(old)
        out: list[np.ndarray] = []
        for e, rk in ranks.items():
            if cls is None:  # one class: every element is in bin table[0]
                members = None
                population = n if e == int(self.bins.table[0]) else 0
            else:
                members = np.flatnonzero(self.bins.mask(cls, e))
                population = len(members)
            if len(rk) > population or int(rk[-1]) >= population:
                raise _bad(self.rec, f"segment {si}, bin {e}: positions past its {population} elements")
            out.append(rk if members is None else members[rk])
        return out


def decode_record(rec: DeltaRecord, old: np.ndarray) -> TensorChange:
    """Decompress and check one record against ``old``, the base tensor's bits (unsigned
    ints of the element size: positions are coded by the old elements' classes and values
    as differences from them). Raises ProtocolError ``delta.format``."""
    if len(old) != rec.numel or old.dtype.itemsize != rec.element_size:
        raise ProtocolError("delta.base", f"{rec.name}: the base tensor does not match the record")
    dec = _RecordDecoder(rec)
    positions: list[np.ndarray] = []
    values: list[np.ndarray] = []
    for si, s0 in enumerate(dec.segs):
        pos, new = dec.segment(si, np.asarray(old[s0 : s0 + SEGMENT]))
        if pos is not None:
            positions.append(s0 + pos)
        values.append(new)
    joined = np.concatenate(values)
    if dec.dense:
        return TensorChange(rec.path, rec.name, rec.dtype, rec.numel, None, joined)
    return TensorChange(rec.path, rec.name, rec.dtype, rec.numel, np.concatenate(positions), joined)


def iter_changes(data: bytes | memoryview, base: Mapping[str, Path]) -> Iterator[TensorChange]:
    """Every tensor the delta changes on ``base`` ({path: file}), decoded (the engines'
    in-place load reads this). Raises ProtocolError ``delta.*``."""
    records = parse_delta(data)
    layouts = check_against_base(records, base)
    for rec in records:
        yield decode_record(rec, _tensor(Path(base[rec.path]), layouts[rec.path][rec.name]))


def changed_tensors(data: bytes | memoryview, base: Mapping[str, Path]) -> list[DeltaRecord]:
    """The records of the tensors the delta changes on ``base``, checked against it but not
    decoded (an engine that reloads whole tensors, vLLM, needs the names, not the bits).
    Raises ProtocolError ``delta.*``."""
    records = parse_delta(data)
    check_against_base(records, base)
    return records


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


class _BlockIO:
    """Opens the result's files with O_DIRECT where the filesystem allows it (directio.py
    says why: fresh page-cache pages are what costs on a VM), buffered otherwise."""

    def __init__(self, direct: bool) -> None:
        self.direct = direct

    def open_out(self, path: Path) -> tuple[int, bool]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if self.direct:
            try:
                return directio.open_direct(path, flags), True
            except DirectIOUnsupported:
                self.direct = False
        return os.open(path, flags, 0o644), False


# bytes a writing thread hashes and writes at once: a whole number of chunks, at least one
# (with a delta's small chunks, 256 KiB, one write per chunk made an apply ~15 % slower)
WRITE_BLOCK = 4 * 1024 * 1024


class _ChunkSink:
    """Takes a file's new bytes in order and, per block of whole ``chunk_size`` chunks (about
    ``WRITE_BLOCK`` bytes), hashes each chunk and writes the block (O_DIRECT where allowed) on
    ``pool``'s threads while the caller decodes the next (sha256 and the write release the
    GIL): ``WRITE_THREADS`` blocks hashed and written at once (one thread hashing while
    another waits on the disk: with one thread, sha256 and the O_DIRECT writes in series
    were the apply's longest path), as many being filled. ``done(index)`` runs on a writing
    thread after chunk ``index`` is written (not necessarily in order)."""

    def __init__(
        self, fd: int, direct: bool, chunk_size: int, pool: ThreadPoolExecutor, done: Callable[[int], None] | None
    ) -> None:
        self.fd, self.direct, self.chunk_size, self.pool, self.done = fd, direct, chunk_size, pool, done
        self.block = chunk_size * max(1, WRITE_BLOCK // chunk_size)
        self.bufs = [
            np.frombuffer(directio.scratch(self.block, f"delta-block-{i}"), dtype=np.uint8)[: self.block]
            for i in range(2 * WRITE_THREADS)
        ]
        self.writes: list[Future[list[bytes]]] = []
        self.fill = 0
        self.offset = 0

    def feed(self, data: np.ndarray) -> None:
        at, n = 0, len(data)
        while at < n:
            buf = self.bufs[len(self.writes) % len(self.bufs)]
            take = min(self.block - self.fill, n - at)
            buf[self.fill : self.fill + take] = data[at : at + take]
            self.fill += take
            at += take
            if self.fill == self.block:
                self._submit()

    def _submit(self) -> None:
        nbuf = len(self.bufs)
        buf = self.bufs[len(self.writes) % nbuf]
        self.writes.append(self.pool.submit(self._write, buf, self.fill, self.offset))
        self.offset += self.fill
        self.fill = 0
        if len(self.writes) >= nbuf:
            self.writes[-nbuf].result()  # the buffer to be filled next has been written

    def _write(self, buf: np.ndarray, n: int, offset: int) -> list[bytes]:
        raw = buf[:n].data
        cs = self.chunk_size
        digests = [hashlib.sha256(raw[i : i + cs]).digest() for i in range(0, n, cs)]
        whole = n - n % directio.ALIGN if self.direct else n
        # O_DIRECT: our buffers are page-aligned and a block's start is a multiple of the
        # chunk size (itself of the alignment), so the aligned part goes as it is; only the
        # file's last block has an unaligned tail, written through pwrite_direct's copy
        done = 0
        while done < whole:
            done += os.pwrite(self.fd, raw[done:whole], offset + done)
        if whole < n:
            directio.pwrite_direct(self.fd, raw[whole:n], offset + whole)
        if self.done is not None:
            for i in range(len(digests)):
                self.done(offset // cs + i)
        return digests

    def close(self) -> list[bytes]:
        """Write what is left; every chunk's sha256, in order, once all are written."""
        if self.fill:
            self._submit()
        return [d for w in self.writes for d in w.result()]


def _read_into(fd: int, buf: np.ndarray, a: int) -> None:
    """Fill ``buf`` with the base file's bytes from offset ``a`` (through the page cache)."""
    view = buf.data
    n, got = len(buf), 0
    while got < n:
        r = os.preadv(fd, [view[got:]], a + got)
        if r == 0:
            raise OSError(f"base file short at {a + got}")
        got += r


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Bytes ``a..b`` of a base file, passed on unchanged or (``dec`` set) segment ``si``
    of a changed tensor, patched."""

    a: int
    b: int
    dec: _RecordDecoder | None = None
    si: int = 0


def _pieces(size: int, tensors: list[tuple[TensorSpan, _RecordDecoder]], block: int) -> Iterator[_Piece]:
    """A base file cut, in order, into unchanged runs of at most ``block`` bytes and the
    position segments of each changed tensor."""
    pos = 0

    def plain(a: int, b: int) -> Iterator[_Piece]:
        for x in range(a, b, block):
            yield _Piece(x, min(b, x + block))

    for span, dec in sorted(tensors, key=lambda t: t[0].start):
        if span.start < pos:
            raise ProtocolError("delta.base", f"{dec.rec.name}: overlaps another tensor of the base")
        yield from plain(pos, span.start)
        s = dec.rec.element_size
        for si, e0 in enumerate(dec.segs):
            yield _Piece(span.start + e0 * s, span.start + min(dec.rec.numel, e0 + SEGMENT) * s, dec, si)
        pos = span.end
    yield from plain(pos, size)


def _patch(fd: int, piece: _Piece, buf: np.ndarray) -> np.ndarray:
    """Read ``piece`` of the base into ``buf`` and, for a segment, decode it against those
    bytes and patch them in place. Runs on a decoding thread (numpy, zstandard and the read
    release the GIL for the bulk of the work)."""
    raw = buf[: piece.b - piece.a]
    _read_into(fd, raw, piece.a)
    dec = piece.dec
    if dec is not None:
        old = raw.view(_UINT[dec.rec.element_size])
        positions, new = dec.segment(piece.si, old)
        if positions is None:
            old[:] = new
        else:
            old[positions] = new
    return raw


def _rebuild_file(
    fd: int,
    size: int,
    tensors: list[tuple[TensorSpan, _RecordDecoder]],
    sink: _ChunkSink,
    pool: ThreadPoolExecutor,
    workers: int,
    block: int,
) -> None:
    """One pass over a base file: unchanged bytes passed on, each changed tensor read a
    segment at a time, decoded against it and patched in place. Pieces are read and
    patched on ``pool`` (``workers`` threads, ``PIECES_AHEAD`` pieces ahead) and fed to ``sink`` in
    file order, each from its own reused buffer."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    ahead = max(workers + 1, PIECES_AHEAD)
    free: list[np.ndarray] = []
    pending: collections.deque[tuple[Future[np.ndarray], np.ndarray]] = collections.deque()

    def drain_one() -> None:
        fut, buf = pending.popleft()
        sink.feed(fut.result())
        free.append(buf)

    try:
        for piece in _pieces(size, tensors, block):
            if len(pending) >= ahead:
                drain_one()
            n = piece.b - piece.a
            buf = free.pop() if free else np.empty(0, dtype=np.uint8)
            if len(buf) < n:
                buf = np.empty(max(n, block), dtype=np.uint8)
            pending.append((pool.submit(_patch, fd, piece, buf), buf))
        while pending:
            drain_one()
    finally:  # on a refusal: nothing may still read ``fd`` once the caller closes it
        for fut, _ in pending:
            fut.cancel()
        futures.wait([fut for fut, _ in pending])


def apply_delta(
    base: Mapping[str, Path],
    data: bytes | memoryview,
    out_dir: Path,
    *,
    chunk_size: int,
    durable: bool = True,
    direct: bool = True,
    on_block: Callable[[str, int], None] | None = None,
    workers: int | None = None,
) -> dict[str, list[bytes]]:
    """Write the new version's files into ``out_dir`` in one pass over the base: unchanged
    bytes are copied, changed tensors decoded a segment at a time against the base bytes
    just read (no second read, no memory map), and every ``chunk_size`` chunk of the result
    is hashed from memory as it is written. Returns the sha256 of every chunk of every
    rebuilt file (what the new version's anchor manifest would list), so the caller checks
    ``weights_root`` without reading the result again.

    The delta's layout, its records against the base's headers and every payload's
    tables are checked before a byte is written; what depends on the base's elements (a
    gap past a bin's population) when its segment comes, so the caller writes into a temp
    folder and renames it only after checking the result. ``on_block(path, index)`` runs
    after each written chunk (tests kill the process there). ``workers``: decode on a pool
    of that many threads of this call's own (tests); None, the default: on the process's
    shared pools (``_shared_pools``).
    """
    records = parse_delta(data)
    layouts = check_against_base(records, base)
    if workers is None:
        decoders, writers, workers = _shared_pools()
        return _apply(
            base, records, layouts, out_dir, decoders, writers, workers, chunk_size, durable, direct, on_block
        )
    with (
        ThreadPoolExecutor(workers, thread_name_prefix="delta-decode") as decoders,
        ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="delta-write") as writers,
    ):
        return _apply(
            base, records, layouts, out_dir, decoders, writers, workers, chunk_size, durable, direct, on_block
        )


def _apply(
    base: Mapping[str, Path],
    records: list[DeltaRecord],
    layouts: dict[str, dict[str, TensorSpan]],
    out_dir: Path,
    decoders: ThreadPoolExecutor,
    writers: ThreadPoolExecutor,
    workers: int,
    chunk_size: int,
    durable: bool,
    direct: bool,
    on_block: Callable[[str, int], None] | None,
) -> dict[str, list[bytes]]:
    """``apply_delta`` on the given pools, its delta parsed and checked against the base."""
    by_file: dict[str, list[tuple[TensorSpan, _RecordDecoder]]] = {}
    # decompressing and checking every payload's tables: in parallel too (zstd and numpy)
    for rec, dec in zip(records, decoders.map(_RecordDecoder, records), strict=True):
        by_file.setdefault(rec.path, []).append((layouts[rec.path][rec.name], dec))
    io = _BlockIO(direct and chunk_size % directio.ALIGN == 0)
    out_dir.mkdir(parents=True, exist_ok=True)
    hashes: dict[str, list[bytes]] = {}
    for rel in sorted(base):
        src, dst = Path(base[rel]), out_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        size = src.stat().st_size
        # buffered reads with readahead, not O_DIRECT: the next range arrives while we decode
        # (the base was written with O_DIRECT, so it is rarely cached; O_DIRECT reads made one
        # apply 1.6-1.8 s instead of 1.2-1.3, docs/benchmarks.md "Sparse deltas")
        fin = os.open(src, os.O_RDONLY)
        try:
            fout, dout = io.open_out(dst)
            try:
                done = None if on_block is None else (lambda i, rel=rel: on_block(rel, i))
                sink = _ChunkSink(fout, dout, chunk_size, writers, done)
                try:
                    _rebuild_file(fin, size, by_file.get(rel, []), sink, decoders, workers, chunk_size)
                    hashes[rel] = sink.close()
                finally:  # on a refusal too: no write of ours may use ``fout`` once it is closed
                    futures.wait(sink.writes)
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
]
