"""Checkpoint visibility: ``primenode status`` shows per version the peers it was fed
from (short ids, bytes each; ``--json`` has the full ids), and while fetching the CLI
draws a progress bar with the version, chunks held/total and MiB/s."""

from __future__ import annotations

import io
import json

import trio
from rich.console import Console
from rich.text import Text

from harness.checkpoints import RUN_ID, keys, make_checkpoint, same_files
from node.checkpoints import Checkpoints, ChunkStore, FetchProgress, LocalControlPlane
from node.home import NodeHome
from node.ops.progress import CheckpointProgress
from node.ops.status_cli import _short, render_role_state, show_status
from node.ops.status_server import serve_status


def _text(renderables, width: int = 200) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=width)
    for r in renderables:
        console.print(r)
    return buf.getvalue()


def _dist_status(versions) -> dict:
    return {"versions": versions, "data_port": 9000, "bytes_served": 0}


def test_fed_from_lists_short_peer_ids_with_bytes_most_first():
    pids = [f"12D3KooW{i:02d}" + "x" * 36 + f"tail{i:04d}" for i in range(11)]
    fed_bytes = {p: (i + 1) * 2**20 for i, p in enumerate(pids)}
    v = {
        "version": 5,
        "chunks_held": 8,
        "chunks_total": 8,
        "complete": True,
        "fetching": False,
        "bytes_served": 0,
        "bytes_fetched": sum(fed_bytes.values()),
        "fed_from": sorted(pids),
        "fed_from_bytes": fed_bytes,
        "mib_per_s": 0.0,
    }
    text = _text(render_role_state("worker", {"distribution": _dist_status([v])}))
    assert "11 peers" in text
    shown = [p for p in pids if _short(p) in text]
    assert shown == pids[-8:]  # the 8 biggest feeders, full ids only in --json
    assert not any(p in text for p in pids)
    assert "+3 more" in text
    lines = text.splitlines()
    row = {p: next(i for i, ln in enumerate(lines) if _short(p) in ln) for p in shown}
    assert sorted(shown, key=row.get) == shown[::-1]  # most bytes first
    assert f"{_short(pids[10])} 11.0 MiB" in text and f"{_short(pids[3])} 4.0 MiB" in text

    # an older node's status without bytes per peer: the ids alone
    old = {**v, "fed_from": pids[:2]}
    del old["fed_from_bytes"]
    text = _text(render_role_state("worker", {"distribution": _dist_status([old])}))
    assert "2 peers" in text
    for p in pids[:2]:
        line = next(ln for ln in text.splitlines() if _short(p) in ln)
        assert "MiB" not in line.split(_short(p))[1]


async def test_status_shows_the_peers_each_version_was_fed_from(tmp_path, capsys):
    """A real fetch from a seed and a peer holding half the chunks: the status JSON (and
    ``primenode status --json``) names both with the bytes each sent, the table shows them."""
    src = make_checkpoint(tmp_path / "ckpt", 4, seed=21)
    trainer, half, me = keys(3)
    servers: dict = {}

    def node(name, k, **kw):
        d = Checkpoints(
            ChunkStore(tmp_path / name, RUN_ID, trainer.peer_id), LocalControlPlane(k.peer_id, servers), **kw
        )
        servers[k.peer_id] = d.server
        return d

    # the seed is capped so the half-holder is certainly asked for its chunks
    seed, partial, fetcher = (
        node("seed", trainer, max_upload_mbps=40.0),
        node("half", half, auto_fetch=False),
        node("me", me),
    )
    async with trio.open_nursery() as nursery:
        for d in (seed, partial, fetcher):
            await nursery.start(d.run)
        raw = await seed.import_version(trainer, 1, src, chunk_size=256 * 1024)
        st_seed = seed.store.get(1)
        partial.on_announce(raw)
        pst = partial.store.get(1)
        for i in range(0, st_seed.bitmap.n, 2):
            h = st_seed.chunks[i][3]
            partial.store.write_object_blocking(h, seed.store.read_chunk_blocking(st_seed, i))
            partial.store.mark_held(h)
        assert 0 < pst.bitmap.count < pst.bitmap.n
        fetcher.add_peer(trainer.peer_id)
        fetcher.add_peer(half.peer_id)
        fetcher.on_announce(raw)
        with trio.fail_after(60):
            await fetcher.wait_version(1)

        st = fetcher.status()
        v = st["versions"][0]
        total = st_seed.manifest.total_bytes
        assert v["version"] == 1 and v["bytes_fetched"] == total
        assert sorted(v["fed_from"]) == sorted([trainer.peer_id, half.peer_id])
        assert set(v["fed_from_bytes"]) == set(v["fed_from"])
        assert sum(v["fed_from_bytes"].values()) == total
        assert all(b > 0 for b in v["fed_from_bytes"].values())

        # the table: short ids with MiB each
        text = _text(render_role_state("worker", {"distribution": st}))
        assert "2 peers" in text
        for pid, b in v["fed_from_bytes"].items():
            assert f"{_short(pid)} {b / 2**20:.1f} MiB" in text, text
            assert pid not in text

        # --json: the whole status, full peer ids and bytes, through the local status server
        class Node:
            peer_id, role = me.peer_id, "worker"

            def status(self):
                return {"peer_id": me.peer_id, "role": "worker", "role_state": {"distribution": fetcher.status()}}

        port = await nursery.start(serve_status, Node(), 0)
        home = NodeHome(tmp_path / "home")
        home.runtime_path.parent.mkdir(parents=True, exist_ok=True)
        home.runtime_path.write_text(json.dumps({"pid": 1, "status_port": port, "addrs": []}))
        capsys.readouterr()
        await trio.to_thread.run_sync(show_status, home.path, True)
        out = json.loads(capsys.readouterr().out)
        jv = out["role_state"]["distribution"]["versions"][0]
        assert jv["fed_from_bytes"] == v["fed_from_bytes"] and sorted(jv["fed_from"]) == sorted(v["fed_from"])
        nursery.cancel_scope.cancel()
    assert same_files(src, fetcher.store.files_dir(1))


# --------------------------------------------------------------------------- the progress bar
def _p(held, total=40, rate=0.0, done=False, version=7):
    return FetchProgress(
        version=version, held=held, total=total, bytes_fetched=held * 2**20, mib_per_s=rate, elapsed_s=1.0, done=done
    )


def _plain(buf: io.StringIO) -> str:
    return Text.from_ansi(buf.getvalue()).plain


def test_progress_bar_shows_version_chunks_and_rate():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    with CheckpointProgress(console=console) as bar:
        bar.update(_p(3, rate=12.5))
        bar.progress.refresh()
        assert "checkpoint v7" in _plain(buf) and "3/40" in _plain(buf) and "12.5 MiB/s" in _plain(buf)
        bar.update(_p(17, rate=48.5))
        bar.update(_p(2, total=10, rate=3.5, version=8))  # a second version gets its own bar
        bar.progress.refresh()
    text = _plain(buf)
    assert "17/40" in text and "48.5 MiB/s" in text
    assert "checkpoint v8" in text and "2/10" in text and "3.5 MiB/s" in text
    assert "\x1b[" in buf.getvalue()  # drawn as a live terminal bar


def test_daemon_draws_the_bar_on_a_terminal_and_closes_it_when_done(monkeypatch):
    import rich.console

    from node.ops.daemon import _FetchReporter

    buf = io.StringIO()
    consoles = []

    def console(**kw):
        consoles.append(kw)
        return Console(file=buf, force_terminal=True, width=120)

    monkeypatch.setattr(rich.console, "Console", console)
    rep = _FetchReporter(tty=True)
    rep.update(_p(5, rate=20.5))
    assert rep.bar is not None and consoles == [{"stderr": True}]
    rep.bar.progress.refresh()
    assert "checkpoint v7" in _plain(buf) and "5/40" in _plain(buf) and "20.5 MiB/s" in _plain(buf)
    rep.update(_p(40, rate=33.5, done=True))
    assert rep.bar is None  # closed: the final state was drawn and the terminal given back
    text = _plain(buf)
    assert "40/40" in text and "33.5 MiB/s" in text
    rep.update(_p(40, rate=33.5, done=True))  # reported twice: no new bar
    assert rep.bar is None and len(consoles) == 1
