"""Fuzzing the pure decoders: every message's ``decode``, envelopes (structure-aware
mutations of valid ones, re-signed so the body checks run), checkpoint manifests and
announces, genesis TOML files, and TOPLOC proofs.

The only outcome ever allowed for bad input is the project's own error:
``ProtocolError`` (protocol/), ``NodeError`` (genesis files), ``ProofError``
(proofs/). Whatever decodes must re-encode to exactly the same bytes.
Budgets: see harness/fuzz.py (``FUZZ_EXAMPLES`` to run longer).
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.fuzz import fuzz_settings, mutate_bytes, mutate_tree, try_pack
from harness.genesis import fuzz_genesis_toml
from harness.strategies import ALL_MESSAGE_CLASSES, message_strategy
from node.checkpoints.manifest import verify_announce
from node.errors import NodeError
from node.genesis_file import read_genesis
from proofs import ProofConfig, ProofError, decode_proof, verify_sequence
from protocol import (
    ZERO_RUN_ID,
    CheckpointAnnounce,
    NodeKey,
    ProtocolError,
    ReplayGuard,
    open_envelope,
    seal,
)
from protocol import (
    messages as m,
)
from protocol.schema import unpack
from protocol.testing import resign

RUN = b"R" * 32
NOW = 1_800_000_000_000
KEY = NodeKey(b"\x07" * 32)
TRAINER = NodeKey(b"\x08" * 32)

ENVELOPE_CLASSES = [m.ENVELOPE_TYPES[t] for t in sorted(m.ENVELOPE_TYPES)]


def decode_or_protocol_error(cls, data: bytes):
    try:
        obj = cls.decode(data)
    except ProtocolError as exc:
        assert isinstance(exc.rule, str) and exc.rule
        return None
    assert obj.encode() == data  # whatever decodes is canonical
    return obj


def open_or_protocol_error(data: bytes, guard=None, **kw):
    try:
        env = open_envelope(data, run_id=RUN, now_ms=NOW, guard=guard if guard is not None else ReplayGuard(), **kw)
    except ProtocolError as exc:
        assert isinstance(exc.rule, str) and exc.rule
        return None
    assert env.raw == data
    return env


def run_for(msg) -> bytes:
    return ZERO_RUN_ID if type(msg).TYPE_ID in m.PRE_RUN_TYPES else RUN


# ------------------------------------------------------------------ messages


@pytest.mark.parametrize("cls", ALL_MESSAGE_CLASSES, ids=lambda c: c.__name__)
@fuzz_settings(60)
@given(data=st.data())
def test_each_message_decode_survives_structure_mutations(cls, data):
    msg = data.draw(message_strategy(cls))
    tree = unpack(msg.encode())
    mutated = try_pack(data.draw(mutate_tree(tree)))
    if mutated is not None:
        decode_or_protocol_error(cls, mutated)


@pytest.mark.parametrize("cls", ALL_MESSAGE_CLASSES, ids=lambda c: c.__name__)
@fuzz_settings(40)
@given(data=st.data())
def test_each_message_decode_survives_byte_mutations(cls, data):
    msg = data.draw(message_strategy(cls))
    decode_or_protocol_error(cls, data.draw(mutate_bytes(msg.encode())))


@pytest.mark.parametrize("cls", ALL_MESSAGE_CLASSES, ids=lambda c: c.__name__)
@fuzz_settings(40)
@given(raw=st.binary(max_size=300))
def test_each_message_decode_random_bytes(cls, raw):
    decode_or_protocol_error(cls, raw)


def test_decode_refuses_non_bytes_and_oversize():
    for cls in ALL_MESSAGE_CLASSES:
        for bad in (None, 3, "text", [1, 2]):
            with pytest.raises(ProtocolError):
                cls.decode(bad)  # type: ignore[arg-type]
        with pytest.raises(ProtocolError):
            cls.decode(b"\x90" + b"\x00" * cls.MAX_BYTES)


def test_deeply_nested_and_huge_containers_are_refused():
    deep = b"\x91" * 100_000 + b"\xc0"  # 100k nested one-element arrays
    big = b"\xdd" + (2**32 - 1).to_bytes(4, "big")  # claims 4 billion elements
    for cls in ALL_MESSAGE_CLASSES:
        for raw in (deep, big, b"\xdb" + (2**32 - 1).to_bytes(4, "big")):
            decode_or_protocol_error(cls, raw[: cls.MAX_BYTES])
    for raw in (deep[:100_000], big):
        open_or_protocol_error(raw)


# ------------------------------------------------------------------ envelopes


def envelope_messages():
    return st.sampled_from(ENVELOPE_CLASSES).flatmap(message_strategy)


@fuzz_settings(400)
@given(msg=envelope_messages(), data=st.data())
def test_envelope_structure_mutations(msg, data):
    try:
        raw = seal(KEY, run_for(msg), msg, NOW, 5)
    except ValueError:
        return
    tree = unpack(raw)
    mutated = try_pack(data.draw(mutate_tree(tree)))
    if mutated is not None:
        env = open_or_protocol_error(mutated)
        if env is not None:  # only a no-op mutation (e.g. swapped equal items) may still open
            assert mutated == raw


@fuzz_settings(300)
@given(msg=envelope_messages(), data=st.data())
def test_envelope_byte_mutations(msg, data):
    try:
        raw = seal(KEY, run_for(msg), msg, NOW, 5)
    except ValueError:
        return
    mutated = data.draw(mutate_bytes(raw))
    env = open_or_protocol_error(mutated)
    if env is not None:
        assert mutated == raw


@fuzz_settings(300)
@given(msg=envelope_messages(), data=st.data())
def test_signed_envelopes_with_mutated_bodies(msg, data):
    """A validly signed envelope whose body is a mutated message: the body checks run."""
    cls = type(msg)
    tree = unpack(msg.encode())
    body = try_pack(data.draw(mutate_tree(tree)))
    if body is None:
        return
    env = open_or_protocol_error(resign(KEY, run_for(msg), cls.TYPE_ID, body, timestamp_ms=NOW, seq=9))
    if env is not None:
        assert env.body.encode() == body and isinstance(env.body, cls)


@fuzz_settings(300)
@given(
    type_id=st.sampled_from(sorted(m.ENVELOPE_TYPES) + [0, 1, 4, 18, 255, 2**31]),
    body=st.binary(max_size=200),
    run=st.sampled_from([RUN, ZERO_RUN_ID, b"X" * 32]),
)
def test_signed_envelopes_with_random_bodies(type_id, body, run):
    open_or_protocol_error(resign(KEY, run, type_id, body, timestamp_ms=NOW, seq=9))


@fuzz_settings(200)
@given(ts=st.integers(-(2**64), 2**64), seq=st.integers(-(2**64), 2**64))
def test_envelope_header_integers(ts, seq):
    body = m.GenesisRequest(want=0).encode()
    try:
        raw = resign(KEY, ZERO_RUN_ID, m.GenesisRequest.TYPE_ID, body, timestamp_ms=ts, seq=seq)
    except Exception:
        return  # msgpack cannot even pack it
    open_or_protocol_error(raw)


def test_replay_guard_survives_random_sequences():
    """Random and adversarial sequence numbers never break the bounded guard."""
    import random

    rnd = random.Random(7)
    guard = ReplayGuard(max_per_sender=16, max_senders=4)
    keys = [NodeKey(bytes([i]) * 32) for i in range(10, 16)]
    body = m.GenesisRequest(want=0).encode()
    for _ in range(2000):
        k = rnd.choice(keys)
        seq = rnd.choice([0, 1, 2**63 - 1, rnd.randrange(0, 2**63), rnd.randrange(0, 64)])
        open_or_protocol_error(
            resign(k, ZERO_RUN_ID, m.GenesisRequest.TYPE_ID, body, timestamp_ms=NOW, seq=seq), guard=guard
        )
    assert len(guard._seen) <= 4
    assert all(len(v) <= 16 + 1 for v in guard._seen.values())


# ------------------------------------------------------------------ manifests


@fuzz_settings(150)
@given(manifest=message_strategy(m.CheckpointManifest), data=st.data())
def test_checkpoint_announce_with_mutated_manifest(manifest, data):
    """The trainer's key signs a mutated manifest (worst case: a buggy or hostile trainer):
    verify_announce raises ProtocolError or returns a manifest whose rules hold."""
    import dataclasses

    manifest = dataclasses.replace(
        manifest,
        run_id=RUN,
        root=m.CheckpointManifest.compute_root(RUN, manifest.version, manifest.chunk_size, manifest.files),
    )
    tree = unpack(CheckpointAnnounce(manifest=manifest).encode())
    body = try_pack(data.draw(mutate_tree(tree)))
    if body is None:
        return
    raw = resign(TRAINER, RUN, CheckpointAnnounce.TYPE_ID, body, timestamp_ms=NOW, seq=9)
    try:
        got, _env = verify_announce(raw, RUN, TRAINER.peer_id, now_ms=NOW, guard=ReplayGuard())
    except ProtocolError:
        return
    # Whatever is accepted is internally consistent: paths safe, chunk counts and root right.
    assert got.root == m.CheckpointManifest.compute_root(got.run_id, got.version, got.chunk_size, got.files)
    assert len(got.chunks()) == got.num_chunks
    for f in got.files:
        assert f.path and not f.path.startswith("/") and ".." not in f.path.split("/") and "\\" not in f.path
        assert len(f.chunk_hashes) == -(-f.size // got.chunk_size)


# ------------------------------------------------------------------ genesis TOML files


@pytest.fixture(scope="module")
def genesis_text() -> str:
    return fuzz_genesis_toml({"steps": 3, "lr": 1e-4, "task": "math"})


def _read_or_node_error(path: Path, text: str | bytes) -> None:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        read_genesis(path)
    except NodeError:
        pass


def _toml_value(v):
    import tomli_w

    return tomli_w.dumps({"v": v})[4:].strip()


@fuzz_settings(250)
@given(data=st.data())
def test_genesis_file_value_mutations(genesis_text, tmp_path_factory, data):
    """Replace one value of the [run] table (or a top-level key) with a value of any TOML type."""
    import tomli_w

    doc = tomllib.loads(genesis_text)
    section = data.draw(st.sampled_from(["top", "run", "config"]))
    table = doc if section == "top" else doc[section]
    keys = sorted(table)
    key = data.draw(st.sampled_from(keys + ["extra_key"]))
    value = data.draw(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**63), 2**63 - 1),
            st.floats(allow_nan=True),
            st.text(max_size=80),
            st.lists(st.text(max_size=60), max_size=5),
            st.lists(st.integers(), max_size=3),
            st.dictionaries(st.text(min_size=1, max_size=5), st.integers(), max_size=2),
        )
    )
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value
    try:
        text = tomli_w.dumps(doc)
    except Exception:
        return
    _read_or_node_error(tmp_path_factory.mktemp("g") / "genesis.toml", text)


@fuzz_settings(250)
@given(data=st.data())
def test_genesis_file_text_mutations(genesis_text, tmp_path_factory, data):
    raw = data.draw(mutate_bytes(genesis_text.encode()))
    _read_or_node_error(tmp_path_factory.mktemp("g") / "genesis.toml", raw)


def test_genesis_file_odd_files(tmp_path):
    for content in (
        b"",
        b"\xff\xfe\x00",
        b"run = 3\nsignature = 4\nrun_id = 5\n",
        b"[run]\n",
        b'run_id = "zz"\nsignature = "00"\n[run]\nname = "x"\n',
        b"\x00" * 100,
    ):
        _read_or_node_error(tmp_path / "g.toml", content)
    with pytest.raises(NodeError):
        read_genesis(tmp_path / "missing.toml")
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(NodeError):
        read_genesis(tmp_path / "dir.toml")


# ------------------------------------------------------------------ TOPLOC proofs


@fuzz_settings(400)
@given(raw=st.binary(max_size=600), topk=st.one_of(st.none(), st.integers(-2, 300)))
def test_decode_proof_random_bytes(raw, topk):
    try:
        mod, coeffs = decode_proof(raw, topk)
    except ProofError:
        return
    assert 0 <= mod < 65536 and coeffs.numel() == len(raw) // 2 - 1


def test_decode_proof_non_bytes():
    for bad in (None, 3, "ab", [1, 2], torch.zeros(4)):
        with pytest.raises(ProofError):
            decode_proof(bad)  # type: ignore[arg-type]


@fuzz_settings(120)
@given(data=st.data())
def test_verify_sequence_random_proofs_and_shapes(data):
    """Random hidden states, prompt lengths, proof counts and proof bytes: a Verdict or ProofError."""
    topk = data.draw(st.sampled_from([1, 4, 16, 128]))
    chunk = data.draw(st.sampled_from([1, 2, 32]))
    cfg = ProofConfig(chunk_size=chunk, topk=topk, skip_prefill=data.draw(st.booleans()))
    rows = data.draw(st.integers(0, 12))
    hidden_size = data.draw(st.integers(1, 24))
    prompt_len = data.draw(st.integers(-1, rows + 1))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    hidden = torch.randn(rows, hidden_size).to(dtype)
    if data.draw(st.booleans()):
        hidden[data.draw(st.integers(0, max(rows - 1, 0))) if rows else slice(None)] = float(
            data.draw(st.sampled_from(["nan", "inf", "-inf", "0"]))
        )
    n_proofs = data.draw(st.integers(0, 6))
    size = data.draw(st.sampled_from([2 + 2 * topk, 2 + 2 * min(topk, hidden_size), 0, 3, 258]))
    proofs = [data.draw(st.binary(min_size=size, max_size=size)) for _ in range(n_proofs)]
    try:
        verdict = verify_sequence(hidden, prompt_len, proofs, cfg)
    except ProofError:
        return
    assert isinstance(verdict.ok, bool)
    for r in verdict.chunks:
        assert r.exp_mismatches >= 0 and not math.isnan(r.mant_err_mean)


def test_verify_sequence_odd_arguments():
    cfg = ProofConfig(chunk_size=2, topk=4)
    for hidden, plen, proofs in [
        ("x", 1, []),
        (torch.zeros(3), 1, []),
        (torch.zeros(2, 2, 2), 1, []),
        (torch.zeros(3, 4, dtype=torch.int64), 1, []),
        (torch.zeros(0, 4), 0, []),
        (torch.zeros(3, 4), 1, [b"\x00" * 10] * 2),
        (torch.zeros(3, 4), 1, ["str"] * 2),
        (torch.zeros(3, 4), 1, [None] * 2),
    ]:
        try:
            verify_sequence(hidden, plen, proofs, cfg)  # type: ignore[arg-type]
        except ProofError:
            pass
