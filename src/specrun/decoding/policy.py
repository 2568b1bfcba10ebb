"""Which drafter drafts, and how far, at each step: the interface the engine calls, and the
policies whose rule is fixed.

- ``FixedPolicy``: one drafter, always ``draft_max`` (modes ``draft`` and ``lookup``).
- ``HybridPolicy``: prompt lookup first; the draft model where lookup has nothing.
- ``AutoPolicy`` (auto.py): the drafter and K the cost model predicts fastest, each step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrun.decoding import sampling as S
from specrun.decoding.drafters import EMPTY, Drafter, DraftModel, Proposal


@dataclass(frozen=True)
class StepReport:
    """One step, as the engine reports it to its policy (``Policy.observe``)."""

    drafter: str  # whose draft the target verified: "draft", "lookup", or "none" (plain decoding)
    k: int  # draft tokens verified
    accepted: int  # of them, accepted
    draft_s: float  # seconds spent drafting (a declined attempt's included)
    verify_s: float  # seconds of the target pass over k + 1 rows
    tokens: Sequence[int] = ()  # what the step committed (accepted drafts, then the target's own)
    declined: str | None = None  # a drafter that ran but proposed too little to verify
    # The target's top probability at the step's first position reached confidence_p() (asked
    # on plain and lookup steps, not after a declined draft); None when not asked.
    target_sure: bool | None = None


class Policy:
    drafters: Sequence[Drafter] = ()

    def draft(
        self,
        tokens: list[int],
        k_cap: int,
        params: S.SamplingParams,
        rng: np.random.Generator,
        greedy_draft: bool,
    ) -> tuple[str, Proposal]:
        """The drafter that drafts this step ("none": plain decoding) and its proposal, of at
        most ``k_cap`` tokens."""
        raise NotImplementedError

    def observe(self, report: StepReport) -> None:
        """What the last step did: the engine reports each step once, here."""

    def confidence_p(self) -> float:
        """> 0: this step, if plain or lookup's, reports whether the target's top probability at
        its first position reached this (``StepReport.target_sure``); asked after each ``draft``."""
        return 0.0

    def prefill(self, tokens: list[int], defer_model: bool = False) -> None:
        """Bring the drafters to "all but the last token evaluated". ``defer_model``: a draft
        model only drops what it holds past the tokens it shares with ``tokens`` and reads the
        rest in ``catch_up``, which the engine calls once the first token is out."""
        for d in self.drafters:
            if defer_model and isinstance(d, DraftModel):
                d.prefill(tokens, evaluate=False)
            else:
                d.prefill(tokens)

    def model_reads_prompt(self) -> bool:
        """Whether a prefill would have a draft model read the prompt (time before the first
        token that the engine may defer: ``prefill(defer_model=True)``, then ``catch_up``)."""
        return any(isinstance(d, DraftModel) for d in self.drafters)

    def catch_up(self, tokens: list[int]) -> None:
        """A deferred prefill's rest: the draft model reads what it has not read of
        ``tokens[:-1]``, all of it (no window: it is the prompt the draft will copy from)."""
        for d in self.drafters:
            if isinstance(d, DraftModel):
                d.prefill(tokens)

    def rollback(self, valid_len: int) -> None:
        for d in self.drafters:
            d.rollback(valid_len)

    def reset(self) -> None:
        for d in self.drafters:
            d.reset()

    def finish(self, tokens: list[int]) -> None:
        for d in self.drafters:
            d.finish(tokens)

    def forget_lookup(self) -> None:
        """The lookup store was cleared (Engine.clear_store): drop what was learnt of it."""


class NoDraft(Policy):
    def draft(
        self,
        tokens: list[int],
        k_cap: int,
        params: S.SamplingParams,
        rng: np.random.Generator,
        greedy_draft: bool,
    ) -> tuple[str, Proposal]:
        return "none", EMPTY


class FixedPolicy(Policy):
    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.drafters = (drafter,)

    def draft(
        self,
        tokens: list[int],
        k_cap: int,
        params: S.SamplingParams,
        rng: np.random.Generator,
        greedy_draft: bool,
    ) -> tuple[str, Proposal]:
        return self.drafter.name, self.drafter.propose(tokens, k_cap, params, rng, greedy_draft)


class HybridPolicy(Policy):
    def __init__(self, lookup: Drafter, model: DraftModel, draft_max: int | None = None) -> None:
        self.lookup, self.model = lookup, model
        self.drafters = (lookup, model)
        self.draft_max = draft_max  # the draft model's K (lookup may be allowed more)

    def draft(
        self,
        tokens: list[int],
        k_cap: int,
        params: S.SamplingParams,
        rng: np.random.Generator,
        greedy_draft: bool,
    ) -> tuple[str, Proposal]:
        prop = self.lookup.propose(tokens, k_cap, params, rng, greedy_draft)
        if len(prop):
            return self.lookup.name, prop
        k = min(k_cap, self.draft_max) if self.draft_max else k_cap
        return self.model.name, self.model.propose(tokens, k, params, rng, greedy_draft)
