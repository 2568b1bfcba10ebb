"""Logit biases, repetition penalties and ignore_eos (decoding/penalties.py) on the verify path,
and the probabilities reported per token: on the fake models (tests/fakes.py), no GGUF file.

- The transform is llama.cpp's (``llama_sampler_logit_bias`` then ``llama_sampler_penalties``),
  checked against a line-by-line transcription of its loop.
- Greedy speculation under penalties is the target alone under the same penalties, token for
  token, in every mode.
- Sampled speculation keeps the penalised distribution: a two-sample chi-square on the first two
  tokens (as tests/test_sampling_engine.py does on the real pair) of mode draft against mode none,
  both under a penalty and a bias; and the same test rejects a verify path that forgets the drafts
  before a row in its history (the power check).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from fakes import EOS, FakeModel, cycle_rule, text_tokens, wrong_every
from test_sampling_engine import two_sample_chi2

from specrun.decoding import penalties as P
from specrun.decoding.engine import Engine, SpecConfig
from specrun.decoding.sampling import SamplingParams

TEXT = "the cat sat on the mat, "
PROMPT = [1, *text_tokens("the cat sat on the mat")]
PENAL = SamplingParams(
    temp=0.0,
    repeat_penalty=1.3,
    frequency_penalty=1.5,
    presence_penalty=0.5,
    repeat_last_n=16,
    logit_bias=((text_tokens("z")[0], 3.0), (text_tokens("q")[0], -math.inf)),
)


def reference(logits: np.ndarray, params: SamplingParams, history: list[int]) -> np.ndarray:
    """llama.cpp's samplers transcribed: logit_bias, then penalties over the last n tokens."""
    out = logits.astype(np.float32).copy()
    for tok, b in params.logit_bias:
        out[tok] += b
    n = params.repeat_last_n
    last = history if n < 0 else history[-n:] if n > 0 else []
    counts = Counter(last)
    for i in range(out.shape[0]):
        c = counts.get(i, 0)
        if c == 0:
            continue
        if out[i] <= 0:
            out[i] *= params.repeat_penalty
        else:
            out[i] /= params.repeat_penalty
        out[i] -= c * params.frequency_penalty + (c > 0) * params.presence_penalty
    return out


@pytest.mark.parametrize("last_n", [-1, 0, 1, 4, 64])
def test_the_transform_is_llama_cpps(last_n: int) -> None:
    rng = np.random.default_rng(3)
    params = replace(PENAL, repeat_last_n=last_n)
    history = [int(t) for t in rng.integers(0, 64, 40)]
    rt = P.RowTransform(params, history)
    for extra in [int(t) for t in rng.integers(0, 64, 6)]:
        logits = rng.normal(0, 3, 64).astype(np.float32)
        raw = logits.copy()
        got = rt.apply(logits)
        np.testing.assert_allclose(got, reference(raw, params, history), rtol=1e-6, atol=1e-5)
        assert np.array_equal(logits, raw)  # the model's row is left alone
        history.append(extra)
        rt.push(extra)


def test_neutral_settings_change_nothing() -> None:
    assert not P.active(SamplingParams())
    assert not P.active(SamplingParams(repeat_penalty=1.5, repeat_last_n=0))
    assert P.active(SamplingParams(ignore_eos=True))
    assert P.active(SamplingParams(logit_bias=((5, 1.0),)))


def _engine(mode: str, wrong: int | None = 3, peak: float = 8.0) -> Engine:
    rule = cycle_rule(TEXT)
    target = FakeModel(rule, peak=peak)
    draft = FakeModel(wrong_every(rule, wrong) if wrong else rule, seed=1, peak=peak)
    return Engine(
        target,
        None if mode in ("none", "lookup") else draft,
        SpecConfig(mode=mode, draft_max=5, draft_p_min=0.0),
    )


@pytest.mark.parametrize("mode", ["draft", "lookup", "hybrid", "auto"])
@pytest.mark.parametrize("wrong", [None, 3])
def test_greedy_under_penalties_is_the_target_alone(mode: str, wrong: int | None) -> None:
    alone = _engine("none").run(PROMPT, max_tokens=60, params=PENAL)
    plain = _engine("none").run(PROMPT, max_tokens=60, params=replace(PENAL, repeat_penalty=1.0,
                                frequency_penalty=0.0, presence_penalty=0.0, logit_bias=()))  # fmt: skip
    assert alone.tokens != plain.tokens  # the penalties bite on this text
    assert text_tokens("q")[0] not in alone.tokens
    got = _engine(mode, wrong).run(PROMPT, max_tokens=60, params=PENAL)
    assert got.tokens == alone.tokens
    assert got.stats.drafted > 0


def test_ignore_eos_runs_to_max_tokens() -> None:
    rule = cycle_rule(TEXT, end_after=len(PROMPT) + 5)
    ends = Engine(FakeModel(rule), None, SpecConfig(mode="none")).run(
        PROMPT, max_tokens=20, params=SamplingParams(temp=0.0)
    )
    assert ends.finish_reason == "eos" and len(ends.tokens) == 5
    params = SamplingParams(temp=0.0, ignore_eos=True)
    alone = Engine(FakeModel(rule), None, SpecConfig(mode="none")).run(
        PROMPT, max_tokens=20, params=params
    )
    assert alone.finish_reason == "length" and len(alone.tokens) == 20
    assert EOS not in alone.tokens
    spec = Engine(
        FakeModel(rule), FakeModel(rule, seed=1), SpecConfig(mode="draft", draft_p_min=0.0)
    ).run(PROMPT, max_tokens=20, params=params)
    assert spec.tokens == alone.tokens


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_probabilities_come_from_the_verified_row(temp: float) -> None:
    params = replace(PENAL, temp=temp, n_probs=3, seed=7)
    alone = _engine("none").run(PROMPT, max_tokens=30, params=params)
    spec = _engine("draft").run(PROMPT, max_tokens=30, params=params)
    assert alone.probs is not None and spec.probs is not None
    assert [p.token for p in alone.probs] == alone.tokens
    assert [p.token for p in spec.probs] == spec.tokens
    for p in spec.probs:
        assert len(p.top) == 3 and p.logprob <= 0.0
        assert sum(math.exp(lp) for _, lp in p.top) <= 1.0 + 1e-9
        if temp == 0.0:
            assert p.top[0][0] == p.token  # greedy: the row's best
    if temp == 0.0:  # the same tokens from the same rows: the same numbers
        assert spec.tokens == alone.tokens
        for a, b in zip(alone.probs, spec.probs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
    post = _engine("draft").run(
        PROMPT, max_tokens=10, params=replace(params, post_sampling_probs=True)
    )
    assert post.probs is not None
    for p in post.probs:
        assert p.logprob > -math.inf  # a sampled token had mass in the sampled distribution
    none = _engine("draft").run(PROMPT, max_tokens=5, params=replace(params, n_probs=-1))
    assert none.probs is None


# -- sampling stays exact ------------------------------------------------------------------------
N_RUNS = 2000
ALPHA = 1e-4
A = text_tokens("a")[0]
# The target prefers "a" everywhere (~35% of the mass at peak 4 over 63 N(0,1) rivals); the
# penalties make a second "a" far less likely; the bias moves mass onto "z" and forbids "q".
WIDE = SamplingParams(
    temp=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    frequency_penalty=1.5,
    presence_penalty=0.5,
    repeat_penalty=1.2,
    logit_bias=((text_tokens("z")[0], 2.0), (text_tokens("q")[0], -math.inf)),
)
SAMPLE_PROMPT = [1, *text_tokens("hello there")]


def _always_a(ctx) -> int:
    return A


def _first_two(mode: str, seeds: range) -> list[tuple[int, ...]]:
    target = FakeModel(_always_a, peak=4.0)
    draft = FakeModel(_always_a, peak=5.0, seed=5)  # surer of "a" than the target: q != p
    eng = Engine(
        target,
        draft if mode == "draft" else None,
        SpecConfig(mode=mode, draft_max=4, draft_p_min=0.0),
    )
    out = []
    for seed in seeds:
        r = eng.run(
            SAMPLE_PROMPT,
            max_tokens=2,
            params=replace(WIDE, seed=seed),
            first_token_first=False,
        )
        out.append(tuple(r.tokens))
    return out


@pytest.fixture(scope="module")
def baseline() -> list[tuple[int, ...]]:
    return _first_two("none", range(10_000, 10_000 + N_RUNS))


def _compare(got, want) -> dict[str, tuple[float, int, float]]:
    return {
        "pair": two_sample_chi2(got, want, coarsen=lambda k: (k[:1], "*")),
        "first": two_sample_chi2([g[:1] for g in got], [w[:1] for w in want]),
    }


def test_sampled_speculation_keeps_the_penalised_distribution(baseline) -> None:
    got = _first_two("draft", range(N_RUNS))
    assert (A, A) in set(got) and text_tokens("q")[0] not in {t for g in got for t in g}
    for what, (stat, df, p) in _compare(got, baseline).items():
        assert df >= 10 and p > ALPHA, f"{what}: chi2={stat:.1f} df={df} p={p:.2e}"


def test_the_test_sees_a_row_penalised_without_the_drafts_before_it(
    baseline, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Power: row 1 penalised with the history before the pass only (its draft forgotten).
    monkeypatch.setattr(P.RowTransform, "push", lambda self, token: None)
    got = _first_two("draft", range(N_RUNS))
    _, _, p = _compare(got, baseline)["pair"]
    assert p < ALPHA, p


def test_the_test_sees_the_penalties_left_out(baseline) -> None:
    global WIDE
    keep = WIDE
    try:
        WIDE = replace(keep, frequency_penalty=0.0, presence_penalty=0.0, repeat_penalty=1.0)
        got = _first_two("draft", range(N_RUNS))
    finally:
        WIDE = keep
    _, _, p = _compare(got, baseline)["pair"]
    assert p < ALPHA, p
