"""The per-sample seed: which randomness a worker owes for one prompt's group.

The seed is recorded in the signed rollout batch and a validator recomputes it
from the run id, the worker's peer id, the policy version, the batch counter and
the prompt index, so a worker cannot shop for lucky samples.  Its bytes are
wire-visible: changing the hash input or the truncation is a protocol change
(tests/test_protocol_golden.py pins it).
"""

from __future__ import annotations

import hashlib


def sample_seed(run_id: bytes, worker: str, version: int, counter: int, prompt_index: int) -> int:
    """The seed a worker uses for one prompt's group (recorded in the signed batch)."""
    h = hashlib.sha256(b"%s|%s|%d|%d|%d" % (run_id, worker.encode(), version, counter, prompt_index)).digest()
    return int.from_bytes(h[:8], "big") >> 1
