"""Drafters propose the next tokens cheaply; the target verifies them.

Every drafter sees the same token list as the engine (prompt + accepted output). ``propose``
returns up to ``k`` tokens and, for a stochastic drafter, the distribution each was drawn from
(q, needed by the rejection rule); a deterministic drafter returns ``dists=None``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specrun.decoding import sampling as S
from specrun.decoding.target import StateData, Target


@dataclass
class Proposal:
    tokens: list[int]
    dists: list[S.Dist] | None  # q per token; None for deterministic proposals

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY = Proposal([], None)


class Store(Protocol):
    """Earlier outputs a lookup drafter keeps across requests (suffix.SuffixStore)."""

    def clear(self) -> None: ...


class Drafter(Protocol):
    """What the engine and the policies use of a drafter. The first five every drafter has
    its own way; the rest are what ``auto`` and the engine read of a lookup drafter, with
    defaults on ``BaseDrafter`` for a drafter that has nothing to say."""

    name: str
    k_max: int  # its longest proposal; 0: no more than the policy's K (--draft-max)
    last_match: int  # match length of its last proposal (0: none, or not a lookup drafter)

    @property
    def store(self) -> Store | None:
        """Earlier outputs kept across requests (Engine.clear_store clears them)."""
        ...

    def prefill(self, tokens: list[int]) -> int:
        """Get ready to draft after ``tokens``; return how many tokens had to be evaluated."""
        ...

    def propose(
        self,
        tokens: list[int],
        k: int,
        params: S.SamplingParams,
        rng: np.random.Generator,
        greedy_draft: bool,
    ) -> Proposal: ...

    def rollback(self, valid_len: int) -> None:
        """Only ``tokens[:valid_len]`` of what was proposed on is still true."""
        ...

    def reset(self) -> None: ...

    def finish(self, tokens: list[int]) -> None:
        """End of a generation: ``tokens`` is the whole text (a store takes its output)."""
        ...

    def fit(self, n_min: int, auto: bool) -> None:
        """The shortest match (--lookup-min) and the rest of what a mode sets (``auto``)."""
        ...

    def bucket(self) -> str:
        """The last proposal's match length as auto's pricing bucket ("lookup:" + this)."""
        ...


class BaseDrafter:
    """Defaults of ``Drafter``'s optional members: nothing kept, nothing to fit, one bucket per
    match length."""

    k_max = 0
    last_match = 0
    store: Store | None = None

    def rollback(self, valid_len: int) -> None:
        """Nothing to undo (a drafter that only holds accepted tokens)."""

    def finish(self, tokens: list[int]) -> None:
        """Nothing to keep."""

    def fit(self, n_min: int, auto: bool) -> None:
        """Nothing varies by mode."""

    def bucket(self) -> str:
        return str(max(1, self.last_match))


SKIPPED = -1  # a token the draft cache skipped (see DraftModel.propose's ``window``)


class DraftModel(BaseDrafter):
    """A small model with its own KV cache.

    Invariant: the draft cache holds ``tokens[:n_cached]`` of the engine's token list (less any
    skipped stretch, below), and before proposing it evaluates ``tokens[n_cached:]`` in one batch
    (normally just the last token; two when the previous draft was accepted whole, since the
    draft never evaluated its own last proposal; more after another drafter's tokens were
    accepted, or plain decoding). Accepted history is never re-decoded.

    Catching up costs a draft row per token the draft has not seen. A probe after a long stretch
    without the draft can cap that (``window``): it skips all but the last ``window`` tokens,
    which then sit in the cache right after what it already held. Positions in the draft cache
    are therefore its own (``_pos``), not token indices; the draft only proposes, and the target
    verifies every token, so a skipped stretch costs acceptance at most, never exactness.
    """

    name = "draft"

    def __init__(self, model: Target, p_min: float = 0.0) -> None:
        self.model = model
        self.p_min = p_min
        # The stop rule's check in C where the model's build has it (llama/native.py).
        self._native = model.top_prob_fn
        # The cache position of each of the engine's tokens the draft has taken in (-1: skipped);
        # what sits at each position the Model records (model.cached).
        self._pos: list[int] = []
        self.skipped = 0  # tokens skipped by windowed catch-ups (stats, tests)
        self.last_catch_up: tuple[int, float] = (0, 0.0)  # rows and seconds of the last catch-up
        # What the last catch-up showed of the draft, row by row (propose's ``evidence``): for
        # each token it read but the last, (sure, hit): whether it was sure of its next token (at
        # p_min) and whether that token is the one that came next.
        self.last_evidence: list[tuple[bool, bool]] = []

    @property
    def single_rows(self) -> bool:
        """The draft's passes run one row at a time (its placement asked for it)."""
        return self.model.single_rows

    def reset(self) -> None:
        self.model.clear()
        self._pos = []
        self.last_catch_up = (0, 0.0)
        self.last_evidence = []

    def _next_pos(self, upto: int) -> int:
        """Cache position right after the last token held among ``tokens[:upto]``."""
        pos = self._pos
        i = min(upto, len(pos)) - 1
        while i >= 0 and pos[i] < 0:
            i -= 1
        return pos[i] + 1 if i >= 0 else 0

    def _append(self, toks: list[int], logits_from: int | None) -> None:
        p0 = self._next_pos(self.n_cached)
        self.model.decode(toks, p0, logits_from=logits_from)
        self._pos.extend(range(p0, p0 + len(toks)))

    def _cut(self, valid_len: int) -> None:
        """Keep ``tokens[:valid_len]`` (what of it the cache holds)."""
        self.model.truncate(self._next_pos(valid_len))
        del self._pos[valid_len:]

    @property
    def n_cached(self) -> int:
        """How many of the engine's tokens the draft has taken in (held or skipped)."""
        return len(self._pos)

    def held_tokens(self) -> list[int]:
        """The engine's tokens as the draft's cache holds them, by token index (SKIPPED where
        skipped), read from the Model's own record: up to the first position the cache no
        longer holds (another engine over the same Model cut it)."""
        held = self.model.cached
        out: list[int] = []
        for p in self._pos:
            if p >= len(held):
                break
            out.append(held[p] if p >= 0 else SKIPPED)
        return out

    def prefill(self, tokens: list[int], evaluate: bool = True) -> int:
        """``evaluate=False``: only drop what the cache holds beyond the tokens it shares with
        ``tokens``; the rest is caught up on if the draft is ever asked (propose), as after any
        stretch without it."""
        keep = min(_common_prefix(self.held_tokens(), tokens), len(tokens) - 1)
        if keep < self.n_cached:
            self._cut(keep)
        if not evaluate:
            return 0
        todo = tokens[keep:-1]
        self._append(todo, None)
        return len(todo)

    def propose(
        self,
        tokens: list[int],
        k: int,
        params: S.SamplingParams,
        rng: np.random.Generator,
        greedy_draft: bool,
        window: int | None = None,
        evidence: bool = False,
    ) -> Proposal:
        """Up to ``k`` tokens after ``tokens``. ``window``: catch up on at most that many of the
        tokens the draft has not seen (the last ones), skipping the rest. ``evidence`` (greedy):
        the catch-up's rows give logits too, and each says what the draft would have proposed
        there, against the token that followed (``last_evidence``): under greedy decoding, what
        the target would have accepted of it."""
        if self.last_evidence:  # not read (a policy that does not ask); no list per step else
            self.last_evidence = []
        k = min(k, self.room(len(tokens)))
        if k <= 0:
            return EMPTY
        m = self.model
        base = len(tokens)
        if window is not None and base - self.n_cached > max(window, 1):
            gap = base - max(window, 1) - self.n_cached
            self._pos.extend([-1] * gap)
            self.skipped += gap
        catch_up = tokens[self.n_cached :]
        n_up = len(catch_up)
        scored = evidence and greedy_draft and 2 <= n_up <= m.n_outputs_max
        t0 = time.perf_counter()
        self._append(catch_up, 0 if scored else n_up - 1)
        if scored:
            p_min, native = self.p_min, self._native
            self.last_evidence = [
                (
                    not (p_min > 0.0 and S.top_prob_below(m.logits(i), p_min, native)),
                    S.greedy(m.logits(i)) == catch_up[i + 1],
                )
                for i in range(n_up - 1)
            ]
        self.last_catch_up = (n_up, time.perf_counter() - t0)
        out: list[int] = []
        dists: list[S.Dist] | None = None if greedy_draft else []
        while True:
            logits = m.logits(-1)
            if greedy_draft:
                if self.p_min > 0.0 and S.top_prob_below(logits, self.p_min, self._native):
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
            self._append([tok], 0)
        return Proposal(out, dists)

    def save_state(self) -> tuple[list[int], tuple[tuple[int, ...], StateData]]:
        """A copy of what the draft holds, for ``load_state`` (a server's prompt cache)."""
        return list(self._pos), self.model.save_state()

    def load_state(self, state: tuple[list[int], tuple[tuple[int, ...], StateData]]) -> None:
        pos, (tokens, data) = state
        self.reset()
        self.model.load_state(tokens, data)
        self._pos = list(pos)

    def room(self, n_tokens: int) -> int:
        """Longest draft the context still holds after ``n_tokens`` tokens."""
        held = self._next_pos(self.n_cached) + (n_tokens - self.n_cached)
        return max(0, self.model.n_ctx - held + 1)

    def rollback(self, valid_len: int) -> None:
        if self.n_cached > valid_len:
            self._cut(valid_len)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n])
    y = np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n
