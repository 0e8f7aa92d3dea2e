"""Keep a long-running node's resident memory flat.

glibc's malloc gives threads that allocate concurrently arenas of their own (up to
8 per core) and keeps memory freed inside an arena for reuse instead of returning
it to the kernel. A worker or validator allocates hundreds of MiB of torch
tensors of ever-changing shapes on worker threads (generation, prefill, a new
state dict every few seconds), so each arena's high-water mark ratchets up and RSS
drifts even though nothing is leaked (the 25-minute soak in docs/benchmarks.md
measured +100-400 MiB/h on those roles; the single-threaded trainer stayed flat).
Three remedies, all no-ops where glibc is absent:

- ``limit_malloc_arenas``: cap the number of arenas early in the process (what the
  ``MALLOC_ARENA_MAX`` environment variable does, but from inside the program,
  so every way of starting a node gets it);
- ``release_free_memory``: ``malloc_trim(0)``, handing freed pages back to the
  kernel, after the big transient allocations (a weight reload, a batch);
- ``set_mmap_threshold``: serve every block of at least a given size from its own
  mapping, unmapped when freed. A trainer step allocates and frees gigabytes of
  activation and gradient blocks of a few MiB each *within* the step, and glibc's
  sliding threshold (raised to the largest block freed so far, up to 32 MiB) puts
  them in its heaps, where freed memory stays resident while anything above it is
  live: on SmolLM2-135M ~1.1 GB (70 % of weights + AdamW state) stayed resident and
  the step's peak stood on it (docs/benchmarks.md, "Trainer memory"). A trim after
  the step cannot lower a peak inside it; a fixed threshold (``mallopt`` also stops
  the sliding) does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
DEFAULT_ARENAS = 2


@functools.cache
def _libc():
    if ctypes.util.find_library("c") is None:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt  # noqa: B018 - glibc only
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def limit_malloc_arenas(arenas: int = DEFAULT_ARENAS) -> bool:
    """Cap glibc malloc arenas; call before threads start. True if applied."""
    libc = _libc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(arenas)))
    if not ok:
        log.debug("mallopt(M_ARENA_MAX, %d) refused", arenas)
    return ok


def release_free_memory() -> bool:
    """Return freed heap pages to the kernel (``malloc_trim(0)``). True if any were released."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.malloc_trim(ctypes.c_size_t(0)))


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve blocks of at least ``nbytes`` from their own mappings, returned to the kernel when
    freed (process-wide, permanent). True if applied."""
    libc = _libc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(nbytes)))
    if not ok:
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) refused", nbytes)
    return ok
