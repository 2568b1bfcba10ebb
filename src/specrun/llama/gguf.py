"""A pure-Python GGUF pre-validator.

llama.cpp aborts or crashes on some malformed GGUF files. :func:`validate_gguf` reads only the
header, the metadata key/value pairs and the tensor infos, checks them against the GGUF spec and
against the rules llama.cpp's own loader enforces (``gguf_init_from_reader`` in ggml's
``gguf.cpp``, and ``llama-model-loader.cpp``), and raises :class:`~specrun.errors.ModelError`
with a one-line message naming the file and the problem.

Layout (all little-endian)::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv  x  { string key | u32 value_type | value }
    n_tensors x { string name | u32 n_dims | n_dims x i64 ne | u32 ggml_type | u64 offset }
    padding to `general.alignment` (default 32) | tensor data

    string = u64 length + bytes;  array value = u32 element_type + u64 count + elements

Design rules: never allocate based on a count read from the file before checking it against the
bytes left in the file; read with a bounded buffer (so a 500 MB model costs a few MB of reads);
skip the long tokenizer arrays without building Python objects for their elements.
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import struct
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from specrun.errors import ModelError

__all__ = [
    "GGML_TYPES",
    "GGUFInfo",
    "OmittedValue",
    "validate_gguf",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"

# Limits. The first three are llama.cpp's (GGML_MAX_NAME, GGML_MAX_DIMS, GGUF_MAX_* in gguf.cpp);
# the key length is the spec's ("at most 2^16-1 bytes").
MAX_TENSOR_NAME = 63  # GGML_MAX_NAME is 64 including the terminating NUL
MAX_DIMS = 4
MAX_STRING_LENGTH = 1 << 30
MAX_ARRAY_ELEMENTS = 1 << 30
MAX_KEY_LENGTH = (1 << 16) - 1
INT64_MAX = (1 << 63) - 1

# What goes into GGUFInfo.metadata: arrays up to this many elements and strings up to this many
# bytes are stored; longer ones are summarised by an OmittedValue unless asked for.
SHORT_ARRAY = 128
MAX_STORED_STRING = 1 << 20

_CHUNK = 1 << 20  # read size of the header buffer

TOKENS_KEY = "tokenizer.ggml.tokens"
# Vocabularies up to this size are checked for repeated tokens (real ones have < 300k tokens).
MAX_UNIQUE_CHECK = 1 << 23
_MAX_HELD_TOKEN = 4096  # longer tokens are compared by digest

# Limits of the llama.cpp that specrun ships (llama-cpp-python 0.3.36); load_hparams()
# GGML_ASSERTs on them, which aborts the process.
LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
NO_VOCAB_MODELS = ("none", "no_vocab")

# --- GGUF metadata value types (gguf.h: enum gguf_type) -------------------------------------------

T_BOOL = 7
T_STRING = 8
T_ARRAY = 9

# type id -> (name, struct format char, size in bytes)
_SCALAR_TYPES: dict[int, tuple[str, str, int]] = {
    0: ("uint8", "B", 1),
    1: ("int8", "b", 1),
    2: ("uint16", "H", 2),
    3: ("int16", "h", 2),
    4: ("uint32", "I", 4),
    5: ("int32", "i", 4),
    6: ("float32", "f", 4),
    T_BOOL: ("bool", "B", 1),
    10: ("uint64", "Q", 8),
    11: ("int64", "q", 8),
    12: ("float64", "d", 8),
}
_SCALAR_STRUCTS = {t: struct.Struct("<" + fmt) for t, (_, fmt, _) in _SCALAR_TYPES.items()}
_TYPE_NAMES = {t: name for t, (name, _, _) in _SCALAR_TYPES.items()} | {
    T_STRING: "string",
    T_ARRAY: "array",
}
T_UINT32 = 4

# --- ggml tensor types: id -> (name, block size in elements, block size in bytes) -----------------
# From ggml/include/ggml.h (enum ggml_type) and the type_traits table in ggml/src/ggml.c
# (sizes of the block_* structs in ggml-common.h), as vendored by llama-cpp-python 0.3.36.
# tests/test_gguf_types.py compares it with the bundled ggml itself (ggml_type_name, ggml_blck_size,
# ggml_type_size for every id below GGML_TYPE_COUNT), so a new llama-cpp-python cannot slip past.
_QK_K = 256
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 2 + 16),
    3: ("Q4_1", 32, 2 + 2 + 16),
    6: ("Q5_0", 32, 2 + 4 + 16),
    7: ("Q5_1", 32, 2 + 2 + 4 + 16),
    8: ("Q8_0", 32, 2 + 32),
    9: ("Q8_1", 32, 2 + 2 + 32),
    10: ("Q2_K", _QK_K, 2 + 2 + _QK_K // 16 + _QK_K // 4),
    11: ("Q3_K", _QK_K, 2 + _QK_K // 4 + _QK_K // 8 + 12),
    12: ("Q4_K", _QK_K, 2 + 2 + _QK_K // 2 + 12),
    13: ("Q5_K", _QK_K, 2 + 2 + _QK_K // 2 + _QK_K // 8 + 12),
    14: ("Q6_K", _QK_K, 2 + _QK_K // 2 + _QK_K // 4 + _QK_K // 16),
    15: ("Q8_K", _QK_K, 4 + _QK_K + _QK_K // 8),
    16: ("IQ2_XXS", _QK_K, 2 + _QK_K // 4),
    17: ("IQ2_XS", _QK_K, 2 + _QK_K // 4 + _QK_K // 32),
    18: ("IQ3_XXS", _QK_K, 2 + _QK_K // 4 + _QK_K // 8),
    19: ("IQ1_S", _QK_K, 2 + _QK_K // 8 + _QK_K // 16),
    20: ("IQ4_NL", 32, 2 + 16),
    21: ("IQ3_S", _QK_K, 2 + _QK_K // 4 + _QK_K // 8 + _QK_K // 32 + 4),
    22: ("IQ2_S", _QK_K, 2 + _QK_K // 4 + _QK_K // 16),
    23: ("IQ4_XS", _QK_K, 2 + 2 + _QK_K // 2 + _QK_K // 64),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", _QK_K, _QK_K // 8 + _QK_K // 16 + _QK_K // 32),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", _QK_K, 2 + 4 * 13),
    35: ("TQ2_0", _QK_K, 2 + 64),
    39: ("MXFP4", 32, 1 + 16),
    40: ("NVFP4", 64, 4 + 32),
    41: ("Q1_0", 128, 2 + 16),
    42: ("Q2_0", 64, 2 + 16),
}


def matrix_bytes(tname: str, rows: int, cols: int, extra_per_block: int = 0) -> int:
    """The bytes of a ``rows`` x ``cols`` matrix of a ggml type (``extra_per_block``: what a
    repacked layout adds to each block)."""
    blck, tsize = next((b, t) for n, b, t in GGML_TYPES.values() if n == tname)
    return rows * (cols // blck) * (tsize + extra_per_block)


# Ids that once existed and that llama.cpp no longer loads from files (blck_size 0 in ggml.c).
_REMOVED_GGML_TYPES = {
    4: "Q4_2",
    5: "Q4_3",
    31: "Q4_0_4_4",
    32: "Q4_0_4_8",
    33: "Q4_0_8_8",
    36: "IQ4_NL_4_4",
    37: "IQ4_NL_4_8",
    38: "IQ4_NL_8_8",
}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")
_DIMS = {n: struct.Struct(f"<{n}q") for n in range(1, MAX_DIMS + 1)}


@dataclass(frozen=True)
class OmittedValue:
    """Stands in GGUFInfo.metadata for a value too long to keep (a tokenizer array, say).

    ``type`` is the GGUF type name: ``"string"`` for a long string (``length`` in bytes), or
    ``"array[<element type>]"`` for an array (``length`` in elements).
    """

    type: str
    length: int


@dataclass(frozen=True)
class GGUFInfo:
    """What validate_gguf learnt about a file that passed."""

    path: Path
    version: int
    n_tensors: int
    n_kv: int
    # Scalars and short arrays (as tuples); long arrays and huge strings as OmittedValue.
    metadata: dict[str, object] = field(hash=False)
    architecture: str | None  # general.architecture
    name: str | None  # general.name
    alignment: int
    # Absolute file offset of the tensor data section; -1 when check_tensors=False.
    tensor_data_offset: int
    file_size: int
    # Bytes of the repeating layers' matrices (blk.*, 2-D) per ggml type name (with check_tensors).
    layer_bytes_by_type: dict[str, int] = field(default_factory=dict, hash=False)
    # The repeating layers' matrices: (name, ggml type name, rows, columns), in file order.
    layer_matrices: list[tuple[str, str, int, int]] = field(default_factory=list, hash=False)
    # The output projection's matrix (output.weight, else the tied token_embd.weight): (ggml type
    # name, rows, columns); None without check_tensors or without either tensor.
    output_matrix: tuple[str, int, int] | None = field(default=None, hash=False)

    def get(self, key: str, default: object = None) -> object:
        return self.metadata.get(key, default)


# --------------------------------------------------------------------------------------------------


def _pad(x: int, n: int) -> int:
    return ((x + n - 1) // n) * n


def _short(b: bytes, limit: int = 40) -> str:
    return repr(b[:limit]) + ("..." if len(b) > limit else "")


def _q(key: str, limit: int = 80) -> str:
    """A key for an error message: quoted, and cut if long."""
    return repr(key) if len(key) <= limit else repr(key[:limit]) + "..."


class _Reader:
    """Sequential reads over a bounded window of the file; every read is bound-checked first."""

    def __init__(self, f: BinaryIO, path: Path, size: int) -> None:
        self.f = f
        self.path = path
        self.size = size
        self.buf = b""
        self.base = 0  # file offset of buf[0]
        self.pos = 0  # current file offset

    # errors
    def corrupt(self, what: str) -> ModelError:
        return ModelError(f"invalid GGUF: {self.path} ({what})")

    def past_eof(self, what: str, n: int) -> ModelError:
        return ModelError(
            f"corrupt or truncated GGUF: {self.path} ({what}: {n} bytes at offset {self.pos} "
            f"run past the end of the file, which has {self.size} bytes)"
        )

    def too_many(self, what: str, left: int, where: str) -> ModelError:
        return ModelError(
            f"corrupt or truncated GGUF: {self.path} (the header claims {what}, more than the "
            f"{left} bytes left {where} can hold)"
        )

    # reading
    def require(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.past_eof(what, n)

    def _fill(self, n: int) -> int:
        """Make n bytes at self.pos available in self.buf; return their index in buf.

        The caller has checked that n bytes are left in the file.
        """
        off = self.pos - self.base
        if 0 <= off and off + n <= len(self.buf):
            return off
        want = min(max(n, _CHUNK), self.size - self.pos)
        try:
            self.f.seek(self.pos)
            data = self.f.read(want)
        except OSError as e:
            raise ModelError(f"cannot read GGUF file: {self.path} ({e.strerror or e})") from e
        if len(data) < n:
            raise ModelError(
                f"truncated GGUF: {self.path} (unexpected end of file at byte "
                f"{self.pos + len(data)}; did the file change while being read?)"
            )
        self.buf = data
        self.base = self.pos
        return 0

    def take(self, n: int, what: str) -> bytes:
        self.require(n, what)
        off = self._fill(n)
        self.pos += n
        return self.buf[off : off + n]

    def unpack(self, st: struct.Struct, what: str) -> tuple[Any, ...]:
        self.require(st.size, what)
        off = self._fill(st.size)
        self.pos += st.size
        return st.unpack_from(self.buf, off)

    def u32(self, what: str) -> int:
        return int(self.unpack(_U32, what)[0])

    def u64(self, what: str) -> int:
        return int(self.unpack(_U64, what)[0])

    def skip(self, n: int, what: str) -> None:
        self.require(n, what)
        self.pos += n

    def _digest(self, n: int) -> bytes:
        """sha256 of the n bytes at self.pos (read in chunks); self.pos is left unchanged."""
        h = hashlib.sha256()
        start = self.pos
        try:
            while n:
                k = min(n, _CHUNK)
                off = self._fill(k)
                h.update(self.buf[off : off + k])
                self.pos += k
                n -= k
        finally:
            self.pos = start
        return h.digest()

    def string_length(self, what: str, limit: int = MAX_STRING_LENGTH) -> int:
        n = self.u64(f"length of {what}")
        if n > limit:
            raise self.corrupt(f"{what} has length {n}, the limit is {limit}")
        self.require(n, what)
        return n

    def skip_string_array(self, n: int, what: str, *, unique: bool = False) -> None:
        """Skip n length-prefixed strings, bound-checking each length.

        Builds no Python objects, unless `unique`: then each string is put in a set, and a
        repeated one is an error (llama.cpp aborts on a vocabulary with a repeated token, and
        stores an empty token as "[EMPTY_<index>]").
        """
        size = self.size
        unpack_from = _U64.unpack_from
        pos = self.pos
        seen: set[bytes | tuple[int, bytes]] = set()
        for i in range(n):
            if pos + 8 > size:
                self.pos = pos
                raise self.past_eof(f"length of {what}[{i}]", 8)
            off = pos - self.base
            if off < 0 or off + 8 > len(self.buf):
                self.pos = pos
                off = self._fill(8)
            (ln,) = unpack_from(self.buf, off)
            pos += 8
            if ln > size - pos:
                self.pos = pos
                raise self.past_eof(f"{what}[{i}] (string)", ln)
            if unique:
                self.pos = pos
                s: bytes | tuple[int, bytes]
                if ln == 0:
                    s = b"[EMPTY_%d]" % i
                elif ln <= _MAX_HELD_TOKEN:
                    off = self._fill(ln)
                    s = self.buf[off : off + ln]
                else:  # a huge "token": keep a digest, never the whole string
                    s = (ln, self._digest(ln))
                if s in seen:
                    shown = _short(s) if isinstance(s, bytes) else f"a {ln}-byte string"
                    raise self.corrupt(
                        f"{what} holds {shown} twice (the second time at index {i}); "
                        "llama.cpp aborts on a vocabulary with repeated tokens"
                    )
                seen.add(s)
            pos += ln
        self.pos = pos


def _read_string_value(r: _Reader, what: str) -> object:
    n = r.string_length(what)
    if n > MAX_STORED_STRING:
        r.skip(n, what)
        return OmittedValue("string", n)
    return r.take(n, what).decode("utf-8", errors="replace")


def _read_value(r: _Reader, key: str, vtype: int, load_full: bool) -> object:
    what = f"value of key {_q(key)}"
    if vtype in _SCALAR_STRUCTS:
        (v,) = r.unpack(_SCALAR_STRUCTS[vtype], what)
        return bool(v) if vtype == T_BOOL else v
    if vtype == T_STRING:
        return _read_string_value(r, what)
    if vtype != T_ARRAY:
        raise r.corrupt(f"key {_q(key)} has unknown value type {vtype}")

    etype = r.u32(f"element type of {what}")
    n = r.u64(f"length of {what}")
    if etype == T_ARRAY:
        raise r.corrupt(f"key {_q(key)} is an array of arrays, which llama.cpp cannot load")
    if etype not in _TYPE_NAMES:
        raise r.corrupt(f"key {_q(key)} is an array of unknown value type {etype}")
    if n > MAX_ARRAY_ELEMENTS:
        raise r.corrupt(
            f"key {_q(key)} is an array of {n} elements, the limit is {MAX_ARRAY_ELEMENTS}"
        )
    tname = _TYPE_NAMES[etype]
    keep = load_full or n <= SHORT_ARRAY

    if etype == T_STRING:
        # each element takes at least its 8-byte length: reject absurd counts before looping
        r.require(n * 8, f"{what} ({n} strings)")
        if key == TOKENS_KEY and n <= MAX_UNIQUE_CHECK:
            start = r.pos
            r.skip_string_array(n, what, unique=True)
            if not keep:
                return OmittedValue(f"array[{tname}]", n)
            r.pos = start
        elif not keep:
            r.skip_string_array(n, what)
            return OmittedValue(f"array[{tname}]", n)
        return tuple(_read_string_value(r, f"{what}[{i}]") for i in range(n))

    _, fmt, size = _SCALAR_TYPES[etype]
    nbytes = n * size
    if not keep:
        r.skip(nbytes, f"{what} ({n} x {tname})")
        return OmittedValue(f"array[{tname}]", n)
    data = r.take(nbytes, f"{what} ({n} x {tname})")
    values = struct.unpack(f"<{n}{fmt}", data)
    if etype == T_BOOL:
        return tuple(bool(v) for v in values)
    return values


def _uint(value: object) -> int | None:
    """The value as llama.cpp's get_key<uint32_t> sees it, or None where it would refuse it."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32:
        return value
    return None


def _check_llama_hparams(r: _Reader, metadata: dict[str, object]) -> None:
    """Hyperparameter values that make llama.cpp abort (GGML_ASSERT) rather than fail cleanly.

    Only values of the type llama.cpp reads are checked: a key of another type makes llama.cpp
    throw a clean "wrong type" error. Each rule below was seen to abort llama.cpp.
    """
    tok_model = metadata.get("tokenizer.ggml.model")
    if isinstance(tok_model, str) and tok_model in NO_VOCAB_MODELS:
        raise r.corrupt(
            f"tokenizer.ggml.model is {tok_model!r}: the model has no vocabulary, and llama.cpp "
            "aborts when asked to tokenize"
        )

    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        return
    a = arch + "."

    for key, value in metadata.items():
        if key.startswith(a) and isinstance(value, float):
            if math.isnan(value):
                raise r.corrupt(f"{key} is NaN")
            if key.endswith("epsilon") and value < 0:
                raise r.corrupt(f"{key} is {value}, must not be negative")

    scaling = metadata.get(a + "rope.scaling.type")
    if isinstance(scaling, str) and scaling not in ROPE_SCALING_TYPES:
        raise r.corrupt(
            f"{a}rope.scaling.type is {scaling!r}, llama.cpp knows {', '.join(ROPE_SCALING_TYPES)}"
        )

    n_layer = _uint(metadata.get(a + "block_count"))
    if n_layer is not None and not 1 <= n_layer <= LLAMA_MAX_LAYERS:
        raise r.corrupt(f"{a}block_count is {n_layer}, llama.cpp needs 1 to {LLAMA_MAX_LAYERS}")
    nextn = _uint(metadata.get(a + "nextn_predict_layers"))
    if nextn is not None and n_layer is not None and nextn > n_layer:
        raise r.corrupt(f"{a}nextn_predict_layers is {nextn}, more than {a}block_count {n_layer}")

    n_expert = _uint(metadata.get(a + "expert_count"))
    if n_expert is None and a + "expert_count" in metadata:
        return  # llama.cpp refuses the type cleanly
    n_expert = n_expert or 0
    used_value = metadata.get(a + "expert_used_count")
    used_values = used_value if isinstance(used_value, tuple) else (used_value,)
    used = [u for u in map(_uint, used_values) if u is not None]
    n_used = max(used, default=0)
    n_groups = _uint(metadata.get(a + "expert_group_count")) or 0
    n_group_used = _uint(metadata.get(a + "expert_group_used_count")) or 0
    problem = None
    if n_expert > LLAMA_MAX_EXPERTS:
        problem = f"{a}expert_count is {n_expert}, llama.cpp allows at most {LLAMA_MAX_EXPERTS}"
    elif n_used > n_expert:
        problem = f"{a}expert_used_count is {n_used}, more than {a}expert_count {n_expert}"
    elif n_expert > 0:
        if n_used == 0:
            problem = f"{a}expert_used_count is 0 (or missing) with {n_expert} experts"
        elif n_groups >= n_expert:
            problem = (
                f"{a}expert_group_count is {n_groups}, not less than {a}expert_count {n_expert}"
            )
        elif n_groups > 1 and n_expert % n_groups:
            problem = (
                f"{a}expert_count {n_expert} is not a multiple of {a}expert_group_count {n_groups}"
            )
        elif n_groups > 1 and not 0 < n_group_used < n_groups:
            problem = (
                f"{a}expert_group_used_count is {n_group_used}, must be 1 to {n_groups - 1} "
                f"with {n_groups} expert groups"
            )
    elif n_groups:
        problem = f"{a}expert_group_count is {n_groups} in a model without experts"
    if problem:
        raise r.corrupt(problem)


def _open_checked(path: Path) -> tuple[BinaryIO, int]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelError(f"model file not found: {path}") from None
    except OSError as e:
        raise ModelError(f"cannot access model file: {path} ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelError(f"not a GGUF file: {path} is a directory")
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "character device"
            if stat.S_ISCHR(st.st_mode)
            else "block device"
            if stat.S_ISBLK(st.st_mode)
            else "FIFO"
            if stat.S_ISFIFO(st.st_mode)
            else "socket"
            if stat.S_ISSOCK(st.st_mode)
            else "special file"
        )
        raise ModelError(f"not a GGUF file: {path} is not a regular file ({kind})")
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the caller
    except OSError as e:
        raise ModelError(f"cannot open model file: {path} ({e.strerror or e})") from None
    try:
        size = os.fstat(f.fileno()).st_size
    except OSError as e:
        f.close()
        raise ModelError(f"cannot access model file: {path} ({e.strerror or e})") from None
    return f, size


def _bad_magic(path: Path, magic: bytes) -> ModelError:
    hint = ""
    if magic in (b"lmgg", b"fmgg", b"tjgg"):  # 'ggml', 'ggmf', 'ggjt' as little-endian u32
        hint = "; this is a legacy GGML/GGMF/GGJT model, convert it to GGUF"
    elif magic.startswith(b"PK"):
        hint = "; looks like a zip archive"
    elif magic.lower().startswith((b"<!do", b"<htm", b"<?xm")):
        hint = "; looks like an HTML/XML page, was the download redirected?"
    elif magic == b"vers":
        hint = "; looks like a Git LFS pointer file, not the model itself"
    elif magic[:1] == b"{" or magic[:2] == b"\x1f\x8b":
        hint = "; looks like JSON or gzip data"
    return ModelError(f"not a GGUF file: {path} (bad magic {magic!r}{hint})")


def validate_gguf(
    path: str | os.PathLike[str],
    *,
    check_tensors: bool = True,
    load_arrays: bool | Collection[str] = (),
) -> GGUFInfo:
    """Check that `path` is a GGUF file llama.cpp can parse; raise ModelError if not.

    With ``check_tensors=False`` only the header and the metadata are read (the tensor infos and
    the data bounds are not checked, and ``tensor_data_offset`` is -1).

    Arrays longer than SHORT_ARRAY elements are stored in ``metadata`` as OmittedValue, unless
    ``load_arrays`` is True or names their key: then their contents are stored as tuples.
    """
    p = Path(path)
    f, size = _open_checked(p)
    with f:
        return _validate(f, p, size, check_tensors=check_tensors, load_arrays=load_arrays)


def _validate(
    f: BinaryIO,
    path: Path,
    size: int,
    *,
    check_tensors: bool,
    load_arrays: bool | Collection[str],
) -> GGUFInfo:
    """The file section by section, each check in the order llama.cpp reads it: the header, the
    metadata (and what llama.cpp reads from it: the alignment, the llama hyperparameters), then,
    with ``check_tensors``, the tensor infos and the tensor data's layout."""
    r = _Reader(f, path, size)
    version, n_tensors, n_kv = _check_header(r)
    _check_counts(r, n_tensors, n_kv, check_tensors)
    metadata, types = _read_metadata(r, n_kv, load_arrays)
    alignment = _alignment(r, metadata, types)
    _check_llama_hparams(r, metadata)
    tensors = _TensorInfos()
    data_offset = -1
    if check_tensors:
        tensors = _read_tensor_infos(r, n_tensors)
        data_offset = _check_tensor_data(r, tensors.layout, alignment)
    arch = metadata.get("general.architecture")
    name = metadata.get("general.name")
    return GGUFInfo(
        path=path,
        version=version,
        n_tensors=n_tensors,
        n_kv=n_kv,
        metadata=metadata,
        architecture=arch if isinstance(arch, str) else None,
        name=name if isinstance(name, str) else None,
        alignment=alignment,
        tensor_data_offset=data_offset,
        file_size=size,
        layer_bytes_by_type=tensors.by_type,
        layer_matrices=tensors.matrices,
        output_matrix=tensors.outputs.get("output.weight")
        or tensors.outputs.get("token_embd.weight"),
    )


def _check_header(r: _Reader) -> tuple[int, int, int]:
    """The magic, the version, the counts: (version, tensor count, metadata key/value count)."""
    path, size = r.path, r.size
    if size == 0:
        raise ModelError(f"not a GGUF file: {path} (the file is empty)")
    if size < 4:
        raise ModelError(f"not a GGUF file: {path} (only {size} bytes long)")
    magic = r.take(4, "magic")
    if magic != GGUF_MAGIC:
        raise _bad_magic(path, magic)
    if size < _HEADER.size:
        raise ModelError(
            f"truncated GGUF: {path} (the header needs {_HEADER.size} bytes, the file has {size})"
        )
    version = r.u32("version")
    if version not in SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version & 0xFFFF == 0 and 0 < swapped < 0x10000:
            raise ModelError(
                f"big-endian GGUF: {path} (version {swapped} stored big-endian); llama.cpp on this "
                "machine needs a little-endian file (convert it with gguf-py's gguf_convert_endian)"
            )
        if version == 1:
            raise ModelError(
                f"unsupported GGUF version: {path} (version 1 is no longer supported by llama.cpp; "
                "re-convert the model)"
            )
        raise ModelError(
            f"unsupported GGUF version: {path} (version {version}; supported: "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))})"
        )
    n_tensors = r.u64("tensor count")
    n_kv = r.u64("metadata key/value count")
    return version, n_tensors, n_kv


def _check_counts(r: _Reader, n_tensors: int, n_kv: int, check_tensors: bool) -> None:
    """The counts against the bytes left: each KV takes at least 8 (key length) + 1 (key) + 4
    (type) + 1 (value) bytes; each tensor info at least 8 (name length) + 1 (name) + 4 (n_dims)
    + 8 (one dim) + 4 (type) + 8 (offset)."""
    left = r.size - r.pos
    if n_kv > left // 14:
        raise r.too_many(f"{n_kv} metadata key/value pairs", left, "after the header")
    if check_tensors and n_tensors * 33 + n_kv * 14 > left:
        raise r.too_many(
            f"{n_tensors} tensors and {n_kv} metadata key/value pairs", left, "after the header"
        )


def _read_metadata(
    r: _Reader, n_kv: int, load_arrays: bool | Collection[str]
) -> tuple[dict[str, object], dict[str, tuple[int, bool]]]:
    """The key/value pairs: (key -> value, key -> (type, is_array)); arrays past SHORT_ARRAY
    elements kept as OmittedValue unless ``load_arrays`` is True or names their key."""
    load_all = load_arrays is True
    wanted: Collection[str] = () if isinstance(load_arrays, bool) else load_arrays
    metadata: dict[str, object] = {}
    types: dict[str, tuple[int, bool]] = {}
    for i in range(n_kv):
        klen = r.u64(f"length of key #{i}")
        if klen == 0:
            raise r.corrupt(f"metadata key #{i} is empty")
        if klen > MAX_KEY_LENGTH:
            raise r.corrupt(f"metadata key #{i} has length {klen}, the limit is {MAX_KEY_LENGTH}")
        raw = r.take(klen, f"metadata key #{i}")
        try:
            key = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise r.corrupt(f"metadata key #{i} is not valid UTF-8: {_short(raw)}") from None
        if "\x00" in key:
            raise r.corrupt(f"metadata key #{i} contains a NUL byte: {_q(key)}")
        if key in metadata:
            raise r.corrupt(f"duplicate metadata key {_q(key)}")
        vtype = r.u32(f"type of key {_q(key)}")
        metadata[key] = _read_value(r, key, vtype, load_all or key in wanted)
        types[key] = (vtype, False) if vtype != T_ARRAY else (-1, True)
    return metadata, types


def _alignment(r: _Reader, metadata: dict[str, object], types: dict[str, tuple[int, bool]]) -> int:
    """general.alignment (a uint32 power of two) or the default."""
    if ALIGNMENT_KEY not in metadata:
        return DEFAULT_ALIGNMENT
    value = metadata[ALIGNMENT_KEY]
    if types[ALIGNMENT_KEY] != (T_UINT32, False):
        vtype, is_array = types[ALIGNMENT_KEY]
        tname = "array" if is_array else _TYPE_NAMES[vtype]
        raise r.corrupt(f"{ALIGNMENT_KEY} must be a uint32, it is a {tname}")
    if not isinstance(value, int) or value == 0 or value & (value - 1):
        raise r.corrupt(f"{ALIGNMENT_KEY} is {value}, not a power of two")
    return value


@dataclass
class _TensorInfos:
    """What the tensor infos say: each tensor's (name, bytes, offset) in file order, and the
    facts GGUFInfo keeps (the layers' bytes per type, their matrices, the output matrix)."""

    layout: list[tuple[str, int, int]] = field(default_factory=list)
    by_type: dict[str, int] = field(default_factory=dict)
    matrices: list[tuple[str, str, int, int]] = field(default_factory=list)
    outputs: dict[str, tuple[str, int, int]] = field(default_factory=dict)


def _read_tensor_infos(r: _Reader, n_tensors: int) -> _TensorInfos:
    """Each tensor's name, shape, type and offset, checked as llama.cpp checks them."""
    # The KVs are read: recheck the tensor count against what is left.
    left = r.size - r.pos
    if n_tensors > left // 33:
        raise r.too_many(f"{n_tensors} tensors", left, "for the tensor infos")
    out = _TensorInfos()
    seen: set[str] = set()
    for i in range(n_tensors):
        name = _tensor_name(r, i, seen)
        n_dims = r.u32(f"n_dims of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.corrupt(f"tensor {name!r} has {n_dims} dimensions, must be 1 to {MAX_DIMS}")
        dims = r.unpack(_DIMS[n_dims], f"shape of tensor {name!r}")
        nelements = 1
        for j, d in enumerate(dims):
            if d <= 0:
                raise r.corrupt(f"tensor {name!r} has dimension {j} = {d}, must be positive")
            nelements *= d
        if nelements > INT64_MAX:
            raise r.corrupt(
                f"tensor {name!r} with shape {list(dims)} has more than 2^63-1 elements"
            )
        tname, nbytes = _tensor_type(r, name, dims, nelements)
        if name.startswith("blk.") and n_dims == 2:
            out.by_type[tname] = out.by_type.get(tname, 0) + nbytes
            out.matrices.append((name, tname, dims[1], dims[0]))
        elif n_dims == 2 and name in ("output.weight", "token_embd.weight"):
            out.outputs[name] = (tname, dims[1], dims[0])
        offset = r.u64(f"data offset of tensor {name!r}")
        out.layout.append((name, nbytes, offset))
    return out


def _tensor_name(r: _Reader, i: int, seen: set[str]) -> str:
    nlen = r.u64(f"length of the name of tensor #{i}")
    if nlen == 0:
        raise r.corrupt(f"tensor #{i} has an empty name")
    if nlen > MAX_TENSOR_NAME:
        raise r.corrupt(
            f"tensor #{i} has a name of {nlen} bytes, llama.cpp allows at most {MAX_TENSOR_NAME}"
        )
    raw = r.take(nlen, f"name of tensor #{i}")
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise r.corrupt(f"name of tensor #{i} is not valid UTF-8: {_short(raw)}") from None
    if "\x00" in name:
        raise r.corrupt(f"name of tensor #{i} contains a NUL byte: {name!r}")
    if name in seen:
        raise r.corrupt(f"duplicate tensor name {name!r} (tensor #{i})")
    seen.add(name)
    return name


def _tensor_type(r: _Reader, name: str, dims: tuple[int, ...], nelements: int) -> tuple[str, int]:
    """The tensor's ggml type, known and fitting its rows: (type name, data bytes)."""
    gtype = r.u32(f"type of tensor {name!r}")
    if gtype not in GGML_TYPES:
        if gtype in _REMOVED_GGML_TYPES:
            raise r.corrupt(
                f"tensor {name!r} has ggml type {gtype} ({_REMOVED_GGML_TYPES[gtype]}), "
                "which llama.cpp no longer supports"
            )
        raise r.corrupt(f"tensor {name!r} has unknown ggml type {gtype}")
    tname, blck, tsize = GGML_TYPES[gtype]
    if dims[0] % blck:
        raise r.corrupt(
            f"tensor {name!r} of type {tname} has {dims[0]} elements per row, "
            f"not a multiple of the block size {blck}"
        )
    return tname, nelements // blck * tsize


def _check_tensor_data(r: _Reader, layout: list[tuple[str, int, int]], alignment: int) -> int:
    """The data's layout: llama.cpp wants each tensor at the aligned end of the previous one,
    all inside the file. Returns where the tensor data starts."""
    path, size = r.path, r.size
    data_offset = _pad(r.pos, alignment) if layout else r.pos
    if data_offset > size:
        raise ModelError(
            f"truncated GGUF: {path} (tensor data should start at byte {data_offset}, "
            f"the file has {size})"
        )
    expected = 0
    for name, nbytes, offset in layout:
        if offset % alignment:
            raise r.corrupt(
                f"tensor {name!r} has data offset {offset}, not a multiple of the alignment "
                f"{alignment}"
            )
        if offset != expected:
            raise r.corrupt(
                f"tensor {name!r} has data offset {offset}, expected {expected} (tensor data "
                "must be stored in order, without gaps or overlaps)"
            )
        end = data_offset + offset + nbytes
        if end > size:
            raise ModelError(
                f"truncated GGUF: {path} (tensor {name!r} data ends at byte {end}, file has {size})"
            )
        expected = offset + _pad(nbytes, alignment)
    return data_offset
