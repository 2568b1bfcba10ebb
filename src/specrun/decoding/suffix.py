"""Suffix drafting: the longest earlier match of the current tokens, in this text and in earlier ones.

``SuffixAutomaton`` is the suffix automaton of a token sequence, built online (amortized O(1)
states and transitions per token), with each state's occurrence count (``cnt``: how many times
its strings end in the text). A *matcher* ``(state, length)`` follows the text: fed each new
token it moves to the longest suffix of the tokens so far that occurred before, in O(1)
amortized (suffix-link fallback). No n-gram length limit.

``SuffixStore`` holds earlier sequences (the outputs of earlier requests: chat turns, ``-N``,
repeated tasks) in one automaton, bounded in tokens (the oldest sequences are evicted, the
automaton rebuilt, which amortizes to O(1) per stored token), optionally kept in a file
(``--lookup-cache``), atomically written, keyed by the target's vocabulary.

``SuffixLookup`` is the drafter: it matches the current tokens (prompt + output) against both
automata, follows each match's most frequent continuation (counts, not the most recent
occurrence) while the path's estimated probability holds, for as many tokens as the match length
and the continuation's support allow, and proposes the candidate with the most expected accepted
tokens. Proposals are deterministic (``dists=None``), as prompt lookup's.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from specrun.decoding import sampling as S
from specrun.decoding.drafters import EMPTY, BaseDrafter, Proposal
from specrun.decoding.target import Target
from specrun.errors import SpecrunError
from specrun.paths import write_json_atomic

SEP = -1  # between stored sequences: never fed to a matcher, so never matched, ends a walk
# The occurrence count of a new end position goes to the new state and its suffix-link
# ancestors; text that repeats one token (or line) over and over makes that chain long, so the
# walk stops after this many states: counts of the shortest contexts are then lower bounds.
COUNT_DEPTH = 48


class SuffixAutomaton:
    """Parallel lists, one entry per state; state 0 is the root (the empty string)."""

    __slots__ = ("nxt", "link", "len", "cnt", "last", "n")

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.nxt: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.len: list[int] = [0]
        self.cnt: list[int] = [0]
        self.last = 0
        self.n = 0  # tokens added
        for t in tokens:
            self.extend(t)

    def extend(self, tok: int) -> None:
        nxt, link, ln, cnt = self.nxt, self.link, self.len, self.cnt
        cur = len(ln)
        ln.append(ln[self.last] + 1)
        link.append(0)
        nxt.append({})
        cnt.append(0)
        p = self.last
        while p != -1 and tok not in nxt[p]:
            nxt[p][tok] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][tok]
            if ln[p] + 1 == ln[q]:
                link[cur] = q
            else:
                clone = len(ln)
                ln.append(ln[p] + 1)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                cnt.append(cnt[q])
                while p != -1 and nxt[p].get(tok) == q:
                    nxt[p][tok] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self.last = cur
        self.n += 1
        s, depth = cur, 0
        while s > 0 and depth < COUNT_DEPTH:
            cnt[s] += 1
            s = link[s]
            depth += 1

    def step(self, state: int, length: int, tok: int) -> tuple[int, int]:
        """The matcher after ``tok``: the longest suffix (of what it matched, plus ``tok``) that
        occurs in this automaton's text; (0, 0) when ``tok`` never occurred."""
        nxt, link, ln = self.nxt, self.link, self.len
        while state and tok not in nxt[state]:
            state = link[state]
            length = ln[state]
        t = nxt[state].get(tok)
        if t is None:
            return 0, 0
        return t, length + 1

    def settle(self, state: int, length: int) -> int:
        """After an ``extend`` that split ``state`` (a clone took its shorter strings), the state
        that now holds the match of ``length``."""
        link, ln = self.link, self.len
        while state > 0 and length <= ln[link[state]]:
            state = link[state]
        return state

    def walk(self, state: int, k: int, min_prob: float) -> tuple[list[int], list[float], int]:
        """The most frequent continuation of the match at ``state``: up to ``k`` tokens while the
        path's estimated probability (product of each step's count share) stays >= min_prob.
        Returns (tokens, the path probability after each, the first step's support)."""
        nxt, cnt = self.nxt, self.cnt
        out: list[int] = []
        probs: list[float] = []
        support = 0
        p = 1.0
        if min_prob > 1.0:  # no path is that likely (a caller's floor over a share: suffix_sim)
            return out, probs, support
        while len(out) < k:
            children = nxt[state]
            if len(children) == 1:
                # One continuation (most steps of a long match: 16-token walks from states with
                # one child were half of auto's walks over the builtin suite): its share is 1,
                # the path's probability stays what it was (>= min_prob, checked above and below).
                ((best_tok, state),) = children.items()
                if best_tok < 0 or cnt[state] <= 0:
                    break
                if not out:
                    support = cnt[state]
                out.append(best_tok)
                probs.append(p)
                continue
            if not children:
                break
            best_tok, best_s, best_c, total = 0, -1, -1, 0
            for tok, s in children.items():
                c = cnt[s]
                total += c
                if c >= best_c:  # ties: the later transition (more recent text)
                    best_tok, best_s, best_c = tok, s, c
            if best_tok < 0 or total <= 0:
                break
            p *= best_c / total
            if p < min_prob:
                break
            if not out:
                support = best_c
            out.append(best_tok)
            probs.append(p)
            state = best_s
        return out, probs, support


class SuffixStore:
    """Earlier sequences in one automaton, bounded to ``max_tokens`` (oldest evicted)."""

    def __init__(self, max_tokens: int = 65536) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.max_tokens = max_tokens
        self.seqs: deque[list[int]] = deque()
        self.total = 0
        self.sam = SuffixAutomaton()
        self.version = 0  # bumped on every change: matchers over the store re-sync

    def __len__(self) -> int:
        return len(self.seqs)

    def clear(self) -> None:
        self.seqs.clear()
        self.total = 0
        self.sam = SuffixAutomaton()
        self.version += 1

    def add(self, seq: list[int]) -> None:
        if not seq:
            return
        seq = list(seq[-self.max_tokens :])
        self.seqs.append(seq)
        self.total += len(seq)
        self.version += 1
        if self.total > self.max_tokens:
            # Evict down to 3/4 of the bound, so that rebuilds are rare (amortized O(1) a token).
            while len(self.seqs) > 1 and self.total > self.max_tokens * 3 // 4:
                self.total -= len(self.seqs.popleft())
            self._rebuild()
            return
        self._append(seq)

    def _append(self, seq: list[int]) -> None:
        if self.sam.n:
            self.sam.extend(SEP)
        for t in seq:
            self.sam.extend(t)

    def _rebuild(self) -> None:
        self.sam = SuffixAutomaton()
        for s in self.seqs:
            self._append(s)


class LookupFile:
    """The ``--lookup-cache`` file: stored sequences per target vocabulary, written atomically.

    Format 2: ``{"format": "specrun-lookup", "version": 2, "vocabs": {KEY: [[tok, ...], ...]}}``.
    A format-1 file (n-gram follower counts: ``lookup.NgramCache``, ``--lookup-kind ngram``) and
    anything else are refused with a one-line error (the file is left as it is).
    """

    FORMAT, VERSION = "specrun-lookup", 2

    def __init__(self, path: Path, vocab: str) -> None:
        self.path = path
        self.vocab = vocab
        self.vocabs: dict[str, list[list[int]]] = {}
        if path.exists():
            self._load()

    def _refuse(self, why: str) -> SpecrunError:
        return SpecrunError(
            f"lookup cache {self.path} is unreadable ({why}); remove it or pick another file"
        )

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise self._refuse(
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            ) from None
        if not isinstance(data, dict):
            raise self._refuse("not a JSON object")
        if data.get("version") == 1 and "ngrams" in data:
            raise SpecrunError(
                f"lookup cache {self.path} is an old-format file (the n-gram counts of "
                "--lookup-kind ngram): delete it or pick another file"
            )
        try:
            if data.get("format") == self.FORMAT and data.get("version") == self.VERSION:
                for key, seqs in data["vocabs"].items():
                    self.vocabs[str(key)] = [[int(t) for t in s] for s in seqs]
            else:
                raise ValueError("unknown format")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise self._refuse(str(exc) or type(exc).__name__) from None

    def sequences(self) -> list[list[int]]:
        return self.vocabs.get(self.vocab, [])

    def save(self, seqs: Iterable[list[int]]) -> None:
        """Write atomically: a crash mid-save leaves the previous file intact."""
        self.vocabs[self.vocab] = [list(s) for s in seqs]
        data = {"format": self.FORMAT, "version": self.VERSION, "vocabs": self.vocabs}
        write_json_atomic(self.path, data)


def vocab_key(model: Target) -> str:
    """The target's vocabulary, as a short key: its size and a hash of a sample of token texts
    (a store of token ids means nothing under another vocabulary)."""
    n = int(model.n_vocab)
    h = hashlib.sha1(str(n).encode())
    if n:
        for t in range(0, n, max(1, n // 512)):
            h.update(model.token_text(t))
            h.update(b"\0")
    return f"{n}-{h.hexdigest()[:16]}"


class SuffixLookup(BaseDrafter):
    """The suffix drafter (``--mode lookup``, and lookup's part in ``hybrid`` and ``auto``).

    The current sequence's automaton holds only accepted tokens (the engine's token list), so a
    rejected draft needs no undo; it is rebuilt when the token list is not an extension of what
    it holds (a new, unrelated prompt). The store survives ``reset`` (a new request in the same
    process) and takes each generation's output at ``finish``.
    """

    name = "lookup"
    store: SuffixStore
    K_MAX = 16  # longest proposal (the engine's cap for lookup: max(--draft-max, this))
    # Stop a walk where its path probability (the product of each step's count share) falls
    # below this (``min_prob``; the engine sets it by mode, ``fit``): --mode lookup verifies what
    # it is given; auto, which prices what it proposes and chooses its own K, walks further.
    # The replays that set both: docs/auto.md.
    MIN_PROB = 0.6
    MIN_PROB_AUTO = 0.5

    def __init__(
        self,
        n_min: int = 1,
        bucket_max: int = 4,
        k_max: int = K_MAX,
        store: SuffixStore | None = None,
        file: LookupFile | None = None,
    ) -> None:
        if n_min < 1 or bucket_max < 1:
            raise ValueError(f"need n_min >= 1 and bucket_max >= 1, got {n_min}, {bucket_max}")
        self.n_min, self.bucket_max, self.k_max = n_min, bucket_max, k_max
        self.min_prob = self.MIN_PROB
        self.store = store if store is not None else SuffixStore()
        self.file = file
        if file is not None:
            for s in file.sequences():
                self.store.add(s)
        self.last_match = 0  # match length of the last proposal
        self.last_support = 0  # occurrences of its first token after the match
        self.last_source = ""  # "seq" or "store"
        self._clear()

    def _clear(self) -> None:
        self.tokens: list[int] = []
        self.sam = SuffixAutomaton()
        self.cur = (0, 0)  # matcher over the current sequence (matches end before its last token)
        self.st = (0, 0)  # matcher over the store
        self._store_version = self.store.version
        self.n_prompt = 0

    def reset(self) -> None:
        """A new, unrelated text: forget the current sequence, keep the store."""
        self._clear()

    def _extend(self, new: list[int]) -> None:
        sam, store = self.sam, self.store.sam
        (cs, cl), (ss, sl) = self.cur, self.st
        toks = self.tokens
        for t in new:
            cs, cl = sam.step(cs, cl, t)  # against the tokens before t
            sam.extend(t)
            cs = sam.settle(cs, cl)
            ss, sl = store.step(ss, sl, t)
            toks.append(t)
        self.cur, self.st = (cs, cl), (ss, sl)

    def sync(self, tokens: list[int], full_check: bool = False) -> None:
        """Make the automaton cover ``tokens`` (as NgramIndex.sync): between prefills the engine
        only appends; a prefill checks the whole prefix; a changed store re-matches it."""
        if self._store_version != self.store.version:
            keep = self.tokens
            self._clear()
            self._extend(keep)
        n = len(self.tokens)
        grew = len(tokens) >= n and (n == 0 or tokens[n - 1] == self.tokens[n - 1])
        if grew and full_check:
            grew = tokens[:n] == self.tokens
        if not grew:
            self._clear()
            n = 0
        self._extend(list(tokens[n:]))

    def prefill(self, tokens: list[int]) -> int:
        self.sync(tokens, full_check=True)
        self.n_prompt = len(tokens)
        return 0

    def fit(self, n_min: int, auto: bool) -> None:
        """The shortest match (--lookup-min) and the walk's floor for a mode: auto, which prices
        what it proposes, walks further (MIN_PROB_AUTO)."""
        if n_min < 1:
            raise ValueError(f"need n_min >= 1, got {n_min}")
        self.n_min = n_min
        self.min_prob = self.MIN_PROB_AUTO if auto else self.MIN_PROB

    def _cap(self, match: int, support: int) -> int:
        """How far a match of this length and support may be followed: as many tokens as it
        matched; twice that (and two) when its continuation was seen 4+ times (docs/auto.md)."""
        return max(1, match + (match + 2 if support >= 4 else 0))

    def candidates(self, k: int) -> list[tuple[float, int, str, list[int], int]]:
        """(expected accepted, match length, source, tokens, support) per matching automaton."""
        out = []
        for src, sam, (state, length) in (
            ("seq", self.sam, self.cur),
            ("store", self.store.sam, self.st),
        ):
            if length < self.n_min or state == 0:
                continue
            toks, probs, support = sam.walk(state, k, self.min_prob)
            cap = min(k, self._cap(length, support))
            toks, probs = toks[:cap], probs[:cap]
            if toks:
                out.append((sum(probs), length, src, toks, support))
        return out

    def propose(
        self,
        tokens: list[int],
        k: int,
        params: S.SamplingParams,
        rng: np.random.Generator,
        greedy_draft: bool,
    ) -> Proposal:
        self.sync(tokens)
        k = min(k, self.k_max)
        cands = self.candidates(k) if k > 0 else []
        if not cands:
            self.last_match = self.last_support = 0
            self.last_source = ""
            return EMPTY
        score, length, src, toks, support = max(cands, key=lambda c: (c[0], c[1], c[2] == "seq"))
        self.last_match, self.last_support, self.last_source = length, support, src
        return Proposal(toks, None)

    def bucket(self) -> str:
        """The last proposal's match length as a pricing bucket: each length up to
        --lookup-max on its own, then doubling ranges (5-8, 9-16, 17+ for 4)."""
        m, b = self.last_match, self.bucket_max
        if m <= b:
            return str(m)
        lo = b
        while lo < 4 * b and m > 2 * lo:
            lo *= 2
        return f"{lo + 1}+" if lo >= 4 * b else f"{lo + 1}-{2 * lo}"

    def finish(self, tokens: list[int]) -> None:
        """End of a generation: its output joins the store (and the file, when one is kept)."""
        out = tokens[self.n_prompt :] if self.n_prompt <= len(tokens) else []
        if out:
            self.store.add(out)
        if self.file is not None:
            self.file.save(self.store.seqs)
