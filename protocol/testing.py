"""Forging helpers for tests, fuzzers and attack benchmarks: never used by a node.

A hostile peer can sign anything with its own key, so the interesting attacks are
correctly signed envelopes around bodies no honest node would send (to reach the
checks behind the signature) and well-formed envelopes with a broken signature
(to reach the signature check itself).  Both are built here, on the envelope
layout of ``protocol.envelope``, so the tests, the fuzzers and the attackers in
``bench/`` all forge the same bytes the real encoder would.
"""

from __future__ import annotations

from .envelope import _sign
from .identity import NodeKey
from .schema import pack, unpack

SIGNATURE_FIELD = 7  # index of the signature in the envelope array


def resign(key: NodeKey, run_id: bytes, type_id: int, body: bytes, *, timestamp_ms: int, seq: int) -> bytes:
    """A correctly signed envelope of ``type_id`` around arbitrary ``body`` bytes (what a
    malicious peer can send): no check of the type, the body or its size."""
    return _sign(key, run_id, type_id, body, timestamp_ms, seq)


def with_signature(envelope: bytes, signature: bytes) -> bytes:
    """``envelope`` (valid bytes, e.g. from ``seal``) carrying ``signature`` instead of its own."""
    fields = unpack(envelope)
    fields[SIGNATURE_FIELD] = signature
    return pack(fields)
