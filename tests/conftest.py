"""Fixtures every test file may use. Factories they build on live in harness/.

* ``node_home``: an initialised node home (key + config.toml) in the test's tmp folder.
* ``tiny_ctx``: the run context of the tiny test run (harness/roles.py:
  genesis with two validators, tiny Llama, target-length task), cache in tmp.
* ``net``: a :class:`node.p2p.testing.NodeFactory` of real libp2p nodes on
  127.0.0.1, started in the test's own nursery and stopped with it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from node.home import NodeHome
from node.p2p.testing import NodeFactory
from node.roles.context import RunContext

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # Parallel workers (README's fast tier, ``-n``) share the cores: torch's default of one
    # compute thread per core in each would oversubscribe them, and its threads, which meet at a
    # barrier many times an operation, then wait for each other's preempted ones.
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture
def node_home(tmp_path: Path) -> NodeHome:
    home = NodeHome(tmp_path / "home")
    home.init()
    return home


@pytest.fixture
def tiny_ctx(tmp_path: Path) -> RunContext:
    from harness.roles import tiny_context

    return tiny_context(tmp_path / "cache")


@pytest.fixture
async def net() -> AsyncIterator[NodeFactory]:
    async with trio.open_nursery() as nursery:
        factory = NodeFactory(nursery)
        yield factory
        nursery.cancel_scope.cancel()
