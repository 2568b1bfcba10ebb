"""Where specrun keeps its files."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def cache_home() -> Path:
    """$XDG_CACHE_HOME, default ~/.cache (the XDG base directory rule)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg).expanduser() if xdg else Path.home() / ".cache"


def specrun_home() -> Path:
    """Pulled and derived models live here: $SPECRUN_HOME, default $XDG_CACHE_HOME/specrun
    (~/.cache/specrun)."""
    env = os.environ.get("SPECRUN_HOME")
    return Path(env).expanduser() if env else cache_home() / "specrun"


def models_dir() -> Path:
    return specrun_home() / "models"


def user_registry_file() -> Path:
    """The user's models.toml: $SPECRUN_MODELS, else ~/.config/specrun/models.toml."""
    env = os.environ.get("SPECRUN_MODELS")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".config"
    return base / "specrun" / "models.toml"


def state_dir() -> Path:
    """Chat history and other small state: $XDG_STATE_HOME/specrun."""
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
    return base / "specrun"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename: a crash midway
    leaves the previous file whole. OSError goes to the caller."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, separators=(",", ":"))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
