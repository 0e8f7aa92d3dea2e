"""docs/grafana-dashboard.json queries only metrics a running node exports, and shows them all.

The board's PromQL is parsed for ``primenode_*`` names; a real ``primenode bootstrap``
process is scraped at ``/metrics`` on its status port and its exposition parsed with
prometheus_client's own parser. A metric renamed in the code, or a typo on the board,
fails here rather than as an empty panel in an operator's Grafana.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from harness.processes import HANG_GUARD_S, init_run, start, stop, wait_for
from node.home import NodeHome

BOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
NAME = re.compile(r"\bprimenode_[a-zA-Z0-9_]+\b")


def queried_names(board: dict) -> set[str]:
    """Every ``primenode_*`` name in the board's panel queries and template variables."""
    texts = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for var in board.get("templating", {}).get("list", []):
        q = var.get("query")
        texts.append(q.get("query", "") if isinstance(q, dict) else str(q or ""))
    return {m for text in texts for m in NAME.findall(text)}


def exported_names(exposition: str) -> dict[str, str]:
    """Sample name -> its family, for every primenode family the node declares (a counter's
    samples are ``<name>_total``; a labelled family with no sample yet still counts)."""
    out: dict[str, str] = {}
    for fam in text_string_to_metric_families(exposition):
        # ``_created``: a counter's creation time (the parser makes an unlabelled one its own
        # family), nothing to chart
        if not fam.name.startswith("primenode_") or fam.name.endswith("_created"):
            continue
        out[fam.name + "_total" if fam.type == "counter" else fam.name] = fam.name
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out[s.name] = fam.name
    return out


def test_the_board_parses_and_every_panel_queries_something():
    board = json.loads(BOARD.read_text())
    assert board["panels"] and all(p.get("targets") for p in board["panels"])
    names = queried_names(board)
    assert "primenode_reqresp_total" in names and "primenode_uptime_seconds" in names, names


def test_every_queried_metric_is_exported_by_a_running_node_and_every_exported_one_is_shown(tmp_path):
    boot, _, genesis = init_run(tmp_path, "grafana-run")
    proc = start("bootstrap", "--home", str(boot), "--genesis", str(genesis), log=tmp_path / "boot.log")
    try:
        runtime = NodeHome(boot).runtime_path
        wait_for(runtime.exists, HANG_GUARD_S, "the bootstrap", [tmp_path / "boot.log"], [proc])
        port = json.loads(runtime.read_text())["status_port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            exposition = r.read().decode()
    finally:
        stop(proc)
    exported = exported_names(exposition)
    queried = queried_names(json.loads(BOARD.read_text()))
    assert queried - set(exported) == set(), f"queried but not exported: {sorted(queried - set(exported))}"
    shown = {exported[n] for n in queried}
    assert set(exported.values()) - shown == set(), f"exported but on no panel: {set(exported.values()) - shown}"
