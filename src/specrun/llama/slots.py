"""Several sequences in one context: ``serve --parallel N``.

A ``Slots`` holds a ``Model`` loaded with ``LoadOptions.n_seq = N`` and gives one ``SeqModel`` per
sequence id: a ``Target`` (decoding/target.py) with its own cache, positions and logits, so that
each slot runs an ordinary ``Engine``. What they share is the context, and that is the point:

- **One target pass verifies every slot.** A slot's verify (``decode`` with logits) waits until
  every slot that is generating has handed in its own, then one ``llama_decode`` scores all their
  rows (continuous batching: a slot joins at its next pass, one that finishes leaves). Passes that
  need no company, a prompt's prefill, a draft model's steps, run at once.
- **A request's output does not depend on what runs beside it.** The row-exact kernels score each
  row of a batch as they score it alone, and patches/' seq-cells puts sequence s's position p in
  cell s*n_ctx + p: a row meets its own sequence's cells at the indices it meets them alone, the
  others masked and skipped. Greedy output is the same token for token whatever else is in the
  batch (tests/test_slots.py).

llama.cpp's calls on one context are not thread-safe, and two passes at once on a 2-core machine
only slow each other down: every call that computes or edits a cache takes ``COMPUTE``, one lock
for all contexts of the process. And every pass runs on one thread (``_Runner``), whichever slot
asked for it: ggml's OpenMP gives each thread that starts a parallel region a team of its own,
whose workers spin a while after each pass, so passes started by N slot threads kept N teams
spinning on 2 cores (a lone slot's decoding then ran 1.5x slower, draft and target alike).
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llama_cpp as ll
import numpy as np

from specrun.errors import SpecrunError
from specrun.llama import native
from specrun.llama.model import Model, StateData, _get_logits_addr, state_buffer, state_view

COMPUTE = threading.RLock()


class _Runner:
    """One thread that runs every pass of every Slots context (the module docstring says why)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, tuple[Any, ...], list[Any], threading.Event]]
        self._jobs = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def call(self, fn: Any, *args: Any) -> Any:
        if self._thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._loop, name="specrun-compute", daemon=True
                    )
                    self._thread.start()
        box: list[Any] = []
        done = threading.Event()
        self._jobs.put((fn, args, box, done))
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _loop(self) -> None:
        while True:
            fn, args, box, done = self._jobs.get()
            try:
                box.append(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                box.append(exc)
            done.set()


_RUNNER = _Runner()


def _decode(ctx: Any, batch: Any) -> int:
    rc = int(ll.llama_decode(ctx, batch))
    if rc == 0:  # a backend may still be computing: the pass's time is all of it
        ll.llama_synchronize(ctx)
    return rc


# Most rows one pass may hold: the row-exact kernels (attention and matmuls) cover batches of up to
# 65 rows; from 66 llamafile's sgemm takes a pass (patches/: sgemm-prompts). Slots whose rows add
# up to more run in several passes.
MAX_ROWS = 65


@dataclass
class _Verify:
    view: SeqModel
    tokens: list[int]
    pos0: int
    logits_from: int
    done: bool = False
    error: BaseException | None = None


class Group:
    """The slots that are generating, over one target context and its draft model's: the passes
    they hand in, and when to run them.

    A slot is *parked* while it waits for a pass (a verify on the target, a draft step on the
    draft model). When every generating slot is parked, the draft steps handed in run first, as
    one pass on the draft model's context (a slot that drafts verifies next), else the verifies,
    as one pass on the target's: every verify pass holds every generating slot's rows, and the
    slots drafting at once share a draft pass. A pass asked for by a slot that is not generating
    (calibration, a test) runs at once, alone."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.active: set[int] = set()
        self.waiting: dict[Slots, list[_Verify]] = {}  # draft models' contexts first
        self.running = False

    def add(self, slots: Slots, drafts: bool) -> None:
        items = list(self.waiting.items())
        items.insert(0 if drafts else len(items), (slots, []))
        self.waiting = dict(items)

    def join(self, seq: int) -> None:
        with self.cond:
            self.active.add(seq)

    def leave(self, seq: int) -> None:
        with self.cond:
            self.active.discard(seq)
            self.cond.notify_all()

    def submit(self, slots: Slots, job: _Verify) -> None:
        with self.cond:
            alone = job.view.seq not in self.active
            if not alone:
                self.waiting[slots].append(job)
                self.cond.notify_all()
                while not job.done:
                    ready = self._ready()
                    if ready is None:
                        self.cond.wait()
                        continue
                    # every generating slot is parked: this thread runs the pass for them
                    self.running = True
                    self.cond.release()
                    try:
                        ready[0]._run(ready[1])
                    finally:
                        self.cond.acquire()
                        self.running = False
                        self.cond.notify_all()
        if alone:
            # not generating (calibration, a test): no group keeps the next pass on this context
            # from coming before this one's logits are read, so they are copied
            slots._run([job], copy=True)
        if job.error is not None:
            raise job.error

    def _ready(self) -> tuple[Slots, list[_Verify]] | None:
        if self.running:
            return None
        parked = {j.view.seq for jobs in self.waiting.values() for j in jobs}
        if not parked or not parked >= self.active:
            return None
        for slots, jobs in self.waiting.items():
            if jobs:
                self.waiting[slots] = []
                return slots, jobs
        return None


class Slots:
    """The sequences of one multi-sequence ``Model`` (a ``Group``'s target or draft context)."""

    def __init__(self, model: Model, group: Group | None = None, drafts: bool = False) -> None:
        n = model.opts.n_seq
        if n < 1:
            raise SpecrunError("a context holds at least one sequence")
        self.model = model
        self.n_seq = n
        self.n_ctx_seq = model.n_ctx // n  # each sequence's cells (seq-cells: s*n_ctx_seq + p)
        self.passes = 0  # passes that held several slots' rows
        self.rows = 0  # rows they held
        self.group = group if group is not None else Group()
        self.group.add(self, drafts)
        self._cap = max(model.n_batch, MAX_ROWS)
        self._batch = ll.llama_batch_init(self._cap, 0, 1)
        b = self._batch
        self._b_token = np.ctypeslib.as_array(b.token, shape=(self._cap,))
        self._b_pos = np.ctypeslib.as_array(b.pos, shape=(self._cap,))
        self._b_logits = np.ctypeslib.as_array(b.logits, shape=(self._cap,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(self._cap,))[:] = 1
        self.views = [SeqModel(self, s) for s in range(n)]

    def close(self) -> None:
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None

    def _run(self, jobs: list[_Verify], copy: bool = False) -> None:
        """Score every job's rows: one pass while they fit in MAX_ROWS, more where they do not
        (each job whole in one pass; the logits of all but the last pass copied out)."""
        passes: list[list[_Verify]] = [[]]
        rows = 0
        for j in jobs:
            if rows + len(j.tokens) > MAX_ROWS and passes[-1]:
                passes.append([])
                rows = 0
            passes[-1].append(j)
            rows += len(j.tokens)
        try:
            for i, group in enumerate(passes):
                self.decode_rows(group, copy=copy or i < len(passes) - 1)
        except BaseException as exc:  # noqa: BLE001 - each slot's engine raises it
            for j in jobs:
                if not j.done:
                    j.error = exc
        finally:
            for j in jobs:
                j.done = True

    # -- passes ------------------------------------------------------------------------------
    def decode_rows(self, jobs: Sequence[_Verify], copy: bool = False) -> None:
        """One llama_decode over ``jobs`` (rows in job order; ``logits_from`` relative to each
        job's tokens, negative: none). Each job's view gets its rows' logits: views into
        llama.cpp's output buffer, or copies (``copy``) when another pass follows."""
        n = sum(len(j.tokens) for j in jobs)
        if n == 0:
            return
        if n > self._cap:
            raise SpecrunError(f"{n} rows in one pass, the batch holds {self._cap}")
        with COMPUTE:  # the batch, the pass and its output buffer: one thread at a time
            b = self._batch
            r = 0
            for j in jobs:
                m = len(j.tokens)
                self._b_token[r : r + m] = j.tokens
                self._b_pos[r : r + m] = np.arange(j.pos0, j.pos0 + m, dtype=np.int32)
                self._b_logits[r : r + m] = 0
                if j.logits_from >= 0:
                    self._b_logits[r + j.logits_from : r + m] = 1
                for i in range(r, r + m):
                    b.seq_id[i][0] = j.view.seq
                r += m
            b.n_tokens = n
            ctx = self.model._ctx
            t0 = time.perf_counter()
            rc = _RUNNER.call(_decode, ctx, b)
            dt = time.perf_counter() - t0
            if rc != 0:
                raise SpecrunError(
                    f"llama_decode failed (code {rc}) for {self.model.path.name}"
                    + (" (no free cells for a sequence: its context is full)" if rc == 1 else "")
                )
            self.model.llama_seconds += dt
            n_out = int(self._b_logits[:n].sum())
            out: np.ndarray | None = None
            if n_out:
                addr = _get_logits_addr(ctx)
                buf = (ctypes.c_float * (n_out * self.model.n_vocab)).from_address(addr)
                out = np.frombuffer(memoryview(buf), dtype=np.float32).reshape(n_out, -1)
                if copy:
                    out = out.copy()
            o = 0
            for j in jobs:
                v = j.view
                v.llama_seconds += dt * len(j.tokens) / n
                v._held[j.pos0 :] = j.tokens
                if j.logits_from >= 0 and out is not None:
                    k = len(j.tokens) - j.logits_from
                    v._out_rows = list(out[o : o + k])
                    v._out_first = j.logits_from
                    o += k
                else:
                    v._out_rows = ()
        if len(jobs) > 1:
            self.passes += 1
            self.rows += n


class SeqModel:
    """Sequence ``seq`` of a ``Slots``' context as a ``Target``: its own cached tokens, positions
    0..n_ctx_seq-1 and logits; the vocabulary and facts are the model's."""

    def __init__(self, slots: Slots, seq: int) -> None:
        self.slots = slots
        self.seq = seq
        self.model = slots.model
        m = slots.model
        self.path = m.path
        self.opts = m.opts
        self.n_vocab = m.n_vocab
        self.n_ctx = slots.n_ctx_seq
        self.n_ctx_train = m.n_ctx_train
        self.n_batch = m.n_batch
        self.n_threads = m.n_threads
        self.n_outputs_max = MAX_ROWS
        self.llama_seconds = 0.0
        self.can_truncate = m.can_truncate
        self.single_rows = False
        self.shared = True  # its passes carry other slots' rows (Target.shared)
        self.top_prob_fn = m.top_prob_fn
        self.load_report = m.load_report
        self._held: list[int] = []
        self._out_rows: Sequence[np.ndarray] = ()
        self._out_first = 0

    def __getattr__(self, name: str) -> Any:
        # the vocabulary, the template and the facts (tokenize, piece, is_eog, bos, meta, ...)
        return getattr(self.model, name)

    @property
    def cached(self) -> Sequence[int]:
        return self._held

    @property
    def n_cached(self) -> int:
        return len(self._held)

    def join(self) -> None:
        """This sequence is generating: its passes wait for the other generating slots'."""
        self.slots.group.join(self.seq)

    def leave(self) -> None:
        """It stopped generating: the others no longer wait for it."""
        self.slots.group.leave(self.seq)

    def decode(self, tokens: Sequence[int], pos0: int, logits_from: int | None = None) -> None:
        """As ``Model.decode``, in this sequence. A pass with logits that fits one batch waits
        for the other generating slots' (``Slots``): one llama_decode scores them all."""
        n = len(tokens)
        if n == 0:
            return
        if pos0 + n > self.n_ctx:
            raise SpecrunError(f"context full: {pos0 + n} tokens > n_ctx {self.n_ctx}")
        if pos0 > len(self._held):
            raise SpecrunError(
                f"decode at position {pos0}, but the cache holds {len(self._held)} tokens"
            )
        if pos0 < len(self._held):
            self.truncate(pos0)
        toks = list(tokens)
        if logits_from is not None and n <= MAX_ROWS:
            if n - logits_from > self.n_outputs_max:
                raise SpecrunError(
                    f"{n - logits_from} rows of logits asked for, at most {self.n_outputs_max}"
                )
            self.slots.group.submit(self.slots, _Verify(self, toks, pos0, logits_from))
            return
        self._decode_now(toks, pos0, -1 if logits_from is None else logits_from)

    def prefill(self, tokens: Sequence[int], pos0: int) -> None:
        """A prompt's tokens, at once and by the fastest kernels (as ``Model.prefill``)."""
        if not tokens:
            return
        if pos0 + len(tokens) > self.n_ctx:
            raise SpecrunError(f"context full: {pos0 + len(tokens)} tokens > n_ctx {self.n_ctx}")
        if pos0 < len(self._held):
            self.truncate(pos0)
        setter = native.sgemm_setter() if len(tokens) > 1 else None
        with COMPUTE:
            if setter is not None:
                setter(1)
            try:
                self._decode_now(list(tokens), pos0, -1)
            finally:
                if setter is not None:
                    setter(-1)

    def _decode_now(self, tokens: list[int], pos0: int, logits_from: int) -> None:
        """In chunks of n_batch rows, now; logits (rows ``logits_from..``, negative: none) must
        lie in the last chunk."""
        n = len(tokens)
        step = min(self.n_batch, self.slots._cap)
        with COMPUTE:
            start = 0
            while start < n:
                end = min(n, start + step)
                lf = -1
                if logits_from >= 0 and end > logits_from:
                    if logits_from < start:
                        raise SpecrunError("logits asked for rows outside the last batch chunk")
                    lf = logits_from - start
                job = _Verify(self, tokens[start:end], pos0 + start, lf)
                self.slots.decode_rows([job], copy=lf >= 0)
                start = end

    def logits(self, row: int) -> np.ndarray:
        rows = self._out_rows
        j = len(rows) + row if row < 0 else row - self._out_first
        if 0 <= j < len(rows):
            return rows[j]
        raise SpecrunError(f"no logits for row {row} of the last batch")

    def truncate(self, n_keep: int) -> None:
        if n_keep >= len(self._held):
            return
        with COMPUTE:
            ok = ll.llama_memory_seq_rm(self.model._mem, self.seq, n_keep, -1)
        if not ok:
            raise SpecrunError(f"{self.path.name}: the KV cache cannot drop a tail")
        del self._held[n_keep:]

    def clear(self) -> None:
        with COMPUTE:
            ll.llama_memory_seq_rm(self.model._mem, self.seq, -1, -1)
        self._held.clear()

    def save_state(self) -> tuple[tuple[int, ...], StateData]:
        ctx = self.model._ctx
        with COMPUTE:
            size = int(ll.llama_state_seq_get_size(ctx, self.seq))
            data, buf = state_buffer(size)
            got = int(ll.llama_state_seq_get_data(ctx, buf, size, self.seq))
        if got != size:
            raise SpecrunError(
                f"{self.path.name}: could not copy the KV cache ({got} of {size} bytes)"
            )
        return tuple(self._held), data

    def load_state(self, tokens: Sequence[int], data: StateData) -> None:
        self.clear()
        with COMPUTE:
            ok = int(
                ll.llama_state_seq_set_data(self.model._ctx, state_view(data), len(data), self.seq)
            )
        if ok == 0:
            self.clear()
            raise SpecrunError(f"{self.path.name}: could not restore a saved KV cache")
        self._held = list(tokens)

    def context_params(self) -> dict[str, Any]:
        p = self.model.context_params()
        p["n_ctx"] = self.n_ctx
        p["n_seq"] = self.slots.n_seq
        return p

    def close(self) -> None:
        """The Slots' owner closes the model."""
