"""Every message type round-trips through its one canonical encoding."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.strategies import ALL_MESSAGE_CLASSES, message_strategy
from protocol import ProtocolError
from protocol import messages as m
from protocol.schema import pack

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_every_envelope_type_is_covered():
    names = {c.__name__ for c in ALL_MESSAGE_CLASSES}
    for cls in m.ENVELOPE_TYPES.values():
        assert cls.__name__ in names
    for required in (
        "RunGenesis",
        "Heartbeat",
        "CheckpointManifest",
        "CheckpointAnnounce",
        "RolloutBatch",
        "RolloutAnnounce",
        "Vote",
        "BanNotice",
        "ChunkTicketRequest",
        "ChunkTicket",
        "BatchRequest",
        "BatchResponse",
    ):
        assert required in names


@pytest.mark.parametrize("cls", ALL_MESSAGE_CLASSES, ids=lambda c: c.__name__)
def test_round_trip_and_canonical(cls):
    @FAST
    @given(message_strategy(cls))
    def check(msg):
        data = msg.encode()
        again = cls.decode(data)
        assert again == msg
        assert again.encode() == data  # canonical: the same object, the same bytes

    check()


def test_type_ids_are_unique():
    ids = [c.TYPE_ID for c in ALL_MESSAGE_CLASSES if c.TYPE_ID]
    assert len(ids) == len(set(ids))


def test_non_canonical_encoding_is_refused():
    msg = m.BatchRequest(batch_id=b"\x01" * 32)
    # 1 packed as a uint16 instead of a fixint is valid msgpack but not canonical.
    data = b"\x91" + b"\xc4\x20" + b"\x01" * 32
    assert m.BatchRequest.decode(data) == msg
    assert m.PeerExchangeRequest.decode(b"\x91\x01").max_peers == 1
    with pytest.raises(ProtocolError) as err:
        m.PeerExchangeRequest.decode(b"\x91\xcd\x00\x01")
    assert err.value.rule == "canonical"


@pytest.mark.parametrize(
    "cls,wire,rule",
    [
        (m.PeerExchangeRequest, [0], "field:PeerExchangeRequest.max_peers"),
        (m.PeerExchangeRequest, [65], "field:PeerExchangeRequest.max_peers"),
        (m.PeerExchangeRequest, ["3"], "field:PeerExchangeRequest.max_peers"),
        (m.PeerExchangeRequest, [True], "field:PeerExchangeRequest.max_peers"),
        (m.PeerExchangeRequest, [], "field:PeerExchangeRequest"),
        (m.BatchRequest, [b"short"], "field:BatchRequest.batch_id"),
        (m.BanNotice, ["x" * 50, "r", -1], "field:BanNotice.until_ms"),
        (m.SamplingParams, [float("nan"), 1.0, 5, 0], "field:SamplingParams.temperature"),
        (m.Vote, [b"\0" * 32, "p" * 52, 0, True, "should be empty", ()], "field:Vote.reason"),
        (m.Vote, [b"\0" * 32, "p" * 52, 0, False, "", ()], "field:Vote.reason"),
    ],
)
def test_field_violations_name_the_field(cls, wire, rule):
    with pytest.raises(ProtocolError) as err:
        cls.decode(pack(wire))
    assert err.value.rule == rule


def test_manifest_root_must_match():
    files = (m.FileEntry("a.safetensors", 10, (b"\x02" * 32,)),)
    root = m.CheckpointManifest.compute_root(b"r" * 32, 1, 4096, files)
    good = m.CheckpointManifest(b"r" * 32, 1, 4096, files, 0, root)
    assert m.CheckpointManifest.decode(good.encode()) == good
    bad = m.CheckpointManifest(b"r" * 32, 2, 4096, files, 0, root)
    with pytest.raises(ProtocolError) as err:
        m.CheckpointManifest.decode(bad.encode())
    assert err.value.rule == "field:CheckpointManifest.root"


@pytest.mark.parametrize("path", ["../etc/passwd", "/abs", "a//b", "a/./b", "a\\b", ""])
def test_manifest_refuses_unsafe_paths(path):
    with pytest.raises(ProtocolError):
        m.FileEntry.decode(pack([path, 0, []]))


def test_manifest_chunk_count_must_match_size():
    files = (m.FileEntry("a", 10000, (b"\x02" * 32,)),)  # 10000 bytes at 4096 need 3 chunks
    root = m.CheckpointManifest.compute_root(b"r" * 32, 1, 4096, files)
    with pytest.raises(ProtocolError, match="chunk hashes"):
        m.CheckpointManifest.decode(m.CheckpointManifest(b"r" * 32, 1, 4096, files, 0, root).encode())


@FAST
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_protocol_error(data):
    for cls in ALL_MESSAGE_CLASSES:
        try:
            cls.decode(data)
        except ProtocolError:
            pass
