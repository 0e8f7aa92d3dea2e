"""bench/simulate.py runs the real Plumtree core over simulated links: a short run, as a user
runs it (a subprocess; tests do not import bench/), must deliver every message on a quiet
overlay, and the tree must cost fewer message frames than the flood beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_short_simulation_delivers_everything_and_the_tree_beats_the_flood():
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "simulate.py"),
            "--what",
            "gossip",
            "--nodes",
            "30",
            "--seconds",
            "3",
            "--churn",
            "0",
            "--loss",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    rows = {r["mode"]: r for r in json.loads(out.strip().splitlines()[-1])["rows"]}
    assert rows["plumtree"]["delivery_ratio"] == 1.0 and rows["flood"]["delivery_ratio"] == 1.0, rows
    assert rows["plumtree"]["message_frames_per_delivery"] < rows["flood"]["message_frames_per_delivery"] / 2, rows


def test_admission_with_committees_replays_each_batch_k_times_and_admits_at_low_load():
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "simulate.py"), "--what", "admission", "--validators", "4"]
        + ["--sizes", "0,1,2", "--workers", "4", "--hours", "0.5"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    rows = {r["committee"]: r for r in json.loads(out.strip().splitlines()[-1])["admission"]}
    assert [rows[k]["replays_per_batch"] for k in (0, 1, 2)] == [4.0, 1.0, 2.0], rows
    assert rows[1]["admitted_share"] == rows[2]["admitted_share"] == 1.0, rows
    assert rows[1]["validator_busy"] < rows[0]["validator_busy"] / 2, rows  # a committee of 1 of 4: a quarter


def test_distribution_reaches_every_fetcher_near_its_bound_and_a_delta_sooner():
    """The real fetch schedule and super-seeding rules over simulated links: a 100 MB checkpoint
    to 20 fetchers reaches all of them, with and without churn; the fetchers carry most of the
    copies (the seeder sends well under one per fetcher); the delta (52 x smaller) arrives
    sooner than the full checkpoint. (The simulation is seeded: the same numbers every run.)"""
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "simulate.py"), "--what", "distribution", "--fetchers", "20"]
        + ["--sizes-mb", "100", "--dist-churn", "0,50", "--seed-mbps", "1000"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    rows = {(r["what"], r["churn_pct_per_min"]): r for r in json.loads(out.strip().splitlines()[-1])["distribution"]}
    assert set(rows) == {("full", 0.0), ("full", 50.0), ("delta", 0.0), ("delta", 50.0)}, rows
    for r in rows.values():
        assert r["p100_s"] is not None, r  # every fetcher present at the end holds it
    full, delta = rows["full", 0.0], rows["delta", 0.0]
    assert full["p95_over_bound"] < 2.0 and full["seed_copies"] < full["fetchers"] / 2, full
    assert delta["p100_s"] < full["p50_s"], (delta, full)
    assert rows["full", 50.0]["left"] > 0, rows["full", 50.0]  # churn happened
