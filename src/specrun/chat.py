"""A chat session over the engine: the conversation is one token list that both KV caches hold.

Each turn's prompt is the previous turn's prompt + the reply's tokens (exactly as generated) +
the template's end-of-turn text + the new user turn. Because that is the old token list plus a
tail, the engine's prefix reuse evaluates only the tail (and the reply's last token, which the
cache never saw: the engine keeps the last token pending). Re-rendering and re-tokenizing the
whole conversation instead would not do: a reply's text does not always tokenize back to the
tokens that produced it, and one differing token early on re-evaluates everything after it.

The tail comes from rendering the template twice, with and without the new turn, and taking
the difference of the texts. Where a template rewrites earlier turns (some trim or drop parts
of old replies) there is no clean tail: the whole conversation is re-tokenized, and the engine
still reuses the longest common prefix.

Nothing here reads a terminal: ``chat_cli`` does the I/O, tests drive this directly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from specrun.chat_template import render_chat, tokenize_chat
from specrun.decoding.engine import Engine, Result, Step
from specrun.decoding.sampling import SamplingParams
from specrun.errors import SpecrunError, UsageError

HELP = """\
Commands:
  /help             this help
  /reset            forget the conversation (the system message stays)
  /system [TEXT]    set the system message (no TEXT: show it; "/system -" clears it)
  /stats            the last reply's statistics as one JSON object
  /save FILE        write the transcript (JSON) to FILE
  /set [KEY VALUE]  change temp, top-k, top-p, min-p, seed or n (max tokens per reply)
  /exit             leave (also /quit, /bye, or Ctrl-D on an empty line)
Input:
  A line ending in a backslash continues on the next line.
  A line starting with \"\"\" starts a block that ends at a line ending with \"\"\".
  //TEXT sends /TEXT as a message.
  Ctrl-C stops the reply (what was written stays in the conversation); Ctrl-D exits."""


class ChatError(SpecrunError):
    pass


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChatSession:
    """The conversation, the token list both caches hold, and the last reply's statistics."""

    def __init__(
        self,
        engine: Engine,
        *,
        params: SamplingParams,
        max_tokens: int = 512,
        system: str | None = None,
        notice: Callable[[str], None] | None = None,
        info: dict[str, Any] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.template_kwargs = dict(template_kwargs or {})  # --chat-template-kwargs
        target = engine.target
        template = target.chat_template()
        if not template:
            raise ChatError(
                f"{target.path.name} has no chat template, and `specrun chat` needs one "
                "(give one with --chat-template NAME|JINJA or --chat-template-file FILE, use a "
                "chat/instruct model, or `specrun generate --raw` for plain completion)"
            )
        self.template: str = template
        self.params = params
        self.max_tokens = max_tokens
        self.system = system or None
        self.notice = notice or (lambda _msg: None)
        self.info = info or {}
        self.messages: list[dict[str, str]] = []  # the turns still in the context
        self.transcript: list[dict[str, Any]] = []  # everything, for /save
        self.tokens: list[int] = []  # the conversation as both models saw it (prompt + reply)
        self._rendered = ""  # the template text that ``tokens`` stands for
        self.last: dict[str, Any] | None = None
        self.turn = 0
        d = engine.draft_model
        self.n_ctx = min(target.n_ctx, d.model.n_ctx) if d is not None else target.n_ctx

    # -- commands -------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the conversation. The caches keep their content: the next turn reuses the part
        they share with it (the system prompt) and drops the rest."""
        self.messages = []
        self.tokens = []
        self._rendered = ""
        self.transcript.append({"event": "reset"})

    def set_system(self, text: str | None) -> None:
        self.system = text or None
        self.tokens = []  # the conversation's start changed: re-tokenize it next turn
        self._rendered = ""
        self.transcript.append({"event": "system", "content": self.system})

    def save(self, path: str | Path) -> Path:
        p = Path(path).expanduser()
        data = {
            **self.info,
            "mode": self.engine.mode,
            "draft_max": self.engine.config.draft_max,
            "system": self.system,
            "sampling": self.params.as_dict(),
            "max_tokens": self.max_tokens,
            "messages": self.transcript,
        }
        try:
            p.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise ChatError(f"cannot write {p}: {exc.strerror or exc}") from None
        return p

    def set_option(self, key: str, value: str) -> str:
        key = key.lower().replace("_", "-")
        try:
            if key in ("n", "max-tokens"):
                n = int(value)
                if n < 1:
                    raise UsageError(f"n must be >= 1, got {n}")
                self.max_tokens = n
                return f"max tokens per reply: {n}"
            conv: dict[str, Callable[[str], Any]] = {
                "temp": float,
                "top-k": int,
                "top-p": float,
                "min-p": float,
                "seed": int,
            }
            if key not in conv:
                raise UsageError(f"/set: unknown key {key!r} (temp, top-k, top-p, min-p, seed, n)")
            params = replace(self.params, **{key.replace("-", "_"): conv[key](value)})
        except ValueError:
            raise UsageError(f"/set {key}: not a number: {value!r}") from None
        params.validate()
        self.params = params
        self.turn = 0  # a new seed restarts the per-turn seed sequence
        return f"{key}: {value}"

    def settings(self) -> str:
        p = self.params
        return (
            f"temp {p.temp}, top-k {p.top_k}, top-p {p.top_p}, min-p {p.min_p}, seed {p.seed}, "
            f"n {self.max_tokens}; mode {self.engine.mode}, K {self.engine.config.draft_max}, "
            f"context {self.n_ctx} tokens ({len(self.tokens)} used)"
        )

    # -- prompts --------------------------------------------------------------------------
    def _render(self, messages: list[dict[str, str]]) -> str:
        full = ([{"role": "system", "content": self.system}] if self.system else []) + messages
        return render_chat(
            self.engine.target, full, template_kwargs=self.template_kwargs, template=self.template
        )

    def build(
        self, messages: list[dict[str, str]], *, extend: bool = True
    ) -> tuple[list[int], str]:
        """Tokens and text of the prompt for ``messages`` (ending with the new user turn)."""
        text = self._render(messages)
        if extend and self.tokens and self._rendered and text.startswith(self._rendered):
            tail = text[len(self._rendered) :]
            return self.tokens + self.engine.target.tokenize(
                tail, add_special=False, parse_special=True
            ), text
        return tokenize_chat(self.engine.target, text), text

    def prepare(self, user_text: str) -> tuple[list[int], str, list[dict[str, str]], int]:
        """The next prompt; drops the oldest exchanges while the prompt and room for a reply do
        not fit the context. Returns (tokens, text, messages, exchanges dropped)."""
        msgs = [*self.messages, {"role": "user", "content": user_text}]
        toks, text = self.build(msgs)
        reserve = min(self.max_tokens, self.n_ctx // 2)
        dropped = 0
        while len(toks) + reserve > self.n_ctx and len(msgs) > 1:
            msgs = msgs[2:] if len(msgs) > 2 else msgs[-1:]  # the oldest user turn and its reply
            dropped += 1
            toks, text = self.build(msgs, extend=False)
        if len(toks) >= self.n_ctx:
            raise ChatError(
                f"this message needs {len(toks)} tokens with the template, but the context holds "
                f"{self.n_ctx} (raise --ctx)"
            )
        return toks, text, msgs, dropped

    def expected_prefill(self, prompt: list[int]) -> int:
        """Tokens the engine will evaluate for ``prompt``: those not already in the target's
        cache (the pending last token counted), as the target's Model records it."""
        return len(prompt) - min(common_prefix(self.engine.target.cached, prompt), len(prompt) - 1)

    # -- a turn ---------------------------------------------------------------------------
    def respond(self, user_text: str) -> Iterator[Step | Result]:
        """Yield the engine's events for the reply. Closing this generator early (Ctrl-C) keeps
        the partial reply in the conversation, consistent with the caches; an exception inside
        the engine (a hard interrupt) empties the caches, so the next turn starts clean."""
        prompt, text, msgs, dropped = self.prepare(user_text)
        if dropped:
            self.notice(
                f"the conversation outgrew the context ({self.n_ctx} tokens): dropped the oldest "
                f"{dropped} exchange{'s' if dropped > 1 else ''}; the caches are rebuilt from the rest"
            )
        new_tokens = self.expected_prefill(prompt)
        params = replace(self.params, seed=self.params.seed + self.turn)
        gen: Generator[Step | Result, None, None] = self.engine.generate(  # type: ignore[assignment]
            prompt, max_tokens=self.max_tokens, params=params, reuse_cache=True
        )
        out: list[int] = []
        parts: list[str] = []
        result: Result | None = None
        stats = None
        state = "error"
        try:
            for ev in gen:
                if isinstance(ev, Result):
                    result = ev
                else:
                    out.extend(ev.tokens)
                    parts.append(ev.text)
                    stats = ev.stats
                yield ev
            state = "done"
        except GeneratorExit:
            state = "interrupted"
            raise
        finally:
            gen.close()  # the engine's own finally: its caches match what it yielded
            if state == "error":
                # Stopped inside the engine: its cache mirror may be off. Start the caches clean.
                self.engine.reset()
                self.tokens, self._rendered = [], ""
            if state != "error" or out or parts:
                self._record(
                    user_text,
                    prompt,
                    text,
                    msgs,
                    out,
                    "".join(parts),
                    result,
                    stats,
                    new_tokens=new_tokens,
                    dropped=dropped,
                    seed=params.seed,
                    state=state,
                )

    def _record(
        self,
        user_text: str,
        prompt: list[int],
        text: str,
        msgs: list[dict[str, str]],
        out: list[int],
        reply: str,
        result: Result | None,
        stats: Any,
        *,
        new_tokens: int,
        dropped: int,
        seed: int,
        state: str,
    ) -> None:
        self.messages = [*msgs, {"role": "assistant", "content": reply}]
        if state != "error":  # after an error the caches were emptied and tokens forgotten
            full = prompt + out
            self.tokens, self._rendered = full, text + reply
        interrupted = state != "done" and result is None
        finish = result.finish_reason if result is not None else "interrupted"
        st = result.stats if result is not None else stats
        last: dict[str, Any] = dict(st.to_dict()) if st is not None else {}
        last.update(
            prompt_tokens=len(prompt),
            new_tokens=new_tokens,
            generated_tokens=len(out),
            finish_reason=finish,
            interrupted=interrupted,
            dropped_exchanges=dropped,
            seed=seed,
            mode=self.engine.mode,
        )
        self.last = last
        self.transcript.append({"role": "user", "content": user_text})
        self.transcript.append(
            {"role": "assistant", "content": reply, "finish_reason": finish, "stats": last}
        )
        self.turn += 1


# -- input: multi-line messages and commands ---------------------------------------------------
def read_message(read_line: Callable[[str], str], prompt: str = ">>> ", cont: str = "... ") -> str:
    """One message: a line; a line ending in a backslash continues; a line starting with \"\"\"
    opens a block closed by a line ending with \"\"\". EOFError/KeyboardInterrupt propagate."""
    line = read_line(prompt)
    if line.lstrip().startswith('"""'):
        body = line.lstrip()[3:]
        if body.rstrip().endswith('"""'):
            return body.rstrip()[:-3]
        lines = [body] if body else []
        while True:
            nxt = read_line(cont)
            if nxt.rstrip().endswith('"""'):
                last = nxt.rstrip()[:-3]
                if last:
                    lines.append(last)
                return "\n".join(lines)
            lines.append(nxt)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = read_line(cont)
    lines.append(line)
    return "\n".join(lines)


def handle_command(
    session: ChatSession, line: str, say: Callable[[str], None], out: Callable[[str], None]
) -> bool:
    """Run a /command; ``say`` for messages (stderr), ``out`` for data (stdout). Returns False
    to leave the chat."""
    name, _, arg = line.strip().partition(" ")
    name, arg = name.lower(), arg.strip()
    if name in ("/exit", "/quit", "/bye"):
        return False
    if name in ("/help", "/?"):
        say(HELP)
    elif name == "/reset":
        session.reset()
        say("conversation cleared")
    elif name == "/system":
        if not arg:
            say(
                f"system message: {session.system!r}"
                if session.system
                else "no system message (the template's default applies)"
            )
        else:
            session.set_system(None if arg == "-" else arg)
            say("system message cleared" if arg == "-" else "system message set")
    elif name == "/stats":
        if session.last is None:
            say("no reply yet")
        else:
            out(json.dumps(session.last, ensure_ascii=False))
    elif name == "/save":
        if not arg:
            say("usage: /save FILE")
        else:
            say(f"transcript saved to {session.save(arg)}")
    elif name == "/set":
        if not arg:
            say(session.settings())
        else:
            key, _, value = arg.partition(" ")
            if not value.strip():
                say("usage: /set KEY VALUE (temp, top-k, top-p, min-p, seed, n)")
            else:
                say(session.set_option(key, value.strip()))
    else:
        say(f"unknown command {name} (/help lists them; //TEXT sends /TEXT)")
    return True
