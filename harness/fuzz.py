"""Shared pieces of the fuzz tests: example budgets and structure-aware mutations.

Budgets: each fuzz test runs ``examples(n)`` hypothesis examples, ``n`` by
default (sized so each test takes a few seconds on a loaded 2-core machine:
the CI budget). ``FUZZ_EXAMPLES=N`` overrides every budget for a long run on
demand, and also switches from the fixed (derandomized) CI inputs to fresh
random ones::

    FUZZ_EXAMPLES=200000 python -m pytest -q tests/protocol/test_fuzz_protocol.py
    FUZZ_EXAMPLES=5000 python -m pytest -q tests/p2p/test_fuzz_network.py tests/p2p/test_fuzz_clients.py

Coverage-guided fuzzing with atheris (optional, not a CI dependency:
``pip install atheris``): ``bench/fuzz_atheris.py`` drives the same decoders
and handlers for as long as asked::

    python bench/fuzz_atheris.py --list
    python bench/fuzz_atheris.py --target envelope --seconds 600

Network fuzz tests (real sockets, live nodes in one trio loop) run hypothesis
in a worker thread: the ``@given`` body is synchronous and reaches the trio
loop through :func:`on_loop`; see :func:`run_given`.

Mutations work on the decoded msgpack tree of a *valid* encoding, so they reach
the deep checks (field ranges, cross-field rules, canonical form) that random
bytes almost never get past.
"""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from protocol.schema import pack

T = TypeVar("T")


def examples(default: int) -> int:
    env = os.environ.get("FUZZ_EXAMPLES")
    return int(env) if env else default


def fuzz_settings(default: int) -> settings:
    # The default (CI) budget is derandomized so a run is reproducible; a long
    # FUZZ_EXAMPLES run explores fresh random inputs.
    return settings(
        max_examples=examples(default),
        deadline=None,
        derandomize="FUZZ_EXAMPLES" not in os.environ,
        suppress_health_check=list(HealthCheck),
    )


async def run_given(test: Callable[[], None]) -> None:
    """Run a hypothesis test (a ``@given`` function taking no arguments) in a worker
    thread of the running trio loop, so every example can talk to nodes, servers and
    sockets that live in this loop (started once, not once per example). The test's
    examples call :func:`on_loop` to run a coroutine here; its failure (the falsifying
    example, shrunk) is raised here."""
    await trio.to_thread.run_sync(test, abandon_on_cancel=True)


def on_loop(afn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """From inside :func:`run_given`'s thread: run ``afn(*args)`` on the trio loop and return its result."""
    return trio.from_thread.run(afn, *args)


# Values that sit on or just past boundaries, or have an unexpected type.
_ODD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31 - 1,
    2**31,
    2**32,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
    0.0,
    -0.0,
    1.5,
    -1e300,
    float("inf"),
    float("nan"),
    "",
    "x" * 300,
    "\x00",
    "..",
    "../x",
    "a/../b",
    b"",
    b"\x00" * 31,
    b"\x00" * 32,
    b"\x00" * 33,
    b"\xff" * 64,
    [],
    [[]],
    [0] * 70,
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


_SPECIAL_BYTES = [0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xC4, 0xCC, 0xCF, 0xD9, 0xDC, 0xDD, 0xFF]


def byte_mutations(max_ops: int = 4) -> st.SearchStrategy:
    """Byte-level mutations drawn independently of the bytes they will apply to (positions
    wrap around the length): for inputs only known when the example runs (envelopes sealed
    with the current time), so the drawn choices, and hence the examples, stay reproducible.
    Apply with :func:`apply_mutations`."""
    op = st.tuples(
        st.sampled_from(["flip", "insert", "delete", "truncate", "extend", "set"]),
        st.integers(0, 2**16),
        st.integers(0, 255),
        st.binary(min_size=1, max_size=16),
    )
    return st.lists(op, min_size=1, max_size=max_ops)


def apply_mutations(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for op, pos, val, blob in ops:
        if not b:
            b += blob
            continue
        i = pos % len(b)
        if op == "flip":
            b[i] ^= 1 << (val % 8)
        elif op == "insert":
            b[i:i] = blob[:8]
        elif op == "delete":
            del b[i : i + 1 + val % 8]
        elif op == "truncate":
            del b[i:]
        elif op == "extend":
            b += blob
        else:
            b[i] = _SPECIAL_BYTES[val % len(_SPECIAL_BYTES)]
    return bytes(b)
