"""Testing helpers for the checkpoints (used by tests/ and bench/fuzz_atheris.py)."""

from __future__ import annotations

from typing import Any

from node.checkpoints.schedule import FetchPeer


class RecordingPeer(FetchPeer):
    """A FetchPeer that keeps every error the fetcher records for it (a later strike
    overwrites ``last_error``), so a fuzz harness can check each outcome was one of ours."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "last_error" and value:
            self.__dict__.setdefault("errors", []).append(value)
        super().__setattr__(name, value)

    @property
    def errors(self) -> list[str]:
        errors: list[str] = self.__dict__.get("errors", [])
        return errors
