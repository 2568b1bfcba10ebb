"""A Rich progress bar on stderr that the registry's ProgressFn callbacks drive."""

from __future__ import annotations

from typing import Any


class RichPullProgress:
    """Callable as ``(description, bytes_done, bytes_total)``; one bar per description."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), console=Console(stderr=True), transient=True,
        )
        self._tasks: dict[str, Any] = {}
        self._started = False

    def __call__(self, desc: str, done: int, total: int | None) -> None:
        if not self._started:
            self._progress.start()
            self._started = True
        task = self._tasks.get(desc)
        if task is None:
            task = self._tasks[desc] = self._progress.add_task(desc, total=total)
        self._progress.update(task, completed=done, total=total)

    def close(self) -> None:
        if self._started:
            self._progress.stop()
            self._started = False
