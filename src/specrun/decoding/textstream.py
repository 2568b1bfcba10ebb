"""Token bytes -> printable text, safely: UTF-8 split across tokens, stop strings split across
tokens. Nothing past a stop string is ever released."""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    """Feed token pieces (bytes); get back text that is safe to print now.

    Text that might be the start of a stop string is held back until the next piece decides it;
    an incomplete UTF-8 sequence is held back by the incremental decoder.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._held = ""  # decoded, not yet released
        self.text = ""  # released so far
        self.stopped = False

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the newly releasable text ("" if none)."""
        if self.stopped:
            return ""
        self._held += self._decoder.decode(piece)
        return self._release(final=False)

    def flush(self) -> str:
        """End of generation: release what is held (a stop string never completed)."""
        if self.stopped:
            return ""
        self._held += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        held = self._held
        if self._stop:
            cut = min((i for i in (held.find(s) for s in self._stop) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                out = held[:cut]
                self._held = ""
                self.text += out
                return out
            if not final:
                keep = _longest_stop_prefix_suffix(held, self._stop)
                out = held[: len(held) - keep]
                self._held = held[len(held) - keep :]
                self.text += out
                return out
        self._held = ""
        self.text += held
        return held


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
