"""llama.cpp's process-wide side: the backend, its log, deferred signals, what this build and
CPU support, and the devices it can place weights on."""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from specrun.errors import SpecrunError
from specrun.llama import libs

# llama_cpp's own libggml before llama_cpp loads libllama, whatever LD_LIBRARY_PATH holds (libs.py)
libs.preload()

import llama_cpp as ll  # noqa: E402

_backend_lock = threading.Lock()
_backend_ready = False
_log_verbose = False
_log_capture: list[str] | None = None  # llama.cpp's log lines while a model loads


@ll.llama_log_callback  # type: ignore[untyped-decorator]
def _log_sink(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:  # pragma: no cover
    line = text.decode("utf-8", errors="replace")
    if _log_capture is not None:
        _log_capture.append(line)
    if _log_verbose:
        sys.stderr.write(line)


@contextlib.contextmanager
def capture_load_log(lines: list[str]) -> Iterator[None]:
    """llama.cpp's log lines go to ``lines`` too while a model loads (parse_load_log reads them)."""
    global _log_capture
    _log_capture = lines
    try:
        yield
    finally:
        _log_capture = None


def parse_load_log(lines: list[str]) -> dict[str, Any]:
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
            if m.group(1) not in (
                "CPU",
                "CPU_Mapped",
                "CPU_REPACK",
                "CPU_AARCH64",
                "AMX",
            ) and "Host" not in m.group(1):
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


@ll.llama_progress_callback  # type: ignore[untyped-decorator]
def load_progress(progress: float, user_data: ctypes.c_void_p) -> bool:  # pragma: no cover
    """Returning False makes llama.cpp abandon the load: a signal arrived meanwhile."""
    return not _pending_signals


def init_backend(verbose: bool = False) -> None:
    """Initialise llama.cpp once; its log goes to stderr only when ``verbose``."""
    global _backend_ready, _log_verbose
    _log_verbose = verbose
    with _backend_lock:
        if not _backend_ready:
            check_build()
            # llama.cpp's tiled K-quant matmul takes batches of 8+ rows only, and sums otherwise
            # than the vec_dot that scores single rows (Q4_K/Q6_K logits up to 0.9 apart): off,
            # so a verify pass of 8+ rows scores each row as decoding it alone would (read by
            # ggml once, at its first matmul; set GGML_CPU_TILED_MM=1 to have it anyway).
            os.environ.setdefault("GGML_CPU_TILED_MM", "0")
            ll.llama_log_set(_log_sink, ctypes.c_void_p(0))
            ll.llama_backend_init()
            _backend_ready = True


# What specrun calls in llama-cpp-python's bindings (llama/*.py: tests/test_install.py keeps the
# list whole) and the struct fields it sets: an installed llama-cpp-python of another version
# (pyproject.toml takes a range, so that pip keeps a CUDA or Metal build it finds) must have them.
REQUIRED_API = (
    "llama_backend_init",
    "llama_batch_free",
    "llama_batch_init",
    "llama_chat_apply_template",
    "llama_chat_builtin_templates",
    "llama_chat_message",
    "llama_context_default_params",
    "llama_decode",
    "llama_free",
    "llama_get_logits",
    "llama_get_memory",
    "llama_init_from_model",
    "llama_log_callback",
    "llama_log_set",
    "llama_max_devices",
    "llama_memory_clear",
    "llama_memory_seq_rm",
    "llama_model_chat_template",
    "llama_model_default_params",
    "llama_model_desc",
    "llama_model_free",
    "llama_model_get_vocab",
    "llama_model_is_hybrid",
    "llama_model_is_recurrent",
    "llama_model_load_from_file",
    "llama_model_meta_val_str",
    "llama_model_n_ctx_train",
    "llama_model_n_layer",
    "llama_model_n_params",
    "llama_model_quantize",
    "llama_model_quantize_default_params",
    "llama_model_size",
    "llama_n_batch",
    "llama_n_ctx",
    "llama_n_threads",
    "llama_n_threads_batch",
    "llama_n_ubatch",
    "llama_print_system_info",
    "llama_progress_callback",
    "llama_state_seq_get_data",
    "llama_state_seq_get_size",
    "llama_state_seq_set_data",
    "llama_supports_gpu_offload",
    "llama_supports_mlock",
    "llama_supports_mmap",
    "llama_supports_rpc",
    "llama_synchronize",
    "llama_token",
    "llama_token_to_piece",
    "llama_tokenize",
    "llama_vocab_bos",
    "llama_vocab_eos",
    "llama_vocab_get_add_bos",
    "llama_vocab_get_add_eos",
    "llama_vocab_get_text",
    "llama_vocab_is_eog",
    "llama_vocab_n_tokens",
    "llama_vocab_type",
    "llama_sampler_accept",
    "llama_sampler_apply",
    "llama_sampler_clone",
    "llama_sampler_free",
    "llama_sampler_init_grammar",
    "llama_token_data",
    "llama_token_data_array",
    "llama_vocab_fim_mid",
    "llama_vocab_fim_pad",
    "llama_vocab_fim_pre",
    "llama_vocab_fim_rep",
    "llama_vocab_fim_sep",
    "llama_vocab_fim_suf",
)
REQUIRED_FIELDS = {
    "llama_model_params": ("n_gpu_layers", "check_tensors", "vocab_only", "progress_callback"),
    "llama_context_params": (
        "n_ctx",
        "n_batch",
        "n_ubatch",
        "n_seq_max",
        "n_threads",
        "n_threads_batch",
        "no_perf",
        "n_outputs_max",
        "flash_attn_type",
        "type_k",
        "type_v",
    ),
    "llama_model_quantize_params": ("ftype", "allow_requantize", "nthread"),
}


def missing_api() -> list[str]:
    """What specrun uses that this llama-cpp-python lacks (``REQUIRED_API``, ``REQUIRED_FIELDS``)."""
    out = [n for n in REQUIRED_API if not hasattr(ll, n)]
    for struct, fields in REQUIRED_FIELDS.items():
        have = {f[0] for f in getattr(getattr(ll, struct, None), "_fields_", ())}
        out += [f"{struct}.{f}" for f in fields if f not in have]
    return out


def llama_cpp_requirement() -> str:
    """The llama-cpp-python versions this specrun was installed to run on (its metadata)."""
    with contextlib.suppress(metadata.PackageNotFoundError):
        for req in metadata.requires("specrun") or []:
            m = re.match(r"llama[-_]cpp[-_]python\s*([^;]*)", req, re.IGNORECASE)
            if m:
                return "llama-cpp-python" + m.group(1).strip().replace(" ", "")
    return "llama-cpp-python"


def check_build() -> None:
    """Refuse, in one line, a llama-cpp-python that lacks what specrun calls, and llama.cpp
    libraries loaded from outside llama_cpp's own directory (``libs``: LD_LIBRARY_PATH)."""
    missing = missing_api()
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise SpecrunError(
            f"llama-cpp-python {llama_cpp_version() or '?'} lacks {', '.join(missing[:3])}{more}: "
            f"specrun needs {llama_cpp_requirement()} (or make install's build)"
        )
    foreign = libs.foreign()
    if foreign:
        raise SpecrunError(
            f"llama.cpp library {foreign[0]} is not the one llama-cpp-python was built with "
            f"({libs.lib_dir()}): unset LD_LIBRARY_PATH, or set LLAMA_CPP_LIB_PATH to that "
            "build's directory"
        )


_noted = False


def unpatched_note(once: bool = True) -> str | None:
    """One line for stderr saying what a run loses on this build of llama.cpp without specrun's
    patches (patches/series), None on a patched one; with ``once``, None after the first time
    in a process (``generate``, ``chat`` and ``serve`` say it as they load: session.load).

    Rows not bit-exact is the loss that matters: a build with llamafile's sgemm on every batch
    (llama.cpp's default, so any plain ``pip install llama-cpp-python``) sums a batched row
    otherwise than a single one. A build without sgemm keeps rows exact (specrun keeps the
    other inexact kernels out of a verify pass) and loses speed only."""
    global _noted
    if once and _noted:
        return None
    if not batch_exact_cpu():
        note = (
            "this llama.cpp build lacks specrun's patches: batch rows are not bit-exact, so greedy "
            "output may part from the target's at a near-tie (make install builds them: docs/build.md)"
        )
    elif "SPECRUN_" not in system_info():
        note = (
            "this llama.cpp build lacks specrun's patches: rows stay exact, but verify passes are "
            "slower (make install builds them: docs/build.md)"
        )
    else:
        return None
    _noted = _noted or once
    return note


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
    return platform.processor() or platform.machine()


def supports_gpu_offload() -> bool:
    return bool(ll.llama_supports_gpu_offload())


def supports_mmap() -> bool:
    return bool(ll.llama_supports_mmap())


def supports_mlock() -> bool:
    return bool(ll.llama_supports_mlock())


def llama_cpp_version() -> str | None:
    """The llama-cpp-python version this process runs."""
    v = getattr(ll, "__version__", None)
    return None if v is None else str(v)


def build_id() -> str:
    """The llama.cpp libraries this process loaded, as files (name, size, modification time): a
    rebuild with other kernels (patches/) is another build even where ``system_info`` reads the
    same, so what was measured on the old one (calibrate.py) is not taken for the new."""
    lib = Path(str(getattr(ll.llama_cpp._lib, "_name", "") or ""))
    if not lib.name:
        return "?"
    parts = []
    with contextlib.suppress(OSError):
        for f in sorted(lib.parent.iterdir()):
            if (f.name.startswith("lib") and ".so" in f.name) or f.suffix in (".dylib", ".dll"):
                if f.is_file() and not f.is_symlink():
                    st = f.stat()
                    parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(parts) or str(lib)


def system_info() -> str:
    init_backend()
    return str(ll.llama_print_system_info().decode("utf-8", errors="replace").strip())


def auto_flash_attn(n_gpu_layers: int, type_v: int | None, remote: bool = False) -> bool | None:
    """Flash attention when none was asked for: for a model on the CPU, on where this build's CPU
    kernel is row-exact (``flash_attn_row_exact``: patches/), else off; off on RPC workers; on
    for a quantized V cache (which needs it); llama.cpp's own choice (None) for one offloaded to
    this machine's GPUs.

    Upstream's CPU flash-attention kernel gives a row decoded in a batch other logits than the
    same row decoded alone once the context is a few hundred tokens long (measured with SmolLM2:
    up to 6e-2 at 400 tokens, exact below ~256: a single row's pass over 512+ cached cells is
    split across threads and reduced), so greedy speculation could part from the target alone at
    a near-tie. The patched kernel computes every row of a batch of up to 65 the way it computes
    one alone, and decodes 1.01-1.19x faster than attention without it (SmolLM2 F16, five
    prompts, 128 tokens, alternating). An RPC worker's devices all say "GPU" whatever they are
    (the protocol does not tell) and run the worker's own build, so a worker is off.
    ``llama_supports_gpu_offload()`` is no guide: a build with the RPC backend says True on a
    machine without a GPU.
    """
    if type_v is not None and type_v not in (0, 1, 30):  # f32, f16, bf16
        return True
    if remote:
        return False
    if n_gpu_layers == 0 or not local_gpus():
        return flash_attn_row_exact()
    return None


def flash_attn_row_exact() -> bool:
    """Whether this build's CPU flash attention scores a row in a batch (of up to 65) as alone
    (patches/: the build says SPECRUN_FA_ROW_EXACT)."""
    return "SPECRUN_FA_ROW_EXACT = 1" in system_info()


def build_number(name: str) -> int:
    """A number the build states in its system info (patches/: ``SPECRUN_GRAPHS = 17``); 0 where
    it states none."""
    m = re.search(rf"\b{re.escape(name)} = (\d+)", system_info())
    return int(m.group(1)) if m else 0


def graphs_per_batch_size() -> int:
    """How many batch sizes (1..N rows with logits) keep a compute graph of their own in this
    build (patches/: the build says SPECRUN_GRAPHS = N); 0 where llama.cpp keeps its one graph,
    rebuilt at every change of batch size: speculation alternates single rows with verify
    passes, and each switch cost 0.5-0.9 ms against 7-11 ms steps on a 2-core CPU."""
    return build_number("SPECRUN_GRAPHS")


def graph_direct() -> bool:
    """Whether this build computes a kept graph (``graphs_per_batch_size``) on the CPU backend
    without llama.cpp's scheduler once the scheduler has placed it (patches/: the build says
    SPECRUN_GRAPH_DIRECT = 1; the environment's SPECRUN_GRAPH_DIRECT=0 turns it off): allocated
    again at every switch between one row and a verify pass, a kept graph cost 0.1-0.5 ms a
    switch on a 2-core CPU (the scheduler's split and the allocator's plan on one thread, the
    other waiting), two a bet: up to a quarter of a 4 ms step."""
    return build_number("SPECRUN_GRAPH_DIRECT") == 1


def flash_attn_block() -> int:
    """How many KV cells this build's CPU flash attention takes at a time for an F16 cache
    (patches/: the build says SPECRUN_FA_BLOCK = N, AVX2 + F16C + FMA): a row's scores over a
    block in SIMD, one rescale, then its weighted V rows. 0 where llama.cpp's loop runs, a cell
    at a time through function pointers with an F16 accumulator: on a 2-core Zen 3 that loop was
    most of a SmolLM2-135M row's time past a few hundred tokens (a Q4_K_M row 8.5 ms at position
    100, 19.7 ms at 1600)."""
    return build_number("SPECRUN_FA_BLOCK")


def batch_exact_cpu() -> bool:
    """Whether CPU matmuls give the same numbers for a row decoded alone and in a verify pass.

    llamafile's tinyBLAS (a build default) takes batches of 2+ rows and leaves single rows to
    ggml's vec_dot, which sums in another order: logits then differ by ~1e-2 and greedy
    speculation can part from the target alone at near-ties. patches/ leave it only the batches
    longer than a verify pass can be (``sgemm_rows``), a prompt's: exact either way.
    """
    rows = sgemm_rows()
    return rows == 0 or rows > MAX_VERIFY_ROWS


MAX_VERIFY_ROWS = 65  # the longest verify pass (decoding.engine.MAX_DRAFT drafts + 1)


def sgemm_rows() -> int:
    """The fewest rows of a batch that llamafile's sgemm takes in this build (patches/: the
    build says SPECRUN_SGEMM_ROWS = N; its kernels are fast on a prompt's batches, 1.1-1.6x
    llama.cpp's others for F16 and F32 weights here), 0 where it takes none: a build
    without it, or ``SPECRUN_SGEMM_ROWS=0``. An unpatched build with it takes every batch of 2+
    rows: 2."""
    if "LLAMAFILE = 1" not in system_info():
        return 0
    if "SPECRUN_SGEMM_ROWS" not in system_info():
        return 2
    return build_number("SPECRUN_SGEMM_ROWS")


@dataclass(frozen=True)
class Device:
    """A ggml backend device (the CPU, a GPU, an accelerator) and its memory."""

    name: str
    description: str
    kind: str  # cpu | gpu | igpu | accel | meta
    free: int
    total: int


_DEV_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")


def _dev_fns() -> dict[str, Any] | None:
    lib = ll.llama_cpp._lib
    try:
        fns = {
            "count": lib.ggml_backend_dev_count,
            "get": lib.ggml_backend_dev_get,
            "name": lib.ggml_backend_dev_name,
            "desc": lib.ggml_backend_dev_description,
            "kind": lib.ggml_backend_dev_type,
            "memory": lib.ggml_backend_dev_memory,
        }
    except AttributeError:  # pragma: no cover - a build that does not export them
        return None
    fns["count"].restype, fns["count"].argtypes = ctypes.c_size_t, []
    fns["get"].restype, fns["get"].argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    for f in (fns["name"], fns["desc"]):
        f.restype, f.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    fns["kind"].restype, fns["kind"].argtypes = ctypes.c_int, [ctypes.c_void_p]
    fns["memory"].restype = None
    fns["memory"].argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_size_t),
    ]
    return fns


def device_of(handle: int) -> Device:
    """A ggml_backend_dev_t as a Device (its memory asked now: for an RPC device, a round trip)."""
    init_backend()
    f = _dev_fns()
    assert f is not None
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    f["memory"](handle, ctypes.byref(free), ctypes.byref(total))
    k = int(f["kind"](handle))
    return Device(
        name=(f["name"](handle) or b"").decode("utf-8", "replace"),
        description=(f["desc"](handle) or b"").decode("utf-8", "replace"),
        kind=_DEV_KINDS[k] if 0 <= k < len(_DEV_KINDS) else str(k),
        free=int(free.value),
        total=int(total.value),
    )


def device_handles() -> list[int]:
    """The devices llama.cpp's backends registered in this process (RPC workers are not)."""
    init_backend()
    f = _dev_fns()
    if f is None:
        return []
    return [int(f["get"](i)) for i in range(int(f["count"]()))]


def devices() -> list[Device]:
    """The devices llama.cpp's backends registered (ggml_backend_dev_*, in libggml-base)."""
    return [device_of(h) for h in device_handles()]


def local_gpus() -> list[Device]:
    """This machine's GPUs llama.cpp can offload to (a build with RPC alone has none)."""
    return [d for d in devices() if d.kind in ("gpu", "igpu")]


def gpu_free_memory() -> int | None:
    """Free bytes over this machine's GPUs llama.cpp can offload to; None when it has none."""
    gpus = local_gpus()
    return sum(d.free for d in gpus) if gpus else None
