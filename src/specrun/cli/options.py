"""The model and sampling options shared by generate, chat and bench, declared once.

``@model_options()`` adds every option of CONTRACT.md's "Model options" table to a Typer command's
signature and hands the command one validated ``ModelOptions`` (argument ``opts``);
``@sampling_options()`` does the same for ``--temp/--top-k/--top-p/--min-p/--seed`` (argument
``params``). A command can leave options out (bench has its own ``--draft-max`` sweep) or change a
default (chat samples at 0.8).
"""

from __future__ import annotations

import functools
import inspect
import secrets
import typing
from collections.abc import Callable, Iterable
from typing import Annotated, Any

import typer

from specrun import defaults as D
from specrun.cli.llama_compat import ALIASES, EXCLUDE_WITH, given, mode_for_spec_type, translate
from specrun.errors import UsageError

P_MODELS, P_SPEC, P_PLACE, P_SAMPLE = "Models", "Speculation", "Placement", "Sampling"


def envvar_for(*decls: str) -> str:
    """An option's environment variable: SPECRUN_ and its long flag (``--batch-size``:
    SPECRUN_BATCH_SIZE), as llama.cpp's LLAMA_ARG_*."""
    long = next(d for d in decls if d.startswith("--")).split("/")[0]
    return "SPECRUN_" + long[2:].upper().replace("-", "_")


def _opt(*decls: str, help: str, **kw: Any) -> tuple[tuple[str, ...], dict[str, Any]]:  # noqa: A002
    """An option's flags and settings; ``_panel`` makes it a typer.Option."""
    return decls, {"help": help, **kw}


def _panel(panel: str | None, *rows: tuple[str, Any, Any, Any]) -> list[tuple[str, Any, Any, Any]]:
    """The options of one --help panel, each reading its environment variable (``envvar_for``),
    shown in --help; the command line wins over it."""
    return [
        (name, typ, typer.Option(*decls, rich_help_panel=panel, envvar=envvar_for(*decls), **kw), d)
        for name, typ, (decls, kw), d in rows
    ]


# (parameter name, type, typer.Option, default), panel by panel. The llama.cpp spellings (-hf,
# --spec-type, and the hidden --spec-draft-n-max, ...) are llama_compat's: options here, their
# translation there; docs/usage.md's tables give the llama.cpp and Ollama equivalent of each flag.
MODEL_OPTIONS: list[tuple[str, Any, Any, Any]] = [
    *_panel(
        P_MODELS,
        (
            "pair",
            str | None,
            _opt(
                "--pair",
                help="A pair from the registry (default: the registry's default).",
            ),
            None,
        ),
        (
            "model",
            str | None,
            _opt(
                "-m",
                "--model",
                help="Target: a GGUF path, a registry name, or USER/REPO[:QUANT] (also hf.co/USER/REPO[:QUANT]) on the hub.",
            ),
            None,
        ),
        (
            "model_draft",
            str | None,
            _opt(
                "-md",
                "--model-draft",
                help="Draft model (overrides the pair's draft).",
            ),
            None,
        ),
        (
            "no_draft",
            bool,
            _opt(
                "--no-draft",
                help="No draft model: neither the pair's nor the one found on disk for -m TARGET (as -md none).",
            ),
            False,
        ),
        (
            "hf_repo",
            str | None,
            _opt(
                "-hf",
                "-hfr",
                "--hf-repo",
                help="Target from the Hugging Face hub, USER/REPO[:QUANT] (as llama.cpp's -hf; same as -m USER/REPO[:QUANT]).",
                metavar="USER/REPO[:QUANT]",
            ),
            None,
        ),
        (
            "hf_file",
            str | None,
            _opt(
                "-hff",
                "--hf-file",
                help="The file of the -hf repo to use (overrides its QUANT).",
                metavar="FILE",
            ),
            None,
        ),
        (
            "hf_repo_draft",
            str | None,
            _opt(
                "-hfd",
                "-hfrd",
                "--hf-repo-draft",
                help="Draft model from the Hugging Face hub, USER/REPO[:QUANT] (as llama.cpp's -hfd).",
                metavar="USER/REPO[:QUANT]",
            ),
            None,
        ),
        (
            "hf_file_draft",
            str | None,
            _opt(
                "-hffd",
                "--hf-file-draft",
                help="The file of the -hfd repo to use (overrides its QUANT).",
                metavar="FILE",
            ),
            None,
        ),
        (
            "chat_template",
            str | None,
            _opt(
                "--chat-template",
                help="Render chats with this template instead of the GGUF's: one of llama.cpp's built-in formats (chatml, gemma, llama3, ...) or Jinja text, as llama.cpp.",
                metavar="NAME|JINJA",
            ),
            None,
        ),
        (
            "chat_template_file",
            str | None,
            _opt(
                "--chat-template-file",
                help="Render chats with the Jinja template in FILE instead of the GGUF's, as llama.cpp.",
                metavar="FILE",
            ),
            None,
        ),
    ),
    *_panel(
        P_SPEC,
        (
            "mode",
            str,
            _opt(
                "--mode",
                help="auto|draft|lookup|hybrid|none (none = the target alone).",
            ),
            D.MODE,
        ),
        (
            "spec_type",
            str | None,
            _opt(
                "--spec-type",
                help="llama.cpp's drafter names, comma-separated, mapped onto --mode: none; draft-simple = draft; ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache = lookup; a draft and an n-gram type = hybrid.",
                metavar="TYPE[,TYPE]",
            ),
            None,
        ),
        (
            "draft_max",
            int | None,
            _opt(
                "--draft-max",
                help="Longest draft (default: the pair's, else 4; auto, which picks K per step: at least 8). llama.cpp: --spec-draft-n-max.",
            ),
            None,
        ),
        (
            "draft_min",
            int,
            _opt(
                "--draft-min",
                help="Shortest draft worth verifying. llama.cpp: --spec-draft-n-min.",
            ),
            D.DRAFT_MIN,
        ),
        (
            "draft_p_min",
            float,
            _opt(
                "--draft-p-min",
                help="Stop drafting when the draft's top probability falls below P (0 = never). llama.cpp: --spec-draft-p-min.",
            ),
            D.DRAFT_P_MIN,
        ),
        (
            "verify",
            str,
            _opt(
                "--verify",
                help="temp > 0: rejection (Leviathan/Chen, default) or match (sample-and-match, as llama-server).",
            ),
            D.VERIFY,
        ),
        (
            "lookup_min",
            int | None,
            _opt(
                "--lookup-min",
                help=f"Shortest match a lookup drafter proposes from (default: {D.LOOKUP_MIN}; auto, which prices each match length: {D.LOOKUP_MIN_AUTO}).",
            ),
            None,
        ),
        (
            "lookup_max",
            int,
            _opt(
                "--lookup-max",
                help="Longest n-gram prompt lookup matches (tried first).",
            ),
            D.LOOKUP_MAX,
        ),
        (
            "lookup_kind",
            str,
            _opt(
                "--lookup-kind",
                help="The lookup drafter (lookup/hybrid/auto): suffix (the longest match in this text and earlier outputs, ranked continuations) or ngram (llama.cpp-style n-gram prompt lookup).",
                metavar="suffix|ngram",
            ),
            D.LOOKUP_KIND,
        ),
        (
            "lookup_draft_max",
            int,
            _opt(
                "--lookup-draft-max",
                help="Longest suffix-lookup proposal (at least --draft-max): a long match is cheap to verify.",
            ),
            D.LOOKUP_DRAFT_MAX,
        ),
        (
            "lookup_cache",
            str | None,
            _opt(
                "--lookup-cache",
                help="A file of n-gram statistics kept across runs (lookup/hybrid/auto).",
            ),
            None,
        ),
    ),
    *_panel(
        P_PLACE,
        (
            "ngl",
            str,
            _opt(
                "--ngl",
                "-ngl",
                help="Target layers offloaded to the GPU: N, auto (all that fit) or all (-1 = auto).",
                metavar="N|auto|all",
            ),
            "auto",
        ),
        (
            "ngl_draft",
            str,
            _opt(
                "--ngl-draft",
                "-ngld",
                help="Draft layers offloaded to the GPU: N, auto (all that fit) or all (-1 = auto).",
                metavar="N|auto|all",
            ),
            "auto",
        ),
        (
            "rpc",
            str | None,
            _opt(
                "--rpc",
                help="llama.cpp RPC workers (`specrun worker` on each) for the target's layers, split by their free memory (llama.cpp: --rpc).",
                metavar="HOST:PORT[,HOST:PORT...]",
            ),
            None,
        ),
        (
            "rpc_draft",
            bool,
            _opt(
                "--rpc-draft",
                help="Place the draft's layers on the --rpc workers too (default: the draft runs here).",
            ),
            False,
        ),
        (
            "tensor_split",
            str | None,
            _opt(
                "--tensor-split",
                "-ts",
                help="Shares of the offloaded layers per device, e.g. 3,1: the --rpc workers' devices in order, then this machine's GPUs (llama.cpp: -ts). Default: by free memory.",
                metavar="N0,N1,...",
            ),
            None,
        ),
        (
            "ctx",
            int,
            _opt(
                "--ctx",
                "-c",
                help="Target context size in tokens (also --ctx-size).",
            ),
            D.CTX,
        ),
        (
            "ctx_draft",
            int | None,
            _opt(
                "--ctx-draft",
                "-cd",
                help="Draft context size (default: as the target's).",
            ),
            None,
        ),
        (
            "threads",
            int | None,
            _opt(
                "--threads",
                "-t",
                help="CPU threads for the target (default: physical cores).",
            ),
            None,
        ),
        (
            "threads_draft",
            int | None,
            _opt(
                "--threads-draft",
                "-td",
                help="CPU threads for the draft (default: as --threads).",
            ),
            None,
        ),
        (
            "batch",
            int,
            _opt(
                "--batch-size",
                "-b",
                help="Most tokens per llama_decode call (prompt chunks).",
            ),
            D.BATCH,
        ),
        (
            "flash_attn",
            str,
            _opt(
                "--flash-attn",
                "-fa",
                help="Flash attention: on|off|auto (auto: off on the CPU, where batched rows then equal single rows bit for bit; llama.cpp decides on a GPU; on for a quantized V cache).",
            ),
            D.FLASH_ATTN,
        ),
        (
            "cache_type_k",
            str,
            _opt(
                "--cache-type-k",
                "-ctk",
                help="Target KV cache type for K: f16, f32, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1.",
            ),
            D.CACHE_TYPE,
        ),
        (
            "cache_type_v",
            str,
            _opt(
                "--cache-type-v",
                "-ctv",
                help="Target KV cache type for V (quantized V needs flash attention).",
            ),
            D.CACHE_TYPE,
        ),
        (
            "cache_type_k_draft",
            str | None,
            _opt(
                "--cache-type-k-draft",
                "-ctkd",
                help="Draft KV cache type for K (default: as the target's).",
            ),
            None,
        ),
        (
            "cache_type_v_draft",
            str | None,
            _opt(
                "--cache-type-v-draft",
                "-ctvd",
                help="Draft KV cache type for V (default: as the target's).",
            ),
            None,
        ),
        (
            "mem_check",
            bool,
            _opt(
                "--mem-check/--no-mem-check",
                help="Refuse to load models the memory estimate says will not fit.",
            ),
            True,
        ),
    ),
    *_panel(
        None,
        (
            "verbose",
            bool,
            _opt("--verbose", help="Show llama.cpp's own log on stderr."),
            False,
        ),
    ),
]

SAMPLING_OPTIONS: list[tuple[str, Any, Any, Any]] = [
    *_panel(
        P_SAMPLE,
        (
            "temp",
            float,
            _opt("--temp", help="Temperature; 0 = greedy."),
            D.TEMP,
        ),
        (
            "top_k",
            int,
            _opt("--top-k", help="Top-k (0 = off)."),
            D.TOP_K,
        ),
        (
            "top_p",
            float,
            _opt("--top-p", help="Top-p (1 = off)."),
            D.TOP_P,
        ),
        (
            "min_p",
            float,
            _opt("--min-p", help="Min-p (0 = off)."),
            D.MIN_P,
        ),
        (
            "seed",
            int | None,
            _opt(
                "--seed",
                "-s",
                help="Random seed (default: random, always reported).",
            ),
            None,
        ),
        (
            "repeat_penalty",
            float,
            _opt(
                "--repeat-penalty",
                help="Penalise tokens of the last --repeat-last-n (1 = off), as llama.cpp.",
            ),
            1.0,
        ),
        (
            "repeat_last_n",
            int,
            _opt(
                "--repeat-last-n", help="Tokens the penalties look back over (-1 = all, 0 = off)."
            ),
            64,
        ),
        (
            "presence_penalty",
            float,
            _opt("--presence-penalty", help="Subtract from tokens seen in the window (0 = off)."),
            0.0,
        ),
        (
            "frequency_penalty",
            float,
            _opt("--frequency-penalty", help="Subtract per occurrence in the window (0 = off)."),
            0.0,
        ),
    ),
]

NGL_ALL = 1 << 30  # --ngl all: every layer, refused when they do not fit (llama.cpp: -ngl all)


def parse_ngl(value: int | str, flag: str) -> int:
    """``N``, ``auto`` (-1: the layers that fit) or ``all`` (``NGL_ALL``), as llama.cpp's -ngl."""
    if isinstance(value, int):
        return value
    v = value.strip().lower()
    if v == "auto":
        return -1
    if v == "all":
        return NGL_ALL
    try:
        return int(v)
    except ValueError:
        raise UsageError(f"{flag} takes a number of layers, auto or all; got {value!r}") from None


def _inject(
    table: list[tuple[str, Any, Any, Any]],
    target_arg: str,
    build: Callable[[dict[str, Any], dict[str, str]], Any],
    exclude: Iterable[str],
    defaults: dict[str, Any],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    skip = set(exclude)
    skip |= {x for n in exclude for x in EXCLUDE_WITH.get(n, ())}
    rows = [(n, t, o, defaults.get(n, d)) for n, t, o, d in table if n not in skip]
    unknown = (set(defaults) | skip) - {n for n, *_ in table}
    if unknown:
        raise ValueError(f"not a shared option: {sorted(unknown)}")

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(func, include_extras=True)
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in inspect.signature(func).parameters.values()
            if p.name != target_arg
        ]
        added = [
            inspect.Parameter(
                n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=Annotated[t, o]
            )
            for n, t, o, d in rows
        ]
        types = {n: t for n, t, *_ in rows}
        aliases = {f"alias_{n}": n for n in types if n in ALIASES}
        added += [
            inspect.Parameter(
                a,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[types[n] | None, typer.Option(*ALIASES[n], hidden=True)],
            )
            for a, n in aliases.items()
        ]
        names = {n for n, *_ in rows}
        # Typer hands the click context (where each value came from) to the one parameter typed
        # typer.Context: the command's own, else one added here and not passed on.
        ctx_own = next(
            (
                p.name
                for p in own
                if isinstance(p.annotation, type) and issubclass(p.annotation, typer.Context)
            ),
            None,
        )
        ctx_arg = ctx_own or f"specrun_ctx_{target_arg}"
        if ctx_own is None:
            added.append(
                inspect.Parameter(ctx_arg, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
            )

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ctx = kwargs.get(ctx_arg) if ctx_own else kwargs.pop(ctx_arg, None)
            mine = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
            src = _sources(ctx, mine)
            for a, n in aliases.items():
                value = kwargs.pop(a, None)
                if value is not None:
                    mine[n], src[n] = value, "COMMANDLINE"
            kwargs[target_arg] = build(mine, src)
            return func(*args, **kwargs)

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + added
        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        del wrapper.__wrapped__  # Typer must see the new signature, not the function's own
        return wrapper

    return decorate


def _sources(ctx: Any, names: Iterable[str]) -> dict[str, str]:
    """Where each value came from: COMMANDLINE, ENVIRONMENT, DEFAULT (click's ParameterSource)."""
    out = {}
    for n in names:
        src = ctx.get_parameter_source(n) if ctx is not None else None
        out[n] = getattr(src, "name", "DEFAULT") if src is not None else "DEFAULT"
    return out


def _drop_env_rivals(
    kw: dict[str, Any], src: dict[str, str], rivals: list[tuple[str, str]]
) -> None:
    """An option given on the command line beats a rival that came from the environment
    (``SPECRUN_PAIR`` set, ``-m X`` typed: X is the target, as with no SPECRUN_PAIR)."""
    for a, b in rivals:
        for mine, other in ((a, b), (b, a)):
            if (
                kw.get(mine) is not None
                and kw.get(other) is not None
                and given(src, mine)
                and src.get(other) == "ENVIRONMENT"
            ):
                kw[other] = None


def _no_draft_or_draft(kw: dict[str, Any], src: dict[str, str]) -> None:
    """--no-draft against a draft named (-md/-hfd): the one typed wins over the one from the
    environment (SPECRUN_NO_DRAFT=1 and -md X typed: X drafts); both typed is refused later."""
    if not kw.get("no_draft") or kw.get("model_draft") is None:
        return
    typed_draft = given(src, "model_draft") or given(src, "hf_repo_draft")
    if typed_draft and src.get("no_draft") == "ENVIRONMENT":
        kw["no_draft"] = False
    elif given(src, "no_draft") and not typed_draft:
        kw["model_draft"] = None
        kw.pop("hf_file_draft", None)


def _build_model_options(kw: dict[str, Any], src: dict[str, str] | None = None) -> Any:
    """The command line's model options -> a validated ModelOptions: an option typed beats its
    rival from the environment, llama.cpp's spellings are translated (llama_compat), --ngl
    auto|all become numbers."""
    from specrun.session import ModelOptions

    src = src or {}
    _drop_env_rivals(
        kw,
        src,
        [
            ("pair", "model"),
            ("pair", "hf_repo"),
            ("model", "hf_repo"),
            ("model_draft", "hf_repo_draft"),
            ("chat_template", "chat_template_file"),
        ],
    )
    translate(kw, src)  # llama.cpp's spellings: -hf/-hfd, --spec-type
    _no_draft_or_draft(kw, src)
    for name, flag in (("ngl", "--ngl"), ("ngl_draft", "--ngl-draft")):
        if name in kw:
            kw[name] = parse_ngl(kw[name], flag)
    opts = ModelOptions(**kw)
    opts.validate()
    return opts


def _build_sampling(kw: dict[str, Any], src: dict[str, str] | None = None) -> Any:
    from specrun.decoding.sampling import SamplingParams

    seed = kw.pop("seed", None)
    params = SamplingParams(**kw, seed=secrets.randbits(31) if seed is None else seed)
    params.validate()
    return params


def model_options(
    exclude: Iterable[str] = (), **defaults: Any
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the shared model options; the command gets ``opts: ModelOptions``, validated."""
    return _inject(MODEL_OPTIONS, "opts", _build_model_options, exclude, defaults)


def sampling_options(**defaults: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add --temp/--top-k/--top-p/--min-p/--seed and the penalties; the command gets
    ``params: SamplingParams``."""
    return _inject(SAMPLING_OPTIONS, "params", _build_sampling, (), defaults)


__all__ = [
    "ALIASES",
    "MODEL_OPTIONS",
    "SAMPLING_OPTIONS",
    "envvar_for",
    "mode_for_spec_type",
    "model_options",
    "sampling_options",
]


# The probe's options, shared by `models check` and `draft make` (defaults: probe.ProbeSettings).
ProbeMaxTokens = Annotated[int, typer.Option("-n", "--max-tokens", help="Tokens per probe run.")]
ProbeDraftMax = Annotated[
    int,
    typer.Option(
        "--draft-max", help="Draft length while learning acceptance; the largest K considered."
    ),
]
ProbeRepeats = Annotated[
    int, typer.Option("--repeats", help="Alternating (none, K) runs per prompt when measuring.")
]
ProbeThreads = Annotated[
    int | None, typer.Option("--threads", "-t", help="CPU threads (default: physical cores).")
]

# llama.cpp's --chat-template-kwargs, for every command that renders a chat (generate, chat, serve).
TemplateKwargs = Annotated[
    str | None,
    typer.Option(
        "--chat-template-kwargs",
        metavar="JSON",
        help="Extra variables for the chat template, as llama.cpp: '{\"enable_thinking\": false}'.",
        envvar=envvar_for("--chat-template-kwargs"),
    ),
]
