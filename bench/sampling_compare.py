"""Sampled speculation, measured: target alone vs draft + rejection sampling vs draft +
sample-and-match, on the default SmolLM2 pair at llama.cpp's default sampling settings.

    .venv/bin/python bench/sampling_compare.py [--repeats 3] [-n 128] [--threads N] [--json FILE]

Every run starts from a fresh cache (reuse_cache=False). Within each repeat the configurations
alternate (in an order rotated per repeat) in one process, so a slow patch on a shared machine
hits all of them alike; the table reports medians over the repeats and the speed-up of each
median against the target alone on the same prompt, beside the median of the per-repeat ratios
(each configuration against the baseline run next to it, which a shared machine disturbs less).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

from specrun.chat_template import encode_chat
from specrun.decoding.engine import Engine, SpecConfig
from specrun.decoding.sampling import SamplingParams
from specrun.llama.backend import physical_cores
from specrun.llama.model import LoadOptions, Model
from specrun.models.registry import Registry

TARGET = "smollm2-135m-instruct-f32"
DRAFT = "smollm2-135m-instruct-q4_0"
PROMPTS = {
    "code": "Write a Python function that checks whether a string is a palindrome, with a docstring.",
    "prose": "Write a short paragraph describing a walk through a forest in autumn.",
    "list": "List ten countries in Europe and their capitals, one per line.",
    "question": "Why is the sky blue? Explain it simply.",
}
PARAMS = SamplingParams(temp=0.8, top_k=40, top_p=0.95, min_p=0.05)
CONFIGS = {
    "none": SpecConfig(mode="none"),
    "draft+rejection": SpecConfig(mode="draft", draft_max=4, verify="rejection"),
    "draft+match": SpecConfig(mode="draft", draft_max=4, verify="match"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument(
        "--threads", type=int, default=0, help="CPU threads per model (0: physical cores)"
    )
    ap.add_argument("--json", default=None, help="also write every run to this file")
    args = ap.parse_args(argv)

    threads = args.threads or physical_cores()
    reg = Registry.load()
    target = Model(reg.ensure(TARGET), LoadOptions(n_ctx=2048, n_threads=threads))
    draft = Model(reg.ensure(DRAFT), LoadOptions(n_ctx=2048, n_threads=threads, amx_rows=True))
    engines = {
        name: Engine(target, draft if cfg.mode == "draft" else None, cfg)
        for name, cfg in CONFIGS.items()
    }
    prompts = {k: encode_chat(target, [{"role": "user", "content": v}]) for k, v in PROMPTS.items()}

    # Warm-up: first decodes pay for allocations and page faults.
    for eng in engines.values():
        eng.run(prompts["question"], max_tokens=16, params=PARAMS, reuse_cache=False)

    runs: list[dict[str, object]] = []
    names = list(CONFIGS)
    t_start = time.perf_counter()
    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for pi, (pname, toks) in enumerate(prompts.items()):
            params = replace(PARAMS, seed=1000 * rep + pi)
            for cname in order:
                r = engines[cname].run(
                    toks, max_tokens=args.max_tokens, params=params, reuse_cache=False
                )
                st = r.stats
                runs.append(
                    {
                        "repeat": rep,
                        "prompt": pname,
                        "config": cname,
                        "seed": params.seed,
                        "generated": st.generated,
                        "tok_s": st.tokens_per_second,
                        "acceptance": st.acceptance_rate if st.drafted else None,
                        "mean_len": st.mean_accepted_length,
                    }
                )
        print(
            f"repeat {rep + 1}/{args.repeats} done ({time.perf_counter() - t_start:.0f} s)",
            file=sys.stderr,
        )

    def med(prompt: str, config: str, key: str) -> float | None:
        vals = [
            x[key]
            for x in runs
            if x["prompt"] == prompt and x["config"] == config and x[key] is not None
        ]
        return statistics.median(vals) if vals else None  # type: ignore[type-var]

    print(
        f"\nSmolLM2-135M F32 target, Q4_0 draft; temp {PARAMS.temp}, top-k {PARAMS.top_k}, "
        f"top-p {PARAMS.top_p}, min-p {PARAMS.min_p}; {args.max_tokens} tokens, draft_max 4, "
        f"{threads} threads, {args.repeats} repeats, medians\n"
    )

    def paired(prompt: str, config: str) -> float:
        """Median over repeats of tok/s against the baseline run of the same repeat and prompt."""
        by_rep = {(x["repeat"], x["config"]): x["tok_s"] for x in runs if x["prompt"] == prompt}
        return statistics.median(by_rep[r, config] / by_rep[r, "none"] for r in range(args.repeats))  # type: ignore[operator]

    print(
        "| prompt | config | tok/s | acceptance | tokens/pass | speed-up vs none | paired speed-up |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    speedups: dict[str, list[float]] = {c: [] for c in names}
    for pname in prompts:
        base = med(pname, "none", "tok_s") or float("nan")
        for cname in names:
            tps = med(pname, cname, "tok_s") or float("nan")
            acc = med(pname, cname, "acceptance")
            ml = med(pname, cname, "mean_len")
            speedups[cname].append(tps / base)
            print(
                f"| {pname} | {cname} | {tps:.1f} | {'-' if acc is None else f'{acc:.2f}'} | "
                f"{ml:.2f} | {tps / base:.2f}x | {paired(pname, cname):.2f}x |"
            )
    for cname in names:
        geo = statistics.geometric_mean(speedups[cname])
        print(f"| **all (geo. mean)** | {cname} | | | | {geo:.2f}x | |")

    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"params": PARAMS.as_dict(), "threads": threads, "runs": runs}, fh, indent=1)
    target.close()
    draft.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
