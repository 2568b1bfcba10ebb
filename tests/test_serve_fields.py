"""Every documented request field of OpenAI's routes and llama-server's, in one table: each is
honoured (the response changes as documented) or answered with a 400 naming it.

The server runs in-process (starlette's TestClient) on the fake models of tests/fakes.py, with
speculation on (mode draft): what a field does, it does through the verify path. The fake's
vocabulary has two extra tokens that print ``<think>`` and ``</think>``; after a ``?`` the target
writes ``<think>hm</think>ok`` and ends, so reasoning_format has something to split.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest

pytest.importorskip("fastapi")

from fakes import EOS, FakeModel, cycle_rule, text_tokens  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from specrun.decoding.engine import Engine, SpecConfig  # noqa: E402
from specrun.decoding.sampling import SamplingParams  # noqa: E402
from specrun.server.app import ServerState, create_app  # noqa: E402
from specrun.server.worker import EngineWorker  # noqa: E402

OPEN, CLOSE = 60, 61
QMARK = text_tokens("?")[0]
SCRIPT = [OPEN, *text_tokens("hm"), CLOSE, *text_tokens("ok"), EOS]
TEXT = "the cat sat on the mat, "
END_AT = 60  # the story ends (EOS) at this context length: ignore_eos has something to ignore
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if shout %}!!{% endif %}"
T = text_tokens("t")[0]


class ThinkingFake(FakeModel):
    def piece(self, token: int) -> bytes:
        return {OPEN: b"<think>", CLOSE: b"</think>"}.get(token, super().piece(token))


def rule(ctx: Sequence[int]) -> int:
    if QMARK in ctx:
        n = len(ctx) - 1 - max(i for i, t in enumerate(ctx) if t == QMARK)
        return SCRIPT[n] if n < len(SCRIPT) else EOS
    return cycle_rule(TEXT, end_after=END_AT)(ctx)


@pytest.fixture(scope="module")
def client() -> Any:
    target = ThinkingFake(rule, template=TEMPLATE, peak=4.5)
    draft = ThinkingFake(rule, seed=1, template=TEMPLATE, peak=4.5)
    engine = Engine(target, draft, SpecConfig(mode="draft", draft_max=4, draft_p_min=0.0))
    # The server's defaults as `specrun serve` has them: llama-server's sampling values.
    state = ServerState(defaults=SamplingParams(temp=0.8, top_k=40, top_p=0.95, min_p=0.05))
    state.n_ctx = target.n_ctx
    state.worker = EngineWorker(engine, 8, lambda *a: None)
    with pytest.MonkeyPatch.context() as mp:
        # llama-server's prompt echo writes special tokens out through llama.cpp; the fake's own
        # pieces stand in for it.
        mp.setattr("specrun.server.native.special_piece", lambda model, t: model.piece(t))
        with TestClient(create_app(state)) as c:
            yield c
    state.worker.stop()


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
NATIVE = "/completion"
BASE: dict[str, dict[str, Any]] = {
    CHAT: {
        "messages": [{"role": "user", "content": "the cat"}],
        "max_tokens": 16,
        "temperature": 0,
    },
    CMPL: {"prompt": "the cat", "max_tokens": 16, "temperature": 0},
    NATIVE: {"prompt": "the cat", "n_predict": 16, "temperature": 0},
}


def text(r: dict[str, Any]) -> str:
    if "content" in r and "choices" not in r:
        return str(r["content"])
    c = r["choices"][0]
    return str(c["message"]["content"] if "message" in c else c["text"])


def n_out(r: dict[str, Any]) -> int:
    return int(
        r["tokens_predicted"] if "tokens_predicted" in r else r["usage"]["completion_tokens"]
    )


def finish(r: dict[str, Any]) -> str:
    return str(r["stop_type"] if "stop_type" in r else r["choices"][0]["finish_reason"])


def differs(r: dict[str, Any], base: dict[str, Any]) -> bool:
    return text(r) != text(base)


def no_t(r: dict[str, Any], base: dict[str, Any]) -> bool:
    return "t" in text(base) and "t" not in text(r)


def chat_logprobs(top: int) -> Callable[[dict[str, Any], dict[str, Any]], bool]:
    def check(r: dict[str, Any], base: dict[str, Any]) -> bool:
        lp = r["choices"][0]["logprobs"]["content"]
        return (
            len(lp) == n_out(r)
            and "".join(e["token"] for e in lp) == text(r)
            and all(len(e["top_logprobs"]) == top and e["logprob"] <= 0 for e in lp)
            and base["choices"][0]["logprobs"] is None
        )

    return check


def legacy_logprobs(r: dict[str, Any], base: dict[str, Any]) -> bool:
    lp = r["choices"][0]["logprobs"]
    return (
        "".join(lp["tokens"]) == text(r)
        and all(len(t) == 2 for t in lp["top_logprobs"])
        and lp["text_offset"][0] == 0
    )


def native_probs(key: str, top: str) -> Callable[[dict[str, Any], dict[str, Any]], bool]:
    def check(r: dict[str, Any], base: dict[str, Any]) -> bool:
        cp = r["completion_probabilities"]
        return (
            len(cp) == n_out(r)
            and all(key in e and len(e[top]) == 2 for e in cp)
            and "completion_probabilities" not in base
        )

    return check


def runs_on(r: dict[str, Any], base: dict[str, Any]) -> bool:
    return finish(base) in ("stop", "eos") and finish(r) in ("length", "limit") and n_out(r) == 60


def capped(r: dict[str, Any], base: dict[str, Any]) -> bool:
    return finish(r) in ("length", "limit") and n_out(r) > 16


def three(r: dict[str, Any], base: dict[str, Any]) -> bool:
    return n_out(r) == 3


def longer_prompt(r: dict[str, Any], base: dict[str, Any]) -> bool:
    return bool(r["usage"]["prompt_tokens"] > base["usage"]["prompt_tokens"])


REFUSED = "400"
ROWS: list[tuple[str, str, Any, Any]] = [
    # -- OpenAI's chat completions (and llama-server's extras on that route) --
    (CHAT, "frequency_penalty", 2.0, differs),
    (CHAT, "presence_penalty", 2.0, differs),
    (CHAT, "repeat_penalty", 4.0, differs),
    (CHAT, "logit_bias", {str(T): -100}, no_t),
    (CHAT, "logit_bias", [[T, False]], no_t),  # llama-server's pairs, false = never
    (CHAT, "logit_bias", {"t": -100}, no_t),  # llama-server: a text's tokens
    (CHAT, "ignore_eos", True, runs_on),
    (CHAT, "n_predict", 3, three),
    (CHAT, "max_tokens", 3, three),
    (CHAT, "max_completion_tokens", 3, three),
    (CHAT, "max_tokens", 10**9, capped),  # past the context: capped, not refused
    (CHAT, "logprobs", True, chat_logprobs(0)),
    (CHAT, "chat_template_kwargs", {"shout": True}, longer_prompt),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}, REFUSED),
    (CHAT, "modalities", ["text", "audio"], REFUSED),
    (CHAT, "prediction", {"type": "content", "content": "x"}, REFUSED),
    (CHAT, "functions", [{"name": "f", "parameters": {}}], REFUSED),
    (CHAT, "function_call", "auto", REFUSED),
    (CHAT, "top_logprobs", 3, REFUSED),  # without logprobs: true
    (CHAT, "reasoning_format", "html", REFUSED),
    (CHAT, "logit_bias", {"99999": 1}, REFUSED),  # outside the vocabulary
    (CHAT, "logit_bias", {str(T): 101}, REFUSED),
    (CHAT, "frequency_penalty", 3.0, REFUSED),  # OpenAI's range is [-2, 2]
    # -- OpenAI's legacy completions --
    (CMPL, "frequency_penalty", 2.0, differs),
    (CMPL, "logit_bias", {str(T): -100}, no_t),
    (CMPL, "ignore_eos", True, runs_on),
    (CMPL, "n_predict", 3, three),
    (CMPL, "logprobs", 2, legacy_logprobs),
    (CMPL, "echo", True, REFUSED),
    (CMPL, "suffix", "x", REFUSED),
    (CMPL, "best_of", 2, REFUSED),
    (CMPL, "chat_template_kwargs", {"shout": True}, REFUSED),
    # -- llama-server's /completion --
    (NATIVE, "repeat_penalty", 4.0, differs),
    (NATIVE, "frequency_penalty", 2.0, differs),
    (NATIVE, "presence_penalty", 2.0, differs),
    (NATIVE, "logit_bias", [[T, False]], no_t),
    (NATIVE, "ignore_eos", True, runs_on),
    (NATIVE, "n_predict", 3, three),
    (NATIVE, "n_predict", 10**9, capped),
    (NATIVE, "n_probs", 2, native_probs("logprob", "top_logprobs")),
    (NATIVE, "dry_multiplier", 0.5, REFUSED),
    (NATIVE, "mirostat", 2, REFUSED),
    (NATIVE, "typical_p", 0.5, REFUSED),
    (NATIVE, "xtc_probability", 0.5, REFUSED),
    (NATIVE, "no_such_field", 1, REFUSED),
]


def post(client: Any, route: str, body: dict[str, Any]) -> Any:
    return client.post(route, json=body)


@pytest.mark.parametrize(("route", "name", "value", "expect"), ROWS)
def test_every_field_honoured_or_refused(
    client: Any, route: str, name: str, value: Any, expect: Any
) -> None:
    base = dict(BASE[route])
    if expect is runs_on:
        base["max_tokens" if route != NATIVE else "n_predict"] = 60
        base.pop("max_tokens" if route == NATIVE else "n_predict", None)
    if expect is capped:
        base["ignore_eos"] = True  # to the end of the context
    r = post(client, route, {**base, name: value})
    if expect == REFUSED:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"].split(".")[0].split("[")[0] == name and name in err["message"]
        return
    assert r.status_code == 200, r.text
    b = post(client, route, base)
    assert b.status_code == 200, b.text
    assert expect(r.json(), b.json()), (r.json(), b.json())


def test_repeat_last_n_zero_turns_the_penalties_off(client: Any) -> None:
    base = post(client, CHAT, BASE[CHAT]).json()
    off = post(client, CHAT, {**BASE[CHAT], "repeat_penalty": 4.0, "repeat_last_n": 0}).json()
    assert text(off) == text(base)


def test_top_logprobs(client: Any) -> None:
    r = post(client, CHAT, {**BASE[CHAT], "logprobs": True, "top_logprobs": 3}).json()
    assert chat_logprobs(3)(r, post(client, CHAT, BASE[CHAT]).json())
    assert all(
        e["top_logprobs"][0]["token"] == e["token"] for e in r["choices"][0]["logprobs"]["content"]
    )


def test_post_sampling_probs(client: Any) -> None:
    body = {**BASE[NATIVE], "n_probs": 2, "post_sampling_probs": True, "temperature": 0.8}
    r = post(client, NATIVE, body).json()
    assert native_probs("prob", "top_probs")(r, {})
    assert all(0 < e["prob"] <= 1 for e in r["completion_probabilities"])


def test_streamed_logprobs_cover_every_token(client: Any) -> None:
    body = {**BASE[CHAT], "logprobs": True, "stream": True}
    with client.stream("POST", CHAT, json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    toks = [
        e
        for ev in events
        for c in ev["choices"]
        if c.get("logprobs")
        for e in c["logprobs"]["content"]
    ]
    said = "".join(c["delta"].get("content") or "" for ev in events for c in ev["choices"])
    assert "".join(e["token"] for e in toks) == said
    with client.stream("POST", NATIVE, json={**BASE[NATIVE], "n_probs": 1, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    probs = [p for ev in events for p in ev.get("completion_probabilities", [])]
    assert [p["id"] for p in probs] == [t for ev in events[:-1] for t in ev["tokens"]]


# -- reasoning ------------------------------------------------------------------------------------
ASK = {"messages": [{"role": "user", "content": "why?"}], "max_tokens": 16, "temperature": 0}


def test_thinking_goes_to_reasoning_content_by_default(client: Any) -> None:
    m = post(client, CHAT, ASK).json()["choices"][0]["message"]
    assert m["reasoning_content"] == "hm" and m["content"] == "ok"
    m = post(client, CHAT, {**ASK, "reasoning_format": "deepseek"}).json()["choices"][0]["message"]
    assert m["reasoning_content"] == "hm" and m["content"] == "ok"


def test_reasoning_format_none_keeps_it_in_content(client: Any) -> None:
    m = post(client, CHAT, {**ASK, "reasoning_format": "none"}).json()["choices"][0]["message"]
    assert m["content"] == "<think>hm</think>ok" and "reasoning_content" not in m
    m = post(client, CHAT, {**ASK, "reasoning_format": "deepseek-legacy"}).json()
    m = m["choices"][0]["message"]
    assert m["content"] == "<think>hm</think>ok" and m["reasoning_content"] == "hm"


def test_reasoning_streams_as_reasoning_content_deltas(client: Any) -> None:
    with client.stream("POST", CHAT, json={**ASK, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["delta"] for ev in events for c in ev["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "hm"
    assert "".join(d.get("content") or "" for d in deltas) == "ok"


def test_the_splitter_holds_a_tag_cut_between_steps() -> None:
    from specrun.server.responses import ReasoningStream, split_reasoning

    s = ReasoningStream(False)
    parts = []
    for piece in [" <th", "ink>a", "b</th", "ink>", " c", "d"]:
        parts += s.feed(piece)
    parts += s.finish()
    got: dict[str, str] = {}
    for k, v in parts:
        got[k] = got.get(k, "") + v
    assert got == {"reasoning_content": "ab", "content": "cd"}
    assert split_reasoning("x</think>y", True) == ("x", "y")  # the template opened it
    assert split_reasoning("plain", False) == (None, "plain")


# -- defaults a client expects ------------------------------------------------------------------------
def test_no_temperature_samples_with_the_server_defaults(client: Any) -> None:
    body = {k: v for k, v in BASE[CHAT].items() if k != "temperature"}
    body["max_tokens"] = 40
    greedy = text(post(client, CHAT, BASE[CHAT] | {"max_tokens": 40}).json())
    outs = {text(post(client, CHAT, {**body, "seed": s}).json()) for s in range(8)}
    assert len(outs - {greedy}) >= 1  # sampled at 0.8, not greedy


def test_the_context_is_the_trained_one_fitted_to_free_memory() -> None:
    from specrun.models.memory import (
        FIT_SHARE,
        FIT_STEP,
        ModelShape,
        Placement,
        Planned,
        estimate,
        fit_ctx,
    )

    shape = ModelShape(
        arch="llama", n_layer=30, n_ctx_train=32768, n_embd=576, n_head=9, n_vocab=49152,
        kv_width=(3 * 128,) * 30, weight_bytes=270 << 20, file_bytes=270 << 20,
    )  # fmt: skip
    pl = Placement(n_ctx=4096)
    plan = [
        Planned("t", shape, pl, estimate(shape, pl)),
        Planned("d", shape, pl, estimate(shape, pl)),
    ]
    roomy = fit_ctx(plan, 64 << 30)
    assert roomy.n_ctx == 32768 and not roomy.reduced
    tight = fit_ctx(plan, 1 << 30)
    assert tight.reduced and tight.n_ctx % FIT_STEP == 0 and 512 <= tight.n_ctx < 32768
    assert tight.need <= (1 << 30) * FIT_SHARE
    more = sum(estimate(p.shape, Placement(n_ctx=tight.n_ctx + FIT_STEP)).total for p in plan)
    assert more > (1 << 30) * FIT_SHARE  # the largest that fits
