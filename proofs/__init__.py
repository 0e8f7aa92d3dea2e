"""Proofs of honest inference. TOPLOC (build and verify, byte-identical to toploc 0.1.6).

torch only; no I/O; never imports node/. The byte layout of a sample's proofs
(chunking, proof sizes, cutting the blob) is ``protocol.proof_layout``: import
it from there.
"""

from .errors import ProofError, ProofFormatError
from .toploc import (
    ChunkResult,
    ProofConfig,
    Verdict,
    build_many,
    build_proofs,
    build_sequence_proofs,
    check_chunks,
    chunk_activations,
    decode_proof,
    judge,
    verify_proofs,
    verify_sequence,
)

__all__ = [
    "ChunkResult",
    "ProofConfig",
    "ProofError",
    "ProofFormatError",
    "Verdict",
    "build_many",
    "build_proofs",
    "build_sequence_proofs",
    "check_chunks",
    "chunk_activations",
    "decode_proof",
    "judge",
    "verify_proofs",
    "verify_sequence",
]
