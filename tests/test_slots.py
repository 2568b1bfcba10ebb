"""``serve --parallel``: several sequences in one context (llama/slots.py), their verify passes in
one batch, and each request's greedy output what the target alone says, whatever runs beside it.

The library half runs slot engines in threads as the server's worker does (join, generate,
leave) and compares every output with the same prompt decoded by a one-sequence target alone; the
HTTP half starts `specrun serve --parallel 4` and sends 1, 2 and 4 requests of different lengths
at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time

import httpx
import pytest
from conftest import DEFAULT_TARGET, SMOL_DRAFT, THREADS
from test_serve import Server

pytestmark = pytest.mark.models

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "List the planets of the solar system in order from the sun, one per line, with one fact "
    "about each of them.",
    "Hi",
    "Explain in two sentences why the sky is blue, then repeat the explanation word for word.",
]
N_TOKENS = [48, 64, 24, 56]


@pytest.fixture(scope="module")
def slot_pair(model_path):
    """The default pair loaded with 4 sequences each, and the target alone with one."""
    from specrun.llama.model import LoadOptions, Model
    from specrun.llama.slots import MAX_ROWS, Group, Slots

    t_path, d_path = model_path(DEFAULT_TARGET), model_path(SMOL_DRAFT)
    lo = LoadOptions(n_ctx=512, n_threads=THREADS, n_seq=4, n_outputs_max=MAX_ROWS)
    target = Model(t_path, lo)
    draft = Model(d_path, LoadOptions(n_ctx=512, n_threads=THREADS, n_seq=4, amx_rows=True))
    alone = Model(t_path, LoadOptions(n_ctx=512, n_threads=THREADS))
    group = Group()
    slots = (Slots(target, group), Slots(draft, group, drafts=True))
    yield slots, alone
    for s in slots:
        s.close()
    for m in (target, draft, alone):
        m.close()


def _prompt(model, text: str) -> list[int]:
    return model.tokenize(f"Question: {text}\nAnswer:", add_special=True)


def _engines(slots, modes):
    from specrun.decoding.engine import Engine, SpecConfig

    t, d = slots
    return [
        Engine(t.views[s], d.views[s], SpecConfig(mode=mode, draft_max=6))
        for s, mode in enumerate(modes)
    ]


def _run_slot(engine, prompt, n, start: threading.Barrier | None = None):
    if start is not None:
        start.wait()
    engine.target.join()
    try:
        return engine.run(prompt, max_tokens=n, reuse_cache=False)
    finally:
        engine.target.leave()


def test_views_are_targets_with_their_own_caches(slot_pair):
    (t, _d), _alone = slot_pair
    a, b = t.views[0], t.views[1]
    assert a.n_ctx == b.n_ctx == 512 and t.n_seq == 4
    pa, pb = a.tokenize("one two three", True), b.tokenize("four five", True)
    a.prefill(pa, 0)
    b.prefill(pb, 0)
    assert list(a.cached) == pa and list(b.cached) == pb
    a.truncate(1)
    assert list(a.cached) == pa[:1] and list(b.cached) == pb  # b's cells untouched
    data = b.save_state()
    b.clear()
    assert b.n_cached == 0
    b.load_state(data[0], data[1])
    assert list(b.cached) == pb
    with pytest.raises(Exception, match="context full"):
        a.decode([1] * 10, 510)
    a.clear()
    b.clear()


def test_rows_beside_another_slot_are_bit_for_bit_alone(slot_pair):
    """The logits of a slot's verify rows: in a pass beside another slot's rows, the same bits as
    in its own pass, and as the one-sequence target's."""
    import numpy as np

    (t, _d), alone = slot_pair
    a, b = t.views[0], t.views[1]
    pa = _prompt(alone, PROMPTS[1]) * 3  # past a few blocks of cells
    pb = _prompt(alone, PROMPTS[0])
    rows_a, rows_b = pa[5:10], pb[3:6]

    alone.clear()
    alone.prefill(pa, 0)
    alone.decode(rows_a, len(pa), logits_from=0)
    want = [alone.logits(i).copy() for i in range(len(rows_a))]
    alone.clear()

    a.prefill(pa, 0)
    b.prefill(pb, 0)
    a.decode(rows_a, len(pa), logits_from=0)  # its own pass
    own = [a.logits(i).copy() for i in range(len(rows_a))]
    a.truncate(len(pa))

    passes = t.passes
    start = threading.Barrier(2)
    got: dict[str, list] = {}

    def verify(view, rows, pos, key):
        view.join()
        start.wait()  # both generating before either hands in its pass
        try:
            view.decode(rows, pos, logits_from=0)
            got[key] = [view.logits(i).copy() for i in range(len(rows))]
        finally:
            view.leave()

    th = threading.Thread(target=verify, args=(b, rows_b, len(pb), "b"))
    th.start()
    verify(a, rows_a, len(pa), "a")
    th.join()
    assert t.passes == passes + 1, "the two slots' rows did not share a pass"
    for i in range(len(rows_a)):
        assert np.array_equal(got["a"][i], own[i]), f"row {i}: beside b != alone"
        assert np.array_equal(got["a"][i], want[i]), f"row {i}: != the one-sequence target"
    a.clear()
    b.clear()


@pytest.mark.parametrize("n_together", [1, 2, 4])
def test_greedy_output_does_not_depend_on_the_batch(slot_pair, n_together):
    """Each slot's greedy output equals the one-sequence target alone (mode none), whether it
    runs alone or beside 1 or 3 others of different lengths and modes; and with company the
    target's passes did hold several slots' rows."""
    from specrun.decoding.engine import Engine, SpecConfig

    slots, alone = slot_pair
    t = slots[0]
    want = []
    ref = Engine(alone, None, SpecConfig(mode="none"))
    for text, n in zip(PROMPTS[:n_together], N_TOKENS, strict=False):
        want.append(ref.run(_prompt(alone, text), max_tokens=n, reuse_cache=False).tokens)

    engines = _engines(slots, ["draft", "lookup", "auto", "none"][:n_together])
    start = threading.Barrier(n_together)
    passes0 = t.passes
    with cf.ThreadPoolExecutor(n_together) as pool:
        futs = [
            pool.submit(_run_slot, e, _prompt(alone, text), n, start)
            for e, text, n in zip(engines, PROMPTS, N_TOKENS, strict=False)
        ]
        got = [f.result(timeout=600) for f in futs]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.tokens == w, f"slot {i} of {n_together} parted from the target alone"
    if n_together > 1:
        assert t.passes > passes0, "no pass held more than one slot's rows"
    for e in engines:
        e.target.clear()
        e.policy.rollback(0)


def test_a_slot_that_leaves_frees_the_others(slot_pair):
    """A generation closed mid-way (a client gone) leaves the group: the slot beside it goes on
    to the end instead of waiting for a pass that never comes."""
    slots, alone = slot_pair
    a, b = _engines(slots, ["draft", "draft"])
    pa, pb = _prompt(alone, PROMPTS[0]), _prompt(alone, PROMPTS[1])
    done = threading.Event()
    out = []

    def long_one() -> None:
        out.append(_run_slot(b, pb, 64))
        done.set()

    a.target.join()
    gen = a.generate(pa, max_tokens=64, reuse_cache=False)
    th = threading.Thread(target=long_one)
    th.start()
    next(gen)  # one pass of a's (b's first pass beside it or not)
    gen.close()
    a.target.leave()
    assert done.wait(300), "the other slot waited for one that left"
    th.join()
    assert len(out[0].tokens) > 0
    for e in (a, b):
        e.target.clear()


def _chat(url: str, text: str, n: int) -> dict:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": text}],
            "max_tokens": n,
            "temperature": 0,
        },
        timeout=600,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_serve_parallel_over_http():
    """`serve --parallel 4`: /props counts the slots; 1, 2 and 4 requests of different lengths at
    once each get what they get alone; /metrics sees several at work."""
    srv = Server("--parallel", "4", "--ctx", "2048")
    try:
        props = httpx.get(f"{srv.url}/props", timeout=30).json()
        assert props["total_slots"] == 4
        assert props["default_generation_settings"]["n_ctx"] == 512
        alone = [
            _chat(srv.url, t, n)["choices"][0]["message"]["content"]
            for t, n in zip(PROMPTS, N_TOKENS, strict=True)
        ]
        for k in (2, 4):
            with cf.ThreadPoolExecutor(k) as pool:
                got = list(
                    pool.map(
                        lambda tn: _chat(srv.url, *tn), zip(PROMPTS[:k], N_TOKENS, strict=False)
                    )
                )
            for i, g in enumerate(got):
                assert g["choices"][0]["message"]["content"] == alone[i], f"{i} of {k}"
        assert "x 4 slots" in "".join(srv.lines), srv.log()
    finally:
        assert srv.stop() == 0, srv.log()


def test_serve_parallel_refuses_what_cannot_fit():
    import subprocess

    from test_serve import BASE, CLI

    r = subprocess.run(
        [*CLI, *BASE, "--parallel", "8", "--ctx", "1024"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "--parallel" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(
        [*CLI, *BASE, "--parallel", "0"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode != 0 and "--parallel must be 1 to" in r.stderr


QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"  # has fill-in-the-middle tokens (/infill)
SOAK_PROMPTS = [
    "def add(a, b):",
    "Name three colours.",
    "import os\nfor name in os.listdir('.'):",
    "What is the capital of France?",
    "class Stack:\n    def __init__(self):",
]


def _soak_request(url: str, kind: str, i: int) -> tuple[str, str | None]:
    """One request of the mix: (kind, its greedy text), None for a stream cancelled on purpose."""
    p = SOAK_PROMPTS[i % len(SOAK_PROMPTS)]
    n = 10
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": p}], "max_tokens": n, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return kind, r.json()["choices"][0]["message"]["content"]
    if kind == "completions":
        body = {"prompt": p, "max_tokens": n, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return kind, r.json()["choices"][0]["text"]
    if kind == "completion":
        r = httpx.post(
            f"{url}/completion", json={"prompt": p, "n_predict": n, "temperature": 0}, timeout=300
        )
        assert r.status_code == 200, r.text
        return kind, r.json()["content"]
    if kind == "infill":
        body = {"input_prefix": p + "\n", "input_suffix": "\n", "n_predict": n, "temperature": 0}
        r = httpx.post(f"{url}/infill", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return kind, r.json()["content"]
    body = {
        "messages": [{"role": "user", "content": p}],
        "max_tokens": n if kind == "stream" else 64,
        "temperature": 0,
        "stream": True,
    }
    text = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"]
            if delta and delta[0]["delta"].get("content"):
                text.append(delta[0]["delta"]["content"])
                if kind == "cancel":
                    return kind, None  # the client goes away mid-stream
    return kind, "".join(text)


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status", encoding="utf-8"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.mark.slow
def test_soak_8_clients_200_mixed_requests(model_path):
    """`--parallel 4` under 8 clients, 200 requests over chat, completions, llama-server's
    /completion and /infill, streams and streams cancelled mid-way: no error, every greedy answer
    the one it gets from a lone client, memory flat, every slot free at the end."""
    from test_serve import BASE

    base = [a for a in BASE if a not in ("--pair", "smollm2-135m")]
    srv = Server(
        "-m", str(model_path(QWEN)), "--no-draft", "--parallel", "4", "--ctx", "4096",
        "--cache-ram", "0", "--queue", "64", base=base,
    )  # fmt: skip
    kinds = ["chat", "completions", "completion", "infill", "stream", "cancel"]
    try:
        alone = {}
        for kind in kinds:
            for i in range(len(SOAK_PROMPTS)):
                alone[kind, i] = _soak_request(srv.url, kind, i)[1]
        rss0 = _rss_kib(srv.proc.pid)
        jobs = [(kinds[j % len(kinds)], j % len(SOAK_PROMPTS)) for j in range(200)]
        with cf.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda kj: (kj, _soak_request(srv.url, *kj)[1]), jobs))
        for (kind, i), text in got:
            if kind != "cancel":
                assert text == alone[kind, i], f"{kind} {i}: {text!r} != alone {alone[kind, i]!r}"
        deadline = time.time() + 30
        while time.time() < deadline:  # cancelled streams end at their next pass
            m = httpx.get(f"{srv.url}/metrics", timeout=30).text
            busy = [ln for ln in m.splitlines() if ln.startswith("specrun_requests_processing")]
            if busy and float(busy[0].split()[-1]) == 0:
                break
            time.sleep(0.2)
        assert busy and float(busy[0].split()[-1]) == 0, busy
        cancelled = [ln for ln in m.splitlines() if ln.startswith("specrun_requests_cancelled")]
        assert cancelled and float(cancelled[0].split()[-1]) >= 10, cancelled  # of 33 cancels
        props = httpx.get(f"{srv.url}/props", timeout=30).json()
        assert props["default_generation_settings"]["is_processing"] is False
        grown = _rss_kib(srv.proc.pid) - rss0
        assert grown < 64 * 1024, f"RSS grew {grown} KiB over 200 requests"
        assert "Traceback" not in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()


def test_parallel_full_queue_answers_503_retry_after():
    srv = Server("--parallel", "2", "--ctx", "1024", "--queue", "1")
    body = {
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 48,
        "temperature": 0,
    }
    try:
        with cf.ThreadPoolExecutor(6) as pool:
            rs = list(pool.map(lambda _: srv.post("/v1/chat/completions", body), range(6)))
        codes = sorted(r.status_code for r in rs)
        assert codes.count(200) >= 3 and 503 in codes, codes  # 2 slots + 1 queued, at least
        full = next(r for r in rs if r.status_code == 503)
        assert int(full.headers["Retry-After"]) >= 1
        assert full.json()["error"]["code"] == "queue_full"
    finally:
        assert srv.stop() == 0, srv.log()
