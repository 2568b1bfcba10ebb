"""The server's request parsing without a model: defaults, llama-server's and specrun's extras,
and what is refused (tests/test_serve.py sends the same through a real server)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from specrun.decoding.sampling import SamplingParams  # noqa: E402
from specrun.server.errors import APIError  # noqa: E402
from specrun.server.requests import parse_json, parse_request  # noqa: E402

DEFAULTS = SamplingParams(temp=0.0, top_k=40, top_p=0.95, min_p=0.05, seed=1)
MSG = [{"role": "user", "content": "hi"}]


def chat(**body):  # type: ignore[no-untyped-def]
    return parse_request({"messages": MSG, **body}, "chat", DEFAULTS, 1024)


def test_defaults_come_from_the_server_options() -> None:
    r = chat()
    assert r.params.temp == 0.0 and r.params.top_k == 40 and r.max_tokens is None and r.n == 1
    assert not r.stream and r.spec == {} and r.cache_prompt
    r = chat(temperature=0.7, top_p=0.5, top_k=5, min_p=0.1, seed=9, max_tokens=20, stop="END", n=2)
    assert (r.params.temp, r.params.top_p, r.params.top_k, r.params.min_p, r.params.seed) == (
        0.7,
        0.5,
        5,
        0.1,
        9,
    )
    assert r.max_tokens == 20 and r.stop == ["END"] and r.n == 2


def test_max_completion_tokens_and_the_smaller_wins() -> None:
    assert chat(max_completion_tokens=7).max_tokens == 7
    assert chat(max_tokens=9, max_completion_tokens=7).max_tokens == 7


def test_speculative_and_specrun_extras() -> None:
    r = chat(
        speculative={"n_max": 6, "n_min": 1, "p_min": 0.5},
        specrun={"mode": "draft", "return_tokens": True},
    )
    assert (
        r.spec == {"draft_max": 6, "draft_min": 1, "draft_p_min": 0.5, "mode": "draft"}
        and r.return_tokens
    )
    assert chat(speculative={"n_max": 0}).spec == {"mode": "none"}


def test_content_parts_and_roles() -> None:
    r = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    assert r.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"audio": {"voice": "alloy"}}, "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_unsupported_is_refused_by_name(body, param) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(APIError) as e:
        chat(**body)
    assert (
        e.value.status == 400 and e.value.param == param and e.value.code == "unsupported_parameter"
    )


@pytest.mark.parametrize(
    "message,param,text",
    [
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id", "is required"),
        (
            {"role": "tool", "content": "x", "tool_call_id": "call_1"},
            "messages[0].tool_call_id",
            "answers no tool call of an earlier assistant message",
        ),
        ({"role": "wizard", "content": "x"}, "messages[0].role", "the role 'wizard' is not"),
        ({"role": "function", "content": "x"}, "messages[0].role", "legacy function-calling"),
    ],
)
def test_a_role_outside_the_five_is_refused(message, param, text) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(APIError) as e:
        parse_request({"messages": [message]}, "chat", DEFAULTS, 1024)
    assert e.value.status == 400 and e.value.param == param and text in str(e.value)


def test_harmless_defaults_of_clients_pass() -> None:
    chat(
        logprobs=False,
        response_format={"type": "text"},
        presence_penalty=0,
        frequency_penalty=0.0,
        tools=[],
        parallel_tool_calls=True,
        user="u",
        store=False,
    )


def test_completion_prompts() -> None:
    assert parse_request({"prompt": "x"}, "completion", DEFAULTS, 64).prompt == "x"
    assert parse_request({"prompt": ["x"]}, "completion", DEFAULTS, 64).prompt == "x"
    assert parse_request({"prompt": [1, 2]}, "completion", DEFAULTS, 64).prompt == [1, 2]
    with pytest.raises(APIError):
        parse_request({"prompt": "x", "echo": True}, "completion", DEFAULTS, 64)


def test_bodies() -> None:
    for raw in (b"", b"{", b"[]", b"3", b"\xff"):
        with pytest.raises(APIError) as e:
            parse_json(raw)
        assert e.value.status == 400 and e.value.code == "invalid_json"
    assert parse_json(b'{"a": 1}') == {"a": 1}
