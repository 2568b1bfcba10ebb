"""One thin wrapper over llama-cpp-python's low-level API. The only module that imports llama_cpp.

A ``Model`` is a llama_model with its one llama_context (one sequence, id 0): load, tokenize,
decode a batch with logits on chosen rows, read logits as numpy views, drop a tail of the KV
cache, vocabulary facts. It keeps no notion of "the conversation": the engine owns positions.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as ll
import numpy as np

from .errors import ModelError, SpecrunError

_backend_lock = threading.Lock()
_backend_ready = False
_log_verbose = False
_log_capture: list[str] | None = None  # llama.cpp's log lines while a model loads


@ll.llama_log_callback
def _log_sink(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:  # pragma: no cover
    line = text.decode("utf-8", errors="replace")
    if _log_capture is not None:
        _log_capture.append(line)
    if _log_verbose:
        import sys

        sys.stderr.write(line)


def _parse_load_log(lines: list[str]) -> dict[str, Any]:
    """What llama.cpp says it allocated and decided while loading (its INFO log)."""
    out: dict[str, Any] = {}
    mib: dict[str, float] = {}
    for line in "".join(lines).splitlines():
        m = re.search(r"(\S+)\s+(model|KV|output|compute) buffer size\s*=\s*([\d.]+) MiB", line)
        if m:
            key = m.group(2).lower()
            if key == "model":
                out.setdefault("weight_buffers", []).append(m.group(1))
            mib[key] = mib.get(key, 0.0) + float(m.group(3))
            if m.group(1) not in ("CPU", "CPU_Mapped", "CPU_REPACK", "CPU_AARCH64", "AMX") and "Host" not in m.group(1):
                mib[key + "_device"] = mib.get(key + "_device", 0.0) + float(m.group(3))
            continue
        m = re.search(r"K \((\w+)\):.*V \((\w+)\):", line)
        if m:
            out["type_k"], out["type_v"] = m.group(1), m.group(2)
            continue
        m = re.search(r"flash_attn\s*=\s*(\w+)", line)
        if m:
            out["flash_attn"] = m.group(1)
            continue
        m = re.search(r"offloaded (\d+)/(\d+) layers to GPU", line)
        if m:
            out["gpu_layers"] = int(m.group(1))
        if re.search(r"enabling flash_attn|Flash Attention was auto, set to enabled", line):
            out["flash_attn_resolved"] = "enabled"
        elif "Flash Attention was auto, set to disabled" in line:
            out["flash_attn_resolved"] = "disabled"
    out["buffers_mib"] = mib
    return out


_pending_signals: list[int] = []


@contextlib.contextmanager
def deferred_signals(signums: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold SIGINT/SIGTERM while llama.cpp runs Python callbacks, then act on them.

    Loading a model runs Python code inside llama.cpp's log and progress callbacks; an exception
    raised there by a signal handler (KeyboardInterrupt, SystemExit) is printed and dropped by
    ctypes ("Exception ignored on calling ctypes callback function"), so Ctrl-C during a load was
    lost. Here the signal is only recorded; the progress callback then tells llama.cpp to abandon
    the load, and once control is back in plain Python the signal's own handler runs.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old: dict[int, Any] = {}
    for sig in signums:
        handler = signal.getsignal(sig)
        if handler in (signal.SIG_IGN, None):
            continue
        old[sig] = handler
        signal.signal(sig, lambda signum, _frame: _pending_signals.append(signum))
    _pending_signals.clear()
    try:
        yield
    finally:
        pending = list(dict.fromkeys(_pending_signals))
        _pending_signals.clear()
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for sig in pending:
            handler = old[sig]
            if callable(handler):
                handler(sig, None)
            else:  # SIG_DFL: let the default action happen now
                os.kill(os.getpid(), sig)


@ll.llama_progress_callback
def _load_progress(progress: float, user_data: ctypes.c_void_p) -> bool:  # pragma: no cover
    """Returning False makes llama.cpp abandon the load: a signal arrived meanwhile."""
    return not _pending_signals


def init_backend(verbose: bool = False) -> None:
    """Initialise llama.cpp once; its log goes to stderr only when ``verbose``."""
    global _backend_ready, _log_verbose
    _log_verbose = verbose
    with _backend_lock:
        if not _backend_ready:
            # llama.cpp's tiled K-quant matmul takes batches of 8+ rows only, and sums otherwise
            # than the vec_dot that scores single rows (Q4_K/Q6_K logits up to 0.9 apart): off,
            # so a verify pass of 8+ rows scores each row as decoding it alone would (read by
            # ggml once, at its first matmul; set GGML_CPU_TILED_MM=1 to have it anyway).
            os.environ.setdefault("GGML_CPU_TILED_MM", "0")
            ll.llama_log_set(_log_sink, ctypes.c_void_p(0))
            ll.llama_backend_init()
            _backend_ready = True


def physical_cores() -> int:
    """Threads default: physical cores (llama.cpp's own rule), at least 1."""
    try:
        cores: set[tuple[str, str]] = set()
        phys = ""
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "physical id":
                    phys = value.strip()
                elif key == "core id":
                    cores.add((phys, value.strip()))
        if cores:
            return max(1, min(len(cores), os.cpu_count() or 1))
    except OSError:
        pass
    return max(1, os.cpu_count() or 1)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def supports_gpu_offload() -> bool:
    return bool(ll.llama_supports_gpu_offload())


def supports_mmap() -> bool:
    return bool(ll.llama_supports_mmap())


def supports_mlock() -> bool:
    return bool(ll.llama_supports_mlock())


def system_info() -> str:
    init_backend()
    return ll.llama_print_system_info().decode("utf-8", errors="replace").strip()


def auto_flash_attn(n_gpu_layers: int, type_v: int | None) -> bool | None:
    """Flash attention when none was asked for: off for a model on the CPU, on for a quantized
    V cache (which needs it), llama.cpp's own choice (None) for one offloaded to a GPU.

    llama.cpp's CPU flash-attention kernel gives a row decoded in a batch other logits than the
    same row decoded alone once the context is a few hundred tokens long (measured with SmolLM2:
    up to 6e-2 at 400 tokens, exact below ~256), so greedy speculation could part from the target
    alone at a near-tie. Without it, CPU batches are row-exact.
    """
    if type_v is not None and type_v not in (0, 1, 30):  # f32, f16, bf16
        return True
    if n_gpu_layers == 0 or not supports_gpu_offload():
        return False
    return None


def batch_exact_cpu() -> bool:
    """Whether CPU matmuls give the same numbers for a row decoded alone and in a batch.

    llamafile's tinyBLAS (a build default) takes batches of 2+ rows and leaves single rows to
    ggml's vec_dot, which sums in another order: logits then differ by ~1e-2 and greedy
    speculation can part from the target alone at near-ties. ``make install`` builds without it.
    """
    return "LLAMAFILE = 1" not in system_info()


_extra_bufts: dict[str, int] | None = None
AMX_OPT_IN = "SPECRUN_ALLOW_AMX"


def cpu_extra_buffer_types() -> dict[str, int]:
    """The CPU backend's extra weight buffer types by name (AMX, CPU_REPACK, ...): handles."""
    global _extra_bufts
    if _extra_bufts is not None:
        return _extra_bufts
    init_backend()
    out: dict[str, int] = {}
    lib = ll.llama_cpp._lib
    try:
        by_type, reg_of = lib.ggml_backend_dev_by_type, lib.ggml_backend_dev_backend_reg
        proc, buft_name = lib.ggml_backend_reg_get_proc_address, lib.ggml_backend_buft_name
    except AttributeError:  # pragma: no cover - a build that does not export them
        _extra_bufts = out
        return out
    by_type.restype, by_type.argtypes = ctypes.c_void_p, [ctypes.c_int]
    reg_of.restype, reg_of.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    proc.restype, proc.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    buft_name.restype, buft_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    dev = by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    addr = proc(reg_of(dev), b"ggml_backend_dev_get_extra_bufts") if dev else None
    if addr:
        get = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(addr)
        arr = get(dev)
        i = 0
        while arr and arr[i]:
            out[(buft_name(arr[i]) or b"?").decode("utf-8", "replace")] = int(arr[i])
            i += 1
    _extra_bufts = out
    return out


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# Weight types whose CPU_REPACK kernels give a row the same result alone and in a batch, on x86
# (tests/test_row_exact_formats.py): Q4_0's 8x8 gemm and gemv agree bit for bit. Q4_K's do not
# (its 4-row gemm and 1-row gemv part by up to 1.0 in the logits), nor is IQ4_NL's or MXFP4's
# checked: a target keeps those in plain buffers, where one vec_dot serves every batch size.
ROW_EXACT_REPACK = ("Q4_0",)


def _weight_buffers(path: Path, mparams: Any, n_gpu_layers: int, single_rows: bool, exact: bool) -> Any:
    """Where a model's weights go on the CPU; returns what must outlive the load.

    Two reasons to override llama.cpp's choice of extra buffer types:

    - AMX (Sapphire Rapids and later): llama.cpp puts quantized weights in AMX buffers, whose
      batched matmul crashes (SIGSEGV in ggml_backend_amx_mul_mat on any batch of 2+ rows:
      ggml-org/llama.cpp#20824, reproduced with 0.3.36 on Q4_0, Q4_1 and Q4_K models). A model
      that decodes one row at a time (``single_rows``: a draft) keeps them, AMX's single-row
      kernel (AVX512-VNNI) being sound and the fastest; any other keeps its weights out of AMX.
      SPECRUN_ALLOW_AMX=1 leaves AMX alone, for a llama.cpp where this is fixed.
    - Row exactness (``exact``: a target, whose verify passes must score each row as decoding it
      alone would): CPU_REPACK's Q4_K kernels compute a batch in groups of four rows with
      another summation than a single row, so only the types in ROW_EXACT_REPACK are repacked.

    Extra buffer types are then turned off and the layer matrices that may be repacked are put
    back in CPU_REPACK by name (rows in eights, as llama.cpp's x86 repacking needs).
    """
    bufts = cpu_extra_buffer_types()
    amx = "AMX" in bufts and os.environ.get(AMX_OPT_IN) != "1" and not single_rows
    if not amx and not exact:
        return None
    if n_gpu_layers != 0 and supports_gpu_offload():
        if amx:
            mparams.use_extra_bufts = False
        return None
    from .gguf import validate_gguf

    try:
        info = validate_gguf(path, check_tensors=True)
    except SpecrunError:
        return None  # llama.cpp reports what is wrong with the file
    allowed = ROW_EXACT_REPACK if exact else ("Q4_0", "Q4_K")
    repackable = {"Q4_0", "Q4_K", "IQ4_NL", "MXFP4", "Q2_K"}
    types = {tname for _name, tname, _rows in info.layer_matrices}
    if not amx and not (types & repackable) - set(allowed):
        return None  # nothing llama.cpp would put where a batch parts from a single row
    mparams.use_extra_bufts = False
    repack = bufts.get("CPU_REPACK")
    if repack is None:
        return None
    layers_by_suffix: dict[str, list[str]] = {}
    for name, tname, rows in info.layer_matrices:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if m and tname in allowed and rows % 8 == 0:
            layers_by_suffix.setdefault(m.group(2), []).append(m.group(1))
    if not layers_by_suffix:
        return None
    entries = [
        _BuftOverride(f"^blk\\.({'|'.join(layers)})\\.{re.escape(suffix)}$".encode(), repack)
        for suffix, layers in layers_by_suffix.items()
    ]
    arr = (_BuftOverride * (len(entries) + 1))(*entries, _BuftOverride(None, None))
    mparams.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)
    return arr


@dataclass(frozen=True)
class Device:
    """A ggml backend device (the CPU, a GPU, an accelerator) and its memory."""

    name: str
    description: str
    kind: str  # cpu | gpu | igpu | accel | meta
    free: int
    total: int


_DEV_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")


def devices() -> list[Device]:
    """The devices llama.cpp's backends registered (ggml_backend_dev_*, in libggml-base)."""
    init_backend()
    lib = ll.llama_cpp._lib
    try:
        count, get = lib.ggml_backend_dev_count, lib.ggml_backend_dev_get
        name, desc = lib.ggml_backend_dev_name, lib.ggml_backend_dev_description
        kind, memory = lib.ggml_backend_dev_type, lib.ggml_backend_dev_memory
    except AttributeError:  # pragma: no cover - a build that does not export them
        return []
    count.restype, count.argtypes = ctypes.c_size_t, []
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    for f in (name, desc):
        f.restype, f.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    kind.restype, kind.argtypes = ctypes.c_int, [ctypes.c_void_p]
    memory.restype = None
    memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    out = []
    for i in range(int(count())):
        dev = get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        memory(dev, ctypes.byref(free), ctypes.byref(total))
        k = int(kind(dev))
        out.append(Device(
            name=(name(dev) or b"").decode("utf-8", "replace"),
            description=(desc(dev) or b"").decode("utf-8", "replace"),
            kind=_DEV_KINDS[k] if 0 <= k < len(_DEV_KINDS) else str(k),
            free=int(free.value),
            total=int(total.value),
        ))
    return out


def gpu_free_memory() -> int | None:
    """Free bytes over the GPUs llama.cpp can offload to; None when this build cannot offload."""
    if not supports_gpu_offload():
        return None
    gpus = [d for d in devices() if d.kind in ("gpu", "igpu")]
    return sum(d.free for d in gpus) if gpus else None


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
    # On a CPU with AMX: keep llama.cpp's AMX weight buffers and decode one row per llama_decode
    # (AMX's single-row kernel is sound and ~2x faster than the alternatives; its batch kernel
    # crashes, see _weight_buffers). For a draft model, which decodes one token at a time; a target
    # verifies batches and keeps the default (weights out of AMX, batches decoded whole).
    amx_rows: bool = False
    n_outputs_max: int = 0  # most rows of logits in one decode (0 = n_batch, llama.cpp's default)
    # Weights only in buffers whose kernels score a row in a batch as they score it alone
    # (_weight_buffers): what a target needs for speculation to say what it says alone.
    # False: llama.cpp's own placement (faster single rows for Q4_K; batches may part).
    exact_rows: bool = True
    check_tensors: bool = False


@dataclass(frozen=True)
class VocabFacts:
    """What llama.cpp's speculative compatibility rules look at."""

    vocab_type: int
    n_vocab: int
    add_bos: bool
    add_eos: bool
    bos: int
    eos: int


QUANT_TYPES: dict[str, int] = {
    name[len("LLAMA_FTYPE_"):].replace("MOSTLY_", "").replace("ALL_", ""): getattr(ll, name)
    for name in dir(ll)
    if name.startswith("LLAMA_FTYPE_") and name != "LLAMA_FTYPE_GUESSED"
}


def quantize(src: Path, dst: Path, quant: str, threads: int | None = None) -> None:
    """Re-quantize ``src`` into ``dst`` (F32, F16, Q8_0, Q4_0, Q4_K_M, ...)."""
    key = quant.upper()
    if key not in QUANT_TYPES:
        raise SpecrunError(
            f"unknown quantization type {quant!r}; one of: {', '.join(sorted(QUANT_TYPES))}"
        )
    init_backend()
    params = ll.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[key]
    params.allow_requantize = True
    params.nthread = threads or physical_cores()
    rc = ll.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise ModelError(f"llama.cpp could not quantize {src} to {quant} (code {rc})")


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
    _out: np.ndarray | None
    _out_first: int
    _out_types: dict[int, Any]

    def __init__(self, path: str | os.PathLike[str], opts: LoadOptions, verbose: bool = False):
        init_backend(verbose)
        self.path = Path(path)
        self.opts = opts
        self._model = None
        self._ctx = None
        self._batch: Any = None

        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = opts.n_gpu_layers
        mparams.check_tensors = opts.check_tensors
        mparams.vocab_only = opts.vocab_only
        mparams.progress_callback = _load_progress
        # Kept for the model's life: llama.cpp keeps a copy of mparams, pointer included.
        self._buft_overrides = (
            _weight_buffers(self.path, mparams, opts.n_gpu_layers, opts.amx_rows, opts.exact_rows and not opts.amx_rows)
            if not opts.vocab_only else None
        )
        global _log_capture
        t0 = time.perf_counter()
        _log_capture = []
        try:
            with deferred_signals():
                self._load(mparams, opts)
        finally:
            self.load_report = _parse_load_log(_log_capture)
            _log_capture = None
        self.load_seconds = time.perf_counter() - t0
        # Weights in AMX buffers that llama.cpp's AMX batch kernel would crash on: every decode
        # goes one row at a time (see LoadOptions.amx_rows).
        self.single_rows = (
            opts.amx_rows and os.environ.get(AMX_OPT_IN) != "1"
            and "AMX" in self.load_report.get("weight_buffers", ())
        )

    def _load(self, mparams: Any, opts: LoadOptions) -> None:
        self._model = ll.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ModelError(f"llama.cpp could not load {self.path} (run with --verbose for its log)")
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
        cparams.n_ctx = opts.n_ctx
        cparams.n_batch = opts.n_batch
        cparams.n_ubatch = opts.n_batch
        cparams.n_seq_max = 1
        cparams.n_threads = threads
        cparams.n_threads_batch = opts.n_threads_batch or threads
        cparams.no_perf = True
        cparams.n_outputs_max = opts.n_outputs_max
        flash = opts.flash_attn if opts.flash_attn is not None else auto_flash_attn(opts.n_gpu_layers, opts.type_v)
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
        self.n_batch = max(1, min(int(ll.llama_n_batch(self._ctx)), int(ll.llama_n_ubatch(self._ctx)), opts.n_batch))
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
        self._out = None  # the last chunk's logits rows, a view
        self._out_first = 0  # batch row of self._out[0]
        self._out_types = {}
        self.llama_seconds = 0.0  # wall time spent inside llama_decode, cumulative

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
        raw = ll.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8", errors="replace") if raw else None

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
        return bool(ll.llama_model_is_recurrent(self._model) or ll.llama_model_is_hybrid(self._model))

    # -- text <-> tokens --------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise SpecrunError("tokenization failed")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes a token prints as (special tokens print nothing), cached per id."""
        got = self._pieces.get(token)
        if got is None:
            n = ll.llama_token_to_piece(self._vocab, token, self._piece_buf, len(self._piece_buf), 0, False)
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
    def decode(self, tokens: Sequence[int], pos0: int, logits_from: int | None = None) -> None:
        """Evaluate ``tokens`` at positions ``pos0..``; logits on rows ``logits_from..`` (relative
        to ``tokens``), none when ``logits_from`` is None. Longer than n_batch: in chunks, and
        then the rows asked for must all lie in the last chunk."""
        n = len(tokens)
        if n == 0:
            return
        if pos0 + n > self.n_ctx:
            raise SpecrunError(f"context full: {pos0 + n} tokens > n_ctx {self.n_ctx}")
        if self.single_rows and n > 1:
            self._decode_rows(tokens, pos0, logits_from)
            return
        start = 0
        while start < n:
            m = min(self.n_batch, n - start)
            end = start + m
            tok_arr = self._b_token
            tok_arr[:m] = tokens[start:end]
            self._b_pos[:m] = np.arange(pos0 + start, pos0 + end, dtype=np.int32)
            lg = self._b_logits
            lg[:m] = 0
            if logits_from is not None and end > logits_from:
                if logits_from < start:
                    raise SpecrunError("logits asked for rows outside the last batch chunk")
                if m - (logits_from - start) > self.n_outputs_max:
                    raise SpecrunError(
                        f"{m - (logits_from - start)} rows of logits asked for, the context keeps "
                        f"at most {self.n_outputs_max}"
                    )
                lg[logits_from - start:m] = 1
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
            start = end
        self._n_rows = m
        self._out = None
        if logits_from is not None:
            # One numpy view over llama.cpp's output buffer for all the rows that asked for
            # logits (in batch order for one sequence): logits(row) is then a slice, not a
            # ctypes round trip per row.
            self._out_first = logits_from - (n - m)
            n_out = m - self._out_first
            base = ll.llama_get_logits(self._ctx)
            if base:
                arr_t = self._out_types.get(n_out)
                if arr_t is None:
                    arr_t = self._out_types[n_out] = ctypes.c_float * (n_out * self.n_vocab)
                buf = arr_t.from_address(ctypes.addressof(base.contents))
                rows = np.frombuffer(memoryview(buf), dtype=np.float32)
                self._out = rows.reshape(n_out, self.n_vocab)

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
            self._out = kept
        self._out_first = first
        self._n_rows = n

    def logits(self, row: int) -> np.ndarray:
        """Logits of ``row`` of the last decoded chunk (negative: from the end): a float32 view,
        valid until the next decode."""
        out = self._out
        if out is not None:
            j = out.shape[0] + row if row < 0 else row - self._out_first
            if 0 <= j < out.shape[0]:
                return out[j]
        raise SpecrunError(f"no logits for row {row} of the last batch")

    def truncate(self, n_keep: int) -> None:
        """Drop every cached position >= n_keep (the rollback after a rejected draft)."""
        if not ll.llama_memory_seq_rm(self._mem, 0, n_keep, -1):
            raise SpecrunError(
                f"{self.path.name}: the KV cache cannot drop a tail (recurrent or hybrid model)"
            )

    def clear(self) -> None:
        ll.llama_memory_clear(self._mem, True)

    def _probe_truncate(self) -> bool:
        """Whether this model's memory can drop a tail; recurrent/hybrid memories cannot."""
        if self.is_recurrent:
            return False
        return True
