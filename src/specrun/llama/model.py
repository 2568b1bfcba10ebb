"""One thin wrapper over llama-cpp-python's low-level API. The only module that imports llama_cpp.

A ``Model`` is a llama_model with its one llama_context (one sequence, id 0): load, tokenize,
decode a batch with logits on chosen rows, read logits as numpy views, drop a tail of the KV
cache, vocabulary facts. It keeps no notion of "the conversation": the engine owns positions.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as ll
import numpy as np

from specrun.errors import ModelError, SpecrunError
from specrun.llama import native
from specrun.llama.backend import (
    auto_flash_attn,
    build_id,
    capture_load_log,
    cpu_name,
    deferred_signals,
    init_backend,
    load_progress,
    local_gpus,
    parse_load_log,
    physical_cores,
    system_info,
)
from specrun.llama.buffers import amx_batches_sound, weight_buffers
from specrun.llama.rpc import keepalive, place_devices

# llama_get_logits with the pointer as an int (llama-cpp-python's returns a POINTER(c_float),
# and its address takes two more objects a pass to read): its own function object, so that
# llama-cpp-python's keeps its restype.
_get_logits_addr = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(
    ("llama_get_logits", ll.llama_cpp._lib)
)


# A copy of a cache's cells (save_state), as decoding.target's Target declares it.
StateData = bytes | bytearray | mmap.mmap


def state_buffer(size: int) -> tuple[mmap.mmap, Any]:
    """A KV cache copy's memory, and a ctypes view of it for llama.cpp to write into: pages of
    its own, written once, no second copy, given back whole when dropped. A server saves one at
    each switch of conversation; a bytes copy of a ctypes buffer took 4 buffers of ~23 MB for
    1,000 tokens of SmolLM2 out of the heap, whose growing and trimming added 20-150 ms to the
    next request's first token (13 ms now)."""
    data = mmap.mmap(-1, max(size, 1))
    return data, (ctypes.c_uint8 * size).from_buffer(data)


def state_view(data: StateData) -> Any:
    """``data`` (a ``save_state`` copy) as llama.cpp reads it: a view, copied only if read-only."""
    if isinstance(data, (bytearray, mmap.mmap)):
        return (ctypes.c_uint8 * len(data)).from_buffer(data)
    return (ctypes.c_uint8 * len(data)).from_buffer_copy(data)


@dataclass(frozen=True)
class LoadOptions:
    n_ctx: int = 2048
    n_gpu_layers: int = -1
    n_threads: int | None = None
    n_threads_batch: int | None = None
    n_batch: int = 512
    flash_attn: bool | None = None  # None = llama.cpp's auto
    type_k: int | None = None
    type_v: int | None = None
    vocab_only: bool = False  # the vocabulary alone: no weights, no context (fast; facts only)
    # On a CPU with AMX, with a llama.cpp whose AMX batch kernel crashes (built without
    # patches/' fix, see weight_buffers): keep the AMX weight buffers and decode one row per
    # llama_decode (AMX's single-row kernel is sound and ~2x faster than the alternatives). For a
    # draft model, which decodes one token at a time; a target verifies batches and keeps its
    # weights out of AMX there. With the fix every model keeps AMX and decodes batches whole.
    amx_rows: bool = False
    n_outputs_max: int = 0  # most rows of logits in one decode (0 = n_batch, llama.cpp's default)
    # Weights only in buffers whose kernels score a row in a batch as they score it alone
    # (weight_buffers): what a target needs for speculation to say what it says alone.
    # False: llama.cpp's own placement (faster single rows for Q4_K; batches may part).
    exact_rows: bool = True
    check_tensors: bool = False
    # RPC workers ("HOST:PORT", checked and registered by llama.rpc) whose devices take the
    # offloaded layers, before this machine's GPUs, as llama.cpp orders them; and the share of
    # the offloaded layers each device takes (llama.cpp's --tensor-split; () = by free memory).
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    # Sequences the context holds (serve --parallel): n_ctx each, in one KV cache where sequence
    # s's position p is cell s*n_ctx + p (patches/: seq-cells); llama.slots gives each its view.
    n_seq: int = 1


@dataclass(frozen=True)
class VocabFacts:
    """What llama.cpp's speculative compatibility rules look at."""

    vocab_type: int
    n_vocab: int
    add_bos: bool
    add_eos: bool
    bos: int
    eos: int


class Model:
    """A loaded GGUF with one context and one preallocated batch."""

    n_vocab: int
    n_ctx_train: int
    n_ctx: int
    n_batch: int
    n_threads: int
    n_outputs_max: int
    llama_seconds: float  # wall time spent inside llama_decode, cumulative
    can_truncate: bool
    single_rows: bool  # every decode one row at a time (LoadOptions.amx_rows took effect)
    shared = False  # one sequence: a pass's wall time is its own (Target.shared)
    load_report: dict[str, Any]
    _vocab: Any
    _mem: Any
    _piece_buf: Any
    _pieces: dict[int, bytes]
    _b_token: np.ndarray
    _b_pos: np.ndarray
    _b_nseq: np.ndarray
    _b_logits: np.ndarray
    _n_rows: int
    _out_rows: Sequence[np.ndarray]
    _out_first: int
    _out_views: dict[int, tuple[int, list[np.ndarray]]]

    def __init__(self, path: str | os.PathLike[str], opts: LoadOptions, verbose: bool = False):
        init_backend(verbose)
        self.path = Path(path)
        self.opts = opts
        self._chat_template: str | None = None  # --chat-template (use_chat_template)
        self._model = None
        self._ctx = None
        self._batch: Any = None

        mparams = ll.llama_model_default_params()
        # Nowhere to offload to (no GPU here, no RPC workers): 0, not llama.cpp's default of all,
        # which a build with RPC would log as "offloaded 31/31 layers to GPU" with every layer here.
        has_devices = bool(opts.rpc) or bool(local_gpus())
        mparams.n_gpu_layers = opts.n_gpu_layers if has_devices else 0
        mparams.check_tensors = opts.check_tensors
        mparams.vocab_only = opts.vocab_only
        mparams.progress_callback = load_progress
        # Kept for the model's life: llama.cpp keeps a copy of mparams, pointers included.
        self._placement = (
            None if opts.vocab_only else place_devices(mparams, opts.rpc, opts.tensor_split)
        )
        offloads = opts.n_gpu_layers != 0 and has_devices
        self._buft_overrides = (
            weight_buffers(
                self.path, mparams, offloads, opts.amx_rows, opts.exact_rows and not opts.amx_rows
            )
            if not opts.vocab_only
            else None
        )
        t0 = time.perf_counter()
        log: list[str] = []
        try:
            with capture_load_log(log), deferred_signals():
                self._load(mparams, opts)
        finally:
            self.load_report = parse_load_log(log)
        self.load_seconds = time.perf_counter() - t0
        if opts.rpc and not opts.vocab_only:
            keepalive(opts.rpc)
        # Weights in AMX buffers that llama.cpp's AMX batch kernel would crash on (a build
        # without patches/' fix): every decode goes one row at a time (LoadOptions.amx_rows).
        self.single_rows = (
            opts.amx_rows
            and not amx_batches_sound()
            and "AMX" in self.load_report.get("weight_buffers", ())
        )
        # The softmax top probability of a row of logits in C (llama/native.py), None where this
        # build lacks it: the --draft-p-min check (decoding/sampling.top_prob_below's ``native``).
        self.top_prob_fn = native.top_prob()

    def _load(self, mparams: Any, opts: LoadOptions) -> None:
        self._model = ll.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ModelError(
                f"llama.cpp could not load {self.path} (run with --verbose for its log)"
            )
        self._vocab = ll.llama_model_get_vocab(self._model)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self._vocab))
        self.n_ctx_train = int(ll.llama_model_n_ctx_train(self._model))
        self._pieces: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)
        if opts.vocab_only:
            self.n_ctx, self.n_batch, self.n_threads, self.n_outputs_max = 0, 0, 0, 0
            self.llama_seconds = 0.0
            self.can_truncate = False
            return

        threads = opts.n_threads or physical_cores()
        cparams = ll.llama_context_default_params()
        # Several sequences: each its n_ctx rounded up to 256 cells, so that each one's cells
        # begin where a lone sequence's would meet the attention kernel's blocks (llama.slots).
        per_seq = opts.n_ctx if opts.n_seq == 1 else -(-opts.n_ctx // 256) * 256
        cparams.n_ctx = per_seq * opts.n_seq
        cparams.n_batch = opts.n_batch
        cparams.n_ubatch = opts.n_batch
        cparams.n_seq_max = opts.n_seq
        cparams.kv_unified = True  # one stream: a batch of several sequences is one pass
        cparams.n_threads = threads
        cparams.n_threads_batch = opts.n_threads_batch or threads
        cparams.no_perf = True
        cparams.n_outputs_max = opts.n_outputs_max
        flash = (
            opts.flash_attn
            if opts.flash_attn is not None
            else auto_flash_attn(opts.n_gpu_layers, opts.type_v, remote=bool(opts.rpc))
        )
        if flash is not None:
            cparams.flash_attn_type = (
                ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
            )
        if opts.type_k is not None:
            cparams.type_k = opts.type_k
        if opts.type_v is not None:
            cparams.type_v = opts.type_v
        self._ctx = ll.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            self.close()
            raise ModelError(
                f"llama.cpp could not create a context of {opts.n_ctx} tokens for {self.path} "
                "(out of memory? try a smaller --ctx)"
            )
        self.n_ctx = int(ll.llama_n_ctx(self._ctx))
        # llama.cpp clamps n_batch (e.g. to n_ctx): size everything from what it really took,
        # since a batch larger than that aborts the process inside llama_decode.
        self.n_batch = max(
            1,
            min(int(ll.llama_n_batch(self._ctx)), int(ll.llama_n_ubatch(self._ctx)), opts.n_batch),
        )
        self.n_threads = threads
        self.n_outputs_max = int(opts.n_outputs_max) or self.n_batch
        self._mem = ll.llama_get_memory(self._ctx)

        # One batch for the life of the model; numpy views over its arrays make filling it cheap.
        self._batch = ll.llama_batch_init(self.n_batch, 0, 1)
        b = self._batch
        self._b_token = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self._b_pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self._b_nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))
        self._b_logits = np.ctypeslib.as_array(b.logits, shape=(self.n_batch,))
        self._b_nseq[:] = 1
        for i in range(self.n_batch):
            b.seq_id[i][0] = 0
        self._n_rows = 0  # rows of the last decoded chunk
        self._out_rows = ()  # the last chunk's logits, a view per row (none: empty)
        self._out_first = 0  # batch row of self._out_rows[0]
        self._out_views = {}  # rows of logits -> (buffer address, a view per row): decode
        self.llama_seconds = 0.0  # wall time spent inside llama_decode, cumulative
        # What the KV cache holds: the token at each position (as llama-cpp-python's Llama keeps
        # input_ids[:n_tokens]). decode extends it, truncate and clear cut it; callers read it.
        self._held: list[int] = []

        self.can_truncate = self._probe_truncate()

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            ll.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # -- facts ----------------------------------------------------------------------------
    def context_params(self) -> dict[str, Any]:
        """What llama.cpp really took: read back from the context, and from its load log where
        the API has no getter (flash attention, KV cache types, offloaded layers, buffer sizes)."""
        rep = self.load_report
        return {
            "n_ctx": int(ll.llama_n_ctx(self._ctx)),
            "n_batch": int(ll.llama_n_batch(self._ctx)),
            "n_ubatch": int(ll.llama_n_ubatch(self._ctx)),
            "n_threads": int(ll.llama_n_threads(self._ctx)),
            "n_threads_batch": int(ll.llama_n_threads_batch(self._ctx)),
            "n_outputs_max": self.n_outputs_max,
            "flash_attn": rep.get("flash_attn_resolved", rep.get("flash_attn")),
            "type_k": rep.get("type_k"),
            "type_v": rep.get("type_v"),
            "gpu_layers": rep.get("gpu_layers", 0),
            "buffers_mib": dict(rep.get("buffers_mib", {})),
            "single_row_decode": self.single_rows,
            "rpc": list(self.opts.rpc),
            "tensor_split": list(self.opts.tensor_split),
        }

    def vocab_facts(self) -> VocabFacts:
        v = self._vocab
        return VocabFacts(
            vocab_type=int(ll.llama_vocab_type(v)),
            n_vocab=self.n_vocab,
            add_bos=bool(ll.llama_vocab_get_add_bos(v)),
            add_eos=bool(ll.llama_vocab_get_add_eos(v)),
            bos=int(ll.llama_vocab_bos(v)),
            eos=int(ll.llama_vocab_eos(v)),
        )

    def machine_key(self) -> str:
        """The build, backend and CPU this model runs on (``decoding.target.Target``)."""
        return "\0".join((system_info(), build_id(), cpu_name()))

    def token_text(self, token: int) -> bytes:
        return ll.llama_vocab_get_text(self._vocab, token) or b""

    def is_eog(self, token: int) -> bool:
        return bool(ll.llama_vocab_is_eog(self._vocab, token))

    @property
    def bos(self) -> int:
        return int(ll.llama_vocab_bos(self._vocab))

    @property
    def eos(self) -> int:
        return int(ll.llama_vocab_eos(self._vocab))

    def chat_template(self) -> str | None:
        """The template this model's chats are rendered with: the one given by
        ``use_chat_template`` (--chat-template), else the GGUF's own."""
        if self._chat_template is not None:
            return self._chat_template
        return self.gguf_chat_template()

    def gguf_chat_template(self) -> str | None:
        raw = ll.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8", errors="replace") if raw else None

    def use_chat_template(self, source: str | None) -> None:
        """Render chats with ``source`` (Jinja text or a llama.cpp built-in name, as
        chat_template.resolve_template checked it) instead of the GGUF's template; None: the
        GGUF's again."""
        self._chat_template = source

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = ll.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else None

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        ll.llama_model_desc(self._model, buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    @property
    def size_bytes(self) -> int:
        return int(ll.llama_model_size(self._model))

    @property
    def n_params(self) -> int:
        return int(ll.llama_model_n_params(self._model))

    @property
    def n_layer(self) -> int:
        return int(ll.llama_model_n_layer(self._model))

    @property
    def is_recurrent(self) -> bool:
        return bool(
            ll.llama_model_is_recurrent(self._model) or ll.llama_model_is_hybrid(self._model)
        )

    # -- text <-> tokens --------------------------------------------------------------------
    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ll.llama_token * cap)()
            n = ll.llama_tokenize(
                self._vocab, data, len(data), buf, cap, add_special, parse_special
            )
        if n < 0:
            raise SpecrunError("tokenization failed")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes a token prints as (special tokens print nothing), cached per id."""
        got = self._pieces.get(token)
        if got is None:
            n = ll.llama_token_to_piece(
                self._vocab, token, self._piece_buf, len(self._piece_buf), 0, False
            )
            if n < 0:
                big = ctypes.create_string_buffer(-n)
                n = ll.llama_token_to_piece(self._vocab, token, big, len(big), 0, False)
                got = big.raw[:n]
            else:
                got = self._piece_buf.raw[:n]
            self._pieces[token] = got
        return got

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    # -- decoding ---------------------------------------------------------------------------
    @property
    def cached(self) -> Sequence[int]:
        """The tokens the KV cache holds, by position (read only: ``decode``, ``truncate`` and
        ``clear`` keep it)."""
        return self._held

    @property
    def n_cached(self) -> int:
        return len(self._held)

    def decode(self, tokens: Sequence[int], pos0: int, logits_from: int | None = None) -> None:
        """Evaluate ``tokens`` at positions ``pos0..`` (at most ``n_cached``: the cache is
        contiguous, and positions from ``pos0`` on are replaced); logits on rows ``logits_from..``
        (relative to ``tokens``), none when ``logits_from`` is None. Longer than n_batch: in
        chunks, and then the rows asked for must all lie in the last chunk."""
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
        if self.single_rows and n > 1:
            self._decode_rows(tokens, pos0, logits_from)
            return
        start = 0
        while start < n:
            m = min(self.n_batch, n - start)
            end = start + m
            lg = self._b_logits
            if m == 1:
                # One row (every plain step): element stores, not numpy temporaries. Right after
                # a pass the interpreter runs from cold caches, and each numpy call here cost
                # 5-10 us (single rows of a Q4_K_M SmolLM2, 2-core Intel Xeon).
                self._b_token[0] = tokens[start]
                self._b_pos[0] = pos0 + start
                lg[0] = logits_from is not None and logits_from <= start
            else:
                self._b_token[:m] = tokens[start:end]
                self._b_pos[:m] = np.arange(pos0 + start, pos0 + end, dtype=np.int32)
                lg[:m] = 0
            if logits_from is not None and end > logits_from:
                if logits_from < start:
                    raise SpecrunError("logits asked for rows outside the last batch chunk")
                if m - (logits_from - start) > self.n_outputs_max:
                    raise SpecrunError(
                        f"{m - (logits_from - start)} rows of logits asked for, the context keeps "
                        f"at most {self.n_outputs_max}"
                    )
                if m > 1:
                    lg[logits_from - start : m] = 1
            self._batch.n_tokens = m
            t0 = time.perf_counter()
            rc = ll.llama_decode(self._ctx, self._batch)
            if rc == 0:
                # A backend may still be computing when llama_decode returns; wait here so that
                # llama_seconds is all of llama.cpp's time and nothing of it lands on our side.
                ll.llama_synchronize(self._ctx)
            self.llama_seconds += time.perf_counter() - t0
            if rc != 0:
                raise SpecrunError(f"llama_decode failed (code {rc}) for {self.path.name}")
            self._held.extend(tokens[start:end])
            start = end
        self._n_rows = m
        self._out_rows = ()
        if logits_from is not None:
            # Numpy views over llama.cpp's output buffer, one per row that asked for logits (in
            # batch order for one sequence): logits(row) is then a list index, not a ctypes
            # round trip or a numpy view per call. Kept per row count while the buffer stays
            # where it is (llama.cpp moves it only when it grows): building them anew every
            # pass cost ~35 us of a single row's 8 ms (cold caches, as above).
            self._out_first = logits_from - (n - m)
            n_out = m - self._out_first
            addr = _get_logits_addr(self._ctx)
            if addr:
                view = self._out_views.get(n_out)
                if view is None or view[0] != addr:
                    buf = (ctypes.c_float * (n_out * self.n_vocab)).from_address(addr)
                    out = np.frombuffer(memoryview(buf), dtype=np.float32)
                    view = self._out_views[n_out] = (addr, list(out.reshape(n_out, self.n_vocab)))
                self._out_rows = view[1]

    def prefill(self, tokens: Sequence[int], pos0: int) -> None:
        """Evaluate a prompt's ``tokens`` (no logits) by the fastest kernels the build has
        (llamafile's sgemm at any batch size): a prompt is evaluated alike whether or not the
        run that follows speculates, so it need not be row-exact; verify passes and single rows
        (``decode``) keep the row-exact kernels."""
        setter = native.sgemm_setter() if len(tokens) > 1 else None
        if setter is None:
            self.decode(tokens, pos0)
            return
        setter(1)
        try:
            self.decode(tokens, pos0)
        finally:
            setter(-1)

    def _decode_rows(self, tokens: Sequence[int], pos0: int, logits_from: int | None) -> None:
        """``decode`` one row per llama_decode (``single_rows``); the rows asked for keep their
        logits (copied out when more than one, the last one a view as usual)."""
        n = len(tokens)
        first = n if logits_from is None else logits_from
        if n - first > self.n_outputs_max:
            raise SpecrunError(
                f"{n - first} rows of logits asked for, the context keeps at most {self.n_outputs_max}"
            )
        kept = np.empty((n - first, self.n_vocab), dtype=np.float32) if n - first > 1 else None
        for i, tok in enumerate(tokens):
            self.decode((tok,), pos0 + i, 0 if i >= first else None)
            if kept is not None and i >= first:
                kept[i - first] = self.logits(0)
        if kept is not None:
            self._out_rows = list(kept)
        self._out_first = first
        self._n_rows = n

    def logits(self, row: int) -> np.ndarray:
        """Logits of ``row`` of the last decoded chunk (negative: from the end): a float32 view,
        valid until the next decode."""
        rows = self._out_rows
        j = len(rows) + row if row < 0 else row - self._out_first
        if 0 <= j < len(rows):
            return rows[j]
        raise SpecrunError(f"no logits for row {row} of the last batch")

    def truncate(self, n_keep: int) -> None:
        """Drop every cached position >= n_keep (the rollback after a rejected draft)."""
        if n_keep >= len(self._held):
            return
        if not ll.llama_memory_seq_rm(self._mem, 0, n_keep, -1):
            raise SpecrunError(
                f"{self.path.name}: the KV cache cannot drop a tail (recurrent or hybrid model)"
            )
        del self._held[n_keep:]

    def clear(self) -> None:
        ll.llama_memory_clear(self._mem, True)
        self._held.clear()

    def save_state(self) -> tuple[tuple[int, ...], StateData]:
        """What the KV cache holds (its tokens, and their cells as llama.cpp writes a sequence's
        state): a copy in memory that ``load_state`` puts back bit for bit (a server's cache of
        earlier prompts)."""
        size = int(ll.llama_state_seq_get_size(self._ctx, 0))
        data, buf = state_buffer(size)
        got = int(ll.llama_state_seq_get_data(self._ctx, buf, size, 0))
        if got != size:
            raise SpecrunError(
                f"{self.path.name}: could not copy the KV cache ({got} of {size} bytes)"
            )
        return tuple(self._held), data

    def load_state(self, tokens: Sequence[int], data: StateData) -> None:
        """Put back a ``save_state`` copy of this model's cache in this context: the cache then
        holds ``tokens``. On failure the cache is left empty."""
        self.clear()
        if int(ll.llama_state_seq_set_data(self._ctx, state_view(data), len(data), 0)) == 0:
            self.clear()
            raise SpecrunError(f"{self.path.name}: could not restore a saved KV cache")
        self._held = list(tokens)

    def _probe_truncate(self) -> bool:
        """Whether this model's memory can drop a tail; recurrent/hybrid memories cannot."""
        if self.is_recurrent:
            return False
        return True
