"""How `specrun bench` measures: the configurations, their engines, and the runs.

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
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specrun import defaults
from specrun.benchmark.suite import Prompt, order_columns
from specrun.decoding.costmodel import expected_tokens
from specrun.decoding.engine import Engine, SpecConfig
from specrun.decoding.sampling import SamplingParams
from specrun.decoding.stats import SpecStats
from specrun.errors import SpecrunError, UsageError
from specrun.session import calibrate_auto


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
    prefill_tokens: int
    first_token_seconds: float
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
            "draft_step_seconds": round_or_none(self.costs["draft_step_seconds"], 6),
        }
        for k in (
            "tokens_per_second",
            "decode_seconds",
            "llama_seconds",
            "prefill_seconds",
            "first_token_seconds",
            "acceptance_rate",
            "mean_accepted_length",
            "overhead_fraction",
            "speedup",
            "predicted_speedup",
        ):
            out[k] = round_or_none(out[k], 4)
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
        prefill_tokens=st.prefill_tokens,
        first_token_seconds=st.first_token_seconds,
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


def round_or_none(v: float | None, nd: int) -> float | None:
    return None if v is None else round(v, nd)
