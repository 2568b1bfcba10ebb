"""Record the target's greedy outputs on the bench workloads, for bench/suffix_sim.py.

Greedy decoding is deterministic and every exact mode emits the target's tokens, so what a
lookup drafter would propose at each step, and how much of it the target accepts, follows from
the prompt and these tokens alone. Usage:
.venv/bin/python bench/record_greedy.py --out runs.json -n 128 bench:summarization seq:sql ...
Each request also keeps ``top_p``: the target's top probability at each output position (the
distribution its token was the argmax of), for replays that ask how sure the target was.
(``bench:CATEGORY``: every prompt of that builtin category, first turn, each its own request;
``seq:CATEGORY``: every prompt of that category of data/workloads.jsonl, every turn, in order;
a prompt by name from specrun.benchmark.harness's set, e.g. ``story``: that prompt, one request.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specrun.benchmark.harness import PROMPTS, WORKLOADS, load_pair
from specrun.benchmark.suite import load_suite
from specrun.chat_template import encode_chat
from specrun.decoding import sampling as S
from specrun.decoding.engine import Engine, Result, SpecConfig, Step


def record(engine: Engine, toks: list[int], n: int) -> tuple[list[int], list[float], str]:
    """Greedy plain decoding of ``toks``: (output tokens, top probability at each, text)."""
    top: list[float] = []
    for ev in engine.generate(toks, max_tokens=n, reuse_cache=False):
        if isinstance(ev, Step) and ev.tokens:
            top.append(S.top_prob(engine.target.logits(0)))
        elif isinstance(ev, Result):
            return ev.tokens, top[: len(ev.tokens)], ev.text
    raise AssertionError("generate ended without a Result")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workloads", nargs="+")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pair", default="smollm2-135m", help="the target of this registry pair")
    ap.add_argument(
        "--chat-template",
        default=None,
        help="a built-in format's name or Jinja, for a target without a template (as specrun's flag)",
    )
    a = ap.parse_args()
    loaded, target, _ = load_pair(a.pair, threads=2, chat_template=a.chat_template, draft=False)
    engine = Engine(target, None, SpecConfig(mode="none"))
    out = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
    for key in a.workloads:
        if key in PROMPTS:
            toks = encode_chat(target, [{"role": "user", "content": PROMPTS[key]}])
            got, top, _ = record(engine, toks, a.n)
            out[key] = [{"id": key, "prompt": toks, "output": got, "top_p": top}]
            print(key, len(toks), len(got), flush=True)
            Path(a.out).write_text(json.dumps(out))
            continue
        kind, _, cat = key.partition(":")
        suite = "builtin" if kind == "bench" else WORKLOADS
        prompts = [p for p in load_suite(suite)[1] if p.category == cat]
        if a.limit:
            prompts = prompts[: a.limit]
        reqs = []
        for p in prompts:
            history: list[dict[str, str]] = []
            for user in p.turns if kind == "seq" else p.turns[:1]:
                history.append({"role": "user", "content": user})
                toks = encode_chat(target, history)
                got, top, text = record(engine, toks, a.n)
                reqs.append({"id": str(p.question_id), "prompt": toks, "output": got, "top_p": top})
                history.append({"role": "assistant", "content": text})
                print(key, p.question_id, len(toks), len(got), flush=True)
        out[key] = reqs
        Path(a.out).write_text(json.dumps(out))
    loaded.close()


if __name__ == "__main__":
    main()
