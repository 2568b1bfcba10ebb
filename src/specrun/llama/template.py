"""Render the chat template stored in a GGUF, with llama-cpp-python's own ``Jinja2ChatFormatter``.

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

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from specrun.errors import SpecrunError


class TemplateError(SpecrunError):
    pass


@lru_cache(maxsize=8)
def _formatter(source: str, bos_token: str, eos_token: str, add_generation_prompt: bool) -> Any:
    from jinja2 import TemplateSyntaxError
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

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
    from jinja2.exceptions import SecurityError
    from jinja2.exceptions import TemplateError as JinjaError

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
