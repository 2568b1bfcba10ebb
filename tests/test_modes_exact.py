"""The draft-less and adaptive modes say exactly what the target says.

Greedy: ``lookup``, ``hybrid`` and ``auto`` (and ``draft``, for reference) emit the tokens of
``--mode none`` on both real pairs, on prompts where prompt lookup fires (a code edit of given
code, quoting and summarising a given passage, a repetitive list) and one where it seldom does (a
story), for several lookup settings and draft lengths, and with a persistent n-gram cache reused
across runs. Equality only means something if lookup drafted: each configuration must show lookup
tokens proposed and accepted, a pass rejected at the first position and a pass accepted whole.
The Gemma pair costs about twice as much per token and runs the lighter part of the matrix.

Sampled: prompt lookup at temp 1 gives the first two tokens the target's own joint distribution
(chi-square against probabilities computed from the target's logits), and the same check rejects
two wrong acceptance rules; see the second half of the file.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import pytest
from conftest import assert_same_as_target
from test_engine_exact import GREEDY, steps_of  # tests/ is on sys.path (rootdir conftest)
from test_sampling import gof

from specrun.decoding import sampling as S
from specrun.decoding.engine import Engine, SpecConfig
from specrun.decoding.lookup import PromptLookup
from specrun.decoding.sampling import SamplingParams

pytestmark = pytest.mark.models

N = 40  # tokens per greedy run: enough to leave the prompt's echo, short enough for 2 cores

SNIPPET = '''def total_price(items, tax_rate):
    """Return the price of all items, tax included."""
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
PASSAGE = (
    "The Great Barrier Reef is the world's largest coral reef system, made of over 2,900 "
    "individual reefs and 900 islands stretching over 2,300 kilometres off the coast of "
    "Queensland, Australia. The reef is built by billions of tiny organisms known as coral "
    "polyps. It was selected as a World Heritage Site in 1981."
)
# Plain completions, not chat turns: the Gemma 3 270M target is a base model with no chat
# template, and the same text then drives both pairs.
PROMPTS = {
    "code-edit": "# The same function with `subtotal` renamed to `net`.\n\n# Before:\n"
    + SNIPPET
    + "\n# After:\n",
    "quote": PASSAGE + '\n\nThe first sentence of the text above, quoted exactly:\n"',
    "list": "Step 1: check the valve and record the pressure.\n"
    "Step 2: check the valve and record the pressure.\nStep 3:",
    # Lookup proposes here (1-grams match) but the target seldom agrees: ~1 in 36 accepted.
    "story": "Once upon a time, in a village by the sea, there lived an old lighthouse keeper named",
}
GROUNDED = ("code-edit", "quote", "list")  # where the answer repeats the prompt or itself
ALL = (*GROUNDED, "story")


@pytest.fixture(scope="module")
def prompts(pairs):
    return {
        (name, key): target.tokenize(text, add_special=True)
        for name, (target, _) in pairs.items()
        for key, text in PROMPTS.items()
    }


@pytest.fixture(scope="module")
def baselines(pairs, prompts):
    """--mode none on every (pair, prompt): what the target alone says."""
    out = {}
    for (name, key), toks in prompts.items():
        alone = Engine(pairs[name][0], None, SpecConfig(mode="none"))
        out[name, key] = alone.run(toks, max_tokens=N, params=GREEDY, reuse_cache=False)
    return out


@dataclass
class LookupUse:
    """What the lookup drafter did, from the engine's per-pass events."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected_first: int = 0  # passes whose first lookup token was rejected
    whole: int = 0  # passes that accepted every lookup token (K >= 1)
    whole_long: int = 0  # ... of at least two tokens

    def add(self, steps) -> None:
        for s in steps:
            if s.drafter != "lookup" or s.k == 0:
                continue
            self.passes += 1
            self.drafted += s.k
            self.accepted += s.accepted
            self.rejected_first += s.accepted == 0
            self.whole += s.accepted == s.k
            self.whole_long += s.accepted == s.k >= 2


BOTH, SMOL = ("smollm2", "gemma3"), ("smollm2",)
CONFIGS = [  # id, mode, lookup_min, lookup_max, draft_max, with the pair's draft model, prompts, pairs
    ("lookup-1:4-K1", "lookup", 1, 4, 1, False, ("code-edit", "list"), BOTH),
    ("lookup-1:4-K3", "lookup", 1, 4, 3, False, ALL, BOTH),
    ("lookup-2:2-K8", "lookup", 2, 2, 8, False, GROUNDED, BOTH),
    ("hybrid-1:4-K3", "hybrid", 1, 4, 3, True, GROUNDED, BOTH),
    ("hybrid-2:2-K8", "hybrid", 2, 2, 8, True, ("code-edit", "quote"), SMOL),
    ("auto-1:4-K8", "auto", 1, 4, 8, True, ALL, SMOL),
    ("auto-1:4-K8", "auto", 1, 4, 8, True, GROUNDED, ("gemma3",)),
    # auto without a draft model chooses between lookup and plain decoding (with one, on the
    # Gemma pair, it drafts with the model throughout and seldom tries lookup)
    ("auto-nodraft-2:2-K3", "auto", 2, 2, 3, False, GROUNDED, BOTH),
    ("draft-K3", "draft", 1, 4, 3, True, ("code-edit",), SMOL),  # test_engine_exact.py has more
]
# The Gemma pair costs twice as much per token: it runs the lighter half of the matrix.
CASES = [
    pytest.param(pair, *cfg[1:-1], id=f"{cfg[0]}-{pair}") for cfg in CONFIGS for pair in cfg[-1]
]


@pytest.mark.parametrize(
    "pair_name, mode, lookup_min, lookup_max, draft_max, with_draft, keys", CASES
)
def test_mode_equals_target_alone(
    pairs, prompts, baselines, pair_name, mode, lookup_min, lookup_max, draft_max, with_draft, keys
):
    target, draft = pairs[pair_name]
    cfg = SpecConfig(
        mode=mode,
        draft_max=draft_max,
        lookup_min=lookup_min,
        lookup_max=lookup_max,
        draft_p_min=0.0,
    )
    engine = Engine(target, draft if with_draft else None, cfg)
    use = LookupUse()
    drafted = 0
    for key in keys:
        steps, got = steps_of(
            engine, prompts[pair_name, key], max_tokens=N, params=GREEDY, reuse_cache=False
        )
        want = baselines[pair_name, key]
        assert_same_as_target(got, want, f"{pair_name}/{key} {cfg}")
        drafted += got.stats.drafted
        use.add(steps)
        print(
            f"[{pair_name} {mode} {lookup_min}:{lookup_max} K={draft_max} {key}] passes "
            f"{got.stats.target_passes} draft steps {got.stats.draft_steps} modes {dict(got.stats.modes_used)}"
        )
    print(f"[{pair_name} {mode} {lookup_min}:{lookup_max} K={draft_max}] {use}")
    assert drafted > 0
    if mode == "draft":
        return
    # Lookup really drafted, and the verify/rollback saw both of its edges.
    assert use.drafted > 0 and use.accepted > 0, use
    assert use.rejected_first > 0, use  # rollback of every draft token
    assert use.whole > 0, use  # nothing to roll back; the bonus token comes from the last row
    if draft_max > 1 and mode != "auto":
        assert use.whole_long > 0, use


def test_persistent_cache_reused_across_runs(pairs, prompts, baselines, tmp_path):
    """Three runs, each a fresh engine that reads the file the previous one saved (as separate
    processes would). The cache proposes a follower seen at least twice (NgramCache.propose's
    min_count), so the first run adds the story's n-grams once, the second makes them count, and
    the third drafts the story from the cache: with 4-grams only, the context itself matches
    nothing in this story. (The cache works on token ids alone: one pair is enough.)"""
    pair_name = "smollm2"
    target, _ = pairs[pair_name]
    n = 32  # a prefix of the baseline: greedy decoding does not look ahead
    path = tmp_path / "ngrams.json"
    cfg = SpecConfig(mode="lookup", draft_max=4, lookup_min=4, lookup_max=4, lookup_cache=str(path))
    toks, want = prompts[pair_name, "story"], baselines[pair_name, "story"].tokens[:n]
    assert len(want) == n
    uses = []
    for run in range(3):
        engine = Engine(target, None, cfg)
        steps, got = steps_of(engine, toks, max_tokens=n, params=GREEDY, reuse_cache=False)
        assert got.tokens == want, f"{pair_name} run {run} with the n-gram cache diverged"
        assert path.exists()
        use = LookupUse()
        use.add(steps)
        uses.append(use)
    print(f"[{pair_name} cache] " + " | ".join(str(u) for u in uses))
    assert uses[0].accepted <= n // 8, uses  # the story seldom repeats itself...
    assert uses[2].accepted >= n // 2, uses  # ...but the cache has seen it twice
    assert uses[2].whole_long > 0, uses


# -- sampled prompt lookup keeps the target's distribution ---------------------------------------
#
# A lookup proposal is one-hot (q = delta at x): the engine accepts x with probability p(x) and,
# on a rejection, samples p with x removed, renormalised. The prompt below makes lookup propose
# two tokens, " door" (the 2-gram " opened the" was followed by it) and " and", where the SmolLM2
# target at temp 1 / top-k 40 gives " door" ~0.59: both branches of the rule fire at position 1,
# and position 2 is reached whenever " door" is accepted. max_tokens=3 with draft_max=2 makes the
# first target pass verify exactly those two tokens.
#
# What is compared: the joint distribution of the first two generated tokens (t1, t2) against the
# target's exact probabilities p(t1) p(t2 | t1) (computed from its logits), by a chi-square
# goodness of fit with rare cells pooled (tests/test_sampling.py's ``gof``), and the acceptance
# counts against p(door) and p(and | door) within 4 sigma. The same statistic must accept --mode
# none (a control of the harness) and reject two wrong rules run through the same engine: always
# accepting the proposal, and resampling from p instead of the residual after a rejection.
#
# Speed: thousands of real-model generations would take minutes on 2 cores, so the target is
# wrapped in ``MemoTarget``, which answers a decode it has already seen (same cache content, same
# batch) with the logits the real model gave for it. Everything else -- Engine.generate, the
# lookup drafter, _verify, sampling.transform / speculative_step / residual -- runs unchanged,
# and a check below shows the wrapped and the bare model give the same tokens seed for seed.

SAMPLED = SamplingParams(temp=1.0, top_k=40, top_p=1.0, min_p=0.0)
LOOKUP_PROMPT = "He opened the door and walked in. She opened the"
N_SAMPLES = 2000
ALPHA = 1e-4


class MemoTarget:
    """A real Model behind a memo of its logits, keyed by (cache content, batch, logits_from).

    Rows that score a position at or past ``horizon`` get zero logits without a real decode:
    the test reads the first two generated tokens only, and the third (which max_tokens=3 makes
    the engine sample) would otherwise need a real decode for nearly every (t1, t2).
    """

    def __init__(self, model, horizon: int) -> None:
        self.model = model
        self.horizon = horizon
        self.held: list[int] = []  # what the engine's cache holds (positions 0..len-1)
        self.real: list[int] = []  # what the real model's cache holds
        self.memo: dict[tuple, np.ndarray | None] = {}
        self.rows: np.ndarray | None = None
        self.row0 = 0
        self.misses = 0

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    @property
    def cached(self) -> list[int]:
        return self.held

    def prefill(self, tokens, pos0: int) -> None:
        self.decode(tokens, pos0)

    def decode(self, tokens, pos0: int, logits_from: int | None = None) -> None:
        if not tokens:
            return
        assert pos0 == len(self.held), (pos0, len(self.held))  # the engine's own bookkeeping
        key = (tuple(self.held), tuple(tokens), logits_from)
        if key not in self.memo:
            if logits_from is not None and pos0 + logits_from + 1 >= self.horizon:
                self.memo[key] = np.zeros(
                    (len(tokens) - logits_from, self.model.n_vocab), np.float32
                )
            else:
                self.memo[key] = self._real_decode(tokens, pos0, logits_from)
        self.rows, self.row0 = self.memo[key], logits_from or 0
        self.held.extend(tokens)

    def _real_decode(self, tokens, pos0: int, logits_from: int | None) -> np.ndarray | None:
        self.misses += 1
        m = self.model
        keep = 0
        while keep < min(len(self.real), len(self.held)) and self.real[keep] == self.held[keep]:
            keep += 1
        m.truncate(keep)
        if keep < len(self.held):
            m.decode(self.held[keep:], keep)
        m.decode(tokens, pos0, logits_from)
        self.real = [*self.held, *tokens]
        if logits_from is None:
            return None
        return np.stack([m.logits(i).copy() for i in range(logits_from, len(tokens))])

    def logits(self, row: int) -> np.ndarray:
        assert self.rows is not None
        return self.rows[row] if row < 0 else self.rows[row - self.row0]

    def truncate(self, n_keep: int) -> None:
        del self.held[n_keep:]

    def clear(self) -> None:
        # Engine.reset: also forget what the real cache holds, since other engines share the model.
        self.held = []
        self.real = []


@pytest.fixture(scope="module")
def lookup_setup(smol_target):
    """The prompt, the lookup proposal, and the target's exact p(t1) and p(t2 | t1)."""
    m = smol_target
    prompt = m.tokenize(LOOKUP_PROMPT, add_special=True)
    lookup = PromptLookup(1, 4)
    lookup.prefill(prompt)
    proposal = lookup.propose(prompt, 2, SAMPLED, np.random.default_rng(0), True).tokens
    m.clear()
    m.decode(prompt, 0, logits_from=len(prompt) - 1)
    p1 = S.transform(m.logits(-1).copy(), SAMPLED)
    p2 = {}
    for t1 in p1.ids.tolist():
        m.truncate(len(prompt))
        m.decode([t1], len(prompt), logits_from=0)
        p2[t1] = S.transform(m.logits(0).copy(), SAMPLED)
    m.clear()
    assert not any(m.is_eog(t) for t in p1.ids.tolist())
    return prompt, proposal, p1, p2


def sample_runs(
    engine: Engine, prompt: list[int], seeds: range
) -> tuple[list[tuple[int, int]], list]:
    """(t1, t2) of one 3-token completion per seed, and the first target pass of each."""
    engine.reset()
    pairs, first = [], []
    for seed in seeds:
        steps, r = steps_of(
            engine, prompt, max_tokens=3, params=replace(SAMPLED, seed=seed), reuse_cache=True
        )
        assert len(r.tokens) >= 2, r.tokens  # no end-of-generation token is in reach
        pairs.append((r.tokens[0], r.tokens[1]))
        first.append(steps[0])
    return pairs, first


def joint_gof(
    pairs: list[tuple[int, int]], p1: S.Dist, p2: dict[int, S.Dist]
) -> tuple[float, int, float]:
    """Chi-square of the observed (t1, t2) pairs against p(t1) p(t2 | t1); a pair the target cannot
    produce fails outright."""
    cells = {
        (int(a), int(b)): float(pa * pb)
        for a, pa in zip(p1.ids, p1.probs, strict=True)
        for b, pb in zip(p2[int(a)].ids, p2[int(a)].probs, strict=True)
    }
    seen = Counter(pairs)
    impossible = set(seen) - set(cells)
    assert not impossible, f"pairs outside the target's support: {impossible}"
    keys = list(cells)
    return gof(np.array([seen[k] for k in keys]), np.array([cells[k] for k in keys]))


def always_accept(p, q, token, rng):
    return True, token


def resample_from_p(p, q, token, rng):
    if rng.random() < S.accept_prob(p, q, token):
        return True, token
    return False, p.sample(rng)


@pytest.fixture(scope="module")
def memo_target(smol_target, lookup_setup):
    return MemoTarget(smol_target, horizon=len(lookup_setup[0]) + 2)


def test_lookup_prompt_is_uncertain(lookup_setup, smol_target):
    prompt, proposal, p1, p2 = lookup_setup
    assert [smol_target.piece(t) for t in proposal] == [b" door", b" and"]
    x1, x2 = proposal
    assert 0.3 < p1.prob(x1) < 0.8, p1.prob(x1)
    assert 0.05 < p2[x1].prob(x2) < 0.95, p2[x1].prob(x2)
    print(
        f"[lookup prompt] p(door)={p1.prob(x1):.3f} p(and|door)={p2[x1].prob(x2):.3f} "
        f"support {p1.ids.size}"
    )


def test_memo_target_is_the_target(smol_target, memo_target, lookup_setup):
    """The memo changes nothing: seed for seed, the same tokens as the bare model."""
    prompt = lookup_setup[0]
    cfg = SpecConfig(mode="lookup", draft_max=2)
    bare, _ = sample_runs(Engine(smol_target, None, cfg), prompt, range(900, 920))
    memo, _ = sample_runs(Engine(memo_target, None, cfg), prompt, range(900, 920))
    assert bare == memo
    assert len(set(bare)) > 3


def test_sampled_lookup_has_the_target_distribution(memo_target, lookup_setup, monkeypatch):
    prompt, (x1, x2), p1, p2 = lookup_setup
    lookup = Engine(memo_target, None, SpecConfig(mode="lookup", draft_max=2))
    alone = Engine(memo_target, None, SpecConfig(mode="none"))
    got, first = sample_runs(lookup, prompt, range(N_SAMPLES))
    control, _ = sample_runs(alone, prompt, range(100_000, 100_000 + N_SAMPLES))

    # Every completion verified the two lookup tokens in its first pass.
    assert all(s.drafter == "lookup" and s.k == 2 for s in first)
    acc1 = sum(s.accepted >= 1 for s in first)
    acc2 = sum(s.accepted == 2 for s in first)
    for what, k, n, p in (
        ("position 1", acc1, N_SAMPLES, p1.prob(x1)),
        ("position 2", acc2, acc1, p2[x1].prob(x2)),
    ):
        sd = math.sqrt(n * p * (1 - p))
        print(f"[sampled lookup] {what}: accepted {k}/{n}, expected {n * p:.1f} +- {sd:.1f}")
        assert abs(k - n * p) < 4 * sd, what
    assert 0 < acc1 < N_SAMPLES and 0 < acc2 < acc1  # both branches at both positions

    results = {"lookup": joint_gof(got, p1, p2), "none (control)": joint_gof(control, p1, p2)}
    for name, rule in (("always accept", always_accept), ("resample from p", resample_from_p)):
        monkeypatch.setattr(S, "speculative_step", rule)
        wrong, _ = sample_runs(lookup, prompt, range(N_SAMPLES))
        results[name] = joint_gof(wrong, p1, p2)
    monkeypatch.undo()
    for name, (stat, df, pv) in results.items():
        print(f"[sampled lookup] {name}: chi2={stat:.1f} df={df} p={pv:.3g} (N={N_SAMPLES})")
    print(f"[sampled lookup] real decodes {memo_target.misses}")
    for name in ("lookup", "none (control)"):
        stat, df, pv = results[name]
        assert df >= 20 and pv > ALPHA, (name, results[name])
    for name in ("always accept", "resample from p"):
        assert results[name][2] < ALPHA, f"{name} passed the test: it has no power {results[name]}"


T1, C_DRAFT = 0.01, 0.2  # a fixed clock for auto: seconds of a target step, a draft row's share


def test_auto_reads_the_targets_sureness_where_the_draft_model_did_not_run(smol_target, smol_draft):
    """auto learns how often the draft model stops from the target's sureness, at the first
    position of every plain and lookup step while a draft model could pay (confidence_p > 0);
    not at a draft model's step (its own stops count there), nor at a step whose draft attempt
    proposed nothing (that stop is counted already: counting the target's doubt at the same
    position too inflated the stop rate)."""
    steps: list[dict] = []
    from specrun.chat_template import encode_chat

    code = encode_chat(
        smol_target,
        [
            {
                "role": "user",
                "content": "Write a Python function `merge_sorted(a, b)` that merges two "
                "sorted lists into one sorted list, with a docstring.",
            }
        ],
    )
    for toks in (
        smol_target.tokenize(PROMPTS["code-edit"], add_special=True),
        smol_target.tokenize(PROMPTS["story"], add_special=True),
        code,
    ):
        engine = Engine(
            smol_target, smol_draft, SpecConfig(mode="auto", draft_max=4, draft_p_min=0.6)
        )
        pol = engine.policy
        # auto's choices on a fixed clock (where the draft model pays: a pass of n rows 1 +
        # 0.15 (n - 1) target steps, a draft row 0.2 of one), so that what it runs depends on
        # the models' tokens only, not on this machine's speeds (on CI's CPU, measured, auto
        # never chose the draft model and the test had no draft steps to check).
        pol.calibrate({n: T1 * (1 + 0.15 * (n - 1)) for n in range(1, 10)}, C_DRAFT * T1)
        orig_draft, orig_obs = pol.draft, pol.observe

        def step() -> dict:
            """The step under way (the last ones of a run skip policy.draft: nothing to draft)."""
            if not steps or steps[-1]["name"] is not None:
                steps.append({"conf": 0, "declined": False, "name": None, "asked": False})
            return steps[-1]

        def draft(*a, orig=orig_draft):
            step()
            return orig(*a)

        def obs(report, orig=orig_obs, pol=pol):
            rows = pol.model.last_catch_up[0]
            pol.model.last_catch_up = (rows, rows * C_DRAFT * T1 * 0.5)  # batched: half a row
            drafted = report.drafter == "draft" or report.declined == "draft"
            report = replace(
                report,
                verify_s=T1 * (1 + 0.15 * report.k),
                draft_s=(C_DRAFT * T1 * (report.k + 1) + pol.model.last_catch_up[1])
                if drafted
                else 0.0,
            )
            s = step()
            s["name"] = report.drafter
            s["conf"] += report.target_sure is not None
            s["declined"] = report.declined is not None
            s["asked"] = pol.confidence_p() > 0.0  # this step's answer (draft() set it)
            orig(report)

        pol.draft, pol.observe = draft, obs
        engine.run(toks, max_tokens=64, params=GREEDY, reuse_cache=False)
    kinds = Counter("declined" if s["declined"] else s["name"] for s in steps)
    assert kinds["lookup"] and kinds["none"] and kinds["draft"] and kinds["declined"], kinds
    assert sum(s["asked"] and s["name"] in ("none", "lookup") for s in steps) >= 20
    for s in steps:
        want = 0 if s["declined"] or s["name"] == "draft" or not s["asked"] else 1
        assert s["conf"] == want, s
