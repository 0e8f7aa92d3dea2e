"""``primenode status``: read a running node's local status endpoint and print it."""

from __future__ import annotations

from pathlib import Path

from .errors import NodeError


def show_status(home: Path, as_json: bool) -> None:
    raise NodeError("status is not implemented yet")
