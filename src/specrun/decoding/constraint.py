"""Constrained decoding: a grammar masks the target's distribution, and speculation stays exact.

A ``Constraint`` says which tokens may come next (llama/grammar.py implements it with llama.cpp's
grammar sampler). The engine applies it to the *target's* rows before the accept test, so:

- greedy: row j's token is the argmax over the admitted tokens; a draft token the grammar forbids
  is never that argmax, so it is rejected like any other miss;
- sampling: p is the transform (temp/top-k/top-p/min-p) of the masked logits; the Leviathan/Chen
  rule then keeps exactly the constrained target's distribution (p(x) = 0 for a forbidden x).

Both only ask the grammar about the tokens that can matter (the top of the row), widening to the
whole vocabulary only when none of those is admitted: a grammar check over 152k tokens costs
milliseconds, over a few hundred microseconds.

Where the grammar admits exactly one next character, the text is forced: ``forced_text`` walks
it, and the ``ForcedDrafter`` proposes its tokens at no drafting cost (verified, not trusted, so a
tokenization the target would not choose is rejected like any draft).
"""

from __future__ import annotations

import string
from typing import Protocol

import numpy as np

from specrun.decoding import sampling as S
from specrun.decoding.target import Target

_FIRST = 64  # top tokens asked first; then 16x more; then the whole vocabulary


class Constraint(Protocol):
    def fork(self) -> Constraint:
        """An independent copy of the state (a verify pass advances it on trial)."""
        ...

    def accept(self, token: int) -> None:
        """Advance by ``token``, which ``allowed`` admitted."""
        ...

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        """Whether each of ``ids`` may come next (bool per id)."""
        ...

    def close(self) -> None: ...


def _top(logits: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` highest logits' ids, highest first, the lower id first on a tie (argmax's rule)."""
    size = logits.shape[0]
    if n >= size:
        ids = np.arange(size)
    else:
        ids = np.argpartition(-logits, n)[:n]
    return ids[np.lexsort((ids, -logits[ids]))]


def argmax(c: Constraint, logits: np.ndarray) -> int:
    """The greedy token under the constraint: the highest-logit admitted token (first on a tie).
    -1 where the grammar admits nothing at all."""
    t = int(logits.argmax())
    if c.allowed(np.array([t], dtype=np.int32))[0]:
        return t
    n = _FIRST
    while True:
        ids = _top(logits, n)
        ok = c.allowed(ids.astype(np.int32))
        hit = np.flatnonzero(ok)
        if hit.size:
            return int(ids[hit[0]])
        if n >= logits.shape[0]:
            return -1
        n *= 16


def mask(c: Constraint, logits: np.ndarray, params: S.SamplingParams) -> np.ndarray:
    """``logits`` with every token the constraint forbids at -inf, as far as ``params`` can see:
    with top-k on, the top_k admitted tokens are what the transform keeps, so only the top of the
    row is asked; otherwise the whole vocabulary."""
    size = logits.shape[0]
    out = np.full(size, -np.inf, dtype=logits.dtype)
    k = params.top_k if 0 < params.top_k < size else 0
    n = max(4 * k, _FIRST) if k else size
    while True:
        ids = _top(logits, n) if n < size else np.arange(size)
        ok = c.allowed(ids.astype(np.int32))
        if (k and int(ok.sum()) >= k) or n >= size:
            keep = ids[ok]
            out[keep] = logits[keep]
            return out
        n = min(size, n * 16)


def forced_text(c: Constraint, probes: dict[str, int], limit: int = 32) -> tuple[str, list[int]]:
    """The text the grammar forces from here: while exactly one of the single-character tokens
    ``probes`` (character -> token id) is admitted and nothing outside them could start, that
    character is next. Returns the forced text and its characters' tokens."""
    chars = list(probes)
    ids = np.array([probes[ch] for ch in chars], dtype=np.int32)
    out: list[str] = []
    toks: list[int] = []
    g = c.fork()
    try:
        while len(out) < limit:
            ok = g.allowed(ids)
            hit = np.flatnonzero(ok)
            if hit.size != 1:
                break
            ch = chars[int(hit[0])]
            out.append(ch)
            toks.append(int(ids[hit[0]]))
            g.accept(int(ids[hit[0]]))
    finally:
        g.close()
    return "".join(out), toks


def char_probes(target: Target) -> dict[str, int]:
    """Printable ASCII and whitespace characters that are one token each in ``target``'s
    vocabulary, as the tokenizer writes them alone."""
    out: dict[str, int] = {}
    for ch in string.printable:
        toks = target.tokenize(ch, False, False)
        if len(toks) == 1:
            out[ch] = toks[0]
    return out
