"""The per-sample seed: the randomness a worker owes for one completion.

Every completion token is drawn by seeded Gumbel-max sampling
(``proofs.sampling``) keyed by this seed and the token's position, so a
validator that derives the seed itself can replay every token. The seed hashes
everything that names the completion's slot: the run, the worker, the policy
version, the batch counter, the prompt index and the completion's member number
in its group, plus the root of the trainer-signed checkpoint manifest of that
version, which nobody knows before the trainer publishes it (so completions
cannot be precomputed, and a worker cannot shop among seeds: there is one).

Its bytes are wire-visible: changing the hash input or the truncation is a
protocol change (tests/test_protocol_golden.py pins it).
"""

from __future__ import annotations

import hashlib

_DOMAIN = b"primenode/sample-seed/v2"


def sample_seed(
    run_id: bytes, worker: str, version: int, counter: int, prompt_index: int, member: int, manifest_root: bytes
) -> int:
    """The 63-bit seed of completion ``member`` of the group for ``prompt_index`` in the
    worker's batch at (``version``, ``counter``)."""
    h = hashlib.sha256()
    for part in (
        _DOMAIN,
        run_id,
        worker.encode(),
        version.to_bytes(8, "big"),
        counter.to_bytes(8, "big"),
        prompt_index.to_bytes(8, "big"),
        member.to_bytes(8, "big"),
        manifest_root,
    ):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return int.from_bytes(h.digest()[:8], "big") >> 1
