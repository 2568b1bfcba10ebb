"""Drafters propose the next tokens cheaply; the target verifies them.

Every drafter sees the same token list as the engine (prompt + accepted output). ``propose``
returns up to ``k`` tokens and, for a stochastic drafter, the distribution each was drawn from
(q, needed by the rejection rule); a deterministic drafter returns ``dists=None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from . import sampling as S

if TYPE_CHECKING:
    from .runtime import Model


@dataclass
class Proposal:
    tokens: list[int]
    dists: list[S.Dist] | None  # q per token; None for deterministic proposals

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY = Proposal([], None)


class Drafter(Protocol):
    name: str

    def prefill(self, tokens: list[int]) -> int:
        """Get ready to draft after ``tokens``; return how many tokens had to be evaluated."""
        ...

    def propose(
        self, tokens: list[int], k: int, params: S.SamplingParams, rng: np.random.Generator,
        greedy_draft: bool,
    ) -> Proposal: ...

    def rollback(self, valid_len: int) -> None:
        """Only ``tokens[:valid_len]`` of what was proposed on is still true."""
        ...

    def reset(self) -> None: ...


class DraftModel:
    """A small model with its own KV cache.

    Invariant: the draft cache holds exactly ``tokens[:n_cached]`` of the engine's token list, and
    before proposing it evaluates ``tokens[n_cached:]`` in one batch (normally just the last token;
    two when the previous draft was accepted whole, since the draft never evaluated its own last
    proposal; more after another drafter's tokens were accepted). Accepted history is never
    re-decoded.
    """

    name = "draft"

    def __init__(self, model: Model, p_min: float = 0.0) -> None:
        self.model = model
        self.p_min = p_min
        self.n_cached = 0
        self._cached: list[int] = []  # mirror of the cache content, for prefix reuse

    def reset(self) -> None:
        self.model.clear()
        self.n_cached = 0
        self._cached = []

    def prefill(self, tokens: list[int]) -> int:
        keep = min(_common_prefix(self._cached, tokens), len(tokens) - 1)
        if keep < self.n_cached:
            self.model.truncate(keep)
        todo = tokens[keep:-1]
        self.model.decode(todo, keep)
        self.n_cached = len(tokens) - 1
        self._cached = list(tokens[:-1])
        return len(todo)

    def room(self, n_tokens: int) -> int:
        """Longest draft the context still holds after ``n_tokens`` tokens."""
        return max(0, self.model.n_ctx - n_tokens + 1)

    def propose(
        self, tokens: list[int], k: int, params: S.SamplingParams, rng: np.random.Generator,
        greedy_draft: bool,
    ) -> Proposal:
        k = min(k, self.room(len(tokens)))
        if k <= 0:
            return EMPTY
        m = self.model
        base = len(tokens)
        catch_up = tokens[self.n_cached:]
        m.decode(catch_up, self.n_cached, logits_from=len(catch_up) - 1)
        self._cached.extend(catch_up)
        self.n_cached = base
        out: list[int] = []
        dists: list[S.Dist] | None = None if greedy_draft else []
        while True:
            logits = m.logits(-1)
            if greedy_draft:
                if self.p_min > 0.0 and S.top_prob_below(logits, self.p_min):
                    break
                tok = S.greedy(logits)
            else:
                q = S.transform(logits, params)
                if q.probs[0] < self.p_min:
                    break
                tok = q.sample(rng)
                assert dists is not None
                dists.append(q)
            out.append(tok)
            if len(out) >= k:
                break
            m.decode((tok,), self.n_cached, logits_from=0)
            self._cached.append(tok)
            self.n_cached += 1
        return Proposal(out, dists)

    def rollback(self, valid_len: int) -> None:
        if self.n_cached > valid_len:
            self.model.truncate(valid_len)
            self.n_cached = valid_len
            del self._cached[valid_len:]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n])
    y = np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n
