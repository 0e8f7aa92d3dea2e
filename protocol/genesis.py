"""Run genesis signing and verification, and the content pins it carries.

The run id is the genesis hash. A genesis may pin the run's model and dataset by
content: ``model_root`` is the content root of version 0's files (weights, the
architecture config, the tokenizer files), ``dataset_hash`` the hash of the
problems as every node loads them. Every node checks both, so nobody needs to
trust a path, a model-hub name or the trainer's word for what the run trains.

Why a content root and not version 0's manifest root: a manifest root binds the
run id (``CheckpointManifest.compute_root``), and the run id is the hash of the
genesis, so the genesis cannot hold it. The content root covers the same bytes
(every file's path, size and chunk hashes, at the genesis's ``chunk_size``) and
nothing else, and any manifest of version 0 must reproduce it.
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import ProtocolError
from .identity import NodeKey, verify_signature
from .messages import CheckpointManifest, FileEntry, RunGenesis, SignedGenesis, sha256
from .schema import pack

_DOMAIN = b"primenode/genesis/v1"
_MODEL_DOMAIN = b"primenode/model/v1"


def sign_genesis(owner: NodeKey, genesis: RunGenesis) -> SignedGenesis:
    if genesis.owner != owner.peer_id:
        raise ValueError("genesis.owner must be the signing key's peer id")
    return SignedGenesis(genesis=genesis, signature=owner.sign(_DOMAIN + genesis.encode()))


def verify_genesis(signed: SignedGenesis, expected_run_id: bytes | None = None) -> RunGenesis:
    """Check the owner's signature (and the run id, when the caller knows it)."""
    g = signed.genesis
    verify_signature(g.owner, _DOMAIN + g.encode(), signed.signature)
    if expected_run_id is not None and g.run_id != expected_run_id:
        raise ProtocolError("run_id", "genesis does not hash to the expected run id")
    return g


def model_content_root(chunk_size: int, files: Iterable[FileEntry]) -> bytes:
    """``sha256(pack([b"primenode/model/v1", chunk_size, [[path, size, [chunk hashes]], ...]]))``
    with the files sorted by path: the genesis's ``model_root`` for these files."""
    ordered = sorted(files, key=lambda f: f.path)
    return sha256(pack([_MODEL_DOMAIN, chunk_size, [f.to_wire() for f in ordered]]))


def check_initial_manifest(genesis: RunGenesis, manifest: CheckpointManifest) -> None:
    """Refuse a version-0 manifest whose files are not the ones the genesis pins (rule
    ``model_root``). A genesis without a model pin accepts any version 0."""
    if not genesis.model_root:
        return
    if manifest.version != 0:
        raise ProtocolError("model_root", f"the genesis pins version 0, not version {manifest.version}")
    if manifest.chunk_size != genesis.chunk_size:
        raise ProtocolError(
            "model_root",
            f"version 0 is cut in {manifest.chunk_size}-byte chunks, the genesis says {genesis.chunk_size}",
        )
    got = model_content_root(manifest.chunk_size, manifest.files)
    if got != genesis.model_root:
        raise ProtocolError(
            "model_root", f"version 0 holds model content {got.hex()}, the genesis pins {genesis.model_root.hex()}"
        )
