"""The request fields that shape the output: ``tools`` / ``tool_choice`` / ``parallel_tool_calls``,
``response_format`` (json_object, json_schema) and llama-server's ``grammar`` / ``json_schema``.
Each is validated here (a 400 naming the field) and the grammar it asks for is built: GBNF that
the engine applies to the target's rows (decoding/constraint.py), so speculation stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specrun.llama.grammar import JSON_OBJECT_GBNF, GrammarError, schema_to_gbnf
from specrun.server.errors import bad
from specrun.tools import call_grammar


@dataclass
class Structured:
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "none"  # "none" | "auto" | "required" | "function"
    tool_name: str | None = None  # tool_choice naming one function
    parallel: bool = True
    gbnf: str | None = None  # the grammar of the whole reply (tool grammars: see with_format)
    gbnf_param: str = "grammar"  # the field it came from, for a 400 on compile
    fmt: str | None = None  # the model's tool-call format (tools.detect_format), once known

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_call(self) -> bool:
        return self.tool_choice in ("required", "function")

    def call_grammar(self, fmt: str) -> str:
        """The grammar of a reply that is a call (tool_choice required or named)."""
        tools = self.tools
        if self.tool_choice == "function":
            tools = [t for t in tools if t["function"]["name"] == self.tool_name]
        return call_grammar(fmt, tools, self.parallel, schema_to_gbnf)


def _kind(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(v), type(v).__name__
    )


def _schema_gbnf(schema: Any, param: str) -> str:
    try:
        return schema_to_gbnf(schema, param)
    except GrammarError as exc:
        raise bad(str(exc), exc.param or param) from None


def parse_tools(v: Any) -> list[dict[str, Any]]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise bad(f"tools must be an array, got {_kind(v)}", "tools", "invalid_type")
    out, names = [], set()
    for i, t in enumerate(v):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(f"{p} must be an object, got {_kind(t)}", p, "invalid_type")
        if t.get("type", "function") != "function":
            raise bad(f"{p}.type: only function tools are supported", f"{p}.type")
        f = t.get("function")
        if not isinstance(f, dict):
            raise bad(f"{p}.function is required (an object)", f"{p}.function")
        name = f.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"{p}.function.name is required (a non-empty string)", f"{p}.function.name")
        if name in names:
            raise bad(f"{p}.function.name: {name!r} is declared twice", f"{p}.function.name")
        names.add(name)
        params = f.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad(f"{p}.function.parameters must be a JSON schema object", f"{p}.function")
            _schema_gbnf(params, f"{p}.function.parameters")  # refused here, not mid-reply
        fn = {"name": name, "parameters": params or {"type": "object", "properties": {}}}
        if isinstance(f.get("description"), str):
            fn["description"] = f["description"]
        out.append({"type": "function", "function": fn})
    return out


def parse_structured(body: dict[str, Any], kind: str) -> Structured:
    s = Structured()
    if kind == "chat":
        s.tools = parse_tools(body.get("tools"))
        choice = body.get("tool_choice")
        if choice is None:
            s.tool_choice = "auto" if s.tools else "none"
        elif isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise bad(
                    f"tool_choice must be none, auto, required or a function, got {choice!r}",
                    "tool_choice",
                )
            s.tool_choice = choice
        elif isinstance(choice, dict):
            f = choice.get("function")
            name = f.get("name") if isinstance(f, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise bad(
                    'tool_choice must name a function as {"type": "function", "function": '
                    '{"name": ...}}',
                    "tool_choice",
                )
            s.tool_choice, s.tool_name = "function", name
        else:
            raise bad(
                f"tool_choice must be a string or an object, got {_kind(choice)}", "tool_choice"
            )
        if s.tool_choice != "none" and not s.tools:
            raise bad(f"tool_choice {choice!r} needs tools", "tool_choice")
        if s.tool_name is not None and s.tool_name not in {t["function"]["name"] for t in s.tools}:
            raise bad(f"tool_choice names {s.tool_name!r}, which is not in tools", "tool_choice")
        ptc = body.get("parallel_tool_calls")
        if ptc is not None:
            if not isinstance(ptc, bool):
                raise bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
            s.parallel = ptc

    sources: list[tuple[str, str]] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise bad("response_format must be an object with a type", "response_format")
        t = rf["type"]
        if t == "json_object":
            schema = rf.get("schema")  # llama-server's extension
            if schema is not None:
                sources.append(
                    ("response_format.schema", _schema_gbnf(schema, "response_format.schema"))
                )
            else:
                sources.append(("response_format", JSON_OBJECT_GBNF))
        elif t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise bad(
                    "response_format.json_schema is required (an object with name and schema)",
                    "response_format.json_schema",
                )
            schema = js.get("schema")
            if not isinstance(schema, dict | bool):
                raise bad(
                    "response_format.json_schema.schema is required (a JSON schema object)",
                    "response_format.json_schema.schema",
                )
            p = "response_format.json_schema.schema"
            sources.append((p, _schema_gbnf(schema, p)))
        elif t != "text":
            raise bad(
                f"response_format.type must be text, json_object or json_schema, got {t!r}",
                "response_format.type",
            )
    if body.get("json_schema") is not None:
        sources.append(("json_schema", _schema_gbnf(body["json_schema"], "json_schema")))
    g = body.get("grammar")
    if g is not None and g != "":
        if not isinstance(g, str):
            raise bad(f"grammar must be a GBNF string, got {_kind(g)}", "grammar", "invalid_type")
        sources.append(("grammar", g))
    if s.forces_call:
        sources.append(("tool_choice", ""))  # built once the model's format is known
    if len(sources) > 1:
        names = ", ".join(n for n, _ in sources)
        raise bad(f"{names}: give one way to constrain the reply, not several", sources[1][0])
    if sources and sources[0][0] != "tool_choice":
        s.gbnf_param, s.gbnf = sources[0]
    return s
