"""The server's cache of earlier prompts (server/prompt_cache.py), on fake models: what it
copies, what it puts back, what it evicts. The real thing, over HTTP: tests/test_serve.py."""

from __future__ import annotations

from specrun.errors import SpecrunError
from specrun.server.prompt_cache import MIN_TOKENS, PromptCache


class FakeModel:
    """A KV cache as a token list; a saved state is the tokens' bytes (10 bytes a token)."""

    def __init__(self) -> None:
        self.cached: list[int] = []
        self.fail = False

    def save_state(self) -> tuple[tuple[int, ...], bytes]:
        return tuple(self.cached), bytes(10 * len(self.cached))

    def load_state(self, tokens, data) -> None:  # type: ignore[no-untyped-def]
        self.cached = []
        if self.fail:
            raise SpecrunError("could not restore")
        assert len(data) == 10 * len(tokens)
        self.cached = list(tokens)


class FakeDraft:
    def __init__(self) -> None:
        self.model = FakeModel()
        self.resets = 0

    def save_state(self):  # type: ignore[no-untyped-def]
        return list(range(len(self.model.cached))), self.model.save_state()

    def load_state(self, state) -> None:  # type: ignore[no-untyped-def]
        self.model.load_state(*state[1])

    def reset(self) -> None:
        self.resets += 1
        self.model.cached = []


class FakeEngine:
    def __init__(self) -> None:
        self.target = FakeModel()
        self.draft_model = FakeDraft()

    def run(self, prompt: list[int], cache: PromptCache) -> int:
        """As the worker and the engine do: prepare, then keep the shared prefix and evaluate
        the rest (both models)."""
        shared = cache.prepare(self, prompt)
        self.target.cached = list(prompt)
        self.draft_model.model.cached = list(prompt)
        return shared


A = list(range(1000, 1000 + 2 * MIN_TOKENS))
B = list(range(5000, 5000 + 2 * MIN_TOKENS))


def test_a_switch_copies_the_conversation_and_the_next_turn_gets_it_back():
    cache, eng = PromptCache(-1), FakeEngine()
    assert eng.run(A, cache) == 0
    assert eng.run(B, cache) == 0  # A copied before B replaced it
    assert cache.stats()["saved"] == 1 and cache.entries[0].tokens == tuple(A)
    assert eng.run(A + [7, 8], cache) == len(A)  # B copied, A put back: both models
    assert eng.draft_model.resets == 0
    st = cache.stats()
    assert st["saved"] == 2 and st["restored"] == 1 and st["entries"] == 2
    assert eng.run(A + [7, 8, 9], cache) == len(A) + 2  # the live cache: nothing to do
    assert cache.stats() == st


def test_a_short_stretch_is_neither_copied_nor_worth_putting_back():
    cache, eng = PromptCache(-1), FakeEngine()
    short = list(range(MIN_TOKENS - 1))
    eng.run(short, cache)
    eng.run(B, cache)
    assert cache.stats()["saved"] == 0
    eng.run(A, cache)  # B copied
    # A copied; B's copy shares MIN_TOKENS - 1 tokens with this prompt: not put back
    assert eng.run(B[: MIN_TOKENS - 1] + [1], cache) == 0
    assert [e.tokens for e in cache.entries] == [tuple(B), tuple(A)]
    assert cache.stats()["restored"] == 0


def test_a_longer_copy_of_the_same_conversation_replaces_the_older():
    cache, eng = PromptCache(-1), FakeEngine()
    eng.run(A, cache)
    eng.run(B, cache)  # copies A
    eng.run(A + [1, 2], cache)  # copies B, restores A
    eng.run(B + [3], cache)  # copies A + [1, 2] (A's copy goes), restores B
    assert sorted(len(e.tokens) for e in cache.entries) == [len(B), len(A) + 2]


def test_the_budget_evicts_the_least_recently_used():
    per = 2 * 10 * len(A)  # target and draft
    cache, eng = PromptCache(2 * per), FakeEngine()
    C = list(range(9000, 9000 + len(A)))
    eng.run(A, cache)
    eng.run(B, cache)  # copies A
    eng.run(C, cache)  # copies B
    eng.run(A + [1], cache)  # copies C: A, the least recently used, goes; A's turn from scratch
    assert [e.tokens[0] for e in cache.entries] == [B[0], C[0]]
    assert cache.stats()["bytes"] <= 2 * per
    small, eng2 = PromptCache(per - 1), FakeEngine()
    eng2.run(A, small)
    eng2.run(B, small)  # A's copy would not fit at all: not kept
    assert small.stats() == {"entries": 0, "bytes": 0, "saved": 0, "restored": 0}


def test_a_failed_restore_leaves_an_empty_cache_and_drops_the_copy():
    cache, eng = PromptCache(-1), FakeEngine()
    eng.run(A, cache)
    eng.run(B, cache)
    eng.target.fail = True
    assert eng.run(A + [1], cache) == 0
    assert eng.draft_model.resets == 1
    assert all(e.tokens != tuple(A) for e in cache.entries)


def test_off():
    cache, eng = PromptCache(0), FakeEngine()
    eng.run(A, cache)
    eng.run(B, cache)
    assert cache.stats()["entries"] == 0
