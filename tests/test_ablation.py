"""The ablation's switches (specrun.benchmark.ablation) reach an engine's policy in real runs as
they reach the replay's: bench/modes_compare.py's ``auto!NAME`` must run the refinement's
absence, not plain auto under another name."""

from __future__ import annotations

import pytest
from fakes import FakeModel, cycle_rule, text_tokens, wrong_every

from specrun.benchmark.ablation import OFF, ablated
from specrun.benchmark.harness import make_engine
from specrun.decoding.auto import AutoPolicy
from specrun.decoding.suffix import SuffixLookup

TEXT = "the cat sat on the mat, "
PROMPT = [1, *text_tokens("the cat")]


def _pair():
    return FakeModel(cycle_rule(TEXT)), FakeModel(wrong_every(cycle_rule(TEXT), 5))


def test_every_switch_builds_and_runs_exactly():
    target, draft = _pair()
    base = make_engine(target, draft, "auto", 4, 0.0).run(PROMPT, max_tokens=40).tokens
    for name in OFF:
        eng = make_engine(target, draft, f"auto!{name}", 4, 0.0)
        assert isinstance(eng.policy, AutoPolicy)
        assert type(eng.policy).__name__ == "AutoWithout"
        assert eng.run(PROMPT, max_tokens=40).tokens == base, name  # greedy: exact either way


def test_go_on_off_reads_the_stop_rate():
    target, draft = _pair()
    eng = make_engine(target, draft, "auto!go-on", 4, 0.0)
    assert eng.policy.go_on.p == pytest.approx(1.0 - eng.policy.stop.p)
    eng.run(PROMPT, max_tokens=40)
    eng.policy.reset()  # a new text keeps the switch
    assert eng.policy.go_on.p == pytest.approx(1.0 - eng.policy.stop.p)


def test_lookup_switches_change_the_suffix_drafter():
    target, draft = _pair()
    eng = make_engine(target, draft, "auto!walk-floor!cap-bonus", 4, 0.0)
    d = eng.policy.lookup
    assert isinstance(d, SuffixLookup)
    assert d.min_prob == SuffixLookup.MIN_PROB  # auto's own floor (MIN_PROB_AUTO) taken out
    assert d._cap(3, 10) == 3
    plain = make_engine(target, draft, "auto", 4, 0.0).policy.lookup
    assert plain.min_prob == SuffixLookup.MIN_PROB_AUTO


def test_first_probe_off_starts_without_a_due_re_try():
    target, draft = _pair()
    assert make_engine(target, draft, "auto!first-probe", 4, 0.0).policy._since == 0
    assert make_engine(target, draft, "auto", 4, 0.0).policy._since > 0


def test_bad_names_are_refused():
    target, draft = _pair()
    with pytest.raises(SystemExit, match="one of"):
        make_engine(target, draft, "auto!nope", 4, 0.0)
    with pytest.raises(SystemExit, match="only auto"):
        make_engine(target, draft, "draft!bursts", 4, 0.0)
    with pytest.raises(SystemExit, match="one of"):
        ablated(("nope",))


def test_a_prior_change_reaches_the_rates_built_from_it():
    """``auto@FIELD=VALUE`` rebuilds what the policy built from its priors (a new text keeps
    its estimates, so nothing else would)."""
    target, draft = _pair()
    eng = make_engine(target, draft, "auto@stop=0.5;probe_min=16", 4, 0.0)
    assert eng.policy.stop.p == pytest.approx(0.5)
    assert eng.policy._probe_every == 16
    assert make_engine(target, draft, "auto", 4, 0.0).policy.stop.p == pytest.approx(0.2)
