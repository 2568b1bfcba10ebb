"""Load any OpenAI-compatible server with N concurrent clients over a prompt suite.

Each request is a streamed chat completion (``/v1/chat/completions``, ``stream: true``,
``stream_options.include_usage``). Per request: time to first token (TTFT: from sending to the
first chunk with text), client decode speed ((completion tokens - 1) / (last chunk - first
token)), and the server's own decode speed where it reports llama-server's
``timings.predicted_per_second``. Per run: requests/s, errors, medians. Works against
``specrun serve``, llama.cpp's ``llama-server``, or anything else that speaks the API.

    # a server already running
    .venv/bin/python bench/serve_load.py --url http://127.0.0.1:8080 --clients 1 --repeats 3

    # or started (and stopped) by the script: {port} is replaced by a free port
    .venv/bin/python bench/serve_load.py --clients 1 --repeats 3 -n 128 \\
        --start '.venv/bin/specrun serve --pair smollm2-135m -t 2 --port {port}' --label 'specrun auto'
    .venv/bin/python bench/serve_load.py --clients 1 --repeats 3 -n 128 \\
        --start '/path/llama-server -m T.gguf -md D.gguf --spec-draft-n-max 4 -t 2 --port {port}'

    # the CLI itself on the same prompts (one process per request): the baseline for a server
    .venv/bin/python bench/serve_load.py --repeats 3 -n 128 --generate '.venv/bin/specrun generate -t 2'

Runs greedy (temperature 0) unless --temperature; requests go round the suite in order, so with
one client and --repeats R each prompt runs R times, alternating prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ``builtin``: these named prompts of specrun.benchmark.harness's set (docs/performance.md's
# tables; all but code-edit, whose long prompt these runs never had).
BUILTIN = ("code", "code2", "summarize", "qa", "story")


def load_suite(spec: str) -> dict[str, str]:
    """``builtin``, a comma list of prompt names, or a Spec-Bench JSON-lines file (first turn)."""
    from specrun.benchmark.harness import PROMPTS

    if spec == "builtin":
        return {n: PROMPTS[n] for n in BUILTIN}
    path = Path(spec)
    if path.suffix == ".jsonl" and path.is_file():
        out = {}
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if line.strip():
                obj = json.loads(line)
                out[f"{obj.get('category', 'q')}-{obj.get('question_id', i)}"] = obj["turns"][0]
        return out
    names = [n for n in spec.split(",") if n]
    unknown = [n for n in names if n not in PROMPTS]
    if unknown:
        raise SystemExit(f"unknown prompt(s) {unknown}; builtin: {', '.join(PROMPTS)}")
    return {n: PROMPTS[n] for n in names}


@dataclass
class Sample:
    prompt: str
    ok: bool
    error: str = ""
    ttft: float = 0.0
    seconds: float = 0.0
    tokens: int = 0
    client_tps: float = 0.0
    server_tps: float | None = None
    cached: int | None = None


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0


async def one(client: Any, url: str, name: str, prompt: str, args: argparse.Namespace) -> Sample:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.n,
        "temperature": args.temperature,
        "seed": args.seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.model:
        body["model"] = args.model
    if args.ignore_eos:
        body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage = timings = None
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers=headers
        ) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:300]
                return Sample(name, False, f"HTTP {r.status_code}: {text}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return Sample(name, False, f"stream error: {obj['error']}")
                now = time.perf_counter()
                for c in obj.get("choices") or []:
                    if (c.get("delta") or {}).get("content"):
                        chunks += 1
                        first = first if first is not None else now
                        last = now
                usage = obj.get("usage") or usage
                timings = obj.get("timings") or timings
    except Exception as exc:  # noqa: BLE001 - a failed request is a counted error
        return Sample(name, False, f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    tokens = int(usage["completion_tokens"]) if usage else chunks
    s = Sample(name, True, seconds=end - t0, tokens=tokens)
    if first is not None:
        s.ttft = first - t0
        if last is not None and last > first and tokens > 1:
            s.client_tps = (tokens - 1) / (last - first)
    if timings and timings.get("predicted_per_second"):
        s.server_tps = float(timings["predicted_per_second"])
    if usage:
        s.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return s


async def drive(url: str, suite: dict[str, str], args: argparse.Namespace) -> Run:
    import httpx

    names = list(suite)
    total = args.requests or len(names) * args.repeats
    todo = [names[i % len(names)] for i in range(total)]
    run = Run()
    pos = 0

    async def client_loop(client: Any) -> None:
        nonlocal pos
        while pos < len(todo):
            name = todo[pos]
            pos += 1
            run.samples.append(await one(client, url, name, suite[name], args))

    limits = httpx.Limits(max_connections=args.clients + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(args.clients)))
        run.wall = time.perf_counter() - t0
    return run


def run_generate(cmd: str, suite: dict[str, str], args: argparse.Namespace) -> Run:
    """The CLI on the same prompts, one process per request: its own decode tok/s."""
    names = list(suite)
    run = Run()
    t0 = time.perf_counter()
    for i in range(args.requests or len(names) * args.repeats):
        name = names[i % len(names)]
        argv = [
            *shlex.split(cmd),
            "--json",
            "--temp",
            str(args.temperature),
            "--seed",
            str(args.seed),
            "-n",
            str(args.n),
            "--prompt",
            suite[name],
        ]
        p = subprocess.run(
            argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=args.timeout
        )
        if p.returncode != 0:
            run.samples.append(Sample(name, False, p.stderr.strip()[-300:]))
            continue
        st = json.loads(p.stdout)["stats"]
        run.samples.append(
            Sample(
                name,
                True,
                seconds=st["prefill_seconds"] + st["decode_seconds"],
                tokens=len(json.loads(p.stdout)["tokens"]),
                client_tps=st["tokens_per_second"],
                server_tps=st["tokens_per_second"],
                ttft=st["prefill_seconds"],
            )
        )
    run.wall = time.perf_counter() - t0
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Started:
    """A server command started for the run (``{port}`` filled in), stopped after it."""

    def __init__(self, cmd: str, timeout: float) -> None:
        import httpx

        self.port = free_port()
        argv = shlex.split(cmd.replace("{port}", str(self.port)))
        import tempfile

        self.log = tempfile.TemporaryFile()  # the server's output, shown if it fails to start
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                err = self.log.read().decode(errors="replace")[-2000:]
                raise SystemExit(f"the server exited ({self.proc.returncode}): {err}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise SystemExit("the server did not become healthy")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarize(run: Run, label: str, args: argparse.Namespace) -> dict[str, Any]:
    ok = [s for s in run.samples if s.ok]
    server = [s.server_tps for s in ok if s.server_tps is not None]
    by_prompt: dict[str, list[float]] = {}
    for s in ok:
        by_prompt.setdefault(s.prompt, []).append(
            s.server_tps if s.server_tps is not None else s.client_tps
        )
    return {
        "label": label,
        "clients": args.clients,
        "requests": len(run.samples),
        "errors": len(run.samples) - len(ok),
        "first_errors": [s.error for s in run.samples if not s.ok][:3],
        "wall_seconds": round(run.wall, 3),
        "requests_per_second": round(len(ok) / run.wall, 3) if run.wall else 0.0,
        "tokens_per_second_total": round(sum(s.tokens for s in ok) / run.wall, 2)
        if run.wall
        else 0.0,
        "ttft_median_ms": round(statistics.median([s.ttft for s in ok]) * 1000, 1) if ok else None,
        "ttft_p90_ms": round(pct([s.ttft for s in ok], 0.9) * 1000, 1) if ok else None,
        "decode_tps_client_median": round(statistics.median([s.client_tps for s in ok]), 2)
        if ok
        else None,
        "decode_tps_server_median": round(statistics.median(server), 2) if server else None,
        "decode_tps_by_prompt": {p: round(statistics.median(v), 2) for p, v in by_prompt.items()},
    }


def table(path: str) -> str:
    """Medians over the runs of each label: decode tok/s per prompt (the server's own figure where
    it reports one), TTFT, requests/s."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            obj = json.loads(line)
            rows.setdefault(obj["label"], []).append(obj)
    prompts: list[str] = []
    for runs in rows.values():
        for r in runs:
            prompts += [p for p in r["decode_tps_by_prompt"] if p not in prompts]
    med = statistics.median
    out = [
        "| configuration | clients | "
        + " | ".join(prompts)
        + " | decode tok/s (median) | TTFT ms | req/s | errors |",
        "|---|---:|" + "---:|" * len(prompts) + "---:|---:|---:|---:|",
    ]
    for label, runs in rows.items():
        cells = []
        for p in prompts:
            vals = [r["decode_tps_by_prompt"][p] for r in runs if p in r["decode_tps_by_prompt"]]
            cells.append(f"{med(vals):.1f}" if vals else "-")
        tps = [r["decode_tps_server_median"] or r["decode_tps_client_median"] for r in runs]
        ttft = [r["ttft_median_ms"] for r in runs if r["ttft_median_ms"] is not None]
        out.append(
            f"| {label} | {runs[0]['clients']} | "
            + " | ".join(cells)
            + f" | {med(tps):.1f} | {med(ttft):.0f} | {med([r['requests_per_second'] for r in runs]):.2f} | "
            f"{sum(r['errors'] for r in runs)} |"
        )
    return "\n".join(out)


def cpu_name() -> str:
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="base URL of a running server (without /v1)")
    where.add_argument("--start", help="a server command to start and stop; {port} is replaced")
    where.add_argument(
        "--table",
        metavar="FILE.jsonl",
        help="no run: print the markdown table of the "
        "summaries --json appended to FILE (medians over the runs of each label)",
    )
    where.add_argument(
        "--generate",
        help="no server: run this `specrun generate` command per request "
        "(--json --temp 0 -n N --prompt P appended) and report its decode tok/s, the "
        "baseline a server's single-client speed is held to",
    )
    ap.add_argument("--label", default=None)
    ap.add_argument(
        "--suite",
        default="builtin",
        help="builtin, names (code,qa,...), or FILE.jsonl (Spec-Bench)",
    )
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument(
        "--repeats", type=int, default=1, help="passes over the suite (ignored with --requests)"
    )
    ap.add_argument(
        "--requests", type=int, default=0, help="total requests (default: suite x repeats)"
    )
    ap.add_argument("--warmup", type=int, default=1, help="requests sent first and not counted")
    ap.add_argument("-n", type=int, default=128, help="max_tokens per request")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    ap.add_argument(
        "--ignore-eos", action="store_true", help="ask llama-server to ignore EOS (its extension)"
    )
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None, help="append the summary as one JSON line to FILE")
    args = ap.parse_args(argv)

    if args.table:
        print(table(args.table))
        return 0
    suite = load_suite(args.suite)
    if args.generate:
        run = run_generate(args.generate, suite, args)
        summary = summarize(run, args.label or "specrun generate", args) | {
            "n": args.n,
            "cpu": cpu_name(),
            "suite": list(suite),
        }
        print(json.dumps(summary, indent=1))
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(summary) + "\n")
        return 1 if summary["errors"] else 0
    started = Started(args.start, args.start_timeout) if args.start else None
    url = started.url if started else args.url.rstrip("/")
    label = args.label or (args.start.split()[0].rsplit("/", 1)[-1] if args.start else url)
    try:
        if args.warmup:
            warm = argparse.Namespace(**{**vars(args), "clients": 1, "requests": args.warmup})
            asyncio.run(drive(url, suite, warm))
        run = asyncio.run(drive(url, suite, args))
    finally:
        if started is not None:
            started.stop()
    summary = summarize(run, label, args) | {"n": args.n, "cpu": cpu_name(), "suite": list(suite)}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(summary) + "\n")
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
