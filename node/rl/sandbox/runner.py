"""Running a program under test: the start-up check (:func:`require_sandbox`, fail closed), one
sandboxed run (memory files for every input and output, bwrap as nobody, a wall-clock deadline that
kills the whole process tree) and the entry points the rewards call."""

from __future__ import annotations

import dataclasses
import functools
import marshal
import math
import os
import re
import select
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from node.errors import SandboxError
from node.rl.sandbox.bwrap import INSTALL_HINT, _bwrap_argv, _drop_to_nobody, find_bwrap, sandbox_python
from node.rl.sandbox.plan import TestPlan, extract_last_python_block, judge, parse_results, parse_tests
from node.rl.sandbox.seccomp import seccomp_program

ISOLATION = "bubblewrap+seccomp"
MARKER = "primenode-sbx"  # in every sandboxed process's command line (tests look for survivors by it)
MAX_RESULT_BYTES = 8 * 2**20
MAX_CASE_OUTPUT = 2**20


@functools.cache
def child_source() -> str:
    """The text of :mod:`node.rl.sandbox.child`, what the sandbox's interpreter runs."""
    return (Path(__file__).parent / "child.py").read_text()


@dataclasses.dataclass
class SandboxResult:
    """Outcome of one sandboxed run. ``status``: passed, failed, timeout, no_code or error
    (a malformed test spec). ``detail`` says why a run failed; ``weak_checks`` counts checks
    whose outcome the program could have forged (see :func:`parse_tests`)."""

    passed: bool
    status: str
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    isolation: str
    detail: str = ""
    checks: int = 0
    weak_checks: int = 0


_probe_lock = threading.Lock()
_probe: dict[str, Any] | None = None


def require_sandbox() -> dict[str, Any]:
    """Check once that a sandboxed program can run here; the description shown by ``primenode
    status``. Raises SandboxError (naming what is missing) otherwise; never falls back."""
    global _probe
    with _probe_lock:
        if _probe is not None:
            return _probe
        bwrap = find_bwrap()
        if bwrap is None:
            raise SandboxError(f"code rewards need bubblewrap (bwrap), which was not found; {INSTALL_HINT}")
        seccomp_program()
        res = _run_sandboxed("print(6 * 7)", TestPlan("io", [{"stdin": ""}], [("stdout", 0, "42")]), bwrap=bwrap)
        if not res.passed:
            raise SandboxError(
                f"code rewards need a working bubblewrap sandbox, and {bwrap} could not run one "
                f"({res.status}: {(res.detail + ' ' + res.stderr).strip()[:300]}); user namespaces may be "
                f"disabled (sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces, or a container "
                f"that forbids them); {INSTALL_HINT}"
            )
        version = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
        _probe = {
            "isolation": ISOLATION,
            "bwrap": bwrap,
            "version": version,
            "python": sandbox_python()[0],
            "probe_ms": round(res.duration_s * 1000, 1),
        }
        return _probe


def sandbox_status() -> dict[str, Any]:
    """For ``primenode status``: the sandbox in use if checked (a node with code tasks checks at
    start), else what would be used, without running anything."""
    if _probe is not None:
        return dict(_probe, ready=True)
    bwrap = find_bwrap()
    return {"isolation": ISOLATION if bwrap else "unavailable", "bwrap": bwrap, "ready": False}


def isolation_mode() -> str:
    """The isolation code rewards use (there is one; SandboxError where it cannot run)."""
    require_sandbox()
    return ISOLATION


def _pread_all(fd: int, cap: int) -> bytes:
    """Up to ``cap`` bytes from the start of ``fd`` (pread may return less than asked at once)."""
    chunks, n = [], 0
    while n < cap and (chunk := os.pread(fd, cap - n, n)):
        chunks.append(chunk)
        n += len(chunk)
    return b"".join(chunks)


def _run_sandboxed(
    code: str,
    plan: TestPlan,
    *,
    bwrap: str | None = None,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_procs: int = 32,
    max_file_mb: int = 16,
    max_output: int = 64 * 1024,
) -> SandboxResult:
    bwrap = bwrap or find_bwrap()
    if bwrap is None:
        raise SandboxError(f"code rewards need bubblewrap (bwrap), which was not found; {INSTALL_HINT}")
    start = time.monotonic()  # wall time: a child process's real run time (no trio here)
    limits = {
        "RLIMIT_AS": memory_mb * 2**20,
        "RLIMIT_CPU": math.ceil(timeout_s) + 1,
        "RLIMIT_NPROC": max_procs,
        "RLIMIT_FSIZE": max_file_mb * 2**20,
        "RLIMIT_NOFILE": 64,
        "RLIMIT_CORE": 0,
    }
    spec = {
        "mode": plan.mode,
        "code": code,
        "steps": plan.steps,
        "limits": limits,
        "max_output": MAX_CASE_OUTPUT,
        "max_result": MAX_RESULT_BYTES,
    }
    # Every file the run uses is an anonymous memory file (no temporary files on disk): the spec
    # (marshal, written here, read inside), the result lines, stdout, stderr and bwrap's status.
    spec_fd, result_fd, out_fd, err_fd, status_fd = fds = [os.memfd_create("primenode-sbx") for _ in range(5)]
    try:
        os.write(spec_fd, marshal.dumps(spec, 4))  # marshal version 4: any Python 3.4+ inside reads it
        os.lseek(spec_fd, 0, os.SEEK_SET)
        seccomp_r, seccomp_w = os.pipe()
        fds.append(seccomp_r)
        try:
            os.write(seccomp_w, seccomp_program())  # a few hundred bytes: fits the pipe buffer
        finally:
            os.close(seccomp_w)
        python, prefix = sandbox_python()
        argv = _bwrap_argv(bwrap, seccomp_r, status_fd, prefix, 64 * 2**20)
        argv += [python, "-I", "-S", "-B", "-c", child_source(), str(spec_fd), str(result_fd), MARKER]
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out_fd,
                stderr=err_fd,
                pass_fds=(seccomp_r, spec_fd, result_fd, status_fd),
                cwd="/",
                start_new_session=True,
                preexec_fn=_drop_to_nobody,
            )
        except OSError as exc:
            raise SandboxError(f"cannot start bubblewrap ({bwrap}): {exc}; {INSTALL_HINT}") from None
        finally:
            os.close(seccomp_r)
            fds.remove(seccomp_r)
        timed_out = not _wait_exit(proc, timeout_s)
        rc: int | None = None if timed_out else proc.returncode
        if timed_out:  # (after a normal exit bwrap is reaped and its pid may be reused: leave it)
            _kill_sandbox(proc.pid)
            proc.wait()
        bwrap_status = _pread_all(status_fd, 65536)
        _wait_namespace_gone(bwrap_status)
        duration = time.monotonic() - start
        stdout = _pread_all(out_fd, max_output).decode("utf-8", "replace")
        stderr = _pread_all(err_fd, max_output).decode("utf-8", "replace")
        raw = _pread_all(result_fd, MAX_RESULT_BYTES)
    finally:
        for fd in fds:
            os.close(fd)
    if b'"child-pid"' not in bwrap_status and not timed_out:
        raise SandboxError(f"bubblewrap ({bwrap}) could not start the sandbox: {stderr.strip()[:500]}")
    checks, weak = len(plan.checks), plan.weak

    def result(passed: bool, status: str, detail: str) -> SandboxResult:
        return SandboxResult(passed, status, rc, stdout, stderr, duration, ISOLATION, detail, checks, weak)

    if timed_out:
        return result(False, "timeout", f"no verdict within {timeout_s:g} s")
    values, detail = parse_results(raw, plan)
    if values is None:
        return result(False, "failed", detail)
    passed, why = judge(plan, values)
    return result(passed, "passed" if passed else "failed", why)


def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait for bwrap to exit (True) or the deadline to pass (False), woken by the exit itself.

    ``Popen.wait(timeout)`` polls with sleeps that double up to 50 ms, so a run that ends at 35 ms
    is noticed at ~64 ms; a pidfd (Linux 5.3+) becomes readable the moment the process exits."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # an older kernel: polling wait
        try:
            proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        exited = bool(poller.poll(max(0, math.ceil(timeout_s * 1000))))  # retried on EINTR (PEP 475)
    finally:
        os.close(pidfd)
    if exited:
        proc.wait()
    return exited


def _kill_sandbox(bwrap_pid: int) -> None:
    """SIGKILL bwrap and the sandbox's pid 1 (which takes every process of its pid namespace with it).

    ``--die-with-parent`` alone is not enough: the sandbox's first process sets its parent-death
    signal only after bwrap cloned it, so a kill in between would orphan it. bwrap is stopped first
    (a clone in flight completes), then its children, found in /proc, are killed, then bwrap."""
    try:
        os.kill(bwrap_pid, signal.SIGSTOP)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 1.0  # wall time: waiting on real processes (no trio here)
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{bwrap_pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            break
        if state in ("T", "t", "Z", "X"):
            break
        time.sleep(0.001)
    children: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{bwrap_pid}/task"):
            children |= {int(c) for c in Path(f"/proc/{bwrap_pid}/task/{tid}/children").read_text().split()}
    except OSError:
        pass
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(bwrap_pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_namespace_gone(bwrap_status: bytes, wait_s: float = 5.0) -> None:
    """Wait until the sandbox's pid 1 is gone or a zombie: the kernel kills every other process of a
    pid namespace when its pid 1 dies and lets pid 1 finish exiting only after they are all reaped,
    so afterwards nothing of the run is left (a fork bomb takes a few ms to be torn down)."""
    m = re.search(rb'"child-pid"\s*:\s*(\d+)', bwrap_status)
    if not m:
        return
    try:  # woken when it exits (readable once it is a zombie), rather than polled
        pidfd = os.pidfd_open(int(m.group(1)))
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # an older kernel: poll /proc
        pidfd = -1
    if pidfd >= 0:
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.poll(math.ceil(wait_s * 1000))
        finally:
            os.close(pidfd)
        return
    stat = Path(f"/proc/{int(m.group(1))}/stat")
    deadline = time.monotonic() + wait_s  # wall time: waiting on the kernel (no trio here)
    while time.monotonic() < deadline:
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.002)


# --------------------------------------------------------------------------- entry points


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
    """Run ``code`` against ``tests`` (any format of :func:`parse_tests`) in the sandbox.

    Raises SandboxError when the sandbox cannot run here (never a weaker fallback); a
    malformed test spec gives status ``error``."""
    bwrap = require_sandbox()["bwrap"]  # the bwrap checked at start
    try:
        plan = parse_tests(tests)
    except (ValueError, SyntaxError, KeyError, TypeError) as exc:
        return SandboxResult(False, "error", None, "", f"bad tests: {exc}", 0.0, ISOLATION, "bad tests")
    return _run_sandboxed(
        code,
        plan,
        bwrap=bwrap,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_procs=max_procs,
        max_file_mb=max_file_mb,
        max_output=max_output,
    )


def code_reward_detailed(completion: str, tests: str, **kwargs: Any) -> SandboxResult:
    """Sandbox the last python block of ``completion`` against ``tests``."""
    code = extract_last_python_block(completion)
    if code is None:
        require_sandbox()
        return SandboxResult(False, "no_code", None, "", "", 0.0, ISOLATION, "no python block")
    return run_python_tests(code, tests, **kwargs)


def code_reward(completion: str, tests: str, **kwargs: Any) -> float:
    """1.0 only if every test passes, else 0.0."""
    return 1.0 if code_reward_detailed(completion, tests, **kwargs).passed else 0.0
