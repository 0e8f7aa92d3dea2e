"""Signed envelopes: every tampering, replay, wrong run or malformed input is refused
with ProtocolError, and nothing else ever escapes the decoder."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.strategies import message_strategy
from protocol import (
    MAX_ENVELOPE_BYTES,
    ZERO_RUN_ID,
    NodeKey,
    ProtocolError,
    ReplayGuard,
    open_envelope,
    seal,
)
from protocol import (
    messages as m,
)
from protocol.schema import pack, unpack

RUN = b"R" * 32
OTHER_RUN = b"O" * 32
NOW = 1_800_000_000_000
KEY = NodeKey(b"\x07" * 32)
MALLORY = NodeKey(b"\x09" * 32)


def heartbeat() -> m.Heartbeat:
    return m.Heartbeat(
        role="worker",
        policy_version=1,
        addrs=("/ip4/127.0.0.1/tcp/4001",),
        data_port=0,
        have=(),
        uptime_s=3.5,
        step=-1,
        batches=2,
    )


def sealed(msg=None, seq=1, ts=NOW, run=RUN, key=KEY) -> bytes:
    return seal(key, run, msg or heartbeat(), ts, seq)


def open_(data, guard=None, **kw):
    return open_envelope(
        data,
        run_id=kw.pop("run_id", RUN),
        now_ms=kw.pop("now_ms", NOW),
        guard=guard if guard is not None else ReplayGuard(),
        **kw,
    )


def rule_of(data, **kw) -> str:
    with pytest.raises(ProtocolError) as err:
        open_(data, **kw)
    return err.value.rule


def test_valid_envelope_opens():
    env = open_(sealed())
    assert env.sender == KEY.peer_id
    assert env.body == heartbeat()
    assert env.type_id == m.Heartbeat.TYPE_ID and env.seq == 1 and env.timestamp_ms == NOW


def test_every_single_byte_flip_is_rejected():
    data = sealed()
    for i in range(len(data)):
        for delta in (1, 0x80):
            bad = bytearray(data)
            bad[i] ^= delta
            with pytest.raises(ProtocolError):
                open_(bytes(bad))


def test_other_run_is_rejected():
    assert rule_of(sealed(run=OTHER_RUN)) == "run_id"


def test_zero_run_id_only_for_pre_run_types():
    assert rule_of(sealed(run=ZERO_RUN_ID)) == "run_id"
    env = open_(seal(KEY, ZERO_RUN_ID, m.GenesisRequest(want=0), NOW, 5))
    assert isinstance(env.body, m.GenesisRequest)


def test_replay_is_rejected():
    guard = ReplayGuard()
    data = sealed(seq=42)
    open_(data, guard=guard)
    with pytest.raises(ProtocolError) as err:
        open_(data, guard=guard)
    assert err.value.rule == "replay"
    # Same sequence number, freshly signed at another time: still a replay.
    with pytest.raises(ProtocolError):
        open_(sealed(seq=42, ts=NOW + 5), guard=guard)
    # Out-of-order but new sequence numbers are fine (gossip reorders).
    open_(sealed(seq=41), guard=guard)
    open_(sealed(seq=43), guard=guard)


def test_replay_memory_is_bounded_and_keeps_a_floor():
    guard = ReplayGuard(max_per_sender=8, max_senders=2)
    for seq in range(1, 20):
        open_(sealed(seq=seq), guard=guard)
    for seq in range(1, 20):
        with pytest.raises(ProtocolError):
            open_(sealed(seq=seq), guard=guard)
    open_(sealed(seq=20, key=MALLORY), guard=guard)
    open_(sealed(seq=20, key=NodeKey(b"\x0a" * 32)), guard=guard)
    assert len(guard._seen) <= 2


def test_forged_messages_do_not_poison_the_replay_cache():
    guard = ReplayGuard()
    env = unpack(sealed(seq=7))
    env[7] = b"\x00" * 64  # bad signature, same sender and seq
    with pytest.raises(ProtocolError):
        open_(pack(env), guard=guard)
    open_(sealed(seq=7), guard=guard)  # the genuine one still gets through


@pytest.mark.parametrize("offset_ms,ok", [(-119_000, True), (-121_000, False), (14_000, True), (16_000, False)])
def test_timestamp_window(offset_ms, ok):
    data = sealed(ts=NOW + offset_ms)
    if ok:
        open_(data)
    else:
        assert rule_of(data) == "timestamp"


def test_sender_must_have_signed():
    env = unpack(sealed())
    env[3] = MALLORY.peer_id  # claim another sender
    assert rule_of(pack(env)) == "signature"


def test_oversized_messages_are_rejected_before_parsing():
    assert rule_of(b"\x00" * (MAX_ENVELOPE_BYTES + 1)) == "size"
    # A heartbeat-typed envelope with a body over the heartbeat cap.
    env = unpack(sealed())
    env[6] = b"\x00" * (m.Heartbeat.MAX_BYTES + 1)
    assert rule_of(pack(env)) == "size"


def test_seal_refuses_oversized_body():
    huge = m.ErrorResponse(code="x", detail="y" * 256)
    seal(KEY, RUN, huge, NOW, 1)
    with pytest.raises(ValueError):
        seal(
            KEY,
            RUN,
            m.Heartbeat(
                role="worker",
                policy_version=1,
                addrs=(),
                data_port=0,
                have=tuple(m.HaveEntry(1, b"r" * 32, b"\xff" * 60000) for _ in range(8)),
                uptime_s=0.0,
                step=0,
                batches=0,
            ),
            NOW,
            1,
        )


def test_allowed_types_filter():
    assert rule_of(sealed(), allowed_types={m.Vote.TYPE_ID}) == "envelope.type"


def test_truncations_are_rejected():
    data = sealed()
    for n in range(len(data)):
        with pytest.raises(ProtocolError):
            open_(data[:n])


def test_unknown_type_and_bad_version():
    env = unpack(sealed())
    env[2] = 999
    assert rule_of(pack(env)) == "envelope.type"
    env = unpack(sealed())
    env[0] = 2
    assert rule_of(pack(env)) == "envelope.version"


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_random_bytes_raise_only_protocol_error(data):
    with pytest.raises(ProtocolError):
        open_(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**64), 2**64),
            st.binary(max_size=70),
            st.text(max_size=70),
            st.floats(),
        ),
        min_size=0,
        max_size=10,
    )
)
def test_random_msgpack_arrays_raise_only_protocol_error(items):
    try:
        data = pack(items)
    except Exception:
        return
    with pytest.raises(ProtocolError):
        open_(data)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(sorted(m.ENVELOPE_TYPES)).flatmap(lambda t: message_strategy(m.ENVELOPE_TYPES[t])),
    st.integers(0, 2**63 - 1),
)
def test_every_envelope_type_round_trips(msg, seq):
    run = ZERO_RUN_ID if type(msg).TYPE_ID in m.PRE_RUN_TYPES else RUN
    try:
        data = seal(KEY, run, msg, NOW, seq)
    except ValueError:
        return  # generated body over its cap: seal refuses, which is the rule
    env = open_envelope(data, run_id=RUN, now_ms=NOW, guard=ReplayGuard())
    assert env.body == msg and env.raw == data
