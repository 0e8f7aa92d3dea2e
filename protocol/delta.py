"""The sparse-delta file: one policy version as the changes against an earlier one.

A delta version's manifest (``CheckpointManifest.delta`` set) lists one file,
``DELTA_FILE``, cut into chunks like any checkpoint file. Applying it to the
base version's safetensors files gives the new version's files byte for byte:
the trainer's export keeps every safetensors header (names, dtypes, shapes,
offsets) from one version to the next, so only tensor *elements* change, and the
delta carries, per changed tensor, which elements changed and their new bit
patterns. Bit patterns, not values: nothing is rounded, so bf16 and fp32 (any
dtype) rebuild exactly, and the result is checked against the manifest's
``weights_root`` before anything loads it.

Layout (all integers little-endian)::

    header   16 bytes  "PNDL", u16 format version (3), u16 flags (0), u32 records, u32 0
    record   32 bytes  u16 path length, u16 name length, u8 dtype length, u8 encoding, 2 x 0,
                       u64 elements in the tensor, u64 elements changed, u64 payload length
             then      path (utf-8), tensor name (utf-8), dtype (ascii, as safetensors spells it)
             then      payload: one zstandard frame (content size in its header)

Records are sorted by (path, name), strictly (so one tensor has one record), and
list only tensors with at least one changed element.

**Values** are sent as the difference of bit patterns, not the new patterns: for
each changed element ``d = (new - old) mod 2**bits`` of its unsigned bit pattern, read
as signed, sent as a sign bit (1: ``d < 0``) and a magnitude ``|d|`` (unsigned, the
element size). The sign bits are bit-packed LSB first, the magnitudes byte-planed
(the lowest byte of every value, then the next, ...). After an RL step a changed
bf16 weight moves by one or two units in the last place: the signs are a coin toss
(one bit each, incompressible) and the magnitudes almost all 1 or 2. Listed in
decode order (below), values of one change-rate group sit side by side (measured
on SmolLM2, lr 3e-6: about 1.5 bits a value after zstd, 2.6 as format 2's zigzag
planes in index order). The receiver holds the old bits (the base), so this is
exact for any dtype.

**Positions** are coded against the *classes* of the base's elements: for float
dtypes the exponent field of the old bit pattern (``CLASS_FIELD``: shift, bits),
one class otherwise. Why: one optimizer step moves a weight by about the same
amount whatever its size, so whether its bf16 bits change depends on its unit in
the last place, i.e. its exponent, which the receiver knows. The encoder merges
the classes into at most ``BINS`` (8) *bins* of similar change rate (a table in
the payload, C x u8: the bin of each class) and per bin sends the changed
elements' ranks among that bin's elements (in index order) as gaps (first rank,
then each rank minus the previous minus 1), Rice-coded with a per-bin parameter r:
the low r bits of every gap in one stream, the rest (``gap >> r``) in unary (that
many 0 bits, then a 1) in another, both bit-packed LSB first. Why bins, not
classes: the receiver then finds a bin's elements with one comparison and one
``flatnonzero`` over the segment per bin (format 2 sorted every segment by class:
1.8 of a fetcher's 2.2 CPU-s), and a few bins chosen by change rate code the
positions almost as well as per-class coding (SmolLM2, lr 3e-6: the entropy of
the positions given 6 bins is within 0.2 % of that given the class; the 4 bins the
encoder uses make the delta 1.8 % larger than 8 bins do).

Positions are coded per *segment* of ``SEGMENT`` (2**22) elements (element i is in
segment i // SEGMENT; ranks count within the segment), each with its own Rice
parameters and counts. The changed elements are listed segment by segment, bin by
bin, in index order within a bin (*decode order*), in every stream: remainders,
signs, magnitudes, unary. Payload of ``ENC_SPARSE`` (1), decompressed: the bin
table (C x u8, each < ``BINS``; C = ``class_count(dtype)``); per segment
``BINS`` x u8 Rice parameters (<= 48) then ``BINS`` x u32 changed elements per bin
(all counts add up to ``changed``); the remainder stream (ceil(sum of count x r / 8)
bytes, padding bits 0); the signs (ceil(changed / 8) bytes, padding bits 0); the
magnitudes (``changed`` x element size bytes); then the unary stream to the end
(exactly ``changed`` 1 bits, fewer than 8 zero bits after the last). ``ENC_DENSE``
(2), every element changed (``changed == numel``): the signs and magnitudes of
every element in index order. The decompressed size is at most ``payload_bound``
(checked against the frame's declared size before decompressing; dense: exactly).

This module is pure (it parses and builds the container and safetensors
headers; it never decompresses or touches numbers): ``node/checkpoints/delta.py``
encodes and applies with numpy and zstandard.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import struct

from .errors import ProtocolError

MAGIC = b"PNDL"
FORMAT_VERSION = 3
DELTA_FILE = "weights.pndl"

ENC_SPARSE = 1
ENC_DENSE = 2
ENCODINGS = (ENC_SPARSE, ENC_DENSE)
MAX_RICE = 48
# positions are coded per segment of this many elements (each with its own Rice table):
# bounds the receiver's working set (8 bytes of index an element) whatever the tensor's size
SEGMENT = 1 << 22
# classes are merged into at most this many bins of similar change rate
BINS = 8

HEADER = struct.Struct("<4sHHII")
RECORD = struct.Struct("<HHBB2xQQQ")
MAX_RECORDS = 1 << 20
MAX_NUMEL = 1 << 48

# safetensors dtype -> bytes per element (the only thing a delta needs to know of a dtype)
ELEMENT_SIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

# float dtypes: (shift, bits) of the exponent field, the class of an element for positions
CLASS_FIELD = {"BF16": (7, 8), "F16": (10, 5), "F32": (23, 8), "F64": (52, 11)}


def class_count(dtype: str) -> int:
    """How many position classes a tensor of ``dtype`` has (1 for non-float dtypes)."""
    field = CLASS_FIELD.get(dtype)
    return 1 << field[1] if field is not None else 1


# safetensors: the header's size, a u64, comes first; we refuse headers over this
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


def _err(detail: str) -> ProtocolError:
    return ProtocolError("delta.format", detail)


def payload_bound(encoding: int, numel: int, changed: int, dtype: str) -> int:
    """Largest decompressed payload a record may declare (dense: exactly this)."""
    values = (changed + 7) // 8 + changed * ELEMENT_SIZE[dtype]  # signs + magnitudes
    if encoding == ENC_DENSE:
        return values
    if encoding == ENC_SPARSE:
        # bin table + Rice tables + remainders (<= MAX_RICE bits a gap) + values + unary (<= numel bits)
        tables = class_count(dtype) + 5 * BINS * -(-numel // SEGMENT)
        return tables + (changed * MAX_RICE + 7) // 8 + values + (numel + 7) // 8
    raise _err(f"unknown position encoding {encoding}")


@dataclasses.dataclass(frozen=True)
class DeltaRecord:
    """The changes to one tensor: ``payload`` is the compressed frame, untouched."""

    path: str
    name: str
    dtype: str
    encoding: int
    numel: int
    changed: int
    payload: bytes

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZE[self.dtype]

    @property
    def raw_bound(self) -> int:
        """Most bytes the payload may decompress to."""
        return payload_bound(self.encoding, self.numel, self.changed, self.dtype)

    def check(self) -> None:
        """The record's own rules (raises ProtocolError ``delta.format``)."""
        if not self.path or not self.name:
            raise _err("empty path or tensor name")
        if self.dtype not in ELEMENT_SIZE:
            raise _err(f"{self.name}: unknown dtype {self.dtype!r}")
        if self.encoding not in ENCODINGS:
            raise _err(f"{self.name}: unknown position encoding {self.encoding}")
        if not 0 < self.numel <= MAX_NUMEL:
            raise _err(f"{self.name}: {self.numel} elements")
        if not 0 < self.changed <= self.numel:
            raise _err(f"{self.name}: {self.changed} changed of {self.numel} elements")
        if self.encoding == ENC_DENSE and self.changed != self.numel:
            raise _err(f"{self.name}: dense encoding with {self.changed} of {self.numel} changed")
        if not self.payload:
            raise _err(f"{self.name}: empty payload")


def pack_delta(records: list[DeltaRecord]) -> bytes:
    """The delta file bytes of ``records`` (sorted here; each must pass ``check``)."""
    recs = sorted(records, key=lambda r: (r.path, r.name))
    for a, b in itertools.pairwise(recs):
        if (a.path, a.name) == (b.path, b.name):
            raise ValueError(f"two records for {a.path}:{a.name}")
    if len(recs) > MAX_RECORDS:
        raise ValueError(f"{len(recs)} records, cap {MAX_RECORDS}")
    out = [HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(recs), 0)]
    for r in recs:
        r.check()
        p, n, d = r.path.encode(), r.name.encode(), r.dtype.encode("ascii")
        out.append(RECORD.pack(len(p), len(n), len(d), r.encoding, r.numel, r.changed, len(r.payload)))
        out += [p, n, d, r.payload]
    return b"".join(out)


def parse_delta(data: bytes | memoryview) -> list[DeltaRecord]:
    """Every record of a delta file, checked against the layout above.

    Raises ProtocolError ``delta.format`` naming what is wrong; never reads
    past ``data`` and never allocates more than ``data`` holds."""
    view = memoryview(data)
    if len(view) < HEADER.size:
        raise _err(f"{len(view)} bytes, shorter than the header")
    magic, version, flags, count, zero = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise _err(f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION or flags or zero:
        raise _err(f"format version {version}, flags {flags}: only version {FORMAT_VERSION}, no flags")
    if count > MAX_RECORDS:
        raise _err(f"{count} records, cap {MAX_RECORDS}")
    pos = HEADER.size
    out: list[DeltaRecord] = []
    prev: tuple[str, str] | None = None
    for i in range(count):
        if pos + RECORD.size > len(view):
            raise _err(f"record {i}: truncated header")
        plen, nlen, dlen, enc, numel, changed, clen = RECORD.unpack_from(view, pos)
        if bytes(view[pos + 6 : pos + 8]) != b"\x00\x00":
            raise _err(f"record {i}: padding is not zero")
        pos += RECORD.size
        end = pos + plen + nlen + dlen + clen
        if end > len(view):
            raise _err(f"record {i}: {end - len(view)} bytes past the end of the file")
        try:
            path = bytes(view[pos : pos + plen]).decode()
            name = bytes(view[pos + plen : pos + plen + nlen]).decode()
            dtype = bytes(view[pos + plen + nlen : pos + plen + nlen + dlen]).decode("ascii")
        except UnicodeDecodeError as exc:
            raise _err(f"record {i}: {exc}") from None
        pos += plen + nlen + dlen
        rec = DeltaRecord(path, name, dtype, enc, numel, changed, bytes(view[pos : pos + clen]))
        pos += clen
        rec.check()
        key = (path, name)
        if prev is not None and key <= prev:
            raise _err(f"record {i}: {path}:{name} out of order or repeated")
        prev = key
        out.append(rec)
    if pos != len(view):
        raise _err(f"{len(view) - pos} bytes after the last record")
    return out


# ----------------------------------------------------------------- safetensors


@dataclasses.dataclass(frozen=True)
class TensorSpan:
    """Where one tensor lives in a safetensors file (absolute byte offsets)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def safetensors_header_size(prefix: bytes | memoryview) -> int:
    """Bytes of header (8-byte length + JSON) from the first 8 bytes of a safetensors file."""
    if len(prefix) < 8:
        raise _err("safetensors file shorter than 8 bytes")
    (n,) = struct.unpack_from("<Q", prefix, 0)
    if n > MAX_SAFETENSORS_HEADER:
        raise _err(f"safetensors header of {n} bytes")
    return int(8 + n)


def parse_safetensors_header(header: bytes | memoryview, file_size: int) -> dict[str, TensorSpan]:
    """Tensors of a safetensors file from its header bytes (``safetensors_header_size`` long)."""
    start = safetensors_header_size(header)
    if len(header) < start:
        raise _err("safetensors header truncated")
    try:
        meta = json.loads(bytes(header[8:start]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise _err(f"safetensors header is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise _err("safetensors header is not an object")
    out: dict[str, TensorSpan] = {}
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = tuple(int(d) for d in info["shape"])
            a, b = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise _err(f"safetensors entry {name!r}: {exc}") from None
        if dtype not in ELEMENT_SIZE:
            raise _err(f"safetensors entry {name!r}: unknown dtype {dtype!r}")
        span = TensorSpan(dtype, shape, start + a, start + b)
        if a < 0 or b < a or span.end > file_size or b - a != span.numel * ELEMENT_SIZE[dtype]:
            raise _err(f"safetensors entry {name!r}: offsets {a}..{b} do not fit")
        out[name] = span
    return out
