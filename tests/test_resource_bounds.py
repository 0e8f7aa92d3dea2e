"""Resource hygiene (issue 8): tables the soak (bench/soak.py) found growing with every
checkpoint version or every peer stay bounded."""

from __future__ import annotations

from node.dataplane.service import FETCH_HISTORY_VERSIONS, MAX_BANNED, SERVED_TO_PEERS, Distribution
from node.store import ChunkStore

from .dist_helpers import RUN_ID, keys


class _NoOverlay:
    """Nothing here fetches or grants tickets."""


def _dist(tmp_path) -> Distribution:
    return Distribution(ChunkStore(tmp_path / "store", RUN_ID, keys(1)[0].peer_id), _NoOverlay())


def test_fetch_history_keeps_the_newest_versions_only(tmp_path):
    dist = _dist(tmp_path)
    for v in range(500):  # a long run fetches one version every few seconds
        dist._remember_fetch(v, {"bytes_fetched": v})
    assert sorted(dist.fetch_history) == list(range(500 - FETCH_HISTORY_VERSIONS, 500))


def test_chunk_server_counters_are_trimmed_at_gc(tmp_path):
    dist = _dist(tmp_path)
    srv = dist.server
    for i in range(5 * SERVED_TO_PEERS):  # fresh identities each fetching a little
        srv.bytes_served_to[f"peer-{i}"] += i + 1
    for v in range(300):
        srv.bytes_served_by_version[v] += 1
    dist.gc()
    assert len(srv.bytes_served_to) <= SERVED_TO_PEERS
    assert f"peer-{5 * SERVED_TO_PEERS - 1}" in srv.bytes_served_to  # the biggest consumers stay
    assert srv.bytes_served_by_version == {}  # no version is held any more


def test_banned_peers_are_bounded_and_the_set_stays_shared(tmp_path):
    dist = _dist(tmp_path)
    shared = dist.banned  # fetchers hold this very set
    live = {f"b-{i}" for i in range(MAX_BANNED + 40, MAX_BANNED + 60)}
    for i in range(MAX_BANNED + 60):
        dist.note_banned(f"b-{i}", lambda: live)
    assert dist.banned is shared
    assert len(dist.banned) <= MAX_BANNED
    assert live <= dist.banned  # still banned by the policy: kept
