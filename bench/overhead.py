"""What the loop costs on top of llama.cpp, and specrun's `--mode none` against llama-cpp-python's
own `Llama.generate` on the same model, prompt and threads.

For each repeat, in one process and alternating (noisy machines: medians and ratios):
  - specrun, --mode none: decode tok/s, and the share of decode time spent outside llama_decode
    (the engine's own timers: stats.decode_seconds vs stats.llama_seconds);
  - specrun, --mode draft (K=4): the same, with the draft model's llama_decode time counted in;
  - llama_cpp.Llama(...).generate(tokens, temp=0): decode tok/s, the first token (which carries the
    prompt's evaluation) excluded, as specrun's decode timer excludes the prefill.
Greedy outputs are compared token by token.

    .venv/bin/python bench/overhead.py --repeats 5 -n 128 --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("-p", "--prompt-file", default=str(ROOT / "examples" / "prompt.txt"))
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--no-llama", action="store_true", help="skip llama_cpp.Llama")
    args = ap.parse_args()

    import llama_cpp

    from specrun.chat_template import encode_chat
    from specrun.decoding.engine import Engine, SpecConfig
    from specrun.decoding.sampling import SamplingParams
    from specrun.llama.backend import physical_cores
    from specrun.llama.model import LoadOptions, Model
    from specrun.models.registry import Registry

    threads = args.threads or physical_cores()
    reg = Registry.load()
    pair = reg.pair(args.pair)
    tpath, dpath = reg.ensure(pair.target), reg.ensure(pair.draft)
    lo = LoadOptions(n_ctx=args.ctx, n_threads=threads, n_batch=512, n_outputs_max=65)
    target, draft = Model(tpath, lo), Model(dpath, dataclasses.replace(lo, amx_rows=True))
    text = Path(args.prompt_file).read_text()
    tmpl = target.chat_template()
    tokens = (
        encode_chat(target, [{"role": "user", "content": text}]) if tmpl else target.tokenize(text)
    )
    greedy = SamplingParams(temp=0.0, seed=0)

    none = Engine(target, None, SpecConfig(mode="none"))
    spec = Engine(target, draft, SpecConfig(mode="draft", draft_max=4, draft_p_min=0.6))
    llm = None
    if not args.no_llama:
        llm = llama_cpp.Llama(
            model_path=str(tpath),
            n_ctx=args.ctx,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            verbose=False,
        )

    rows: dict[str, list[tuple[float, float]]] = {"none": [], "draft": [], "Llama": []}
    outs: dict[str, list[int]] = {}

    def run_engine(name: str, eng: Engine) -> None:
        eng.reset()
        r = eng.run(tokens, max_tokens=args.n, params=greedy, reuse_cache=False)
        st = r.stats
        overhead = 1.0 - st.llama_seconds / st.decode_seconds
        rows[name].append((st.generated / st.decode_seconds, overhead))
        outs[name] = r.tokens

    def run_llama() -> None:
        assert llm is not None
        llm.reset()
        got: list[int] = []
        t_first = 0.0
        for tok in llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
            if not got:
                t_first = time.perf_counter()
            got.append(int(tok))
            if len(got) >= args.n or target.is_eog(int(tok)):
                break
        dt = time.perf_counter() - t_first
        rows["Llama"].append(((len(got) - 1) / dt, float("nan")))
        outs["Llama"] = got

    # one warm-up each
    run_engine("none", none)
    run_engine("draft", spec)
    if llm is not None:
        run_llama()
    for v in rows.values():
        v.clear()
    for _ in range(args.repeats):
        run_engine("none", none)
        if llm is not None:
            run_llama()
        run_engine("draft", spec)

    def med(name: str, i: int) -> float:
        return statistics.median(x[i] for x in rows[name])

    print(
        f"{tpath.name} (+ {dpath.name} for draft), {len(tokens)} prompt tokens, -n {args.n}, "
        f"threads {threads}, {args.repeats} repeats, medians"
    )
    print(f"{'run':<8} {'tok/s':>8} {'outside llama_decode':>22}  runs (tok/s)")
    for name in ("none", "draft", "Llama"):
        if not rows[name]:
            continue
        ov = med(name, 1)
        ov_s = "-" if ov != ov else f"{100 * ov:.2f}%"
        print(
            f"{name:<8} {med(name, 0):8.1f} {ov_s:>22}  "
            + " ".join(f"{x[0]:.1f}" for x in rows[name])
        )
    if rows["Llama"]:
        ratios = [a[0] / b[0] for a, b in zip(rows["none"], rows["Llama"], strict=True)]
        print(
            f"specrun none / Llama.generate: median ratio {statistics.median(ratios):.3f} "
            f"(per pair: {' '.join(f'{r:.3f}' for r in ratios)})"
        )
        n = min(len(outs["none"]), len(outs["Llama"]))
        same = outs["none"][:n] == outs["Llama"][:n]
        print(
            f"greedy tokens: specrun none vs Llama {'identical' if same else 'DIFFERENT'} over {n}"
        )
    print(
        f"greedy tokens: draft vs none {'identical' if outs['draft'] == outs['none'] else 'DIFFERENT'}"
    )
    target.close()
    draft.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
