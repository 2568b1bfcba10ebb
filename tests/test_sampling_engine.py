"""Sampled speculation on the real SmolLM2 pair is lossless: what ``--mode draft`` emits has the
target's distribution, measured, and the measurement has the power to tell a different model apart.

Design of the statistical tests (numbers from the models, temp 0.9 / top-k 50 / top-p 0.95 /
min-p 0, chat-templated "Name an animal."):
- The first token is genuinely uncertain (entropy ~2.4 nats over ~35 tokens; the first two
  tokens together ~4.8 nats), and the Q4_0 draft disagrees with the F32 target enough (first-token
  total variation ~0.30, so ~70% of drafts are accepted) that both branches of the rule -- accept,
  and resample from the residual -- are exercised hundreds of times.
- max_tokens=2 with draft_max 4 makes the engine draft exactly one token per completion, so the
  first token comes out of the accept/residual step and the second either as the bonus token (row
  1 of the same target pass) or from a fresh pass after the rollback.
- Statistic: a two-sample chi-square on the *pair* (t1, t2), with rare pairs pooled
  hierarchically -- into (t1, *) first, then "other" -- so every cell expects >= 5. The pair
  catches a wrong second token (bonus from the wrong row, a stale cache after the rollback) that the
  first-token marginal cannot see; the hierarchical pooling keeps most of the first-token
  information. The first-token marginal is tested as well, because it has the most power against
  a wrong acceptance rule: against "resample from p instead of the residual" the expected power at
  1000 + 1000 completions and p < 1e-4 is ~0.99 (marginal) and ~0.91 (pair); against the draft
  model alone (total variation ~0.5 on pairs) it is ~1 for both.
- Pass: p-value > 1e-4 for both statistics. Power check: the same statistics, same sizes, on the
  draft model alone against the target, must give p-value < 1e-4.
Seeds 0..999 for the speculative runs and the draft alone, 10000..10999 for the target alone.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace

import numpy as np
import pytest
from test_sampling import chi2_sf  # tests/ is on sys.path (rootdir conftest, prepend import mode)

from specrun.chat_template import encode_chat
from specrun.decoding import sampling as S
from specrun.decoding.engine import Engine, SpecConfig
from specrun.decoding.sampling import SamplingParams

pytestmark = [pytest.mark.models, pytest.mark.slow]

ALPHA = 1e-4
N_RUNS = 1000
WIDE = SamplingParams(temp=0.9, top_k=50, top_p=0.95, min_p=0.0)
QUESTION = "Name an animal."
SPEC_SEEDS = range(0, N_RUNS)
BASE_SEEDS = range(10_000, 10_000 + N_RUNS)


def chat(model, text: str) -> list[int]:
    return encode_chat(model, [{"role": "user", "content": text}])


def two_sample_chi2(
    a: Sequence[Hashable],
    b: Sequence[Hashable],
    coarsen: Callable[[Hashable], Hashable] = lambda k: k,
    min_expected: float = 5.0,
) -> tuple[float, int, float]:
    """Two-sample chi-square homogeneity test over categorical samples: (statistic, df, p).

    A category whose pooled count gives an expected count < ``min_expected`` in either sample is
    moved to ``coarsen(category)``; what is still too rare goes to "other"; an "other" that is
    still too rare joins the smallest remaining cell.
    """
    na, nb = len(a), len(b)
    share = min(na, nb) / (na + nb)  # expected count in the smaller sample per pooled count
    ca, cb = Counter(a), Counter(b)

    def pool(
        ca: Counter, cb: Counter, key: Callable[[Hashable], Hashable]
    ) -> tuple[Counter, Counter]:
        oa, ob = Counter(), Counter()
        for k in set(ca) | set(cb):
            dst = k if (ca[k] + cb[k]) * share >= min_expected else key(k)
            oa[dst] += ca[k]
            ob[dst] += cb[k]
        return oa, ob

    ca, cb = pool(ca, cb, coarsen)
    ca, cb = pool(ca, cb, lambda k: "other")
    cells = sorted(set(ca) | set(cb), key=lambda k: ca[k] + cb[k])
    if len(cells) > 1 and (ca[cells[0]] + cb[cells[0]]) * share < min_expected:
        small = cells.pop(0)
        ca[cells[0]] += ca.pop(small)
        cb[cells[0]] += cb.pop(small)
    if len(cells) < 2:
        return 0.0, 0, 1.0
    obs = np.array([[ca[k] for k in cells], [cb[k] for k in cells]], dtype=np.float64)
    exp = obs.sum(axis=1, keepdims=True) * obs.sum(axis=0, keepdims=True) / obs.sum()
    stat = float(np.sum((obs - exp) ** 2 / exp))
    df = len(cells) - 1
    return stat, df, chi2_sf(stat, df)


def first_two(
    engine: Engine, prompt: list[int], seeds: range, grammar: Callable[[], object] | None = None
) -> tuple[list[tuple[int, ...]], list]:
    """The first two tokens of one completion per seed; the prompt stays in the cache.
    ``grammar``: a fresh constraint per completion."""
    engine.reset()  # the fixtures' models are shared with other engines and modules
    pairs, stats = [], []
    for seed in seeds:
        # The first position drafted (not the engine's plain first pass, which serves time to
        # first token): p and q there are first_dists'.
        r = engine.run(
            prompt,
            max_tokens=2,
            params=replace(WIDE, seed=seed),
            reuse_cache=True,
            first_token_first=False,
            constraint=grammar() if grammar is not None else None,  # type: ignore[arg-type]
        )
        pairs.append(tuple(r.tokens))  # shorter than 2 only after an end-of-generation token
        stats.append(r.stats)
    return pairs, stats


def compare(name: str, got: list[tuple[int, ...]], want: list[tuple[int, ...]]) -> dict[str, tuple]:
    out = {
        "pair": two_sample_chi2(got, want, coarsen=lambda k: (k[:1], "*")),
        "first": two_sample_chi2([g[:1] for g in got], [w[:1] for w in want]),
    }
    for what, (stat, df, p) in out.items():
        print(f"[{name}] {what}: chi2={stat:.1f} df={df} p={p:.3g}")
    return out


@pytest.fixture(scope="module")
def prompt(smol_target):
    return chat(smol_target, QUESTION)


@pytest.fixture(scope="module")
def first_dists(smol_target, smol_draft, prompt):
    """p and q of the first token, straight from the models (for the expected acceptance)."""
    out = []
    for m in (smol_target, smol_draft):
        m.clear()
        m.decode(prompt, 0, logits_from=len(prompt) - 1)
        out.append(S.transform(m.logits(-1).copy(), WIDE))
        m.clear()
    return out


@pytest.fixture(scope="module")
def baseline(smol_target, prompt):
    pairs, _ = first_two(Engine(smol_target, None, SpecConfig(mode="none")), prompt, BASE_SEEDS)
    return pairs


def test_prompt_is_uncertain(first_dists):
    p, q = first_dists
    entropy = float(-(p.probs * np.log(p.probs)).sum())
    assert entropy > 1.5, entropy
    assert p.probs[0] < 0.6
    tv = 0.5 * sum(abs(p.prob(t) - q.prob(t)) for t in set(p.ids.tolist()) | set(q.ids.tolist()))
    assert 0.1 < tv < 0.6, tv  # the draft differs: both branches of the rule get exercised


def test_rejection_sampling_matches_target(smol_target, smol_draft, prompt, baseline, first_dists):
    engine = Engine(
        smol_target,
        smol_draft,
        SpecConfig(mode="draft", draft_max=4, verify="rejection", draft_p_min=0.0),
    )
    got, stats = first_two(engine, prompt, SPEC_SEEDS)
    for what, (stat, df, p) in compare("draft+rejection", got, baseline).items():
        assert df >= 10 and p > ALPHA, f"{what}: chi2={stat:.1f} df={df} p={p:.2e}"
    # One draft token per completion, accepted with probability sum(min(p, q)).
    p1, q1 = first_dists
    assert all(s.drafted == 1 for s in stats)
    accepted = sum(s.accepted for s in stats)
    rate = sum(min(p1.prob(t), q1.prob(t)) for t in set(p1.ids.tolist()) | set(q1.ids.tolist()))
    sd = math.sqrt(rate * (1 - rate) / N_RUNS)
    print(f"[draft+rejection] accepted {accepted}/{N_RUNS}, expected {rate:.3f} +- {sd:.3f}")
    assert abs(accepted / N_RUNS - rate) < 4 * sd


def test_sample_and_match_matches_target(smol_target, smol_draft, prompt, baseline, first_dists):
    engine = Engine(
        smol_target,
        smol_draft,
        SpecConfig(mode="draft", draft_max=4, verify="match", draft_p_min=0.0),
    )
    got, stats = first_two(engine, prompt, SPEC_SEEDS)
    for what, (stat, df, p) in compare("draft+match", got, baseline).items():
        assert df >= 10 and p > ALPHA, f"{what}: chi2={stat:.1f} df={df} p={p:.2e}"
    # The draft proposes its argmax; the target's own sample matches it with probability p(argmax q).
    p1, q1 = first_dists
    rate = p1.prob(int(q1.ids[0]))
    accepted = sum(s.accepted for s in stats)
    sd = math.sqrt(rate * (1 - rate) / N_RUNS)
    print(f"[draft+match] accepted {accepted}/{N_RUNS}, expected {rate:.3f} +- {sd:.3f}")
    assert abs(accepted / N_RUNS - rate) < 4 * sd


def test_the_test_rejects_the_draft_model_alone(smol_draft, prompt, baseline):
    """Power: the draft model sampled alone is a different distribution, and the same statistics on
    the same sample sizes say so."""
    alone = Engine(smol_draft, None, SpecConfig(mode="none"))
    got, _ = first_two(alone, prompt, SPEC_SEEDS)
    for what, (stat, df, p) in compare("draft model alone", got, baseline).items():
        assert p < ALPHA, f"{what}: chi2={stat:.1f} df={df} p={p:.2e} -- the test has no power"


# -- under a grammar -----------------------------------------------------------------------------
# The answer must start with a capital from D to Z: "A", "An", "Cat", "Bear"... are masked out of
# the target's distribution, so the constrained p differs from the free one, and the Q4_0 draft
# (which knows nothing of the grammar) proposes forbidden tokens often: the rule must reject them.
ANIMAL_GBNF = r"""root ::= [D-Z] [a-z]* (" " [a-zA-Z]+)* "."?"""


def test_constrained_rejection_sampling_matches_the_constrained_target(
    smol_target, smol_draft, prompt, baseline
):
    from specrun.llama.grammar import Grammar

    def grammar() -> Grammar:
        return Grammar.compile(smol_target, ANIMAL_GBNF)

    alone = Engine(smol_target, None, SpecConfig(mode="none"))
    want, _ = first_two(alone, prompt, BASE_SEEDS, grammar)
    spec = Engine(
        smol_target,
        smol_draft,
        SpecConfig(mode="draft", draft_max=4, verify="rejection", draft_p_min=0.0),
    )
    got, stats = first_two(spec, prompt, SPEC_SEEDS, grammar)
    first = {smol_target.piece(t[0]).decode(errors="replace")[:1] for t in got + want}
    assert first and all("D" <= c <= "Z" for c in first), first
    for what, (stat, df, p) in compare("constrained draft+rejection", got, want).items():
        assert df >= 5 and p > ALPHA, f"{what}: chi2={stat:.1f} df={df} p={p:.2e}"
    # The constraint bites: the free target's first tokens are another distribution.
    free = compare("free target vs constrained", baseline, want)["first"]
    assert free[2] < ALPHA
    # Drafts were verified and both branches ran: some accepted, many rejected.
    assert all(s.drafted == 1 for s in stats)
    accepted = sum(s.accepted for s in stats)
    assert 50 < accepted < N_RUNS - 50, accepted


# -- reproducibility and the greedy path --------------------------------------------------------
STORY = "Write a short story about a lighthouse keeper."


def test_same_seed_same_tokens_different_seed_different(smol_target, smol_draft):
    engine = Engine(smol_target, smol_draft, SpecConfig(mode="draft", draft_max=4, draft_p_min=0.0))
    engine.reset()
    toks = chat(smol_target, STORY)
    params = SamplingParams(temp=0.8, seed=1234)
    a = engine.run(toks, max_tokens=48, params=params, reuse_cache=False).tokens
    b = engine.run(toks, max_tokens=48, params=params, reuse_cache=False).tokens
    # A warm cache (the prompt kept from the previous run) must not change the draw either.
    c = engine.run(toks, max_tokens=48, params=params, reuse_cache=True).tokens
    assert len(a) > 10
    assert a == b == c
    others = [
        engine.run(toks, max_tokens=48, params=replace(params, seed=s), reuse_cache=True).tokens
        for s in (1235, 99)
    ]
    assert all(o != a for o in others)


@pytest.mark.parametrize("text", ["Explain what a hash table is.", "List five colours."])
def test_temp_zero_is_greedy_and_exact(smol_target, smol_draft, text):
    toks = chat(smol_target, text)
    greedy = SamplingParams(temp=0.0, seed=5)
    spec = Engine(smol_target, smol_draft, SpecConfig(mode="draft", draft_max=4, draft_p_min=0.0))
    spec.reset()
    got = spec.run(toks, max_tokens=64, params=greedy, reuse_cache=False)
    alone = Engine(smol_target, None, SpecConfig(mode="none"))
    alone.reset()
    want = alone.run(toks, max_tokens=64, params=greedy, reuse_cache=False)
    assert got.tokens == want.tokens
    assert got.stats.drafted > 0
