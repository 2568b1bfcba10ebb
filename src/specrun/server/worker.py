"""One engine, one generation at a time: a worker thread takes jobs from a bounded FIFO queue.

A job's events go back to the request's event loop (``call_soon_threadsafe``); its ``cancel``
flag (a client that went away, the server shutting down) is read after every target pass, so a
cancelled generation frees the engine within one pass. The engine reuses the longest common
token prefix with what its caches hold, so a conversation resent whole evaluates only its tail.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from specrun.decoding.engine import Result, Step
from specrun.errors import SpecrunError
from specrun.server.prompt_cache import PromptCache
from specrun.server.requests import GenRequest


@dataclass
class Job:
    req: GenRequest
    tokens: list[int]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[tuple[Any, ...]] = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)
    started: float | None = None

    def emit(self, *item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is gone
            pass


class QueueFull(Exception):
    pass


class EngineWorker:
    """Runs jobs on the engine, in order, one at a time."""

    def __init__(
        self,
        engine: Any,
        max_queue: int,
        on_done: Callable[[Job, list[Result], str], None],
        cache: PromptCache | None = None,
    ) -> None:
        self.engine = engine
        self.cache = cache  # earlier prompts' KV caches (prompt_cache.py), or none
        self.max_queue = max_queue
        self.on_done = on_done
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0  # jobs queued, not yet running
        self.running: Job | None = None
        self.stopping = False
        self.recent_seconds = 1.0  # a running mean of job durations (Retry-After)
        self._thread = threading.Thread(target=self._loop, name="specrun-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            if self.waiting >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self.waiting += 1
        self._q.put(job)

    def retry_after(self) -> int:
        return max(1, round(self.recent_seconds * (self.waiting + 1) / 2))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what runs and what waits; end the thread."""
        with self._lock:
            self.stopping = True
            running = self.running
        if running is not None:
            running.cancel.set()
        self._q.put(None)
        self._thread.join(timeout)

    # -- the thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            with self._lock:
                self.waiting -= 1
                self.running = job
            results: list[Result] = []
            state = "cancelled"
            try:
                if job.cancel.is_set() or self.stopping:
                    continue
                job.started = time.perf_counter()
                results, state = self._run(job)
                self.recent_seconds += 0.2 * (
                    time.perf_counter() - job.started - self.recent_seconds
                )
                try:
                    self.on_done(job, results, state)
                except Exception:  # noqa: BLE001 - bookkeeping never stops the engine
                    pass
            finally:
                with self._lock:
                    self.running = None
                job.emit("end", results, state)  # always: a request never waits forever

    def _run(self, job: Job) -> tuple[list[Result], str]:
        engine, req = self.engine, job.req
        results: list[Result] = []
        state = "done"
        before = engine.configure(**req.spec) if req.spec else None
        try:
            if self.cache is not None and req.cache_prompt:
                self.cache.prepare(engine, job.tokens)
            for i in range(req.n):
                constraint = None
                if req.structured.gbnf:  # a fresh grammar state per completion
                    from specrun.llama.grammar import Grammar

                    constraint = Grammar.compile(engine.target, req.structured.gbnf, checked=True)
                gen = engine.generate(
                    job.tokens,
                    max_tokens=req.max_tokens or 0,
                    params=replace(req.params, seed=req.params.seed + i),
                    stop=req.stop,
                    reuse_cache=req.cache_prompt,
                    constraint=constraint,
                )
                try:
                    for ev in gen:
                        if isinstance(ev, Result):
                            results.append(ev)
                        elif isinstance(ev, Step) and req.stream:  # a whole response needs no steps
                            job.emit("step", i, ev)
                        if job.cancel.is_set():
                            state = "cancelled"
                            break
                finally:
                    gen.close()  # the engine's own finally: its caches match what it yielded
                    if constraint is not None:
                        constraint.close()
                if state != "done":
                    break
                job.emit("result", i, results[-1])
        except SpecrunError as exc:
            state = "error"
            job.emit("error", 400, str(exc))
        except Exception as exc:  # a bug or llama.cpp failure: answer 500, start the caches clean
            state = "error"
            engine.reset()
            job.emit("error", 500, f"internal error: {type(exc).__name__}: {exc}")
        finally:
            if before is not None:
                engine.configure(
                    mode=before.mode,
                    draft_max=before.draft_max,
                    draft_min=before.draft_min,
                    draft_p_min=before.draft_p_min,
                )
        return results, state
