"""The proof layout of a sample: how many TOPLOC proofs it carries and how its bytes are cut.

A sample's ``proof`` field is the concatenation of one proof per chunk of its
final hidden states: the whole prompt (unless ``skip_prefill``), then every
``chunk_size`` generated tokens (the last chunk may be shorter).  One proof is a
big-endian uint16 modulus then ``topk`` big-endian uint16 coefficients
(``proof_size``); a chunk with fewer than ``topk`` values carries all of them, so
every size follows from the sample's shape.  A validator needs this to cut the
blob before it checks anything, and a worker to know what it owes, so the
layout lives here, beside the messages that carry it; ``proofs/`` (which
builds and checks the proofs themselves) imports it from here.
"""

from __future__ import annotations

import dataclasses

CHUNK_SIZE = 32  # generated tokens per proof (toploc's "decode_batching_size")
TOPK = 128  # values a proof interpolates
SKIP_PREFILL = False  # the prompt's rows are a chunk of their own


@dataclasses.dataclass(frozen=True)
class ProofLayout:
    """The chunking knobs; the run's wire format uses the defaults.
    (``proofs.ProofConfig`` extends it with the checking thresholds.)"""

    chunk_size: int = CHUNK_SIZE
    topk: int = TOPK
    skip_prefill: bool = SKIP_PREFILL


LAYOUT = ProofLayout()


def proof_size(topk: int = TOPK) -> int:
    """Bytes of one proof over ``topk`` values: the modulus and ``topk`` coefficients."""
    return 2 + 2 * topk


def expected_chunks(prompt_len: int, completion_len: int, config: ProofLayout = LAYOUT) -> int:
    """How many proofs a (prompt, completion) pair carries."""
    decode = -(-completion_len // config.chunk_size)
    return decode + (0 if config.skip_prefill else (1 if prompt_len > 0 else 0))


def chunk_rows(prompt_len: int, completion_len: int, config: ProofLayout = LAYOUT) -> list[int]:
    """Hidden-state rows per proof chunk: the whole prompt (unless skipped), then
    ``chunk_size`` generated tokens at a time (the last chunk may be shorter)."""
    rows = [] if config.skip_prefill or prompt_len == 0 else [prompt_len]
    rows += [min(config.chunk_size, completion_len - i) for i in range(0, completion_len, config.chunk_size)]
    return rows


def split_proofs(
    blob: bytes, prompt_len: int, completion_len: int, hidden_size: int, config: ProofLayout = LAYOUT
) -> list[bytes] | None:
    """Cut a sample's concatenated proofs into per-chunk proofs. A chunk with fewer than
    ``topk`` values carries a shorter proof (all its values), so the sizes follow from the
    shape; None if the blob does not have exactly the expected length."""
    sizes = [
        proof_size(min(config.topk, rows * hidden_size)) for rows in chunk_rows(prompt_len, completion_len, config)
    ]
    if sum(sizes) != len(blob):
        return None
    out, pos = [], 0
    for n in sizes:
        out.append(blob[pos : pos + n])
        pos += n
    return out
