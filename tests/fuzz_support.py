"""Shared pieces of the fuzz tests: example budgets and structure-aware mutations.

Budgets: each fuzz test runs ``examples(n)`` hypothesis examples, ``n`` by
default (sized so every test file stays well under 20 s on a loaded 2-core
machine). ``FUZZ_EXAMPLES=N`` overrides every budget for a long run on demand::

    FUZZ_EXAMPLES=200000 python -m pytest -q tests/test_fuzz_protocol.py

Coverage-guided fuzzing with atheris (optional, not a CI dependency):
``bench/fuzz_atheris.py`` drives the same targets.

Mutations work on the decoded msgpack tree of a *valid* encoding, so they reach
the deep checks (field ranges, cross-field rules, canonical form) that random
bytes almost never get past.
"""

from __future__ import annotations

import os
import math
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from protocol.schema import pack


def examples(default: int) -> int:
    env = os.environ.get("FUZZ_EXAMPLES")
    return int(env) if env else default


def fuzz_settings(default: int) -> settings:
    # The default (CI) budget is derandomized so a run is reproducible; a long
    # FUZZ_EXAMPLES run explores fresh random inputs.
    return settings(max_examples=examples(default), deadline=None,
                    derandomize="FUZZ_EXAMPLES" not in os.environ,
                    suppress_health_check=list(HealthCheck))


# Values that sit on or just past boundaries, or have an unexpected type.
_ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1, 0.0, -0.0, 1.5, -1e300,
    float("inf"), float("nan"), "", "x" * 300, "\x00", "..", "../x", "a/../b", b"", b"\x00" * 31, b"\x00" * 32,
    b"\x00" * 33, b"\xff" * 64, [], [[]], [0] * 70,
]


def _paths(tree: Any, prefix: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    out = [prefix]
    if isinstance(tree, list):
        for i, v in enumerate(tree):
            out += _paths(v, prefix + (i,))
    return out


def _get(tree: Any, path: tuple[int, ...]) -> Any:
    for i in path:
        tree = tree[i]
    return tree


def _copy(tree: Any) -> Any:
    return [_copy(v) for v in tree] if isinstance(tree, list) else tree


@st.composite
def mutate_tree(draw, tree: Any, max_mutations: int = 3) -> Any:
    """Apply 1..max_mutations structure-aware mutations to a msgpack tree (a copy)."""
    tree = _copy(tree)
    for _ in range(draw(st.integers(1, max_mutations))):
        paths = _paths(tree)
        path = draw(st.sampled_from(paths))
        node = _get(tree, path)
        kind = draw(st.sampled_from(["odd", "tweak", "drop", "dup", "append", "swap", "bytes"]))
        new: Any = node
        if kind == "odd":
            new = _copy(draw(st.sampled_from(_ODD_VALUES)))
        elif kind == "tweak":
            if isinstance(node, bool):
                new = not node
            elif isinstance(node, int):
                new = node + draw(st.sampled_from([-1, 1, -(2**32), 2**32, -node - 1 if node else 1]))
            elif isinstance(node, float):
                choices = [node * 2, -node, node + 1e-9]
                if math.isfinite(node):  # int(inf) / int(nan) raise in the helper, not the decoder
                    choices += [float(int(node)), int(node)]
                new = draw(st.sampled_from(choices))
            elif isinstance(node, str):
                new = node + draw(st.text(max_size=3)) if draw(st.booleans()) else node[:-1]
            elif isinstance(node, bytes):
                new = node[:-1] if node and draw(st.booleans()) else node + b"\x00"
            elif isinstance(node, list):
                new = node[:-1]
        elif kind == "drop" and isinstance(node, list) and node:
            node.pop(draw(st.integers(0, len(node) - 1)))
            continue
        elif kind == "dup" and isinstance(node, list) and node:
            node.append(_copy(node[draw(st.integers(0, len(node) - 1))]))
            continue
        elif kind == "append" and isinstance(node, list):
            node.append(_copy(draw(st.sampled_from(_ODD_VALUES))))
            continue
        elif kind == "swap" and isinstance(node, list) and len(node) >= 2:
            i, j = draw(st.integers(0, len(node) - 1)), draw(st.integers(0, len(node) - 1))
            node[i], node[j] = node[j], node[i]
            continue
        elif kind == "bytes" and isinstance(node, bytes) and node:
            b = bytearray(node)
            b[draw(st.integers(0, len(b) - 1))] ^= draw(st.integers(1, 255))
            new = bytes(b)
        if not path:
            tree = new
        else:
            _get(tree, path[:-1])[path[-1]] = new
    return tree


def try_pack(tree: Any) -> bytes | None:
    try:
        return pack(tree)
    except Exception:
        return None


@st.composite
def mutate_bytes(draw, data: bytes) -> bytes:
    """Byte-level mutations of a valid encoding: flips, inserts, deletes, splices, truncation."""
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "extend", "set"]))
        if not b:
            b += draw(st.binary(min_size=1, max_size=8))
            continue
        i = draw(st.integers(0, len(b) - 1))
        if op == "flip":
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del b[i : i + draw(st.integers(1, 8))]
        elif op == "truncate":
            del b[i:]
        elif op == "extend":
            b += draw(st.binary(min_size=1, max_size=16))
        elif op == "set":
            b[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xC4, 0xCC, 0xCF, 0xD9, 0xDC, 0xDD, 0xFF]))
    return bytes(b)
