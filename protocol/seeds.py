"""The per-sample seed: the randomness a worker owes for one completion.

Every completion token is drawn by seeded Gumbel-max sampling
(``proofs.sampling``) keyed by this seed and the token's position, so a
validator that derives the seed itself can replay every token. The seed hashes
everything that names the completion's slot: the run, the worker, the batch
counter (numbering the worker's batches across the run), the prompt index and
the completion's member number in its group. There is one seed per completion,
whatever policy version generates it: a worker that computes one counter with two
versions in the window gets the same prompts and the same Gumbel noise from both,
so the two batches differ only where the policies do, and choosing the better
one buys little (docs/security.md, "Choosing among slots"). Protocol 3 also
hashed the version and its manifest root (no precomputing before a version is
published); that made a choice among versions a choice among independent draws,
which is worth far more than precomputing (generation still needs the weights
the batch claims, which prefill and the sampling replay check).

Its bytes are wire-visible: changing the hash input or the truncation is a
protocol change (tests/protocol/test_protocol_golden.py pins it).
"""

from __future__ import annotations

import hashlib

_DOMAIN = b"primenode/sample-seed/v3"


def sample_seed(run_id: bytes, worker: str, counter: int, prompt_index: int, member: int) -> int:
    """The 63-bit seed of completion ``member`` of the group for ``prompt_index`` in the
    worker's batch ``counter``."""
    h = hashlib.sha256()
    for part in (
        _DOMAIN,
        run_id,
        worker.encode(),
        counter.to_bytes(8, "big"),
        prompt_index.to_bytes(8, "big"),
        member.to_bytes(8, "big"),
    ):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    return int.from_bytes(h.digest()[:8], "big") >> 1
