"""node/memory.py: the glibc knobs that keep a long-running node's RSS flat."""

from __future__ import annotations

import ctypes
import os
import platform

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
