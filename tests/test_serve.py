"""`specrun serve` end to end: a real server process on 127.0.0.1 (started and stopped here), real
clients (the `openai` package, httpx for the raw shapes)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from conftest import DEFAULT_TARGET, SMOL_DRAFT, THREADS

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.models

# The CLI as a module of this interpreter, so PYTHONPATH (a work tree) reaches the child too.
CLI = [
    sys.executable,
    "-c",
    "import sys; from specrun.cli.main import entry; sys.argv[0] = 'specrun'; entry()",
]
BASE = ["serve", "--pair", "smollm2-135m", "-t", str(THREADS), "--ctx", "1024", "--port", "0"]
Q = "Name three colours."


class Server:
    """A `specrun serve` child: its URL from the 'listening on' line; stderr kept."""

    def __init__(self, *extra: str, wait: bool = True, base: list[str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*CLI, *(BASE if base is None else base), *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        self.lines: list[str] = []
        self.url = ""
        got = threading.Event()

        def drain() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line)
                m = re.search(r"listening on (http://[\d.]+:\d+)", line)
                if m and not self.url:
                    self.url = m.group(1)
                    got.set()
            got.set()

        threading.Thread(target=drain, daemon=True).start()
        assert got.wait(60) and self.url, self.log()
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, self.log()
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("server not ready: " + self.log())

    def log(self) -> str:
        return "".join(self.lines[-30:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("server did not stop on a signal: " + self.log()) from None
        return int(self.proc.returncode)

    def post(self, path: str, body: Any, **kw: Any) -> Any:
        return httpx.post(f"{self.url}{path}", json=body, timeout=300, **kw)


@pytest.fixture(scope="module")
def pair(model_path):  # type: ignore[no-untyped-def]
    model_path(DEFAULT_TARGET)
    model_path(SMOL_DRAFT)


@pytest.fixture(scope="module")
def server(pair):  # type: ignore[no-untyped-def]
    s = Server("--queue", "16")
    try:
        yield s
    finally:
        assert s.stop(signal.SIGINT) == 0, s.log()  # Ctrl-C: a clean stop, exit 0


def chat(s: Server, content: str | list[dict[str, str]], n: int = 16, **kw: Any) -> dict[str, Any]:
    msgs = [{"role": "user", "content": content}] if isinstance(content, str) else content
    r = s.post("/v1/chat/completions", {"messages": msgs, "max_tokens": n, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_health_models_metrics(server: Server) -> None:
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    m = httpx.get(f"{server.url}/v1/models").json()
    assert m["object"] == "list"
    (model,) = m["data"]
    assert model["id"] == DEFAULT_TARGET and model["owned_by"] == "specrun"
    assert model["context_length"] == 1024 and model["draft_model"] == SMOL_DRAFT
    chat(server, Q, 4)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "specrun_requests_total",
        "specrun_tokens_predicted_total",
        "specrun_prompt_tokens_total",
        "specrun_requests_deferred",
        "specrun_draft_tokens_total",
        "specrun_draft_tokens_accepted_total",
        "specrun_predicted_tokens_seconds",
        "specrun_acceptance_rate",
    ):
        assert name in text, name
    assert re.search(
        r'specrun_requests_total\{endpoint="/v1/chat/completions",status="200"\} [1-9]', text
    )


def test_openai_client_chat_and_completions(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    r = client.chat.completions.create(
        model="anything", messages=[{"role": "user", "content": Q}], max_tokens=12, temperature=0
    )
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 5
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    extra = r.model_extra or {}
    assert set(extra["timings"]) >= {
        "prompt_n",
        "prompt_ms",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
        "draft_n",
        "draft_n_accepted",
    }
    assert set(extra["specrun"]) >= {
        "drafted",
        "accepted",
        "acceptance_rate",
        "target_passes",
        "mean_accepted_length",
        "per_position_acceptance",
        "accepted_length_histogram",
        "prefill_seconds",
        "decode_seconds",
        "tokens_per_second",
    }
    # streaming: the same greedy text, a usage chunk with empty choices last
    chunks = list(
        client.chat.completions.create(
            model="anything",
            messages=[{"role": "user", "content": Q}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert (
        chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[
        0
    ].finish_reason
    # completions, plain and streamed
    c = client.completions.create(
        model="x", prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert c.choices[0].text and c.object == "text_completion"
    parts = list(
        client.completions.create(
            model="x", prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in parts if p.choices) == c.choices[0].text


def test_raw_stream_shape(server: Server) -> None:
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        timeout=300,
        json={
            "messages": [{"role": "user", "content": Q}],
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
        },
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert all(o["object"] == "chat.completion.chunk" for o in objs)
    assert objs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert objs[-1]["choices"][0]["finish_reason"] in ("stop", "length") and "timings" in objs[-1]


def generate_json(prompt: str, n: int, mode: str) -> dict[str, Any]:
    p = subprocess.run(
        [
            *CLI,
            "generate",
            "--pair",
            "smollm2-135m",
            "-t",
            str(THREADS),
            "--ctx",
            "1024",
            "--json",
            "--temp",
            "0",
            "-n",
            str(n),
            "--mode",
            mode,
            "--prompt",
            prompt,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("mode", ["auto", "none"])
def test_greedy_equals_generate(server: Server, mode: str) -> None:
    prompt = "Write a Python function that reverses a string."
    ref = generate_json(prompt, 40, mode)
    got = chat(server, prompt, 40, specrun={"mode": mode, "return_tokens": True})
    assert got["choices"][0]["tokens"] == ref["tokens"]
    assert got["choices"][0]["message"]["content"] == ref["text"]
    assert got["usage"]["prompt_tokens"] == ref["prompt_tokens"]
    assert got["specrun"]["mode"] == mode


def test_eight_concurrent_clients(server: Server) -> None:
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(
            pool.map(lambda p: chat(server, p, 12)["choices"][0]["message"]["content"], prompts)
        )
    alone = [chat(server, p, 12)["choices"][0]["message"]["content"] for p in prompts]
    assert together == alone
    assert len(set(alone)) > 1


def test_disconnect_frees_the_engine(server: Server) -> None:
    def cancelled() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        m = re.search(r"^specrun_requests_cancelled_total ([\d.]+)", text, re.M)
        return float(m.group(1)) if m else 0.0

    before = cancelled()
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        timeout=300,
        json={
            "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
            "max_tokens": 900,
            "temperature": 0,
            "stream": True,
            "specrun": {"mode": "none"},
        },
    ) as r:
        got = 0
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                got += 1
                if got >= 3:
                    break
    # the client is gone; the next request starts within a target pass or so, not after 900 tokens
    t0 = time.perf_counter()
    chat(server, Q, 2)
    assert time.perf_counter() - t0 < 10
    deadline = time.time() + 10
    while cancelled() < before + 1 and time.time() < deadline:
        time.sleep(0.1)
    assert cancelled() == before + 1


def test_prefix_reuse_across_turns(server: Server) -> None:
    turn1 = [{"role": "user", "content": "My name is Ada. What is a good name for a cat?"}]
    r1 = chat(server, turn1, 16)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And for a dog?"},
    ]
    r2 = chat(server, turn2, 8)
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= r1["usage"]["prompt_tokens"], (cached, r1["usage"])
    assert r2["timings"]["prompt_n"] == r2["usage"]["prompt_tokens"] - cached
    assert r2["timings"]["cache_n"] == cached


def test_a_switch_between_conversations_keeps_both_caches(server: Server) -> None:
    """An editor or agent interleaves conversations: the one a request switches away from is
    copied to memory (--cache-ram) and put back when its next turn comes, which then evaluates
    only its tail, and replies as it would have had the server never switched (the copy is the
    computed cache, bit for bit)."""
    passage = (
        "The Great Barrier Reef is the world's largest coral reef system, made of over 2,900 "
        "individual reefs and 900 islands stretching over 2,300 kilometres off the coast of "
        "Queensland, Australia. It was selected as a World Heritage Site in 1981."
    )
    turn1 = [{"role": "user", "content": passage + " Summarize this in one sentence."}]
    r1 = chat(server, turn1, 24)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "When was it made a World Heritage Site?"},
    ]
    direct = chat(server, turn2, 16)  # the next turn at once: the live cache
    other = "Write a Python class `Queue` with enqueue and dequeue methods, with docstrings. " * 3
    chat(server, other, 8)  # another conversation takes the engine
    again = chat(server, turn2, 16)  # back: the copy is put back
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= again["usage"]["prompt_tokens"] - 2, (cached, again["usage"])
    assert again["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    m = httpx.get(f"{server.url}/metrics", timeout=30).text
    restored = re.search(r'^specrun_prompt_cache\{what="restored"\} (\S+)$', m, re.M)
    assert restored is not None and float(restored.group(1)) >= 1, m[-2000:]


LONG = "word " * 1500
LONG = "word " * 1500
BAD: list[tuple[str, Any, int, str | None]] = [
    # (path, body (bytes: raw), status, param)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "tool", "content": "x"}]},
        400,
        "messages[0].tool_call_id",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0].type",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
        400,
        "max_tokens",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**12},
        400,
        "max_tokens",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"},
        400,
        "max_tokens",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": True},
        400,
        "max_tokens",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -5},
        400,
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
        400,
        "temperature",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
        400,
        "temperature",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_p": 0},
        400,
        "top_p",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_k": -3},
        400,
        "top_k",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "min_p": 1.5},
        400,
        "min_p",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "seed": "abc"},
        400,
        "seed",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 1000}, 400, "n"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "stop": [1, 2]},
        400,
        "stop",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "stream": "yes"},
        400,
        "stream",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "tools[0].function",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema"},
        },
        400,
        "response_format.json_schema",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 5},
        400,
        "presence_penalty",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "speculative": {"n_max": 999}},
        400,
        "speculative.n_max",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "speculative": {"p_min": 2}},
        400,
        "speculative.p_min",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "speculative": {"n_max": 2, "n_min": 3}},
        400,
        "speculative.n_min",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "speculative": 4},
        400,
        "speculative",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "specrun": {"mode": "warp"}},
        400,
        "specrun.mode",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "model": 7},
        400,
        "model",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/nope", {}, 404, None),
]


@pytest.mark.parametrize(
    "path,body,status,param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)]
)
def test_bad_requests(server: Server, path: str, body: Any, status: int, param: str | None) -> None:
    if isinstance(body, bytes):
        r = httpx.post(
            f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"}
        )
    else:
        r = server.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err


def test_bad_requests_leave_it_serving(server: Server) -> None:
    r = httpx.get(f"{server.url}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b"x" * (9 << 20))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{server.url}/health").status_code == 200
    chat(server, Q, 2)


def test_chat_template_flag_over_http(pair) -> None:  # type: ignore[no-untyped-def]
    """--chat-template NAME: /v1/chat/completions renders the messages in that llama.cpp format,
    so the reply (greedy) and the prompt's tokens are those of /v1/completions given the rendered
    text; a template that is neither a name nor Jinja stops the server before it loads a model."""
    s = Server("--chat-template", "gemma", "--mode", "none")
    try:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none")
        r = c.chat.completions.create(
            model="x", messages=[{"role": "user", "content": Q}], max_tokens=12, temperature=0
        )
        rendered = f"<start_of_turn>user\n{Q}<end_of_turn>\n<start_of_turn>model\n"
        p = c.completions.create(model="x", prompt=rendered, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == p.choices[0].text
        assert r.usage is not None and p.usage is not None
        assert r.usage.prompt_tokens == p.usage.prompt_tokens
    finally:
        assert s.stop() == 0, s.log()
    bad = subprocess.run(
        [*CLI, *BASE, "--chat-template", "gema"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and bad.stderr.startswith("specrun: error: --chat-template 'gema'")
    assert bad.stderr.count("\n") == 1


@pytest.fixture(scope="module")
def keyed(pair):  # type: ignore[no-untyped-def]
    s = Server(
        "--api-key",
        "sekrit",
        "--queue",
        "1",
        "--mode",
        "none",
        "--cors",
        "https://app.example",
        wait=False,
    )
    try:
        yield s
    finally:
        s.stop()


def test_health_503_while_loading_then_auth(keyed: Server) -> None:
    r = httpx.get(f"{keyed.url}/health")  # right after 'listening on': the models are loading
    if r.status_code == 503:  # (a machine fast enough to load first would skip this check)
        assert r.json()["error"]["code"] == "loading"
    keyed.wait_ready()
    body = {"messages": [{"role": "user", "content": Q}], "max_tokens": 2}
    r = keyed.post("/v1/chat/completions", body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = keyed.post("/v1/chat/completions", body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(f"{keyed.url}/v1/models").status_code == 401
    r = keyed.post("/v1/chat/completions", body, headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200, r.text
    client = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sekrit")
    assert client.models.list().data[0].id == DEFAULT_TARGET


def test_cors_only_when_asked(keyed: Server, server: Server) -> None:
    pre = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = httpx.options(f"{keyed.url}/v1/chat/completions", headers=pre)
    assert (
        r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    )
    r = httpx.options(
        f"{keyed.url}/v1/chat/completions", headers={**pre, "Origin": "https://evil.example"}
    )
    assert r.headers.get("access-control-allow-origin") is None
    r = httpx.get(f"{server.url}/health", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in r.headers


def test_full_queue_answers_503_retry_after(keyed: Server) -> None:
    body = {
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 24,
        "temperature": 0,
    }
    auth = {"Authorization": "Bearer sekrit"}
    with ThreadPoolExecutor(4) as pool:
        rs = list(
            pool.map(lambda _: keyed.post("/v1/chat/completions", body, headers=auth), range(4))
        )
    codes = sorted(r.status_code for r in rs)
    assert 200 in codes and 503 in codes, codes
    full = next(r for r in rs if r.status_code == 503)
    assert int(full.headers["Retry-After"]) >= 1 and full.json()["error"]["code"] == "queue_full"


def test_sigterm_mid_stream_exits_0(keyed: Server) -> None:
    got = threading.Event()

    def stream() -> None:
        try:
            with httpx.stream(
                "POST",
                f"{keyed.url}/v1/chat/completions",
                timeout=120,
                headers={"Authorization": "Bearer sekrit"},
                json={
                    "messages": [{"role": "user", "content": "Write a long story."}],
                    "max_tokens": 900,
                    "stream": True,
                },
            ) as r:
                for _ in r.iter_lines():
                    got.set()
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert got.wait(60)
    t0 = time.perf_counter()
    assert keyed.stop(signal.SIGTERM, timeout=30) == 0, keyed.log()
    assert time.perf_counter() - t0 < 20
    t.join(10)


def test_non_loopback_without_key_warns(pair) -> None:  # type: ignore[no-untyped-def]
    # 192.0.2.1 (TEST-NET-1) is on no interface here: the warning comes, then the bind fails.
    p = subprocess.run(
        [*CLI, "serve", "--host", "192.0.2.1", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 1
    assert "without --api-key" in p.stderr and "cannot listen on 192.0.2.1" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_load_200_requests_8_clients(server: Server) -> None:
    pid = server.proc.pid

    def rss() -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))

    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 2}
    samples: dict[int, int] = {}
    done = 0
    lock = threading.Lock()

    def one(i: int) -> int:
        nonlocal done
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "seed": i}, timeout=300)
        with lock:
            done += 1
            samples[done] = rss()
        return r.status_code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(one, range(200)))
    assert codes.count(200) == 200, {c: codes.count(c) for c in set(codes)}
    growth = (max(samples[i] for i in range(20, 201)) - samples[20]) / 1024
    assert growth < 16, (growth, samples[20], samples[200])


def test_cache_ram_below_minus_one_is_refused() -> None:
    p = subprocess.run(
        [*CLI, "serve", "--cache-ram", "-2"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 2, p.stderr
    assert "--cache-ram must be -1 (no limit), 0 (off) or MiB, got -2" in p.stderr
    assert "Traceback" not in p.stderr
