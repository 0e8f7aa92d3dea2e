"""The trainer's durable ledger (stdlib sqlite3): batches, votes, admissions, steps.

Everything the trainer admits is committed here (WAL, synchronous=FULL) before
anyone is told; a killed trainer reopens the ledger, rolls back whatever it had
consumed after its last checkpoint, and loses nothing admitted.

Admission rule: a batch is admitted once ``quorum`` distinct genesis validators
*of its committee* (``protocol/committee.py``: every validator when the run has no
committees; else the validators its slot's order has called on, which grows past a
silent or disagreeing member) accept it *and their rewards agree* (every sample within ``reward_agreement`` of
each other's, :func:`protocol.rules.agreeing_validators`), its policy version is
within ``max_async`` of the trainer's current version, and the signed batch
itself is held. Accepting validators whose rewards disagree are logged and the
batch waits for more votes; once the validators that have not voted could no
longer complete an agreeing quorum (at the latest when every genesis validator
has voted), it is rejected. A vote is on one announce, (worker, batch id), and
counts only where that worker signed the batch (protocol/batches.py): a vote on
another peer's announce of the same id (a thief's copy, rejected) is about a batch
that does not exist. Each (worker, batch counter) slot is admitted at most once,
so a worker cannot get the same owed prompts counted twice. A worker's counters
form one chain over the run (``protocol.rules.counter_gap``): a batch is admitted
only once the ledger holds a batch at every lower counter of its worker (the
``chains`` table keeps each worker's held prefix, so retention never breaks it),
and never at a version older than its previous counter's. Rewards come from the
agreeing validators (median per sample), never from the worker.

Retention (identities are free, so batches from announcers nobody vouches for
must not fill the disk). Nothing admitted is ever deleted, and an
admitted batch keeps its bytes. For everything else:

* a batch that is rejected (by votes, as stale, as a duplicate slot) loses its
  stored envelope at once; its row (worker, version, counter, reason) and its
  votes stay as the record of the decision;
* pending batches that fall out of the ``max_async`` window can never be
  admitted: :meth:`prune` rejects them as stale (and drops their bytes);
* the bytes of pending batches are capped (``max_pending`` batches,
  ``max_pending_bytes``): a new batch evicts the envelopes of the oldest pending
  ones, those with no accept vote first. An evicted batch stays pending; once a
  quorum of validators accepts it, :meth:`bytes_wanted` tells the trainer to
  fetch it again from its worker, so eviction costs an honest batch a second
  fetch, never its admission (unless its worker has forgotten it too);
* the metadata of batches never admitted (rejected or evicted rows) is capped at
  ``max_unadmitted_rows``, oldest first, with their votes; votes for batches the
  ledger never recorded are kept ``orphan_vote_ttl_s`` (a vote may arrive before
  the trainer has fetched the batch), then deleted.
"""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import msgpack

from node.util import now_ms
from protocol.admission import BatchFacts, Ruling, admission
from protocol.committee import Ballot, CommitteeRule, Decision
from protocol.rules import (
    Quorum,
    is_stale,
    window_floor,
)

log = logging.getLogger(__name__)

# A vote is on one announce: (batch_id, worker = the announcer the validator fetched from). It
# counts for a batch only where that worker is the batch's signer (protocol/batches.py), so a
# vote on someone else's announce of the same id (a thief's, rejected) never touches the batch.
VOTES_TABLE = """
CREATE TABLE IF NOT EXISTS votes (
    batch_id BLOB NOT NULL,
    worker TEXT NOT NULL,                      -- the announcer the vote is on (counts only if the signer)
    validator TEXT NOT NULL,
    accept INTEGER NOT NULL,
    reason TEXT NOT NULL,
    rewards BLOB NOT NULL,
    received_ms INTEGER NOT NULL,
    PRIMARY KEY (batch_id, worker, validator)
)
"""
VOTES_INDEX = "CREATE INDEX IF NOT EXISTS votes_by_time ON votes(received_ms)"

SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    batch_id BLOB PRIMARY KEY,                 -- sha256 of the signed batch: one signer per id ...
    worker TEXT NOT NULL,                      -- ... its signer (= announcer: rows are written only then)
    policy_version INTEGER NOT NULL,
    batch_counter INTEGER NOT NULL,
    num_samples INTEGER NOT NULL,
    envelope BLOB,
    status TEXT NOT NULL DEFAULT 'pending',   -- pending | admitted | rejected
    reason TEXT NOT NULL DEFAULT '',
    rewards BLOB,                              -- msgpack list of floats (agreeing validators' median)
    admitted_ms INTEGER,
    trained_step INTEGER,                      -- step that consumed it (NULL = not yet)
    seen_ms INTEGER                            -- when the row was written (a committee's clock starts)
);
CREATE UNIQUE INDEX IF NOT EXISTS admitted_chain_slot
    ON batches(worker, batch_counter) WHERE status = 'admitted';
CREATE INDEX IF NOT EXISTS batches_by_status ON batches(status);
CREATE INDEX IF NOT EXISTS batches_by_chain_slot ON batches(worker, batch_counter);
CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
-- per worker: counters 0 .. head-1 all have a batch row (or had: retention may delete a
-- rejected row, never the fact that its counter was used)
CREATE TABLE IF NOT EXISTS chains (worker TEXT PRIMARY KEY, head INTEGER NOT NULL);
"""
SCHEMA += VOTES_TABLE + ";\n" + VOTES_INDEX + ";\n"


@dataclasses.dataclass(frozen=True)
class AdmittedBatch:
    batch_id: bytes
    worker: str
    policy_version: int
    batch_counter: int
    envelope: bytes
    rewards: list[float]


@dataclasses.dataclass(frozen=True)
class BatchRecord:
    """What the ledger holds on one batch: the decision (``status``: pending, admitted or
    rejected, with its ``reason``) and the signed bytes, if still held."""

    batch_id: bytes
    worker: str
    policy_version: int
    batch_counter: int
    status: str
    reason: str
    envelope: bytes | None
    trained_step: int | None = None  # the committed version a step trained it into (None: untrained)


@dataclasses.dataclass(frozen=True)
class VoteRecord:
    """One genesis validator's vote on a batch, as the ledger recorded it."""

    validator: str
    accept: bool
    reason: str
    worker: str = ""  # the announcer the vote is on


# Retention defaults (see the module docstring; the trainer reads overrides from the run config).
MAX_PENDING = 256
MAX_PENDING_BYTES = 1 << 30
MAX_UNADMITTED_ROWS = 100_000
ORPHAN_VOTE_TTL_S = 3600.0
# Genesis [config] reward_agreement: how far (absolute, per sample) the rewards of the
# validators that admit a batch may differ. Rules are deterministic unless a sandboxed test
# times out, so honest validators agree exactly; the slack only absorbs float rounding.
REWARD_AGREEMENT = 1e-6

# (worker, policy version, batch counter) -> the batch's validator order (protocol/committee.py),
# or None where the version's manifest is unknown (then every validator is on the committee).
OrderOf = Callable[[str, int, int], "tuple[str, ...] | None"]

# Why an admitted batch was never trained on (ledger.discarded() counts them by reason).
STALE_BEFORE_TRAINING = "stale before training"  # it fell out of the max_async window while queued
NO_POLICY_WEIGHTS = "generating policy weights unavailable"  # its old log-probs cannot be computed

# A row was admitted at some point (admitted, or aged out of the window before training):
# such rows and their bytes are never deleted.
_EVER_ADMITTED = "admitted_ms IS NOT NULL"


class Ledger:
    def __init__(
        self,
        path: Path | str,
        validators: Sequence[str],
        quorum: int,
        max_async: int,
        *,
        max_pending: int = MAX_PENDING,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        max_unadmitted_rows: int = MAX_UNADMITTED_ROWS,
        orphan_vote_ttl_s: float = ORPHAN_VOTE_TTL_S,
        reward_agreement: float = REWARD_AGREEMENT,
        committee_size: int = 0,
        committee_deadline_s: float = 60.0,
        order_of: OrderOf | None = None,
    ) -> None:
        if not reward_agreement >= 0:
            raise ValueError(f"reward_agreement must be >= 0, got {reward_agreement!r}")
        self.validators = frozenset(validators)
        self.quorum = quorum
        # who decides a batch: protocol/committee.py (size 0: every validator, the rule before committees)
        self.rule = CommitteeRule(committee_size, quorum, committee_deadline_s, reward_agreement)
        self.order_of = order_of
        self.max_async = max_async
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.max_unadmitted_rows = max_unadmitted_rows
        self.orphan_vote_ttl_s = orphan_vote_ttl_s
        self.reward_agreement = reward_agreement
        self.evicted = 0  # pending envelopes dropped to stay under the caps (since start)
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)
        self._migrate_votes()
        if "seen_ms" not in {row[1] for row in self.db.execute("PRAGMA table_info(batches)")}:
            self.db.execute("ALTER TABLE batches ADD COLUMN seen_ms INTEGER")  # ledgers from before committees

    @property
    def committees(self) -> bool:
        """Whether batches are decided by committees smaller than the validator set."""
        return not self.rule.everyone(len(self.validators))

    def _migrate_votes(self) -> None:
        """Ledgers from before votes named their batch's worker: each vote is given the worker
        of the batch row it is on (the only announcer whose votes were ever acted on); votes on
        no row (orphans) get none, so they never count, and retention deletes them."""
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(votes)")}
        if "worker" in columns:
            return
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute("ALTER TABLE votes RENAME TO votes_v1")  # its index goes with it
            self.db.execute(VOTES_TABLE)
            self.db.execute(
                "INSERT INTO votes(batch_id, worker, validator, accept, reason, rewards, received_ms) "
                "SELECT v.batch_id, COALESCE(b.worker, ''), v.validator, v.accept, v.reason, v.rewards, v.received_ms "
                "FROM votes_v1 v LEFT JOIN batches b ON b.batch_id = v.batch_id"
            )
            self.db.execute("DROP TABLE votes_v1")
            self.db.execute(VOTES_INDEX)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self.db.close()

    # ---------------------------------------------------------------- state
    def get_state(self, key: str, default: int = 0) -> int:
        row = self.db.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def set_state(self, key: str, value: int) -> None:
        self.db.execute(
            "INSERT INTO state(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value = ?", (key, value, value)
        )

    @property
    def policy_version(self) -> int:
        return self.get_state("policy_version", 0)

    # --------------------------------------------------------------- inputs
    def record_batch(
        self,
        batch_id: bytes,
        worker: str,
        policy_version: int,
        batch_counter: int,
        num_samples: int,
        envelope: bytes | None,
    ) -> None:
        """Remember an announced batch (and its bytes once fetched). Only a pending batch takes
        bytes: a decided one keeps what it has (a rejected batch fetched again stores nothing).
        Storing bytes may evict the envelopes of older pending batches (see the module docstring).
        ``worker`` must be the batch's signer (the caller checked the bytes,
        ``protocol.open_announced_batch``); a row never changes hands: bytes offered under
        another worker than the row's are ignored."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute(
                "INSERT INTO batches(batch_id, worker, policy_version, batch_counter, num_samples, envelope, seen_ms) "
                "VALUES(?, ?, ?, ?, ?, ?, ?) ON CONFLICT(batch_id) DO UPDATE SET envelope = CASE "
                "WHEN batches.status = 'pending' THEN COALESCE(batches.envelope, excluded.envelope) "
                "ELSE batches.envelope END WHERE batches.worker = excluded.worker",
                (batch_id, worker, policy_version, batch_counter, num_samples, envelope, now_ms()),
            )
            self._advance_chain(worker)
            if envelope is not None:
                self._evict_pending(keep=batch_id)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def _advance_chain(self, worker: str) -> None:
        """Move ``worker``'s chain head past every counter now held (inside the caller's transaction)."""
        row = self.db.execute("SELECT head FROM chains WHERE worker = ?", (worker,)).fetchone()
        head = start = row[0] if row else 0
        while self.db.execute(
            "SELECT 1 FROM batches WHERE worker = ? AND batch_counter = ? LIMIT 1", (worker, head)
        ).fetchone():
            head += 1
        if head != start:
            self.db.execute(
                "INSERT INTO chains(worker, head) VALUES(?, ?) ON CONFLICT(worker) DO UPDATE SET head = excluded.head",
                (worker, head),
            )

    def chain_head(self, worker: str) -> int:
        """How many of ``worker``'s counters, from 0, the ledger holds a batch for."""
        row = self.db.execute("SELECT head FROM chains WHERE worker = ?", (worker,)).fetchone()
        return row[0] if row else 0

    def _evict_pending(self, keep: bytes) -> None:
        """Drop envelopes of pending batches (not ``keep``) until the caps hold: batches no
        validator has accepted yet go first, oldest first."""
        n, size = self.db.execute(
            "SELECT COUNT(*), COALESCE(SUM(length(envelope)), 0) FROM batches "
            "WHERE status = 'pending' AND envelope IS NOT NULL"
        ).fetchone()
        if n <= self.max_pending and size <= self.max_pending_bytes:
            return
        victims = self.db.execute(
            "SELECT b.batch_id, length(b.envelope), "
            "EXISTS(SELECT 1 FROM votes v WHERE v.batch_id = b.batch_id AND v.worker = b.worker AND v.accept = 1) "
            "AS vouched "
            "FROM batches b WHERE b.status = 'pending' AND b.envelope IS NOT NULL AND b.batch_id != ? "
            "ORDER BY vouched, b.rowid",
            (keep,),
        ).fetchall()
        for batch_id, length, _vouched in victims:
            if n <= self.max_pending and size <= self.max_pending_bytes:
                break
            self.db.execute("UPDATE batches SET envelope = NULL WHERE batch_id = ?", (batch_id,))
            n, size = n - 1, size - length
            self.evicted += 1

    def bytes_wanted(self, batch_id: bytes) -> tuple[str, int, int, int] | None:
        """(worker, policy version, batch counter, samples) of a pending batch that an agreeing
        quorum of validators accepts but whose bytes are not held (evicted): fetch it again. Else None."""
        row = self.db.execute(
            "SELECT worker, policy_version, batch_counter, num_samples FROM batches "
            "WHERE batch_id = ? AND status = 'pending' AND envelope IS NULL",
            (batch_id,),
        ).fetchone()
        if row is None:
            return None
        if self._decision(batch_id, row[0], row[1], row[2], row[3]).outcome is not Quorum.ACCEPTED:
            return None
        if is_stale(row[1], self.policy_version, self.max_async):
            return None
        return row

    def owner(self, batch_id: bytes) -> str | None:
        """The worker (signer) of the batch the ledger holds under ``batch_id``, or None."""
        row = self.db.execute("SELECT worker FROM batches WHERE batch_id = ?", (batch_id,)).fetchone()
        return None if row is None else str(row[0])

    def needs_fetch(self, batch_id: bytes) -> bool:
        """Whether fetching this batch could still matter: unknown, or pending without bytes."""
        row = self.db.execute("SELECT status, envelope IS NULL FROM batches WHERE batch_id = ?", (batch_id,)).fetchone()
        return row is None or (row[0] == "pending" and bool(row[1]))

    def record_vote(
        self,
        batch_id: bytes,
        validator: str,
        accept: bool,
        reason: str,
        rewards: Sequence[float],
        *,
        worker: str,
    ) -> bool:
        """Store a vote from a genesis validator on ``worker``'s announce of ``batch_id`` (the
        vote's ``worker`` field); returns False if the voter is not a genesis validator
        (ignored). The vote counts for the batch only if ``worker`` is its signer: a vote on
        another peer's announce of the same id is about a batch that does not exist."""
        if validator not in self.validators:
            return False
        self.db.execute(
            "INSERT OR IGNORE INTO votes(batch_id, worker, validator, accept, reason, rewards, received_ms) "
            "VALUES(?, ?, ?, ?, ?, ?, ?)",
            (batch_id, worker, validator, int(accept), reason, msgpack.packb(list(rewards)), now_ms()),
        )
        return True

    # ------------------------------------------------------------ decisions
    def try_admit(self, batch_id: bytes, now: int | None = None) -> str:
        """Decide a pending batch (as of ``now``, wall-clock ms: a committee's reach grows with
        time). Returns its status: pending, admitted or rejected.

        The rule is ``protocol.admission``: this gathers the facts it needs from the ledger
        (in one transaction, so the slot a batch is admitted to cannot be taken meanwhile) and
        writes its ruling. The decision and everything it rests on are committed before
        returning.
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
        self.db.execute("BEGIN IMMEDIATE")
        try:
            d = self._decision(batch_id, worker, version, counter, n, now)
            ruling = self._ruling(batch_id, worker, version, counter, n, envelope is not None, d)
            status = self._apply(batch_id, n, ruling, d)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return status

    def _ruling(
        self, batch_id: bytes, worker: str, version: int, counter: int, n: int, have_bytes: bool, d: Decision
    ) -> Ruling:
        """``protocol.admission`` on the facts the ledger holds (``d``: the votes' decision)."""
        first_reject = ""
        if d.outcome is Quorum.REJECTED and self.rule.rejected_by_votes(len(d.rejects), len(self.validators)):
            first = self.db.execute(
                "SELECT validator, reason FROM votes WHERE batch_id = ? AND worker = ? AND accept = 0 "
                "ORDER BY received_ms, rowid",
                (batch_id, worker),
            ).fetchall()
            first_reject = next(r for v, r in first if v in d.rejects)
        # the slot is taken by a batch admitted before (also one that aged out untrained since)
        holder = self.db.execute(
            f"SELECT batch_id FROM batches WHERE worker = ? AND batch_counter = ? "
            f"AND batch_id != ? AND {_EVER_ADMITTED} LIMIT 1",
            (worker, counter, batch_id),
        ).fetchone()
        facts = BatchFacts(
            worker=worker,
            version=version,
            counter=counter,
            num_samples=n,
            policy_version=self.policy_version,
            max_async=self.max_async,
            chain_head=self.chain_head(worker),
            previous_version=self._previous_version(worker, counter),
            have_bytes=have_bytes,
            slot_holder=holder[0] if holder else None,
        )
        accepted = self._accept_rewards(batch_id, worker)
        return admission(facts, d, self.rule, len(self.validators), accepted, first_reject, self.committees)

    def _apply(self, batch_id: bytes, n: int, ruling: Ruling, d: Decision) -> str:
        """Write ``ruling`` on the pending batch; its status."""
        if ruling.why in ("disagreement", "disagreeing"):  # logged, with who disagrees
            return self._disagreement(batch_id, n, d, reject=ruling.why == "disagreement")
        if ruling.status == "rejected":
            return self._reject(batch_id, ruling.reason)
        if ruling.status == "pending":
            if ruling.reason:
                self._note_pending(batch_id, ruling.reason)
            return "pending"
        self.db.execute(
            "UPDATE batches SET status = 'admitted', rewards = ?, admitted_ms = ? WHERE batch_id = ?",
            (msgpack.packb(list(ruling.rewards)), now_ms(), batch_id),
        )
        return "admitted"

    def _previous_version(self, worker: str, counter: int) -> int | None:
        """The newest version of ``worker``'s batches at ``counter - 1`` (None: counter 0, or
        that row was deleted by retention)."""
        if counter == 0:
            return None
        row = self.db.execute(
            "SELECT MAX(policy_version) FROM batches WHERE worker = ? AND batch_counter = ?", (worker, counter - 1)
        ).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def waiting_after(self, worker: str, counter: int) -> list[bytes]:
        """Pending batches of ``worker`` with a counter above ``counter``, lowest first: the
        ones a newly recorded batch at ``counter`` may unblock (a held counter is held whatever
        the batch's outcome: it was announced and fetched, which is all the chain asks)."""
        rows = self.db.execute(
            "SELECT batch_id FROM batches WHERE worker = ? AND batch_counter > ? "
            "AND status = 'pending' ORDER BY batch_counter",
            (worker, counter),
        )
        return [b for (b,) in rows]

    def _note_pending(self, batch_id: bytes, reason: str) -> None:
        """Say why a batch is still pending (shown by ``primenode status``), written only when it changes."""
        self.db.execute(
            "UPDATE batches SET reason = ? WHERE batch_id = ? AND status = 'pending' AND reason != ?",
            (reason, batch_id, reason),
        )

    def _accept_rewards(self, batch_id: bytes, worker: str) -> dict[str, list[float]]:
        """The rewards each genesis validator that accepts ``worker``'s batch recomputed."""
        rows = self.db.execute(
            "SELECT validator, rewards FROM votes WHERE batch_id = ? AND worker = ? AND accept = 1", (batch_id, worker)
        )
        return {v: msgpack.unpackb(r) for v, r in rows if v in self.validators}

    def _decision(
        self, batch_id: bytes, worker: str, version: int, counter: int, num_samples: int, now: int | None = None
    ) -> Decision:
        """Where the votes on ``worker``'s batch stand under the run's committee rule
        (``protocol/committee.py``): its validator order, and the time since the ledger first
        saw the batch or a vote on it (whichever came first) for members that stay silent."""
        rows = self.db.execute(
            "SELECT validator, accept, rewards, received_ms FROM votes WHERE batch_id = ? AND worker = ?",
            (batch_id, worker),
        ).fetchall()
        ballots = {v: Ballot(bool(a), tuple(msgpack.unpackb(r))) for v, a, r, _ in rows if v in self.validators}
        order = self.order_of(worker, version, counter) if self.order_of is not None and self.committees else None
        if order is None:
            order = tuple(sorted(self.validators))
            rule = dataclasses.replace(self.rule, size=0)  # no draw possible: every validator
        else:
            rule = self.rule
        seen = self.db.execute("SELECT seen_ms FROM batches WHERE batch_id = ?", (batch_id,)).fetchone()
        starts = [t for _, _, _, t in rows] + ([seen[0]] if seen and seen[0] is not None else [])
        now = now_ms() if now is None else now
        elapsed_s = max(0.0, (now - min(starts)) / 1000) if starts else 0.0
        return rule.outcome(order, ballots, elapsed_s, num_samples)

    def _disagreement(self, batch_id: bytes, num_samples: int, d: Decision, *, reject: bool) -> str:
        """No quorum of accepting validators agrees on the rewards (yet). While validators not
        yet voted (or not yet called on) could still complete one, the batch waits (logged);
        else it is rejected."""
        accepted = {v: r for v, r in self._accept_rewards_of(batch_id).items() if v in d.accepts}
        missized = sorted(v for v, r in accepted.items() if len(r) != num_samples)
        if not reject:
            log.warning(
                "batch %s: %d validators accept it but their rewards disagree (no %d agree within %g; "
                "largest agreeing set %s; accepting %s%s); waiting for more votes",
                batch_id.hex()[:12],
                len(accepted),
                self.quorum,
                self.reward_agreement,
                sorted(d.agreeing),
                sorted(accepted),
                f"; wrong reward count from {missized}" if missized else "",
            )
            return "pending"
        unvoted = len(self.validators) - len(d.accepts) - len(d.rejects)
        reason = (
            f"validators' rewards disagree: no {self.quorum} genesis validators accept it with rewards that agree "
            f"within {self.reward_agreement:g} per sample (accepting {sorted(accepted)}, largest agreeing set "
            f"{sorted(d.agreeing)}, {unvoted} not voted)"
        )
        if missized:
            reason += f"; reward lists that do not match the batch size ({num_samples} samples) from {missized}"
        log.warning("batch %s rejected: %s", batch_id.hex()[:12], reason)
        return self._reject(batch_id, reason)

    def _accept_rewards_of(self, batch_id: bytes) -> dict[str, list[float]]:
        """The rewards of every accepting genesis validator's vote on the batch's signer's announce."""
        worker = self.owner(batch_id)
        return {} if worker is None else self._accept_rewards(batch_id, worker)

    def _reject(self, batch_id: bytes, reason: str) -> str:
        # only ever called on pending rows: never admitted, so the bytes go (the row stays)
        self.db.execute(
            "UPDATE batches SET status = 'rejected', reason = ?, envelope = NULL WHERE batch_id = ?", (reason, batch_id)
        )
        return "rejected"

    # ------------------------------------------------------------ retention
    def prune(self, now: int | None = None) -> dict[str, int]:
        """Apply the retention rules (module docstring) as of ``now`` (wall-clock ms). Never touches
        a batch that was ever admitted. Its queries use the status index and a moving window over the
        votes, so its cost follows the rows not admitted, not the ledger's size. Returns what it did."""
        now = now_ms() if now is None else now
        unadmitted = f"status IN ('pending', 'rejected') AND envelope IS NULL AND NOT ({_EVER_ADMITTED})"
        out = {}
        self.db.execute("BEGIN IMMEDIATE")
        try:
            out["stale"] = self.db.execute(
                "UPDATE batches SET status = 'rejected', envelope = NULL, reason = ? "
                "WHERE status = 'pending' AND policy_version < ?",
                (
                    f"stale: fell out of the max_async window ({self.max_async}) while pending",
                    window_floor(self.policy_version, self.max_async),
                ),
            ).rowcount
            # rows rejected before this policy existed (older ledgers) lose their bytes too
            out["bytes_dropped"] = self.db.execute(
                f"UPDATE batches SET envelope = NULL WHERE status = 'rejected' AND envelope IS NOT NULL "
                f"AND NOT ({_EVER_ADMITTED})"
            ).rowcount
            excess = (
                self.db.execute(f"SELECT COUNT(*) FROM batches WHERE {unadmitted}").fetchone()[0]
                - self.max_unadmitted_rows
            )
            out["rows_deleted"] = 0
            if excess > 0:
                gone = [
                    (r[0],)
                    for r in self.db.execute(
                        f"SELECT batch_id FROM batches WHERE {unadmitted} ORDER BY rowid LIMIT ?", (excess,)
                    )
                ]
                self.db.executemany("DELETE FROM votes WHERE batch_id = ?", gone)
                self.db.executemany("DELETE FROM batches WHERE batch_id = ?", gone)
                out["rows_deleted"] = len(gone)
            # votes for batches never recorded (or on another announcer's copy of a recorded id),
            # older than the TTL; each vote is looked at once
            cutoff = now - int(self.orphan_vote_ttl_s * 1000)
            since = self.get_state("orphan_votes_checked_ms", 0)
            out["orphan_votes_deleted"] = self.db.execute(
                "DELETE FROM votes WHERE received_ms >= ? AND received_ms < ? "
                "AND NOT EXISTS (SELECT 1 FROM batches b WHERE b.batch_id = votes.batch_id AND b.worker = votes.worker)",
                (since, cutoff),
            ).rowcount
            if cutoff > since:
                self.set_state("orphan_votes_checked_ms", cutoff)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return out

    def storage(self) -> dict[str, int]:
        """Rows and stored envelope bytes, by kind (for status and tests)."""

        def one(where: str) -> tuple[int, int]:
            return self.db.execute(
                f"SELECT COUNT(*), COALESCE(SUM(length(envelope)), 0) FROM batches WHERE {where}"
            ).fetchone()

        pending, pending_bytes = one("status = 'pending' AND envelope IS NOT NULL")
        unadmitted, unadmitted_bytes = one(f"status = 'rejected' AND NOT ({_EVER_ADMITTED})")
        return {
            "pending_with_bytes": pending,
            "pending_bytes": pending_bytes,
            "pending_without_bytes": one("status = 'pending' AND envelope IS NULL")[0],
            "rejected_rows": unadmitted,
            "rejected_bytes": unadmitted_bytes,
            "votes": self.db.execute("SELECT COUNT(*) FROM votes").fetchone()[0],
            "evicted": self.evicted,
        }

    # ------------------------------------------------------------- training
    def untrained(self, limit: int | None = None, *, oldest_first: bool = False) -> list[AdmittedBatch]:
        """Admitted batches no step has consumed yet, freshest policy first, or with
        ``oldest_first`` the ones closest to falling out of the window first (the trainer's
        order: a step takes them all up to its token budget, so nothing ages out while fresher
        batches wait)."""
        order = (
            "policy_version, admitted_ms, batch_id" if oldest_first else "policy_version DESC, admitted_ms, batch_id"
        )
        q = (
            "SELECT batch_id, worker, policy_version, batch_counter, envelope, rewards FROM batches "
            f"WHERE status = 'admitted' AND trained_step IS NULL ORDER BY {order}"
        )
        if limit is not None:
            q += f" LIMIT {int(limit)}"
        return [AdmittedBatch(b, w, v, c, e, msgpack.unpackb(r)) for b, w, v, c, e, r in self.db.execute(q)]

    def drop_stale(self) -> int:
        """Admitted-but-untrained batches that fell out of the window: never trained on."""
        cur = self.db.execute(
            "UPDATE batches SET status = 'rejected', reason = ? "
            "WHERE status = 'admitted' AND trained_step IS NULL AND policy_version < ?",
            (STALE_BEFORE_TRAINING, window_floor(self.policy_version, self.max_async)),
        )
        return cur.rowcount

    def discard(self, batch_ids: Iterable[bytes], reason: str) -> int:
        """Admitted-but-untrained batches the trainer cannot train on (``reason``): they keep
        their bytes and their admission record, like batches that aged out."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            n = 0
            for b in batch_ids:
                n += self.db.execute(
                    "UPDATE batches SET status = 'rejected', reason = ? "
                    "WHERE batch_id = ? AND status = 'admitted' AND trained_step IS NULL",
                    (reason, b),
                ).rowcount
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return n

    def discarded(self) -> dict[str, int]:
        """Batches admitted and then never trained on, by reason (the trainer's waste)."""
        rows = self.db.execute(
            f"SELECT reason, COUNT(*) FROM batches WHERE status = 'rejected' AND {_EVER_ADMITTED} GROUP BY reason"
        )
        return {reason: n for reason, n in rows}

    def mark_trained(self, batch_ids: Iterable[bytes], step: int) -> None:
        """Batches a step consumed without changing the policy (every group filtered out): they
        are used up at the current version, no checkpoint is involved."""
        self.db.execute("BEGIN IMMEDIATE")
        self.db.executemany("UPDATE batches SET trained_step = ? WHERE batch_id = ?", [(step, b) for b in batch_ids])
        self.db.execute("COMMIT")

    def commit_step(self, batch_ids: Iterable[bytes], version: int) -> None:
        """The trainer's commit point: the training state of ``version`` is durably on disk, and
        ``batch_ids`` are the batches the step that made it trained on. In one transaction the
        batches become trained and ``version`` becomes the resume point, so after a crash
        either both happened or neither did: a batch is trained into exactly one committed
        version, and a state folder newer than the commit is known to be uncommitted."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.executemany(
                "UPDATE batches SET trained_step = ? WHERE batch_id = ? AND trained_step IS NULL",
                [(version, b) for b in batch_ids],
            )
            self.set_state("checkpoint_step", version)
            self.set_state("policy_version", version)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def commit_checkpoint(self, step: int, policy_version: int) -> None:
        """A checkpoint for ``step`` is safely on disk: make it the resume point."""
        self.db.execute("BEGIN IMMEDIATE")
        self.set_state("checkpoint_step", step)
        self.set_state("policy_version", policy_version)
        self.db.execute("COMMIT")

    def committed_version(self) -> int | None:
        """The version of the last committed training state, or None if none was ever committed
        (a new ledger)."""
        row = self.db.execute("SELECT value FROM state WHERE key = 'checkpoint_step'").fetchone()
        return None if row is None else int(row[0])

    def recover(self) -> int:
        """After a crash: batches consumed by steps newer than the last checkpoint go back
        to the queue. Returns how many were restored. (Ledgers written by :meth:`commit_step`
        never hold such rows; older ones, which marked batches before saving, may.)"""
        step = self.get_state("checkpoint_step", 0)
        cur = self.db.execute("UPDATE batches SET trained_step = NULL WHERE trained_step > ?", (step,))
        return cur.rowcount

    def pending_ids(self) -> list[bytes]:
        """Batches still undecided, oldest first: after a restart each is decided again (its
        votes may all have arrived before a crash cut the decision off)."""
        return [r[0] for r in self.db.execute("SELECT batch_id FROM batches WHERE status = 'pending' ORDER BY rowid")]

    # ---------------------------------------------------------------- stats
    def counts(self) -> dict[str, int]:
        out = {"pending": 0, "admitted": 0, "rejected": 0, "trained": 0}
        for status, n in self.db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status"):
            out[status] = n
        out["trained"] = self.db.execute("SELECT COUNT(*) FROM batches WHERE trained_step IS NOT NULL").fetchone()[0]
        out["buffer"] = self.db.execute(
            "SELECT COUNT(*) FROM batches WHERE status = 'admitted' AND trained_step IS NULL"
        ).fetchone()[0]
        return out

    def batch(self, batch_id: bytes) -> BatchRecord | None:
        """The ledger's record of one batch, or None if it holds none."""
        row = self.db.execute(
            "SELECT batch_id, worker, policy_version, batch_counter, status, reason, envelope, trained_step "
            "FROM batches WHERE batch_id = ?",
            (batch_id,),
        ).fetchone()
        return BatchRecord(*row) if row is not None else None

    def records(
        self, *, worker: str | None = None, status: str | None = None, ever_admitted: bool = False
    ) -> list[BatchRecord]:
        """Every batch the ledger holds, optionally only one ``worker``'s, only those with
        ``status``, or only those ``ever_admitted`` (admitted now or aged out after admission),
        in arrival order: the read seam for audits and tests (no SQL outside this module)."""
        where, args = [], []
        if worker is not None:
            where.append("worker = ?")
            args.append(worker)
        if status is not None:
            where.append("status = ?")
            args.append(status)
        if ever_admitted:
            where.append(_EVER_ADMITTED)
        sql = "SELECT batch_id, worker, policy_version, batch_counter, status, reason, envelope, trained_step FROM batches"
        if where:
            sql += " WHERE " + " AND ".join(where)
        return [BatchRecord(*row) for row in self.db.execute(sql + " ORDER BY rowid", args)]

    def votes(self, batch_id: bytes, worker: str | None = None) -> list[VoteRecord]:
        """The votes recorded on ``worker``'s announce of ``batch_id`` (recorded before the batch
        itself, too), oldest first; with no ``worker``, on every announce of that id."""
        sql = "SELECT validator, accept, reason, worker FROM votes WHERE batch_id = ?"
        args: list[object] = [batch_id]
        if worker is not None:
            sql += " AND worker = ?"
            args.append(worker)
        rows = self.db.execute(sql + " ORDER BY received_ms, rowid", args)
        return [VoteRecord(v, bool(a), r, w) for v, a, r, w in rows]

    def admitted_ids(self) -> set[bytes]:
        return {r[0] for r in self.db.execute("SELECT batch_id FROM batches WHERE status = 'admitted'")}

    def accept_voters(self, batch_id: bytes) -> set[str]:
        """The validators that accept the batch held under ``batch_id`` (votes on its signer's announce)."""
        return {
            r[0]
            for r in self.db.execute(
                "SELECT v.validator FROM votes v JOIN batches b ON b.batch_id = v.batch_id AND b.worker = v.worker "
                "WHERE v.batch_id = ? AND v.accept = 1",
                (batch_id,),
            )
        }
