"""Sampling math without a model: the transform against a plain reference of llama.cpp's chain,
and the speculative rule proved lossless twice per (p, q) pair -- exactly (the emitted
distribution, summed over every draft token, equals p to rounding) and by statistics (tokens drawn
through ``speculative_step`` itself pass a chi-square goodness-of-fit against p, and the acceptance
rate sits within 4 sigma of sum(min(p, q))).

Thresholds: every goodness-of-fit test passes at p-value > ALPHA = 1e-4 with a fixed seed; the
chi-square tail is computed here (``chi2_sf``, checked against closed forms below) so the suite
needs no scipy. The same harness is shown to reject a broken rule at the same sample size, so a
pass means something.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from specrun.decoding import sampling as S
from specrun.decoding.sampling import (
    Dist,
    SamplingParams,
    accept_prob,
    greedy,
    residual,
    speculative_step,
    transform,
)

ALPHA = 1e-4  # goodness-of-fit threshold (p-value must exceed it)
N_DRAWS = 4000  # speculative_step calls per pair: ~50 us each keeps the file well under 10 s
SIGMAS = 4.0


# -- chi-square tail, no scipy ------------------------------------------------------------------
def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2).

    Series for P when x/2 < df/2 + 1, Lentz's continued fraction for Q otherwise (Numerical
    Recipes 6.2); the continued fraction keeps tiny tails accurate.
    """
    if df <= 0:
        raise ValueError("df must be positive")
    if x <= 0.0:
        return 1.0
    a, z = df / 2.0, x / 2.0
    log_front = a * math.log(z) - z - math.lgamma(a)
    if z < a + 1.0:
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1.0
            term *= z / n
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = z + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return math.exp(log_front) * h


def gof(
    counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0
) -> tuple[float, int, float]:
    """Chi-square goodness of fit of ``counts`` to ``probs``: (statistic, df, p-value).

    Cells with expected count < ``min_expected`` are pooled (smallest first) until every cell
    reaches it, which keeps the chi-square approximation valid.
    """
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.sum()
    exp = np.asarray(probs, dtype=np.float64) * n
    order = np.argsort(exp)
    exp, counts = list(exp[order]), list(counts[order])
    while len(exp) > 1 and exp[0] < min_expected:
        e, c = exp.pop(0), counts.pop(0)
        exp[0] += e
        counts[0] += c
        idx = int(np.argsort(exp, kind="stable")[0])  # keep the smallest cell first
        exp.insert(0, exp.pop(idx))
        counts.insert(0, counts.pop(idx))
    if len(exp) < 2:
        return 0.0, 0, 1.0
    e, c = np.array(exp), np.array(counts)
    stat = float(np.sum((c - e) ** 2 / e))
    df = len(e) - 1
    return stat, df, chi2_sf(stat, df)


@pytest.mark.parametrize("x", [0.01, 0.5, 1.0, 3.0, 10.0, 40.0, 120.0])
def test_chi2_sf_closed_forms(x):
    assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9, abs=1e-300)
    assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9, abs=1e-300)
    assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize(
    "x, df, p",
    # Critical values from the standard chi-square table.
    [
        (3.841, 1, 0.05),
        (15.137, 1, 1e-4),
        (18.307, 10, 0.05),
        (43.773, 30, 0.05),
        (124.342, 100, 0.05),
        (6.635, 1, 0.01),
    ],
)
def test_chi2_sf_table(x, df, p):
    assert chi2_sf(x, df) == pytest.approx(p, rel=2e-3)


# -- building distributions ---------------------------------------------------------------------
def mk(mass: dict[int, float]) -> Dist:
    """A Dist from {token: mass}, normalized and sorted as transform() sorts it."""
    ids = np.array(list(mass), dtype=np.int64)
    probs = np.array(list(mass.values()), dtype=np.float64)
    keep = probs > 0
    ids, probs = ids[keep], probs[keep] / probs[keep].sum()
    order = np.argsort(-probs, kind="stable")
    return Dist(ids[order], probs[order])


def dirichlet(rng: np.random.Generator, ids: range | list[int], conc: float) -> Dist:
    probs = rng.dirichlet(np.full(len(ids), conc))
    probs = np.maximum(probs, 1e-9)  # a Dist holds positive masses only
    return mk(dict(zip(ids, probs, strict=True)))


def _pairs() -> dict[str, tuple[Dist, Dist]]:
    rng = np.random.default_rng(20240601)
    d10 = dirichlet(rng, range(10), 1.0)
    pairs = {
        "disjoint": (mk({0: 0.5, 1: 0.3, 2: 0.2}), mk({3: 0.6, 4: 0.4})),
        "q_equals_p": (d10, d10),
        "onehot_p": (mk({5: 1.0}), dirichlet(rng, range(10), 1.0)),
        "onehot_q": (dirichlet(rng, range(10), 1.0), mk({2: 1.0})),
        "onehot_q_outside_p": (mk({0: 0.7, 1: 0.3}), mk({9: 1.0})),
        "onehot_both_same": (mk({4: 1.0}), mk({4: 1.0})),
        "onehot_both_differ": (mk({4: 1.0}), mk({7: 1.0})),
        "q_heavy_where_p_light": (mk({0: 0.9, 1: 0.05, 2: 0.05}), mk({0: 0.02, 1: 0.49, 2: 0.49})),
        "partial_overlap": (dirichlet(rng, range(0, 6), 1.0), dirichlet(rng, range(3, 10), 1.0)),
        "q_superset": (dirichlet(rng, range(0, 4), 1.0), dirichlet(rng, range(0, 12), 1.0)),
        "p_superset": (dirichlet(rng, range(0, 12), 1.0), dirichlet(rng, range(0, 4), 1.0)),
        "flat_vs_peaked": (
            mk(dict.fromkeys(range(8), 1.0)),
            mk({0: 0.93, **dict.fromkeys(range(1, 8), 0.01)}),
        ),
        "peaked_vs_flat": (
            mk({0: 0.93, **dict.fromkeys(range(1, 8), 0.01)}),
            mk(dict.fromkeys(range(8), 1.0)),
        ),
        "tiny_masses": (
            mk({0: 0.6, 1: 0.4 - 3e-4, 2: 1e-4, 3: 1e-4, 4: 1e-4}),
            mk({0: 0.2, 1: 0.2, 2: 0.2, 3: 0.2, 4: 0.2}),
        ),
        "nearly_equal": (mk({0: 0.5, 1: 0.3, 2: 0.2}), mk({0: 0.5 + 1e-9, 1: 0.3, 2: 0.2 - 1e-9})),
    }
    for n, conc, shift in [
        (2, 1.0, 0),
        (3, 0.5, 1),
        (5, 1.0, 0),
        (8, 0.3, 0),
        (16, 1.0, 4),
        (16, 0.3, 0),
        (40, 0.5, 10),
        (64, 1.0, 0),
        (64, 0.2, 32),
    ]:
        p = dirichlet(rng, range(n), conc)
        q = dirichlet(rng, range(shift, shift + n), conc)
        pairs[f"dirichlet_n{n}_a{conc}_shift{shift}"] = (p, q)
    return pairs


PAIRS = _pairs()


def support_of(*dists: Dist) -> np.ndarray:
    return np.unique(np.concatenate([d.ids for d in dists]))


def test_enough_pairs():
    assert len(PAIRS) >= 20


# -- the rule, exactly ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PAIRS))
def test_rule_is_exact(name):
    """sum_x q(x) [a(x) 1{y=x} + (1 - a(x)) r_x(y)] == p(y) for every y, and P(accept) ==
    sum(min(p, q)); every residual lives where p > q, proportional to p - q."""
    p, q = PAIRS[name]
    ids = support_of(p, q)
    n = int(ids.max()) + 1
    pd, qd = p.dense(n), q.dense(n)
    emitted = np.zeros(n)
    p_accept = 0.0
    for x, qx in zip(q.ids, q.probs, strict=True):
        a = accept_prob(p, q, int(x))
        assert 0.0 <= a <= 1.0
        p_accept += qx * a
        emitted[x] += qx * a
        if a < 1.0:
            r = residual(p, q, int(x))
            rd = r.dense(n)
            assert np.all(r.probs > 0)
            assert np.all(pd[r.ids] > qd[r.ids]), "residual sampled where p <= q"
            want = np.maximum(pd - qd, 0.0)
            np.testing.assert_allclose(rd, want / want.sum(), atol=1e-12)
            emitted += qx * (1.0 - a) * rd
    np.testing.assert_allclose(emitted, pd, atol=1e-12)
    assert p_accept == pytest.approx(np.minimum(pd, qd).sum(), abs=1e-12)


# -- the rule, by statistics through speculative_step --------------------------------------------
def run_steps(
    p: Dist,
    q: Dist | None,
    n: int,
    seed: int,
    token: int | None = None,
    step: Callable[
        [Dist, Dist | None, int, np.random.Generator], tuple[bool, int]
    ] = speculative_step,
) -> tuple[dict[int, int], int]:
    """n draws: x ~ q (or the fixed ``token`` when q is None), then ``step``; (counts, accepted)."""
    rng = np.random.default_rng(seed)
    if q is None:
        xs = np.full(n, token, dtype=np.int64)
    else:
        xs = rng.choice(q.ids, size=n, p=q.probs)
    counts: dict[int, int] = {}
    accepted = 0
    for x in xs.tolist():
        ok, y = step(p, q, x, rng)
        accepted += ok
        counts[y] = counts.get(y, 0) + 1
    return counts, accepted


def check_emitted_like_p(p: Dist, counts: dict[int, int]) -> tuple[float, int, float]:
    outside = {t: c for t, c in counts.items() if p.prob(t) == 0.0}
    assert not outside, f"emitted tokens outside p's support: {outside}"
    obs = np.array([counts.get(int(t), 0) for t in p.ids])
    return gof(obs, p.probs)


def within_sigmas(k: int, n: int, rate: float) -> bool:
    sd = math.sqrt(max(rate * (1.0 - rate), 0.0) / n)
    return abs(k / n - rate) <= SIGMAS * sd + 1e-12


@pytest.mark.parametrize("name", list(PAIRS))
def test_speculative_step_emits_p(name):
    p, q = PAIRS[name]
    seed = sum(map(ord, name))
    counts, accepted = run_steps(p, q, N_DRAWS, seed)
    stat, df, pval = check_emitted_like_p(p, counts)
    assert pval > ALPHA, f"{name}: chi2={stat:.1f} df={df} p={pval:.2e}"
    ids = support_of(p, q)
    n = int(ids.max()) + 1
    rate = float(np.minimum(p.dense(n), q.dense(n)).sum())
    assert within_sigmas(accepted, N_DRAWS, rate), (
        f"{name}: accepted {accepted}/{N_DRAWS}, expected {rate:.4f}"
    )


DETERMINISTIC = {
    # (p, proposed token): q is one-hot at the token (prompt lookup), passed as q=None
    "top_token": (PAIRS["dirichlet_n8_a0.3_shift0"][0], None),
    "rare_token": (mk({0: 0.85, 1: 0.1, 2: 0.05}), 2),
    "outside_p": (mk({0: 0.6, 1: 0.4}), 7),
    "onehot_p_same": (mk({3: 1.0}), 3),
    "onehot_p_other": (mk({3: 1.0}), 4),
    "wide": (PAIRS["dirichlet_n64_a1.0_shift0"][0], 17),
}


@pytest.mark.parametrize("name", list(DETERMINISTIC))
def test_deterministic_proposal_emits_p(name):
    p, token = DETERMINISTIC[name]
    if token is None:
        token = int(p.ids[0])
    counts, accepted = run_steps(p, None, N_DRAWS, seed=len(name), token=token)
    stat, df, pval = check_emitted_like_p(p, counts)
    assert pval > ALPHA, f"{name}: chi2={stat:.1f} df={df} p={pval:.2e}"
    assert accept_prob(p, None, token) == pytest.approx(p.prob(token))
    assert within_sigmas(accepted, N_DRAWS, p.prob(token))
    r = residual(p, None, token)
    if p.prob(token) < 1.0:
        assert token not in r.ids.tolist()
        np.testing.assert_allclose(r.probs.sum(), 1.0)


def test_harness_rejects_a_broken_rule():
    """The same sample size and threshold catch a plausible bug: resampling from p (instead of the
    residual) after a rejection, and emitting the draft token unconditionally."""
    p, q = PAIRS["q_heavy_where_p_light"]

    def resample_from_p(p, q, x, rng):
        if rng.random() < accept_prob(p, q, x):
            return True, x
        return False, p.sample(rng)

    def always_accept(p, q, x, rng):
        return True, x

    for broken in (resample_from_p, always_accept):
        counts, _ = run_steps(p, q, N_DRAWS, seed=1, step=broken)
        _, _, pval = gof(np.array([counts.get(int(t), 0) for t in p.ids]), p.probs)
        assert pval < ALPHA, broken.__name__


def test_q_equal_p_always_accepts():
    p, q = PAIRS["q_equals_p"]
    counts, accepted = run_steps(p, q, 500, seed=3)
    assert accepted == 500


def test_disjoint_never_accepts():
    p, q = PAIRS["disjoint"]
    counts, accepted = run_steps(p, q, 500, seed=4)
    assert accepted == 0
    assert set(counts) <= set(p.ids.tolist())


# -- transform against a plain reference of llama.cpp's chain ------------------------------------
def ref_chain(
    logits: list[float], top_k: int, top_p: float, min_p: float, temp: float
) -> dict[int, float]:
    """llama.cpp's default chain written the obvious way: top-k -> top-p -> min-p -> temp -> dist.

    top-p keeps the smallest prefix (by decreasing probability) whose cumulative mass reaches
    top_p, the crossing token included; min-p keeps p_i >= min_p * p_max; both see the softmax of
    the untempered logits of what survived the previous step; temperature only shapes the final
    softmax. top_k = 0, top_p = 1 and min_p = 0 disable their step.
    """

    def softmax(xs: list[float]) -> list[float]:
        m = max(xs)
        e = [math.exp(x - m) for x in xs]
        s = sum(e)
        return [v / s for v in e]

    cand = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k > 0:
        cand = cand[:top_k]
    if top_p < 1.0:
        cum = 0.0
        for j, pj in enumerate(softmax([logits[i] for i in cand])):
            cum += pj
            if cum >= top_p:
                cand = cand[: j + 1]
                break
    if min_p > 0.0:
        ps = softmax([logits[i] for i in cand])
        pmax = max(ps)
        cand = [i for i, pi in zip(cand, ps, strict=True) if pi >= min_p * pmax]
    final = softmax([logits[i] / temp for i in cand])
    return dict(zip(cand, final, strict=True))


def as_map(d: Dist) -> dict[int, float]:
    return dict(zip(d.ids.tolist(), d.probs.tolist(), strict=True))


def assert_same(d: Dist, ref: dict[int, float]) -> None:
    got = as_map(d)
    assert set(got) == set(ref)
    for t, v in ref.items():
        assert got[t] == pytest.approx(v, abs=1e-12)
    assert np.all(np.diff(d.probs) <= 1e-15), "ids must be sorted by decreasing probability"
    assert d.probs.sum() == pytest.approx(1.0, abs=1e-12)


def test_transform_matches_reference_on_random_arrays():
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(400):
        n = int(rng.integers(2, 14))
        logits = (rng.normal(size=n) * rng.choice([0.5, 2.0, 5.0])).astype(np.float32)
        params = SamplingParams(
            temp=float(rng.choice([0.1, 0.5, 0.8, 1.0, 1.7, 5.0])),
            top_k=int(rng.choice([0, 1, 2, 3, 5, 40])),
            top_p=float(rng.choice([1.0, 0.95, 0.8, 0.5, 0.2])),
            min_p=float(rng.choice([0.0, 0.05, 0.1, 0.3, 0.7])),
        )
        ref = ref_chain(
            logits.astype(np.float64).tolist(),
            params.top_k,
            params.top_p,
            params.min_p,
            params.temp,
        )
        assert_same(transform(logits, params), ref)
        checked += 1
    assert checked == 400


def test_transform_large_vocab_matches_reference():
    rng = np.random.default_rng(11)
    logits = (rng.normal(size=50_000) * 3).astype(np.float32)
    for params in (
        SamplingParams(temp=0.8, top_k=40, top_p=0.95, min_p=0.05),
        SamplingParams(temp=0.9, top_k=50, top_p=0.95, min_p=0.0),
        SamplingParams(temp=1.3, top_k=0, top_p=0.5, min_p=0.0),
        SamplingParams(temp=0.7, top_k=0, top_p=1.0, min_p=0.2),
    ):
        ref = ref_chain(
            logits.astype(np.float64).tolist(),
            params.top_k,
            params.top_p,
            params.min_p,
            params.temp,
        )
        assert_same(transform(logits, params), ref)


def logits_of(probs: list[float]) -> np.ndarray:
    return np.log(np.array(probs, dtype=np.float64))


def test_top_k_keeps_the_k_largest():
    d = transform(
        np.array([1.0, 5.0, 3.0, 4.0, 2.0]), SamplingParams(temp=1.0, top_k=2, top_p=1.0, min_p=0.0)
    )
    assert d.ids.tolist() == [1, 3]
    np.testing.assert_allclose(d.probs, [math.e / (math.e + 1), 1 / (math.e + 1)])


@pytest.mark.parametrize("top_p, kept", [(0.45, 1), (0.75, 2), (0.85, 3), (0.999, 4)])
def test_top_p_includes_the_crossing_token(top_p, kept):
    # masses 0.5, 0.3, 0.15, 0.05: cumulative 0.5, 0.8, 0.95, 1.0
    d = transform(
        logits_of([0.3, 0.5, 0.05, 0.15]), SamplingParams(temp=1.0, top_k=0, top_p=top_p, min_p=0.0)
    )
    assert d.ids.tolist() == [1, 0, 3, 2][:kept]


def test_min_p_is_relative_to_the_max():
    # p_max = 0.5, min_p = 0.25: threshold 0.125 keeps 0.15 (an absolute 0.25 would drop it)
    d = transform(
        logits_of([0.5, 0.3, 0.15, 0.05]), SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.25)
    )
    assert d.ids.tolist() == [0, 1, 2]
    np.testing.assert_allclose(d.probs, np.array([0.5, 0.3, 0.15]) / 0.95)


@pytest.mark.parametrize("temp", [0.1, 0.5, 1.0, 3.0, 10.0])
def test_temperature_is_applied_last(temp):
    """top-p and min-p select on the untempered distribution whatever the temperature; the
    temperature then reshapes only the survivors."""
    base = [0.5, 0.3, 0.15, 0.05]
    d = transform(logits_of(base), SamplingParams(temp=temp, top_k=0, top_p=0.75, min_p=0.0))
    assert d.ids.tolist() == [0, 1]
    w = np.array(base[:2]) ** (1.0 / temp)
    np.testing.assert_allclose(d.probs, w / w.sum())
    d = transform(logits_of(base), SamplingParams(temp=temp, top_k=0, top_p=1.0, min_p=0.2))
    assert d.ids.tolist() == [0, 1, 2]


def test_disabled_steps_keep_everything():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=30)
    for params in (
        SamplingParams(temp=0.7, top_k=0, top_p=1.0, min_p=0.0),
        SamplingParams(temp=0.7, top_k=30, top_p=1.0, min_p=0.0),
        SamplingParams(temp=0.7, top_k=1000, top_p=1.0, min_p=0.0),
    ):
        d = transform(logits, params)
        assert d.ids.size == 30
        want = np.exp(logits / 0.7 - np.max(logits / 0.7))
        np.testing.assert_allclose(d.dense(30), want / want.sum(), atol=1e-12)


def test_greedy_is_argmax_first_on_ties():
    assert greedy(np.array([0.1, 3.0, 3.0, -1.0], dtype=np.float32)) == 1


# -- Dist.sample ---------------------------------------------------------------------------------
def test_sample_is_reproducible_for_a_seed():
    d = PAIRS["dirichlet_n64_a1.0_shift0"][0]
    r1, r2, r3 = (np.random.default_rng(s) for s in (99, 99, 100))
    s1 = [d.sample(r1) for _ in range(500)]
    s2 = [d.sample(r2) for _ in range(500)]
    s3 = [d.sample(r3) for _ in range(500)]
    assert s1 == s2
    assert s1 != s3


def test_sample_matches_probs():
    d = PAIRS["dirichlet_n16_a0.3_shift0"][0]
    rng = np.random.default_rng(8)
    counts: dict[int, int] = {}
    for _ in range(20_000):
        t = d.sample(rng)
        counts[t] = counts.get(t, 0) + 1
    stat, df, pval = check_emitted_like_p(d, counts)
    assert pval > ALPHA, f"chi2={stat:.1f} df={df} p={pval:.2e}"


# -- the draft's stop rule, fast ---------------------------------------------------------------
@pytest.mark.parametrize("in_c", [False, True], ids=["numpy", "native"])
def test_top_prob_below_agrees_with_the_exact_softmax(in_c: bool):
    """top_prob_below (counts and a 16-nat window) answers as top_prob(...) < p_min does, on flat,
    peaked and in-between logits over a real-sized vocabulary, away from a 1% band around p_min;
    in numpy and in C (the build's specrun_top_prob, patches/), on lengths that are not whole
    blocks of its SIMD loops too."""
    from specrun.llama import native

    f = native.top_prob() if in_c else None
    if in_c:
        assert f is not None, "this build of llama.cpp lacks specrun_top_prob (patches/)"
    rng = np.random.default_rng(7)
    checked = 0
    for trial in range(400):
        n = int(rng.choice([1, 7, 31, 33, 1000, 49152, 151936, 262144]))
        logits = (rng.standard_normal(n) * rng.uniform(0.5, 4)).astype(np.float32)
        top = int(rng.integers(n))
        logits[top] += np.float32(rng.uniform(0, 30))
        exact = S.top_prob(logits)
        if f is not None:
            assert f(logits) == pytest.approx(exact, rel=1e-4, abs=n * math.exp(-16)), (trial, n)
        for p_min in (0.05, 0.3, 0.6, 0.9, 0.99):
            if abs(exact - p_min) < 0.01 * p_min:
                continue
            assert S.top_prob_below(logits, p_min, f) == (exact < p_min), (trial, n, p_min, exact)
            checked += 1
    assert checked > 1500
    one_hot = np.full(49152, -1e9, dtype=np.float32)
    one_hot[5] = 0.0
    assert not S.top_prob_below(one_hot, 0.999, f) and S.top_prob_below(one_hot, 1.0, f)
    assert not S.top_prob_below(np.zeros(10, np.float32), 0.0, f)
    if f is not None:
        assert f(np.zeros(1000, np.float32)) == pytest.approx(1e-3)  # a tie: 1 / n
        assert f(one_hot) == 1.0
