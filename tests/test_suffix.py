"""The suffix drafter (suffix.py): automaton, matcher, ranked continuations, store, file."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

from specrun.decoding.auto import AutoPolicy
from specrun.decoding.policy import StepReport
from specrun.decoding.sampling import SamplingParams
from specrun.decoding.suffix import SEP, LookupFile, SuffixAutomaton, SuffixLookup, SuffixStore
from specrun.errors import SpecrunError

P = SamplingParams()
RNG = np.random.default_rng(0)


def occurrences(text: list[int], pat: list[int]) -> int:
    n = len(pat)
    return sum(text[i : i + n] == pat for i in range(len(text) - n + 1))


def brute_longest_earlier(text: list[int]) -> int:
    """Longest suffix of ``text`` that also occurs in text[:-1]."""
    best = 0
    for n in range(1, len(text)):
        suf = text[-n:]
        if any(text[i : i + n] == suf for i in range(len(text) - n)):
            best = n
    return best


def test_automaton_counts_and_matcher_equal_brute_force():
    rng = random.Random(3)
    text = [rng.randrange(4) for _ in range(300)]
    sam = SuffixAutomaton()
    state = length = 0
    for i, t in enumerate(text):
        state, length = sam.step(state, length, t)
        sam.extend(t)
        state = sam.settle(state, length)
        assert length == brute_longest_earlier(text[: i + 1]), i
    # occurrence counts of every short substring (the count walk is not capped at this depth)
    for n in (1, 2, 3, 5):
        for i in range(0, len(text) - n, 7):
            pat = text[i : i + n]
            s = 0
            for t in pat:
                s = sam.nxt[s][t]
            assert sam.cnt[s] == occurrences(text, pat), pat


def test_longest_match_has_no_length_limit():
    """A 12-token context seen before, with a 4-gram inside it seen elsewhere followed by
    something else: the long match decides (an n <= 4 index would follow the recent 4-gram)."""
    ctx = list(range(100, 112))
    seq = ctx + [7, 8, 9] + [50] + ctx[-4:] + [60, 61, 62] + [51] + ctx
    d = SuffixLookup()
    d.prefill(seq)
    prop = d.propose(seq, 8, P, RNG, True)
    assert prop.tokens[:3] == [7, 8, 9]
    assert d.last_match == 12 and d.last_source == "seq"


def test_most_frequent_continuation_wins_over_most_recent():
    seq = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 3, 5, 0, 1, 2, 3]
    d = SuffixLookup()
    d.prefill(seq)
    assert d.propose(seq, 1, P, RNG, True).tokens == [9]  # seen 3 times; 5 is the most recent
    assert d.last_support == 3


def test_proposal_length_grows_with_match_and_support():
    d = SuffixLookup()
    seq = list(range(40)) + [99] + list(range(30, 40))  # a 10-token match, seen once
    d.prefill(seq)
    long = d.propose(seq, 16, P, RNG, True)
    assert len(long) > 8
    seq2 = list(range(40)) + [99, 39]  # a one-token match, seen once
    d.prefill(seq2)
    short = d.propose(seq2, 16, P, RNG, True)
    assert 1 <= len(short) <= 2
    assert len(d.propose(seq2, 1, P, RNG, True)) == 1  # the caller's K caps it


def test_no_match_and_min_length():
    d = SuffixLookup(n_min=3)
    seq = [1, 2, 3, 4, 2, 3]
    d.prefill(seq)
    assert d.propose(seq, 4, P, RNG, True).tokens == []  # longest earlier match is 2 tokens
    d2 = SuffixLookup()
    d2.prefill([5, 6, 7])
    assert d2.propose([5, 6, 7], 4, P, RNG, True).tokens == []


def test_incremental_equals_rebuilt_and_resyncs_on_a_new_text():
    rng = random.Random(1)
    seq = [rng.randrange(6) for _ in range(200)]
    a, b = SuffixLookup(), SuffixLookup()
    a.prefill(seq[:50])
    for i in range(50, 200, 3):
        a.propose(seq[:i], 4, P, RNG, True)
    a.propose(seq, 4, P, RNG, True)
    b.prefill(seq)
    assert (
        a.cur == b.cur
        and a.propose(seq, 6, P, RNG, True).tokens == b.propose(seq, 6, P, RNG, True).tokens
    )
    other = [9, 9, 8, 9, 9]
    a.propose(other, 4, P, RNG, True)  # not an extension: rebuilt
    assert a.tokens == other and a.propose(other, 1, P, RNG, True).tokens == [8]


def test_update_cost_does_not_grow_with_history():
    rng = random.Random(2)
    text = [rng.randrange(500) for _ in range(30000)]
    sam = SuffixAutomaton()
    t0 = time.process_time()  # CPU time: other processes on the machine do not count
    for t in text[:10000]:
        sam.extend(t)
    early = time.process_time() - t0
    for t in text[10000:20000]:
        sam.extend(t)
    t0 = time.process_time()
    for t in text[20000:30000]:
        sam.extend(t)
    late = time.process_time() - t0
    assert late < 3 * early + 0.05
    assert len(sam.len) <= 2 * sam.n


def test_store_serves_earlier_outputs_and_survives_reset():
    d = SuffixLookup()
    prompt1 = [1, 2, 3]
    out = [40, 41, 42, 43, 44, 45, 46, 47]
    d.prefill(prompt1)
    d.finish(prompt1 + out)
    assert len(d.store) == 1
    d.reset()
    prompt2 = [7, 8, 40, 41, 42]  # a new request whose text starts like the stored output
    d.prefill(prompt2)
    prop = d.propose(prompt2, 8, P, RNG, True)
    assert prop.tokens[:3] == [43, 44, 45] and d.last_source == "store"


def test_store_is_bounded_and_evicts_the_oldest():
    store = SuffixStore(max_tokens=100)
    for i in range(30):
        store.add([1000 + i] * 10)
    assert store.total <= 100
    assert store.seqs[-1] == [1029] * 10 and [1000] * 10 not in store.seqs
    assert store.sam.n == store.total + len(store.seqs) - 1  # rebuilt over what is kept, separated
    assert SEP in store.sam.nxt[0]


def test_lookup_file_round_trip_per_vocabulary(tmp_path):
    path = tmp_path / "lookup.json"
    d = SuffixLookup(file=LookupFile(path, "vocab-a"))
    d.prefill([1, 2])
    d.finish([1, 2, 30, 31, 32, 33])
    other = LookupFile(path, "vocab-b")
    assert other.sequences() == []  # another vocabulary sees nothing
    other.save([[5, 6, 7]])
    again = SuffixLookup(file=LookupFile(path, "vocab-a"))
    assert list(again.store.seqs) == [[30, 31, 32, 33]]
    assert LookupFile(path, "vocab-b").sequences() == [[5, 6, 7]]
    assert not list(tmp_path.glob("*.tmp"))


def test_lookup_file_refuses_the_old_ngram_format_in_one_line(tmp_path):
    """Format 1 (--lookup-kind ngram's follower counts) is no longer migrated: one line says so."""
    path = tmp_path / "old.json"
    content = json.dumps({"version": 1, "n": 3, "ngrams": {"1 2 3": {"4": 5, "9": 1}}})
    path.write_text(content)
    with pytest.raises(SpecrunError) as exc:
        LookupFile(path, "v")
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg and "old-format file" in msg and "delete it" in msg
    assert path.read_text() == content  # left as it was


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        '{"version": 7}',
        '{"format": "specrun-lookup", "version": 2, "vocabs": {"v": [["x"]]}}',
    ],
)
def test_lookup_file_refuses_a_corrupt_file_in_one_line(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(SpecrunError) as exc:
        LookupFile(path, "v")
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg and "unreadable" in msg
    assert path.read_text() == content  # left as it was


def test_buckets_respect_lookup_max():
    d = SuffixLookup(bucket_max=4)
    names = []
    for m in (1, 4, 5, 8, 9, 16, 17, 40):
        d.last_match = m
        names.append(d.bucket())
    assert names == ["1", "4", "5-8", "5-8", "9-16", "9-16", "17+", "17+"]
    d2 = SuffixLookup(bucket_max=2)
    d2.last_match = 3
    assert d2.bucket() == "3-4"


def test_auto_prices_the_suffix_drafter_per_bucket_and_drafts_long():
    """Auto keys lookup's estimates by the drafter's bucket and may draft past --draft-max
    when long matches are accepted."""
    d = SuffixLookup()
    policy = AutoPolicy(4, d, None)
    text = list(range(200, 260))
    seq = text + [1] + text[:12]
    policy.prefill(seq)
    ks = []
    for _ in range(30):
        name, prop = policy.draft(seq, 16, P, RNG, True)
        k = len(prop)
        if name == "lookup":
            assert policy.last_choice[0] == "lookup:" + d.bucket()
            new = prop.tokens + [text[(len(seq) + k - 61) % 60]]
            policy.observe(StepReport(name, k, k, 0.0, 0.016 * (1 + 0.1 * k), new))
        else:
            new = [text[(len(seq) - 61) % 60]]
            policy.observe(StepReport(name, 0, 0, 0.0, 0.016, new))
        seq = seq + new
        ks.append(k)
    assert max(ks) > 4


class _AskedModel:
    """A draft model stand-in that records the K it is asked for."""

    name = "draft"
    p_min = 0.0
    single_rows = False
    n_cached = 0
    last_catch_up = (0, 0.0)

    def __init__(self):
        self.asked = []
        self.last_evidence = []

    def propose(self, tokens, k, params, rng, greedy_draft, window=None, evidence=False):
        from specrun.decoding.drafters import Proposal

        self.asked.append(k)
        self.n_cached = len(tokens)
        return Proposal([1] * k, None)

    def prefill(self, tokens, evaluate=True):
        return 0

    def rollback(self, valid_len):
        pass

    def reset(self):
        pass


def test_the_draft_model_keeps_its_own_k_under_lookups_longer_cap():
    from specrun.decoding.policy import HybridPolicy

    model = _AskedModel()
    hybrid = HybridPolicy(SuffixLookup(), model, draft_max=4)
    hybrid.prefill([1, 2, 3])
    name, prop = hybrid.draft([1, 2, 3], 16, P, RNG, True)  # lookup has nothing: the model drafts
    assert name == "draft" and model.asked == [4]
    auto_model = _AskedModel()
    auto = AutoPolicy(4, SuffixLookup(), auto_model)
    auto.prefill([1, 2, 3])
    for _ in range(20):
        name, prop = auto.draft([1, 2, 3], 16, P, RNG, True)
        auto.observe(StepReport(name, len(prop), len(prop), 0.001 * len(prop), 0.02))
    assert auto_model.asked and max(auto_model.asked) <= 4
