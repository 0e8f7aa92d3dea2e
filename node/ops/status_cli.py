"""``primenode status``: read a running node's local status endpoint and print it.

The node writes ``HOME/runtime.json`` (pid, status port, addresses) once it
listens; this command reads it, asks ``http://127.0.0.1:PORT/status`` and
prints rich tables, or (``--json``) the status object as one JSON line.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.errors import ConfigError, NetworkError
from node.home import NodeHome

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table

TIMEOUT_S = 5.0


def fetch_status(home: Path | str, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """The node's status object; NetworkError (one line) when no node runs in ``home``."""
    h = NodeHome(home)
    not_running = NetworkError(f"no running node in {h.path} (start it with primenode join/bootstrap)")
    try:
        runtime = json.loads(h.runtime_path.read_text())
        port = int(runtime["status_port"])
    except FileNotFoundError:
        raise not_running from None
    except (ValueError, KeyError, TypeError, OSError):
        raise ConfigError(f"{h.runtime_path} is unreadable; is a node starting? (else delete it)") from None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=timeout) as r:
            st: dict[str, Any] = json.loads(r.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        raise not_running from None
    except ValueError:
        raise NetworkError(f"127.0.0.1:{port} did not answer with status JSON; is it a primenode?") from None
    st.setdefault("addrs", runtime.get("addrs", []))
    st.setdefault("pid", runtime.get("pid"))
    return st


def show_status(home: Path, as_json: bool) -> None:
    st = fetch_status(home)
    if as_json:
        print(json.dumps(st, default=str))
        return
    from rich.console import Console

    console = Console()
    for table in render(st):
        console.print(table)


# --------------------------------------------------------------------------- rendering
def _short(pid: str | None, n: int = 16) -> str:
    if not pid:
        return "-"
    return pid if len(pid) <= n + 4 else f"{pid[:8]}…{pid[-n + 8 :]}"


def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def _mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _kv_table(title: str, rows: list[tuple[str, Any]]) -> Table:
    from rich.table import Table

    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("key", style="bold")
    t.add_column("value", overflow="fold")
    for k, v in rows:
        t.add_row(k, "-" if v is None else str(v))
    return t


def clock_cell(clock: dict[str, Any]) -> str:
    """This node's clock against its peers' (node/p2p/clock.py): the warning when it is off,
    else the median offset."""
    if clock.get("warning"):
        return f"[bold red]{clock['warning']}[/bold red]"
    ahead, peers = clock.get("ahead_ms"), clock.get("peers", 0)
    if ahead is None:
        return "no peer timestamp seen yet"
    return f"{ahead / 1000:+.1f} s against {peers} peer{'s' if peers != 1 else ''} (median; fine)"


def _sandbox(sb: Any) -> str:
    """The code-reward sandbox line: isolation, bwrap binary and version, checked or not."""
    if not isinstance(sb, dict):
        return str(sb)
    parts = [str(sb.get("isolation", "?")), str(sb.get("version") or sb.get("bwrap") or "")]
    parts.append("checked" if sb.get("ready") else "not checked (no code tasks)")
    return ", ".join(p for p in parts if p)


def render(st: dict[str, Any]) -> list[RenderableType]:
    """The status object as a list of rich renderables."""
    from rich.table import Table

    out: list[RenderableType] = []
    out.append(
        _kv_table(
            "node",
            [
                ("peer id", st.get("peer_id")),
                ("role", st.get("role")),
                ("run", f"{st.get('run_name') or ''} {st.get('run_id', '')}".strip() or None),
                ("uptime", _dur(st.get("uptime_s"))),
                ("addrs", "\n".join(st.get("addrs") or []) or None),
                ("peers", f"{len(st.get('peers') or [])} connected (target {st.get('target_peers', '-')})"),
                *([("reachability", st["nat"].get("summary"))] if st.get("nat") else []),
                *([("clock", clock_cell(st["clock"]))] if st.get("clock") else []),
                *([("sandbox", _sandbox(st["sandbox"]))] if st.get("sandbox") else []),
                *([("error", st["error"])] if st.get("error") else []),
            ],
        )
    )

    peers = Table(title="connected peers", title_justify="left")
    for col in ("peer id", "role", "address", "latency"):
        peers.add_column(col)
    for p in st.get("peers") or []:
        lat = p.get("latency_ms")
        peers.add_row(
            _short(p.get("peer_id")),
            str(p.get("role") or "?") + (" (banned)" if p.get("banned") else ""),
            str(p.get("addr") or "-"),
            "-" if lat is None else f"{lat:.1f} ms",
        )
    out.append(peers)

    g = st.get("gossip") or {}
    gt = Table(title="gossip", title_justify="left")
    for col in ("topic", "received", "relayed", "published"):
        gt.add_column(col)
    topics = sorted(
        set(g.get("received_by_topic", {})) | set(g.get("relayed_by_topic", {})) | set(g.get("published_by_topic", {}))
    )
    for t in topics:
        gt.add_row(
            t,
            str(g.get("received_by_topic", {}).get(t, 0)),
            str(g.get("relayed_by_topic", {}).get(t, 0)),
            str(g.get("published_by_topic", {}).get(t, 0)),
        )
    gt.add_row("[bold]all[/bold]", str(g.get("received", 0)), str(g.get("relayed", 0)), str(g.get("published", 0)))
    out.append(gt)
    dropped = g.get("dropped_by_reason") or {}
    if dropped:
        out.append(_kv_table("gossip dropped, by reason", sorted(dropped.items(), key=lambda kv: -kv[1])))
    bans = st.get("bans")
    if bans:
        rows = []
        for pid, b in bans.items() if isinstance(bans, dict) else ((str(b), {}) for b in bans):
            b = b if isinstance(b, dict) else {"reason": b}
            rows.append((_short(pid), f"{b.get('reason', '')} ({_dur(b.get('seconds_left'))} left)"))
        out.append(_kv_table("banned peers", rows))

    sw = st.get("swarm") or {}
    swt = Table(title=f"swarm view ({sw.get('size', 0)} peers heard from)", title_justify="left")
    for col in ("role", "peers", "policy versions", "batches"):
        swt.add_column(col)
    by_role: dict[str, list[dict[str, Any]]] = {}
    for p in sw.get("peers") or []:
        by_role.setdefault(str(p.get("role")), []).append(p)
    for role in sorted(set(by_role) | set(sw.get("by_role", {}))):
        ps = by_role.get(role, [])
        versions = sorted({int(p["policy_version"]) for p in ps if p.get("policy_version", -1) >= 0})
        swt.add_row(
            role,
            str(sw.get("by_role", {}).get(role, len(ps))),
            ", ".join(map(str, versions)) or "-",
            str(sum(int(p.get("batches") or 0) for p in ps)),
        )
    out.append(swt)

    out.extend(render_role_state(st.get("role") or "", st.get("role_state") or {}))
    return out


FED_FROM_SHOWN = 8  # peers listed per version in the table; --json has them all


def _fed_from(fed: Any, fed_bytes: Any = None) -> str:
    """The peers a version was fetched from: count, then short peer ids with the bytes each
    sent (most first), e.g. ``2 peers`` / ``12D3KooW…x1y2z3w4 3.0 MiB``."""
    if fed is None and not fed_bytes:
        return "-"
    if not isinstance(fed, (list, tuple, dict)):
        return str(fed)
    sizes: dict[str, Any] = dict(fed) if isinstance(fed, dict) else {}
    if isinstance(fed_bytes, dict):
        sizes.update(fed_bytes)
    peers = list(dict.fromkeys([*fed, *sizes]))
    if not peers:
        return "-"
    peers.sort(key=lambda p: -sizes[p] if isinstance(sizes.get(p), (int, float)) else 0)
    lines = [f"{len(peers)} peer" + ("" if len(peers) == 1 else "s")]
    for p in peers[:FED_FROM_SHOWN]:
        b = sizes.get(p)
        lines.append(_short(str(p)) + (f" {_mib(b)}" if isinstance(b, (int, float)) else ""))
    if len(peers) > FED_FROM_SHOWN:
        lines.append(f"+{len(peers) - FED_FROM_SHOWN} more (--json)")
    return "\n".join(lines)


def _reasons(counts: dict[str, Any]) -> str:
    """``{reason: n}`` as ``n in all`` (0 when nothing was discarded)."""
    return f"{sum(int(v) for v in counts.values())} in all"


def _staleness_rows(by: Any) -> list[tuple[str, Any]]:
    """The last step's importance ratios and clip fraction, one row per staleness."""
    if not isinstance(by, dict):
        return []
    rows = []
    for s, st in sorted(by.items(), key=lambda kv: int(kv[0])):
        if not isinstance(st, dict):
            continue
        rows.append(
            (
                f"last step: {s} versions behind",
                f"{st.get('rollouts', 0)} rollouts, {st.get('tokens', 0)} tokens, ratio mean "
                f"{st.get('ratio_mean', 1.0):.4f} [{st.get('ratio_min', 1.0):.3f}, {st.get('ratio_max', 1.0):.3f}], "
                f"clipped {100 * st.get('clip_fraction', 0.0):.1f}%",
            )
        )
    return rows


def render_role_state(role: str, rs: dict[str, Any]) -> list[RenderableType]:
    from rich.table import Table

    out: list[RenderableType] = []
    rs = dict(rs)
    checkpoints = rs.pop("distribution", None)
    if role == "trainer":
        rows = [
            (k, rs.get(k))
            for k in (
                "step",
                "target_steps",
                "reward_mean",
                "admitted",
                "rejected",
                "pending",
                "buffer",
                "trained_batches",
            )
        ]
        discarded = rs.get("discarded_batches")
        if isinstance(discarded, dict):
            rows.append(("discarded batches", _reasons(discarded)))
            rows += [(f"discarded: {k}", v) for k, v in sorted(discarded.items(), key=lambda kv: -kv[1])]
        rows += [(k, rs.get(k)) for k in ("restored_after_crash", "dropped_announces")]
        last_eval = rs.get("last_eval")
        if isinstance(last_eval, dict):  # the trainer's newest held-out evaluation ([config] eval_every)
            lo, hi = last_eval.get("pass@1_ci95") or ("?", "?")
            rows.append(
                (
                    "held-out eval",
                    f"v{last_eval.get('policy_version')}: pass@1 {last_eval.get('pass@1')} [{lo}, {hi}], "
                    f"reward {last_eval.get('reward_mean')} over {last_eval.get('problems')} problems "
                    f"x {last_eval.get('samples')}",
                )
            )
        for k, v in (rs.get("last_step") or {}).items():
            if k == "by_staleness":
                rows += _staleness_rows(v)
            else:
                rows.append((f"last step: {k}", json.dumps(v) if isinstance(v, (dict, list)) else v))
        out.append(_kv_table("trainer", rows))
    elif role == "worker":
        keys = ["policy_version"] + [k for k in rs if k.startswith("batches")] + ["tamper"]
        rows = [(k, rs.get(k)) for k in keys if k in rs]
        rows += [(k, v) for k, v in rs.items() if k not in keys and not isinstance(v, (dict, list))]
        spent = rs.get("spent_s")
        if isinstance(spent, dict) and spent:  # where the wall time went (utilization = generate's share)
            rows.append(
                ("time spent", ", ".join(f"{k} {v:.0f} s" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])))
            )
        out.append(_kv_table("worker", rows))
    elif role == "validator":
        verdicts = rs.get("verdicts") or {}
        rows = [
            ("policy_version", rs.get("policy_version")),
            ("verdicts", ", ".join(f"{k} {v}" for k, v in sorted(verdicts.items())) or "none yet"),
            ("queued", rs.get("queued")),
            ("dropped announces", rs.get("dropped_announces")),
            ("last verify", None if rs.get("last_verify_s") is None else f"{rs['last_verify_s']:.2f} s"),
        ]
        rows += [(f"reason: {k}", v) for k, v in sorted((rs.get("reasons") or {}).items(), key=lambda kv: -kv[1])]
        out.append(_kv_table("validator", rows))
        recent = rs.get("recent_rejections") or []
        if recent:
            t = Table(title="recent rejections", title_justify="left")
            t.add_column("rejection", overflow="fold")
            for r in recent[-10:]:
                t.add_row(json.dumps(r, default=str) if not isinstance(r, str) else r)
            out.append(t)
    elif rs:
        out.append(
            _kv_table(
                role or "role",
                [(k, json.dumps(v, default=str) if isinstance(v, (dict, list)) else v) for k, v in rs.items()],
            )
        )

    if checkpoints:
        t = Table(
            title=(
                f"checkpoint distribution (data port {checkpoints.get('data_port', '-')}, "
                f"served {_mib(checkpoints.get('bytes_served'))})"
            ),
            title_justify="left",
        )
        for col in ("version", "chunks", "complete", "served", "fetched", "fed from", "rate"):
            t.add_column(col)
        for v in checkpoints.get("versions") or []:
            fed_s = _fed_from(v.get("fed_from"), v.get("fed_from_bytes"))
            t.add_row(
                str(v.get("version")),
                f"{v.get('chunks_held', 0)}/{v.get('chunks_total', 0)}",
                "yes" if v.get("complete") else ("fetching" if v.get("fetching") else "no"),
                _mib(v.get("bytes_served")),
                _mib(v.get("bytes_fetched")),
                fed_s,
                f"{v.get('mib_per_s', 0.0):.1f} MiB/s" if v.get("fetching") else "-",
            )
        if not checkpoints.get("versions"):
            t.add_row("-", "no checkpoint yet", "", "", "", "", "")
        out.append(t)
    return out
