"""Worker bookkeeping without a network: what its status counts, bounded per-version
counters, and reading the next version's weights ahead of the swap."""

from __future__ import annotations

import contextlib
import itertools
import types

import trio
import trio.lowlevel
import trio.testing

from harness.genesis import VALIDATORS, WORKERS, tiny_genesis
from node.home import NodeHome
from node.roles import weights
from node.roles.context import RunContext
from node.roles.worker import WorkerRole
from protocol import NodeKey, Vote

W = WORKERS[0].peer_id


def make_worker(tmp_path, signed, **kw) -> WorkerRole:
    home = NodeHome(tmp_path / "worker")
    home.path.mkdir(parents=True, exist_ok=True)
    return WorkerRole(home, RunContext.from_genesis(signed.genesis, tmp_path / "cache"), **kw)


def vote(batch_id: bytes, sender: NodeKey | str, accept: bool, worker: str = W):
    body = Vote(
        batch_id=batch_id,
        worker=worker,
        policy_version=0,
        accept=accept,
        reason="" if accept else "toploc: x",
        rewards=(0.5,) * 8 if accept else (),
    )
    return types.SimpleNamespace(body=body, sender=sender if isinstance(sender, str) else sender.peer_id)


def test_batches_accepted_counts_batches_with_a_quorum_not_votes(tmp_path):
    w = make_worker(tmp_path, tiny_genesis())  # 2 validators, quorum 2
    w.node = types.SimpleNamespace(peer_id=W)
    v1, v2 = VALIDATORS
    a, b, c = (bytes([i]) * 32 for i in (1, 2, 3))
    w._my_batches |= {a, b}
    # votes on another peer's announce of our batch's id (a thief's copy) are not about our batch
    w._on_vote(vote(a, v1, False, worker=WORKERS[1].peer_id))
    w._on_vote(vote(a, v2, False, worker=WORKERS[1].peer_id))
    assert (w.stats["batches_rejected"], w.stats["reject_votes"]) == (0, 0)
    w._on_vote(vote(a, v1, True))
    assert (w.stats["batches_accepted"], w.stats["accept_votes"]) == (0, 1)  # one of two: not yet
    w._on_vote(vote(a, v1, True))  # the same validator again (gossip duplicate)
    w._on_vote(vote(a, NodeKey(b"\x77" * 32), True))  # not a genesis validator
    assert (w.stats["batches_accepted"], w.stats["accept_votes"]) == (0, 1)
    w._on_vote(vote(a, v2, True))
    assert (w.stats["batches_accepted"], w.stats["accept_votes"]) == (1, 2)  # one batch, two votes
    w._on_vote(vote(b, v1, False))  # with quorum == validators one reject decides
    assert (w.stats["batches_rejected"], w.stats["reject_votes"]) == (1, 1)
    w._on_vote(vote(b, v2, True))
    assert (w.stats["batches_accepted"], w.stats["batches_rejected"], w.stats["accept_votes"]) == (1, 1, 3)
    w._on_vote(vote(c, v1, True))  # not our batch
    assert w.stats["accept_votes"] == 3
    assert w.status()["batches_accepted"] == 1


def test_with_quorum_below_the_validators_one_reject_does_not_decide(tmp_path):
    validators = [*VALIDATORS, NodeKey(b"\x27" * 32)]
    signed = tiny_genesis(fields={"name": "q", "validators": validators})
    w = make_worker(tmp_path, signed)
    w.node = types.SimpleNamespace(peer_id=W)
    a, b = bytes([1]) * 32, bytes([2]) * 32
    w._my_batches |= {a, b}
    w._on_vote(vote(a, validators[0], False))
    assert w.stats["batches_rejected"] == 0  # two accepts can still admit it
    w._on_vote(vote(a, validators[1], True))
    w._on_vote(vote(a, validators[2], True))
    assert (w.stats["batches_accepted"], w.stats["batches_rejected"]) == (1, 0)
    w._on_vote(vote(b, validators[0], False))
    w._on_vote(vote(b, validators[1], False))  # no quorum of accepts possible any more
    assert (w.stats["batches_accepted"], w.stats["batches_rejected"]) == (1, 1)
    assert (w.stats["accept_votes"], w.stats["reject_votes"]) == (2, 3)


class _FakeWeights:
    def __init__(self):
        self.got: list[int] = []

    async def get(self, version):
        self.got.append(version)
        return {}


class _Manifests(dict):
    """Every version's manifest facts (the worker keeps them at load: seeds hash the root)."""

    def __missing__(self, version):
        return types.SimpleNamespace(manifest=types.SimpleNamespace(version=version, root=bytes(32), created_ms=0))


async def test_per_version_counters_stay_within_the_max_async_window(tmp_path):
    w = make_worker(tmp_path, tiny_genesis())
    w.weights = _FakeWeights()
    w.store = types.SimpleNamespace(versions=_Manifests())
    w.engine = types.SimpleNamespace(load_weights=lambda state: None, delta_values=False)
    window = w.ctx.genesis.max_async
    for v in range(200):
        await w._load(v)
        w.produced[v] += 2
        assert set(w.produced) <= set(range(v - window, v + 1)), (v, sorted(w.produced))
    assert len(w.produced) == window + 1 and w.produced[199] == 2


async def test_the_next_version_is_read_while_the_current_one_generates(tmp_path):
    """The read-ahead task loads each newly assembled version into the weight cache without
    waiting for the generation loop; the "stale" test mode, pinned to its version, reads nothing."""
    for tamper, expect in ((None, [1, 2]), ("stale", [])):
        w = make_worker(tmp_path / str(tamper), tiny_genesis(), tamper=tamper)
        w.weights = _FakeWeights()
        w.loaded_version = 0  # generating with version 0
        newest = types.SimpleNamespace(v=0, changed=trio.Event())

        async def wait_version(n, timeout=None, newest=newest):
            while newest.v < n:
                await newest.changed.wait()
            return newest.v

        w.checkpoints = types.SimpleNamespace(wait_version=wait_version)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(w._read_ahead_loop)
                for v in (1, 2):
                    newest.v = v
                    newest.changed.set()
                    newest.changed = trio.Event()
                    await trio.testing.wait_all_tasks_blocked()  # the read-ahead took it and waits again
                nursery.cancel_scope.cancel()
        assert w.weights.got == expect, tamper


async def test_weight_cache_shares_one_read_between_concurrent_gets(monkeypatch):
    reads = []

    def slow_load(files):
        import time

        reads.append(files["v"])
        time.sleep(0.2)
        return {"v": files["v"]}

    @contextlib.contextmanager
    def open_version(version):
        yield {"v": version}

    monkeypatch.setattr(weights, "load_state_dict", slow_load)
    role = types.SimpleNamespace(checkpoints=types.SimpleNamespace(open_version=open_version), store=None)
    cache = weights.WeightCache(role, capacity=2)
    results = []

    async def get(v):
        results.append(await cache.get(v))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(get, 5)
    assert reads == [5] and results == [{"v": 5}] * 3
    for v in (6, 7):
        await cache.get(v)
    assert reads == [5, 6, 7] and list(cache._cache) == [6, 7]  # capacity bounds what it keeps


async def test_held_batches_are_announced_again_while_in_the_window(tmp_path, autojump_clock):
    """A validator or the trainer whose fetch lane was full sheds an announce without
    remembering it: the worker announces a batch no quorum decided again every
    ``reannounce_s``, ``REANNOUNCES`` times. After that, and for a decided batch from the
    start, every ``KEEPALIVE_S``: a trainer that restarted may never have recorded a batch
    the validators decided, and its later counters wait for it. Once the version falls out
    of the window, a batch the trainer fetched is never announced again; one it did not is
    announced every ``KEEPALIVE_S``, ``STALE_KEEPALIVES`` times (the trainer records a stale
    batch too, and the worker's chain waits for that), then dropped."""
    from node.roles.worker import KEEPALIVE_S, REANNOUNCES, STALE_KEEPALIVES, _Announced
    from protocol import RolloutAnnounce

    w = make_worker(tmp_path, tiny_genesis())
    published: list[tuple[bytes, float]] = []

    async def publish(msg) -> None:
        published.append((msg.batch_id, trio.current_time()))

    w.node = types.SimpleNamespace(peer_id=W, gossip=types.SimpleNamespace(publish=publish))
    w.store = types.SimpleNamespace(versions={0: None})
    undecided, decided = bytes([1]) * 32, bytes([2]) * 32
    start = trio.current_time()
    for b in (undecided, decided):
        ann = RolloutAnnounce(batch_id=b, policy_version=0, batch_counter=b[0], num_samples=8, size_bytes=100)
        w._announced[b] = _Announced(ann, start)
        w._my_batches.add(b)
    for v in VALIDATORS:  # a quorum accepts one of them
        w._on_vote(vote(decided, v, True))
    w.trainer_fetched.add(decided)  # ... and the trainer fetched it
    horizon = w.reannounce_s * REANNOUNCES + 3 * KEEPALIVE_S
    async with trio.open_nursery() as nursery:
        nursery.start_soon(w._reannounce_loop)
        await trio.sleep(horizon + 1)  # (off the loop's beat: the announce at the horizon is in the window)
        # version 3 arrives: version 0 falls out of the max_async (2) window
        w.store.versions[3] = None
        await trio.sleep((STALE_KEEPALIVES + 3) * KEEPALIVE_S)
        nursery.cancel_scope.cancel()
    times = {b: [t - start for bb, t in published if bb == b] for b in (undecided, decided)}
    fast = times[undecided][:REANNOUNCES]
    assert all(w.reannounce_s <= t <= w.reannounce_s * (k + 1) + w.reannounce_s / 4 for k, t in enumerate(fast))
    slow = {undecided: times[undecided][REANNOUNCES - 1 :], decided: [0.0, *times[decided]]}
    for b, ts in slow.items():
        assert all(t2 - t1 >= KEEPALIVE_S for t1, t2 in itertools.pairwise(ts)), (b[0], times[b])
    assert max(times[decided]) <= horizon + w.reannounce_s / 4  # fetched by the trainer: nothing once stale
    late = [t for t in times[undecided] if t > horizon + 1]
    assert len(late) == STALE_KEEPALIVES, times[undecided]  # not fetched: kept up while stale, then dropped
    assert times[decided][0] >= KEEPALIVE_S  # a decided batch waits the longer period
    assert len(times[decided]) >= 2 and len(times[undecided]) >= REANNOUNCES + 2
    assert w.stats["reannounced"] == REANNOUNCES and not w._announced


class _Held:
    """The versions a worker holds (assembled) as its checkpoint service reports them."""

    def __init__(self, newest: int) -> None:
        self.newest = newest
        self.changed = trio.Event()

    def newest_version(self) -> int:
        return self.newest

    async def wait_version(self, n: int = 0, timeout=None) -> int:
        while self.newest < n:
            await self.changed.wait()
        return self.newest

    def assemble(self, version: int) -> None:
        self.newest = version
        self.changed.set()
        self.changed = trio.Event()

    async def delta_changes(self, version: int, loaded: int, *, values: bool = True) -> None:
        return None  # every version held is a full anchor: the engine loads whole weights


def pipeline_worker(tmp_path, held: int, known: int, **config):
    """A worker whose generation is a stub that books (version, counter): its loop decides
    what to generate when, which is what these tests are about."""
    w = make_worker(tmp_path, tiny_genesis(**config))
    w.weights = _FakeWeights()
    facts = _Manifests()
    w.store = types.SimpleNamespace(versions=_Manifests({v: facts[v] for v in range(known + 1)}))
    w.engine = types.SimpleNamespace(load_weights=lambda state: None, delta_values=False)
    w.checkpoints = _Held(held)
    w.made = []
    w.after_made = lambda: None

    async def produce(version: int) -> None:
        w.made.append((version, w.produced[version]))
        w.produced[version] += 1
        w.after_made()
        await trio.lowlevel.checkpoint()

    w._produce = produce
    return w


async def run_until(w, done) -> None:
    """Run the worker's loop until ``done()`` holds after a batch."""
    async with trio.open_nursery() as nursery:
        w.after_made = lambda: done() and nursery.cancel_scope.cancel()
        nursery.start_soon(w._loop)


async def test_a_worker_generates_continuously_without_waiting_for_a_version(mock_clock):
    """Continuous by default: with no new version, batch follows batch (counters 0, 1, 2, ...
    of the version held) and no (virtual) time passes waiting; the old pace made two batches
    per version and then idled for worker_idle_s."""
    import tempfile
    from pathlib import Path

    mock_clock.autojump_threshold = 0
    with tempfile.TemporaryDirectory() as d:
        w = pipeline_worker(Path(d), held=0, known=0, worker_batches_per_version=0)
        start = trio.current_time()
        await run_until(w, lambda: len(w.made) >= 6)
        assert w.made[:6] == [(0, c) for c in range(6)]
        assert trio.current_time() == start  # never waited
        # a new version is swapped in between two batches, and its counters start at 0
        w2 = pipeline_worker(Path(d) / "2", held=0, known=1, worker_batches_per_version=0)
        await run_until(w2, lambda: len(w2.made) >= 2)
        w2.checkpoints.assemble(1)
        await run_until(w2, lambda: w2.loaded_version == 1 and w2.made[-1][0] == 1)
        assert w2.made[-1] == (1, 0) and set(w2.made[:-1]) <= {(0, c) for c in range(10)}
        assert w2.spent["load"] >= 0 and "pace" not in w2.spent


async def test_a_worker_waits_only_when_its_policy_fell_out_of_the_window(mock_clock):
    """Versions 0..5 are known (announced) but only 0..2 are held: version 2 is more than
    max_async (2) behind 5, its batches would be refused as stale, so nothing is generated
    until a version inside the window arrives; then generation resumes with it."""
    import tempfile
    from pathlib import Path

    mock_clock.autojump_threshold = 0
    with tempfile.TemporaryDirectory() as d:
        w = pipeline_worker(Path(d), held=2, known=5, worker_batches_per_version=0)
        loaded, made = trio.Event(), trio.Event()
        load = w._load

        async def load_and_tell(version: int) -> None:
            await load(version)
            loaded.set()

        w._load = load_and_tell
        w.after_made = made.set
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w._loop)
            await loaded.wait()  # loading runs in a thread
            await trio.sleep(100)  # virtual
            assert w.made == [] and w.loaded_version == 2
            w.checkpoints.assemble(3)
            await made.wait()
            nursery.cancel_scope.cancel()
        assert w.made[0] == (3, 0)
        assert w.spent["window"] > 0


async def test_a_run_may_cap_batches_per_version_the_lockstep_pace(mock_clock):
    """worker_batches_per_version 2: two batches per version, then one more per worker_idle_s
    with no newer version (a trainer restarting)."""
    import tempfile
    from pathlib import Path

    mock_clock.autojump_threshold = 0
    with tempfile.TemporaryDirectory() as d:
        w = pipeline_worker(Path(d), held=0, known=0, worker_batches_per_version=2, worker_idle_s=20)
        start = trio.current_time()
        await run_until(w, lambda: len(w.made) >= 3)
        assert w.made == [(0, 0), (0, 1), (0, 2)]
        assert trio.current_time() - start == 20  # the third waited one idle period


async def test_a_paced_worker_runs_ahead_of_the_trainer_by_its_lead_and_no_further(mock_clock):
    """worker_batches_per_version 1, worker_lead_versions 1 (the devnet's pace): one batch per
    version plus one version's worth of lead, so the worker generates the next step's batch
    while the trainer trains, and waits only when that far ahead. A worker far behind its
    credit (versions came in a burst) makes at most (lead + 1) batches before it waits again:
    no burst. Control: the same worker without the lead is lock-step (one batch per version)."""
    import tempfile
    from pathlib import Path

    mock_clock.autojump_threshold = 0
    with tempfile.TemporaryDirectory() as d:
        for lead, first in ((1, [(0, 0), (0, 1)]), (0, [(0, 0)])):
            w = pipeline_worker(
                Path(d) / str(lead), held=0, known=0, worker_batches_per_version=1, worker_lead_versions=lead
            )
            waits, paused = _count_pace_waits(w)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(w._loop)
                await paused(1)
                assert w.made == first, lead
                for k, version in enumerate((1, 2, 9), start=2):  # 9: seven versions at once
                    w.store.versions[version] = _Manifests()[version]  # announced (known)
                    w.checkpoints.assemble(version)  # and assembled (held)
                    await paused(k)
                    if version < 9:  # the trainer's next versions: one batch each
                        assert len(w.made) == len(first) + version and w.made[-1][0] == version, w.made
                assert [v for v, _ in w.made[len(first) + 2 :]] == [9] * (lead + 1), w.made
                nursery.cancel_scope.cancel()
            assert "pace" in w.spent and "window" not in w.spent and waits == [1, 2, 3, 10]


def _count_pace_waits(w):
    """Record each time ``w`` starts waiting for a newer version (its pace), and a way to wait
    (in virtual time) until it has done so k times: loads run in threads, so a fixed virtual
    sleep could end before the worker got there."""
    waits: list[int] = []
    counted = [trio.Event()]
    wait_version = w.checkpoints.wait_version

    async def wait_and_count(n: int = 0, timeout=None) -> int:
        if n > 0:
            waits.append(n)
            counted[0].set()
            counted[0] = trio.Event()
        return await wait_version(n, timeout)

    async def paused(k: int) -> None:
        while len(waits) < k:
            await counted[0].wait()

    w.checkpoints.wait_version = wait_and_count
    return waits, paused


async def test_the_idle_allowance_is_an_advance_that_lapses_with_the_next_version(mock_clock):
    """A paced worker with no new version for worker_idle_s makes one more batch (a rejected
    batch may leave the trainer short, and it would wait for ever); that batch is an advance
    on the next version's credit, not a permanent step ahead: after one slow step the worker
    is back to one batch per version (else every later step would train a batch one version
    older, for the rest of the run)."""
    import tempfile
    from pathlib import Path

    mock_clock.autojump_threshold = 0
    with tempfile.TemporaryDirectory() as d:
        w = pipeline_worker(Path(d), held=0, known=0, worker_batches_per_version=1, worker_idle_s=20)
        _, paused = _count_pace_waits(w)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w._loop)
            await paused(1)
            assert w.made == [(0, 0)]
            await paused(2)  # one idle period (20 s, virtual) without a version: one more
            assert w.made == [(0, 0), (0, 1)]
            for version, k in ((1, 3), (2, 4)):
                w.store.versions[version] = _Manifests()[version]
                w.checkpoints.assemble(version)
                await paused(k)
            # version 1 was paid for in advance; version 2 gets its one batch
            assert w.made == [(0, 0), (0, 1), (2, 0)], w.made
            nursery.cancel_scope.cancel()


def test_status_says_how_busy_the_worker_was_and_where_the_rest_went(tmp_path):
    """utilization: the generating share of wall time after the first version; spent_s: seconds
    per activity, the remainder as "other"; `primenode status` prints them."""
    import io
    import time

    from rich.console import Console

    from node.ops.status_cli import render_role_state

    w = make_worker(tmp_path, tiny_genesis())
    w.checkpoints_status = lambda: {}
    assert w.status()["utilization"] == 0.0  # not started
    w.started_at = time.monotonic() - 100.0
    w.spent.update(first_version=20.0, generate=72.0, load=4.0)
    st = w.status()
    assert st["utilization"] == 0.9  # 72 of the 80 s after the first version
    assert st["spent_s"]["other"] >= 4.0 and set(st["spent_s"]) == {"first_version", "generate", "load", "other"}
    out = io.StringIO()
    for r in render_role_state("worker", st):
        Console(file=out, width=200, color_system=None).print(r)
    assert "utilization" in out.getvalue() and "time spent" in out.getvalue() and "generate 72 s" in out.getvalue()


async def test_a_restarted_worker_resumes_its_chain_and_announces_what_it_kept(tmp_path, autojump_clock):
    """Every batch is written to the home before it is announced: a worker started again on
    the same home continues at the counter after its last batch (a counter used twice would
    be a duplicate slot; one skipped would strand every later batch at the trainer), holds
    its kept batches again (served on request) and announces them at once. A batch signed
    by another key in the directory is skipped. Control: a fresh home starts at counter 0."""
    from protocol import RolloutBatch, Sample, SamplingParams, SequenceCounter, seal

    genesis = tiny_genesis()
    key = WORKERS[0]
    w = make_worker(tmp_path, genesis)
    published: list = []

    async def publish(msg) -> None:
        published.append(msg)

    def fake_node():
        return types.SimpleNamespace(
            peer_id=key.peer_id, key=key, seq=SequenceCounter(1), gossip=types.SimpleNamespace(publish=publish)
        )

    def batch(counter: int, version: int, worker: str = key.peer_id) -> RolloutBatch:
        return RolloutBatch(
            run_id=genesis.genesis.run_id,
            worker=worker,
            policy_version=version,
            batch_counter=counter,
            sampling=SamplingParams(),
            samples=(Sample(prompt_index=0, completion=b"\x01\x00\x00\x00", seed=1, proof=b"", claimed_reward=0.0),),
            created_ms=1,
        )

    w.node = fake_node()
    w._restore_chain(key.peer_id)
    assert w.next_counter == 0  # the control: nothing kept yet
    for version in (0, 0, 1):
        await w._publish(batch(w._take_counter(), version))
    assert [a.batch_counter for a in published] == [0, 1, 2] and w.next_counter == 3
    kept = dict(w.batches)
    # a foreign batch in the directory (a copied home, a bug) is not ours to announce
    other = WORKERS[1]
    (w.batch_dir / "0000000099.batch").write_bytes(
        seal(other, genesis.genesis.run_id, batch(99, 1, other.peer_id), 1, 1)
    )

    again = make_worker(tmp_path, genesis)  # the same home: the process restarted
    again.node = fake_node()
    again._restore_chain(key.peer_id)
    assert again.next_counter == 3
    assert dict(again.batches) == kept
    assert {a.announce.batch_counter for a in again._announced.values()} == {0, 1, 2}
    served = again._serve_batch(types.SimpleNamespace(body=types.SimpleNamespace(batch_id=next(iter(kept)))), "x")
    assert served.found
    published.clear()
    with trio.move_on_after(again.reannounce_s):
        await again._reannounce_loop()
    assert sorted(a.batch_counter for a in published) == [0, 1, 2]  # announced at once after the restart
