"""The seccomp filter every sandboxed process runs under, compiled with libseccomp through ctypes
and handed to ``bwrap --seccomp`` (what it refuses: see :mod:`node.rl.sandbox`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

from node.errors import SandboxError
from node.rl.sandbox.bwrap import INSTALL_HINT

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_NE, _SCMP_CMP_MASKED_EQ = 1, 7
_CLONE_NS_FLAGS = 0x7E020000  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C
_EPERM_SYSCALLS = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "process_madvise",
    "pidfd_getfd",
    "kcmp",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "syslog",
    "quotactl",
    "name_to_handle_at",
    "open_by_handle_at",
    "lookup_dcookie",
    "iopl",
    "ioperm",
    "vhangup",
    "personality",
    "uselib",
)


class _Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


@functools.lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The compiled BPF filter (see the module docstring); SandboxError if libseccomp is missing."""
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise SandboxError(f"code rewards need libseccomp ({name}: {exc}); {INSTALL_HINT}") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_Cmp),
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)  # foreign-architecture syscalls: KILL (libseccomp's default)
    if not ctx:
        raise SandboxError("seccomp_init failed")

    def errno_action(e: int) -> int:
        return 0x00050000 | e

    def add(syscall: str, action: int, *cmps: _Cmp) -> None:
        nr = lib.seccomp_syscall_resolve_name(syscall.encode())
        if nr < 0:  # not a syscall on this architecture
            return
        arr = (_Cmp * len(cmps))(*cmps) if cmps else None
        rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
        if rc < 0:
            raise SandboxError(f"seccomp rule for {syscall} failed ({rc})")

    try:
        for sc in _EPERM_SYSCALLS:
            add(sc, errno_action(errno.EPERM))
        add("clone3", errno_action(errno.ENOSYS))  # flags are behind a pointer: make libc use clone
        # one rule per namespace flag: MASKED_EQ(mask, mask) with several bits would need all of them
        for bit in range(32):
            if _CLONE_NS_FLAGS & (1 << bit):
                add("clone", errno_action(errno.EPERM), _Cmp(0, _SCMP_CMP_MASKED_EQ, 1 << bit, 1 << bit))
        add("socket", errno_action(errno.EAFNOSUPPORT), _Cmp(0, _SCMP_CMP_NE, 1, 0))  # AF_UNIX only
        for req in (_TIOCSTI, _TIOCLINUX):
            add("ioctl", errno_action(errno.EPERM), _Cmp(1, _SCMP_CMP_MASKED_EQ, 0xFFFFFFFF, req))
        r, w = os.pipe()
        try:
            rc = lib.seccomp_export_bpf(ctx, w)
            os.close(w)
            w = -1
            data = b""
            while chunk := os.read(r, 65536):
                data += chunk
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        if rc < 0 or not data:
            raise SandboxError(f"seccomp_export_bpf failed ({rc})")
        return data
    finally:
        lib.seccomp_release(ctx)
