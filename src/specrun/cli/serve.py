"""`specrun serve`: the OpenAI-compatible HTTP server (server/) on the same engine and options."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from specrun.cli.options import TemplateKwargs, model_options, sampling_options

# What a request without them samples with: llama-server's defaults (OpenAI's clients expect
# sampling, not greedy decoding, when they leave temperature out). --temp 0 makes it greedy.
SERVE_SAMPLING = {"temp": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
# --parallel's bound: each slot's verify rows share one pass of at most 65 (llama/slots.py).
MAX_PARALLEL = 16


def register(app: typer.Typer) -> None:
    @app.command(short_help="An OpenAI-compatible HTTP server over the same engine.")
    @sampling_options(**SERVE_SAMPLING)
    @model_options()
    def serve(
        click_ctx: typer.Context,
        host: Annotated[
            str,
            typer.Option(
                "--host",
                help="Address to listen on (127.0.0.1: this machine only).",
                envvar="SPECRUN_HOST",
            ),
        ] = "127.0.0.1",
        port: Annotated[
            int,
            typer.Option(
                "--port",
                help="Port to listen on (0: any free port, printed).",
                envvar="SPECRUN_PORT",
            ),
        ] = 8080,
        api_key: Annotated[
            str | None,
            typer.Option(
                "--api-key",
                help="Require Authorization: Bearer KEY on every route but /health.",
                envvar="SPECRUN_API_KEY",
            ),
        ] = None,
        cors: Annotated[
            list[str] | None,
            typer.Option(
                "--cors",
                metavar="ORIGIN",
                help="Allow browser requests from ORIGIN (repeatable; * for any). Off unless given.",
            ),
        ] = None,
        queue: Annotated[
            int,
            typer.Option(
                "--queue",
                help="Requests that may wait while one generates; more get 503 with Retry-After.",
                envvar="SPECRUN_QUEUE",
            ),
        ] = 64,
        cache_ram: Annotated[
            int,
            typer.Option(
                "--cache-ram",
                metavar="MIB",
                help="Memory for earlier prompts' KV caches, so a switch between conversations "
                "does not evaluate each again (-1: no limit, 0: off). llama.cpp: --cache-ram.",
                envvar="SPECRUN_CACHE_RAM",
            ),
        ] = 8192,
        parallel: Annotated[
            int,
            typer.Option(
                "--parallel",
                "-np",
                metavar="N",
                help="Slots: N requests generate at once, their verify passes in one batch (a "
                "request's greedy output never depends on the others). The context (--ctx) is "
                "shared: each slot gets ctx/N. llama.cpp: -np.",
                envvar="SPECRUN_PARALLEL",
            ),
        ] = 1,
        template_kwargs: TemplateKwargs = None,
        opts: Any = None,
        params: Any = None,
    ) -> None:
        """An OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models,
        /health, /metrics, and llama-server's /completion, /infill...). Request fields the CLI's
        sampling options name default to them (llama-server's values: temperature 0.8, top-k 40,
        top-p 0.95, min-p 0.05). Without --ctx the context is the target's trained one, fitted
        to the free memory (specrun info shows the fit)."""
        from specrun.chat_template import parse_kwargs
        from specrun.errors import UsageError
        from specrun.server import serve as run

        if not 0 <= port <= 65535:
            raise UsageError(f"--port must be 0 to 65535, got {port}")
        if queue < 1:
            raise UsageError(f"--queue must be >= 1, got {queue}")
        if cache_ram < -1:
            raise UsageError(f"--cache-ram must be -1 (no limit), 0 (off) or MiB, got {cache_ram}")
        if not 1 <= parallel <= MAX_PARALLEL:
            raise UsageError(f"--parallel must be 1 to {MAX_PARALLEL}, got {parallel}")
        if not _given(click_ctx, "ctx"):
            opts = _fit_context(opts)
        if parallel > 1:
            from dataclasses import replace

            if opts.ctx // parallel < 256:
                raise UsageError(
                    f"--ctx {opts.ctx} gives {parallel} slots {opts.ctx // parallel} tokens each: "
                    "at least 256 each (raise --ctx or lower --parallel)"
                )
            opts = replace(opts, n_seq=parallel)
        run(
            opts,
            params,
            host=host,
            port=port,
            api_key=api_key,
            cors=list(cors or []) or None,
            queue=queue,
            cache_ram=cache_ram,
            template_kwargs=parse_kwargs(template_kwargs, template=opts.template_source()),
        )


def _given(click_ctx: Any, name: str) -> bool:
    """Whether the option was set on the command line or in the environment (its -c/--ctx-size
    spellings included), not left at its default."""
    for n in (name, f"alias_{name}"):
        src = click_ctx.get_parameter_source(n) if click_ctx is not None else None
        if src is not None and getattr(src, "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP"):
            return True
    return False


def _fit_context(opts: Any) -> Any:
    """The target's trained context where it fits in free memory, else the most that does
    (models/memory.py's estimate); the default context where the models cannot be read yet."""
    from dataclasses import replace

    from specrun.session import fit_for_options

    fit = fit_for_options(opts)
    if fit is None:
        return opts
    return replace(opts, ctx=fit.n_ctx)
