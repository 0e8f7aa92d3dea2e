"""Code rewards: run untrusted Python against unit tests without harming the node.

The last fenced ```python block of a completion is written to a fresh scratch
directory and executed, followed by the task's tests, in a child process:

* resource limits (``setrlimit`` before exec): address space (``RLIMIT_AS``,
  default 512 MiB), CPU seconds, file size, open files, no core dumps, and
  ``RLIMIT_NPROC`` for the sandbox user (stops fork bombs);
* a wall-clock time limit (INTELLECT-2: 5 s); on expiry, or when the run ends,
  the whole process group is SIGKILLed;
* isolation, strongest available, probed once and reported as ``isolation``:

  - ``"namespaces+uid"`` (running as root): ``unshare --net --pid --fork
    --kill-child`` (an empty network namespace, so no network at all; a PID
    namespace, so every descendant, even one that called setsid, dies with the
    sandbox) and ``setpriv`` to uid/gid 65534 (nobody) keeping only
    CAP_DAC_READ_SEARCH, so the interpreter under /root can be read but nothing
    outside the scratch directory (and world-writable places) can be written,
    and RLIMIT_NPROC is enforced;
  - ``"namespaces"`` (unprivileged user with user namespaces):
    ``unshare --map-root-user --net --pid --fork --kill-child``;
  - ``"audit"``: no namespaces; only the in-process guard below, which then also
    refuses ``os.fork`` (RLIMIT_NPROC does not bind a root user).

* an in-process guard in every mode (defence in depth, a ``sys.addaudithook``
  installed before the untrusted code runs): sockets, ``os.exec*``, ``os.system``,
  subprocesses, ``ctypes`` loading, writes outside the scratch directory and
  ``os.kill``/``os.killpg`` aimed at anything but the sandbox's own process or
  process group raise ``PermissionError``. Audit hooks alone do not stop native
  code, and some calls raise no audit event (``signal.pidfd_send_signal`` on an
  ``os.pidfd_open`` descriptor); in ``"audit"`` mode, where the sandbox runs as
  the node's own user, the guard is all there is.

A pass needs exit status 0 *and* a per-run nonce written by the runner after the
tests finished, so ``os._exit(0)`` or ``sys.exit(0)`` at the top of a solution
does not pass. (Code that hunts the nonce out of the runner's frames could still
forge it; scoring it would need tests run in a separate process.)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SANDBOX_UID = 65534

_RUNNER = r"""
import os, sys
cfg_fd = int(sys.argv[1])
import json
with os.fdopen(cfg_fd, "r") as fh:
    _cfg = json.load(fh)
_scratch = os.path.realpath(_cfg["scratch"])
_nonce = _cfg.pop("nonce")
_result_fd = _cfg["result_fd"]
os.chdir(_scratch)
sys.path.insert(0, _scratch)
_src = open("solution.py").read()
_tests = open("tests.py").read()

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                "os.symlink", "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move"}
_BLOCKED = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "ctypes.dlopen",
            "ctypes.dlsym", "ctypes.cdata", "os.startfile", "pty.spawn", "os.forkpty"}
if _cfg.get("block_fork"):
    _BLOCKED |= {"os.fork", "os.forkpty"}
_realpath = os.path.realpath
def _inside(p):
    try:
        if isinstance(p, int):
            return True
        p = os.fsdecode(p)
        r = _realpath(p if os.path.isabs(p) else os.path.join(os.getcwd(), p))
        return r == _scratch or r.startswith(_scratch + os.sep) or r == "/dev/null"
    except Exception:
        return False
def _guard(event, args):
    if event.startswith("socket.") or event in _BLOCKED:
        raise PermissionError("sandbox: " + event + " is not allowed")
    if event == "os.kill" and args[0] not in (os.getpid(), 0, -os.getpgrp()) or (
            event == "os.killpg" and args[0] not in (0, os.getpgrp())):
        raise PermissionError("sandbox: signals only to its own processes")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writing and path is not None and not _inside(path):
            raise PermissionError("sandbox: writing outside the scratch directory")
    elif event in _PATH_EVENTS:
        for a in args[:2]:
            if isinstance(a, (str, bytes, os.PathLike)) and not _inside(a):
                raise PermissionError("sandbox: " + event + " outside the scratch directory")
sys.addaudithook(_guard)

def _run():
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(_src, "solution.py", "exec"), ns)
        exec(compile(_tests, "tests.py", "exec"), ns)
    except SystemExit:
        print("sandbox: SystemExit before the tests finished", file=sys.stderr)
        return False
    except BaseException:
        import traceback
        traceback.print_exc()
        return False
    return True

_ok = _run()
sys.stdout.flush()
if _ok:
    os.write(_result_fd, _nonce.encode())
os._exit(0 if _ok else 1)
"""


@dataclasses.dataclass
class SandboxResult:
    """Outcome of one sandboxed run. ``status``: passed, failed, timeout, no_code or error."""

    passed: bool
    status: str
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    isolation: str


_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_last_python_block(text: str) -> str | None:
    """The last fenced code block tagged python (or untagged when no tagged one exists)."""
    tagged, untagged = None, None
    for m in _FENCE.finditer(text):
        if m.group(1):
            tagged = m.group(2)
        else:
            untagged = m.group(2)
    return tagged if tagged is not None else untagged


@functools.lru_cache(maxsize=1)
def isolation_mode() -> str:
    """Probe once which isolation works here (see the module docstring)."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    candidates: list[tuple[str, list[str]]] = []
    if os.geteuid() == 0 and unshare and setpriv:
        candidates.append(("namespaces+uid", _ns_prefix("namespaces+uid")))
    if os.geteuid() != 0 and unshare:
        candidates.append(("namespaces", _ns_prefix("namespaces")))
    for name, prefix in candidates:
        try:
            r = subprocess.run(prefix + [sys.executable, "-I", "-c", "import socket"], capture_output=True, timeout=20)
            if r.returncode == 0:
                return name
        except (OSError, subprocess.SubprocessError):
            pass
    return "audit"


def _ns_prefix(mode: str) -> list[str]:
    if mode == "namespaces+uid":
        return [
            "unshare",
            "--net",
            "--pid",
            "--fork",
            "--kill-child",
            "setpriv",
            f"--reuid={SANDBOX_UID}",
            f"--regid={SANDBOX_UID}",
            "--clear-groups",
            "--inh-caps=-all,+dac_read_search",
            "--ambient-caps=+dac_read_search",
            "--bounding-set=-all,+dac_read_search",
            "--no-new-privs",
        ]
    if mode == "namespaces":
        return ["unshare", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"]
    return []


def _limits(memory_bytes: int, cpu_s: int, max_procs: int, file_bytes: int) -> None:
    """preexec_fn: runs in the child between fork and exec."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (max_procs, max_procs))


def _nproc_limit(mode: str, max_procs: int) -> int:
    """RLIMIT_NPROC counts every process of the real uid: as uid 65534 that is ~0, but an
    unprivileged user may already run many, so add those to the budget."""
    if mode == "namespaces+uid" or os.geteuid() == 0:
        return max_procs
    uid = os.getuid()
    count = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count + max_procs


def _stragglers(marker: bytes) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as fh:
                    if marker in fh.read():
                        pids.append(int(d))
            except OSError:
                pass
    return pids


def _reap_stragglers(scratch: Path, wait_s: float = 5.0) -> None:
    """Backstop after the group kill: every process of this run still carries the scratch path in
    its command line (forks inherit it), including one that left the process group; SIGKILL them
    and wait until they are gone, so the next run starts from a clean slate."""
    marker = str(scratch).encode()
    deadline = time.monotonic() + wait_s
    while (pids := _stragglers(marker)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python_tests(
    code: str,
    tests: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_procs: int = 32,
    max_file_mb: int = 16,
    max_output: int = 64 * 1024,
) -> SandboxResult:
    """Run ``code`` then ``tests`` in one namespace inside the sandbox; passed only if every test passed."""
    mode = isolation_mode()
    scratch = Path(tempfile.mkdtemp(prefix="primenode-sbx-"))
    nonce = secrets.token_hex(16)
    start = time.monotonic()
    try:
        (scratch / "solution.py").write_text(code)
        (scratch / "tests.py").write_text(tests)
        (scratch / "runner.py").write_text(_RUNNER)
        if mode == "namespaces+uid":
            for p in [scratch, *scratch.iterdir()]:
                os.chown(p, SANDBOX_UID, SANDBOX_UID)
        cfg_r, cfg_w = os.pipe()
        res_r, res_w = os.pipe()
        cfg = {"scratch": str(scratch), "nonce": nonce, "result_fd": res_w, "block_fork": mode == "audit"}
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(scratch),
            "TMPDIR": str(scratch),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        argv = _ns_prefix(mode) + [sys.executable, "-I", "-B", str(scratch / "runner.py"), str(cfg_r)]
        preexec = functools.partial(
            _limits, memory_mb * 2**20, int(timeout_s) + 2, _nproc_limit(mode, max_procs), max_file_mb * 2**20
        )
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=scratch,
                env=env,
                pass_fds=(cfg_r, res_w),
                start_new_session=True,
                preexec_fn=preexec,
            )
            os.close(cfg_r)
            os.close(res_w)
            with os.fdopen(cfg_w, "w") as fh:
                json.dump(cfg, fh)
            timed_out = False
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out, rc = True, None
            _kill_group(proc)
            proc.wait()
            _reap_stragglers(scratch)
            os.set_blocking(res_r, False)
            try:
                got = os.read(res_r, 64)
            except BlockingIOError:
                got = b""
            os.close(res_r)
            out.seek(0)
            err.seek(0)
            stdout = out.read(max_output).decode("utf-8", "replace")
            stderr = err.read(max_output).decode("utf-8", "replace")
        passed = (not timed_out) and rc == 0 and got == nonce.encode()
        status = "passed" if passed else ("timeout" if timed_out else "failed")
        return SandboxResult(passed, status, rc, stdout, stderr, time.monotonic() - start, mode)
    except OSError as exc:
        return SandboxResult(False, "error", None, "", str(exc), time.monotonic() - start, mode)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def code_reward_detailed(completion: str, tests: str, **kwargs) -> SandboxResult:
    """Sandbox the last python block of ``completion`` against ``tests``."""
    code = extract_last_python_block(completion)
    if code is None:
        return SandboxResult(False, "no_code", None, "", "", 0.0, isolation_mode())
    return run_python_tests(code, tests, **kwargs)


def code_reward(completion: str, tests: str, **kwargs) -> float:
    """1.0 only if every unit test passes, else 0.0."""
    return 1.0 if code_reward_detailed(completion, tests, **kwargs).passed else 0.0
