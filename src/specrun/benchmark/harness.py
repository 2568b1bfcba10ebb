"""What the measuring scripts in bench/ share (they import it as any module of specrun; none
reaches another through sys.path): the one prompt set, conversations and sequences of requests,
an engine per configuration over models loaded once, and the loading itself, through session as
every front end loads.

The prompt set is ``data/workloads.jsonl`` (Spec-Bench's format): a prompt by name is its
``question_id`` in category ``single`` (``code``, ``code2``, ``code-edit``, ``summarize``, ``qa``,
``story``: the prompts of docs/performance.md's tables), ``seq:CATEGORY`` every prompt of that
category, every turn, in order. ``bench:CATEGORY`` is the first prompt of that category of
`specrun bench`'s builtin suite (data/suite.jsonl), for a figure beside the bench's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from importlib import resources
from typing import Any

from specrun.benchmark.ablation import take_out
from specrun.benchmark.suite import Prompt, load_suite
from specrun.decoding.engine import Engine, SpecConfig
from specrun.decoding.priors import PRIORS
from specrun.models.registry import Registry
from specrun.session import ModelOptions, load_engine

WORKLOADS = str(resources.files("specrun").joinpath("data/workloads.jsonl"))
SINGLE = "single"  # the category of the prompts that go by name
P_MIN = 0.6  # the command line's default --draft-p-min


def named_prompts(suite: str = WORKLOADS) -> dict[str, str]:
    """The prompts that go by name: question_id -> its first turn."""
    return {p.question_id: p.turns[0] for p in load_suite(suite)[1] if p.category == SINGLE}


PROMPTS = named_prompts()


def prompt_text(key: str) -> str:
    """A named prompt, or ``bench:CATEGORY``: the builtin bench suite's first of the category."""
    if key.startswith("bench:"):
        _, prompts = load_suite("builtin")
        found = [p for p in prompts if p.category == key[len("bench:") :]]
        if not found:
            raise SystemExit(f"no builtin bench prompt of category {key[len('bench:') :]!r}")
        return found[0].turns[0]
    if key not in PROMPTS:
        raise SystemExit(f"unknown prompt {key!r}: one of {', '.join(PROMPTS)} or bench:CATEGORY")
    return PROMPTS[key]


def sequence(suite: str, key: str, limit: int = 0) -> list[Prompt]:
    """The prompts of ``seq:CATEGORY`` in ``suite``, the first ``limit`` of them (0: all)."""
    _, prompts = load_suite(suite)
    seq = [p for p in prompts if p.category == key[len("seq:") :]]
    seq = seq[:limit] if limit else seq
    if not seq:
        raise SystemExit(f"no prompts of category {key[len('seq:') :]!r} in {suite}")
    return seq


def converse(conversations: Iterable[Sequence[str]], turn: Callable[[list], str]) -> None:
    """Every turn of every conversation through ``turn(messages) -> reply``, a follow-up
    carrying the replies before it (a sequence of requests: ``seq:CATEGORY``)."""
    for turns in conversations:
        history: list[dict[str, str]] = []
        for user in turns:
            history.append({"role": "user", "content": user})
            history.append({"role": "assistant", "content": turn(history)})


def pair_files(pair: str) -> tuple[str, str]:
    """A registry pair's target and draft files (pulled if missing), for a server of another
    program started on them."""
    reg = Registry.load()
    entry = reg.pairs[pair]
    return str(reg.ensure(entry.target)), str(reg.ensure(entry.draft))


def load_pair(
    pair: str,
    *,
    threads: int | None = None,
    ctx: int = 4096,
    chat_template: str | None = None,
    draft: bool = True,
    **options: Any,
) -> tuple[Any, Any, Any]:
    """A registry pair loaded as the command line loads it (session: the pair resolved and
    pulled, validated, the memory checked, the pair's vocabularies checked), without auto's
    calibration: (the Loaded, to close; the target; the draft, None with ``draft=False``)."""
    opts = ModelOptions(
        pair=pair,
        mode="draft" if draft else "none",
        threads=threads,
        ctx=ctx,
        chat_template=chat_template,
        calibrate=False,
        **options,
    )
    opts.validate()
    loaded = load_engine(opts)
    target, *rest = loaded.models
    return loaded, target, rest[0] if rest else None


def make_engine(target: Any, draft: Any, mode: str, k: int | None, p_min: float) -> Any:
    """``mode`` as the scripts' --configs name it (none, draft, lookup (the suffix drafter),
    ngram (the n-gram lookup before it), hybrid, auto, auto-ngram);
    ``auto@FIELD=VALUE[;FIELD=VALUE]`` runs auto with those AutoPriors fields changed (a tuning
    experiment against plain ``auto`` in the same run), ``auto!NAME[!NAME]`` auto with those
    refinements taken out (specrun.benchmark.ablation; both combine: ``auto!bursts@stop=0.5``)."""
    mode, _, tweaks = mode.partition("@")
    mode, *offs = mode.split("!")
    if offs and mode != "auto":
        raise SystemExit(f"{mode}!...: only auto has refinements to take out")
    kind = "ngram" if mode.endswith("ngram") else "suffix"
    m = {"ngram": "lookup", "auto-ngram": "auto"}.get(mode, mode)
    eng = Engine(
        target,
        None if m in ("none", "lookup") else draft,
        SpecConfig(
            mode=m,
            draft_max=k or 4,
            draft_p_min=p_min,
            lookup_kind=kind,
            lookup_min=1 if mode == "ngram" else None,
        ),
    )
    if tweaks:
        changes = {
            f: type(getattr(PRIORS, f))(v)
            for f, _, v in (t.partition("=") for t in tweaks.split(";"))
        }
        eng.policy.priors = dataclasses.replace(PRIORS, **changes)  # type: ignore[attr-defined]
        eng.policy._fresh()  # type: ignore[attr-defined]  # its rates and schedule, from them
    if offs:
        take_out(eng.policy, tuple(offs))  # type: ignore[arg-type]
    return eng
