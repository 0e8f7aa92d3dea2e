"""Honest side of bench/hostile.py: one OS process (a *shard*) running some of the honest nodes.

``python bench/hostile.py`` (the coordinator) starts, per scenario, a fresh honest
network: ``--honest-procs`` shard processes (default one per honest node), each
``python bench/hostile.py --honest-child --workdir W --shard i``. Node ``i`` lives
in shard ``i % procs``. They agree on everything through the seed and files in the
scenario's work directory ``W`` (the pattern of bench/gossip_procs.py):

1. ``config.json`` (coordinator): scenario, node count, timings, seed, genesis time;
2. shard 0 starts node 0 (bootstrap, the run's trainer, the probe publisher) and
   writes ``bootstrap.json``; every shard starts its nodes, waits until each of them
   hears every other node's heartbeat and has gossip links (scenario ``chunks``:
   until each also holds checkpoint v0), and writes ``ready-i.json``;
3. the coordinator writes ``plan.json`` (warm-up and quiet windows, wall clock) and,
   once the attackers run, ``attack.json`` (the attack window); node 0 publishes
   ``--honest-rate`` announcements per second in each window, each of a real, signed
   one-sample rollout batch that node 0 serves on request (``batch_id`` = sha256 of
   the batch envelope, so validators can fetch it); at the end it writes ``sent.json``
   (batch id -> send time, phase);
4. every other node records the first arrival of each; scenario ``unserved``: the
   ``--fetchers`` nodes run the validator's real announce intake and fetch loops
   (``ValidatorRole._on_announce`` / ``_fetch_loop``: per-announcer cap, bounded
   queue, 30 s fetch deadline, ``charge_unserved``) and record each batch fetched;
   scenario ``chunks``: every node runs the checkpoint distribution and node 0
   publishes v1 at the start of the attack window; scenario ``garbage``: the
   run is the tiny model's (``garbage_genesis``), node 0 publishes its v0 weights and,
   instead of the probe announcements, produces one real batch (``produce_batch``:
   seeded sampling, TOPLOC proofs) every ``batch_interval_s`` and announces it, and
   node 1 is a real ``ValidatorRole`` (the genesis validator) that fetches, checks and
   votes on every announced batch; it records when it voted on each of node 0's;
5. after the attack window each shard drains (until its nodes hold every honest
   message, every fetcher fetched every honest batch and every node holds v1, or the
   drain deadline; ``garbage``: until the validator voted on every honest
   batch), writes ``result-i.json`` (arrivals, votes, counters before the attack and
   at the end, RSS samples, exceptions logged) and serves until ``stop`` appears.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import random
import time
import types
from pathlib import Path

import trio

from harness.genesis import GARBAGE_VALIDATOR, bench_genesis, garbage_genesis
from node.util import now_ms
from protocol import (
    BatchRequest,
    BatchResponse,
    CheckpointAnnounce,
    NodeKey,
    RolloutAnnounce,
    RolloutBatch,
    Sample,
    SamplingParams,
    seal,
    sha256,
)

POLL = 0.05
CKPT_BYTES = 512 * 1024  # a small checkpoint: 32 chunks of 16 KiB
CKPT_CHUNK = 16 * 1024


def seeded_keys(seed: str, n: int) -> list[NodeKey]:
    rng = random.Random(f"hostile-bench-keys/{seed}")
    return [NodeKey(rng.randbytes(32)) for _ in range(n)]


def proc_mem_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MiB."""
    rss = hwm = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024
    return rss, hwm


async def wait_file(path: Path, timeout: float) -> str:
    with trio.fail_after(timeout):
        while not path.exists():
            await trio.sleep(POLL)
    return path.read_text()


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.rename(path)


async def sleep_until_wall(t: float) -> None:
    await trio.sleep(max(0.0, t - time.time()))


class ExceptionLog(logging.Handler):
    """Counts what escaped a handler: records of the project's loggers at ERROR or above that
    carry a traceback (``log.exception`` in gossip dispatch and validation, request handlers,
    the heartbeat loop, ...). libp2p's own ERROR records are counted apart (not ours)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.exceptions = 0
        self.errors = 0
        self.libp2p_errors = 0
        self.samples: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "node" or record.name.startswith("node."):
            if record.exc_info:
                self.exceptions += 1
                if len(self.samples) < 5:
                    exc = record.exc_info[1]
                    self.samples.append(
                        f"{record.name}: {record.getMessage()[:120]}: {type(exc).__name__}: {exc}"[:300]
                    )
            else:
                self.errors += 1
        else:
            self.libp2p_errors += 1


# ===================================================================== roles of the honest nodes


def make_batch(node, counter: int) -> tuple[bytes, RolloutAnnounce]:
    """A real, signed one-sample rollout batch of ``node`` and its announcement."""
    batch = RolloutBatch(
        run_id=node.run_id,
        worker=node.peer_id,
        policy_version=0,
        batch_counter=counter,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_tokens=4),
        samples=(
            Sample(
                prompt_index=0, completion=counter.to_bytes(4, "little"), seed=counter, proof=b"", claimed_reward=0.0
            ),
        ),
        created_ms=now_ms(),
    )
    raw = seal(node.key, node.run_id, batch, now_ms(), node.seq.next())
    return raw, RolloutAnnounce(
        batch_id=sha256(raw), policy_version=0, batch_counter=counter, num_samples=1, size_bytes=len(raw)
    )


def garbage_batch(ctx, worker: str, policy, counter: int, hidden_size: int, rnd: random.Random) -> RolloutBatch:
    """A batch of ``worker`` that breaks only rules a prefill checks (scenario ``garbage``):
    the owed prompts at its counter, ``group_size`` completions each of ``max_tokens``
    random tokens and no EOS (a proper ending, and the longest prefill the rules allow), and
    random proof bytes of exactly the length the shape implies, so every rule that needs no
    model passes (``rollouts.check_batch_rules``) and the validator must prefill a group to
    reject it."""
    from node.roles.rollouts import owed_prompts
    from protocol.proof_layout import TOPK, chunk_rows, proof_size

    g = ctx.genesis
    eos, vocab, max_tokens = ctx.eos_token_id, ctx.vocab_size, ctx.sampling.max_tokens
    samples = []
    for i in owed_prompts(ctx, worker, counter):
        prompt_len = len(ctx.prompt_tokens(i))
        for _ in range(g.group_size):
            toks = [rnd.randrange(vocab) for _ in range(max_tokens)]
            toks = [t if t != eos else (t + 1) % vocab for t in toks]
            size = sum(proof_size(min(TOPK, rows * hidden_size)) for rows in chunk_rows(prompt_len, max_tokens))
            samples.append(
                Sample(
                    prompt_index=i,
                    completion=Sample.pack_tokens(toks),
                    seed=0,
                    proof=rnd.randbytes(size),
                    claimed_reward=0.0,
                )
            )
    return RolloutBatch(
        run_id=g.run_id,
        worker=worker,
        policy_version=policy.version,
        batch_counter=counter,
        sampling=ctx.sampling,
        samples=tuple(samples),
        created_ms=now_ms(),
    )


def make_validator_fetcher(node, on_fetched):
    """The validator's real announce intake and fetch loops, on ``node``; a fetched batch goes to
    ``on_fetched(announce envelope)`` instead of TOPLOC verification (no model in this bench)."""
    import inspect

    from node.roles.intake import AnnounceIntake, verify_queue
    from node.roles.validator import ValidatorRole

    defaults = inspect.signature(ValidatorRole.__init__).parameters

    class BenchValidator(ValidatorRole):
        # No LearningRole.__init__: no chunk store, run context or model. What
        # ValidatorRole._on_announce and _fetch_loop use is set here, with the validator's
        # own defaults (fetch tasks, queue bound); every batch's version (0) counts as held
        # and no manifest is known (no model-free rules to run), so a fetched batch goes
        # straight to the verify queue, which we drain (its announcer counts as proven from
        # then on, as if the batch had been accepted).
        def __init__(self) -> None:
            self.node = node
            self.ctx = types.SimpleNamespace(genesis=node.genesis)
            self.n_fetchers = defaults["fetchers"].default
            self.intake = AnnounceIntake(
                defaults["queue"].default, unproven_slots=max(1, self.n_fetchers // 2), on_evicted=self._unsee
            )
            self._verify = verify_queue()
            self.fetch_failures = 0
            self._seen = collections.OrderedDict()
            self._signers = collections.OrderedDict()
            self.stolen_announces = 0
            self.strikes = collections.Counter()
            self.ban_after = 2
            self._nursery = None
            self._standby = collections.OrderedDict()
            self.store = types.SimpleNamespace(versions={})
            self.weights = types.SimpleNamespace(held=lambda version: True)
            self.fetched = 0
            self.bad_batches = 0
            self.failures_by_code = collections.Counter()

        def charge_unserved(self, sender: str, exc: Exception) -> None:
            self.failures_by_code[getattr(exc, "code", type(exc).__name__)] += 1
            super().charge_unserved(sender, exc)

        def _stand_by(self, key, env) -> bool:  # no committees: this bench's validator takes every batch
            return False

        async def _vote(self, env, verdict) -> None:  # only reached for bytes that fail the checks
            self.bad_batches += 1

        async def run_fetchers(self, nursery: trio.Nursery) -> None:
            self._nursery = nursery
            node.gossip.on("rollout", self._on_announce)
            for _ in range(self.n_fetchers):
                nursery.start_soon(self._fetch_loop)
            nursery.start_soon(self._record)

        async def _record(self) -> None:
            while True:
                taken = await self._verify.get()
                env, _batch = taken.item
                self._verify.done(taken)
                self.fetched += 1
                self._verify.mark_proven(env.sender)
                on_fetched(env)

        def stats(self) -> dict:
            return {
                "fetched": self.fetched,
                "dropped_announces": self.dropped_announces,
                "fetch_failures": self.fetch_failures,
                "failures_by_code": dict(self.failures_by_code),
                "bad_batches": self.bad_batches,
                "queued": len(self.intake),
                "pending_announcers": len(self.intake.pending),
            }

    return BenchValidator()


def make_recording_validator(home_dir: Path, ctx, on_vote, *, fifo: bool = False):
    """A real ``ValidatorRole`` (scenario ``garbage``) that tells ``on_vote(env, verdict,
    enqueued)`` about each vote as it decides it (``enqueued``: when the batch entered the
    verify queue, None if it never did). ``fifo``: with the first-come verify channel (16 batches)
    the verify queue replaced, as a baseline (``--verify-queue fifo``)."""
    from node.home import NodeHome
    from node.roles.fair_queue import FairQueue, LaneRules
    from node.roles.validator import ValidatorRole

    class RecordingValidator(ValidatorRole):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.failures_by_code: collections.Counter[str] = collections.Counter()
            self.failure_samples: list[str] = []
            self.enqueued: dict[bytes, float] = {}

        async def _enqueue(self, env, batch) -> None:
            self.enqueued[env.body.batch_id] = time.time()
            while len(self.enqueued) > 10_000:
                del self.enqueued[next(iter(self.enqueued))]
            await super()._enqueue(env, batch)

        async def _vote(self, env, verdict) -> None:
            on_vote(env, verdict, self.enqueued.pop(env.body.batch_id, None))
            await super()._vote(env, verdict)

        def charge_unserved(self, sender: str, exc: Exception) -> None:
            self.failures_by_code[getattr(exc, "code", type(exc).__name__)] += 1
            if len(self.failure_samples) < 5:
                self.failure_samples.append(str(exc)[:200])
            super().charge_unserved(sender, exc)

    class FifoQueue(FairQueue):
        def proven(self, sender: str) -> bool:  # everyone in one first-come lane, put waits for room
            return True

    home_dir.mkdir(parents=True, exist_ok=True)
    v = RecordingValidator(NodeHome(home_dir), ctx)
    if fifo:
        v._verify = FifoQueue(LaneRules(16, "wait", "fifo"), LaneRules(1, "refuse"))
    return v


def validator_stats(v, node) -> dict:
    """What the real validator of ``garbage`` did, for the before/after snapshots."""
    return {
        "verdicts": dict(v.verdicts),
        "reasons": dict(v.reasons),
        "verify_queue": v._verify.status(),
        "dropped_batches": sum(v._verify.dropped.values()),
        "dropped_announces": v.dropped_announces,
        "fetch_failures": v.fetch_failures,
        "failures_by_code": dict(v.failures_by_code),
        "failure_samples": list(v.failure_samples),
        "banned": len(node.standing.banned()),
        "last_verify_s": v.verify_s,
    }


class BenchRole:
    """The hook of one honest node (a ``RoleHook``): node 0 serves its probe batches; in
    ``unserved`` the fetcher nodes run the validator's fetch path; in ``chunks`` every node
    runs the checkpoint distribution (node 0 is the trainer and publishes); in
    ``garbage`` node 0 publishes the tiny model's v0 and produces real batches, and
    node 1 runs a real validator."""

    def __init__(self, shard: Shard, idx: int) -> None:
        self.shard = shard
        self.idx = idx
        scen = shard.cfg["scenario"]
        self.fetcher = scen == "unserved" and 1 <= idx <= shard.cfg["fetchers"]
        self.garbage_validator = scen == "garbage" and idx == GARBAGE_VALIDATOR
        self.role = "trainer" if idx == 0 else ("validator" if self.fetcher or self.garbage_validator else "worker")
        self.checkpoints = None
        self.validator = None
        self.real_validator = None  # garbage, node 1
        self.engine = None  # garbage, node 0: produces the honest batches
        self.policy = None  # garbage, node 0: PolicyFacts of v0
        self.generating = trio.Lock()
        self.batches: dict[bytes, bytes] = {}
        self.served = 0
        self.dp_refused_full = 0
        self.dp_peak_connections = 0
        self.ready = trio.Event()

    # RoleHook interface
    def heartbeat_fields(self) -> dict:
        if self.real_validator is not None:
            return self.real_validator.heartbeat_fields()
        if self.checkpoints is None:
            return {}
        from node.roles.checkpoint_wiring import checkpoint_heartbeat_fields

        return checkpoint_heartbeat_fields(self.checkpoints)

    def status(self) -> dict:
        return {}

    async def run(self, node) -> None:
        async with trio.open_nursery() as nursery:
            if self.idx == 0:
                node.reqresp.register(BatchRequest, self._serve_batch)
            if self.shard.cfg["scenario"] == "chunks":
                await self._start_distribution(node, nursery)
            if self.shard.cfg["scenario"] == "garbage":
                if self.idx == 0:
                    await self._start_distribution(node, nursery)
                    await self._start_producing(node)
                elif self.garbage_validator:
                    await self._start_validator(node, nursery)
            if self.fetcher:
                self.validator = make_validator_fetcher(node, self.shard.on_fetched(self.idx))
                await self.validator.run_fetchers(nursery)
            self.ready.set()
            await trio.sleep_forever()

    def _serve_batch(self, env, peer: str) -> BatchResponse:
        raw = self.batches.get(env.body.batch_id)
        if raw is not None:
            self.served += 1
        return BatchResponse(found=raw is not None, envelope=raw or b"")

    async def _start_distribution(self, node, nursery: trio.Nursery) -> None:
        from node.checkpoints import Checkpoints, ChunkStore
        from node.roles.checkpoint_wiring import P2PControlPlane, serve_checkpoints

        root = self.shard.work / f"node-{self.idx}"
        store = ChunkStore(root / "chunks", node.run_id, node.genesis.trainer)
        self.checkpoints = Checkpoints(store, P2PControlPlane(node), max_async=node.genesis.max_async)
        server = self.checkpoints.server
        original = server._handle

        async def counting_handle(stream) -> None:  # data-plane connections refused at the global cap
            if server.connections >= server.max_connections:
                self.dp_refused_full += 1
            self.dp_peak_connections = max(self.dp_peak_connections, server.connections + 1)
            await original(stream)

        server._handle = counting_handle  # looked up when the listener starts
        await nursery.start(serve_checkpoints, node, self.checkpoints)
        if self.idx == 0:
            await self.publish_checkpoint(node, 0)
            nursery.start_soon(self._reannounce, node)

    async def _start_producing(self, node) -> None:
        """garbage, node 0: the engine on v0 (the weights it just published)."""
        from node.engines.transformers_engine import TransformersEngine
        from node.roles.rollouts import PolicyFacts

        ctx = self.shard.ctx
        self.engine = await trio.to_thread.run_sync(
            lambda: TransformersEngine(
                ctx.initial_model(), eos_token_id=ctx.eos_token_id, pad_token_id=ctx.pad_token_id
            )
        )
        self.policy = PolicyFacts.of(self.checkpoints.store.get(0).manifest)

    async def make_real_batch(self, node, counter: int) -> tuple[bytes, RolloutAnnounce]:
        """garbage, node 0: a real batch (seeded sampling, proofs) and its announcement."""
        from node.roles.rollouts import produce_batch

        batch = await trio.to_thread.run_sync(
            produce_batch, self.shard.ctx, self.engine, node.peer_id, self.policy, counter
        )
        raw = seal(node.key, node.run_id, batch, now_ms(), node.seq.next())
        return raw, RolloutAnnounce(
            batch_id=sha256(raw),
            policy_version=0,
            batch_counter=counter,
            num_samples=len(batch.samples),
            size_bytes=len(raw),
        )

    async def _start_validator(self, node, nursery: trio.Nursery) -> None:
        """garbage, node 1: the real validator, on v0 with its engine built before the
        windows start (the first verification would otherwise pay for both)."""
        v = self.real_validator = make_recording_validator(
            self.shard.work / f"node-{self.idx}",
            self.shard.ctx,
            self.shard.on_vote(self.idx),
            fifo=self.shard.cfg.get("verify_queue") == "fifo",
        )
        nursery.start_soon(v.run, node)
        while v.checkpoints is None or not v.weights.held(0):
            await trio.sleep(0.1)
        await v._ensure_version(0)

    async def _reannounce(self, node) -> None:
        """As the trainer does (every 5 s): nodes that joined after an announce learn the newest version."""
        while True:
            await trio.sleep(2.0)
            st = self.checkpoints.store.newest()
            if st is not None and st.complete:
                await node.gossip.publish(CheckpointAnnounce(manifest=st.manifest))

    async def publish_checkpoint(self, node, version: int) -> None:
        src = self.shard.work / f"ckpt-v{version}"
        if self.shard.cfg["scenario"] == "garbage":  # the real policy (what batches are checked against)
            from node.roles.weights import export_weights

            model = await trio.to_thread.run_sync(self.shard.ctx.initial_model)
            await trio.to_thread.run_sync(export_weights, model, src)
            await self.checkpoints.import_version(node.key, version, src, chunk_size=node.genesis.chunk_size)
        else:
            src.mkdir(parents=True, exist_ok=True)
            (src / "model.safetensors").write_bytes(random.Random(version).randbytes(CKPT_BYTES))
            await self.checkpoints.import_version(node.key, version, src, chunk_size=CKPT_CHUNK)
        await node.gossip.publish(CheckpointAnnounce(manifest=self.checkpoints.store.get(version).manifest))

    def holds(self, version: int) -> bool:
        st = self.checkpoints.store.get(version) if self.checkpoints is not None else None
        return st is not None and st.assembled

    def missing_chunks(self, version: int) -> int:
        st = self.checkpoints.store.get(version) if self.checkpoints is not None else None
        if st is None:
            return -1  # never heard of the version
        return st.bitmap.n - st.bitmap.count


# ===================================================================== the shard process


def node_snapshot(node, role: BenchRole) -> dict:
    m = node.metrics
    pol = node.standing.sizes()
    d = {
        "dropped": dict(m.dropped),
        "internal": m.dropped["internal"] + sum(c["internal"] for c in m.req.values()),
        "duplicates": node.gossip.duplicates,
        "bans": len(node.standing.banned()),
        "inbound_refused": getattr(node.host.get_network(), "primenode_inbound_refused", 0),
        "trimmed": node.conns.trimmed,
        # the connection watchdog closes connections that never carry a gossip stream
        "dropped_no_gossip": int(
            m.registry.get_sample_value("primenode_dials_total", {"outcome": "dropped_no_gossip"}) or 0
        ),
        "connections": len(node.conns.connected()),
        "tables": {
            "scores": pol["scores"],
            "bans": pol["bans"],
            "buckets": pol["buckets"],
            "swarm_view": len(node.swarm._peers),
            "book": len(node.conns.book),
            "seen_cache": len(node.gossip.tree.seen),
            "message_cache": len(node.gossip.tree.cache),
        },
    }
    if role.validator is not None:
        d["fetcher"] = role.validator.stats()
    if role.real_validator is not None:
        d["validator"] = validator_stats(role.real_validator, node)
    if role.checkpoints is not None:
        srv = role.checkpoints.server
        d["dataplane"] = {
            "connections": srv.connections,
            "peak_connections": role.dp_peak_connections,
            "refused_full": role.dp_refused_full,
            "tickets_granted": srv.tickets_granted,
            "tickets_held": len(srv.tickets),
            "chunks_served": srv.chunks_served,
        }
    d["foreign_announces"] = role.shard.foreign_announces[role.idx]
    if role.idx == 0:
        d["batches_served"] = role.served
    return d


class Shard:
    def __init__(self, workdir: str, shard: int) -> None:
        self.work = Path(workdir)
        self.cfg = json.loads((self.work / "config.json").read_text())
        self.shard = shard
        self.n = self.cfg["honest"]
        self.mine = [i for i in range(self.n) if i % self.cfg["procs"] == shard]
        self.arrivals: dict[int, dict[str, float]] = {i: {} for i in self.mine if i != 0}
        self.fetched: dict[int, dict[str, float]] = {}
        self.foreign_announces: collections.Counter[int] = collections.Counter()  # rollout announces not node 0's
        # garbage: node 0's batch id -> [vote time, accept, rule, time queued for verification, verify seconds]
        self.voted: dict[str, list] = {}
        self.sent: dict[str, list] = {}
        self.ctx = None  # garbage: the run context (tiny model)
        self.rss: list[tuple[float, float]] = []
        self.v1_done: dict[int, float] = {}
        self.exc = ExceptionLog()

    def on_arrival(self, idx: int, src: str):
        rec = self.arrivals[idx]

        def handler(env) -> None:
            if env.sender == src:
                rec.setdefault(env.body.batch_id.hex(), time.time())
            else:
                self.foreign_announces[idx] += 1

        return handler

    def on_fetched(self, idx: int):
        rec = self.fetched.setdefault(idx, {})
        src = self.keys[0].peer_id

        def handler(env) -> None:
            if env.sender == src:
                rec.setdefault(env.body.batch_id.hex(), time.time())

        return handler

    def on_vote(self, idx: int):
        src = self.keys[0].peer_id

        def handler(env, verdict, enqueued: float | None) -> None:
            if env.sender == src:
                rec = [time.time(), verdict.accept, verdict.rule, enqueued, verdict.seconds]
                self.voted.setdefault(env.body.batch_id.hex(), rec)

        return handler

    async def _watch_v1(self) -> None:
        while True:
            for i, r in self.roles.items():
                if i not in self.v1_done and r.holds(1):
                    self.v1_done[i] = time.time()
            await trio.sleep(0.05)

    async def _sample_rss(self) -> None:
        while True:
            self.rss.append((time.time(), proc_mem_mib()[0]))
            await trio.sleep(0.5)

    async def _publish(self, node, role: BenchRole, start: float, end: float, phase: str) -> None:
        rate = self.cfg["honest_rate"]
        await sleep_until_wall(start)
        k = 0
        while True:
            due = start + k / rate
            if due >= end:
                break
            await sleep_until_wall(due)
            raw, ann = make_batch(node, self._counter)
            self._counter += 1
            role.batches[ann.batch_id] = raw
            self.sent[ann.batch_id.hex()] = [time.time(), phase]
            await node.gossip.publish(ann)
            k += 1

    async def _publish_batches(self, node, role: BenchRole, start: float, end: float, phase: str) -> None:
        """garbage: one real batch every ``batch_interval_s``; each is produced ahead of
        its due time and announced on it (a batch still generating then is announced late)."""
        interval = self.cfg["batch_interval_s"]
        due = start
        while due < end:
            async with role.generating:  # one engine: one batch at a time
                raw, ann = await role.make_real_batch(node, self._counter)
            self._counter += 1
            await sleep_until_wall(due)
            if time.time() >= end:  # generated too late for this window
                break
            role.batches[ann.batch_id] = raw
            self.sent[ann.batch_id.hex()] = [time.time(), phase]
            await node.gossip.publish(ann)
            due = max(due + interval, time.time())  # a late batch pushes the schedule back, never bunches it

    def _drained(self, ids: set[str]) -> bool:
        if any(not ids <= rec.keys() for rec in self.arrivals.values()):
            return False
        if any(not ids <= rec.keys() for rec in self.fetched.values()):
            return False
        validator = self.roles.get(GARBAGE_VALIDATOR)
        if validator is not None and validator.garbage_validator and not ids <= self.voted.keys():
            return False
        return not (self.cfg["scenario"] == "chunks" and not all(r.holds(1) for r in self.roles.values()))

    async def run(self) -> None:
        from node.p2p.testing import NodeFactory

        cfg = self.cfg
        self.keys = seeded_keys(cfg["seed"], self.n)
        if cfg["scenario"] == "garbage":
            from node.genesis_file import write_genesis
            from node.roles.context import RunContext

            genesis = garbage_genesis(self.keys, cfg["created_ms"])
            self.ctx = RunContext.from_genesis(genesis.genesis, self.work / f"cache-{self.shard}")
            if self.shard == 0:  # the attackers build their garbage for this run
                write_genesis(genesis, self.work / "genesis.toml")
        else:
            genesis = bench_genesis(self.keys, cfg["created_ms"])
        self._counter = 0
        overrides = {"budget": math.inf} if cfg["scenario"] == "invalid_noban" else {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sample_rss)
            net = NodeFactory(
                nursery, genesis=genesis, target_peers=cfg["target_peers"], heartbeat_interval_s=1.0, **overrides
            )
            self.nodes, self.roles = {}, {}
            if self.shard == 0:
                self.roles[0] = BenchRole(self, 0)
                self.nodes[0] = await net.start(hook=self.roles[0], key=self.keys[0], bootstrap=[])
                write_json(self.work / "bootstrap.json", self.nodes[0].full_addrs())
            boot = json.loads(await wait_file(self.work / "bootstrap.json", 120))
            for i in self.mine:
                if i not in self.nodes:
                    self.roles[i] = BenchRole(self, i)
                    self.nodes[i] = await net.start(hook=self.roles[i], key=self.keys[i], bootstrap=boot)
            src = self.keys[0].peer_id
            for i in self.arrivals:
                self.nodes[i].gossip.on("rollout", self.on_arrival(i, src))
            all_ids = {k.peer_id for k in self.keys}

            def formed() -> bool:
                for n in self.nodes.values():
                    if len(n.conns.connected()) < min(2, self.n - 1) or not (all_ids - {n.peer_id}) <= set(
                        n.swarm.peers()
                    ):
                        return False
                    if self.n > 1 and not n.gossip.mesh_peers("rollout"):
                        return False
                return all(r.ready.is_set() for r in self.roles.values())

            ok = True
            with trio.move_on_after(cfg["connect_timeout"]) as cs:
                while not formed():
                    await trio.sleep(0.1)
                if cfg["scenario"] == "chunks":  # every node holds v0 (the version the hoarders ask for)
                    while not all(r.holds(0) for r in self.roles.values()):
                        await trio.sleep(0.1)
            ok = not cs.cancelled_caught
            ready = {
                "shard": self.shard,
                "formed": ok,
                "run_id": self.nodes[self.mine[0]].run_id.hex(),
                "nodes": {i: {"peer_id": n.peer_id, "addrs": n.full_addrs()} for i, n in self.nodes.items()},
                "rss_mib": proc_mem_mib()[0],
            }
            if self.shard == 0 and cfg["scenario"] == "chunks":
                st = self.roles[0].checkpoints.store.get(0)
                ready["ckpt"] = {"version": 0, "root": st.root.hex(), "chunks": st.bitmap.n}
            write_json(self.work / f"ready-{self.shard}.json", ready)

            plan = json.loads(await wait_file(self.work / "plan.json", 600))
            publish = self._publish_batches if cfg["scenario"] == "garbage" else self._publish
            if self.shard == 0:
                node, role = self.nodes[0], self.roles[0]
                if cfg["scenario"] == "garbage":

                    async def warm_then_quiet() -> None:  # one after the other: one engine generates
                        await publish(node, role, *plan["warm"], "warm")
                        await publish(node, role, *plan["quiet"], "quiet")

                    nursery.start_soon(warm_then_quiet)
                else:
                    nursery.start_soon(publish, node, role, *plan["warm"], "warm")
                    nursery.start_soon(publish, node, role, *plan["quiet"], "quiet")
            await sleep_until_wall(plan["quiet"][1])
            before = {i: node_snapshot(n, self.roles[i]) for i, n in self.nodes.items()}
            rss_before = proc_mem_mib()[0]
            attack = json.loads(await wait_file(self.work / "attack.json", 600))
            v1_published = None
            if cfg["scenario"] == "chunks":
                nursery.start_soon(self._watch_v1)
            if self.shard == 0:
                node, role = self.nodes[0], self.roles[0]
                if cfg["scenario"] == "chunks":
                    await sleep_until_wall(attack["start"])
                    v1_published = time.time()
                    nursery.start_soon(role.publish_checkpoint, node, 1)
                await publish(node, role, attack["start"], attack["end"], "attack")
                write_json(self.work / "sent.json", self.sent)
            await sleep_until_wall(attack["end"])
            sent = json.loads(await wait_file(self.work / "sent.json", cfg["drain_s"] + 60))
            ids = {b for b, (_t, phase) in sent.items() if phase != "warm"}
            deadline = attack["end"] + cfg["drain_s"]
            while time.time() < deadline and not self._drained(ids):
                await trio.sleep(0.1)
            drained_at = time.time()
            after = {i: node_snapshot(n, self.roles[i]) for i, n in self.nodes.items()}
            ckpt = {}
            if cfg["scenario"] == "chunks":
                for i, r in self.roles.items():
                    f = r.checkpoints.fetchers.get(1)
                    fs = f.status() if f is not None else r.checkpoints.fetch_history.get(1, {})
                    ckpt[i] = {
                        "holds_v1": r.holds(1),
                        "done_at": self.v1_done.get(i),
                        "missing_chunks": r.missing_chunks(1),
                        "fetch": {
                            k: fs.get(k) for k in ("seconds", "chunks_fetched", "chunks_elsewhere", "chunks_rejected")
                        },
                        "peer_failures": sum(p.get("failures", 0) for p in (fs.get("peers") or {}).values()),
                    }
            rss, hwm = proc_mem_mib()
            result = {
                "shard": self.shard,
                "nodes": list(self.nodes),
                "arrivals": self.arrivals,
                "fetched": self.fetched,
                "voted": self.voted,
                "sent": self.sent if self.shard == 0 else {},
                "before": before,
                "after": after,
                "rss_before_mib": round(rss_before, 1),
                "rss_peak_mib": round(max([r for t, r in self.rss if t >= plan["quiet"][1]] + [rss]), 1),
                "rss_end_mib": round(rss, 1),
                "hwm_mib": round(hwm, 1),
                "exceptions": self.exc.exceptions,
                "errors": self.exc.errors,
                "libp2p_errors": self.exc.libp2p_errors,
                "exception_samples": self.exc.samples,
                "drained_at": drained_at,
                "v1_published": v1_published,
                "ckpt": ckpt,
            }
            write_json(self.work / f"result-{self.shard}.json", result)
            await wait_file(self.work / "stop", 600)
            nursery.cancel_scope.cancel()


def shard_main(workdir: str, shard: int) -> None:
    s = Shard(workdir, shard)
    if s.cfg["scenario"] == "garbage":
        import torch

        torch.set_num_threads(1)  # several model processes share the cores: intra-op threads only fight
    for name in ("libp2p", "multiaddr", "trio", "node"):
        logging.getLogger(name).setLevel(logging.ERROR)
        logging.getLogger(name).addHandler(s.exc)
        logging.getLogger(name).propagate = False
    trio.run(s.run)
