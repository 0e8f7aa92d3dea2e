"""Small helpers every part of the daemon shares, each written once.

* ``now_ms``: wall-clock milliseconds, the unit of every timestamp on the wire.
* ``aclose_shielded``: close something during cancellation without leaking it.
* ``atomic_write_bytes`` / ``atomic_write_text`` / ``fsync_dir``: the crash-safe
  file write (temp file, fsync, rename, fsync of the folder) that the node home,
  the chunk store, the ledger's neighbours and the RL checkpoints rely on.
* ``crash_point``: a named place where a test can have the process SIGKILL itself
  (``PRIMENODE_CRASH_AT=name``), so crash tests kill a real process at an exact step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

T = TypeVar("T")


def now_ms() -> int:
    """Milliseconds since the epoch (wall clock): the unit of wire timestamps."""
    return time.time_ns() // 1_000_000


async def aclose_shielded(close: Callable[[], Awaitable[object]], timeout: float = 1.0) -> None:
    """Run ``close()`` shielded from cancellation, for at most ``timeout`` seconds.

    Why: when a node is stopped by cancelling its scope, an unshielded ``await
    stream.close()`` is cancelled at its first checkpoint and the socket stays open
    (a leak the remote sees as a silent peer). Errors are swallowed: whatever is
    being closed is already being abandoned, and the caller's own error matters more.
    """
    with trio.CancelScope(shield=True), trio.move_on_after(timeout):
        with contextlib.suppress(Exception):
            await close()


class TokenBucket:
    """The one token bucket of the node: ``rate`` tokens per second, at most ``burst`` held.

    Two ways to spend, for the two kinds of limit the node has:

    * :meth:`take` refuses when the bucket holds fewer than ``n`` tokens (admission: a frame, a
      connection or a request over its sender's rate is dropped, never queued);
    * :meth:`reserve` always grants and returns how long the caller must wait first (pacing: an
      upload's bytes go out late, never lost). The bucket goes into debt, and the next
      reservation waits behind it, so concurrent callers are served in arrival order and over
      any interval of length T at most ``burst + rate * T`` tokens are granted.

    ``clock`` (seconds) is read at each call, so the bucket runs on whatever clock its owner
    runs on: the wall clock, trio's clock, or a clock a test moves by hand.
    """

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = trio.current_time) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.t = burst, clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now

    def take(self, n: float = 1.0) -> bool:
        """Spend ``n`` tokens if the bucket holds them; False (nothing spent) if not."""
        self._refill()
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False

    def reserve(self, n: float) -> float:
        """Spend ``n`` tokens now, in debt if need be; the seconds to wait until they are paid."""
        self._refill()
        self.tokens -= n
        return max(0.0, -self.tokens / self.rate)


def fsync_dir(path: Path) -> None:
    """fsync a folder so a rename inside it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path``, then every folder, deepest first: after this, a rename
    of ``path`` (and an fsync of its parent) publishes content that survives a crash. Files
    written by libraries (``save_pretrained``, ``torch.save``) are not fsynced by them."""
    path = Path(path)
    folders = [path]
    for p in sorted(path.rglob("*")):
        if p.is_dir():
            folders.append(p)
        else:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in sorted(folders, key=lambda d: -len(d.parts)):
        fsync_dir(d)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically: readers see the old file or the new one, never
    a half-written one. ``durable`` adds the fsyncs (file, then folder) that make the new
    content survive a crash; ``mode`` applies before the rename (a key file is never readable
    by others, not even for an instant)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str, *, mode: int = 0o644, durable: bool = True) -> None:
    """``atomic_write_bytes`` for UTF-8 text."""
    atomic_write_bytes(path, text.encode(), mode=mode, durable=durable)


CRASH_ENV = "PRIMENODE_CRASH_AT"


def crash_point(name: str, version: int | None = None) -> None:
    """SIGKILL this process here if ``PRIMENODE_CRASH_AT`` names this point: ``name``, or
    ``name@version`` to crash only while handling that policy version (a test that restarts
    a trainer aims each crash at the next step, not at the restart).

    Why a real SIGKILL and not an exception: a crash test must see what the disk and the
    ledger hold when nothing more runs (no ``finally``, no atexit, no buffered flush), exactly
    as after ``kill -9`` or a power cut of the process. Unset (every normal run), it is a
    dictionary lookup."""
    want = os.environ.get(CRASH_ENV)
    if want is not None and want in (name, f"{name}@{version}"):
        os.kill(os.getpid(), signal.SIGKILL)


STOP_ENV = "PRIMENODE_STOP_DURING"


def stop_point(name: str) -> None:
    """If ``PRIMENODE_STOP_DURING`` names this point: send this process SIGTERM, then block
    this thread for good. It stands for work that outlasts any grace period (a trainer step of
    minutes on a real model), so a test can show that a stop does not wait for it. Unset
    (every normal run), it is a dictionary lookup."""
    if os.environ.get(STOP_ENV) == name:
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait()


_abandoned: list[str] = []


def abandon(what: str) -> None:
    """Record that a worker thread was left running when its task was cancelled (a trainer
    step on SIGTERM). The process then ends with ``os._exit`` after its clean-up
    (``exit_if_abandoned``): interpreter finalization must not race a thread inside torch."""
    _abandoned.append(what)


def exit_if_abandoned(code: int = 0) -> None:
    """End the process now (``os._exit``) if work was abandoned; logs are flushed first."""
    if _abandoned:
        import logging
        import sys

        logging.getLogger(__name__).info("exiting without waiting for: %s", ", ".join(_abandoned))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def thread_cpu(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """``fn(*args)`` and the CPU seconds the calling thread spent on it (``time.thread_time``:
    a measurement of this work alone, where the process's CPU time would also count every
    other thread that ran meanwhile). For ``trio.to_thread.run_sync(thread_cpu, fn, ...)``."""
    t0 = time.thread_time()
    out = fn(*args)
    return out, time.thread_time() - t0
