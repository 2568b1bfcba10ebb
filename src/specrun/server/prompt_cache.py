"""Earlier prompts' KV caches kept in memory, so that a server that switches between
conversations does not evaluate each again (llama-server's ``--cache-ram``).

The engine keeps one KV cache and reuses its longest common token prefix with the next prompt:
a conversation resent whole evaluates only its new tail. An editor or an agent interleaves
requests, though (the chat, a title or summary request, a sub-agent's own conversation), and
each switch used to throw the other conversation's cache away: the next turn of it evaluated its
whole prompt again. Before a request would drop a long stretch of what the target's cache
holds, that cache is copied here (``Model.save_state``); a request whose prompt shares a longer
prefix with a copy than with the live cache gets the copy put back first (``load_state``: bit
for bit what was computed, so the reply is what it would have been had the engine never
switched). The draft model's cache is copied with the target's (else it would read the whole
prompt again after the first token).

Bounded in bytes (least recently used out first); a copy that a newer one extends (the same
conversation, further on) is dropped for it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from specrun.chat import common_prefix
from specrun.errors import SpecrunError

MIN_TOKENS = 64  # a stretch shorter than this is cheaper to evaluate again than to copy


@dataclass
class Entry:
    tokens: tuple[int, ...]  # what the target's cache held
    data: bytes
    draft: Any = None  # DraftModel.save_state(), or None

    @property
    def size(self) -> int:
        return len(self.data) + (len(self.draft[1][1]) if self.draft is not None else 0)


class PromptCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes  # < 0: no limit
        self.entries: list[Entry] = []  # least recently used first
        self.bytes = 0
        self.saved = self.restored = 0  # copies made and put back (metrics, tests)
        self._lock = threading.Lock()  # the engine's thread writes; /metrics reads

    def prepare(self, engine: Any, prompt: list[int]) -> int:
        """Before ``engine`` generates from ``prompt``: copy what its target holds if the prompt
        would drop a long stretch of it, and put back the copy that shares the longest prefix
        with the prompt if that beats the live cache by MIN_TOKENS. The prefix the target now
        shares with the prompt."""
        target = engine.target
        held = target.cached
        live = common_prefix(held, prompt)
        with self._lock:
            best, best_n = None, live
            for e in self.entries:
                n = common_prefix(e.tokens, prompt)
                if n > best_n:
                    best, best_n = e, n
        if len(held) - live >= MIN_TOKENS:
            self._store(engine)
        if best is None or best_n - live < MIN_TOKENS:
            return live
        draft = engine.draft_model
        try:
            target.load_state(best.tokens, best.data)
            if draft is not None:
                if best.draft is not None:
                    draft.load_state(best.draft)
                else:
                    draft.reset()  # it reads the prompt after the first token
        except SpecrunError:  # a cache left empty: the prompt is evaluated whole
            if draft is not None:
                draft.reset()
            with self._lock:
                if best in self.entries:
                    self.entries.remove(best)
                    self.bytes -= best.size
            return common_prefix(target.cached, prompt)
        with self._lock:
            if best in self.entries:  # most recently used now
                self.entries.remove(best)
                self.entries.append(best)
            self.restored += 1
        return best_n

    def _store(self, engine: Any) -> None:
        target, draft = engine.target, engine.draft_model
        if len(target.cached) < MIN_TOKENS or self.budget == 0:
            return
        tokens, data = target.save_state()
        entry = Entry(tokens, data, draft.save_state() if draft is not None else None)
        if 0 <= self.budget < entry.size:
            return
        with self._lock:
            # A copy this one extends (or equals) is the same conversation, earlier: drop it.
            for e in [e for e in self.entries if tokens[: len(e.tokens)] == e.tokens]:
                self.entries.remove(e)
                self.bytes -= e.size
            while self.entries and 0 <= self.budget < self.bytes + entry.size:
                self.bytes -= self.entries.pop(0).size
            self.entries.append(entry)
            self.bytes += entry.size
            self.saved += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self.entries),
                "bytes": self.bytes,
                "saved": self.saved,
                "restored": self.restored,
            }
