"""specrun against llama.cpp's own llama-server on the same pair, prompts, threads and greedy decoding.

For each llama-server configuration a server is started on 127.0.0.1 (and stopped after), each
chat turn is rendered with the GGUF's template by specrun and sent to both sides as the same
prompt tokens (llama-server's `/completion`, temperature 0, `n_predict` N), and the server's own
decode speed (`timings.predicted_n / predicted_ms`) is kept; specrun's decode speed is counted the
way llama-server counts its own: the first token comes with the prompt (its pass is not timed)
and an EOS is a token. A run per prompt per configuration per repeat; medians; speed-ups against
each side's own plain decoding and against llama-server's plain decoding.

llama-server configurations: none (target alone), md:K (`--spec-type draft-simple -md DRAFT
--spec-draft-n-max K`, the draft's `--spec-draft-p-min` as specrun's; `-md` alone only loads the
draft), and TYPE (`--spec-type TYPE`, an n-gram drafter,
e.g. ngram-mod, ngram-cache). Build llama-server from the llama.cpp that llama-cpp-python
vendors (README, "Development"). specrun configurations: MODE:K as modes_compare names
them (none, draft, lookup (the suffix drafter), ngram (the n-gram lookup before it), hybrid,
auto, auto-ngram).

``--prompts`` takes prompt names, bench:CATEGORY (the builtin suite's first of that category)
and seq:CATEGORY: every conversation of that category of ``--suite`` (workloads.jsonl), every
turn, a follow-up carrying each side's own earlier replies, as one run: specrun's suffix store
and one llama-server's n-gram state (a server per sequence) kept across its requests, its tok/s
the sequence's tokens over its decode time. Single prompts start afresh every time (the store
cleared; a server per request). The sides alternate per prompt and repeat, so that a slow spell
of the machine lands on both. Every configuration's replies are compared with its own side's
plain decoding (greedy speculation should not change the text; the report names where it did),
and the two sides' plain decodings with each other (llama.cpp's default build batches the prompt
with other kernels, so its greedy text can part from specrun's at a near-tie: speeds are then of
different texts of the same length).

    .venv/bin/python bench/server_compare.py --llama-server /path/llama-server --pair smollm2-135m \\
        --specrun none,draft:4,lookup:4,auto:8 --server none,md:4,ngram-mod --repeats 2 -n 128
    .venv/bin/python bench/server_compare.py --llama-server /path/llama-server \\
        --pair gemma3-270m --chat-template gemma --prompts bench:qa,bench:code
    .venv/bin/python bench/server_compare.py --llama-server /path/llama-server \\
        --prompts seq:code_edit,seq:sql --specrun none,ngram:4,lookup:4,auto:8 \\
        --server none,ngram-mod,ngram-cache
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from specrun.benchmark.harness import (
    P_MIN,
    PROMPTS,
    WORKLOADS,
    converse,
    load_pair,
    make_engine,
    prompt_text,
    sequence,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    def __init__(
        self, exe: str, target: Path, draft: Path, cfg: str, threads: int, ctx: int
    ) -> None:
        self.port = free_port()
        cmd = [
            exe,
            "-m",
            str(target),
            "-t",
            str(threads),
            "-c",
            str(ctx),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-np",
            "1",
            "--no-webui",
            # Flash attention as llama-server's default (auto: on for the CPU). With it off the
            # default build's batched prompt pass (llamafile's sgemm) parted from specrun's at the
            # Q8_0 pair's story's 4th token, and llama-server then decoded a loop.
        ]
        if cfg.startswith("md:"):
            cmd += [
                # -md only loads the draft: speculation is --spec-type's (default none)
                "--spec-type",
                "draft-simple",
                "-md",
                str(draft),
                "--spec-draft-n-max",
                cfg[3:],
                "--spec-draft-n-min",
                "0",
                "--spec-draft-p-min",
                str(P_MIN),
                "-td",
                str(threads),
            ]
        elif cfg != "none":
            cmd += ["--spec-type", cfg]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        deadline = time.time() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server ({cfg}) exited: {self.proc.stderr.read().decode()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"llama-server ({cfg}) did not become healthy")
            time.sleep(0.3)

    def run(self, prompt: list[int], n: int) -> tuple[int, float, str]:
        """One request of these prompt tokens: (tokens decoded, their decode seconds, the reply).
        Tokens, not chat messages: llama-server's own rendering of a chat template can differ
        from the GGUF's (SmolLM2's default system message left out), and the two sides then
        decode different texts (on the Q8_0 pair's story llama-server fell into a loop that its
        n-gram drafter sped up 1.47x)."""
        out = post(
            f"http://127.0.0.1:{self.port}/completion",
            {
                "prompt": prompt,
                "n_predict": n,
                "temperature": 0,
                "seed": 0,
                "cache_prompt": False,
            },
        )
        t = out["timings"]
        return int(t["predicted_n"]), float(t["predicted_ms"]) / 1e3, str(out["content"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


Job = list[list[str]]  # conversations, each its user turns


def jobs_for(keys: list[str], suite: str, limit: int) -> dict[str, Job]:
    return {
        key: [p.turns for p in sequence(suite, key, limit)]
        if key.startswith("seq:")
        else [[prompt_text(key)]]
        for key in keys
    }


def conversations(job: Job, turn) -> tuple[int, float, list[str]]:  # type: ignore[no-untyped-def]
    """Every turn of every conversation through ``turn(messages) -> (tokens, seconds, reply)``
    (modes_compare.converse): (tokens, seconds) summed, and the replies."""
    tokens, seconds = 0, 0.0
    replies: list[str] = []

    def one(history: list) -> str:
        nonlocal tokens, seconds
        n, sec, reply = turn(history)
        tokens, seconds = tokens + n, seconds + sec
        replies.append(str(reply))
        return str(reply)

    converse(job, one)
    return tokens, seconds, replies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument(
        "--prompts",
        default=",".join(PROMPTS),
        help="comma list of prompt names, bench:CATEGORY or seq:CATEGORY",
    )
    ap.add_argument(
        "--suite",
        default=WORKLOADS,
        help="the suite seq:CATEGORY reads",
    )
    ap.add_argument("--limit", type=int, default=0, help="seq: only the first N of the category")
    ap.add_argument("--specrun", default="none,draft:4,lookup:4,auto:8")
    ap.add_argument("--server", default="none,md:4,ngram-mod")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--chat-template",
        default=None,
        help="a built-in format's name or Jinja, for a target without a template (as specrun's "
        "flag); both sides get the prompt tokens it renders",
    )
    args = ap.parse_args()

    from specrun.chat_template import encode_chat
    from specrun.decoding.engine import Result, Step
    from specrun.decoding.sampling import SamplingParams
    from specrun.llama.backend import physical_cores
    from specrun.session import calibrate_auto

    threads = args.threads or physical_cores()
    prompts = [p for p in args.prompts.split(",") if p]
    jobs = jobs_for(prompts, args.suite, args.limit)
    results: dict[str, dict[str, list[float]]] = {}

    loaded, target, draft = load_pair(
        args.pair, threads=threads, ctx=args.ctx, chat_template=args.chat_template, batch=512
    )
    tpath, dpath = loaded.plan.target.path, loaded.plan.draft.path
    engines = {}
    for cfg in args.specrun.split(","):
        mode, _, k = cfg.partition(":")
        eng = make_engine(target, draft, mode, int(k) if k else None, P_MIN)
        if eng.mode == "auto":
            calibrate_auto(eng)
        engines[f"specrun {cfg}"] = eng
    greedy = SamplingParams(temp=0.0, seed=0)

    def specrun_job(eng, job: Job) -> tuple[float, list[str]]:  # type: ignore[no-untyped-def]
        # A sequence's requests share the suffix store; the next job starts without it.
        eng.clear_store()

        def turn(messages):  # type: ignore[no-untyped-def]
            # Counted as llama-server counts its own (timings.predicted_*): the first token comes
            # with the prompt, so its pass is left out of the time, and an EOS is a token. Left
            # as specrun reports it (every pass timed, EOS not counted), a 30-token answer read
            # ~7% slower than the same passes in llama-server's accounting.
            first_pass, res = None, None
            for ev in eng.generate(
                encode_chat(target, messages), max_tokens=args.n, params=greedy, reuse_cache=False
            ):
                if first_pass is None and isinstance(ev, Step):
                    first_pass = ev.stats.decode_seconds  # the decode time so far: one pass
                elif isinstance(ev, Result):
                    res = ev
            assert res is not None
            st = res.stats
            eos = 1 if res.finish_reason == "eos" else 0
            return st.generated + eos, st.decode_seconds - (first_pass or 0.0), res.text

        n, sec, replies = conversations(job, turn)
        return (n / sec if sec else 0.0), replies

    def server_job(cfg: str, job: Job) -> tuple[float, list[str]]:
        # A sequence is one server's: its n-gram state is kept across the sequence's requests,
        # as specrun's store is; a single prompt gets a fresh server (a first request).
        srv = Server(args.llama_server, tpath, dpath, cfg, threads, args.ctx)
        try:
            n, sec, replies = conversations(job, lambda m: srv.run(encode_chat(target, m), args.n))
        finally:
            srv.stop()
        return (n / sec if sec else 0.0), replies

    # The replies of each configuration's first run: greedy speculation should give the text of
    # its side's plain decoding; where it did not, its batched passes parted from its single rows
    # at a near-tie, and its speed is for another text (compared below).
    texts: dict[str, dict[str, list[str]]] = {}

    def record(label: str, key: str, got: tuple[float, list[str]]) -> None:
        results.setdefault(label, {}).setdefault(key, []).append(got[0])
        texts.setdefault(label, {}).setdefault(key, got[1])

    for _ in range(args.repeats):
        for key, job in jobs.items():
            for label, eng in engines.items():
                record(label, key, specrun_job(eng, job))
            for cfg in args.server.split(","):
                if cfg:
                    record(f"llama-server {cfg}", key, server_job(cfg, job))
    loaded.close()

    med = {lab: {p: statistics.median(v) for p, v in by.items()} for lab, by in results.items()}
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        "?",
    )
    print(
        f"{args.pair}: {tpath.name} + {dpath.name}; greedy, {args.n} tokens, {threads} threads, "
        f"medians of {args.repeats}; {cpu}"
    )
    base_s = med.get("specrun none", {})
    base_l = med.get("llama-server none", {})
    print(
        "| configuration | "
        + " | ".join(prompts)
        + " | geo-mean vs own none | vs llama-server none |"
    )
    print("|---" * (len(prompts) + 3) + "|")
    for lab, by in med.items():
        own = base_s if lab.startswith("specrun") else base_l
        cells = [f"{by[p]:.1f}" for p in prompts]
        gm = statistics.geometric_mean([by[p] / own[p] for p in prompts]) if own else float("nan")
        gl = (
            statistics.geometric_mean([by[p] / base_l[p] for p in prompts])
            if base_l
            else float("nan")
        )
        print(f"| {lab} | " + " | ".join(cells) + f" | {gm:.2f}x | {gl:.2f}x |")
    # Exactness per side: each configuration's replies against its own side's plain decoding.
    # The two sides' plain decodings may differ from each other: llama.cpp's default build
    # computes the prompt's batch (llamafile's sgemm, flash attention) in another order than
    # specrun's row-exact build, and greedy decoding parts at the first near-tie.
    same = {}
    for lab, by in texts.items():
        ref = texts.get("specrun none" if lab.startswith("specrun") else "llama-server none", {})
        same[lab] = {p: by[p] == ref.get(p, by[p]) for p in prompts}
    differ = [
        f"{lab}: {', '.join(p for p, ok in by.items() if not ok)}"
        for lab, by in same.items()
        if not all(by.values())
    ]
    print(
        "Replies other than the same side's plain decoding's: "
        + ("; ".join(differ) if differ else "none")
    )
    a, b = texts.get("specrun none"), texts.get("llama-server none")
    if a and b:
        both = [p for p in prompts if a[p] == b[p]]
        print(
            f"specrun none and llama-server none gave the same text on {len(both)} of "
            f"{len(prompts)}" + (f" ({', '.join(both)})" if both else "")
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "pair": args.pair,
                    "threads": threads,
                    "n": args.n,
                    "cpu": cpu,
                    "tok_s": med,
                    "same_text": same,
                    "replies": texts,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
