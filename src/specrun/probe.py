"""Does a draft model pay for this target, on this machine? The measurements behind
`specrun models check` and `specrun draft make`. No Typer and no printing here.

The probe, on a few short built-in prompts, greedy:
1. *learn*: the target alone (``mode="none"``: the one-row pass time t1) and the draft at a long
   draft length (``mode="draft"``, K = 8): per-position acceptance, draft step seconds, and the
   target's pass seconds by rows;
2. *model*: c = draft step / t1, V(n) = 1 + s (n - 1) with s fitted to the measured pass times,
   and the K that the cost model (costmodel.py) predicts fastest;
3. *measure*: the recommended K against the target alone, alternating on every prompt; the
   measured speed-up is the median of the paired ratios, so a neighbour's load that comes and
   goes hits both sides of a pair alike.

Greedy speculation must reproduce the target alone token for token: every draft run is compared
with the target's own run on the same prompt (``identical``).

This module is on `specrun --help`'s import path (cli/models.py and cli/draft.py import it): what
the measurements need (the engine, numpy, llama/, models.drafts) is imported where used.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specrun.decoding import costmodel
from specrun.errors import UsageError
from specrun.models import compat

if TYPE_CHECKING:
    from specrun.decoding.engine import Result
    from specrun.llama.model import Model

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "List five facts about the Moon.",
    "Explain in two sentences why the sky is blue.",
)
WARMUP_TOKENS = 8

Say = Callable[[str], None]


@dataclass(frozen=True)
class ProbeSettings:
    max_tokens: int = 48  # per run
    learn_k: int = 8  # draft length while learning acceptance; also the largest K considered
    repeats: int = 1  # alternating (none, K) pairs per prompt in the measurement
    prompts: tuple[str, ...] = PROMPTS

    def validate(self) -> None:
        if self.max_tokens < 8:
            raise UsageError(f"the probe needs at least 8 tokens per run, got {self.max_tokens}")
        if not 1 <= self.learn_k <= 32:
            raise UsageError(f"--draft-max must be in [1, 32], got {self.learn_k}")
        if self.repeats < 1:
            raise UsageError(f"--repeats must be >= 1, got {self.repeats}")
        if not self.prompts:
            raise UsageError("the probe needs at least one prompt")


@dataclass
class Probe:
    """What the probe measured and what the cost model makes of it (seconds unless noted)."""

    acceptance: float  # accepted / drafted while learning (greedy, K = learn_k)
    cum_acceptance: list[float]  # [i]: P(draft positions 0..i all accepted)
    t1: float  # one-row target pass
    verify_seconds: dict[int, float]  # rows -> mean target pass
    draft_step: float  # one draft step
    c: float  # draft step / t1
    verify_slope: float  # V(n) = 1 + verify_slope * (n - 1)
    best_k: int  # 0: drafting does not pay
    predicted: float  # predicted speed-up at best_k
    predicted_by_k: list[float]  # [K] for K = 0..learn_k
    measured_k: int  # the K measured: best_k, or when that is 0 the best K >= 1 (to show the loss)
    measured: float | None  # median paired speed-up at measured_k against the target alone
    baseline_tps: float  # median tokens/s of the target alone
    spec_tps: float | None  # median tokens/s at measured_k
    identical: bool  # every greedy draft run said exactly what the target alone said
    runs: int = 0
    seconds: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)

    def v(self, n: int) -> float:
        return 1.0 + self.verify_slope * (n - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verify_seconds"] = {str(k): v for k, v in self.verify_seconds.items()}
        d["v_best"] = self.v(self.best_k + 1)
        return _rounded(d)


def _rounded(obj: Any) -> Any:
    if isinstance(obj, float):
        return round(obj, 6 if abs(obj) < 0.01 else 4)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


def compatibility(target: Model, draft: Model) -> list[str]:
    """Every rule the pair breaks (llama.cpp's vocabulary rules plus rollback); empty when fine."""
    # (compat.Facts declares plain attributes; VocabFacts is frozen: same reads, mypy disagrees)
    out = compat.problems(
        target.vocab_facts(),  # type: ignore[arg-type]
        draft.vocab_facts(),  # type: ignore[arg-type]
        target.token_text,
        draft.token_text,
    )
    for role, m in (("target", target), ("draft", draft)):
        if not m.can_truncate:
            out.append(
                f"the {role}'s KV cache cannot be rolled back (recurrent or hybrid model): "
                "rejected draft tokens could not be undone"
            )
    return out


def encode(model: Model, text: str) -> list[int]:
    """A user message through the model's own chat template, or raw text when it has none."""
    from specrun.chat_template import encode_chat

    if not model.chat_template():
        return model.tokenize(text, add_special=True)
    return encode_chat(model, [{"role": "user", "content": text}])


def fit_verify_slope(t1: float, verify_seconds: dict[int, float], counts: dict[int, int]) -> float:
    """Least-squares slope s of V(n) = 1 + s (n - 1) through the measured passes, V(1) = 1."""
    num = den = 0.0
    for rows, secs in verify_seconds.items():
        if rows <= 1:
            continue
        w = counts.get(rows, 1)
        x = rows - 1
        num += w * x * (secs / t1 - 1.0)
        den += w * x * x
    return max(0.0, num / den) if den else 0.0


@dataclass
class _Tally:
    """Per-run stats summed over the learning runs."""

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    verify_s: dict[int, float] = field(default_factory=dict)
    verify_n: dict[int, int] = field(default_factory=dict)
    draft_s: float = 0.0
    draft_steps: int = 0

    def add(self, r: Result) -> None:
        st = r.stats
        for lst, src in (
            (self.drafted, st.per_position_drafted),
            (self.accepted, st.per_position_accepted),
        ):
            lst.extend([0] * (len(src) - len(lst)))
            for i, n in enumerate(src):
                lst[i] += n
        for rows, s in st.verify_seconds.items():
            self.verify_s[rows] = self.verify_s.get(rows, 0.0) + s
            self.verify_n[rows] = self.verify_n.get(rows, 0) + st.verify_counts[rows]
        self.draft_s += st.draft_seconds
        self.draft_steps += st.draft_steps

    def mean_verify(self) -> dict[int, float]:
        return {r: self.verify_s[r] / self.verify_n[r] for r in sorted(self.verify_n)}


def probe(
    target: Model,
    draft: Model,
    settings: ProbeSettings | None = None,
    say: Say | None = None,
) -> Probe:
    """Measure the pair (which must be compatible) as the module docstring describes."""
    from specrun.decoding.engine import Engine, SpecConfig
    from specrun.decoding.sampling import SamplingParams

    s = settings or ProbeSettings()
    s.validate()
    tell = say or (lambda _msg: None)
    t_start = time.perf_counter()
    room = min(target.n_ctx, draft.n_ctx) - s.max_tokens - s.learn_k - 2
    if room <= 8:
        raise UsageError(f"a context of {target.n_ctx} tokens is too small for the probe")
    prompts = [encode(target, p)[-room:] for p in s.prompts]

    alone = Engine(target, None, SpecConfig(mode="none"))
    learner = Engine(target, draft, SpecConfig(mode="draft", draft_max=s.learn_k))
    runs = 0

    def run(engine: Engine, toks: list[int], n: int = s.max_tokens) -> Result:
        nonlocal runs
        runs += 1
        return engine.run(toks, max_tokens=n, params=SamplingParams(temp=0.0), reuse_cache=False)

    # Page the weights in (mmap) before anything is timed.
    tell("warming up")
    run(alone, prompts[0], WARMUP_TOKENS)
    run(learner, prompts[0], WARMUP_TOKENS)

    base = _Tally()
    learnt = _Tally()
    identical = True
    baseline: dict[int, list[int]] = {}
    tps_none: list[float] = []
    for i, toks in enumerate(prompts):
        tell(f"learning acceptance ({i + 1}/{len(prompts)})")
        r0 = run(alone, toks)
        r1 = run(learner, toks)
        base.add(r0)
        learnt.add(r1)
        baseline[i] = r0.tokens
        tps_none.append(r0.stats.tokens_per_second)
        identical &= r1.tokens == r0.tokens

    t1 = base.mean_verify().get(1) or 0.0
    if t1 <= 0:
        raise RuntimeError("the target alone made no timed pass")  # pragma: no cover
    cum = [a / d if d else 0.0 for a, d in zip(learnt.accepted, learnt.drafted, strict=True)]
    cum += [0.0] * (s.learn_k - len(cum))
    for i in range(1, len(cum)):  # position i cannot be accepted more often than i - 1
        cum[i] = min(cum[i], cum[i - 1])
    acceptance = _acceptance(learnt)
    draft_step = learnt.draft_s / learnt.draft_steps if learnt.draft_steps else 0.0
    c = draft_step / t1
    slope = fit_verify_slope(t1, learnt.mean_verify(), learnt.verify_n)
    vcost = costmodel.linear_verify_cost(slope)
    # c here is the draft's time per drafted token over whole steps, the catch-up of a draft
    # accepted whole included, so DESIGN.md's K * c + V(K + 1) applies as it is (auto, which
    # times a draft step per decode, prices that catch-up apart: costmodel.speedups).
    by_k = [costmodel.predicted_speedup(cum, k, c, vcost) for k in range(s.learn_k + 1)]
    best_k = max(range(len(by_k)), key=by_k.__getitem__)  # the first best: ties to the smaller K
    predicted = by_k[best_k]

    # K = 0 is the target alone: then measure the best K >= 1, so the loss is seen, not assumed.
    mk = best_k or max(range(1, s.learn_k + 1), key=lambda k: by_k[k])
    measured = spec_tps = None
    if mk > 0:
        engine = Engine(target, draft, SpecConfig(mode="draft", draft_max=mk))
        ratios: list[float] = []
        tps_k: list[float] = []
        n = 0
        for rep in range(s.repeats):
            for i, toks in enumerate(prompts):
                tell(
                    f"measuring K={mk} against the target alone ({n + 1}/{s.repeats * len(prompts)})"
                )
                n += 1
                first_alone = (i + rep) % 2 == 0  # alternate which side goes first
                if first_alone:
                    ra, rk = run(alone, toks), run(engine, toks)
                else:
                    rk, ra = run(engine, toks), run(alone, toks)
                identical &= rk.tokens == ra.tokens == baseline[i]
                tps_none.append(ra.stats.tokens_per_second)
                tps_k.append(rk.stats.tokens_per_second)
                if ra.stats.tokens_per_second > 0:
                    ratios.append(rk.stats.tokens_per_second / ra.stats.tokens_per_second)
        measured = statistics.median(ratios) if ratios else None
        spec_tps = statistics.median(tps_k) if tps_k else None

    return Probe(
        acceptance=acceptance,
        cum_acceptance=cum,
        t1=t1,
        verify_seconds=learnt.mean_verify() | {1: t1},
        draft_step=draft_step,
        c=c,
        verify_slope=slope,
        best_k=best_k,
        predicted=predicted,
        predicted_by_k=by_k,
        measured_k=mk,
        measured=measured,
        baseline_tps=statistics.median(tps_none),
        spec_tps=spec_tps,
        identical=identical,
        runs=runs,
        seconds=time.perf_counter() - t_start,
        settings={
            "max_tokens": s.max_tokens,
            "learn_k": s.learn_k,
            "repeats": s.repeats,
            "prompts": len(s.prompts),
        },
    )


def _acceptance(t: _Tally) -> float:
    """accepted / drafted over every verified draft token (the CONTRACT's acceptance_rate)."""
    # position i of a pass is drafted once per pass that drafted it: the sums are the totals.
    d = sum(t.drafted)
    return sum(t.accepted) / d if d else 0.0


def recommended(p: Probe | None) -> int | None:
    """The draft_max to write into a pair: the best K, or None when drafting does not pay."""
    return p.best_k if p is not None and p.best_k > 0 else None


def summary_rows(d: dict[str, Any]) -> list[tuple[str, str]]:
    """(figure, value) lines for a small table, from ``Probe.to_dict()``."""
    k = d["best_k"]
    meas = "-" if d["measured"] is None else f"{d['measured']:.2f}x at K={d['measured_k']}"
    if d["spec_tps"] is not None:
        meas += f" (medians: {d['spec_tps']:.1f} vs {d['baseline_tps']:.1f} tok/s)"
    mk = d["measured_k"]
    return [
        (f"acceptance (greedy, K={d['settings']['learn_k']})", f"{d['acceptance']:.1%}"),
        ("per-position acceptance", " ".join(f"{a:.2f}" for a in d["cum_acceptance"])),
        ("target pass t1", f"{d['t1'] * 1000:.2f} ms"),
        ("draft step", f"{d['draft_step'] * 1000:.2f} ms (c = {d['c']:.2f})"),
        ("verify cost V(n)", f"1 + {d['verify_slope']:.3f}(n-1); V({k + 1}) = {d['v_best']:.2f}"),
        ("best K", str(k) if k else "0 (drafting does not pay here)"),
        (
            "predicted speed-up",
            f"{d['predicted']:.2f}x"
            + (f" (K={mk}: {d['predicted_by_k'][mk]:.2f}x)" if mk != k else ""),
        ),
        ("measured speed-up", meas),
        (
            "greedy output",
            "identical to the target alone" if d["identical"] else "DIFFERENT (a bug)",
        ),
    ]


# --------------------------------------------------------------------------------------------
# A draft for any target, found on disk (`specrun models drafts`, and -m with no draft)

DRAFTS_SETTINGS = ProbeSettings(max_tokens=24, learn_k=4, repeats=1, prompts=PROMPTS[:2])


@dataclass
class DraftRank:
    """One candidate draft as measured: ``speedup`` the probe's measured (else predicted)
    speed-up at its best K; ``problem`` why it was left out after loading, if it was."""

    name: str
    source: str
    path: str
    size: int
    probe: dict[str, Any] | None = None
    speedup: float | None = None
    draft_max: int | None = None
    problem: str | None = None


def rank_drafts(
    target_path: Any,
    registry: Any,
    settings: ProbeSettings = DRAFTS_SETTINGS,
    say: Say | None = None,
    n_threads: int | None = None,
) -> tuple[list[DraftRank], list[Any]]:
    """Every local model that could draft for the target (``models.drafts.candidates``),
    probed and ranked by measured speed-up, best first; and those left out, with why."""
    from specrun.llama.model import LoadOptions, Model
    from specrun.models import drafts

    tell = say or (lambda _msg: None)
    target_path = Path(target_path)
    keep, left, _tf = drafts.candidates(target_path, registry)
    ranks: list[DraftRank] = []
    if not keep:
        return ranks, left
    n_ctx = 256 + settings.max_tokens + settings.learn_k
    opts = LoadOptions(n_ctx=n_ctx, n_threads=n_threads, n_batch=min(512, n_ctx))
    tell(f"loading {target_path.name}")
    target = Model(target_path, opts)
    try:
        for m in keep:
            r = DraftRank(m.name, m.source, str(m.path), m.size)
            ranks.append(r)
            tell(f"probing {m.name}")
            try:
                d = Model(m.path, opts)
            except Exception as exc:  # a file llama.cpp refuses: left out, the rest go on
                r.problem = f"llama.cpp cannot load it: {exc}"
                continue
            try:
                probs = compatibility(target, d)
                if probs:
                    r.problem = "incompatible: " + probs[0]
                    continue
                p = probe(target, d, settings, say=_prefixed(tell, m.name))
                r.probe = p.to_dict()
                r.speedup = p.measured if p.measured is not None else p.predicted
                r.draft_max = recommended(p)
            finally:
                d.close()
    finally:
        target.close()
    ranks.sort(key=lambda r: (r.problem is not None, -(r.speedup or 0.0)))
    return ranks, left


def _prefixed(tell: Say, name: str) -> Say:
    return lambda msg: tell(f"{name}: {msg}")


def remembered_draft(target_path: Any) -> tuple[bool, tuple[Any, int | None] | None]:
    """(known, the choice) remembered for this very target file, probing nothing: known is
    False when nothing is remembered (or the draft remembered is gone); the choice is None when
    it was "none pays", else (the draft's path, its draft_max)."""
    from specrun.models import drafts

    target_path = Path(target_path)
    known, path = drafts.remembered(target_path)
    if not known or path is None:
        return known, None
    dm = remembered_figures(target_path).get("draft_max")
    return True, (path, dm if isinstance(dm, int) else None)


def remembered_figures(target_path: Any) -> dict[str, Any]:
    """What the probe measured for the draft remembered for this target (name, speedup,
    draft_max), or {}."""
    from specrun.models import drafts

    try:
        key = str(Path(target_path).resolve())
    except OSError:
        return {}
    entry = drafts._read().get(key, {})
    figures = entry.get("figures", {}) if isinstance(entry, dict) else {}
    return figures if isinstance(figures, dict) else {}


def best_draft_for(
    target_path: Any,
    registry: Any,
    say: Say | None = None,
    n_threads: int | None = None,
) -> tuple[Any, int | None] | None:
    """The draft that pays best for this target file among the models on disk, and its
    draft_max: remembered per target file (``models.drafts.remember``), else found by
    ``rank_drafts`` and remembered. None when none is compatible or none pays."""
    from specrun.models import drafts

    target_path = Path(target_path)
    known, choice = remembered_draft(target_path)
    if known:
        return choice
    ranks, _left = rank_drafts(target_path, registry, say=say, n_threads=n_threads)
    best = next(
        (r for r in ranks if r.problem is None and r.speedup is not None and r.speedup > 1.0),
        None,
    )
    if best is None:
        drafts.remember(target_path, None)
        return None
    figures = {"name": best.name, "speedup": best.speedup, "draft_max": best.draft_max}
    drafts.remember(target_path, Path(best.path), figures)
    return Path(best.path), best.draft_max
