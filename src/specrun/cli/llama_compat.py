"""llama.cpp's spellings of specrun's options, and their translation.

A user of llama-cli or llama-server can keep their flags: ``-hf/-hfd USER/REPO[:QUANT]`` (with
``-hff/-hffd FILE``) stand for ``-m/-md``, ``--spec-type`` for ``--mode``, and llama.cpp's long
names (``--spec-draft-n-max``, ``--n-gpu-layers``, ``--ctx-size``, ...) are hidden aliases of
specrun's (accepted, left out of --help; docs/usage.md's tables list them). options.py declares
the visible options and calls ``translate`` on what the command line gave; nothing else here.
"""

from __future__ import annotations

from typing import Any

from specrun.errors import UsageError
from specrun.models.hub import parse_hub_spec

# llama.cpp's long spellings of options, accepted but left out of --help (where they would crowd
# the column of names). Given, they stand for the option.
ALIASES: dict[str, tuple[str, ...]] = {
    "draft_max": ("--spec-draft-n-max",),
    "draft_min": ("--spec-draft-n-min",),
    "draft_p_min": ("--spec-draft-p-min",),
    "ngl": ("--n-gpu-layers", "--gpu-layers"),
    "ngl_draft": ("--n-gpu-layers-draft", "--gpu-layers-draft"),
    "ctx": ("--ctx-size",),
    "ctx_draft": ("--ctx-size-draft",),
}

# What an excluded option takes with it (bench sweeps --mode itself, so --spec-type goes too).
EXCLUDE_WITH = {"mode": ("spec_type",)}

# llama.cpp's --spec-type names -> specrun's --mode. The others name drafters specrun does not
# have (heads or draft networks trained for one target): refused by name.
SPEC_TYPE_MODES = {
    "none": "none",
    "draft-simple": "draft",
    "ngram-simple": "lookup",
    "ngram-map-k": "lookup",
    "ngram-map-k4v": "lookup",
    "ngram-mod": "lookup",
    "ngram-cache": "lookup",
}
SPEC_TYPES_REFUSED = {
    "draft-mtp": "multi-token-prediction (MTP) heads",
    "draft-eagle3": "EAGLE-3 draft heads",
    "draft-dflash": "DFlash drafters",
    "draft-dspark": "DSpark drafters",
}

# (-hf's option, the option it stands for, its file option, its flag)
HUB_REPOS = (
    ("hf_repo", "model", "hf_file", "-hf"),
    ("hf_repo_draft", "model_draft", "hf_file_draft", "-hfd"),
)


def given(src: dict[str, str], name: str) -> bool:
    """Whether the option was typed on the command line (not the environment, not a default)."""
    return src.get(name) == "COMMANDLINE"


def mode_for_spec_type(value: str) -> str:
    """``--spec-type a,b`` -> a --mode, as llama.cpp combines them: n-gram types are tried before
    a draft model, which is specrun's hybrid."""
    modes = set()
    for name in (t.strip().lower() for t in value.split(",")):
        if name in SPEC_TYPES_REFUSED:
            raise UsageError(
                f"--spec-type {name}: specrun has no {SPEC_TYPES_REFUSED[name]}; it offers none, "
                "draft-simple (--mode draft) and the n-gram types (--mode lookup)"
            )
        if name not in SPEC_TYPE_MODES:
            known = ", ".join([*SPEC_TYPE_MODES, *SPEC_TYPES_REFUSED])
            raise UsageError(f"--spec-type: unknown type {name!r} (llama.cpp's types: {known})")
        if SPEC_TYPE_MODES[name] != "none":
            modes.add(SPEC_TYPE_MODES[name])
    if modes == {"draft", "lookup"}:
        return "hybrid"
    return modes.pop() if modes else "none"


def translate(kw: dict[str, Any], src: dict[str, str]) -> None:
    """Fold llama.cpp's spellings into specrun's, in place: -hf/-hfd into -m/-md, --spec-type
    into --mode (a --mode typed beside it must agree; one from the environment gives way)."""
    for hub, plain, file, flag in HUB_REPOS:
        repo = kw.pop(hub, None)
        if kw.get(file) is not None and repo is None:
            raise UsageError(
                f"{'--hf-file' if flag == '-hf' else '--hf-file-draft'} names a file of "
                f"the {flag} repo: give {flag} USER/REPO too"
            )
        if repo is None:
            continue
        if kw.get(plain) is not None:
            raise UsageError(f"give either {flag} or {'-m' if flag == '-hf' else '-md'}, not both")

        if parse_hub_spec(repo) is None:
            raise UsageError(f"{flag} takes a Hugging Face repo, USER/REPO[:QUANT]; got {repo!r}")
        kw[plain] = repo
    spec_type = kw.pop("spec_type", None)
    if spec_type is not None:
        mode = mode_for_spec_type(spec_type)
        if given(src, "mode") and kw.get("mode") != mode and given(src, "spec_type"):
            raise UsageError(
                f"--spec-type {spec_type} means --mode {mode}, but --mode {kw['mode']} was given"
            )
        if not (given(src, "mode") and not given(src, "spec_type")):
            kw["mode"] = mode
