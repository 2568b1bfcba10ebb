"""Response objects in OpenAI's shapes, with llama-server's ``timings`` and specrun's statistics."""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from specrun.tools import HoldBack, parse

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


def choice(
    kind: str,
    index: int,
    result: Any,
    return_tokens: bool,
    piece: Any = None,
    reasoning: tuple[str, bool] | None = None,
) -> dict[str, Any]:
    """One choice of a whole reply. ``piece`` (a token's bytes): report the result's ``probs``
    as ``logprobs``; ``reasoning``: (reasoning_format, whether the prompt opened <think>)."""
    reason = FINISH.get(result.finish_reason, "stop")
    probs = result.probs if piece is not None else None
    if kind == "chat":
        msg: dict[str, Any] = {"role": "assistant", "content": result.text}
        if reasoning is not None and reasoning[0] != "none":
            thought, content = split_reasoning(result.text, reasoning[1])
            if thought is not None:
                msg["reasoning_content"] = thought
                if reasoning[0] != "deepseek-legacy":
                    msg["content"] = content
        c: dict[str, Any] = {
            "index": index,
            "message": msg,
            "logprobs": chat_logprobs(probs, piece) if probs is not None else None,
            "finish_reason": reason,
        }
    else:
        lp = completion_logprobs(probs, piece) if probs is not None else None
        c = {"index": index, "text": result.text, "logprobs": lp, "finish_reason": reason}
    if return_tokens:
        c["tokens"] = list(result.tokens)
    return c


def completion(
    kind: str,
    rid: str,
    model: str,
    results: list[Any],
    return_tokens: bool,
    piece: Any = None,
    reasoning: tuple[str, bool] | None = None,
) -> dict[str, Any]:
    u, t, s = merged_stats(results)
    return {
        "id": rid,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "specrun",
        "choices": [
            choice(kind, i, r, return_tokens, piece, reasoning) for i, r in enumerate(results)
        ],
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
    kind: str,
    index: int,
    text: str | None,
    finish: str | None = None,
    role: bool = False,
    reasoning: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    if kind == "chat":
        d: dict[str, Any] = {}
        if role:
            d["role"] = "assistant"
        if reasoning is not None:
            d["reasoning_content"] = reasoning
        if text is not None:
            d["content"] = text
        return {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}


def sse(obj: dict[str, Any] | str) -> bytes:
    data = (
        obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n".encode()


def hold_back(st: Any) -> Any:
    return HoldBack(st.fmt, everything=st.forces_call)


def tool_choices(body: dict[str, Any], results: list[Any], st: Any) -> None:
    """A whole reply's choices with the calls the model made: ``message.tool_calls`` and
    ``finish_reason: "tool_calls"``; what it said besides stays ``content`` (null if nothing)."""
    for c, r in zip(body["choices"], results, strict=True):
        said = c["message"].get("content")  # after the reasoning, if it was split off
        content, calls = parse(st.fmt, r.text if said is None else said, st.tools)
        if not st.parallel:
            calls = calls[:1]
        if calls:
            c["message"] = {
                **c["message"],
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


# -- log probabilities ------------------------------------------------------------------------------
LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token the distribution gives no mass


def _lp(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR


def _tok(piece: Any, t: int) -> tuple[str, list[int]]:
    raw = piece(t)
    return raw.decode("utf-8", "replace"), list(raw)


def chat_logprobs(probs: list[Any], piece: Any) -> dict[str, Any]:
    """OpenAI's ``choices[].logprobs`` of a chat completion: ``{"content": [{token, logprob,
    bytes, top_logprobs}]}``; ``piece`` gives a token's bytes."""
    content = []
    for p in probs:
        text, raw = _tok(piece, p.token)
        top = []
        for t, lp in p.top:
            tt, tr = _tok(piece, t)
            top.append({"token": tt, "logprob": _lp(lp), "bytes": tr})
        content.append(
            {"token": text, "logprob": _lp(p.logprob), "bytes": raw, "top_logprobs": top}
        )
    return {"content": content}


def completion_logprobs(probs: list[Any], piece: Any, offset: int = 0) -> dict[str, Any]:
    """The legacy completions' ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``
    (one ``{token: logprob}`` per position) and ``text_offset``."""
    tokens, lps, tops, offs = [], [], [], []
    for p in probs:
        text, _ = _tok(piece, p.token)
        tokens.append(text)
        lps.append(_lp(p.logprob))
        tops.append({_tok(piece, t)[0]: _lp(lp) for t, lp in p.top})
        offs.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def native_probs(probs: list[Any], piece: Any, post: bool) -> list[dict[str, Any]]:
    """llama-server's ``completion_probabilities``: ``{id, token, bytes, logprob, top_logprobs}``
    per token, or with ``post_sampling_probs`` ``prob`` and ``top_probs`` (probabilities)."""
    out = []
    for p in probs:
        text, raw = _tok(piece, p.token)
        top = []
        for t, lp in p.top:
            tt, tr = _tok(piece, t)
            v = math.exp(lp) if post else _lp(lp)
            top.append({"id": t, "token": tt, "bytes": tr, "prob" if post else "logprob": v})
        out.append(
            {
                "id": p.token,
                "token": text,
                "bytes": raw,
                "prob" if post else "logprob": math.exp(p.logprob) if post else _lp(p.logprob),
                "top_probs" if post else "top_logprobs": top,
            }
        )
    return out


# -- reasoning (<think>...</think>) -----------------------------------------------------------------
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def thinking_open(prompt_tail: str) -> bool:
    """Whether the rendered prompt ends inside a thinking block (templates that open <think>
    for the model, as DeepSeek-R1's and Qwen3's do)."""
    tail = prompt_tail.rstrip()
    return tail.endswith(THINK_OPEN)


def split_reasoning(text: str, opened: bool) -> tuple[str | None, str]:
    """(reasoning, content) of a whole reply, as llama-server's "deepseek" format parses it: the
    text of a leading <think>...</think> (or up to </think> when the prompt opened it) is the
    reasoning, what follows the content; a block never closed is all reasoning."""
    t = text
    if not opened:
        s = t.lstrip()
        if not s.startswith(THINK_OPEN):
            return None, text
        t = s[len(THINK_OPEN) :]
    end = t.find(THINK_CLOSE)
    if end < 0:
        return t.strip(), ""
    return t[:end].strip(), t[end + len(THINK_CLOSE) :].lstrip()


def _partial_tail(buf: str, tag: str) -> int:
    """Length of the longest end of ``buf`` that begins ``tag`` (held back: it may be the tag)."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if tag.startswith(buf[-n:]):
            return n
    return 0


class ReasoningStream:
    """A streamed reply split into ``reasoning_content`` and ``content`` deltas: ``feed`` text,
    get ``(field, text)`` parts; text that may be the start of a tag waits for the next."""

    def __init__(self, opened: bool) -> None:
        self.state = "reasoning" if opened else "start"
        self.buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if not s or (THINK_OPEN.startswith(s) and len(s) < len(THINK_OPEN)):
                    return out
                if s.startswith(THINK_OPEN):
                    self.buf, self.state = s[len(THINK_OPEN) :].lstrip(), "reasoning"
                else:
                    self.state = "content"
                continue
            if self.state == "reasoning":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    if i:
                        out.append(("reasoning_content", self.buf[:i]))
                    self.buf, self.state = self.buf[i + len(THINK_CLOSE) :], "after"
                    continue
                keep = _partial_tail(self.buf, THINK_CLOSE)
                cut = len(self.buf) - keep
                if cut:
                    out.append(("reasoning_content", self.buf[:cut]))
                self.buf = self.buf[cut:]
                return out
            if self.state == "after":
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.state = "content"
            if self.buf:
                out.append(("content", self.buf))
            self.buf = ""
            return out

    def finish(self) -> list[tuple[str, str]]:
        rest, self.buf = self.buf, ""
        if not rest or self.state == "after":
            return []
        return [("reasoning_content" if self.state == "reasoning" else "content", rest)]
