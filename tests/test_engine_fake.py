"""The engine's bookkeeping on fake models (tests/fakes.py): rollback, prefix reuse, the end of
the context, stop strings, max_tokens cut inside an accepted draft. No GGUF file; runs in
well under a second, so ``make test-fast`` covers the loop's edge cases too."""

from __future__ import annotations

import pytest
from fakes import EOS, FakeModel, cycle_rule, text_tokens, wrong_every

from specrun.decoding.engine import Engine, Result, SpecConfig
from specrun.decoding.sampling import SamplingParams

TEXT = "the cat sat on the mat, "
PROMPT = [1, *text_tokens("the cat")]
GREEDY = SamplingParams(temp=0.0)


def run(engine: Engine, prompt=PROMPT, n=40, **kw) -> Result:
    return engine.run(prompt, max_tokens=n, params=kw.pop("params", GREEDY), **kw)


def alone(n=40, prompt=PROMPT, rule=None, **kw) -> Result:
    target = FakeModel(rule or cycle_rule(TEXT), **kw)
    return run(Engine(target, None, SpecConfig(mode="none")), prompt, n)


@pytest.mark.parametrize("mode", ["draft", "lookup", "hybrid", "auto"])
@pytest.mark.parametrize("wrong", [None, 2, 3, 7])
def test_output_is_the_target_alone_and_caches_stay_consistent(
    mode: str, wrong: int | None
) -> None:
    rule = cycle_rule(TEXT)
    target = FakeModel(rule)
    draft = FakeModel(wrong_every(rule, wrong) if wrong else rule, seed=1)
    eng = Engine(target, draft, SpecConfig(mode=mode, draft_max=5, draft_p_min=0.0))
    res = run(eng)
    assert res.tokens == alone().tokens
    # Both caches hold the run's tokens, all but the pending last one, and nothing past it.
    full = PROMPT + res.tokens
    assert list(target.cached) == full[: len(target.cached)]
    assert len(target.cached) == len(full) - 1
    if eng.draft_model is not None:
        assert list(draft.cached) == full[: len(draft.cached)]
        assert len(draft.cached) <= len(full) - 1


def test_a_fully_accepted_draft_never_re_decodes_history() -> None:
    rule = cycle_rule(TEXT)
    target, draft = FakeModel(rule), FakeModel(rule, seed=1)
    eng = Engine(target, draft, SpecConfig(mode="draft", draft_max=4, draft_p_min=0.0))
    res = run(eng, n=40)
    assert res.stats.acceptance_rate == 1.0
    # The draft evaluates each position at most once: the prompt, then one row per token it
    # proposed or caught up on; a rejected or re-decoded row would push it past that.
    assert draft.rows_decoded <= len(PROMPT) + len(res.tokens)


def test_target_rows_are_prompt_plus_one_pass_each() -> None:
    rule = cycle_rule(TEXT)
    target, draft = FakeModel(rule), FakeModel(rule, seed=1)
    eng = Engine(target, draft, SpecConfig(mode="draft", draft_max=4, draft_p_min=0.0))
    res = run(eng, n=41)
    # Every pass verifies K=4 drafts but the last, cut to what max_tokens leaves.
    prefill = len(PROMPT) - 1
    verify_rows = sum(n for pos, n in target.decode_calls[1:])
    assert target.decode_calls[0] == (0, prefill)
    assert verify_rows == res.stats.target_passes + res.stats.drafted
    assert len(res.tokens) == 41


def test_rejections_roll_both_caches_back() -> None:
    rule = cycle_rule(TEXT)
    target, draft = FakeModel(rule), FakeModel(wrong_every(rule, 3), seed=1)
    eng = Engine(target, draft, SpecConfig(mode="draft", draft_max=6, draft_p_min=0.0))
    res = run(eng, n=30)
    assert res.stats.drafted > res.stats.accepted > 0
    # Some pass rolled the target back: a decode started below the previous one's end.
    ends = []
    rolled = False
    for pos, n in target.decode_calls:
        if ends and pos < ends[-1]:
            rolled = True
        ends.append(pos + n)
    assert rolled
    assert res.tokens == alone(30).tokens


def test_prefix_reuse_decodes_only_the_new_tokens() -> None:
    rule = cycle_rule(TEXT)
    target = FakeModel(rule)
    eng = Engine(target, None, SpecConfig(mode="none"))
    first = run(eng, n=10)
    before = target.rows_decoded
    turn2 = PROMPT + first.tokens + text_tokens(" on")
    second = run(eng, prompt=turn2, n=5)
    assert second.stats.prefill_tokens == len(text_tokens(" on")) + 1  # + the pending token
    assert target.rows_decoded - before == second.stats.prefill_tokens - 1 + len(second.tokens)
    # A prompt that shares only a prefix: the cache is cut back to it, not cleared.
    other = PROMPT[:3] + text_tokens("xyz")
    calls = len(target.decode_calls)
    run(eng, prompt=other, n=3)
    assert target.decode_calls[calls] == (3, 2)  # [x, y] after the shared [BOS, t, h]


def test_the_context_end_stops_cleanly() -> None:
    rule = cycle_rule(TEXT)
    target, draft = FakeModel(rule, n_ctx=24), FakeModel(rule, n_ctx=24, seed=1)
    eng = Engine(target, draft, SpecConfig(mode="draft", draft_max=8, draft_p_min=0.0))
    res = run(eng, n=100)
    assert res.finish_reason == "length"
    assert len(PROMPT) + len(res.tokens) <= 24 + 1
    assert res.tokens == alone(100, n_ctx=24).tokens


def test_eos_inside_an_accepted_draft_ends_there() -> None:
    rule = cycle_rule(TEXT, end_after=len(PROMPT) + 6)
    target, draft = FakeModel(rule), FakeModel(rule, seed=1)
    eng = Engine(target, draft, SpecConfig(mode="draft", draft_max=8, draft_p_min=0.0))
    res = run(eng, n=50)
    assert res.finish_reason == "eos"
    assert EOS not in res.tokens[:-1]
    assert res.tokens == alone(50, rule=rule).tokens


def test_a_stop_string_inside_a_draft_cuts_the_text() -> None:
    rule = cycle_rule(TEXT)
    target, draft = FakeModel(rule), FakeModel(rule, seed=1)
    eng = Engine(target, draft, SpecConfig(mode="draft", draft_max=8, draft_p_min=0.0))
    res = eng.run(PROMPT, max_tokens=60, params=GREEDY, stop=("e cat",))  # alone: "he cathe cat..."
    assert res.finish_reason == "stop"
    assert res.text == "h"
    assert len(res.tokens) < 8  # not the whole 8-token draft's worth past the stop


def test_sampled_runs_repeat_with_their_seed() -> None:
    rule = cycle_rule(TEXT)
    params = SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7)

    def once() -> list[int]:
        target, draft = FakeModel(rule, peak=2.0), FakeModel(wrong_every(rule, 4), peak=2.0, seed=1)
        return run(
            Engine(target, draft, SpecConfig(mode="draft", draft_max=4, draft_p_min=0.0)),
            n=30,
            params=params,
        ).tokens

    a, b = once(), once()
    assert a == b and len(a) == 30


def test_two_engines_over_one_model_read_its_cache_not_a_stale_copy() -> None:
    """Engines sharing a Model (bench, the probe, tests) each see what the cache really holds:
    the second's run cuts the first's tokens, and the first then re-evaluates, not trusts them."""
    rule = cycle_rule(TEXT)
    target, draft = FakeModel(rule), FakeModel(rule, seed=1)
    a = Engine(target, draft, SpecConfig(mode="draft", draft_max=4, draft_p_min=0.0))
    b = Engine(target, draft, SpecConfig(mode="draft", draft_max=2, draft_p_min=0.0))
    first = run(a, n=30)
    run(b, prompt=[1, *text_tokens("sat")], n=5)
    again = run(a, n=30)
    assert again.tokens == first.tokens == alone(30).tokens
    assert (
        again.stats.prefill_tokens == len(PROMPT) - 1
    )  # only the BOS both prompts start with was kept


@pytest.mark.parametrize("kind", ["suffix", "ngram"])
def test_the_shortest_lookup_match_is_the_modes_and_follows_a_change_of_mode(kind: str) -> None:
    """--lookup-min unset: 2 for lookup and hybrid (a one-token match is a weak guess where a
    2-row pass costs 1.3-1.6 steps), 1 under auto (it prices each match length); given, it holds
    for every mode. The engine's one lookup drafter follows a server request's change of mode."""
    assert SpecConfig(mode="lookup").min_match("lookup") == 2
    assert SpecConfig().min_match("hybrid") == 2
    assert SpecConfig().min_match("auto") == 1
    assert SpecConfig(lookup_max=1).min_match("lookup") == 1  # never above --lookup-max
    assert SpecConfig(lookup_min=3).min_match("auto") == 3
    with pytest.raises(Exception, match="--lookup-min"):
        SpecConfig(lookup_min=5, lookup_max=4).validate()
    target = FakeModel(cycle_rule(TEXT))
    eng = Engine(target, None, SpecConfig(mode="lookup", draft_max=4, lookup_kind=kind))
    drafter = eng.lookup
    assert drafter is not None and drafter.n_min == 2  # type: ignore[attr-defined]
    if kind == "suffix":  # and the walk's floor: auto chooses its own K, so it walks further
        assert drafter.min_prob == drafter.MIN_PROB > drafter.MIN_PROB_AUTO  # type: ignore[attr-defined]
    eng.configure(mode="auto")
    assert eng.lookup is drafter and drafter.n_min == 1  # type: ignore[attr-defined]
    if kind == "suffix":
        assert drafter.min_prob == drafter.MIN_PROB_AUTO  # type: ignore[attr-defined]
    # Under auto a one-token match proposes: "x" once before, followed by "y".
    x, y = text_tokens("xy")
    history = [1, *text_tokens("ab"), x, y, *text_tokens("cd"), x]
    rng = None
    prop = drafter.propose(history, 4, GREEDY, rng, True)  # type: ignore[arg-type]
    assert prop.tokens[:1] == [y]
    eng.configure(mode="lookup")
    assert drafter.n_min == 2  # type: ignore[attr-defined]
    assert not len(drafter.propose(history, 4, GREEDY, rng, True))  # type: ignore[arg-type]
    # And the same result as plain decoding in every mode.
    assert run(eng).tokens == alone().tokens
