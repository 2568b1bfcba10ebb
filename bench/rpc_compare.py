"""Decode speed with the target on llama.cpp RPC workers: this machine alone, against one and two
`specrun worker`s on loopback, with and without simulated network latency; `none` against
`draft` and `auto` on each.

Per setup one process loads the pair once (the target as `--rpc` places it, the draft here) and
runs the configurations alternating within each repeat, a fresh cache per run, greedy; medians
of decode tok/s (prefill excluded, as `generate --json` reports it) and every run's tokens
checked against this machine's `none`. Workers are started here on 127.0.0.1 and stopped here.

Latency: with ``--delay-ms D`` the workers are reached through a forwarder that holds every
chunk D ms in each direction (a round trip costs 2 D more), run as its own process. Where the
kernel has netem (``--check-netem`` says), the kernel can add the delay instead, to every packet
on a loopback of a network namespace of the benchmark's own (this machine alone sends nothing
over it, so its figures stay as they are)::

    unshare -rn sh -c 'ip link set lo up && tc qdisc add dev lo root netem delay 1ms &&
                       .venv/bin/python bench/rpc_compare.py --delay-ms 0'

Usage: .venv/bin/python bench/rpc_compare.py [--pair smollm2-135m] [-n 128] [--repeats 3]
           [--delay-ms 1] [--configs none,draft:4,auto:8] [--threads 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

# The named prompts of specrun.benchmark.harness's set that this measures (the qa passage is the
# set's; before the one set it was a shorter one).
PROMPT_NAMES = ("qa", "code")
NETEM = ["sh", "-c", "ip link set lo up && tc qdisc add dev lo root netem delay 1ms"]


# -- simulated latency ---------------------------------------------------------------------------


def serve_proxy(listen_port: int, target_port: int, delay_s: float) -> None:
    """Forward 127.0.0.1:listen_port -> 127.0.0.1:target_port, each chunk held delay_s per direction."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", listen_port))
    srv.listen(8)

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        q: list[tuple[float, int, bytes]] = []
        cv = threading.Condition()
        n = [0]

        def reader() -> None:
            while True:
                try:
                    data = src.recv(1 << 20)
                except OSError:
                    data = b""
                with cv:
                    n[0] += 1
                    heapq.heappush(q, (time.monotonic() + delay_s, n[0], data))
                    cv.notify()
                if not data:
                    return

        def writer() -> None:
            while True:
                with cv:
                    while not q:
                        cv.wait()
                    due, _, data = q[0]
                    wait = due - time.monotonic()
                    if wait > 0:
                        cv.wait(wait)
                        continue
                    heapq.heappop(q)
                try:
                    if not data:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=reader, daemon=True).start()
        threading.Thread(target=writer, daemon=True).start()

    while True:
        a, _ = srv.accept()
        b = socket.create_connection(("127.0.0.1", target_port))
        for s in (a, b):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pipe(a, b)
        pipe(b, a)


def netem_allowed() -> tuple[bool, str]:
    try:
        p = subprocess.run(["unshare", "-rn", *NETEM], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    return p.returncode == 0, (p.stderr.strip() or "ok")


# -- workers -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"process for port {port} exited {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"nothing listening on {port} after {timeout} s")


class Workers:
    """n `specrun worker`s (and, with a delay, a forwarder before each); stopped on exit."""

    def __init__(self, n: int, threads: int, delay_ms: float, cache: str | None):
        self.procs: list[subprocess.Popen] = []
        self.endpoints: list[str] = []
        specrun = str(Path(sys.executable).with_name("specrun"))
        for _ in range(n):
            port = free_port()
            cmd = [specrun, "worker", "--port", str(port), "--threads", str(threads)]
            if cache:
                cmd += ["--cache", cache]
            w = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.procs.append(w)
            wait_listening(port, w)
            if delay_ms:
                front = free_port()
                px = subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--serve-proxy",
                        str(front),
                        str(port),
                        str(delay_ms / 1000),
                    ]
                )
                self.procs.append(px)
                wait_listening(front, px)
                port = front
            self.endpoints.append(f"127.0.0.1:{port}")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


# -- the measurement ---------------------------------------------------------------------------


def run_setup(
    pair: str,
    rpc: str | None,
    configs: list[tuple[str, int | None]],
    n: int,
    repeats: int,
    threads: int,
) -> dict[str, dict[str, list]]:
    from specrun import defaults
    from specrun.benchmark.harness import P_MIN, PROMPTS, load_pair
    from specrun.chat_template import encode_chat
    from specrun.decoding.engine import Engine, SpecConfig
    from specrun.decoding.sampling import SamplingParams
    from specrun.session import calibrate_auto

    # The context the command line gives (defaults.CTX), the target's layers on the workers.
    loaded, target, draft = load_pair(pair, threads=threads, ctx=defaults.CTX, rpc=rpc)
    try:
        engines = {}
        for mode, k in configs:
            eng = Engine(
                target,
                draft if mode != "none" else None,
                SpecConfig(mode=mode, draft_max=k or 4, draft_p_min=P_MIN),
            )
            if mode == "auto":
                calibrate_auto(eng)
            engines[f"{mode}:{k}" if k else mode] = eng
        prompts = {
            key: encode_chat(target, [{"role": "user", "content": text}])
            for key, text in ((name, PROMPTS[name]) for name in PROMPT_NAMES)
        }
        out: dict[str, dict[str, list]] = {key: {name: [] for name in engines} for key in prompts}
        for eng in (
            engines.values()
        ):  # first passes allocate compute buffers (and, remote, graphs): not timed
            eng.run(
                next(iter(prompts.values())),
                max_tokens=8,
                params=SamplingParams(temp=0.0),
                reuse_cache=False,
            )
        for _ in range(repeats):
            for key, toks in prompts.items():
                for name, eng in engines.items():
                    r = eng.run(
                        toks, max_tokens=n, params=SamplingParams(temp=0.0), reuse_cache=False
                    )
                    out[key][name].append(
                        (r.stats.tokens_per_second, list(r.tokens), r.stats.mean_accepted_length)
                    )
        return out
    finally:
        loaded.close()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-proxy":
        serve_proxy(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--delay-ms", default="1", help="simulated one-way delays to add, comma-separated (0: none)"
    )
    ap.add_argument("--configs", default="none,draft:4,auto:8")
    ap.add_argument("--setups", default="local,1,2", help="local and/or numbers of workers")
    ap.add_argument("--cache", default=None, help="the workers' --cache DIR")
    ap.add_argument("--check-netem", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    if a.check_netem:
        ok, why = netem_allowed()
        print(f"netem in an unshare -rn namespace: {'yes' if ok else 'no'} ({why})")
        return
    configs = []
    for c in a.configs.split(","):
        mode, _, k = c.partition(":")
        configs.append((mode, int(k) if k else None))
    delays = [float(x) for x in a.delay_ms.split(",")]
    setups: list[tuple[str, int, float]] = []
    for s in a.setups.split(","):
        if s == "local":
            setups.append(("this machine", 0, 0.0))
        else:
            for d in delays:
                label = f"{s} worker{'s' if s != '1' else ''}" + (
                    f", +{d:g} ms each way" if d else ""
                )
                setups.append((label, int(s), d))
    results = {}
    for label, n_workers, delay in setups:
        print(f"== {label}", file=sys.stderr, flush=True)
        workers = Workers(n_workers, a.threads, delay, a.cache) if n_workers else None
        try:
            results[label] = run_setup(
                a.pair,
                ",".join(workers.endpoints) if workers else None,
                configs,
                a.n,
                a.repeats,
                a.threads,
            )
        finally:
            if workers:
                workers.close()
    base = (
        {key: results["this machine"][key]["none"][0][1] for key in PROMPT_NAMES}
        if "this machine" in results
        else None
    )
    names = [f"{m}:{k}" if k else m for m, k in configs]
    header = (
        "| setup | prompt | "
        + " | ".join(
            "none tok/s"
            if n == "none"
            else f"{n.replace(':', ' K=' if not n.startswith('auto') else ' K<=')}"
            for n in names
        )
        + " | tokens = local none |"
    )
    lines = [header, "|" + "---|" * (len(names) + 3)]
    for label, per_prompt in results.items():
        for key, per_cfg in per_prompt.items():
            med = {name: statistics.median(r[0] for r in runs) for name, runs in per_cfg.items()}
            same = base is None or all(r[1] == base[key] for runs in per_cfg.values() for r in runs)
            cells = []
            for name in names:
                if name == "none":
                    cells.append(f"{med[name]:.1f}")
                else:
                    mal = statistics.median(r[2] for r in per_cfg[name])
                    cells.append(
                        f"{med[name]:.1f} ({med[name] / med['none']:.2f}x, {mal:.2f} tok/pass)"
                    )
            lines.append(
                f"| {label} | {key} | " + " | ".join(cells) + f" | {'yes' if same else 'NO'} |"
            )
    table = "\n".join(lines)
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    print(
        f"\n{cpu}, {os.cpu_count()} CPUs, {a.threads} threads per process, greedy, {a.n} tokens, "
        f"medians of {a.repeats}\n\n{table}"
    )
    if a.md:
        Path(a.md).write_text(table + "\n")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "cpu": cpu,
                    "args": vars(a),
                    "results": {
                        label: {
                            key: {name: [[r[0], r[2]] for r in runs] for name, runs in pc.items()}
                            for key, pc in pp.items()
                        }
                        for label, pp in results.items()
                    },
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
