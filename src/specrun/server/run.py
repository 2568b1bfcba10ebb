"""``specrun serve``: bind, answer /health 503 while the models load, then serve; SIGINT/SIGTERM
stop accepting, cancel what runs and waits, close the models and return 0."""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import threading
import time
from collections.abc import Generator
from typing import Any

import uvicorn

from specrun.errors import SpecrunError
from specrun.server.app import MAX_BODY, ServerState, create_app
from specrun.server.prompt_cache import PromptCache
from specrun.server.status import Status
from specrun.server.worker import EngineWorker, Job
from specrun.session import load_engine


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    h = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in h else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((h, port))
        sock.listen(128)
        sock.set_inheritable(True)
    except OSError as exc:
        raise SpecrunError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve(
    opts: Any,
    defaults: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    cors: list[str] | None = None,
    queue: int = 64,
    cache_ram: int = 8192,
    template_kwargs: dict[str, Any] | None = None,
    max_body: int = MAX_BODY,
    tty: bool | None = None,
) -> int:
    if queue < 1:
        raise SpecrunError("--queue must be >= 1")
    status = Status(tty)
    if not is_loopback(host) and not api_key:
        status.log(
            f"warning: listening on {host}, beyond this machine, without --api-key: anyone who "
            "can reach it can use it"
        )
    sock = bind(host, port)
    real_port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    status.url = f"http://{shown}:{real_port}"
    state = ServerState(
        defaults=defaults,
        api_key=api_key or None,
        max_body=max_body,
        template_kwargs=dict(template_kwargs or {}),
        status=status,
    )
    app = create_app(state, cors)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
        server_header=False,
    )
    server = _Server(config)
    failure: list[BaseException] = []

    def on_done(job: Job, results: list[Any], st: str) -> None:
        for r in results:
            state.metrics.record(r.stats, r.prompt_tokens)
        if st == "cancelled":
            state.metrics.cancelled.inc()
        cached = (
            max(0, results[0].prompt_tokens - results[0].stats.prefill_tokens) if results else 0
        )
        status.done(
            f"/v1/{'chat/' if job.req.kind == 'chat' else ''}completions",
            len(job.tokens),
            cached,
            results,
            st,
            time.perf_counter() - (job.started or job.enqueued),
        )

    def load() -> None:
        try:
            loaded = load_engine(
                opts, status=status.say, warn=lambda m: status.log(f"warning: {m}")
            )
        except BaseException as exc:  # noqa: BLE001 - reported after the server stops
            failure.append(exc)
            server.should_exit = True
            return
        if server.should_exit:  # stopped while loading
            loaded.close()
            return
        engine = loaded.engine
        state.loaded = loaded
        state.model_id = loaded.plan.target.name
        state.draft_id = loaded.plan.draft.name if loaded.plan.draft is not None else None
        state.n_ctx = engine.target.n_ctx
        cache = (
            PromptCache(cache_ram * 1024 * 1024 if cache_ram > 0 else -1)
            if cache_ram != 0 and not engine.target.is_recurrent
            else None
        )
        worker = EngineWorker(engine, queue, on_done, cache, engines=loaded.engines)
        status.worker, status.metrics = worker, state.metrics
        state.worker = worker  # last: /health turns 200 now
        draft = f" + draft {state.draft_id}" if state.draft_id else ""
        status.log(
            f"ready: {state.model_id}{draft}, mode {engine.mode}, context {state.n_ctx}"
            + (f" x {len(loaded.engines)} slots" if len(loaded.engines) > 1 else "")
            + f", queue {queue}"
            + (
                f", prompt cache {'no limit' if cache_ram < 0 else f'{cache_ram} MiB'}"
                if cache is not None
                else ""
            )
        )

    server.on_exit = lambda: _cancel_all(state)
    status.log(f"listening on {status.url} (OpenAI API at {status.url}/v1)")
    loader = threading.Thread(target=load, name="specrun-load", daemon=True)
    status.start()
    try:
        loader.start()
        server.run(sockets=[sock])
    finally:
        _cancel_all(state)
        loader.join()
        if state.worker is not None:
            state.worker.stop()
        status.stop()
        if state.loaded is not None:
            state.loaded.close()
        sock.close()
    if failure:
        raise failure[0]
    status.log(f"stopped ({status.served} requests served)")
    return 0


def _cancel_all(state: ServerState) -> None:
    """Signal-safe (no locks): stop taking jobs, stop the one that runs; the rest end cancelled."""
    w = state.worker
    if w is None:
        return
    w.stopping = True
    for job in list(w.running):
        job.cancel.set()


class _Server:
    """uvicorn's server with specrun's own signal handling: the first SIGINT/SIGTERM stops it
    gracefully (in-flight generations are cancelled at their next target pass), a second one
    forces it; the signal is not raised again afterwards, so the process exits 0."""

    def __new__(cls, config: Any) -> Any:
        class Server(uvicorn.Server):
            on_exit: Any = None

            @contextlib.contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return

                def handler(_sig: int, _frame: Any) -> None:
                    if self.should_exit:
                        self.force_exit = True
                    self.should_exit = True
                    if self.on_exit is not None:
                        self.on_exit()

                before = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for s, h in before.items():
                        signal.signal(s, h)

        return Server(config)
