"""specrun/benchmark/llama_ngram.py: the ports of llama-server's n-gram drafters behave as the C++ does
(common/ngram-cache.cpp, common/ngram-mod.cpp of the vendored llama.cpp), quirks included,
and bench/suffix_sim.py replays them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture()
def ngram():
    from specrun.benchmark import llama_ngram

    return llama_ngram


def _suffix_sim():
    """bench/suffix_sim.py as a module, loaded from its file (no sys.path entry)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("suffix_sim", BENCH / "suffix_sim.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _propose(d, tokens, k=16):
    return d.propose(list(tokens), k, None, np.random.default_rng(0), True).tokens


def test_ngram_cache_chains_through_its_own_draft_up_to_eight(ngram):
    d = ngram.LlamaNgramCache()
    seq = [5, 6, 7, 8] * 6
    # every 1-4-gram of the cycle has one follower, seen 5+ times: the draft chains, capped at 8
    assert _propose(d, seq) == [5, 6, 7, 8, 5, 6, 7, 8]
    assert _propose(d, seq + [5], k=3) == [6, 7, 8]


def test_ngram_cache_thresholds(ngram):
    d = ngram.LlamaNgramCache()
    # 3 -> 4 seen once: a 1- or 2-gram needs 2 samples; the 3-gram (1, 2, 3) needs only one
    assert _propose(d, [1, 2, 3, 4, 9, 1, 2, 3]) == [4, 9, 1, 2, 3, 4, 9, 1]
    d = ngram.LlamaNgramCache()
    assert _propose(d, [7, 3, 4, 8, 3]) == []  # (3,) seen once, (8, 3) never: nothing
    d = ngram.LlamaNgramCache()
    # (3,) followed by 4, 5, 4: 2 of 3 = 66%, enough for a 1-gram (66%); by 4, 5: 50%, not
    assert _propose(d, [3, 4, 3, 5, 3, 4, 0, 3], k=1) == [4]
    d = ngram.LlamaNgramCache()
    assert _propose(d, [3, 4, 3, 5, 0, 3], k=1) == []


def test_ngram_cache_counts_only_within_each_chunk_of_new_tokens(ngram):
    d = ngram.LlamaNgramCache()
    assert _propose(d, [1, 2]) == []  # the first chunk, [1, 2]: (1,) -> 2 once
    # the next chunk is [9, 1, 2, 9, 1]: its (2,) -> 9 is counted, the 2 -> 9 across the boundary
    # is not; (9, 1) -> 2 was seen once, too few for a 2-gram; (1,) -> 2 twice drafts 2
    assert _propose(d, [1, 2, 9, 1, 2, 9, 1], k=1) == [2]
    assert d.cache[(2,)] == {9: 1}
    assert d.cache[(1,)] == {2: 2}


def test_ngram_mod_needs_a_long_repeat(ngram):
    d = ngram.LlamaNgramMod()
    text = list(range(100, 200))
    prompt = text + [7, 7]
    d.prefill(prompt)
    # the text's first 24 tokens again: 48+ tokens follow them in the table
    toks = prompt + text[:24]
    got = _propose(d, toks, k=64)
    assert got == text[24:88]
    # a repeat of only 30 tokens cannot give 48: no proposal
    d = ngram.LlamaNgramMod()
    short = list(range(300, 330))
    d.prefill(short + [1])
    assert _propose(d, short + [1] + short[:24], k=64) == []


def test_suffix_sim_replays_the_llama_drafters(tmp_path):
    copy = list(range(1000, 1200))
    runs = {
        "seq:demo": [
            {"prompt": [1, 2, 3] + copy + [4], "output": copy[:150]},
            {"prompt": [5, 6], "output": copy[:150]},
        ],
        "bench:demo": [{"prompt": copy + [9], "output": copy[:150]}],
    }
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(runs))
    r = subprocess.run(
        [
            sys.executable,
            str(BENCH / "suffix_sim.py"),
            str(path),
            "--vtable",
            "2:1.5,3:1.8,5:2.4,9:3.9",
            "--max-tokens",
            "200",
            "--kinds",
            "ngram,suffix,llama-ngram-cache,llama-ngram-mod",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rows = {line.split("|")[1].strip(): line for line in r.stdout.splitlines() if "demo" in line}
    assert set(rows) == {"seq:demo", "bench:demo"}
    # every drafter finds the copy: each speeds the replay up
    for line in rows.values():
        speedups = [float(c.split("x")[0]) for c in line.split("|")[3:-1]]
        assert len(speedups) == 4 and all(s > 1.0 for s in speedups), line


def test_suffix_sim_auto_takes_prior_changes(tmp_path):
    copy = list(range(1000, 1200))
    runs = {"bench:demo": [{"prompt": copy + [9], "output": copy[:150]}]}
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(runs))

    def sim(kinds: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(BENCH / "suffix_sim.py"), str(path), "--kinds", kinds],
            capture_output=True,
            text=True,
            timeout=120,
        )

    r = sim("auto,auto@margin=100.0")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if "bench:demo" in line)
    plain, never = (float(c.split("x")[0]) for c in row.split("|")[3:-1])
    assert plain > 1.5 and never == 1.0  # a margin nothing clears: plain decoding throughout
    geo = next(line for line in r.stdout.splitlines() if "geo-mean" in line)
    g_plain, g_never = (float(c.strip().rstrip("x")) for c in geo.split("|")[3:-1])
    assert g_plain == pytest.approx(plain, abs=0.01) and g_never == 1.0  # one workload
    bad = sim("auto@no_such_field=1")
    assert bad.returncode != 0 and "no_such_field" in bad.stderr
    assert bad.stdout == ""  # refused before any table
    assert sim("suffix@margin=1").returncode != 0


def test_suffix_sim_tree_tries_the_second_follower_when_the_first_fails():
    suffix_sim = _suffix_sim()

    from specrun.decoding.suffix import SuffixLookup

    # after 6 7 came 8 twice and 9 once: the suffix drafter's best path starts with 8, the
    # second branch with 9 (a third of the count), and the target goes on with 9 (a 2-token
    # match: --mode lookup's shortest)
    prompt = [6, 7, 8, 1, 6, 7, 8, 2, 6, 7, 9, 3, 4, 6, 7]
    d = SuffixLookup()
    d.prefill(prompt)
    first = d.propose(prompt, 4, None, np.random.default_rng(0), True).tokens
    assert first[0] == 8
    assert suffix_sim.second_branch(d, first, 4, 0.2) == [9]
    assert suffix_sim.second_branch(d, first, 4, 0.5) == []  # below the least share

    reqs = [{"prompt": prompt, "output": [9, 3, 4, 5]}]
    v = suffix_sim.verify_cost({}, 0.1)
    one = suffix_sim.replay(lambda: suffix_sim.make("suffix")[0], reqs, 4, 16, v, fresh=True)
    two = suffix_sim.replay(
        lambda: suffix_sim.make("suffix-tree")[0], reqs, 4, 16, v, fresh=True, tree_min_share=0.2
    )
    assert one["trees"] == 0 and one["second_won"] == 0
    assert two["trees"] >= 1 and two["second_won"] == 1


def test_suffix_sim_ceilings_choose_k_knowing_the_target():
    suffix_sim = _suffix_sim()

    line = suffix_sim.verify_cost({}, 0.1)
    # the target takes 3 of the 5 proposed: K = 3 (4 tokens for V(4)); rows past them only cost
    assert suffix_sim.best_k_knowing([1, 2, 3, 9, 9], [1, 2, 3, 4, 5], line) == 3
    assert suffix_sim.best_k_knowing([7, 2, 3], [1, 2, 3], line) == 0  # first one wrong: plain
    dear = suffix_sim.verify_cost({2: 2.5}, 0.1)  # a second row dearer than a second token
    assert suffix_sim.best_k_knowing([1], [1, 2], dear) == 0

    # an answer that copies its prompt, then goes on with text seen nowhere before
    copy = list(range(100, 160))
    new = list(range(500, 540))
    reqs = [{"prompt": [1, 2, *copy, 3], "output": copy[:40] + new}]
    r = {
        kind: suffix_sim.replay(
            lambda kind=kind: suffix_sim.make(kind, vcost=line)[0], reqs, 80, 16, line, fresh=True
        )
        for kind in ("suffix", "auto", "oracle-k", "bound")
    }
    # neither ceiling ever loses a pass: every token of the new text is a plain pass's
    assert r["oracle-k"]["speedup"] >= max(r["suffix"]["speedup"], r["auto"]["speedup"])
    assert r["bound"]["speedup"] >= r["oracle-k"]["speedup"] > 1.5
    assert r["bound"]["acceptance"] == 1.0  # it proposes only what the target takes

    # the bound copies from an earlier request of the same process (a seq: workload)
    later = [{"prompt": [7, 8], "output": new}]
    seq = suffix_sim.replay(
        lambda: suffix_sim.make("bound", vcost=line)[0], reqs + later, 80, 16, line, fresh=False
    )
    alone = suffix_sim.replay(
        lambda: suffix_sim.make("bound", vcost=line)[0], later, 80, 16, line, fresh=False
    )
    assert alone["speedup"] == 1.0 and seq["speedup"] > r["bound"]["speedup"]
