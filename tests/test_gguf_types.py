"""Issue 21: gguf.py's table of tensor types is the build's own. The validator must refuse no file
the llama.cpp it guards would load, so every type the bundled ggml knows (ggml_type_name,
ggml_blck_size, ggml_type_size, read from the library itself) is in GGML_TYPES with the same
sizes, and the ids ggml dropped (block size 0) are the ones the validator names as removed."""

from __future__ import annotations

import ctypes
import pathlib

import pytest

from specrun.llama.gguf import _REMOVED_GGML_TYPES, GGML_TYPES

llama_cpp = pytest.importorskip("llama_cpp")


def _ggml() -> ctypes.CDLL:
    lib_dir = pathlib.Path(llama_cpp.__file__).parent / "lib"
    lib = next(
        (p for p in sorted(lib_dir.glob("*ggml-base*")) if p.suffix in (".so", ".dylib", ".dll")),
        None,
    )
    lib = lib or next(iter(sorted(lib_dir.glob("*ggml-base*"))))
    g = ctypes.CDLL(str(lib))
    g.ggml_type_name.restype, g.ggml_type_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
    g.ggml_blck_size.restype, g.ggml_blck_size.argtypes = ctypes.c_int64, [ctypes.c_int]
    g.ggml_type_size.restype, g.ggml_type_size.argtypes = ctypes.c_size_t, [ctypes.c_int]
    return g


def test_every_type_of_the_bundled_ggml_is_known_with_its_sizes() -> None:
    g = _ggml()
    count = llama_cpp.GGML_TYPE_COUNT
    built = {}
    for t in range(count):
        blck = g.ggml_blck_size(t)
        if blck == 0:  # a retired id: files that use it are refused by name, not as unknown
            assert t not in GGML_TYPES and t in _REMOVED_GGML_TYPES, t
            continue
        built[t] = ((g.ggml_type_name(t) or b"").decode().upper(), blck, g.ggml_type_size(t))
    assert {t: v for t, v in GGML_TYPES.items() if t < count} == built
    assert max(GGML_TYPES) < count  # nothing the build cannot load is accepted
    assert GGML_TYPES[42][0] == "Q2_0" and GGML_TYPES[41][0] == "Q1_0"


def test_a_q2_0_tensor_is_accepted(tmp_path: pathlib.Path) -> None:
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from test_gguf import Tensor, build, write

    from specrun.llama.gguf import validate_gguf

    _name, blck, size = GGML_TYPES[42]
    nbytes = 128 * 2 // blck * size  # two rows of two 64-element blocks
    p = write(tmp_path, build(tensors=[Tensor("w", (128, 2), gtype=42)]) + bytes(nbytes))
    assert validate_gguf(p).tensor_data_offset > 0
