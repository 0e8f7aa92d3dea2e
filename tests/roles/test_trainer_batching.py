"""A trainer step takes every admitted, still-fresh batch up to a token budget, and says what
it used and what it discarded, by reason (real SQLite ledgers; a real in-process network)."""

from __future__ import annotations

import io
import json

import trio
from rich.console import Console

from harness.genesis import tiny_genesis
from harness.network import start_network
from node.ops.status_cli import render_role_state
from node.p2p.testing import wait_until
from node.roles.ledger import NO_POLICY_WEIGHTS, STALE_BEFORE_TRAINING, Ledger

V = ["val-a", "val-b"]


def admitted(lg: Ledger, batch_id: bytes, version: int, counter: int = 0, worker: str = "w") -> None:
    lg.record_batch(batch_id, worker, version, counter, 1, b"env-" + batch_id)
    for v in V:
        lg.record_vote(batch_id, v, True, "", [1.0], worker=worker)
    assert lg.try_admit(batch_id) == "admitted"


def test_oldest_first_order_and_discards_by_reason(tmp_path):
    lg = Ledger(tmp_path / "node.db", V, 2, 2)
    lg.commit_checkpoint(step=3, policy_version=3)
    versions = (3, 1, 2, 1)
    for i, version in enumerate(versions):  # one worker each (a worker's chain never goes back a version)
        admitted(lg, b"b%d" % i, version, worker=f"w{i}")
    # the trainer's order: closest to falling out of the window first; the default stays freshest first
    assert [b.batch_id for b in lg.untrained(oldest_first=True)] == [b"b1", b"b3", b"b2", b"b0"]
    assert [b.policy_version for b in lg.untrained()] == [3, 2, 1, 1]
    assert lg.discarded() == {}
    lg.mark_trained([b"b1"], step=4)
    assert lg.discard([b"b1", b"b2"], NO_POLICY_WEIGHTS) == 1  # a trained batch is never discarded
    lg.commit_checkpoint(step=4, policy_version=4)
    assert lg.drop_stale() == 1  # b3 (version 1) fell out of the window untrained
    assert lg.discarded() == {NO_POLICY_WEIGHTS: 1, STALE_BEFORE_TRAINING: 1}
    assert lg.counts()["trained"] == 1 and [b.batch_id for b in lg.untrained()] == [b"b0"]
    rec = lg.batch(b"b2")
    assert rec is not None and rec.envelope == b"env-b2"  # an admitted batch keeps its bytes
    assert lg.discard([b"never-recorded"], NO_POLICY_WEIGHTS) == 0


async def test_steps_take_all_waiting_batches_and_report_ratios_by_staleness(tmp_path):
    """Two workers, two batches each per version; a step starts once three are admitted and
    then takes every fresh one (up to the token budget). Every metrics line accounts for its
    batches, ratios are exactly 1 on batches of the current version and read against the
    generating version's published weights on older ones, and nothing admitted is lost."""
    genesis = tiny_genesis(steps=4, batches_per_step=3, worker_batches_per_version=2)
    with trio.fail_after(400):
        async with trio.open_nursery() as nursery:
            _net, trainer, _validators, _workers = await start_network(nursery, tmp_path, genesis)
            metrics = trainer.home.metrics_path
            await wait_until(
                lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 4,
                380,
                poll=0.5,
                what="four trainer steps in metrics.jsonl",
            )
            rows = [json.loads(line) for line in metrics.read_text().splitlines()]
            status = trainer.status()
            nursery.cancel_scope.cancel()
    assert len(rows) >= 4
    assert all(r["batches"] >= 3 for r in rows)  # a step waits for batches_per_step, then takes them all
    assert sum(r["batches"] for r in rows) == rows[-1]["batches_used"]
    # four batches per version, three start a step: the fourth rides in the same step or the next one
    assert max(r["batches"] for r in rows) >= 4 or any("1" in r["batch_staleness"] for r in rows)
    for r in rows:
        assert sum(r["batch_staleness"].values()) == r["batches"]
        if not r["skipped"]:
            assert set(r["by_staleness"]) <= set(r["batch_staleness"])
            if "0" in r["by_staleness"]:  # old log-probs from the published file of the live version
                assert r["by_staleness"]["0"]["ratio_dev"] < 1e-5 and r["by_staleness"]["0"]["clip_fraction"] == 0
            for s, st in r["by_staleness"].items():
                if s != "0":
                    assert st["ratio_dev"] > 0  # against the generating version, not the current one
        assert r["missing_policy_groups"] == 0
        # reward per generating version: every rollout of the step, once, under its own version
        by_version = r["by_version"]
        assert sum(v["rollouts"] for v in by_version.values()) == r["num_rollouts"]
        assert {int(v) for v in by_version} <= set(r["batch_versions"])
        mean = sum(v["rollouts"] * v["reward_mean"] for v in by_version.values()) / r["num_rollouts"]
        assert abs(mean - r["reward_mean"]) < 1e-9
    # what was admitted was used (a batch admitted during a step at its last eligible version can
    # still age out: the one sanctioned loss), and the status says so
    assert set(status["discarded_batches"]) <= {STALE_BEFORE_TRAINING}
    assert status["trained_batches"] >= rows[-1]["batches_used"]
    text = io.StringIO()
    for table in render_role_state("trainer", status):
        Console(file=text, width=200, color_system=None).print(table)
    assert "discarded batches" in text.getvalue() and "versions behind" in text.getvalue()
