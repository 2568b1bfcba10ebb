"""Agents' workloads over HTTP: `specrun serve` against llama.cpp's own llama-server, the same
requests, the same grammar on both sides (greedy).

Two workloads: ``json`` -- the json_extract requests of workloads.jsonl, each with
``response_format: json_schema`` (name, age, city, job); ``tools`` -- one function-calling
conversation of the tool_calls category, every turn with ``tool_choice: "required"`` (both servers
build the call's grammar from the tools), a tool result fed back after each call. Every server is
started here on 127.0.0.1 and stopped after; all run at once and the requests alternate between
them, so a slow spell of the machine lands on every side. Decode speed is each server's own
``timings`` (predicted_n / predicted_ms, summed over a workload). specrun's replies under auto are
compared token for token with its own constrained plain decoding (``specrun.mode: none``).

    .venv/bin/python bench/structured_compare.py --llama-server /path/llama-server \\
        --pair qwen2.5-coder-0.5b --server none,md:4,ngram-mod --workloads json,tools
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from specrun.benchmark.harness import WORKLOADS, pair_files
from specrun.benchmark.servers import free_port, post_json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "job": {"type": "string"},
    },
    "required": ["name", "age", "city", "job"],
}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": list(props)}}}
    for name, desc, props in (
        ("get_weather", "Current weather in a city.", {"city": {"type": "string"}}),
        ("get_time", "Local time in a city.", {"city": {"type": "string"}}),
        ("convert_currency", "Convert an amount between currencies.", {
            "amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}}),
        ("search_flights", "Find flights between two cities on a date.", {
            "origin": {"type": "string"}, "destination": {"type": "string"},
            "date": {"type": "string"}}),
    )
]  # fmt: skip


class Side:
    def __init__(self, name: str, cmd: list[str], port: int) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/structured_compare.{name.replace(':', '_')}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.n = 0
        self.ms = 0.0

    def ready(self, timeout: float = 300.0) -> None:
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                sys.exit(f"{self.name} exited: see {self.log.name}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        sys.exit(f"{self.name} not ready in {timeout:.0f} s")

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        r = post_json(f"{self.url}/v1/chat/completions", body)
        t = r.get("timings") or {}
        self.n += int(t.get("predicted_n", 0))
        self.ms += float(t.get("predicted_ms", 0.0))
        return r

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def llama_cmd(exe: str, target: str, draft: str, conf: str, port: int, threads: int) -> list[str]:
    cmd = [exe, "-m", target, "--jinja", "-t", str(threads), "-c", "4096", "--port", str(port),
           "--host", "127.0.0.1", "-np", "1"]  # fmt: skip
    if conf.startswith("md:"):
        # -md only loads the draft: speculation is --spec-type's (default none)
        cmd += ["--spec-type", "draft-simple", "-md", draft, "--spec-draft-n-max", conf[3:],
                "-td", str(threads)]  # fmt: skip
    elif conf != "none":
        cmd += ["--spec-type", conf]
    return cmd


def workload(kind: str) -> list[list[str]]:
    """Conversations (lists of user turns) of a workload."""
    cat = {"json": "json_extract", "tools": "tool_calls"}[kind]
    rows = [json.loads(line) for line in open(WORKLOADS, encoding="utf-8")]
    convs = [r["turns"] for r in rows if r["category"] == cat]
    return [[t for c in convs for t in c]] if kind == "tools" else convs


def run(args: argparse.Namespace) -> dict[str, Any]:
    target, draft = pair_files(args.pair)
    sides: list[Side] = []
    port = free_port()
    sides.append(Side("specrun:auto", [sys.executable, "-m", "specrun", "serve", "--pair",
                  args.pair, "-t", str(args.threads), "--ctx", "4096", "--port", str(port)], port))  # fmt: skip
    for conf in args.server.split(","):
        port = free_port()
        cmd = llama_cmd(args.llama_server, target, draft, conf, port, args.threads)
        sides.append(Side(f"llama-server:{conf}", cmd, port))
    report: dict[str, Any] = {"pair": args.pair, "workloads": {}}
    try:
        for s in sides:
            s.ready()
        for kind in args.workloads.split(","):
            for s in sides:
                s.n, s.ms = 0, 0.0
            same, total = 0, 0
            for conv in workload(kind)[: args.limit or None]:
                history: dict[str, list[dict[str, Any]]] = {s.name: [] for s in sides}
                for turn in conv:
                    for s in sides:
                        msgs = history[s.name] + [{"role": "user", "content": turn}]
                        body: dict[str, Any] = {"messages": msgs, "temperature": 0,
                                                "max_tokens": args.n, "seed": 1}  # fmt: skip
                        if kind == "json":
                            body["response_format"] = {"type": "json_schema", "json_schema": {
                                "name": "person", "schema": SCHEMA, "strict": True}}  # fmt: skip
                        else:
                            body |= {"tools": TOOLS, "tool_choice": "required",
                                     "parallel_tool_calls": False}  # fmt: skip
                        if s.name.startswith("specrun"):
                            body["specrun"] = {"return_tokens": True}
                        r = s.chat(body)
                        msg = r["choices"][0]["message"]
                        if s.name.startswith("specrun"):
                            plain = post_json(f"{s.url}/v1/chat/completions",
                                         body | {"specrun": {"mode": "none", "return_tokens": True}})  # fmt: skip
                            total += 1
                            same += plain["choices"][0]["tokens"] == r["choices"][0]["tokens"]
                        if kind == "tools":
                            calls = msg.get("tool_calls") or []
                            keep = {"role": "assistant", "content": msg.get("content") or "",
                                    "tool_calls": calls}  # fmt: skip
                            history[s.name] += [{"role": "user", "content": turn}, keep] + [
                                {"role": "tool", "tool_call_id": c["id"],
                                 "content": json.dumps({"ok": True, "result": "42"})}
                                for c in calls
                            ]  # fmt: skip
            base = next(s for s in sides if s.name == "llama-server:none")
            rows = {}
            for s in sides:
                tps = 1000.0 * s.n / s.ms if s.ms else 0.0
                rows[s.name] = {"tokens": s.n, "tok_s": round(tps, 2),
                                "vs_llama_plain": round(tps / (1000.0 * base.n / base.ms), 3)
                                if base.ms else None}  # fmt: skip
            report["workloads"][kind] = {"sides": rows, "specrun_identical": f"{same}/{total}"}
            print(json.dumps({kind: report["workloads"][kind]}, indent=1), flush=True)
    finally:
        for s in sides:
            s.stop()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--pair", default="qwen2.5-coder-0.5b")
    ap.add_argument("--server", default="none,md:4,ngram-mod")
    ap.add_argument("--workloads", default="json,tools")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="conversations per workload (0: all)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args()
    report = run(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
