"""Churn for a local devnet: kill -9 random nodes and restart them, and audit
the trainer's ledger so that nothing admitted is ever lost.

Used by ``tests/system/test_churn.py`` (a bounded run) and ``bench/churn.py`` (minutes).
One node is down at a time: it is killed with SIGKILL, stays down a random
while, and is restarted with the same home (keys, chunk store, ledger), so a
restarted trainer resumes from its checkpoint and ledger.

The audit reads the trainer's SQLite ledger read-only (the trainer may be dead
or writing; WAL readers never block it) and remembers every batch it ever saw
admitted. A batch is **lost** if it was once admitted and later is missing or
holds any status but ``admitted``, except the one sanctioned exit: the ledger's
``drop_stale`` rule ("stale before training": admitted but fallen more than
``max_async`` versions behind before a step took it), reported as ``aged_out``.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from node.ops.devnet import Devnet

AGED_OUT_REASON = "stale before training"


@dataclasses.dataclass
class LedgerAudit:
    db_path: Path
    seen_admitted: set[bytes] = dataclasses.field(default_factory=set)
    lost: dict[bytes, str] = dataclasses.field(default_factory=dict)
    aged_out: set[bytes] = dataclasses.field(default_factory=set)
    duplicate_slots: int = 0
    samples: int = 0

    def _rows(self) -> dict[bytes, tuple[str, str, int | None]] | None:
        if not self.db_path.exists():
            return None
        try:
            con = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=10)
            try:
                rows = con.execute("SELECT batch_id, status, reason, trained_step FROM batches").fetchall()
                dups = con.execute(
                    "SELECT COUNT(*) FROM (SELECT 1 FROM batches WHERE status = 'admitted' "
                    "GROUP BY worker, batch_counter HAVING COUNT(*) > 1)"
                ).fetchone()[0]
            finally:
                con.close()
        except sqlite3.Error:
            return None  # e.g. the database is being created; try again next sample
        self.duplicate_slots = max(self.duplicate_slots, dups)
        return {b: (s, r, t) for b, s, r, t in rows}

    def counters(self, worker: str) -> list[tuple[int, str, str]]:
        """(batch counter, status, reason) of every batch of ``worker`` the ledger holds, in
        counter order: its chain as the trainer sees it ([] when the ledger cannot be read)."""
        try:
            con = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=10)
            try:
                return con.execute(
                    "SELECT batch_counter, status, reason FROM batches WHERE worker = ? ORDER BY batch_counter",
                    (worker,),
                ).fetchall()
            finally:
                con.close()
        except sqlite3.Error:
            return []

    def sample(self) -> bool:
        """Read the ledger once; returns False if it could not be read."""
        rows = self._rows()
        if rows is None:
            return False
        self.samples += 1
        for b, (status, _reason, _t) in rows.items():
            if status == "admitted":
                self.seen_admitted.add(b)
        for b in self.seen_admitted:
            row = rows.get(b)
            if row is None:
                self.lost[b] = "row missing"
            elif row[0] == "admitted":
                self.lost.pop(b, None)  # (a transient read never counts: judged on the latest sample)
            elif row[0] == "rejected" and row[1] == AGED_OUT_REASON:
                self.aged_out.add(b)
                self.lost.pop(b, None)
            else:
                self.lost[b] = f"{row[0]}: {row[1]}"
        return True

    def trained(self) -> int:
        rows = self._rows() or {}
        return sum(1 for b in self.seen_admitted if rows.get(b, ("", "", None))[2] is not None)


@dataclasses.dataclass
class ChurnEvent:
    t: float
    node: str
    down_s: float
    step_before: int


def trainer_step(devnet: Devnet) -> int:
    return max((r.get("step", 0) for r in devnet.trainer_metrics()), default=0)


def trained_steps(devnet: Devnet) -> list[int]:
    return [r["step"] for r in devnet.trainer_metrics() if not r.get("skipped")]


def churn(
    devnet: Devnet,
    audit: LedgerAudit,
    *,
    duration_s: float = 0.0,
    schedule: list[str] | None = None,
    period_s: tuple[float, float] = (5.0, 15.0),
    down_s: tuple[float, float] = (1.0, 6.0),
    victims: list[str] | None = None,
    seed: int = 0,
    on_event: Callable[[ChurnEvent], None] | None = None,
) -> list[ChurnEvent]:
    """Kill -9 and restart nodes, one down at a time, sampling the audit all along.

    ``schedule``: these nodes in this order; otherwise random nodes of ``victims``
    (default: every node) for ``duration_s``. Between two kills the network runs
    ``period_s`` seconds (uniform); a killed node stays down ``down_s`` seconds."""
    rng = random.Random(seed)
    names = victims or [n.name for n in devnet.nodes]
    events: list[ChurnEvent] = []
    t0 = time.monotonic()  # wall time: the operator's churn schedule runs on real seconds
    todo = list(schedule) if schedule is not None else None
    while todo if todo is not None else time.monotonic() - t0 < duration_s:
        _sleep_sampling(audit, rng.uniform(*period_s))
        name = todo.pop(0) if todo is not None else rng.choice(names)
        down = rng.uniform(*down_s)
        ev = ChurnEvent(round(time.monotonic() - t0, 1), name, round(down, 1), trainer_step(devnet))
        audit.sample()
        devnet.kill(name, signal.SIGKILL)
        _sleep_sampling(audit, down)
        node = devnet.node(name)
        if node.log:
            node.log.close()
        devnet.start(node)
        events.append(ev)
        if on_event:
            on_event(ev)
    audit.sample()
    return events


def _sleep_sampling(audit: LedgerAudit, seconds: float) -> None:
    end = time.monotonic() + seconds  # wall time (outside trio: the churn driver sleeps for real)
    while True:
        audit.sample()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(1.0, left))
