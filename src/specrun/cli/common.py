"""What every command shares: where output goes, the one stderr console, the one spinner and
pull progress, loading an engine with them, JSON lines."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specrun.cli.console import console
from specrun.cli.progress import PullProgress
from specrun.models.registry import Registry

if TYPE_CHECKING:
    from specrun import session


@dataclass
class Streams:
    """Where things go: stdout carries only text; the rest is for a terminal on stderr."""

    stdout_tty: bool
    stderr_tty: bool

    @classmethod
    def detect(cls) -> Streams:
        return cls(sys.stdout.isatty(), sys.stderr.isatty())


def err_console() -> Any:
    return console()


@contextmanager
def spinner(enabled: bool, text: str) -> Iterator[Callable[[str], None]]:
    """A transient spinner on stderr while something slow happens (a terminal only); yields a
    function that changes its text."""
    console = err_console()
    if not (enabled and console.is_terminal):
        yield lambda _msg: None
        return
    with console.status(text, spinner="dots") as st:
        yield lambda msg: st.update(msg)


def pull_progress(enabled: bool) -> PullProgress | None:
    """The pull's progress bars, on a terminal only (the pull before loading a model)."""
    return PullProgress(lines=False) if enabled else None


def given_on_command_line(ctx: Any, name: str) -> bool:
    """Whether option ``name`` came from the command line (not its default or the environment)."""
    src = ctx.get_parameter_source(name)
    return getattr(src, "name", "") == "COMMANDLINE"


def json_line(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _last_words(line: str) -> None:
    """llama.cpp is about to end the process (an RPC worker was lost mid-run): what was generated
    stays printed, then the one line that says why (exit 1)."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    sys.stderr.write(("\n" if sys.stdout.isatty() else "") + f"specrun: error: {line}\n")
    sys.stderr.flush()


def load_engine(opts: Any, streams: Streams) -> session.Loaded:
    """Resolve (pulling what is missing, with progress bars) and load (with a spinner), on a terminal."""
    from specrun import session

    if opts.rpc:
        from specrun.llama.rpc import set_fatal_handler

        set_fatal_handler(_last_words)

    registry = Registry.load(verbose=opts.verbose)
    progress = pull_progress(streams.stderr_tty)
    try:
        # The first run of a target with no draft probes the drafts found on disk (seconds):
        # said on a terminal, one line a step (pull progress may hold the live display).
        say = (lambda m: print(f"specrun: {m}", file=sys.stderr)) if streams.stderr_tty else None
        plan = session.plan(opts, registry, progress=progress, status=say)
    finally:
        if progress is not None:
            progress.close()
    with spinner(streams.stderr_tty, f"loading {plan.target.name}") as say:
        return session.load(
            plan, opts, status=say, warn=lambda line: print(f"specrun: {line}", file=sys.stderr)
        )
