"""Request bodies of /v1/chat/completions and /v1/completions -> one validated ``GenRequest``.

Every field is checked by hand, so a bad one is answered with OpenAI's 400 naming it (``param``)
instead of a validation dump. Tools and constrained output are parsed in structured.py. Known
fields specrun cannot honour (audio, predicted outputs...) are refused, never silently ignored;
fields it does not know are ignored, as OpenAI-compatible servers do (clients send ``user``,
``store``, ``metadata``...). The penalties, ``logit_bias``, ``ignore_eos`` and the log
probabilities are honoured (decoding/penalties.py), on these routes and llama-server's.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

from specrun.decoding.engine import MAX_DRAFT, MODES
from specrun.decoding.sampling import SamplingParams
from specrun.server.errors import APIError, bad
from specrun.server.structured import Structured, parse_structured

MAX_N = 16  # completions per request (n)
MAX_STOP = 16  # stop strings per request
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# (field, what is supported instead): refused when present with a value that asks for something.
_REFUSED_CHAT: dict[str, str | None] = {
    "functions": "function calling",
    "function_call": "function calling",
    "audio": "audio output",
    "modalities": None,
    "prediction": "predicted outputs",
}
_REFUSED_COMPLETION: dict[str, str | None] = {
    "echo": "echo",
    "suffix": "suffix (fill-in-the-middle: POST /infill)",
    "best_of": "best_of",
}
REASONING_FORMATS = ("auto", "deepseek", "deepseek-legacy", "none")
MAX_TOP_LOGPROBS = 20


@dataclass
class GenRequest:
    kind: str  # "chat" | "completion"
    model: str | None
    messages: list[dict[str, Any]] | None  # chat
    prompt: str | list[int] | None  # completion: text or token ids
    max_tokens: int | None  # None: to the end of the context
    params: SamplingParams
    stop: list[str]
    n: int
    stream: bool
    include_usage: bool
    spec: dict[str, Any] = field(default_factory=dict)  # Engine.configure changes
    return_tokens: bool = False
    cache_prompt: bool = True
    structured: Structured = field(default_factory=Structured)  # tools, response_format, grammar
    logprobs: bool = False  # report each token's log probability (params.n_probs: how many top)
    logit_bias: list[tuple[int | str, float]] = field(default_factory=list)  # resolve_bias
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    reasoning_format: str = "auto"  # chat: <think>...</think> to reasoning_content unless "none"
    thinking_open: bool = False  # the prompt ends inside <think> (the template opened it)


def parse_json(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise bad("the request body is empty; send a JSON object", None, "invalid_json")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad(
            f"the request body must be a JSON object, got {type(body).__name__}",
            None,
            "invalid_json",
        )
    return body


def _kind(v: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }.get(type(v), type(v).__name__)


def _int(body: dict[str, Any], name: str, lo: int, hi: int, param: str | None = None) -> int | None:
    v = body.get(name)
    param = param or name
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{param} must be an integer, got {_kind(v)}", param, "invalid_type")
    if not lo <= v <= hi:
        raise bad(f"{param} must be in [{lo}, {hi}], got {v}", param)
    return v


def _num(
    body: dict[str, Any],
    name: str,
    lo: float,
    hi: float,
    param: str | None = None,
    lo_open: bool = False,
) -> float | None:
    v = body.get(name)
    param = param or name
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(f"{param} must be a number, got {_kind(v)}", param, "invalid_type")
    v = float(v)
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        raise bad(f"{param} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v:g}", param)
    return v


def _bool(body: dict[str, Any], name: str, param: str | None = None) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad(
            f"{param or name} must be a boolean, got {_kind(v)}", param or name, "invalid_type"
        )
    return v


def _obj(body: dict[str, Any], name: str) -> dict[str, Any]:
    v = body.get(name)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad(f"{name} must be an object, got {_kind(v)}", name, "invalid_type")
    return v


def _refuse(body: dict[str, Any], table: dict[str, str | None]) -> None:
    for name, what in table.items():
        v = body.get(name)
        if v is None or v is False or v == [] or v == {} or v == 0 or name == "parallel_tool_calls":
            continue
        if name == "response_format" and isinstance(v, dict) and v.get("type") == "text":
            continue
        if name == "best_of" and v == 1:
            continue
        if name == "modalities" and v == ["text"]:
            continue
        raise bad(
            f"{name} is not supported by specrun serve ({what or name} is not available)",
            name,
            "unsupported_parameter",
        )


def _content(v: Any, param: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):  # content parts: text only
        parts = []
        for j, p in enumerate(v):
            if not isinstance(p, dict) or not isinstance(p.get("type"), str):
                raise bad(
                    f"{param}[{j}] must be a content part object with a type",
                    f"{param}[{j}]",
                    "invalid_type",
                )
            if p["type"] != "text":
                raise bad(
                    f"{param}[{j}]: content of type {p['type']!r} is not supported (text only)",
                    f"{param}[{j}].type",
                    "unsupported_parameter",
                )
            if not isinstance(p.get("text"), str):
                raise bad(
                    f"{param}[{j}].text must be a string", f"{param}[{j}].text", "invalid_type"
                )
            parts.append(p["text"])
        return "".join(parts)
    raise bad(
        f"{param} must be a string or an array of text parts, got {_kind(v)}", param, "invalid_type"
    )


def parse_messages(v: Any) -> list[dict[str, Any]]:
    """Chat messages for the template: text content, an assistant's ``tool_calls`` (arguments
    parsed into objects, as templates render them) and ``tool`` results answering a call made
    earlier in the conversation."""
    if v is None:
        raise bad("messages is required", "messages", "missing_required_parameter")
    if not isinstance(v, list):
        raise bad(f"messages must be an array, got {_kind(v)}", "messages", "invalid_type")
    if not v:
        raise bad("messages must not be empty", "messages")
    out: list[dict[str, Any]] = []
    calls: dict[str, str] = {}  # tool_call_id -> function name, from assistant messages
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{p} must be an object, got {_kind(m)}", p, "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad(f"{p}.role is required (a string)", f"{p}.role", "invalid_type")
        if role == "function" or m.get("function_call"):
            raise bad(
                f"{p}: the legacy function-calling messages are not supported (use tool_calls "
                "and role tool)",
                f"{p}.role",
                "unsupported_parameter",
            )
        if role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise bad(f"{p}.tool_call_id is required for a tool message", f"{p}.tool_call_id")
            if cid not in calls:
                raise bad(
                    f"{p}.tool_call_id {cid!r} answers no tool call of an earlier assistant "
                    "message",
                    f"{p}.tool_call_id",
                )
            if "content" not in m or m["content"] is None:
                raise bad(f"{p}.content is required", f"{p}.content", "missing_required_parameter")
            out.append(
                {
                    "role": "tool",
                    "content": _content(m["content"], f"{p}.content"),
                    "tool_call_id": cid,
                    "name": calls[cid],
                }
            )
            continue
        if role not in ROLES:
            raise bad(
                f"{p}.role: the role {role!r} is not supported (system, developer, user, "
                "assistant, tool)",
                f"{p}.role",
                "invalid_value",
            )
        msg: dict[str, Any] = {"role": ROLES[role]}
        tool_calls = m.get("tool_calls")
        if tool_calls:
            if role != "assistant":
                raise bad(
                    f"{p}.tool_calls: only assistant messages make tool calls", f"{p}.tool_calls"
                )
            msg["tool_calls"] = _parse_calls(tool_calls, f"{p}.tool_calls", calls)
            content = m.get("content")
            msg["content"] = "" if content is None else _content(content, f"{p}.content")
        else:
            if "content" not in m or m["content"] is None:
                raise bad(f"{p}.content is required", f"{p}.content", "missing_required_parameter")
            msg["content"] = _content(m["content"], f"{p}.content")
        out.append(msg)
    return out


def _parse_calls(v: Any, p: str, calls: dict[str, str]) -> list[dict[str, Any]]:
    if not isinstance(v, list):
        raise bad(f"{p} must be an array, got {_kind(v)}", p, "invalid_type")
    out = []
    for j, c in enumerate(v):
        q = f"{p}[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise bad(f"{q}.function.name is required", f"{q}.function.name")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError:
                raise bad(
                    f"{q}.function.arguments must be a JSON object encoded as a string",
                    f"{q}.function.arguments",
                ) from None
        if not isinstance(args, dict):
            raise bad(f"{q}.function.arguments must be a JSON object", f"{q}.function.arguments")
        cid = c.get("id")
        if not isinstance(cid, str) or not cid:
            raise bad(f"{q}.id is required (the tool message answers it)", f"{q}.id")
        calls[cid] = f["name"]
        out.append(
            {"id": cid, "type": "function", "function": {"name": f["name"], "arguments": args}}
        )
    return out


def parse_prompt(v: Any) -> str | list[int]:
    if v is None:
        raise bad("prompt is required", "prompt", "missing_required_parameter")
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return list(v)
    if isinstance(v, list) and len(v) == 1:
        return parse_prompt(v[0])
    if isinstance(v, list) and len(v) > 1:
        raise bad(
            "prompt: one prompt per request (send several requests, or n for several completions)",
            "prompt",
            "unsupported_parameter",
        )
    raise bad(
        f"prompt must be a string or an array of token ids, got {_kind(v)}",
        "prompt",
        "invalid_type",
    )


def parse_stop(v: Any) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop must be a string or an array of strings", "stop", "invalid_type")
    if len(v) > MAX_STOP:
        raise bad(f"stop takes at most {MAX_STOP} strings, got {len(v)}", "stop")
    if any(s == "" for s in v):
        raise bad("stop strings must not be empty", "stop")
    return list(v)


def parse_request(
    body: dict[str, Any], kind: str, defaults: SamplingParams, n_ctx: int
) -> GenRequest:
    """Validate ``body`` (a chat or completion request) against the server's defaults."""
    _refuse(body, _REFUSED_CHAT if kind == "chat" else _REFUSED_COMPLETION)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"model must be a string, got {_kind(model)}", "model", "invalid_type")
    messages = parse_messages(body.get("messages")) if kind == "chat" else None
    prompt = parse_prompt(body.get("prompt")) if kind == "completion" else None

    # Beyond what the context holds is capped there (finish_reason "length"), as llama-server.
    max_tokens = _int(body, "max_tokens", 0, MAX_TOKENS)
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        mct = _int(body, "max_completion_tokens", 0, MAX_TOKENS)
        max_tokens = mct if max_tokens is None else min(max_tokens, mct or 0)
    n_predict = _int(body, "n_predict", -1, MAX_TOKENS)  # llama-server's name; -1: no limit
    if n_predict is not None and n_predict >= 0:
        max_tokens = n_predict if max_tokens is None else min(max_tokens, n_predict)
    temp = _num(body, "temperature", 0.0, 100.0)
    top_p = _num(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, 1 << 30)
    min_p = _num(body, "min_p", 0.0, 1.0)
    if min_p is not None and min_p >= 1.0:
        raise bad(f"min_p must be in [0, 1), got {min_p:g}", "min_p")
    seed = _int(body, "seed", -1, (1 << 63) - 1)
    params = replace(
        defaults,
        temp=defaults.temp if temp is None else temp,
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=defaults.top_k if top_k is None else top_k,
        min_p=defaults.min_p if min_p is None else min_p,
        seed=secrets.randbits(31) if seed is None or seed == -1 else seed,
    )
    params, bias = parse_penalties(body, params, openai=True)
    logprobs = False
    if kind == "chat":
        logprobs = bool(_bool(body, "logprobs"))
        top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and top > 0 and not logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        if logprobs:
            params = replace(params, n_probs=top or 0)
    elif body.get("logprobs") is not None:  # the legacy completions' integer (0: the token's own)
        top = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        logprobs = True
        params = replace(params, n_probs=top or 0)
    template_kwargs: dict[str, Any] = {}
    reasoning = "auto"
    if kind == "chat":
        template_kwargs = _obj(body, "chat_template_kwargs")
        rf = body.get("reasoning_format")
        if rf is not None:
            if rf not in REASONING_FORMATS:
                raise bad(
                    f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got "
                    f"{json.dumps(rf)[:40]}",
                    "reasoning_format",
                )
            reasoning = rf
    else:
        for name in ("chat_template_kwargs", "reasoning_format"):
            if body.get(name) is not None:
                raise bad(
                    f"{name} applies to /v1/chat/completions only (a completion's prompt is "
                    "not rendered by the chat template)",
                    name,
                    "unsupported_parameter",
                )
    n = _int(body, "n", 1, MAX_N) or 1
    stream = bool(_bool(body, "stream"))
    so = _obj(body, "stream_options")
    include_usage = bool(_bool(so, "include_usage", "stream_options.include_usage"))
    if so and not stream:
        raise bad("stream_options is only allowed when stream is true", "stream_options")

    spec: dict[str, Any] = {}
    sp = _obj(body, "speculative")
    n_max = _int(sp, "n_max", 0, MAX_DRAFT, "speculative.n_max")
    n_min = _int(sp, "n_min", 0, MAX_DRAFT, "speculative.n_min")
    p_min = _num(sp, "p_min", 0.0, 1.0, "speculative.p_min")
    if n_max == 0:
        spec["mode"] = "none"  # llama-server: no draft tokens at all
    elif n_max is not None:
        spec["draft_max"] = n_max
    if n_min is not None:
        spec["draft_min"] = n_min
    if p_min is not None:
        spec["draft_p_min"] = p_min
    own = _obj(body, "specrun")
    mode = own.get("mode")
    if mode is not None:
        if not isinstance(mode, str) or mode not in MODES:
            raise bad(
                f"specrun.mode must be one of {', '.join(MODES)}, got {mode!r}", "specrun.mode"
            )
        if spec.get("mode") == "none" and mode != "none":
            raise bad(
                f"speculative.n_max 0 means no drafting, but specrun.mode asks for {mode}",
                "speculative.n_max",
            )
        spec["mode"] = mode
    return_tokens = bool(_bool(own, "return_tokens", "specrun.return_tokens"))
    structured = parse_structured(body, kind)
    cache_prompt = _bool(body, "cache_prompt")  # llama-server's name
    return GenRequest(
        kind=kind,
        model=model,
        messages=messages,
        prompt=prompt,
        max_tokens=max_tokens,
        params=params,
        stop=parse_stop(body.get("stop")),
        n=n,
        stream=stream,
        include_usage=include_usage,
        spec=spec,
        return_tokens=return_tokens,
        cache_prompt=True if cache_prompt is None else cache_prompt,
        structured=structured,
        logprobs=logprobs,
        logit_bias=bias,
        template_kwargs=template_kwargs,
        reasoning_format=reasoning,
    )


MAX_TOKENS = (1 << 31) - 1


def parse_penalties(
    body: dict[str, Any], params: SamplingParams, openai: bool
) -> tuple[SamplingParams, list[tuple[int | str, float]]]:
    """The fields that change the target's distribution (decoding/penalties.py) over ``params``:
    ``repeat_penalty``, ``repeat_last_n``, ``presence_penalty``, ``frequency_penalty`` (OpenAI's
    range [-2, 2] on its routes; llama-server takes any), ``ignore_eos``; and ``logit_bias``,
    returned unresolved (token ids or texts: ``resolve_bias`` reads them with the vocabulary)."""
    lim = 2.0 if openai else 1e9
    rp = _num(body, "repeat_penalty", 0.0, 1e9)
    if rp is not None and rp <= 0.0:  # llama.cpp: <= 0 is off; said plainly here
        rp = 1.0
    rn = _int(body, "repeat_last_n", -1, MAX_TOKENS)
    pp = _num(body, "presence_penalty", -lim, lim)
    fp = _num(body, "frequency_penalty", -lim, lim)
    ie = _bool(body, "ignore_eos")
    params = replace(
        params,
        repeat_penalty=params.repeat_penalty if rp is None else rp,
        repeat_last_n=params.repeat_last_n if rn is None else rn,
        presence_penalty=params.presence_penalty if pp is None else pp,
        frequency_penalty=params.frequency_penalty if fp is None else fp,
        ignore_eos=params.ignore_eos if ie is None else ie,
    )
    return params, parse_logit_bias(body.get("logit_bias"))


def _bias_value(v: Any, param: str) -> float:
    if v is False:  # llama-server: false = never this token
        return -math.inf
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise bad(
            f"{param} must be a number in [-100, 100] or false, got {_kind(v)}",
            param,
            "invalid_type",
        )
    if not -100.0 <= v <= 100.0:
        raise bad(f"{param} must be in [-100, 100], got {v:g}", param)
    return float(v)


def _bias_key(k: Any, param: str) -> int | str:
    if isinstance(k, int) and not isinstance(k, bool):
        return k
    if isinstance(k, str):
        try:
            return int(k)
        except ValueError:
            return k  # a text: llama-server biases each of its tokens
    raise bad(f"{param}: a token id or a text, got {_kind(k)}", param, "invalid_type")


def parse_logit_bias(v: Any) -> list[tuple[int | str, float]]:
    """OpenAI's ``{"token id": bias}``; llama-server's ``[[id or text, bias or false], ...]`` and
    texts as keys too. A bias of -100 (or false) forbids the token."""
    if v is None:
        return []
    out: list[tuple[int | str, float]] = []
    if isinstance(v, dict):
        for k, b in v.items():
            p = f"logit_bias.{k}"
            out.append((_bias_key(k, p), _bias_value(b, p)))
        return out
    if isinstance(v, list):
        for i, pair in enumerate(v):
            p = f"logit_bias[{i}]"
            if not isinstance(pair, list) or len(pair) != 2:
                raise bad(f"{p} must be a pair [token id or text, bias]", p, "invalid_type")
            out.append((_bias_key(pair[0], p), _bias_value(pair[1], p)))
        return out
    raise bad(
        f"logit_bias must be an object of token id -> bias, got {_kind(v)}",
        "logit_bias",
        "invalid_type",
    )


def resolve_bias(raw: list[tuple[int | str, float]], target: Any) -> tuple[tuple[int, float], ...]:
    """Token ids checked against the vocabulary, texts tokenized (each of their tokens biased,
    as llama-server does). -100 is added as it is: a ban in effect."""
    out: list[tuple[int, float]] = []
    n = target.n_vocab
    for key, b in raw:
        if isinstance(key, int):
            if not 0 <= key < n:
                raise bad(
                    f"logit_bias: token id {key} is outside the vocabulary (0..{n - 1})",
                    "logit_bias",
                )
            out.append((key, b))
        else:
            out += [(t, b) for t in target.tokenize(key, False, False)]
    return tuple(out)


def check_spec(spec: dict[str, Any], engine: Any) -> None:
    """The per-request speculation settings against what the engine can do (before queueing)."""
    cfg = engine.config
    mode = spec.get("mode", cfg.mode)
    if mode in ("draft", "hybrid") and engine.draft_model is None:
        raise bad(
            f"specrun.mode {mode} needs a draft model, and this server has none loaded "
            "(start it with a --pair or -md, and --mode auto|draft|hybrid)",
            "specrun.mode",
        )
    if mode != "none" and not engine.target.can_truncate:
        raise bad(
            "this target's cache cannot be rolled back: only mode none is possible", "specrun.mode"
        )
    k = spec.get("draft_max", cfg.draft_max)
    if spec.get("draft_min", cfg.draft_min) > k:
        raise bad(f"speculative.n_min must be <= n_max ({k})", "speculative.n_min")


__all__ = ["GenRequest", "APIError", "parse_json", "parse_request", "check_spec"]
