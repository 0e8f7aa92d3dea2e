"""Code rewards: passing, failing, hanging, memory-hungry and escaping programs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from node.rl.rewards import compute_reward
from node.rl.sandbox import code_reward, extract_last_python_block, isolation_mode, run_python_tests
from node.rl.tasks import Problem

TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def fence(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\n"


def sandbox_processes() -> list[int]:
    """Live processes started from a sandbox scratch directory (there must be none after a run)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if b"primenode-sbx-" in cmd:
                pids.append(int(d))
    return pids


def test_extracts_last_python_block():
    text = "```python\nx = 1\n```\ntext\n```\ny = 2\n```\n```python\nz = 3\n```"
    assert extract_last_python_block(text).strip() == "z = 3"
    assert extract_last_python_block("no code") is None


def test_passing_and_failing():
    assert code_reward(fence("def add(a, b):\n    return a + b"), TESTS) == 1.0
    assert code_reward(fence("def add(a, b):\n    return a - b"), TESTS) == 0.0
    assert code_reward(fence("def add(a, b) return"), TESTS) == 0.0  # syntax error
    assert code_reward("def add(a, b): return a + b", TESTS) == 0.0  # no fenced block


def test_early_exit_does_not_pass():
    for code in ("import os\nos._exit(0)", "import sys\nsys.exit(0)", "raise SystemExit(0)"):
        assert code_reward(fence(code), TESTS) == 0.0


def test_hanging_program_is_killed():
    r = run_python_tests("while True:\n    pass", TESTS, timeout_s=1.0)
    assert not r.passed and r.status == "timeout"
    assert sandbox_processes() == []


def test_memory_hungry_program_fails():
    r = run_python_tests(
        "x = bytearray(8 * 1024**3)\ndef add(a, b):\n    return a + b", TESTS, timeout_s=5.0, memory_mb=512
    )
    assert not r.passed and "MemoryError" in r.stderr
    r = run_python_tests(
        "x = [1] * (2 * 1024**3)\ndef add(a, b):\n    return a + b", TESTS, timeout_s=5.0, memory_mb=512
    )
    assert not r.passed


def test_fork_bomb_is_contained():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_python_tests(bomb, TESTS, timeout_s=2.0, max_procs=16)
    assert not r.passed
    assert sandbox_processes() == []
    # the node still works afterwards
    assert code_reward(fence("def add(a, b):\n    return a + b"), TESTS) == 1.0


def test_no_network():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    accepted = []

    def serve():
        for _ in range(15):
            try:
                accepted.append(srv.accept())
            except OSError:
                pass

    th = threading.Thread(target=serve)
    th.start()
    code = (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "s.sendall(b'leak')\n"
        "def add(a, b):\n    return a + b\n"
    )
    r = run_python_tests(code, TESTS, timeout_s=3.0)
    th.join()
    srv.close()
    assert not r.passed and accepted == []
    assert not run_python_tests(
        "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=2)", "", timeout_s=4
    ).passed


def test_cannot_write_outside_scratch(tmp_path):
    target = tmp_path / "owned.txt"
    code = f"open({str(target)!r}, 'w').write('pwned')\ndef add(a, b):\n    return a + b\n"
    assert code_reward(fence(code), TESTS) == 0.0
    assert not target.exists()
    code = f"import os\nos.remove({str(tmp_path / 'keep.txt')!r})\n"
    (tmp_path / "keep.txt").write_text("x")
    assert not run_python_tests(code, "", timeout_s=3).passed
    assert (tmp_path / "keep.txt").exists()
    # the scratch directory itself is writable, and removed afterwards
    r = run_python_tests(
        "import os\nopen('f.txt', 'w').write('ok')\nprint(os.getcwd())", "assert open('f.txt').read() == 'ok'"
    )
    assert r.passed
    assert not Path(r.stdout.strip()).exists()


def test_no_subprocess_escape():
    code = "import subprocess\nsubprocess.run(['true'])\ndef add(a, b):\n    return a + b\n"
    assert code_reward(fence(code), TESTS) == 0.0


def test_isolation_mode_is_reported():
    assert isolation_mode() in ("namespaces+uid", "namespaces", "audit")
    r = run_python_tests("def add(a, b):\n    return a + b", TESTS)
    assert r.passed and r.isolation == isolation_mode()


def test_audit_fallback_still_blocks_escapes(monkeypatch, tmp_path):
    """Where namespaces are unavailable the in-process guard alone must hold the common escapes."""
    import node.rl.sandbox as sb

    monkeypatch.setattr(sb, "isolation_mode", lambda: "audit")
    ok = run_python_tests("def add(a, b):\n    return a + b", TESTS)
    assert ok.passed and ok.isolation == "audit"
    target = tmp_path / "x.txt"
    assert not run_python_tests(f"open({str(target)!r}, 'w').write('x')", "").passed
    assert not target.exists()
    assert not run_python_tests("import socket\nsocket.socket()", "").passed
    assert not run_python_tests("import os\nwhile True:\n    os.fork()", "", timeout_s=2).passed
    assert sandbox_processes() == []


ADD = "def add(a, b):\n    return a + b\n"
CORRECT = fence(ADD)
CODE_PROBLEM = Problem(id="add", prompt="write add", task="code", tests=TESTS)
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


def hostile_cases(tmp_path: Path, victim_pid: int, tcp_port: int, udp_port: int) -> dict[str, tuple[str, bool]]:
    """name -> (program, harmless to run unsandboxed). Each program defines a correct ``add``, so it would
    pass the tests if its hostile part did no harm or went unnoticed; each must score 0."""
    return {
        "busy loop": ("while True:\n    pass\n" + ADD, False),
        "sleeping hang": ("import time\ntime.sleep(3600)\n" + ADD, False),
        "hang inside the tested function": ("def add(a, b):\n    while True:\n        pass\n", False),
        "8 GiB at once": ("x = bytearray(8 * 1024**3)\n" + ADD, False),
        "growing allocation": ("x = []\nwhile True:\n    x.append(bytearray(64 * 1024**2))\n" + ADD, False),
        "fork bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n" + ADD,
            False,
        ),
        "tcp connection": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {tcp_port}), timeout=2).close()\n" + ADD,
            True,
        ),
        "udp datagram": (
            "import socket\n"
            f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {udp_port}))\n" + ADD,
            True,
        ),
        "name lookup": (  # resolving names is a way out too (DNS exfiltration); refused by the guard
            "import socket\nsocket.getaddrinfo('localhost', 80)\n" + ADD,
            True,
        ),
        "write outside scratch": (f"open({str(tmp_path / 'outside.txt')!r}, 'w').write('pwned')\n" + ADD, True),
        "write to /tmp": (f"open({str(ESCAPE)!r}, 'w').write('pwned')\n" + ADD, True),
        "subprocess": ("import subprocess\nsubprocess.run(['true'], check=True)\n" + ADD, True),
        "os.system": ("import os\nassert os.system('true') == 0\n" + ADD, True),
        "kill a process outside": (f"import os, signal\nos.kill({victim_pid}, signal.SIGKILL)\n" + ADD, True),
    }


def test_hostile_programs_would_pass_without_the_sandbox(tmp_path, victim, listeners):
    """Control: the harmless-to-run hostile programs do pass the tests unsandboxed, so the zeros below
    come from the sandbox, not from a broken program."""
    tcp_port, udp_port, reached = listeners
    try:
        for name, (code, harmless) in hostile_cases(tmp_path, victim.pid, tcp_port, udp_port).items():
            if harmless:
                r = subprocess.run([sys.executable, "-c", code + TESTS], cwd=tmp_path, capture_output=True, timeout=60)
                assert r.returncode == 0, (name, r.stderr[-500:])
        assert (tmp_path / "outside.txt").exists() and ESCAPE.exists() and victim.wait(10) == -9
        assert sorted(set(reached())) == ["tcp", "udp"]
    finally:
        ESCAPE.unlink(missing_ok=True)


@pytest.mark.parametrize("mode", ["detected", "audit"])
def test_hostile_programs_score_zero_and_leave_the_node_unharmed(mode, tmp_path, victim, listeners, monkeypatch):
    import node.rl.sandbox as sb

    if mode == "audit":  # the fallback where namespaces are unavailable: the in-process guard alone
        monkeypatch.setattr(sb, "isolation_mode", lambda: "audit")
    tcp_port, udp_port, reached = listeners
    cwd, env = os.getcwd(), dict(os.environ)
    for name, (code, _) in hostile_cases(tmp_path, victim.pid, tcp_port, udp_port).items():
        r = compute_reward(CODE_PROBLEM, fence(code), num_tokens=1, code_timeout_s=2.0)
        assert r.reward == 0.0 and not r.passed and r.details["status"] in ("failed", "timeout"), (name, r)
        assert r.details["isolation"] == sb.isolation_mode()
        assert sandbox_processes() == [], name  # nothing of the run survives it
        assert victim.poll() is None, name  # the process outside is alive
    assert reached() == []
    assert not (tmp_path / "outside.txt").exists() and not ESCAPE.exists()
    assert os.getcwd() == cwd and dict(os.environ) == env
    # the node still scores a correct program 1
    assert compute_reward(CODE_PROBLEM, CORRECT, num_tokens=1).reward == 1.0


def test_daemonised_child_does_not_outlive_the_run():
    """A child that leaves the process group and sleeps is killed with the run (its score is the tests'
    verdict: they pass here, except in audit mode, which refuses fork)."""
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\n" + ADD
    r = run_python_tests(code, TESTS, timeout_s=5.0)
    assert r.passed == (r.isolation != "audit"), r
    assert sandbox_processes() == []
