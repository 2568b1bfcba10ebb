"""What a model's passes cost on this machine, measured once and cached: V(n) before the first bet.

``auto`` prices a draft of K tokens with V(K + 1), the time of a target pass over K + 1 rows
relative to one row, and with c, a draft step relative to one target row. Learnt online alone,
the first estimates come from a prior (V(5) ~ 1.4): on a target whose batches are expensive
(F16 or Q4_K_M on a 2-core CPU, V(5) 2-3.5 with the build specrun used to have) the first dozen
bets were losses before the measurements caught up. So a model is timed once at load: passes of
1, 2, 3, 5 and 9 rows with logits on every row (as verification reads them) after 200 tokens of
context (where verification happens), alternating, medians of a few. The result is cached per
model file, build (the llama.cpp libraries' files), CPU, threads and GPU layers in
``$SPECRUN_HOME/calibration.json``, so later runs pay nothing; what those runs' passes cost
refines it (``refine``).

A draft step is timed as the engine pays it (``draft_step``): right after a target row, not
after another draft row. Priced from the draft alone (2.6-2.8 ms a row against 4.2-4.6 right
after a target row: SmolLM2-135M Q4_0 drafting for its Q4_K_M, 2-core Intel Xeon with AMX), auto
bet on a draft that could not pay there (code: 0.85-0.92x of plain decoding).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specrun.decoding.target import Target
from specrun.paths import specrun_home, write_json_atomic

SIZES = (1, 2, 3, 5, 9)
REPS = 5
AT = 200  # tokens of context before the timed passes (see measure)
RUN = 8  # single rows timed one after another (see measure)
_VERSION = 4  # 4: measurements checked for a busy machine (steady); older ones taken anew


def cache_file() -> Path:
    return specrun_home() / "calibration.json"


def _key(model: Target, sizes: Sequence[int]) -> str:
    st = Path(model.path).stat()
    cp = model.context_params()
    parts = [
        str(_VERSION),
        str(Path(model.path).resolve()),
        str(st.st_size),
        str(st.st_mtime_ns),
        model.machine_key(),
        str(cp["n_threads"]),
        str(cp["n_threads_batch"]),
        str(cp.get("gpu_layers", 0)),
        str(cp.get("flash_attn")),
        str(cp.get("type_k")),
        str(model.single_rows),
        # Where the weights are (AMX, CPU_REPACK, plain): a pass's cost follows the kernels.
        ",".join(model.load_report.get("weight_buffers", ())),
        ",".join(map(str, sizes)),
    ]
    if cp.get("rpc"):  # layers on RPC workers: every pass pays their round trips
        parts += [",".join(cp["rpc"]), ",".join(map(str, cp.get("tensor_split") or ()))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def measure(
    model: Any, sizes: Sequence[int] = SIZES, reps: int = REPS, at: int = AT
) -> dict[int, float]:
    """Median seconds of a pass of n rows (logits on all of them) after ``at`` tokens of context
    (fewer where the context is short), sizes alternating; the cache is left empty."""
    return {n: statistics.median(v) for n, v in measure_rounds(model, sizes, reps, at).items()}


def measure_rounds(
    model: Any, sizes: Sequence[int] = SIZES, reps: int = REPS, at: int = AT
) -> dict[int, list[float]]:
    """``measure``'s timings, every one: seconds of each counted pass by rows, in order.

    Where verification happens, not at an empty cache: on SmolLM2-135M F16 (2-core Zen 4) V(5)
    measured 2.19 at position 0 against 2.6-3.1 at positions 100-400 in the runs it priced, and
    auto bet on lookup matches that lost (code: 0.94x of plain decoding in model time).

    One row as plain decoding pays it: ``RUN`` single rows one after another (each pass of
    another size than the last rebuilds llama.cpp's graph; a run of single rows reuses it), not
    the single rows of the alternating rounds. Those read 4-18% slower (SmolLM2 F16: 10.6-12.0
    against 10.2 ms), and the calibration priced batches that much too cheap against the 9.7-10.4
    ms single rows of the runs (calibrated V(2) 1.43, V(3) 1.63; paid 1.7-1.9 and 1.9-2.15)."""
    sizes = [n for n in sizes if n <= min(model.n_batch, model.n_outputs_max, model.n_ctx)]
    if not sizes:
        return {}
    bos = model.bos if model.bos >= 0 else 0
    pos = max(0, min(at, model.n_ctx - max(sizes) - 1))
    rows = [bos] * max(sizes)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    model.clear()
    try:
        if pos:  # the context: once, not timed
            model.decode([bos] * pos, 0, None)
        for rep in range(reps + 1):  # the first round warms up and is not counted
            for n in sizes:
                t0 = time.perf_counter()
                model.decode(rows[:n], pos, 0)
                dt = time.perf_counter() - t0
                model.truncate(pos)
                if rep:
                    times[n].append(dt)
        run = min(RUN, model.n_ctx - pos - 1)
        if 1 in times and run >= 2:  # else (a tiny context) the alternating rounds' single rows
            times[1] = []
            for i in range(run + 1):  # the first follows another size: not counted
                t0 = time.perf_counter()
                model.decode([bos], pos + i, 0)
                dt = time.perf_counter() - t0
                if i:
                    times[1].append(dt)
    finally:
        model.clear()
    return times


# A measurement whose halves disagree was made on a busy machine: each size's passes split in two
# interleaved halves (1st, 3rd, ... against 2nd, 4th, ...), whose medians must agree within
# SPREAD (or SPREAD_S, for passes too short for a ratio to mean anything).
SPREAD = 0.15
SPREAD_S = 50e-6
TRIES = 2  # measurements before an unsteady one is used for this run alone, not cached


def steady(times: dict[int, list[float]]) -> bool:
    """Whether a measurement (``measure_rounds``) can stand for the machine: every size's two
    interleaved halves agree. Other work on the machine scatters the passes' times, and a
    measurement taken then, once cached, would price every later run (docs/auto.md, the
    ablation in real runs)."""
    for v in times.values():
        if len(v) < 2:
            continue
        a, b = statistics.median(v[0::2]), statistics.median(v[1::2])
        if abs(a - b) > max(SPREAD * max(a, b), SPREAD_S):
            return False
    return True


def monotone(times: dict[int, float]) -> dict[int, float]:
    """Seconds by rows, made non-decreasing in rows (adjacent violators pooled: the least-squares
    non-decreasing fit): a pass of more rows never costs less, and a measurement that says so is
    noise either way, so neither reading is trusted over the other."""
    blocks: list[tuple[float, int, list[int]]] = []  # (sum, count, sizes)
    for n in sorted(times):
        total, count, ns = times[n], 1, [n]
        while blocks and blocks[-1][0] / blocks[-1][1] > total / count:
            t, c, m = blocks.pop()
            total, count, ns = total + t, count + c, m + ns
        blocks.append((total, count, ns))
    return {n: total / count for total, count, ns in blocks for n in ns}


def measure_draft(target: Any, draft: Any, reps: int = REPS, at: int = AT, run: int = 4) -> float:
    """Median seconds of a draft step as the engine pays it (``measure_draft_steps``)."""
    step = measure_draft_steps(target, draft, reps, at, run)
    return statistics.median(step) if step else 0.0


def measure_draft_steps(
    target: Any, draft: Any, reps: int = REPS, at: int = AT, run: int = 4
) -> list[float]:
    """Seconds of each counted draft step: a draft row right after a target row, ``run`` such
    pairs a round (the first not counted), after ``at`` tokens of context (fewer where a context
    is short). Both caches are left empty.

    Not a draft row after another draft row: every draft attempt starts right after a target
    pass, and there its first row costs more (the target's weights and KV cache in the caches,
    not the draft's). SmolLM2-135M Q4_0 as the draft of its Q4_K_M (2-core Intel Xeon, AMX):
    2.6-2.8 ms a row alone, 4.2-4.6 ms right after a target row, and 4.6 ms a step in the runs
    of ``--mode draft`` (catch-ups and unsure stops included)."""
    bos = target.bos if target.bos >= 0 else 0
    pos = max(0, min(at, target.n_ctx - run - 1, draft.n_ctx - run - 1))
    step: list[float] = []
    target.clear()
    draft.clear()
    try:
        if pos:  # the context: once, not timed
            target.decode([bos] * pos, 0, None)
            draft.decode([bos] * pos, 0, None)
        for rep in range(reps + 1):  # the first round warms up and is not counted
            for i in range(run):
                target.decode([bos], pos + i, 0)
                t0 = time.perf_counter()
                draft.decode([bos], pos + i, 0)
                dt = time.perf_counter() - t0
                if rep and i:
                    step.append(dt)
            target.truncate(pos)
            draft.truncate(pos)
    finally:
        target.clear()
        draft.clear()
    return step


def draft_step(target: Any, draft: Any, refresh: bool = False) -> float:
    """``measure_draft(target, draft)``: from the cache, else measured (and cached where
    ``steady``, as ``pass_times``), per pair of model files and settings on this machine. Clears
    both models' caches when it measures."""
    key = hashlib.sha256(
        "\0".join(("draft", _key(target, (1,)), _key(draft, (1,)))).encode()
    ).hexdigest()[:32]
    data = _load_cache()
    got = data.get(key)
    if not refresh and isinstance(got, dict):
        with contextlib.suppress(KeyError, TypeError, ValueError):
            step = float(got["step"])
            if step > 0:
                return step
    step = 0.0
    for _ in range(TRIES):
        steps = measure_draft_steps(target, draft)
        step = statistics.median(steps) if steps else 0.0
        if steady({1: steps}):
            if step > 0:
                _store(data, key, {"step": step})
            break
    return step


def _store(data: dict[str, Any], key: str, value: dict[str, float]) -> None:
    data[key] = value
    if len(data) > 256:  # keep the newest entries (dicts keep insertion order)
        data = dict(list(data.items())[-256:])
    _save_cache(data)


def _load_cache() -> dict[str, Any]:
    try:
        data = json.loads(cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_cache(data: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # a read-only home only costs the next run a measurement
        write_json_atomic(cache_file(), data)


def pass_times(model: Any, sizes: Sequence[int] = SIZES, refresh: bool = False) -> dict[int, float]:
    """Seconds of an n-row pass of ``model`` by n, non-decreasing in n (``monotone``): from the
    cache, else measured and cached where the measurement is ``steady`` (after TRIES unsteady
    ones, the last serves this run alone and the next run measures again). Call it before the
    model's cache holds anything one wants to keep: it clears it."""
    key = _key(model, sizes)
    data = _load_cache()
    got = data.get(key)
    if not refresh and isinstance(got, dict):
        with contextlib.suppress(TypeError, ValueError):
            times = {int(n): float(t) for n, t in got.items()}
            if times and all(t > 0 for t in times.values()):
                return monotone(times)
    for _ in range(TRIES):
        rounds = measure_rounds(model, sizes)
        times = {n: statistics.median(v) for n, v in rounds.items()}
        if steady(rounds):
            if times:
                _store(data, key, {str(n): t for n, t in times.items()})
            break
    return monotone(times)


# A run's own passes refine the cached measurement (``refine``): a size seen this many times in
# the run moves the cached V(n) toward the run's, by at most REFINE_MAX. One calibration is one
# process's few dozen passes, and it stays for every later run: on a 2-core Zen 3 an F16
# SmolLM2's cached V(3) / V(9) read 1.96 / 3.83 where four fresh processes measured 1.46-1.70 /
# 3.14-3.64 and a run paid ~1.55 for its 3-row passes, so auto priced every run's first bets a
# quarter too dear until its online estimate caught up.
REFINE_SEEN = 4
REFINE_MAX = 0.5


def refine(model: Any, sizes: Sequence[int], observed: dict[int, tuple[float, int]]) -> None:
    """Move the cached V(n) of ``model`` (its ``pass_times(model, sizes)`` entry) toward what a
    run paid: ``observed`` = rows -> (seconds of a pass, passes seen), one row among them. A size
    seen REFINE_SEEN+ times moves by its share of 2 x REFINE_SEEN observations, at most
    REFINE_MAX; one row's seconds move the same way. Nothing is written where nothing is cached,
    the run saw too little, or no V(n) moved by more than 2%."""
    key = _key(model, sizes)
    data = _load_cache()
    got = data.get(key)
    one = observed.get(1)
    if not isinstance(got, dict) or one is None or one[1] < REFINE_SEEN or one[0] <= 0:
        return
    try:
        cached = {int(n): float(t) for n, t in got.items()}
    except (TypeError, ValueError):
        return
    c1 = cached.get(1)
    if not c1:
        return
    w1 = min(REFINE_MAX, one[1] / (2 * REFINE_SEEN))
    t1 = c1 + w1 * (one[0] - c1)
    out = {1: t1}
    moved = False
    for n, t in cached.items():
        if n == 1:
            continue
        v = t / c1
        secs, seen = observed.get(n, (0.0, 0))
        if seen >= REFINE_SEEN and secs > 0:
            new = v + min(REFINE_MAX, seen / (2 * REFINE_SEEN)) * (secs / one[0] - v)
            moved = moved or abs(new - v) > 0.02 * v  # else not worth a write (a server's request)
            v = new
        out[n] = v * t1
    if moved:
        data[key] = {str(n): t for n, t in sorted(out.items())}
        _save_cache(data)


def relative(times: dict[int, float]) -> dict[int, float]:
    """V(n) = time(n rows) / time(1 row)."""
    t1 = times.get(1)
    return {n: t / t1 for n, t in sorted(times.items())} if t1 else {}
