"""`specrun serve`: the OpenAI-compatible HTTP server (server/) on the same engine and options."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from specrun.cli.options import TemplateKwargs, model_options, sampling_options


def register(app: typer.Typer) -> None:
    @app.command(short_help="An OpenAI-compatible HTTP server over the same engine.")
    @sampling_options()
    @model_options()
    def serve(
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
        template_kwargs: TemplateKwargs = None,
        opts: Any = None,
        params: Any = None,
    ) -> None:
        """An OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models,
        /health, /metrics). Request fields the CLI's sampling options name default to them."""
        from specrun.chat_template import parse_kwargs
        from specrun.errors import UsageError
        from specrun.server import serve as run

        if not 0 <= port <= 65535:
            raise UsageError(f"--port must be 0 to 65535, got {port}")
        if queue < 1:
            raise UsageError(f"--queue must be >= 1, got {queue}")
        if cache_ram < -1:
            raise UsageError(f"--cache-ram must be -1 (no limit), 0 (off) or MiB, got {cache_ram}")
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
