"""Whole-file writes and reads that bypass the page cache (``O_DIRECT``), with a fallback.

Why: a node writes every byte of every checkpoint it fetches exactly once and
serves most of it to peers within seconds. Through the page cache each written
byte first needs a freshly allocated cache page; on the virtual machines these
nodes often run on (measured here on a Firecracker guest, docs/benchmarks.md)
touching a fresh page costs a host-side fault, and ``write()`` into new page
cache ran at 0.45-0.75 GiB/s of CPU, more than half of all CPU the distribution
benchmark used. With ``O_DIRECT`` the device reads the bytes straight out of our
(reused, already resident) buffer: 1 GiB written and fsynced for 0.07 CPU-s
instead of 2.3. Reads for serving then fill the page cache by DMA (readahead),
which costs the guest little.

``O_DIRECT`` needs the buffer address, file offset and length aligned to the
device's logical block; we use one page (4096 bytes), which covers every common
device. So a write goes in two parts: the aligned prefix directly from a
page-aligned scratch buffer (one per thread, grown on demand, reused so its
pages stay resident), the unaligned tail (< 4 KiB, only at the end of a file)
through the page cache after clearing ``O_DIRECT`` on the same descriptor.

Filesystems without ``O_DIRECT`` (or refusing it for a given file) raise
``EINVAL`` at open or write; callers get :class:`DirectIOUnsupported` and use the
buffered path. Nothing here touches a file other than the one being written.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from typing import Any

# What chunk bytes arrive as (a received buffer, a view of one, or bytes) and how paths are given.
Buffer = bytes | bytearray | memoryview
StrPath = str | os.PathLike[str]

ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class DirectIOUnsupported(OSError):
    """This platform or filesystem refuses O_DIRECT; use buffered I/O."""


class _Scratch(threading.local):
    def __init__(self) -> None:
        self.bufs: dict[str, mmap.mmap] = {}


_scratch = _Scratch()


def scratch(size: int, slot: str = "write") -> mmap.mmap:
    """This thread's page-aligned buffer ``slot`` of at least ``size`` bytes (reused across calls)."""
    need = max(ALIGN, -(-size // ALIGN) * ALIGN)
    buf = _scratch.bufs.get(slot)
    if buf is None or len(buf) < need:
        if buf is not None:
            try:
                buf.close()
            except BufferError:  # a caller still holds a view of it: let it go with the last view
                pass
        buf = _scratch.bufs[slot] = mmap.mmap(-1, need)  # anonymous mappings are page-aligned
    return buf


def _unsupported(exc: OSError) -> bool:
    return exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


def open_direct(path: StrPath, flags: int, mode: int = 0o644) -> int:
    """``os.open`` with ``O_DIRECT``; :class:`DirectIOUnsupported` where it cannot be had."""
    if not _O_DIRECT:
        raise DirectIOUnsupported(errno.EINVAL, "O_DIRECT is not available on this platform")
    try:
        return os.open(path, flags | _O_DIRECT, mode)
    except OSError as exc:
        if _unsupported(exc):
            raise DirectIOUnsupported(exc.errno, f"O_DIRECT refused for {path}: {exc.strerror}") from None
        raise


def _clear_direct(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)


def pwrite_direct(fd: int, data: Buffer, offset: int) -> None:
    """Write ``data`` at ``offset`` on a descriptor opened with :func:`open_direct`.

    The aligned prefix goes direct from the scratch buffer; an unaligned tail clears
    O_DIRECT on ``fd`` and goes through the page cache, and so does everything written
    after it or at an unaligned offset (correct, just no longer direct).
    """
    view = memoryview(data).cast("B")
    n = len(view)
    body = n - n % ALIGN
    if offset % ALIGN or not fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT:
        body = 0  # unaligned offset, or O_DIRECT already cleared by an earlier tail: buffered
    try:
        if body:
            buf = scratch(body)
            buf[:body] = view[:body]
            with memoryview(buf)[:body] as out:
                done = 0
                while done < body:
                    w = os.pwrite(fd, out[done:], offset + done)
                    if w <= 0 or w % ALIGN:
                        raise OSError(errno.EIO, f"short direct write ({w} bytes)")
                    done += w
    except OSError as exc:
        if _unsupported(exc):
            raise DirectIOUnsupported(exc.errno, f"O_DIRECT write refused: {exc.strerror}") from None
        raise
    if body < n:
        if body or fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT:
            _clear_direct(fd)
        tail = view[body:]
        done = 0
        while done < len(tail):
            done += os.pwrite(fd, tail[done:], offset + body + done)


def write_new_file(path: StrPath, data: Buffer, *, durable: bool) -> None:
    """Create ``path`` (which must not exist) holding exactly ``data``, bypassing the page cache.

    Raises :class:`DirectIOUnsupported` (having removed any partial file) where O_DIRECT
    is refused, so the caller can retry buffered.
    """
    fd = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        pwrite_direct(fd, data, 0)
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        raise
    os.close(fd)


def read_file_into(path: StrPath, length: int) -> memoryview:
    """The first ``length`` bytes of ``path``, read with O_DIRECT into this thread's "read" scratch.

    The view is valid until the next read on this thread (release it before then). Raises
    :class:`DirectIOUnsupported` where O_DIRECT is refused, ``OSError`` if short.
    """
    fd = open_direct(path, os.O_RDONLY)
    try:
        want = -(-length // ALIGN) * ALIGN
        buf = scratch(want, "read")
        view = memoryview(buf)[:want]
        got = 0
        try:
            while got < length:
                r = os.preadv(fd, [view[got:]], got)
                if r == 0:
                    break
                got += r
                if got < length and got % ALIGN:
                    break  # end of file inside a block: short
        except OSError as exc:
            if _unsupported(exc):
                raise DirectIOUnsupported(exc.errno, f"O_DIRECT read refused: {exc.strerror}") from None
            raise
        finally:
            view.release()
        if got < length:
            raise OSError(errno.EIO, f"{path} is short: {got} of {length} bytes")
        return memoryview(buf)[:length]
    finally:
        os.close(fd)


_libc_fallocate: Any = None  # the libc function once looked up; False where there is none


def preallocate(fd: int, size: int) -> None:
    """Give the open file ``fd`` exactly ``size`` bytes, reserving the disk blocks where the
    filesystem can (``fallocate``: a full disk fails now, not half-way through a fetch, and
    the later O_DIRECT writes land in allocated extents); a sparse ``ftruncate`` elsewhere.

    The raw syscall, not ``os.posix_fallocate``: glibc emulates that one by writing every
    block where the filesystem lacks fallocate, which is the cost this module avoids.
    """
    global _libc_fallocate
    if _libc_fallocate is None:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = getattr(libc, "fallocate", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
            fn.restype = ctypes.c_int
        _libc_fallocate = fn or False
    if size and _libc_fallocate:
        import ctypes

        if _libc_fallocate(fd, 0, 0, size) == 0:
            if os.fstat(fd).st_size > size:
                os.ftruncate(fd, size)
            return
        err = ctypes.get_errno()
        if err not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err))
    os.ftruncate(fd, size)
