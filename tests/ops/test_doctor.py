"""``primenode doctor`` (node/ops/doctor.py): each check's passing and failing case through its
pure function, the bootstrap probe against real peers (a primenode bootstrap, a libp2p node
that is not primenode, a closed port), and the command as a user runs it against a real
bootstrap process: the table or ``--json``, exit 1 on a blocker."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import trio

from harness.processes import ENV, HANG_GUARD_S, init_run, start, stop, wait_for
from node.home import NodeHome
from node.ops import doctor as d
from node.p2p.clock import describe
from node.p2p.testing import NodeFactory
from protocol import NodeKey

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ the pure checks
def test_python():
    assert d.check_python((3, 11, 7)).status == d.OK
    bad = d.check_python((3, 10, 2))
    assert bad.blocks and "3.11" in bad.fix


def test_torch_engine_and_vllm():
    gpu = d.check_torch(d.TorchFacts("2.5.0", cuda_build="12.4", devices=(("NVIDIA H100", 80 * d.GIB),)))
    assert gpu.status == d.OK and "H100 80 GiB" in gpu.detail and "CUDA 12.4" in gpu.detail
    cpu = d.check_torch(d.TorchFacts("2.5.0+cpu"))
    assert cpu.status == d.WARN and not cpu.blocks and "CPU build" in cpu.detail and "CUDA index" in cpu.fix
    driverless = d.check_torch(d.TorchFacts("2.5.0", cuda_build="12.4"))
    assert driverless.status == d.WARN and "driver" in driverless.fix
    missing = d.check_torch(d.TorchFacts(None, "ModuleNotFoundError: torch"))
    assert missing.blocks and missing.fix == "pip install torch"
    assert d.check_vllm("0.6.3").status == d.OK
    novllm = d.check_vllm(None, "no module named vllm")
    assert novllm.status == d.WARN and not novllm.blocks and novllm.fix == "pip install vllm"


def test_disk_for_the_checkpoint_window():
    need = d.checkpoint_window_bytes("smollm2", max_async=2)
    assert need == 4 * 135_000_000 * 4  # max_async + 2 versions of the float32 weights
    assert d.check_disk(Path("/x"), 10 * need, need, "w").status == d.OK
    assert d.check_disk(Path("/x"), need + 1, need, "w").status == d.WARN
    short = d.check_disk(Path("/x"), need // 2, need, "w")
    assert short.blocks and "free" in short.fix


def test_sandbox_each_missing_piece_names_its_fix_and_blocks_only_code_runs():
    ok = d.check_sandbox(d.SandboxFacts("/usr/bin/bwrap"))
    assert ok.status == d.OK
    cases = [
        (d.SandboxFacts(None), "bubblewrap"),
        (d.SandboxFacts("/usr/bin/bwrap", seccomp_error="libseccomp not found"), "libseccomp2"),
        (d.SandboxFacts("/usr/bin/bwrap", userns="/proc/sys/user/max_user_namespaces is 0"), "sysctl"),
        (d.SandboxFacts("/usr/bin/bwrap", probe_error="bwrap: setting up uid map: Permission denied"), "detail"),
    ]
    for facts, fix in cases:
        c = d.check_sandbox(facts)
        assert c.status == d.FAIL and fix in c.fix and not c.blocks, c
        code_run = d.check_sandbox(d.SandboxFacts(**{**facts.__dict__, "needed": True}))
        assert code_run.blocks, code_run


def test_this_machines_sandbox_gathers_to_a_verdict():
    """What gather_sandbox finds here agrees with the sandbox the node itself would use."""
    from node.rl.sandbox import find_bwrap

    facts = d.gather_sandbox(needed=True)
    assert facts.bwrap == find_bwrap()
    c = d.check_sandbox(facts)
    assert (c.status == d.OK) == (
        facts.bwrap is not None and not (facts.seccomp_error or facts.userns or facts.probe_error)
    )


def test_bootstrap_verdicts():
    good = d.BootstrapFacts("/ip4/1.2.3.4/tcp/1/p2p/X", True, True, run_id="ab" * 32, run_name="r")
    assert d.check_bootstrap(good, "ab" * 32).status == d.OK
    other_run = d.check_bootstrap(good, "cd" * 32)
    assert other_run.blocks and "another run" in other_run.fix
    foreign = d.check_bootstrap(d.BootstrapFacts("a", True, False, error="no /primenode/rr/1.0.0"))
    assert foreign.blocks and "does not speak primenode" in foreign.detail
    down = d.check_bootstrap(d.BootstrapFacts("a", False, error="no connection"))
    assert down.blocks and "unreachable" in down.detail
    assert not d.check_bootstrap(d.BootstrapFacts("a", False), others_ok=True).blocks  # another one answered
    skewed = d.check_bootstrap(d.BootstrapFacts("a", True, True, clock="X says our clock is 23.0 s ahead of its"))
    assert skewed.blocks and "refused our timestamp" in skewed.detail and "NTP" in skewed.fix


def test_running_node_checks():
    assert d.check_reachability(None, None).status == d.SKIP
    assert d.check_reachability({"reachability": "public", "summary": "public"}, 4002).status == d.OK
    relayed = {"reachability": "private", "summary": "behind NAT via relay R", "relays": {"R": ["a"]}}
    assert d.check_reachability(relayed, 0).status == d.OK
    stuck = d.check_reachability({"reachability": "private", "summary": "behind NAT, no relay yet", "relays": {}}, 0)
    assert stuck.status == d.WARN and "forward" in stuck.fix
    assert d.check_clock(None).status == d.SKIP
    assert d.check_clock({"ahead_ms": 30, "peers": 4, "warning": None}).status == d.OK
    off = d.check_clock({"ahead_ms": 23_000, "peers": 5, "warning": describe(23_000, 5)})
    assert off.status == d.FAIL and "23 s ahead of 5 peers" in off.detail and "ntp" in off.fix
    assert d.check_bandwidth(None).status == d.SKIP
    moving = {"versions": [{"bytes_fetched": 8 << 20, "fetching": True, "mib_per_s": 40.0}], "bytes_served": 0}
    assert d.check_bandwidth(moving).status == d.OK and "40.0 MiB/s" in d.check_bandwidth(moving).detail
    slow = {"versions": [{"bytes_fetched": 1 << 20, "fetching": True, "mib_per_s": 0.3}], "bytes_served": 0}
    assert d.check_bandwidth(slow).status == d.WARN
    assert d.exit_code([d.check_python((3, 11)), stuck]) == 0
    assert d.exit_code([d.check_python((3, 9)), stuck]) == 1


# ------------------------------------------------------------------ the bootstrap probe, real peers
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_probe_tells_a_primenode_bootstrap_from_a_foreign_node_and_a_closed_port(tmp_path):
    async with trio.open_nursery() as nursery:
        net = NodeFactory(nursery)
        boot = await net.start()
        facts = await d.probe_bootstrap(boot.full_addrs()[0], timeout=10)
        assert (facts.reachable, facts.primenode, facts.run_id) == (True, True, boot.run_id.hex())
        assert facts.run_name == net.genesis.genesis.name
        nursery.cancel_scope.cancel()

    foreign = await trio.lowlevel.open_process(
        [sys.executable, "-m", "harness.foreign_libp2p"], stdout=subprocess.PIPE, cwd=REPO
    )
    try:
        assert foreign.stdout is not None
        with trio.fail_after(HANG_GUARD_S):
            line = b""
            while not line.endswith(b"\n"):
                line += await foreign.stdout.receive_some(1)
        facts = await d.probe_bootstrap(line.decode().strip(), timeout=10)
        assert (facts.reachable, facts.primenode) == (True, False), facts
        assert "primenode" in d.check_bootstrap(facts).detail
    finally:
        foreign.kill()
        await foreign.wait()

    nobody = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{NodeKey.generate().peer_id}"
    facts = await d.probe_bootstrap(nobody, timeout=5)
    assert not facts.reachable and "no connection" in facts.error
    bad = await d.probe_bootstrap("not-an-address")
    assert not bad.reachable and "address" in bad.error


# ------------------------------------------------------------------ the command, as a user runs it
def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node.ops.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env={**ENV, "COLUMNS": "80", "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )


def test_doctor_against_a_running_bootstrap_passes_and_a_dead_one_blocks(tmp_path):
    boot, _, genesis = init_run(tmp_path, "doctor-run")
    proc = start("bootstrap", "--home", str(boot), "--genesis", str(genesis), log=tmp_path / "boot.log")
    try:
        runtime = NodeHome(boot).runtime_path
        wait_for(runtime.exists, HANG_GUARD_S, "the bootstrap", [tmp_path / "boot.log"], [proc])
        addr = json.loads(runtime.read_text())["addrs"][0]
        ok = doctor("--home", str(boot), "--bootstrap", addr, "--genesis", str(genesis), "--json")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        report = json.loads(ok.stdout)
        by = {c["name"]: c for c in report["checks"]}
        assert report["ok"] is True and by["bootstrap"]["status"] == "ok" and "doctor-run" in by["bootstrap"]["detail"]
        # read from the running node's status: its AutoNAT verdict, its clock (no peers yet)
        assert by["reachability"]["status"] in {"ok", "warn"} and by["reachability"]["detail"] != "no running node"
        assert by["clock"]["status"] == "skip" and "no peer" in by["clock"]["detail"]
        dead = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{NodeKey.generate().peer_id}"
        table = doctor("--home", str(boot), "--bootstrap", dead)
    finally:
        stop(proc)
    assert table.returncode == 1, table.stdout + table.stderr
    assert "FAIL (blocker)" in table.stdout and "fix: check the address" in table.stdout
    assert max(len(line) for line in table.stdout.splitlines()) <= 80
    assert "Traceback" not in table.stderr and "Failed to open" not in table.stderr, table.stderr


def test_doctor_without_a_node_says_how_to_get_the_network_lines(tmp_path):
    res = doctor("--home", str(tmp_path / "nohome"), "--json")
    assert res.returncode in (0, 1), res.stderr  # 1 only where this machine has a blocker
    report = json.loads(res.stdout)
    by = {c["name"]: c for c in report["checks"]}
    assert {"python", "torch", "vllm", "disk", "sandbox", "reachability", "clock", "bandwidth"} <= set(by)
    assert by["clock"]["status"] == "skip" and "primenode join" in by["clock"]["fix"]
    assert (
        report["ok"] == (res.returncode == 0) == (not any(c["status"] == "fail" and c["blocker"] for c in by.values()))
    )


def test_a_dataset_of_code_problems_makes_the_sandbox_a_blocker(tmp_path):
    from node.rl.tasks import save_dataset

    code = save_dataset(
        [{"task": "code", "prompt": "print 42", "tests": '{"io": [{"stdin": "", "stdout": "42"}]}'}],
        tmp_path / "code.jsonl",
    )
    math = save_dataset([{"task": "math", "prompt": "1+1", "answer": "2"}], tmp_path / "math.jsonl")
    assert d.runs_code(str(code)) and not d.runs_code(str(math))
    assert not d.runs_code("builtin:arithmetic") and not d.runs_code(str(tmp_path / "missing.jsonl"))


async def test_probe_of_a_bootstrap_whose_clock_disagrees_with_ours_says_so():
    """The bootstrap answers a request whose timestamp it refuses with the offset it saw
    (clock_skew); doctor names the clock, not "does not speak primenode"."""
    from node.util import now_ms

    async with trio.open_nursery() as nursery:
        net = NodeFactory(nursery)
        boot = await net.start(wall_ms=lambda: now_ms() - 30_000)  # its clock 30 s behind ours
        facts = await d.probe_bootstrap(boot.full_addrs()[0], timeout=10)
        nursery.cancel_scope.cancel()
    # "... says our clock is 30.0 s ahead of its": the offset it saw is the shift less the
    # request's delay (our timestamp was older when it arrived), so a loaded machine reads a
    # little less than 30 s, never more
    said = re.search(r"says our clock is ([0-9.]+) s ahead of its", facts.clock)
    assert facts.primenode and said and 25.0 <= float(said[1]) <= 30.05, facts
    c = d.check_bootstrap(facts)
    assert c.blocks and "refused our timestamp" in c.detail
