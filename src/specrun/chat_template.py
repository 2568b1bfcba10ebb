"""Render the chat template stored in a GGUF. The template is untrusted input (it came with a
downloaded file), so it runs in jinja2's immutable sandbox."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from .errors import SpecrunError


class TemplateError(SpecrunError):
    pass


def _raise(message: str) -> None:
    raise TemplateError(f"chat template: {message}")


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # As transformers' apply_chat_template: trimmed blocks, loop controls (break/continue).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateSyntaxError as exc:
        raise TemplateError(f"the model's chat template does not parse: {exc}") from None


def render(
    source: str,
    messages: Sequence[dict[str, str]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
) -> str:
    from jinja2.exceptions import SecurityError
    from jinja2.exceptions import TemplateError as JinjaError

    template = _compile(source)
    try:
        return str(
            template.render(
                messages=list(messages),
                bos_token=bos_token,
                eos_token=eos_token,
                add_generation_prompt=add_generation_prompt,
            )
        )
    except SecurityError as exc:
        raise TemplateError(f"the model's chat template tried something unsafe: {exc}") from None
    except JinjaError as exc:
        raise TemplateError(f"the model's chat template failed: {exc}") from None
