"""node/memory.py: the glibc knobs that keep a long-running node's RSS flat."""

from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from node import memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")


def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


@glibc
def test_arena_cap_is_accepted():
    assert memory.limit_malloc_arenas(2)


@glibc
def test_trim_returns_freed_heap_pages_to_the_kernel():
    # many small blocks (below the mmap threshold, so they live in the heap), then free all
    # but the last one: without malloc_trim the freed pages stay resident in the process
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 * 1024) for _ in range(4000)]  # ~250 MiB
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)  # touch: make the pages resident
    for b in blocks[:-1]:
        libc.free(b)
    before = _rss_kib()
    assert memory.release_free_memory()
    after = _rss_kib()
    libc.free(blocks[-1])
    assert before - after > 100 * 1024, f"RSS {before} -> {after} KiB: freed heap pages were not released"


# In a fresh process (the threshold is process-wide and permanent): blocks of 2 MiB, like a
# trainer step's activations; one freed first (glibc's sliding threshold then rises to 2 MiB, as
# it does after a step's first frees), then 120 live at once, each followed by a small block that
# stays allocated (a metric, a saved scalar), then the 120 freed. Prints the MiB given back.
_STEP_CHILD = """
import ctypes, json, sys
from node import memory

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
applied = memory.set_mmap_threshold(1 << 20) if sys.argv[1] == "fixed" else None
size = 2 << 20
libc.free(libc.malloc(size))
blocks, pins = [], []
for _ in range(120):
    blocks.append(libc.malloc(size))
    ctypes.memset(blocks[-1], 1, size)
    pins.append(libc.malloc(16 * 1024))
held = rss_mib()
for b in blocks:
    libc.free(b)
print(json.dumps({"applied": applied, "returned_mib": held - rss_mib()}))
"""


def _returned_by_frees(mode: str) -> dict[str, object]:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _STEP_CHILD, mode], cwd=root, capture_output=True, text=True, check=True, timeout=60
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@glibc
def test_a_fixed_mmap_threshold_returns_a_steps_freed_blocks_at_once():
    sliding = _returned_by_frees("sliding")  # glibc's default: the freed blocks stay in its heap
    assert sliding["returned_mib"] < 40, sliding
    fixed = _returned_by_frees("fixed")  # the trainer's setting (GRPOConfig.malloc_mmap_threshold)
    assert fixed["applied"] is True
    assert fixed["returned_mib"] > 200, fixed  # 240 MiB were freed
