"""Deterministic prompt assignment.

A worker's prompts for its batch counter are drawn from a seed that hashes the
run id, the worker's peer id and the counter, so a worker cannot pick easy
prompts and any validator can recompute what was owed. The counter numbers the
worker's batches across the whole run, whatever policy version made each one
(``protocol.rules.counter_gap``): the version is not hashed, so generating one
counter with two versions gives the same prompts (and seeds: ``protocol.seeds``),
and there is nothing to shop for among slots.  The draw is a partial Fisher-Yates shuffle driven by SHA-256 in counter
mode with rejection sampling (no modulo bias), independent of any RNG library
version.
"""

from __future__ import annotations

import hashlib

_DOMAIN = b"primenode/assign/v2"


def assignment_seed(run_id: bytes, worker: str, batch_counter: int) -> bytes:
    h = hashlib.sha256()
    for part in (_DOMAIN, run_id, worker.encode(), batch_counter.to_bytes(8, "big")):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return h.digest()


class _HashStream:
    def __init__(self, seed: bytes) -> None:
        self._seed = seed
        self._counter = 0

    def below(self, n: int) -> int:
        """Uniform integer in [0, n)."""
        limit = (2**64 // n) * n
        while True:
            block = hashlib.sha256(self._seed + self._counter.to_bytes(8, "big")).digest()
            self._counter += 1
            for i in range(0, 32, 8):
                v = int.from_bytes(block[i : i + 8], "big")
                if v < limit:
                    return v % n


def assign_prompts(run_id: bytes, worker: str, batch_counter: int, dataset_size: int, count: int) -> list[int]:
    """The ``count`` distinct prompt indices (in draw order) owed by ``worker``.

    If ``count`` exceeds ``dataset_size`` every index is returned once.
    """
    if dataset_size <= 0:
        raise ValueError("dataset_size must be positive")
    if count <= 0:
        raise ValueError("count must be positive")
    count = min(count, dataset_size)
    stream = _HashStream(assignment_seed(run_id, worker, batch_counter))
    swapped: dict[int, int] = {}  # sparse Fisher-Yates over range(dataset_size)
    out = []
    for i in range(count):
        j = i + stream.below(dataset_size - i)
        vi, vj = swapped.get(i, i), swapped.get(j, j)
        swapped[i], swapped[j] = vj, vi
        out.append(vj)
    return out
