"""Where a model's weights go on the CPU: llama.cpp's extra buffer types (AMX, CPU_REPACK) kept
only where their kernels score a row in a batch as they score it alone."""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path
from typing import Any

import llama_cpp as ll

from specrun.errors import SpecrunError
from specrun.llama.backend import init_backend, system_info

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
# (tests/test_row_exact_formats.py): Q4_0's 8x8 gemm and gemv agree bit for bit. Q4_K's do with
# patches/ (upstream's 1-row gemv rounds once per super block of 256 values and its 4-row gemm once
# per 64, so a row parted by up to 1.0 in the logits between the two; the patched gemv rounds as
# the gemm does), which the build reports as SPECRUN_Q4_K_REPACK. IQ4_NL's and MXFP4's are not
# checked: a target keeps those in plain buffers, where one vec_dot serves every batch size.
ROW_EXACT_REPACK = ("Q4_0",)
ROW_EXACT_REPACK_PATCHED = ("Q4_0", "Q4_K")


def row_exact_repack() -> tuple[str, ...]:
    """The weight types a target may have repacked with this build of llama.cpp."""
    return (
        ROW_EXACT_REPACK_PATCHED if "SPECRUN_Q4_K_REPACK = 1" in system_info() else ROW_EXACT_REPACK
    )


def weight_buffers(path: Path, mparams: Any, offloads: bool, single_rows: bool, exact: bool) -> Any:
    """Where a model's weights go on the CPU; returns what must outlive the load.

    Two reasons to override llama.cpp's choice of extra buffer types:

    - AMX (Sapphire Rapids and later): llama.cpp puts quantized weights in AMX buffers, whose
      batched matmul crashes (SIGSEGV in ggml_backend_amx_mul_mat on any batch of 2+ rows:
      ggml-org/llama.cpp#20824, reproduced with 0.3.36 on Q4_0, Q4_1 and Q4_K models). A model
      that decodes one row at a time (``single_rows``: a draft) keeps them, AMX's single-row
      kernel (AVX512-VNNI) being sound and the fastest; any other keeps its weights out of AMX.
      SPECRUN_ALLOW_AMX=1 leaves AMX alone, for a llama.cpp where this is fixed.
    - Row exactness (``exact``: a target, whose verify passes must score each row as decoding it
      alone would): only the types whose repacked kernels are row-exact (``row_exact_repack``)
      are repacked; upstream's Q4_K kernels compute a batch in groups of four rows with another
      summation than a single row.

    Extra buffer types are then turned off and the layer matrices that may be repacked are put
    back in CPU_REPACK by name (rows in eights, as llama.cpp's x86 repacking needs).
    """
    bufts = cpu_extra_buffer_types()
    amx = "AMX" in bufts and os.environ.get(AMX_OPT_IN) != "1" and not single_rows
    if not amx and not exact:
        return None
    if offloads:
        # Layers go to GPUs or RPC workers too: the ones left on the CPU keep plain buffers
        # (patterns by layer would also catch the offloaded ones).
        if amx or exact:
            mparams.use_extra_bufts = False
        return None
    from specrun.llama.gguf import validate_gguf

    try:
        info = validate_gguf(path, check_tensors=True)
    except SpecrunError:
        return None  # llama.cpp reports what is wrong with the file
    allowed = row_exact_repack() if exact else ("Q4_0", "Q4_K")
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
