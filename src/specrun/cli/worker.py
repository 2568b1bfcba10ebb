"""`specrun worker`: serve this machine's devices to a driver (`--rpc HOST:PORT` on generate,
chat and bench) through llama.cpp's own RPC server, so both ends speak one protocol version."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from specrun.errors import SpecrunError, UsageError

NO_AUTH_WARNING = """\
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
WARNING: specrun worker is listening on {addr}:{port}, not on the loopback address.
         llama.cpp's RPC protocol has NO authentication and NO encryption: anyone who can
         reach this port can run computations on this machine and read what it holds.
         Use it only on a network you trust, never on an open one.
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"""


def register(app: typer.Typer) -> None:
    app.command(name="worker")(worker)


def worker(
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="Address to listen on (loopback by default; any other has no authentication).",
            envvar="SPECRUN_WORKER_HOST",
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", help="TCP port to listen on.", envvar="SPECRUN_WORKER_PORT")
    ] = 50052,
    threads: Annotated[
        int | None,
        typer.Option(
            "--threads",
            "-t",
            help="CPU threads for the work (default: physical cores).",
            envvar="SPECRUN_THREADS",
        ),
    ] = None,
    cache: Annotated[
        Path | None,
        typer.Option(
            "--cache",
            help="Directory where the worker keeps the tensors it was sent, so a restarted driver or worker does not send the weights again.",
            envvar="SPECRUN_WORKER_CACHE",
            metavar="DIR",
        ),
    ] = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", help="Show llama.cpp's own log on stderr.")
    ] = False,
) -> None:
    """Serve this machine's devices (its GPUs, else its CPU) to specrun drivers over llama.cpp's RPC.

    A driver places the target's layers here with `--rpc HOST:PORT`. One driver at a time; Ctrl-C
    stops the worker.
    """
    from specrun.llama import backend, rpc

    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    addr = rpc.listen_address(host, port)
    cache_dir = None
    if cache is not None:
        try:
            cache.expanduser().mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpecrunError(f"--cache {cache}: cannot create it ({e.strerror or e})") from None
        cache_dir = str(cache.expanduser().resolve())
    if not rpc.is_loopback(addr):
        print(NO_AUTH_WARNING.format(addr=addr, port=port), file=sys.stderr, flush=True)
    backend.init_backend(verbose)
    served = rpc.serving_devices()
    n_threads = threads or backend.physical_cores()
    names = ", ".join(
        f"{d.name} ({d.description}, {d.free / 2**30:.1f} GiB free)" for _h, d in served
    )
    print(
        f"specrun worker: serving {names} on {addr}:{port} with {n_threads} threads "
        f"(RPC protocol v{rpc.PROTO_MAJOR}.{rpc.PROTO_MINOR}.{rpc.PROTO_PATCH}"
        f"{', cache ' + cache_dir if cache_dir else ''}); Ctrl-C stops it",
        file=sys.stderr,
        flush=True,
    )
    server = rpc.serve(addr, port, n_threads, cache_dir, [h for h, _d in served])
    try:
        while server.is_alive():
            server.join(0.5)
    except KeyboardInterrupt:
        sys.stdout.flush()
        sys.stderr.write("\nspecrun worker: stopped\n")
        sys.stderr.flush()
        os._exit(130)  # llama.cpp's server thread never returns: leave without waiting for it
    raise SpecrunError(
        f"llama.cpp's RPC server on {addr}:{port} stopped (run with --verbose for its log)"
    )
