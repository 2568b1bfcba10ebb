"""Messages or a prompt to the target's tokens: the chat template stored in the GGUF, rendered by
llama/template.py, then tokenized (one BOS, not two). The one place every front end encodes a chat."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from specrun.errors import UsageError
from specrun.llama.template import TemplateError, render


def parse_kwargs(text: str | None, flag: str = "--chat-template-kwargs") -> dict[str, Any]:
    """llama.cpp's ``--chat-template-kwargs '{"enable_thinking": false}'``: a JSON object."""
    if not text:
        return {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{flag} takes a JSON object: {exc.msg} at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{flag} takes a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return obj


def _special_text(model: Any, token: int) -> str:
    return model.token_text(token).decode("utf-8", "replace") if token >= 0 else ""


def render_chat(
    model: Any,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    template: str | None = None,
) -> str:
    """The text of ``messages`` as ``model`` (a llama.model.Model) reads a chat: its GGUF's template
    (or ``template``) rendered with the model's BOS and EOS text."""
    source = template if template is not None else model.chat_template()
    if not source:
        raise TemplateError(f"{model.path.name} has no chat template")
    return render(
        source,
        messages,
        bos_token=_special_text(model, model.bos),
        eos_token=_special_text(model, model.eos),
        add_generation_prompt=add_generation_prompt,
        **(template_kwargs or {}),
    )


def tokenize_chat(model: Any, rendered: str) -> list[int]:
    """Rendered chat text to tokens, special tokens parsed; a BOS the template wrote and the
    tokenizer added again is kept once."""
    toks = model.tokenize(rendered, add_special=True, parse_special=True)
    if len(toks) >= 2 and toks[0] == toks[1] == model.bos:
        toks = toks[1:]
    return list(toks)


def encode_chat(
    model: Any,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    template: str | None = None,
) -> list[int]:
    """The tokens of ``messages`` for ``model``: render_chat, then tokenize_chat."""
    text = render_chat(
        model,
        messages,
        add_generation_prompt=add_generation_prompt,
        template_kwargs=template_kwargs,
        template=template,
    )
    return tokenize_chat(model, text)


def encode_prompt(
    model: Any,
    text: str,
    chat: bool | None,
    system: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], bool]:
    """A prompt's tokens: through the chat template (the default when the model has one, or when
    ``chat`` is True) or raw text with the model's BOS (``chat`` False). Returns (tokens, chat used)."""
    use_chat = bool(model.chat_template()) if chat is None else chat
    if not use_chat:
        if system:
            raise UsageError("--system needs the chat template (drop --raw)")
        return list(model.tokenize(text, add_special=True, parse_special=True)), False
    if not model.chat_template():
        raise UsageError(f"{model.path.name} has no chat template; use --raw")
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    return encode_chat(model, messages, template_kwargs=template_kwargs), True
