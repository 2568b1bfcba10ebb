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
for all contexts of the process.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as ll
import numpy as np

from specrun.errors import SpecrunError
from specrun.llama import native
from specrun.llama.model import Model, _get_logits_addr

COMPUTE = threading.RLock()

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


@dataclass
class _Group:
    """The slots that are generating and the verifies they have handed in."""

    active: set[int] = field(default_factory=set)
    waiting: list[_Verify] = field(default_factory=list)
    running: bool = False


class Slots:
    """The sequences of one multi-sequence ``Model``, and the batcher of their verify passes."""

    def __init__(self, model: Model) -> None:
        n = model.opts.n_seq
        if n < 1:
            raise SpecrunError("a context holds at least one sequence")
        self.model = model
        self.n_seq = n
        self.n_ctx_seq = model.n_ctx // n  # each sequence's cells (seq-cells: s*n_ctx_seq + p)
        self.passes = 0  # batched verify passes run
        self.rows = 0  # rows they held
        self._cond = threading.Condition()
        self._group = _Group()
        self._batch = ll.llama_batch_init(max(model.n_batch, MAX_ROWS), 0, 1)
        self._cap = max(model.n_batch, MAX_ROWS)
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

    # -- the group of generating slots ---------------------------------------------------
    def join(self, view: SeqModel) -> None:
        """``view`` is generating: verifies wait for its own from now on."""
        with self._cond:
            self._group.active.add(view.seq)

    def leave(self, view: SeqModel) -> None:
        """``view`` stopped generating: the others no longer wait for it."""
        with self._cond:
            self._group.active.discard(view.seq)
            self._cond.notify_all()

    def _verify(self, view: SeqModel, tokens: list[int], pos0: int, logits_from: int) -> None:
        job = _Verify(view, tokens, pos0, logits_from)
        g = self._group
        with self._cond:
            alone = view.seq not in g.active  # not generating (calibration, a test): now
            if not alone:
                g.waiting.append(job)
                self._cond.notify_all()
                while not job.done:
                    if g.waiting and not g.running and {j.view.seq for j in g.waiting} >= g.active:
                        # every generating slot has handed in its pass: this thread runs them
                        jobs, g.waiting = g.waiting, []
                        g.running = True
                        self._cond.release()
                        try:
                            self._run(jobs)
                        finally:
                            self._cond.acquire()
                            g.running = False
                            self._cond.notify_all()
                    else:
                        self._cond.wait()
        if alone:
            self._run([job])
        if job.error is not None:
            raise job.error

    def _run(self, jobs: list[_Verify]) -> None:
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
                self.decode_rows(group, copy=i < len(passes) - 1)
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
        with COMPUTE:
            t0 = time.perf_counter()
            rc = ll.llama_decode(ctx, b)
            if rc == 0:
                ll.llama_synchronize(ctx)
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
        self.slots.join(self)

    def leave(self) -> None:
        self.slots.leave(self)

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
            self.slots._verify(self, toks, pos0, logits_from)
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
                self.slots.decode_rows([job])
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

    def save_state(self) -> tuple[tuple[int, ...], bytes]:
        ctx = self.model._ctx
        with COMPUTE:
            size = int(ll.llama_state_seq_get_size(ctx, self.seq))
            buf = (ctypes.c_uint8 * size)()
            got = int(ll.llama_state_seq_get_data(ctx, buf, size, self.seq))
        if got != size:
            raise SpecrunError(
                f"{self.path.name}: could not copy the KV cache ({got} of {size} bytes)"
            )
        return tuple(self._held), bytes(buf)

    def load_state(self, tokens: Sequence[int], data: bytes) -> None:
        self.clear()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        with COMPUTE:
            ok = int(ll.llama_state_seq_set_data(self.model._ctx, buf, len(data), self.seq))
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
