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

    header   16 bytes  "PNDL", u16 format version (1), u16 flags (0), u32 records, u32 0
    record   32 bytes  u16 path length, u16 name length, u8 dtype length, u8 encoding, 2 x 0,
                       u64 elements in the tensor, u64 elements changed, u64 payload length
             then      path (utf-8), tensor name (utf-8), dtype (ascii, as safetensors spells it)
             then      payload: one zstandard frame (content size in its header)

Records are sorted by (path, name), strictly (so one tensor has one record), and
list only tensors with at least one changed element. The payload decompresses
to exactly ``payload_size(encoding, numel, changed, element size)`` bytes:

* ``ENC_BITMAP`` (1): a bitmap of the changed elements, bit i = element i,
  byte i // 8, mask 1 << (i % 8), ceil(numel / 8) bytes (bits past ``numel`` zero),
  then the values;
* ``ENC_GAPS`` (2): ``changed`` u32 gaps (the first changed index, then each
  index minus the previous, so every gap after the first is >= 1), then the
  values; only for tensors under 2**32 elements;
* ``ENC_DENSE`` (3): every element changed (``changed == numel``): the values only.

Values: the new bit patterns of the changed elements in index order, byte-planed:
the lowest byte of every value, then the next byte of every value, and so on
(element size s gives s planes of ``changed`` bytes). Splitting the planes puts
the slowly varying sign/exponent bytes together, which the compressor packs far
better than interleaved values.

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
FORMAT_VERSION = 1
DELTA_FILE = "weights.pndl"

ENC_BITMAP = 1
ENC_GAPS = 2
ENC_DENSE = 3
ENCODINGS = (ENC_BITMAP, ENC_GAPS, ENC_DENSE)

HEADER = struct.Struct("<4sHHII")
RECORD = struct.Struct("<HHBB2xQQQ")
MAX_RECORDS = 1 << 20
MAX_NUMEL = 1 << 48
MAX_GAPS_NUMEL = 1 << 32

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

# safetensors: the header's size, a u64, comes first; we refuse headers over this
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


def _err(detail: str) -> ProtocolError:
    return ProtocolError("delta.format", detail)


def payload_size(encoding: int, numel: int, changed: int, element_size: int) -> int:
    """Exact decompressed payload length of a record."""
    values = changed * element_size
    if encoding == ENC_BITMAP:
        return (numel + 7) // 8 + values
    if encoding == ENC_GAPS:
        return 4 * changed + values
    if encoding == ENC_DENSE:
        return values
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
    def raw_size(self) -> int:
        """Length of the decompressed payload."""
        return payload_size(self.encoding, self.numel, self.changed, self.element_size)

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
        if self.encoding == ENC_GAPS and self.numel > MAX_GAPS_NUMEL:
            raise _err(f"{self.name}: u32 gaps for a tensor of {self.numel} elements")
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
