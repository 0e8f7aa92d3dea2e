"""The js-libp2p peer process, started once per test module (see jspeer.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.interop.jspeer import JsPeer, require_js


@pytest.fixture(scope="module")
def js() -> Iterator[JsPeer]:
    require_js()
    peer = JsPeer()
    try:
        yield peer
    finally:
        peer.close()
