"""The sparse-delta wire formats (protocol/delta.py, ``DeltaRef``, ``ManifestRequest``):
fixed bytes for fixed inputs, and every malformed delta file refused with a reason.

The literals were computed once with the code of the commit that introduced them
and checked by hand against the layout in docs/protocol.md ("Sparse deltas"):
changing one is a wire-protocol break.
"""

from __future__ import annotations

import struct

import pytest

import protocol.messages as m
from protocol import ProtocolError, sha256
from protocol.delta import (
    BINS,
    ENC_DENSE,
    ENC_SPARSE,
    MAGIC,
    SEGMENT,
    DeltaRecord,
    class_count,
    pack_delta,
    parse_delta,
    parse_safetensors_header,
    payload_bound,
)

RUN_ID = bytes(range(32))
SPARSE = DeltaRecord("model.safetensors", "w", "BF16", ENC_SPARSE, 10, 2, b"\x28\xb5\x2f\xfd\x00")
DENSE = DeltaRecord("model.safetensors", "b", "F32", ENC_DENSE, 1, 1, b"PAYL")

# bytes.fromhex skips the spaces
DELTA_HEX = (
    "504e444c 0300 0000 02000000 00000000"  # "PNDL", version 3, flags 0, 2 records, 0
    # record "b": path 17, name 1, dtype 3, dense, pad, numel 1, changed 1, payload 4; path, name, dtype, payload
    " 1100 0100 03 02 0000 0100000000000000 0100000000000000 0400000000000000"
    " 6d6f64656c2e7361666574656e736f7273 62 463332 5041594c"
    # record "w": sparse, numel 10, changed 2, payload 5
    " 1100 0100 04 01 0000 0a00000000000000 0200000000000000 0500000000000000"
    " 6d6f64656c2e7361666574656e736f7273 77 42463136 28b52ffd00"
)


def test_fixed_records_pack_to_fixed_bytes_sorted_by_path_and_name():
    data = pack_delta([SPARSE, DENSE])  # given out of order: the file is sorted
    assert data == bytes.fromhex(DELTA_HEX)
    assert parse_delta(data) == [DENSE, SPARSE]


def test_payload_bounds_per_encoding():
    assert payload_bound(ENC_DENSE, 10, 10, "BF16") == 2 + 20  # dense: exactly the signs and magnitudes
    # sparse: the bin table (one byte per exponent class), one segment's Rice table (BINS x
    # (u8 + u32)), remainders of at most 48 bits a gap, signs and magnitudes, a unary stream
    # of at most numel bits
    assert BINS == 8
    assert payload_bound(ENC_SPARSE, 10, 3, "BF16") == 256 + 5 * 8 + 18 + 1 + 6 + 2
    assert payload_bound(ENC_SPARSE, 10, 3, "I32") == 1 + 5 * 8 + 18 + 1 + 12 + 2  # one class
    assert payload_bound(ENC_SPARSE, SEGMENT + 1, 1, "F16") == 32 + 2 * 5 * 8 + 6 + 1 + 2 + (SEGMENT + 8) // 8
    assert (class_count("BF16"), class_count("F32"), class_count("F16"), class_count("F64")) == (256, 256, 32, 2048)


def _file(*records: bytes, count: int | None = None, header: bytes | None = None) -> bytes:
    head = (
        header
        if header is not None
        else struct.pack("<4sHHII", MAGIC, 3, 0, len(records) if count is None else count, 0)
    )
    return head + b"".join(records)


def _record(path=b"a.safetensors", name=b"w", dtype=b"F32", enc=ENC_SPARSE, numel=4, changed=1, payload=b"x", pad=0):
    return struct.pack("<HHBBHQQQ", len(path), len(name), len(dtype), enc, pad, numel, changed, len(payload)) + (
        path + name + dtype + payload
    )


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"PND", "shorter than the header"),
        (_file(header=struct.pack("<4sHHII", b"XXXX", 2, 0, 0, 0)), "bad magic"),
        (_file(header=struct.pack("<4sHHII", MAGIC, 1, 0, 0, 0)), "format version 1"),  # older formats
        (_file(header=struct.pack("<4sHHII", MAGIC, 2, 0, 0, 0)), "format version 2"),
        (_file(header=struct.pack("<4sHHII", MAGIC, 3, 1, 0, 0)), "flags 1"),
        (_file(count=1), "truncated header"),
        (_file(_record()[:-1]), "past the end"),
        (_file(_record()) + b"\x00", "after the last record"),
        (_file(_record(pad=1)), "padding"),
        (_file(_record(dtype=b"F99")), "unknown dtype"),
        (_file(_record(enc=9)), "unknown position encoding"),
        (_file(_record(changed=0)), "0 changed"),
        (_file(_record(changed=5)), "5 changed of 4"),
        (_file(_record(numel=0, changed=0)), "0 elements"),
        (_file(_record(enc=ENC_DENSE, changed=2)), "dense encoding"),
        (_file(_record(payload=b"")), "empty payload"),
        (_file(_record(name=b"b"), _record(name=b"a")), "out of order"),
        (_file(_record(), _record()), "repeated"),
        (_file(_record(name=b"\xff")), "utf-8"),
    ],
)
def test_malformed_delta_files_are_refused_with_a_reason(data, says):
    with pytest.raises(ProtocolError) as exc:
        parse_delta(data)
    assert exc.value.rule == "delta.format"
    assert says in exc.value.detail


def test_safetensors_header_offsets_must_fit_the_file():
    header = b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    blob = struct.pack("<Q", len(header)) + header
    spans = parse_safetensors_header(blob, len(blob) + 8)
    assert spans["w"].start == len(blob) and spans["w"].numel == 2
    with pytest.raises(ProtocolError, match="do not fit"):
        parse_safetensors_header(blob, len(blob) + 7)  # file too short for the tensor
    bad = b'{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}'
    with pytest.raises(ProtocolError, match="do not fit"):
        parse_safetensors_header(struct.pack("<Q", len(bad)) + bad, 1000)


# ------------------------------------------------------------------ manifest fields

REF = m.DeltaRef(base_version=2, base_root=bytes([1]) * 32, weights_root=bytes([2]) * 32)
FILE = m.FileEntry(path="weights.pndl", size=10, chunk_hashes=(sha256(b"0123456789"),))


def test_fixed_delta_ref_and_delta_manifest_root():
    assert REF.encode().hex() == "9302c420" + "01" * 32 + "c420" + "02" * 32
    root = m.CheckpointManifest.compute_root(RUN_ID, 3, 4096, (FILE,), REF)
    assert root.hex() == "f5d275f5ad7453426cd68c45849559588769b03f290f71152345258029f45973"
    # the delta fields are bound into the root: the same files as an anchor hash differently
    assert m.CheckpointManifest.compute_root(RUN_ID, 3, 4096, (FILE,)) != root
    man = m.CheckpointManifest(
        run_id=RUN_ID, version=3, chunk_size=4096, files=(FILE,), created_ms=1, root=root, delta=REF
    )
    assert not man.is_anchor
    assert m.CheckpointManifest.decode(man.encode()) == man
    assert man.encode().endswith(REF.encode())  # the last field; an anchor's is nil (0xc0)


def test_anchor_manifest_ends_with_nil_and_keeps_its_root():
    root = m.CheckpointManifest.compute_root(RUN_ID, 3, 4096, (FILE,))
    man = m.CheckpointManifest(run_id=RUN_ID, version=3, chunk_size=4096, files=(FILE,), created_ms=1, root=root)
    assert man.is_anchor and man.encode().endswith(b"\xc0")
    assert m.CheckpointManifest.decode(man.encode()) == man


def test_delta_manifest_refused_when_base_is_not_earlier_or_root_lies():
    for base in (3, 4):
        ref = m.DeltaRef(base_version=base, base_root=REF.base_root, weights_root=REF.weights_root)
        root = m.CheckpointManifest.compute_root(RUN_ID, 3, 4096, (FILE,), ref)
        man = m.CheckpointManifest(
            run_id=RUN_ID, version=3, chunk_size=4096, files=(FILE,), created_ms=1, root=root, delta=ref
        )
        with pytest.raises(ProtocolError, match="earlier version"):
            m.CheckpointManifest.decode(man.encode())
    # a delta manifest carrying the anchor root of its files (delta fields not bound)
    anchor_root = m.CheckpointManifest.compute_root(RUN_ID, 3, 4096, (FILE,))
    man = m.CheckpointManifest(
        run_id=RUN_ID, version=3, chunk_size=4096, files=(FILE,), created_ms=1, root=anchor_root, delta=REF
    )
    with pytest.raises(ProtocolError, match="root hash"):
        m.CheckpointManifest.decode(man.encode())


def test_fixed_manifest_request_and_response_bytes():
    req = m.ManifestRequest(version=3, root=bytes([1]) * 32)
    assert req.encode().hex() == "9203c420" + "01" * 32
    assert m.ManifestResponse(found=False, envelope=b"").encode().hex() == "92c2c400"
    assert m.ENVELOPE_TYPES[18] is m.ManifestRequest and m.ENVELOPE_TYPES[19] is m.ManifestResponse
