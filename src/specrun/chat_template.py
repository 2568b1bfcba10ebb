"""Messages or a prompt to the target's tokens: the chat template stored in the GGUF (or the one
``--chat-template`` / ``--chat-template-file`` gives), rendered, then tokenized (one BOS, not two).
The one place every front end encodes a chat.

A template is Jinja text, rendered by llama/template.py, or the name of one of llama.cpp's
built-in formats (``chatml``, ``gemma``, ``llama3`` ...: ``llama_chat_builtin_templates``),
rendered by llama.cpp's own ``llama_chat_apply_template``, as llama-server renders
``--chat-template NAME``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specrun.errors import UsageError
from specrun.llama.template import TemplateError, builtin_names, check, render, render_builtin


def parse_kwargs(
    text: str | None, flag: str = "--chat-template-kwargs", template: str | None = None
) -> dict[str, Any]:
    """llama.cpp's ``--chat-template-kwargs '{"enable_thinking": false}'``: a JSON object, for a
    Jinja template (``template``: what --chat-template gave, if anything; a built-in format of
    llama.cpp's takes no variables)."""
    if not text:
        return {}
    if template is not None and is_builtin(template):
        raise UsageError(_no_variables(template))
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{flag} takes a JSON object: {exc.msg} at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{flag} takes a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    return obj


def is_builtin(source: str) -> bool:
    """Whether ``source`` names one of llama.cpp's built-in chat formats (not Jinja text)."""
    return source in builtin_names()


def _no_variables(name: str) -> str:
    return (
        f"--chat-template-kwargs takes a Jinja template; --chat-template {name} is one of "
        "llama.cpp's built-in formats, which take no variables"
    )


def resolve_template(spec: str | None, file: str | None) -> str | None:
    """``--chat-template`` (a built-in name or Jinja text) or ``--chat-template-file`` (Jinja) to
    the template every chat is then rendered with, checked here, before a model loads; None when
    neither is given (the GGUF's own template)."""
    if spec is not None and file is not None:
        raise UsageError("give either --chat-template or --chat-template-file, not both")
    if file is not None:
        path = Path(file).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"chat template file not found: {file}") from None
        except UnicodeDecodeError:
            raise UsageError(f"chat template file {file} is not UTF-8 text") from None
        except OSError as exc:
            raise UsageError(
                f"cannot read chat template file {file}: {exc.strerror or exc}"
            ) from None
        if not text.strip():
            raise UsageError(f"chat template file {file} is empty")
        _check(text, f"--chat-template-file {file}")
        return text
    if spec is None:
        return None
    if is_builtin(spec):
        return spec
    if "{{" in spec or "{%" in spec:
        _check(spec, "--chat-template")
        return spec
    raise UsageError(
        f"--chat-template {spec!r} is neither a Jinja template nor one of llama.cpp's built-in "
        f"formats: {', '.join(builtin_names())}"
    )


def _check(source: str, flag: str) -> None:
    try:
        check(source)
    except TemplateError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def describe_template(source: str | None, given: str | None) -> str:
    """One line for ``specrun info``: the chat template in use and where it comes from (``given``:
    the option that gave it, else the GGUF's)."""
    if not source:
        return "none (the GGUF has none: --chat-template NAME|JINJA, or --raw)"
    origin = given or "the GGUF's"
    if is_builtin(source):
        return f"{origin}: {source!r}, llama.cpp's built-in format"
    return f"{origin}: Jinja, {len(source)} characters"


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
    if is_builtin(source):
        if template_kwargs:
            raise TemplateError(_no_variables(source))
        return render_builtin(source, messages, add_generation_prompt)
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
        raise UsageError(
            f"{model.path.name} has no chat template: give one (--chat-template NAME|JINJA, "
            "--chat-template-file FILE), or use --raw"
        )
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    return encode_chat(model, messages, template_kwargs=template_kwargs), True
