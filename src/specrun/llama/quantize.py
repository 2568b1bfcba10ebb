"""Re-quantize a GGUF with llama.cpp's own quantizer."""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp as ll

from specrun.errors import ModelError, SpecrunError
from specrun.llama.backend import init_backend, physical_cores

QUANT_TYPES: dict[str, int] = {
    name[len("LLAMA_FTYPE_") :].replace("MOSTLY_", "").replace("ALL_", ""): getattr(ll, name)
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
