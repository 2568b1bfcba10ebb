"""Acceptance counters: per-position rates, accepted-length histogram, rolling window, timings."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    drafted: int = 0  # draft tokens that were verified
    accepted: int = 0
    target_passes: int = 0
    generated: int = 0
    per_position_drafted: list[int] = field(default_factory=list)
    per_position_accepted: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)  # [n] = passes that accepted n drafts
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    first_token_seconds: float = 0.0  # from the call to the first token out (time to first token)
    decode_seconds: float = 0.0
    llama_seconds: float = 0.0
    modes_used: Counter[str] = field(default_factory=Counter)
    draft_seconds: float = 0.0  # inside drafter.propose (draft model decodes + sampling)
    draft_steps: int = 0  # draft model decode steps (one per proposed token)
    verify_seconds: dict[int, float] = field(default_factory=dict)  # rows -> total pass time
    verify_counts: dict[int, int] = field(default_factory=dict)  # rows -> passes
    window: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=64))

    def record_pass(self, drafter: str, k: int, n_accepted: int) -> None:
        """One target pass that verified ``k`` draft tokens and accepted the first ``n_accepted``."""
        self.target_passes += 1
        self.drafted += k
        self.accepted += n_accepted
        if len(self.per_position_drafted) < k:
            grow = k - len(self.per_position_drafted)
            self.per_position_drafted += [0] * grow
            self.per_position_accepted += [0] * grow
        for i in range(k):
            self.per_position_drafted[i] += 1
        for i in range(n_accepted):
            self.per_position_accepted[i] += 1
        if len(self.histogram) <= n_accepted:
            self.histogram += [0] * (n_accepted + 1 - len(self.histogram))
        self.histogram[n_accepted] += 1
        self.modes_used[f"{drafter}:{k}" if k else "none:0"] += 1
        if k:
            self.window.append((k, n_accepted))

    def record_timing(self, rows: int, verify_s: float, draft_s: float, draft_steps: int) -> None:
        self.verify_seconds[rows] = self.verify_seconds.get(rows, 0.0) + verify_s
        self.verify_counts[rows] = self.verify_counts.get(rows, 0) + 1
        self.draft_seconds += draft_s
        self.draft_steps += draft_steps

    def costs(self) -> dict[str, object]:
        """Measured costs for the cost model: mean target pass time per batch size, mean draft
        step time, both in seconds."""
        return {
            "verify_seconds_by_rows": {
                r: self.verify_seconds[r] / self.verify_counts[r]
                for r in sorted(self.verify_counts)
            },
            "draft_step_seconds": self.draft_seconds / self.draft_steps
            if self.draft_steps
            else None,
        }

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def window_acceptance_rate(self) -> float:
        d = sum(k for k, _ in self.window)
        return sum(a for _, a in self.window) / d if d else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.generated / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def per_position_acceptance(self) -> list[float]:
        return [
            a / d if d else 0.0
            for a, d in zip(self.per_position_accepted, self.per_position_drafted, strict=True)
        ]

    def to_dict(self) -> dict[str, object]:
        overhead = max(0.0, self.decode_seconds - self.llama_seconds)
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "target_passes": self.target_passes,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance()],
            "accepted_length_histogram": list(self.histogram),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "llama_seconds": round(self.llama_seconds, 4),
            "overhead_fraction": round(overhead / self.decode_seconds, 4)
            if self.decode_seconds > 0
            else 0.0,
            "tokens_per_second": round(self.tokens_per_second, 2),
            "prefill_tokens": self.prefill_tokens,
            "first_token_seconds": round(self.first_token_seconds, 4),
            "modes_used": dict(sorted(self.modes_used.items())),
        }
