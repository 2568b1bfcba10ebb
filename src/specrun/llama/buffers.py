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
from specrun.llama.gguf import matrix_bytes, validate_gguf

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


# Every weight type llama.cpp 0.3.36's AMX matmul takes. Its two kernels, one row (AVX512-VNNI)
# and 2+ rows (AMX tiles), sum each block in integers and scale the sums in the same order, so a
# row gets the same result alone and in a batch, bit for bit (tests/test_row_exact_formats.py
# and test_amx_rows.py on an AMX CPU; each of these in batches of 2 to 16).
AMX_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
_AMX_ROW_BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "F16": 16}  # the others: a super block, 256
AMX_FIXED = "SPECRUN_AMX_TILECFG = 1"


def amx_batches_sound() -> bool:
    """Whether llama.cpp's AMX batch kernel runs here: built with the whole tile configuration
    loaded (patches/, reported as SPECRUN_AMX_TILECFG), or SPECRUN_ALLOW_AMX=1 (a llama.cpp where
    it is fixed otherwise). Upstream's ``_tile_loadconfig(&tc)`` under GCC 12 (whose intrinsic
    names only a pointer's 8 bytes of the configuration as its input) had the configuration's
    stores dropped as dead: the first batched AMX matmul raised SIGILL or SIGSEGV, by what the
    stack held (ggml-org/llama.cpp#20824). SPECRUN_ALLOW_AMX=0 says it is not (targets then keep
    out of AMX and drafts decode in it row by row, as without the fix)."""
    said = os.environ.get(AMX_OPT_IN)
    if said in ("0", "1"):
        return said == "1"
    return AMX_FIXED in system_info()


def _amx_takes(tname: str, rows: int, cols: int) -> bool:
    """Whether llama.cpp's AMX buffer takes a matrix (its supports_op): a type it has kernels
    for, or F16; rows in pairs of 16-row tiles; a row a whole number of blocks."""
    return (
        (tname in AMX_TYPES or tname == "F16")
        and rows % 32 == 0
        and cols % _AMX_ROW_BLOCK.get(tname, 256) == 0
    )


def amx_fits(tname: str, rows: int, cols: int) -> bool:
    """Whether a matrix belongs in AMX: a quantized type AMX takes. Not F16, which llama.cpp
    would put there too: AMX's F16 kernel (plain AVX-512 FMAs, no tiles) made SmolLM2 F16's
    passes of 5 and 9 rows cost 1.9 and 3.0 rows (1.2 and 1.8 in plain buffers, whose F16
    kernel patches/ makes row-exact over several columns)."""
    return tname in AMX_TYPES and _amx_takes(tname, rows, cols)


# Bytes AMX's packed layout adds per block to the type's own: Q8_0's int8 compensation sums,
# Q4_K's and Q5_K's unpacked scales, IQ4_XS's (ggml-cpu/amx/mmq.cpp, get_row_size).
_AMX_EXTRA = {"Q8_0": 4, "Q4_K": 4, "Q5_K": 4, "IQ4_XS": 2}


def amx_bytes(tname: str, rows: int, cols: int) -> int:
    """What AMX's copy of a matrix takes (its packed layout, beside the mapped file)."""
    return matrix_bytes(tname, rows, cols, _AMX_EXTRA.get(tname, 0))


def amx_holds_weights(single_rows: bool) -> bool:
    """Whether a model loaded here (``single_rows``: as a draft is, LoadOptions.amx_rows) gets
    weights in AMX buffers: the CPU offers them and the batch kernel is sound or never run."""
    return "AMX" in cpu_extra_buffer_types() and (single_rows or amx_batches_sound())


def layer_placement(
    matrices: list[tuple[str, str, int, int]], exact: bool, has_amx: bool, amx_use: bool
) -> tuple[bool, list[str | None]]:
    """Where weight_buffers wants each layer matrix (name, type, rows, columns): whether
    llama.cpp's own placement (AMX first where it takes a matrix, else CPU_REPACK where it
    repacks) is that, and per matrix "AMX", "CPU_REPACK" or None (plain), for placing by name.
    ``amx_use``: AMX may hold the weights (amx_holds_weights); ``exact``: a target."""
    allowed = row_exact_repack() if exact else ("Q4_0", "Q4_K")
    repackable = {"Q4_0", "Q4_K", "IQ4_NL", "MXFP4", "Q2_K"}

    def place(tname: str, rows: int, cols: int) -> str | None:
        if amx_use and amx_fits(tname, rows, cols):
            return "AMX"
        if tname in allowed and rows % 8 == 0:
            return "CPU_REPACK"
        return None

    def stands(tname: str, rows: int, cols: int) -> bool:
        if has_amx and _amx_takes(tname, rows, cols):
            return amx_use and amx_fits(tname, rows, cols)
        return not exact or tname not in repackable or place(tname, rows, cols) is not None

    return (
        all(stands(t, r, c) for _n, t, r, c in matrices),
        [place(t, r, c) for _n, t, r, c in matrices],
    )


def weight_buffers(path: Path, mparams: Any, offloads: bool, single_rows: bool, exact: bool) -> Any:
    """Where a model's weights go on the CPU; returns what must outlive the load.

    Two reasons to override llama.cpp's choice of extra buffer types:

    - AMX (Sapphire Rapids and later): llama.cpp puts quantized weights in AMX buffers. Built
      as patches/ builds it, AMX is sound and row-exact (``AMX_TYPES``) and its single rows are
      the fastest kernel there is for those types (SmolLM2 Q8_0 at position 200: 6.8 ms a row
      against 12.5 ms in plain buffers; a 5-row pass 11.1 against 23.2 ms): every model keeps it.
      Where the batch kernel would crash (``amx_batches_sound`` false) a model that decodes one
      row at a time (``single_rows``: a draft) keeps AMX, its single-row kernel being sound, and
      any other keeps its weights out of AMX.
    - Row exactness (``exact``: a target, whose verify passes must score each row as decoding it
      alone would): only the types whose repacked kernels are row-exact (``row_exact_repack``)
      are repacked; upstream's Q4_K kernels compute a batch in groups of four rows with another
      summation than a single row.

    Where llama.cpp's own placement would break either, extra buffer types are turned off and
    the layer matrices that may go there are put back by name: in AMX (where sound) or in
    CPU_REPACK (rows in eights, as llama.cpp's x86 repacking needs).
    """
    bufts = cpu_extra_buffer_types()
    has_amx = "AMX" in bufts
    # AMX may hold this model's weights: its batch kernel is sound, or the model never batches.
    amx_use = has_amx and (single_rows or amx_batches_sound())
    amx_bad = has_amx and not amx_use
    if not has_amx and not exact:
        return None
    if offloads:
        # Layers go to GPUs or RPC workers too: the ones left on the CPU keep plain buffers
        # (patterns by layer would also catch the offloaded ones).
        if amx_bad or exact:
            mparams.use_extra_bufts = False
        return None

    try:
        info = validate_gguf(path, check_tensors=True)
    except SpecrunError:
        return None  # llama.cpp reports what is wrong with the file
    stands, wheres = layer_placement(info.layer_matrices, exact, has_amx, amx_use)
    if not amx_bad and stands:
        return None
    mparams.use_extra_bufts = False
    by_place: dict[tuple[str, str], list[str]] = {}
    for (name, _t, _r, _c), where in zip(info.layer_matrices, wheres, strict=True):
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if m and where is not None and where in bufts:
            by_place.setdefault((where, m.group(2)), []).append(m.group(1))
    if not by_place:
        return None
    entries = [
        _BuftOverride(f"^blk\\.({'|'.join(layers)})\\.{re.escape(suffix)}$".encode(), bufts[where])
        for (where, suffix), layers in by_place.items()
    ]
    arr = (_BuftOverride * (len(entries) + 1))(*entries, _BuftOverride(None, None))
    mparams.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)
    return arr
