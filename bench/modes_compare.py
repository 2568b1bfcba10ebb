"""Greedy speed of every drafting mode against the target alone, per kind of prompt.

One process, models loaded once, a fresh cache per run, configurations alternating within each
repeat; reports medians of tok/s, the ratio to `none`, acceptance and whether the tokens equal
the baseline's. Usage: .venv/bin/python bench/modes_compare.py [--repeats 3] [-n 128] [--json F]

Also the speed-up in *model time*: every llama_decode of the decode phase is logged, and a run
is priced at the median time this prompt's runs took for a target pass of that many rows and
for a draft row, all configurations pooled. Greedy decoding makes the tokens, and so each mode's
passes, the same from run to run; model time then compares the choices a mode made without the
machine's noise (5-15% between runs here) and without the Python around llama.cpp, which the
tok/s figures include. Prompts by name are specrun.benchmark.harness's (data/workloads.jsonl,
category ``single``); ``--prompts bench:CATEGORY`` takes the first turn of the builtin bench
suite's first prompt of that category. The pair loads as the command line loads it (session).

Multi-request workloads: ``--prompts seq:CATEGORY`` runs every prompt of that category of
``--suite`` (default: src/specrun/data/workloads.jsonl), every turn (a follow-up answers the
reply the configuration itself gave: greedy, so every exact mode gives the same), in order, in
one process: the lookup store of earlier outputs starts empty at the sequence's start and grows
through it, as over chat turns or repeated requests. Figures are over the whole sequence (its
tokens over its summed model time). Single prompts run with an empty store (every repeat is a
first request). Mode ``ngram`` is the n-gram prompt lookup before the suffix drafter, as it was
(``SpecConfig(lookup_kind="ngram", lookup_min=1)``: the baseline #20 measures the suffix drafter
against), ``auto-ngram`` auto over it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path

from specrun.benchmark.harness import (
    P_MIN,
    PROMPTS,
    WORKLOADS,
    converse,
    load_pair,
    make_engine,
    prompt_text,
    sequence,
)
from specrun.chat_template import encode_chat
from specrun.decoding.engine import Engine
from specrun.llama.model import Model
from specrun.session import calibrate_auto

CONFIGS = [("none", None), ("draft", 4), ("lookup", 4), ("hybrid", 4), ("auto", 4)]


class DecodeLog:
    """The llama_decode calls of each run's decode phase: (model, rows, seconds)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float]] = []
        self.on = False

    def wrap(self, model: Model, tag: str) -> None:
        orig = model.decode
        depth = [0]  # a single-row model decodes a batch as nested one-row calls: log the outer

        def decode(tokens, pos0, logits_from=None):  # type: ignore[no-untyped-def]
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return orig(tokens, pos0, logits_from)
            finally:
                depth[0] -= 1
                if depth[0] == 0 and self.on:
                    self.calls.append((tag, len(tokens), time.perf_counter() - t0))

        model.decode = decode  # type: ignore[method-assign]

    def watch(self, engine: Engine) -> None:
        """Log from the end of the engine's prefill (target and drafters) on, less the draft
        model's prefill when the engine defers it past the first token (``catch_up``)."""
        orig, orig_catch_up = engine.policy.prefill, engine.policy.catch_up

        def prefill(tokens, defer_model=False):  # type: ignore[no-untyped-def]
            orig(tokens, defer_model)
            self.on = True

        def catch_up(tokens):  # type: ignore[no-untyped-def]
            self.on = False
            orig_catch_up(tokens)
            self.on = True

        engine.policy.prefill = prefill  # type: ignore[method-assign]
        engine.policy.catch_up = catch_up  # type: ignore[method-assign]

    def run(
        self, engine: Engine, toks: list[int], n: int
    ) -> tuple[object, list[tuple[str, int, float]]]:
        self.calls, self.on = [], False
        result = engine.run(toks, max_tokens=n, reuse_cache=False)
        self.on = False
        return result, self.calls


class SeqResult:
    """A sequence of requests as one run: its tokens, and stats summed where they add up."""

    def __init__(self, results: list) -> None:
        self.results = results
        self.tokens = [t for r in results for t in r.tokens]
        self.generated = sum(r.stats.generated for r in results)
        self.decode_seconds = sum(r.stats.decode_seconds for r in results)
        self.drafted = sum(r.stats.drafted for r in results)
        self.accepted = sum(r.stats.accepted for r in results)
        self.passes = sum(r.stats.target_passes for r in results)
        self.modes_used: dict[str, int] = defaultdict(int)
        for r in results:
            for k, v in r.stats.modes_used.items():
                self.modes_used[k] += v


def run_sequence(
    log: DecodeLog, engine: Engine, target: Model, prompts: list, n: int
) -> tuple[SeqResult, list]:
    engine.clear_store()
    results, calls = [], []

    def turn(history: list) -> str:
        r, cs = log.run(engine, encode_chat(target, history), n)
        results.append(r)
        calls.extend(cs)
        return r.text  # type: ignore[attr-defined, no-any-return]

    converse((p.turns for p in prompts), turn)
    return SeqResult(results), calls


class _SeqStats:
    """A SeqResult in the shape the report reads (``r.stats.*``, ``r.tokens``)."""

    def __init__(self, s: SeqResult) -> None:
        self.results = s.results
        self.tokens = s.tokens
        self.stats = self
        self.generated = s.generated
        self.tokens_per_second = s.generated / s.decode_seconds if s.decode_seconds else 0.0
        self.acceptance_rate = s.accepted / s.drafted if s.drafted else 0.0
        self.mean_accepted_length = s.generated / s.passes if s.passes else 0.0
        self.modes_used = dict(s.modes_used)


def fit_line(by_rows: dict[int, list[float]]) -> dict[int, float]:
    """Target pass seconds as a + b * rows, least squares over every pass's rows with the
    median time of its row count (a count seen a few times, as long lookup drafts are, would
    otherwise price a run by one or two noisy passes on a busy machine)."""
    pts = [(n, statistics.median(v), len(v)) for n, v in by_rows.items()]
    w = sum(c for _, _, c in pts)
    mx = sum(n * c for n, _, c in pts) / w
    my = sum(t * c for _, t, c in pts) / w
    sxx = sum(c * (n - mx) ** 2 for n, _, c in pts)
    b = max(0.0, sum(c * (n - mx) * (t - my) for n, t, c in pts) / sxx) if sxx > 0 else 0.0
    a = my - b * mx
    return {n: a + b * n for n in by_rows}


def model_seconds(
    calls: list[tuple[str, int, float]], target_s: dict[int, float], draft_row_s: float
) -> float:
    return sum(target_s[n] if tag == "target" else draft_row_s * n for tag, n, _ in calls)


def ablation_summary(rows: list[dict], chosen: list[str]) -> None:
    """Each configuration's geo-mean model speed-up over the prompts; beside plain ``auto``
    (when it ran): the change of the geo-mean and the prompts it turns into a loss (auto at
    1.00x or more, this configuration below), the rule docs/auto.md's ablation applies."""

    def cell(key: str, name: str) -> float:
        return float(
            next(r["model_speedup"] for r in rows if r["prompt"] == key and name == _name(r))
        )

    names = list(dict.fromkeys(_name(r) for r in rows))
    geo = {n: math.exp(statistics.fmean(math.log(cell(k, n)) for k in chosen)) for n in names}
    print()
    print("| configuration | geo-mean (model) | vs auto | lowest | turned into a loss |")
    print("|---|---:|---:|---:|---|")
    for n in names:
        low = min(chosen, key=lambda k: cell(k, n))
        vs, lost = "", ""
        if "auto" in geo and n != "auto":
            vs = f"{(geo[n] / geo['auto'] - 1) * 100:+.2f}%"
            lost = ", ".join(k for k in chosen if cell(k, "auto") >= 1.0 > cell(k, n)) or "none"
        print(f"| {n} | {geo[n]:.3f} | {vs} | {cell(low, n):.3f} ({low}) | {lost} |")


def _name(r: dict) -> str:
    return str(r["mode"]) + ("" if r["draft_max"] in (None, 4) else f":{r['draft_max']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--pair", default="smollm2-135m", help="a registry pair (default: the default pair)"
    )
    ap.add_argument("--json")
    ap.add_argument("--p-min", type=float, default=P_MIN, help="--draft-p-min for the draft model")
    ap.add_argument(
        "--prompts",
        help="comma list of prompt names, bench:CATEGORY or seq:CATEGORY (default: all)",
    )
    ap.add_argument(
        "--suite",
        default=WORKLOADS,
        help="the suite seq:CATEGORY reads",
    )
    ap.add_argument(
        "--limit", type=int, default=0, help="seq: only the first N prompts of the category"
    )
    ap.add_argument(
        "--configs",
        help="comma list of MODE:K, e.g. none,draft:2,draft:3,lookup:4,auto:4 "
        "(default: none,draft:4,lookup:4,hybrid:4,auto:4)",
    )
    ap.add_argument(
        "--chat-template",
        default=None,
        help="a built-in format's name or Jinja, for a target without a template (as specrun's flag)",
    )
    a = ap.parse_args()
    global CONFIGS
    if a.configs:
        CONFIGS = [
            (m, int(k) if k else None)
            for m, _, k in (c.partition(":") for c in a.configs.split(","))
        ]
        if CONFIGS[0][0] != "none":
            ap.error("--configs must start with none (the baseline)")
    loaded, target, draft = load_pair(a.pair, threads=a.threads, chat_template=a.chat_template)
    engines = {(m, k): make_engine(target, draft, m, k, a.p_min) for m, k in CONFIGS}
    for e in engines.values():
        if e.mode == "auto":  # as the command line starts it: from the measured pass costs
            calibrate_auto(e)
    log = DecodeLog()
    log.wrap(target, "target")
    log.wrap(draft, "draft")
    for e in engines.values():
        log.watch(e)
    rows = []
    chosen = a.prompts.split(",") if a.prompts else list(PROMPTS)
    for key in chosen:
        seq = None
        if key.startswith("seq:"):
            seq = sequence(a.suite, key, a.limit)
            toks = encode_chat(target, [{"role": "user", "content": seq[0].turns[0]}])
        else:
            text = prompt_text(key)
            toks = encode_chat(target, [{"role": "user", "content": text}])
        engines[CONFIGS[0]].run(toks, max_tokens=16, reuse_cache=False)  # warm-up
        runs: dict[tuple, list] = {c: [] for c in CONFIGS}
        calls: dict[tuple, list] = {c: [] for c in CONFIGS}
        for _ in range(a.repeats):
            for c in CONFIGS:
                if seq is not None:
                    r, cs = run_sequence(log, engines[c], target, seq, a.n)
                else:
                    engines[c].clear_store()  # every repeat a first request
                    r, cs = log.run(engines[c], toks, a.n)
                runs[c].append(r)
                calls[c].append(cs)
        by_rows: dict[int, list[float]] = defaultdict(list)
        per_row: list[float] = []
        for cs_list in calls.values():
            for cs in cs_list:
                for tag, n, sec in cs:
                    if tag == "target":
                        by_rows[n].append(sec)
                    else:
                        per_row.append(sec / n)
        target_s = {n: statistics.median(v) for n, v in by_rows.items()}
        target_fit = fit_line(by_rows)
        t1 = target_fit.get(1) or min(target_fit.values())
        print(
            json.dumps(
                {
                    "prompt": key,
                    "passes_by_rows": {n: len(v) for n, v in sorted(by_rows.items())},
                    "V_median": {n: round(target_s[n] / t1, 2) for n in sorted(target_s)},
                    "V_fit": {n: round(target_fit[n] / t1, 2) for n in sorted(target_fit)},
                    "t1_ms": round(t1 * 1000, 2),
                }
            ),
            flush=True,
        )
        draft_row_s = statistics.median(per_row) if per_row else 0.0

        if seq is not None:
            runs = {c: [_SeqStats(r) for r in rs] for c, rs in runs.items()}
        model_tps = {
            c: statistics.median(
                r.stats.generated / model_seconds(cs, target_s, draft_row_s)
                for r, cs in zip(runs[c], calls[c], strict=True)
            )
            for c in CONFIGS
        }
        fit_tps = {
            c: statistics.median(
                r.stats.generated / model_seconds(cs, target_fit, draft_row_s)
                for r, cs in zip(runs[c], calls[c], strict=True)
            )
            for c in CONFIGS
        }
        base = statistics.median(r.stats.tokens_per_second for r in runs[CONFIGS[0]])
        model_base = model_tps[CONFIGS[0]]
        for c in CONFIGS:
            rs = runs[c]
            tps = statistics.median(r.stats.tokens_per_second for r in rs)
            rows.append(
                {
                    "prompt": key,
                    "prompt_tokens": len(toks),
                    "mode": c[0],
                    "draft_max": c[1],
                    "requests": len(rs[0].results) if seq is not None else 1,
                    "generated": rs[0].stats.generated,
                    "tokens_per_second": round(tps, 2),
                    "speedup": round(tps / base, 3),
                    "model_speedup": round(model_tps[c] / model_base, 3),
                    "fit_speedup": round(fit_tps[c] / fit_tps[CONFIGS[0]], 3),
                    "acceptance_rate": round(
                        statistics.median(r.stats.acceptance_rate for r in rs), 3
                    ),
                    "mean_accepted_length": round(
                        statistics.median(r.stats.mean_accepted_length for r in rs), 2
                    ),
                    "identical": all(r.tokens == runs[CONFIGS[0]][0].tokens for r in rs),
                    "modes_used": dict(rs[-1].stats.modes_used),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print()
    print(
        "| prompt | "
        + " | ".join(f"{m}{'' if k is None else f' K={k}'}" for m, k in CONFIGS)
        + " |"
    )
    print("|---|" + "---:|" * len(CONFIGS))
    for key in chosen:
        cells = []
        for m, k in CONFIGS:
            r = next(
                x for x in rows if x["prompt"] == key and x["mode"] == m and x["draft_max"] == k
            )
            cells.append(
                f"{r['tokens_per_second']:.1f} tok/s ({r['speedup']:.2f}x, model {r['model_speedup']:.2f}x, "
                f"fit {r['fit_speedup']:.2f}x, "
                f"acc {r['acceptance_rate']:.2f}{'' if r['identical'] else ', DIFFERENT'})"
            )
        print(f"| {key} | " + " | ".join(cells) + " |")
    ablation_summary(rows, chosen)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    loaded.close()


if __name__ == "__main__":
    main()
