"""``AutoPolicy``: before each step, the drafter and K that maximise expected tokens per second
by the cost model (costmodel.py), from running estimates (estimates.py) of per-position
acceptance (per drafter, and per match length for lookup), of how often the draft model stops
under --draft-p-min, and of the costs measured online (target pass time as a function of rows,
draft step time, draft catch-up rows). K = 0 (plain decoding) when nothing pays; the draft
model, when it does not pay, is re-tried now and then, with a backoff, so that it is found again
when it starts paying; lookup's proposals not taken are scored for free. Its priors and rates:
priors.py.
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

    def prefill(self, tokens: list[int], defer_model: bool = False) -> None:
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
        # How often the draft model stops at its first token, unsure (--draft-p-min): from its
        # own attempts, and on plain and lookup steps from the target's confidence, a free
        # stand-in (SmolLM2 at 0.6: the target was that sure on 88% of the code prompts' tokens,
        # 41% of a story's).
        self.stop = Rate(pr.stop, alpha=pr.stop_alpha, prior_n=pr.prior_n)
        # The same, slower, for the probe gate only (probe_bar). On a story (the target sure at
        # 41% of positions) the fast estimate's noise (sd ~0.14 at alpha 0.15) dipped it far
        # enough, now and then, for a perfect draft to look like it would pay 15%, and each such
        # probe cost a catch-up (25-37 ms, about a target step; 2-3 per 128 tokens).
        self.stop_slow = Rate(pr.stop, alpha=pr.stop_slow_alpha, prior_n=pr.prior_n)
        # How often it goes on past a position once it has proposed the token before: sureness
        # comes in stretches (on code the target was sure after a sure token 91-94% of the time,
        # 47-71% after an unsure one; on a story 40% and 43%), so one stop rate for every
        # position undervalued the draft where code alternates with prose (a Stack class's
        # docstrings: five unsure tokens in a row, and auto left the draft model, which went on to
        # propose 4/4, 3/3, 1/1, 4/4, for lookup's 2-token guesses). From the draft's attempts
        # and from consecutive plain steps (the target's sureness after a sure token).
        self.go_on = Rate(pr.go_on, alpha=pr.stop_alpha, prior_n=pr.prior_n)
        self._prev_sure = False  # the last step was plain and its target sure
        self._asked = 0  # the K the draft model was last asked for
        self.acc: dict[str, Acceptance] = {}
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
            single = self.model is not None and self.model.single_rows
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
        return "draft", self.model.propose(
            tokens,
            k,
            params,
            rng,
            greedy_draft,
            window=window,
            evidence=self.priors.evidence_weight > 0.0,
        )

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
