"""Testing helpers for the data plane (used by tests/ and bench/fuzz_atheris.py)."""

from __future__ import annotations

from node.checkpoints.fetcher import FetchPeer


class RecordingPeer(FetchPeer):
    """A FetchPeer that keeps every error the fetcher records for it (a later strike
    overwrites ``last_error``), so a fuzz harness can check each outcome was one of ours."""

    def __setattr__(self, name, value):
        if name == "last_error" and value:
            self.__dict__.setdefault("errors", []).append(value)
        super().__setattr__(name, value)

    @property
    def errors(self) -> list[str]:
        return self.__dict__.get("errors", [])
