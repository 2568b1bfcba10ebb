"""Prompt lookup decoding over n-grams: the drafter before the suffix drafter (suffix.py), kept
for comparisons (``SpecConfig(lookup_kind="ngram")``) and for its format-1 cache files
(``--lookup-kind ngram``). suffix.LookupFile does not migrate them: given to the suffix drafter,
a format-1 file is refused with a one-line error and left as it is.

``NgramIndex`` maps every n-gram of the token history (n in [n_min, n_max]) to the position
right after its most recent occurrence. It is updated with each accepted token in O(n_max)
(no scan of the history), so proposing costs a few dict lookups per step.

``NgramCache`` is the optional persistent store (``--lookup-cache FILE``): follower counts per
n-gram gathered across runs, as llama.cpp's lookup tool keeps them, saved atomically.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from specrun.decoding import sampling as S
from specrun.decoding.drafters import EMPTY, BaseDrafter, Proposal
from specrun.errors import SpecrunError
from specrun.paths import write_json_atomic


class NgramIndex:
    def __init__(self, n_min: int = 1, n_max: int = 4) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}

    def reset(self) -> None:
        self.tokens = []
        self._last = {}

    def extend(self, new: list[int]) -> None:
        """Append accepted tokens; index each n-gram that now has a follower (from one token
        up, whatever ``n_min``: the engine sets it per mode, and a server's requests change mode)."""
        toks = self.tokens
        last = self._last
        lo, hi = 1, self.n_max
        for tok in new:
            i = len(toks)  # the new token's position: it follows the n-grams ending at i - 1
            for n in range(lo, min(hi, i) + 1):
                last[tuple(toks[i - n : i])] = i
            toks.append(tok)

    def sync(self, tokens: list[int], full_check: bool = False) -> None:
        """Make the index cover ``tokens``. Between prefills the engine only appends, so the
        cheap check (length and last indexed token) suffices; a prefill checks the whole prefix."""
        n = len(self.tokens)
        grew = len(tokens) >= n and (n == 0 or tokens[n - 1] == self.tokens[n - 1])
        if grew and full_check:
            grew = tokens[:n] == self.tokens
        if grew:
            self.extend(tokens[n:])
        else:
            self.reset()
            self.extend(tokens)

    def match(self) -> tuple[int, int]:
        """(match length, position of the follower) of the longest suffix n-gram seen before,
        most recent occurrence; (0, -1) when none."""
        toks = self.tokens
        L = len(toks)
        for n in range(min(self.n_max, L), self.n_min - 1, -1):
            j = self._last.get(tuple(toks[L - n :]))
            if j is not None:
                return n, j
        return 0, -1

    def propose(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the longest matching suffix; and the match length."""
        n, j = self.match()
        if n == 0 or k <= 0:
            return [], 0
        return self.tokens[j : j + k], n


class NgramCache:
    """Persistent n-gram -> follower counts, merged across runs."""

    VERSION = 1

    def __init__(self, path: Path | None, n: int = 3, max_entries: int = 500_000) -> None:
        self.path = path
        self.n = n
        self.max_entries = max_entries
        self.counts: dict[tuple[int, ...], Counter[int]] = {}
        if path is not None and path.exists():
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("version") != self.VERSION or int(data.get("n", 0)) != self.n:
                raise ValueError("unknown format")
            for key, followers in data["ngrams"].items():
                self.counts[tuple(int(x) for x in key.split())] = Counter(
                    {int(t): int(c) for t, c in followers.items()}
                )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SpecrunError(
                f"lookup cache {path} is unreadable ({exc}); remove it or pick another file"
            ) from None

    def add(self, tokens: list[int]) -> None:
        n = self.n
        for i in range(n, len(tokens)):
            key = tuple(tokens[i - n : i])
            c = self.counts.get(key)
            if c is None:
                c = self.counts[key] = Counter()
            c[tokens[i]] += 1

    def propose(self, tokens: list[int], k: int, min_count: int = 2) -> list[int]:
        """Chain the most frequent followers while they are frequent enough."""
        out: list[int] = []
        ctx = list(tokens[-self.n :])
        while len(out) < k and len(ctx) == self.n:
            c = self.counts.get(tuple(ctx))
            if not c:
                break
            tok, cnt = c.most_common(1)[0]
            if cnt < min_count:
                break
            out.append(tok)
            ctx = ctx[1:] + [tok]
        return out

    def save(self) -> None:
        """Write atomically: a crash mid-save leaves the previous file intact."""
        if self.path is None:
            return
        items = list(self.counts.items())
        if len(items) > self.max_entries:
            items = sorted(items, key=lambda kv: -sum(kv[1].values()))[: self.max_entries]
        data = {
            "version": self.VERSION,
            "n": self.n,
            "ngrams": {" ".join(map(str, k)): {str(t): c for t, c in v.items()} for k, v in items},
        }
        write_json_atomic(self.path, data)


class PromptLookup(BaseDrafter):
    """Drafter over the context's own n-grams (and, optionally, a persistent n-gram cache).

    Proposals are deterministic (``dists=None``): under sampling the engine accepts a proposed
    token x with probability p(x), the exact rule for a one-hot proposal.
    """

    name = "lookup"

    def __init__(self, n_min: int = 1, n_max: int = 4, cache: NgramCache | None = None) -> None:
        self.index = NgramIndex(n_min, n_max)
        self.cache = cache
        self.last_match = 0  # match length of the last proposal (the controller keys on it)

    @property
    def n_min(self) -> int:
        """The shortest n-gram matched (--lookup-min)."""
        return self.index.n_min

    def fit(self, n_min: int, auto: bool) -> None:
        """The shortest n-gram matched for a mode (as SuffixLookup.fit; nothing else varies)."""
        if not 1 <= n_min <= self.index.n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {self.index.n_max}")
        self.index.n_min = n_min

    def bucket(self) -> str:
        """Each match length up to --lookup-max on its own."""
        return str(max(1, min(self.last_match, self.index.n_max)))

    def reset(self) -> None:
        self.index.reset()

    def prefill(self, tokens: list[int]) -> int:
        self.index.sync(tokens, full_check=True)
        return 0

    def propose(
        self,
        tokens: list[int],
        k: int,
        params: S.SamplingParams,
        rng: np.random.Generator,
        greedy_draft: bool,
    ) -> Proposal:
        self.index.sync(tokens)
        out, n = self.index.propose(k)
        if not out and self.cache is not None:
            out = self.cache.propose(tokens, k)
            n = self.cache.n if out else 0
        self.last_match = n
        return Proposal(out, None) if out else EMPTY

    def finish(self, tokens: list[int]) -> None:
        """End of a generation: fold its n-grams into the persistent cache and save it."""
        if self.cache is not None:
            self.cache.add(tokens)
            self.cache.save()
