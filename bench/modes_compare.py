"""Greedy speed of every drafting mode against the target alone, per kind of prompt.

One process, models loaded once, a fresh cache per run, configurations alternating within each
repeat; reports medians of tok/s, the ratio to `none`, acceptance and whether the tokens equal
the baseline's. Usage: .venv/bin/python bench/modes_compare.py [--repeats 3] [-n 128] [--json F]

Also the speed-up in *model time*: every llama_decode of the decode phase is logged, and a run
is priced at the median time this prompt's runs took for a target pass of that many rows and
for a draft row, all configurations pooled. Greedy decoding makes the tokens, and so each mode's
passes, the same from run to run; model time then compares the choices a mode made without the
machine's noise (5-15% between runs here) and without the Python around llama.cpp, which the
tok/s figures include. ``--prompts bench:CATEGORY`` takes the first turn of the builtin bench
suite's first prompt of that category.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

from specrun.cli import chat_tokens
from specrun.engine import Engine, SpecConfig
from specrun.loader import calibrate_auto
from specrun.registry import Registry
from specrun.runtime import LoadOptions, Model

HERE = Path(__file__).resolve().parent
CODE = (HERE.parent / "src" / "specrun" / "textstream.py").read_text()[:1400]
PASSAGE = (
    "The Great Barrier Reef is the world's largest coral reef system, made of over 2,900 "
    "individual reefs and 900 islands stretching over 2,300 kilometres off the coast of "
    "Queensland, Australia. It can be seen from outer space and is the world's biggest single "
    "structure made by living organisms. The reef is built by billions of tiny organisms known "
    "as coral polyps. It supports a wide diversity of life and was selected as a World Heritage "
    "Site in 1981. Climate change, pollution and crown-of-thorns starfish are its main threats; "
    "mass coral bleaching events occurred in 1998, 2002, 2016, 2017 and 2020."
)
PROMPTS = {
    "code": "Write a Python function `merge_sorted(a, b)` that merges two sorted lists into one "
            "sorted list in linear time. Include a docstring and a few doctest examples.",
    "code2": "Write a Python class `Stack` with push, pop, peek and is_empty methods, with docstrings.",
    "code-edit": "Rename the method `feed` to `push` everywhere in this code and print the whole "
                 "updated file:\n\n" + CODE,
    "summarize": "Summarize this text in three sentences:\n\n" + PASSAGE,
    "qa": PASSAGE + "\n\nQuestion: When was the reef selected as a World Heritage Site, and what "
                    "are its main threats? Answer using the text.",
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
CONFIGS = [("none", None), ("draft", 4), ("lookup", 4), ("hybrid", 4), ("auto", 4)]
P_MIN = 0.6  # the command line's default --draft-p-min


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
        """Log from the end of the engine's prefill (target and drafters) on."""
        orig = engine.policy.prefill

        def prefill(tokens):  # type: ignore[no-untyped-def]
            orig(tokens)
            self.on = True

        engine.policy.prefill = prefill  # type: ignore[method-assign]

    def run(self, engine: Engine, toks: list[int], n: int) -> tuple[object, list[tuple[str, int, float]]]:
        self.calls, self.on = [], False
        result = engine.run(toks, max_tokens=n, reuse_cache=False)
        self.on = False
        return result, self.calls


def model_seconds(calls: list[tuple[str, int, float]], target_s: dict[int, float], draft_row_s: float) -> float:
    return sum(target_s[n] if tag == "target" else draft_row_s * n for tag, n, _ in calls)


def prompt_text(key: str) -> str:
    if key.startswith("bench:"):
        from specrun.bench import load_suite

        _, prompts = load_suite("builtin")
        found = [p for p in prompts if p.category == key[len("bench:"):]]
        if not found:
            raise SystemExit(f"no builtin bench prompt of category {key[len('bench:'):]!r}")
        return found[0].turns[0]
    if key not in PROMPTS:
        raise SystemExit(f"unknown prompt {key!r}: one of {', '.join(PROMPTS)} or bench:CATEGORY")
    return PROMPTS[key]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pair", default="smollm2-135m", help="a registry pair (default: the default pair)")
    ap.add_argument("--json")
    ap.add_argument("--p-min", type=float, default=P_MIN, help="--draft-p-min for the draft model")
    ap.add_argument("--prompts", help="comma list of prompt names (default: all)")
    ap.add_argument("--configs", help="comma list of MODE:K, e.g. none,draft:2,draft:3,lookup:4,auto:4 "
                                      "(default: none,draft:4,lookup:4,hybrid:4,auto:4)")
    a = ap.parse_args()
    global CONFIGS
    if a.configs:
        CONFIGS = [(m, int(k) if k else None) for m, _, k in (c.partition(":") for c in a.configs.split(","))]
        if CONFIGS[0][0] != "none":
            ap.error("--configs must start with none (the baseline)")
    reg = Registry.load()
    pair = reg.pair(a.pair)
    target = Model(reg.ensure(pair.target), LoadOptions(n_ctx=4096, n_threads=a.threads))
    draft = Model(reg.ensure(pair.draft), LoadOptions(n_ctx=4096, n_threads=a.threads, amx_rows=True))
    engines = {
        (m, k): Engine(target, None if m in ("none", "lookup") else draft,
                       SpecConfig(mode=m, draft_max=k or 4, draft_p_min=a.p_min))
        for m, k in CONFIGS
    }
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
        text = prompt_text(key)
        toks = chat_tokens(target, target.chat_template(), [{"role": "user", "content": text}])
        engines[CONFIGS[0]].run(toks, max_tokens=16, reuse_cache=False)  # warm-up
        runs: dict[tuple, list] = {c: [] for c in CONFIGS}
        calls: dict[tuple, list] = {c: [] for c in CONFIGS}
        for _ in range(a.repeats):
            for c in CONFIGS:
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
        draft_row_s = statistics.median(per_row) if per_row else 0.0

        model_tps = {
            c: statistics.median(r.stats.generated / model_seconds(cs, target_s, draft_row_s)
                                 for r, cs in zip(runs[c], calls[c], strict=True))
            for c in CONFIGS
        }
        base = statistics.median(r.stats.tokens_per_second for r in runs[CONFIGS[0]])
        model_base = model_tps[CONFIGS[0]]
        for c in CONFIGS:
            rs = runs[c]
            tps = statistics.median(r.stats.tokens_per_second for r in rs)
            rows.append({
                "prompt": key, "prompt_tokens": len(toks), "mode": c[0], "draft_max": c[1],
                "tokens_per_second": round(tps, 2), "speedup": round(tps / base, 3),
                "model_speedup": round(model_tps[c] / model_base, 3),
                "acceptance_rate": round(statistics.median(r.stats.acceptance_rate for r in rs), 3),
                "mean_accepted_length": round(statistics.median(r.stats.mean_accepted_length for r in rs), 2),
                "identical": all(r.tokens == runs[CONFIGS[0]][0].tokens for r in rs),
                "modes_used": dict(rs[-1].stats.modes_used),
            })
            print(json.dumps(rows[-1]), flush=True)
    print()
    print("| prompt | " + " | ".join(f"{m}{'' if k is None else f' K={k}'}" for m, k in CONFIGS) + " |")
    print("|---|" + "---:|" * len(CONFIGS))
    for key in chosen:
        cells = []
        for m, k in CONFIGS:
            r = next(x for x in rows if x["prompt"] == key and x["mode"] == m and x["draft_max"] == k)
            cells.append(f"{r['tokens_per_second']:.1f} tok/s ({r['speedup']:.2f}x, model {r['model_speedup']:.2f}x, "
                         f"acc {r['acceptance_rate']:.2f}{'' if r['identical'] else ', DIFFERENT'})")
        print(f"| {key} | " + " | ".join(cells) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
