"""The CLI's checkpoint progress bar (rich): version, chunks held/total, MiB/s.

with CheckpointProgress() as bar:
    checkpoints.progress_callbacks.append(bar.update)
    ...
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from node.checkpoints.fetcher import FetchProgress


class CheckpointProgress:
    def __init__(self, console: Console | None = None) -> None:
        self.progress = Progress(
            TextColumn("checkpoint v{task.fields[version]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("chunks  {task.fields[rate]:>7.1f} MiB/s"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.tasks: dict[int, TaskID] = {}

    # Rows (versions) shown at once: a node that is always fetching keeps one bar open for
    # the whole run, and a row per version ever fetched would grow without bound.
    MAX_ROWS = 4

    def __enter__(self) -> CheckpointProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def update(self, p: FetchProgress) -> None:
        task = self.tasks.get(p.version)
        if task is None:
            task = self.tasks[p.version] = self.progress.add_task("", total=p.total, version=p.version, rate=0.0)
            while len(self.tasks) > self.MAX_ROWS:
                self.progress.remove_task(self.tasks.pop(min(self.tasks)))
        self.progress.update(task, completed=p.held, total=p.total, rate=p.mib_per_s)
