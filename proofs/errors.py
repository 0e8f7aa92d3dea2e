"""Errors raised by proofs/. Kept here (not in node/) so proofs/ never imports node/."""


class ProofError(ValueError):
    """Bad input to building or checking a proof (empty prompt, wrong shapes, bad config)."""


class ProofFormatError(ProofError):
    """Proof bytes that cannot be a TOPLOC proof (wrong length, wrong count)."""
