"""What the registry holds: a model entry (one source each, an hf source may name a fallback), a
pair, a resolved model."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from specrun.models.hub import DEFAULT_HF_QUANT

SOURCES = ("package", "derive", "hf", "path")


@dataclass(frozen=True)
class ModelEntry:
    name: str
    source: str  # "package" | "derive" | "hf" | "path"
    origin: Path | None = (
        None  # the models.toml it came from; None for a hub spec on the command line
    )
    line: int | None = None
    sha256: str | None = None
    description: str | None = None
    packages: tuple[str, ...] = ()  # package: pip requirement specs, in part order
    files: tuple[str, ...] = ()  # package: wheel members, one per part
    derive_from: str | None = None  # derive
    quant: str | None = None  # derive: target type; hf: quant tag when no file is named
    hf_repo: str | None = None  # hf
    hf_file: str | None = None  # hf: file in the repo (None: picked by quant tag)
    revision: str | None = None  # hf
    path: Path | None = None  # path: expanded, absolute
    # hf: where the hub cannot be reached (offline, no connection), the same file (same sha256)
    # from another source (a ``package``), kept in the store as a package model's file is
    fallback: ModelEntry | None = None

    @property
    def label(self) -> str:
        """Where it comes from, in one short string: pypi:..., derive:...@Q, hf:..., path:..."""
        if self.source == "package":
            extra = f" (+{len(self.packages) - 1} parts)" if len(self.packages) > 1 else ""
            return f"pypi:{self.packages[0]}{extra}"
        if self.source == "derive":
            return f"derive:{self.derive_from}@{self.quant}"
        if self.source == "hf":
            rev = f"@{self.revision}" if self.revision else ""
            tail = f"/{self.hf_file}" if self.hf_file else f":{self.quant or DEFAULT_HF_QUANT}"
            alt = f" | {self.fallback.label}" if self.fallback is not None else ""
            return f"hf:{self.hf_repo}{rev}{tail}{alt}"
        return f"path:{self.path}"


@dataclass(frozen=True)
class PairEntry:
    name: str
    target: str
    draft: str
    draft_max: int | None = None
    origin: Path | None = None
    line: int | None = None
    description: str | None = None


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    path: Path
    entry: ModelEntry | None  # None for a plain path


def suggest(name: str, options: Iterable[str]) -> str:
    """``; did you mean A, B?`` for the names in ``options`` close to ``name``, else ``""``."""
    close = difflib.get_close_matches(name, list(options), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else ""
