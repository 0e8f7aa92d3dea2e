"""Every message of the primenode protocol, as typed, validated classes.

Field bounds are part of the protocol: a value outside them is a protocol
violation, whoever sent it.  docs/protocol.md explains each field and limit.
``TYPE_ID`` is the envelope type code (0 = only ever nested in another message);
``MAX_BYTES`` caps the canonical body size for that type.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, ClassVar

from .errors import ProtocolError
from .identity import PEER_ID_MAX_LEN
from .schema import Message, Spec, pack, spec

KIB = 1024
MIB = 1024 * KIB
# Samples one rollout batch may hold (so prompts_per_batch x group_size in a genesis).
MAX_BATCH_SAMPLES = 65536
# Rewards a validator may report: far beyond any rule's range (task rewards are 0..1, the
# length penalty is 0.0003 per token), finite so a median stays meaningful.
MAX_ABS_REWARD = 1e6

MAX_U63 = 2**63 - 1
HASH_LEN = 32
ROLES = ("bootstrap", "trainer", "worker", "validator")

# Reusable field bounds (keyword arguments of ``Spec``).
_PEER: dict[str, Any] = dict(min_len=40, max_len=PEER_ID_MAX_LEN)
_HASH: dict[str, Any] = dict(exact_len=HASH_LEN)
_VERSION: dict[str, Any] = dict(lo=0, hi=2**31 - 1)
_COUNT: dict[str, Any] = dict(lo=0, hi=MAX_U63)
_REASON: dict[str, Any] = dict(max_len=256)
_ADDR: dict[str, Any] = dict(max_len=256)


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# --------------------------------------------------------------------------- run


@dataclasses.dataclass(frozen=True)
class RunGenesis(Message):
    """Everything that defines a run. ``run_id = sha256(canonical bytes)``.

    Fields the protocol enforces are typed; the remaining hyper-parameters travel
    as the TOML text ``config_toml`` that node/ parses.
    """

    MAX_BYTES: ClassVar[int] = 256 * KIB

    name: str = spec(min_len=1, max_len=128)
    owner: str = spec(**_PEER)
    created_ms: int = spec(**_COUNT)
    model: str = spec(min_len=1, max_len=512)
    dataset: str = spec(min_len=1, max_len=512)
    dataset_size: int = spec(lo=1, hi=2**31 - 1)
    trainer: str = spec(**_PEER)
    validators: tuple[str, ...] = spec(min_len=1, max_len=64, item=Spec(**_PEER))
    quorum: int = spec(lo=1, hi=64)
    max_async: int = spec(lo=0, hi=64)
    prompts_per_batch: int = spec(lo=1, hi=4096)
    group_size: int = spec(lo=1, hi=1024)
    chunk_size: int = spec(lo=64 * KIB, hi=64 * MIB)
    config_toml: str = spec(max_len=128 * KIB)
    # Content pins (protocol/genesis.py): empty, or the sha256 roots every node checks
    # version 0's files and its local dataset against (after config_toml: constructors in
    # code may leave them out; the wire always carries them).
    model_root: bytes = spec(max_len=HASH_LEN, default=b"")
    dataset_hash: bytes = spec(max_len=HASH_LEN, default=b"")

    def validate(self) -> None:
        for name in ("model_root", "dataset_hash"):
            if len(getattr(self, name)) not in (0, HASH_LEN):
                raise ProtocolError(f"field:RunGenesis.{name}", f"must be empty or {HASH_LEN} bytes")
        if self.quorum > len(self.validators):
            raise ProtocolError("field:RunGenesis.quorum", "quorum exceeds the number of validators")
        if len(set(self.validators)) != len(self.validators):
            raise ProtocolError("field:RunGenesis.validators", "duplicate validator")
        if self.prompts_per_batch * self.group_size > MAX_BATCH_SAMPLES:
            raise ProtocolError(
                "field:RunGenesis.group_size",
                f"prompts_per_batch x group_size exceeds {MAX_BATCH_SAMPLES} samples per batch",
            )

    @property
    def run_id(self) -> bytes:
        return sha256(self.encode())


@dataclasses.dataclass(frozen=True)
class SignedGenesis(Message):
    """A genesis with the run owner's signature over ``b"primenode/genesis/v1" + genesis``."""

    TYPE_ID: ClassVar[int] = 0
    MAX_BYTES: ClassVar[int] = 260 * KIB

    genesis: RunGenesis
    signature: bytes = spec(exact_len=64)


# ----------------------------------------------------------------- membership


@dataclasses.dataclass(frozen=True)
class PeerAddr(Message):
    """A peer and the multiaddrs it can be dialled on."""

    peer_id: str = spec(**_PEER)
    addrs: tuple[str, ...] = spec(max_len=8, item=Spec(min_len=1, **_ADDR))


@dataclasses.dataclass(frozen=True)
class HaveEntry(Message):
    """Which chunks of one checkpoint version a node holds (bit i = chunk i)."""

    version: int = spec(**_VERSION)
    root: bytes = spec(**_HASH)
    bitmap: bytes = spec(max_len=64 * KIB)


@dataclasses.dataclass(frozen=True)
class Heartbeat(Message):
    """Periodic liveness and state announcement of one node."""

    TYPE_ID: ClassVar[int] = 2
    MAX_BYTES: ClassVar[int] = 200 * KIB

    role: str = spec(max_len=16)
    policy_version: int = spec(lo=-1, hi=2**31 - 1)  # -1: holds no checkpoint yet
    addrs: tuple[str, ...] = spec(max_len=8, item=Spec(min_len=1, **_ADDR))
    data_port: int = spec(lo=0, hi=65535)  # 0: serves no chunks
    have: tuple[HaveEntry, ...] = spec(max_len=8)
    uptime_s: float = spec(lo=0.0, hi=1e10)
    step: int = spec(lo=-1, hi=2**31 - 1)  # trainer step, or -1
    batches: int = spec(**_COUNT)  # produced (worker), verified (validator), admitted (trainer)

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ProtocolError("field:Heartbeat.role", f"unknown role {self.role!r}")


@dataclasses.dataclass(frozen=True)
class BanNotice(Message):
    """A validator or the trainer tells the swarm to stop talking to a peer."""

    TYPE_ID: ClassVar[int] = 8
    MAX_BYTES: ClassVar[int] = 1 * KIB

    peer_id: str = spec(**_PEER)
    reason: str = spec(**_REASON)
    until_ms: int = spec(**_COUNT)


# ---------------------------------------------------------------- checkpoints


@dataclasses.dataclass(frozen=True)
class FileEntry(Message):
    """One safetensors file of a checkpoint, cut into ``chunk_size`` pieces."""

    path: str = spec(min_len=1, max_len=256)
    size: int = spec(lo=0, hi=2**48)
    chunk_hashes: tuple[bytes, ...] = spec(max_len=1 << 20, item=Spec(**_HASH))

    def validate(self) -> None:
        p = self.path
        if p.startswith("/") or "\\" in p or "\x00" in p or any(part in ("", ".", "..") for part in p.split("/")):
            raise ProtocolError("field:FileEntry.path", f"unsafe path {p!r}")


@dataclasses.dataclass(frozen=True)
class DeltaRef(Message):
    """What a delta version applies to and what applying it must give.

    ``base_version``/``base_root``: the published version (its manifest root) the
    delta was encoded against. ``weights_root``: the root the *full* checkpoint of
    this version would have as an anchor manifest (same run, version and chunk
    size, the rebuilt files), checked before anything loads the result.
    """

    base_version: int = spec(**_VERSION)
    base_root: bytes = spec(**_HASH)
    weights_root: bytes = spec(**_HASH)


@dataclasses.dataclass(frozen=True)
class CheckpointManifest(Message):
    """A checkpoint version: its files, chunk hashes and a root hash over all of it.

    ``root = sha256(canonical bytes of [run_id, version, chunk_size, files])`` for an
    anchor (``delta`` nil: the files are the full weights), and of
    ``[run_id, version, chunk_size, files, delta]`` for a delta version (the files
    are one sparse-delta file, protocol/delta.py); chunk ``i`` of the version is
    the i-th hash when the files' lists are concatenated in order.
    """

    MAX_BYTES: ClassVar[int] = 900 * KIB

    run_id: bytes = spec(**_HASH)
    version: int = spec(**_VERSION)
    chunk_size: int = spec(lo=4 * KIB, hi=64 * MIB)
    files: tuple[FileEntry, ...] = spec(min_len=1, max_len=1024)
    created_ms: int = spec(**_COUNT)
    root: bytes = spec(**_HASH)
    delta: DeltaRef | None = spec(default=None)  # noqa: RUF009 (field specifier); nil: an anchor

    @staticmethod
    def compute_root(
        run_id: bytes, version: int, chunk_size: int, files: tuple[FileEntry, ...], delta: DeltaRef | None = None
    ) -> bytes:
        fields: list[Any] = [b"primenode/manifest/v1", run_id, version, chunk_size, [f.to_wire() for f in files]]
        if delta is not None:
            fields.append(delta.to_wire())
        return sha256(pack(fields))

    @property
    def is_anchor(self) -> bool:
        """A full checkpoint (loadable on its own), not a delta against an earlier version."""
        return self.delta is None

    def validate(self) -> None:
        paths = set()
        for f in self.files:
            expected = -(-f.size // self.chunk_size) if f.size else 0
            if len(f.chunk_hashes) != expected:
                raise ProtocolError(
                    "field:CheckpointManifest.files",
                    f"{f.path}: {len(f.chunk_hashes)} chunk hashes for {f.size} bytes, expected {expected}",
                )
            if f.path in paths:
                raise ProtocolError("field:CheckpointManifest.files", f"duplicate path {f.path}")
            paths.add(f.path)
        if self.delta is not None and self.delta.base_version >= self.version:
            raise ProtocolError("field:CheckpointManifest.delta", "a delta's base must be an earlier version")
        if self.compute_root(self.run_id, self.version, self.chunk_size, self.files, self.delta) != self.root:
            raise ProtocolError("field:CheckpointManifest.root", "root hash does not match the files")

    @property
    def num_chunks(self) -> int:
        return sum(len(f.chunk_hashes) for f in self.files)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def chunks(self) -> list[tuple[str, int, int, bytes]]:
        """(path, offset, length, sha256) of every chunk, in global index order."""
        out = []
        for f in self.files:
            for i, h in enumerate(f.chunk_hashes):
                off = i * self.chunk_size
                out.append((f.path, off, min(self.chunk_size, f.size - off), h))
        return out


@dataclasses.dataclass(frozen=True)
class CheckpointAnnounce(Message):
    """The trainer publishes a new version. Accepted only from the run's trainer."""

    TYPE_ID: ClassVar[int] = 3
    MAX_BYTES: ClassVar[int] = 920 * KIB

    manifest: CheckpointManifest


# ------------------------------------------------------------------- rollouts


@dataclasses.dataclass(frozen=True)
class SamplingParams(Message):
    """How completions are sampled: the run's values travel in every batch, and the
    engines take this same object. INTELLECT-2 sampled at temperature 0.6."""

    temperature: float = spec(lo=0.0, hi=10.0, default=1.0)
    top_p: float = spec(lo=0.0, hi=1.0, default=1.0)
    max_tokens: int = spec(lo=1, hi=1 << 20, default=64)
    top_k: int = spec(lo=0, hi=1 << 20, default=0)  # 0: no top-k cut


@dataclasses.dataclass(frozen=True)
class Sample(Message):
    """One completion. ``completion`` is the token ids as little-endian uint32.

    ``claimed_reward`` is the worker's own opinion; nobody trusts it (validators
    and the trainer recompute rewards from the rules).
    """

    prompt_index: int = spec(lo=0, hi=2**31 - 1)
    completion: bytes = spec(max_len=4 * 65536)
    seed: int = spec(lo=0, hi=2**64 - 1)
    proof: bytes = spec(max_len=4 * MIB)
    claimed_reward: float = spec(lo=-1e6, hi=1e6)

    def validate(self) -> None:
        if len(self.completion) % 4:
            raise ProtocolError("field:Sample.completion", "token bytes are not a multiple of 4")
        if not self.completion:
            raise ProtocolError("field:Sample.completion", "empty completion")

    def token_ids(self) -> list[int]:
        return [int.from_bytes(self.completion[i : i + 4], "little") for i in range(0, len(self.completion), 4)]

    @staticmethod
    def pack_tokens(ids: list[int]) -> bytes:
        return b"".join(int(t).to_bytes(4, "little") for t in ids)


@dataclasses.dataclass(frozen=True)
class RolloutBatch(Message):
    """A worker's signed batch: the prompts it owed at ``batch_counter`` (its batches' number
    in the run, one chain across versions), ``group_size`` completions each, generated with
    ``policy_version``, with proofs. Fetched by request, never gossiped.
    """

    TYPE_ID: ClassVar[int] = 5
    MAX_BYTES: ClassVar[int] = 32 * MIB

    run_id: bytes = spec(**_HASH)
    worker: str = spec(**_PEER)
    policy_version: int = spec(**_VERSION)
    batch_counter: int = spec(lo=0, hi=2**31 - 1)
    sampling: SamplingParams = spec()  # noqa: RUF009 (spec() is a field specifier, not a shared default)
    samples: tuple[Sample, ...] = spec(min_len=1, max_len=MAX_BATCH_SAMPLES)
    created_ms: int = spec(**_COUNT)


@dataclasses.dataclass(frozen=True)
class RolloutAnnounce(Message):
    """A worker says a batch exists; ``batch_id`` is sha256 of the batch's envelope bytes."""

    TYPE_ID: ClassVar[int] = 6
    MAX_BYTES: ClassVar[int] = 1 * KIB

    batch_id: bytes = spec(**_HASH)
    policy_version: int = spec(**_VERSION)
    batch_counter: int = spec(lo=0, hi=2**31 - 1)
    num_samples: int = spec(lo=1, hi=MAX_BATCH_SAMPLES)
    size_bytes: int = spec(lo=1, hi=RolloutBatch.MAX_BYTES + 4 * KIB)


@dataclasses.dataclass(frozen=True)
class Vote(Message):
    """A validator's verdict on a batch, with the rewards it recomputed (one per sample)."""

    TYPE_ID: ClassVar[int] = 7
    MAX_BYTES: ClassVar[int] = 600 * KIB

    batch_id: bytes = spec(**_HASH)
    worker: str = spec(**_PEER)
    policy_version: int = spec(**_VERSION)
    accept: bool = spec()
    reason: str = spec(**_REASON)
    rewards: tuple[float, ...] = spec(max_len=MAX_BATCH_SAMPLES, item=Spec(lo=-MAX_ABS_REWARD, hi=MAX_ABS_REWARD))

    def validate(self) -> None:
        if self.accept and self.reason:
            raise ProtocolError("field:Vote.reason", "an accept vote carries no reason")
        if not self.accept and not self.reason:
            raise ProtocolError("field:Vote.reason", "a reject vote must say why")


# ---------------------------------------------------------- request/response


@dataclasses.dataclass(frozen=True)
class ChunkTicketRequest(Message):
    """Ask a peer for a ticket to fetch some chunks of a version over the data plane."""

    TYPE_ID: ClassVar[int] = 9
    MAX_BYTES: ClassVar[int] = 4 * KIB

    version: int = spec(**_VERSION)
    root: bytes = spec(**_HASH)
    chunk_indices: tuple[int, ...] = spec(min_len=1, max_len=256, item=Spec(lo=0, hi=2**32 - 1))


@dataclasses.dataclass(frozen=True)
class ChunkTicket(Message):
    """The grant: present ``ticket`` on a TCP connection to ``host:port`` before ``expires_ms``."""

    TYPE_ID: ClassVar[int] = 10
    MAX_BYTES: ClassVar[int] = 2 * KIB

    ok: bool
    reason: str = spec(**_REASON)
    ticket: bytes = spec(max_len=32)
    host: str = spec(max_len=64)
    port: int = spec(lo=0, hi=65535)
    expires_ms: int = spec(**_COUNT)


@dataclasses.dataclass(frozen=True)
class ReverseChunkRequest(Message):
    """A reachable fetcher asks a holder behind NAT (heartbeat ``data_port`` 0) to open a
    data-plane connection *to it*: the holder dials ``host:port`` (one of the fetcher's own
    advertised addresses) and presents ``ticket`` in a reverse HELLO. The fetcher made the
    ticket and sent it over the holder's authenticated libp2p stream, so a connection
    presenting it was opened by that holder; the fetcher accepts it once, within seconds."""

    TYPE_ID: ClassVar[int] = 20
    MAX_BYTES: ClassVar[int] = 4 * KIB

    version: int = spec(**_VERSION)
    root: bytes = spec(**_HASH)
    chunk_indices: tuple[int, ...] = spec(min_len=1, max_len=256, item=Spec(lo=0, hi=2**32 - 1))
    ticket: bytes = spec(**_HASH)
    host: str = spec(min_len=1, max_len=64)
    port: int = spec(lo=1, hi=65535)


@dataclasses.dataclass(frozen=True)
class ReverseChunkAnswer(Message):
    """``ok``: the holder is dialling (the fetcher waits for the connection); else ``reason``."""

    TYPE_ID: ClassVar[int] = 21
    MAX_BYTES: ClassVar[int] = 1 * KIB

    ok: bool
    reason: str = spec(**_REASON)


@dataclasses.dataclass(frozen=True)
class BatchRequest(Message):
    TYPE_ID: ClassVar[int] = 11
    MAX_BYTES: ClassVar[int] = 256

    batch_id: bytes = spec(**_HASH)


@dataclasses.dataclass(frozen=True)
class BatchResponse(Message):
    """``envelope`` is the worker's signed RolloutBatch envelope, byte for byte."""

    TYPE_ID: ClassVar[int] = 12
    MAX_BYTES: ClassVar[int] = RolloutBatch.MAX_BYTES + 8 * KIB

    found: bool
    envelope: bytes = spec(max_len=RolloutBatch.MAX_BYTES + 4 * KIB)


@dataclasses.dataclass(frozen=True)
class ManifestRequest(Message):
    """Ask a peer for the trainer's announce of one version it holds (a late joiner
    resolving the base chain of a delta, without asking the trainer)."""

    TYPE_ID: ClassVar[int] = 18
    MAX_BYTES: ClassVar[int] = 256

    version: int = spec(**_VERSION)
    root: bytes = spec(**_HASH)


@dataclasses.dataclass(frozen=True)
class ManifestResponse(Message):
    """``envelope`` is the trainer's signed CheckpointAnnounce envelope, byte for byte
    (empty when not ``found``); the asker checks signer, run, version and root."""

    TYPE_ID: ClassVar[int] = 19
    MAX_BYTES: ClassVar[int] = CheckpointAnnounce.MAX_BYTES + 8 * KIB

    found: bool
    envelope: bytes = spec(max_len=CheckpointAnnounce.MAX_BYTES + 4 * KIB)


@dataclasses.dataclass(frozen=True)
class PeerExchangeRequest(Message):
    TYPE_ID: ClassVar[int] = 13
    MAX_BYTES: ClassVar[int] = 256

    max_peers: int = spec(lo=1, hi=64)


@dataclasses.dataclass(frozen=True)
class PeerExchangeResponse(Message):
    TYPE_ID: ClassVar[int] = 14
    # 64 peers x (peer id + 8 addresses of 256 chars) is ~133 KiB: the cap admits every legal answer
    MAX_BYTES: ClassVar[int] = 136 * KIB

    peers: tuple[PeerAddr, ...] = spec(max_len=64)


@dataclasses.dataclass(frozen=True)
class GenesisRequest(Message):
    """Sent before the joiner knows the run id: its envelope carries an all-zero run id."""

    TYPE_ID: ClassVar[int] = 15
    MAX_BYTES: ClassVar[int] = 64

    want: int = spec(lo=0, hi=0)


@dataclasses.dataclass(frozen=True)
class GenesisResponse(Message):
    TYPE_ID: ClassVar[int] = 16
    MAX_BYTES: ClassVar[int] = SignedGenesis.MAX_BYTES + KIB

    genesis: SignedGenesis


@dataclasses.dataclass(frozen=True)
class ErrorResponse(Message):
    """Any request may be answered with this instead of its response type."""

    TYPE_ID: ClassVar[int] = 17
    MAX_BYTES: ClassVar[int] = 1 * KIB

    code: str = spec(min_len=1, max_len=32)
    detail: str = spec(**_REASON)


ENVELOPE_TYPES: dict[int, type[Message]] = {
    cls.TYPE_ID: cls
    for cls in (
        Heartbeat,
        CheckpointAnnounce,
        RolloutBatch,
        RolloutAnnounce,
        Vote,
        BanNotice,
        ChunkTicketRequest,
        ChunkTicket,
        BatchRequest,
        BatchResponse,
        PeerExchangeRequest,
        PeerExchangeResponse,
        GenesisRequest,
        GenesisResponse,
        ErrorResponse,
        ManifestRequest,
        ManifestResponse,
        ReverseChunkRequest,
        ReverseChunkAnswer,
    )
}
# Types that may travel before a joiner knows the run (zero run id allowed).
PRE_RUN_TYPES = frozenset({GenesisRequest.TYPE_ID, GenesisResponse.TYPE_ID, ErrorResponse.TYPE_ID})
# Types small enough to gossip (the pubsub layer silently drops > 1 MiB).
GOSSIP_TYPES = frozenset(
    {Heartbeat.TYPE_ID, CheckpointAnnounce.TYPE_ID, RolloutAnnounce.TYPE_ID, Vote.TYPE_ID, BanNotice.TYPE_ID}
)
