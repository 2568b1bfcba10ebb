"""What the live display costs the speculative loop: the same generation (default SmolLM2 pair,
mode draft, K=4, greedy, a fresh cache every run) consumed by PlainStream and by LiveDisplay.

    .venv/bin/python bench/display_overhead.py [--repeats 7] [-n 128] [--threads N] [--json FILE]

Both sinks write to /dev/null (the live display as if to a 100-column terminal, footer, colours
and all), so the figures are the display's own CPU cost inside the loop, not the terminal
emulator's. The two configurations alternate within each repeat (order rotated per repeat) in
one process. Reported: medians of the loop's wall time; medians of its time outside llama.cpp
calls (where the display's cost lands; less exposed to other processes on a busy machine); and
a replay of one run's recorded events through each sink with no model at all, on a simulated
clock that advances one measured loop step per event: the display's cost per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from specrun.chat_template import encode_chat
from specrun.cli.display import LiveDisplay, PlainStream
from specrun.decoding.engine import Engine, Result, SpecConfig, Step
from specrun.decoding.sampling import SamplingParams
from specrun.llama.backend import physical_cores
from specrun.llama.model import LoadOptions, Model
from specrun.models.registry import Registry

TARGET = "smollm2-135m-instruct-f32"
DRAFT = "smollm2-135m-instruct-q4_0"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _sinks(devnull: Any, piece: Callable[[int], bytes]) -> dict[str, Callable[[], Any]]:
    return {
        "plain": lambda: PlainStream(devnull),
        "live": lambda: LiveDisplay(
            out=devnull,
            err=devnull,
            width=100,
            summary="none",
            draft_max=4,
            mode="draft",
            piece=piece,
        ),
    }


def _run(engine: Engine, prompt: list[int], n: int, sink: Any) -> tuple[float, Result, list[Step]]:
    steps: list[Step] = []
    result = None
    t0 = time.perf_counter()
    with sink:
        for ev in engine.generate(
            prompt, max_tokens=n, params=SamplingParams(temp=0.0), reuse_cache=False
        ):
            if isinstance(ev, Result):
                result = ev
            else:
                sink.step(ev)
                steps.append(ev)
        assert result is not None
        # Only the loop: decode_seconds is what tok/s is computed from; prefill is the same work.
        t1 = time.perf_counter()
        sink.finish(result)
    return t1 - t0 - result.stats.prefill_seconds, result, steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument(
        "--threads", type=int, default=0, help="CPU threads per model (0: physical cores)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    threads = args.threads or physical_cores()
    reg = Registry.load()
    target = Model(reg.ensure(TARGET), LoadOptions(n_ctx=1024, n_threads=threads))
    draft = Model(reg.ensure(DRAFT), LoadOptions(n_ctx=1024, n_threads=threads, amx_rows=True))
    engine = Engine(target, draft, SpecConfig(mode="draft", draft_max=4))
    prompt = encode_chat(target, [{"role": "user", "content": PROMPT}])
    devnull = open(os.devnull, "w")  # noqa: SIM115
    sinks = _sinks(devnull, target.piece)
    names = list(sinks)

    times: dict[str, list[float]] = {k: [] for k in names}
    outside: dict[str, list[float]] = {k: [] for k in names}  # loop time outside llama.cpp calls
    tokens: dict[str, set[tuple[int, ...]]] = {k: set() for k in names}
    recorded: list[Step] = []
    _run(engine, prompt, 8, sinks["plain"]())  # warm-up
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            dt, res, steps = _run(engine, prompt, args.max_tokens, sinks[name]())
            times[name].append(dt)
            outside[name].append(dt - res.stats.llama_seconds)
            tokens[name].add(tuple(res.tokens))
            recorded = steps
        print(
            f"repeat {r + 1}: " + ", ".join(f"{k} {times[k][-1]:.3f} s" for k in names),
            file=sys.stderr,
        )

    med = {k: statistics.median(v) for k, v in times.items()}
    med_out = {k: statistics.median(v) for k, v in outside.items()}
    n_steps = len(recorded)
    overhead = med["live"] / med["plain"] - 1.0
    # Replay: the display alone on the recorded events, on a simulated clock that advances one
    # measured loop step per event, so its rate limits behave as in the real run.
    per_step_loop = med["plain"] / n_steps
    replay: dict[str, float] = {}
    for name in names:
        samples = []
        for _ in range(20):
            now = [0.0]
            sink = sinks[name]()
            if isinstance(sink, LiveDisplay):
                sink._clock = lambda now=now: now[0]  # type: ignore[misc]
            busy = 0.0
            with sink:
                for ev in recorded:
                    t = time.perf_counter()
                    sink.step(ev)
                    busy += time.perf_counter() - t
                    now[0] += per_step_loop
            samples.append(busy / n_steps)
        replay[name] = statistics.median(samples)
    same = (
        all(len(v) == 1 for v in tokens.values())
        and len({next(iter(v)) for v in tokens.values()}) == 1
    )

    print(
        f"{n_steps} target passes, {args.max_tokens} tokens, {args.repeats} repeats, threads {threads}, "
        f"output identical: {same}"
    )
    print(
        f"loop time (median)   plain {med['plain']:.3f} s   live {med['live']:.3f} s   "
        f"live/plain {100 * overhead:+.2f}%"
    )
    print(
        f"outside llama.cpp    plain {med_out['plain']:.3f} s   live {med_out['live']:.3f} s   "
        f"(difference {100 * (med_out['live'] - med_out['plain']) / med['plain']:+.2f}% of the plain loop)"
    )
    print(
        f"display cost / step  plain {1e6 * replay['plain']:.0f} us   live {1e6 * replay['live']:.0f} us   "
        f"(loop step {1e3 * per_step_loop:.1f} ms: live adds {100 * (replay['live'] - replay['plain']) / per_step_loop:.2f}%)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "times": times,
                    "median": med,
                    "overhead": overhead,
                    "steps": n_steps,
                    "outside_llama": outside,
                    "replay_seconds_per_step": replay,
                    "identical": same,
                },
                f,
                indent=2,
            )
    devnull.close()
    target.close()
    draft.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
