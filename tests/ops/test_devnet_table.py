"""The devnet's live table, rendered from canned status objects (no processes)."""

from __future__ import annotations

import io

from rich.console import Console

from node.ops.devnet import COMPACT_COLUMNS, TABLE_COLUMNS, live_view, staleness_cell, status_table

DIST = {"versions": [{"version": 3, "chunks_held": 2, "chunks_total": 2, "complete": True}]}
SNAP = {
    "bootstrap": {"peer_id": "12D3KooWboot", "role": "bootstrap", "peers": [{}, {}, {}], "role_state": {}},
    "trainer": {
        "peers": [{}] * 4,
        "role_state": {
            "step": 3,
            "policy_version": 3,
            "target_steps": 40,
            "reward_mean": 0.45678,
            "admitted": 17,
            "rejected": 5,
            "pending": 1,
            "buffer": 2,
            "trained_batches": 3,
            "discarded_batches": {"stale before training": 2},
            "restored_after_crash": 0,
            "dropped_announces": 0,
            "last_step": {
                "loss": 0.1,
                "by_staleness": {
                    "0": {"rollouts": 64, "tokens": 900, "ratio_mean": 1.0, "clip_fraction": 0.0},
                    "2": {"rollouts": 64, "tokens": 850, "ratio_mean": 0.9621, "clip_fraction": 0.071},
                },
            },
            "distribution": DIST,
        },
    },
    "worker-0": {
        "peers": [{}] * 4,
        "role_state": {
            "policy_version": 2,
            "batches_produced": 9,
            "utilization": 0.934,
            "batches_accepted": 6,
            "batches_rejected": 1,
            "batches_served": 12,
            "accept_votes": 12,
            "reject_votes": 2,
            "tamper": None,
            "distribution": DIST,
        },
    },
    "validator-0": {
        "peers": [{}] * 4,
        "role_state": {
            "policy_version": 3,
            "verdicts": {"accept": 11, "reject": 4, "unverifiable": 1},
            "reasons": {"toploc": 3, "stale": 1},
            "recent_rejections": ["12D3KooWxxxx: toploc: sample 0"],
            "distribution": DIST,
        },
    },
    "validator-1": None,  # not answering (starting, or killed)
}
NODES = [
    ("bootstrap", "bootstrap", True),
    ("trainer", "trainer", True),
    ("worker-0", "worker", True),
    ("validator-0", "validator", True),
    ("validator-1", "validator", False),
]


def rendered(width: int) -> tuple[str, dict[str, list[str]]]:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(status_table(NODES, SNAP, "devnet step 3/40"))
    rows = {}
    for line in out.getvalue().splitlines():
        cells = [c.strip() for c in line.strip().strip("│┃").split("│" if "│" in line else "┃")]
        if cells and cells[0] in {name for name, _, _ in NODES} | {"node"}:
            rows[cells[0]] = cells
    return out.getvalue(), rows


def test_each_role_fills_its_own_columns():
    text, rows = rendered(200)
    assert rows["node"] == list(TABLE_COLUMNS)
    col = {name: i for i, name in enumerate(TABLE_COLUMNS)}
    tr, wk, va, dead, boot = (rows[n] for n in ("trainer", "worker-0", "validator-0", "validator-1", "bootstrap"))
    assert (tr[col["version"]], tr[col["step"]], tr[col["reward"]]) == ("3", "3/40", "0.457")
    assert (tr[col["accepted"]], tr[col["rejected"]]) == ("17", "5")  # the trainer's ledger: admitted, rejected
    # batches trained on, and those admitted but discarded (by reason); ratios per staleness
    assert "".join(tr[col["used"]].split()).startswith("3(+2")
    assert tr[col["reasons"]].startswith("stale before")
    assert tr[col["ratios"]].startswith("s0 1.000/0%"), text
    by_staleness = SNAP["trainer"]["role_state"]["last_step"]["by_staleness"]
    assert staleness_cell(by_staleness) == "s0 1.000/0% s2 0.962/7%"  # mean ratio / clipped, per staleness
    assert (wk[col["used"]], wk[col["ratios"]], va[col["ratios"]]) == ("-", "-", "-")
    assert (wk[col["version"]], wk[col["produced"]], wk[col["accepted"]], wk[col["rejected"]]) == ("2", "9", "6", "1")
    assert (wk[col["busy"]], tr[col["busy"]]) == ("93%", "-")  # a worker's share of wall time generating
    assert (va[col["version"]], va[col["accepted"]], va[col["rejected"]]) == ("3", "11", "4")  # its verdicts
    assert va[col["reasons"]] == "toploc 3, stale 1, unverifiable 1 (no vote)"
    assert (dead[col["alive"]], dead[col["peers"]], dead[col["version"]], dead[col["reasons"]]) == ("no", "-", "-", "-")
    assert (boot[col["peers"]], boot[col["version"]], boot[col["step"]]) == ("3", "-", "-")


def test_a_narrow_terminal_folds_cells_instead_of_cutting_them():
    text, rows = rendered(100)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert rows["trainer"][TABLE_COLUMNS.index("rejected")] == "5"
    squeezed = "".join(ch for ch in text if ch.isalnum())
    for word in ("toploc3", "stale1", "unverifiable1"):
        assert word in squeezed, squeezed


def test_an_80_column_terminal_gets_one_line_per_node_and_the_free_text_below():
    """The live view at 80 columns (the full table folded every cell letter by letter there):
    each node's short cells on one line of a table, ratios and reasons on a line of their own."""
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(live_view(NODES, SNAP, "devnet  step 3/40", 80))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    table: dict[str, list[str]] = {}  # each node's first line: its table row (its notes line comes after)
    for line in lines:
        if line.split() and line.split()[0] in SNAP:
            table.setdefault(line.split()[0], line.split())
    heads = next(line.split() for line in lines if line.split()[:2] == ["node", "up"])
    assert heads == list(COMPACT_COLUMNS.values())
    assert table["trainer"][: heads.index("used") + 1] == [
        "trainer",
        "yes",
        "4",
        "3",
        "3/40",
        "0.457",
        "-",
        "-",
        "17",
        "5",
        "3",
    ]
    assert table["worker-0"] == ["worker-0", "yes", "4", "2", "-", "-", "9", "93%", "6", "1", "-"]
    assert table["validator-1"] == ["validator-1", "no", "-", "-", "-", "-", "-", "-", "-", "-", "-"]
    text = out.getvalue()
    assert "ratios s0 1.000/0% s2 0.962/7%; reasons stale before training 2" in text
    assert "reasons toploc 3, stale 1, unverifiable 1 (no vote)" in text
    # where the whole table fits, the live view is the full table
    assert isinstance(live_view(NODES, SNAP, "devnet", 200), type(status_table(NODES, SNAP)))
