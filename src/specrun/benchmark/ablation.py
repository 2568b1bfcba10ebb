"""auto with one of its refinements taken out: the ablation of docs/auto.md, for the replay
(bench/suffix_sim.py) and for real runs (bench/modes_compare.py) alike.

``OFF`` maps a refinement's name (as docs/auto.md's ablation table names it) to what takes it
out of an ``AutoPolicy`` subclass; ``cap-bonus`` and ``walk-floor`` are the suffix drafter's and
change the ``SuffixLookup`` auto runs instead (``off_lookup``). A tuned value is taken out with
``auto@FIELD=VALUE`` instead (an AutoPriors change).
"""

from __future__ import annotations

from typing import Any

from specrun.decoding.auto import AutoPolicy
from specrun.decoding.suffix import SuffixLookup


class _GoOnAsGo:
    """``!go-on``: the draft goes on past a later position as often as it starts (1 - stop)."""

    def __init__(self, stop: Any) -> None:
        self.stop = stop

    @property
    def p(self) -> float:
        return float(1.0 - self.stop.p)

    def update(self, hit: bool) -> None:
        pass


def _off_fresh(cls: type[AutoPolicy], after: Any) -> None:
    base = cls._fresh

    def _fresh(self: AutoPolicy) -> None:
        base(self)
        after(self)

    cls._fresh = _fresh  # type: ignore[method-assign]


def _off_bursts(cls: type[AutoPolicy]) -> None:
    base = cls._observe_step

    def _observe_step(self: AutoPolicy, name: str, k: int, n_accepted: int, *rest: Any) -> None:
        base(self, name, k, n_accepted, *rest)
        if name == "draft" and k and n_accepted == k:  # a paying re-try, no more
            self._probe_every = self.priors.probe_min

    cls._observe_step = _observe_step  # type: ignore[method-assign, assignment]
    cls._end_burst = lambda self: None  # type: ignore[method-assign]


def _off_score_full(cls: type[AutoPolicy]) -> None:
    base = cls._observe_tokens

    def _observe_tokens(self: AutoPolicy, tokens: Any) -> None:
        base(self, tokens)
        self._pending = []  # a proposal is scored against its own step's tokens only

    cls._observe_tokens = _observe_tokens  # type: ignore[method-assign]


OFF: dict[str, Any] = {
    "pool": lambda c: setattr(c, "_lookup_prior", lambda self, key: self.priors.accept_prior(key)),
    "lookup-busy": lambda c: setattr(c, "_lookup_busy_c", lambda self, tokens, best: 0.0),
    "sure-retry": lambda c: setattr(c, "_sure_now", lambda self: True),
    "go-on": lambda c: _off_fresh(c, lambda self: setattr(self, "go_on", _GoOnAsGo(self.stop))),
    "first-probe": lambda c: _off_fresh(c, lambda self: setattr(self, "_since", 0)),
    "bursts": _off_bursts,
    "score-full": _off_score_full,
    "cap-bonus": None,  # the suffix drafter's (off_lookup)
    "walk-floor": None,  # the suffix drafter's (off_lookup)
}


def check(offs: tuple[str, ...]) -> None:
    for off in offs:
        if off not in OFF:
            raise SystemExit(f"!{off}: one of {', '.join(OFF)}")


def ablated(offs: tuple[str, ...]) -> type[AutoPolicy]:
    """AutoPolicy with the policy's refinements among ``offs`` taken out."""
    check(offs)
    cls = type("AutoWithout", (AutoPolicy,), {})
    for off in offs:
        if OFF[off] is not None:
            OFF[off](cls)
    return cls


def off_lookup(d: SuffixLookup, offs: tuple[str, ...]) -> None:
    """The suffix drafter's refinements among ``offs`` taken out of ``d``, after its ``fit``."""
    if "cap-bonus" in offs:
        d._cap = lambda match, support: max(1, match)  # type: ignore[method-assign]
    if "walk-floor" in offs:
        d.min_prob = SuffixLookup.MIN_PROB


def take_out(policy: AutoPolicy, offs: tuple[str, ...]) -> None:
    """A built AutoPolicy (an engine's) with ``offs`` taken out, as if built so."""
    policy.__class__ = ablated(offs)
    policy._fresh()  # what __init__ set, again under the refinements taken out
    if isinstance(policy.lookup, SuffixLookup):
        off_lookup(policy.lookup, offs)
