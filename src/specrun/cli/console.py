"""The one place a Rich console is made: every display, table, spinner and progress bar of the
command line draws on a console from here."""

from __future__ import annotations

from typing import Any

from rich.console import Console


def console(*, stderr: bool = True, **kw: Any) -> Any:
    """A Rich console: stderr unless told, numbers not highlighted (``kw``: Rich's own, e.g.
    file, width, force_terminal)."""
    kw.setdefault("highlight", False)
    return Console(stderr=stderr, **kw)
