"""Run genesis signing and verification. The run id is the genesis hash."""

from __future__ import annotations

from .errors import ProtocolError
from .identity import NodeKey, verify_signature
from .messages import RunGenesis, SignedGenesis

_DOMAIN = b"primenode/genesis/v1"


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
