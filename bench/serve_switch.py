"""Conversations interleaved on one server: what each turn waits for its first token.

Two (or more) chat conversations, each opening with a long document, take turns: A's first
turn, B's, A's second ("Go on."), B's second, ... Each request is a streamed, greedy chat
completion; per turn: time to first token, the request's whole time, prompt and cached tokens
(``usage.prompt_tokens_details.cached_tokens``). A server that keeps one KV cache evaluates each
conversation's whole prompt again at every switch; one with a cache of earlier prompts
(``specrun serve --cache-ram``, llama-server's ``--cache-ram``) only its new tail.

    .venv/bin/python bench/serve_switch.py --start '.venv/bin/specrun serve --pair smollm2-135m -t 2 --port {port}'
    .venv/bin/python bench/serve_switch.py --start '... --cache-ram 0 --port {port}'   # without
    .venv/bin/python bench/serve_switch.py --url http://127.0.0.1:8080 --turns 4 -n 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serve_load import Started  # noqa: E402

# The documents the conversations open with: this repository's own text, ~900-1000 tokens each
# with SmolLM2's tokenizer.
DOCS = [
    ("Summarize this document:\n\n", HERE.parent / "README.md", 0),
    ("Summarize this document:\n\n", HERE.parent / "docs" / "build.md", 0),
    ("Summarize this document:\n\n", HERE.parent / "docs" / "performance.md", 0),
]


def ask(url: str, messages: list[dict[str, str]], n: int) -> dict[str, Any]:
    import httpx

    t0 = time.perf_counter()
    first, text, usage = None, "", None
    body = {
        "messages": messages,
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line[6:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for ch in chunk.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    first = first if first is not None else time.perf_counter() - t0
                    text += piece
    assert usage is not None, "the server sent no usage (stream_options.include_usage)"
    return {
        "ttft_ms": round(1000 * (first if first is not None else time.perf_counter() - t0), 1),
        "request_ms": round(1000 * (time.perf_counter() - t0), 1),
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "text": text,
    }


def med(xs: Any) -> float:
    return round(statistics.median(xs), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running OpenAI-compatible server")
    where.add_argument("--start", help="a server command to start and stop ({port}: a free port)")
    ap.add_argument("--conversations", type=int, default=2, help="2 or 3")
    ap.add_argument("--turns", type=int, default=3, help="turns of each conversation")
    ap.add_argument("-n", type=int, default=16, help="tokens per reply")
    ap.add_argument("--chars", type=int, default=3000, help="characters of each document")
    ap.add_argument("--label", default="")
    ap.add_argument("--json", help="append the run (one JSON line) to this file")
    a = ap.parse_args(argv)
    if not 1 <= a.conversations <= len(DOCS):
        ap.error(f"--conversations must be 1 to {len(DOCS)}")
    started = Started(a.start, 300.0) if a.start else None
    url = started.url if started else a.url.rstrip("/")
    try:
        convs = [
            [{"role": "user", "content": head + path.read_text()[skip : skip + a.chars]}]
            for head, path, skip in DOCS[: a.conversations]
        ]
        turns = []
        for t in range(a.turns):
            for c, msgs in enumerate(convs):
                r = ask(url, msgs, a.n)
                msgs += [
                    {"role": "assistant", "content": r.pop("text")},
                    {"role": "user", "content": "Go on."},
                ]
                turns.append({"conversation": "ABC"[c], "turn": t + 1, **r})
                print(json.dumps(turns[-1]), flush=True)
    finally:
        if started:
            started.stop()
    later = [x for x in turns if x["turn"] > 1]  # after a switch
    out = {
        "label": a.label,
        "turns": turns,
        "first_turn_ttft_ms": med(x["ttft_ms"] for x in turns if x["turn"] == 1),
        "later_ttft_ms": med(x["ttft_ms"] for x in later) if later else None,
        "later_request_ms": med(x["request_ms"] for x in later) if later else None,
    }
    print(
        f"{a.label or url}: first turns' time to first token {out['first_turn_ttft_ms']} ms; "
        f"later turns' (after a switch) {out['later_ttft_ms']} ms, their requests "
        f"{out['later_request_ms']} ms (medians)"
    )
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
