"""Tool calling as the model families write it: which format a chat template speaks, the grammar
that forces a call (``tool_choice`` required or a named function), and the parser that turns the
model's text into OpenAI's ``tool_calls``. The formats follow llama.cpp's common/chat.cpp:

- ``hermes`` (Qwen 2.5, Hermes 2/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call;
- ``llama3`` (Llama 3.1-3.3): a bare ``{"name": ..., "parameters": {...}}`` (after an optional
  ``<|python_tag|>``), several joined by ``;``;
- ``mistral`` (Mistral Nemo, Small): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

FORMATS = ("hermes", "llama3", "mistral")
_START = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "{"}


def detect_format(template: str | None) -> str | None:
    """The tool-call format a chat template writes, or None when it renders no tools at all."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|start_header_id|>" in template or "<|python_tag|>" in template:
        return "llama3"
    return "hermes" if "tool_call" in template else None


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(obj: Any, names: set[str], args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names and obj["name"] not in names:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    cid = obj["id"] if isinstance(obj.get("id"), str) and obj["id"] else new_call_id()
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), cid)


_DECODER = json.JSONDecoder()


def _objects(text: str) -> list[tuple[int, int, Any]]:
    """Every JSON value that starts at a ``{`` or ``[`` of ``text``, outermost only: (start,
    end, value)."""
    out: list[tuple[int, int, Any]] = []
    i = 0
    while True:
        m = re.search(r"[\[{]", text[i:])
        if m is None:
            return out
        start = i + m.start()
        try:
            value, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            i = start + 1
            continue
        out.append((start, end, value))
        i = end


def _bare_calls(text: str, names: set[str], args_key: str) -> tuple[str, list[ToolCall]]:
    """A reply that is nothing but call objects (``;`` or newlines between them): its calls."""
    rest = text.replace("<|python_tag|>", "").strip()
    calls = []
    while rest.startswith("{"):
        try:
            obj, end = _DECODER.raw_decode(rest)
        except json.JSONDecodeError:
            break
        c = _call(obj, names, args_key)
        if c is None:
            break
        calls.append(c)
        rest = rest[end:].lstrip().removeprefix(";").lstrip()
    if calls and not rest:
        return "", calls
    return text, []


def parse(fmt: str, text: str, tools: Sequence[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
    """(content, calls): the model's text split into what it said and the calls it made. Text
    that only looks like a call (an unknown function, broken JSON) stays content."""
    names = {t["function"]["name"] for t in tools}
    if fmt == "hermes":
        calls: list[ToolCall] = []
        spans = []
        for m in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S):
            try:
                c = _call(json.loads(m.group(1)), names)
            except json.JSONDecodeError:
                c = None
            if c is not None:
                calls.append(c)
                spans.append((m.start(), m.end()))
        content = text
        for a, b in reversed(spans):
            content = content[:a] + content[b:]
        if not calls:  # small models often drop the tags: a reply that is only call objects
            return _bare_calls(text, names, "arguments")
        return content.strip(), calls
    if fmt == "mistral":
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return text, []
        objs = _objects(text[at + len("[TOOL_CALLS]") :])
        if not objs or not isinstance(objs[0][2], list):
            return text, []
        calls = [c for c in (_call(o, names) for o in objs[0][2]) if c is not None]
        return (text[:at].strip() if calls else text), calls
    if fmt == "llama3":
        return _bare_calls(text, names, "parameters")
    raise ValueError(f"unknown tool-call format {fmt!r}")


class HoldBack:
    """Streams a reply's text while it can be content, and holds back from where a tool call may
    begin (the format's opening text, or a prefix of it at the end of what came): those
    characters come out as ``tool_calls`` at the end, or as content if they were not a call."""

    def __init__(self, fmt: str, everything: bool = False) -> None:
        self.start = _START[fmt]
        self.fmt = fmt
        self.everything = everything  # tool_choice required / named: all of it is the call
        self.text = ""
        self.sent = 0
        self.held = everything

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.held:
            return ""
        if self.fmt in ("llama3", "hermes") and not self.sent:
            # A reply that is a bare call object: decided by its first non-blank character.
            if not self.text.strip():
                return ""
            if self.text.lstrip().startswith(("{", "<|python_tag|>")):
                self.held = True
                return ""
        at = self.text.find(self.start, self.sent)
        if at >= 0:
            self.held = True
            out = self.text[self.sent : at]
            self.sent = at
            return out
        # Keep back a tail that could be the opening's first characters.
        keep = 0
        for n in range(min(len(self.start) - 1, len(self.text) - self.sent), 0, -1):
            if self.start.startswith(self.text[-n:]):
                keep = n
                break
        out = self.text[self.sent : len(self.text) - keep]
        self.sent = len(self.text) - keep
        return out

    def finish(self, tools: Sequence[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
        """What is left to send as content, and the calls."""
        held = self.text[self.sent :]
        content, calls = parse(self.fmt, held, tools)
        return (content if calls else held), calls


# -- grammars --------------------------------------------------------------------------------
def call_schema(tools: Sequence[dict[str, Any]], args_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call to any of ``tools``."""
    options = []
    for t in tools:
        f = t["function"]
        params = f.get("parameters") or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def call_grammar(
    fmt: str,
    tools: Sequence[dict[str, Any]],
    parallel: bool,
    schema_to_gbnf: Callable[[Any, str], str],
) -> str:
    """GBNF for a reply that is one call (``parallel``: one or more) to ``tools``."""
    args_key = "parameters" if fmt == "llama3" else "arguments"
    body = schema_to_gbnf(call_schema(tools, args_key), "tools")
    # json-schema-to-grammar names its start rule root: it becomes the call rule.
    body = re.sub(r"^root\s*::=", "call ::=", body, count=1, flags=re.M)
    more = {
        "hermes": '("\\n<tool_call>\\n" call "\\n</tool_call>")*',
        "mistral": '("," call)*',
        "llama3": '(";" call)*',
    }[fmt]
    head = {
        "hermes": 'root ::= "<tool_call>\\n" call "\\n</tool_call>"',
        "mistral": 'root ::= "[TOOL_CALLS][" call',
        "llama3": "root ::= call",
    }[fmt]
    tail = ' "]"' if fmt == "mistral" else ""
    return f"{head} {more if parallel else ''}{tail}\n{body}"
