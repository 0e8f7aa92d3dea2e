"""Vectorised polynomial arithmetic modulo the TOPLOC prime 65497.

The reference builds its polynomial with Newton divided differences: two nested
loops over 128 points, far too slow in Python (~12 ms per chunk). Through
distinct points there is exactly one interpolating polynomial of degree < n, so
any exact method yields the same coefficients. Here we use the Lagrange form,
which reduces to a product tree and three matrix-vector products:

    M(x)  = prod_i (x - a_i) = sum_t m_t x^t           (product tree, log2 n levels)
    w_i   = 1 / M'(a_i)                                 (mat-vec + inverse table)
    P(x)  = sum_i y_i w_i M(x) / (x - a_i)
    c_k   = sum_t m_{k+1+t} s_t,  s_t = sum_i y_i w_i a_i^t   (two mat-vecs)

Every product of two residues is < 2**32 and every sum has <= 129 terms, so all
partial sums stay below 2**40: float64 matmuls are exact here and much faster
than integer ones. Element-wise work uses torch int64 (its remainder kernel is
~5x faster than numpy's on this CPU). Everything batches over leading axes.
"""

from __future__ import annotations

import functools

import torch

PRIME = 65497  # the field TOPLOC interpolates in: the largest prime below 2**16 - 38

_I64 = torch.int64
_F64 = torch.float64


@functools.lru_cache(maxsize=1)
def inverse_table() -> torch.Tensor:
    """inv[r] = r^(p-2) mod p for every residue (inv[0] = 0); built once, 0.5 MB."""
    base = torch.arange(PRIME, dtype=_I64)
    result = torch.ones(PRIME, dtype=_I64)
    exponent = PRIME - 2
    while exponent:
        if exponent & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        exponent >>= 1
    result[0] = 0
    return result


def power_matrix(a: torch.Tensor, n: int) -> torch.Tensor:
    """a[..., i] -> P[..., i, t] = a_i^t mod p for t < n (int64), by doubling."""
    a = torch.as_tensor(a, dtype=_I64) % PRIME
    out = torch.empty(a.shape + (n,), dtype=_I64)
    out[..., 0] = 1
    filled = 1
    step = a  # a^filled
    while filled < n:
        take = min(filled, n - filled)
        out[..., filled : filled + take] = out[..., :take] * step.unsqueeze(-1) % PRIME
        step = step * step % PRIME
        filled += take
    return out


@functools.lru_cache(maxsize=32)
def _spread_index(lp: int, lq: int) -> torch.Tensor:
    return (torch.arange(lp).unsqueeze(-1) + torch.arange(lq).unsqueeze(0)).flatten()


def _poly_mul(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Batched product of polynomials (ascending coefficients, last axis), mod p."""
    lp, lq = p.shape[-1], q.shape[-1]
    outer = (p.unsqueeze(-1) * q.unsqueeze(-2)).flatten(-2)  # each < 2**32
    out = torch.zeros(p.shape[:-1] + (lp + lq - 1,), dtype=_I64)
    out.index_add_(-1, _spread_index(lp, lq), outer)
    return out % PRIME


def master_polynomial(a: torch.Tensor) -> torch.Tensor:
    """Coefficients (ascending, length n+1, monic) of prod_i (x - a_i), by a product tree."""
    a = torch.as_tensor(a, dtype=_I64) % PRIME
    batch, n = a.shape[:-1], a.shape[-1]
    polys = torch.stack([(-a) % PRIME, torch.ones_like(a)], dim=-1)  # (..., n, 2)
    while polys.shape[-2] > 1:
        if polys.shape[-2] % 2:  # pad with the constant polynomial 1
            one = torch.zeros(batch + (1, polys.shape[-1]), dtype=_I64)
            one[..., 0, 0] = 1
            polys = torch.cat([polys, one], dim=-2)
        polys = _poly_mul(polys[..., 0::2, :], polys[..., 1::2, :])
    return polys[..., 0, : n + 1]


_BABY = 16  # powers are split as a^(16u + r): a 16-column and an 8-column table
# instead of a full 128 x 128 power matrix (4x fewer modular products)


def _split_powers(a: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Baby steps R[..., i, r] = a_i^r (r < 16) and giant steps G[..., i, u] = a_i^(16u)."""
    baby = power_matrix(a, min(_BABY, n))
    giants = -(-n // _BABY)
    if giants == 1:
        return baby, torch.ones(a.shape + (1,), dtype=_I64)
    stride = baby[..., -1] * (a % PRIME) % PRIME  # a^16
    return baby, power_matrix(stride, giants)


def _power_sums(baby: torch.Tensor, giant: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
    """s_t = sum_i v_i a_i^t mod p for t < n."""
    w = v.unsqueeze(-1) * giant % PRIME  # (..., pts, u)
    s = torch.matmul(w.to(_F64).transpose(-1, -2), baby.to(_F64))  # (..., u, r), < 2**40
    s = s.round_().to(_I64) % PRIME
    return s.flatten(-2)[..., :n]


def _evaluate_split(baby: torch.Tensor, giant: torch.Tensor, coeffs: torch.Tensor) -> torch.Tensor:
    """sum_t c_t a_i^t mod p, with c (..., n) and the split power tables of the a_i."""
    r, u = baby.shape[-1], giant.shape[-1]
    pad = r * u - coeffs.shape[-1]
    c = torch.nn.functional.pad(coeffs, (0, pad)).reshape(coeffs.shape[:-1] + (u, r))
    t = torch.matmul(baby.to(_F64), c.to(_F64).transpose(-1, -2))  # (..., pts, u)
    t = t.round_().to(_I64) % PRIME
    return (t * giant % PRIME).sum(dim=-1) % PRIME


@functools.lru_cache(maxsize=8)
def _hankel_index(n: int) -> torch.Tensor:
    return torch.arange(n).unsqueeze(-1) + 1 + torch.arange(n).unsqueeze(0)


def interpolate(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Coefficients c (ascending, length n) of the unique degree < n polynomial with
    P(x_i) = y_i mod p. x: (..., n) residues distinct mod p; y: (..., n) integers >= 0."""
    x = torch.as_tensor(x, dtype=_I64) % PRIME
    y = torch.as_tensor(y, dtype=_I64) % PRIME
    n = x.shape[-1]
    baby, giant = _split_powers(x, n)
    m = master_polynomial(x)  # (..., n+1)
    dm = torch.arange(1, n + 1, dtype=_I64) * m[..., 1:] % PRIME  # M'(x) coefficients
    weights = inverse_table()[_evaluate_split(baby, giant, dm)]  # 1 / M'(a_i)
    s = _power_sums(baby, giant, y * weights % PRIME, n)
    m_ext = torch.cat([m, torch.zeros(m.shape[:-1] + (n,), dtype=_I64)], dim=-1).to(_F64)
    c = torch.matmul(m_ext[..., _hankel_index(n)], s.to(_F64).unsqueeze(-1)).squeeze(-1)
    return c.round_().to(_I64) % PRIME


def evaluate(coeffs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """P(x) mod p for ascending coefficients (..., n) at points (..., k); equals the
    reference's Horner loop, which reduces x modulo p implicitly."""
    coeffs = torch.as_tensor(coeffs, dtype=_I64) % PRIME
    baby, giant = _split_powers(torch.as_tensor(x, dtype=_I64) % PRIME, coeffs.shape[-1])
    return _evaluate_split(baby, giant, coeffs)


def injective_modulus(x: torch.Tensor, block: int = 256) -> int:
    """Largest m <= p such that x mod m has no collisions (the reference searches
    down from p one by one); candidates are tested a block at a time."""
    x = torch.as_tensor(x, dtype=_I64).reshape(-1)
    if x.numel() <= 1:
        return PRIME
    first = torch.sort(x % PRIME).values  # the usual answer: p itself
    if bool((first[1:] != first[:-1]).all()):
        return PRIME
    top = PRIME - 1
    while top >= 1:
        cand = torch.arange(top, max(top - block, 0), -1, dtype=_I64)
        residues = torch.sort(x.unsqueeze(1) % cand.unsqueeze(0), dim=0).values
        ok = (residues[1:] != residues[:-1]).all(dim=0)
        hits = torch.nonzero(ok).flatten()
        if hits.numel():
            return int(cand[hits[0]])
        top -= block
    raise ValueError("no injective modulus: duplicate points")
