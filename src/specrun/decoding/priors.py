"""AutoPolicy's priors and rates: what it assumes before measuring and how fast its estimates
move, each with the benchmark that set it."""

from __future__ import annotations

from dataclasses import dataclass


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
    # 4 -> 16 once a catch-up's rows are read as evidence (evidence_weight, below): a re-try
    # that follows a plain stretch then brings back 16 rows of what the draft would have said,
    # not 4. F16 pair, Stack class, model time, the two in the same processes (eight): the
    # path that lost the draft (1.11-1.14x in 4 of 8 at 4) taken in none at 16 (1.29-1.43x,
    # mean 1.36x against 1.26x; the draft alone 1.36-1.39x); the story 0.99-1.00x either way
    # (the re-tries wait on the target's sureness, so few come); code, a summary, QA and a code
    # edit level, and so the Q8_0, Q4_K_M, F32 and Gemma F16 pairs (within the machine's noise).
    probe_window: int = 16
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
    # Each token of a draft catch-up of 2+ tokens (a re-try, or the draft chosen after another
    # drafter's stretch; DraftModel.propose's evidence) where the draft was sure of the next token
    # counts as a first-position proposal, hit or missed, worth this many observations (0: not
    # read). Under greedy decoding the draft's choice there, read off the catch-up's own logits
    # (~0.1 ms a row), is what the target would have accepted. Without it the draft's acceptance
    # moved only when the draft proposed: two early first-position misses sank it where no K
    # pays, and the re-tries that followed mostly proposed nothing (the Stack class: auto 1.01-1.07x
    # in some processes against the draft's 1.39x). F16 pair, model time, eight processes with and
    # without it: the Stack class mean 1.26x -> 1.33x (1.08-1.42x -> 1.23-1.39x); merge_sorted,
    # a summary, QA, a code edit and a story level, and so the Q8_0, Q4_K_M and F32 pairs.
    evidence_weight: float = 1.0

    def accept_prior(self, key: str) -> float:
        """The base prior of a drafter's acceptance ("draft", "lookup:N")."""
        if key == "lookup:1":
            return self.accept_lookup_1
        return self.accept_lookup if key.startswith("lookup") else self.accept_draft


PRIORS = AutoPriors()
