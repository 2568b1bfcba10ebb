"""The engines' workers: a thread per slot takes jobs from one bounded FIFO queue.

``serve`` runs one slot (one engine, one generation at a time) unless ``--parallel N``: then N
slots, each its own engine over its own sequence of one shared context (llama/slots.py), whose
verify passes run together in one batch. A job goes to the free slot whose cache shares the
longest prefix with its prompt (llama-server's slot choice), so a conversation keeps its slot.

A job's events go back to the request's event loop (``call_soon_threadsafe``); its ``cancel``
flag (a client that went away, the server shutting down) is read after every target pass, so a
cancelled generation frees its slot within one pass. The engine reuses the longest common token
prefix with what its caches hold, so a conversation resent whole evaluates only its tail.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from specrun.chat import common_prefix
from specrun.decoding.engine import Result, Step
from specrun.errors import SpecrunError
from specrun.llama.grammar import Grammar
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
    slot: int = -1

    def emit(self, *item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is gone
            pass


class QueueFull(Exception):
    pass


@dataclass
class _Slot:
    index: int
    engine: Any
    job: Job | None = None  # assigned or running
    thread: threading.Thread | None = None


class EngineWorker:
    """Runs jobs on the engines, in order of arrival, one per slot at a time."""

    def __init__(
        self,
        engine: Any,
        max_queue: int,
        on_done: Callable[[Job, list[Result], str], None],
        cache: PromptCache | None = None,
        engines: list[Any] | None = None,
    ) -> None:
        self.engines = list(engines) if engines else [engine]
        self.engine = self.engines[0]  # the vocabulary, template and settings routes read
        self.grouped = len(self.engines) > 1  # verify passes batched across slots
        self.cache = cache  # earlier prompts' KV caches (prompt_cache.py), or none
        self.max_queue = max_queue
        self.on_done = on_done
        self._lock = threading.Condition()
        self._pending: deque[Job] = deque()
        self.stopping = False
        self.recent_seconds = 1.0  # a running mean of job durations (Retry-After)
        self.slots = [_Slot(i, e) for i, e in enumerate(self.engines)]
        for sl in self.slots:
            sl.thread = threading.Thread(
                target=self._loop, args=(sl,), name=f"specrun-slot-{sl.index}", daemon=True
            )
            sl.thread.start()

    @property
    def waiting(self) -> int:
        """Jobs queued, not yet given a slot."""
        return len(self._pending)

    @property
    def running(self) -> list[Job]:
        """The jobs the slots run now."""
        return [sl.job for sl in self.slots if sl.job is not None]

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            if self.waiting >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self._pending.append(job)
            self._dispatch()

    def retry_after(self) -> int:
        return max(1, round(self.recent_seconds * (self.waiting + 1) / (2 * len(self.slots))))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what runs and what waits; end the threads."""
        with self._lock:
            self.stopping = True
            for job in self.running:
                job.cancel.set()
            for job in self._pending:
                job.cancel.set()
            self._lock.notify_all()
        for sl in self.slots:
            if sl.thread is not None:
                sl.thread.join(timeout)

    def _dispatch(self) -> None:
        """Give queued jobs to free slots (with the lock held): the oldest job first, to the
        free slot whose target cache shares the longest prefix with its prompt."""
        while self._pending:
            free = [sl for sl in self.slots if sl.job is None]
            if not free:
                return
            job = self._pending.popleft()
            best = max(
                free, key=lambda sl: (common_prefix(sl.engine.target.cached, job.tokens), -sl.index)
            )
            best.job = job
            job.slot = best.index
            self._lock.notify_all()

    # -- the threads ----------------------------------------------------------------------
    def _loop(self, sl: _Slot) -> None:
        while True:
            with self._lock:
                while sl.job is None and not self.stopping:
                    self._lock.wait()
                job = sl.job
                if job is None:  # stopping, nothing assigned
                    self._drain()
                    return
            results: list[Result] = []
            state = "cancelled"
            try:
                if job.cancel.is_set() or self.stopping:
                    continue
                job.started = time.perf_counter()
                results, state = self._run(job, sl.engine)
                self.recent_seconds += 0.2 * (
                    time.perf_counter() - job.started - self.recent_seconds
                )
                try:
                    self.on_done(job, results, state)
                except Exception:  # noqa: BLE001 - bookkeeping never stops the engine
                    pass
            finally:
                with self._lock:
                    sl.job = None
                    self._dispatch()
                job.emit("end", results, state)  # always: a request never waits forever

    def _drain(self) -> None:
        """Stopping: the jobs still queued end cancelled (lock held)."""
        while self._pending:
            self._pending.popleft().emit("end", [], "cancelled")

    def _run(self, job: Job, engine: Any) -> tuple[list[Result], str]:
        req = job.req
        results: list[Result] = []
        state = "done"
        before = engine.configure(**req.spec) if req.spec else None
        try:
            if self.cache is not None and req.cache_prompt:
                self.cache.prepare(engine, job.tokens)
            for i in range(req.n):
                constraint = None
                if req.structured.gbnf:  # a fresh grammar state per completion
                    constraint = Grammar.compile(engine.target, req.structured.gbnf, checked=True)
                gen = engine.generate(
                    job.tokens,
                    max_tokens=req.max_tokens or 0,
                    params=replace(req.params, seed=req.params.seed + i),
                    stop=req.stop,
                    reuse_cache=req.cache_prompt,
                    constraint=constraint,
                )
                if self.grouped:  # its verify passes join the other slots' from now on
                    engine.target.join()
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
                    if self.grouped:
                        engine.target.leave()
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
