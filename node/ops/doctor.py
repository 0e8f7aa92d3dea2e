"""``primenode doctor``: is this machine ready to join a run, and if not, what to do.

One line per check, each with a fix when it fails, and a non-zero exit when a *blocker*
fails (the node could not run: no torch, no disk for the checkpoint window, no reachable
primenode bootstrap, code tasks without a sandbox). ``--json`` prints the same as one
object for scripts.

Shape: every check is a pure function of *facts* (``check_*``: plain values in, one
:class:`Check` out), and a thin driver gathers the facts (``gather_*``: imports, the
file system, a libp2p dial, the running node's status endpoint). Tests drive each check's
passing and failing case through the pure functions, and the gatherers against real
things: a real bootstrap, a foreign libp2p node, a closed port, this machine's sandbox.

What needs a running node (AutoNAT's verdict and relay reservation, the clock against
peers, bandwidth to the swarm) is read from that node's status endpoint
(``HOME/runtime.json``); without a running node those lines say how to get them.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
GIB = 1 << 30
MIN_PYTHON = (3, 11)
# float32 parameter bytes of the models a genesis can name (node/models.py); a checkpoint
# version on disk is about that, and a node keeps the window of versions below
MODEL_BYTES = {"tiny": 2 * (1 << 20), "tiny-llama": 2 * (1 << 20), "smollm2": 135_000_000 * 4}


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok, warn, fail, skip
    detail: str
    fix: str = ""
    blocker: bool = False  # failing, the node cannot run: doctor exits 1

    @property
    def blocks(self) -> bool:
        return self.status == FAIL and self.blocker

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- pure checks
def check_python(version: Sequence[int]) -> Check:
    v = ".".join(str(x) for x in version[:3])
    if tuple(version[:2]) < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return Check("python", FAIL, f"Python {v}", f"install Python {need} or newer", blocker=True)
    return Check("python", OK, f"Python {v}")


@dataclasses.dataclass(frozen=True)
class TorchFacts:
    version: str | None  # None: not importable
    error: str = ""
    cuda_build: str | None = None  # torch.version.cuda
    devices: tuple[tuple[str, int], ...] = ()  # (name, total bytes)


def check_torch(f: TorchFacts) -> Check:
    if f.version is None:
        return Check("torch", FAIL, f"not importable ({f.error})", "pip install torch", blocker=True)
    build = f"CUDA {f.cuda_build} build" if f.cuda_build else "CPU build"
    if f.devices:
        gpus = ", ".join(f"{name} {total / GIB:.0f} GiB" for name, total in f.devices)
        return Check("torch", OK, f"torch {f.version} ({build}); {len(f.devices)} GPU: {gpus}")
    fix = (
        "install the NVIDIA driver (nvidia-smi must list the GPU)"
        if f.cuda_build
        else "for a GPU: pip install torch from the CUDA index (https://pytorch.org/get-started)"
    )
    return Check("torch", WARN, f"torch {f.version} ({build}); no CUDA device: roles run on CPU (slow)", fix)


def check_vllm(version: str | None, error: str = "") -> Check:
    if version is None:
        return Check(
            "vllm", WARN, f"not installed ({error or 'no module'}); only --engine vllm needs it", "pip install vllm"
        )
    return Check("vllm", OK, f"vLLM {version} (--engine vllm available)")


def checkpoint_window_bytes(model: str, max_async: int) -> int:
    """Disk a node needs for checkpoints: the versions it may hold at once (the ``max_async``
    window, the one being fetched and the one being trained), each about the model's float32
    size; unknown models count as 1 GiB a version."""
    per_version = MODEL_BYTES.get(model, GIB)
    return per_version * (max_async + 2)


def check_disk(path: Path, free_bytes: int, need_bytes: int, what: str) -> Check:
    detail = f"{free_bytes / GIB:.1f} GiB free at {path}; {what} needs {need_bytes / GIB:.2f} GiB"
    if free_bytes < need_bytes:
        return Check(
            "disk", FAIL, detail, f"free {(need_bytes - free_bytes) / GIB:.1f} GiB or use --home elsewhere", True
        )
    if free_bytes < 2 * need_bytes:
        return Check("disk", WARN, detail, "less than twice the window is free: logs and caches grow too")
    return Check("disk", OK, detail)


@dataclasses.dataclass(frozen=True)
class SandboxFacts:
    bwrap: str | None
    seccomp_error: str = ""  # "" when libseccomp built the filter
    userns: str = ""  # "" when user namespaces are allowed, else why not
    probe_error: str = ""  # "" when a sandboxed program ran (require_sandbox)
    needed: bool = False  # the run's task runs code: no sandbox, no code rewards


def check_sandbox(f: SandboxFacts) -> Check:
    blocker = f.needed
    why = "" if f.needed else " (only code tasks need it)"
    if f.bwrap is None:
        return Check(
            "sandbox", FAIL, "bubblewrap (bwrap) not found" + why, "apt-get install -y bubblewrap libseccomp2", blocker
        )
    if f.seccomp_error:
        return Check("sandbox", FAIL, f"seccomp: {f.seccomp_error}{why}", "apt-get install -y libseccomp2", blocker)
    if f.userns:
        return Check(
            "sandbox",
            FAIL,
            f"user namespaces: {f.userns}{why}",
            "sysctl -w kernel.unprivileged_userns_clone=1 user.max_user_namespaces=15000 "
            "(a container: run it with user namespaces allowed)",
            blocker,
        )
    if f.probe_error:
        return Check(
            "sandbox", FAIL, f"{f.bwrap} could not run a sandbox: {f.probe_error}{why}", "see the detail", blocker
        )
    return Check("sandbox", OK, f"bwrap {f.bwrap}, seccomp, user namespaces: a sandboxed program ran")


@dataclasses.dataclass(frozen=True)
class BootstrapFacts:
    addr: str
    reachable: bool
    primenode: bool = False
    run_id: str = ""
    run_name: str = ""
    error: str = ""
    clock: str = ""  # the bootstrap refused our request's timestamp: what it said


def check_bootstrap(f: BootstrapFacts, expected_run_id: str | None = None, others_ok: bool = False) -> Check:
    """One bootstrap address. Failing, it blocks only when no other bootstrap answered."""
    name = "bootstrap"
    if not f.reachable:
        return Check(
            name,
            FAIL,
            f"{f.addr}: unreachable: {f.error}",
            "check the address and port, the firewall, and that the bootstrap runs",
            not others_ok,
        )
    if f.clock:
        return Check(
            name,
            FAIL,
            f"{f.addr}: primenode, but it refused our timestamp: {f.clock}",
            "enable NTP: timedatectl set-ntp true (or install chrony)",
            True,  # every peer would refuse us too
        )
    if not f.primenode:
        return Check(
            name,
            FAIL,
            f"{f.addr}: a libp2p node, but it does not speak primenode ({f.error})",
            "this is not a primenode bootstrap: ask the run owner for the right address",
            not others_ok,
        )
    detail = f"{f.addr}: primenode, run {f.run_name} {f.run_id}"
    if expected_run_id and f.run_id != expected_run_id:
        return Check(
            name,
            FAIL,
            f"{detail}: not the run {expected_run_id}",
            "a bootstrap of another run: check --run-id / the genesis and the address",
            not others_ok,
        )
    return Check(name, OK, detail)


def check_reachability(nat: dict[str, Any] | None, data_port: int | None) -> Check:
    """From a running node's status: AutoNAT's verdict, the relay reservation, the data port."""
    if nat is None:
        return Check("reachability", SKIP, "no running node", "start the node (primenode join) and rerun doctor")
    summary = nat.get("summary") or "unknown"
    reach = nat.get("reachability")
    port = f"; data port {data_port}" if data_port else ""
    if reach == "public":
        return Check("reachability", OK, f"{summary}{port}")
    if reach == "private":
        if nat.get("relays"):
            return Check(
                "reachability",
                OK,
                f"{summary}{port}; peers reach us through the relay, checkpoints over connections we open",
            )
        return Check(
            "reachability",
            WARN,
            summary,
            "forward the TCP listen and data ports on the router (then set advertise_host), or wait for a relay",
        )
    return Check("reachability", WARN, summary, "wait a minute: AutoNAT asks peers to dial back after joining")


def check_clock(clock: dict[str, Any] | None) -> Check:
    if clock is None:
        return Check("clock", SKIP, "no running node", "start the node (primenode join) and rerun doctor")
    if clock.get("warning"):
        return Check("clock", FAIL, clock["warning"], "timedatectl set-ntp true (or install chrony)")
    if clock.get("ahead_ms") is None:
        return Check("clock", SKIP, "no peer timestamp seen yet", "rerun once the node has peers")
    return Check("clock", OK, f"{clock['ahead_ms'] / 1000:+.1f} s against {clock.get('peers', 0)} peers (median)")


def check_bandwidth(distribution: dict[str, Any] | None) -> Check:
    """Checkpoint traffic a running node measured: bytes fetched and served, the rate of a
    fetch in progress."""
    if distribution is None:
        return Check("bandwidth", SKIP, "no running node with checkpoints", "start a worker or validator and rerun")
    versions = distribution.get("versions") or []
    fetched = sum(int(v.get("bytes_fetched") or 0) for v in versions)
    served = int(distribution.get("bytes_served") or 0)
    rates = [float(v.get("mib_per_s") or 0.0) for v in versions if v.get("fetching")]
    detail = f"fetched {fetched / (1 << 20):.1f} MiB, served {served / (1 << 20):.1f} MiB"
    if rates:
        rate = max(rates)
        detail += f"; fetching now at {rate:.1f} MiB/s"
        if rate < 1.0:
            return Check("bandwidth", WARN, detail, "a slow link: each version takes long; check --max-upload-mbps")
    if not fetched and not served:
        return Check("bandwidth", SKIP, detail + " (no checkpoint moved yet)", "rerun after the first version")
    return Check("bandwidth", OK, detail)


def exit_code(checks: Sequence[Check]) -> int:
    return 1 if any(c.blocks for c in checks) else 0


# --------------------------------------------------------------------------- gatherers
def gather_torch() -> TorchFacts:
    try:
        import torch
    except Exception as exc:
        return TorchFacts(None, f"{type(exc).__name__}: {exc}")
    devices: list[tuple[str, int]] = []
    try:
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                devices.append((p.name, int(p.total_memory)))
    except Exception:
        devices = []
    return TorchFacts(str(torch.__version__), cuda_build=torch.version.cuda, devices=tuple(devices))


def gather_vllm() -> tuple[str | None, str]:
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None, "no module named vllm"
    try:
        return importlib.metadata.version("vllm"), ""
    except importlib.metadata.PackageNotFoundError:
        return "unknown version", ""


def userns_problem() -> str:
    """Why unprivileged user namespaces are off here, or ""."""
    for path, bad in (("/proc/sys/kernel/unprivileged_userns_clone", "0"), ("/proc/sys/user/max_user_namespaces", "0")):
        try:
            if Path(path).read_text().strip() == bad:
                return f"{path} is {bad}"
        except OSError:
            continue
    return ""


def gather_sandbox(needed: bool) -> SandboxFacts:
    from node.rl import sandbox

    bwrap = sandbox.find_bwrap()
    try:
        sandbox.seccomp_program()
        seccomp_error = ""
    except Exception as exc:
        seccomp_error = str(exc) or type(exc).__name__
    userns = userns_problem()
    probe_error = ""
    if bwrap and not seccomp_error and not userns:
        try:
            sandbox.require_sandbox()
        except Exception as exc:
            probe_error = str(exc)[:300]
    return SandboxFacts(bwrap, seccomp_error, userns, probe_error, needed)


async def probe_bootstrap(addr: str, timeout: float = 10.0) -> BootstrapFacts:
    """Dial ``addr`` with a throwaway identity and ask it for the run genesis."""
    import logging
    import time

    import trio

    from node.p2p.host import closing_host, make_host, parse_peer_addr
    from node.p2p.metrics import NodeMetrics
    from node.p2p.reqresp import ReqResp, RequestError
    from node.p2p.standing import PeerStanding
    from protocol import ZERO_RUN_ID, GenesisRequest, GenesisResponse, NodeKey, SequenceCounter, verify_genesis

    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # its dial errors: ours say it in one line
    try:
        info = parse_peer_addr(addr)
    except Exception as exc:
        return BootstrapFacts(addr, False, error=f"not a /ip4/.../tcp/PORT/p2p/ID address ({exc})")
    key = NodeKey.generate()
    host = make_host(key, dial_timeout=timeout)
    async with closing_host(host, ["/ip4/127.0.0.1/tcp/0"]):
        rr = ReqResp(
            host, key, ZERO_RUN_ID, standing=PeerStanding(), metrics=NodeMetrics(), seq=SequenceCounter(time.time_ns())
        )
        pid = info.peer_id.to_base58()
        try:
            with trio.fail_after(timeout):
                await host.connect(info)
        except trio.TooSlowError:
            return BootstrapFacts(addr, False, error=f"no connection within {timeout:g} s")
        except Exception as exc:  # py-libp2p's dial error names the peer id again: the class is enough
            return BootstrapFacts(addr, False, error=f"no connection ({type(exc).__name__})")
        try:
            env = await rr.request(pid, GenesisRequest(want=0), GenesisResponse, timeout=timeout)
            g = verify_genesis(env.body.genesis)
        except RequestError as exc:
            if exc.code == "clock_skew":  # primenode, and our clock is off (protocol.reqresp)
                return BootstrapFacts(addr, True, True, clock=exc.detail)
            if exc.code == "unsupported":
                return BootstrapFacts(addr, True, False, error="no /primenode/rr/1.0.0")
            return BootstrapFacts(addr, True, False, error=str(exc)[:200])
        except Exception as exc:
            return BootstrapFacts(addr, True, False, error=f"{type(exc).__name__}: {exc}"[:200])
        return BootstrapFacts(addr, True, True, run_id=g.run_id.hex(), run_name=g.name)


def runs_code(dataset: str) -> bool:
    """Whether the genesis's dataset holds code problems (scored in the sandbox): the built-in
    tasks do not; a dataset file here is read (one the node cannot read yet counts as no)."""
    if dataset.startswith("builtin:"):
        return False
    try:
        from node.rl.tasks import load_dataset

        return any(p.task == "code" for p in load_dataset(dataset))
    except Exception:
        return False


def running_status(home: Path) -> dict[str, Any] | None:
    from node.ops.status_cli import fetch_status

    try:
        return fetch_status(home)
    except Exception:
        return None


@dataclasses.dataclass
class DoctorOptions:
    home: Path
    bootstrap: list[str] = dataclasses.field(default_factory=list)
    genesis: Path | None = None
    run_id: str | None = None
    timeout_s: float = 10.0


def run_doctor(opts: DoctorOptions) -> list[Check]:
    """Every check, in order: the machine, the network, then what a running node measured."""
    import trio

    checks = [check_python(sys.version_info[:3])]
    checks.append(check_torch(gather_torch()))
    checks.append(check_vllm(*gather_vllm()))
    model, max_async, code_run = "unknown", 2, False
    if opts.genesis is not None:
        from node.genesis_file import read_genesis

        g = read_genesis(opts.genesis).genesis
        model, max_async = g.model, g.max_async
        code_run = runs_code(g.dataset)
        opts.run_id = opts.run_id or g.run_id.hex()
    where = opts.home if opts.home.exists() else next(p for p in opts.home.parents if p.exists())
    free = shutil.disk_usage(where).free
    what = f"the checkpoint window ({max_async + 2} versions of {model})"
    checks.append(check_disk(where, free, checkpoint_window_bytes(model, max_async), what))
    checks.append(check_sandbox(gather_sandbox(needed=code_run)))
    probes = [trio.run(probe_bootstrap, a, opts.timeout_s) for a in opts.bootstrap]
    any_ok = any(p.primenode and (not opts.run_id or p.run_id == opts.run_id) for p in probes)
    checks += [check_bootstrap(p, opts.run_id, any_ok) for p in probes]
    st = running_status(opts.home)
    rs = (st or {}).get("role_state") or {}
    dist = rs.get("distribution") if st else None
    checks.append(check_reachability((st or {}).get("nat") if st else None, (dist or {}).get("data_port")))
    checks.append(check_clock((st or {}).get("clock") if st else None))
    checks.append(check_bandwidth(dist))
    return checks


def render(checks: Sequence[Check]) -> Any:
    """The table: check, verdict, and the detail with the fix under it (fits 80 columns)."""
    from rich.table import Table
    from rich.text import Text

    marks = {OK: ("ok", "green"), WARN: ("warn", "yellow"), FAIL: ("FAIL", "bold red"), SKIP: ("skip", "dim")}
    t = Table(title="primenode doctor", title_justify="left")
    t.add_column("check", no_wrap=True)
    t.add_column("", no_wrap=True)
    t.add_column("detail / fix", overflow="fold")
    for c in checks:
        word, style = marks[c.status]
        body = Text(c.detail)
        if c.fix and c.status != OK:
            body.append("\nfix: ", style="bold")
            body.append(c.fix)
        t.add_row(c.name, Text(word + (" (blocker)" if c.blocks else ""), style=style), body)
    return t
