"""Constrained decoding: the grammar masks the target's rows, speculation stays exact under it,
forced text is drafted for free; and llama.cpp's grammar sampler behind it on the real models."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pytest
from fakes import ALPHABET, EOS, FakeModel, cycle_rule, text_tokens

from specrun.decoding import constraint as C
from specrun.decoding.engine import Engine, SpecConfig
from specrun.decoding.sampling import SamplingParams

GREEDY = SamplingParams(temp=0.0)


class Pattern:
    """A constraint over the fakes' alphabet: the output must spell ``pattern`` where it has a
    letter and may write any of ``free`` where it has ``?``; EOS only at the end."""

    def __init__(self, pattern: str, free: str = "abcdefghijklmnopqrstuvwxyz") -> None:
        self.pattern, self.free, self.pos = pattern, free, 0
        self.forks = 0

    def fork(self) -> Pattern:
        c = Pattern(self.pattern, self.free)
        c.pos = self.pos
        self.forks += 1
        return c

    def accept(self, token: int) -> None:
        assert self.allowed(np.array([token]))[0], f"accepted a forbidden token {token}"
        self.pos += 1

    def _ok(self, token: int) -> bool:
        if self.pos >= len(self.pattern):
            return token == EOS
        want = self.pattern[self.pos]
        ch = ALPHABET[token - 3] if 3 <= token < 3 + len(ALPHABET) else None
        return ch is not None and (ch in self.free if want == "?" else ch == want)

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        return np.array([self._ok(int(t)) for t in ids], dtype=bool)

    def close(self) -> None:
        pass


def _run(engine: Engine, prompt: Sequence[int], con: Pattern | None, params=GREEDY, n=40):
    return engine.run(list(prompt), max_tokens=n, params=params, reuse_cache=False, constraint=con)


TEXT = "abcdefghijklmnopqrstuvwxyz"  # the fakes prefer the next letter, cyclically


def test_the_grammar_masks_the_greedy_choice():
    target = FakeModel(cycle_rule(TEXT))
    free = _run(Engine(target, None, SpecConfig(mode="none")), [1], None, n=8)
    assert free.text == "abcdefgh"
    got = _run(Engine(target, None, SpecConfig(mode="none")), [1], Pattern("a??? b????."))
    assert (got.text, got.finish_reason) == ("abcd bcdef.", "eos")


@pytest.mark.parametrize("mode", ["draft", "lookup", "hybrid", "auto"])
def test_greedy_under_a_grammar_is_the_constrained_target_in_every_mode(mode):
    """A draft model that ignores the grammar proposes forbidden tokens; they are rejected, and the
    output is the constrained target's token for token."""
    target = FakeModel(cycle_rule(TEXT))
    draft = FakeModel(cycle_rule(TEXT), seed=3)
    prompt = [1, *text_tokens(TEXT * 2)]
    pattern = "ab?de?ghxyz?bcd?fghijkl??opqrstu?wxyza?cdef"
    want = _run(Engine(target, None, SpecConfig(mode="none")), prompt, Pattern(pattern), n=80)
    assert want.finish_reason == "eos"
    eng = Engine(target, draft, SpecConfig(mode=mode, draft_max=6))
    got = _run(eng, prompt, Pattern(pattern), n=80)
    assert got.tokens == want.tokens
    assert got.stats.target_passes < want.stats.target_passes


def test_forced_text_is_drafted_for_free():
    """Where the pattern leaves one character, the engine proposes it without a drafter: a run
    of forced characters costs one target pass, not one each."""
    target = FakeModel(cycle_rule(TEXT))
    prompt = [1, *text_tokens("xyz")]
    pattern = "abcdefghijklmnopqrs?uvw"
    plain = _run(Engine(target, None, SpecConfig(mode="none")), prompt, Pattern(pattern))
    eng = Engine(target, None, SpecConfig(mode="lookup", draft_max=8))
    got = _run(eng, prompt, Pattern(pattern))
    assert got.tokens == plain.tokens
    forced = [int(k.split(":")[1]) for k in got.stats.modes_used if k.startswith("forced:")]
    assert forced and max(forced) >= 8, got.stats.modes_used
    assert got.stats.target_passes <= 5 < plain.stats.target_passes


def test_sampling_never_leaves_the_grammar():
    target = FakeModel(cycle_rule(TEXT), peak=2.0)
    draft = FakeModel(cycle_rule(TEXT[::-1]), peak=2.0, seed=5)
    eng = Engine(target, draft, SpecConfig(mode="draft", draft_max=4, draft_p_min=0.0))
    for seed in range(20):
        params = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        r = _run(eng, [1], Pattern("??? ?? ?", free="abc"), params=params)
        assert r.finish_reason == "eos"
        assert all(ch in "abc " for ch in r.text) and r.text[3] == " ", r.text


def test_mask_keeps_exactly_the_admitted_top_k():
    logits = np.arange(64, dtype=np.float32)[::-1].copy()  # token 0 highest
    con = Pattern("?", free="xyz")  # only x, y, z (low logits) admitted
    out = C.mask(con, logits, SamplingParams(temp=1.0, top_k=2))
    kept = np.flatnonzero(np.isfinite(out))
    ids = [ALPHABET.index(c) + 3 for c in "xyz"]
    assert set(kept) >= set(sorted(ids)[:2]) and set(kept) <= set(ids)
    assert C.argmax(con, logits) == min(ids)
    assert C.argmax(Pattern(""), logits) == EOS  # only EOS admitted at the end


# -- the real grammar sampler ----------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "hobbies"],
}
PERSON = "Extract as JSON: Maria Lopez is a 34 year old architect from Lisbon who likes jazz."


def test_schema_keywords_the_grammar_cannot_honour_are_refused():
    from specrun.llama.grammar import GrammarError, schema_to_gbnf

    assert "root" in schema_to_gbnf(SCHEMA)
    for bad, word in (
        ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
        ({"type": "array", "items": {"type": "integer", "multipleOf": 3}}, "multipleOf"),
        ({"type": "string", "format": "email"}, "email"),
        ({"not": {"type": "string"}}, "not"),
    ):
        with pytest.raises(GrammarError, match=word) as err:
            schema_to_gbnf(bad)
        assert err.value.param and err.value.param.startswith("schema")


@pytest.mark.models
def test_an_invalid_grammar_is_one_clear_error(smol_target):
    from specrun.llama.grammar import Grammar, GrammarError

    with pytest.raises(GrammarError, match="invalid grammar"):
        Grammar.compile(smol_target, 'root ::= "a')
    with pytest.raises(GrammarError, match="invalid grammar"):
        Grammar.compile(smol_target, "root ::= undefined-rule")


@pytest.mark.models
@pytest.mark.parametrize("mode", ["draft", "lookup", "auto"])
def test_json_schema_greedy_identical_in_every_mode_on_the_real_pair(smol_target, smol_draft, mode):
    from specrun.chat_template import encode_chat
    from specrun.llama.grammar import Grammar, schema_to_gbnf

    gbnf = schema_to_gbnf(SCHEMA)
    prompt = encode_chat(smol_target, [{"role": "user", "content": PERSON}])
    alone = Engine(smol_target, None, SpecConfig(mode="none"))
    want = alone.run(
        prompt, max_tokens=96, params=GREEDY, reuse_cache=False,
        constraint=Grammar.compile(smol_target, gbnf),
    )  # fmt: skip
    obj = json.loads(want.text)
    assert set(obj) == {"name", "age", "city", "hobbies"} and isinstance(obj["age"], int)
    eng = Engine(smol_target, smol_draft, SpecConfig(mode=mode, draft_max=8))
    got = eng.run(
        prompt, max_tokens=96, params=GREEDY, reuse_cache=False,
        constraint=Grammar.compile(smol_target, gbnf),
    )  # fmt: skip
    assert got.tokens == want.tokens
    assert any(k.startswith("forced") for k in got.stats.modes_used)
