"""`specrun bench`: the target alone against every speculation mode on a prompt suite.

Method (DESIGN.md, "Benchmarks report medians and ratios measured in one process"):
- the models are loaded once; one Engine per (mode, K) shares them; every run starts from a
  fresh cache (``reuse_cache=False``) and an empty lookup store (no earlier output to copy,
  not even this prompt's from the repeat before; bench/modes_compare.py's ``seq:`` workloads
  measure the store over a sequence of requests);
- one short warm-up run per configuration before anything is measured (llama.cpp allocates
  its compute buffers per batch size on first use);
- within each repeat every configuration runs once on the prompt, in an order rotated per repeat,
  so slow drift of the machine (other processes, heat) hits all configurations alike;
- speed-up of a run = its tok/s over the baseline's (``none``) on the same prompt in the same
  repeat; per prompt the median over repeats; per category and overall the geometric mean over
  prompts (the mean of ratios that does not favour the prompts that happen to go fastest).

The cost model (costmodel.py) is printed beside each measurement: from a run's measured
per-position acceptance, its measured draft time and target pass times, and the baseline's
measured one-row pass time, the speed-up speculation would give with no time lost outside
llama.cpp's passes and the drafter. The gap between the two is where time goes.

No Typer here: bench_cli.py parses options and calls ``run_bench`` and the report functions.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from specrun import defaults, machine
from specrun.errors import SpecrunError, UsageError
from specrun.session import calibrate_auto
from specrun.spec.costmodel import expected_tokens
from specrun.spec.engine import Engine, SpecConfig
from specrun.spec.sampling import SamplingParams
from specrun.spec.stats import SpecStats

BUILTIN = "builtin"
# Spec-Bench's leaderboard columns, in its order, then code. MT-bench's own categories (the
# first 80 questions of Spec-Bench's question.jsonl) all count as multi-turn conversation.
COLUMNS = {
    "mt_bench": "MT",
    "translation": "Trans",
    "summarization": "Sum",
    "qa": "QA",
    "math_reasoning": "Math",
    "rag": "RAG",
    "code": "Code",
}
MT_BENCH = {
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
}


# -- the suite ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    question_id: str
    category: str
    turns: tuple[str, ...]

    @property
    def column(self) -> str:
        return column_of(self.category)


def column_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


def load_suite(spec: str) -> tuple[str, list[Prompt]]:
    """``builtin`` or a Spec-Bench JSON-lines file -> (where, prompts). Errors name the line."""
    if spec == BUILTIN:
        where = "builtin suite"
        text = resources.files("specrun").joinpath("data/suite.jsonl").read_text(encoding="utf-8")
    else:
        path = Path(spec)
        where = str(path)
        if path.is_dir():
            raise UsageError(f"--suite: {path} is a directory, not a JSON-lines file")
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"--suite: no such file: {path} (or use --suite builtin)") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"--suite: {path} is not UTF-8 text (byte {exc.start})") from None
        except OSError as exc:
            raise UsageError(f"--suite: cannot read {path}: {exc.strerror}") from None
    return where, parse_suite(text, where)


def parse_suite(text: str, where: str = "suite") -> list[Prompt]:
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue

        def bad(why: str, lineno: int = lineno) -> UsageError:
            return UsageError(f"{where}:{lineno}: {why}")

        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise bad(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise bad(f"expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in ("question_id", "category", "turns") if k not in obj]
        if missing:
            raise bad(
                f"missing key{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                "(Spec-Bench format: question_id, category, turns)"
            )
        qid, cat, turns = obj["question_id"], obj["category"], obj["turns"]
        if isinstance(qid, bool) or not isinstance(qid, int | str) or str(qid) == "":
            raise bad("question_id must be a number or a non-empty string")
        if not isinstance(cat, str) or not cat.strip():
            raise bad("category must be a non-empty string")
        if not isinstance(turns, list) or not turns:
            raise bad("turns must be a non-empty list of user messages")
        if not all(isinstance(t, str) and t.strip() for t in turns):
            raise bad("every turn must be a non-empty string")
        key = str(qid)
        if key in seen:
            raise bad(f"question_id {key} repeats line {seen[key]}")
        seen[key] = lineno
        prompts.append(Prompt(key, cat.strip(), tuple(turns)))
    if not prompts:
        raise UsageError(f"{where}: no prompts in the suite")
    return prompts


def select(
    prompts: Sequence[Prompt], limit: int | None = None, categories: Sequence[str] | None = None
) -> list[Prompt]:
    """The first ``limit`` prompts of each category (by the column it reports under)."""
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be >= 1, got {limit}")
    if categories:
        known = {p.category for p in prompts} | {p.column for p in prompts}
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise UsageError(
                f"--categories: no prompts in {', '.join(unknown)} "
                f"(the suite has {', '.join(order_columns(prompts))})"
            )
    out: list[Prompt] = []
    count: dict[str, int] = {}
    for p in prompts:
        if categories and p.category not in categories and p.column not in categories:
            continue
        if limit is not None and count.get(p.column, 0) >= limit:
            continue
        count[p.column] = count.get(p.column, 0) + 1
        out.append(p)
    return out


def order_columns(prompts: Sequence[Prompt]) -> list[str]:
    present = list(dict.fromkeys(p.column for p in prompts))
    return [c for c in COLUMNS if c in present] + [c for c in present if c not in COLUMNS]


# -- configurations -------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    mode: str
    draft_max: int  # 0 for the baseline: K means nothing there

    @property
    def label(self) -> str:
        return self.mode if self.mode == "none" else f"{self.mode} K={self.draft_max}"


def parse_modes(text: str) -> list[str]:
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    if not modes:
        raise UsageError("--modes: give at least one mode (none,draft,lookup,hybrid,auto)")
    return modes


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UsageError(
            f"--draft-max: expected a comma list of integers like 2,4,8, got {text!r}"
        ) from None
    if not ks or ks[0] < 1:
        raise UsageError(f"--draft-max: every K must be >= 1, got {text!r}")
    return ks


def configs_for(modes: Sequence[str], ks: Sequence[int]) -> list[Config]:
    """The baseline first (always run), then every other mode at every K."""
    return [Config("none", 0)] + [Config(m, k) for m in modes if m != "none" for k in ks]


def needs_draft_model(modes: Sequence[str]) -> bool:
    """Whether to load a draft model: unless every mode is known to work without one."""
    return any(m not in ("none", "lookup") for m in modes)


@dataclass
class Skipped:
    config: Config
    reason: str


def build_engines(
    target: Any,
    draft: Any,
    configs: Sequence[Config],
    ks: Sequence[int],
    draft_min: int = defaults.DRAFT_MIN,
    draft_p_min: float = defaults.DRAFT_P_MIN,
    verify: str = defaults.VERIFY,
    lookup_min: int | None = None,
    lookup_max: int = defaults.LOOKUP_MAX,
) -> tuple[list[tuple[Config, Engine]], list[Skipped]]:
    """One Engine per configuration over the same loaded models. A mode the engine refuses for
    this pair (unknown, needs a draft model that is not loaded, ...) is skipped with its reason."""
    engines: list[tuple[Config, Engine]] = []
    skipped: list[Skipped] = []
    for cfg in configs:
        if cfg.mode == "none":
            spec = SpecConfig(mode="none", draft_max=max(ks), verify=verify)
            engines.append((cfg, Engine(target, None, spec)))
            continue
        try:
            spec = SpecConfig(
                mode=cfg.mode,
                draft_max=cfg.draft_max,
                draft_min=min(draft_min, cfg.draft_max),
                draft_p_min=draft_p_min,
                verify=verify,
                lookup_min=lookup_min,
                lookup_max=lookup_max,
            )
            engine = Engine(target, draft, spec)
            if engine.mode == "auto":  # as generate starts it: from the measured pass costs
                calibrate_auto(engine)
            engines.append((cfg, engine))
        except SpecrunError as exc:
            skipped.append(Skipped(cfg, str(exc)))
    return engines, skipped


# -- measuring ------------------------------------------------------------------------------
@dataclass
class Run:
    mode: str
    draft_max: int
    engine_mode: str
    category: str
    column: str
    prompt_id: str
    turn: int
    repeat: int
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str
    tokens_per_second: float
    decode_seconds: float
    llama_seconds: float
    prefill_seconds: float
    acceptance_rate: float
    mean_accepted_length: float
    drafted: int
    accepted: int
    target_passes: int
    per_position_acceptance: list[float]
    overhead_fraction: float
    modes_used: dict[str, int]
    costs: dict[str, Any]
    speedup: float | None = None
    identical: bool | None = None
    predicted_speedup: float | None = None
    # pooled into the summary, not written per run
    stats: SpecStats | None = field(default=None, repr=False)
    tokens: list[int] = field(default_factory=list, repr=False)
    text: str = field(default="", repr=False)

    @property
    def config(self) -> Config:
        return Config(self.mode, self.draft_max)

    def as_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("stats", "tokens", "text")}
        out["costs"] = {
            "verify_seconds_by_rows": {
                str(r): round(s, 6) for r, s in self.costs["verify_seconds_by_rows"].items()
            },
            "draft_step_seconds": _round(self.costs["draft_step_seconds"], 6),
        }
        for k in (
            "tokens_per_second",
            "decode_seconds",
            "llama_seconds",
            "prefill_seconds",
            "acceptance_rate",
            "mean_accepted_length",
            "overhead_fraction",
            "speedup",
            "predicted_speedup",
        ):
            out[k] = _round(out[k], 4)
        out["per_position_acceptance"] = [round(x, 4) for x in self.per_position_acceptance]
        return out


def overhead_fraction(st: SpecStats) -> float:
    """Share of decode time spent outside llama_decode (Python, sampling, bookkeeping)."""
    if st.decode_seconds <= 0:
        return 0.0
    return max(0.0, 1.0 - st.llama_seconds / st.decode_seconds)


def predict_speedup(st: SpecStats, t1: float | None) -> float | None:
    """The cost model's speed-up for one run, from what the run measured.

    ``t1``: the target's one-row pass time from the baseline runs on the same prompt. Every pass
    that verified rows r = k + 1 yields ``expected_tokens(acceptance, k)`` tokens (DESIGN.md) at
    a cost of V(r) = (this run's mean r-row pass time) / t1, and the drafter's whole measured
    time counts on top, in units of t1. For a run whose passes all drafted K tokens with the
    draft model this is exactly ``costmodel.predicted_speedup(acceptance, K, c, V)`` with
    c = draft step time / t1; it also covers passes where the drafter had nothing (k = 0) or
    where a cheap drafter (lookup) proposed, since it uses only what was measured.
    """
    if not t1 or t1 <= 0 or not st.verify_counts:
        return None
    cum = st.per_position_acceptance()
    tokens = cost = 0.0
    for rows, n in st.verify_counts.items():
        k = rows - 1
        if k > len(cum):
            return None
        tokens += n * expected_tokens(cum, k)
        cost += st.verify_seconds[rows] / t1  # n passes x (mean r-row time / t1)
    cost += st.draft_seconds / t1
    return tokens / cost if cost > 0 else None


@dataclass
class BenchSettings:
    max_tokens: int = 128
    repeats: int = 3
    params: SamplingParams = field(default_factory=SamplingParams)
    all_turns: bool = False
    warmup: bool = True
    warmup_tokens: int = 16

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise UsageError(f"-n/--max-tokens must be >= 1, got {self.max_tokens}")
        if self.repeats < 1:
            raise UsageError(f"--repeats must be >= 1, got {self.repeats}")


@dataclass
class BenchResult:
    configs: list[Config]
    skipped: list[Skipped]
    runs: list[Run]
    columns: list[str]
    prompts_skipped: list[tuple[str, str]] = field(default_factory=list)
    interrupted: bool = False
    wall_seconds: float = 0.0
    load_max: float | None = None  # highest 1-minute load average seen (other work skews timings)

    def sample_load(self) -> None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # pragma: no cover - not on this platform
            return
        self.load_max = max(self.load_max or 0.0, load)

    def busy_warning(self) -> str | None:
        """A note when other processes competed for the CPU during the run: this bench's own
        threads account for about one unit of load per core."""
        cpus = os.cpu_count() or 1
        if self.load_max is not None and self.load_max > 1.5 * cpus:
            return (
                f"the machine was busy during the run (load average up to {self.load_max:.1f} "
                f"on {cpus} CPUs): timings and speed-ups are unreliable; rerun on an idle machine"
            )
        return None


Encode = Callable[[list[dict[str, str]]], list[int]]
Progress = Callable[[str], None]  # called before each run with a description; advances by one


def count_runs(prompts: Sequence[Prompt], n_configs: int, settings: BenchSettings) -> int:
    turns = sum(len(p.turns) if settings.all_turns else 1 for p in prompts)
    return turns * n_configs * settings.repeats + (n_configs if settings.warmup and prompts else 0)


def run_bench(
    engines: Sequence[tuple[Config, Engine]],
    prompts: Sequence[Prompt],
    encode: Encode,
    settings: BenchSettings,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> BenchResult:
    """Measure every configuration on every prompt (see the module docstring for the method)."""
    import time

    settings.validate()
    tick = progress or (lambda _d: None)
    say = warn or (lambda _m: None)
    t_start = time.perf_counter()
    result = BenchResult(
        configs=[c for c, _ in engines], skipped=[], runs=[], columns=order_columns(prompts)
    )
    params = settings.params
    try:
        if settings.warmup and prompts:
            first = encode([{"role": "user", "content": prompts[0].turns[0]}])
            for cfg, eng in engines:
                tick(f"warm-up {cfg.label}")
                eng.run(
                    first,
                    max_tokens=min(settings.max_tokens, settings.warmup_tokens),
                    params=params,
                    reuse_cache=False,
                )
        for p in prompts:
            result.sample_load()
            history: list[dict[str, str]] = []
            for turn, user in enumerate(p.turns if settings.all_turns else p.turns[:1], 1):
                history.append({"role": "user", "content": user})
                tokens = encode(history)
                try:
                    engines[0][1].check_prompt(tokens)
                except SpecrunError as exc:
                    say(f"skipping prompt {p.question_id} ({p.category}) turn {turn}: {exc}")
                    result.prompts_skipped.append((p.question_id, str(exc)))
                    break
                runs: list[Run] = []
                try:
                    _measure_prompt(engines, p, turn, tokens, settings, tick, runs)
                finally:  # on Ctrl-C too: what was measured is reported
                    result.runs.extend(runs)
                # The next turn answers the baseline's reply: every configuration sees one history.
                reply = next((r.text for r in runs if r.mode == "none"), "")
                history.append({"role": "assistant", "content": reply})
    except KeyboardInterrupt:
        result.interrupted = True
    result.sample_load()
    result.wall_seconds = time.perf_counter() - t_start
    return result


def _measure_prompt(
    engines: Sequence[tuple[Config, Engine]],
    p: Prompt,
    turn: int,
    tokens: list[int],
    settings: BenchSettings,
    tick: Progress,
    runs: list[Run],
) -> None:
    n = len(engines)
    try:
        for rep in range(settings.repeats):
            for i in range(n):
                cfg, eng = engines[(i + rep) % n]  # rotate the order from repeat to repeat
                tick(f"{p.column} #{p.question_id} {cfg.label}")
                clear = getattr(eng, "clear_store", None)
                if (
                    clear is not None
                ):  # a first request: no earlier output (nor this prompt's) to copy
                    clear()
                res = eng.run(
                    tokens,
                    max_tokens=settings.max_tokens,
                    params=settings.params,
                    reuse_cache=False,
                )
                runs.append(_to_run(cfg, eng, p, turn, rep, res))
    finally:  # also on Ctrl-C: what was measured gets its ratios
        _compare(runs, settings.params.greedy)


def _to_run(cfg: Config, eng: Engine, p: Prompt, turn: int, rep: int, res: Any) -> Run:
    st: SpecStats = res.stats
    return Run(
        mode=cfg.mode,
        draft_max=cfg.draft_max,
        engine_mode=eng.mode,
        category=p.category,
        column=p.column,
        prompt_id=p.question_id,
        turn=turn,
        repeat=rep,
        prompt_tokens=res.prompt_tokens,
        generated_tokens=len(res.tokens),
        finish_reason=res.finish_reason,
        tokens_per_second=st.tokens_per_second,
        decode_seconds=st.decode_seconds,
        llama_seconds=st.llama_seconds,
        prefill_seconds=st.prefill_seconds,
        acceptance_rate=st.acceptance_rate,
        mean_accepted_length=st.mean_accepted_length,
        drafted=st.drafted,
        accepted=st.accepted,
        target_passes=st.target_passes,
        per_position_acceptance=st.per_position_acceptance(),
        overhead_fraction=overhead_fraction(st),
        modes_used=dict(st.modes_used),
        costs=st.costs(),
        stats=st,
        tokens=list(res.tokens),
        text=res.text,
    )


def _compare(runs: list[Run], greedy: bool) -> None:
    """Speed-up and identity against the baseline of the same repeat; the cost model's
    prediction against the baseline's median one-row pass time on this prompt."""
    base = {r.repeat: r for r in runs if r.mode == "none"}
    t1s = [r.costs["verify_seconds_by_rows"].get(1) for r in base.values()]
    t1 = statistics.median([t for t in t1s if t]) if any(t1s) else None
    for r in runs:
        b = base.get(r.repeat)
        if r.mode == "none":
            r.speedup, r.predicted_speedup = 1.0, 1.0
        else:
            if b is not None and b.tokens_per_second > 0:
                r.speedup = r.tokens_per_second / b.tokens_per_second
            assert r.stats is not None
            r.predicted_speedup = predict_speedup(r.stats, t1)
        if greedy and b is not None:
            r.identical = r.tokens == b.tokens


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
    identical: tuple[int, int]  # (identical, greedy runs compared)
    n_prompts: int

    def as_json(self) -> dict[str, Any]:
        return {
            "mode": self.config.mode,
            "draft_max": self.config.draft_max,
            "label": self.config.label,
            "engine_modes": self.engine_modes,
            "speedup_by_category": {c: _round(v, 4) for c, v in self.speedup_by_column.items()},
            "speedup": _round(self.speedup, 4),
            "predicted_speedup": _round(self.predicted_speedup, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_rate": _round(self.acceptance_rate, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "overhead_fraction": round(self.overhead_fraction, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
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
        + ["overall", "predicted", "MAT", "accept", "overhead", "tok/s", "identical"]
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
                same,
            ]
        )
    return head, body


CAPTION = (
    "speed-up = tok/s over the target alone on the same prompt (median over repeats, "
    "geometric mean over prompts); predicted = the cost model from measured acceptance "
    "and pass times; MAT = tokens per target pass; overhead = decode time outside llama.cpp"
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
        "load_average_max": _round(result.load_max, 2),
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


def _round(v: float | None, nd: int) -> float | None:
    return None if v is None else round(v, nd)
