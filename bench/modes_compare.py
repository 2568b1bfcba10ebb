"""Greedy speed of every drafting mode against the target alone, per kind of prompt.

One process, models loaded once, a fresh cache per run, configurations alternating within each
repeat; reports medians of tok/s, the ratio to `none`, acceptance and whether the tokens equal
the baseline's. Usage: .venv/bin/python bench/modes_compare.py [--repeats 3] [-n 128] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specrun.cli import chat_tokens
from specrun.engine import Engine, SpecConfig
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
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
    pair = reg.pair("smollm2-135m")
    target = Model(reg.ensure(pair.target), LoadOptions(n_ctx=4096, n_threads=a.threads))
    draft = Model(reg.ensure(pair.draft), LoadOptions(n_ctx=4096, n_threads=a.threads, amx_rows=True))
    engines = {
        (m, k): Engine(target, None if m in ("none", "lookup") else draft,
                       SpecConfig(mode=m, draft_max=k or 4, draft_p_min=a.p_min))
        for m, k in CONFIGS
    }
    rows = []
    chosen = a.prompts.split(",") if a.prompts else list(PROMPTS)
    for key in chosen:
        text = PROMPTS[key]
        toks = chat_tokens(target, target.chat_template(), [{"role": "user", "content": text}])
        engines[CONFIGS[0]].run(toks, max_tokens=16, reuse_cache=False)  # warm-up
        runs: dict[tuple, list] = {c: [] for c in CONFIGS}
        for _ in range(a.repeats):
            for c in CONFIGS:
                runs[c].append(engines[c].run(toks, max_tokens=a.n, reuse_cache=False))
        base = statistics.median(r.stats.tokens_per_second for r in runs[CONFIGS[0]])
        for c in CONFIGS:
            rs = runs[c]
            tps = statistics.median(r.stats.tokens_per_second for r in rs)
            rows.append({
                "prompt": key, "prompt_tokens": len(toks), "mode": c[0], "draft_max": c[1],
                "tokens_per_second": round(tps, 2), "speedup": round(tps / base, 3),
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
            cells.append(f"{r['tokens_per_second']:.1f} tok/s ({r['speedup']:.2f}x, acc {r['acceptance_rate']:.2f}"
                         f"{'' if r['identical'] else ', DIFFERENT'})")
        print(f"| {key} | " + " | ".join(cells) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
