"""Prompt lookup index, the persistent n-gram cache, and the auto controller's choices on
synthetic costs and acceptance (no models)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specrun.decoding import costmodel
from specrun.decoding.auto import AutoPolicy
from specrun.decoding.drafters import BaseDrafter, Proposal
from specrun.decoding.lookup import NgramCache, NgramIndex, PromptLookup
from specrun.decoding.policy import StepReport
from specrun.decoding.priors import PRIORS
from specrun.decoding.sampling import SamplingParams


# -- NgramIndex --------------------------------------------------------------------------------
def test_longest_match_wins():
    idx = NgramIndex(1, 4)
    #             0  1  2  3  4  5  6  7  8  9
    idx.extend([5, 1, 2, 3, 9, 7, 2, 3, 8, 1, 2, 3])
    # suffix 1 2 3 occurred at 1..3 (followed by 9); suffix 2 3 also at 6..7 (followed by 8)
    n, j = idx.match()
    assert n == 3 and idx.tokens[j] == 9
    assert idx.propose(3) == ([9, 7, 2], 3)


def test_most_recent_occurrence_wins():
    idx = NgramIndex(1, 2)
    idx.extend([4, 6, 0, 4, 7, 0, 4])
    toks, n = idx.propose(1)
    assert n == 2 and toks == [7]  # "0 4" last seen followed by 7, not by... the older "4 6"


def test_no_match_proposes_nothing():
    idx = NgramIndex(2, 3)
    idx.extend([1, 2, 3, 4, 5])
    assert idx.propose(4) == ([], 0)


def test_incremental_equals_rebuilt():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 6, size=300).tolist()
    inc = NgramIndex(1, 4)
    for i in range(0, len(seq), 7):
        inc.extend(seq[i : i + 7])
        full = NgramIndex(1, 4)
        full.extend(seq[: i + 7])
        assert inc.match() == full.match()
        assert inc._last == full._last


def test_sync_rebuilds_on_a_different_history():
    idx = NgramIndex(1, 2)
    idx.sync([1, 2, 3, 1, 2], full_check=True)
    assert idx.propose(2)[0] == [3, 1]
    idx.sync([9, 9, 8], full_check=True)  # a new prompt: the old n-grams must be gone
    assert idx.tokens == [9, 9, 8]
    assert idx.propose(2) == ([], 0)


def test_update_cost_does_not_grow_with_history():
    # O(n_max) per token: the dict grows by at most n_max entries per appended token.
    idx = NgramIndex(1, 4)
    idx.extend(list(range(1000)))
    before = len(idx._last)
    idx.extend([5])
    assert len(idx._last) - before <= 4


def test_prompt_lookup_drafter_is_deterministic():
    d = PromptLookup(1, 3)
    toks = [3, 4, 5, 6, 3, 4]
    d.prefill(toks)
    prop = d.propose(toks, 2, SamplingParams(), np.random.default_rng(0), True)
    assert prop.tokens == [5, 6] and prop.dists is None and d.last_match == 2


# -- NgramCache --------------------------------------------------------------------------------
def test_ngram_cache_persists_atomically(tmp_path):
    path = tmp_path / "ngrams.json"
    c = NgramCache(path, n=2)
    c.add([1, 2, 3, 1, 2, 3, 1, 2, 4])
    c.save()
    assert not list(tmp_path.glob("*.tmp"))
    again = NgramCache(path, n=2)
    assert again.propose([7, 1, 2], 3, min_count=2) == [3, 1, 2]
    data = json.loads(path.read_text())
    assert data["version"] == 1 and data["n"] == 2


def test_ngram_cache_rejects_a_corrupt_file(tmp_path):
    from specrun.errors import SpecrunError

    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(SpecrunError, match="unreadable"):
        NgramCache(path, n=2)
    assert path.read_text() == "{not json"  # never overwritten behind the user's back


# -- cost model ------------------------------------------------------------------------------------
def test_expected_tokens_geometric_closed_form():
    a, k = 0.7, 5
    assert costmodel.expected_tokens(costmodel.geometric(a, k), k) == pytest.approx(
        (1 - a ** (k + 1)) / (1 - a)
    )


def test_best_k_zero_when_nothing_pays():
    v = costmodel.linear_verify_cost(0.1)
    assert costmodel.best_k(costmodel.geometric(0.2, 8), 0.5, v, 8)[0] == 0


def test_best_k_long_when_cheap_and_accepted():
    v = costmodel.linear_verify_cost(0.05)
    k, s = costmodel.best_k(costmodel.geometric(0.95, 8), 0.05, v, 8)
    assert k == 8 and s > 3


# -- AutoPolicy on synthetic drafters -------------------------------------------------------------
class FakeDraftModel(BaseDrafter):
    """Stands in for the draft model: proposes k tokens and reports a synthetic cost."""

    name = "draft"
    p_min = 0.0
    single_rows = False

    def __init__(self):
        self.proposed = []
        self.windows = []
        self.last_catch_up = (1, 0.0)
        self.last_evidence = []
        self.n_cached = 0

    def prefill(self, tokens, evaluate=True):
        self.prefilled = evaluate
        if evaluate:
            self.n_cached = len(tokens) - 1
        return 0

    def propose(self, tokens, k, params, rng, greedy_draft, window=None, evidence=False):
        self.proposed.append(k)
        self.windows.append(window)
        self.n_cached = len(tokens) - 1  # caught up; the proposal's rows rolled back
        return Proposal([1] * k, None)

    def rollback(self, valid_len):
        pass

    def reset(self):
        pass


def plain(policy, sure: bool, t1: float = 0.02) -> None:
    """A plain step whose target was (not) sure at its first position."""
    policy.observe(StepReport("none", 0, 0, 0.0, t1, target_sure=sure))


def drive(policy, steps, accept_rate, draft_step_s, t1, slope, rng, lookup_tokens=None):
    """Run the controller against a simulated target: verify time t1 * (1 + slope * (rows-1)),
    each draft position accepted with probability accept_rate."""
    ks = []
    for _ in range(steps):
        name, prop = policy.draft([0] * 10, 8, SamplingParams(), rng, True)
        k = len(prop)
        n_acc = 0
        while n_acc < k and rng.random() < accept_rate:
            n_acc += 1
        verify_s = t1 * (1 + slope * k)
        draft_s = draft_step_s * k if name == "draft" else 0.0
        policy.observe(StepReport(name, k, n_acc, draft_s, verify_s))
        ks.append((name, k))
    return ks


def test_auto_chooses_plain_decoding_when_the_draft_is_too_slow():
    rng = np.random.default_rng(1)
    policy = AutoPolicy(8, None, FakeDraftModel())
    ks = drive(policy, 400, accept_rate=0.6, draft_step_s=0.012, t1=0.016, slope=0.1, rng=rng)
    tail = ks[200:]
    drafted = [k for name, k in tail if name == "draft"]
    # Only the occasional short probe: at most one step in 16 drafts.
    assert len(drafted) <= len(tail) / 16 and all(k <= 2 for k in drafted)


def test_auto_chooses_plain_decoding_when_acceptance_is_low():
    rng = np.random.default_rng(2)
    policy = AutoPolicy(8, None, FakeDraftModel())
    ks = drive(policy, 400, accept_rate=0.1, draft_step_s=0.002, t1=0.016, slope=0.1, rng=rng)
    assert sum(1 for name, _ in ks[200:] if name == "draft") <= 200 / 16


def test_auto_drafts_long_when_acceptance_is_high_and_draft_cheap():
    rng = np.random.default_rng(3)
    policy = AutoPolicy(8, None, FakeDraftModel())
    ks = drive(policy, 300, accept_rate=0.95, draft_step_s=0.001, t1=0.016, slope=0.05, rng=rng)
    tail = [k for _, k in ks[150:]]
    assert np.median(tail) >= 6


def test_auto_finds_a_drafter_again_when_it_starts_paying():
    rng = np.random.default_rng(4)
    policy = AutoPolicy(8, None, FakeDraftModel())
    drive(policy, 300, accept_rate=0.05, draft_step_s=0.004, t1=0.016, slope=0.1, rng=rng)
    ks = drive(policy, 600, accept_rate=0.9, draft_step_s=0.004, t1=0.016, slope=0.1, rng=rng)
    assert np.median([k for _, k in ks[-200:]]) >= 3


class FakeLookup(BaseDrafter):
    """Stands in for prompt lookup: always has a match of ``last_match`` tokens to offer."""

    name = "lookup"
    last_match = 3

    def prefill(self, tokens):
        return 0

    def propose(self, tokens, k, params, rng, greedy_draft):
        return Proposal([2] * k, None)

    def rollback(self, valid_len):
        pass

    def reset(self):
        pass


def drive_two(policy, steps, rates, draft_step_s, t1, slope, rng):
    """As ``drive``, with an acceptance rate per drafter. The step's tokens are reported too
    (observe_tokens): where lookup did not run, each is the one lookup proposed (2) with
    lookup's rate."""
    names = []
    for _ in range(steps):
        name, prop = policy.draft([0] * 10, 8, SamplingParams(), rng, True)
        k = len(prop)
        n_acc = 0
        while n_acc < k and rng.random() < rates.get(name, 0.0):
            n_acc += 1
        draft_s = draft_step_s * k if name == "draft" else 0.0
        if name == "lookup":
            produced = [2] * n_acc + [3]
        else:
            produced = [
                2 if rng.random() < rates.get("lookup", 0.0) else 3 for _ in range(n_acc + 1)
            ]
        policy.observe(StepReport(name, k, n_acc, draft_s, t1 * (1 + slope * k), produced))
        names.append(name)
    return names


def test_lookup_is_scored_while_the_draft_model_pays_and_takes_over():
    """Lookup's proposals are scored against what the draft model's steps produced (no re-try
    of lookup costs a draft step): one that failed early is not drafted while the draft model
    pays, and takes over once it pays more (the text turned to copying the prompt)."""
    rng = np.random.default_rng(5)
    policy = AutoPolicy(8, FakeLookup(), FakeDraftModel())
    # As every front end starts auto: from measured pass and draft-step costs (calibrate.py).
    policy.calibrate({n: 0.016 * (1 + 0.1 * (n - 1)) for n in (1, 2, 3, 5, 9)}, 0.003)
    policy.prefill([0] * 10)
    first = drive_two(policy, 200, {"draft": 0.7, "lookup": 0.0}, 0.003, 0.016, 0.1, rng)
    # The draft model carries the first phase (right 70% of the time it is predicted at ~1.4x;
    # a run of rejections now and then takes it under the 1.1 margin for a few steps).
    assert first[100:].count("draft") >= 80
    assert "lookup" not in first[100:]  # and lookup, scored for free, never displaces it
    second = drive_two(policy, 400, {"draft": 0.7, "lookup": 0.98}, 0.003, 0.016, 0.1, rng)
    assert second[-200:].count("lookup") >= 180


def test_one_early_miss_does_not_zero_the_estimate():
    from specrun.decoding.estimates import Acceptance

    acc = Acceptance(0.6, 4)
    acc.update(2, 0)
    assert 0.2 < acc.estimate()[0] < 0.6


def test_positions_after_the_first_rejection_are_not_counted():
    """Acceptance is estimated per position *given* the earlier positions were accepted: a
    draft rejected at position 1 says nothing about positions 2 and 3."""
    from specrun.decoding.estimates import Acceptance

    acc = Acceptance(0.6, 4)
    acc.update(4, 1)
    r = acc.rates()
    assert r[0] > r[1] and r[1] < 0.6  # position 0 accepted, position 1 rejected
    assert r[2] == r[3]  # untried: the pooled rate, both
    assert acc.tries[2] == acc.tries[3] == 0.0


def test_deep_positions_borrow_from_the_pool():
    """A few fully accepted short drafts make the positions they never reached likely too (one
    acceptance process): per-position estimates from a geometric prior each had to be reached
    several times before auto drafted past K = 2 on a draft accepted 98% of the time."""
    from specrun.decoding.estimates import Acceptance

    acc = Acceptance(0.6, 8)
    for k in (1, 2, 3, 4):
        acc.update(k, k)
    est = acc.estimate()
    assert est[4] > 0.6 and est[7] > 0.45
    assert all(
        a >= b for a, b in zip(est, est[1:], strict=False)
    )  # cumulative: never rises with depth
    v = costmodel.linear_verify_cost(0.15)
    assert costmodel.best_k(est, 0.2, v, 8)[0] >= 4


def test_acceptance_tracks_a_change_of_text():
    from specrun.decoding.estimates import Acceptance

    acc = Acceptance(0.6, 4)
    for _ in range(40):
        acc.update(4, 4)
    assert acc.estimate()[3] > 0.9
    for _ in range(25):
        acc.update(4, 0)
    assert acc.estimate()[0] < 0.2


def test_a_draft_that_stopped_is_priced_per_decode():
    """A draft that stopped under --draft-p-min after j tokens decoded j + 1 times (its last
    proposal too, to find the next one unsure): its step cost is its time over j + 1."""
    model = FakeDraftModel()
    policy = AutoPolicy(4, None, model)
    policy.costs.observe_verify(1, 0.02)
    policy._key, policy._asked = "draft", 4  # as after draft() asked the model for 4
    model.last_catch_up = (1, 0.005)
    policy.observe(
        StepReport("draft", 1, 1, 2 * 0.005, 0.025)
    )  # asked for more, proposed 1: 2 decodes
    assert policy.costs.draft_step == pytest.approx(0.005)


def test_declined_lookup_is_scored_against_what_the_target_said():
    """A lookup proposal that auto declines is checked for free against the step's tokens, so a
    pessimistic estimate recovers without waiting for a probe."""
    rng = np.random.default_rng(6)
    policy = AutoPolicy(8, FakeLookup(), None)
    key = "lookup:3"
    for _ in range(12):  # lookup misses at once, every time: its estimate falls below paying
        policy._acc(key).update(2, 0)
    policy.costs.observe_verify(1, 0.016)
    policy.costs.observe_verify(3, 0.016 * 1.3)
    name, prop = policy.draft([0] * 10, 8, SamplingParams(), rng, True)
    assert name == "none" and len(prop) == 0
    before = policy._acc(key).estimate()[0]
    policy.observe(
        StepReport(name, 0, 0, 0.0, 0.016, [2])
    )  # the target said exactly what lookup offered (FakeLookup: 2s)
    assert policy._acc(key).estimate()[0] > before
    chosen = []
    for _ in range(20):
        name, prop = policy.draft([0] * 10, 8, SamplingParams(), rng, True)
        policy.observe(
            StepReport(
                name,
                len(prop),
                len(prop),
                0.0,
                0.016 * (1 + 0.15 * len(prop)),
                [2] * (len(prop) + 1),
            )
        )
        chosen.append(name)
    assert chosen[-10:] == ["lookup"] * 10
    # ... and a miss lowers it the same way.
    policy._pending = [[key, [2, 2, 2], 0]]
    before = policy._acc(key).estimate()[0]
    policy.observe(StepReport("none", 0, 0, 0.0, 0.016, [5]))
    assert policy._acc(key).estimate()[0] < before


class ScriptedLookup(FakeLookup):
    """Proposes what it is told to, one proposal per call."""

    def __init__(self, proposals):
        self.proposals = list(proposals)

    def propose(self, tokens, k, params, rng, greedy_draft):
        return Proposal(self.proposals.pop(0)[:k], None)


def test_a_declined_proposal_is_scored_past_its_first_token_as_the_text_goes_on():
    """A plain step commits one token; the rest of a declined proposal is scored against the
    tokens the next steps commit, up to its first miss: the deep positions of lookup's
    acceptance are learnt for free, not borrowed from the first."""
    rng = np.random.default_rng(0)
    policy = AutoPolicy(8, ScriptedLookup([[7, 8, 9, 4], [1], [1], [1]]), None)
    policy.costs.observe_verify(1, 0.016)
    policy.costs.observe_verify(5, 0.016 * 4)  # batches dear: nothing is verified
    key = "lookup:3"
    for tok in (7, 8, 5, 6):  # the target goes on with 7, 8 (as proposed), then 5 (not 9)
        name, prop = policy.draft([0] * 10, 8, SamplingParams(), rng, True)
        assert name == "none"
        policy.observe(StepReport(name, 0, 0, 0.0, 0.016, [tok]))
    acc = policy._acc(key)
    # The first proposal: positions 0 and 1 right, 2 wrong, 3 never reached. The three 1-token
    # proposals after it: wrong at their one position (8, 5, 6 are not 1).
    assert acc.tries[2] > 0 and acc.tries[3] == 0
    assert acc.hits[0] > 0 and acc.hits[1] > 0 and acc.hits[2] == 0
    assert acc.hits[1] == pytest.approx(acc.tries[1])  # position 1: tried once, right
    assert policy._pending == []


def test_a_verified_proposal_is_scored_past_what_was_verified():
    """A proposal cut to K and accepted whole: its next position is scored against the
    target's own token of that step, and the rest against the steps after."""
    rng = np.random.default_rng(0)
    policy = AutoPolicy(8, ScriptedLookup([[3, 3, 3, 3, 4, 5]] + [[1]] * 4), None)
    policy.costs.observe_verify(1, 0.016)
    for n in range(2, 10):  # up to 3 rows free, more dear: K = 2 of the 6
        policy.costs.observe_verify(n, 0.016 if n <= 3 else 0.016 * n)
    name, prop = policy.draft([0] * 10, 8, SamplingParams(), rng, True)
    assert name == "lookup" and prop.tokens == [3, 3]
    policy.observe(StepReport(name, 2, 2, 0.0, 0.016, [3, 3, 3]))  # the target's own 3: right
    for tok in (3, 4, 9):  # then 3 and 4 as proposed, and 9 where it proposed 5
        name, _ = policy.draft([0] * 10, 8, SamplingParams(), rng, True)
        policy.observe(StepReport(name, 0, 0, 0.0, 0.016, [tok]))
    acc = policy._acc("lookup:3")
    # (position 0 also holds the 1-token proposals' misses)
    assert [round(h / t, 6) for h, t in zip(acc.hits[1:6], acc.tries[1:6], strict=True)] == [
        1.0,
        1.0,
        1.0,
        1.0,
        0.0,
    ]
    assert acc.tries[6] == 0
    assert policy._pending == []


class ShyDraftModel(FakeDraftModel):
    """A draft model that is rarely sure: most attempts stop under --draft-p-min and propose
    nothing, though what it does propose is always right."""

    p_min = 0.6

    def __init__(self, rng):
        super().__init__()
        self.rng = rng

    def propose(self, tokens, k, params, rng, greedy_draft, window=None, evidence=False):
        self.proposed.append(k)
        return Proposal([1] * k if self.rng.random() < 0.1 else [], None)


def test_auto_counts_draft_attempts_that_propose_nothing():
    """An attempt that proposes nothing still costs a draft step; counted as plain decoding (as
    before) it made a rarely-sure draft model look free, and auto kept running it."""
    rng = np.random.default_rng(7)
    model = ShyDraftModel(np.random.default_rng(8))
    policy = AutoPolicy(8, None, model)
    t1, c = 0.016, 0.006
    attempts = []
    for _ in range(400):
        name, prop = policy.draft([0] * 10, 8, SamplingParams(), rng, True)
        k = len(prop)
        draft_s = c * max(k, 1) if name == "draft" else 0.0
        if name == "draft" and k == 0:
            policy.observe(StepReport("none", 0, 0, draft_s, t1, declined="draft"))
        else:
            policy.observe(StepReport(name, k, k, draft_s, t1 * (1 + 0.1 * k)))
        attempts.append(name == "draft")
    assert sum(attempts[200:]) <= 200 / 8, sum(attempts[200:])


def test_draft_catch_ups_are_capped():
    """A probe of the draft model after a stretch without it catches up on CATCH_UP_WINDOW tokens at
    most (a full catch-up costs a draft row per token generated meanwhile, which on open-ended
    text made auto slower than the target); a draft chosen because it pays, on CATCH_UP_WINDOW."""
    rng = np.random.default_rng(11)
    model = FakeDraftModel()
    policy = AutoPolicy(8, None, model)
    drive(policy, 300, accept_rate=0.05, draft_step_s=0.004, t1=0.016, slope=0.1, rng=rng)
    probes = model.windows[-4:]  # the first drafts are chosen (the prior pays); then probes
    assert probes and all(w == PRIORS.catch_up_window for w in probes)
    model.windows.clear()
    drive(policy, 600, accept_rate=0.95, draft_step_s=0.001, t1=0.016, slope=0.05, rng=rng)
    assert model.windows[-50:] == [PRIORS.catch_up_window] * 50


def test_a_draft_that_decodes_row_by_row_is_re_tried_on_two_rows():
    """Where the draft model decodes its rows one at a time (AMX: Model.single_rows) each
    catch-up row costs a whole draft step, so a re-try catches up on two rows (what a re-try
    right after a plain step owes), not CATCH_UP_WINDOW."""

    rng = np.random.default_rng(11)
    model = FakeDraftModel()
    model.single_rows = True
    policy = AutoPolicy(8, None, model)
    drive(policy, 300, accept_rate=0.05, draft_step_s=0.004, t1=0.016, slope=0.1, rng=rng)
    probes = model.windows[-4:]
    assert probes and all(w == PRIORS.probe_window_single for w in probes), probes


def test_a_long_catch_up_is_not_the_drafts_price():
    """The draft's cost per step excludes a catch-up beyond its first row: one long catch-up
    (the draft back after plain decoding) must not make the draft look slow for many steps."""
    model = FakeDraftModel()
    policy = AutoPolicy(4, None, model)
    policy.costs.observe_verify(1, 0.02)
    policy.draft([0] * 10, 4, SamplingParams(), np.random.default_rng(0), True)
    model.last_catch_up = (40, 0.2)  # 40 rows at 5 ms
    policy.observe(StepReport("draft", 4, 4, 0.2 + 3 * 0.005, 0.03))
    assert policy.costs.draft_step == pytest.approx((0.005 + 3 * 0.005) / 4)


def test_a_draft_step_is_priced_from_single_row_decodes():
    """The catch-up's last row is the draft's first step, but a row of a batch costs less than
    a row alone: the step is priced from the decodes after the batch (F16 target, Q4_0 draft:
    a 4-row catch-up of 10 ms, then 5.5 ms a row; priced as the batch's average row, a step
    read 4 ms and a draft that cannot pay looked as if it could)."""
    model = FakeDraftModel()
    policy = AutoPolicy(4, None, model)
    policy.costs.observe_verify(1, 0.01)
    policy._key, policy._asked = "draft", 4
    model.last_catch_up = (4, 0.010)
    # proposed 1 and stopped: the catch-up, then one single-row decode to find the 2nd unsure
    policy.observe(StepReport("draft", 1, 1, 0.010 + 0.0055, 0.017))
    assert policy.costs.draft_step == pytest.approx(0.0055)
    assert policy.costs.catch_up_row == pytest.approx(0.0025)
    # a 1-token draft from a batch alone says nothing of a single row's cost
    before = policy.costs.draft_step
    policy._asked = 1
    policy.observe(StepReport("draft", 1, 1, 0.010, 0.017))
    assert policy.costs.draft_step == before


def test_a_new_text_keeps_what_was_learnt():
    """Engine.reset (a new text) keeps the estimates, as a server's next request finds them:
    the draft's acceptance, the re-try schedule and the pass costs carry over; what belonged to
    the last text (lookup proposals awaiting their score) goes."""
    rng = np.random.default_rng(12)
    policy = AutoPolicy(8, None, FakeDraftModel())
    drive(policy, 300, accept_rate=0.02, draft_step_s=0.004, t1=0.016, slope=0.1, rng=rng)
    learnt = policy._acc("draft").estimate()
    every, step = policy._probe_every, policy.costs.draft_step
    assert learnt[0] < 0.3 and every > PRIORS.probe_min and step is not None
    policy._pending.append(["lookup:2", [5, 6], 0])
    policy.reset()
    assert policy._acc("draft").estimate() == learnt
    assert policy._probe_every == every and policy.costs.draft_step == step
    assert policy._pending == []


def test_a_probe_that_gets_nothing_ends_a_burst():
    """After a fully accepted probe auto probes again at once (a burst); a probe that then
    proposes nothing (or is rejected at once) ends the burst instead of halving the wait."""
    rng = np.random.default_rng(13)
    model = FakeDraftModel()
    policy = AutoPolicy(8, None, model)
    drive(policy, 200, accept_rate=0.02, draft_step_s=0.004, t1=0.016, slope=0.1, rng=rng)
    policy._probe_every = 1  # as after a fully accepted probe
    policy._since = 1
    name, prop = policy.draft([0] * 10, 8, SamplingParams(), rng, True)
    assert name == "draft" and policy._probing
    policy.observe(StepReport("none", 0, 0, 0.004, 0.016, declined="draft"))
    assert policy._probe_every >= PRIORS.probe_min


def test_cost_model_prices_a_draft_that_stops_where_unsure():
    """A draft with a confidence floor proposes j < K tokens with probability go^j (1 - go):
    K = 1 by hand, go = 1 by hand, and a mostly-stopping draft does not pay."""
    v = costmodel.linear_verify_cost(0.2)
    cum = costmodel.geometric(0.9, 4)
    c, q = 0.3, 0.7
    # A whole proposal accepted costs its last token's decode at the next step: + c * cum[K-1].
    want = (1 + q * cum[0]) / ((1 - q) * (c + v(1)) + q * (c + c * cum[0] + v(2)))
    assert costmodel.speedups(cum, 1, c, v, go=q)[1] == pytest.approx(want)
    assert costmodel.speedups(cum, 3, c, v, go=1.0)[3] == pytest.approx(
        costmodel.expected_tokens(cum, 3) / (3 * c + c * cum[2] + v(4))
    )
    # Lengths 0..2 of an attempt of K = 2, enumerated.
    p = [1 - q, q * (1 - q), q * q]
    tok = [1, 1 + cum[0], 1 + cum[0] + cum[1]]
    cost = [c + v(1), 2 * c + v(2), 2 * c + c * cum[1] + v(3)]
    want2 = sum(a * b for a, b in zip(p, tok, strict=True)) / sum(
        a * b for a, b in zip(p, cost, strict=True)
    )
    assert costmodel.speedups(cum, 2, c, v, go=q)[2] == pytest.approx(want2)
    sure = [1.0] * 4
    assert (
        costmodel.best_k(sure, 0.35, costmodel.linear_verify_cost(0.16), 4, go=0.3)[1]
        < PRIORS.margin
    )
    assert costmodel.best_k(cum, 0.3, costmodel.linear_verify_cost(0.16), 4, go=0.9)[0] >= 3


def test_the_targets_confidence_stands_in_for_the_drafts():
    """Plain steps report whether the target was sure at --draft-p-min; where it mostly was not,
    auto neither drafts nor probes the draft model (a probe could not find it paying), and where
    it was, the draft model is chosen again."""
    rng = np.random.default_rng(14)
    model = ShyDraftModel(np.random.default_rng(15))
    policy = AutoPolicy(4, None, model)
    assert policy.confidence_p() == 0.6
    policy.costs.observe_verify(1, 0.02)
    policy.costs.observe_verify(5, 0.033)
    for _ in range(40):
        plain(policy, sure=False)
    names = []
    for _ in range(60):
        name, prop = policy.draft([0] * 10, 4, SamplingParams(), rng, True)
        names.append(name)
        policy.observe(StepReport(name, 0, 0, 0.0, 0.02, target_sure=bool(rng.random() < 0.15)))
    assert "draft" not in names and model.proposed == []
    for _ in range(30):  # the text turns sure: plain steps report it, the draft is back
        name, prop = policy.draft([0] * 10, 4, SamplingParams(), rng, True)
        if name == "draft":
            break
        policy.observe(StepReport(name, 0, 0, 0.0, 0.02, target_sure=True))
    assert name == "draft"


def test_a_draft_that_stops_where_unsure_is_re_tried_only_after_a_sure_token():
    """With --draft-p-min, a re-try of the draft model waits for a plain step whose target was
    sure: at a position the target doubts, the smaller model mostly stops and proposes nothing,
    after paying its catch-up. A draft that never stops is re-tried on the backoff alone."""
    rng = np.random.default_rng(21)
    for p_min in (0.6, 0.0):
        model = ShyDraftModel(np.random.default_rng(22))
        model.p_min = p_min
        policy = AutoPolicy(4, None, model)
        policy.calibrate({1: 0.012, 3: 0.0167, 5: 0.0211}, 0.003)  # a perfect draft pays 1.7x
        for _ in range(3):  # the draft is not chosen, only re-tried
            policy._acc("draft").update(4, 0)
        after = []  # the step before each re-try: its target sure?
        sure = None
        for _ in range(400):
            name, prop = policy.draft([0] * 10, 4, SamplingParams(), rng, True)
            if name == "draft":
                after.append(sure)
                policy.observe(StepReport("none", 0, 0, 0.003, 0.012, declined="draft"))
                sure = None
                continue
            sure = bool(rng.random() < 0.5) if p_min else None
            policy.observe(StepReport(name, 0, 0, 0.0, 0.012, target_sure=sure))
        assert len(after) >= 2
        assert all(after) if p_min else all(s is None for s in after), after


def test_a_slower_single_row_does_not_make_batches_look_cheaper():
    """Calibrated V(n) holds while the machine's pace drifts: plain steps that take 15% longer
    than at calibration leave V(3) and V(9) where they were (not 15% lower), and a 3-row pass
    measured afterwards moves V(3) against the one-row time of now."""
    policy = AutoPolicy(4, None, FakeDraftModel())
    policy.calibrate({1: 0.0122, 3: 0.0222, 9: 0.0398}, 0.0066)
    v0 = policy.costs.verify_cost()
    for _ in range(40):
        policy.costs.observe_verify(1, 0.014)
    v = policy.costs.verify_cost()
    assert policy.costs.t1() == pytest.approx(0.014, rel=1e-3)
    assert v(3) == pytest.approx(v0(3)) and v(9) == pytest.approx(v0(9))
    for _ in range(40):
        policy.costs.observe_verify(3, 0.014 * 1.5)
    assert policy.costs.verify_cost()(3) == pytest.approx(1.5, rel=1e-3)


def test_the_targets_confidence_is_not_asked_where_no_draft_could_pay():
    """Reading the target's sureness costs a pass over the vocabulary each step; where even a
    draft accepted whole that never stopped would not pay (batches and draft steps this dear),
    auto does not ask for it (confidence_p 0), and asks again once the costs say it could."""
    rng = np.random.default_rng(19)
    model = ShyDraftModel(np.random.default_rng(20))
    policy = AutoPolicy(4, None, model)
    policy.calibrate({1: 0.02, 2: 0.036, 3: 0.044, 5: 0.06}, 0.012)
    assert policy.draft([0] * 10, 4, SamplingParams(), rng, True)[0] == "none"
    assert policy.confidence_p() == 0.0
    cheap = AutoPolicy(4, None, model)
    cheap.calibrate({1: 0.02, 2: 0.021, 3: 0.022, 5: 0.024}, 0.003)
    cheap.draft([0] * 10, 4, SamplingParams(), rng, True)
    assert cheap.confidence_p() == 0.6


def test_a_draft_that_can_neither_be_chosen_nor_retried_is_not_priced():
    """A perfect draft beats the margin but not the re-try bar (a Q8_0 target beside a Q4_0
    draft with AMX): no re-try can run it, and its acceptance estimate (the prior's, moved only
    by running it) does not pay either, so auto neither prices it nor reads the target's
    sureness. Once that estimate would pay (a draft right every time), both resume."""
    rng = np.random.default_rng(29)
    model = ShyDraftModel(np.random.default_rng(30))
    policy = AutoPolicy(8, None, model)
    policy.calibrate({1: 0.006, 2: 0.0086, 3: 0.0091, 5: 0.0101, 9: 0.0135}, 0.0045)
    v = policy.costs.verify_cost()
    perfect = costmodel.perfect_best(policy._draft_c(), v, 8)
    assert PRIORS.margin < perfect < PRIORS.probe_bar
    priced = []
    policy._draft_best = lambda *a, **k: priced.append(1) or (0, 1.0)
    for _ in range(50):
        assert policy.draft([0] * 10, 8, SamplingParams(), rng, True)[0] == "none"
        assert policy.confidence_p() == 0.0
        policy.observe(StepReport("none", 0, 0, 0.0, 0.006))
    assert not priced
    for _ in range(30):
        policy._acc("draft").update(8, 8)
    policy.draft([0] * 10, 8, SamplingParams(), rng, True)
    assert priced and policy.confidence_p() == model.p_min


def test_the_verify_cost_is_rebuilt_only_when_v_moves():
    """verify_cost() is kept while V(n) stands: one-row passes scale every size alike, so the
    same answer serves; a pass of more rows or a size first seen makes a new one, equal to what
    a rebuild from the measurements gives."""
    policy = AutoPolicy(4, None, FakeDraftModel())
    policy.calibrate({1: 0.010, 3: 0.016, 9: 0.030}, 0.004)
    costs = policy.costs
    v = costs.verify_cost()
    for t in (0.011, 0.012, 0.0105):
        costs.observe_verify(1, t)
        assert costs.verify_cost() is v
    assert [v(n) for n in range(1, 12)] == pytest.approx(
        [costs._verify_cost()(n) for n in range(1, 12)]
    )
    costs.observe_verify(3, 0.025)
    w = costs.verify_cost()
    assert w is not v and w(3) > v(3)
    assert [w(n) for n in range(1, 12)] == pytest.approx(
        [costs._verify_cost()(n) for n in range(1, 12)]
    )
    costs.observe_verify(2, 0.013)
    assert costs.verify_cost() is not w and costs.verify_cost()(2) == pytest.approx(
        costs.verify[2] / costs.verify[1]
    )


def test_an_acceptance_estimate_follows_its_counts_and_prior():
    """The estimate kept between updates is the one its counts and prior give."""
    from specrun.decoding.estimates import Acceptance

    acc = Acceptance(0.5, 4)
    first = acc.estimate()
    assert acc.estimate() is first
    acc.update(4, 2)
    moved = acc.estimate()
    assert moved is not first and moved[0] > first[0]
    acc.prior = 0.2
    assert acc.estimate()[3] < moved[3]
    acc.scale(0.5)
    fresh = Acceptance(0.2, 4)
    fresh.hits, fresh.tries = list(acc.hits), list(acc.tries)
    assert acc.estimate() == pytest.approx(fresh.estimate())


def test_the_draft_reads_the_prompt_only_where_it_may_run():
    """Where even a draft accepted whole that never stops would not clear the re-try bar at the
    measured costs, auto neither re-tries nor chooses it: its prefill is skipped (time before the
    first token for nothing). Where it could pay, it reads the prompt as before."""
    rng = np.random.default_rng(23)
    # V(5) 1.8, a draft step half a target step: a perfect K=4 draft makes 5 / 4.3 = 1.16x
    dear = AutoPolicy(4, FakeLookup(), FakeDraftModel())
    dear.calibrate({1: 0.010, 2: 0.0126, 3: 0.0155, 5: 0.018}, 0.005)
    assert not dear.draft_may_run()
    dear.prefill([0] * 50)
    assert dear.model.prefilled is False and dear.model.n_cached == 0
    for _ in range(100):
        assert dear.draft([0] * 50, 4, SamplingParams(), rng, True)[0] != "draft"
        dear.observe(StepReport("none", 0, 0, 0.0, 0.010, target_sure=True))
    cheap = AutoPolicy(4, FakeLookup(), FakeDraftModel())
    cheap.calibrate({1: 0.010, 2: 0.0126, 3: 0.0155, 5: 0.018}, 0.002)  # 5 / 2.8 = 1.79x
    assert cheap.draft_may_run()
    cheap.prefill([0] * 50)
    assert cheap.model.prefilled is True and cheap.model.n_cached == 49


def test_the_draft_is_retried_only_where_it_could_pay_for_the_retry():
    """A re-try of the draft model costs its catch-up; where even a draft accepted whole would
    gain under PROBE_BAR (a draft unsure at most positions), none is made, and where the text
    turned sure one is. The gate reads the slow stop rate: a dip of the fast one (noise, on a
    story) does not buy a re-try."""
    rng = np.random.default_rng(17)
    model = ShyDraftModel(np.random.default_rng(18))
    policy = AutoPolicy(4, None, model)
    policy.costs.observe_verify(1, 0.02)
    policy.costs.observe_verify(5, 0.026)
    policy.costs.observe_draft(4, 4 * 0.006)
    v = policy.costs.verify_cost()
    for _ in range(40):  # estimates of a draft that is wrong where it drafts: not chosen
        policy._acc("draft").update(2, 0)
    policy.stop.p = policy.stop_slow.p = policy.go_on.p = 0.5
    s_whole = policy._draft_best(v, 4, sure=True)[1]
    assert PRIORS.margin < s_whole < PRIORS.probe_bar
    policy._since = 1000
    assert policy.draft([0] * 10, 4, SamplingParams(), rng, True)[0] == "none"
    policy.stop.p = 0.1  # the fast estimate dips; the slow one has not moved
    policy._since = 1000
    assert policy.draft([0] * 10, 4, SamplingParams(), rng, True)[0] == "none"
    for _ in range(60):  # the text turned sure: the slow estimate follows within ~60 tokens
        plain(policy, sure=True)
    assert policy.stop_slow.p < 0.2
    policy._since = 1000
    assert policy.draft([0] * 10, 4, SamplingParams(), rng, True)[0] == "draft"


def test_a_catch_up_owed_is_priced_when_choosing_the_draft():
    """Choosing the draft model after a stretch without it first costs a catch-up (up to
    CATCH_UP_WINDOW rows): a draft that would pay a little is not worth it then (it was chosen on
    a summary at a predicted 1.22x, paid 64 ms of catch-up and proposed nothing), one that pays
    well still is, and the same marginal draft is chosen once it is caught up."""
    rng = np.random.default_rng(3)
    model = FakeDraftModel()
    policy = AutoPolicy(4, None, model)
    policy.costs.observe_verify(1, 0.02)
    policy.costs.observe_verify(5, 0.026)
    for _ in range(5):
        policy.costs.observe_draft(4, 4 * 0.006)
        policy.costs.observe_catch_up(8, 8 * 0.006)
    policy._probe_every = 10_000
    for _ in range(40):  # right about two times in three
        policy._acc("draft").update(3, 2)
    v = policy.costs.verify_cost()
    tokens = [0] * 40
    model.n_cached = 39  # caught up
    k, s = policy._draft_best(v, 4, tokens=tokens)
    assert k > 0 and PRIORS.margin < s < 1.4
    assert policy.draft(tokens, 4, SamplingParams(), rng, True)[0] == "draft"
    model.n_cached = 10  # 30 tokens behind: a 16-row catch-up owed
    assert policy._draft_best(v, 4, tokens=tokens)[1] < PRIORS.margin
    assert policy.draft(tokens, 4, SamplingParams(), rng, True)[0] == "none"
    for _ in range(40):  # right nearly always: worth its catch-up
        policy._acc("draft").update(4, 4)
    model.n_cached = 10
    assert policy.draft(tokens, 4, SamplingParams(), rng, True)[0] == "draft"


def _attempt_by_outcome(cum, k, c, v, go, go_on, per_accepted, fixed):  # type: ignore[no-untyped-def]
    """An attempt of K priced outcome by outcome (j = 0..K proposed), from the module's notes."""
    tokens, cost = 0.0, fixed
    for j in range(k + 1):
        reach = 1.0 if j == 0 else go * go_on ** (j - 1)
        p = reach * ((1 - go if j == 0 else 1 - go_on) if j < k else 1.0)
        acc = sum(cum[:j])
        steps = j + 1 if j < k else k + cum[k - 1]
        tokens += p * (1 + acc)
        cost += p * (c * steps + v(j + 1) + per_accepted * acc)
    return tokens / cost


def test_every_k_in_one_pass_prices_each_attempt_as_alone():
    """costmodel.speedups (all K at once, running sums) gives each K the speed-up of that
    attempt priced outcome by outcome, and best_k picks the first best of them."""
    rng = np.random.default_rng(21)
    for _ in range(300):
        k_max = int(rng.integers(1, 10))
        cum = list(np.cumprod(rng.uniform(0.3, 1.0, k_max)))
        slope, c = float(rng.uniform(0.0, 0.6)), float(rng.uniform(0.0, 0.6))
        v = costmodel.linear_verify_cost(slope)
        go = 1.0 if rng.random() < 0.3 else float(rng.uniform(0.1, 1.0))
        go_on = 1.0 if rng.random() < 0.3 else float(rng.uniform(0.1, 1.0))
        per, fixed = float(rng.uniform(0.0, 0.3)), float(rng.uniform(0.0, 0.5))
        got = costmodel.speedups(cum, k_max, c, v, go, per, fixed, go_on)
        assert got[0] == pytest.approx(1.0)
        for k in range(1, k_max + 1):
            want = _attempt_by_outcome(cum, k, c, v, go, go_on, per, fixed)
            assert got[k] == pytest.approx(want, rel=1e-12)
        best = max(range(k_max + 1), key=lambda k: (got[k], -k))
        assert costmodel.best_k(cum, c, v, k_max, go, per, fixed, go_on)[0] == best


def test_the_draft_goes_on_in_stretches():
    """Sureness comes in stretches: a draft that often declines its first token but, once
    sure, goes on (code between docstrings) pays where one stopping as often at every position
    (a story) does not. go_on defaults to go (one rate for every position)."""
    v = costmodel.linear_verify_cost(0.12)
    acc = costmodel.geometric(0.97, 4)
    same = costmodel.speedups(acc, 4, 0.25, v, go=0.3)[4]
    assert same == costmodel.speedups(acc, 4, 0.25, v, go=0.3, go_on=0.3)[4]
    assert same < PRIORS.margin
    assert costmodel.speedups(acc, 4, 0.25, v, go=0.3, go_on=0.95)[4] > 1.15
    # go = go_on = 1: the closed form
    assert (
        abs(
            costmodel.speedups(acc, 4, 0.25, v, go=1.0, go_on=1.0)[4]
            - costmodel.speedups(acc, 4, 0.25, v)[4]
        )
        < 1e-12
    )


def test_go_on_is_learnt_from_sure_steps_and_the_drafts_runs():
    policy = AutoPolicy(4, None, FakeDraftModel())
    for sure in [True, True, False, True, False, False, True, True] * 10:
        plain(policy, sure=sure)  # after a sure step: sure 2 times in 4
    assert 0.3 < policy.go_on.p < 0.7
    policy._asked = 4
    for _ in range(20):  # the draft proposes its whole K: it went on past 3 positions each time
        policy.observe(StepReport("draft", 4, 4, 0.02, 0.03))
    assert policy.go_on.p > 0.9
    policy._asked = 4
    for _ in range(20):  # it stops after one token each time
        policy.observe(StepReport("draft", 1, 1, 0.01, 0.03))
    assert policy.go_on.p < 0.1


def test_a_match_length_borrows_from_the_others():
    """A match length seldom seen starts from what the other lengths have shown on this text,
    not from the generic prior alone."""
    policy = AutoPolicy(4, FakeLookup(), None)
    for _ in range(10):
        policy._acc("lookup:4").update(4, 4)
    assert policy._lookup_prior("lookup:1") > 0.8 > PRIORS.accept_lookup_1
    for _ in range(30):
        policy._acc("lookup:4").update(4, 0)
    assert policy._lookup_prior("lookup:2") < 0.3 < PRIORS.accept_lookup
    assert policy._lookup_prior("lookup:4") == PRIORS.accept_lookup  # not itself


def test_reset_keeps_lookups_acceptance_and_clear_store_forgets_it():
    """A new request in the same process (Engine.reset) keeps lookup's acceptance counts, as the
    lookup store is kept; Engine.clear_store (every run a first request) drops them."""
    policy = AutoPolicy(4, PromptLookup(1, 4), FakeDraftModel())
    acc = policy._acc("lookup:4")
    prior = acc.estimate()
    for _ in range(20):
        acc.update(4, 4)  # every proposal accepted whole
    learnt = acc.estimate()
    policy.reset()
    assert policy.acc["lookup:4"].estimate() == learnt
    policy.forget_lookup()
    assert policy._acc("lookup:4").estimate() == prior


def test_engine_clear_store_forgets_autos_lookup_estimates():
    from fakes import FakeModel, cycle_rule

    from specrun.decoding.engine import Engine, SpecConfig

    eng = Engine(FakeModel(cycle_rule("abc")), None, SpecConfig(mode="auto", draft_max=4))
    eng.policy._acc("lookup:2").update(2, 2)
    eng.reset()
    assert "lookup:2" in eng.policy.acc
    eng.clear_store()
    assert "lookup:2" not in eng.policy.acc


def test_perfect_best_is_best_k_of_a_perfect_draft():
    """The perfect-draft gate's closed form gives best_k's own speed-up for a draft accepted whole
    that never stops, float for float, over drafts cheap and dear and lines and curves of V(n)."""
    rng = np.random.default_rng(3)
    for _ in range(2000):
        k = int(rng.integers(1, 9))
        c = float(rng.uniform(0.0, 1.5))
        table = {1: 1.0, **{n: 1.0 + float(rng.uniform(0.0, 1.2)) * (n - 1) for n in range(2, 10)}}
        v = table.__getitem__
        assert costmodel.perfect_best(c, v, k) == costmodel.best_k([1.0] * k, c, v, k)[1]


def test_a_catch_ups_evidence_moves_the_drafts_acceptance():
    """The rows of a draft's catch-up, scored against the tokens that followed them (sure rows
    only), move its acceptance estimate even when the attempt proposed nothing: two early
    first-position misses no longer leave the draft where no K pays until a re-try proposes and
    is accepted (the Stack class: auto 1.01-1.07x in some processes against the draft's 1.39x).
    With ``evidence_weight`` 0 they are not read."""
    import dataclasses

    from specrun.decoding.priors import PRIORS

    for weight, lifts in ((1.0, True), (0.0, False)):
        model = FakeDraftModel()
        policy = AutoPolicy(
            8, None, model, priors=dataclasses.replace(PRIORS, evidence_weight=weight)
        )
        policy.costs.observe_verify(1, 0.02)
        acc = policy._acc("draft")
        acc.update(4, 0)
        acc.update(4, 0)
        before = acc.estimate()[0]
        # A re-try that proposed nothing, after a catch-up of seven tokens: the draft was sure
        # of five of the next tokens and right on them, unsure of one, wrong once where sure.
        model.last_catch_up = (7, 0.01)
        model.last_evidence = [(True, True)] * 5 + [(False, False), (True, False)]
        policy.observe(StepReport("none", 0, 0, 0.005, 0.02, declined="draft"))
        after = acc.estimate()[0]
        assert (after > before + 0.2) if lifts else (after == before), (weight, before, after)
        assert acc.tries[0] == pytest.approx(1.85 + (6 if lifts else 0))  # the six sure rows
        assert len(model.last_evidence) == (0 if lifts else 7)  # read once, where read
