"""A fake ``llama.model.Model``: numpy logits from a rule, no GGUF file, no llama.cpp.

It keeps the real Model's contract where the engine depends on it: a contiguous KV cache record
(``cached``: decode at a position <= n_cached replaces from there; ``truncate``/``clear`` cut
it), logits only for the rows asked for and only until the next decode, ``n_outputs_max``, a
context limit. Every decoded row is counted, so a test can say how much work a run did.

The logits of a row are a function of the tokens up to and including it: ``rule(context)``
returns the token the model prefers there (logit ``peak``, the rest ``base + noise`` from a seeded
table), so a draft built on another rule disagrees with the target exactly where the rules do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

Rule = Callable[[Sequence[int]], int]

BOS, EOS = 1, 2
N_VOCAB = 64


def text_tokens(text: str) -> list[int]:
    """One token per character of a small alphabet (a-z, space, newline, some punctuation)."""
    return [ALPHABET.index(c) + 3 for c in text]


ALPHABET = "abcdefghijklmnopqrstuvwxyz .,\n!?0123456789"


class FakeModel:
    """The parts of ``specrun.decoding.target.Target`` the engine tests need."""

    single_rows = False
    shared = False
    is_recurrent = False
    can_truncate = True
    top_prob_fn = None

    def __init__(
        self,
        rule: Rule,
        *,
        n_ctx: int = 512,
        n_batch: int = 512,
        n_outputs_max: int = 65,
        peak: float = 8.0,
        seed: int = 0,
        name: str = "fake.gguf",
        template: str | None = None,
    ) -> None:
        self.rule = rule
        self.n_vocab = N_VOCAB
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_outputs_max = n_outputs_max
        self.peak = peak
        self.path = Path(name)
        self.template = template
        self.noise = (
            np.random.default_rng(seed).normal(0.0, 1.0, (n_ctx + 1, N_VOCAB)).astype(np.float32)
        )
        self._held: list[int] = []
        self._out: np.ndarray | None = None
        self._out_first = 0
        self.rows_decoded = 0  # every row ever evaluated
        self.decode_calls: list[tuple[int, int]] = []  # (pos0, rows) of each decode
        self.llama_seconds = 0.0
        self.load_report: dict[str, object] = {}

    # -- what the engine reads ---------------------------------------------------------------
    @property
    def cached(self) -> Sequence[int]:
        return self._held

    @property
    def n_cached(self) -> int:
        return len(self._held)

    bos = BOS
    eos = EOS

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def piece(self, token: int) -> bytes:
        return ALPHABET[token - 3].encode() if 3 <= token < 3 + len(ALPHABET) else b""

    def machine_key(self) -> str:
        return "fake"

    def token_text(self, token: int) -> bytes:
        return {BOS: b"<s>", EOS: b"</s>"}.get(token, self.piece(token))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode()

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        known = "".join(c for c in text if c in ALPHABET)  # the rest has no token here
        return ([BOS] if add_special else []) + text_tokens(known)

    def chat_template(self) -> str | None:
        return self.template

    def context_params(self) -> dict[str, object]:
        return {"n_ctx": self.n_ctx, "n_batch": self.n_batch}

    # -- the cache ------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], pos0: int) -> None:
        self.decode(tokens, pos0)

    def decode(self, tokens: Sequence[int], pos0: int, logits_from: int | None = None) -> None:
        n = len(tokens)
        if n == 0:
            return
        if pos0 + n > self.n_ctx:
            raise RuntimeError(f"context full: {pos0 + n} > {self.n_ctx}")
        if pos0 > len(self._held):
            raise AssertionError(f"decode at {pos0} but the cache holds {len(self._held)}")
        if logits_from is not None and n - logits_from > self.n_outputs_max:
            raise AssertionError(
                f"{n - logits_from} rows of logits > n_outputs_max {self.n_outputs_max}"
            )
        del self._held[pos0:]
        self._held.extend(tokens)
        self.rows_decoded += n
        self.decode_calls.append((pos0, n))
        self._out = None
        if logits_from is not None:
            rows = []
            for j in range(logits_from, n):
                ctx = self._held[: pos0 + j + 1]
                row = self.noise[pos0 + j].copy()
                row[self.rule(ctx)] = self.peak
                rows.append(row)
            self._out = np.stack(rows)
            self._out_first = logits_from

    def logits(self, row: int) -> np.ndarray:
        if self._out is None:
            raise RuntimeError("no logits")
        j = self._out.shape[0] + row if row < 0 else row - self._out_first
        if not 0 <= j < self._out.shape[0]:
            raise RuntimeError(f"no logits for row {row}")
        return self._out[j]

    def truncate(self, n_keep: int) -> None:
        del self._held[n_keep:]

    def clear(self) -> None:
        self._held.clear()

    def close(self) -> None:
        pass


def cycle_rule(text: str, end_after: int | None = None) -> Rule:
    """Prefers the character after the last one in ``text`` (cyclically); EOS after
    ``end_after`` generated-looking tokens (counted from the context's length)."""
    toks = text_tokens(text)

    def rule(ctx: Sequence[int]) -> int:
        if end_after is not None and len(ctx) >= end_after:
            return EOS
        last = ctx[-1]
        if last in toks:
            return toks[(toks.index(last) + 1) % len(toks)]
        return toks[0]

    return rule


def wrong_every(rule: Rule, n: int, offset: int = 0) -> Rule:
    """``rule``, except at context lengths that are ``offset`` mod ``n``: another token."""

    def other(ctx: Sequence[int]) -> int:
        t = rule(ctx)
        if len(ctx) % n == offset:
            return 3 + (t - 3 + 1) % len(ALPHABET) if t >= 3 else 3
        return t

    return other
