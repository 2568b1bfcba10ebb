"""``AutoPolicy``: the ``auto`` mode.

The rule: before each step, auto prices every choice it has with the cost model (costmodel.py):
the draft model at each K up to --draft-max and the lookup drafter's proposal at each K up to its
length, each as expected tokens per pass over the pass's cost, from running estimates
(estimates.py) of each drafter's per-position acceptance (lookup's per match-length bucket), of
how often the draft model stops under --draft-p-min, and of what a target pass of n rows and a
draft step cost (seeded by calibration, then measured); it takes the best, or plain decoding
(K = 0) where nothing is predicted to pay ``margin``, and after the step updates the estimates
from what the step did. The estimates carry from one text to the next (a server's requests, a
bench's prompts), as the machine and the drafters do; clearing the lookup store drops lookup's.
Its priors and rates are an ``AutoPriors`` (priors.py); the evidence for each refinement and
value below is in docs/auto.md, with the ablations (replayed and real) that test them.

Refinements, by name (what each buys):

- lookup scored in full: every lookup proposal, taken or not, is scored against the tokens the
  steps commit until its first miss, so lookup is never re-tried and its deep positions are
  measured rather than borrowed from the first.
- pooled lookup prior: a match length seldom seen borrows the other lengths' rate so far.
- lookup priced with the catch-up: while the draft model pays, each token lookup gets accepted
  costs the draft a catch-up row later.
- first probe and backoff: the draft model, when not chosen, is re-tried (K <= 2) once at the
  start and then every ``probe_min`` steps, backing off to ``probe_max``: an estimate moves only
  when its drafter runs.
- re-try bar: only where a draft accepted whole would pay ``probe_bar`` (a re-try costs about a
  target step).
- re-try after a sure step: under --draft-p-min only right after a plain step whose target was
  sure, where the draft is likely to propose at all.
- bursts: a re-try accepted whole re-tries at once; one that proposes nothing ends the burst; a
  re-try resets the backoff only when it now beats what it displaced.
- re-try window: where the draft decodes row by row, a re-try catches up on at most
  ``probe_window_single`` unseen tokens (elsewhere on ``catch_up_window``, as a chosen draft).
- catch-up window and price: a draft chosen after another drafter's stretch catches up on at
  most ``catch_up_window`` tokens, and the catch-up owed is priced over ``catch_up_horizon``
  steps.
- catch-up evidence: each catch-up row the draft was sure at counts as a first-position try
  (``evidence_weight``), so two early misses no longer lose the draft where it pays.
- stop and go-on rates: the draft's stops under --draft-p-min, at its first position and past
  later ones, from its attempts and, for free, from the target's sureness on plain and lookup
  steps; a slower copy of the first gates re-tries.
- catch-up priced apart: a draft step is priced from single-row decodes, a catch-up's rows
  apart (lookup is priced with those).
- deferred prompt: the draft model reads the prompt only where it could pay at all (time to
  first token).
- skipped work: where the draft model cannot run, it is neither priced nor is the target's
  sureness read (~1% of a step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from specrun.decoding import costmodel
from specrun.decoding import sampling as S
from specrun.decoding.drafters import EMPTY, Drafter, DraftModel, Proposal
from specrun.decoding.estimates import Acceptance, Costs, Rate
from specrun.decoding.policy import Policy, StepReport
from specrun.decoding.priors import PRIORS, AutoPriors


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
        # (lookup_n_max, --lookup-max, is the lookup drafter's own business now: bucket())
        del lookup_n_max
        self.lookup, self.model = lookup, model
        # Lookup's longest proposal (the suffix drafter's may exceed the draft model's K).
        self.lookup_k = max(draft_max, lookup.k_max if lookup is not None else 0)
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
        """A new text (Engine.reset): what was learnt carries over (acceptance, pass costs, the
        draft's stop rates, the re-try schedule: the machine and the drafters are the same ones,
        as a server's next request finds them); what belonged to the last text (lookup proposals
        awaiting their score, the last step's choice) goes. ``forget_lookup`` drops lookup's
        estimates with the store."""
        super().reset()
        self._new_text()

    def forget_lookup(self) -> None:
        """Drop lookup's acceptance estimates (Engine.clear_store: every run a first request)."""
        for key in [k for k in self.acc if k.startswith("lookup")]:
            del self.acc[key]

    def prefill(self, tokens: list[int], defer_model: bool = False) -> None:
        """The draft model reads the prompt only where it may run: where even a draft accepted
        whole that never stops would not clear the re-try bar (probe_bar) at the measured costs,
        auto does not re-try it, nor, with its acceptance unmeasured (the prior's 0.6), choose
        it, and its prefill would be time before the first token for nothing. A draft asked
        later all the same (the costs moved) catches up then (DraftModel.propose, windowed).
        ("deferred prompt")"""
        if self.lookup is not None:
            self.lookup.prefill(tokens)
        if self.model is not None:
            self.model.prefill(tokens, evaluate=not defer_model and self.draft_may_run())

    def model_reads_prompt(self) -> bool:
        return self.draft_may_run()

    def catch_up(self, tokens: list[int]) -> None:
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
        self.costs = Costs(alpha=pr.cost_alpha, slope=pr.verify_slope)
        self._seed_costs()
        # "stop and go-on rates": how often the draft model stops at its first token, unsure
        # (--draft-p-min), from its own attempts and, on plain and lookup steps, from the
        # target's confidence, a free stand-in.
        self.stop = Rate(pr.stop, alpha=pr.stop_alpha, prior_n=pr.prior_n)
        # The same, slower, for the re-try gate only (probe_bar): the fast one's noise let a
        # perfect draft look like it would pay now and then, and each such re-try cost a catch-up.
        self.stop_slow = Rate(pr.stop, alpha=pr.stop_slow_alpha, prior_n=pr.prior_n)
        # How often it goes on past a position once it has proposed the one before (sureness
        # comes in stretches): from the draft's attempts and from consecutive plain steps.
        self.go_on = Rate(pr.go_on, alpha=pr.stop_alpha, prior_n=pr.prior_n)
        self.acc: dict[str, Acceptance] = {}
        self._probe_every = self.priors.probe_min  # steps between re-tries of the draft model
        # Steps since the draft model last ran: as if a re-try were due, so that it is tried
        # once at the start even where the prior does not expect it to pay (with nothing
        # measured yet, the prior's verdict is the least informed one auto will ever make).
        self._since = self.priors.probe_min
        self._new_text()

    def _new_text(self) -> None:
        """The state of one text's steps (``reset``: a new text keeps the estimates)."""
        self._prev_sure = False  # the last step was plain and its target sure
        self._asked = 0  # the K the draft model was last asked for
        self.last_choice: tuple[str, int, float] = ("none", 0, 1.0)
        self._rival_s = 1.0  # predicted speed-up of what would have run had there been no probe
        self._probing = False  # the last step was a probe, not the best choice
        # Lookup's proposals, taken or not, scored position by position against the tokens the
        # steps commit, until their first miss or their end: [key, tokens, next position].
        self._pending: list[list[Any]] = []
        self._draft_may_run_now = True  # the last step's _draft_could_run
        self._run_memo: tuple[costmodel.VerifyCost, list[float], int, float, bool] | None = None

    def _acc(self, key: str) -> Acceptance:
        a = self.acc.get(key)
        if a is None:
            pr = self.priors
            is_lookup = key.startswith("lookup")
            a = self.acc[key] = Acceptance(
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

    def draft(
        self,
        tokens: list[int],
        k_cap: int,
        params: S.SamplingParams,
        rng: np.random.Generator,
        greedy_draft: bool,
    ) -> tuple[str, Proposal]:
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
                extra = self._lookup_busy_c(tokens, best[1])
                acc = self._acc(lookup_key)
                acc.prior = self._lookup_prior(lookup_key)
                k, s = costmodel.best_k(acc.estimate(), 0.0, v, len(prop), per_accepted=extra)
                if k and s > best[0]:
                    best = (s, lookup_key, k, Proposal(prop.tokens[:k], None))

        s, key, k, prop_ready = best
        self._rival_s = s
        window = self.priors.catch_up_window
        # Re-tries ("first probe and backoff", "re-try bar", "re-try after a sure step"): the
        # draft model's estimates move only when it runs. Lookup needs none: a proposal not taken
        # is scored against the tokens the steps commit (_observe_tokens).
        if (
            self.model is not None
            and key == "none"
            and self._draft_may_run_now
            and self._sure_now()
            and self._since >= self._probe_every
            and self._draft_best(v, k_model, sure=True)[1] > self.priors.probe_bar
        ):
            self._since = 0
            self._probe_every = min(self.priors.probe_max, self._probe_every * 2)
            key, k, s = "draft", min(2, k_model), 0.0
            if self.model.single_rows:
                window = self.priors.probe_window_single
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
        self._asked = k
        return "draft", self.model.propose(
            tokens,
            k,
            params,
            rng,
            greedy_draft,
            window=window,
            evidence=self.priors.evidence_weight > 0.0,
        )

    def _lookup_busy_c(self, tokens: list[int], best: str) -> float:
        """What each token lookup gets accepted costs later, relative to a target step: a
        catch-up row of the draft model, while the draft model is the best choice and less than
        a catch-up window behind (it skips the rest); else nothing."""
        behind = (
            best == "draft"
            and self.model is not None
            and len(tokens) - self.model.n_cached < self.priors.catch_up_window
        )
        return self._catch_up_c() if behind else 0.0

    def _sure_now(self) -> bool:
        """Whether a re-try may come now: right after a plain step whose target was sure at
        --draft-p-min (where the draft mostly stops, a re-try proposes nothing)."""
        assert self.model is not None
        return self._prev_sure or self.model.p_min <= 0.0

    def _draft_could_run(self, v: costmodel.VerifyCost, k: int) -> bool:
        """Whether the draft model can run this step, by upper bounds of what decides it: a
        re-try needs a draft accepted whole that never stopped to clear ``probe_bar``; a choice
        needs ``_draft_best`` to beat the margin, and that is at most what its acceptance
        estimate would make of a draft that never stopped (stops and a catch-up owed only lower
        it), an estimate that moves only when the draft runs. Where neither can, the draft model
        is not priced and the target's sureness goes unread (``confidence_p``; "skipped work")."""
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
        """The prior of a match length's acceptance ("pooled lookup prior"): its base prior,
        pooled with what the other match lengths have shown on this text (counted as they are,
        the base as prior_n observations)."""
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
        draft's price ("catch-up priced apart"). The catch-up's last row is the first step, but a
        row of a batch costs less than a row alone, so a step is priced from the single-row
        decodes after the batch only. The catch-up's own cost per row is kept apart (lookup is
        priced with it)."""
        rows, secs = self.model.last_catch_up if self.model is not None else (0, 0.0)
        self.costs.observe_catch_up(rows, secs)
        self._observe_evidence()
        if rows <= 1:
            self.costs.observe_draft(steps, draft_s)
        elif steps > 1 and draft_s > secs:
            self.costs.observe_draft(steps - 1, draft_s - secs)

    def _observe_evidence(self) -> None:
        """The draft's last catch-up, row by row (``AutoPriors.evidence_weight``): each row where
        it was sure of the next token is a first-position proposal, hit or missed. Read once."""
        ev = self.model.last_evidence if self.model is not None else None
        w = self.priors.evidence_weight
        if not ev or w <= 0.0:
            return
        assert self.model is not None
        self.model.last_evidence = []
        acc = self._acc("draft")
        for sure, hit in ev:
            if sure:
                acc.add(0, hit, w)

    def _observe_tokens(self, tokens: Sequence[int]) -> None:
        """Lookup's acceptance, from the tokens the steps commit: each proposal lookup made,
        whether the step verified it or not, is scored position by position against what the
        target went on to produce, until its first miss or its end, over as many steps as that
        takes (greedy: exactly what the target would have accepted; sampled: each position is
        accepted with the probability the target gives the proposed token, which is also the
        chance that it samples that token, so the estimate stays unbiased). Whatever ran:
        plain decoding, the draft model, or lookup itself ("lookup scored in full": scored only
        as far as the step went, deep positions borrowed the first's rate)."""
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
        depends on them): the check reads the whole vocabulary's logits ("skipped work")."""
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
        """A draft attempt that proposed nothing: it cost a draft step (priced as one, so a
        rarely-sure draft does not look free) and the step decoded plainly; it ends a burst."""
        if name != "draft":
            return
        self._prev_sure = False
        self._observe_draft(1, draft_s)
        self._end_burst()

    def _stopped(self, hit: bool) -> None:
        self.stop.update(hit)
        self.stop_slow.update(hit)

    def _end_burst(self) -> None:
        """A re-try that got nothing ends a burst of re-tries ("bursts"; _observe_step, after a
        fully accepted draft)."""
        if self._probing:
            self._probe_every = max(self._probe_every, self.priors.probe_min)

    def _lookup_key(self) -> str:
        """Lookup's acceptance is estimated per match-length bucket: the suffix drafter's own
        buckets, else each n-gram length up to --lookup-max."""
        assert self.lookup is not None
        return f"lookup:{self.lookup.bucket()}"

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
        if name != "draft":
            return  # lookup's proposal is scored with the others (_observe_tokens)
        acc = self._acc("draft")
        acc.update(k, n_accepted)
        stopped = k < self._asked
        # A draft that stopped under --draft-p-min decoded its last proposal too, to find its
        # next one unsure: k + 1 draft steps (as the cost model prices it).
        self._observe_draft(k + 1 if stopped else k, draft_s)
        self._stopped(False)  # it proposed its first token
        for _ in range(k - 1):
            self.go_on.update(True)
        if stopped:
            self.go_on.update(False)
        # "bursts": a fully accepted draft re-tries at once (a stale, pessimistic estimate is
        # corrected quickly); one that would have paid resets the backoff.
        if n_accepted == k:
            self._probe_every = 1
            return
        if n_accepted == 0:
            self._end_burst()
        # A re-try resets the backoff only when it now beats what it displaced.
        bar = max(self.priors.margin, self._rival_s) if self._probing else self.priors.margin
        if self._draft_best(self.costs.verify_cost(), acc.k)[1] > bar:
            self._probe_every = self.priors.probe_min
