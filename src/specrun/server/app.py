"""The FastAPI application: OpenAI's routes over the engine worker, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specrun.chat_template import encode_prompt, render_chat, tokenize_chat
from specrun.decoding.sampling import SamplingParams
from specrun.errors import SpecrunError
from specrun.llama.grammar import Grammar, GrammarError
from specrun.server import native
from specrun.server import responses as R
from specrun.server.errors import APIError, bad, error_body
from specrun.server.metrics import CONTENT_TYPE, Metrics
from specrun.server.requests import (
    GenRequest,
    check_spec,
    parse_json,
    parse_request,
    resolve_bias,
)
from specrun.server.worker import EngineWorker, Job, QueueFull
from specrun.tools import detect_format

MAX_BODY = 8 << 20  # bytes: far above any prompt a context holds, far below a memory problem
OPEN_PATHS = (
    "/health",
    "/v1/health",
)  # answered without the API key (load balancers, llama-server)


@dataclass
class ServerState:
    """What the routes share: the loaded engine (None while loading) and the server's settings."""

    defaults: SamplingParams
    api_key: str | None = None
    max_body: int = MAX_BODY
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    metrics: Metrics = field(default_factory=Metrics)
    loaded: Any = None
    worker: EngineWorker | None = None
    model_id: str = "specrun"
    draft_id: str | None = None
    n_ctx: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    status: Any = None  # the status line / log (status.py)

    @property
    def ready(self) -> bool:
        return self.worker is not None

    def engine_or_503(self) -> Any:
        if self.worker is None:
            raise APIError(503, "Loading model", code="loading", headers={"Retry-After": "5"})
        return self.worker.engine


def create_app(state: ServerState, cors: list[str] | None = None) -> FastAPI:
    app = FastAPI(title="specrun", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specrun = state

    app.add_middleware(
        Edge, state=state
    )  # a plain ASGI layer: nothing in the way of a stream's chunks

    if cors:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cors,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            allow_credentials="*" not in cors,
        )

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> Response:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        msg = {404: "no such route", 405: "method not allowed"}.get(
            exc.status_code, str(exc.detail)
        )
        return JSONResponse(
            error_body(
                exc.status_code,
                f"{msg}: {_request.method} {_request.url.path}",
                code="not_found" if exc.status_code == 404 else None,
            ),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def crash(_request: Request, exc: Exception) -> Response:
        return JSONResponse(
            error_body(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500
        )

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> Response:
        if not state.ready:
            return JSONResponse(
                error_body(503, "Loading model", code="loading"),
                status_code=503,
                headers={"Retry-After": "5"},
            )
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> Response:
        engine = state.engine_or_503()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": state.model_id,
                        "object": "model",
                        "created": state.created,
                        "owned_by": "specrun",
                        "context_length": state.n_ctx,
                        "draft_model": state.draft_id,
                        "meta": {
                            "n_ctx": state.n_ctx,
                            "draft": state.draft_id is not None,
                            "mode": engine.mode,
                            "draft_max": engine.config.draft_max,
                            "n_vocab": engine.target.n_vocab,
                        },
                    }
                ],
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        w = state.worker
        if w is not None:
            state.metrics.deferred.set(w.waiting)
            state.metrics.processing.set(len(w.running))
            if w.cache is not None:
                for what, v in w.cache.stats().items():
                    state.metrics.prompt_cache.labels(what).set(v)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, "chat")

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completion")

    native.mount(app, state, _read_body)
    return app


class Edge:
    """The API key, the body size, and each request counted by route and status: in front of
    every route, as a plain ASGI layer (Starlette's BaseHTTPMiddleware relays a streamed body
    through a task and a memory channel, a cost on every chunk)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state, path = self.state, scope["path"]
        status = [500]

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            problem = self._refuse(scope)
            if problem is not None:
                await _error_response(problem)(scope, receive, sending)
            else:
                await self.app(scope, receive, sending)
        finally:
            state.metrics.requests.labels(_endpoint(path), str(status[0])).inc()

    def _refuse(self, scope: Any) -> APIError | None:
        state = self.state
        headers = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())
        }
        if (
            state.api_key is not None
            and scope["path"] not in OPEN_PATHS
            and scope["method"] != "OPTIONS"
        ):
            auth = headers.get("authorization", "")
            scheme, _, key = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                key.strip().encode(), state.api_key.encode()
            ):
                return APIError(
                    401,
                    "Invalid API key: send Authorization: Bearer KEY"
                    if auth
                    else "Missing API key: send Authorization: Bearer KEY",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > state.max_body:
            return APIError(
                413,
                f"the request body is {int(length)} bytes; the limit is {state.max_body}",
                code="request_too_large",
            )
        return None


def _endpoint(path: str) -> str:
    known = (
        "/v1/chat/completions",
        "/chat/completions",
        "/v1/completions",
        "/completions",
        "/v1/models",
        "/models",
        "/health",
        "/v1/health",
        "/metrics",
        "/completion",
        "/infill",
        "/tokenize",
        "/detokenize",
        "/props",
        "/apply-template",
    )
    return path if path in known else "other"


def _error_response(exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(
                413,
                f"the request body is over the limit of {limit} bytes",
                code="request_too_large",
            )
        chunks.append(part)
    return b"".join(chunks)


def _encode(state: ServerState, engine: Any, req: GenRequest) -> list[int]:
    target = engine.target
    param = "messages" if req.kind == "chat" else "prompt"
    try:
        if req.kind == "chat":
            if not target.chat_template():
                raise bad(
                    f"{state.model_id} has no chat template: use /v1/completions, or start the "
                    "server with --chat-template",
                    "messages",
                )
            # The request's chat_template_kwargs over the server's --chat-template-kwargs.
            kwargs = {**(state.template_kwargs or {}), **req.template_kwargs}
            st = req.structured
            if st.tools:
                st.fmt = detect_format(target.chat_template())
                if st.fmt is None:
                    raise bad(
                        f"tools: {state.model_id}'s chat template has no tool support (it "
                        "renders no tools): send the request without tools, or start the "
                        "server with a model or --chat-template that has it",
                        "tools",
                        "unsupported_parameter",
                    )
                if st.calls_tools:
                    kwargs["tools"] = st.tools
                if st.forces_call:
                    st.gbnf, st.gbnf_param = st.call_grammar(st.fmt), "tools"
            text = render_chat(target, req.messages or [], template_kwargs=kwargs or None)
            req.thinking_open = R.thinking_open(text[-64:])
            tokens = tokenize_chat(target, text)
        elif isinstance(req.prompt, list):
            bad_ids = [t for t in req.prompt if not 0 <= t < target.n_vocab]
            if bad_ids:
                raise bad(
                    f"prompt: token id {bad_ids[0]} is outside the vocabulary (0..{target.n_vocab - 1})",
                    "prompt",
                )
            tokens = list(req.prompt)
        else:
            tokens, _ = encode_prompt(target, req.prompt or "", False, None, None)
    except SpecrunError as exc:
        raise bad(f"{param}: {exc}", param) from None
    if not tokens:
        raise bad(f"{param}: the prompt is empty", param)
    if len(tokens) >= state.n_ctx:
        raise APIError(
            400,
            f"{param}: the prompt is {len(tokens)} tokens but the context holds "
            f"{state.n_ctx}: {len(tokens) - state.n_ctx + 1} too many (start the server "
            "with a larger --ctx, or shorten the prompt)",
            param,
            "context_length_exceeded",
        )
    return tokens


def _check_grammar(engine: Any, req: GenRequest) -> None:
    """Compile the request's grammar once against the target's vocabulary: an invalid one is a
    400 naming its field, before the request waits in the queue."""
    st = req.structured
    try:
        Grammar.compile(engine.target, st.gbnf or "", param=st.gbnf_param).close()
    except GrammarError as exc:
        raise bad(str(exc), st.gbnf_param) from None


async def _generate(state: ServerState, request: Request, kind: str) -> Response:
    engine = state.engine_or_503()
    body = parse_json(await _read_body(request, state.max_body))
    req = parse_request(body, kind, state.defaults, state.n_ctx)
    check_spec(req.spec, engine)
    if req.logit_bias:
        req.params = replace(req.params, logit_bias=resolve_bias(req.logit_bias, engine.target))
    tokens = _encode(state, engine, req)
    if req.structured.gbnf:
        _check_grammar(engine, req)
    # To the end of the context when not given, and never past it (finish_reason "length"), as
    # llama-server.
    room = state.n_ctx - len(tokens)
    req.max_tokens = room if req.max_tokens is None else min(req.max_tokens, room)
    job = Job(req, tokens, asyncio.get_running_loop())
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
    rid = R.new_id(kind)
    model = req.model or state.model_id
    piece = engine.target.piece if req.logprobs else None
    reasoning = (req.reasoning_format, req.thinking_open) if kind == "chat" else None
    if req.stream:
        return StreamingResponse(
            _stream(job, kind, rid, model, piece),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    results = await _collect(job, request)
    body = R.completion(kind, rid, model, results, req.return_tokens, piece, reasoning)
    if req.structured.calls_tools:
        R.tool_choices(body, results, req.structured)
    return JSONResponse(body)


async def _next(job: Job, request: Request | None) -> tuple[Any, ...]:
    """The job's next event; while waiting, notice a client that went away (then cancel)."""
    getter = asyncio.ensure_future(job.events.get())
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=0.25)
            if done:
                return getter.result()
            if request is not None and await request.is_disconnected():
                job.cancel.set()
    finally:
        if not getter.done():
            getter.cancel()


async def _collect(job: Job, request: Request) -> list[Any]:
    try:
        while True:
            item = await _next(job, request)
            if item[0] == "error":
                raise APIError(
                    item[1], item[2], code="server_error" if item[1] >= 500 else "invalid_value"
                )
            if item[0] == "end":
                results, state = item[1], item[2]
                if state == "cancelled" or len(results) < job.req.n:
                    raise APIError(
                        503,
                        "the generation was cancelled (the server is shutting down)",
                        code="cancelled",
                    )
                return results
    finally:
        job.cancel.set()  # a no-op once it ended; stops it when this handler is torn down


async def _stream(
    job: Job, kind: str, rid: str, model: str, piece: Any = None
) -> AsyncIterator[bytes]:
    req = job.req
    created = int(time.time())
    usage_too = req.include_usage
    started: set[int] = set()
    tools = kind == "chat" and req.structured.calls_tools
    held: dict[int, Any] = {}  # choice -> tools.HoldBack: text that may be a call waits
    # choice -> the reasoning splitter (chat, reasoning_format other than none)
    thinking: dict[int, R.ReasoningStream] = {}
    split = kind == "chat" and req.reasoning_format != "none"
    pending: dict[int, list[Any]] = {}  # choice -> token probabilities not sent yet
    offsets: dict[int, int] = {}  # choice -> text offset (the legacy completions' logprobs)

    def lp_of(i: int) -> dict[str, Any] | None:
        """The log probabilities of the tokens since the last chunk of choice ``i``."""
        probs = pending.pop(i, None)
        if piece is None or probs is None:
            return None
        if kind == "chat":
            return R.chat_logprobs(probs, piece)
        out = R.completion_logprobs(probs, piece, offsets.get(i, 0))
        offsets[i] = offsets.get(i, 0) + sum(len(t) for t in out["tokens"])
        return out

    def content(i: int, text: str, out: list[bytes]) -> None:
        """Send ``text`` of choice ``i``: split into reasoning and content, tool calls held."""
        parts = [("content", text)]
        if split:
            parts = thinking.setdefault(i, R.ReasoningStream(req.thinking_open)).feed(text)
        for what, t in parts:
            if what == "reasoning_content":
                out.append(ch([R.delta_choice(kind, i, None, reasoning=t, logprobs=lp_of(i))]))
                continue
            if tools and t:
                t = held.setdefault(i, R.hold_back(req.structured)).feed(t)
            if t:
                out.append(ch([R.delta_choice(kind, i, t, logprobs=lp_of(i))]))

    def ch(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return R.sse(R.chunk(kind, rid, model, created, choices, usage_too, **extra))

    def opened(i: int, out: list[bytes]) -> None:
        if kind == "chat" and i not in started:  # a choice's first chunk names the role
            out.append(ch([R.delta_choice(kind, i, "", role=True)]))
            started.add(i)

    def render(item: tuple[Any, ...], out: list[bytes]) -> bool:
        """Append the SSE bytes of one event; True at the end of the stream."""
        tag = item[0]
        if tag == "step":
            i, ev = item[1], item[2]
            opened(i, out)
            if piece is not None and ev.probs:
                pending.setdefault(i, []).extend(ev.probs)
            if ev.text:
                content(i, ev.text, out)
        elif tag == "result":
            i, res = item[1], item[2]
            opened(i, out)
            if split and i in thinking:
                for what, txt in thinking[i].finish():
                    if what == "reasoning_content":
                        out.append(ch([R.delta_choice(kind, i, None, reasoning=txt)]))
                    elif tools:
                        txt = held.setdefault(i, R.hold_back(req.structured)).feed(txt)
                        if txt:
                            out.append(ch([R.delta_choice(kind, i, txt)]))
                    else:
                        out.append(ch([R.delta_choice(kind, i, txt)]))
            extra: dict[str, Any] = {
                "timings": R.timings(res.stats, R.cached_of(res)),
                "specrun": R.specrun_stats(res),
            }
            if req.return_tokens:
                extra["tokens"] = list(res.tokens)
            reason = R.FINISH.get(res.finish_reason, "stop")
            if tools:
                hb = held.setdefault(i, R.hold_back(req.structured))
                rest, calls = hb.finish(req.structured.tools)
                if not req.structured.parallel:
                    calls = calls[:1]
                if rest:
                    out.append(ch([R.delta_choice(kind, i, rest)]))
                for j, c in enumerate(calls):
                    out += [ch([d]) for d in R.tool_call_deltas(i, j, c)]
                if calls:
                    reason = "tool_calls"
            fin = R.delta_choice(kind, i, None if kind == "chat" else "", reason, logprobs=lp_of(i))
            out.append(ch([fin], **extra))
        elif tag == "error":
            out.append(R.sse({"error": error_body(item[1], item[2])["error"]}))
            return True
        elif tag == "end":
            results, st = item[1], item[2]
            if st == "cancelled":
                out.append(
                    R.sse(
                        {
                            "error": error_body(
                                503,
                                "the generation was cancelled (the server is shutting down)",
                                code="cancelled",
                            )["error"]
                        }
                    )
                )
            elif usage_too and results:
                u, t, s = R.merged_stats(results)
                out.append(
                    R.sse(
                        R.chunk(kind, rid, model, created, [], False, usage=u, timings=t, specrun=s)
                    )
                )
            return True
        return False

    try:
        first: list[bytes] = []
        opened(0, first)
        if first:
            yield first[0]
        done = False
        while not done:
            # Wait on the queue itself: a client that goes away cancels this task (and so the job,
            # below); send everything already waiting in one write when the loop fell behind.
            items = [await job.events.get()]
            while not job.events.empty():
                items.append(job.events.get_nowait())
            out: list[bytes] = []
            for item in items:
                done = render(item, out)
                if done:
                    break
            if out:
                yield b"".join(out)
        yield R.sse("[DONE]")
    finally:
        job.cancel.set()  # the client went away (the response was torn down) or it ended
