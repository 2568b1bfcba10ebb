"""specrun's HTTP front end: OpenAI-compatible routes over the one Engine the application layer
loads (``specrun serve``). Imports the application layer, never cli/; HTTP errors live here."""

from __future__ import annotations

__all__ = ["serve"]


def serve(*args, **kwargs):  # type: ignore[no-untyped-def]
    from specrun.server.run import serve as _serve  # deferred: fastapi, uvicorn on a call only

    return _serve(*args, **kwargs)
