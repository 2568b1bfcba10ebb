"""Prompt lookup index, the persistent n-gram cache, and the auto controller's choices on
synthetic costs and acceptance (no models)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specrun.spec import costmodel
from specrun.spec.drafters import Proposal
from specrun.spec.lookup import NgramCache, NgramIndex, PromptLookup
from specrun.spec.policy import PRIORS, AutoPolicy, StepReport
from specrun.spec.sampling import SamplingParams


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
class FakeDraftModel:
    """Stands in for the draft model: proposes k tokens and reports a synthetic cost."""

    name = "draft"
    p_min = 0.0

    def __init__(self):
        self.proposed = []
        self.windows = []
        self.last_catch_up = (1, 0.0)
        self.n_cached = 0

    def prefill(self, tokens, evaluate=True):
        self.prefilled = evaluate
        if evaluate:
            self.n_cached = len(tokens) - 1
        return 0

    def propose(self, tokens, k, params, rng, greedy_draft, window=None):
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


class FakeLookup:
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
    from specrun.spec.policy import _Acceptance

    acc = _Acceptance(0.6, 4)
    acc.update(2, 0)
    assert 0.2 < acc.estimate()[0] < 0.6


def test_positions_after_the_first_rejection_are_not_counted():
    """Acceptance is estimated per position *given* the earlier positions were accepted: a
    draft rejected at position 1 says nothing about positions 2 and 3."""
    from specrun.spec.policy import _Acceptance

    acc = _Acceptance(0.6, 4)
    acc.update(4, 1)
    r = acc.rates()
    assert r[0] > r[1] and r[1] < 0.6  # position 0 accepted, position 1 rejected
    assert r[2] == r[3]  # untried: the pooled rate, both
    assert acc.tries[2] == acc.tries[3] == 0.0


def test_deep_positions_borrow_from_the_pool():
    """A few fully accepted short drafts make the positions they never reached likely too (one
    acceptance process): per-position estimates from a geometric prior each had to be reached
    several times before auto drafted past K = 2 on a draft accepted 98% of the time."""
    from specrun.spec.policy import _Acceptance

    acc = _Acceptance(0.6, 8)
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
    from specrun.spec.policy import _Acceptance

    acc = _Acceptance(0.6, 4)
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
        1.0, 1.0, 1.0, 1.0, 0.0
    ]
    assert acc.tries[6] == 0
    assert policy._pending == []
