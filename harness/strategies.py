"""Hypothesis strategies for every protocol message, derived from the field specs.

Generic generation reads each dataclass field's type hint and :class:`Spec`;
classes with cross-field rules (roots, quorums, reasons) get small builders.
Reused by the fuzz tests.
"""

from __future__ import annotations

import dataclasses
import typing

from hypothesis import strategies as st

from protocol import NodeKey
from protocol import messages as m
from protocol.schema import Message, Spec

_KEYS = [NodeKey(bytes([i]) * 32) for i in range(1, 6)]
PEER_IDS = [k.peer_id for k in _KEYS]
peer_ids = st.sampled_from(PEER_IDS)

# Keep generated containers small so property tests stay fast.
_LIST_CAP = 4
_TEXT_CAP = 40
_BYTES_CAP = 64


def _for_hint(hint: typing.Any, s: Spec, name: str) -> st.SearchStrategy:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, __import__("types").UnionType):
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return st.none() | _for_hint(inner, s, name)
    if origin in (list, tuple):
        item_hint = typing.get_args(hint)[0]
        hi = min(s.max_len if s.max_len is not None else _LIST_CAP, _LIST_CAP)
        lo = min(s.min_len, hi)
        return st.lists(_for_hint(item_hint, s.item or Spec(), name), min_size=lo, max_size=hi).map(tuple)
    if isinstance(hint, type) and issubclass(hint, Message):
        return st.deferred(lambda: message_strategy(hint))
    if hint is bool:
        return st.booleans()
    if hint is int:
        lo = int(s.lo) if s.lo is not None else -(2**63)
        hi = int(s.hi) if s.hi is not None else 2**63 - 1
        return st.integers(lo, hi)
    if hint is float:
        return st.floats(s.lo, s.hi, allow_nan=False, allow_infinity=False)
    if hint is str:
        if s.min_len >= 40:  # peer ids
            return peer_ids
        hi = min(s.max_len if s.max_len is not None else _TEXT_CAP, _TEXT_CAP)
        return st.text(min_size=min(s.min_len, hi), max_size=hi)
    if hint is bytes:
        if s.exact_len is not None:
            return st.binary(min_size=s.exact_len, max_size=s.exact_len)
        hi = min(s.max_len if s.max_len is not None else _BYTES_CAP, _BYTES_CAP)
        return st.binary(min_size=min(s.min_len, hi), max_size=hi)
    raise TypeError(hint)


def _generic(cls: type[Message], **overrides: st.SearchStrategy) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kwargs[f.name] = (
            overrides[f.name]
            if f.name in overrides
            else _for_hint(hints[f.name], f.metadata.get("spec", Spec()), f.name)
        )
    return st.builds(cls, **kwargs)


_safe_path = st.lists(st.from_regex(r"[a-z0-9_]{1,8}(\.safetensors)?", fullmatch=True), min_size=1, max_size=3).map(
    "/".join
)


@st.composite
def _file_entries(draw, chunk_size: int) -> m.FileEntry:
    size = draw(st.integers(0, chunk_size * 3))
    n = -(-size // chunk_size)
    hashes = tuple(draw(st.binary(min_size=32, max_size=32)) for _ in range(n))
    return m.FileEntry(path=draw(_safe_path), size=size, chunk_hashes=hashes)


@st.composite
def _manifests(draw) -> m.CheckpointManifest:
    chunk_size = draw(st.sampled_from([4096, 65536, 4 << 20]))
    files = draw(st.lists(_file_entries(chunk_size), min_size=1, max_size=3, unique_by=lambda f: f.path))
    run_id = draw(st.binary(min_size=32, max_size=32))
    version = draw(st.integers(0, 2**31 - 1))
    files = tuple(files)
    root = m.CheckpointManifest.compute_root(run_id, version, chunk_size, files)
    return m.CheckpointManifest(run_id, version, chunk_size, files, draw(st.integers(0, 2**63 - 1)), root)


_pin = st.just(b"") | st.binary(min_size=32, max_size=32)  # a genesis content pin: empty or a sha256


@st.composite
def _geneses(draw) -> m.RunGenesis:
    validators = draw(st.lists(peer_ids, min_size=1, max_size=5, unique=True))
    group = draw(st.integers(1, 1024))
    per_batch = st.integers(1, min(4096, m.MAX_BATCH_SAMPLES // group))  # a batch holds at most MAX_BATCH_SAMPLES
    base = draw(
        _generic(
            m.RunGenesis,
            validators=st.just(tuple(validators)),
            quorum=st.integers(1, len(validators)),
            group_size=st.just(group),
            prompts_per_batch=per_batch,
            model_root=_pin,
            dataset_hash=_pin,
        )
    )
    return base


@st.composite
def _votes(draw) -> m.Vote:
    accept = draw(st.booleans())
    reason = "" if accept else draw(st.text(min_size=1, max_size=40))
    return draw(_generic(m.Vote, accept=st.just(accept), reason=st.just(reason)))


_SPECIAL: dict[type, st.SearchStrategy] = {
    m.RunGenesis: _geneses(),
    m.CheckpointManifest: _manifests(),
    m.FileEntry: _file_entries(65536),
    m.Vote: _votes(),
    m.Heartbeat: _generic(m.Heartbeat, role=st.sampled_from(m.ROLES)),
    m.Sample: _generic(
        m.Sample, completion=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8).map(m.Sample.pack_tokens)
    ),
    m.PeerAddr: _generic(m.PeerAddr, addrs=st.lists(st.just("/ip4/127.0.0.1/tcp/4001"), max_size=3).map(tuple)),
}


def message_strategy(cls: type[Message]) -> st.SearchStrategy:
    if cls in _SPECIAL:
        return _SPECIAL[cls]
    if cls is m.SignedGenesis:
        return st.builds(m.SignedGenesis, genesis=_geneses(), signature=st.binary(min_size=64, max_size=64))
    return _generic(cls)


ALL_MESSAGE_CLASSES: list[type[Message]] = [
    v for v in vars(m).values() if isinstance(v, type) and issubclass(v, Message) and v is not Message
]
