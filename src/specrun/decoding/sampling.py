"""Sampling math, pure numpy: no llama_cpp here.

Distributions are sparse: ``Dist(ids, probs)`` over the tokens that survive top-k/top-p/min-p, so
the cost per row is one argpartition over the vocabulary plus work on a few dozen candidates.

The transform follows llama.cpp's default sampler chain order (top-k -> top-p -> min-p ->
temperature -> dist): top-p and min-p see the softmax of the *untempered* logits, temperature only
shapes what survives. ``--mode none`` therefore samples what llama.cpp's default chain would, and
the draft (q) and the target (p) are transformed identically, which the exactness proof needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specrun import defaults
from specrun.errors import UsageError


@dataclass(frozen=True)
class SamplingParams:
    temp: float = defaults.TEMP
    top_k: int = defaults.TOP_K
    top_p: float = defaults.TOP_P
    min_p: float = defaults.MIN_P
    seed: int = 0
    # The target's distribution changed before sampling (penalties.py, llama.cpp's neutral values):
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # -1: the whole history, 0: no penalties
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias); -inf forbids
    ignore_eos: bool = False  # every end-of-generation token at -inf
    # What to report of each chosen token (TokenProb): -1 nothing; 0 its own probability; n also
    # the n most likely tokens of its row. post_sampling_probs: from the distribution sampled
    # (after top-k/top-p/min-p/temperature), else the whole row's softmax.
    n_probs: int = -1
    post_sampling_probs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0

    def validate(self) -> None:
        if not np.isfinite(self.temp) or self.temp < 0:
            raise UsageError(f"--temp must be >= 0 (0 = greedy), got {self.temp}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise UsageError(f"--min-p must be in [0, 1), got {self.min_p}")
        if self.seed < 0 or self.seed >= 2**63:
            raise UsageError(f"--seed must be in [0, 2^63), got {self.seed}")
        if not np.isfinite(self.repeat_penalty) or self.repeat_penalty <= 0:
            raise UsageError(f"--repeat-penalty must be > 0 (1 = off), got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise UsageError(
                f"--repeat-last-n must be >= -1 (-1: the context, 0: off), got {self.repeat_last_n}"
            )
        for name, v in (
            ("--presence-penalty", self.presence_penalty),
            ("--frequency-penalty", self.frequency_penalty),
        ):
            if not np.isfinite(v):
                raise UsageError(f"{name} must be a finite number, got {v}")

    def as_dict(self) -> dict[str, float | int]:
        return {
            "temp": self.temp,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "seed": self.seed,
            **self.penalty_dict(),
        }

    def penalty_dict(self) -> dict[str, float | int]:
        """The penalties that are on (nothing when they are all neutral)."""
        out: dict[str, float | int] = {}
        if self.repeat_penalty != 1.0:
            out["repeat_penalty"] = self.repeat_penalty
        if self.presence_penalty != 0.0:
            out["presence_penalty"] = self.presence_penalty
        if self.frequency_penalty != 0.0:
            out["frequency_penalty"] = self.frequency_penalty
        if out:
            out["repeat_last_n"] = self.repeat_last_n
        return out


@dataclass(frozen=True)
class TokenProb:
    """A chosen token's log-probability under the row it was verified on, and the ``top`` most
    likely tokens of that row with theirs (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def row_logprobs(logits: np.ndarray, token: int, n_top: int) -> TokenProb:
    """``token``'s log-softmax in ``logits`` (temperature 1, the whole row) and the ``n_top``
    best tokens'."""
    row = logits.astype(np.float64)
    m = float(row.max())
    lse = m + math.log(float(np.exp(row - m).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if n_top > 0:
        n = min(n_top, row.shape[0])
        ids = np.argpartition(-row, n - 1)[:n] if n < row.shape[0] else np.arange(n)
        ids = ids[np.lexsort((ids, -row[ids]))]
        top = tuple((int(i), float(row[i] - lse)) for i in ids)
    return TokenProb(int(token), float(row[token] - lse), top)


def dist_logprobs(p: Dist, token: int, n_top: int) -> TokenProb:
    """The same from the distribution sampled (llama-server's ``post_sampling_probs``)."""
    px = p.prob(token)
    lp = math.log(px) if px > 0 else -math.inf
    top = tuple(
        (int(i), math.log(float(q))) for i, q in zip(p.ids[:n_top], p.probs[:n_top], strict=True)
    )
    return TokenProb(int(token), lp, top if n_top > 0 else ())


@dataclass(frozen=True)
class Dist:
    """A probability distribution on a sparse support: ``probs[i]`` is the mass of ``ids[i]``.

    ``ids`` are sorted by decreasing probability; ``probs`` sums to 1.
    """

    ids: np.ndarray  # int64
    probs: np.ndarray  # float64

    def prob(self, token: int) -> float:
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0

    def sample(self, rng: np.random.Generator) -> int:
        # Inverse CDF with one uniform: cheaper than rng.choice and reproducible across numpy versions.
        cdf = np.cumsum(self.probs)
        i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
        return int(self.ids[min(i, self.ids.size - 1)])

    def dense(self, n_vocab: int) -> np.ndarray:
        out = np.zeros(n_vocab, dtype=np.float64)
        out[self.ids] = self.probs
        return out


def greedy(logits: np.ndarray) -> int:
    """The target's own greedy choice: argmax of the raw logits (first index on a tie). The
    method, not ``np.argmax``: its Python wrapper cost ~5 us a step from cold caches."""
    return int(logits.argmax())


def top_prob(logits: np.ndarray) -> float:
    """Probability of the most likely token under the untempered softmax (for --draft-p-min)."""
    m = float(np.max(logits))
    return float(1.0 / np.sum(np.exp(logits.astype(np.float64) - m)))


_TAIL_CUT = 16.0  # logits this far below the top add at most n_vocab * e^-16 (5e-3 for 49k)
_NEAR_CUT = 2.0


def top_prob_below(
    logits: np.ndarray, p_min: float, native: Callable[[np.ndarray], float] | None = None
) -> bool:
    """Whether the top token's softmax probability is below ``p_min`` (the draft's stop rule).

    Same answer as ``top_prob(logits) < p_min`` up to the tail's e^-16 share, at a fraction of
    its cost: exp over a 49k-262k vocabulary costs 150-600 us a call here, more than the rest of
    a draft step's Python. P(top) < p_min  <=>  sum over the others of e^(l - max) > 1/p_min - 1.
    Many rivals within 2 nats settle it from a count alone (a flat distribution); otherwise only
    the logits within 16 nats of the top are exponentiated (few, when the draft is confident).
    ``native``: the same sum in C (a Model's ``top_prob_fn``, where its build has one; float32
    rows as llama.cpp writes them), 35-45 us a check in a run where this takes 85-100.
    """
    if p_min <= 0.0:
        return False
    if p_min >= 1.0:
        return True
    if native is not None and logits.dtype == np.float32 and logits.flags.c_contiguous:
        return native(logits) < p_min
    budget = 1.0 / p_min - 1.0
    m = logits.max()
    rivals = int(np.count_nonzero(logits > m - _NEAR_CUT)) - 1
    if rivals * math.exp(-_NEAR_CUT) > budget:
        return True
    # np.compress, not logits[mask]: the same elements, in 35 us instead of 80-90 (49k floats).
    near = np.compress(logits > m - _TAIL_CUT, logits)
    # exp in float32, summed in float64: 18 us against 46 for exp in float64 (7.7k logits within
    # 16 nats of an F16 SmolLM2's top), the sum 8e-9 apart.
    others = float(np.exp(near - m).sum(dtype=np.float64)) - 1.0
    return others > budget


def transform(logits: np.ndarray, params: SamplingParams) -> Dist:
    """logits -> the distribution llama.cpp's top-k/top-p/min-p/temp chain samples from."""
    n = logits.shape[0]
    k = params.top_k if 0 < params.top_k < n else n
    if k < n:
        ids = np.argpartition(logits, n - k)[n - k :]
    else:
        ids = np.arange(n)
    cand = logits[ids].astype(np.float64)
    order = np.argsort(-cand, kind="stable")
    ids = ids[order].astype(np.int64)
    cand = cand[order]

    keep = cand.size
    if cand[-1] == -np.inf:  # masked by a grammar (constraint.py): never sampled
        keep = int(np.count_nonzero(cand > -np.inf))
    if params.top_p < 1.0:
        p = np.exp(cand - cand[0])
        p /= p.sum()
        cum = np.cumsum(p)
        # Smallest prefix whose mass reaches top_p (llama.cpp: include the crossing token).
        keep = min(keep, int(np.searchsorted(cum, params.top_p, side="left")) + 1)
    if params.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed.
        keep = min(
            keep, max(1, int(np.count_nonzero(cand[:keep] >= cand[0] + np.log(params.min_p))))
        )
    ids, cand = ids[:keep], cand[:keep]

    temp = params.temp if params.temp > 0 else 1.0
    probs = np.exp((cand - cand[0]) / temp)
    probs /= probs.sum()
    return Dist(ids, probs)


def accept_prob(p: Dist, q: Dist | None, token: int) -> float:
    """Leviathan/Chen acceptance probability min(1, p(x)/q(x)) for a draft token x ~ q.

    ``q=None`` means a deterministic proposal (prompt lookup): q is one-hot at x, and the exact
    rule reduces to accepting with probability p(x).
    """
    px = p.prob(token)
    qx = 1.0 if q is None else q.prob(token)
    if qx <= 0.0:
        return 1.0 if px > 0 else 0.0  # cannot happen for x ~ q; keep the rule total
    return min(1.0, px / qx)


def residual(p: Dist, q: Dist | None, token: int) -> Dist:
    """norm(max(0, p - q)): what to sample from after rejecting ``token``.

    With ``q=None`` (one-hot proposal at ``token``) the residual is p without ``token``.
    """
    if q is None:
        mask = p.ids != token
        ids, mass = p.ids[mask], p.probs[mask]
    else:
        ids = np.union1d(p.ids, q.ids)
        pd = np.zeros(ids.size)
        qd = np.zeros(ids.size)
        pd[np.searchsorted(ids, p.ids)] = p.probs
        qd[np.searchsorted(ids, q.ids)] = q.probs
        mass = np.maximum(pd - qd, 0.0)
        nz = mass > 0.0
        ids, mass = ids[nz], mass[nz]
    total = mass.sum()
    if ids.size == 0 or total <= 1e-12:
        # Only reachable through rounding when p == q: then p itself is the right answer.
        return p
    order = np.argsort(-mass, kind="stable")
    return Dist(ids[order], mass[order] / total)


def speculative_step(
    p: Dist, q: Dist | None, token: int, rng: np.random.Generator
) -> tuple[bool, int]:
    """One position of rejection sampling: (accepted, emitted token).

    Accept x with probability min(1, p(x)/q(x)); on rejection emit a sample of the residual. The
    emitted token is distributed exactly as p whatever q is (tests/test_sampling.py proves it).
    """
    if rng.random() < accept_prob(p, q, token):
        return True, token
    return False, residual(p, q, token).sample(rng)
