"""Lookup drafters replayed over recorded greedy runs (bench/record_greedy.py), no model needed.

Under greedy decoding a lookup proposal's fate is fixed by the target's tokens: the accepted
part is its longest prefix that equals what the target produced next. Each recorded request is
replayed pass by pass through a drafter (the store carries over the requests of a workload, in
order, as in one process) and priced V(n) target steps, from a measured table (``--vtable``) or
a line 1 + slope * (n - 1) (the model-time figures of bench/modes_compare.py price real passes the same way).
Reports, per workload and drafter: speed-up over plain decoding, tokens per pass, acceptance.
``auto`` is AutoPolicy over the drafter alone (no draft model), fed the replayed costs.
``llama-ngram-cache`` and ``llama-ngram-mod`` are llama-server's own n-gram drafters, ported
(specrun/benchmark/llama_ngram.py). ``suffix-tree`` is the suffix drafter verifying two candidate sequences
in one pass (a tree with two branches at the root): its best path and the best path that starts
with another token (the matched context's second most frequent follower, or the other
automaton's path), both priced as one pass of 1 + both lengths rows; the branch the target
accepts counts. ``--tree-min-share`` is the least count share the second branch's first token
needs. Two ceilings, each told the target's tokens: ``oracle-k`` is the suffix drafter as auto
runs it (1-token matches, auto's walk floor) with each pass's K the best for that pass alone
(the most tokens per cost, knowing how much of the proposal the target takes): what a perfect
choice of K could make of these proposals. ``bound`` proposes the longest continuation of the
target's next tokens that occurs anywhere in what came before (the workload's earlier prompts
and outputs as the store would hold them, this prompt, the output so far), K chosen the same
way: what any drafter that copies earlier text could reach. A ``bench:`` workload's requests each start afresh (specrun's store emptied, a new
llama-server), as bench/server_compare.py runs them; a ``seq:`` workload's share one process,
in order.
``--switch S`` charges each single row right after a pass of several rows S rows more, whichever
drafter ran: what the machine makes the rows after a batch pay (docs/performance.md, "A bet's hidden cost":
on a 2-core Zen 3, F16, the next row 0.035-0.045, the rows until the next batch 0-0.15 more).
Usage: .venv/bin/python bench/suffix_sim.py runs.json [--slope 0.1 | --vtable 2:1.55,3:1.77,...]
[--max-tokens 128] [--kinds ngram,suffix,suffix-tree,auto,oracle-k,bound] [--tree-min-share 0.2]
[--switch 0.03]; ``suffix:N:P`` is the suffix drafter as ``--mode lookup`` with ``--lookup-min N`` and
a walk floor of P (``suffix`` = ``suffix:2:0.6``); ``auto@FIELD=VALUE[;FIELD=VALUE]`` is auto with
those AutoPriors fields changed (``auto@lookup_alpha=0.15``), beside plain ``auto`` in one run.
``auto+draft`` is auto with the pair's draft model too, replayed (``SimDraft``: run
``--annotate-draft PAIR`` on the runs file once; ``--p-min``, ``--draft-c``, ``--draft-row``,
``--single-rows`` price it), ``draft`` that draft model alone; ``auto!NAME`` (and
``auto+draft!NAME``, combinable with ``@``) is auto with one of its refinements taken out
(specrun.benchmark.ablation; docs/auto.md, the ablation).
The last row is each drafter's geo-mean over the workloads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from specrun import defaults
from specrun.benchmark.ablation import ablated, check, off_lookup
from specrun.benchmark.llama_ngram import LlamaNgramCache, LlamaNgramMod
from specrun.decoding.auto import AutoPolicy
from specrun.decoding.drafters import EMPTY, BaseDrafter, Proposal
from specrun.decoding.lookup import PromptLookup
from specrun.decoding.policy import FixedPolicy, Policy, StepReport
from specrun.decoding.priors import PRIORS
from specrun.decoding.sampling import SamplingParams
from specrun.decoding.suffix import SEP, SuffixAutomaton, SuffixLookup

GREEDY = SamplingParams()


class _LlamaNgramCache(LlamaNgramCache, BaseDrafter):
    """llama-server's drafter with the Drafter defaults it does not define (finish, ...)."""


class _LlamaNgramMod(LlamaNgramMod, BaseDrafter):
    """As _LlamaNgramCache."""


def verify_cost(vtable: dict[int, float] | None, slope: float):
    """V(n) for n rows: linear between the table's sizes (and beyond its last two), else
    1 + slope (n - 1)."""
    if not vtable:
        return lambda n: 1.0 + slope * (n - 1)
    pts = sorted({1: 1.0, **vtable}.items())

    def v(n: int) -> float:
        for (a, va), (b, vb) in zip(pts, pts[1:], strict=False):
            if n <= b:
                return va + (vb - va) * (n - a) / (b - a)
        (a, va), (b, vb) = pts[-2], pts[-1]
        return vb + (vb - va) * (n - b) / (b - a)

    return v


def second_branch(d: SuffixLookup, first: list[int], k: int, min_share: float) -> list[int]:
    """The best continuation that does not start with ``first[0]``: over both automata (the
    current sequence's and the store's) at their matched states, the follower with the largest
    count share other than ``first[0]``, then its most frequent path, capped as the drafter caps
    a path of that match."""
    if not first:
        return []
    best: tuple[float, list[int]] = (0.0, [])
    for sam, (state, length) in ((d.sam, d.cur), (d.store.sam, d.st)):
        if length < d.n_min or state == 0:
            continue
        children = sam.nxt[state]
        total = sum(sam.cnt[s] for s in children.values())
        for tok, st in children.items():
            share = sam.cnt[st] / total if total else 0.0
            if tok == first[0] or share < min_share or share <= best[0]:
                continue
            rest, _probs, _sup = sam.walk(st, k - 1, d.min_prob / share)
            cap = min(k, d._cap(length, sam.cnt[st]))
            best = (share, ([tok] + rest)[:cap])
    return best[1]


def best_k_knowing(prop: list[int], truth: list[int], vcost) -> int:
    """The K (0..len(prop)) whose pass yields the most tokens per cost, knowing that the target
    goes on with ``truth``: (accepted + 1) / V(K + 1); the smallest such K."""
    best, best_k, m = 1.0 / vcost(1), 0, 0
    for k in range(1, len(prop) + 1):
        if m == k - 1 and k - 1 < len(truth) and prop[k - 1] == truth[k - 1]:
            m += 1
        s = (m + 1) / vcost(k + 1)
        if s > best + 1e-9:
            best, best_k = s, k
    return best_k


class _Ceiling(Policy):
    """A policy told the target's tokens: replay hands it each request's (``know``)."""

    def __init__(self, vcost) -> None:  # type: ignore[no-untyped-def]
        self.vcost = vcost
        self.truth: list[int] = []
        self.base = 0

    def know(self, prompt: list[int], output: list[int]) -> None:
        self.truth, self.base = output, len(prompt)

    def choose(self, name: str, prop: list[int], tokens: list[int]) -> tuple[str, Proposal]:
        """``prop`` cut to the K that pays best, knowing what the target goes on with."""
        k = best_k_knowing(prop, self.truth[len(tokens) - self.base :], self.vcost)
        return (name, Proposal(prop[:k], None)) if k else ("none", EMPTY)


class OracleK(_Ceiling):
    """``oracle-k``: a drafter's proposals with each pass's K chosen knowing the target's tokens."""

    def __init__(self, drafter, vcost) -> None:  # type: ignore[no-untyped-def]
        super().__init__(vcost)
        self.drafter = drafter
        self.drafters = (drafter,)

    def draft(self, tokens, k_cap, params, rng, greedy_draft):  # type: ignore[no-untyped-def]
        prop = self.drafter.propose(tokens, k_cap, params, rng, greedy_draft).tokens
        return self.choose(self.drafter.name, prop, tokens)


class Bound(_Ceiling):
    """``bound``: the longest continuation of the target's next tokens found anywhere before (a
    suffix automaton over the workload's earlier prompts and outputs, separated, then this
    prompt and the output so far), K chosen knowing them."""

    def __init__(self, vcost, k_max: int = SuffixLookup.K_MAX) -> None:  # type: ignore[no-untyped-def]
        super().__init__(vcost)
        self.k_max = k_max
        self.sam = SuffixAutomaton()
        self.fed = 0  # tokens of the current request's sequence in the automaton

    def prefill(self, tokens: list[int]) -> None:
        if self.sam.n:
            self.sam.extend(SEP)
        for t in tokens:
            self.sam.extend(t)
        self.fed = len(tokens)

    def draft(self, tokens, k_cap, params, rng, greedy_draft):  # type: ignore[no-untyped-def]
        for t in tokens[self.fed :]:
            self.sam.extend(t)
        self.fed = len(tokens)
        truth = self.truth[len(tokens) - self.base :]
        state, prop = 0, []
        while len(prop) < min(k_cap, self.k_max, len(truth)):
            nxt = self.sam.nxt[state].get(truth[len(prop)])
            if nxt is None:
                break
            state = nxt
            prop.append(truth[len(prop)])
        return self.choose("lookup", prop, tokens)


class SimDraft(BaseDrafter):
    """The pair's draft model replayed (``auto+draft``, ``draft``): its greedy choice and top
    probability after every prefix of a request's text, recorded teacher-forced (``--annotate-
    draft``), stand in for its proposals: exactly right while a proposal follows the target's
    tokens (the only part a greedy target accepts); past its first miss it is taken to go on as
    sure as the recorded row says, with a token that is never right. Priced ``c`` target steps a
    draft step and ``c * row`` a catch-up row beyond the first (``--draft-c``, ``--draft-row``);
    a catch-up's rows are evidence as DraftModel.propose's are. ``spent`` (target steps) is what
    it cost since replay last read it."""

    name = "draft"

    def __init__(self, p_min: float, c: float, row: float, single_rows: bool = False) -> None:
        self.p_min, self.c, self.row, self.single_rows = p_min, c, row, single_rows
        self.n_cached = 0
        self.last_catch_up: tuple[int, float] = (0, 0.0)
        self.last_evidence: list[tuple[bool, bool]] = []
        self.arg: dict[
            int, int
        ] = {}  # token position q -> the draft's choice after tokens[: q + 1]
        self.top: dict[int, float] = {}
        self.spent = 0.0
        self.t1 = 0.02
        self.truth: list[int] = []

    def know(self, prompt: list[int], req: dict) -> None:  # type: ignore[type-arg]
        self.truth = prompt + list(req["output"])
        base = len(prompt) - 1
        self.arg = {base + j: int(t) for j, t in enumerate(req["draft_arg"])}
        self.top = {base + j: float(p) for j, p in enumerate(req["draft_top"])}

    def reset(self) -> None:
        self.n_cached = 0
        self.last_catch_up = (0, 0.0)
        self.last_evidence = []

    def prefill(self, tokens: list[int], evaluate: bool = True) -> int:
        if evaluate:  # the prompt's rows are not priced (replay prices decoding only)
            self.n_cached = len(tokens) - 1
        return 0

    def rollback(self, valid_len: int) -> None:
        self.n_cached = min(self.n_cached, valid_len)

    def propose(  # type: ignore[no-untyped-def]
        self, tokens, k, params, rng, greedy_draft, window=None, evidence=False
    ) -> Proposal:
        self.last_evidence = []
        base = len(tokens)
        if window is not None and base - self.n_cached > max(window, 1):
            self.n_cached = base - max(window, 1)
        n_up = base - self.n_cached
        if evidence and n_up >= 2:
            self.last_evidence = [
                (self.top[q] >= self.p_min, self.arg[q] == tokens[q + 1])
                for q in range(self.n_cached, base - 1)
                if q in self.arg
            ]
        up = self.c * (1.0 + (1.0 if self.single_rows else self.row) * (n_up - 1))
        self.last_catch_up = (n_up, up * self.t1)
        cost = up
        out: list[int] = []
        on_track = True
        while True:
            q = base - 1 + len(out)
            if q not in self.top or (self.p_min > 0.0 and self.top[q] < self.p_min):
                break
            tok = self.arg[q] if on_track else -2
            out.append(tok)
            if len(out) >= k:
                break
            on_track = on_track and q + 1 < len(self.truth) and tok == self.truth[q + 1]
            cost += self.c
        self.n_cached = base + max(0, len(out) - (0 if len(out) < k else 1))
        self.spent += cost
        return Proposal(out, None)


def annotate_draft(path: str, pair: str) -> None:
    """Add the pair's draft model's greedy choice and top probability after each prefix of every
    recorded request (prompt, then output), teacher-forced: ``draft_arg``, ``draft_top``."""
    from specrun.benchmark.harness import load_pair
    from specrun.decoding import sampling as S

    runs = json.loads(Path(path).read_text())
    loaded, _target, draft = load_pair(pair, threads=2)
    for reqs in runs.values():
        for req in reqs:
            prompt, out = req["prompt"], req["output"]
            seq = prompt + out
            draft.clear()
            draft.decode(prompt[:-1], 0, None)
            rows = seq[len(prompt) - 1 : len(seq) - 1]
            arg: list[int] = []
            top: list[float] = []
            step = max(1, min(64, draft.n_outputs_max))
            for i in range(0, len(rows), step):
                chunk = rows[i : i + step]
                draft.decode(chunk, len(prompt) - 1 + i, 0)
                for r in range(len(chunk)):
                    lg = draft.logits(r)
                    arg.append(S.greedy(lg))
                    top.append(S.top_prob(lg))
            req["draft_arg"], req["draft_top"] = arg, top
    loaded.close()
    Path(path).write_text(json.dumps(runs))


def replay(
    make_policy,
    reqs,
    max_tokens: int,
    k_cap: int,
    vcost,
    fresh: bool,
    t1: float = 0.02,
    tree_min_share: float | None = None,
    switch: float = 0.0,
) -> dict:
    """``make_policy()`` gives a new policy; ``fresh``: a new one per request (nothing carried).
    An ``auto`` policy starts from the pass costs as a calibration would measure them (V(1),
    V(2), V(3), V(5), V(9)), as the engine's does (calibrate.py)."""
    rng = np.random.default_rng(0)

    def new_policy():  # type: ignore[no-untyped-def]
        p = make_policy()
        if isinstance(p, AutoPolicy):
            sims = [d for d in p.drafters if isinstance(d, SimDraft)]
            p.calibrate(
                {n: vcost(n) * t1 for n in (1, 2, 3, 5, 9)},
                sims[0].c * t1 if sims else None,
            )
        for d in p.drafters:
            if isinstance(d, SimDraft):
                d.t1 = t1
        return p

    cost = plain = 0.0
    gen = passes = drafted = accepted = trees = alt_won = 0
    policy = new_policy()
    last_rows = 1
    for req in reqs:
        if fresh:
            policy = new_policy()
        policy.reset()  # as Engine.reset: a new text; estimates and the lookup store stay
        tokens = list(req["prompt"])
        out = req["output"]
        know = getattr(policy, "know", None)
        if know is not None:  # a ceiling: told the target's tokens
            know(tokens, out)
        sims = [d for d in policy.drafters if isinstance(d, SimDraft)]
        for d in sims:
            d.know(tokens, req)
        policy.prefill(tokens)
        i = 0
        while i < len(out):
            k = min(k_cap, max_tokens - i - 1)
            name, prop = policy.draft(tokens, k, GREEDY, rng, True) if k > 0 else ("none", None)
            drafts = prop.tokens if prop is not None else []
            alt: list[int] = []
            if tree_min_share is not None and drafts:
                alt = second_branch(policy.drafters[0], drafts, k, tree_min_share)
                trees += bool(alt)
            m = 0
            while m < len(drafts) and i + m < len(out) and drafts[m] == out[i + m]:
                m += 1
            if alt and m == 0:  # the first branch failed at its first token: the second's turn
                while m < len(alt) and i + m < len(out) and alt[m] == out[i + m]:
                    m += 1
                alt_won += m > 0
            new = out[i : i + m + 1]
            rows = len(drafts) + len(alt) + 1
            v = vcost(rows)
            if rows == 1 and last_rows > 1:  # the row after a batch (--switch)
                v += switch
            last_rows = rows
            spent = sum(d.spent for d in sims)
            for d in sims:
                d.spent = 0.0
            cost += v + spent
            declined = name if name != "none" and not drafts else None
            sure = None
            p_conf = policy.confidence_p()
            if p_conf > 0.0 and (name != "draft" or not drafts) and declined is None:
                sure = req["top_p"][i] >= p_conf
            for d in policy.drafters:
                hook = getattr(d, "accepted", None)  # llama-ngram-mod's accept()
                if hook is not None and d.name == name:
                    hook(m)
            passes += 1
            drafted += len(drafts) + len(alt)
            accepted += m
            policy.observe(
                StepReport(
                    name if drafts else "none",
                    len(drafts),
                    m,
                    spent * t1,
                    v * t1,
                    new,
                    declined,
                    sure,
                )
            )
            policy.rollback(len(tokens) + m)
            tokens += new
            i += len(new)
        policy.finish(tokens)
        plain += len(out)
        gen += len(out)
    return {
        "speedup": plain / cost if cost else 0.0,
        "tok_per_pass": gen / passes if passes else 0.0,
        "acceptance": accepted / drafted if drafted else 0.0,
        "passes": passes,
        "trees": trees,
        "second_won": alt_won,
    }


# The draft model's replay (``auto+draft``, ``draft``): --p-min, --draft-c, --draft-row, --single-rows.
DRAFT_SIM: dict = {"p_min": 0.6, "c": 0.3, "row": 0.3, "single_rows": False}  # type: ignore[type-arg]


def make(kind: str, draft_max: int = 4, vcost=None):  # type: ignore[no-untyped-def]
    """The drafter ``kind`` names and its K cap; ``auto@FIELD=VALUE[;FIELD=VALUE]`` is auto with
    those AutoPriors fields changed (a tuning experiment beside plain ``auto``, as
    bench/modes_compare.py's)."""
    kind, _, tweaks = kind.partition("@")
    kind, *offs = kind.split("!")
    priors = PRIORS
    if tweaks and not kind.startswith("auto"):
        raise SystemExit(f"{kind}@...: only auto takes AutoPriors changes")
    if offs and not kind.startswith("auto"):
        raise SystemExit(f"{kind}!...: only auto has refinements to take out")
    check(tuple(offs))
    if tweaks:
        try:
            changes = {
                f: type(getattr(PRIORS, f))(v)
                for f, _, v in (t.partition("=") for t in tweaks.split(";"))
            }
        except (AttributeError, ValueError) as e:
            raise SystemExit(f"auto@{tweaks}: {e}") from None
        priors = dataclasses.replace(PRIORS, **changes)
    if kind == "ngram":
        return FixedPolicy(PromptLookup(1, 4)), draft_max
    if kind in ("suffix", "suffix-tree"):  # as --mode lookup runs it (2-token matches and up)
        d = SuffixLookup()
        d.fit(defaults.LOOKUP_MIN, auto=False)
        return FixedPolicy(d), max(draft_max, d.k_max)
    if kind.startswith("suffix:"):  # suffix:N:P, --mode lookup from N-token matches, walk floor P
        try:
            _, n_min, floor = kind.split(":")
            d = SuffixLookup()
            d.fit(int(n_min), auto=False)
            d.min_prob = float(floor)
        except ValueError:
            raise SystemExit(f"{kind}: give suffix:N:P, e.g. suffix:1:0.3") from None
        return FixedPolicy(d), max(draft_max, d.k_max)
    if kind == "auto-ngram":
        return AutoPolicy(draft_max, PromptLookup(1, 4), None), draft_max
    if kind in ("auto", "auto+draft"):
        d = SuffixLookup()
        d.fit(defaults.LOOKUP_MIN_AUTO, auto=True)
        off_lookup(d, tuple(offs))
        cls = ablated(tuple(offs))
        model = SimDraft(**DRAFT_SIM) if kind == "auto+draft" else None
        return cls(draft_max, d, model, priors=priors), max(draft_max, d.k_max)  # type: ignore[arg-type]
    if kind == "draft":
        return FixedPolicy(SimDraft(**DRAFT_SIM)), draft_max
    if kind == "oracle-k":
        d = SuffixLookup()
        d.fit(defaults.LOOKUP_MIN_AUTO, auto=True)
        return OracleK(d, vcost or verify_cost(None, 0.1)), max(draft_max, d.k_max)
    if kind == "bound":
        return Bound(vcost or verify_cost(None, 0.1)), SuffixLookup.K_MAX
    if kind == "llama-ngram-cache":
        return FixedPolicy(_LlamaNgramCache()), LlamaNgramCache.N_DRAFT
    if kind == "llama-ngram-mod":
        return FixedPolicy(_LlamaNgramMod()), LlamaNgramMod.N_MAX
    raise SystemExit(f"unknown drafter {kind}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs")
    ap.add_argument("--slope", type=float, default=0.1)
    ap.add_argument(
        "--vtable", default="", help="measured V(n), e.g. 2:1.55,3:1.77,5:2.40,9:3.88 (F16)"
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kinds", default="ngram,suffix,auto-ngram,auto")
    ap.add_argument("--tree-min-share", type=float, default=0.2)
    ap.add_argument(
        "--switch",
        type=float,
        default=0.0,
        help="what a single row right after a pass of several rows costs more, in rows (the "
        "machine's): charged to every drafter's replay",
    )
    ap.add_argument(
        "--annotate-draft", metavar="PAIR", help="record PAIR's draft model on runs, then exit"
    )
    ap.add_argument("--p-min", type=float, default=0.6, help="the draft's --draft-p-min")
    ap.add_argument("--draft-c", type=float, default=0.3, help="a draft step, in target steps")
    ap.add_argument("--draft-row", type=float, default=0.3, help="a catch-up row, in draft steps")
    ap.add_argument("--single-rows", action="store_true", help="the draft decodes row by row")
    a = ap.parse_args()
    if a.annotate_draft:
        annotate_draft(a.runs, a.annotate_draft)
        return
    DRAFT_SIM.update(p_min=a.p_min, c=a.draft_c, row=a.draft_row, single_rows=a.single_rows)
    runs = json.loads(Path(a.runs).read_text())
    kinds = a.kinds.split(",")
    vtable = {int(n): float(v) for n, v in (x.split(":") for x in a.vtable.split(",") if x)}
    vcost = verify_cost(vtable, a.slope)
    for kind in kinds:  # an unknown drafter or field: refused before any table
        make(kind, vcost=vcost)
    print("| workload | requests | " + " | ".join(kinds) + " |")
    print("|---|---:|" + "---:|" * len(kinds))
    logs: list[list[float]] = [[] for _ in kinds]
    for key, reqs in runs.items():
        cells = []
        for kind in kinds:
            k_cap = make(kind, vcost=vcost)[1]
            r = replay(
                lambda kind=kind: make(kind, vcost=vcost)[0],
                reqs,
                a.max_tokens,
                k_cap,
                vcost,
                fresh=key.startswith("bench:"),
                tree_min_share=a.tree_min_share if kind == "suffix-tree" else None,
                switch=a.switch,
            )
            tree = (
                f", 2 branches {r['trees']}/{r['passes']}, second won {r['second_won']}"
                if kind == "suffix-tree"
                else ""
            )
            if r["speedup"] > 0:  # (a workload with no tokens has none)
                logs[len(cells)].append(math.log(r["speedup"]))
            cells.append(
                f"{r['speedup']:.2f}x ({r['tok_per_pass']:.2f} tok/pass, acc {r['acceptance']:.2f}"
                f"{tree})"
            )
        print(f"| {key} | {len(reqs)} | " + " | ".join(cells) + " |")
    geo = [f"{math.exp(sum(g) / len(g)):.3f}x" if g else "-" for g in logs]
    print(f"| geo-mean | {len(runs)} | " + " | ".join(geo) + " |")


if __name__ == "__main__":
    main()
