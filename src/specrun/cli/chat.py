"""`specrun chat`: the terminal side of a chat session (line editing, history, Ctrl-C, display).
The conversation logic is in chat.py."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

from specrun.cli.common import Streams, load_engine
from specrun.cli.options import TemplateKwargs, model_options, sampling_options
from specrun.errors import SpecrunError, UsageError
from specrun.paths import state_dir

PROMPT = ">>> "
CONT = "... "


class _SigintGuard:
    """During a reply: the first Ctrl-C asks the loop to stop after the current target pass (so
    the engine is closed at a clean point and its caches match the transcript); a second one
    interrupts at once."""

    def __init__(self) -> None:
        self.hits = 0
        self.armed = True  # off while the engine is being closed: that must run to the end
        self._old: Any = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.hits += 1
        if self.hits > 1 and self.armed:
            raise KeyboardInterrupt

    def __enter__(self) -> _SigintGuard:
        self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._old)


def _setup_readline(path: Path | None) -> Any:
    try:
        import readline
    except ImportError:  # pragma: no cover - Windows without pyreadline
        return None
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.read_history_file(path)
        except OSError:
            pass
    readline.set_history_length(2000)
    return readline


def _save_history(rl: Any, path: Path | None) -> None:
    if rl is None or path is None:
        return
    try:
        rl.write_history_file(path)
    except OSError:
        pass


def register(app: typer.Typer) -> None:
    @app.command()
    @sampling_options(temp=0.8)
    @model_options()
    def chat(
        system: Annotated[str | None, typer.Option("--system", help="System message.")] = None,
        template_kwargs: TemplateKwargs = None,
        max_tokens: Annotated[
            int, typer.Option("-n", "--max-tokens", help="Tokens per reply at most.")
        ] = 512,
        live: Annotated[
            bool | None,
            typer.Option(
                "--live/--no-live",
                help="Live acceptance footer while a reply streams (default: on a terminal).",
            ),
        ] = None,
        color: Annotated[
            bool | None,
            typer.Option(
                "--color/--no-color",
                help="Colour accepted draft tokens and the target's own tokens apart (default: on a terminal, unless NO_COLOR).",
            ),
        ] = None,
        stats: Annotated[
            bool, typer.Option("--stats", help="A one-line summary on stderr after each reply.")
        ] = False,
        history: Annotated[
            Path | None,
            typer.Option(
                "--history", help="Line history file (default: STATE_DIR/chat_history; '-' = none)."
            ),
        ] = None,
        opts: Any = None,
        params: Any = None,
    ) -> None:
        """Interactive chat with the target's template; each turn evaluates only its new tokens.

        Type /help inside for the commands. Multi-line input: end a line with a backslash, or
        open a block with \"\"\" and close it with \"\"\". Ctrl-C stops a reply, Ctrl-D exits.
        """
        if max_tokens < 1:
            raise UsageError(f"--max-tokens must be >= 1, got {max_tokens}")
        from specrun.chat_template import parse_kwargs

        extra = parse_kwargs(template_kwargs, template=opts.template_source())
        streams = Streams.detect()
        loaded = load_engine(opts, streams)
        try:
            _run(
                loaded,
                params,
                max_tokens,
                system,
                live,
                color,
                stats,
                streams,
                None if str(history) == "-" else (history or state_dir() / "chat_history"),
                extra,
            )
        finally:
            loaded.close()


def _run(
    loaded: Any,
    params: Any,
    max_tokens: int,
    system: str | None,
    live: bool | None,
    color: bool | None,
    stats: bool,
    streams: Streams,
    history: Path | None,
    template_kwargs: dict[str, Any] | None = None,
) -> None:
    from specrun.chat import ChatSession, handle_command, read_message
    from specrun.cli.display import sink_for as make_sink
    from specrun.decoding.engine import Result
    from specrun.session import describe

    engine = loaded.engine
    stdin_tty = sys.stdin.isatty()

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def out(msg: str) -> None:
        print(msg, flush=True)

    info = {"target": describe(loaded.plan.target), "draft": describe(loaded.plan.draft)}
    session = ChatSession(
        engine,
        params=params,
        max_tokens=max_tokens,
        system=system,
        notice=lambda m: say(f"specrun: {m}"),
        info=info,
        template_kwargs=template_kwargs,
    )
    if streams.stderr_tty:
        draft = (
            f" + draft {loaded.plan.draft.name}"
            if loaded.plan.draft and engine.mode != "none"
            else ""
        )
        k = f" K={engine.config.draft_max}" if engine.mode != "none" else ""
        say(
            f"specrun chat: {loaded.plan.target.name}{draft} · mode {engine.mode}{k} · "
            f"temp {params.temp} · seed {params.seed} · context {session.n_ctx}\n"
            '/help for commands, """ or a trailing \\ for multi-line input, Ctrl-C stops a reply, Ctrl-D exits'
        )

    rl = _setup_readline(history) if stdin_tty else None
    use_prompt = stdin_tty and streams.stdout_tty

    def read_line(prompt: str) -> str:
        if use_prompt:
            return input(prompt)
        if stdin_tty:  # stdout redirected: keep it for replies, prompt on stderr
            sys.stderr.write(prompt)
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    try:
        while True:
            try:
                text = read_message(read_line, PROMPT, CONT)
            except KeyboardInterrupt:  # at the prompt: drop the line, as a shell does
                sys.stderr.write("^C\n" if not use_prompt else "\n")
                continue
            except EOFError:
                if use_prompt:
                    sys.stdout.write("\n")
                break
            if not text.strip():
                continue
            if text.startswith("/") and not text.startswith("//"):
                try:
                    if not handle_command(session, text, say, out):
                        break
                except SpecrunError as exc:
                    say(f"specrun: error: {exc}")
                continue
            if text.startswith("//"):
                text = text[1:]
            _reply(session, text, make_sink, Result, live, color, stats, streams, say)
    finally:
        _save_history(rl, history)


def _reply(
    session: Any,
    text: str,
    make_sink: Any,
    result_type: Any,
    live: bool | None,
    color: bool | None,
    stats: bool,
    streams: Streams,
    say: Any,
) -> None:
    engine = session.engine
    sink = make_sink(
        engine,
        live=live,
        color=color,
        stdout_tty=streams.stdout_tty,
        stderr_tty=streams.stderr_tty,
        summary="line" if stats else "none",
    )
    gen = session.respond(text)
    guard = _SigintGuard()
    reply = ""
    summary_done = False
    try:
        with guard:
            try:
                with sink:
                    for ev in gen:
                        if isinstance(ev, result_type):
                            sink.finish(ev)
                            summary_done = sink.prints_summary
                            if stats and not summary_done:
                                from specrun.cli.display import summary_line

                                say(summary_line(ev, engine.config.draft_max))
                        else:
                            reply += ev.text
                            sink.step(ev)
                        if guard.hits:
                            break
            finally:
                guard.armed = False
                gen.close()  # runs the engine's finally: the caches match what was shown
    except KeyboardInterrupt:  # the second Ctrl-C, in the middle of a target pass
        guard.hits = max(guard.hits, 1)
    except SpecrunError as exc:
        say(f"specrun: error: {exc}")
    if reply and not reply.endswith("\n") and not streams.stdout_tty:
        sys.stdout.write("\n")  # replies on a pipe: one message per paragraph
        sys.stdout.flush()
    if guard.hits:
        say("[interrupted]")
