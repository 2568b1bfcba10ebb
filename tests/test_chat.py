"""`specrun chat`: the session logic on a fake engine (fast), then the real command in a
pseudo-terminal on the default pair (pexpect)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from specrun.chat import ChatError, ChatSession, common_prefix, handle_command, read_message
from specrun.decoding.engine import Engine, SpecConfig
from specrun.decoding.sampling import SamplingParams

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a test.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = {"<|im_start|>": 3, "<|im_end|>": 2}


class FakeTarget:
    """A fake Model for the real Engine: one token per character (id 100 + ord), two special
    tokens, BOS = 1; it keeps its KV cache record as llama.model.Model does, and its logits
    spell the reply the test scripted for the current generation, then <|im_end|> (EOS)."""

    path = Path("fake.gguf")
    bos, eos = 1, 2
    top_prob_fn = None
    n_vocab = 256
    n_batch = 512
    n_outputs_max = 65
    can_truncate = True
    is_recurrent = False
    single_rows = False
    shared = False

    def __init__(self, n_ctx: int = 400, template: str | None = CHATML) -> None:
        self.n_ctx = n_ctx
        self.template = template
        self.held: list[int] = []
        self.reply: list[int] = []
        self.start = 0  # where the current generation's reply begins
        self.fail_at: int | None = None
        self.llama_seconds = 0.0
        self._rows: list[np.ndarray] = []

    @property
    def cached(self) -> list[int]:
        return self.held

    def chat_template(self) -> str | None:
        return self.template

    def token_text(self, t: int) -> bytes:
        return {1: b"<s>", 2: b"<|im_end|>", 3: b"<|im_start|>"}.get(t, b"")

    def is_eog(self, t: int) -> bool:
        return t == 2

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        out = [1] if add_special else []
        i = 0
        while i < len(text):
            for s, tok in SPECIAL.items():
                if parse_special and text.startswith(s, i):
                    out.append(tok)
                    i += len(s)
                    break
            else:
                out.append(100 + ord(text[i]))
                i += 1
        return out

    def piece(self, t: int) -> bytes:
        return chr(t - 100).encode() if t >= 100 else b""

    def prefill(self, tokens, pos0: int) -> None:
        self.decode(tokens, pos0)

    def decode(self, tokens, pos0: int, logits_from: int | None = None) -> None:
        assert pos0 <= len(self.held), (pos0, len(self.held))
        del self.held[pos0:]
        self.held.extend(tokens)
        self._rows = []
        for j in range(logits_from if logits_from is not None else len(tokens), len(tokens)):
            i = pos0 + j + 1 - self.start  # the reply token this row predicts
            if self.fail_at is not None and i == self.fail_at:
                raise KeyboardInterrupt  # a hard interrupt inside the engine
            row = np.zeros(self.n_vocab, np.float32)
            row[self.reply[i] if 0 <= i < len(self.reply) else 2] = 10.0
            self._rows.append(row)

    def logits(self, row: int) -> np.ndarray:
        return self._rows[row]

    def truncate(self, n_keep: int) -> None:
        del self.held[n_keep:]

    def clear(self) -> None:
        self.held = []


class FakeEngine(Engine):
    """The real Engine (plain decoding) on the fake target, which replies from a script; it
    records the prompts it was given and its resets."""

    def __init__(self, target: FakeTarget, replies: list[str], fail_at: int | None = None) -> None:
        super().__init__(target, None, SpecConfig(mode="none"))  # type: ignore[arg-type]
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.resets = 0
        self.fail_at = fail_at

    @property
    def cached(self) -> list[int]:
        return self.target.cached  # type: ignore[return-value]

    def reset(self) -> None:
        self.resets += 1
        super().reset()

    def generate(self, prompt, max_tokens=256, params=None, stop=(), reuse_cache=True):  # type: ignore[override]
        self.prompts.append(list(prompt))
        t = self.target
        t.reply = [100 + ord(c) for c in self.replies.pop(0)]
        t.start, t.fail_at = len(prompt), self.fail_at
        return super().generate(
            prompt, max_tokens=max_tokens, params=params, stop=stop, reuse_cache=reuse_cache
        )


def _session(replies, n_ctx=400, max_tokens=50, **kw):
    eng = FakeEngine(FakeTarget(n_ctx), replies, **kw)
    notices: list[str] = []
    s = ChatSession(
        eng,
        params=SamplingParams(temp=0.8, seed=5),
        max_tokens=max_tokens,  # type: ignore[arg-type]
        notice=notices.append,
    )
    return s, eng, notices


def _run(gen):
    return [ev for ev in gen]


def test_second_turn_extends_the_token_list():
    s, eng, _ = _session(["Hello there", "Fine"])
    _run(s.respond("Hi"))
    first = eng.prompts[0]
    assert s.last["prefill_tokens"] == len(first) == s.last["new_tokens"]
    _run(s.respond("How are you?"))
    second = eng.prompts[1]
    reply = [100 + ord(c) for c in "Hello there"]
    assert second[: len(first) + len(reply)] == first + reply  # the old list, then only a tail
    tail = second[len(first) + len(reply) :]
    assert tail[:2] == [2, 100 + ord("\n")]  # the template's end of turn: <|im_end|>\n
    assert s.last["prefill_tokens"] == s.last["new_tokens"] == len(tail) + 1  # + the pending token
    assert s.last["seed"] == 6  # seed S + turn


def test_interrupted_reply_stays_in_history_and_cache():
    s, eng, _ = _session(["abcdefghij", "ok"])
    gen = s.respond("Hi")
    for i, _ev in enumerate(gen):
        if i == 2:
            break
    gen.close()
    assert s.messages[-1] == {"role": "assistant", "content": "abc"}
    assert s.last["interrupted"] and s.last["finish_reason"] == "interrupted"
    assert eng.cached == s.tokens[:-1]  # the caches hold the transcript, the last token pending
    _run(s.respond("Go on"))
    assert s.last["prefill_tokens"] == s.last["new_tokens"] < len(eng.prompts[1]) // 2


def test_hard_interrupt_inside_engine_starts_clean():
    s, eng, _ = _session(["abcdef", "ok"], fail_at=3)
    with pytest.raises(KeyboardInterrupt):
        _run(s.respond("Hi"))
    assert eng.resets == 1 and s.tokens == []
    assert s.messages[-1] == {"role": "assistant", "content": "abc"}
    eng.fail_at = None
    _run(s.respond("Again"))
    assert s.last["prefill_tokens"] == len(eng.prompts[1])  # everything re-evaluated


def test_overflow_drops_oldest_exchanges_with_a_notice():
    s, eng, notices = _session(["x" * 40] * 6, n_ctx=160, max_tokens=40)
    for i in range(6):
        _run(s.respond(f"message number {i}"))
        assert len(eng.prompts[-1]) + 40 <= 160
    assert notices and "dropped the oldest" in notices[0]
    assert s.messages[-2]["content"] == "message number 5"
    assert s.last["dropped_exchanges"] >= 1 or any("dropped" in n for n in notices)
    assert len(s.transcript) == 12  # the transcript keeps everything


def test_message_longer_than_context_is_an_error_not_a_crash():
    s, _, _ = _session(["ok"], n_ctx=60)
    with pytest.raises(ChatError, match="raise --ctx"):
        _run(s.respond("y" * 100))
    assert s.messages == []


def test_template_that_rewrites_replies_falls_back_to_full_tokenization():
    """A template that trims contents: the reply's text is not a prefix of the new rendering,
    so the conversation is re-tokenized whole; the engine still reuses the common prefix."""
    eng = FakeEngine(
        FakeTarget(template=CHATML.replace("message['content']", "(message['content'] | trim)")),
        ["  spaced reply  ", "ok"],
    )
    s = ChatSession(eng, params=SamplingParams())  # type: ignore[arg-type]
    _run(s.respond("Hi"))
    _run(s.respond("Again"))
    first, second = eng.prompts
    assert "spaced reply<|im_end|>" in "".join(
        chr(t - 100) if t >= 100 else "<|im_end|>" if t == 2 else "" for t in second
    )
    assert s.last["prefill_tokens"] == s.last["new_tokens"] < len(second)
    assert common_prefix(first, second) == len(first)


def test_model_without_template():
    eng = FakeEngine(FakeTarget(template=None), [])
    with pytest.raises(ChatError, match="needs one"):
        ChatSession(eng, params=SamplingParams())  # type: ignore[arg-type]


def test_system_and_reset():
    s, eng, _ = _session(["a", "b", "c"])
    s.set_system("Be brief.")
    _run(s.respond("Hi"))
    assert "Be brief." in "".join(chr(t - 100) for t in eng.prompts[0] if t >= 100)
    s.reset()
    _run(s.respond("Hi again"))
    text = "".join(chr(t - 100) for t in eng.prompts[1] if t >= 100)
    assert "Hi again" in text and "Hi\n" not in text


def test_read_message_multiline():
    def reader(lines):
        it = iter(lines)
        prompts: list[str] = []

        def read(p):
            prompts.append(p)
            try:
                return next(it)
            except StopIteration:
                raise EOFError from None

        return read, prompts

    read, prompts = reader(["one \\", "two\\", "three"])
    assert read_message(read) == "one \ntwo\nthree" and prompts == [">>> ", "... ", "... "]
    read, _ = reader(['"""', "a", "", "b", '"""'])
    assert read_message(read) == "a\n\nb"
    read, _ = reader(['"""first', 'last"""'])
    assert read_message(read) == "first\nlast"
    read, _ = reader(['"""inline"""'])
    assert read_message(read) == "inline"
    read, _ = reader([])
    with pytest.raises(EOFError):
        read_message(read)


def test_commands(tmp_path):
    s, _, _ = _session(["Hello"])
    said: list[str] = []
    printed: list[str] = []
    cmd = lambda line: handle_command(s, line, said.append, printed.append)  # noqa: E731
    assert cmd("/stats") and said[-1] == "no reply yet"
    _run(s.respond("Hi"))
    assert cmd("/stats")
    stats = json.loads(printed[-1])
    assert {
        "acceptance_rate",
        "mean_accepted_length",
        "per_position_acceptance",
        "tokens_per_second",
        "prefill_tokens",
        "accepted_length_histogram",
    } <= stats.keys()
    assert cmd(f"/save {tmp_path}/t.json")
    saved = json.loads((tmp_path / "t.json").read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    assert saved["messages"][1]["content"] == "Hello"
    assert cmd("/set temp 0.3") and s.params.temp == 0.3
    assert cmd("/set n 7") and s.max_tokens == 7
    with pytest.raises(Exception, match="must be >= 0"):
        cmd("/set temp -1")
    assert cmd("/nope") and "unknown command" in said[-1]
    assert cmd("/help") and "/reset" in said[-1]
    assert not cmd("/exit") and not cmd("/quit")


@pytest.mark.models
def test_new_turn_prefills_only_its_tokens_in_both_models(smol_target, smol_draft):
    from specrun.decoding.engine import Engine

    # A draft that never stops early (p_min 0) ends each turn one token behind the target at
    # most, so its next prefill is exactly the target's; one stopped under --draft-p-min may
    # end a token further behind and catch that up in the next prefill.
    engine = Engine(smol_target, smol_draft, SpecConfig(mode="draft", draft_max=4, draft_p_min=0.0))
    engine.reset()  # the session-scoped models may hold another test's tokens
    assert engine.draft_model is not None
    draft_prefill: list[int] = []
    real = engine.draft_model.prefill

    def prefill(toks, evaluate=True):  # type: ignore[no-untyped-def]
        n = real(toks, evaluate)
        if evaluate:
            draft_prefill.append(n)
        return n

    engine.draft_model.prefill = prefill  # type: ignore[method-assign]
    s = ChatSession(engine, params=SamplingParams(temp=0.8, seed=3), max_tokens=12)
    _run(s.respond("Hi!"))
    first = s.last
    _run(s.respond("What is the capital of France?"))
    second = s.last
    assert first["prefill_tokens"] == first["prompt_tokens"]
    assert second["prefill_tokens"] == second["new_tokens"]
    assert (
        second["prefill_tokens"]
        == second["prompt_tokens"] - first["prompt_tokens"] - first["generated_tokens"] + 1
    )
    # the draft model evaluated the same tail, after the first token (which the target decoded
    # alone from the pending last prompt token): so the prompt's last token too
    assert draft_prefill == [first["prompt_tokens"], second["prefill_tokens"]]


# -- the real command in a pseudo-terminal ----------------------------------------------------
SPECRUN = str(Path(sys.executable).with_name("specrun"))
PROMPT = ">>> "
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def _stats(child) -> dict:
    child.sendline("/stats")
    child.expect(r"\{\"drafted\".*\}\r?\n")
    obj = json.loads(ANSI.sub("", child.match.group(0).decode()))
    child.expect_exact(PROMPT)
    return obj


@pytest.mark.models
def test_chat_in_a_terminal(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    env = dict(os.environ, XDG_STATE_HOME=str(tmp_path), TERM="xterm-256color", COLUMNS="100")
    env.pop("NO_COLOR", None)
    child = pexpect.spawn(
        SPECRUN,
        ["chat", "--ctx", "256", "-n", "24", "--seed", "1", "--threads", "2"],
        env=env,
        timeout=90,
        dimensions=(40, 100),
    )
    try:
        child.expect_exact(PROMPT)
        child.sendline("Hi, who are you?")
        child.expect_exact(PROMPT)
        first = _stats(child)
        assert first["prefill_tokens"] == first["prompt_tokens"]  # a cold cache: everything

        child.sendline("Tell me one fact about the moon.")
        child.expect_exact(PROMPT)
        second = _stats(child)
        # Only the new turn was evaluated, not the history
        assert second["prefill_tokens"] == second["new_tokens"]
        assert second["prefill_tokens"] < second["prompt_tokens"] - first["prompt_tokens"]

        # Ctrl-C in the middle of a long reply: back to the prompt, the caches still match
        child.sendline("/set n 400")
        child.expect_exact(PROMPT)
        child.sendline("Write a very long story about a dragon and a knight.")
        child.expect("tok/s")  # the live footer: the reply is under way
        child.sendintr()
        child.expect_exact("[interrupted]")
        child.expect_exact(PROMPT)
        child.sendline("/set n 24")
        child.expect_exact(PROMPT)
        child.sendline("What was the dragon called?")
        child.expect_exact(PROMPT)
        after = _stats(child)
        assert after["prefill_tokens"] == after["new_tokens"]  # the interrupted reply is cached

        # Outgrow the 256-token context: the oldest turns go, with a notice, and chat goes on
        long_msg = "Please summarise this: " + "the quick brown fox jumps over the lazy dog " * 8
        child.sendline(long_msg)
        child.expect("dropped the oldest")
        child.expect_exact(PROMPT)
        child.sendline("Thanks!")
        child.expect_exact(PROMPT)
        last = _stats(child)
        assert last["generated_tokens"] > 0 and last["prompt_tokens"] + 24 <= 256

        child.sendeof()  # Ctrl-D
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
    assert (tmp_path / "specrun" / "chat_history").exists()


@pytest.mark.models
def test_chat_needs_a_template():
    import subprocess

    # Gemma 3 270M is a base model: its GGUF has no chat template
    p = subprocess.run(
        [SPECRUN, "chat", "-m", "gemma-3-270m-q4_k_m", "--mode", "none", "--ctx", "64"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1
    assert p.stderr.startswith("specrun: error: gemma-3-270m-q4_k_m.gguf has no chat template")
    assert "--chat-template" in p.stderr and "Traceback" not in p.stderr
    # given one (llama.cpp's built-in Gemma format), it chats
    p = subprocess.run(
        [SPECRUN, "chat", "-m", "gemma-3-270m-q4_k_m", "--chat-template", "gemma"]
        + ["--mode", "none", "--ctx", "128", "-n", "6", "--temp", "0"],
        input="Hello!\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip()


@pytest.mark.models
def test_chat_reads_a_pipe():
    """Not a terminal: no prompt, no footer, no colour; one reply per line of input."""
    import subprocess

    p = subprocess.run(
        [SPECRUN, "chat", "--ctx", "256", "-n", "8", "--seed", "1", "--temp", "0"],
        input="Hi!\n/stats\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "\x1b" not in p.stdout and PROMPT not in p.stdout
    stats = json.loads(lines[-1])
    assert stats["generated_tokens"] == 8 and stats["prefill_tokens"] == stats["prompt_tokens"]
