"""The shared options' table, pinned: every environment variable and --help panel as users know
them (options.py derives both; this keeps the derivation honest), and a fingerprint of all the
rest (flags, help, metavar, defaults, types, the hidden llama.cpp aliases)."""

from __future__ import annotations

import hashlib
import typing

from specrun.cli import options
from specrun.cli.options import MODEL_OPTIONS, SAMPLING_OPTIONS

M, S, P, SA = "Models", "Speculation", "Placement", "Sampling"
PINNED = {
    "pair": ("SPECRUN_PAIR", M),
    "model": ("SPECRUN_MODEL", M),
    "model_draft": ("SPECRUN_MODEL_DRAFT", M),
    "no_draft": ("SPECRUN_NO_DRAFT", M),
    "hf_repo": ("SPECRUN_HF_REPO", M),
    "hf_file": ("SPECRUN_HF_FILE", M),
    "hf_repo_draft": ("SPECRUN_HF_REPO_DRAFT", M),
    "hf_file_draft": ("SPECRUN_HF_FILE_DRAFT", M),
    "chat_template": ("SPECRUN_CHAT_TEMPLATE", M),
    "chat_template_file": ("SPECRUN_CHAT_TEMPLATE_FILE", M),
    "mode": ("SPECRUN_MODE", S),
    "spec_type": ("SPECRUN_SPEC_TYPE", S),
    "draft_max": ("SPECRUN_DRAFT_MAX", S),
    "draft_min": ("SPECRUN_DRAFT_MIN", S),
    "draft_p_min": ("SPECRUN_DRAFT_P_MIN", S),
    "verify": ("SPECRUN_VERIFY", S),
    "lookup_min": ("SPECRUN_LOOKUP_MIN", S),
    "lookup_max": ("SPECRUN_LOOKUP_MAX", S),
    "lookup_kind": ("SPECRUN_LOOKUP_KIND", S),
    "lookup_draft_max": ("SPECRUN_LOOKUP_DRAFT_MAX", S),
    "lookup_cache": ("SPECRUN_LOOKUP_CACHE", S),
    "ngl": ("SPECRUN_NGL", P),
    "ngl_draft": ("SPECRUN_NGL_DRAFT", P),
    "rpc": ("SPECRUN_RPC", P),
    "rpc_draft": ("SPECRUN_RPC_DRAFT", P),
    "tensor_split": ("SPECRUN_TENSOR_SPLIT", P),
    "ctx": ("SPECRUN_CTX", P),
    "ctx_draft": ("SPECRUN_CTX_DRAFT", P),
    "threads": ("SPECRUN_THREADS", P),
    "threads_draft": ("SPECRUN_THREADS_DRAFT", P),
    "batch": ("SPECRUN_BATCH_SIZE", P),
    "flash_attn": ("SPECRUN_FLASH_ATTN", P),
    "cache_type_k": ("SPECRUN_CACHE_TYPE_K", P),
    "cache_type_v": ("SPECRUN_CACHE_TYPE_V", P),
    "cache_type_k_draft": ("SPECRUN_CACHE_TYPE_K_DRAFT", P),
    "cache_type_v_draft": ("SPECRUN_CACHE_TYPE_V_DRAFT", P),
    "mem_check": ("SPECRUN_MEM_CHECK", P),
    "verbose": ("SPECRUN_VERBOSE", None),
    "temp": ("SPECRUN_TEMP", SA),
    "top_k": ("SPECRUN_TOP_K", SA),
    "top_p": ("SPECRUN_TOP_P", SA),
    "min_p": ("SPECRUN_MIN_P", SA),
    "seed": ("SPECRUN_SEED", SA),
    "repeat_penalty": ("SPECRUN_REPEAT_PENALTY", SA),
    "repeat_last_n": ("SPECRUN_REPEAT_LAST_N", SA),
    "presence_penalty": ("SPECRUN_PRESENCE_PENALTY", SA),
    "frequency_penalty": ("SPECRUN_FREQUENCY_PENALTY", SA),
}
# sha256 of _fingerprint() as the table stood before envvar/panel were derived.
FINGERPRINT = "aff9103a181050b38eeea1e2960a8dd73c69b40ebbb91e6f40b6cf0d3e33245e"
# Options added since, each pinned whole by its own row (flags, help, ...) as _row gives it.
ADDED = {
    "no_draft": (
        "('no_draft', \"<class 'bool'>\", False, ['--no-draft'], 'SPECRUN_NO_DRAFT', "
        "'Models', \"No draft model: neither the pair's nor the one found on disk for -m TARGET "
        '(as -md none).", None, False, True)'
    ),
    "repeat_penalty": "('repeat_penalty', \"<class 'float'>\", 1.0, ['--repeat-penalty'], 'SPECRUN_REPEAT_PENALTY', 'Sampling', 'Penalise tokens of the last --repeat-last-n (1 = off), as llama.cpp.', None, False, True)",
    "repeat_last_n": "('repeat_last_n', \"<class 'int'>\", 64, ['--repeat-last-n'], 'SPECRUN_REPEAT_LAST_N', 'Sampling', 'Tokens the penalties look back over (-1 = all, 0 = off).', None, False, True)",
    "presence_penalty": "('presence_penalty', \"<class 'float'>\", 0.0, ['--presence-penalty'], 'SPECRUN_PRESENCE_PENALTY', 'Sampling', 'Subtract from tokens seen in the window (0 = off).', None, False, True)",
    "frequency_penalty": "('frequency_penalty', \"<class 'float'>\", 0.0, ['--frequency-penalty'], 'SPECRUN_FREQUENCY_PENALTY', 'Sampling', 'Subtract per occurrence in the window (0 = off).', None, False, True)",
}


def _rows():
    return [*MODEL_OPTIONS, *SAMPLING_OPTIONS]


def _row(name, typ, opt, default) -> str:
    flags = [opt.default, *opt.param_decls]
    return repr(
        (
            name,
            str(typ),
            default,
            flags,
            opt.envvar,
            opt.rich_help_panel,
            opt.help,
            opt.metavar,
            opt.hidden,
            opt.show_envvar,
        )
    )


def _fingerprint() -> str:
    lines = []
    for name, typ, opt, default in _rows():
        if name in ADDED:
            continue
        lines.append(_row(name, typ, opt, default))
    lines.append(repr(sorted(options.ALIASES.items())))
    kwargs = typing.get_args(options.TemplateKwargs)[1]
    lines.append(repr((kwargs.envvar, kwargs.rich_help_panel)))
    return "\n".join(lines)


def test_every_env_var_and_panel_is_as_users_know_it():
    got = {name: (opt.envvar, opt.rich_help_panel) for name, _t, opt, _d in _rows()}
    assert got == PINNED
    assert len(got) == len(_rows()) == 47  # no name declared twice


def test_the_rest_of_the_table_is_unchanged():
    assert hashlib.sha256(_fingerprint().encode()).hexdigest() == FINGERPRINT, _fingerprint()


def test_the_options_added_since_are_as_pinned():
    got = {name: _row(name, *rest) for name, *rest in _rows() if name in ADDED}
    assert got == ADDED
