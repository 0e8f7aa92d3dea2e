"""Entry points behind ``primenode bootstrap`` and ``primenode join``.

The P2P overlay (issue 3) replaces these with real daemons.
"""

from __future__ import annotations

from .errors import NodeError


def run_bootstrap(**kwargs) -> None:
    raise NodeError("bootstrap is not implemented yet")


def run_join(**kwargs) -> None:
    raise NodeError(f"join --role {kwargs.get('role')} is not implemented yet")
