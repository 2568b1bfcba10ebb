"""Response objects in OpenAI's shapes, with llama-server's ``timings`` and specrun's statistics."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def timings(stats: Any, cached: int) -> dict[str, Any]:
    """llama-server's ``timings``: ``prompt_n`` the prompt tokens evaluated (the cached ones are
    ``cache_n``), ``predicted_*`` the decode phase, ``draft_n``/``draft_n_accepted`` the drafts."""
    pn, pms = stats.prefill_tokens, stats.prefill_seconds * 1000.0
    gn, gms = stats.generated, stats.decode_seconds * 1000.0
    return {
        "cache_n": cached,
        "prompt_n": pn,
        "prompt_ms": round(pms, 3),
        "prompt_per_token_ms": round(pms / pn, 3) if pn else 0.0,
        "prompt_per_second": round(pn * 1000.0 / pms, 3) if pms > 0 else 0.0,
        "predicted_n": gn,
        "predicted_ms": round(gms, 3),
        "predicted_per_token_ms": round(gms / gn, 3) if gn else 0.0,
        "predicted_per_second": round(gn * 1000.0 / gms, 3) if gms > 0 else 0.0,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
    }


def cached_of(result: Any) -> int:
    """Prompt tokens the caches already held (the engine evaluated the rest)."""
    return max(0, result.prompt_tokens - result.stats.prefill_tokens)


def specrun_stats(result: Any) -> dict[str, Any]:
    """The ``stats`` object of ``specrun generate --json``, with the mode and seed used."""
    return {
        **result.stats.to_dict(),
        "mode": result.mode,
        "seed": result.seed,
        "finish_reason": result.finish_reason,
    }


def merged_stats(results: list[Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """usage, timings and specrun objects for the choices of one request (n >= 1)."""
    first = results[0]
    cached = cached_of(first)
    gen = sum(len(r.tokens) for r in results)
    u = usage(first.prompt_tokens, gen, cached)
    t = timings(first.stats, cached)
    if len(results) > 1:
        t["predicted_n"] = gen
        t["predicted_ms"] = round(sum(r.stats.decode_seconds for r in results) * 1000.0, 3)
        t["predicted_per_second"] = (
            round(gen * 1000.0 / t["predicted_ms"], 3) if t["predicted_ms"] else 0.0
        )
        t["predicted_per_token_ms"] = round(t["predicted_ms"] / gen, 3) if gen else 0.0
        t["draft_n"] = sum(r.stats.drafted for r in results)
        t["draft_n_accepted"] = sum(r.stats.accepted for r in results)
    s = specrun_stats(first)
    if len(results) > 1:
        s["completions"] = [specrun_stats(r) for r in results]
    return u, t, s


def choice(kind: str, index: int, result: Any, return_tokens: bool) -> dict[str, Any]:
    reason = FINISH.get(result.finish_reason, "stop")
    if kind == "chat":
        c: dict[str, Any] = {
            "index": index,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": None,
            "finish_reason": reason,
        }
    else:
        c = {"index": index, "text": result.text, "logprobs": None, "finish_reason": reason}
    if return_tokens:
        c["tokens"] = list(result.tokens)
    return c


def completion(
    kind: str, rid: str, model: str, results: list[Any], return_tokens: bool
) -> dict[str, Any]:
    u, t, s = merged_stats(results)
    return {
        "id": rid,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "specrun",
        "choices": [choice(kind, i, r, return_tokens) for i, r in enumerate(results)],
        "usage": u,
        "timings": t,
        "specrun": s,
    }


def chunk(
    kind: str,
    rid: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    include_usage: bool,
    **extra: Any,
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": "specrun",
        "choices": choices,
    }
    if include_usage:
        obj["usage"] = None
    obj.update(extra)
    return obj


def delta_choice(
    kind: str, index: int, text: str | None, finish: str | None = None, role: bool = False
) -> dict[str, Any]:
    if kind == "chat":
        d: dict[str, Any] = {}
        if role:
            d["role"] = "assistant"
        if text is not None:
            d["content"] = text
        return {"index": index, "delta": d, "logprobs": None, "finish_reason": finish}
    return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}


def sse(obj: dict[str, Any] | str) -> bytes:
    data = (
        obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n".encode()


def hold_back(st: Any) -> Any:
    from specrun.tools import HoldBack

    return HoldBack(st.fmt, everything=st.forces_call)


def tool_choices(body: dict[str, Any], results: list[Any], st: Any) -> None:
    """A whole reply's choices with the calls the model made: ``message.tool_calls`` and
    ``finish_reason: "tool_calls"``; what it said besides stays ``content`` (null if nothing)."""
    from specrun.tools import parse

    for c, r in zip(body["choices"], results, strict=True):
        content, calls = parse(st.fmt, r.text, st.tools)
        if not st.parallel:
            calls = calls[:1]
        if calls:
            c["message"] = {
                "role": "assistant",
                "content": content or None,
                "tool_calls": [call.as_openai() for call in calls],
            }
            c["finish_reason"] = "tool_calls"


def tool_call_deltas(index: int, j: int, call: Any) -> list[dict[str, Any]]:
    """One call as OpenAI streams it: id, type and name first, then the arguments."""
    head = {"index": j, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": ""}}  # fmt: skip
    args = {"index": j, "function": {"arguments": call.arguments}}
    return [
        {"index": index, "delta": {"tool_calls": [head]}, "logprobs": None, "finish_reason": None},
        {"index": index, "delta": {"tool_calls": [args]}, "logprobs": None, "finish_reason": None},
    ]
