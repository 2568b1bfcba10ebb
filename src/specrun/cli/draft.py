"""`specrun draft make`: a draft for any target, by re-quantizing the target itself.

A re-quantized copy shares the target's vocabulary (so it is always compatible) and costs a
fraction of a target pass per token; whether it pays depends on how often the target agrees with
it, which only a measurement shows. So `make` probes the result as `models check` does (see
probe.py), and `--sweep` puts several quantization types side by side.

Files are written to ``OUT.part-<pid>`` and renamed into place once llama.cpp has finished and
the result starts with the GGUF magic: an interrupted run never leaves a file at OUT.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from specrun import paths
from specrun.cli.common import spinner
from specrun.cli.models import (
    _stdout,
    check_pair,
    human_size,
    print_check,
    save_pair,
)
from specrun.cli.options import ProbeDraftMax, ProbeMaxTokens, ProbeRepeats, ProbeThreads, parse_ngl
from specrun.cli.progress import PullProgress
from specrun.errors import IncompatiblePairError, ModelError, UsageError
from specrun.models.derive import quantize_file
from specrun.models.registry import Registry, ResolvedModel
from specrun.probe import ProbeSettings

draft_app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def register(app: typer.Typer) -> None:
    app.add_typer(
        draft_app, name="draft", help="Make a draft model for a target (re-quantization)."
    )


def default_dir() -> Path:
    return paths.models_dir() / "drafts"


def parse_quants(quant: str, sweep: str | None) -> list[str]:
    from specrun.llama.quantize import QUANT_TYPES

    wanted = [q.strip().upper() for q in (sweep.split(",") if sweep else [quant]) if q.strip()]
    if not wanted:
        raise UsageError("--sweep needs a comma-separated list of quantization types")
    for q in wanted:
        if q not in QUANT_TYPES:
            raise UsageError(
                f"unknown quantization type {q!r}; one of: {', '.join(sorted(QUANT_TYPES))}"
            )
    return list(dict.fromkeys(wanted))


def output_paths(target_name: str, quants: list[str], out: Path | None, sweep: bool) -> list[Path]:
    """-o names the file for one type, the folder for a sweep; default: $SPECRUN_HOME/models/drafts."""
    if not sweep and out is not None:
        if out.is_dir():
            raise UsageError(f"-o {out} is a directory; give a file name (OUT.gguf)")
        return [out]
    folder = out if out is not None else default_dir()
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"with --sweep, -o names a folder; {folder} is a file")
    stem = target_name.removesuffix(".gguf")
    return [folder / f"{stem}-{q.lower()}.gguf" for q in quants]


def quantize_atomic(src: Path, dest: Path, quant: str, threads: int | None) -> Path:
    """Re-quantize ``src`` into ``dest`` through a part file and a rename."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file where the folder should be
        raise ModelError(f"cannot write to {dest.parent}: Not a directory") from None
    except OSError as exc:
        raise ModelError(f"cannot write to {dest.parent}: {exc.strerror}") from None
    part = dest.with_name(f"{dest.name}.part-{os.getpid()}")
    try:
        quantize_file(src, part, quant, threads=threads)
        try:
            with open(part, "rb+") as f:
                head = f.read(4)
                os.fsync(f.fileno())
        except FileNotFoundError:
            raise ModelError(f"quantizing {src.name} to {quant} wrote no file") from None
        except OSError as exc:
            raise ModelError(f"cannot write to {dest.parent}: {exc.strerror}") from None
        if head != b"GGUF":
            raise ModelError(f"quantizing {src.name} to {quant} did not produce a GGUF file")
        try:
            os.replace(part, dest)
        except OSError as exc:
            raise ModelError(f"cannot write {dest}: {exc.strerror}") from None
        with contextlib.suppress(OSError):
            fd = os.open(dest.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return dest
    finally:
        with contextlib.suppress(OSError):
            part.unlink()


@draft_app.command()
def make(
    model: Annotated[
        str,
        typer.Option(
            "-m", "--model", help="The target: a GGUF path, a registry name or USER/REPO[:QUANT]."
        ),
    ],
    quant: Annotated[
        str,
        typer.Option(
            "--quant", "-q", help="Quantization type of the draft (Q8_0, Q4_K_M, Q4_0, Q2_K, ...)."
        ),
    ] = "Q4_0",
    output: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            help="The draft's file (with --sweep: a folder); default: $SPECRUN_HOME/models/drafts/.",
        ),
    ] = None,
    sweep: Annotated[
        str | None,
        typer.Option(
            "--sweep", help="Make and probe several types, e.g. Q8_0,Q4_K_M,Q4_0,Q2_K: one table."
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            help="Register in your models.toml: model NAME-draft and pair NAME (target + draft).",
        ),
    ] = None,
    probe_run: Annotated[
        bool,
        typer.Option("--probe/--no-probe", help="Measure acceptance and speed-up of the result."),
    ] = True,
    force: Annotated[
        bool, typer.Option("--force", help="Overwrite an existing output file.")
    ] = False,
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
            help="Layers offloaded to the GPU while probing (N, auto or all; -1 = all).",
        ),
    ] = "auto",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object for scripts.")
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="Show llama.cpp's own log.")] = False,
) -> None:
    """Re-quantize a target into a draft model, probe whether it pays, optionally register it."""
    quants = parse_quants(quant, sweep)
    settings = ProbeSettings(max_tokens=max_tokens, learn_k=draft_max, repeats=repeats)
    settings.validate()
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")

    ngl_n = parse_ngl(ngl, "--ngl")
    if name is not None and not name.strip():
        raise UsageError("--name must not be empty")

    reg = Registry.load(verbose=verbose)
    with PullProgress() as show:
        target = reg.resolve(model, show)
    dests = output_paths(target.name, quants, output, sweep is not None)
    for d in dests:
        if d.absolute() == target.path.absolute():
            raise UsageError(f"the output {d} is the target itself")
        if d.exists() and not force:
            raise UsageError(f"{d} exists; use --force to overwrite it")

    results: list[dict[str, Any]] = []
    target_model = None
    try:
        if probe_run:
            target_model = _load_target(target, settings, threads, ngl_n, verbose, quiet=as_json)
        for q, dest in zip(quants, dests, strict=True):
            with spinner(not as_json, f"quantizing {target.name} to {q}"):
                quantize_atomic(target.path, dest, q, threads)
            if not as_json and sweep is None:
                print(f"wrote {dest} ({human_size(dest.stat().st_size)})", file=sys.stderr)
            draft = ResolvedModel(
                name=dest.name.removesuffix(".gguf"), path=dest.absolute(), entry=None
            )
            out = check_pair(
                target,
                draft,
                settings if probe_run else None,
                threads=threads,
                ngl=ngl_n,
                verbose=verbose,
                quiet=as_json,
                target_model=target_model,
            )
            results.append({"quant": q, **out})
    finally:
        if target_model is not None:
            target_model.close()

    best = pick_best(results)
    registered = None
    if name is not None and best is not None:
        draft = ResolvedModel(
            name=best["draft"]["name"], path=Path(best["draft"]["path"]), entry=None
        )
        registered = save_pair(reg, name, target, draft, best["recommended_draft_max"])

    if as_json:
        doc = {
            "target": results[0]["target"] if results else None,
            "drafts": results,
            "best": best["quant"] if best else None,
            "registered": registered,
        }
        print(json.dumps(doc, indent=2))
    else:
        con = _stdout()
        if sweep is None:
            print_check(con, results[0])
        else:
            con.print(sweep_table(results, target.name))
            if best is not None and probe_run:
                con.print(f"best: {best['quant']} ({best['draft']['path']})", soft_wrap=True)
        if registered is not None:
            dm = registered["draft_max"]
            con.print(
                f"registered pair {registered['pair']} ({registered['target']} + {registered['draft']}"
                + (
                    f", draft_max = {dm}"
                    if dm
                    else ", no draft_max: not probed"
                    if not probe_run
                    else ", no draft_max: drafting does not pay here"
                )
                + f") in {registered['file']}",
                soft_wrap=True,
            )
    if any(not r["compatible"] for r in results):
        raise IncompatiblePairError(
            "a re-quantized draft is incompatible with its target (see above)"
        )


def _load_target(
    target: ResolvedModel, settings: Any, threads: int | None, ngl: int, verbose: bool, quiet: bool
) -> Any:
    """Load the target once for every probe (a sweep would otherwise load it per type)."""
    from specrun.llama.gguf import validate_gguf
    from specrun.llama.model import LoadOptions, Model

    validate_gguf(target.path)
    n_ctx = 256 + settings.max_tokens + settings.learn_k
    with spinner(not quiet, f"loading {target.name}"):
        return Model(
            target.path,
            LoadOptions(n_ctx=n_ctx, n_gpu_layers=ngl, n_threads=threads, n_batch=min(512, n_ctx)),
            verbose=verbose,
        )


def _speed(r: dict[str, Any]) -> float:
    p = r["probe"]
    if not r["compatible"] or p is None:
        return 0.0
    if p["best_k"] == 0:  # the target alone is as fast as it gets: rank by how little is lost
        return min(1.0, float(p["measured"] or p["predicted"]))
    return float(p["measured"] if p["measured"] is not None else p["predicted"])


def pick_best(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest compatible draft (measured speed-up, else predicted); the first one unprobed."""
    ok = [r for r in results if r["compatible"]]
    if not ok:
        return None
    return max(ok, key=_speed) if any(r["probe"] for r in ok) else ok[0]


def sweep_table(results: list[dict[str, Any]], target_name: str) -> Table:
    table = Table(title=f"drafts for {target_name}", title_justify="left")
    for col, right in (
        ("quant", False),
        ("size", True),
        ("acceptance", True),
        ("c", True),
        ("best K", True),
        ("predicted", True),
        ("measured", True),
    ):
        table.add_column(col, justify="right" if right else "left", no_wrap=True)
    for r in results:
        p = r["probe"]
        size = human_size(r["draft"]["size"])
        if not r["compatible"]:
            table.add_row(r["quant"], size, "incompatible", "-", "-", "-", "-")
        elif p is None:
            table.add_row(r["quant"], size, "-", "-", "-", "-", "-")
        else:
            k, mk = p["best_k"], p["measured_k"]
            note = f" (K={mk})" if mk != k else ""  # K = 0 wins: the best K >= 1 is shown measured
            pred = f"{p['predicted']:.2f}x" + (
                f" (K={mk}: {p['predicted_by_k'][mk]:.2f}x)" if note else ""
            )
            meas = "-" if p["measured"] is None else f"{p['measured']:.2f}x{note}"
            table.add_row(
                r["quant"], size, f"{p['acceptance']:.1%}", f"{p['c']:.2f}", str(k), pred, meas
            )
    return table
