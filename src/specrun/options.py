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

P_MODELS, P_SPEC, P_PLACE, P_SAMPLE = "Models", "Speculation", "Placement", "Sampling"


def _opt(*decls: str, help: str, panel: str | None = None, **kw: Any) -> Any:  # noqa: A002
    return typer.Option(*decls, help=help, rich_help_panel=panel, **kw)


# (parameter name, type, typer.Option, default)
MODEL_OPTIONS: list[tuple[str, Any, Any, Any]] = [
    ("pair", str | None, _opt("--pair", help="A pair from the registry (default: the registry's default).", panel=P_MODELS), None),
    ("model", str | None, _opt("-m", "--model", help="Target: a GGUF path, a registry name, or USER/REPO[:QUANT] on the hub.", panel=P_MODELS), None),
    ("model_draft", str | None, _opt("-md", "--model-draft", help="Draft model (overrides the pair's draft).", panel=P_MODELS), None),
    ("mode", str, _opt("--mode", help="auto|draft|lookup|hybrid|none (none = the target alone).", panel=P_SPEC), "auto"),
    ("draft_max", int | None, _opt("--draft-max", help="Longest draft (default: the pair's, else 4; auto, which picks K per step: at least 8).", panel=P_SPEC), None),
    ("draft_min", int, _opt("--draft-min", help="Shortest draft worth verifying.", panel=P_SPEC), 0),
    ("draft_p_min", float, _opt("--draft-p-min", help="Stop drafting when the draft's top probability falls below P (0 = never).", panel=P_SPEC), 0.6),
    ("verify", str, _opt("--verify", help="temp > 0: rejection (Leviathan/Chen, default) or match (sample-and-match, as llama-server).", panel=P_SPEC), "rejection"),
    ("lookup_min", int, _opt("--lookup-min", help="Shortest n-gram prompt lookup matches.", panel=P_SPEC), 1),
    ("lookup_max", int, _opt("--lookup-max", help="Longest n-gram prompt lookup matches (tried first).", panel=P_SPEC), 4),
    ("lookup_cache", str | None, _opt("--lookup-cache", help="A file of n-gram statistics kept across runs (lookup/hybrid/auto).", panel=P_SPEC), None),
    ("ngl", int, _opt("--ngl", "-ngl", help="Target layers offloaded to the GPU (-1 = all that fit).", panel=P_PLACE), -1),
    ("ngl_draft", int, _opt("--ngl-draft", "-ngld", help="Draft layers offloaded to the GPU (-1 = all that fit).", panel=P_PLACE), -1),
    ("ctx", int, _opt("--ctx", "-c", help="Target context size in tokens.", panel=P_PLACE), 4096),
    ("ctx_draft", int | None, _opt("--ctx-draft", "-cd", help="Draft context size (default: as the target's).", panel=P_PLACE), None),
    ("threads", int | None, _opt("--threads", "-t", help="CPU threads for the target (default: physical cores).", panel=P_PLACE), None),
    ("threads_draft", int | None, _opt("--threads-draft", "-td", help="CPU threads for the draft (default: as --threads).", panel=P_PLACE), None),
    ("batch", int, _opt("--batch-size", "-b", help="Most tokens per llama_decode call (prompt chunks).", panel=P_PLACE), 512),
    ("flash_attn", str, _opt("--flash-attn", "-fa", help="Flash attention: on|off|auto (auto: off on the CPU, where batched rows then equal single rows bit for bit; llama.cpp decides on a GPU; on for a quantized V cache).", panel=P_PLACE), "auto"),
    ("cache_type_k", str, _opt("--cache-type-k", "-ctk", help="Target KV cache type for K: f16, f32, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1.", panel=P_PLACE), "f16"),
    ("cache_type_v", str, _opt("--cache-type-v", "-ctv", help="Target KV cache type for V (quantized V needs flash attention).", panel=P_PLACE), "f16"),
    ("cache_type_k_draft", str | None, _opt("--cache-type-k-draft", "-ctkd", help="Draft KV cache type for K (default: as the target's).", panel=P_PLACE), None),
    ("cache_type_v_draft", str | None, _opt("--cache-type-v-draft", "-ctvd", help="Draft KV cache type for V (default: as the target's).", panel=P_PLACE), None),
    ("mem_check", bool, _opt("--mem-check/--no-mem-check", help="Refuse to load models the memory estimate says will not fit.", panel=P_PLACE), True),
    ("verbose", bool, _opt("--verbose", help="Show llama.cpp's own log on stderr."), False),
]

SAMPLING_OPTIONS: list[tuple[str, Any, Any, Any]] = [
    ("temp", float, _opt("--temp", help="Temperature; 0 = greedy.", panel=P_SAMPLE), 0.0),
    ("top_k", int, _opt("--top-k", help="Top-k (0 = off).", panel=P_SAMPLE), 40),
    ("top_p", float, _opt("--top-p", help="Top-p (1 = off).", panel=P_SAMPLE), 0.95),
    ("min_p", float, _opt("--min-p", help="Min-p (0 = off).", panel=P_SAMPLE), 0.05),
    ("seed", int | None, _opt("--seed", "-s", help="Random seed (default: random, always reported).", panel=P_SAMPLE), None),
]


def _inject(
    table: list[tuple[str, Any, Any, Any]],
    target_arg: str,
    build: Callable[[dict[str, Any]], Any],
    exclude: Iterable[str],
    defaults: dict[str, Any],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    skip = set(exclude)
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
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=Annotated[t, o])
            for n, t, o, d in rows
        ]
        names = {n for n, *_ in rows}

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            mine = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
            kwargs[target_arg] = build(mine)
            return func(*args, **kwargs)

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + added
        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        del wrapper.__wrapped__  # Typer must see the new signature, not the function's own
        return wrapper

    return decorate


def _build_model_options(kw: dict[str, Any]) -> Any:
    from .loader import ModelOptions

    opts = ModelOptions(**kw)
    opts.validate()
    return opts


def _build_sampling(kw: dict[str, Any]) -> Any:
    from .sampling import SamplingParams

    seed = kw.pop("seed", None)
    params = SamplingParams(**kw, seed=secrets.randbits(31) if seed is None else seed)
    params.validate()
    return params


def model_options(exclude: Iterable[str] = (), **defaults: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the shared model options; the command gets ``opts: ModelOptions``, validated."""
    return _inject(MODEL_OPTIONS, "opts", _build_model_options, exclude, defaults)


def sampling_options(**defaults: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add --temp/--top-k/--top-p/--min-p/--seed; the command gets ``params: SamplingParams``."""
    return _inject(SAMPLING_OPTIONS, "params", _build_sampling, (), defaults)


__all__ = ["MODEL_OPTIONS", "SAMPLING_OPTIONS", "model_options", "sampling_options"]
