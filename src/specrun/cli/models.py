"""`specrun models ...`: list, pull, path, check and rm registry models.

Results (tables, paths, JSON) go to stdout; progress goes to stderr, as a transient Rich bar on
a terminal and as one line per step otherwise. Errors are raised as SpecrunError and turned into
one line by cli.main.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from specrun.cli.common import spinner
from specrun.cli.console import console
from specrun.cli.options import ProbeDraftMax, ProbeMaxTokens, ProbeRepeats, ProbeThreads, parse_ngl
from specrun.cli.progress import PullProgress
from specrun.errors import IncompatiblePairError, ModelError, RegistryError, UsageError
from specrun.models.registry import Registry, ResolvedModel
from specrun.models.toml import UserEntry, update_user_registry
from specrun.probe import (
    DraftRank,
    ProbeSettings,
    compatibility,
    probe,
    rank_drafts,
    recommended,
    summary_rows,
)

if TYPE_CHECKING:
    from specrun.llama.model import Model
    from specrun.probe import ProbeSettings

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def _stdout() -> Console:
    con = console(stderr=False)
    # Piped output: no wrapping at 80 columns, so scripts see one row per line.
    return con if con.is_terminal else console(stderr=False, width=max(con.width, 200))


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover


def _load(verbose: bool = False) -> Registry:
    return Registry.load(verbose=verbose)


@app.command("list")
def list_models(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list for scripts.")] = False,
    all_: Annotated[
        bool,
        typer.Option(
            "--all",
            "-a",
            help="Also every GGUF on disk: Ollama's store, LM Studio's folder, the Hugging Face "
            "cache (source, size, format, architecture, vocabulary).",
        ),
    ] = False,
) -> None:
    """Registry models (source, size, present) and pairs; with --all every GGUF on disk."""
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
    if all_:
        rows += _local_rows(reg)
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
    if all_:
        _print_local(con, [r for r in rows if r["kind"] == "local"])


def _local_rows(reg: Registry) -> list[dict[str, Any]]:
    """Every GGUF on disk (the registry's present models and the other tools' stores), with
    what its header says; a file llama.cpp cannot load carries the reason in ``problem``."""
    from specrun.models import drafts, stores  # deferred: keeps --help light

    out = []
    for m in drafts.local_models(reg, dedupe=False):
        f = stores.facts(m.path)
        out.append(
            {
                "kind": "local",
                "name": m.name,
                "source": m.source,
                "path": str(m.path),
                "size": m.size,
                **f.to_dict(),
            }
        )
    return out


def _print_local(con: Console, rows: list[dict[str, Any]]) -> None:
    table = Table(title="on disk (-m NAME)", title_justify="left")
    for col in ("name", "source", "size", "format", "arch", "vocab"):
        table.add_column(col, justify="right" if col == "size" else "left")
    for r in rows:
        table.add_row(
            r["name"],
            r["source"],
            human_size(r["size"]),
            r["format"] or "-",
            r["arch"] or "-",
            r["vocab"] or "-",
        )
    con.print(table)
    for r in rows:
        if r["problem"]:
            con.print(f"{r['source']} {r['name']}: {r['problem']}", soft_wrap=True, markup=False)


@app.command()
def drafts(
    target: Annotated[
        str,
        typer.Argument(help="The target: a path, a registry name, an Ollama or LM Studio name."),
    ],
    probe_run: Annotated[
        bool,
        typer.Option("--probe/--no-probe", help="Measure each candidate (a short probe)."),
    ] = True,
    threads: ProbeThreads = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object for scripts.")
    ] = False,
) -> None:
    """Rank every model on disk that could draft for TARGET (compatible vocabulary, under half
    its size) by a short measured probe; say why the others were left out."""
    from specrun.models import drafts as drafts_mod

    reg = _load()
    t = reg.resolve(target, pull=False)
    if probe_run:
        with spinner(not as_json, f"ranking drafts for {t.name}") as say:
            ranks, left = rank_drafts(t.path, reg, say=say, n_threads=threads)
    else:
        keep, left, _tf = drafts_mod.candidates(t.path, reg)
        ranks = [DraftRank(m.name, m.source, str(m.path), m.size) for m in keep]
    out = {
        "target": {"name": t.name, "path": str(t.path), "size": t.path.stat().st_size},
        "ranked": [dataclasses.asdict(r) for r in ranks],
        "left_out": [
            {
                "name": lo.model.name,
                "source": lo.model.source,
                "path": str(lo.model.path),
                "reason": lo.reason,
            }
            for lo in left
        ],
    }
    if as_json:
        print(json.dumps(out, indent=2))
        return
    con = _stdout()
    table = Table(title=f"drafts for {t.name}", title_justify="left")
    for col in ("#", "name", "source", "size", "acceptance", "best K", "speed-up", "note"):
        table.add_column(col, justify="right" if col in ("#", "size") else "left")
    for i, r in enumerate(ranks, 1):
        pr = r.probe or {}
        table.add_row(
            str(i),
            r.name,
            r.source,
            human_size(r.size),
            f"{pr['acceptance']:.0%}" if pr else "-",
            str(r.draft_max or 0) if pr else "-",
            f"{r.speedup:.2f}x" if r.speedup is not None else "-",
            r.problem or "",
        )
    con.print(table)
    if not ranks:
        con.print("no model on disk can draft for it: auto runs draft-free", soft_wrap=True)
    for lo in left:
        con.print(
            f"left out {lo.model.name} ({lo.model.source}): {lo.reason}",
            soft_wrap=True,
            markup=False,
        )


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
    with PullProgress() as show:
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


@app.command(
    short_help="Check a pair (compatibility, acceptance, speed-up), or the registry's files."
)
def check(
    names: Annotated[
        list[str] | None,
        typer.Argument(
            help="Without --pair/-m: models (or pairs) whose files to verify; default: all present."
        ),
    ] = None,
    pair: Annotated[
        str | None, typer.Option("--pair", help="Check that this pair can speculate, and probe it.")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option("-m", "--model", help="Target to check (a path, name or USER/REPO[:QUANT])."),
    ] = None,
    model_draft: Annotated[
        str | None,
        typer.Option(
            "-md", "--model-draft", help="Draft to check against it (default: its pair's)."
        ),
    ] = None,
    probe_run: Annotated[
        bool,
        typer.Option(
            "--probe/--no-probe", help="Measure acceptance and speed (a compatible pair)."
        ),
    ] = True,
    max_tokens: ProbeMaxTokens = ProbeSettings.max_tokens,
    draft_max: ProbeDraftMax = ProbeSettings.learn_k,
    repeats: ProbeRepeats = ProbeSettings.repeats,
    threads: ProbeThreads = None,
    ngl: Annotated[
        str,
        typer.Option(
            "--ngl",
            "-ngl",
            metavar="N|auto|all",
            help="Layers offloaded to the GPU, both models (N, auto or all; -1 = all).",
        ),
    ] = "auto",
    save: Annotated[
        bool,
        typer.Option(
            "--save", help="Write the recommended draft_max into your models.toml (\\[pairs.NAME])."
        ),
    ] = False,
    name: Annotated[
        str | None, typer.Option("--name", help="The pair's name for --save with -m/-md.")
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object for scripts.")
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="Show llama.cpp's own log.")] = False,
) -> None:
    """Check a pair (--pair, or -m/-md): compatibility, then measured acceptance and speed-up;
    exit 1 when incompatible. Without them: validate the registry files and verify present
    models (GGUF header, sha256)."""
    if pair is None and model is None:
        if model_draft or save or name:
            raise UsageError("-md, --save and --name need --pair NAME or -m TARGET")
        _check_files(names)
        return
    if names:
        raise UsageError(f"give either model names or --pair/-m, not both (got {names[0]!r})")
    if pair is not None and model is not None:
        raise UsageError("give either --pair or -m/--model, not both")
    if save and not probe_run:
        raise UsageError("--save writes the probe's recommendation: drop --no-probe")
    if save and model is not None and not name:
        raise UsageError("--save with -m/-md needs --name NAME for the pair")
    if name and not save:
        raise UsageError("--name goes with --save")

    settings = ProbeSettings(max_tokens=max_tokens, learn_k=draft_max, repeats=repeats)
    settings.validate()
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")

    ngl_n = parse_ngl(ngl, "--ngl")

    reg = _load(verbose)
    with PullProgress() as show:
        if pair is not None:
            p = reg.pair(pair)
            target = reg.resolve(p.target, show)
            draft = reg.resolve(model_draft or p.draft, show)
            pair_name: str | None = pair
        else:
            assert model is not None
            target = reg.resolve(model, show)
            if model_draft is None:
                found = reg.pair_for_target(target.name) if target.entry is not None else None
                if found is None:
                    raise UsageError(
                        f"{model} is the target of no registry pair: give the draft with -md"
                    )
                model_draft = found.draft
            draft = reg.resolve(model_draft, show)
            pair_name = name
    out = check_pair(
        target,
        draft,
        settings if probe_run else None,
        threads=threads,
        ngl=ngl_n,
        verbose=verbose,
        quiet=as_json,
    )
    out["saved"] = None
    if save and out["recommended_draft_max"] is not None:
        assert pair_name is not None
        out["saved"] = save_pair(reg, pair_name, target, draft, out["recommended_draft_max"])
    elif save and out["compatible"]:
        print(
            "specrun: not saved: drafting does not pay on this machine (best K = 0)",
            file=sys.stderr,
        )
    if as_json:
        print(json.dumps(out, indent=2))
    else:
        con = _stdout()
        print_check(con, out)
        saved = out["saved"]
        if saved:
            con.print(
                f"saved draft_max = {saved['draft_max']} as [pairs.{saved['pair']}] in {saved['file']}",
                soft_wrap=True,
            )
    if not out["compatible"]:
        n = len(out["problems"])
        raise IncompatiblePairError(
            f"{draft.name} cannot draft for {target.name} ({n} rule{'s' * (n != 1)} fail)"
        )


def check_pair(
    target: ResolvedModel,
    draft: ResolvedModel,
    settings: ProbeSettings | None,
    *,
    threads: int | None = None,
    ngl: int = -1,
    verbose: bool = False,
    quiet: bool = False,
    target_model: Model | None = None,
) -> dict[str, Any]:
    """Load both models (small contexts: the probe needs little), list every failing rule, and
    probe a compatible pair. ``target_model``: an already loaded target (a sweep loads it once)."""
    from specrun.decoding import calibrate
    from specrun.llama.gguf import validate_gguf
    from specrun.llama.model import LoadOptions, Model

    n_ctx = 256 + (settings.max_tokens + settings.learn_k if settings else 0)
    opts = LoadOptions(n_ctx=n_ctx, n_gpu_layers=ngl, n_threads=threads, n_batch=min(512, n_ctx))
    loaded: list[Model] = []
    try:
        with spinner(not quiet, f"loading {target.name} and {draft.name}") as say:
            t = target_model
            if t is None:
                validate_gguf(target.path)
                t = Model(target.path, opts, verbose=verbose)
                loaded.append(t)
            validate_gguf(draft.path)
            d = Model(draft.path, dataclasses.replace(opts, amx_rows=True), verbose=verbose)
            loaded.append(d)
            problems = compatibility(t, d)
            say(f"timing {target.name}'s passes")
            passes = calibrate.pass_times(t)  # cached per file and machine: auto reads the same
            result = None
            if not problems and settings is not None:
                result = probe(t, d, settings, say=lambda msg: say(f"probing {draft.name}: {msg}"))
    finally:
        for m in loaded:
            m.close()
    return {
        "target": _describe(target),
        "draft": _describe(draft),
        "compatible": not problems,
        "problems": problems,
        "probe": result.to_dict() if result is not None else None,
        "recommended_draft_max": recommended(result),
        # V(n) = an n-row verify pass (logits on every row) / one row, on this machine and build
        "target_pass_ms": {str(n): round(sec * 1e3, 3) for n, sec in passes.items()},
        "verify_cost": {str(n): round(v, 3) for n, v in calibrate.relative(passes).items()},
    }


def _describe(r: ResolvedModel) -> dict[str, Any]:
    try:
        size: int | None = r.path.stat().st_size
    except OSError:
        size = None
    return {"name": r.name, "path": str(r.path), "size": size}


def print_check(con: Console, out: dict[str, Any]) -> None:
    """The verdict, every failing rule, and the probe's figures as a small table."""
    t, d = out["target"]["name"], out["draft"]["name"]
    if not out["compatible"]:
        n = len(out["problems"])
        con.print(
            f"{d} cannot draft for {t}: incompatible ({n} rule{'s' * (n != 1)} fail)",
            soft_wrap=True,
        )
        for p in out["problems"]:
            con.print(f"  - {p}", soft_wrap=True, markup=False)
        return
    con.print(f"{d} can draft for {t}: compatible", soft_wrap=True)
    vc = out.get("verify_cost") or {}
    if vc:
        ms = out["target_pass_ms"].get("1")
        con.print(
            f"verify cost V(n) = n-row pass / one row ({ms:.1f} ms): "
            + ", ".join(f"V({n}) {v:.2f}" for n, v in vc.items() if n != "1"),
            soft_wrap=True,
            markup=False,
        )
    pr = out["probe"]
    if pr is None:
        return

    table = Table(
        title=f"probe: {pr['settings']['prompts']} prompts x {pr['settings']['max_tokens']} tokens, greedy",
        title_justify="left",
    )
    table.add_column("figure")
    table.add_column("value")
    for k, v in summary_rows(pr):
        table.add_row(k, v)
    con.print(table)


def save_pair(
    reg: Registry,
    pair_name: str,
    target: ResolvedModel,
    draft: ResolvedModel,
    draft_max: int | None,
) -> dict[str, Any]:
    """Write ``[pairs.NAME]`` (target, draft, draft_max) into the user's models.toml, adding a
    ``path`` (or ``hf``) model for a target or draft that is not a registry model yet."""
    entries: list[UserEntry] = []
    names = []
    for role, r in (("target", target), ("draft", draft)):
        mname, body = _model_ref(reg, r, f"{pair_name}-{role}")
        if body is not None:
            entries.append(("models", mname, body))
        names.append(mname)
    keys: dict[str, str | int] = {"target": names[0], "draft": names[1]}
    if draft_max is not None:
        keys["draft_max"] = draft_max
    entries.append(("pairs", pair_name, keys))
    written = update_user_registry(entries)
    return {
        "file": str(written),
        "pair": pair_name,
        "target": names[0],
        "draft": names[1],
        "draft_max": draft_max,
        "models_added": [e[1] for e in entries if e[0] == "models"],
    }


def _model_ref(
    reg: Registry, r: ResolvedModel, fallback: str
) -> tuple[str, dict[str, str | int] | None]:
    """The registry name for a resolved model, and the entry to add when it has none."""
    if r.entry is not None and r.entry.name in reg.models:
        return r.entry.name, None
    if (
        r.entry is not None and r.entry.source == "hf"
    ):  # USER/REPO[:QUANT] typed on the command line
        body: dict[str, str | int] = {"hf": r.entry.name}
    else:
        body = {"path": str(r.path.absolute())}
    existing = reg.models.get(fallback)
    if existing is not None:
        same = (existing.source == "path" and existing.path == r.path.absolute()) or (
            existing.source == "hf" and body.get("hf") == existing.name
        )
        if same:
            return fallback, None
        raise RegistryError(
            f"the registry already has a model {fallback!r} ({existing.label}); "
            "choose another --name"
        )
    return fallback, body


def _check_files(names: list[str] | None) -> None:
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
    with PullProgress() as show:
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
        str,
        typer.Argument(
            help="A pulled or derived model, a hub reference as pulled (USER/REPO[:QUANT], hf.co/USER/REPO[:QUANT]), or a pair (both models)."
        ),
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
