"""A NAT'd worker and a NAT'd validator contribute to a run across namespace hosts.

A whole network as real ``primenode`` processes (harness/wan.py): bootstrap, trainer,
a public worker and validator, and one worker and one validator each behind its own NAT
router (iptables MASQUERADE, outbound only). Quorum 2 of 2: a batch is admitted only if
the NAT'd validator votes too. The NAT'd worker's batches must be accepted (the validators
and the trainer fetch them over its own connections or a relay), it must load the trainer's
checkpoints (fetched from public peers over connections it opens: it advertises data port 0,
so nobody dials it; public peers may ask it to dial them and serve chunks that way; no chunk
crosses a relay), and ``primenode status`` on it must
say it is behind NAT via a relay.

Skipped, with one line saying why, where namespaces cannot be built.
"""

from __future__ import annotations

import time

import pytest

from harness.netns import Testbed, leftover_namespaces, skip_reason
from harness.processes import small_options
from harness.wan import Placement, WanDevnet

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))

HANG_GUARD_S = 420  # six processes with models on a shared 2-core machine: a hang guard, not a threshold


def _wait(wan: WanDevnet, pred, what: str, timeout: float = HANG_GUARD_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        dead = [n.name for n in wan.nodes if n.proc is not None and n.proc.poll() is not None]
        if dead:
            pytest.fail(f"{dead} exited while waiting for {what}{wan.logs()}")
        time.sleep(2)
    pytest.fail(f"timed out after {timeout}s waiting for {what}{wan.logs()}")


@pytest.mark.slow  # ~40 s on two quiet cores: the slow tier (README)
def test_nat_worker_and_validator_contribute(tmp_path):
    opts = small_options(tmp_path, workers=2, validators=2, quorum=2)
    placement = {"worker-1": Placement(nat=True), "validator-1": Placement(nat=True)}
    with Testbed() as tb, WanDevnet(opts, placement, tb) as wan:
        tag = tb.tag

        def role_state(name: str) -> dict:
            return (wan.status(name) or {}).get("role_state") or {}

        def nat(name: str) -> dict:
            return (wan.status(name) or {}).get("nat") or {}

        for name in ("worker-1", "validator-1"):
            _wait(
                wan, lambda n=name: nat(n).get("reachability") == "private" and nat(n).get("relays"), f"{name} relayed"
            )
        _wait(wan, lambda: nat("trainer").get("reachability") == "public", "the trainer to find itself public")

        # The NAT'd worker's batches pass a quorum that includes the NAT'd validator's vote.
        _wait(wan, lambda: role_state("worker-1").get("batches_accepted", 0) >= 1, "a NAT'd worker's accepted batch")
        # It loads checkpoints the trainer published after its batches (fetched from reachable peers).
        _wait(wan, lambda: (role_state("worker-1").get("policy_version") or 0) >= 1, "the NAT'd worker at version 1")

        # Nobody is told to fetch chunks from a NAT'd node: its heartbeats carry data port 0.
        me = wan.node("worker-1").home.load_key().peer_id
        peers = ((wan.status("trainer") or {}).get("swarm") or {}).get("peers") or []
        seen = next(p for p in peers if p["peer_id"] == me)
        assert seen["data_port"] == 0, seen
        assert all("/p2p-circuit" in a for a in seen["addrs"]), seen

        # Bulk never crossed a relay: every chunk the NAT'd worker fetched came over the data
        # plane (raw TCP connections it opened) from public peers (two NAT'd nodes exchange no
        # bulk), and what a NAT'd node served went over connections it opened (reverse).
        public = {wan.node(n.name).home.load_key().peer_id for n in wan.nodes if n.name not in placement}
        versions = (role_state("worker-1").get("distribution") or {}).get("versions") or []
        fed = {pid for v in versions for pid in v.get("fed_from_bytes") or {}}
        assert fed and fed <= public, (fed, public)
        for name in placement:
            d = role_state(name)["distribution"]
            assert d["bytes_served"] == 0 or d["reverse"].get("served_connections", 0) >= 1, d

        out = wan.cli_status("worker-1")
        assert out.returncode == 0, out.stderr
        assert "behind NAT via relay" in out.stdout, out.stdout
    assert leftover_namespaces(tag) == []
