"""Prompt evaluation: specrun's prompt path (``Model.prefill``: llamafile's sgemm at any size)
against its row-exact path (``Model.decode``, what every prompt took before) and, with
``--llama-bench``, llama.cpp's own ``llama-bench -p N -n 0`` on the same file and threads.

For each pair's target and each prompt length N: a prompt of N tokens evaluated from an empty
cache, the two paths alternating, the median of ``--repeats`` timings each; llama-bench's mean
over its own repetitions. Prints one table (ms per prompt and the ratios) and writes JSON.

    .venv/bin/python bench/prompt_eval.py --pairs smollm2-135m,smollm2-135m-q8_0,smollm2-135m-q4_k_m \\
        --sizes 8,40,100,400,1500 --llama-bench /path/llama-bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from typing import Any

from specrun.benchmark.harness import load_pair


def time_paths(model: Any, n: int, repeats: int) -> dict[str, float]:
    toks = [model.bos] + [1000 + (i * 37) % 5000 for i in range(n - 1)]
    out: dict[str, list[float]] = {"decode": [], "prefill": []}
    for _ in range(repeats):
        for how in ("decode", "prefill"):
            model.clear()
            t0 = time.perf_counter()
            getattr(model, how)(toks, 0)
            out[how].append(time.perf_counter() - t0)
    model.clear()
    return {k: 1000 * statistics.median(v) for k, v in out.items()}


def llama_bench(exe: str, path: str, n: int, threads: int, repeats: int) -> float | None:
    p = subprocess.run(
        [exe, "-m", path, "-p", str(n), "-n", "0", "-t", str(threads), "-r", str(repeats),
         "-o", "json"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if p.returncode != 0:
        return None
    rows = json.loads(p.stdout)
    return 1000.0 * n / float(rows[0]["avg_ts"]) if rows else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="smollm2-135m,smollm2-135m-q8_0,smollm2-135m-q4_k_m")
    ap.add_argument("--sizes", default="8,40,100,400,1500")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench, for its prompt timings")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    results = []
    print(f"{'target':<38} {'N':>5} {'row-exact ms':>12} {'prefill ms':>10} {'speed-up':>8}"
          f" {'llama-bench ms':>14} {'prefill/llama':>13}")  # fmt: skip
    for pair in args.pairs.split(","):
        loaded, target, _ = load_pair(
            pair, threads=args.threads, ctx=max(sizes) + 64, draft=False, batch=512
        )
        try:
            for n in sizes:
                t = time_paths(target, n, args.repeats)
                ref = (
                    llama_bench(args.llama_bench, str(target.path), n, args.threads, args.repeats)
                    if args.llama_bench
                    else None
                )
                row = {"pair": pair, "target": target.path.name, "n": n, **t, "llama_bench": ref}
                results.append(row)
                ref_ms = "-" if ref is None else f"{ref:.1f}"
                vs = "-" if ref is None else f"{t['prefill'] / ref:.2f}x"
                print(
                    f"{target.path.name:<38} {n:>5} {t['decode']:>12.1f} {t['prefill']:>10.1f} "
                    f"{t['decode'] / t['prefill']:>7.2f}x {ref_ms:>14} {vs:>13}",
                    flush=True,
                )
        finally:
            loaded.close()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
