"""The `specrun bench` command: options in, benchmark/run.py's runner and benchmark/report.py's report out."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from specrun.cli.common import Streams, err_console, load_engine
from specrun.cli.console import console
from specrun.cli.options import model_options, sampling_options
from specrun.errors import UsageError


def register(app: typer.Typer) -> None:
    app.command(
        name="bench",
        short_help="Every speculation mode against the target alone on a prompt suite.",
    )(bench)


@sampling_options()
@model_options(exclude=("mode", "draft_max", "lookup_cache"))
def bench(
    suite: Annotated[
        str,
        typer.Option(
            "--suite",
            help="'builtin' or a Spec-Bench JSON-lines file (question_id, category, turns).",
        ),
    ] = "builtin",
    modes: Annotated[
        str,
        typer.Option(
            "--modes",
            help="Comma list of modes to compare with the target alone (none always runs).",
            rich_help_panel="Speculation",
        ),
    ] = "none,draft,lookup,auto",
    draft_max: Annotated[
        str,
        typer.Option(
            "--draft-max", help="K values to sweep, comma list.", rich_help_panel="Speculation"
        ),
    ] = "2,4,8",
    max_tokens: Annotated[
        int, typer.Option("-n", "--max-tokens", help="Tokens to generate per run at most.")
    ] = 128,
    repeats: Annotated[
        int,
        typer.Option("--repeats", help="Runs per configuration and prompt (medians are reported)."),
    ] = 3,
    limit: Annotated[
        int | None, typer.Option("--limit", help="The first N prompts of each category.")
    ] = None,
    categories: Annotated[
        str | None, typer.Option("--categories", help="Only these categories (comma list).")
    ] = None,
    all_turns: Annotated[
        bool,
        typer.Option(
            "--all-turns",
            help="Every turn of multi-turn prompts (the next turn follows the baseline's reply).",
        ),
    ] = False,
    warmup: Annotated[
        bool,
        typer.Option(
            "--warmup/--no-warmup", help="One short unmeasured run per configuration first."
        ),
    ] = True,
    json_out: Annotated[
        Path | None,
        typer.Option(
            "--json",
            help="Write every run and the summary to FILE.",
            dir_okay=False,
            rich_help_panel="Output",
        ),
    ] = None,
    md_out: Annotated[
        Path | None,
        typer.Option(
            "--md",
            help="Write the table as Markdown to FILE.",
            dir_okay=False,
            rich_help_panel="Output",
        ),
    ] = None,
    plot_out: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Draw speed-up vs K and per-position acceptance to FILE.png (needs matplotlib).",
            dir_okay=False,
            rich_help_panel="Output",
        ),
    ] = None,
    opts: Any = None,
    params: Any = None,
) -> None:
    """Baseline against speculation modes on a prompt suite: speed-up per category, acceptance,
    and the cost model's prediction beside each measurement."""

    from specrun.benchmark import report as bench_report
    from specrun.benchmark import run as bench_run
    from specrun.benchmark import suite as bench_suite

    streams = Streams.detect()
    mode_list = bench_run.parse_modes(modes)
    ks = bench_run.parse_ks(draft_max)
    settings = bench_run.BenchSettings(
        max_tokens=max_tokens, repeats=repeats, params=params, all_turns=all_turns, warmup=warmup
    )
    settings.validate()
    where, prompts = bench_suite.load_suite(suite)
    cats = [c.strip() for c in categories.split(",") if c.strip()] if categories else None
    prompts = bench_suite.select(prompts, limit, cats)
    if plot_out is not None:
        bench_report.check_plot_available()
    # The loader loads a draft model unless it is told the mode needs none.
    opts = replace(
        opts, mode="auto" if bench_run.needs_draft_model(mode_list) else "none", draft_max=max(ks)
    )
    opts.validate()
    err = err_console()
    loaded = load_engine(opts, streams)
    try:
        target = loaded.engine.target
        draft = loaded.engine.draft_model.model if loaded.engine.draft_model is not None else None
        engines, skipped = bench_run.build_engines(
            target,
            draft,
            bench_run.configs_for(mode_list, ks),
            ks,
            draft_min=opts.draft_min,
            draft_p_min=opts.draft_p_min,
            verify=opts.verify,
            lookup_min=opts.lookup_min,
            lookup_max=opts.lookup_max,
        )
        for mode, reason in _group_skips(skipped).items():
            print(f"specrun: skipping --mode {mode}: {reason}", file=sys.stderr)

        template = target.chat_template()

        def encode(messages: list[dict[str, str]]) -> list[int]:
            from specrun.chat_template import encode_chat

            if template:
                return encode_chat(target, messages)
            text = "\n\n".join(m["content"] for m in messages)
            return target.tokenize(text, add_special=True, parse_special=False)

        total = bench_run.count_runs(prompts, len(engines), settings)
        result = _run_with_progress(engines, prompts, encode, settings, total, streams, err)
        result.skipped = skipped
        rows = bench_report.summarize(result)

        names = f"{loaded.plan.target.name}" + (
            f" + {loaded.plan.draft.name}" if loaded.plan.draft is not None else ""
        )
        n_prompts = len({(r.prompt_id, r.turn) for r in result.runs})
        title = (
            f"specrun bench: {names}; {where}, {n_prompts} prompts, -n {max_tokens}, "
            f"{repeats} repeat{'s' if repeats > 1 else ''}, temp {params.temp:g}"
            + ("" if settings.params.greedy else f", seed {settings.params.seed}")
            + f"; {result.wall_seconds:.0f} s"
        )

        out = console(stderr=False, file=sys.stdout, width=None if streams.stdout_tty else 200)
        out.print(rich_table(rows, result.columns, title=title))
        note = bench_report.spread_note(bench_report.baseline_spread(result.runs))
        if note:
            out.print(note, soft_wrap=True, highlight=False)
        sys.stdout.flush()
        busy = result.busy_warning()
        if busy:
            print(f"specrun: warning: {busy}", file=sys.stderr)

        if json_out is not None or md_out is not None:
            machine = bench_report.machine_info(loaded.models)
        if json_out is not None:
            from specrun.session import describe

            meta = {
                "suite": where,
                "settings": {
                    "modes": mode_list,
                    "draft_max": ks,
                    "max_tokens": max_tokens,
                    "repeats": repeats,
                    "limit": limit,
                    "categories": cats,
                    "all_turns": all_turns,
                    "warmup": warmup,
                    "draft_min": opts.draft_min,
                    "draft_p_min": opts.draft_p_min,
                    "verify": opts.verify,
                    "lookup_min": opts.lookup_min,
                    "lookup_max": opts.lookup_max,
                    "ctx": opts.ctx,
                    "sampling": settings.params.as_dict(),
                },
                "models": {
                    "target": describe(loaded.plan.target),
                    "draft": describe(loaded.plan.draft),
                },
                "machine": machine,
            }
            _write(
                json_out,
                json.dumps(bench_report.to_json(result, rows, meta), indent=1, ensure_ascii=False)
                + "\n",
            )
        if md_out is not None:
            header = (
                f"# {title}\n\n{machine['cpu']}, {machine['physical_cores']} cores, "
                f"threads {'/'.join(str(t) for t in machine['threads'])}, {machine['date']}"
                + (f"\n\n**Warning:** {busy}." if busy else "")
            )
            _write(md_out, bench_report.markdown(rows, result.columns, header, note))
        if plot_out is not None:
            bench_report.plot(rows, plot_out, title)
            print(f"specrun: wrote {plot_out}", file=sys.stderr)
        if result.interrupted:
            raise KeyboardInterrupt
    finally:
        loaded.close()


def _group_skips(skipped: list[Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for s in skipped:
        out.setdefault(s.config.mode, s.reason)
    return out


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None
    print(f"specrun: wrote {path}", file=sys.stderr)


def _run_with_progress(
    engines: Any,
    prompts: Any,
    encode: Any,
    settings: Any,
    total: int,
    streams: Streams,
    err: Any,
) -> Any:
    """The runner under a Rich progress bar on stderr (a terminal only, as the contract says)."""
    from specrun.benchmark import run as bench_run

    if not streams.stderr_tty:
        return bench_run.run_bench(
            engines,
            prompts,
            encode,
            settings,
            warn=lambda m: print(f"specrun: {m}", file=sys.stderr),
        )
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task("bench", total=total)
        started = [False]

        def tick(desc: str) -> None:
            if started[0]:
                bar.advance(task)
            started[0] = True
            bar.update(task, description=desc)

        result = bench_run.run_bench(
            engines,
            prompts,
            encode,
            settings,
            progress=tick,
            warn=lambda m: err.print(f"specrun: {m}"),
        )
        bar.update(task, completed=total)
    return result


def rich_table(rows: Any, columns: Any, title: str | None = None) -> Any:
    from specrun.benchmark import report as bench_report

    head, body = bench_report.table_data(rows, columns)
    t = Table(
        title=title, title_justify="left", caption=bench_report.CAPTION, caption_justify="left"
    )
    for i, h in enumerate(head):
        t.add_column(
            h,
            justify="left" if i == 0 else "right",
            no_wrap=True,
            style="bold" if h == "overall" else None,
        )
    for cells in body:
        t.add_row(*cells)
    return t
