"""How often greedy speculation parts from the target alone when batched and single rows do not
agree: the near-tie divergence rate of a build that is not row-exact (e.g. llama.cpp's default,
`--lib`), against specrun's own build, on the same prompts.

For every prompt (modes_compare's and the builtin bench suite's first turns) the target alone
(`--mode none`) and `--mode lookup` / `--mode draft` (K=4) generate greedily; a run counts as
diverged when its tokens differ from the target alone's, and the first differing position is kept.

    .venv/bin/python bench/divergence.py --pair smollm2-135m --lib /path/llama.cpp/build/bin
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def child(pair: str, n: int, exact: bool) -> dict:
    if not exact:
        os.environ["GGML_CPU_TILED_MM"] = "1"
    from modes_compare import PROMPTS

    from specrun.benchmark.suite import load_suite
    from specrun.chat_template import encode_chat
    from specrun.decoding.engine import Engine, SpecConfig
    from specrun.llama.model import LoadOptions, Model
    from specrun.models.registry import Registry

    reg = Registry.load()
    p = reg.pair(pair)
    target = Model(reg.ensure(p.target), LoadOptions(n_ctx=4096, n_threads=2, exact_rows=exact))
    draft = Model(reg.ensure(p.draft), LoadOptions(n_ctx=4096, n_threads=2, amx_rows=True))
    texts = dict(PROMPTS)
    _, suite = load_suite("builtin")
    texts.update({f"bench:{q.question_id}": q.turns[0] for q in suite})
    alone = Engine(target, None, SpecConfig(mode="none"))
    spec = {
        m: Engine(target, draft if m == "draft" else None, SpecConfig(mode=m, draft_max=4))
        for m in ("lookup", "draft")
    }
    out: dict = {"prompts": len(texts), "diverged": {m: [] for m in spec}}
    for key, text in texts.items():
        toks = encode_chat(target, [{"role": "user", "content": text}])
        want = alone.run(toks, max_tokens=n, reuse_cache=False).tokens
        for m, eng in spec.items():
            got = eng.run(toks, max_tokens=n, reuse_cache=False).tokens
            if got != want:
                first = next(
                    (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                    min(len(got), len(want)),
                )
                out["diverged"][m].append([key, first])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--lib", default=None, help="a llama.cpp build's bin dir (shared libraries)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fast", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.pair, a.n, exact=not a.fast)))
        return 0
    from verify_cost import overlay

    results = {}
    for label, lib in (("specrun build", None), (f"{a.lib}", a.lib)):
        if label != "specrun build" and lib is None:
            continue
        env = dict(os.environ)
        cmd = [sys.executable, __file__, "--child", "--pair", a.pair, "-n", str(a.n)]
        if lib:
            env["PYTHONPATH"] = os.pathsep.join([str(overlay(Path(lib))), str(HERE.parent / "src")])
            cmd.append("--fast")
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode:
            print(res.stderr[-2000:], file=sys.stderr)
            return 1
        results[label] = json.loads(res.stdout)
    for label, r in results.items():
        for m, d in r["diverged"].items():
            firsts = ", ".join(f"{k}@{i}" for k, i in d) or "none"
            print(f"{label}: --mode {m}: {len(d)}/{r['prompts']} prompts diverged ({firsts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
