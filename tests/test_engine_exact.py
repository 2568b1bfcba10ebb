"""Greedy speculation says exactly what the target says: on both real pairs, varied prompts,
several draft lengths; and the rollback edges, each named."""

from __future__ import annotations

import pytest
from conftest import assert_rows_exact, assert_same_as_target

from specrun.chat_template import encode_chat
from specrun.decoding.drafters import BaseDrafter, Proposal
from specrun.decoding.engine import Engine, Result, SpecConfig
from specrun.decoding.policy import FixedPolicy
from specrun.decoding.sampling import SamplingParams

pytestmark = pytest.mark.models

GREEDY = SamplingParams(temp=0.0)
N = 128

PROMPTS = {
    "code": 'def quicksort(items):\n    """Sort a list with quicksort."""\n',
    "prose": "The history of the printing press begins in the fifteenth century, when",
    "list": "Ten common fruits, one per line:\n1. Apple\n2.",
    "repeat": "la la la la la la la la la la la la la la la la la la la la",
    "json": '{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics",',
    "numbers": "1, 2, 3, 5, 8, 13, 21,",
    "french": "Translate to French: The cat sleeps on the warm windowsill.\nFrench:",
    "chat": None,  # a chat-templated question, built per model
}
CHAT_QUESTION = "What are three good habits for writing maintainable code?"


def prompt_tokens(model, key: str) -> list[int]:
    if key == "chat":
        template = model.chat_template()
        if template:
            return encode_chat(model, [{"role": "user", "content": CHAT_QUESTION}])
        return model.tokenize(f"Question: {CHAT_QUESTION}\nAnswer:", add_special=True)
    return model.tokenize(PROMPTS[key], add_special=True)


@pytest.fixture(scope="module")
def baselines(pairs):
    """--mode none on every (pair, prompt): what the target alone says."""
    out = {}
    for pair_name, (target, _draft) in pairs.items():
        alone = Engine(target, None, SpecConfig(mode="none"))
        for key in PROMPTS:
            toks = prompt_tokens(target, key)
            out[pair_name, key] = alone.run(toks, max_tokens=N, params=GREEDY, reuse_cache=False)
    return out


@pytest.mark.parametrize("long_context", [False, True])
@pytest.mark.parametrize("pair_name", ["smollm2", "gemma3"])
def test_batched_logits_equal_one_at_a_time(pairs, pair_name, long_context):
    """What greedy exactness rests on: a row verified inside a batch of K + 1 gets exactly the
    logits it gets when the target decodes it alone. Fails on a llama.cpp built with llamafile's
    sgemm on every batch (batches of 2+ rows sum in another order than single rows): build with
    patches/ (sgemm on prompts' batches only), as `make install` does. The long context (400+ tokens) is
    where llama.cpp's CPU flash attention parts batched rows from single ones: runtime.py turns
    it off on the CPU unless asked for."""

    target, _draft = pairs[pair_name]
    prompt = prompt_tokens(target, "prose")
    if long_context:
        filler = " ".join(v for v in PROMPTS.values() if v) + "\n"
        prompt = target.tokenize(filler * 8, add_special=True) + prompt
        assert len(prompt) > 400
    assert_rows_exact(target, prompt, (2, 5, 9), f"{pair_name} (a build that is not row-exact?)")


def test_a_graph_kept_per_batch_size_is_reused_and_gives_the_same_logits(smol_target, model_path):
    """patches/ (graph per size): a pass of a size seen before reuses the compute graph kept for
    that size, though passes of other sizes ran since (llama.cpp keeps one graph and rebuilds it
    at every change of size: a speculative step paid two rebuilds), and gives, bit for bit, the
    logits a graph built for it in a fresh context gives. Such a graph is computed without the
    scheduler, which holds another (SPECRUN_GRAPH_DIRECT), so the graphs share the compute
    buffer's places; a size first built after them (9 rows, placed by the scheduler among the
    others' places) leaves them right too. (Which path ran is not observable here: the check is
    that either gives these logits; `specrun info` says which the build takes.)"""
    import llama_cpp as ll
    import numpy as np
    from conftest import SMOL_TARGET, _load

    from specrun.llama.backend import graphs_per_batch_size

    if graphs_per_batch_size() < 5:
        pytest.skip("this build keeps one compute graph (make install's keeps one per size)")
    prompt = prompt_tokens(smol_target, "prose")
    p = len(prompt)
    fresh = _load(model_path(SMOL_TARGET))  # a new context: each size's graph built anew
    try:
        fresh.decode(prompt, 0, None)
        want = {}
        for size in (1, 3, 5, 9):
            fresh.decode(prompt[:size], p, 0)
            want[size] = [fresh.logits(r).copy() for r in range(size)]
            fresh.truncate(p)
    finally:
        fresh.close()
    m = smol_target
    m.clear()
    m.decode(prompt, 0, None)
    for size in (1, 3, 5):  # each size's graph built (or kept from earlier tests) once
        m.decode(prompt[:size], p, 0)
        m.truncate(p)

    def check(size: int) -> None:
        m.decode(prompt[:size], p, 0)
        for r in range(size):
            assert np.array_equal(want[size][r], m.logits(r)), (size, r)
        m.truncate(p)

    before = ll.llama_perf_context(m._ctx).n_reused
    for _ in range(3):
        for size in (1, 3, 5):  # every pass follows one of another size
            check(size)
    assert ll.llama_perf_context(m._ctx).n_reused - before == 9
    for size in (9, 5, 1, 3, 9, 1):
        check(size)
    m.clear()


@pytest.mark.parametrize("pair_name", ["smollm2", "gemma3"])
@pytest.mark.parametrize("draft_max", [1, 3, 4, 8])
def test_draft_equals_target_alone(pairs, baselines, pair_name, draft_max):
    target, draft = pairs[pair_name]
    engine = Engine(target, draft, SpecConfig(mode="draft", draft_max=draft_max, draft_p_min=0.0))
    drafted = 0
    for key in PROMPTS:
        toks = prompt_tokens(target, key)
        got = engine.run(toks, max_tokens=N, params=GREEDY, reuse_cache=False)
        want = baselines[pair_name, key]
        assert_same_as_target(got, want, f"{pair_name}/{key} K={draft_max}")
        drafted += got.stats.drafted
    assert drafted > 0


def test_baselines_are_long_enough(baselines):
    # The exactness claim is only as strong as the outputs are long.
    long = [k for k, r in baselines.items() if len(r.tokens) >= N]
    assert len(long) >= 12, {k: len(r.tokens) for k, r in baselines.items()}


# -- rollback edges ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def self_draft(model_path):
    """The target's own weights as the draft: every greedy draft token is accepted."""
    from conftest import SMOL_TARGET, THREADS

    from specrun.llama.model import LoadOptions, Model

    m = Model(model_path(SMOL_TARGET), LoadOptions(n_ctx=2048, n_threads=THREADS))
    yield m
    m.close()


class WrongDrafter(BaseDrafter):
    """Proposes a token the target never picks, so every pass rejects at position 0."""

    name = "draft"

    def __init__(self, token: int) -> None:
        self.token = token

    def prefill(self, tokens):
        return 0

    def propose(self, tokens, k, params, rng, greedy_draft):
        return Proposal([self.token] * k, None)

    def rollback(self, valid_len):
        pass

    def reset(self):
        pass


def steps_of(engine, toks, **kw):
    steps, result = [], None
    for ev in engine.generate(toks, **kw):
        if isinstance(ev, Result):
            result = ev
        else:
            steps.append(ev)
    return steps, result


def test_all_drafts_accepted(smol_target, self_draft, monkeypatch):
    toks = prompt_tokens(smol_target, "code")
    want = Engine(smol_target, None, SpecConfig(mode="none")).run(
        toks, max_tokens=N, reuse_cache=False
    )
    engine = Engine(smol_target, self_draft, SpecConfig(mode="draft", draft_max=4, draft_p_min=0.0))
    rows: list[int] = []
    real_decode = self_draft.decode
    monkeypatch.setattr(
        self_draft,
        "decode",
        lambda t, p, logits_from=None: (rows.append(len(t)), real_decode(t, p, logits_from))[1],
    )
    got = engine.run(toks, max_tokens=N, reuse_cache=False)
    assert got.tokens == want.tokens
    h = got.stats.histogram
    assert len(h) == 5 and h[4] >= 0.8 * sum(h), h  # nearly every pass accepted all 4
    assert got.stats.acceptance_rate > 0.9
    # Fully accepted passes leave the draft one token behind: it must catch up, not re-decode.
    # Each position of prompt + output is evaluated by the draft at most once; beyond that only
    # the rows of rejected drafts (a rejected draft's last token is never evaluated, so at most
    # one row each). One re-decoded row per pass would add ~N/5 rows.
    rejected = got.stats.drafted - got.stats.accepted
    assert sum(rows) <= len(toks) + len(got.tokens) - 1 + rejected, (
        sum(rows),
        len(toks),
        len(got.tokens),
        rejected,
    )
    assert sum(rows) >= len(toks) - 1 + len(got.tokens) - got.stats.target_passes


def test_rejection_at_first_position(smol_target):
    toks = prompt_tokens(smol_target, "prose")
    want = Engine(smol_target, None, SpecConfig(mode="none")).run(
        toks, max_tokens=64, reuse_cache=False
    )
    engine = Engine(smol_target, None, SpecConfig(mode="none"))
    engine.policy = FixedPolicy(WrongDrafter(token=smol_target.n_vocab - 1))
    got = engine.run(toks, max_tokens=64, reuse_cache=False)
    assert got.tokens == want.tokens
    assert got.stats.accepted == 0 and got.stats.drafted > 0
    assert got.stats.histogram == [got.stats.target_passes]


def test_eos_inside_accepted_draft(smol_target, self_draft):
    toks = prompt_tokens(smol_target, "chat")
    want = Engine(smol_target, None, SpecConfig(mode="none")).run(
        toks, max_tokens=400, reuse_cache=False
    )
    assert want.finish_reason == "eos"
    inside = []
    # Where the EOS falls in a pass depends on the answer's length modulo K + 1 (the self-draft
    # has every token accepted); as the first token of a pass it emits nothing and yields no
    # step. Several K make sure it lands strictly inside an accepted draft at least once.
    for k in (8, 7, 5):
        engine = Engine(
            smol_target, self_draft, SpecConfig(mode="draft", draft_max=k, draft_p_min=0.0)
        )
        steps, got = steps_of(engine, toks, max_tokens=400, reuse_cache=False)
        assert got.finish_reason == "eos"
        assert got.tokens == want.tokens
        assert not any(smol_target.is_eog(t) for t in got.tokens)
        last = steps[-1]
        # The EOS came inside a draft the target accepted: the pass committed fewer tokens than
        # it accepted (the EOS and what followed it in the draft were dropped, never emitted).
        inside.append(last.accepted >= 1 and len(last.tokens) < last.accepted)
    assert any(inside), inside


def test_stop_string_inside_draft(smol_target, self_draft):
    toks = prompt_tokens(smol_target, "list")
    free = Engine(smol_target, None, SpecConfig(mode="none")).run(
        toks, max_tokens=N, reuse_cache=False
    )
    stop = "\n5."
    assert stop in free.text
    alone = Engine(smol_target, None, SpecConfig(mode="none")).run(
        toks, max_tokens=N, stop=[stop], reuse_cache=False
    )
    engine = Engine(smol_target, self_draft, SpecConfig(mode="draft", draft_max=8, draft_p_min=0.0))
    got = engine.run(toks, max_tokens=N, stop=[stop], reuse_cache=False)
    assert got.finish_reason == alone.finish_reason == "stop"
    assert got.text == alone.text == free.text[: free.text.index(stop)]
    assert got.tokens == alone.tokens
    # The caches were cut back to the transcript: a second run reusing them says the same.
    again = engine.run(toks, max_tokens=N, stop=[stop], reuse_cache=True)
    assert again.tokens == got.tokens


def test_max_tokens_mid_draft(smol_target, self_draft):
    toks = prompt_tokens(smol_target, "code")
    want = Engine(smol_target, None, SpecConfig(mode="none")).run(
        toks, max_tokens=37, reuse_cache=False
    )
    engine = Engine(smol_target, self_draft, SpecConfig(mode="draft", draft_max=8, draft_p_min=0.0))
    got = engine.run(toks, max_tokens=37, reuse_cache=False)
    assert len(got.tokens) == 37 and got.finish_reason == "length"
    assert got.tokens == want.tokens


@pytest.mark.parametrize("pair_name", ["smollm2", "gemma3"])
def test_context_end(model_path, pair_name):
    from conftest import GEMMA_DRAFT, GEMMA_TARGET, SMOL_DRAFT, SMOL_TARGET, THREADS

    from specrun.llama.model import LoadOptions, Model

    names = {"smollm2": (SMOL_TARGET, SMOL_DRAFT), "gemma3": (GEMMA_TARGET, GEMMA_DRAFT)}[pair_name]
    n_ctx = 96
    with (
        Model(model_path(names[0]), LoadOptions(n_ctx=n_ctx, n_threads=THREADS)) as target,
        Model(
            model_path(names[1]), LoadOptions(n_ctx=n_ctx, n_threads=THREADS, amx_rows=True)
        ) as draft,
    ):
        n_ctx = target.n_ctx  # llama.cpp may round the context up
        toks = (target.tokenize(PROMPTS["list"], add_special=True) * 64)[: n_ctx - 24]
        want = Engine(target, None, SpecConfig(mode="none")).run(
            toks, max_tokens=500, reuse_cache=False
        )
        got = Engine(target, draft, SpecConfig(mode="draft", draft_max=8, draft_p_min=0.0)).run(
            toks, max_tokens=500, reuse_cache=False
        )
        assert got.finish_reason == want.finish_reason
        assert got.tokens == want.tokens
        if want.finish_reason == "length":
            # The context is used to the last position: the final token is emitted unevaluated.
            assert len(toks) + len(want.tokens) == n_ctx + 1


@pytest.mark.parametrize("mode", ["draft", "auto"])
def test_the_first_token_comes_before_the_draft_model_reads_the_prompt(pairs, baselines, mode):
    """Time to first token is the target's prefill and one row: the first pass is plain, and the
    draft model reads the prompt (all of it, once) only after that pass's Step is out; the
    reply is still the target's own, and the stats count the draft's reading as prefill."""
    from specrun.decoding.engine import Step

    target, draft = pairs["smollm2"]
    engine = Engine(target, draft, SpecConfig(mode=mode, draft_max=4))
    assert engine.draft_model is not None
    real = engine.draft_model.prefill
    steps: list[Step] = []
    read: list[tuple[int, int]] = []  # (rows the draft model read, Steps out by then)

    def prefill(toks, evaluate=True):  # type: ignore[no-untyped-def]
        n = real(toks, evaluate)
        if evaluate:
            read.append((n, len(steps)))
        return n

    engine.draft_model.prefill = prefill  # type: ignore[method-assign]
    toks = prompt_tokens(target, "code")
    result = None
    for ev in engine.generate(toks, max_tokens=N, params=GREEDY, reuse_cache=False):
        if isinstance(ev, Step):
            steps.append(ev)
        else:
            result = ev
    assert read == [(len(toks), 1)]
    assert steps[0].drafter == "none" and len(steps[0].tokens) == 1
    if mode == "draft":  # auto drafts where its costs say so, which may be nowhere here
        assert any(s.drafter == "draft" for s in steps[1:])
    assert result is not None
    assert_same_as_target(result, baselines["smollm2", "code"], f"{mode}, first token first")
    assert result.stats.prefill_tokens == len(toks)
    assert result.stats.prefill_seconds > 0.0
