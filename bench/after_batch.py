"""What a pass of several rows costs the single rows after it: a bet's hidden cost.

A bet's pass over K+1 rows is timed and priced (V(K+1)), but the single rows of plain decoding
right after it can run dearer too, for several rows (the machine's clock or caches: nothing else
runs between the passes here), and that is paid only because the bet was made. This times, for
each batch size n, rounds of: one pass of n rows (logits on every row, rolled back as a rejected
draft is), then ``--rows`` single rows one after another; the last ``--rows`` / 2 of those are the
reference (one row as plain decoding pays it). Sizes alternate within a round; medians over
``--reps`` rounds (the first not counted). Reported per n: each of the first rows after the batch
over the reference, their sum (in one-row times: what the bet costs beyond its pass), V(n), and
the sum as a share of V(n) - 1.

    .venv/bin/python bench/after_batch.py --pair smollm2-135m-q8_0 --sizes 2,3,5,9 --reps 16
"""

from __future__ import annotations

import argparse
import statistics
import time


def measure(
    model, sizes: list[int], reps: int, rows: int, at: int
) -> tuple[float, dict[int, dict]]:  # type: ignore[no-untyped-def]
    """(one row's seconds, per batch size n: the rows after it over one row, their sum, V(n),
    and the sum's share of V(n) - 1, None where the batch costs under 5% more than a row)."""
    bos = model.bos if model.bos >= 0 else 0
    pos = max(0, min(at, model.n_ctx - max(*sizes, rows) - 1))
    batch: dict[int, list[float]] = {n: [] for n in sizes}
    after: dict[int, list[list[float]]] = {n: [[] for _ in range(rows)] for n in sizes}
    model.clear()
    try:
        if pos:
            model.decode([bos] * pos, 0, None)
        for rep in range(reps + 1):
            for n in sizes:
                t0 = time.perf_counter()
                model.decode([bos] * n, pos, 0)
                dt = time.perf_counter() - t0
                model.truncate(pos)
                if rep:
                    batch[n].append(dt)
                for j in range(rows):
                    t0 = time.perf_counter()
                    model.decode([bos], pos + j, 0)
                    dt = time.perf_counter() - t0
                    if rep:
                        after[n][j].append(dt)
                model.truncate(pos)
    finally:
        model.clear()
    half = rows // 2
    one = statistics.median([t for n in sizes for a in after[n][half:] for t in a])
    out = {}
    for n in sizes:
        excess = [statistics.median(a) / one - 1.0 for a in after[n][:half]]
        v = statistics.median(batch[n]) / one
        share = sum(excess) / (v - 1.0) if v > 1.05 else None
        out[n] = {"excess": excess, "sum": sum(excess), "V": v, "share": share}
    return one, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="smollm2-135m", help="the target of this registry pair")
    ap.add_argument("--sizes", default="2,3,5,9")
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8, help="single rows after each batch")
    ap.add_argument("--pos", type=int, default=200, help="tokens of context before the passes")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    from specrun.session import ModelOptions, load_engine

    loaded = load_engine(ModelOptions(pair=a.pair, mode="none", threads=a.threads or None))
    try:
        sizes = [int(x) for x in a.sizes.split(",")]
        target = loaded.engine.target
        if min(sizes) < 2:
            raise SystemExit("--sizes: batches of 2 rows or more")
        one, got = measure(target, sizes, a.reps, a.rows, a.pos)
        threads = target.context_params()["n_threads"]
        print(f"{a.pair}: one row {one * 1e3:.2f} ms ({threads} threads, pos {a.pos})")
        print("| rows | V(n) | rows after it, each over one row | sum | share of V(n) - 1 |")
        print("|---:|---:|---|---:|---:|")
        for n in sizes:
            g = got[n]
            each = " / ".join(f"{100 * x:+.1f}%" for x in g["excess"])
            share = "-" if g["share"] is None else f"{g['share']:+.2f}"
            print(f"| {n} | {g['V']:.2f} | {each} | {g['sum']:+.3f} | {share} |")
    finally:
        loaded.close()


if __name__ == "__main__":
    main()
