"""Render the chat template stored in a GGUF, with llama-cpp-python's own ``Jinja2ChatFormatter``;
and llama.cpp's built-in chat formats (``--chat-template NAME``), by llama.cpp itself.

The formatter is the one llama-cpp-python 0.3.36 (pinned) uses for a GGUF's template, and it keeps
in step with transformers' ``apply_chat_template``: jinja2's immutable sandbox (the template is
untrusted input: it came with a downloaded file), trimmed blocks, loop controls, a ``tojson``
that writes non-ASCII text as it is (``ensure_ascii=False``) and takes ``indent``, the
``{% generation %}`` tag, ``strftime_now``, and extra keyword arguments (``enable_thinking``,
``tools``, ``date_string`` ...) passed through to the template. It is pure Python over jinja2: no
model is touched here. What is specrun's own: errors become one line (``TemplateError``), and a
compiled template is reused across turns.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import llama_cpp as ll
from jinja2 import TemplateSyntaxError
from jinja2.exceptions import SecurityError
from jinja2.exceptions import TemplateError as JinjaError
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from specrun.errors import SpecrunError


class TemplateError(SpecrunError):
    pass


@lru_cache(maxsize=8)
def _formatter(source: str, bos_token: str, eos_token: str, add_generation_prompt: bool) -> Any:
    try:
        return Jinja2ChatFormatter(
            template=source,
            eos_token=eos_token,
            bos_token=bos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except TemplateSyntaxError as exc:
        raise TemplateError(f"the chat template does not parse: {exc}") from None


def check(source: str) -> None:
    """Compile ``source`` (a TemplateError when it does not parse): a template given on the
    command line is checked before any model loads."""
    _formatter(source, "", "", True)


def render(
    source: str,
    messages: Sequence[dict[str, Any]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """The prompt text for ``messages``; ``kwargs`` (``tools``, ``enable_thinking``, ...) go to
    the template as variables, as transformers and llama-cpp-python pass them."""
    formatter = _formatter(source, bos_token, eos_token, add_generation_prompt)
    try:
        return str(formatter(messages=list(messages), **kwargs).prompt)
    except SecurityError as exc:
        raise TemplateError(f"the chat template tried something unsafe: {exc}") from None
    except JinjaError as exc:
        raise TemplateError(f"the chat template failed: {exc}") from None
    except ValueError as exc:  # the template's raise_exception(...), as llama-cpp-python raises it
        raise TemplateError(f"chat template: {exc}") from None
    except TypeError as exc:  # e.g. an extra argument the formatter itself takes, given twice
        raise TemplateError(f"the chat template failed: {exc}") from None


@lru_cache(maxsize=1)
def builtin_names() -> tuple[str, ...]:
    """The names of llama.cpp's built-in chat formats (``llama_chat_builtin_templates``), sorted."""
    n = int(ll.llama_chat_builtin_templates(None, 0))
    names = (ctypes.c_char_p * max(n, 1))()
    n = min(int(ll.llama_chat_builtin_templates(names, n)), len(names))
    return tuple(sorted(b.decode() for b in names[: max(n, 0)] if b))


def render_builtin(
    name: str, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
) -> str:
    """The prompt text of ``messages`` in llama.cpp's built-in format ``name``, by llama.cpp's own
    ``llama_chat_apply_template`` (as llama-server renders ``--chat-template NAME``): text
    contents only, no template variables."""
    chat = (ll.llama_chat_message * max(len(messages), 1))()
    keep: list[bytes] = []  # the bytes the structs point into, alive until the call returns
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, str):
            raise TemplateError(
                f"chat template {name!r}: message {i} has no text content (built-in formats "
                "take text)"
            )
        role, text = str(m.get("role", "")).encode(), content.encode("utf-8")
        if b"\0" in text or b"\0" in role:  # C strings: the text would end there, unseen
            raise TemplateError(
                f"chat template {name!r}: message {i} contains a NUL character (built-in "
                "formats take C strings)"
            )
        keep += [role, text]
        chat[i].role, chat[i].content = role, text
    size = 1024 + 2 * sum(len(b) for b in keep)
    for _ in range(2):  # the first call says how much it needs when the buffer is short
        buf = ctypes.create_string_buffer(size)
        n = int(
            ll.llama_chat_apply_template(
                name.encode(), chat, len(messages), add_generation_prompt, buf, size
            )
        )
        if n < 0:
            raise TemplateError(f"llama.cpp could not apply the chat template {name!r}")
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n + 1
    raise TemplateError(f"llama.cpp's chat template {name!r} kept growing")  # pragma: no cover
