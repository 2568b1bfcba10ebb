"""Time to first token over HTTP: `specrun serve` against llama.cpp's `llama-server` on the same
target file, prompts of N tokens, with and without a cached prefix.

Both servers are started here on 127.0.0.1 (one slot each, the same threads and context) and
stopped after; requests alternate between them. Each request is llama-server's ``/completion``
with the prompt as token ids and ``n_predict: 1``, so both evaluate exactly the same tokens:

- ``cold``: N tokens no earlier request began with (the cache holds nothing of them);
- ``cached``: a 1,000-token prefix the server evaluated just before, then N new tokens (an
  editor's next request, a chat's next turn: only the N are evaluated).

Per request: the server's own ``timings.prompt_ms`` (what llama-server reports) and the client's
wall time to the whole response (one token: the time to first token). Medians of ``--repeats``.

    .venv/bin/python bench/serve_ttft.py --llama-server /path/llama-server \\
        --pairs smollm2-135m,qwen2.5-coder-0.5b --sizes 8,40,100,400,1500
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from specrun.benchmark.harness import pair_files
from specrun.benchmark.servers import ServerProcess, post_json


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    out = post_json(url + "/completion", body)
    return out, time.perf_counter() - t0


def tokens(rng: random.Random, n: int, n_vocab: int = 40000) -> list[int]:
    """N ordinary token ids (not special), different each call."""
    return [rng.randrange(1000, n_vocab) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--pairs", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--sizes", default="8,40,100,400,1500")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--json", help="append one JSON line per (pair, size, kind) here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(0)
    rows = []
    for pair in args.pairs.split(","):
        target, _draft = pair_files(pair)
        t = str(args.threads)
        cmds = {
            "specrun": [
                sys.executable, "-m", "specrun", "serve", "--pair", pair, "-t", t,
                "--ctx", str(args.ctx), "--port", "{port}", "--temp", "0",
            ],
            "llama-server": [
                args.llama_server, "-m", target, "-t", t, "-c", str(args.ctx),
                "--port", "{port}", "--host", "127.0.0.1", "-np", "1",
            ],
        }  # fmt: skip
        servers: dict[str, ServerProcess] = {}
        try:
            for name, cmd in cmds.items():
                servers[name] = ServerProcess(cmd, f"/tmp/serve_ttft_{name}.log")
            for n in sizes:
                got: dict[tuple[str, str], list[tuple[float, float]]] = {}
                for _ in range(args.repeats):
                    cold = tokens(rng, n)
                    prefix = tokens(rng, 1000)
                    new = tokens(rng, n)
                    for name, srv in servers.items():
                        body = {"n_predict": 1, "temperature": 0, "cache_prompt": True}
                        out, wall = post(srv.url, body | {"prompt": cold})
                        got.setdefault((name, "cold"), []).append(
                            (out["timings"]["prompt_ms"], 1000 * wall)
                        )
                        post(srv.url, body | {"prompt": prefix})  # the prefix, evaluated
                        out, wall = post(srv.url, body | {"prompt": prefix + new})
                        assert out["timings"]["prompt_n"] <= n + 1, out["timings"]
                        got.setdefault((name, "cached"), []).append(
                            (out["timings"]["prompt_ms"], 1000 * wall)
                        )
                for kind in ("cold", "cached"):
                    row: dict[str, Any] = {"pair": pair, "tokens": n, "kind": kind}
                    for name in servers:
                        xs = got[name, kind]
                        row[f"{name}_prompt_ms"] = statistics.median(x[0] for x in xs)
                        row[f"{name}_ttft_ms"] = statistics.median(x[1] for x in xs)
                    row["ratio_prompt"] = row["specrun_prompt_ms"] / row["llama-server_prompt_ms"]
                    row["ratio_ttft"] = row["specrun_ttft_ms"] / row["llama-server_ttft_ms"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.json:
                        with open(args.json, "a", encoding="utf-8") as f:
                            f.write(json.dumps(row) + "\n")
        finally:
            for srv in servers.values():
                srv.stop()
    print("| pair | tokens | prefix | specrun prompt_ms | llama-server prompt_ms | ratio "
          "| specrun TTFT ms | llama-server TTFT ms | ratio |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['pair']} | {r['tokens']} | {'1000 cached' if r['kind'] == 'cached' else '-'} "
            f"| {r['specrun_prompt_ms']:.1f} | {r['llama-server_prompt_ms']:.1f} "
            f"| {r['ratio_prompt']:.2f} | {r['specrun_ttft_ms']:.1f} "
            f"| {r['llama-server_ttft_ms']:.1f} | {r['ratio_ttft']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
