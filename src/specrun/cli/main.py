"""The command line: parse, resolve models, choose the display. No math, no llama calls here."""

from __future__ import annotations

import os
import signal
import sys
from importlib import metadata
from typing import Annotated

import typer

from specrun import __version__
from specrun.cli.bench import register as register_bench
from specrun.cli.chat import register as register_chat
from specrun.cli.draft import register as register_draft
from specrun.cli.generate import register as register_generate
from specrun.cli.info import register as register_info
from specrun.cli.models import app as models_app
from specrun.cli.serve import register as register_serve
from specrun.cli.worker import register as register_worker
from specrun.errors import SpecrunError

app = typer.Typer(
    name="specrun",
    help="Speculative decoding for local GGUF models: the target's exact output, faster.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if not value:
        return
    try:
        llama = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        llama = "not installed"
    typer.echo(f"specrun {__version__} (llama-cpp-python {llama})")
    raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            "-V",
            callback=_print_version,
            is_eager=True,
            help="Print specrun's version and llama-cpp-python's, and exit.",
        ),
    ] = False,
) -> None:
    pass


def _mount_subcommands() -> None:
    register_generate(app)
    app.add_typer(models_app, name="models", help="List, pull, locate and remove registry models.")
    register_chat(app)
    register_bench(app)
    register_draft(app)
    register_info(app)
    register_serve(app)
    register_worker(app)


_mounted = False


def main(argv: list[str] | None = None) -> int:
    """Entry point: domain errors become one line on stderr and an exit code, never a traceback."""
    global _mounted
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or bool(os.environ.get("SPECRUN_DEBUG"))
    args = [a for a in args if a != "--debug"]
    if not _mounted:
        _mount_subcommands()
        _mounted = True
    # SIGTERM unwinds like Ctrl-C so temp files are removed by the finally blocks on the way out.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    try:
        rc = app(args=args, standalone_mode=False, prog_name="specrun")
        if rc == 130:  # click turned a Ctrl-C into Exit(130) and returned it
            _flush_quietly()
            sys.stderr.write("\nspecrun: interrupted\n")
        if isinstance(rc, int):
            return rc
    except SpecrunError as exc:
        if debug:
            raise
        _flush_quietly()
        print(f"specrun: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        _flush_quietly()
        sys.stderr.write("\nspecrun: interrupted\n")
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as a C tool killed by SIGPIPE would.
        _silence_stdout()
        return 141
    except typer.Exit as exc:
        return int(exc.exit_code or 0)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception as exc:
        # Usage errors from the option parser (click's, or the copy Typer vendors): its own
        # message and exit code 2.
        if hasattr(exc, "show") and isinstance(getattr(exc, "exit_code", None), int):
            exc.show(file=sys.stderr)
            return int(getattr(exc, "exit_code", 2))
        if type(exc).__name__ == "Abort":
            sys.stderr.write("\nspecrun: interrupted\n")
            return 130
        if debug:
            raise
        print(
            f"specrun: internal error: {type(exc).__name__}: {exc} (rerun with --debug)",
            file=sys.stderr,
        )
        return 1
    return 0


def _flush_quietly() -> None:
    try:
        sys.stdout.flush()
    except (BrokenPipeError, OSError, ValueError):
        _silence_stdout()


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def entry() -> None:
    code = main()
    _flush_quietly()
    sys.exit(code)


if __name__ == "__main__":
    entry()
