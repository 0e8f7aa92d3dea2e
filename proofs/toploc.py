"""TOPLOC proofs: build them from a generation's final hidden states, check them
against a validator's own hidden states.

Wire format (byte-identical to the reference, toploc 0.1.6; the layout of a
sample's proofs is ``protocol.proof_layout``): one proof per chunk, big-endian
uint16 modulus m, then topk big-endian uint16 polynomial coefficients (258 bytes
for topk=128). A chunk is the prompt's hidden states (unless skip_prefill) or
``chunk_size`` consecutive generated-token rows, flattened; the proof interpolates (index mod m, bf16 bit pattern) of its top-k |values| modulo
65497.

Checking mirrors the reference: the validator takes its own top-k indices,
evaluates the polynomial there (at the raw index, as the reference does), and
compares bf16 exponents and mantissas. A chunk fails above the thresholds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from protocol.proof_layout import ProofLayout, proof_size

from . import modarith
from .errors import ProofError, ProofFormatError

NO_MATCH = float(2**64)  # mantissa error reported when no exponent matches (reference value)


@dataclasses.dataclass(frozen=True)
class ProofConfig(ProofLayout):
    """Knobs. Defaults: the reference's chunking (the wire layout,
    ``protocol.proof_layout``) and the paper's thresholds (fail a chunk above 38
    exponent mismatches, mean 10 or median 8)."""

    max_exp_mismatches: int = 38
    max_mant_err_mean: float = 10.0
    max_mant_err_median: float = 8.0

    @classmethod
    def tight(cls, **overrides: object) -> ProofConfig:
        """Thresholds for a worker and validator on the same numerics stack (e.g. both
        fp32 transformers on CPU): honest runs then give 0 mismatches, and a bf16/fp32
        swap still passes (<= 4 mismatches, mean <= 2.4 measured on SmolLM2-135M), while
        single-token prompt edits that the paper's defaults miss are caught. See docs/proofs.md."""
        base: dict[str, Any] = dict(max_exp_mismatches=8, max_mant_err_mean=4.0, max_mant_err_median=3.0)
        base.update(overrides)
        return cls(**base)

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.topk < 1:
            raise ProofError(f"chunk_size and topk must be >= 1, got {self.chunk_size}, {self.topk}")


@dataclasses.dataclass(frozen=True)
class ChunkResult:
    """What the reference's VerificationResult holds, for one chunk."""

    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float

    def passes(self, config: ProofConfig) -> bool:
        return (
            self.exp_mismatches <= config.max_exp_mismatches
            and self.mant_err_mean <= config.max_mant_err_mean
            and self.mant_err_median <= config.max_mant_err_median
        )


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Per-chunk results and the overall decision; ``reason`` names the first failure."""

    ok: bool
    chunks: tuple[ChunkResult, ...]
    reason: str = ""


# ---------------------------------------------------------------- chunking


def _as_bf16(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ProofError(f"hidden states must be a torch.Tensor, got {type(t).__name__}")
    if not (t.is_floating_point()):
        raise ProofError(f"hidden states must be floating point, got {t.dtype}")
    return t.detach().to(device="cpu", dtype=torch.bfloat16)


def chunk_activations(prefill: torch.Tensor | None, decode: torch.Tensor, config: ProofConfig) -> list[torch.Tensor]:
    """Flat bf16 chunks in proof order: [prefill] + decode rows cut every chunk_size."""
    decode = _as_bf16(decode)
    if decode.dim() != 2:
        raise ProofError(f"decode hidden states must be 2-D (tokens, hidden), got {tuple(decode.shape)}")
    chunks: list[torch.Tensor] = []
    if not config.skip_prefill:
        if prefill is None:
            raise ProofError("prefill hidden states are required unless skip_prefill")
        prefill = _as_bf16(prefill)
        if prefill.dim() != 2 or prefill.shape[0] == 0:
            raise ProofError("empty prompt: a proof needs at least one prompt token")
        if prefill.shape[1] != decode.shape[1]:
            raise ProofError(f"hidden size mismatch: prefill {prefill.shape[1]} vs decode {decode.shape[1]}")
        chunks.append(prefill.reshape(-1))
    for start in range(0, decode.shape[0], config.chunk_size):
        chunks.append(decode[start : start + config.chunk_size].reshape(-1))
    if not chunks:
        raise ProofError("nothing to prove: no generated tokens and the prefill is skipped")
    return chunks


def _top(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the k largest |values| (torch's own topk, as the reference: ties break
    identically) and those values' bf16 bit patterns as non-negative ints."""
    k = min(k, flat.numel())  # the reference emits null proofs here; we prove what exists
    idx = flat.abs().topk(k).indices
    bits = flat[idx].view(torch.int16).to(torch.int64) & 0xFFFF
    return idx, bits


def _group_by_size(items: Sequence[torch.Tensor]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(items):
        groups.setdefault(t.shape[-1], []).append(i)
    return groups


# ---------------------------------------------------------------- build


def _encode(modulus: int, coeffs: torch.Tensor) -> bytes:
    words = torch.cat([torch.tensor([modulus], dtype=torch.int64), coeffs.to(torch.int64)])
    return words.to(torch.int32).numpy().astype(">u2").tobytes()


def build_chunk_proofs(chunks: Sequence[torch.Tensor], topk: int) -> list[bytes]:
    """One proof per flat bf16 chunk; the interpolation is batched over all chunks."""
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    moduli: list[int] = []
    for flat in chunks:
        idx, bits = _top(flat, topk)
        m = modarith.injective_modulus(idx)
        moduli.append(m)
        xs.append(idx % m)
        ys.append(bits)
    proofs: list[bytes | None] = [None] * len(chunks)
    for _, members in _group_by_size(xs).items():
        coeffs = modarith.interpolate(torch.stack([xs[i] for i in members]), torch.stack([ys[i] for i in members]))
        for row, i in enumerate(members):
            proofs[i] = _encode(moduli[i], coeffs[row])
    return [p for p in proofs if p is not None]


def build_proofs(
    prefill: torch.Tensor | None, decode: torch.Tensor, config: ProofConfig = ProofConfig()
) -> list[bytes]:
    """Proofs for one generation: prefill (prompt rows) and decode (one row per
    generated token) final hidden states, any float dtype (cast to bf16)."""
    return build_chunk_proofs(chunk_activations(prefill, decode, config), config.topk)


def build_sequence_proofs(hidden: torch.Tensor, prompt_len: int, config: ProofConfig = ProofConfig()) -> list[bytes]:
    """The same for the engines' layout: hidden is (prompt_len + completion_len, hidden_size)."""
    prefill, decode = split_hidden(hidden, prompt_len)
    return build_proofs(prefill, decode, config)


def build_many(items: Sequence[tuple[torch.Tensor, int]], config: ProofConfig = ProofConfig()) -> list[list[bytes]]:
    """Proofs for many (hidden, prompt_len) sequences, interpolated in one batch (faster)."""
    per_seq = [chunk_activations(*split_hidden(h, p), config) for h, p in items]
    flat = build_chunk_proofs([c for chunks in per_seq for c in chunks], config.topk)
    out, pos = [], 0
    for chunks in per_seq:
        out.append(flat[pos : pos + len(chunks)])
        pos += len(chunks)
    return out


def split_hidden(hidden: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ProofError("hidden states must be a 2-D tensor (tokens, hidden_size)")
    if prompt_len <= 0:
        raise ProofError("empty prompt: a proof needs at least one prompt token")
    if prompt_len > hidden.shape[0]:
        raise ProofError(f"prompt_len {prompt_len} exceeds the {hidden.shape[0]} hidden rows")
    return hidden[:prompt_len], hidden[prompt_len:]


# ---------------------------------------------------------------- verify


def decode_proof(data: bytes, topk: int | None = None) -> tuple[int, torch.Tensor]:
    """(modulus, coefficients) from proof bytes; malformed input raises ProofFormatError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProofFormatError(f"a proof must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < 4 or len(data) % 2:
        raise ProofFormatError(f"a proof is 2 + 2*topk bytes; got {len(data)}")
    if topk is not None and len(data) != proof_size(topk):
        raise ProofFormatError(f"expected a {proof_size(topk)}-byte proof (topk={topk}), got {len(data)}")
    words = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64).view(-1, 2)
    values = words[:, 0] * 256 + words[:, 1]
    return int(values[0]), values[1:].clone()


def _fp_parts(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 exponent (8 bits) and mantissa (7 bits); the sign is ignored, as in the reference."""
    return (bits & 0x7F80) >> 7, bits & 0x7F


def _stats(errs: list[int]) -> tuple[float, float]:
    """Mean and median as the reference's statistics.mean / statistics.median give them
    (int / int true division is correctly rounded, as statistics.mean is)."""
    if not errs:
        return NO_MATCH, NO_MATCH
    errs = sorted(errs)
    n, mid = len(errs), len(errs) // 2
    median = float(errs[mid]) if n % 2 else (errs[mid - 1] + errs[mid]) / 2
    return sum(errs) / n, median


def check_chunks(chunks: Sequence[torch.Tensor], proofs: Sequence[bytes], topk: int) -> list[ChunkResult]:
    """The reference's verification numbers for each (validator chunk, proof) pair."""
    if len(proofs) != len(chunks):
        raise ProofFormatError(f"expected {len(chunks)} proofs, got {len(proofs)}")
    tops = [_top(flat, topk) for flat in chunks]
    coeffs = [decode_proof(p, min(topk, flat.numel()))[1] for p, flat in zip(proofs, chunks)]
    claimed: list[torch.Tensor | None] = [None] * len(chunks)
    for _, members in _group_by_size([c for c in coeffs]).items():
        vals = modarith.evaluate(torch.stack([coeffs[i] for i in members]), torch.stack([tops[i][0] for i in members]))
        for row, i in enumerate(members):
            claimed[i] = vals[row]
    results = []
    for (_, own_bits), proof_bits in zip(tops, claimed):
        assert proof_bits is not None
        e1, m1 = _fp_parts(proof_bits)
        e2, m2 = _fp_parts(own_bits)
        mismatch = e1 != e2
        errs = (m1 - m2).abs()[~mismatch].tolist()
        mean, median = _stats(errs)
        results.append(ChunkResult(int(mismatch.sum()), mean, median))
    return results


def verify_proofs(
    prefill: torch.Tensor | None,
    decode: torch.Tensor,
    proofs: Sequence[bytes],
    config: ProofConfig = ProofConfig(),
) -> list[ChunkResult]:
    """Per-chunk results for the validator's own hidden states against claimed proofs."""
    return check_chunks(chunk_activations(prefill, decode, config), proofs, config.topk)


def judge(results: Sequence[ChunkResult], config: ProofConfig = ProofConfig()) -> Verdict:
    for i, r in enumerate(results):
        if not r.passes(config):
            reason = (
                f"chunk {i}: {r.exp_mismatches} exponent mismatches (max {config.max_exp_mismatches}), "
                f"mantissa error mean {r.mant_err_mean:g} (max {config.max_mant_err_mean:g}), "
                f"median {r.mant_err_median:g} (max {config.max_mant_err_median:g})"
            )
            return Verdict(False, tuple(results), reason)
    return Verdict(True, tuple(results))


def verify_sequence(
    hidden: torch.Tensor, prompt_len: int, proofs: Sequence[bytes], config: ProofConfig = ProofConfig()
) -> Verdict:
    """Validator entry point: hidden is its own prefill of prompt + claimed completion,
    shape (prompt_len + completion_len, hidden_size). Malformed proofs raise
    ProofFormatError (a ProofError); a dishonest but well-formed proof gives ok=False."""
    prefill, decode = split_hidden(hidden, prompt_len)
    return judge(verify_proofs(prefill, decode, proofs, config), config)
