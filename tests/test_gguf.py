"""Tests for specrun.llama.gguf, the pure-Python GGUF pre-validator.

Synthetic files are built by the small writer below; the real-model tests need SmolLM2-135M
(see the `real_gguf` fixture) and skip without it. Fuzzing is derandomized; set
SPECRUN_FUZZ_EXAMPLES=5000 (say) for a longer run.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specrun.errors import ModelError
from specrun.llama.gguf import GGML_TYPES, GGUFInfo, OmittedValue, validate_gguf

# --------------------------------------------------------------------------------------------------
# A tiny GGUF writer (independent of the module under test)

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY = range(10)
UINT64, INT64, FLOAT64 = 10, 11, 12
_FMT = {
    UINT8: "B",
    INT8: "b",
    UINT16: "H",
    INT16: "h",
    UINT32: "I",
    INT32: "i",
    FLOAT32: "f",
    BOOL: "?",
    UINT64: "Q",
    INT64: "q",
    FLOAT64: "d",
}
# ggml type -> (block size, bytes per block), for the types the tests use
_TSIZE = {0: (1, 4), 1: (1, 2), 2: (32, 18), 8: (32, 34), 12: (256, 144)}


class Raw(bytes):
    """A KV value given as raw bytes: written after the key as-is (type field included)."""


@dataclass(frozen=True)
class Tensor:
    name: str | bytes
    dims: tuple[int, ...]
    gtype: int = 0  # F32
    offset: int | None = None  # None: the aligned end of the previous tensor
    n_dims: int | None = None  # None: len(dims)


def _str(s: str | bytes, bo: str = "<") -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(bo + "Q", len(b)) + b


def _value(vtype: int, value: object, bo: str) -> bytes:
    if vtype == STRING:
        assert isinstance(value, str | bytes)
        return _str(value, bo)
    if vtype == ARRAY:
        assert isinstance(value, tuple)
        etype, items = value
        out = struct.pack(bo + "IQ", etype, len(items))
        return out + b"".join(_value(etype, v, bo) for v in items)
    return struct.pack(bo + _FMT[vtype], value)


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def tensor_nbytes(t: Tensor) -> int:
    blck, size = _TSIZE[t.gtype]
    n = 1
    for d in t.dims:
        n *= d
    return n // blck * size


DEFAULT_KVS: list[tuple[str | bytes, int | None, object]] = [
    ("general.architecture", STRING, "llama"),
    ("general.name", STRING, "tiny test"),
    ("test.u8", UINT8, 200),
    ("test.i8", INT8, -5),
    ("test.u16", UINT16, 65535),
    ("test.i16", INT16, -300),
    ("test.u32", UINT32, 4_000_000_000),
    ("test.i32", INT32, -123456),
    ("test.f32", FLOAT32, 1.5),
    ("test.bool", BOOL, True),
    ("test.u64", UINT64, 2**63 + 5),
    ("test.i64", INT64, -(2**40)),
    ("test.f64", FLOAT64, 2.25),
    ("test.unicode", STRING, "héllo ✓"),
    ("test.arr_i32", ARRAY, (INT32, [1, -2, 3])),
    ("test.arr_str", ARRAY, (STRING, ["a", "bc", ""])),
    ("test.arr_bool", ARRAY, (BOOL, [True, False])),
    ("test.arr_empty", ARRAY, (FLOAT32, [])),
    ("test.arr_long", ARRAY, (UINT16, list(range(300)))),
    ("test.arr_long_str", ARRAY, (STRING, [f"tok{i}" for i in range(200)])),
]
DEFAULT_TENSORS = [Tensor("a.weight", (8, 4)), Tensor("b.bias", (3,))]


def build(
    kvs: list | None = None,
    tensors: list[Tensor] | None = None,
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    alignment: int | None = None,
    bo: str = "<",
) -> bytes:
    """A GGUF file: header, KVs, tensor infos, padding, tensor data (filled with a pattern)."""
    kvs = list(DEFAULT_KVS if kvs is None else kvs)
    tensors = list(DEFAULT_TENSORS if tensors is None else tensors)
    if alignment is not None:
        kvs.append(("general.alignment", UINT32, alignment))
    align = alignment if alignment and alignment & (alignment - 1) == 0 else 32
    out = bytearray(magic)
    out += struct.pack(
        bo + "IQQ",
        version,
        len(tensors) if n_tensors is None else n_tensors,
        len(kvs) if n_kv is None else n_kv,
    )
    for key, vtype, value in kvs:
        out += _str(key, bo)
        if vtype is None:
            assert isinstance(value, bytes)
            out += value
        else:
            out += struct.pack(bo + "I", vtype) + _value(vtype, value, bo)
    offset = 0
    layout = []
    for t in tensors:
        out += _str(t.name, bo) + struct.pack(
            bo + "I", len(t.dims) if t.n_dims is None else t.n_dims
        )
        out += struct.pack(f"{bo}{len(t.dims)}q", *t.dims)
        out += struct.pack(bo + "IQ", t.gtype, (offset if t.offset is None else t.offset) % 2**64)
        size = tensor_nbytes(t) if t.gtype in _TSIZE and all(d > 0 for d in t.dims) else 0
        layout.append((offset, size))
        offset += _pad(size, align)
    if tensors:
        out += bytes(_pad(len(out), align) - len(out))
        start = len(out)
        for off, size in layout:
            if size >= 1 << 20:  # a huge tensor: leave the file truncated from here on
                break
            out += bytes(start + off - len(out))
            out += bytes((i * 7 + 3) & 0xFF for i in range(size))
    return bytes(out)


def write(tmp_path: Path, data: bytes, name: str = "model.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def expect_error(path: Path, *fragments: str) -> str:
    with pytest.raises(ModelError) as ei:
        validate_gguf(path)
    msg = str(ei.value)
    assert str(path) in msg, msg
    assert "\n" not in msg, msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


def kv(key: str | bytes, raw: bytes) -> tuple[str | bytes, None, bytes]:
    return (key, None, raw)


# --------------------------------------------------------------------------------------------------
# Valid synthetic files


def test_valid_synthetic_file(tmp_path: Path) -> None:
    data = build()
    p = write(tmp_path, data)
    info = validate_gguf(p)
    assert isinstance(info, GGUFInfo)
    assert info.path == p
    assert info.version == 3
    assert (info.n_tensors, info.n_kv) == (2, len(DEFAULT_KVS))
    assert info.architecture == "llama"
    assert info.name == "tiny test"
    assert info.alignment == 32
    assert info.file_size == len(data)
    assert info.tensor_data_offset % 32 == 0
    assert info.tensor_data_offset + 128 + 12 == len(data)
    m = info.metadata
    assert m["test.u8"] == 200 and m["test.i8"] == -5
    assert m["test.u16"] == 65535 and m["test.i16"] == -300
    assert m["test.u32"] == 4_000_000_000 and m["test.i32"] == -123456
    assert m["test.f32"] == 1.5 and m["test.f64"] == 2.25
    assert m["test.bool"] is True
    assert m["test.u64"] == 2**63 + 5 and m["test.i64"] == -(2**40)
    assert m["test.unicode"] == "héllo ✓"
    assert m["test.arr_i32"] == (1, -2, 3)
    assert m["test.arr_str"] == ("a", "bc", "")
    assert m["test.arr_bool"] == (True, False)
    assert m["test.arr_empty"] == ()
    assert m["test.arr_long"] == OmittedValue("array[uint16]", 300)
    assert m["test.arr_long_str"] == OmittedValue("array[string]", 200)
    assert info.get("test.u8") == 200
    assert info.get("missing") is None
    assert info.get("missing", 7) == 7


def test_version_2_is_accepted(tmp_path: Path) -> None:
    assert validate_gguf(write(tmp_path, build(version=2))).version == 2


def test_load_arrays_on_request(tmp_path: Path) -> None:
    p = write(tmp_path, build())
    info = validate_gguf(p, load_arrays=["test.arr_long_str"])
    assert info.metadata["test.arr_long_str"] == tuple(f"tok{i}" for i in range(200))
    assert isinstance(info.metadata["test.arr_long"], OmittedValue)
    info = validate_gguf(p, load_arrays=True)
    assert info.metadata["test.arr_long"] == tuple(range(300))


def test_custom_alignment(tmp_path: Path) -> None:
    data = build(alignment=64)
    info = validate_gguf(write(tmp_path, data))
    assert info.alignment == 64
    assert info.tensor_data_offset % 64 == 0
    assert info.tensor_data_offset + 128 + 12 == len(data)


def test_no_tensors_no_kvs(tmp_path: Path) -> None:
    info = validate_gguf(write(tmp_path, build(kvs=[], tensors=[])))
    assert (info.n_tensors, info.n_kv, info.tensor_data_offset) == (0, 0, 24)
    assert info.architecture is None and info.name is None


def test_quantized_tensor_sizes(tmp_path: Path) -> None:
    tensors = [
        Tensor("q4", (64, 3), gtype=2),
        Tensor("q8", (32,), gtype=8),
        Tensor("k", (256, 2), gtype=12),
    ]
    data = build(tensors=tensors)
    info = validate_gguf(write(tmp_path, data))
    # 6 Q4_0 blocks of 18 bytes -> 108, padded to 128; then 34 -> 64; then 2 Q4_K blocks of 144
    assert info.tensor_data_offset + 128 + 64 + 288 == len(data)
    expect_error(write(tmp_path, data[:-1], "cut.gguf"), "truncated GGUF", "'k' data ends at byte")


def test_ggml_type_table() -> None:
    # block sizes in bytes, from the static_asserts in ggml-common.h
    expected = {
        "F32": (1, 4),
        "F16": (1, 2),
        "BF16": (1, 2),
        "Q4_0": (32, 18),
        "Q4_1": (32, 20),
        "Q5_0": (32, 22),
        "Q5_1": (32, 24),
        "Q8_0": (32, 34),
        "Q8_1": (32, 36),
        "Q2_K": (256, 84),
        "Q3_K": (256, 110),
        "Q4_K": (256, 144),
        "Q5_K": (256, 176),
        "Q6_K": (256, 210),
        "Q8_K": (256, 292),
        "IQ2_XXS": (256, 66),
        "IQ2_XS": (256, 74),
        "IQ3_XXS": (256, 98),
        "IQ1_S": (256, 50),
        "IQ4_NL": (32, 18),
        "IQ3_S": (256, 110),
        "IQ2_S": (256, 82),
        "IQ4_XS": (256, 136),
        "IQ1_M": (256, 56),
        "TQ1_0": (256, 54),
        "TQ2_0": (256, 66),
        "MXFP4": (32, 17),
        "I8": (1, 1),
        "I16": (1, 2),
        "I32": (1, 4),
        "I64": (1, 8),
        "F64": (1, 8),
    }
    table = {name: (blck, size) for name, blck, size in GGML_TYPES.values()}
    for name, sizes in expected.items():
        assert table[name] == sizes, name
    assert GGML_TYPES[0][0] == "F32" and GGML_TYPES[3][0] == "Q4_1" and GGML_TYPES[30][0] == "BF16"


def test_check_tensors_false_reads_only_metadata(tmp_path: Path) -> None:
    bad = build(tensors=[Tensor("a", (4,), gtype=999)])
    p = write(tmp_path, bad)
    expect_error(p, "unknown ggml type 999")
    info = validate_gguf(p, check_tensors=False)
    assert info.tensor_data_offset == -1
    assert info.architecture == "llama"


# --------------------------------------------------------------------------------------------------
# Each class of corruption


def test_bad_magic(tmp_path: Path) -> None:
    expect_error(
        write(tmp_path, build(magic=b"PK\x03\x04")), "not a GGUF file", "bad magic b'PK\\x03\\x04'"
    )
    expect_error(write(tmp_path, build(magic=b"tjgg"), "old.bin"), "legacy GGML")
    expect_error(write(tmp_path, b"<!DOCTYPE html><html>" + bytes(40), "page.gguf"), "HTML")
    expect_error(
        write(tmp_path, b"version https://git-lfs.github.com/spec/v1\n", "lfs.gguf"), "Git LFS"
    )


@pytest.mark.parametrize(
    ("version", "fragment"),
    [
        (1, "version 1 is no longer supported"),
        (99, "version 99"),
        (0, "version 0"),
        (4, "version 4"),
    ],
)
def test_unsupported_version(tmp_path: Path, version: int, fragment: str) -> None:
    expect_error(write(tmp_path, build(version=version)), "unsupported GGUF version", fragment)


def test_big_endian(tmp_path: Path) -> None:
    expect_error(write(tmp_path, build(bo=">")), "big-endian GGUF", "version 3")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"n_kv": 2**60}, "claims 1152921504606846976 metadata key/value pairs"),
        ({"n_kv": 2**64 - 1}, "metadata key/value pairs"),
        ({"n_tensors": 2**62}, "4611686018427387904 tensors"),
        ({"n_tensors": 2**64 - 1}, "tensors"),
        ({"n_tensors": 50}, "tensors"),
    ],
)
def test_huge_counts(tmp_path: Path, kwargs: dict, fragment: str) -> None:
    expect_error(write(tmp_path, build(**kwargs)), "corrupt or truncated GGUF", fragment)


def test_counts_slightly_off(tmp_path: Path) -> None:
    expect_error(write(tmp_path, build(n_kv=len(DEFAULT_KVS) + 1)))
    expect_error(write(tmp_path, build(n_kv=len(DEFAULT_KVS) - 1), "b.gguf"))
    expect_error(write(tmp_path, build(n_tensors=3), "c.gguf"))
    # one tensor fewer: the second info reads as padding; a structurally valid file (llama.cpp
    # would accept it too), so it passes
    assert validate_gguf(write(tmp_path, build(n_tensors=1), "d.gguf")).n_tensors == 1


@pytest.mark.parametrize(
    ("entry", "fragments"),
    [
        (
            kv("x.s", struct.pack("<IQ", STRING, 10**8) + b"abc"),
            ("corrupt or truncated GGUF", "run past the end"),
        ),
        (
            kv("x.s", struct.pack("<IQ", STRING, 10**12) + b"abc"),
            ("length 1000000000000, the limit is 1073741824",),
        ),
        (kv("x.s", struct.pack("<IQ", STRING, 2**64 - 1)), ("x.s",)),
        (kv("x.t", struct.pack("<I", 13) + bytes(8)), ("key 'x.t' has unknown value type 13",)),
        (kv("x.t", struct.pack("<I", 0xFFFFFFFF) + bytes(8)), ("unknown value type 4294967295",)),
        (
            kv("x.a", struct.pack("<IIQ", ARRAY, 77, 1) + bytes(8)),
            ("array of unknown value type 77",),
        ),
        (
            kv("x.a", struct.pack("<IIQ", ARRAY, ARRAY, 1) + struct.pack("<IQ", UINT8, 0)),
            ("array of arrays",),
        ),
        (kv("x.a", struct.pack("<IIQ", ARRAY, UINT8, 2**20) + bytes(8)), ("run past the end",)),
        (kv("x.a", struct.pack("<IIQ", ARRAY, UINT64, 2**62) + bytes(8)), ("limit is 1073741824",)),
        (kv("x.a", struct.pack("<IIQ", ARRAY, STRING, 2**29) + bytes(8)), ("536870912 strings",)),
        (
            kv(
                "x.a", struct.pack("<IIQ", ARRAY, STRING, 3) + _str("ok") + struct.pack("<Q", 10**9)
            ),
            ("x.a'[1]",),
        ),
        (kv("", struct.pack("<IB", UINT8, 1)), ("key #2 is empty",)),
        (kv(b"\xff\xfe", struct.pack("<IB", UINT8, 1)), ("not valid UTF-8",)),
        (kv(b"a\x00b", struct.pack("<IB", UINT8, 1)), ("NUL",)),
        (
            kv("general.name", struct.pack("<IB", UINT8, 1)),
            ("duplicate metadata key 'general.name'",),
        ),
        (kv("k" * 70000, struct.pack("<IB", UINT8, 1)), ("length 70000", "65535")),
    ],
)
def test_bad_kv(tmp_path: Path, entry: tuple, fragments: tuple[str, ...]) -> None:
    kvs = DEFAULT_KVS[:2] + [entry] + DEFAULT_KVS[2:]
    msg = expect_error(write(tmp_path, build(kvs=kvs)), *fragments)
    assert len(msg) < 400


def test_long_keys_are_cut_in_messages(tmp_path: Path) -> None:
    long_key = "k" * 5000
    kvs = [(long_key, UINT8, 1), (long_key, UINT8, 2)]
    msg = expect_error(write(tmp_path, build(kvs=kvs, tensors=[])), "duplicate metadata key 'kkk")
    assert len(msg) < 300


def test_bad_kv_messages_show_limits_in_words(tmp_path: Path) -> None:
    # the array-length limit message names the limit
    kvs = [kv("x.a", struct.pack("<IIQ", ARRAY, UINT64, 2**31) + bytes(64))]
    expect_error(write(tmp_path, build(kvs=kvs)), "2147483648 elements", "limit is 1073741824")


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (48, "general.alignment is 48, not a power of two"),
        (0, "general.alignment is 0"),
        (3, "not a power of two"),
    ],
)
def test_bad_alignment(tmp_path: Path, value: int, fragment: str) -> None:
    expect_error(write(tmp_path, build(alignment=value)), fragment)


def test_alignment_must_be_uint32(tmp_path: Path) -> None:
    kvs = DEFAULT_KVS + [("general.alignment", UINT64, 32)]
    expect_error(
        write(tmp_path, build(kvs=kvs)), "general.alignment must be a uint32, it is a uint64"
    )
    kvs = DEFAULT_KVS + [("general.alignment", ARRAY, (UINT32, [32]))]
    expect_error(write(tmp_path, build(kvs=kvs), "b.gguf"), "it is a array")


T_A, T_B = DEFAULT_TENSORS


@pytest.mark.parametrize(
    ("tensors", "fragments"),
    [
        ([replace(T_A, gtype=99), T_B], ("tensor 'a.weight' has unknown ggml type 99",)),
        ([replace(T_A, gtype=31), T_B], ("ggml type 31 (Q4_0_4_4)", "no longer supports")),
        ([replace(T_A, gtype=2**31), T_B], ("unknown ggml type 2147483648",)),
        (
            [replace(T_A, n_dims=0, dims=()), T_B],
            ("tensor 'a.weight' has 0 dimensions, must be 1 to 4",),
        ),
        ([replace(T_A, dims=(1, 1, 1, 1, 8)), T_B], ("has 5 dimensions",)),
        ([replace(T_A, n_dims=2**32 - 1, dims=()), T_B], ("has 4294967295 dimensions",)),
        (
            [replace(T_A, dims=(8, 0)), T_B],
            ("tensor 'a.weight' has dimension 1 = 0, must be positive",),
        ),
        ([replace(T_A, dims=(-8, 4)), T_B], ("dimension 0 = -8",)),
        ([replace(T_A, dims=(2**62, 2, 2)), T_B], ("more than 2^63-1 elements",)),
        (
            [replace(T_A, dims=(33, 1), gtype=2), T_B],
            ("Q4_0", "33 elements per row", "block size 32"),
        ),
        (
            [T_A, replace(T_B, offset=130)],
            ("tensor 'b.bias' has data offset 130, not a multiple of the alignment 32",),
        ),
        ([T_A, replace(T_B, offset=160)], ("data offset 160, expected 128",)),
        ([T_A, replace(T_B, offset=0)], ("data offset 0, expected 128",)),
        ([replace(T_A, offset=2**63), T_B], ("data offset 9223372036854775808",)),
        ([T_A, replace(T_B, name="a.weight")], ("duplicate tensor name 'a.weight'",)),
        ([T_A, replace(T_B, name="")], ("tensor #1 has an empty name",)),
        ([T_A, replace(T_B, name="n" * 64)], ("64 bytes", "at most 63")),
        ([T_A, replace(T_B, name=b"\xc3(")], ("not valid UTF-8",)),
        ([T_A, replace(T_B, name=b"b\x00")], ("NUL",)),
        (
            [T_A, replace(T_B, dims=(2**40,))],
            ("truncated GGUF", "tensor 'b.bias' data ends at byte"),
        ),
    ],
)
def test_bad_tensor_info(tmp_path: Path, tensors: list[Tensor], fragments: tuple[str, ...]) -> None:
    expect_error(write(tmp_path, build(tensors=tensors)), *fragments)


def test_tensor_name_of_63_bytes_is_fine(tmp_path: Path) -> None:
    validate_gguf(write(tmp_path, build(tensors=[T_A, replace(T_B, name="n" * 63)])))


def test_truncated_tensor_data(tmp_path: Path) -> None:
    data = build()
    size = len(data) - 1
    msg = expect_error(write(tmp_path, data[:-1]), "truncated GGUF")
    assert f"tensor 'b.bias' data ends at byte {size + 1}, file has {size})" in msg


def test_truncated_everywhere(tmp_path: Path) -> None:
    """Every proper prefix of a valid file is rejected with a ModelError."""
    data = build(kvs=DEFAULT_KVS[:18])
    p = tmp_path / "cut.gguf"
    for n in range(len(data)):
        p.write_bytes(data[:n])
        with pytest.raises(ModelError):
            validate_gguf(p)


def test_truncated_header(tmp_path: Path) -> None:
    data = build()
    expect_error(
        write(tmp_path, data[:200]),
        "corrupt or truncated GGUF",
        "claims 20 metadata key/value pairs, more than the 176 bytes",
    )
    expect_error(
        write(tmp_path, data[:700], "z.gguf"),
        "corrupt or truncated GGUF",
        "run past the end of the file, which has 700 bytes",
    )
    expect_error(write(tmp_path, data[:3], "x.gguf"), "not a GGUF file", "only 3 bytes")
    expect_error(write(tmp_path, data[:10], "y.gguf"), "truncated GGUF", "header needs 24 bytes")


def test_data_section_start_beyond_eof(tmp_path: Path) -> None:
    data = build()
    start = validate_gguf(write(tmp_path, data)).tensor_data_offset
    # cut inside the padding between the tensor infos and the data
    expect_error(
        write(tmp_path, data[: start - 1], "cut.gguf"),
        "truncated GGUF",
        f"should start at byte {start}",
    )


# --------------------------------------------------------------------------------------------------
# Well-formed files with values that make llama.cpp abort (each seen to abort llama.cpp 0.3.36)


def tiny_model_kvs(extra: list | None = None, *, tokens: list[str] | None = None) -> list:
    """The metadata of a minimal llama-architecture model (no tensors)."""
    toks = ["a", "b", "c", "\u010a"] if tokens is None else tokens
    return [
        ("general.architecture", STRING, "llama"),
        ("llama.block_count", UINT32, 1),
        ("llama.context_length", UINT32, 64),
        ("llama.embedding_length", UINT32, 32),
        ("llama.feed_forward_length", UINT32, 64),
        ("llama.attention.head_count", UINT32, 4),
        ("llama.attention.layer_norm_rms_epsilon", FLOAT32, 1e-5),
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.pre", STRING, "default"),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, toks)),
        ("tokenizer.ggml.token_type", ARRAY, (INT32, [1] * len(toks))),
        ("tokenizer.ggml.merges", ARRAY, (STRING, ["a b"])),
    ] + (extra or [])


def _replaced(kvs: list, key: str, vtype: int, value: object) -> list:
    return [(k, vtype, value) if k == key else (k, t, v) for k, t, v in kvs]


_EXPERTS = [("llama.expert_count", UINT32, 8), ("llama.expert_used_count", UINT32, 2)]
ABORTING_HPARAMS = [
    ([("llama.block_count", UINT32, 0)], "llama.block_count is 0, llama.cpp needs 1 to 512"),
    ([("llama.block_count", UINT32, 513)], "block_count is 513"),
    ([("llama.block_count", UINT32, 2**32 - 1)], "block_count is 4294967295"),
    ([("llama.nextn_predict_layers", UINT32, 2)], "nextn_predict_layers is 2, more than"),
    (
        [("llama.expert_count", UINT32, 1025), ("llama.expert_used_count", UINT32, 2)],
        "expert_count is 1025, llama.cpp allows at most 1024",
    ),
    (
        [("llama.expert_count", UINT32, 4), ("llama.expert_used_count", UINT32, 5)],
        "expert_used_count is 5, more than llama.expert_count 4",
    ),
    (
        [("llama.expert_count", UINT32, 4), ("llama.expert_used_count", ARRAY, (UINT32, [5]))],
        "expert_used_count is 5",
    ),
    ([("llama.expert_used_count", UINT32, 2)], "more than llama.expert_count 0"),
    (
        [("llama.expert_count", UINT32, 4), ("llama.expert_used_count", UINT32, 0)],
        "expert_used_count is 0",
    ),
    (
        _EXPERTS + [("llama.expert_group_count", UINT32, 8)],
        "expert_group_count is 8, not less than",
    ),
    (
        _EXPERTS
        + [("llama.expert_group_count", UINT32, 3), ("llama.expert_group_used_count", UINT32, 1)],
        "not a multiple of llama.expert_group_count 3",
    ),
    (
        _EXPERTS + [("llama.expert_group_count", UINT32, 2)],
        "expert_group_used_count is 0, must be 1 to 1",
    ),
    (
        _EXPERTS
        + [("llama.expert_group_count", UINT32, 2), ("llama.expert_group_used_count", UINT32, 2)],
        "expert_group_used_count is 2",
    ),
    (
        [("llama.expert_group_count", UINT32, 1)],
        "expert_group_count is 1 in a model without experts",
    ),
    ([("llama.rope.scaling.type", STRING, "bogus")], "rope.scaling.type is 'bogus'"),
]
FINE_HPARAMS = [
    [("llama.block_count", UINT32, 512)],
    [("llama.expert_count", UINT32, 1024), ("llama.expert_used_count", UINT32, 2)],
    _EXPERTS
    + [("llama.expert_group_count", UINT32, 2), ("llama.expert_group_used_count", UINT32, 1)],
    [("llama.rope.scaling.type", STRING, "yarn")],
    [("llama.expert_count", STRING, "8")],  # the wrong type: llama.cpp refuses it cleanly
]


def _with_overrides(extra: list) -> list:
    kvs = tiny_model_kvs()
    keys = {k for k, _, _ in kvs}
    for k, t, v in extra:
        kvs = _replaced(kvs, k, t, v) if k in keys else kvs + [(k, t, v)]
    return kvs


@pytest.mark.parametrize(("extra", "fragment"), ABORTING_HPARAMS)
def test_aborting_hparams(tmp_path: Path, extra: list, fragment: str) -> None:
    expect_error(
        write(tmp_path, build(kvs=_with_overrides(extra), tensors=[])), "invalid GGUF", fragment
    )


@pytest.mark.parametrize("extra", FINE_HPARAMS)
def test_fine_hparams(tmp_path: Path, extra: list) -> None:
    validate_gguf(write(tmp_path, build(kvs=_with_overrides(extra), tensors=[])))


@pytest.mark.parametrize(
    ("value", "fragment"),
    [(float("nan"), "layer_norm_rms_epsilon is NaN"), (-1.0, "is -1.0, must not be negative")],
)
def test_bad_epsilon(tmp_path: Path, value: float, fragment: str) -> None:
    # llama.cpp loads these, then llama_decode never returns
    kvs = _with_overrides([("llama.attention.layer_norm_rms_epsilon", FLOAT32, value)])
    expect_error(write(tmp_path, build(kvs=kvs, tensors=[])), fragment)


@pytest.mark.parametrize("value", [0.0, float("inf")])
def test_odd_but_harmless_epsilon(tmp_path: Path, value: float) -> None:
    kvs = _with_overrides([("llama.attention.layer_norm_rms_epsilon", FLOAT32, value)])
    validate_gguf(write(tmp_path, build(kvs=kvs, tensors=[])))


def test_nan_hparam(tmp_path: Path) -> None:
    kvs = _with_overrides([("llama.rope.freq_base", FLOAT32, float("nan"))])
    expect_error(write(tmp_path, build(kvs=kvs, tensors=[])), "llama.rope.freq_base is NaN")


@pytest.mark.parametrize("model", ["none", "no_vocab"])
def test_no_vocabulary(tmp_path: Path, model: str) -> None:
    kvs = _replaced(tiny_model_kvs(), "tokenizer.ggml.model", STRING, model)
    expect_error(write(tmp_path, build(kvs=kvs, tensors=[])), f"tokenizer.ggml.model is '{model}'")


def test_repeated_token(tmp_path: Path) -> None:
    kvs = tiny_model_kvs(tokens=["a", "b", "c", "b", "d"])
    expect_error(
        write(tmp_path, build(kvs=kvs, tensors=[])),
        "tokenizer.ggml.tokens' holds b'b' twice (the second time at index 3)",
    )


def test_repeated_token_in_a_long_vocabulary(tmp_path: Path) -> None:
    toks = [f"t{i}" for i in range(5000)] + ["t17"]
    kvs = tiny_model_kvs(tokens=toks)
    expect_error(write(tmp_path, build(kvs=kvs, tensors=[])), "b't17' twice", "index 5000")
    toks[-1] = "x" * 10000 + "a"
    toks[-2] = "x" * 10000 + "a"
    kvs = tiny_model_kvs(tokens=toks)
    expect_error(write(tmp_path, build(kvs=kvs, tensors=[]), "b.gguf"), "a 10001-byte string twice")


def test_empty_tokens(tmp_path: Path) -> None:
    # llama.cpp renames an empty token to "[EMPTY_<i>]": empty tokens are fine...
    validate_gguf(write(tmp_path, build(kvs=tiny_model_kvs(tokens=["", "", "a"]), tensors=[])))
    # ...unless the new name is taken
    kvs = tiny_model_kvs(tokens=["[EMPTY_1]", "", "a"])
    expect_error(write(tmp_path, build(kvs=kvs, tensors=[]), "b.gguf"), "b'[EMPTY_1]' twice")


# --------------------------------------------------------------------------------------------------
# Not files


def test_empty_file(tmp_path: Path) -> None:
    expect_error(write(tmp_path, b""), "not a GGUF file", "empty")


def test_directory(tmp_path: Path) -> None:
    expect_error(tmp_path, "not a GGUF file", "is a directory")


def test_dev_null() -> None:
    if not os.path.exists("/dev/null"):
        pytest.skip("no /dev/null")
    expect_error(Path("/dev/null"), "not a regular file (character device)")


def test_fifo(tmp_path: Path) -> None:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    p = tmp_path / "pipe.gguf"
    os.mkfifo(p)
    expect_error(p, "not a regular file (FIFO)")  # and does not block opening it


def test_missing_file(tmp_path: Path) -> None:
    expect_error(tmp_path / "nope.gguf", "model file not found")


def test_accepts_str_path(tmp_path: Path) -> None:
    p = write(tmp_path, build())
    assert validate_gguf(str(p)).path == p


# --------------------------------------------------------------------------------------------------
# The real model


REAL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _real_candidates() -> Iterator[Path]:
    env = os.environ.get("SPECRUN_TEST_GGUF")
    if env:
        yield Path(env).expanduser()
        return
    try:
        from specrun.paths import models_dir

        yield models_dir() / "smollm2-135m-instruct-q4_1.gguf"
    except ImportError:
        pass
    yield Path.home() / ".cache" / "specrun" / "models" / "smollm2-135m-instruct-q4_1.gguf"
    yield Path("/tmp/specrun-test-models") / REAL_NAME


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    for p in _real_candidates():
        if p.is_file():
            return p
    pytest.skip(
        "no SmolLM2-135M GGUF: set SPECRUN_TEST_GGUF, run `make install`, or put "
        f"{REAL_NAME} in /tmp/specrun-test-models/"
    )


def test_real_model(real_gguf: Path) -> None:
    t0 = time.perf_counter()
    info = validate_gguf(real_gguf)
    elapsed = time.perf_counter() - t0
    assert info.architecture == "llama"
    assert info.version == 3
    assert "tokenizer.chat_template" in info.metadata
    assert isinstance(info.get("tokenizer.chat_template"), str)
    assert info.n_tensors > 100
    tokens = info.metadata["tokenizer.ggml.tokens"]
    assert (
        isinstance(tokens, OmittedValue)
        and tokens.type == "array[string]"
        and tokens.length > 40000
    )
    assert info.get("llama.block_count") == 30
    assert info.tensor_data_offset % info.alignment == 0
    assert info.file_size == real_gguf.stat().st_size
    assert elapsed < 2.0, f"validating took {elapsed:.2f}s"


def test_real_model_load_tokens(real_gguf: Path) -> None:
    info = validate_gguf(real_gguf, load_arrays=["tokenizer.ggml.tokens"])
    tokens = info.metadata["tokenizer.ggml.tokens"]
    assert (
        isinstance(tokens, tuple)
        and len(tokens) > 40000
        and all(isinstance(t, str) for t in tokens)
    )


def test_real_model_truncated(real_gguf: Path, tmp_path: Path) -> None:
    """A partial download: the header is whole, the data is cut (sparse copy, cheap)."""
    size = real_gguf.stat().st_size
    with real_gguf.open("rb") as f:
        head = f.read(4 << 20)
    p = tmp_path / "partial.gguf"
    with p.open("wb") as f:
        f.write(head)
        f.truncate(size // 2)
    expect_error(p, "truncated GGUF", "data ends at byte", f"file has {size // 2})")


# --------------------------------------------------------------------------------------------------
# Fuzzing: validate_gguf returns or raises ModelError, in bounded time and memory


_FUZZ = int(os.environ.get("SPECRUN_FUZZ_EXAMPLES", "0") or 0)


def fuzz_settings(default: int) -> settings:
    return settings(
        max_examples=_FUZZ or default,
        deadline=timedelta(seconds=10),
        derandomize=True,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
            HealthCheck.data_too_large,
        ],
    )


MAX_SECONDS = 5.0
MAX_PEAK_BYTES = 24 << 20


def check_total(path: Path, *, trace_memory: bool = True) -> None:
    t0 = time.perf_counter()
    if trace_memory:
        tracemalloc.start()
    try:
        validate_gguf(path)
    except ModelError as e:
        msg = str(e)
        assert str(path) in msg and "\n" not in msg, msg
    finally:
        if trace_memory:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak < MAX_PEAK_BYTES, f"validate_gguf peaked at {peak} bytes"
    elapsed = time.perf_counter() - t0
    assert elapsed < MAX_SECONDS, f"validate_gguf took {elapsed:.1f}s"


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


VALID = build()
INTERESTING = [
    0,
    1,
    2,
    3,
    4,
    5,
    8,
    9,
    12,
    13,
    31,
    32,
    63,
    64,
    255,
    256,
    2**16 - 1,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
]


@fuzz_settings(300)
@given(
    data=st.one_of(
        st.binary(max_size=256),
        st.binary(max_size=256).map(lambda b: b"GGUF" + b),
        st.binary(max_size=256).map(lambda b: b"GGUF\x03\x00\x00\x00" + b),
        st.binary(max_size=64).map(
            lambda b: b"GGUF\x03\x00\x00\x00\x01" + bytes(7) + b"\x02" + bytes(7) + b
        ),
    )
)
def test_fuzz_random_bytes(fuzz_dir: Path, data: bytes) -> None:
    p = fuzz_dir / "random.gguf"
    p.write_bytes(data)
    check_total(p)


@fuzz_settings(400)
@given(
    flips=st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=4),
    words=st.lists(
        st.tuples(
            st.integers(0, len(VALID) - 1), st.sampled_from(INTERESTING), st.sampled_from([4, 8])
        ),
        max_size=2,
    ),
    cut=st.one_of(st.none(), st.integers(0, len(VALID))),
)
def test_fuzz_synthetic_mutations(
    fuzz_dir: Path, flips: list, words: list, cut: int | None
) -> None:
    data = bytearray(VALID)
    for pos, b in flips:
        data[pos] = b
    for pos, value, width in words:
        data[pos : pos + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
    if cut is not None:
        del data[cut:]
    p = fuzz_dir / "mutant.gguf"
    p.write_bytes(bytes(data))
    check_total(p)


# --- real file: a sparse copy (real header, zero data) mutated in place ---


@dataclass
class RealCopy:
    path: Path
    head: bytes  # the original header region
    size: int
    data_offset: int
    kv_end: int  # the end of the scalar KVs before the tokenizer arrays (approximate)
    infos_start: int


@pytest.fixture(scope="module")
def real_copy(real_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> RealCopy:
    info = validate_gguf(real_gguf)
    with real_gguf.open("rb") as f:
        head = f.read(min(info.tensor_data_offset, 4 << 20))
    kvs, tensors, _ = gguf_layout(head)
    p = tmp_path_factory.mktemp("realfuzz") / "real.gguf"
    with p.open("wb") as f:
        f.write(head)
        f.truncate(info.file_size)
    first_array = min(off for _, t, off, _ in kvs if t == ARRAY)
    return RealCopy(
        p, head, info.file_size, info.tensor_data_offset, first_array, tensors[0][1] - 40
    )


@fuzz_settings(300)
@given(data=st.data())
def test_fuzz_real_header(real_copy: RealCopy, data: st.DataObject) -> None:
    rc = real_copy
    region = data.draw(
        st.sampled_from([(0, rc.kv_end), (rc.infos_start, rc.data_offset), (0, rc.data_offset)])
    )
    pos_st = st.integers(region[0], region[1] - 1)
    flips = data.draw(st.lists(st.tuples(pos_st, st.integers(0, 255)), max_size=3))
    words = data.draw(st.lists(st.tuples(pos_st, st.sampled_from(INTERESTING)), max_size=1))
    cut = data.draw(st.one_of(st.none(), st.integers(0, rc.size)))
    patches = [(pos, bytes([b])) for pos, b in flips]
    patches += [(pos, v.to_bytes(8, "little")) for pos, v in words]
    with rc.path.open("r+b") as f:
        for pos, b in patches:
            f.seek(pos)
            f.write(b)
        if cut is not None:
            f.truncate(cut)
    try:
        check_total(rc.path, trace_memory=False)
    finally:
        with rc.path.open("r+b") as f:
            f.seek(0)
            f.write(rc.head)
            f.truncate(rc.size)


# --------------------------------------------------------------------------------------------------
# Does llama.cpp survive the files the validator accepts?


def gguf_layout(
    buf: bytes,
) -> tuple[list[tuple[str, int, int, int]], list[tuple[str, int, int]], int]:
    """Walk a valid GGUF header: KVs as (key, type, value offset, value size), tensor infos as
    (name, offset of n_dims, n_dims), and the end of the tensor infos."""
    sizes = {
        UINT8: 1,
        INT8: 1,
        UINT16: 2,
        INT16: 2,
        UINT32: 4,
        INT32: 4,
        FLOAT32: 4,
        BOOL: 1,
        UINT64: 8,
        INT64: 8,
        FLOAT64: 8,
    }
    n_t, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos = 24

    def string(pos: int) -> tuple[bytes, int]:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return buf[pos + 8 : pos + 8 + n], pos + 8 + n

    kvs, tensors = [], []
    for _ in range(n_kv):
        key, pos = string(pos)
        (t,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        start = pos
        if t in sizes:
            pos += sizes[t]
        elif t == STRING:
            _, pos = string(pos)
        else:
            et, n = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if et == STRING:
                for _ in range(n):
                    _, pos = string(pos)
            else:
                pos += n * sizes[et]
        kvs.append((key.decode(), t, start, pos - start))
    for _ in range(n_t):
        name, pos = string(pos)
        (nd,) = struct.unpack_from("<I", buf, pos)
        tensors.append((name.decode(), pos, nd))
        pos += 4 + 8 * nd + 4 + 8
    return kvs, tensors, pos


def llama_mutations(
    head: bytes, rng: random.Random
) -> Iterator[tuple[str, list[tuple[int, bytes]]]]:
    """An endless, varied stream of (label, patches) for the real model's header."""
    kvs, tensors, end = gguf_layout(head)
    by_key = {k: (t, off, size) for k, t, off, size in kvs}
    scalars = [(k, t, off) for k, t, off, _ in kvs if t in (UINT32, INT32, FLOAT32)]
    while True:
        kind = rng.randrange(7)
        if kind == 0:  # a numeric hyperparameter set to an edge value
            k, t, off = rng.choice(scalars)
            if t == FLOAT32:
                v = rng.choice([0.0, -1.0, float("nan"), float("inf"), 1e30])
                yield f"{k}={v}", [(off, struct.pack("<f", v))]
            else:
                v = rng.choice([0, 1, 2, 7, 511, 513, 2**31 - 1, 2**32 - 1, 49152, 100000])
                yield f"{k}={v}", [(off, struct.pack("<I", v))]
        elif kind == 1 and "tokenizer.ggml.tokens" in by_key:  # a byte in a token
            _, off, size = by_key["tokenizer.ggml.tokens"]
            pos, b = rng.randrange(off + 12, off + size), rng.randrange(256)
            yield f"tokens byte@{pos}={b}", [(pos, bytes([b]))]
        elif kind == 2 and "tokenizer.ggml.merges" in by_key:  # a byte in a merge rule
            _, off, size = by_key["tokenizer.ggml.merges"]
            pos, b = (
                rng.randrange(off + 12, off + size),
                rng.choice([0x20, 0, 0xFF, rng.randrange(256)]),
            )
            yield f"merges byte@{pos}={b}", [(pos, bytes([b]))]
        elif kind == 3 and "tokenizer.ggml.token_type" in by_key:  # a token type
            _, off, size = by_key["tokenizer.ggml.token_type"]
            i = rng.randrange((size - 12) // 4)
            v = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, -1, 2**30])
            yield f"token_type[{i}]={v}", [(off + 12 + 4 * i, struct.pack("<i", v))]
        elif kind == 4:  # a tensor's shape
            name, off, nd = rng.choice(tensors)
            dims = struct.unpack_from(f"<{nd}q", head, off + 4)
            if nd == 2 and rng.random() < 0.5:
                yield f"{name} dims swapped", [(off + 4, struct.pack("<2q", dims[1], dims[0]))]
            else:
                j = rng.randrange(nd)
                v = rng.choice([1, 2, 32, dims[j] * 2])
                yield f"{name} ne[{j}]={v}", [(off + 4 + 8 * j, struct.pack("<q", v))]
        elif kind == 5:  # a tensor's type
            name, off, nd = rng.choice(tensors)
            v = rng.choice(sorted(GGML_TYPES))
            yield f"{name} type={v}", [(off + 4 + 8 * nd, struct.pack("<I", v))]
        else:  # any byte in the scalar KVs or in the tensor infos
            lo, hi = rng.choice(
                [(24, min(off for _, t, off, _ in kvs if t == ARRAY)), (tensors[0][1] - 40, end)]
            )
            pos, b = rng.randrange(lo, hi), rng.randrange(256)
            yield f"byte@{pos}={b}", [(pos, bytes([b]))]


_CHILD = r"""
import sys, llama_cpp as L
L.llama_backend_init()
p = L.llama_model_default_params()
p.vocab_only = sys.argv[2] == "vocab"
m = L.llama_model_load_from_file(sys.argv[1].encode(), p)
if not m:
    sys.exit(3)
vocab = L.llama_model_get_vocab(m)
buf = (L.llama_token * 64)()
L.llama_tokenize(vocab, b"Hello world, <|im_start|>user", 29, buf, 64, True, True)
L.llama_model_free(m)
"""


def _has_llama_cpp() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def load_in_child(
    path: Path, mode: str = "full", timeout: float = 120
) -> subprocess.CompletedProcess:
    """Load `path` with llama.cpp in a child process (a crash must not take pytest down)."""
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), mode],
        capture_output=True,
        timeout=timeout,
        check=False,
    )


def _crash_line(stderr: bytes) -> str:
    lines = stderr.decode(errors="replace").splitlines()
    keep = [
        ln
        for ln in lines
        if any(w in ln for w in ("GGML_ASSERT", "GGML_ABORT", "terminate", "what()"))
    ]
    return " | ".join(keep[:3])[:300]


@pytest.mark.slow
@pytest.mark.skipif(not _has_llama_cpp(), reason="llama_cpp not importable")
def test_llama_cpp_survives_accepted_mutants(real_gguf: Path, tmp_path: Path) -> None:
    n_wanted = int(os.environ.get("SPECRUN_LLAMA_MUTANTS", "30"))
    copy = tmp_path / "mutant.gguf"
    shutil.copyfile(real_gguf, copy)
    head = copy.read_bytes()[: validate_gguf(copy).tensor_data_offset]
    assert load_in_child(copy).returncode == 0, "the unmodified model does not load"

    rng = random.Random(20240611)
    crashes, tried, loaded, refused = [], 0, 0, 0
    for label, patches in llama_mutations(head, rng):
        if tried >= n_wanted:
            break
        with copy.open("r+b") as f:
            for pos, b in patches:
                f.seek(pos)
                f.write(b)
        try:
            try:
                validate_gguf(copy)
            except ModelError:
                continue
            tried += 1
            try:
                proc = load_in_child(copy)
            except subprocess.TimeoutExpired:
                crashes.append(f"{label}: hang")
                continue
            if proc.returncode < 0:
                crashes.append(f"{label}: signal {-proc.returncode} {_crash_line(proc.stderr)}")
            elif proc.returncode == 0:
                loaded += 1
            else:
                refused += 1
        finally:
            with copy.open("r+b") as f:
                for pos, b in patches:
                    f.seek(pos)
                    f.write(head[pos : pos + len(b)])
    print(
        f"{tried} accepted mutants: {loaded} loaded, {refused} refused cleanly, {len(crashes)} crashed"
    )
    assert not crashes, "llama.cpp crashed on files validate_gguf accepted:\n" + "\n".join(crashes)


@pytest.mark.slow
@pytest.mark.skipif(not _has_llama_cpp(), reason="llama_cpp not importable")
@pytest.mark.parametrize("extra", [[], *FINE_HPARAMS])
def test_llama_cpp_survives_accepted_hparams(tmp_path: Path, extra: list) -> None:
    """The values next to the rejected ones: validate_gguf accepts them and llama.cpp refuses
    this tensor-less model cleanly (it has no weights) instead of aborting."""
    p = write(tmp_path, build(kvs=_with_overrides(extra), tensors=[]))
    validate_gguf(p)
    proc = load_in_child(p, timeout=60)
    assert proc.returncode >= 0, _crash_line(proc.stderr)
