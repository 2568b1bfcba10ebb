"""Agents against `specrun serve`: tool calls and constrained output with real clients (the
`openai` package, the `llm` CLI), on Qwen2.5-Coder-0.5B-Instruct (a tool-calling template), the
server started and stopped here on 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from typing import Any

import pytest
from conftest import THREADS
from test_serve import Server

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

pytestmark = pytest.mark.models

QWEN = ["--pair", "qwen2.5-coder-0.5b", "-t", str(THREADS), "--ctx", "2048", "--port", "0"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


class QwenServer(Server):
    def __init__(self, *extra: str) -> None:
        super().__init__(*extra, base=["serve", *QWEN])


@pytest.fixture(scope="module")
def server(model_path):  # type: ignore[no-untyped-def]
    model_path("qwen2.5-coder-0.5b-instruct-f16")
    model_path("qwen2.5-coder-0.5b-instruct-q4_k_m")
    s = QwenServer("--queue", "8")
    try:
        yield s
    finally:
        assert s.stop(signal.SIGINT) == 0, s.log()


@pytest.fixture(scope="module")
def client(server):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_a_tool_round_trip_with_the_openai_client(client) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(
        model="x", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=96
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] == "Paris"
    # The tool's answer goes back; the model answers in words (tool_choice none: this 0.5B model,
    # offered the tools again, calls them again).
    messages = [
        *ASK,
        c.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "cloudy"}'},
    ]
    r2 = client.chat.completions.create(
        model="x", messages=messages, tools=[WEATHER, TIME], tool_choice="none",
        temperature=0, max_tokens=64,
    )  # fmt: skip
    c2 = r2.choices[0]
    assert c2.finish_reason in ("stop", "length") and not c2.message.tool_calls, c2
    assert "18" in c2.message.content or "cloud" in c2.message.content.lower()


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client) -> None:  # type: ignore[no-untyped-def]
    whole = client.chat.completions.create(
        model="x", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=96
    )
    want = whole.choices[0].message.tool_calls[0].function
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", None
    with client.chat.completions.create(
        model="x", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=96, stream=True
    ) as stream:
        for chunk in stream:
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert "<tool_call>" not in content
    assert calls == {0: {"name": want.name, "arguments": want.arguments}}


def test_tool_choice_required_and_named_force_a_call(client) -> None:  # type: ignore[no-untyped-def]
    chat = [{"role": "user", "content": "Say hello."}]
    req = client.chat.completions.create(
        model="x", messages=chat, tools=[WEATHER, TIME], tool_choice="required",
        temperature=0, max_tokens=64, parallel_tool_calls=False,
    )  # fmt: skip
    assert req.choices[0].finish_reason == "tool_calls"
    assert len(req.choices[0].message.tool_calls) == 1
    named = client.chat.completions.create(
        model="x", messages=ASK, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0, max_tokens=64,
    )  # fmt: skip
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and "zone" in json.loads(call.function.arguments)
    none = client.chat.completions.create(
        model="x", messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=24
    )
    assert none.choices[0].finish_reason in ("stop", "length")
    assert not none.choices[0].message.tool_calls


class Person(pydantic.BaseModel):  # type: ignore[misc,name-defined]
    name: str
    age: int
    city: str


def test_parse_returns_a_pydantic_object(client) -> None:  # type: ignore[no-untyped-def]
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(
        model="x",
        messages=[{"role": "user", "content": "Maria Lopez, 34, lives in Lisbon. As JSON."}],
        response_format=Person,
        temperature=0,
        max_tokens=64,
    )
    p = r.choices[0].message.parsed
    assert isinstance(p, Person) and p.age == 34 and "Maria" in p.name


def test_schema_output_is_the_constrained_targets_in_every_mode(server) -> None:  # type: ignore[no-untyped-def]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "hobbies"],
    }  # fmt: skip
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Tom likes chess and cycling. As JSON."}],
        "temperature": 0,
        "max_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    }
    out = {}
    for mode in ("none", "auto", "draft", "lookup"):
        r = server.post(
            "/v1/chat/completions", {**body, "specrun": {"mode": mode, "return_tokens": True}}
        )
        assert r.status_code == 200, r.text
        out[mode] = r.json()["choices"][0]
    obj = json.loads(out["none"]["message"]["content"])
    assert set(obj) == {"name", "hobbies"}
    assert all(o["tokens"] == out["none"]["tokens"] for o in out.values())
    # llama-server's own field names do the same.
    r = server.post(
        "/v1/chat/completions",
        {k: v for k, v in body.items() if k != "response_format"} | {"json_schema": schema},
    )
    assert r.json()["choices"][0]["message"]["content"] == out["none"]["message"]["content"]
    g = server.post(
        "/v1/completions",
        {"prompt": "The answer is", "grammar": 'root ::= " yes" | " no"', "max_tokens": 8},
    )
    assert g.status_code == 200 and g.json()["choices"][0]["text"] in (" yes", " no")


@pytest.mark.parametrize(
    "extra,param,words",
    [
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name", "required"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "patternProperties": {}}}}}, "response_format.json_schema.schema.patternProperties", "patternProperties"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema", "required"),
        ({"grammar": 'root ::= "unterminated'}, "grammar", "invalid grammar"),
        ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "grammar", "one way"),
        ({"messages": [{"role": "tool", "tool_call_id": "call_x", "content": "{}"}]}, "messages[0].tool_call_id", "answers no tool call"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(server, extra, param, words) -> None:  # type: ignore[no-untyped-def]
    body = {"messages": ASK, "max_tokens": 4, **extra}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert (
        server.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 2}).status_code == 200
    )


def test_a_template_without_tools_is_a_400(model_path) -> None:  # type: ignore[no-untyped-def]
    from conftest import DEFAULT_TARGET, SMOL_DRAFT

    model_path(DEFAULT_TARGET)
    model_path(SMOL_DRAFT)
    s = Server()
    try:
        r = s.post("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER], "max_tokens": 4})
        assert r.status_code == 400 and "no tool support" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "tools"
    finally:
        s.stop()


@pytest.mark.skipif(shutil.which("llm") is None and not os.path.exists(
    os.path.join(os.path.dirname(os.sys.executable), "llm")), reason="the llm CLI is not installed")  # fmt: skip
def test_the_llm_cli_with_a_schema(server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`llm` pointed at the server through its OpenAI-compatible model configuration."""
    llm = shutil.which("llm") or os.path.join(os.path.dirname(os.sys.executable), "llm")
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: specrun\n  model_name: specrun\n  api_base: {server.url}/v1\n"
        "  supports_schema: true\n"
    )
    env = dict(os.environ, LLM_USER_PATH=str(tmp_path), OPENAI_API_KEY="none")
    p = subprocess.run(
        [llm, "-m", "specrun", "--schema", "name, age int", "-o", "temperature", "0",
         "Maria Lopez is 34 years old."],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert obj["age"] == 34 and "Maria" in obj["name"]
