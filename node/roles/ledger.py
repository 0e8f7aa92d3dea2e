"""The trainer's durable ledger (stdlib sqlite3): batches, votes, admissions, steps.

Everything the trainer admits is committed here (WAL, synchronous=FULL) before
anyone is told; a killed trainer reopens the ledger, rolls back whatever it had
consumed after its last checkpoint, and loses nothing admitted.

Admission rule: a batch is admitted once accept votes from ``quorum`` distinct
genesis validators are recorded, its policy version is within ``max_async`` of
the trainer's current version, and the signed batch itself is held. Each
(worker, policy version, batch counter) slot is admitted at most once, so a
worker cannot get the same owed prompts counted twice. Rewards come from the
accepting validators (median per sample), never from the worker.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import statistics
import time
from pathlib import Path
from typing import Iterable, Sequence

import msgpack

SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    batch_id BLOB PRIMARY KEY,
    worker TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    batch_counter INTEGER NOT NULL,
    num_samples INTEGER NOT NULL,
    envelope BLOB,
    status TEXT NOT NULL DEFAULT 'pending',   -- pending | admitted | rejected
    reason TEXT NOT NULL DEFAULT '',
    rewards BLOB,                              -- msgpack list of floats (validators' median)
    admitted_ms INTEGER,
    trained_step INTEGER                       -- step that consumed it (NULL = not yet)
);
CREATE UNIQUE INDEX IF NOT EXISTS admitted_slot
    ON batches(worker, policy_version, batch_counter) WHERE status = 'admitted';
CREATE TABLE IF NOT EXISTS votes (
    batch_id BLOB NOT NULL,
    validator TEXT NOT NULL,
    accept INTEGER NOT NULL,
    reason TEXT NOT NULL,
    rewards BLOB NOT NULL,
    received_ms INTEGER NOT NULL,
    PRIMARY KEY (batch_id, validator)
);
CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


@dataclasses.dataclass(frozen=True)
class AdmittedBatch:
    batch_id: bytes
    worker: str
    policy_version: int
    batch_counter: int
    envelope: bytes
    rewards: list[float]


class Ledger:
    def __init__(self, path: Path | str, validators: Sequence[str], quorum: int, max_async: int) -> None:
        self.validators = frozenset(validators)
        self.quorum = quorum
        self.max_async = max_async
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    # ---------------------------------------------------------------- state
    def get_state(self, key: str, default: int = 0) -> int:
        row = self.db.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def set_state(self, key: str, value: int) -> None:
        self.db.execute("INSERT INTO state(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value = ?",
                        (key, value, value))

    @property
    def policy_version(self) -> int:
        return self.get_state("policy_version", 0)

    # --------------------------------------------------------------- inputs
    def record_batch(self, batch_id: bytes, worker: str, policy_version: int, batch_counter: int,
                     num_samples: int, envelope: bytes | None) -> None:
        """Remember an announced batch (and its bytes once fetched)."""
        self.db.execute(
            "INSERT INTO batches(batch_id, worker, policy_version, batch_counter, num_samples, envelope) "
            "VALUES(?, ?, ?, ?, ?, ?) ON CONFLICT(batch_id) DO UPDATE SET envelope = COALESCE(envelope, excluded.envelope)",
            (batch_id, worker, policy_version, batch_counter, num_samples, envelope),
        )

    def record_vote(self, batch_id: bytes, validator: str, accept: bool, reason: str,
                    rewards: Sequence[float]) -> bool:
        """Store a vote from a genesis validator; returns False if it is not one (ignored)."""
        if validator not in self.validators:
            return False
        self.db.execute(
            "INSERT OR IGNORE INTO votes(batch_id, validator, accept, reason, rewards, received_ms) "
            "VALUES(?, ?, ?, ?, ?, ?)",
            (batch_id, validator, int(accept), reason, msgpack.packb(list(rewards)), int(time.time() * 1000)),
        )
        return True

    # ------------------------------------------------------------ decisions
    def try_admit(self, batch_id: bytes) -> str:
        """Decide a pending batch. Returns its status: pending, admitted or rejected.

        The decision and everything it rests on are committed before returning.
        """
        row = self.db.execute(
            "SELECT worker, policy_version, batch_counter, num_samples, envelope, status FROM batches WHERE batch_id = ?",
            (batch_id,),
        ).fetchone()
        if row is None:
            return "pending"
        worker, version, counter, n, envelope, status = row
        if status != "pending":
            return status
        votes = self.db.execute("SELECT accept, reason, rewards FROM votes WHERE batch_id = ?", (batch_id,)).fetchall()
        accepts = [msgpack.unpackb(r) for a, _, r in votes if a]
        rejects = [reason for a, reason, _ in votes if not a]
        if version < self.policy_version - self.max_async:
            return self._reject(batch_id, f"stale: policy version {version}, trainer at {self.policy_version}, "
                                          f"max_async {self.max_async}")
        if len(rejects) > len(self.validators) - self.quorum:
            return self._reject(batch_id, f"rejected by validators: {rejects[0]}")
        if len(accepts) < self.quorum or envelope is None:
            return "pending"
        accepts = [r for r in accepts if len(r) == n]
        if len(accepts) < self.quorum:
            return self._reject(batch_id, "validators' reward lists do not match the batch size")
        rewards = [statistics.median(col) for col in zip(*accepts)]
        self.db.execute("BEGIN IMMEDIATE")
        try:
            dup = self.db.execute(
                "SELECT 1 FROM batches WHERE worker = ? AND policy_version = ? AND batch_counter = ? AND status = 'admitted'",
                (worker, version, counter),
            ).fetchone()
            if dup:
                self.db.execute("UPDATE batches SET status = 'rejected', reason = ? WHERE batch_id = ?",
                                ("duplicate slot: this worker's batch for that version and counter is already admitted",
                                 batch_id))
                self.db.execute("COMMIT")
                return "rejected"
            self.db.execute(
                "UPDATE batches SET status = 'admitted', rewards = ?, admitted_ms = ? WHERE batch_id = ?",
                (msgpack.packb(rewards), int(time.time() * 1000), batch_id),
            )
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return "admitted"

    def _reject(self, batch_id: bytes, reason: str) -> str:
        self.db.execute("UPDATE batches SET status = 'rejected', reason = ? WHERE batch_id = ?", (reason, batch_id))
        return "rejected"

    # ------------------------------------------------------------- training
    def untrained(self, limit: int | None = None) -> list[AdmittedBatch]:
        """Admitted batches no step has consumed yet, freshest policy first (the most
        on-policy data trains first; older leftovers age out through ``drop_stale``)."""
        q = ("SELECT batch_id, worker, policy_version, batch_counter, envelope, rewards FROM batches "
             "WHERE status = 'admitted' AND trained_step IS NULL ORDER BY policy_version DESC, admitted_ms, batch_id")
        if limit is not None:
            q += f" LIMIT {int(limit)}"
        return [AdmittedBatch(b, w, v, c, e, msgpack.unpackb(r)) for b, w, v, c, e, r in self.db.execute(q)]

    def drop_stale(self) -> int:
        """Admitted-but-untrained batches that fell out of the window: never trained on."""
        cur = self.db.execute(
            "UPDATE batches SET status = 'rejected', reason = 'stale before training' "
            "WHERE status = 'admitted' AND trained_step IS NULL AND policy_version < ?",
            (self.policy_version - self.max_async,),
        )
        return cur.rowcount

    def mark_trained(self, batch_ids: Iterable[bytes], step: int) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        self.db.executemany("UPDATE batches SET trained_step = ? WHERE batch_id = ?", [(step, b) for b in batch_ids])
        self.db.execute("COMMIT")

    def commit_checkpoint(self, step: int, policy_version: int) -> None:
        """A checkpoint for ``step`` is safely on disk: make it the resume point."""
        self.db.execute("BEGIN IMMEDIATE")
        self.set_state("checkpoint_step", step)
        self.set_state("policy_version", policy_version)
        self.db.execute("COMMIT")

    def recover(self) -> int:
        """After a crash: batches consumed by steps newer than the last checkpoint go back
        to the queue. Returns how many were restored."""
        step = self.get_state("checkpoint_step", 0)
        cur = self.db.execute("UPDATE batches SET trained_step = NULL WHERE trained_step > ?", (step,))
        return cur.rowcount

    # ---------------------------------------------------------------- stats
    def counts(self) -> dict[str, int]:
        out = {"pending": 0, "admitted": 0, "rejected": 0, "trained": 0}
        for status, n in self.db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status"):
            out[status] = n
        out["trained"] = self.db.execute("SELECT COUNT(*) FROM batches WHERE trained_step IS NOT NULL").fetchone()[0]
        out["buffer"] = self.db.execute(
            "SELECT COUNT(*) FROM batches WHERE status = 'admitted' AND trained_step IS NULL").fetchone()[0]
        return out

    def admitted_ids(self) -> set[bytes]:
        return {r[0] for r in self.db.execute("SELECT batch_id FROM batches WHERE status = 'admitted'")}

    def accept_voters(self, batch_id: bytes) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT validator FROM votes WHERE batch_id = ? AND accept = 1",
                                              (batch_id,))}
