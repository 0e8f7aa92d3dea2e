"""Code rewards: passing, failing, hanging, memory-hungry and escaping programs."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from node.rl.sandbox import code_reward, extract_last_python_block, isolation_mode, run_python_tests

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
    r = run_python_tests("x = bytearray(8 * 1024**3)\ndef add(a, b):\n    return a + b", TESTS, timeout_s=5.0, memory_mb=512)
    assert not r.passed and "MemoryError" in r.stderr
    r = run_python_tests("x = [1] * (2 * 1024**3)\ndef add(a, b):\n    return a + b", TESTS, timeout_s=5.0, memory_mb=512)
    assert not r.passed


def test_fork_bomb_is_contained():
    bomb = (
        "import os\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        pass\n"
    )
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
    assert not run_python_tests("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=2)", "", timeout_s=4).passed


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
    r = run_python_tests("import os\nopen('f.txt', 'w').write('ok')\nprint(os.getcwd())", "assert open('f.txt').read() == 'ok'")
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
