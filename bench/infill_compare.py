"""An editor's workload: fill-in-the-middle requests cut from this repository's own sources, sent
to `specrun serve` and to llama.cpp's `llama-server` as llama.vim sends them.

Each request removes a middle of 1-20 lines from a function of a file under src/specrun/ (seeded,
so every run cuts the same ones): ``input_prefix`` is up to 64 lines before the cut (llama.vim
sends its n_prefix lines), ``input_suffix`` up to 32 after, ``prompt`` the text of the cut's first
line up to the cursor (its indentation), ``input_extra`` the file's other functions as llama.vim's
ring chunks ({filename, text}, 3 of them). llama.vim's body otherwise (``n_indent``, its
``samplers`` and ``response_fields``, ``cache_prompt``), greedy (``top_k: 1``) and without its
time limits, so that both sides decode the same tokens to ``n_predict``. Every server is started
here on 127.0.0.1 and stopped after, one slot each, all running at once; the requests alternate
between them. Decode speed is each server's own ``timings`` (predicted_n over predicted_ms,
summed over the workload).

    .venv/bin/python bench/infill_compare.py --llama-server /path/llama-server \\
        --pair qwen2.5-coder-0.5b --requests 20 --server none,md:4,ngram-mod
"""

from __future__ import annotations

import argparse
import ast
import random
import sys
from pathlib import Path
from typing import Any

from specrun.benchmark.harness import pair_files
from specrun.benchmark.servers import ServerProcess, post_json

ROOT = Path(__file__).resolve().parent.parent
FIELDS = [
    "content", "timings/prompt_n", "timings/prompt_ms", "timings/predicted_n",
    "timings/predicted_ms", "truncated", "tokens_cached",
]  # fmt: skip


def cuts(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` llama.vim bodies, each a middle of 1-20 lines cut from a function of src/specrun."""
    rng = random.Random(seed)
    files = sorted((ROOT / "src" / "specrun").rglob("*.py"))
    out: list[dict[str, Any]] = []
    while len(out) < n:
        path = rng.choice(files)
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        funcs = [
            f
            for f in ast.walk(ast.parse(text))
            if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            and f.end_lineno is not None
            and f.end_lineno - f.lineno >= 4
        ]
        if len(funcs) < 2:
            continue
        f = rng.choice(funcs)
        assert f.end_lineno is not None
        body0 = f.body[0].lineno - 1  # the body's first line (0-based), after the signature
        end = f.end_lineno  # one past the function's last line
        start = rng.randrange(body0, end - 1)
        size = rng.randint(1, min(20, end - start))
        cur = lines[start]
        indent = cur[: len(cur) - len(cur.lstrip())]
        others = [g for g in funcs if g is not f and g.end_lineno is not None]
        chunks = [
            {
                "filename": str(path.relative_to(ROOT)),
                "text": "".join(lines[g.lineno - 1 : g.end_lineno]),
            }
            for g in rng.sample(others, min(3, len(others)))
        ]
        out.append(
            {
                "input_prefix": "".join(lines[max(0, start - 64) : start]),
                "input_suffix": "".join(lines[start + size : start + size + 32]),
                "input_extra": chunks,
                "prompt": indent,
                "n_predict": 64,
                "n_indent": len(indent),
                "top_k": 1,
                "top_p": 0.99,
                "temperature": 0,
                "samplers": ["top_k", "top_p", "infill"],
                "stream": False,
                "cache_prompt": True,
                "response_fields": FIELDS,
                "_where": f"{path.relative_to(ROOT)}:{start + 1}+{size}",
            }
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b")
    ap.add_argument("--server", default="none,md:4,ngram-mod", help="llama-server's settings")
    ap.add_argument("--mode", default="auto", help="specrun's mode")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192)
    args = ap.parse_args()
    target, draft = pair_files(args.pair)
    t, c = str(args.threads), str(args.ctx)
    cmds: dict[str, list[str]] = {
        f"specrun {args.mode}": [
            sys.executable, "-m", "specrun", "serve", "--pair", args.pair, "--mode", args.mode,
            "-t", t, "--ctx", c, "--port", "{port}",
        ],
    }  # fmt: skip
    for conf in args.server.split(","):
        cmd = [args.llama_server, "-m", target, "-t", t, "-c", c, "--host", "127.0.0.1",
               "--port", "{port}", "-np", "1"]  # fmt: skip
        if conf.startswith("md:"):
            cmd += ["--spec-type", "draft-simple", "-md", draft, "--spec-draft-n-max", conf[3:],
                    "-td", t]  # fmt: skip
        elif conf != "none":
            cmd += ["--spec-type", conf]
        cmds[f"llama-server {conf}"] = cmd
    bodies = cuts(args.requests, args.seed)
    servers: dict[str, ServerProcess] = {}
    sums = {name: [0, 0.0, 0] for name in cmds}  # predicted_n, predicted_ms, requests
    try:
        for name, cmd in cmds.items():
            servers[name] = ServerProcess(cmd, f"/tmp/infill_compare.{name.replace(' ', '_')}.log")
        for i, body in enumerate(bodies):
            req = {k: v for k, v in body.items() if not k.startswith("_")}
            for name, srv in servers.items():
                r = post_json(srv.url + "/infill", req)
                # response_fields flattens the paths it names: "timings/predicted_n" is a key
                tm = r.get("timings") or {
                    k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("timings/")
                }
                s = sums[name]
                s[0] += int(tm.get("predicted_n", 0))
                s[1] += float(tm.get("predicted_ms", 0.0))
                s[2] += 1
            print(f"{i + 1}/{len(bodies)} {body['_where']}", file=sys.stderr, flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    base = next((n for n in sums if n == "llama-server none"), None)
    base_tps = sums[base][0] / (sums[base][1] / 1000) if base and sums[base][1] else None
    print("| server | tokens | decode tok/s | vs llama-server plain |\n|---|---:|---:|---:|")
    for name, (n, ms, _k) in sums.items():
        tps = n / (ms / 1000) if ms else 0.0
        ratio = f"{tps / base_tps:.2f}x" if base_tps else "-"
        print(f"| {name} | {n} | {tps:.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
