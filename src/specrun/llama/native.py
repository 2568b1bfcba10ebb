"""C helpers that specrun's build of llama.cpp adds (patches/llama-cpp-python-0.3.36-top-prob.patch),
found by symbol: a llama-cpp-python built without the patch lacks them, and callers keep their
numpy paths."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import numpy as np


@functools.cache
def top_prob() -> Callable[[np.ndarray], float] | None:
    """``f(x)``: the untempered softmax probability of the largest of a C-contiguous float32
    vector's values, from those within 16 of it (the rest add at most n e^-16 to the sum). One
    pass for the maximum and one for the sum of exponentials, in C (AVX2 where the build has
    it), without the temporaries numpy needs: 35-45 us against 85-100 us a check in a run
    (49k logits of an F16 SmolLM2, 2-core Zen 3). None where the build lacks it."""
    try:
        import llama_cpp as ll

        fn = ll.llama_cpp._lib.specrun_top_prob
    except (AttributeError, ImportError, OSError):
        return None
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64]

    def call(x: np.ndarray) -> float:
        return float(fn(x.__array_interface__["data"][0], x.shape[0]))

    return call


@functools.cache
def sgemm_setter() -> Callable[[int], None] | None:
    """``set(rows)``: llamafile's sgemm for the next passes' batches of at least ``rows`` rows
    (-1: the build's own bound, longer than any verify pass). None where the build lacks it
    (patches/llama-cpp-python-0.3.36-sgemm-by-pass.patch)."""
    try:
        import llama_cpp as ll

        fn = ll.llama_cpp._lib.specrun_set_sgemm_rows
    except (AttributeError, ImportError, OSError):
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_int]
    return fn  # type: ignore[no-any-return]
