"""Code rewards: run untrusted Python under bubblewrap and judge its output outside.

Every program under test runs in its own process tree under ``bwrap`` (bubblewrap):

* every namespace unshared (``--unshare-all``): no network (an empty network
  namespace: loopback only), its own pid/ipc/uts/cgroup/mount namespaces and a
  user namespace in which it is uid/gid 65534 with no capabilities;
  ``--die-with-parent``, ``--new-session`` (no terminal injection);
* a read-only minimal filesystem: ``/usr`` (and the ``/lib``, ``/bin``...
  links or folders of a merged-usr system) and the running interpreter's prefix
  (``sys.base_prefix``, e.g. a pyenv version folder, never a home folder as a
  whole); a fresh ``/proc`` and ``/dev``; a size-capped tmpfs ``/tmp`` as the
  only writable place (the working directory); no ``/etc``, no ``/home``, no
  node home, no other user files, an empty environment;
* resource limits set by the harness inside the sandbox before any untrusted
  code runs (hard limits, which an unprivileged process cannot raise): address
  space, CPU seconds, processes (counted in the sandbox's own user namespace),
  file size, open files, no core dumps;
* a seccomp filter (compiled here with libseccomp through ctypes, handed to
  ``bwrap --seccomp``): ptrace and cross-process memory access, namespace
  creation, mounts, keyrings, BPF, perf, io_uring, kernel modules, clock and
  reboot calls fail with EPERM, sockets other than AF_UNIX with EAFNOSUPPORT,
  ``TIOCSTI``/``TIOCLINUX`` ioctls with EPERM; syscalls of a foreign
  architecture kill the process;
* a wall-clock deadline: bwrap's process group is SIGKILLed, and with it (pid 1
  of the sandbox's pid namespace dies with bwrap, ``--die-with-parent``) every
  process the program started, daemonised or not.

The verdict is decided here, outside the sandbox, from serialised values (see
:func:`parse_tests` for the test formats and what each guarantees): the expected
answers never enter the sandbox. Nothing falls back to a weaker mode: where
bubblewrap or libseccomp cannot be used, :func:`require_sandbox` raises
:class:`node.errors.SandboxError` naming what is missing.

The rooms: :mod:`~node.rl.sandbox.plan` (test formats, results, verdict: pure),
:mod:`~node.rl.sandbox.child` (the program inside), :mod:`~node.rl.sandbox.seccomp` (the filter),
:mod:`~node.rl.sandbox.bwrap` (bubblewrap and the interpreter) and
:mod:`~node.rl.sandbox.runner` (one run, the start-up check, the entry points). This package
re-exports what the rest of the node uses.
"""

from node.rl.sandbox.bwrap import INSTALL_HINT, SANDBOX_UID, find_bwrap, sandbox_python
from node.rl.sandbox.plan import TestPlan, extract_last_python_block, judge, parse_tests
from node.rl.sandbox.runner import (
    ISOLATION,
    MARKER,
    SandboxResult,
    code_reward,
    code_reward_detailed,
    isolation_mode,
    require_sandbox,
    run_python_tests,
    sandbox_status,
)
from node.rl.sandbox.seccomp import seccomp_program

__all__ = [
    "INSTALL_HINT",
    "ISOLATION",
    "MARKER",
    "SANDBOX_UID",
    "SandboxResult",
    "TestPlan",
    "code_reward",
    "code_reward_detailed",
    "extract_last_python_block",
    "find_bwrap",
    "isolation_mode",
    "judge",
    "parse_tests",
    "require_sandbox",
    "run_python_tests",
    "sandbox_python",
    "sandbox_status",
    "seccomp_program",
]
