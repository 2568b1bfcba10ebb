"""llama-server's native routes, in llama-server's shapes: ``POST /completion``, ``POST /infill``
(editors' fill-in-the-middle: llama.vim, llama.vscode), ``POST /tokenize``, ``POST /detokenize``,
``GET /props`` and ``POST /apply-template`` (tools/server/README.md in llama.cpp).

Every field of a request is honoured or refused with a 400 naming it: the fields specrun
implements are honoured (the penalties, ``logit_bias``, ``ignore_eos`` and ``n_probs`` among
them); llama-server's fields whose feature specrun lacks are accepted only at their neutral value
(``dry_multiplier`` 0, ``mirostat`` 0 ...: the value that changes nothing) and refused otherwise; a field llama-server does not document either is refused.
One exception, visible in every response: the ``infill`` sampler (llama.cpp's, which editors list
in ``samplers``) is not applied; ``generation_settings.samplers`` lists the ones that were.

Generation goes through the one engine worker like the OpenAI routes (same queue, same prompt
cache). ``n_indent`` and ``t_max_predict_ms`` end a generation from here, between target passes
(the worker sees it as a cancel; the reply is a normal one with ``stop_type`` "limit").
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import specrun
from specrun.chat_template import render_chat
from specrun.decoding.engine import MAX_DRAFT, MODES
from specrun.decoding.penalties import penalises
from specrun.errors import SpecrunError
from specrun.llama.fim import fim_tokens, special_piece
from specrun.server import responses as R
from specrun.server.errors import APIError, bad, error_body
from specrun.server.infill import format_infill
from specrun.server.requests import (
    GenRequest,
    check_spec,
    parse_json,
    parse_messages,
    parse_penalties,
    resolve_bias,
)
from specrun.server.worker import Job, QueueFull

PATHS = ("/completion", "/infill", "/tokenize", "/detokenize", "/props", "/apply-template")
RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama-server's "pick one" seeds (LLAMA_DEFAULT_SEED)

# Samplers by llama.cpp's names (common_sampler_types_from_names, with its alternative names) and
# letters (common_sampler_types_from_chars). specrun applies top_k, top_p, min_p, temperature; the
# ones specrun lacks are inert at the neutral values this module insists on, except infill.
_SAMPLER_NAMES = {
    "top_k": "top_k",
    "top-k": "top_k",
    "top_p": "top_p",
    "top-p": "top_p",
    "nucleus": "top_p",
    "min_p": "min_p",
    "min-p": "min_p",
    "temperature": "temperature",
    "temp": "temperature",
    "typ_p": "typ_p",
    "typical_p": "typ_p",
    "typ-p": "typ_p",
    "typical-p": "typ_p",
    "typical": "typ_p",
    "typ": "typ_p",
    "xtc": "xtc",
    "dry": "dry",
    "penalties": "penalties",
    "top_n_sigma": "top_n_sigma",
    "top-n-sigma": "top_n_sigma",
    "infill": "infill",
}
_SAMPLER_CHARS = {
    "d": "dry",
    "k": "top_k",
    "y": "typ_p",
    "p": "top_p",
    "s": "top_n_sigma",
    "m": "min_p",
    "x": "xtc",
    "t": "temperature",
    "i": "infill",
    "e": "penalties",
}
NOT_APPLIED = ("infill",)

# llama-server's fields for features specrun lacks: accepted at the neutral value, else refused.
# name -> (is it neutral, what to send instead)
_NEUTRAL: dict[str, tuple[Any, str]] = {
    "dry_multiplier": (lambda v: v == 0, "0 (off)"),
    "xtc_probability": (lambda v: v == 0, "0 (off)"),
    "typical_p": (lambda v: v == 1, "1.0 (off)"),
    "dynatemp_range": (lambda v: v == 0, "0 (off)"),
    "mirostat": (lambda v: v == 0, "0 (off)"),
    "top_n_sigma": (lambda v: isinstance(v, int | float) and v <= 0, "-1 (off)"),
    "min_keep": (lambda v: v in (0, 1), "0"),
    "logprobs": (lambda v: v in (0, False, None), "0"),
    "n_cache_reuse": (lambda v: v == 0, "0 (specrun reuses the longest common prefix)"),
    "lora": (lambda v: v == [], "[] (specrun loads no LoRA adapters)"),
    "grammar": (lambda v: v == "", '""'),
    "grammar_lazy": (lambda v: v is False, "false"),
    "grammar_triggers": (lambda v: v == [], "[]"),
    "preserved_tokens": (lambda v: v == [], "[]"),
    "json_schema": (lambda v: False, "nothing: leave it out"),
    "n_cmpl": (lambda v: v == 1, "1 (one slot)"),
    "n": (lambda v: v == 1, "1 (one slot)"),
    "return_progress": (lambda v: v is False, "false"),
    "multimodal_data": (lambda v: v == [], "[] (text models only)"),
    "image_data": (lambda v: v == [], "[] (text models only)"),
}
# Honoured by doing nothing, truthfully: settings of samplers that are off (their switch above is
# held at its neutral value), context shifting that specrun never does (a prompt that does not fit
# is refused), and the prompt-time limit that llama-server itself leaves unimplemented.
_INERT = {
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "xtc_threshold",
    "dynatemp_exponent",
    "mirostat_tau",
    "mirostat_eta",
    "n_keep",
    "n_discard",
    "t_max_prompt_ms",
}
_HONOURED = {
    "prompt",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "ignore_eos",
    "n_probs",
    "post_sampling_probs",
    "n_predict",
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "stop",
    "stream",
    "cache_prompt",
    "return_tokens",
    "n_indent",
    "t_max_predict_ms",
    "response_fields",
    "samplers",
    "id_slot",
    "timings_per_token",
    "model",
    "speculative",
    "speculative.n_max",
    "speculative.n_min",
    "speculative.p_min",
    "specrun",
}
_INFILL_ONLY = {"input_prefix", "input_suffix", "input_extra"}

# generation_settings: llama-server's task_params::to_json, each at its value or neutral default
_SETTINGS_DEFAULTS: dict[str, Any] = {
    "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0,
    "top_n_sigma": -1.0,
    "xtc_probability": 0.0,
    "xtc_threshold": 0.1,
    "typical_p": 1.0,
    "repeat_last_n": 64,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "dry_multiplier": 0.0,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": -1,
    "dry_sequence_breakers": ["\n", ":", '"', "*"],
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
    "n_keep": 0,
    "n_discard": 0,
    "ignore_eos": False,
    "logit_bias": [],
    "n_probs": 0,
    "min_keep": 0,
    "grammar": "",
    "post_sampling_probs": False,
    "lora": [],
    "t_max_prompt_ms": -1,
}

# The batch llama-server sizes /infill's prefix and suffix by when it is not told (-b 2048).
INFILL_BATCH = 2048


# -- small typed readers (400s naming the field) ---------------------------------------------------
def _kind(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(v),
        "an array" if isinstance(v, list) else "an object" if isinstance(v, dict) else "null",
    )


def _int(body: dict[str, Any], name: str, lo: int, hi: int, default: int) -> int:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{name} must be an integer, got {_kind(v)}", name, "invalid_type")
    if not lo <= v <= hi:
        raise bad(f"{name} must be in [{lo}, {hi}], got {v}", name)
    return v


def _num(body: dict[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(f"{name} must be a number, got {_kind(v)}", name, "invalid_type")
    if not lo <= float(v) <= hi:
        raise bad(f"{name} must be in [{lo:g}, {hi:g}], got {v}", name)
    return float(v)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} must be a boolean, got {_kind(v)}", name, "invalid_type")
    return v


def _samplers(v: Any) -> list[str]:
    if isinstance(v, str):
        names = []
        for c in v:
            if c not in _SAMPLER_CHARS:
                raise bad(f"samplers: {c!r} names no sampler llama.cpp knows", "samplers")
            names.append(_SAMPLER_CHARS[c])
        return names
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("samplers must be an array of names or a string of letters", "samplers")
    out = []
    for s in v:
        if s.lower() not in _SAMPLER_NAMES:
            raise bad(f"samplers: {s!r} names no sampler llama.cpp knows", "samplers")
        out.append(_SAMPLER_NAMES[s.lower()])
    return out


# -- a native generation request --------------------------------------------------------------------
@dataclass
class Native:
    req: GenRequest
    route: str  # "completion" | "infill"
    n_predict: int  # as asked: -1 = to the end of the context
    n_indent: int = 0
    t_max_predict_ms: float = 0.0
    response_fields: list[str] | None = None
    timings_per_token: bool = False
    settings: dict[str, Any] = field(default_factory=dict)  # generation_settings
    not_applied: list[str] = field(default_factory=list)  # samplers named but not applied


def _check_fields(body: dict[str, Any], route: str) -> None:
    allowed = _HONOURED | _INERT | set(_NEUTRAL) | (_INFILL_ONLY if route == "infill" else set())
    for name, v in body.items():
        if name in _NEUTRAL:
            ok, instead = _NEUTRAL[name]
            if v is not None and not ok(v):
                raise bad(
                    f"{name} {json.dumps(v)[:80]} is not supported by specrun serve yet: send "
                    f"{instead}, llama-server's neutral value, or leave it out",
                    name,
                    "unsupported_parameter",
                )
        elif name not in allowed:
            where = (
                "" if route == "infill" or name not in _INFILL_ONLY else " (it belongs to /infill)"
            )
            raise bad(
                f"{name} is not a field of llama-server's /{route} that specrun knows{where}: "
                "specrun refuses what it would otherwise ignore",
                name,
                "unknown_parameter",
            )


def parse_native(body: dict[str, Any], route: str, state: Any, engine: Any) -> Native:
    _check_fields(body, route)
    d = state.defaults
    n_ctx = state.n_ctx
    n_predict = _int(body, "n_predict", -1, 1 << 31, _int(body, "max_tokens", -1, 1 << 31, -1))
    temp = _num(body, "temperature", -1e9, 100.0, d.temp)  # llama.cpp: <= 0 is greedy
    top_k = _int(body, "top_k", -(1 << 30), 1 << 30, d.top_k)
    top_p = _num(body, "top_p", 0.0, 1.0, d.top_p)
    min_p = _num(body, "min_p", 0.0, 1.0, d.min_p)
    if min_p >= 1.0:
        raise bad(f"min_p must be in [0, 1), got {min_p:g}", "min_p")
    seed = _int(body, "seed", -1, (1 << 63) - 1, -1)
    applied = ["top_k", "top_p", "min_p", "temperature"]
    not_applied: list[str] = []
    if body.get("samplers") is not None:
        named = _samplers(body["samplers"])
        applied = [s for s in named if s not in NOT_APPLIED]
        not_applied = sorted({s for s in named if s in NOT_APPLIED})
    # A sampler left out of the chain is off, as in llama.cpp (no temperature: sampled at 1.0).
    params = replace(
        d,
        temp=max(temp, 0.0) if "temperature" in applied else 1.0,
        top_k=max(top_k, 0) if "top_k" in applied else 0,
        top_p=(top_p if top_p > 0 else 1e-9) if "top_p" in applied else 1.0,  # 0: the top token
        min_p=min_p if "min_p" in applied else 0.0,
        seed=secrets.randbits(31) if seed in RANDOM_SEEDS else seed,
    )
    params, bias = parse_penalties(body, params, openai=False)
    params = replace(params, logit_bias=resolve_bias(bias, engine.target))
    if body.get("samplers") is not None and "penalties" not in applied:
        params = replace(params, repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    elif penalises(params) and "penalties" not in applied:
        applied = ["penalties", *applied]  # llama.cpp's default chain begins with it
    n_probs = _int(body, "n_probs", 0, 1 << 10, 0)
    post = _bool(body, "post_sampling_probs", False)
    if n_probs > 0:
        params = replace(params, n_probs=n_probs, post_sampling_probs=post)
    stop_v = body.get("stop")
    if stop_v is None:
        stop: list[str] = []
    elif isinstance(stop_v, str):
        stop = [stop_v] if stop_v else []
    elif isinstance(stop_v, list) and all(isinstance(s, str) for s in stop_v):
        stop = [s for s in stop_v if s]  # llama-server skips empty words
    else:
        raise bad("stop must be an array of strings", "stop", "invalid_type")
    id_slot = _int(body, "id_slot", -1, 1 << 30, -1)
    if id_slot not in (-1, 0):
        raise bad(f"id_slot {id_slot}: this server has one slot, 0 (-1: any)", "id_slot")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"model must be a string, got {_kind(model)}", "model", "invalid_type")
    rf = body.get("response_fields")
    if rf is not None and (not isinstance(rf, list) or not all(isinstance(s, str) for s in rf)):
        raise bad("response_fields must be an array of strings", "response_fields", "invalid_type")

    spec: dict[str, Any] = {}
    sp = body.get("speculative")
    if sp is not None and not isinstance(sp, dict):
        raise bad("speculative must be an object", "speculative", "invalid_type")
    flat = {k: body.get(f"speculative.{k}", (sp or {}).get(k)) for k in ("n_max", "n_min", "p_min")}
    n_max = _int(flat, "n_max", 0, MAX_DRAFT, -1)
    n_min = _int(flat, "n_min", 0, MAX_DRAFT, -1)
    p_min = _num(flat, "p_min", 0.0, 1.0, -1.0)
    if n_max == 0:
        spec["mode"] = "none"
    elif n_max > 0:
        spec["draft_max"] = n_max
    if n_min >= 0:
        spec["draft_min"] = n_min
    if p_min >= 0:
        spec["draft_p_min"] = p_min
    own = body.get("specrun") or {}
    if not isinstance(own, dict) or set(own) - {"mode", "return_tokens"}:
        raise bad('specrun must be an object of "mode" and "return_tokens"', "specrun")
    mode = own.get("mode")
    if mode is not None:
        if mode not in MODES:
            raise bad(
                f"specrun.mode must be one of {', '.join(MODES)}, got {mode!r}", "specrun.mode"
            )
        spec["mode"] = mode
    check_spec(spec, engine)
    return_tokens = _bool(body, "return_tokens", False) or bool(own.get("return_tokens"))
    stream = _bool(body, "stream", False)

    req = GenRequest(
        kind="completion",
        model=model,
        messages=None,
        prompt=None,
        max_tokens=None,
        params=params,
        stop=stop,
        n=1,
        stream=True,  # always: the worker's steps drive n_indent, t_max_predict_ms and streams
        include_usage=False,
        spec=spec,
        return_tokens=return_tokens,
        cache_prompt=_bool(body, "cache_prompt", True),
    )
    cfg = engine.config
    settings = {
        "n_predict": n_predict,
        "max_tokens": n_predict,
        "seed": params.seed,
        "temperature": temp,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        **{k: body.get(k, v) for k, v in _SETTINGS_DEFAULTS.items()},
        "stop": stop,
        "stream": stream,
        "samplers": applied,
        "n_indent": _int(body, "n_indent", 0, 1 << 20, 0),
        "t_max_predict_ms": _num(body, "t_max_predict_ms", 0.0, 1e12, 0.0),
        "cache_prompt": req.cache_prompt,
        "id_slot": id_slot,
        "speculative.n_max": spec.get(
            "draft_max", 0 if spec.get("mode") == "none" else cfg.draft_max
        ),
        "speculative.n_min": spec.get("draft_min", cfg.draft_min),
        "speculative.p_min": spec.get("draft_p_min", cfg.draft_p_min),
        "speculative.mode": spec.get("mode", cfg.mode),
        "timings_per_token": _bool(body, "timings_per_token", False),
        "return_tokens": return_tokens,
        "n_ctx": n_ctx,
        "model": model or state.model_id,
    }
    return Native(
        req=req,
        route=route,
        n_predict=n_predict,
        n_indent=settings["n_indent"],
        t_max_predict_ms=settings["t_max_predict_ms"],
        response_fields=rf,
        timings_per_token=settings["timings_per_token"],
        settings=settings,
        not_applied=not_applied,
    )


def _stream_flag(nat: Native) -> bool:
    return bool(nat.settings["stream"])


def nested(paths: list[str], obj: dict[str, Any]) -> dict[str, Any]:
    """llama-server's json_get_nested_values: ``"timings/prompt_n"`` -> that value, under that
    whole path as its key; a path that leads nowhere is left out."""
    out: dict[str, Any] = {}
    for path in paths:
        cur: Any = obj
        for k in path.split("/"):
            if isinstance(cur, dict) and k in cur:
                cur = cur[k]
            else:
                break
        else:
            out[path] = cur
    return out


# -- prompts ------------------------------------------------------------------------------------------
def mixed_tokens(
    target: Any, v: Any, param: str, add_special: bool, parse_special: bool
) -> list[int]:
    """llama-server's tokenize_mixed: a string, or an array of strings and token ids (the first
    string gets the BOS where ``add_special`` and the vocabulary asks for one)."""
    n_vocab = target.n_vocab
    if isinstance(v, str):
        return list(target.tokenize(v, add_special, parse_special)) if v else []
    if not isinstance(v, list):
        raise bad(
            f"{param} must be a string or an array of strings and token ids", param, "invalid_type"
        )
    if v and all(isinstance(p, list) for p in v):
        if len(v) == 1:
            return mixed_tokens(target, v[0], param, add_special, parse_special)
        raise bad(
            f"{param}: one prompt per request (specrun serves one slot)",
            param,
            "unsupported_parameter",
        )
    out: list[int] = []
    for i, p in enumerate(v):
        if isinstance(p, str):
            out += target.tokenize(p, add_special and i == 0, parse_special) if p else []
        elif isinstance(p, int) and not isinstance(p, bool):
            if not 0 <= p < n_vocab:
                raise bad(
                    f"{param}[{i}]: token id {p} is outside the vocabulary (0..{n_vocab - 1})",
                    param,
                )
            out.append(p)
        else:
            raise bad(
                f"{param}[{i}] must be a string or a token id, got {_kind(p)}",
                param,
                "invalid_type",
            )
    return out


def _fits(state: Any, tokens: list[int], param: str) -> None:
    if not tokens:
        raise bad(f"{param}: the prompt is empty", param)
    if len(tokens) >= state.n_ctx:
        raise APIError(
            400,
            f"{param}: the prompt is {len(tokens)} tokens but the context holds {state.n_ctx}: "
            f"{len(tokens) - state.n_ctx + 1} too many (start the server with a larger --ctx, or "
            "shorten the prompt)",
            param,
            "context_length_exceeded",
        )


# -- running one --------------------------------------------------------------------------------------
@dataclass
class _Gen:
    """What a generation produced so far, as the worker's events arrive."""

    nat: Native
    n_prompt: int
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    stats: Any = None
    result: Any = None
    stop_type: str = "none"
    cut: bool = False  # ended here (n_indent, t_max_predict_ms)
    t_first: float | None = None
    nl_from: int = 0  # where the next unchecked line may start
    error: tuple[int, str] | None = None
    probs: list[Any] = field(default_factory=list)  # n_probs: each token's probabilities

    def step(self, step: Any, job: Job) -> str:
        """Take one Step; the text to send for it (less than its text where this cut)."""
        if self.cut:
            return ""
        now = time.perf_counter()
        if self.t_first is None and step.tokens:
            self.t_first = now
        self.stats = step.stats
        self.tokens += step.tokens
        if step.probs:
            self.probs += step.probs
        before = len(self.text)
        self.text += step.text
        nat = self.nat
        if nat.n_indent > 0:
            # llama-server: every line after a newline needs n_indent leading blanks; the first
            # that has less (and something else) ends the completion, cut after its blanks.
            while True:
                nl = self.text.find("\n", self.nl_from)
                if nl < 0:
                    break
                pos = nl + 1
                while pos < len(self.text) and self.text[pos] in " \t":
                    pos += 1
                if pos >= len(self.text) or self.text[pos] == "\n":
                    if pos < len(self.text):  # an empty line: look at the next one
                        self.nl_from = pos
                        continue
                    break  # the line has only blanks so far
                if pos - (nl + 1) < nat.n_indent:
                    self.text = self.text[:pos]
                    self._end(job)
                    break
                self.nl_from = pos
        if (
            not self.cut
            and nat.t_max_predict_ms > 0
            and "\n" in self.text
            and self.t_first is not None
            and (now - self.t_first) * 1000.0 > nat.t_max_predict_ms
        ):
            self._end(job)
        return self.text[before:]

    def _end(self, job: Job) -> None:
        self.cut = True
        self.stop_type = "limit"
        job.cancel.set()  # the worker stops after this pass; its caches keep what was computed

    def take_result(self, res: Any) -> None:
        self.result = res
        self.stats = res.stats
        if not self.cut:
            self.text = res.text
            self.tokens = list(res.tokens)
            self.probs = list(res.probs or [])
            self.stop_type = {"eos": "eos", "stop": "word", "length": "limit"}.get(
                res.finish_reason, "limit"
            )


def _stopping_word(target: Any, gen: _Gen) -> str:
    if gen.stop_type != "word" or gen.result is None:
        return ""
    full = target.detokenize(gen.tokens)
    for s in gen.nat.req.stop:
        if full.startswith(s, len(gen.text)):
            return s
    return next((s for s in gen.nat.req.stop if s in full[len(gen.text) - 1 :]), "")


def _final(
    state: Any, gen: _Gen, prompt: list[int], stream: bool, truncated: bool
) -> dict[str, Any]:
    nat = gen.nat
    target = state.engine_or_503().target
    n_gen = len(gen.tokens)
    stats = gen.stats
    cached = max(0, len(prompt) - stats.prefill_tokens) if stats is not None else 0
    room = state.n_ctx - len(prompt)
    if gen.stop_type == "limit" and not gen.cut and (nat.n_predict < 0 or nat.n_predict > room):
        truncated = True  # the context ran out before n_predict
    obj: dict[str, Any] = {
        "index": 0,
        "content": "" if stream else gen.text,
        "tokens": [] if stream or not nat.req.return_tokens else list(gen.tokens),
        "id_slot": 0,
        "stop": True,
        "model": nat.settings["model"],
        "tokens_predicted": n_gen,
        "tokens_evaluated": len(prompt),
        "generation_settings": nat.settings,
        "prompt": b"".join(special_piece(target, t) for t in prompt).decode("utf-8", "replace"),
        "has_new_line": "\n" in gen.text,
        "truncated": truncated,
        "stop_type": gen.stop_type,
        "stopping_word": _stopping_word(target, gen),
        "tokens_cached": len(prompt) + n_gen,
        "timings": R.timings(stats, cached) if stats is not None else {},
    }
    params = nat.req.params
    if params.n_probs > 0 and not stream:
        obj["completion_probabilities"] = R.native_probs(
            gen.probs, target.piece, params.post_sampling_probs
        )
    if stats is not None:
        s = {**stats.to_dict(), "seed": nat.req.params.seed}
        if gen.result is not None:
            s["mode"] = gen.result.mode
        if nat.not_applied:
            s["samplers_not_applied"] = nat.not_applied
        obj["specrun"] = s
    return nested(nat.response_fields, obj) if nat.response_fields else obj


def _submit(state: Any, nat: Native, tokens: list[int]) -> Job:
    nat.req.prompt = tokens
    room = state.n_ctx - len(tokens)
    nat.req.max_tokens = room if nat.n_predict < 0 else min(nat.n_predict, room)
    job = Job(nat.req, tokens, asyncio.get_running_loop())
    assert state.worker is not None
    try:
        state.worker.submit(job)
    except QueueFull as exc:
        state.metrics.rejected_full.inc()
        raise APIError(
            503,
            f"{exc}: retry later",
            code="queue_full",
            headers={"Retry-After": str(state.worker.retry_after())},
        ) from None
    return job


async def _next(job: Job, request: Request) -> tuple[Any, ...]:
    getter = asyncio.ensure_future(job.events.get())
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=0.25)
            if done:
                return getter.result()
            if await request.is_disconnected():
                job.cancel.set()
    finally:
        if not getter.done():
            getter.cancel()


def _apply(gen: _Gen, item: tuple[Any, ...], job: Job) -> str | None:
    """One worker event into ``gen``; the text to send for a step, None for other events."""
    tag = item[0]
    if tag == "step":
        return gen.step(item[2], job)
    if tag == "result":
        gen.take_result(item[2])
    elif tag == "error":
        gen.error = (item[1], item[2])
    elif tag == "end" and item[2] == "cancelled" and not gen.cut and gen.error is None:
        gen.error = (503, "the generation was cancelled (the server is shutting down)")
    return None


async def run_native(
    state: Any, request: Request, nat: Native, tokens: list[int], truncated: bool = False
) -> Response:
    job = _submit(state, nat, tokens)
    gen = _Gen(nat, len(tokens))
    if _stream_flag(nat):
        return StreamingResponse(
            _stream(state, job, gen, tokens, truncated),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        while True:
            item = await _next(job, request)
            _apply(gen, item, job)
            if item[0] == "end":
                break
    finally:
        job.cancel.set()
    if gen.error is not None:
        status, msg = gen.error
        raise APIError(status, msg, code="server_error" if status >= 500 else "invalid_value")
    return JSONResponse(_final(state, gen, tokens, False, truncated))


async def _stream(
    state: Any, job: Job, gen: _Gen, tokens: list[int], truncated: bool
) -> AsyncIterator[bytes]:
    """llama-server's stream: ``data: {content, tokens, stop: false, ...}`` per step, then the
    final object (``stop`` true, content empty: it was sent), and no ``[DONE]``."""
    nat = gen.nat
    try:
        done = False
        while not done:
            items = [await job.events.get()]
            while not job.events.empty():
                items.append(job.events.get_nowait())
            out: list[bytes] = []
            for item in items:
                text = _apply(gen, item, job)
                if item[0] == "step" and (text or (item[2].tokens and not gen.cut)):
                    chunk: dict[str, Any] = {
                        "index": 0,
                        "content": text,
                        "tokens": list(item[2].tokens),
                        "stop": False,
                        "id_slot": 0,
                        "tokens_predicted": len(gen.tokens),
                        "tokens_evaluated": len(tokens),
                    }
                    params = nat.req.params
                    if params.n_probs > 0 and item[2].probs:
                        chunk["completion_probabilities"] = R.native_probs(
                            item[2].probs,
                            state.engine_or_503().target.piece,
                            params.post_sampling_probs,
                        )
                    if nat.timings_per_token and gen.stats is not None:
                        chunk["timings"] = R.timings(
                            gen.stats, max(0, len(tokens) - gen.stats.prefill_tokens)
                        )
                    out.append(R.sse(chunk))
                elif item[0] == "end":
                    done = True
                    if gen.error is not None:
                        out.append(R.sse({"error": error_body(*gen.error)["error"]}))
                    else:
                        out.append(R.sse(_final(state, gen, tokens, True, truncated)))
                    break
            if out:
                yield b"".join(out)
    finally:
        job.cancel.set()


# -- the routes ---------------------------------------------------------------------------------------
def _infill_inputs(body: dict[str, Any]) -> tuple[Any, Any, list[dict[str, str]], str]:
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise bad(f"{name} is required", name, "missing_required_parameter")
        if not isinstance(body[name], str | list):
            raise bad(f"{name} must be a string", name, "invalid_type")
    extra = body.get("input_extra")
    if extra is None:
        extra = []
    if not isinstance(extra, list):
        raise bad(
            'input_extra must be an array of {"filename": string, "text": string}',
            "input_extra",
            "invalid_type",
        )
    chunks = []
    for i, c in enumerate(extra):
        p = f"input_extra[{i}]"
        if not isinstance(c, dict) or not isinstance(c.get("text"), str):
            raise bad(f'{p} must contain a "text" field with a string value', p, "invalid_type")
        if "filename" in c and not isinstance(c["filename"], str):
            raise bad(f'{p}: "filename" must be a string', f"{p}.filename", "invalid_type")
        for k in c:
            if k not in ("text", "filename", "time"):  # time: llama.vim's chunk age, unused
                raise bad(
                    f"{p}.{k} is not a field of an extra chunk", f"{p}.{k}", "unknown_parameter"
                )
        chunks.append({"text": c["text"], "filename": c.get("filename", "tmp")})
    prompt = body.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise bad('"prompt" must be a string', "prompt", "invalid_type")
    return body["input_prefix"], body["input_suffix"], chunks, prompt


def _props(state: Any, engine: Any) -> dict[str, Any]:
    try:
        llcpp = version("llama_cpp_python")
    except PackageNotFoundError:  # pragma: no cover
        llcpp = "?"
    target = engine.target
    cfg = engine.config
    d = state.defaults
    params = {
        "n_predict": -1,
        "max_tokens": -1,
        "seed": -1,
        "temperature": d.temp,
        "top_k": d.top_k,
        "top_p": d.top_p,
        "min_p": d.min_p,
        **_SETTINGS_DEFAULTS,
        "stop": [],
        "stream": False,
        "samplers": ["top_k", "top_p", "min_p", "temperature"],
        "speculative.n_max": cfg.draft_max if cfg.mode != "none" else 0,
        "speculative.n_min": cfg.draft_min,
        "speculative.p_min": cfg.draft_p_min,
        "speculative.mode": cfg.mode,
        "timings_per_token": False,
    }
    w = state.worker
    fim = fim_tokens(target)
    return {
        "default_generation_settings": {
            "id": 0,
            "id_task": -1,
            "n_ctx": state.n_ctx,
            "speculative": cfg.mode != "none",
            "is_processing": w is not None and bool(w.running),
            "params": params,
            "prompt": "",
            "next_token": {
                "has_next_token": True,
                "has_new_line": False,
                "n_remain": -1,
                "n_decoded": 0,
                "stopping_word": "",
            },
        },
        "total_slots": len(w.slots) if w is not None else 1,
        "model_path": str(getattr(target, "path", "")),
        "chat_template": target.chat_template() or "",
        "chat_template_caps": {},
        "modalities": {"vision": False, "audio": False},
        "bos_token": target.token_text(target.bos).decode("utf-8", "replace")
        if target.bos >= 0
        else "",
        "eos_token": target.token_text(target.eos).decode("utf-8", "replace")
        if target.eos >= 0
        else "",
        "build_info": f"specrun {specrun.__version__} (llama-cpp-python {llcpp})",
        "is_sleeping": False,
        "specrun": {
            "model": state.model_id,
            "draft_model": state.draft_id,
            "mode": engine.mode,
            "draft_max": cfg.draft_max,
            "draft_min": cfg.draft_min,
            "draft_p_min": cfg.draft_p_min,
            "n_vocab": target.n_vocab,
            "n_batch": target.n_batch,
            "infill": not fim.missing(),
            "prompt_cache": w is not None and w.cache is not None,
        },
    }


def _only(body: dict[str, Any], route: str, allowed: set[str]) -> None:
    for name in body:
        if name not in allowed:
            raise bad(
                f"{name} is not a field of /{route} that specrun knows (it refuses what it would "
                f"otherwise ignore; the fields: {', '.join(sorted(allowed))})",
                name,
                "unknown_parameter",
            )


def mount(app: FastAPI, state: Any, read_body: Callable[[Request, int], Awaitable[bytes]]) -> None:
    """Add llama-server's native routes to ``app``; ``state`` is app.py's ServerState, ``read_body``
    its reader of a body within the size limit."""

    async def body_of(request: Request) -> dict[str, Any]:
        return parse_json(await read_body(request, state.max_body))

    @app.post("/completion")
    async def completion(request: Request) -> Response:
        engine = state.engine_or_503()
        body = await body_of(request)
        if "prompt" not in body:
            raise bad("prompt is required", "prompt", "missing_required_parameter")
        nat = parse_native(body, "completion", state, engine)
        try:
            tokens = mixed_tokens(engine.target, body["prompt"], "prompt", True, True)
        except SpecrunError as exc:
            raise bad(f"prompt: {exc}", "prompt") from None
        _fits(state, tokens, "prompt")
        return await run_native(state, request, nat, tokens)

    @app.post("/infill")
    async def infill(request: Request) -> Response:
        engine = state.engine_or_503()
        target = engine.target
        fim = fim_tokens(target)
        if fim.missing():
            raise APIError(
                400,
                f"Infill is not supported by this model: {'. '.join(fim.missing())}. "
                f"({state.model_id} has no fill-in-the-middle tokens in its vocabulary: serve a "
                "code model that has them, e.g. qwen2.5-coder-0.5b-instruct-q4_k_m)",
                None,
                "not_supported",
            )
        body = await body_of(request)
        prefix, suffix, extra, prompt = _infill_inputs(body)
        nat = parse_native(body, "infill", state, engine)
        try:
            prompt_tokens = list(target.tokenize(prompt, False, True)) if prompt else []
            for name, v in (("input_prefix", prefix), ("input_suffix", suffix)):
                if isinstance(v, list):
                    mixed_tokens(target, v, name, False, False)  # checks the ids
            inf = format_infill(
                target,
                fim,
                prefix,
                suffix,
                extra,
                prompt_tokens,
                # llama-server's budgets at its default batch (-b 2048, which llama.cpp clamps to
                # the context) unless ours is larger: an editor's request makes the same prompt
                # on either server
                n_batch=min(max(target.n_batch, INFILL_BATCH), state.n_ctx),
                n_ctx=state.n_ctx,
            )
        except SpecrunError as exc:
            raise bad(f"input: {exc}", None) from None
        _fits(state, inf.tokens, "input_prefix")
        return await run_native(state, request, nat, inf.tokens, inf.truncated)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        engine = state.engine_or_503()
        body = await body_of(request)
        _only(body, "tokenize", {"content", "add_special", "parse_special", "with_pieces"})
        target = engine.target
        if body.get("content") is None:
            return JSONResponse({"tokens": []})
        toks = mixed_tokens(
            target,
            body["content"],
            "content",
            _bool(body, "add_special", False),
            _bool(body, "parse_special", True),
        )
        if not _bool(body, "with_pieces", False):
            return JSONResponse({"tokens": toks})
        out = []
        for t in toks:
            raw = special_piece(target, t)
            try:
                piece: Any = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            out.append({"id": t, "piece": piece})
        return JSONResponse({"tokens": out})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        engine = state.engine_or_503()
        body = await body_of(request)
        _only(body, "detokenize", {"tokens"})
        toks = body.get("tokens") or []
        n = engine.target.n_vocab
        if not isinstance(toks, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in toks
        ):
            raise bad("tokens must be an array of token ids", "tokens", "invalid_type")
        for t in toks:
            if not 0 <= t < n:
                raise bad(f"tokens: token id {t} is outside the vocabulary (0..{n - 1})", "tokens")
        raw = b"".join(special_piece(engine.target, t) for t in toks)
        return JSONResponse({"content": raw.decode("utf-8", "replace")})

    @app.get("/props")
    async def props() -> Response:
        engine = state.engine_or_503()
        return JSONResponse(_props(state, engine))

    @app.post("/apply-template")
    async def apply_template(request: Request) -> Response:
        engine = state.engine_or_503()
        body = await body_of(request)
        _only(
            body,
            "apply-template",
            {"messages", "add_generation_prompt", "chat_template_kwargs", "model"},
        )
        messages = parse_messages(body.get("messages"))
        kw = body.get("chat_template_kwargs") or {}
        if not isinstance(kw, dict):
            raise bad(
                "chat_template_kwargs must be an object", "chat_template_kwargs", "invalid_type"
            )
        target = engine.target
        if not target.chat_template():
            raise bad(f"{state.model_id} has no chat template", "messages")
        try:
            text = render_chat(
                target,
                messages,
                add_generation_prompt=_bool(body, "add_generation_prompt", True),
                template_kwargs={**state.template_kwargs, **kw} or None,
            )
        except SpecrunError as exc:
            raise bad(f"messages: {exc}", "messages") from None
        return JSONResponse({"prompt": text})
