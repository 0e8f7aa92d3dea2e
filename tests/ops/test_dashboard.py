"""The web dashboard each node serves at ``GET /`` (node/ops/dashboard.html).

It must work offline (nothing fetched from elsewhere) and, in a real headless browser
(Debian's chromium, which .ci/run installs), show the live values of a running devnet
node. The browser's screenshot is kept: under ``$PRIMENODE_TEST_ARTIFACTS`` when set,
else in the test's tmp folder. Without chromium the browser test skips, except where
``PRIMENODE_REQUIRE_BROWSER=1`` (CI) makes it fail.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from harness.processes import small_options
from harness.processes import wait_for_devnet as wait_for
from node.ops.churn import trainer_step
from node.ops.devnet import Devnet
from node.ops.status_server import dashboard_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_page_fetches_nothing_from_elsewhere():
    page = dashboard_html().decode()
    assert "<script src" not in page and "<link" not in page and "@import" not in page and "url(" not in page
    # the only absolute URL is SVG's namespace name, an identifier nothing fetches
    assert set(re.findall(r"https?://[^\s\"'`)]+", page)) == {"http://www.w3.org/2000/svg"}
    assert 'fetch("/status"' in page and "setTimeout(poll" in page  # polls its own node, refreshes itself


def _cell(dom: str, ident: str) -> str:
    m = re.search(rf'id="{ident}"[^>]*>([^<]*)<', dom)
    assert m, f"no #{ident} in the page"
    return html.unescape(m[1]).strip()


def _browser(url: str, *args: str) -> str:
    """Headless chromium, JavaScript on; virtual time lets the page's first polls run."""
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=6000", *args, url]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


@pytest.mark.slow  # ~35 s on two quiet cores: the slow tier (README)
def test_a_browser_shows_the_live_values_of_a_devnet_trainer(tmp_path):
    if CHROMIUM is None:
        if os.environ.get("PRIMENODE_REQUIRE_BROWSER") == "1":
            pytest.fail("chromium is not installed (apt-get install chromium)")
        pytest.skip("chromium is not installed")
    artifacts = Path(os.environ.get("PRIMENODE_TEST_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    devnet = Devnet(small_options(tmp_path, workers=1, validators=1, quorum=1))
    devnet.prepare()
    devnet.start_all()
    try:
        wait_for(lambda: trainer_step(devnet) >= 1, 300, "the trainer's first step", devnet)
        trainer = devnet.node("trainer")
        before = trainer.status()
        assert before is not None
        port = before_port = _status_port(trainer)
        url = f"http://127.0.0.1:{port}/"
        with urllib.request.urlopen(url, timeout=30) as r:
            assert r.headers["Content-Type"].startswith("text/html")
        dom = _browser(url, "--dump-dom")
        _browser(url, f"--screenshot={artifacts / 'dashboard.png'}", "--window-size=1200,1000")
        after = trainer.status()
        assert after is not None and _status_port(trainer) == before_port
    finally:
        devnet.stop_all()
    assert _cell(dom, "role") == "trainer"
    assert _cell(dom, "peer-id") == before["peer_id"]
    assert _cell(dom, "run") == before["run_name"]
    rs0, rs1 = before["role_state"], after["role_state"]
    step = int(_cell(dom, "step").split("/")[0])  # "3/1000": live, between the two reads
    assert rs0["step"] <= step <= rs1["step"], (rs0["step"], step, rs1["step"])
    assert rs0["policy_version"] <= int(_cell(dom, "version")) <= rs1["policy_version"]
    assert re.fullmatch(r"-?\d+\.\d{3}", _cell(dom, "reward"))
    peers = int(_cell(dom, "peers-count"))
    assert peers >= 1 and peers <= 3  # bootstrap, worker, validator
    assert _cell(dom, "updated") not in ("never", "") and "not answering" not in _cell(dom, "updated")
    assert (artifacts / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _status_port(node) -> int:
    import json

    return int(json.loads(node.home.runtime_path.read_text())["status_port"])
