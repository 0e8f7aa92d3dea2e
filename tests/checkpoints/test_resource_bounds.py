"""Resource hygiene (issue 8): tables the soak (bench/soak.py) found growing with every
checkpoint version or every peer stay bounded."""

from __future__ import annotations

from harness.checkpoints import RUN_ID, keys
from node.checkpoints import ChunkStore
from node.checkpoints.service import FETCH_HISTORY_VERSIONS, MAX_BANNED, SERVED_TO_PEERS, Checkpoints


class _NoOverlay:
    """Nothing here fetches or grants tickets."""


def _service(tmp_path) -> Checkpoints:
    return Checkpoints(ChunkStore(tmp_path / "store", RUN_ID, keys(1)[0].peer_id), _NoOverlay())


def test_fetch_history_keeps_the_newest_versions_only(tmp_path):
    service = _service(tmp_path)
    for v in range(500):  # a long run fetches one version every few seconds
        service._remember_fetch(v, {"bytes_fetched": v})
    assert sorted(service.fetch_history) == list(range(500 - FETCH_HISTORY_VERSIONS, 500))


def test_chunk_server_counters_are_trimmed_at_gc(tmp_path):
    service = _service(tmp_path)
    srv = service.server
    for i in range(5 * SERVED_TO_PEERS):  # fresh identities each fetching a little
        srv.bytes_served_to[f"peer-{i}"] += i + 1
    for v in range(300):
        srv.bytes_served_by_version[v] += 1
    service.gc()
    assert len(srv.bytes_served_to) <= SERVED_TO_PEERS
    assert f"peer-{5 * SERVED_TO_PEERS - 1}" in srv.bytes_served_to  # the biggest consumers stay
    assert srv.bytes_served_by_version == {}  # no version is held any more


def test_banned_peers_are_bounded_and_the_set_stays_shared(tmp_path):
    service = _service(tmp_path)
    shared = service.banned  # fetchers hold this very set
    live = {f"b-{i}" for i in range(MAX_BANNED + 40, MAX_BANNED + 60)}
    for i in range(MAX_BANNED + 60):
        service.note_banned(f"b-{i}", lambda: live)
    assert service.banned is shared
    assert len(service.banned) <= MAX_BANNED
    assert live <= service.banned  # still banned by the policy: kept


def test_a_fetch_tracks_a_bounded_number_of_peers(tmp_path):
    """Heartbeats from ever new identities during a fetch add peers to it: bounded, and the
    peers that showed a bitmap (the useful ones) are never pushed out by newcomers."""
    from harness.checkpoints import make_checkpoint
    from node.checkpoints.fetcher import VersionFetcher
    from node.checkpoints.schedule import MAX_KNOWN_PEERS

    trainer = keys(1)[0]
    store = ChunkStore(tmp_path / "seed", RUN_ID, trainer.peer_id)
    _, raw = store.import_directory_blocking(trainer, 1, make_checkpoint(tmp_path / "ckpt", 1), 1 << 18)
    store.add_announce(raw)
    fetcher_store = ChunkStore(tmp_path / "fetcher", RUN_ID, trainer.peer_id)
    fetcher_store.add_announce(raw)
    f = VersionFetcher(fetcher_store, 1, _NoOverlay())
    full = b"\xff" * ((f.n + 7) // 8)
    if f.n % 8:
        full = full[:-1] + bytes([(1 << (f.n % 8)) - 1])
    f.update_have("holder", full)
    for i in range(3 * MAX_KNOWN_PEERS):
        f.add_peer(f"stranger-{i}")
    assert len(f.peers) <= MAX_KNOWN_PEERS
    assert "holder" in f.peers and f.peers["holder"].seed
    assert f.schedule.nseeds == 1


def test_progress_display_state_is_bounded_over_many_versions():
    """The daemon's fetch reporter and the progress bar keep a bounded number of versions."""
    import io

    from rich.console import Console

    from node.checkpoints.fetcher import FetchProgress
    from node.ops.daemon import _FetchReporter
    from node.ops.progress import CheckpointProgress

    rep = _FetchReporter(tty=False, every_s=0.0)
    bar = CheckpointProgress(console=Console(file=io.StringIO(), force_terminal=True))
    with bar:
        for v in range(1000):
            for held, done in ((1, False), (4, True)):
                p = FetchProgress(
                    version=v, held=held, total=4, bytes_fetched=held, mib_per_s=1.0, elapsed_s=0.1, done=done
                )
                rep.update(p)
                bar.update(p)
    assert len(rep.done) <= _FetchReporter.KEEP_VERSIONS and 999 in rep.done
    assert len(rep.last_log) <= _FetchReporter.KEEP_VERSIONS
    assert len(bar.tasks) <= CheckpointProgress.MAX_ROWS and 999 in bar.tasks
