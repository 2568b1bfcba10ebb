"""llama.cpp's grammar sampler as a ``decoding.constraint.Constraint``: GBNF (or a JSON schema,
through llama.cpp's json-schema-to-grammar) compiled against a model's vocabulary.

The sampler is used only as an oracle: ``allowed`` asks which of some token ids the grammar admits
next (llama.cpp sets the others' logits to -inf), ``accept`` advances it by a token it admitted,
``fork`` clones it (a verify pass tries a draft's tokens on a clone; the committed state advances
only by what the engine keeps).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import llama_cpp as ll
import numpy as np
from llama_cpp.llama_grammar import JSON_GBNF, SchemaConverter

from specrun.errors import UsageError
from specrun.llama.backend import capture_load_log, init_backend


class GrammarError(UsageError):
    """A grammar or schema llama.cpp cannot use: a 400 for the server, exit 2 for the CLI."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# JSON Schema keywords llama.cpp's json-schema-to-grammar turns into grammar rules, and those it
# reads as annotations. Anything else would be dropped without a word: refused instead.
SCHEMA_KEYWORDS = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
        "definitions", "pattern", "format", "minLength", "maxLength", "minimum", "maximum",
        "exclusiveMinimum", "exclusiveMaximum",
        # annotations: no constraint to apply
        "title", "description", "default", "examples", "$schema", "$id", "$comment",
        "deprecated", "readOnly", "writeOnly", "nullable", "strict",
    }
)  # fmt: skip
# Keywords whose value is a map of names to schemas (the names are not keywords).
_NAMED_SCHEMAS = ("properties", "$defs", "definitions")
_FORMATS = frozenset({"date", "time", "date-time", "uuid"})


def check_schema(schema: Any, where: str = "schema") -> None:
    """Refuse what json-schema-to-grammar would not honour, naming the keyword and its place."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be an object, got {type(schema).__name__}", where)
    for key, value in schema.items():
        here = f"{where}.{key}"
        if key not in SCHEMA_KEYWORDS:
            raise GrammarError(
                f"{here}: the JSON Schema keyword {key!r} is not supported by the grammar "
                "(supported: " + ", ".join(sorted(k for k in SCHEMA_KEYWORDS if k[0] != "$")) + ")",
                here,
            )
        if key in _NAMED_SCHEMAS:
            if not isinstance(value, dict):
                raise GrammarError(f"{here} must be an object", here)
            for name, sub in value.items():
                check_schema(sub, f"{here}.{name}")
        elif key in ("items", "additionalProperties") and isinstance(value, dict | bool):
            check_schema(value, here)
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if not isinstance(value, list):
                raise GrammarError(f"{here} must be an array of schemas", here)
            for i, sub in enumerate(value):
                check_schema(sub, f"{here}[{i}]")
        elif key == "format" and schema.get("type") == "string" and value not in _FORMATS:
            raise GrammarError(
                f"{here}: the string format {value!r} is not supported by the grammar "
                f"(supported: {', '.join(sorted(_FORMATS))})",
                here,
            )


def schema_to_gbnf(schema: Any, where: str = "schema") -> str:
    """A JSON schema -> GBNF, as llama.cpp's json-schema-to-grammar writes it."""
    check_schema(schema, where)
    try:
        conv: Any = SchemaConverter(  # type: ignore[no-untyped-call]
            prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False
        )
        schema = conv.resolve_refs(json.loads(json.dumps(schema)), "input")
        conv.visit(schema, "")
        return str(conv.format_grammar())
    except (KeyError, ValueError, TypeError, AssertionError, RecursionError) as exc:
        raise GrammarError(f"{where}: cannot be turned into a grammar: {exc}", where) from None


JSON_OBJECT_GBNF: str = JSON_GBNF  # any JSON object (response_format json_object)

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(ll.llama_token_data)


_FD2 = threading.Lock()  # one redirection of fd 2 at a time (a server compiles on two threads)


@contextlib.contextmanager
def _stderr_to(lines: list[str]) -> Iterator[None]:
    """What the process writes to fd 2 meanwhile, appended to ``lines`` instead."""
    with _FD2:
        yield from _stderr_to_locked(lines)


def _stderr_to_locked(lines: list[str]) -> Iterator[None]:
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 (embedded): let it go where it goes
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.append(tmp.read().decode("utf-8", errors="replace"))


class Grammar:
    """A compiled grammar's state over one model's vocabulary (``decoding.constraint.Constraint``)."""

    def __init__(self, vocab: Any, n_vocab: int, smpl: Any) -> None:
        self._vocab = vocab
        self.n_vocab = n_vocab
        self._smpl = smpl
        # Grown to the largest ``allowed`` asked so far, not the vocabulary's size up front: a
        # state is forked for every verify pass and every forced-text walk, while most questions
        # name a few ids (docs/performance.md, what a grammar costs when it forces nothing).
        self._buf = np.zeros(0, dtype=_TOKEN_DATA)
        self._arr = ll.llama_token_data_array()
        self._arr.selected = -1
        self._arr.sorted = False

    @classmethod
    def compile(
        cls,
        model: Any,
        gbnf: str,
        root: str = "root",
        param: str = "grammar",
        checked: bool = False,
    ) -> Grammar:
        """``gbnf`` against ``model``'s vocabulary; a GrammarError with llama.cpp's own words when
        it does not parse. ``checked``: it compiled before (a server checks a request's grammar
        on arrival), so nothing is captured."""
        init_backend()
        lines: list[str] = []
        if checked:
            smpl = ll.llama_sampler_init_grammar(model._vocab, gbnf.encode(), root.encode())
        else:
            # llama.cpp's grammar parser prints its reason with fprintf(stderr): taken from fd 2
            # for the call (milliseconds), so the error names it and the terminal stays clean.
            with capture_load_log(lines), _stderr_to(lines):
                smpl = ll.llama_sampler_init_grammar(model._vocab, gbnf.encode(), root.encode())
        if not smpl:
            text = [ln.strip() for chunk in lines for ln in chunk.splitlines() if ln.strip()]
            why = next(
                (ln.split("error parsing grammar:", 1)[1].strip() for ln in text
                 if "error parsing grammar:" in ln),
                next((ln for ln in text if "root" in ln or "error" in ln), "it does not parse"),
            )  # fmt: skip
            raise GrammarError(f"{param}: invalid grammar: {why}", param)
        return cls(model._vocab, model.n_vocab, smpl)

    def fork(self) -> Grammar:
        return Grammar(self._vocab, self.n_vocab, ll.llama_sampler_clone(self._smpl))

    def accept(self, token: int) -> None:
        ll.llama_sampler_accept(self._smpl, int(token))

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` the grammar admits as the next token (a bool per id)."""
        n = int(ids.shape[0])
        if n == 0:
            return np.zeros(0, dtype=bool)
        if n > self._buf.shape[0]:
            self._buf = np.zeros(max(n, 256), dtype=_TOKEN_DATA)
        buf = self._buf[:n]
        buf["id"] = ids
        buf["logit"] = 0.0
        self._arr.data = buf.ctypes.data_as(ctypes.POINTER(ll.llama_token_data))  # type: ignore[assignment]
        self._arr.size = n
        self._arr.selected = -1
        self._arr.sorted = False
        ll.llama_sampler_apply(self._smpl, ctypes.byref(self._arr))
        # The grammar keeps the array's order and size, marking what it rejects with -inf.
        return np.asarray(buf["logit"][: self._arr.size] != -np.inf)

    def close(self) -> None:
        if self._smpl is not None:
            ll.llama_sampler_free(self._smpl)
            self._smpl = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
