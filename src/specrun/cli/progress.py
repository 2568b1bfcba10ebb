"""The one download progress: a ProgressFn (the registry's ``(description, bytes_done,
bytes_total)`` callbacks) for ``models pull`` and for the pull that generate, chat and bench do
before loading."""

from __future__ import annotations

import sys
from typing import Any

from specrun.cli.console import console as make_console


class PullProgress:
    """A transient Rich bar on a terminal (stderr), showing the current step alone; elsewhere one
    line per step (``specrun: downloading ...``) when ``lines``, else nothing. Starts drawing at
    the first report, so a model already present draws nothing; ``close`` (or leaving the
    ``with`` block) takes the bar away."""

    def __init__(self, console: Any = None, lines: bool = True) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.console = console or make_console()
        self.live = self.console.is_terminal
        self.lines = lines
        self.tasks: dict[str, Any] = {}
        self._started = False
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )

    def __enter__(self) -> PullProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, desc: str, done: int, total: int | None) -> None:
        if self.live and not self._started:
            self.progress.start()
            self._started = True
        tid = self.tasks.get(desc)
        if tid is None:
            if not self.live and self.lines:
                print(f"specrun: {desc}", file=sys.stderr, flush=True)
            for other in self.tasks.values():
                self.progress.update(other, visible=False)
            tid = self.tasks[desc] = self.progress.add_task(desc, total=total)
        self.progress.update(tid, completed=done, total=total)

    def close(self) -> None:
        if self._started:
            self.progress.stop()
            self._started = False
