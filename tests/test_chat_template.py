"""Issue 21: chat templates render as llama-cpp-python's Jinja2ChatFormatter (and transformers)
render them, on real templates kept as text fixtures: SmolLM2 (read from the bundled GGUF),
Gemma 3, Qwen2.5 and Llama 3.2. No model is loaded."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specrun.llama.template import TemplateError, render

pytest.importorskip("llama_cpp")

FIXTURES = Path(__file__).resolve().parent / "data" / "chat_templates"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "What is 2+2?"},
]
# A tool whose text would be escaped by jinja2's own tojson (HTML-safe, ASCII-only)
TOOL = {
    "type": "function",
    "function": {
        "name": "météo",
        "description": "Temps <b>&</b> 'ciel' à Paris",
        "parameters": {"type": "object", "properties": {}},
    },
}


def template(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_smollm2() -> None:
    t = template("smollm2-135m-instruct.jinja")
    assert render(t, CHAT[1:2], bos_token="<|im_start|>", eos_token="<|im_end|>") == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(t, CHAT, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\nHi.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    )


def test_gemma3() -> None:
    # the output transformers gives for google/gemma-3-4b-it's template
    assert render(template("gemma-3-it.jinja"), CHAT, bos_token="<bos>", eos_token="<eos>") == (
        "<bos><start_of_turn>user\nYou are terse.\n\nHello!<end_of_turn>\n"
        "<start_of_turn>model\nHi.<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    with pytest.raises(TemplateError, match=r"^chat template: Conversation roles must alternate"):
        render(template("gemma-3-it.jinja"), [CHAT[1], CHAT[1]])


def test_qwen25_and_tools_as_transformers_writes_them() -> None:
    t = template("qwen2.5-instruct.jinja")
    assert render(t, CHAT[1:2]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    )
    out = render(t, CHAT[:2], tools=[TOOL])
    # tojson as transformers: non-ASCII and HTML characters as they are
    assert (
        '{"type": "function", "function": {"name": "météo", "description": "Temps <b>&</b> \'ciel\' à Paris"'
        in out
    )
    assert out.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert out.endswith("<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")


def test_llama32_with_extra_arguments_and_indented_tojson() -> None:
    t = template("llama-3.2-instruct.jinja")
    out = render(t, CHAT, bos_token="<|begin_of_text|>", date_string="26 Jul 2024")
    assert out == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHi.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # without date_string the template asks strftime_now for today's date
    assert "Today Date: " in render(t, CHAT[1:2]) and "26 Jul 2024" not in render(t, CHAT[1:2])
    tools = render(t, CHAT[1:2], tools=[TOOL], date_string="26 Jul 2024")
    assert '{\n    "type": "function",\n    "function": {\n        "name": "météo",' in tools


def test_generation_tag_and_template_arguments() -> None:
    # {% generation %} (transformers' assistant mask) renders its body; enable_thinking and the
    # like reach the template as variables
    t = (
        "{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% if not enable_thinking %}<think></think>{% endif %}{% endif %}"
    )
    assert render(t, CHAT[1:3], add_generation_prompt=False) == "<|user|>Hello!<|assistant|>Hi."
    assert render(t, CHAT[1:2], enable_thinking=False).endswith("<|assistant|><think></think>")
    assert render(t, CHAT[1:2], enable_thinking=True).endswith("<|assistant|>")


def test_bad_templates_are_one_line_errors() -> None:
    with pytest.raises(TemplateError, match="does not parse"):
        render("{% for m in messages %}", CHAT)
    with pytest.raises(TemplateError, match="unsafe"):
        render("{{ messages.__class__.__mro__ }}", CHAT)
    with pytest.raises(TemplateError, match="^chat template: no"):
        render("{{ raise_exception('no') }}", CHAT)


def test_chat_template_kwargs_as_llama_cpp_takes_them() -> None:
    from specrun.chat_template import parse_kwargs
    from specrun.errors import UsageError

    assert parse_kwargs('{"enable_thinking": false, "date_string": "1 Jan 2025"}') == {
        "enable_thinking": False,
        "date_string": "1 Jan 2025",
    }
    assert parse_kwargs(None) == {}
    with pytest.raises(UsageError, match="takes a JSON object"):
        parse_kwargs("[]")


# --chat-template NAME|JINJA and --chat-template-file FILE (llama.cpp's flags): a built-in name
# renders by llama.cpp's own llama_chat_apply_template, Jinja text as a GGUF's template would.


def test_builtin_formats_render_as_llama_cpp_renders_them() -> None:
    from specrun.chat_template import render_chat
    from specrun.llama.template import builtin_names

    names = builtin_names()
    assert {"chatml", "gemma", "llama3", "phi3", "mistral-v7"} <= set(names)
    assert list(names) == sorted(names)
    # no model is touched for a built-in format: the template comes from the argument
    assert render_chat(None, CHAT, template="chatml") == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\nHi.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # the same text the GGUF-style Jinja template of Gemma 3 gives, less its BOS
    gemma = render_chat(None, CHAT, template="gemma")
    assert "<bos>" + gemma == render(
        template("gemma-3-it.jinja"), CHAT, bos_token="<bos>", eos_token="<eos>"
    )
    assert not render_chat(None, CHAT[:2], template="chatml", add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n"
    )
    long = [{"role": "user", "content": "x" * 100_000}]  # past the first buffer's size
    assert render_chat(None, long, template="chatml").count("x") == 100_000
    with pytest.raises(TemplateError, match="takes no variables|built-in formats"):
        render_chat(None, CHAT, template="chatml", template_kwargs={"enable_thinking": False})
    with pytest.raises(TemplateError, match="message 0 contains a NUL character"):
        render_chat(None, [{"role": "user", "content": "a\0b"}], template="chatml")


def test_resolve_template_checks_what_the_flags_give(tmp_path: Path) -> None:
    from specrun.chat_template import parse_kwargs, resolve_template
    from specrun.errors import UsageError

    assert resolve_template(None, None) is None
    assert resolve_template("gemma", None) == "gemma"
    jinja = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert resolve_template(jinja, None) == jinja
    f = tmp_path / "t.jinja"
    f.write_text(jinja, encoding="utf-8")
    assert resolve_template(None, str(f)) == jinja
    cases = [
        (("chatml", str(f)), "give either --chat-template or --chat-template-file, not both"),
        (("nonesuch", None), "neither a Jinja template nor one of llama.cpp's built-in formats: "),
        (("{% for m in messages %}", None), "--chat-template: the chat template does not parse"),
        ((None, str(tmp_path / "missing.jinja")), "chat template file not found"),
        ((None, str(tmp_path)), "cannot read chat template file"),
    ]
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n", encoding="utf-8")
    cases.append(((None, str(empty)), "is empty"))
    latin = tmp_path / "latin1.jinja"
    latin.write_bytes("{{ 'é' }}".encode("latin-1"))
    cases.append(((None, str(latin)), "is not UTF-8 text"))
    for (spec, file), msg in cases:
        with pytest.raises(UsageError, match=re.escape(msg)):
            resolve_template(spec, file)
    with pytest.raises(UsageError) as err:
        resolve_template("nonesuch", None)
    assert "chatml" in str(err.value) and "\n" not in str(err.value)
    # variables go to Jinja templates only
    assert parse_kwargs('{"enable_thinking": false}', template=jinja) == {"enable_thinking": False}
    with pytest.raises(UsageError, match="built-in formats, which take no variables"):
        parse_kwargs('{"enable_thinking": false}', template="chatml")
