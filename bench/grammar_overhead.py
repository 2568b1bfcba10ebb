"""What a grammar costs when it forces nothing: decode speed under a grammar that admits every
text, against the same run without one (greedy: the tokens are the same, so the difference is
the grammar's own work: asking llama.cpp's grammar sampler about each verified row's top tokens,
advancing it by what is kept, forking it for a verify pass).

One process, the pair loaded once through session; per prompt, the configurations alternate
(``--repeats`` times), each run from a fresh cache and an empty lookup store; reports median decode tok/s with and
without the grammar, their ratio, and whether the tokens are equal. ``--grammar`` takes another
GBNF (one that forces nothing, or the tokens differ and the ratio compares different texts).

    .venv/bin/python bench/grammar_overhead.py --pair qwen2.5-coder-0.5b --modes none,auto
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

from specrun.benchmark.harness import P_MIN, PROMPTS, load_pair, make_engine, prompt_text
from specrun.chat_template import encode_chat
from specrun.llama.grammar import Grammar
from specrun.session import calibrate_auto

ANY_TEXT = "root ::= [^\\x00]*"  # every text, and the end anywhere: nothing is ever forced


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--modes", default="none,auto", help="comma list of engine modes")
    ap.add_argument("--prompts", help="comma list of prompt names (default: all)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--grammar", default=ANY_TEXT)
    a = ap.parse_args()
    loaded, target, draft = load_pair(a.pair, threads=a.threads)
    modes = a.modes.split(",")
    engines = {m: make_engine(target, draft, m, None, P_MIN) for m in modes}
    for e in engines.values():
        if e.mode == "auto":
            calibrate_auto(e)
    grammar = Grammar.compile(target, a.grammar)
    rows = []
    for key in a.prompts.split(",") if a.prompts else list(PROMPTS):
        toks = encode_chat(target, [{"role": "user", "content": prompt_text(key)}])
        for mode, eng in engines.items():
            eng.run(toks, max_tokens=8, reuse_cache=False)  # warm-up
            tps: dict[bool, list[float]] = {False: [], True: []}
            out: dict[bool, list[int]] = {}
            for _ in range(a.repeats):
                for constrained in (False, True):
                    con = grammar.fork() if constrained else None
                    eng.clear_store()  # every run a first request: neither copies the other
                    try:
                        r = eng.run(toks, max_tokens=a.n, reuse_cache=False, constraint=con)
                    finally:
                        if con is not None:
                            con.close()
                    tps[constrained].append(r.stats.tokens_per_second)
                    out.setdefault(constrained, r.tokens)
            free, held = statistics.median(tps[False]), statistics.median(tps[True])
            rows.append(
                {
                    "prompt": key,
                    "mode": mode,
                    "tok_s": round(free, 2),
                    "tok_s_grammar": round(held, 2),
                    "ratio": round(held / free, 3),
                    "identical": out[False] == out[True],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    grammar.close()
    print()
    print("| mode | prompts | geo-mean ratio (grammar / none) | lowest | identical |")
    print("|---|---:|---:|---:|---|")
    for mode in modes:
        rs = [r for r in rows if r["mode"] == mode]
        geo = math.exp(statistics.fmean(math.log(r["ratio"]) for r in rs))
        low = min(rs, key=lambda r: r["ratio"])
        same = all(r["identical"] for r in rs)
        print(f"| {mode} | {len(rs)} | {geo:.3f} | {low['ratio']:.3f} ({low['prompt']}) | {same} |")
    loaded.close()


if __name__ == "__main__":
    main()
