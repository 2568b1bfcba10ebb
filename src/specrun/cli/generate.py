"""`specrun generate`: one prompt (argument, file or pipe), its completion on stdout."""

from __future__ import annotations

import json
import os
import select
import stat
import sys
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from specrun.cli.common import Streams, given_on_command_line, json_line, load_engine
from specrun.cli.options import TemplateKwargs, model_options, sampling_options
from specrun.errors import UsageError


def register(app: typer.Typer) -> None:
    app.command()(generate)


def _stdin_has_input() -> bool:
    """stdin is a pipe or a file (`git diff | specrun ...`, `< file`): not a terminal, and not a
    character device such as /dev/null, which a job started without input inherits."""
    try:
        if sys.stdin.isatty():
            return False
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or stat.S_ISSOCK(mode)


def _hint_while_stdin_is_silent(wait: float = 5.0) -> None:
    """A prompt was given and stdin is a pipe, read to its end (as `llm` does): on a terminal,
    say so when nothing has come after a while, in case the pipe was not meant for specrun."""
    if not sys.stderr.isatty():
        return
    try:
        ready, _, _ = select.select([sys.stdin], [], [], wait)
    except (OSError, ValueError):
        return
    if not ready:
        print(
            "specrun: reading the text piped on stdin (it goes before the prompt; "
            "</dev/null for none)",
            file=sys.stderr,
            flush=True,
        )


def _read_bytes(where: str, prompt_file: str | None) -> bytes:
    if where == "stdin":
        return sys.stdin.buffer.read()
    path = Path(prompt_file or "")
    if path.is_dir():
        raise UsageError(f"prompt file is a directory: {path}")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"prompt file not found: {path}") from None
    except OSError as exc:
        raise UsageError(f"cannot read prompt file {path}: {exc.strerror}") from None


def _decode(data: bytes, where: str) -> str:
    if b"\x00" in data:
        raise UsageError(
            f"the prompt from {where} looks binary (it has NUL bytes); specrun reads text"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        print(
            f"specrun: warning: the prompt from {where} is not valid UTF-8 (first bad byte at "
            f"offset {exc.start}); decoded with replacement characters",
            file=sys.stderr,
        )
        return data.decode("utf-8", errors="replace")


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """--prompt TEXT (or the positional PROMPT), -p/-f FILE (- = stdin), or stdin.

    Text piped in beside a prompt comes first, then the prompt on its own line, as simonw's
    `llm` does (`git diff | specrun generate "write a commit message"`)."""
    if prompt is not None and prompt_file is not None:
        raise UsageError("give either a prompt or -p/-f FILE, not both")
    if prompt is not None:
        text = prompt
        if _stdin_has_input():
            _hint_while_stdin_is_silent()
            piped = _decode(_read_bytes("stdin", None), "stdin")
            if piped.strip():
                text = piped + ("" if piped.endswith("\n") else "\n") + prompt
    else:
        if prompt_file is None and sys.stdin.isatty():
            raise UsageError(
                "no prompt: give PROMPT, --prompt TEXT, -f FILE, or pipe text on stdin"
            )
        where = "stdin" if prompt_file in (None, "-") else str(prompt_file)
        text = _decode(_read_bytes(where, prompt_file), where)
    if not text.strip():
        raise UsageError("the prompt is empty")
    return text


@sampling_options()
@model_options()
def generate(
    click_ctx: typer.Context,
    text: Annotated[
        str | None,
        typer.Argument(
            metavar="PROMPT",
            help="The prompt text (as `llm` and `ollama run` take it); piped stdin goes before it.",
            show_default=False,
        ),
    ] = None,
    prompt: Annotated[
        str | None, typer.Option("--prompt", help="The prompt text (piped stdin goes before it).")
    ] = None,
    prompt_file: Annotated[
        str | None,
        typer.Option(
            "-p",
            "-f",
            "--prompt-file",
            "--file",
            help="Read the prompt from FILE (- = stdin); -f as llama.cpp.",
        ),
    ] = None,
    chat: Annotated[
        bool | None,
        typer.Option(
            "--chat/--raw", help="Apply the target's chat template (default when it has one)."
        ),
    ] = None,
    system: Annotated[
        str | None, typer.Option("--system", help="System message (chat template only).")
    ] = None,
    template_kwargs: TemplateKwargs = None,
    max_tokens: Annotated[
        int, typer.Option("-n", "--max-tokens", help="Tokens to generate at most.")
    ] = 256,
    stop: Annotated[
        list[str] | None, typer.Option("--stop", help="Stop at this text (repeatable).")
    ] = None,
    n_completions: Annotated[
        int,
        typer.Option(
            "-N", "--n-completions", help="Independent completions; completion i uses seed S+i."
        ),
    ] = 1,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of streaming.")
    ] = False,
    json_stream: Annotated[
        bool,
        typer.Option(
            "--json-stream",
            help="Stream JSON lines: one object per target pass (text, tokens, from_draft), then the --json object.",
        ),
    ] = False,
    stats: Annotated[
        bool,
        typer.Option(
            "--stats", help="Print the one-line summary on stderr even when it is not a terminal."
        ),
    ] = False,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare",
            help="Then run the target alone on the same prompt and report the speed-up.",
        ),
    ] = False,
    live: Annotated[
        bool | None,
        typer.Option(
            "--live/--no-live",
            help="Live acceptance footer on stderr (default: when stdout and stderr are terminals).",
        ),
    ] = None,
    grammar: Annotated[
        str | None,
        typer.Option(
            "--grammar",
            help="Constrain the output to this GBNF grammar (llama.cpp's); speculation stays exact.",
        ),
    ] = None,
    grammar_file: Annotated[
        str | None,
        typer.Option("--grammar-file", help="Constrain the output to the GBNF grammar in FILE."),
    ] = None,
    json_schema: Annotated[
        str | None,
        typer.Option(
            "-j",
            "--json-schema",
            help="Constrain the output to JSON valid under this schema (JSON text, or a FILE holding it).",
        ),
    ] = None,
    color: Annotated[
        bool | None,
        typer.Option(
            "--color/--no-color",
            help="Colour accepted draft tokens and the target's own tokens apart (default: on a terminal, unless NO_COLOR).",
        ),
    ] = None,
    opts: Any = None,
    params: Any = None,
) -> None:
    """One completion, streamed to stdout (statistics go to stderr)."""
    from specrun.chat_template import encode_prompt

    streams = Streams.detect()
    if max_tokens < 0:
        raise UsageError(f"--max-tokens must be >= 0, got {max_tokens}")
    if n_completions < 1:
        raise UsageError(f"--n-completions must be >= 1, got {n_completions}")
    if compare and n_completions > 1:
        raise UsageError("--compare works with one completion")
    if text is not None and prompt is not None and given_on_command_line(click_ctx, "prompt"):
        raise UsageError("give the prompt once: PROMPT or --prompt, not both")
    if as_json and json_stream:
        raise UsageError("give either --json or --json-stream, not both")
    if chat is False:
        # --raw against a template given on the command line is a contradiction; one that came
        # from the environment (SPECRUN_CHAT_TEMPLATE) gives way to the command line's --raw.
        for name in ("chat_template", "chat_template_file"):
            if getattr(opts, name) is not None and given_on_command_line(click_ctx, name):
                raise UsageError(
                    f"--raw renders no chat template: drop --{name.replace('_', '-')} or --raw"
                )
    from specrun.chat_template import parse_kwargs

    extra = parse_kwargs(template_kwargs, template=opts.template_source())
    text = read_prompt(text if text is not None else prompt, prompt_file)
    gbnf = _grammar_text(grammar, grammar_file, json_schema)  # checked before any model loads
    structured = as_json or json_stream
    loaded = load_engine(opts, streams)
    try:
        engine = loaded.engine
        tokens, _ = encode_prompt(engine.target, text, chat, system, extra)
        engine.check_prompt(tokens)

        def constraint() -> Any:  # a fresh grammar state for each completion
            if gbnf is None:
                return None
            from specrun.llama.grammar import Grammar

            return Grammar.compile(engine.target, gbnf[0], param=gbnf[1])

        constraint_of_run = constraint()  # an invalid grammar fails here, before any output

        from specrun.cli.display import sink_for, summary_line
        from specrun.decoding.engine import Result
        from specrun.session import describe

        show_summary = stats or streams.stderr_tty
        results: list[Result] = []
        for i in range(n_completions):
            p_i = replace(params, seed=params.seed + i)
            sink = (
                None
                if structured
                else sink_for(
                    engine,
                    live=live,
                    color=color,
                    stdout_tty=streams.stdout_tty,
                    stderr_tty=streams.stderr_tty,
                    summary="full" if show_summary else "none",
                )
            )
            if n_completions > 1 and sink is not None and i > 0:
                sys.stdout.write("\n\n")
            result = None
            with sink if sink is not None else nullcontext():  # the footer is erased on Ctrl-C too
                con = constraint_of_run if i == 0 else constraint()
                for ev in engine.generate(
                    tokens, max_tokens=max_tokens, params=p_i, stop=stop or (), constraint=con
                ):
                    if isinstance(ev, Result):
                        result = ev
                    elif sink is not None:
                        sink.step(ev)
                    elif json_stream and ev.tokens:
                        json_line(_step_json(ev) | ({"completion": i} if n_completions > 1 else {}))
                assert result is not None
                if sink is not None:
                    sink.finish(result)
            results.append(result)
            if show_summary and not structured and not (sink is not None and sink.prints_summary):
                print(summary_line(result, engine.config.draft_max), file=sys.stderr)

        baseline = None
        if compare:
            baseline = _baseline(engine, tokens, max_tokens, params, stop or (), constraint())
            r = results[0]
            speedup = (
                r.stats.tokens_per_second / baseline.stats.tokens_per_second
                if baseline.stats.tokens_per_second
                else 0.0
            )
            same = "identical" if baseline.tokens == r.tokens else "DIFFERENT"
            print(
                f"specrun: target alone {baseline.stats.tokens_per_second:.1f} tok/s -> "
                f"{engine.mode} {r.stats.tokens_per_second:.1f} tok/s: speed-up {speedup:.2f}x, output {same}",
                file=sys.stderr,
            )

        if structured:
            obj: dict[str, Any] = {
                "mode": engine.mode,
                "target": describe(loaded.plan.target),
                "draft": describe(loaded.plan.draft),
                "sampling": params.as_dict(),
                "prompt_tokens": len(tokens),
                "draft_max": engine.config.draft_max,
                # What llama.cpp really took for each model (context size, threads, batch, flash
                # attention, KV cache types, GPU layers, buffer sizes).
                "runtime": {
                    role: m.context_params()
                    for role, m in zip(("target", "draft"), loaded.models, strict=False)
                },
            }
            if n_completions == 1:
                obj = _result_json(results[0]) | obj
            else:
                obj["completions"] = [_result_json(r) | {"seed": r.seed} for r in results]
            if baseline is not None:
                obj["baseline"] = {
                    "tokens_per_second": round(baseline.stats.tokens_per_second, 2),
                    "identical": baseline.tokens == results[0].tokens,
                }
            json_line(({"event": "done"} | obj) if json_stream else obj)
    finally:
        loaded.close()


def _step_json(ev: Any) -> dict[str, Any]:
    """One target pass for --json-stream: what it committed and which of it the draft proposed."""
    return {
        "event": "step",
        "text": ev.text,
        "tokens": ev.tokens,
        "from_draft": ev.from_draft,
        "drafter": ev.drafter,
        "k": ev.k,
        "accepted": ev.accepted,
    }


def _result_json(r: Any) -> dict[str, Any]:
    return {
        "text": r.text,
        "tokens": r.tokens,
        "finish_reason": r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "generated_tokens": len(r.tokens),
        "stats": r.stats.to_dict(),
    }


def _baseline(
    engine: Any, tokens: list[int], max_tokens: int, params: Any, stop: Any, constraint: Any
) -> Any:
    """The target alone on the same prompt (under the same grammar), cold cache both: the
    honest comparison."""
    from specrun.decoding.engine import Engine, SpecConfig

    alone = Engine(engine.target, None, SpecConfig(mode="none"))
    engine.reset()
    return alone.run(
        tokens,
        max_tokens=max_tokens,
        params=params,
        stop=stop,
        reuse_cache=False,
        constraint=constraint,
    )


def _grammar_text(
    grammar: str | None, grammar_file: str | None, json_schema: str | None
) -> tuple[str, str] | None:
    """(GBNF, the option it came from) of --grammar, --grammar-file or --json-schema; one at
    most. A schema is turned into GBNF here (its unsupported keywords refused by name)."""
    given = [(n, v) for n, v in (("--grammar", grammar), ("--grammar-file", grammar_file),
             ("--json-schema", json_schema)) if v is not None]  # fmt: skip
    if not given:
        return None
    if len(given) > 1:
        raise UsageError(f"give one of {' and '.join(n for n, _ in given)}, not several")
    name, value = given[0]
    if name == "--grammar-file":
        value = _read_text(value, name)
    if name != "--json-schema":
        return value, name

    from specrun.llama.grammar import schema_to_gbnf

    if not value.lstrip().startswith(("{", "true", "false")):
        value = _read_text(value, name)
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--json-schema: not valid JSON ({exc})") from None
    return schema_to_gbnf(schema, "--json-schema"), name


def _read_text(path: str, flag: str) -> str:
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{flag}: cannot read {path}: {exc}") from None
