"""A vocabulary's fill-in-the-middle tokens, as llama.cpp finds them (``llama_vocab_fim_pre`` and
its siblings: the GGUF's ``tokenizer.ggml.fim_*_token_id`` keys, else the token texts llama.cpp
recognises when it loads the vocabulary: ``<|fim_prefix|>``, ``<PRE>``, ``<fim-prefix>``...), and
a token's printed bytes with its special text (llama-server's ``common_token_to_piece``, which
``/tokenize`` and ``/detokenize`` answer with). Read from a loaded ``llama.model.Model``."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import llama_cpp as ll

NULL = -1  # LLAMA_TOKEN_NULL: the vocabulary has no such token


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    pad: int
    rep: int  # the repository name marker (<|repo_name|>), repo-level FIM
    sep: int  # the file separator (<|file_sep|>), repo-level FIM
    add_bos: bool  # the vocabulary puts BOS before a text (llama_vocab_get_add_bos)
    bos: int

    def missing(self) -> list[str]:
        """llama-server's words for the three tokens infill cannot do without, where absent."""
        return [
            f"{name} token is missing"
            for name, tok in (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid))
            if tok == NULL
        ]


def _vocab(model: Any) -> Any:
    return model._vocab  # noqa: SLF001 - llama/ reads its own Model's handle


def fim_tokens(model: Any) -> FimTokens:
    v = _vocab(model)
    return FimTokens(
        pre=int(ll.llama_vocab_fim_pre(v)),
        suf=int(ll.llama_vocab_fim_suf(v)),
        mid=int(ll.llama_vocab_fim_mid(v)),
        pad=int(ll.llama_vocab_fim_pad(v)),
        rep=int(ll.llama_vocab_fim_rep(v)),
        sep=int(ll.llama_vocab_fim_sep(v)),
        add_bos=bool(ll.llama_vocab_get_add_bos(v)),
        bos=int(ll.llama_vocab_bos(v)),
    )


def special_piece(model: Any, token: int) -> bytes:
    """The bytes ``token`` prints as, special tokens with their text (``<|fim_middle|>``), as
    llama-server's ``common_token_to_piece(ctx, token, special=true)``."""
    v = _vocab(model)
    buf = ctypes.create_string_buffer(64)
    n = ll.llama_token_to_piece(v, token, buf, len(buf), 0, True)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = ll.llama_token_to_piece(v, token, buf, len(buf), 0, True)
    return buf.raw[: max(n, 0)]
