"""The speculative loop: draft -> verify in one target pass -> accept -> roll back. Never prints.

Cache invariant (target and draft alike): between steps each cache holds every token of
``tokens`` except the last one, which is *pending*: the next target pass evaluates
``[pending, d1..dK]`` with logits on all K+1 rows, so row j scores the token after d_j.
After accepting n drafts and one target token t, both caches are cut back to the accepted
prefix (``llama_memory_seq_rm``) and t becomes the pending token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from specrun import defaults
from specrun.decoding import constraint as C
from specrun.decoding import penalties as P
from specrun.decoding import sampling as S
from specrun.decoding.auto import AutoPolicy
from specrun.decoding.drafters import EMPTY, Drafter, DraftModel, Proposal, _common_prefix
from specrun.decoding.lookup import NgramCache, PromptLookup
from specrun.decoding.policy import FixedPolicy, HybridPolicy, NoDraft, Policy, StepReport
from specrun.decoding.stats import SpecStats
from specrun.decoding.suffix import LookupFile, SuffixLookup, SuffixStore, vocab_key
from specrun.decoding.target import Target
from specrun.decoding.textstream import TextStream
from specrun.errors import SpecrunError, UsageError

MODES = ("auto", "draft", "lookup", "hybrid", "none")
VERIFY_RULES = ("rejection", "match")
LOOKUP_KINDS = ("suffix", "ngram")
MAX_DRAFT = 64  # longest draft; the contexts keep MAX_DRAFT + 1 rows of logits


@dataclass(frozen=True)
class SpecConfig:
    mode: str = defaults.MODE
    draft_max: int = defaults.DRAFT_MAX
    draft_min: int = defaults.DRAFT_MIN
    draft_p_min: float = defaults.DRAFT_P_MIN
    verify: str = (
        defaults.VERIFY
    )  # temp > 0: Leviathan/Chen rejection sampling, or sample-and-match
    lookup_min: int | None = None  # None: the mode's (defaults.LOOKUP_MIN, LOOKUP_MIN_AUTO)
    lookup_max: int = defaults.LOOKUP_MAX
    lookup_cache: str | None = None  # a file of earlier outputs kept across runs
    lookup_kind: str = defaults.LOOKUP_KIND  # suffix | ngram (defaults.py says which is which)
    lookup_draft_max: int = defaults.LOOKUP_DRAFT_MAX  # the suffix drafter's longest proposal
    lookup_store_tokens: int = 65536  # earlier outputs kept in memory (oldest evicted)

    def min_match(self, mode: str) -> int:
        """--lookup-min for ``mode``: as given, else the mode's default (no longer than
        --lookup-max)."""
        if self.lookup_min is not None:
            return self.lookup_min
        return min(
            defaults.LOOKUP_MIN_AUTO if mode == "auto" else defaults.LOOKUP_MIN, self.lookup_max
        )

    def validate(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 1 <= self.draft_max <= MAX_DRAFT:
            raise UsageError(f"--draft-max must be 1 to {MAX_DRAFT}, got {self.draft_max}")
        if self.draft_min < 0 or self.draft_min > self.draft_max:
            raise UsageError(f"--draft-min must be in [0, --draft-max], got {self.draft_min}")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise UsageError(f"--draft-p-min must be in [0, 1], got {self.draft_p_min}")
        if not 1 <= self.min_match(self.mode) <= self.lookup_max:
            raise UsageError(
                f"--lookup-min/--lookup-max must satisfy 1 <= min <= max, got {self.min_match(self.mode)}, {self.lookup_max}"
            )
        if self.lookup_kind not in LOOKUP_KINDS:
            raise UsageError(
                f"--lookup-kind must be one of {', '.join(LOOKUP_KINDS)}, got {self.lookup_kind!r}"
            )
        if not 1 <= self.lookup_draft_max <= MAX_DRAFT:
            raise UsageError(
                f"--lookup-draft-max must be 1 to {MAX_DRAFT}, got {self.lookup_draft_max}"
            )
        if self.verify not in VERIFY_RULES:
            raise UsageError(
                f"--verify must be one of {', '.join(VERIFY_RULES)}, got {self.verify!r}"
            )


@dataclass
class Step:
    """What one target pass committed."""

    tokens: list[int]
    from_draft: list[bool]  # True where the token was a draft token the target accepted
    text: str  # newly printable text (may be "" while a UTF-8 char or stop string is pending)
    drafter: str
    k: int  # draft tokens verified in this pass
    accepted: int
    stats: SpecStats
    probs: list[S.TokenProb] | None = None  # per token, where params.n_probs >= 0


@dataclass
class Result:
    text: str
    tokens: list[int]
    finish_reason: str  # "length" | "stop" | "eos"
    prompt_tokens: int
    stats: SpecStats
    seed: int = 0
    mode: str = "none"
    probs: list[S.TokenProb] | None = None  # per token, where params.n_probs >= 0


@dataclass
class _Run:
    tokens: list[int]
    n_prompt: int
    stream: TextStream
    stats: SpecStats = field(default_factory=SpecStats)
    finish: str | None = None
    probs: list[S.TokenProb] | None = None


M = TypeVar("M", bound=Target)


class Engine(Generic[M]):
    """Owns the target, the optional drafter, and the positions of both caches."""

    def __init__(self, target: M, draft: Target | None = None, config: SpecConfig | None = None):
        self.target = target
        self._probes: dict[str, int] | None = None  # single-character tokens (constraint.py)
        self._eog: list[int] | None = None  # end-of-generation tokens (ignore_eos)
        self.config = config or SpecConfig()
        self.config.validate()
        self.draft_model = DraftModel(draft, self.config.draft_p_min) if draft is not None else None
        self.mode = self.resolve_mode(self.config.mode)
        self.lookup: Drafter | None = None  # the lookup drafter, when the mode has one
        self.policy = self._make_policy(self.mode)
        self._fit_lookup(self.mode)
        self.k_cap = self._k_cap()  # longest draft any drafter of this engine may propose
        self._policies: dict[tuple[str, int], Policy] = {
            (self.mode, self.config.draft_max): self.policy
        }

    def _k_cap(self) -> int:
        if (
            self.lookup is not None
            and self.config.lookup_kind == "suffix"
            and self.mode != "draft"
            and self.mode != "none"
        ):
            return max(self.config.draft_max, self.config.lookup_draft_max)
        return self.config.draft_max

    def configure(self, **changes: Any) -> SpecConfig:
        """Change mode, draft_max, draft_min or draft_p_min between generations (a server's
        per-request ``speculative`` settings); returns the settings before, to pass back.

        The drafters stay, and so does what their caches hold (the next prefill reuses it); a
        policy is kept per (mode, draft_max), so auto's learned costs and acceptance outlive a
        request that asked for something else, and a new auto policy starts from the measured
        pass costs the first one was calibrated with."""
        old = self.config
        cfg = replace(old, **changes)
        if cfg == old:
            return old
        cfg.validate()
        mode = self.resolve_mode(cfg.mode)
        self.config = cfg
        key = (mode, cfg.draft_max)
        policy = self._policies.get(key)
        if policy is None:
            policy = self._make_policy(mode)
            seed = next((p for p in self._policies.values() if isinstance(p, AutoPolicy)), None)
            if isinstance(policy, AutoPolicy) and seed is not None:
                policy.calibrate(*seed._measured, refine=seed._refine)
            self._policies[key] = policy
        self.mode, self.policy = mode, policy
        self._fit_lookup(mode)
        if self.draft_model is not None:
            self.draft_model.p_min = cfg.draft_p_min
        self.k_cap = self._k_cap()
        return old

    # -- set-up ---------------------------------------------------------------------------
    def resolve_mode(self, mode: str) -> str:
        if mode == "auto":
            # Adaptive, never slower than the target alone by design; a target whose cache
            # cannot be rolled back cannot speculate at all.
            return "auto" if self.target.can_truncate else "none"
        if mode in ("draft", "hybrid") and self.draft_model is None:
            raise UsageError(f"--mode {mode} needs a draft model (-md PATH_OR_NAME or a --pair)")
        if mode != "none" and not self.target.can_truncate:
            raise SpecrunError(
                f"{self.target.path.name} is a recurrent or hybrid model whose cache cannot be "
                "rolled back: speculation is not possible; use --mode none"
            )
        return mode

    def _make_policy(self, mode: str) -> Policy:
        cfg = self.config
        lookup: PromptLookup | SuffixLookup | Drafter | None = None
        if mode in ("lookup", "hybrid", "auto") and self.lookup is not None:
            lookup = self.lookup  # one lookup drafter per engine: its store outlives a policy
        elif mode in ("lookup", "hybrid", "auto"):
            path = Path(cfg.lookup_cache).expanduser() if cfg.lookup_cache else None
            if cfg.lookup_kind == "ngram":
                lookup = PromptLookup(1, cfg.lookup_max, NgramCache(path) if path else None)
            else:
                # The store lives as long as the engine (one target, so one vocabulary): the
                # requests of one process share it; the file keys it by vocabulary.
                file = LookupFile(path, vocab_key(self.target)) if path else None
                lookup = SuffixLookup(
                    1,
                    cfg.lookup_max,
                    max(cfg.draft_max, cfg.lookup_draft_max),
                    SuffixStore(cfg.lookup_store_tokens),
                    file,
                )
        self.lookup = lookup or self.lookup
        if mode == "draft":
            assert self.draft_model is not None
            return FixedPolicy(self.draft_model)
        if mode == "lookup":
            assert lookup is not None
            return FixedPolicy(lookup)
        if mode == "hybrid":
            assert lookup is not None and self.draft_model is not None
            return HybridPolicy(lookup, self.draft_model, cfg.draft_max)
        if mode == "auto":
            return AutoPolicy(cfg.draft_max, lookup, self.draft_model, lookup_n_max=cfg.lookup_max)
        return NoDraft()

    def _fit_lookup(self, mode: str) -> None:
        """The engine's one lookup drafter, made for another mode maybe (a server's requests
        change it): its shortest match and walk for this one."""
        if self.lookup is not None:
            self.lookup.fit(self.config.min_match(mode), mode == "auto")

    def clear_store(self) -> None:
        """Forget the lookup store of earlier outputs (kept across ``reset``, in memory; the
        file, if any, is rewritten only at the next generation's end), and auto's estimates of
        lookup's acceptance (kept across ``reset`` at a fraction of their weight)."""
        if self.lookup is not None and self.lookup.store is not None:
            self.lookup.store.clear()
        self.policy.forget_lookup()  # what auto learnt of lookup's acceptance goes with it

    def reset(self) -> None:
        """Forget both caches (bench: every run starts cold). The lookup store of earlier
        outputs stays (``clear_store``)."""
        self.target.clear()
        if self.draft_model is not None:
            self.draft_model.reset()
        self.policy.reset()

    def check_prompt(self, prompt: Sequence[int]) -> None:
        n, ctx = len(prompt), self.target.n_ctx
        if n == 0:
            raise UsageError("the prompt is empty")
        if n >= ctx:
            raise SpecrunError(
                f"the prompt is {n} tokens but the context holds {ctx}: {n - ctx + 1} too many "
                f"(raise --ctx to at least {n + 1}, or shorten the prompt)"
            )

    # -- the loop -------------------------------------------------------------------------
    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int = 256,
        params: S.SamplingParams | None = None,
        stop: Sequence[str] = (),
        reuse_cache: bool = True,
        first_token_first: bool = True,
        constraint: C.Constraint | None = None,
    ) -> Iterator[Step | Result]:
        """Yield one ``Step`` per target pass, then the ``Result``. ``first_token_first``: the
        first pass is plain and the draft model reads the prompt after its Step (below); False:
        before the first pass, which may then be drafted (a test of the first position's
        distribution). ``constraint``: a grammar's state at the start of the output; every row
        the target scores is masked by it (constraint.py), and it advances by what is kept."""
        params = params or S.SamplingParams()
        self.check_prompt(prompt)
        if max_tokens < 0:
            raise UsageError(f"--max-tokens must be >= 0, got {max_tokens}")
        if not reuse_cache:
            self.reset()
        rng = np.random.Generator(np.random.PCG64(params.seed))
        run = _Run(tokens=list(prompt), n_prompt=len(prompt), stream=TextStream(stop))
        want_probs = params.n_probs >= 0
        if want_probs:
            run.probs = []
        row_probs: list[S.TokenProb] = []  # what _verify_rows reports of each token it returns
        if params.ignore_eos and self._eog is None:
            self._eog = P.eog_ids(self.target)
        st = run.stats
        target = self.target
        llama0 = self._llama_seconds()

        t0 = time.perf_counter()
        # The draft model reads the prompt after the first token is out, not before: that
        # token needs the target alone, so the first step is plain and the draft model's
        # prefill (catch_up) follows its Step. Time to first token is then the target's
        # prefill and one row; the draft's reading still counts as prefill in the stats.
        deferred = first_token_first and self.policy.model_reads_prompt()
        # Prompt tokens this generation evaluates: the prefill plus the pending last token,
        # which the first target pass evaluates (a reused cache makes this the new turn only).
        st.prefill_tokens = self._prefill(run.tokens, deferred) + 1
        st.prefill_seconds = time.perf_counter() - t0
        llama_prefill = self._llama_seconds() - llama0

        greedy = params.greedy
        match = not greedy and self.config.verify == "match"
        draft_max = self.k_cap
        draft_min = self.config.draft_min
        eog = target.is_eog
        piece = target.piece
        native = target.top_prob_fn  # the sureness check in C (llama/native.py)
        policy = self.policy
        # A pass shared with other sequences (serve --parallel): the policy is told what this
        # sequence's step cost in compute (its llama seconds: its own drafting, its share of the
        # pass), not the wall time, which carries the other slots' rows and drafting.
        shared = target.shared
        own = self._llama_seconds
        t_decode = time.perf_counter()
        try:
            while run.finish is None:
                n_gen = len(run.tokens) - run.n_prompt
                remaining = max_tokens - n_gen
                if remaining <= 0:
                    run.finish = "length"
                    break
                base = len(run.tokens)
                if base > target.n_ctx:  # the pending token has no position left
                    run.finish = "length"
                    break
                # Never verify more than can be emitted or than the context holds.
                k = 0 if deferred else min(draft_max, remaining - 1, target.n_ctx - base)
                name, prop = "none", EMPTY
                t_step = time.perf_counter()
                l_step = own() if shared else 0.0
                declined = None
                if k > 0 and constraint is not None and self.mode != "none":
                    prop = self._forced(constraint, k)
                    name = "forced" if prop.tokens else "none"
                if k > 0 and not prop.tokens:
                    name, prop = policy.draft(run.tokens, k, params, rng, greedy or match)
                    if len(prop) < max(draft_min, 1):
                        declined = name if name != "none" else None
                        name, prop = "none", EMPTY
                t_verify = time.perf_counter()
                l_verify = own() if shared else 0.0
                row_probs.clear()
                n_acc, new = self._verify(
                    run.tokens, prop, params, rng, greedy, match, constraint, row_probs
                )
                k_used = len(prop)
                verify_s = time.perf_counter() - t_verify
                st.record_timing(
                    k_used + 1, verify_s, t_verify - t_step, k_used if name == "draft" else 0
                )
                st.record_pass(name, k_used, n_acc)
                sure = None
                p_conf = policy.confidence_p()  # asked each step: 0 while it cannot matter
                if p_conf > 0.0 and name != "draft" and declined is None:
                    # The target's sureness at the step's first position: on plain steps and on
                    # lookup's too (or a lookup stretch froze the draft model's stop rate at what
                    # it was when the stretch began). Not after a declined draft: its stop at this
                    # very position is counted already, and counting the target's doubt there too
                    # inflated the stop rate in mixed stretches of code.
                    sure = not S.top_prob_below(target.logits(0), p_conf, native)
                if shared:
                    draft_s, verify_cost = l_verify - l_step, own() - l_verify
                else:
                    draft_s, verify_cost = t_verify - t_step, verify_s
                policy.observe(
                    StepReport(name, k_used, n_acc, draft_s, verify_cost, new, declined, sure)
                )
                # Both caches: keep tokens[:base + n_acc]; the new pending token is new[-1].
                valid = base + n_acc
                target.truncate(valid)
                policy.rollback(valid)

                out_tokens: list[int] = []
                step_probs: list[S.TokenProb] | None = [] if want_probs else None
                flags: list[bool] = []
                text_parts: list[str] = []
                for i, tok in enumerate(new):
                    if eog(tok):
                        run.finish = "eos"
                        break
                    run.tokens.append(tok)
                    if constraint is not None:
                        constraint.accept(tok)
                    out_tokens.append(tok)
                    if step_probs is not None:
                        step_probs.append(row_probs[i])
                    flags.append(i < n_acc)
                    text_parts.append(run.stream.feed(piece(tok)))
                    if run.stream.stopped:
                        run.finish = "stop"
                        break
                    if len(run.tokens) - run.n_prompt >= max_tokens:
                        run.finish = "length"
                        break
                if run.finish is not None and len(run.tokens) < base + len(new):
                    # Tokens after EOS/stop were computed but never happened: drop them from
                    # the caches too, so a reused cache (chat, -N) matches the transcript.
                    self._rollback_to(len(run.tokens) - 1)
                st.generated = len(run.tokens) - run.n_prompt
                st.decode_seconds = time.perf_counter() - t_decode
                st.llama_seconds = self._llama_seconds() - llama0 - llama_prefill
                if step_probs is not None and run.probs is not None:
                    run.probs += step_probs
                if out_tokens:
                    if not st.first_token_seconds:  # the prompt and the first pass: TTFT
                        st.first_token_seconds = time.perf_counter() - t0
                    yield Step(
                        out_tokens, flags, "".join(text_parts), name, k_used, n_acc, st, step_probs
                    )
                if deferred and run.finish is None:
                    deferred = False
                    t_c, llama_c = time.perf_counter(), self._llama_seconds()
                    policy.catch_up(run.tokens)
                    catch_up_s = time.perf_counter() - t_c
                    st.prefill_seconds += catch_up_s
                    t_decode += catch_up_s  # not decoding time
                    llama_prefill += self._llama_seconds() - llama_c
        finally:
            st.decode_seconds = time.perf_counter() - t_decode
            st.llama_seconds = self._llama_seconds() - llama0 - llama_prefill
        policy.finish(run.tokens)
        tail = run.stream.flush()
        if tail:
            yield Step([], [], tail, "none", 0, 0, st)
        st.generated = len(run.tokens) - run.n_prompt
        yield Result(
            text=run.stream.text,
            tokens=run.tokens[run.n_prompt :],
            finish_reason=run.finish or "length",
            prompt_tokens=run.n_prompt,
            stats=st,
            seed=params.seed,
            mode=self.mode,
            probs=run.probs,
        )

    def run(self, prompt: Sequence[int], **kw: object) -> Result:
        """Generate to the end and return the Result (tests, bench)."""
        result = None
        for ev in self.generate(prompt, **kw):  # type: ignore[arg-type]
            if isinstance(ev, Result):
                result = ev
        assert result is not None
        return result

    # -- pieces ---------------------------------------------------------------------------
    def _llama_seconds(self) -> float:
        s = self.target.llama_seconds
        if self.draft_model is not None:
            s += self.draft_model.model.llama_seconds
        return s

    def _prefill(self, tokens: list[int], defer_model: bool = False) -> int:
        """Bring the target (and the drafters) to 'all but the last token evaluated'
        (``defer_model``: Policy.prefill)."""
        keep = min(_common_prefix(self.target.cached, tokens), len(tokens) - 1)
        self.target.truncate(keep)
        todo = tokens[keep:-1]
        self.target.prefill(todo, keep)
        self.policy.prefill(tokens, defer_model)
        return len(todo)

    def _forced(self, constraint: C.Constraint, k: int) -> Proposal:
        """The tokens of the text the grammar forces from here (at most ``k``): a draft that
        costs no drafting, verified like any other."""
        if self._probes is None:
            self._probes = C.char_probes(self.target)
        text, _ = C.forced_text(constraint, self._probes, limit=8 * k)
        if not text:
            return EMPTY
        # parse_special: a forced "<tool_call>" is the vocabulary's own token where it has one.
        toks = self.target.tokenize(text, False, True)
        # The last token may merge with what the grammar leaves open after the forced text (a
        # key's closing quote with the colon: `":`), and the target then writes that merged
        # token instead: proposed, it was rejected about half the time (Qwen2.5-Coder, JSON).
        return Proposal(toks[: min(k, len(toks) - 1)], None) if len(toks) > 1 else EMPTY

    def _rollback_to(self, valid: int) -> None:
        self.target.truncate(valid)
        self.policy.rollback(valid)

    def _verify(
        self,
        tokens: list[int],
        prop: Proposal,
        params: S.SamplingParams,
        rng: np.random.Generator,
        greedy: bool,
        match: bool,
        constraint: C.Constraint | None = None,
        probs: list[S.TokenProb] | None = None,
    ) -> tuple[int, list[int]]:
        """One target pass over [pending, d1..dK]: (drafts accepted, tokens to commit). Under a
        constraint each row is masked by the grammar's state after the drafts before it (a
        fork, advanced on trial: the caller advances the real state by what it keeps). Logit
        biases and penalties (penalties.py) transform row j with the history up to it, the
        drafts before it included: the accept test sees the penalised target. ``probs``: where
        ``params.n_probs >= 0``, each returned token's probabilities are appended to it."""
        target = self.target
        drafts = prop.tokens
        base = len(tokens)
        batch = [tokens[-1], *drafts]
        target.decode(batch, base - 1, logits_from=0)
        rt = P.RowTransform(params, tokens, self._eog or ()) if P.active(params) else None
        out = probs if params.n_probs >= 0 else None
        if constraint is not None:
            g = constraint.fork()
            try:
                return self._verify_rows(drafts, prop, params, rng, greedy, match, g, rt, out)
            finally:
                g.close()
        return self._verify_rows(drafts, prop, params, rng, greedy, match, None, rt, out)

    def _verify_rows(
        self,
        drafts: list[int],
        prop: Proposal,
        params: S.SamplingParams,
        rng: np.random.Generator,
        greedy: bool,
        match: bool,
        g: C.Constraint | None,
        rt: P.RowTransform | None = None,
        probs: list[S.TokenProb] | None = None,
    ) -> tuple[int, list[int]]:
        target = self.target
        k = len(drafts)
        new: list[int] = []
        n_top = params.n_probs
        for j in range(k + 1):
            logits = target.logits(j)
            if g is not None and j > 0:
                g.accept(drafts[j - 1])  # row j follows d_j, accepted just before
            if rt is not None:
                if j > 0:
                    rt.push(drafts[j - 1])
                logits = rt.apply(logits)
            if greedy:
                t = S.greedy(logits) if g is None else C.argmax(g, logits)
                if t < 0:
                    raise SpecrunError("the grammar admits no token here (it cannot be completed)")
                if probs is not None:
                    if params.post_sampling_probs:  # greedy samples the argmax for sure
                        probs.append(S.TokenProb(t, 0.0, ((t, 0.0),) if n_top > 0 else ()))
                    else:
                        row = logits if g is None else C.mask(g, logits, params)
                        probs.append(S.row_logprobs(row, t, n_top))
                if j < k and t == drafts[j]:
                    new.append(t)
                    continue
                new.append(t)
                return j, new
            if g is not None:
                logits = C.mask(g, logits, params)
                if not np.isfinite(logits).any():
                    raise SpecrunError("the grammar admits no token here (it cannot be completed)")
            p = S.transform(logits, params)
            if j == k:
                t = p.sample(rng)  # every draft accepted: the bonus token comes from p
                new.append(t)
                self._prob(probs, logits, p, t, params)
                return k, new
            if match:
                # Sample-and-match: the target samples its own token; the draft stands if equal.
                t = p.sample(rng)
                new.append(t)
                self._prob(probs, logits, p, t, params)
                if t != drafts[j]:
                    return j, new
                continue
            q = prop.dists[j] if prop.dists is not None else None
            ok, t = S.speculative_step(p, q, drafts[j], rng)
            new.append(t)
            self._prob(probs, logits, p, t, params)
            if not ok:
                return j, new
        return k, new  # unreachable: the loop returns at j == k

    @staticmethod
    def _prob(
        probs: list[S.TokenProb] | None,
        logits: np.ndarray,
        p: S.Dist,
        t: int,
        params: S.SamplingParams,
    ) -> None:
        if probs is None:
            return
        if params.post_sampling_probs:
            probs.append(S.dist_logprobs(p, t, params.n_probs))
        else:
            probs.append(S.row_logprobs(logits, t, params.n_probs))
