"""V(n): what a verify pass of n rows costs relative to one row, per weight format and build.

Speculation pays only where a pass over K+1 rows costs little more than one row. This measures
V(n) = time(one llama_decode of n rows) / time(one row) the way the engine pays it: at a real
position (``--pos`` tokens already cached), with logits on every row (what verification reads)
and, for comparison, on the last row only. Sizes alternate within one process and each figure is
a median of ``--reps`` passes, each rolled back with the KV cache's tail removal, as a rejected
draft is; builds alternate over ``--rounds`` child processes each, and the table shows the
medians over them (single processes of one build differ by 5-25% here). Each child gets an
environment variable of random length (``--seed``): a process's heap layout, and with it the
alignment of llama.cpp's work buffer, follows from its environment, and an unlucky one held
for every round of a build moved its F16 batches by 10%.

Builds: ``--lib DIR`` (repeatable) runs the same measurement, in a child process, over another
llama.cpp build's shared libraries (a ``build/bin`` of llama.cpp built with -DBUILD_SHARED_LIBS=ON,
e.g. llama.cpp's default build), with the weights placed as llama.cpp places them (every repacked
type, its tiled K-quant matmul on); the first column is always specrun's own build and placement.
``--llama-bench PATH`` adds llama.cpp's own llama-bench (pp1/pp2/pp5/pp9, position 0, last-row
logits) for the same files. ``--specrun-env 'NAME=VALUE ...'`` (repeatable) runs specrun's own
build again under those settings, alternating with it: a patch's switch off against on (e.g.
``SPECRUN_SPLIT_ROWS=0 SPECRUN_F16_ROW_COLS=0``, upstream's split and single F16 row).

The switch: a pass of another shape than the one before it made llama.cpp build its compute graph
anew (it kept one), and speculation alternates single rows with verify passes, so a bet also cost
the single row after it. Each build is asked what one row costs right after an n-row pass against
right after one row (``switch``, in one-row times: 0.12 is 12% more). specrun's build keeps a
graph per batch size (patches/...-graph-per-size.patch), so its own figures pay no rebuild, and
computes a kept graph without llama.cpp's scheduler (``--specrun-env SPECRUN_GRAPH_DIRECT=0``
allocates it again at each switch, as before).

Formats come from the registry (SmolLM2-135M F32, F16, Q8_0, Q4_K_M, Q4_0, Q4_1); the others
(BF16, Q5_K_M, Q6_K by default; any type llama.cpp quantizes to, e.g. IQ4_XS, by ``--formats``)
are derived once from its F32 into ``$SPECRUN_HOME/derived``.

    .venv/bin/python bench/verify_cost.py --formats F32,F16,Q8_0,Q4_K_M --lib /path/llama.cpp/build/bin
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = (1, 2, 3, 5, 9)
FORMATS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K")


def derived(fmt: str, base: str) -> Path:
    """The registry model ``base`` re-quantized to ``fmt`` (made once, then reused)."""
    from specrun.llama.quantize import quantize
    from specrun.models.registry import Registry
    from specrun.paths import specrun_home

    reg = Registry.load()
    named = f"{base.rsplit('-', 1)[0]}-{fmt.lower()}"  # the registry's own, where it has one
    if named in reg.models:
        return reg.ensure(named)
    src = reg.ensure(base)
    out = specrun_home() / "derived" / f"{src.stem}.{fmt}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        quantize(src, tmp, fmt)
        os.replace(tmp, out)
    return out


def measure(
    path: Path,
    pos: int,
    reps: int,
    threads: int,
    sizes: tuple[int, ...],
    exact: bool = True,
    flash_attn: bool | None = None,
) -> dict:
    """Median seconds of an n-row pass at position ``pos``, all-row and last-row logits.
    ``exact``: weights placed as specrun places a target's (row-exact kernels only); otherwise as
    llama.cpp places them by default (every repacked type, the tiled K-quant matmul).
    ``flash_attn``: None is the build's own default (specrun's ``--flash-attn auto``; llama.cpp's
    auto, which is on for the CPU)."""
    if not exact:
        os.environ["GGML_CPU_TILED_MM"] = "1"
        if flash_attn is None:  # llama.cpp's own auto: on for the CPU
            flash_attn = True
    from specrun.llama.backend import system_info
    from specrun.llama.model import LoadOptions, Model

    m = Model(
        path,
        LoadOptions(
            n_ctx=pos + 64,
            n_threads=threads,
            n_batch=512,
            n_outputs_max=16,
            exact_rows=exact,
            flash_attn=flash_attn,
        ),
    )
    try:
        text = "The quick brown fox jumps over the lazy dog. " * (pos // 8 + 8)  # ~10 tokens each
        prompt = m.tokenize(text)[:pos]
        m.decode(prompt, 0, None)
        rows = [prompt[(7 * i) % len(prompt)] for i in range(max(sizes))]
        times: dict[str, list[float]] = {f"{n}{w}": [] for n in sizes for w in ("a", "l")}
        for _ in range(2):  # warm-up
            for n in sizes:
                m.decode(rows[:n], pos, 0)
                m.truncate(pos)
        for _ in range(reps):
            for n in sizes:
                for w in ("a", "l"):
                    t0 = time.perf_counter()
                    m.decode(rows[:n], pos, 0 if w == "a" else n - 1)
                    times[f"{n}{w}"].append(time.perf_counter() - t0)
                    m.truncate(pos)
        after: dict[int, list[float]] = {n: [] for n in sizes}  # one row right after n rows
        for _ in range(reps):
            for n in sizes:
                m.decode(rows[:n], pos, 0)
                m.truncate(pos)
                t0 = time.perf_counter()
                m.decode(rows[:1], pos, 0)
                after[n].append(time.perf_counter() - t0)
                m.truncate(pos)
        single = statistics.median(after[1])
        med = {k: statistics.median(v) for k, v in times.items()}
        return {
            "switch": {n: statistics.median(after[n]) / single - 1.0 for n in sizes if n > 1},
            "t1_ms": med["1a"] * 1e3,
            "all": {n: med[f"{n}a"] / med["1a"] for n in sizes},
            "last": {n: med[f"{n}l"] / med["1l"] for n in sizes},
            "llamafile": "LLAMAFILE = 1" in system_info(),
            "flash_attn": str(m.context_params()["flash_attn"]),
            "weights": m.load_report.get("weight_buffers", []),
        }
    finally:
        m.close()


def median_rounds(runs: list[dict]) -> dict:
    """Per file, the median over rounds of the one-row time and of each V(n) (builds alternate
    round by round, so a slow spell of the machine falls on every build alike)."""
    out: dict = {}
    for path, first in runs[0].items():
        out[path] = dict(first)
        out[path]["t1_ms"] = statistics.median(r[path]["t1_ms"] for r in runs)
        for w in ("all", "last"):
            out[path][w] = {n: statistics.median(r[path][w][n] for r in runs) for n in first[w]}
        if "switch" in first:
            out[path]["switch"] = {
                n: statistics.median(r[path]["switch"][n] for r in runs) for n in first["switch"]
            }
        out[path]["rounds"] = len(runs)
    return out


def overlay(lib_dir: Path) -> Path:
    """A copy of the installed llama_cpp package whose shared libraries are those of ``lib_dir``."""
    import llama_cpp

    pkg = Path(llama_cpp.__file__).parent
    root = Path(tempfile.mkdtemp(prefix="specrun-lib-"))
    shutil.copytree(pkg, root / "llama_cpp", ignore=shutil.ignore_patterns("lib"))
    (root / "llama_cpp" / "lib").mkdir()
    for so in lib_dir.glob("*.so*"):
        (root / "llama_cpp" / "lib" / so.name).symlink_to(so.resolve())
    return root


def llama_bench(exe: str, path: Path, threads: int, reps: int) -> dict:
    sizes = ",".join(str(n) for n in SIZES)
    out = subprocess.run(
        [
            exe,
            "-m",
            str(path),
            "-t",
            str(threads),
            "-p",
            sizes,
            "-n",
            "0",
            "-r",
            str(reps),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    by_n = {int(r["n_prompt"]): r["avg_ns"] / 1e9 for r in json.loads(out)}
    return {"t1_ms": by_n[1] * 1e3, "last": {n: by_n[n] / by_n[1] for n in SIZES}}


def _settings(text: str) -> list[tuple[str, str]]:
    """'NAME=VALUE NAME=VALUE' (--specrun-env) as (name, value) pairs, each shown as given."""
    out = []
    for item in text.split():
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise SystemExit(f"--specrun-env takes NAME=VALUE settings, got {item!r}")
        out.append((name, value))
    if not out:
        raise SystemExit("--specrun-env needs at least one NAME=VALUE")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument(
        "--base", default="smollm2-135m-instruct-f32", help="registry model to derive from"
    )
    ap.add_argument("--model", action="append", default=[], help="a GGUF file to measure as well")
    ap.add_argument("--pos", type=int, default=200)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument(
        "--rounds", type=int, default=3, help="child runs per build, builds alternating; medians"
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--lib", action="append", default=[], help="another llama.cpp build's bin dir")
    ap.add_argument(
        "--specrun-lib",
        action="append",
        default=[],
        help="another build of specrun's llama.cpp (patches/; its bin dir), run as specrun runs it",
    )
    ap.add_argument(
        "--specrun-env",
        action="append",
        default=[],
        help="specrun's build again, under these environment settings ('NAME=VALUE NAME=VALUE', "
        "e.g. 'SPECRUN_SPLIT_ROWS=0 SPECRUN_F16_ROW_COLS=0': the build's switches off)",
    )
    ap.add_argument(
        "--flash-attn",
        choices=("default", "on", "off"),
        default="default",
        help="default: each build as it runs by default (specrun's auto; llama.cpp's, on for the CPU)",
    )
    ap.add_argument("--seed", type=int, default=0, help="of the children's environment pads")
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--llama-defaults", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    from specrun.llama.backend import physical_cores

    threads = args.threads or physical_cores()
    if args.child:  # one build's measurements, as JSON on stdout
        paths = json.loads(args.child)
        print(
            json.dumps(
                {
                    p: measure(
                        Path(p),
                        args.pos,
                        args.reps,
                        threads,
                        SIZES,
                        not args.llama_defaults,
                        {"on": True, "off": False}.get(args.flash_attn),
                    )
                    for p in paths
                }
            )
        )
        return 0

    settings = [_settings(e) for e in args.specrun_env]  # refused before anything is derived
    files = [(f, derived(f, args.base)) for f in args.formats.split(",") if f]
    files += [(Path(p).name, Path(p)) for p in args.model]
    # each other build's overlay is made once, then reused by every round
    builds = (
        [("specrun", None, True, {})]
        + [("specrun " + " ".join(f"{n}={v}" for n, v in e), None, True, dict(e)) for e in settings]
        + [(f"specrun {lib}", overlay(Path(lib)), True, {}) for lib in args.specrun_lib]
        + [(str(lib), overlay(Path(lib)), False, {}) for lib in args.lib]
    )
    rounds: dict[str, list[dict]] = {label: [] for label, _, _, _ in builds}
    pads = random.Random(args.seed)
    for _round, (label, lib, exact, extra) in itertools.product(range(args.rounds), builds):
        env = dict(os.environ)
        env.update(extra)
        # A process's heap layout is fixed by its environment, and with it where llama.cpp's
        # work buffer lands relative to a cache line: F16 5-row passes of one build took 31-32 ms
        # in some environments and 28-29 ms in others, round after round. A pad of random length
        # gives each child another layout, so that the medians over rounds are over layouts too
        # (and no build keeps a lucky or unlucky one).
        env["SPECRUN_BENCH_PAD"] = "x" * pads.randrange(0, 4096)
        if lib is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                [str(lib), str(ROOT / "src"), env.get("PYTHONPATH", "")]
            )
            # The overlay's libraries, not those of the directory a build's RUNPATH names
            # (a copied build would otherwise load its original's).
            libs = Path(lib) / "llama_cpp" / "lib"
            env["LD_LIBRARY_PATH"] = os.pathsep.join([str(libs), env.get("LD_LIBRARY_PATH", "")])
        cmd = [
            sys.executable,
            __file__,
            "--child",
            json.dumps([str(p) for _, p in files]),
            "--pos",
            str(args.pos),
            "--reps",
            str(args.reps),
            "--threads",
            str(threads),
        ]
        cmd += ["--flash-attn", args.flash_attn]
        if not exact:  # another llama.cpp: as llama.cpp itself would run it
            cmd.append("--llama-defaults")
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode != 0:
            print(f"{label}: failed\n{res.stderr[-2000:]}", file=sys.stderr)
            return 1
        rounds[label].append(json.loads(res.stdout))
    results = {label: median_rounds(runs) for label, runs in rounds.items()}
    if args.llama_bench:
        results["llama-bench"] = {
            str(p): llama_bench(args.llama_bench, p, threads, 5) for _, p in files
        }

    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        "?",
    )
    print(
        f"V(n) = time of an n-row pass / one row; {threads} threads, position {args.pos}; {cpu}; "
        f"medians of {args.rounds} alternating rounds"
    )
    print(
        "flash attention: "
        + "; ".join(
            f"{c} {sorted({r['flash_attn'] for r in results[c].values()})}"
            for c in results
            if c != "llama-bench"
        )
    )
    cols = list(results)
    print(
        "| format | "
        + " | ".join(f"{c} (all rows) | {c} (last row)" if c != "llama-bench" else c for c in cols)
        + " |"
    )
    print("|---" * (1 + sum(2 if c != "llama-bench" else 1 for c in cols)) + "|")
    for fmt, p in files:
        cells = []
        for c in cols:
            r = results[c][str(p)]
            shown = ("last",) if c == "llama-bench" else ("all", "last")
            for w in shown:
                v = r[w]
                cells.append(
                    f"{r['t1_ms']:.1f} ms · "
                    + " / ".join(f"{v[str(n)] if str(n) in v else v[n]:.2f}" for n in (2, 5, 9))
                )
        print(f"| {fmt} | " + " | ".join(cells) + " |")
    switched = [c for c in cols if c != "llama-bench"]
    print()
    print("One row right after a pass of 2 / 5 / 9 rows, against right after one row (+%):")
    print("| format | " + " | ".join(switched) + " |")
    print("|---" * (1 + len(switched)) + "|")
    for fmt, p in files:
        cells = []
        for c in switched:
            sw = results[c][str(p)]["switch"]
            cells.append(
                " / ".join(
                    f"{100 * (sw[str(n)] if str(n) in sw else sw[n]):+.0f}" for n in (2, 5, 9)
                )
            )
        print(f"| {fmt} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "threads": threads,
                    "pos": args.pos,
                    "cpu": cpu,
                    "files": {f: str(p) for f, p in files},
                    "results": results,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
