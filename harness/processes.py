"""Helpers for tests that run primenode as a user does: real OS processes through the CLI.

Time limits here are hang guards, not performance thresholds. The waits poll because
the state they wait on lives in other processes (no trio event crosses a process boundary).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from node.ops.devnet import Devnet, DevnetOptions

PRIMENODE = shutil.which("primenode")
BASE = [PRIMENODE] if PRIMENODE else [sys.executable, "-m", "node.ops.cli"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
HANG_GUARD_S = 120


def cli(*args: str, timeout: float = HANG_GUARD_S) -> subprocess.CompletedProcess:
    return subprocess.run([*BASE, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def terminal_signals() -> None:
    """Ctrl+C and a closed terminal as in a terminal session, for a child started from a test
    run that itself runs in the background of a shell without job control (SIGINT inherited
    ignored) or under ``nohup`` (SIGHUP inherited ignored): the devnet keeps an inherited
    ignore, by design, and the SIGINT and SIGHUP tests would wait forever (a CI run started
    with ``nohup bash .ci/run`` hung the SIGHUP stop test exactly so)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def start(*args: str, log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [*BASE, *args],
            stdout=subprocess.PIPE,
            stderr=f,
            env=ENV,
            start_new_session=True,
            preexec_fn=terminal_signals,
        )


def init_home(path: Path) -> str:
    res = cli("init", "--home", str(path))
    assert res.returncode == 0, res.stderr
    return cli("id", "--home", str(path)).stdout.strip()


def wait_for(pred, timeout: float, what: str, logs: list[Path] = (), procs: list[subprocess.Popen] = ()):
    """Poll ``pred``; fail (with the logs) on timeout or as soon as one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    problem = f"timed out after {timeout}s waiting for {what}"
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            problem = f"{dead[0].args[len(BASE)]} exited with {dead[0].returncode} while waiting for {what}"
            break
        time.sleep(0.3)
    text = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"{problem}{text}")


def status_json(home: Path) -> dict | None:
    res = cli("status", "--json", "--home", str(home), timeout=60)
    if res.returncode != 0:
        return None
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stdout  # one JSON object
    return json.loads(lines[0])


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"process {proc.args} did not stop within {timeout}s of signal {sig}") from None


def processes_naming(folder: Path) -> list[str]:
    """Command lines of live ``primenode bootstrap`` / ``join`` processes whose arguments name
    ``folder`` (a devnet's output folder): the nodes it started, counted from /proc."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state == "Z":  # exited, not yet reaped by its parent: gone for our purpose
            continue
        if ("node.ops.cli join" in cmd or "node.ops.cli bootstrap" in cmd) and str(folder) in cmd:
            found.append(cmd)
    return found


def outgoing_ip() -> str | None:
    """A non-loopback address of this machine, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def wait_for_devnet(pred, timeout: float, what: str, devnet: Devnet | None = None) -> None:
    """Poll ``pred`` (other processes: no event crosses to us); fail with the devnet's logs on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{devnet_report(devnet)}")


def devnet_report(devnet: Devnet | None, lines: int = 25) -> str:
    """What a failed devnet test needs to be diagnosed from CI's output alone: each node's role
    status (queues, votes, versions) while it still runs, and the last ``lines`` lines of its log
    from our own loggers (py-libp2p's lines about dead peers would fill any tail)."""
    if devnet is None:
        return ""
    out = ""
    for p in sorted((devnet.out / "logs").glob("*.log")):
        ours = [ln for ln in p.read_text(errors="replace").splitlines() if " libp2p." not in ln]
        out += f"\n--- {p.name}\n" + "\n".join(ln[:300] for ln in ours[-lines:])
        node = next((n for n in devnet.nodes if n.name == p.stem), None)
        st = node.status(timeout=2.0) if node is not None and node.proc is not None else None
        if st is not None:
            role = st.get("role_state", st.get("role"))
            out += f"\n    status: {json.dumps(role, default=str)[:1500]}"
    return out


def small_options(tmp_path, *, config: dict | None = None, **kw) -> DevnetOptions:
    """The small devnet the system tests and bench/committees.py run: tiny model, short batches,
    workers two batches per version then waiting (light on a shared machine). ``config``: more
    genesis ``[config]`` keys (merged over these); other keywords set DevnetOptions fields."""
    opts = DevnetOptions(
        out=tmp_path / "devnet",
        workers=2,
        validators=3,
        quorum=2,
        steps=1000,
        prompts_per_batch=2,
        group_size=4,
        max_tokens=16,
        extra_config={
            "tiny_hidden_size": 64,
            "tiny_layers": 2,
            "batches_per_step": 1,
            "worker_batches_per_version": 2,
            "worker_lead_versions": 0,  # two per version, then wait: light on a shared machine
            "worker_idle_s": 5.0,
        },
    )
    opts.extra_config.update(config or {})
    for k, v in kw.items():
        setattr(opts, k, v)
    return opts


def init_run(tmp_path: Path, name: str) -> tuple[Path, Path, Path]:
    """Two homes made with ``primenode init`` (a bootstrap's and a joiner's) and a signed genesis
    written by ``primenode run init`` that names the joiner as trainer and validator."""
    boot, joiner = tmp_path / "boot", tmp_path / "joiner"
    init_home(boot)
    joiner_id = init_home(joiner)
    genesis = tmp_path / "run.toml"
    res = cli(
        "run", "init", "--home", str(boot), "--out", str(genesis),
        "--trainer", joiner_id, "--validator", joiner_id, "--name", name,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return boot, joiner, genesis
