"""What the user sees: streamed text on stdout, statistics on stderr. Consumes engine events;
never touches model state."""

from __future__ import annotations

import sys
from typing import TextIO

from .engine import Result, Step


class PlainStream:
    """Text to stdout as it is committed; nothing else. Used when stdout is not a terminal too."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout

    def step(self, ev: Step) -> None:
        if ev.text:
            self.out.write(ev.text)
            self.out.flush()

    def finish(self, result: Result) -> None:
        if result.text and not result.text.endswith("\n") and self.out.isatty():
            self.out.write("\n")
        self.out.flush()


def summary_line(result: Result, draft_max: int | None = None) -> str:
    s = result.stats
    parts = [
        f"{s.generated} tokens in {s.decode_seconds:.2f} s ({s.tokens_per_second:.1f} tok/s)",
        f"prefill {s.prefill_tokens} tokens in {s.prefill_seconds:.2f} s",
        f"mode {result.mode}" + (f" K={draft_max}" if draft_max and result.mode != "none" else ""),
    ]
    if s.drafted:
        parts.append(
            f"acceptance {100 * s.acceptance_rate:.1f}% ({s.accepted}/{s.drafted})"
            f", {s.mean_accepted_length:.2f} tokens/pass"
        )
    parts.append(f"finish {result.finish_reason}")
    parts.append(f"seed {result.seed}")
    return "specrun: " + ", ".join(parts)
