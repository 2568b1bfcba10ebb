"""Which drafter drafts, and how far, at each step.

- ``FixedPolicy``: one drafter, always ``draft_max`` (modes ``draft`` and ``lookup``).
- ``HybridPolicy``: prompt lookup first; the draft model where lookup has nothing.
- ``AutoPolicy``: before each step, the drafter and K that maximise expected tokens per second
  by the cost model (costmodel.py), from running estimates of per-position acceptance (per
  drafter, and per match length for lookup), of how often the draft model stops under
  --draft-p-min, and of the costs measured online (target pass time as a function of rows,
  draft step time, draft catch-up rows). K = 0 (plain decoding) when nothing pays; the draft
  model, when it does not pay, is re-tried now and then, with a backoff, so that it is found
  again when it starts paying; lookup's proposals not taken are scored for free.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specrun import defaults
from specrun.spec import costmodel
from specrun.spec import sampling as S
from specrun.spec.drafters import EMPTY, Drafter, DraftModel, Proposal


@dataclass(frozen=True)
class StepReport:
    """One step, as the engine reports it to its policy (``Policy.observe``)."""

    drafter: str  # whose draft the target verified: "draft", "lookup", or "none" (plain decoding)
    k: int  # draft tokens verified
    accepted: int  # of them, accepted
    draft_s: float  # seconds spent drafting (a declined attempt's included)
    verify_s: float  # seconds of the target pass over k + 1 rows
    tokens: Sequence[int] = ()  # what the step committed (accepted drafts, then the target's own)
    declined: str | None = None  # a drafter that ran but proposed too little to verify
    # The target's top probability at the step's first position reached confidence_p() (asked
    # on plain and lookup steps, not after a declined draft); None when not asked.
    target_sure: bool | None = None


class Policy:
    drafters: Sequence[Drafter] = ()

    def draft(
        self,
        tokens: list[int],
        k_cap: int,
        params: S.SamplingParams,
        rng: np.random.Generator,
        greedy_draft: bool,
    ) -> tuple[str, Proposal]:
        raise NotImplementedError

    def observe(self, report: StepReport) -> None:
        """What the last step did: the engine reports each step once, here."""

    def confidence_p(self) -> float:
        """> 0: this step, if plain or lookup's, reports whether the target's top probability at
        its first position reached this (``StepReport.target_sure``); asked after each ``draft``."""
        return 0.0

    def prefill(self, tokens: list[int]) -> None:
        for d in self.drafters:
            d.prefill(tokens)

    def rollback(self, valid_len: int) -> None:
        for d in self.drafters:
            d.rollback(valid_len)

    def reset(self) -> None:
        for d in self.drafters:
            d.reset()

    def finish(self, tokens: list[int]) -> None:
        for d in self.drafters:
            fin = getattr(d, "finish", None)
            if fin is not None:
                fin(tokens)


class NoDraft(Policy):
    def draft(self, tokens, k_cap, params, rng, greedy_draft):  # type: ignore[no-untyped-def]
        return "none", EMPTY


class FixedPolicy(Policy):
    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.drafters = (drafter,)

    def draft(self, tokens, k_cap, params, rng, greedy_draft):  # type: ignore[no-untyped-def]
        return self.drafter.name, self.drafter.propose(tokens, k_cap, params, rng, greedy_draft)


class HybridPolicy(Policy):
    def __init__(self, lookup: Drafter, model: DraftModel, draft_max: int | None = None) -> None:
        self.lookup, self.model = lookup, model
        self.drafters = (lookup, model)
        self.draft_max = draft_max  # the draft model's K (lookup may be allowed more)

    def draft(self, tokens, k_cap, params, rng, greedy_draft):  # type: ignore[no-untyped-def]
        prop = self.lookup.propose(tokens, k_cap, params, rng, greedy_draft)
        if len(prop):
            return self.lookup.name, prop
        k = min(k_cap, self.draft_max) if self.draft_max else k_cap
        return self.model.name, self.model.propose(tokens, k, params, rng, greedy_draft)


@dataclass(frozen=True)
class AutoPriors:
    """AutoPolicy's priors (what it assumes before measuring) and rates (how fast its estimates
    move), in one place. Each was set by a benchmark; the note says which and what it showed.
    Figures: SmolLM2-135M pairs on a 2-core CPU, bench/modes_compare.py, model time, unless said."""

    # -- costs --------------------------------------------------------------------------------
    # V(n) = 1 + slope (n - 1) before any pass is measured: V(5) ~ 1.4 on a 2-core CPU (DESIGN.md).
    # A calibrated run (calibrate.py) replaces it at once.
    verify_slope: float = 0.1
    # A draft step relative to a target step, before one is measured: a re-quantized self-draft
    # costs c ~ 0.25-0.5.
    draft_cost: float = 0.35
    # A measured draft step (calibration) counts as this many observations against draft_cost.
    seen_weight: int = 4
    # EMA rate of the measured pass and catch-up costs.
    cost_alpha: float = 0.2

    # -- acceptance ---------------------------------------------------------------------------
    accept_draft: float = 0.6  # the draft model's per-position acceptance, unmeasured
    # A lookup match of 2+ tokens. 0.5 bet on code-like text where matches seldom held (see
    # margin below, measured together).
    accept_lookup: float = 0.4
    # A one-token match is weak evidence: on open-ended text its proposals were all rejected,
    # and a 0.5 prior spent the first dozen steps learning that (1.9% of a story's time).
    accept_lookup_1: float = 0.3
    # Each draft ages every position's counts by this (an EMA in count form): per-position EMAs
    # of the cumulative rate from a geometric 0.6 prior needed ~20 steps on a code prompt
    # before the deep positions believed a draft accepted 98% of the time (K = 2-3 meanwhile).
    accept_alpha: float = 0.15
    # Lookup's estimates forget more slowly: where lookup is near break-even (a summary in the
    # model's own words: its first token right ~30% of the time) a fast estimate crossed the line
    # on a lucky streak and bet on it. Summary 2.175x -> 2.261x, the bench's summary turn 0.960
    # -> 0.968 of the target, its math turn 1.194x -> 1.173x, QA, a code edit, RAG, translation,
    # code and the story within 0.5%.
    lookup_alpha: float = 0.08
    # What a reset (a new request in the same process) keeps of lookup's acceptance counts.
    # Replayed over recorded greedy runs of the default pair (bench/suffix_sim.py, calibrated
    # F16 costs; and V(n) = 1 + 0.1 (n - 1)): code editing 1.28x -> 1.32x (1.92x -> 1.96x), JSON
    # extraction 1.09x -> 1.11x (1.54x -> 1.64x), SQL 1.08x either way (1.49x -> 1.51x); 0.3, 0.6
    # and 1.0 within 1-2% of 0.5. Single requests, each from a cleared store, are not affected.
    lookup_carry: float = 0.5
    prior_n: float = 2.0  # a prior counts as this many observations (one early miss lowers it)
    shrink_n: float = 2.0  # a position's own rate weighs against the others' as if from this many

    # -- the draft model's stops under --draft-p-min ----------------------------------------------
    stop: float = 0.2  # it stops at its first position (top probability under --draft-p-min)
    go_on: float = 0.8  # ... and goes on past a later one, having proposed the one before
    stop_alpha: float = 0.15  # EMA rate of the stop and go-on estimates after the first few
    # The probe gate's slower stop rate: sd ~0.07 on a story, ~25 tokens to turn. At the fast
    # rate (sd ~0.14) its dips made a perfect draft look like it would pay 15% now and then on a
    # story, and each such probe cost a catch-up (25-37 ms, about a target step; 2-3 per 128).
    stop_slow_alpha: float = 0.04

    # -- choosing -----------------------------------------------------------------------------
    # Speculate only when it is predicted to pay at least this much. On targets whose batches
    # are dear (F16/Q8_0/Q4_K_M SmolLM2 on a 2-core Zen 4: V(5) 2.4-3.1) a bet predicted at
    # 1.03-1.10 was as often a loss, and lookup streaks on code that did not last left auto below
    # the target alone. bench/modes_compare.py, 6 prompts x 3 pairs, model time, medians of 3:
    # margin 1.03 + accept_lookup 0.5 gave 0.95-0.96 on 3 of the 18 (the Stack class on F16 and
    # Q8_0, QA on Q4_K_M); 1.1 + 0.4 gave >= 0.98 on all 18, for 1.85x against 1.96x on Q8_0's QA
    # and 1.08x against 1.12x on Q4_K_M's Stack class.
    margin: float = 1.1
    probe_min: int = 8  # steps between re-tries of an unchosen draft model, at first ...
    probe_max: int = 128  # ... doubling up to this
    # The draft model is re-tried only where it would pay at least this much were every proposal
    # accepted: a re-try costs its catch-up, about one target step (20-28 ms against 28-35 ms),
    # and where even a perfect draft would gain a few percent (the story: the draft unsure at
    # 55-60% of positions) finding it right cannot earn that back. At margin, the draft's time
    # on the story, nearly all re-tries that proposed nothing, was 2.2-2.9% of the decode time.
    # 1.15 -> 1.3 once a draft step was priced right (F16 target, Q4_0 draft: c ~ 0.52, where a
    # perfect 8-token draft reads 1.19): model time, medians of 3, a Stack class 0.98x -> 1.00x,
    # code 0.97x -> 1.00x, the bench's summary turn 0.95x -> 0.98x, its math and MT turns the
    # same; on the F32 pair, where the draft pays, code 1.39x -> 1.38x, a summary 1.52x -> 1.54x.
    probe_bar: float = 1.3
    # A probe catches up on at most this many of the tokens the draft has not seen (the last
    # ones; DraftModel.propose's window). A full catch-up costs a draft row per token generated
    # since the draft last ran, and on open-ended text that alone made auto slower than the
    # target (13 probes took 0.6 s of draft time; two 16-row probes 3.9% of a story's run).
    probe_window: int = 4
    # ... and on two where the draft decodes its rows one at a time (AMX, Model.single_rows):
    # there each catch-up row costs a whole draft step (~4.5 ms beside a 9.5 ms Q8_0 target on
    # a 2-core Intel Xeon), a 4-row re-try ~15 ms, mostly for nothing. Two rows are what a
    # re-try right after a plain step owes (that step's token and the pending one); one skipped
    # the token before the pending one, the re-try's proposal missed, and the draft was lost
    # where it pays (F32 pair code 1.66x -> 1.17x). One process, alternating 3-6 times, ratio
    # to plain decoding, 4 rows -> 2 (-> 1): Q8_0 pair Stack class 0.874 -> 0.982 (0.973; no draft
    # model at all 0.990), F32 pair code 1.660 -> 1.665 (1.169), Stack class 1.659 -> 1.687.
    probe_window_single: int = 2
    # And a draft chosen because it pays, after another drafter's stretch, on at most this many:
    # where the draft decodes row by row (AMX) a full catch-up of the ~100 tokens lookup had
    # accepted (~0.4 s at 4.7 ms a row) cost more than lookup had saved: auto 1.94x vs lookup
    # 2.68x on QA, 3.00x with the window.
    catch_up_window: int = 16
    # A catch-up owed is a one-off cost; choosing the draft prices it spread over this many
    # steps. Unpriced, the draft was chosen on a summary after a lookup stretch at a predicted
    # 1.22x, paid a 16-row catch-up (64 ms, ~2.5 target steps) and then proposed nothing.
    catch_up_horizon: int = 4

    def accept_prior(self, key: str) -> float:
        """The base prior of a drafter's acceptance ("draft", "lookup:N")."""
        if key == "lookup:1":
            return self.accept_lookup_1
        return self.accept_lookup if key.startswith("lookup") else self.accept_draft


PRIORS = AutoPriors()


class _Acceptance:
    """Running estimate of cumulative per-position acceptance, from conditional rates.

    Position i of a draft is *tried* when positions 0..i-1 were accepted, and a *hit* when it
    is accepted too; its conditional rate is hits / tries. Positions after the first rejection
    say nothing about their own rate and are not counted. One acceptance process underlies all
    positions, so each position's rate is shrunk toward the rate of the *other* positions
    (a deep position, seldom reached, borrows from them; its own data is not counted twice),
    itself shrunk toward the prior. ``cum[i]`` is the product of the rates of positions 0..i
    (monotone by construction). Counts decay (an EMA in count form, ``alpha`` per draft, every
    position, reached or not) so that a change of text is tracked: deep positions that a run of
    early rejections no longer reaches must not keep vouching for the others.

    Why: per-position EMAs of the cumulative rate, each from a geometric 0.6 prior, needed ~20
    steps on a code prompt before the deep positions believed a draft the target accepted 98%
    of the time, and auto drafted K = 2-3 meanwhile (53 target passes for 128 tokens against
    the fixed K = 4's 37).
    """

    def __init__(
        self, prior: float, k: int, alpha: float | None = None, priors: AutoPriors | None = None
    ) -> None:
        pr = priors or PRIORS
        self.prior, self.k = prior, k
        self.alpha = pr.accept_alpha if alpha is None else alpha
        self.prior_n, self.shrink_n = pr.prior_n, pr.shrink_n
        self.hits = [0.0] * k
        self.tries = [0.0] * k
        # estimate()'s answer and the prior it was made with, until the counts move (auto asks
        # for the draft model's on every step, where it runs one step in a hundred)
        self._est: tuple[float, list[float]] | None = None

    def update(self, k: int, n_accepted: int) -> None:
        """A draft of ``k`` tokens whose first ``n_accepted`` were accepted."""
        self.age()
        for i in range(min(k, n_accepted + 1, self.k)):
            self.add(i, i < n_accepted)

    def age(self) -> None:
        """A new draft: every position ages, reached or not."""
        keep = 1.0 - self.alpha
        for i in range(self.k):
            self.hits[i] *= keep
            self.tries[i] *= keep
        self._est = None

    def add(self, i: int, hit: bool) -> None:
        """Position ``i`` of the last draft was tried (its positions before it accepted)."""
        if i < self.k:
            self.hits[i] += 1.0 if hit else 0.0
            self.tries[i] += 1.0
            self._est = None

    def scale(self, w: float) -> None:
        """Keep this share of every count (what a new request keeps of the last one's)."""
        self.hits = [h * w for h in self.hits]
        self.tries = [t * w for t in self.tries]
        self._est = None

    def rates(self) -> list[float]:
        """Conditional acceptance per position."""
        h_all, n_all = sum(self.hits), sum(self.tries)
        out = []
        for h, n in zip(self.hits, self.tries, strict=True):
            others = (h_all - h + self.prior_n * self.prior) / (n_all - n + self.prior_n)
            out.append((h + self.shrink_n * others) / (n + self.shrink_n))
        return out

    def estimate(self) -> list[float]:
        """Cumulative acceptance per position (the list is shared: do not change it)."""
        if self._est is not None and self._est[0] == self.prior:
            return self._est[1]
        out, c = [], 1.0
        for r in self.rates():
            c *= r
            out.append(c)
        self._est = (self.prior, out)
        return out


@dataclass
class _Rate:
    """Running estimate of how often something happens (the draft model stopping at a
    position): a plain average over the first observations, with the prior counted as
    ``prior_n`` of them, then an EMA."""

    p: float
    alpha: float = PRIORS.stop_alpha
    seen: int = 0
    prior_n: float = PRIORS.prior_n

    def update(self, hit: bool) -> None:
        w = max(self.alpha, 1.0 / (self.seen + 1 + self.prior_n))
        self.p += w * ((1.0 if hit else 0.0) - self.p)
        self.seen += 1


@dataclass
class _Costs:
    """Online measurements: target pass seconds by rows, draft step seconds."""

    verify: dict[int, float] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)  # passes measured this run, by rows
    draft_step: float | None = None
    draft_n: int = 0
    catch_up_row: float | None = None  # seconds per row of a draft catch-up of 2+ rows
    alpha: float = PRIORS.cost_alpha
    slope: float = PRIORS.verify_slope  # V(n)'s slope until two sizes are measured
    # verify_cost()'s answer, kept while V(n) stands: a one-row pass moves every size alike
    # (observe_verify), so only a pass of more rows, a size first seen, or seeding changes it.
    # Rebuilt every step it was 13 us, ~0.2% of a 6 ms Q8_0 step (AMX, 2-core Intel Xeon).
    _v: costmodel.VerifyCost | None = field(default=None, init=False, repr=False)

    def seed(self, verify: dict[int, float]) -> None:
        """Measured pass seconds by rows (a calibration), as if observed."""
        self.verify.update(verify)
        self._v = None

    def observe_catch_up(self, rows: int, seconds: float) -> None:
        if rows > 1:
            per = seconds / rows
            old = self.catch_up_row
            self.catch_up_row = per if old is None else old + self.alpha * (per - old)

    def observe_verify(self, rows: int, seconds: float) -> None:
        self.seen[rows] = self.seen.get(rows, 0) + 1
        old = self.verify.get(rows)
        new = seconds if old is None else old + self.alpha * (seconds - old)
        if rows == 1 and old is not None and old > 0.0:
            # The machine's pace moves a pass of every size alike (a busy neighbour, the clock, a
            # longer context): passes of more rows, seen seldom (some only at calibration), keep
            # their ratio to one row, V(n), rather than seconds from when one row took other
            # time. Left as seconds, one row drifting from 12.2 to 14 ms (a shared 2-core EPYC,
            # an F16 target) priced V(3) 1.82 -> 1.57 and V(9) 3.25 -> 2.82, and auto bet on a
            # draft model whose passes had not got cheaper (code: 0.95x of plain decoding).
            scale = new / old
            for r in self.verify:
                if r != 1:
                    self.verify[r] *= scale
        else:
            self._v = None  # V(rows) moved, or one row was first seen
        self.verify[rows] = new

    def observe_draft(self, steps: int, seconds: float) -> None:
        if steps <= 0:
            return
        per = seconds / steps
        self.draft_n += 1
        # A plain average over the first observations, then an EMA: one early draft step took
        # 42 ms against 5-9 ms later (cause not isolated), and as the whole estimate it priced
        # the draft model out for the rest of the run.
        w = max(self.alpha, 1.0 / self.draft_n)
        self.draft_step = (
            per if self.draft_step is None else self.draft_step + w * (per - self.draft_step)
        )

    def t1(self) -> float | None:
        if 1 in self.verify:
            return self.verify[1]
        if self.verify:  # extrapolate from the smallest batch seen, with the prior slope
            r = min(self.verify)
            return self.verify[r] / (1.0 + self.slope * (r - 1))
        return None

    def verify_cost(self) -> costmodel.VerifyCost:
        """V(n) relative to one row: measured where seen, else a line through what was seen."""
        if self._v is None:
            self._v = self._verify_cost()
        return self._v

    def _verify_cost(self) -> costmodel.VerifyCost:
        t1 = self.t1()
        if t1 is None or t1 <= 0:
            return costmodel.linear_verify_cost(self.slope)
        rows = sorted(r for r in self.verify if r > 1)
        if rows:
            r = rows[-1]
            slope = max(0.0, (self.verify[r] / t1 - 1.0) / (r - 1))
        else:
            slope = self.slope
        seen = {r: t / t1 for r, t in self.verify.items()}
        pts = sorted(seen.items())

        def v(n: int) -> float:
            got = seen.get(n)
            if got is not None:
                return got
            # Between two sizes measured (a calibration measures 1, 2, 3, 5 and 9 rows): on
            # the line between them; beyond the largest, on the line from one row to it.
            lo = hi = None
            for r, x in pts:
                if r < n:
                    lo = (r, x)
                elif r > n:
                    hi = (r, x)
                    break
            if lo is not None and hi is not None:
                got = lo[1] + (hi[1] - lo[1]) * (n - lo[0]) / (hi[0] - lo[0])
            else:
                got = 1.0 + slope * (n - 1)
            seen[n] = got  # asked again within the step: the cost model prices K = 1..k_max
            return got

        return v


class AutoPolicy(Policy):
    """The drafter and K of each step by the cost model, from running estimates; its priors and
    rates are an ``AutoPriors`` (``PRIORS`` unless given)."""

    def __init__(
        self,
        draft_max: int,
        lookup: Drafter | None = None,
        model: DraftModel | None = None,
        priors: AutoPriors = PRIORS,
        lookup_n_max: int | None = None,
    ) -> None:
        self.priors = priors
        self.draft_max = draft_max
        # The n-gram drafter's longest match (--lookup-max): its acceptance buckets go up to it.
        self.lookup_n_max = lookup_n_max
        self.lookup, self.model = lookup, model
        # Lookup's longest proposal (the suffix drafter's may exceed the draft model's K).
        self.lookup_k = max(draft_max, int(getattr(lookup, "k_max", draft_max)))
        self.drafters = tuple(d for d in (lookup, model) if d is not None)
        self._measured: tuple[dict[int, float], float | None] = ({}, None)
        self._refine: Callable[[dict[int, tuple[float, int]]], None] | None = None
        self._fresh()

    def calibrate(
        self,
        verify_s: dict[int, float],
        draft_step_s: float | None = None,
        refine: Callable[[dict[int, tuple[float, int]]], None] | None = None,
    ) -> None:
        """Start every run from measured costs (calibrate.py: seconds of a target pass by rows,
        of a draft step) instead of the priors: a target whose batches are expensive is then
        priced right at its first step, not after a dozen lost bets. They weigh as
        ``priors.seen_weight`` observations; later measurements move them as any other.
        ``refine``, at each text's end, is given the run's estimates of what its passes cost
        (rows -> (seconds, passes seen)): calibrate.refine keeps the measurement in step with
        what runs pay."""
        self._measured = (dict(verify_s), draft_step_s)
        self._refine = refine
        self._seed_costs()

    def _seed_costs(self) -> None:
        verify, draft_step = self._measured
        self.costs.seed(verify)
        if draft_step is not None and draft_step > 0:
            self.costs.draft_step = draft_step
            self.costs.draft_n = self.priors.seen_weight

    def reset(self) -> None:
        """A cold start (Engine.reset: a new text): forget what was learnt too, or the estimates
        of one text steer the next (a story's hopeless draft estimate kept auto from drafting on
        the code prompt benchmarked after it: 1.02x vs the draft's 1.49x). Lookup's acceptance
        estimates are kept at a fraction of their weight (``AutoPriors.lookup_carry``), as the
        lookup store is: they cost nothing to correct (a declined proposal is scored against the
        tokens the step produced), and the next request of one process is often of the same kind
        (chat turns, repeated tasks). ``forget_lookup`` drops them with the store."""
        super().reset()
        kept = {k: a for k, a in self.acc.items() if k.startswith("lookup")}
        self._fresh()
        carry = self.priors.lookup_carry
        if carry > 0.0:
            for key, a in kept.items():
                a.scale(carry)
                self.acc[key] = a

    def forget_lookup(self) -> None:
        """Drop lookup's acceptance estimates (Engine.clear_store: every run a first request)."""
        for key in [k for k in self.acc if k.startswith("lookup")]:
            del self.acc[key]

    def prefill(self, tokens: list[int]) -> None:
        """The draft model reads the prompt only where it may run: where even a draft accepted
        whole that never stops would not clear the re-try bar (probe_bar) at the measured costs,
        auto does not re-try it, nor, with its acceptance unmeasured (the prior's 0.6), choose
        it, and its prefill would be time before the first token for nothing. A draft asked
        later all the same (the costs moved) catches up then (DraftModel.propose, windowed).
        SmolLM2-135M Q4_K_M target, Q4_0 draft on a 2-core Intel Xeon with AMX (the draft's
        prefill row by row, 2.8 ms a token): a 327-token prompt took 1.25 s before the first
        token under auto, 0.60 s under plain decoding."""
        if self.lookup is not None:
            self.lookup.prefill(tokens)
        if self.model is not None:
            self.model.prefill(tokens, evaluate=self.draft_may_run())

    def draft_may_run(self) -> bool:
        """Whether a perfect draft would clear the re-try bar at the costs known now."""
        if self.model is None:
            return False
        v = self.costs.verify_cost()
        return costmodel.perfect_best(self._draft_c(), v, self.draft_max) > self.priors.probe_bar

    def _fresh(self) -> None:
        pr = self.priors
        self.costs = _Costs(alpha=pr.cost_alpha, slope=pr.verify_slope)
        self._seed_costs()
        # How often the draft model stops at its first token, unsure (--draft-p-min): from its
        # own attempts, and on plain and lookup steps from the target's confidence, a free
        # stand-in (SmolLM2 at 0.6: the target was that sure on 88% of the code prompts' tokens,
        # 41% of a story's).
        self.stop = _Rate(pr.stop, alpha=pr.stop_alpha, prior_n=pr.prior_n)
        # The same, slower, for the probe gate only (probe_bar). On a story (the target sure at
        # 41% of positions) the fast estimate's noise (sd ~0.14 at alpha 0.15) dipped it far
        # enough, now and then, for a perfect draft to look like it would pay 15%, and each such
        # probe cost a catch-up (25-37 ms, about a target step; 2-3 per 128 tokens).
        self.stop_slow = _Rate(pr.stop, alpha=pr.stop_slow_alpha, prior_n=pr.prior_n)
        # How often it goes on past a position once it has proposed the token before: sureness
        # comes in stretches (on code the target was sure after a sure token 91-94% of the time,
        # 47-71% after an unsure one; on a story 40% and 43%), so one stop rate for every
        # position undervalued the draft where code alternates with prose (a Stack class's
        # docstrings: five unsure tokens in a row, and auto left the draft model, which went on to
        # propose 4/4, 3/3, 1/1, 4/4, for lookup's 2-token guesses). From the draft's attempts
        # and from consecutive plain steps (the target's sureness after a sure token).
        self.go_on = _Rate(pr.go_on, alpha=pr.stop_alpha, prior_n=pr.prior_n)
        self._prev_sure = False  # the last step was plain and its target sure
        self._asked = 0  # the K the draft model was last asked for
        self.acc: dict[str, _Acceptance] = {}
        self._probe_every = self.priors.probe_min  # steps between re-tries of the draft model
        # Steps since the draft model last ran: as if a re-try were due, so that it is tried
        # once at the start even where the prior does not expect it to pay (with nothing
        # measured yet, the prior's verdict is the least informed one auto will ever make).
        self._since = self.priors.probe_min
        self.last_choice: tuple[str, int, float] = ("none", 0, 1.0)
        self._longer = False  # the last draft was accepted whole: explore one position further
        self._rival_s = 1.0  # predicted speed-up of what would have run had there been no probe
        self._probing = False  # the last step was a probe, not the best choice
        # Lookup's proposals, taken or not, scored position by position against the tokens the
        # steps commit, until their first miss or their end: [key, tokens, next position].
        self._pending: list[list[Any]] = []
        self._draft_may_run_now = True  # the last step's _draft_could_run
        self._run_memo: tuple[costmodel.VerifyCost, list[float], int, float, bool] | None = None

    def _acc(self, key: str) -> _Acceptance:
        a = self.acc.get(key)
        if a is None:
            pr = self.priors
            is_lookup = key.startswith("lookup")
            a = self.acc[key] = _Acceptance(
                pr.accept_prior(key),
                self.lookup_k if is_lookup else self.draft_max,
                pr.lookup_alpha if is_lookup else pr.accept_alpha,
                pr,
            )
        return a

    def _draft_c(self) -> float:
        t1 = self.costs.t1()
        if self.costs.draft_step is None or not t1:
            return self.priors.draft_cost
        w = self.costs.draft_n / (
            self.costs.draft_n + self.priors.prior_n
        )  # the prior as prior_n observations
        return w * self.costs.draft_step / t1 + (1.0 - w) * self.priors.draft_cost

    def draft(self, tokens, k_cap, params, rng, greedy_draft):  # type: ignore[no-untyped-def]
        v = self.costs.verify_cost()
        self._since += 1
        k_model = min(k_cap, self.draft_max)  # k_cap may be lookup's longer cap
        self._draft_may_run_now = self._draft_could_run(v, k_model)
        if not self._draft_may_run_now:
            self._prev_sure = False  # sureness goes unasked: no run of it to continue
        best: tuple[float, str, int, Proposal | None] = (self.priors.margin, "none", 0, None)
        lookup_prop: Proposal | None = None
        lookup_key = "lookup"
        if self.model is not None and self._draft_may_run_now:  # else it cannot beat the margin
            k, s = self._draft_best(v, k_model, tokens=tokens)
            if k and s > best[0]:
                best = (s, "draft", k, None)
        if self.lookup is not None:
            prop = self.lookup.propose(tokens, k_cap, params, rng, greedy_draft)
            if len(prop):
                lookup_prop, lookup_key = prop, self._lookup_key()
                # While the draft model pays, every token lookup gets accepted is one the draft
                # model must catch up on later: lookup is not free then (code: auto took lookup's
                # 2-token matches over a draft right 98% of the time, 1.12x vs 1.47x), until the
                # draft is a catch-up window behind (it skips the rest).
                behind = (
                    best[1] == "draft"
                    and self.model is not None
                    and len(tokens) - self.model.n_cached < self.priors.catch_up_window
                )
                extra = self._catch_up_c() if behind else 0.0
                acc = self._acc(lookup_key)
                acc.prior = self._lookup_prior(lookup_key)
                k, s = costmodel.best_k(acc.estimate(), 0.0, v, len(prop), per_accepted=extra)
                if k and s > best[0]:
                    best = (s, lookup_key, k, Proposal(prop.tokens[:k], None))

        s, key, k, prop_ready = best
        self._rival_s = s
        window = self.priors.catch_up_window
        # Re-probing. An estimate only moves when its drafter runs, so the draft model, when it
        # is not chosen, is tried now and then, with a backoff. Lookup needs no re-try: its
        # proposal costs nothing, and one not taken is scored against the tokens the step
        # produces (_observe_tokens), whatever ran instead. (Re-trying it with 2-token proposals
        # while the draft model ran cost a draft step each, and a lucky 2/2 began a burst: on code
        # auto came to 0.935 of the draft alone in model time, 0.957 with scoring instead; on a
        # Stack class 0.916 and 0.963.)
        #
        # Only just after a plain step whose target was sure (at --draft-p-min) when the draft
        # stops where it is unsure: a re-try at a position the smaller model is not sure of
        # proposes nothing and still pays its catch-up (~1.3% of an F16 summary's run each),
        # and one that gets nothing ends its burst, so the draft was often left unfound where it
        # pays. After a sure token the next is sure 40-94% of the time (go_on). One process, the
        # builtin turns alternating 10 times, medians of the ratio to plain decoding: F32 pair
        # code 1.02x -> 1.16x, RAG 1.67x -> 1.96x, summary 0.971x -> 0.965x; F16 summary
        # 0.963x -> 0.973x, RAG 1.44x -> 1.50x, code 0.990x -> 0.986x.
        if (
            self.model is not None
            and key == "none"
            and self._draft_may_run_now
            and (self._prev_sure or self.model.p_min <= 0.0)
            and self._since >= self._probe_every
            and self._draft_best(v, k_model, sure=True)[1] > self.priors.probe_bar
        ):
            self._since = 0
            self._probe_every = min(self.priors.probe_max, self._probe_every * 2)
            key, k, s = "draft", min(2, k_model), 0.0
            single = getattr(getattr(self.model, "model", None), "single_rows", False)
            window = self.priors.probe_window_single if single else self.priors.probe_window
        if lookup_prop is not None:
            self._pending.append([lookup_key, lookup_prop.tokens, 0])
        self.last_choice = (key, k, s)
        self._probing = key != best[1]
        if key == "none":
            return "none", EMPTY
        if key.startswith("lookup"):
            assert prop_ready is not None
            return "lookup", prop_ready
        self._since = 0
        assert self.model is not None
        if self._longer and s > 0:
            # Positions past the chosen K are only learnt by drafting them: after a draft that
            # was accepted whole, draft one more (as adaptive-K heuristics do).
            k = min(k + 1, k_model)
        self._asked = k
        return "draft", self.model.propose(tokens, k, params, rng, greedy_draft, window=window)

    def _draft_could_run(self, v: costmodel.VerifyCost, k: int) -> bool:
        """Whether the draft model can run this step, by upper bounds of what decides it: a
        re-try needs a draft accepted whole that never stopped to clear ``probe_bar``; a choice
        needs ``_draft_best`` to beat the margin, and that is at most what its acceptance
        estimate would make of a draft that never stopped (stops and a catch-up owed only lower
        it), an estimate that moves only when the draft runs. Where neither can, the draft model
        is not priced and the target's sureness goes unread (``confidence_p``). (Gated on the
        perfect draft beating the margin alone, a Q8_0 target with a Q4_0 draft on a 2-core
        Intel Xeon with AMX, where a perfect draft makes 1.1-1.25x and the re-try bar is 1.3,
        priced the draft on 2/3 of its steps and read the target's sureness on half, 50 us
        each: ~1% of its 6 ms steps, for a draft that never ran.)"""
        if self.model is None or k <= 0:
            return False
        c = self._draft_c()
        est = self._acc("draft").estimate()
        memo = self._run_memo
        # Asked every step, answered again only when an input moved: V(n) (the same object
        # while it stands), the draft's acceptance (likewise), K, or the draft's cost by 1%.
        if memo is not None and memo[0] is v and memo[1] is est and memo[2] == k:
            if abs(memo[3] - c) <= 0.01 * memo[3]:
                return memo[4]
        perfect = costmodel.perfect_best(c, v, k)
        if perfect > self.priors.probe_bar:
            may = True
        elif perfect <= self.priors.margin:
            may = False
        else:
            may = costmodel.best_k(est, c, v, k)[1] > self.priors.margin
        self._run_memo = (v, est, k, c, may)
        return may

    def _lookup_prior(self, key: str) -> float:
        """The prior of a match length's acceptance: its base prior, pooled with what the other
        match lengths have shown on this text (counted as they are, the base as prior_n
        observations). A length seldom matched learns from the others: on QA over a passage,
        fresh 1- and 2-token matches had been drafted at K = 2-3 from the generic priors while
        every length was right ~90% of the time. In model time, K <= 4: QA 2.38x -> 2.53x, a
        summary 2.09x -> 2.31x, a Stack class 1.30x -> 1.36x, the story 0.990x either way."""
        base = self.priors.accept_prior(key)
        h = n = 0.0
        for other, a in self.acc.items():
            if other != key and other.startswith("lookup"):
                h += sum(a.hits)
                n += sum(a.tries)
        n0 = self.priors.prior_n
        return (h + n0 * base) / (n + n0)

    def _catch_up_c(self) -> float:
        """A catch-up row of the draft model, relative to a target step."""
        t1 = self.costs.t1()
        if self.costs.catch_up_row is None or not t1:
            return self._draft_c()
        return self.costs.catch_up_row / t1

    def _draft_best(
        self,
        v: costmodel.VerifyCost,
        k_cap: int,
        sure: bool = False,
        tokens: list[int] | None = None,
    ) -> tuple[int, float]:
        """The draft model's best K and predicted speed-up; ``sure``: were every proposal
        accepted (a probe learns acceptance; where even that would not pay, as where the draft
        would mostly stop, there is nothing to probe for; judged on the slow stop rate).
        ``tokens``: price the catch-up the draft owes on them (see AutoPriors.catch_up_horizon)."""
        stop = self.stop_slow if sure else self.stop
        floor = self.model is not None and self.model.p_min > 0.0
        go = 1.0 - stop.p if floor else 1.0
        go_on = self.go_on.p if floor else 1.0
        acc = [1.0] * self.draft_max if sure else self._acc("draft").estimate()
        fixed = 0.0
        if tokens is not None and self.model is not None:
            # Rows beyond a normal step's one or two (the pending token; a whole draft's last).
            owed = min(len(tokens) - self.model.n_cached, self.priors.catch_up_window) - 2
            if owed > 0:
                fixed = owed * self._catch_up_c() / self.priors.catch_up_horizon
        return costmodel.best_k(acc, self._draft_c(), v, k_cap, go=go, fixed=fixed, go_on=go_on)

    def _observe_draft(self, steps: int, draft_s: float) -> None:
        """The draft's time for the step, less a catch-up: a draft step costs one decode per
        drafted token, and a catch-up after a stretch without the draft is a one-off, not the
        draft's price. The catch-up's last row is the first step, but a row of a batch costs
        less than a row alone, so a step is priced from the single-row decodes after the batch
        only. (Priced as a batch's average row, the first step made a draft step look 30%
        cheaper than it is: F16 target, Q4_0 draft, 3.3-3.8 ms against 5-6 ms a decode.) The
        catch-up's own cost per row is kept apart (lookup is priced with it)."""
        rows, secs = self.model.last_catch_up if self.model is not None else (0, 0.0)
        self.costs.observe_catch_up(rows, secs)
        if rows <= 1:
            self.costs.observe_draft(steps, draft_s)
        elif steps > 1 and draft_s > secs:
            self.costs.observe_draft(steps - 1, draft_s - secs)

    def _observe_tokens(self, tokens: Sequence[int]) -> None:
        """Lookup's acceptance, from the tokens the steps commit: each proposal lookup made,
        whether the step verified it or not, is scored position by position against what the
        target went on to produce, until its first miss or its end, over as many steps as that
        takes (greedy: exactly what the target would have accepted; sampled: each position is
        accepted with the probability the target gives the proposed token, which is also the
        chance that it samples that token, so the estimate stays unbiased). Whatever ran:
        plain decoding, the draft model, or lookup itself.

        Why all of it: scored only as far as the step went, a declined proposal said nothing
        past its first token (a plain step commits one), and deep positions borrowed that
        token's rate. On summaries a match's first token was right about half the time and its
        second seldom (the model goes on in its own words), so a lucky first token priced a
        2-token bet at 1.16x, and it lost (Q4_K_M target, V(3) 1.69)."""
        if not self._pending or not tokens:
            return
        keep = []
        for entry in self._pending:
            key, prop, i = entry
            acc = self._acc(key)
            if i == 0:
                acc.age()
            going = True
            for t in tokens:
                hit = prop[i] == t
                acc.add(i, hit)
                i += 1
                if not hit or i >= len(prop):
                    going = False
                    break
            if going:
                entry[2] = i
                keep.append(entry)
        self._pending = keep

    def finish(self, tokens: list[int]) -> None:
        super().finish(tokens)
        if self._refine is not None:
            c = self.costs
            self._refine({n: (c.verify[n], k) for n, k in c.seen.items() if n in c.verify})

    def confidence_p(self) -> float:
        """--draft-p-min: plain steps report the target's confidence at it. 0 (nothing to learn)
        where the draft never stops early, and while the draft model cannot run this step
        (``_draft_could_run``: the stop rates can only lower its price then, so no choice
        depends on them): the check reads the whole vocabulary's logits, 0.1-0.2 ms a step, 1-2%
        of a 10-14 ms F16 step on a pair whose draft model cannot pay on this CPU."""
        if self.model is None or not self._draft_may_run_now:
            return 0.0
        return self.model.p_min

    def _observe_confidence(self, sure: bool) -> None:
        """The target was (not) sure at a plain or lookup step's first position at --draft-p-min:
        where it is not, the draft model (a smaller model of the same text) would mostly have
        stopped; after a sure plain step, whether it went on being sure (``go_on``)."""
        self._stopped(not sure)
        if self._prev_sure:
            self.go_on.update(sure)
        self._prev_sure = sure

    def _observe_declined(self, name: str, draft_s: float) -> None:
        """A draft attempt that proposed nothing: it cost a draft step and the step decoded
        plainly. Counted as a stop at the first position, which the cost model prices (costmodel.
        speedups), not as plain decoding (a rarely-sure draft then looked free: story
        0.92x) nor as a rejection (an unsure start then sank the draft's acceptance on code it
        drafts at 0.98: auto 1.12x vs the draft's 1.47x)."""
        if name != "draft":
            return
        self._stopped(True)
        self._prev_sure = False
        self._observe_draft(1, draft_s)
        self._end_burst()

    def _stopped(self, hit: bool) -> None:
        self.stop.update(hit)
        self.stop_slow.update(hit)

    def _end_burst(self) -> None:
        """A re-try that got nothing ends a burst of re-tries (_observe_step, after a fully accepted
        draft): on a story, lucky 1/1 and 2/2 re-tries were followed by a run that proposed
        nothing, each paying a catch-up (declined re-tries: 6.7% of the run)."""
        if self._probing:
            self._probe_every = max(self._probe_every, self.priors.probe_min)

    def _lookup_key(self) -> str:
        """Lookup's acceptance is estimated per match-length bucket: the suffix drafter's own
        buckets, else each n-gram length up to --lookup-max."""
        bucket = getattr(self.lookup, "bucket", None)
        if bucket is not None:
            return f"lookup:{bucket()}"
        index = getattr(self.lookup, "index", None)
        n_max = index.n_max if index is not None else (self.lookup_n_max or defaults.LOOKUP_MAX)
        return f"lookup:{max(1, min(getattr(self.lookup, 'last_match', 1), n_max))}"

    def observe(self, report: StepReport) -> None:
        """One step: the target's sureness (a stand-in for the draft's stop rate), the drafter's
        acceptance and costs, a declined draft attempt, and free evidence for lookup's proposal
        if it was not taken; in that order."""
        r = report
        if r.target_sure is not None:
            self._observe_confidence(r.target_sure)
        self._observe_step(r.drafter, r.k, r.accepted, r.draft_s, r.verify_s)
        if r.declined is not None:
            self._observe_declined(r.declined, r.draft_s)
        self._observe_tokens(r.tokens)

    def _observe_step(
        self, name: str, k: int, n_accepted: int, draft_s: float, verify_s: float
    ) -> None:
        self.costs.observe_verify(k + 1, verify_s)
        if name == "none" or k == 0:
            return
        self._prev_sure = False
        self._longer = name == "draft" and n_accepted == k
        if name != "draft":
            return  # lookup's proposal is scored with the others (_observe_tokens)
        acc = self._acc("draft")
        acc.update(k, n_accepted)
        stopped = k < self._asked
        # A draft that stopped under --draft-p-min decoded its last proposal too, to find its
        # next one unsure: k + 1 draft steps (as the cost model prices it). Divided by k, 1-token
        # drafts priced the draft at c = 0.43 on a code prompt where it costs 0.30.
        self._observe_draft(k + 1 if stopped else k, draft_s)
        self._stopped(False)  # it proposed its first token
        for _ in range(k - 1):
            self.go_on.update(True)
        if stopped:
            self.go_on.update(False)
        # A fully accepted draft re-tries at once (a burst that quickly corrects a stale,
        # pessimistic estimate); one that would have paid resets the backoff.
        if n_accepted == k:
            self._probe_every = 1
            return
        if n_accepted == 0:
            self._end_burst()
        # A re-try resets the backoff only when it now beats what it displaced.
        bar = max(self.priors.margin, self._rival_s) if self._probing else self.priors.margin
        if self._draft_best(self.costs.verify_cost(), acc.k)[1] > bar:
            self._probe_every = self.priors.probe_min
