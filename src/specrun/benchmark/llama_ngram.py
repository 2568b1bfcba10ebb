"""llama.cpp's own n-gram drafters, ported line for line for bench/suffix_sim.py's replays (kept
here, in the package, so that the script imports it as any module).

What llama-server runs for ``--spec-type ngram-cache`` and ``--spec-type ngram-mod`` (the
llama.cpp that llama-cpp-python 0.3.36 vendors: common/ngram-cache.cpp, common/ngram-mod.cpp,
common/speculative.cpp), with llama-server's defaults, as drafters with specrun's interface, so
that a replay over recorded greedy runs compares them with specrun's drafters token for token,
free of the machine's timing noise. One instance is one llama-server slot: its state lives as
long as the server (server_compare starts one per ``bench:`` request and one per ``seq:``
sequence), and it is not told about new requests beyond what the server tells it (``begin``).

Deliberately kept quirks of the originals (they decide what the servers propose):
- ngram-cache adds each chunk of new tokens to its context cache on its own, so n-grams that
  straddle two chunks (the end of one pass's tokens and the start of the next) are never counted;
  it drafts at most 8 tokens (``n_draft = 8``, hard-coded in create_state_ngram_cache); its
  static and dynamic caches are empty (llama-server loads none unless given files); it only adds
  tokens past the longest context it has seen, so a shorter new prompt is not added at all.
- ngram-mod keys a 4M-entry table by a hash of the last 24 tokens (``n_match``), proposes only
  when it can chain at least 48 tokens (``n_min``; up to 64, ``n_max``), adds new context in
  chunks of 32+ tokens, and clears its table after 5 passes in a row that accept under a quarter.
"""

from __future__ import annotations

from specrun.decoding.drafters import EMPTY, Proposal

NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2
MIN_SAMPLE_LAX = (2, 2, 1, 1)
MIN_PERCENT_LAX = (66, 50, 50, 50)


def _cache_update(cache: dict, inp: list[int], nnew: int) -> None:
    """common_ngram_cache_update(cache, 1, 4, inp, nnew)."""
    size = len(inp)
    for n in range(NGRAM_MIN, NGRAM_MAX + 1):
        for i in range(max(size - nnew, n), size):
            part = cache.setdefault(tuple(inp[i - n : i]), {})
            part[inp[i]] = part.get(inp[i], 0) + 1


class LlamaNgramCache:
    """``--spec-type ngram-cache``: 1-4-gram follower counts over the context."""

    name = "lookup"
    N_DRAFT = 8

    def __init__(self) -> None:
        self.cache: dict[tuple[int, ...], dict[int, int]] = {}
        self.cache_size = 0

    def prefill(self, tokens: list[int]) -> int:
        return 0  # begin() is a no-op

    def reset(self) -> None:
        """A new request on the same server: nothing is cleared."""

    def rollback(self, valid_len: int) -> None:
        pass

    def _try(self, ctx: list[int]) -> int | None:
        # try_draft over the context cache: the longest n-gram first, lax thresholds
        for i in range(NGRAM_MAX - NGRAM_MIN, -1, -1):
            n = i + NGRAM_MIN
            if len(ctx) < n:
                continue
            part = self.cache.get(tuple(ctx[-n:]))
            if part is None:
                continue
            best_tok, best_c, total = None, 0, 0
            for tok, c in part.items():  # static cache empty: each count times 1
                if c > best_c:
                    best_tok, best_c = tok, c
                total += c
            if total < MIN_SAMPLE_LAX[i] or 100 * best_c < MIN_PERCENT_LAX[i] * total:
                continue
            return best_tok
        return None

    def propose(self, tokens, k, params, rng, greedy_draft):  # type: ignore[no-untyped-def]
        # draft_one: ``prompt`` is tokens[:-1], ``id_last`` tokens[-1]
        if self.cache_size < len(tokens):
            new = tokens[self.cache_size :]
            _cache_update(self.cache, new, len(new))
            self.cache_size = len(tokens)
        if len(tokens) < NGRAM_STATIC:
            return EMPTY
        ctx = list(tokens)
        draft: list[int] = []
        while len(draft) < min(k, self.N_DRAFT):
            tok = self._try(ctx)
            if tok is None:
                break
            draft.append(tok)
            ctx.append(tok)
        return Proposal(draft, None) if draft else EMPTY


class LlamaNgramMod:
    """``--spec-type ngram-mod``: a hashed table from the last 24 tokens to the next one."""

    name = "lookup"
    N_MATCH, N_MAX, N_MIN, SIZE = 24, 64, 48, 4 * 1024 * 1024

    def __init__(self) -> None:
        self.entries: dict[int, int] = {}  # sparse: a missing index is EMPTY
        self.i_last = 0
        self.n_draft_last = 0
        self.n_low = 0

    def _idx(self, toks: list[int]) -> int:
        res = 0
        for t in toks:
            res = (res * 6364136223846793005 + t) & 0xFFFFFFFFFFFFFFFF  # size_t arithmetic
        return res % self.SIZE

    def _add(self, ctx: list[int], i: int) -> None:
        self.entries[self._idx(ctx[i : i + self.N_MATCH])] = ctx[i + self.N_MATCH]

    def prefill(self, tokens: list[int]) -> int:
        # begin(prompt)
        self.i_last = 0
        self.n_draft_last = 0
        n = self.N_MATCH
        if len(tokens) < n:
            return 0
        for i in range(len(tokens) - n):
            self._add(tokens, i)
        self.i_last = len(tokens) - n
        if len(self.entries) / self.SIZE > 0.25:
            self.entries.clear()
        return 0

    def reset(self) -> None:
        pass

    def rollback(self, valid_len: int) -> None:
        pass

    def accepted(self, n_accepted: int) -> None:
        """accept(): after each verify pass, with how many drafted tokens the target took."""
        if self.n_draft_last > 0:
            if n_accepted / self.n_draft_last < 0.25:
                self.n_low += 1
                if self.n_low >= 5:
                    self.entries.clear()
                    self.n_low = 0
                    self.i_last = 0
            else:
                self.n_low = 0

    def propose(self, tokens, k, params, rng, greedy_draft):  # type: ignore[no-untyped-def]
        prompt = tokens[:-1]
        self.n_draft_last = 0
        n = self.N_MATCH
        cur_len = len(prompt)
        if cur_len < n:
            return EMPTY
        if self.i_last + 32 < cur_len:
            for i in range(self.i_last, cur_len - n):
                self._add(prompt, i)
            self.i_last = cur_len - n
        result = list(tokens[-n:])
        for i in range(self.N_MAX):
            tok = self.entries.get(self._idx(result[i : i + n]))
            if tok is None:
                if i < self.N_MIN:
                    return EMPTY
                break
            result.append(tok)
        draft = result[n:]
        self.n_draft_last = len(draft)
        return Proposal(draft[:k], None) if draft else EMPTY
