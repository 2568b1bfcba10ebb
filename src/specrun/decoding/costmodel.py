"""The cost model of speculative decoding (DESIGN.md), as pure functions.

Units: time is measured in "target tokens", the cost of one plain target decode step.

- ``cum_acc[i]`` is the probability that draft positions 0..i are all accepted (what the stats
  call per-position acceptance). With a constant per-position rate a, ``cum_acc[i] = a**(i+1)``.
- Expected tokens per target pass with a draft of K: ``1 + sum(cum_acc[:K])`` (the accepted
  drafts plus the target's own token) = (1 - a^(K+1)) / (1 - a) in the constant case.
- Cost of that pass: ``K * c + V(K + 1)``: K draft steps of relative cost c, plus one target pass
  over K + 1 rows of relative cost V(K + 1) (V(1) = 1).
- Speed-up over the target alone: the ratio of the two.
- A draft model with a confidence floor (--draft-p-min) stops drafting where it is unsure: it
  proposes its first token with probability ``go`` and, having proposed one, goes on past each
  later position with probability ``go_on`` (default ``go``): an attempt of K proposes j < K
  tokens with probability (1 - go) for j = 0 (a step that decodes plainly after one draft step)
  and go * go_on^(j-1) * (1 - go_on) for 0 < j < K (sureness comes in stretches). Each
  length j costs its own draft steps (j + 1, or K when whole) and a pass over j + 1 rows, and
  yields ``1 + sum(cum_acc[:j])`` tokens; ``per_accepted`` adds a later cost per accepted draft
  token (a draft model catching up on tokens another drafter proposed), ``fixed`` a cost every
  attempt pays (a share of a pending catch-up).
- A draft model never decodes its own last proposal within the attempt (nothing follows it);
  when all K are accepted it decodes it at the next step's catch-up, so an attempt accepted
  whole costs one draft step more: ``c * cum_acc[K-1]`` in expectation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

VerifyCost = Callable[[int], float]


def geometric(a: float, k: int) -> list[float]:
    """Cumulative acceptance for a constant per-position rate ``a``."""
    return [a ** (i + 1) for i in range(k)]


def expected_tokens(cum_acc: Sequence[float], k: int) -> float:
    if k > len(cum_acc):
        raise ValueError(f"need acceptance for {k} positions, have {len(cum_acc)}")
    return 1.0 + float(sum(cum_acc[:k]))


def pass_cost(k: int, c: float, verify_cost: Callable[[int], float]) -> float:
    return (k * c if k else 0.0) + verify_cost(k + 1)


def predicted_speedup(
    cum_acc: Sequence[float], k: int, c: float, verify_cost: Callable[[int], float]
) -> float:
    return expected_tokens(cum_acc, k) / pass_cost(k, c, verify_cost)


def speedups(
    cum_acc: Sequence[float],
    k_max: int,
    c: float,
    verify_cost: Callable[[int], float],
    go: float = 1.0,
    per_accepted: float = 0.0,
    fixed: float = 0.0,
    go_on: float | None = None,
) -> list[float]:
    """The speed-up of a draft attempt of up to K tokens for every K in 0..k_max, in one pass:
    an attempt of K proposes its first token with probability ``go`` and goes on past each later
    one with probability ``go_on`` (see the module's notes). An attempt of K and one of K + 1
    share every outcome that stops before K, so their sums are kept as running prefixes: V(n) is
    asked once per n, and the whole list costs what one attempt of k_max did (auto prices every
    K before every step)."""
    k_max = min(k_max, len(cum_acc))
    if go_on is None:
        go_on = go
    out = [1.0 / verify_cost(1)]  # K = 0: plain decoding
    # Outcomes stopped before K: j = 0 (unsure at once) .. K - 1 proposed, summed as K grows
    # (weight 0 where go = go_on = 1: every attempt then proposes all K).
    tokens, cost = 0.0, fixed
    accepted = 0.0  # expected accepted drafts of a proposal of length j
    for j in range(k_max + 1):
        reach = 1.0 if j == 0 else go * go_on ** (j - 1)  # P(at least j proposed)
        vj = verify_cost(j + 1)
        if j > 0:  # an attempt of K = j: the stopped outcomes, then all j proposed
            whole_tokens = reach * (1.0 + accepted)
            whole_cost = reach * (c * (j + cum_acc[j - 1]) + vj + per_accepted * accepted)
            out.append((tokens + whole_tokens) / (cost + whole_cost))
        if j < k_max:  # the outcome "j proposed, then stopped", for every longer attempt
            pj = reach * ((1.0 - go) if j == 0 else (1.0 - go_on))
            tokens += pj * (1.0 + accepted)
            cost += pj * (c * (j + 1) + vj + per_accepted * accepted)
            accepted += cum_acc[j]
    return out


def best_k(
    cum_acc: Sequence[float],
    c: float,
    verify_cost: Callable[[int], float],
    k_max: int,
    go: float = 1.0,
    per_accepted: float = 0.0,
    fixed: float = 0.0,
    go_on: float | None = None,
) -> tuple[int, float]:
    """The K in 0..k_max with the highest predicted speed-up (K = 0: plain decoding, 1.0); the
    smallest such K on a tie."""
    by_k = speedups(cum_acc, k_max, c, verify_cost, go, per_accepted, fixed, go_on)
    best = (0, by_k[0])
    for k in range(1, len(by_k)):
        if by_k[k] > best[1] + 1e-9:
            best = (k, by_k[k])
    return best


def perfect_best(c: float, verify_cost: VerifyCost, k_max: int) -> float:
    """``best_k([1.0] * k_max, c, verify_cost, k_max)[1]`` in closed form, the same floats: a draft
    that never stops and is always accepted yields K + 1 tokens for c (K + 1) + V(K + 1) (its last
    proposal decoded at the next catch-up). Auto asks it every step (its perfect-draft gate)."""
    best = 1.0 / verify_cost(1)
    for k in range(1, k_max + 1):
        s = (k + 1) / (c * (k + 1) + verify_cost(k + 1))
        if s > best + 1e-9:
            best = s
    return best


def linear_verify_cost(slope: float) -> Callable[[int], float]:
    """V(n) = 1 + slope * (n - 1): a batch of n rows costs a bit more than one row."""
    return lambda n: 1.0 + slope * (n - 1)
