"""Code rewards under bubblewrap: test formats, hostile programs, fail-closed start.

Every test here except the format parsers needs bubblewrap (``bwrap``) and libseccomp. They are
not skipped where those are missing: ``test_bubblewrap_sandbox_is_available`` (and every other
test) fails with SandboxError naming what to install (`.ci/run` installs ``bubblewrap``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import node.rl.sandbox.runner as sb  # where the start-up check reads find_bwrap and keeps its probe
from node.errors import NodeError, SandboxError
from node.rl.rewards import compute_reward
from node.rl.sandbox import (
    ISOLATION,
    MARKER,
    code_reward,
    extract_last_python_block,
    parse_tests,
    require_sandbox,
    run_python_tests,
)
from node.rl.tasks import Problem

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
ADD = "def add(a, b):\n    return a + b\n"
CORRECT = None  # set below (fence needs defining first)
T = 2.0  # the wall-clock limit for hostile programs


def fence(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\n"


CORRECT = fence(ADD)
CODE_PROBLEM = Problem(id="add", prompt="write add", task="code", tests=TESTS)


def sandbox_processes() -> list[int]:
    """Live sandboxed processes (their command line carries MARKER); there must be none after a run."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if MARKER.encode() in cmd:  # bwrap, the sandbox's pid 1 and the harness (and its forks)
                pids.append(int(d))
    return pids


# ----------------------------------------------------------------- availability, fail closed


def test_bubblewrap_sandbox_is_available():
    """Fails loudly (SandboxError: install bubblewrap) where the sandbox cannot run: code rewards
    would refuse there, so CI must not silently skip the rest of this module."""
    info = require_sandbox()
    assert info["isolation"] == ISOLATION and Path(info["bwrap"]).name == "bwrap"
    assert sb.sandbox_status()["ready"] is True


def test_missing_bubblewrap_refuses_with_one_clear_error(monkeypatch):
    monkeypatch.setattr(sb, "_probe", None)
    monkeypatch.setattr(sb, "find_bwrap", lambda: None)
    with pytest.raises(SandboxError, match="bubblewrap") as exc:
        code_reward(CORRECT, TESTS)
    assert "apt-get install bubblewrap" in str(exc.value) and isinstance(exc.value, NodeError)
    with pytest.raises(SandboxError, match="bubblewrap"):
        compute_reward(CODE_PROBLEM, CORRECT, num_tokens=1)
    assert sb.sandbox_status()["isolation"] == "unavailable"


def test_a_bwrap_that_cannot_sandbox_refuses(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sb, "_probe", None)
    monkeypatch.setenv("PRIMENODE_BWRAP", str(fake))
    with pytest.raises(SandboxError, match="bubblewrap") as exc:  # nobody cannot even run it from tmp_path
        code_reward(CORRECT, TESTS)
    assert "No permissions to create new namespace" in str(exc.value) or "Permission denied" in str(exc.value)


def test_missing_libseccomp_refuses(monkeypatch):
    monkeypatch.setattr(sb, "_probe", None)
    sb.seccomp_program.cache_clear()
    monkeypatch.setattr("ctypes.util.find_library", lambda name: "libseccomp-missing.so.9")
    try:
        with pytest.raises(SandboxError, match="libseccomp"):
            code_reward(CORRECT, TESTS)
    finally:
        sb.seccomp_program.cache_clear()


def test_node_with_code_tasks_does_not_start_without_the_sandbox(monkeypatch):
    from node.roles.factory import check_code_sandbox

    code = [Problem(id="c", prompt="p", task="code", tests=TESTS)]
    math = [Problem(id="m", prompt="p", task="math", answer="1")]
    monkeypatch.setattr(sb, "_probe", None)
    monkeypatch.setattr(sb, "find_bwrap", lambda: None)
    check_code_sandbox(math)  # no code task: nothing to check
    with pytest.raises(SandboxError, match="bubblewrap"):
        check_code_sandbox(code)


# ----------------------------------------------------------------- formats


def test_extracts_last_python_block():
    text = "```python\nx = 1\n```\ntext\n```\ny = 2\n```\n```python\nz = 3\n```"
    assert extract_last_python_block(text).strip() == "z = 3"
    assert extract_last_python_block("no code") is None


def test_legacy_asserts_keep_literals_outside():
    plan = parse_tests("x = 3\nassert add(x, 2) == 5\nassert add(1, 1) != 3\nassert ok()\nassert 0 < add(1, 1) < 9\n")
    assert plan.mode == "calls"
    assert plan.steps == [{"exec": "x = 3"}, {"eval": "add(x, 2)"}, {"eval": "add(1, 1)"}, {"eval": "ok()"}] + [
        {"eval": "add(1, 1)"}
    ]
    assert "5" not in repr(plan.steps)  # the expected value never enters the sandbox
    assert len(plan.checks) == 4 and plan.weak == 3  # != , truthiness and the chained comparison
    loop = parse_tests("for a, b in [(1, 2)]:\n    assert add(a, a) == b\n")
    assert loop.weak == 1 and loop.checks == []


def test_io_and_call_specs_parse():
    io = parse_tests('{"io": [{"stdin": "1 2\\n", "stdout": "3\\n"}]}')
    assert io.mode == "io" and io.steps == [{"stdin": "1 2\n"}] and io.weak == 0
    i2 = parse_tests('[{"type": "stdin_stdout", "input": "1 2", "output": "3"}]')  # INTELLECT-2 test_cases
    assert i2.mode == "io" and i2.checks == [("stdout", 0, "3")]
    calls = parse_tests('{"calls": [{"call": "add(1, 2)", "expect": 3}], "setup": "import math"}')
    assert calls.steps == [{"exec": "import math"}, {"eval": "add(1, 2)"}] and calls.weak == 0
    for bad in ('{"io": []}', '{"calls": [{"call": "f("}]}', "x = (\n"):
        with pytest.raises((ValueError, SyntaxError)):
            parse_tests(bad)
    assert run_python_tests(ADD, "x = (\n").status == "error"
    assert parse_tests("x = 1\n").weak == 1  # statements only: weak (the run just has to finish)


IO_TESTS = '{"io": [{"stdin": "2 3\\n", "stdout": "5\\n"}, {"stdin": "-1 1\\n", "stdout": "0"}]}'
CALL_TESTS = (
    '{"calls": [{"call": "add(2, 3)", "expect": 5}, {"call": "add(0.1, 0.2)", "expect": 0.3, "tol": 1e-9},'
    ' {"call": "pair(1)", "expect": [1, 1]}]}'
)
IO_SOLUTION = "a, b = map(int, input().split())\nprint(a + b)\n"


def test_every_format_scores_correct_and_wrong_solutions():
    pair = "def pair(x):\n    return (x, x)\n"
    cases = [
        (ADD, TESTS, True),
        (ADD.replace("+", "-"), TESTS, False),
        ("def add(a, b) return", TESTS, False),  # syntax error
        (IO_SOLUTION, IO_TESTS, True),
        (IO_SOLUTION.replace("+", "*"), IO_TESTS, False),
        ("print(5)\n", IO_TESTS, False),
        (ADD + pair, CALL_TESTS, True),
        (ADD + pair.replace("(x, x)", "[x, 2]"), CALL_TESTS, False),
        (ADD.replace("a + b", "True") + pair, '{"calls": [{"call": "add(0, 1)", "expect": 1}]}', False),  # bool
        (ADD, "assert add(1, 2) == (3)\nassert add((1,), (2,)) == (1, 2)\nassert add([1], [2]) != (1, 2)\n", True),
        (ADD, "assert add(1, 2) is not None\nassert not add(0, 0)\nassert add(1, 1) in (2, 3)\n", True),
        (ADD, "assert False\n", False),
    ]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: run_python_tests(c[0], c[1], timeout_s=10), cases))
    for (code, tests, want), r in zip(cases, results):
        assert r.passed == want and r.status == ("passed" if want else "failed"), (code, tests, r)


def test_values_cross_the_boundary_exactly():
    """The harness's own encoder (no json import inside) keeps every plain value exact: strings with
    quotes, control characters, astral and lone-surrogate code points, big ints, -0.0, inf and nan,
    and tuples, sets, frozensets, dicts with non-string keys and bytes, nested."""
    code = (
        "S = 'q\"\\\\' + chr(0) + chr(10) + chr(0x7f) + 'é' + chr(0x1F600) + chr(0xD800)\n"
        "def f():\n"
        "    return [S, 10**300, -0.0, 1e-300, float('inf'), (1, (2,)), {3}, frozenset(), {(1, 2): b'\\x00\\xff'}, None]\n"
    )
    tests = (
        "assert f()[0] == 'q\"\\\\' + chr(0) + chr(10) + chr(0x7f) + 'é' + chr(0x1F600) + chr(0xD800)\n"
        "assert f()[1:5] == [10**300, -0.0, 1e-300, float('inf')]\n"
        "assert f()[5:] == [(1, (2,)), {3}, frozenset(), {(1, 2): b'\\x00\\xff'}, None]\n"
        "assert f()[5] != [1, [2]]\n"  # a tuple stays a tuple
        "assert f()[2] != f()[2] or True\n"
    )
    r = run_python_tests(code, tests)
    assert r.passed, r
    nan = run_python_tests("def g():\n    return float('nan')\n", "assert g() != g()\n")
    assert nan.passed, nan
    deep = run_python_tests("def g():\n    x = []\n    x.append(x)\n    return x\n", "assert g() == 1\n")
    assert not deep.passed and "ValueError" in deep.detail, deep


def test_io_programs_run_as_scripts():
    """Each io case runs the program as ``python -I -S solution.py`` would: ``__main__``, its argv,
    the interpreter's own exit (threads joined, atexit handlers, sys.exit codes), /dev/stdin."""
    cases = {
        "main guard and argv": "import sys\nif __name__ == '__main__':\n    print(sys.argv[0], input())\n",
        "worker thread": (
            "import sys, threading\nthreading.stack_size(2**26)\nsys.setrecursionlimit(10**5)\n"
            "def main():\n    print('solution.py', input())\nthreading.Thread(target=main).start()\n"
        ),
        "atexit and sys.exit": (
            "import atexit, sys\nx = input()\natexit.register(lambda: print('solution.py', x))\nsys.exit(3)\n"
        ),
        "/dev/stdin": "print('solution.py', open('/dev/stdin').read().strip())\n",
    }
    tests = '{"io": [{"stdin": "a\\n", "stdout": "solution.py a"}, {"stdin": "b", "stdout": "solution.py b"}]}'
    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(cases, pool.map(lambda c: run_python_tests(c, tests, timeout_s=10), cases.values())))
    for name, r in results.items():
        assert r.passed, (name, r)
    # a large input: more than the file-size limit, which binds the program's own writes only
    big = run_python_tests(
        "import sys\nprint(len(sys.stdin.buffer.read()))\n",
        json.dumps({"io": [{"stdin": "x" * (17 * 2**20), "stdout": str(17 * 2**20)}]}),
        max_file_mb=16,
        timeout_s=20,
    )
    assert big.passed, big


# ----------------------------------------------------------------- hostile programs

ESCAPE = Path(f"/tmp/primenode-escape-{os.getpid()}")


@pytest.fixture
def victim():
    """A process of the node's user, outside the sandbox, that hostile code tries to kill."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def listeners():
    """A TCP listener and a UDP socket on loopback; yields (tcp port, udp port, what reached them)."""
    tcp, udp = socket.socket(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    tcp.setblocking(False)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    reached: list[str] = []

    def poll() -> list[str]:
        for sock, what in ((tcp, "tcp"), (udp, "udp")):
            try:
                got = sock.accept() if what == "tcp" else sock.recvfrom(64)
                reached.append(what)
                if what == "tcp":
                    got[0].close()
            except BlockingIOError:
                pass
        return reached

    yield tcp.getsockname()[1], udp.getsockname()[1], poll
    tcp.close()
    udp.close()


# The old in-process guard's escapes (issue 15): clear its tables from the runner's frame, then shell
# out; forge its pass nonce; read any file (the node key) as root.
GUARD_ESCAPE = """
import sys, subprocess
f = sys._getframe(0)
while f is not None:
    for name in ("_BLOCKED", "_PATH_EVENTS"):
        if name in f.f_globals:
            f.f_globals[name].clear()
    f = f.f_back
subprocess.run(["/bin/sh", "-c", "cat {key} > {out} && echo pwned > {escape}"], check=True)
"""
FORGE_NONCE = """
import os, sys
f = sys._getframe(0)
while f.f_back is not None:
    f = f.f_back
g = f.f_globals
for fd in range(3, 64):  # every descriptor: write a forged record ending in "done", then leave clean
    try:
        os.write(fd, b'{"started": true}\\n{"i": 0, "v": true}\\n{"done": true}\\n')
    except OSError:
        pass
if "_nonce" in g:
    os.write(g["_result_fd"], g["_nonce"].encode())
os._exit(0)
"""
TAMPER_HARNESS = """
import sys, json, builtins
g = sys._getframe(1).f_globals
g["_enc"] = lambda x, depth=0: 5          # every value the harness reports is now 5
json.dumps = lambda *a, **k: '{"done": true}'
builtins.type = lambda x: int
builtins.AssertionError = type("Never", (Exception,), {})
def add(a, b):
    return a - b
"""
ALWAYS_EQUAL = """
class Eq:
    def __eq__(self, other):
        return True
    __ne__ = lambda self, other: False
    __hash__ = object.__hash__
def add(a, b):
    return Eq()
"""
INT_EQUAL = """
class I(int):
    def __eq__(self, other):
        return True
def add(a, b):
    return I(0)
"""


def hostile_cases(tmp_path: Path, key: Path, victim_pid: int, tcp_port: int, udp_port: int) -> dict:
    """name -> (program, tests, harmless to run unsandboxed). Except where the program's point is to
    forge a verdict, each defines a correct ``add``: only its hostile part can make it score 0."""
    out = tmp_path / "stolen.txt"
    node_pid = os.getpid()
    return {
        "guard escape: clear tables, shell out": (
            GUARD_ESCAPE.format(key=key, out=out, escape=ESCAPE) + ADD,
            TESTS,
            True,
        ),
        "forged pass record/nonce, tests say assert False": (FORGE_NONCE, "assert False\n", True),
        "forged pass record, real tests": (FORGE_NONCE, TESTS, True),
        "read the node key": (f"open({str(key)!r}).read()\n" + ADD, TESTS, True),
        "copy the node key into scratch": (f"import shutil\nshutil.copy({str(key)!r}, 'k')\n" + ADD, TESTS, True),
        "read /etc/passwd": ("open('/etc/passwd').read()\n" + ADD, TESTS, True),
        "list /root and /home": (
            "import os\nassert os.listdir('/root') != ['.pyenv'] or os.listdir('/home')\n" + ADD,
            TESTS,
            True,
        ),
        "always-equal object": (ALWAYS_EQUAL, TESTS, True),
        "int subclass equal to anything": (INT_EQUAL, TESTS, True),
        "tampered harness and builtins": (TAMPER_HARNESS, TESTS, True),
        "sys.exit(0) before the tests": ("import sys\nsys.exit(0)\n" + ADD, TESTS, False),
        "raise SystemExit(0) in the tested function": ("def add(a, b):\n    raise SystemExit(0)\n", TESTS, False),
        "os._exit(0) before the tests": ("import os\nos._exit(0)\n" + ADD, TESTS, False),
        "os._exit(0) inside the tested function": ("import os\ndef add(a, b):\n    os._exit(0)\n", TESTS, False),
        "write outside scratch": (f"open({str(tmp_path / 'outside.txt')!r}, 'w').write('x')\n" + ADD, TESTS, True),
        "write to the root folder": ("open('/owned', 'w').write('x')\n" + ADD, TESTS, False),
        "write under /usr": ("open('/usr/lib/owned', 'w').write('x')\n" + ADD, TESTS, False),
        "tcp connection": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {tcp_port}), timeout=1).close()\n" + ADD,
            TESTS,
            True,
        ),
        "udp datagram": (
            "import socket\n"
            f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {udp_port}))\n" + ADD,
            TESTS,
            True,
        ),
        "name lookup": ("import socket\nsocket.getaddrinfo('localhost', 80)\n" + ADD, TESTS, True),
        "raw netlink socket": (
            "import socket\nsocket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)\n" + ADD,
            TESTS,
            True,
        ),
        "fork bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n" + ADD,
            TESTS,
            False,
        ),
        "memory bomb, 8 GiB at once": ("x = bytearray(8 * 1024**3)\n" + ADD, TESTS, False),
        "memory bomb, growing": ("x = []\nwhile True:\n    x.append(bytearray(64 * 1024**2))\n" + ADD, TESTS, False),
        "tmpfs filler": (
            "with open('big', 'wb') as f:\n    while True:\n        f.write(bytes(2**20))\n" + ADD,
            TESTS,
            False,
        ),
        "busy loop": ("while True:\n    pass\n" + ADD, TESTS, False),
        "sleeping hang": ("import time\ntime.sleep(3600)\n" + ADD, TESTS, False),
        "hang inside the tested function": ("def add(a, b):\n    while True:\n        pass\n", TESTS, False),
        "daemonised child, parent exits early": (
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\nos._exit(0)\n" + ADD,
            TESTS,
            False,
        ),
        "kill the node": (f"import os\nos.kill({node_pid}, 9)\n" + ADD, TESTS, False),
        "kill a process outside": (f"import os, signal\nos.kill({victim_pid}, signal.SIGKILL)\n" + ADD, TESTS, True),
        "kill every process it can": ("import os\nos.kill(-1, 9)\n" + ADD, TESTS, False),
        "ptrace": ("import ctypes\nassert ctypes.CDLL(None).ptrace(16, 1, 0, 0) == 0\n" + ADD, TESTS, False),
        "new user namespace": ("import os\nos.unshare(os.CLONE_NEWUSER)\n" + ADD, TESTS, False),
        "subprocess shell to the outside": (
            f"import subprocess\nsubprocess.run(['sh', '-c', 'echo x > {tmp_path}/shell.txt'], check=True)\n" + ADD,
            TESTS,
            True,
        ),
    }


@pytest.fixture
def node_key(tmp_path):
    """A stand-in node key (0600, owned by the node's user) outside the sandbox."""
    key = tmp_path / "home" / "node.key"
    key.parent.mkdir()
    key.write_text("SECRET-KEY-MATERIAL")
    key.chmod(0o600)
    return key


def test_hostile_programs_would_pass_without_the_sandbox(tmp_path, victim, listeners, node_key):
    """Control: the harmless-to-run hostile programs pass the tests unsandboxed (run as plain code plus
    the asserts), so the zeros below come from the sandbox, not from a broken program."""
    tcp_port, udp_port, reached = listeners
    try:
        for name, (code, tests, harmless) in hostile_cases(tmp_path, node_key, victim.pid, tcp_port, udp_port).items():
            if harmless and not name.startswith(("forged", "always", "int subclass", "tampered", "list")):
                r = subprocess.run([sys.executable, "-c", code + tests], cwd=tmp_path, capture_output=True, timeout=60)
                assert r.returncode == 0, (name, r.stderr[-500:])
        assert (tmp_path / "stolen.txt").read_text() == "SECRET-KEY-MATERIAL"
        assert (tmp_path / "outside.txt").exists() and ESCAPE.exists() and victim.wait(10) == -9
        assert sorted(set(reached())) == ["tcp", "udp"]
    finally:
        ESCAPE.unlink(missing_ok=True)
    # the in-process tricks do fool asserts run in the program's own process
    for code in (ALWAYS_EQUAL, INT_EQUAL):
        assert subprocess.run([sys.executable, "-c", code + TESTS], capture_output=True).returncode == 0


def test_hostile_programs_score_zero_and_leave_the_node_unharmed(tmp_path, victim, listeners, node_key):
    tcp_port, udp_port, reached = listeners
    cwd, env = os.getcwd(), dict(os.environ)
    cases = hostile_cases(tmp_path, node_key, victim.pid, tcp_port, udp_port)

    def score(item):
        name, (code, tests, _) = item
        problem = Problem(id=name, prompt="write add", task="code", tests=tests)
        return name, compute_reward(problem, fence(code), num_tokens=1, code_timeout_s=T)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(score, cases.items()))
    for name, r in results:
        assert r.reward == 0.0 and not r.passed, (name, r)
        assert r.details["status"] in ("failed", "timeout") and r.details["isolation"] == ISOLATION, (name, r)
    statuses = dict((n, r.details["status"]) for n, r in results)
    for name in ("busy loop", "sleeping hang", "hang inside the tested function"):
        assert statuses[name] == "timeout", name
    assert sandbox_processes() == []  # nothing of any run survives it
    assert victim.poll() is None  # the process outside is alive (and so is this one)
    assert reached() == []
    assert not (tmp_path / "outside.txt").exists() and not (tmp_path / "stolen.txt").exists()
    assert not ESCAPE.exists()
    assert not Path("/owned").exists() and not Path("/usr/lib/owned").exists()
    assert os.getcwd() == cwd and dict(os.environ) == env
    # the node still scores a correct program 1
    assert compute_reward(CODE_PROBLEM, CORRECT, num_tokens=1).reward == 1.0


def test_hostile_io_programs_score_zero():
    cases = {
        "exit before output": "import os\nos._exit(0)\n",
        "tries to read the expected output": "import os\nprint(os.listdir('.'), open('/proc/1/cmdline').read())\n",
        "prints the input back": "print(input())\n",
        "hang": "while True:\n    pass\n",
        "kills the harness after answering": "import os\nprint(sum(map(int, input().split())), flush=True)\n"
        "os.kill(os.getppid(), 9)\n",
        "forges records into every descriptor of the harness": "import os\nfor fd in range(64):\n    try:\n"
        "        f = os.open(f'/proc/{os.getppid()}/fd/{fd}', os.O_WRONLY)\n"
        '        os.write(f, b\'{"i": 0, "v": "5\\\\n"}\\n{"done": true}\\n\')\n    except OSError:\n'
        "        pass\nprint(7)\n",
    }
    with ThreadPoolExecutor(4) as pool:
        results = dict(zip(cases, pool.map(lambda c: run_python_tests(c, IO_TESTS, timeout_s=T), cases.values())))
    for name, r in results.items():
        assert not r.passed, (name, r)
    assert results["hang"].status == "timeout"
    assert sandbox_processes() == []


def test_daemonised_child_does_not_outlive_the_run():
    """A child that leaves the session and sleeps is killed with the run; the score is the tests'."""
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\n" + ADD
    r = run_python_tests(code, TESTS, timeout_s=5.0)
    assert r.passed, r
    assert sandbox_processes() == []
    # and a run that times out takes its whole tree with it
    code = "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        os.setsid()\n        break\ntime.sleep(3600)\n"
    r = run_python_tests(code + ADD, TESTS, timeout_s=1.0)
    assert r.status == "timeout" and sandbox_processes() == []


def test_timeout_is_reported_to_the_reward_contract():
    """RunContext.reward_checked treats details["status"] == "timeout" as non-deterministic."""
    r = compute_reward(CODE_PROBLEM, fence("import time\ntime.sleep(60)\n" + ADD), num_tokens=1, code_timeout_s=1.0)
    assert r.reward == 0.0 and r.details["status"] == "timeout"
    ok = compute_reward(CODE_PROBLEM, CORRECT, num_tokens=1)
    assert ok.reward == 1.0 and ok.details["status"] == "passed" and ok.details["isolation"] == ISOLATION


def test_scratch_is_writable_and_private():
    """/tmp inside is the run's own tmpfs: a write to a path of the node's /tmp lands there, not here."""
    r = run_python_tests(f"open({str(ESCAPE)!r}, 'w').write('x')\n" + ADD, TESTS)
    assert r.passed and not ESCAPE.exists()
    r = run_python_tests(
        "import os\nopen('f.txt', 'w').write('ok')\nprint(os.getcwd(), sorted(os.listdir('/')))\n" + ADD,
        TESTS + "assert open('f.txt').read() == 'ok'\n",
    )
    assert r.passed, r
    cwd, rest = r.stdout.split(" ", 1)
    assert cwd == "/tmp" and "home" not in rest and "etc" not in rest and "work" not in rest


def test_status_shows_the_sandbox():
    from node.ops.status_cli import _sandbox
    from node.ops.status_server import status_json

    class FakeNode:
        peer_id, role = "p", "validator"

        def status(self):
            return {"peer_id": "p", "role": "validator"}

    require_sandbox()
    st = json.loads(status_json(FakeNode()))
    assert st["sandbox"]["isolation"] == ISOLATION and st["sandbox"]["ready"] is True
    assert st["sandbox"]["version"].startswith("bubblewrap")
    assert _sandbox(st["sandbox"]).startswith(ISOLATION + ", bubblewrap")
