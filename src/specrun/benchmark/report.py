"""The bench's summary (per configuration: speed-up per column and overall, the cost model's
prediction, acceptance, overhead, exactness) and its outputs: the table, Markdown, JSON, plot."""

from __future__ import annotations

import datetime as _dt
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specrun import machine
from specrun.benchmark.run import BenchResult, Config, Run, round_or_none
from specrun.benchmark.suite import COLUMNS
from specrun.errors import SpecrunError


# -- summary --------------------------------------------------------------------------------
@dataclass
class Row:
    config: Config
    engine_modes: list[str]
    speedup_by_column: dict[str, float | None]
    speedup: float | None
    predicted_speedup: float | None
    mean_accepted_length: float
    acceptance_rate: float | None
    per_position_acceptance: list[float]
    overhead_fraction: float
    tokens_per_second: float
    prompt_tokens_per_second: float  # prompt tokens evaluated over the time to first token
    first_token_seconds: float | None  # median time to first token over the runs
    identical: tuple[int, int]  # (identical, greedy runs compared)
    n_prompts: int

    def as_json(self) -> dict[str, Any]:
        return {
            "mode": self.config.mode,
            "draft_max": self.config.draft_max,
            "label": self.config.label,
            "engine_modes": self.engine_modes,
            "speedup_by_category": {
                c: round_or_none(v, 4) for c, v in self.speedup_by_column.items()
            },
            "speedup": round_or_none(self.speedup, 4),
            "predicted_speedup": round_or_none(self.predicted_speedup, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_rate": round_or_none(self.acceptance_rate, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "overhead_fraction": round(self.overhead_fraction, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "prompt_tokens_per_second": round(self.prompt_tokens_per_second, 2),
            "first_token_seconds": round_or_none(self.first_token_seconds, 4),
            "identical": {"identical": self.identical[0], "compared": self.identical[1]},
            "prompts": self.n_prompts,
        }


def geomean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(result: BenchResult) -> list[Row]:
    rows: list[Row] = []
    for cfg in result.configs:
        runs = [r for r in result.runs if r.config == cfg]
        if not runs:
            continue
        per_prompt: dict[tuple[str, int], list[Run]] = {}
        for r in runs:
            per_prompt.setdefault((r.prompt_id, r.turn), []).append(r)

        def med(group: list[Run], attr: str) -> float | None:
            xs = [getattr(r, attr) for r in group if getattr(r, attr) is not None]
            return statistics.median(xs) if xs else None

        sp = {key: med(g, "speedup") for key, g in per_prompt.items()}
        pr = {key: med(g, "predicted_speedup") for key, g in per_prompt.items()}
        col_of = {key: g[0].column for key, g in per_prompt.items()}
        by_col = {
            c: geomean([v for k, v in sp.items() if col_of[k] == c and v is not None])
            for c in result.columns
        }
        drafted = sum(r.drafted for r in runs)
        accepted = sum(r.accepted for r in runs)
        passes = sum(r.target_passes for r in runs)
        generated = sum(r.generated_tokens for r in runs)
        decode = sum(r.decode_seconds for r in runs)
        llama = sum(r.llama_seconds for r in runs)
        prompt_n = sum(r.prefill_tokens for r in runs)
        ttft_s = sum(r.first_token_seconds for r in runs)
        pos_d: list[int] = []
        pos_a: list[int] = []
        for r in runs:
            assert r.stats is not None
            for i, (d, a) in enumerate(
                zip(r.stats.per_position_drafted, r.stats.per_position_accepted, strict=True)
            ):
                if i >= len(pos_d):
                    pos_d.append(0)
                    pos_a.append(0)
                pos_d[i] += d
                pos_a[i] += a
        compared = [r.identical for r in runs if r.identical is not None]
        rows.append(
            Row(
                config=cfg,
                engine_modes=sorted({r.engine_mode for r in runs}),
                speedup_by_column=by_col,
                speedup=geomean([v for v in sp.values() if v is not None]),
                predicted_speedup=geomean([v for v in pr.values() if v is not None]),
                mean_accepted_length=generated / passes if passes else 0.0,
                acceptance_rate=accepted / drafted if drafted else None,
                per_position_acceptance=[
                    a / d if d else 0.0 for a, d in zip(pos_a, pos_d, strict=True)
                ],
                overhead_fraction=max(0.0, 1.0 - llama / decode) if decode > 0 else 0.0,
                tokens_per_second=generated / decode if decode > 0 else 0.0,
                prompt_tokens_per_second=prompt_n / ttft_s if ttft_s > 0 else 0.0,
                first_token_seconds=statistics.median(r.first_token_seconds for r in runs),
                identical=(sum(compared), len(compared)),
                n_prompts=len(per_prompt),
            )
        )
    return rows


def baseline_spread(runs: Sequence[Run]) -> dict[str, float | int] | None:
    """How far apart the target alone ran one prompt's repeats: (fastest - slowest) / median of
    their tok/s, for each prompt (and turn) with two or more; the median and the largest over
    prompts. Those repeats are the same work, token for token, so a speed-up that differs from
    1.0 (or from another's) by less than this is within what this machine did to the baseline
    itself. None with one repeat."""
    by_prompt: dict[tuple[str, int], list[float]] = {}
    for r in runs:
        if r.mode == "none" and r.tokens_per_second > 0:
            by_prompt.setdefault((r.prompt_id, r.turn), []).append(r.tokens_per_second)
    spreads = [(max(v) - min(v)) / statistics.median(v) for v in by_prompt.values() if len(v) >= 2]
    if not spreads:
        return None
    return {
        "median": round(statistics.median(spreads), 4),
        "max": round(max(spreads), 4),
        "prompts": len(spreads),
    }


def spread_note(spread: dict[str, float | int] | None) -> str | None:
    """One line for the report: the baseline's own spread between repeats (baseline_spread)."""
    if spread is None:
        return None
    return (
        f"noise: the target alone ran a prompt's repeats {100 * spread['median']:.1f}% apart "
        f"(median over {spread['prompts']} prompts; at most {100 * spread['max']:.1f}%): "
        "speed-ups that differ from 1.00x, or from each other, by that much are within the "
        "machine's own variation"
    )


# -- report ---------------------------------------------------------------------------------
def table_data(rows: Sequence[Row], columns: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """Header and cells, shared by the Rich table and the Markdown file."""
    head = (
        ["mode", "K"]
        + [COLUMNS.get(c, c) for c in columns]
        + ["overall", "predicted", "MAT", "accept", "overhead", "tok/s", "prompt tok/s", "TTFT"]
        + ["identical"]
    )
    body: list[list[str]] = []
    for r in rows:
        mode = r.config.mode
        if r.engine_modes and r.engine_modes != [mode]:
            mode += f" ({'/'.join(r.engine_modes)})"
        same = (
            f"{r.identical[0]}/{r.identical[1]}"
            if r.identical[1] and r.config.mode != "none"
            else "-"
        )
        body.append(
            [mode, str(r.config.draft_max) if r.config.draft_max else "-"]
            + [_x(r.speedup_by_column.get(c)) for c in columns]
            + [
                _x(r.speedup),
                _x(r.predicted_speedup),
                f"{r.mean_accepted_length:.2f}",
                "-" if r.acceptance_rate is None else f"{100 * r.acceptance_rate:.0f}%",
                f"{100 * r.overhead_fraction:.0f}%",
                f"{r.tokens_per_second:.1f}",
                f"{r.prompt_tokens_per_second:.0f}",
                "-" if r.first_token_seconds is None else f"{1000 * r.first_token_seconds:.0f} ms",
                same,
            ]
        )
    return head, body


CAPTION = (
    "speed-up = tok/s over the target alone on the same prompt (median over repeats, "
    "geometric mean over prompts); predicted = the cost model from measured acceptance "
    "and pass times; MAT = tokens per target pass; overhead = decode time outside llama.cpp; "
    "prompt tok/s = prompt tokens evaluated over the time to first token (TTFT, median)"
)


def markdown(
    rows: Sequence[Row], columns: Sequence[str], header: str, note: str | None = None
) -> str:
    head, body = table_data(rows, columns)
    out = [
        header,
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
    ]
    out += ["| " + " | ".join(cells) + " |" for cells in body]
    out += ["", CAPTION + "."]
    if note:
        out += ["", note[0].upper() + note[1:] + "."]
    out += [""]
    return "\n".join(out)


def machine_info(models: Sequence[Any]) -> dict[str, Any]:
    """machine.machine_info, with the threads each model runs and the date of the run."""
    return machine.machine_info() | {
        "threads": [getattr(m, "n_threads", None) for m in models],
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def to_json(result: BenchResult, rows: Sequence[Row], meta: dict[str, Any]) -> dict[str, Any]:
    return meta | {
        "categories": list(result.columns),
        "skipped": [
            {"mode": s.config.mode, "draft_max": s.config.draft_max, "reason": s.reason}
            for s in result.skipped
        ],
        "prompts_skipped": [{"prompt_id": q, "reason": why} for q, why in result.prompts_skipped],
        "interrupted": result.interrupted,
        "wall_seconds": round(result.wall_seconds, 2),
        "load_average_max": round_or_none(result.load_max, 2),
        "warning": result.busy_warning(),
        "baseline_spread": baseline_spread(result.runs),
        "summary": [r.as_json() for r in rows],
        "runs": [r.as_json() for r in result.runs],
    }


def check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SpecrunError(
            "--plot needs matplotlib, which is not installed: pip install 'specrun[plot]' "
            "(or matplotlib)"
        ) from None


def plot(rows: Sequence[Row], path: Path, title: str) -> None:
    """Speed-up against K per mode (measured solid, predicted dashed), and per-position
    acceptance per configuration."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    modes = list(dict.fromkeys(r.config.mode for r in rows if r.config.mode != "none"))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ax1.axhline(1.0, color="grey", linewidth=1, linestyle=":", label="none (target alone)")
    for i, mode in enumerate(modes):
        pts = sorted((r.config.draft_max, r) for r in rows if r.config.mode == mode)
        ks = [k for k, _ in pts]
        col = colors[i % len(colors)]
        ax1.plot(
            ks,
            [r.speedup or float("nan") for _, r in pts],
            marker="o",
            color=col,
            label=f"{mode} measured",
        )
        ax1.plot(
            ks,
            [r.predicted_speedup or float("nan") for _, r in pts],
            marker="x",
            linestyle="--",
            color=col,
            alpha=0.7,
            label=f"{mode} predicted",
        )
        for j, (k, r) in enumerate(pts):
            if r.per_position_acceptance:
                xs = range(1, len(r.per_position_acceptance) + 1)
                ax2.plot(
                    xs,
                    r.per_position_acceptance,
                    marker=".",
                    color=col,
                    alpha=0.4 + 0.6 * (j + 1) / len(pts),
                    label=f"{mode} K={k}",
                )
    ks_all = sorted({r.config.draft_max for r in rows if r.config.draft_max})
    ax1.set(xlabel="K (--draft-max)", ylabel="speed-up over the target alone", title="speed-up")
    if ks_all:
        ax1.set_xticks(ks_all)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax2.set(
        xlabel="draft position",
        ylabel="P(accepted up to this position)",
        title="per-position acceptance",
        ylim=(0, 1.02),
    )
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.grid(alpha=0.3)
    if ax2.lines:
        ax2.legend(fontsize=8, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"
