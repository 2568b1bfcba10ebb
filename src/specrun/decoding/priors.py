"""AutoPolicy's priors and rates: what it assumes before measuring and how fast its estimates
move. What set each value, and what it was measured to do: docs/auto.md."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AutoPriors:
    """AutoPolicy's priors (what it assumes before measuring) and rates (how fast its estimates
    move), one line each; the evidence for each value is in docs/auto.md."""

    # -- costs (a calibrated run, calibrate.py, measures what the first two assume) -------------
    verify_slope: float = 0.1  # V(n) = 1 + slope (n - 1): a pass of n rows, before any is measured
    draft_cost: float = 0.35  # a draft step relative to a target step, before one is measured
    seen_weight: int = 4  # a calibrated draft step counts as this many observations
    cost_alpha: float = 0.2  # EMA rate of the measured pass and catch-up costs

    # -- acceptance -----------------------------------------------------------------------------
    accept_draft: float = 0.6  # the draft model's per-position acceptance, unmeasured
    accept_lookup: float = 0.4  # a lookup match's per-position acceptance, unmeasured
    accept_lookup_1: float = 0.3  # ... of a one-token match (weaker evidence)
    accept_alpha: float = 0.15  # how much of its counts the draft's acceptance forgets per draft
    lookup_alpha: float = 0.08  # ... lookup's, per proposal (slower: it hovers near break-even)
    prior_n: float = 2.0  # a prior counts as this many observations
    shrink_n: float = 2.0  # a position's own rate weighs against the others' as this many

    # -- the draft model's stops under --draft-p-min ------------------------------------------------
    stop: float = 0.2  # it stops at its first position, unsure (prior)
    go_on: float = 0.8  # ... and goes on past a later one, having proposed the one before (prior)
    stop_alpha: float = 0.15  # EMA rate of the stop and go-on estimates after the first few
    stop_slow_alpha: float = 0.04  # EMA rate of the slower stop estimate the re-try gate reads

    # -- choosing -------------------------------------------------------------------------------
    margin: float = 1.1  # speculate only where predicted to pay at least this much
    probe_min: int = 8  # steps between re-tries of an unchosen draft model, at first ...
    probe_max: int = 128  # ... doubling up to this
    probe_bar: float = 1.3  # re-try only where a draft accepted whole would pay this much
    probe_window_single: int = 2  # a re-try catches up on at most this many unseen tokens where
    # the draft decodes row by row (AMX); elsewhere on catch_up_window, as a chosen draft does
    catch_up_window: int = 16  # a draft chosen after another drafter's stretch: at most this many
    catch_up_horizon: int = 4  # a catch-up owed is priced spread over this many steps
    evidence_weight: float = 1.0  # a catch-up row the draft was sure at, as a first-position try

    def accept_prior(self, key: str) -> float:
        """The base prior of a drafter's acceptance ("draft", "lookup:N")."""
        if key == "lookup:1":
            return self.accept_lookup_1
        return self.accept_lookup if key.startswith("lookup") else self.accept_draft


PRIORS = AutoPriors()
