"""TOPLOC proofs: byte-identical to the reference's vectors, exact arithmetic, edge cases."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from proofs import (
    ChunkResult,
    ProofConfig,
    ProofError,
    ProofFormatError,
    build_many,
    build_proofs,
    build_sequence_proofs,
    decode_proof,
    judge,
    modarith,
    verify_proofs,
    verify_sequence,
)
from protocol.proof_layout import ProofLayout, chunk_rows, expected_chunks, proof_size, split_proofs

VECTORS = Path(__file__).resolve().parent / "toploc_vectors"  # the reference's answers (README.md there)
CASES = json.loads((VECTORS / "index.json").read_text())["cases"]


def _case(name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    meta = json.loads((VECTORS / f"{name}.json").read_text())
    return meta, load_file(str(VECTORS / f"{name}.safetensors"))


@pytest.mark.parametrize("name", CASES)
def test_proofs_byte_identical_to_reference(name: str) -> None:
    meta, t = _case(name)
    cfg = ProofConfig(chunk_size=meta["decode_batching_size"], topk=meta["topk"])
    with_prefill = build_proofs(t["prefill"], t["decode"], cfg)
    assert [p.hex() for p in with_prefill] == meta["proofs_with_prefill"]
    skip = ProofConfig(chunk_size=meta["decode_batching_size"], topk=meta["topk"], skip_prefill=True)
    assert [p.hex() for p in build_proofs(None, t["decode"], skip)] == meta["proofs_skip_prefill"]
    assert all(len(p) == proof_size(meta["topk"]) for p in with_prefill)


@pytest.mark.parametrize("name", CASES)
def test_verification_equals_reference(name: str) -> None:
    meta, t = _case(name)
    cfg = ProofConfig(chunk_size=meta["decode_batching_size"], topk=meta["topk"])
    proofs = [bytes.fromhex(h) for h in meta["proofs_with_prefill"]]
    for v in meta["verifications"]:
        got = verify_proofs(t[v["prefill_key"]], t[v["decode_key"]], proofs, cfg)
        assert got == [ChunkResult(**r) for r in v["results"]], v["label"]


def test_default_thresholds_separate_the_reference_perturbations() -> None:
    meta, t = _case("case0")
    proofs = [bytes.fromhex(h) for h in meta["proofs_with_prefill"]]
    verdicts = {
        v["label"]: judge(verify_proofs(t[v["prefill_key"]], t[v["decode_key"]], proofs)).ok
        for v in meta["verifications"]
    }
    assert verdicts["identical"] and verdicts["noise_0.3pct"]
    assert not verdicts["noise_30pct"] and not verdicts["unrelated"]


# ------------------------------------------------------------------ arithmetic


def _literal_newton(x: list[int], y: list[int]) -> list[int]:
    """The reference's algorithm (Newton divided differences, then expansion), written
    plainly in Python as an oracle for the vectorised Lagrange form."""
    p = modarith.PRIME
    n = len(x)
    dd = [v % p for v in y]
    for k in range(1, n):
        for i in range(n - 1, k - 1, -1):
            dd[i] = (dd[i] - dd[i - 1]) * pow((x[i] - x[i - k]) % p, p - 2, p) % p
    coeffs, factor = [0] * n, [1] + [0] * (n - 1)
    for i in range(n):
        for j in range(i + 1):
            coeffs[j] = (coeffs[j] + dd[i] * factor[j]) % p
        if i + 1 < n:
            new = [0] * n
            for j in range(i + 2):
                new[j] = ((factor[j - 1] if j else 0) - x[i] * factor[j]) % p
            factor = new
    return coeffs


@pytest.mark.parametrize("n", [1, 2, 3, 17, 128])
def test_interpolation_matches_newton_oracle(n: int) -> None:
    rng = random.Random(n)
    for _ in range(3):
        x = rng.sample(range(modarith.PRIME), n)
        y = [rng.randrange(65536) for _ in range(n)]  # includes values >= p
        got = modarith.interpolate(torch.tensor([x]), torch.tensor([y]))[0].tolist()
        assert got == _literal_newton(x, y)
        back = modarith.evaluate(torch.tensor(got), torch.tensor(x))
        assert back.tolist() == [v % modarith.PRIME for v in y]


def test_evaluate_matches_horner_at_large_points() -> None:
    rng = random.Random(1)
    coeffs = [rng.randrange(65536) for _ in range(128)]
    points = [rng.randrange(200_000) for _ in range(50)]

    def horner(x: int) -> int:
        r = coeffs[-1]
        for c in reversed(coeffs[:-1]):
            r = (r * x + c) % modarith.PRIME
        return r % modarith.PRIME

    got = modarith.evaluate(torch.tensor(coeffs), torch.tensor(points)).tolist()
    assert got == [horner(x) for x in points]


def test_injective_modulus_searches_down_from_the_prime() -> None:
    assert modarith.injective_modulus(torch.tensor([1, 5, 9])) == modarith.PRIME
    x = [3, 3 + modarith.PRIME, 100]  # collide mod p, so the next candidate down is tried
    m = modarith.injective_modulus(torch.tensor(x))
    expect = next(i for i in range(modarith.PRIME, 0, -1) if len({v % i for v in x}) == len(x))
    assert m == expect == modarith.PRIME - 1
    rng = random.Random(2)
    x = rng.sample(range(3 * modarith.PRIME), 128)
    m = modarith.injective_modulus(torch.tensor(x))
    assert m == next(i for i in range(modarith.PRIME, 0, -1) if len({v % i for v in x}) == len(x))


# ------------------------------------------------------------------ edge cases


def _hidden(rows: int, width: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g)


@pytest.mark.parametrize("completion", [1, 31, 32, 33, 100])
def test_roundtrip_any_length(completion: int) -> None:
    hidden = _hidden(7 + completion)
    proofs = build_sequence_proofs(hidden, 7)
    assert len(proofs) == expected_chunks(7, completion) == 1 + -(-completion // 32)
    verdict = verify_sequence(hidden, 7, proofs)
    assert verdict.ok and all(r == ChunkResult(0, 0.0, 0.0) for r in verdict.chunks)


def test_no_generated_tokens_proves_the_prompt_only() -> None:
    hidden = _hidden(5)
    proofs = build_sequence_proofs(hidden, 5)
    assert len(proofs) == 1 and verify_sequence(hidden, 5, proofs).ok
    with pytest.raises(ProofError):
        build_proofs(None, hidden[:0], ProofConfig(skip_prefill=True))


def test_empty_prompt_is_rejected_clearly() -> None:
    with pytest.raises(ProofError, match="empty prompt"):
        build_sequence_proofs(_hidden(4), 0)
    with pytest.raises(ProofError, match="empty prompt"):
        build_proofs(_hidden(0), _hidden(4))
    with pytest.raises(ProofError, match="empty prompt"):
        verify_sequence(_hidden(4), 0, [])


def test_fp32_input_is_cast_to_bf16_first() -> None:
    hidden = _hidden(40)
    assert build_sequence_proofs(hidden, 8) == build_sequence_proofs(hidden.to(torch.bfloat16), 8)


@pytest.mark.parametrize(
    "bad",
    [b"", b"\x00", b"\xff\xd9", b"\xff\xd9\x00", b"\x00" * 257, b"\x00" * 260, "ffd9" * 129, None, 12],
)
def test_malformed_proof_bytes_raise_a_project_error(bad: object) -> None:
    hidden = _hidden(40)
    good = build_sequence_proofs(hidden, 8)
    with pytest.raises(ProofFormatError):
        verify_sequence(hidden, 8, [bad, good[1]])  # type: ignore[list-item]


def test_wrong_number_of_proofs_is_malformed() -> None:
    hidden = _hidden(40)
    good = build_sequence_proofs(hidden, 8)
    with pytest.raises(ProofFormatError, match="expected 2 proofs"):
        verify_sequence(hidden, 8, good[:1])
    with pytest.raises(ProofFormatError):
        verify_sequence(hidden, 8, good + good[:1])


def test_garbage_of_the_right_size_fails_without_crashing() -> None:
    hidden = _hidden(40)
    rng = random.Random(3)
    junk = [bytes(rng.randrange(256) for _ in range(258)) for _ in range(2)]
    verdict = verify_sequence(hidden, 8, junk)
    assert not verdict.ok and "chunk 0" in verdict.reason
    zero = [b"\x00" * 258] * 2  # the reference's "null proof"
    assert not verify_sequence(hidden, 8, zero).ok


def test_decode_proof_reads_modulus_and_coefficients() -> None:
    m, coeffs = decode_proof(bytes.fromhex("ffd9" + "0001" * 128))
    assert m == 65497 and coeffs.tolist() == [1] * 128


def test_configurable_chunking_topk_and_thresholds() -> None:
    hidden = _hidden(50, width=64)
    cfg = ProofConfig(chunk_size=16, topk=32)
    proofs = build_sequence_proofs(hidden, 10, cfg)
    assert len(proofs) == 1 + 3 and all(len(p) == proof_size(32) for p in proofs)
    assert verify_sequence(hidden, 10, proofs, cfg).ok
    noisy = hidden * (1 + 0.03 * _hidden(50, width=64, seed=9))
    lax = verify_sequence(noisy, 10, proofs, cfg)
    strict = verify_sequence(noisy, 10, proofs, ProofConfig(chunk_size=16, topk=32, max_exp_mismatches=0))
    assert lax.ok and not strict.ok


def test_small_chunks_prove_what_exists() -> None:
    """A chunk with fewer values than topk (a narrow model, one token): the reference
    emits null proofs; we interpolate every value instead, and it verifies."""
    hidden = _hidden(3, width=48)
    proofs = build_sequence_proofs(hidden, 2)
    assert [len(p) for p in proofs] == [proof_size(96), proof_size(48)]
    assert verify_sequence(hidden, 2, proofs).ok


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ProofError):
        ProofConfig(chunk_size=0)


def test_build_many_equals_one_by_one() -> None:
    items = [(_hidden(9 + n, seed=n), 9) for n in (1, 32, 70)]
    assert build_many(items) == [build_sequence_proofs(h, p) for h, p in items]


def test_changed_hidden_states_fail() -> None:
    hidden = _hidden(72)
    proofs = build_sequence_proofs(hidden, 8)
    other = _hidden(72, seed=5)
    verdict = verify_sequence(other, 8, proofs)
    assert not verdict.ok and verdict.chunks[0].exp_mismatches > 38


# ------------------------------------------------------------------ the proof layout of a sample (protocol.proof_layout)


def test_layout_defaults_are_the_wire_format() -> None:
    """ProofConfig extends the layout: its defaults are the run's chunking."""
    assert (ProofLayout().chunk_size, ProofLayout().topk, ProofLayout().skip_prefill) == (32, 128, False)
    assert isinstance(ProofConfig(), ProofLayout) and ProofConfig().topk == ProofLayout().topk
    assert proof_size() == 258


def test_chunk_rows_follow_the_shape() -> None:
    assert chunk_rows(7, 70) == [7, 32, 32, 6]
    assert chunk_rows(7, 64) == [7, 32, 32]
    assert chunk_rows(7, 1) == [7, 1]
    assert chunk_rows(0, 33) == [32, 1]  # no prompt rows, no prompt chunk
    assert chunk_rows(7, 70, ProofLayout(skip_prefill=True)) == [32, 32, 6]
    for prompt, completion in [(7, 70), (1, 1), (0, 5), (40, 33)]:
        assert len(chunk_rows(prompt, completion)) == expected_chunks(prompt, completion)


def test_split_proofs_cuts_by_the_shape() -> None:
    """A chunk with fewer than topk values carries all of them: its proof is shorter."""
    blob = bytes(range(256)) * 3
    sizes = [proof_size(min(128, rows * 32)) for rows in chunk_rows(3, 1)]  # hidden 32: [3 rows, 1 row]
    assert sizes == [proof_size(96), proof_size(32)]
    parts = split_proofs(blob[: sum(sizes)], 3, 1, 32)
    assert parts is not None and [len(p) for p in parts] == sizes and b"".join(parts) == blob[: sum(sizes)]
    assert split_proofs(b"\0" * 7, 3, 1, 32) is None  # not the expected length
    assert split_proofs(b"\0" * (sum(sizes) + 1), 3, 1, 32) is None
