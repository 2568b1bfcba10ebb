"""DraftModel's windowed catch-up: a probe after a long stretch without the draft model decodes
only the last few unseen tokens; the draft cache then holds a skipped stretch, and its own
positions stay consecutive (llama.cpp refuses a batch that does not follow the cached positions).
"""

from __future__ import annotations

import numpy as np

from specrun.decoding.drafters import DraftModel
from specrun.decoding.sampling import SamplingParams

GREEDY = SamplingParams(temp=0.0, seed=0)


def _tokens(m):
    text = (
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
        "    return a\n\n\ndef fact(n):\n    out = 1\n    for i in range(2, n + 1):\n"
    )
    return m.tokenize(text, add_special=True)


def test_windowed_catch_up_skips_all_but_the_last_tokens(smol_draft):
    d = DraftModel(smol_draft)
    d.reset()
    toks = _tokens(smol_draft)
    assert len(toks) > 40
    rng = np.random.default_rng(0)
    d.prefill(toks[:12])
    prop = d.propose(toks, 3, GREEDY, rng, True, window=8)
    assert len(prop) == 3
    assert d.skipped == len(toks) - 8 - 11  # 11 cached by the prefill, 8 caught up
    # The cache positions stay consecutive: 11 + 8 + 2 drafted tokens evaluated.
    assert d._next_pos(d.n_cached) == 11 + 8 + 2
    # Roll back to the accepted prefix and go on drafting: llama.cpp accepts the positions.
    d.rollback(len(toks))
    more = toks + prop.tokens[:1]
    assert len(d.propose(more, 4, GREEDY, rng, True)) == 4
    d.rollback(len(more))
    assert d._next_pos(d.n_cached) == 11 + 8 + 1
    # Rolling back into the skipped stretch keeps what was cached before it.
    d.rollback(20)
    assert d._next_pos(d.n_cached) == 11
    d.reset()


def test_a_new_turn_re_decodes_from_the_skipped_stretch(smol_draft):
    """Prefix reuse (chat) stops at a skipped stretch: after the next prefill the cache is the
    full history again, and the draft proposes what a fresh draft cache proposes."""
    toks = _tokens(smol_draft)
    rng = np.random.default_rng(0)
    d = DraftModel(smol_draft)
    d.reset()
    d.prefill(toks[:12])
    d.propose(toks[:-10], 2, GREEDY, rng, True, window=4)
    assert d.skipped > 0
    d.rollback(len(toks) - 10)
    assert d.prefill(toks) == len(toks) - 1 - 11  # re-decoded from the start of the skipped stretch
    got = d.propose(toks, 4, GREEDY, rng, True).tokens

    d.reset()
    d.prefill(toks)
    want = d.propose(toks, 4, GREEDY, rng, True).tokens
    assert got == want
    d.reset()


def test_a_skipped_prefill_keeps_only_the_shared_prefix_and_catches_up_when_asked(smol_draft):
    """auto skips the draft's prefill where the draft cannot pay (AutoPolicy.prefill): what the
    cache held beyond the new prompt's shared prefix goes (a chat's earlier turn it does not
    continue), nothing is evaluated, and a later proposal catches up on the whole prompt and
    proposes what a draft that read it at once proposes."""
    toks = _tokens(smol_draft)
    rng = np.random.default_rng(0)
    d = DraftModel(smol_draft)
    d.reset()
    d.prefill(toks[:30])
    other = toks[:10] + toks[30:]
    assert d.prefill(other, evaluate=False) == 0
    assert d.n_cached == 10 and d.held_tokens() == toks[:10]
    got = d.propose(other, 4, GREEDY, rng, True).tokens
    assert d.last_catch_up[0] == len(other) - 10
    d.reset()
    d.prefill(other)
    assert d.propose(other, 4, GREEDY, rng, True).tokens == got
    d.reset()


def test_catch_up_evidence_is_what_the_draft_proposes_at_each_token(smol_draft):
    """``evidence``: each row of a catch-up says what the draft, sure or not, would have proposed
    after it, against the token that came next; the same as decoding the prefix alone and asking
    it. The proposal itself is the one a catch-up without evidence makes."""
    toks = _tokens(smol_draft)
    rng = np.random.default_rng(0)
    d = DraftModel(smol_draft, p_min=0.6)
    d.reset()
    d.prefill(toks[:12])
    prop = d.propose(toks[:30], 3, GREEDY, rng, True, evidence=True)
    ev = d.last_evidence
    assert len(ev) == 30 - 11 - 1  # every caught-up token but the last
    d.reset()
    d.prefill(toks[:12])
    assert d.propose(toks[:30], 3, GREEDY, rng, True).tokens == prop.tokens
    assert d.last_evidence == []  # not asked for
    # Each row against the draft decoding its prefix: what it proposes next, and whether sure.
    from specrun.decoding import sampling as S

    for i, (sure, hit) in enumerate(ev):
        n = 11 + i + 1  # the prefix the row's logits follow
        smol_draft.clear()
        smol_draft.decode(toks[:n], 0, logits_from=n - 1)
        lg = smol_draft.logits(-1)
        assert hit == (S.greedy(lg) == toks[n])
        assert sure == (S.top_prob(lg) >= 0.6)
    assert any(hit for _, hit in ev) and any(sure for sure, _ in ev)
    d.reset()


def test_no_evidence_from_a_sampled_draft_or_a_single_row(smol_draft):
    toks = _tokens(smol_draft)
    rng = np.random.default_rng(0)
    d = DraftModel(smol_draft)
    d.reset()
    d.prefill(toks[:12])
    d.propose(toks[:20], 2, SamplingParams(temp=0.8, seed=0), rng, False, evidence=True)
    assert d.last_evidence == []  # sampled: acceptance is not an argmax
    d.reset()
    d.prefill(toks[:20])
    d.propose(toks[:20], 2, GREEDY, rng, True, evidence=True)
    assert d.last_evidence == []  # one row caught up: nothing before the proposal
    d.reset()
