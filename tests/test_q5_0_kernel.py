"""The Q5_0 x Q8_0 dot product of the build (patches/...-row-q5_0-vnni.patch on AVX-512 VNNI CPUs,
upstream's AVX2 or scalar code elsewhere), called directly in the CPU backend's library: it must
give the exact integer sums a reference computes from the blocks' bytes, and the multi-column
kernels a verify pass uses (patches/...-row-exact.patch, and the layout of a batch's columns
once for many weight rows in ...-row-q5_0-vnni.patch) must give each column, bit for bit, what
the one-column kernel gives it alone. Block counts odd and even (the VNNI kernel takes two blocks
a step). No model is loaded.

Also: how far ahead a single row's quantized matmul fetches weight rows
(patches/...-row-prefetch.patch), as the build reports it."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from conftest import build_number_with

QK = 32
Q5_0_BYTES = 22  # fp16 scale, 32 high bits, 16 bytes of nibbles
Q8_0_BYTES = 34  # fp16 scale, 32 int8


def _cpu_lib() -> ctypes.CDLL:
    import llama_cpp

    libdir = Path(llama_cpp.__file__).parent / "lib"
    names = sorted(libdir.glob("libggml-cpu.*"))
    if not names:
        pytest.skip(f"no libggml-cpu in {libdir}")
    lib = ctypes.CDLL(str(names[0]))
    lib.ggml_cpu_init()
    return lib


def _quantize(lib: ctypes.CDLL, fn: str, x: np.ndarray, block_bytes: int) -> ctypes.Array:
    x = np.ascontiguousarray(x, dtype=np.float32)
    buf = ctypes.create_string_buffer(len(x) // QK * block_bytes)
    getattr(lib, fn)(x.ctypes.data_as(ctypes.c_void_p), buf, ctypes.c_int64(len(x)))
    return buf


def _reference(qx: bytes, qy: bytes, nb: int) -> float:
    """sum over blocks of d_x * d_y * (exact integer dot product), from the bytes."""
    total = 0.0
    for b in range(nb):
        xb = qx[b * Q5_0_BYTES : (b + 1) * Q5_0_BYTES]
        yb = qy[b * Q8_0_BYTES : (b + 1) * Q8_0_BYTES]
        dx = float(np.frombuffer(xb[:2], dtype=np.float16)[0])
        qh = int.from_bytes(xb[2:6], "little")
        qs = np.frombuffer(xb[6:], dtype=np.uint8).astype(np.int64)
        nib = np.concatenate([qs & 0x0F, qs >> 4])
        high = np.array([(qh >> j) & 1 for j in range(QK)], dtype=np.int64)
        q = nib + 16 * high - 16
        dy = float(np.frombuffer(yb[:2], dtype=np.float16)[0])
        y = np.frombuffer(yb[2:], dtype=np.int8).astype(np.int64)
        total += dx * dy * float(np.dot(q, y))
    return total


def _vec_dot(lib: ctypes.CDLL, n: int, qx, qy) -> float:
    out = ctypes.c_float()
    lib.ggml_vec_dot_q5_0_q8_0(
        ctypes.c_int(n), ctypes.byref(out), ctypes.c_size_t(0), qx, ctypes.c_size_t(0), qy,
        ctypes.c_size_t(0), ctypes.c_int(1),
    )  # fmt: skip
    return out.value


@pytest.mark.parametrize("nb", [1, 2, 3, 18, 19, 48])
def test_q5_0_dot_is_the_exact_block_sum(nb):
    lib = _cpu_lib()
    rng = np.random.default_rng(nb)
    n = nb * QK
    for trial in range(20):
        # Blocks of very different scales, as a layer's rows have.
        x = rng.standard_normal(n) * np.repeat(rng.uniform(0.01, 4.0, nb), QK)
        y = rng.standard_normal(n) * np.repeat(rng.uniform(0.01, 4.0, nb), QK)
        qx = _quantize(lib, "quantize_row_q5_0", x, Q5_0_BYTES)
        qy = _quantize(lib, "quantize_row_q8_0", y, Q8_0_BYTES)
        ref = _reference(qx.raw, qy.raw, nb)
        got = _vec_dot(lib, n, qx, qy)
        # float32 accumulation of exact integer sums: a few ulps of the magnitudes summed
        scale = sum(
            abs(_reference(qx.raw[b * Q5_0_BYTES :], qy.raw[b * Q8_0_BYTES :], 1))
            for b in range(nb)
        )
        assert abs(got - ref) <= 1e-5 * scale + 1e-6, (nb, trial, got, ref)


@pytest.mark.parametrize("nb", [3, 18, 19])
def test_q5_0_columns_equal_one_column_bit_for_bit(nb):
    lib = _cpu_lib()
    if not hasattr(lib, "specrun_vec_dot_q5_0_cols"):
        pytest.skip("no multi-column Q5_0 kernel in this build (x86 AVX2 only)")
    rng = np.random.default_rng(100 + nb)
    n = nb * QK
    x = rng.standard_normal(n) * np.repeat(rng.uniform(0.01, 4.0, nb), QK)
    qx = _quantize(lib, "quantize_row_q5_0", x, Q5_0_BYTES)
    cols = [
        _quantize(lib, "quantize_row_q8_0", rng.standard_normal(n), Q8_0_BYTES) for _ in range(6)
    ]
    ys = ctypes.create_string_buffer(b"".join(c.raw for c in cols))
    alone = [_vec_dot(lib, n, qx, c) for c in cols]
    for nc in range(2, 7):
        out = (ctypes.c_float * 6)()
        lib.specrun_vec_dot_q5_0_cols(
            ctypes.c_int(n), out, ctypes.c_size_t(1), qx, ys,
            ctypes.c_size_t(nb * Q8_0_BYTES), ctypes.c_int(nc),
        )  # fmt: skip
        assert list(out[:nc]) == alone[:nc], nc
    if not hasattr(lib, "specrun_vec_dot_q5_0_cols_prep"):
        return  # the columns laid out once: AVX512-VNNI builds only
    pairs = (nb + 1) // 2
    raw = np.zeros(2 * 6 * pairs * 64 + 64, dtype=np.uint8)
    prep = raw[(-raw.ctypes.data) % 64 :]  # 64-byte aligned, as the kernel loads it
    lib.specrun_q5_0_prep(
        ctypes.c_int(n), prep.ctypes.data_as(ctypes.c_void_p), ys,
        ctypes.c_size_t(nb * Q8_0_BYTES), ctypes.c_int(6),
    )  # fmt: skip
    for nc in range(2, 7):
        out = (ctypes.c_float * 6)()
        lib.specrun_vec_dot_q5_0_cols_prep(
            ctypes.c_int(n), out, ctypes.c_size_t(1), qx,
            prep.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(nc),
        )  # fmt: skip
        assert list(out[:nc]) == alone[:nc], ("prepared", nc)


def test_the_build_reports_how_far_ahead_a_single_row_fetches():
    """8 weight rows ahead on Intel (measured there), none elsewhere unless
    SPECRUN_PREFETCH_AHEAD (0-64) says; the CPU backend reports it (`specrun info`'s system
    line, so a calibration is keyed by it)."""
    from specrun.llama.backend import system_info

    if "SPECRUN_PREFETCH_AHEAD" not in system_info():
        pytest.skip("not an x86 AVX2 build")
    name = "SPECRUN_PREFETCH_AHEAD"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        intel = "GenuineIntel" in cpuinfo.read_text()
        assert build_number_with(name, None) == (8 if intel else 0)
    assert build_number_with(name, "3") == 3
    assert build_number_with(name, "100") == 64
    assert build_number_with(name, "-5") == 0
