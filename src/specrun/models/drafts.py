"""Which local models could draft for a target, and which one was chosen (remembered per file).

``candidates`` looks at every GGUF on disk (the registry's present models and the other tools'
stores, ``stores``) and keeps those much cheaper than the target (under half its bytes: the
registry's own Q4 drafts of its F16 targets are 34-39% of them) whose vocabulary passes
llama.cpp's compatibility rules (``compat``) as read from the GGUF headers, saying why each
other one was left out. Measuring them (the probe) is the application's job
(``specrun.probe.rank_drafts``); the choice it makes is kept in ``$SPECRUN_HOME/drafts.json``,
keyed by the target file (its path, size and mtime), so the next run takes it without probing.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specrun import paths
from specrun.models import compat, stores
from specrun.models.store import locked, noop

if TYPE_CHECKING:
    from specrun.models.registry import Registry

CHEAPER = 2  # a draft's file must be under 1/CHEAPER of the target's
_VOCAB_TYPES = {"llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5, "plamo2": 6}


@dataclass(frozen=True)
class LeftOut:
    model: stores.LocalModel
    reason: str


@dataclass(frozen=True)
class _Vocab:
    """compat.Facts from a GGUF header (llama.cpp's defaults where a key is absent, roughly:
    loading both models, as the probe does, decides for certain)."""

    vocab_type: int
    n_vocab: int
    add_bos: bool
    add_eos: bool
    bos: int
    eos: int


def _vocab(f: stores.GGUFFacts) -> _Vocab:
    vt = _VOCAB_TYPES.get(f.tokenizer or "", 0)
    return _Vocab(
        vocab_type=vt,
        n_vocab=f.n_vocab or 0,
        add_bos=f.add_bos if f.add_bos is not None else vt == 1,
        add_eos=bool(f.add_eos),
        bos=f.bos if f.bos is not None else -1,
        eos=f.eos if f.eos is not None else -1,
    )


def vocab_problems(target: stores.GGUFFacts, draft: stores.GGUFFacts) -> list[str]:
    """compat's rules over two files' headers (``facts(..., keep_tokens=True)``)."""
    if not target.tokens or not draft.tokens:
        return ["no vocabulary in the file"]
    return compat.problems(
        _vocab(target),
        _vocab(draft),
        lambda i: target.tokens[i].encode("utf-8", "surrogatepass"),
        lambda i: draft.tokens[i].encode("utf-8", "surrogatepass"),
    )


def local_models(registry: Registry, dedupe: bool = True) -> list[stores.LocalModel]:
    """Every GGUF on disk: the registry's present models first, then the other stores'; one
    file found twice is listed once (unless not ``dedupe``)."""
    out: list[stores.LocalModel] = []
    for name in registry.models:
        with contextlib.suppress(Exception):
            if registry.is_present(name):
                p = registry.local_path(name)
                out.append(stores.LocalModel(name, "registry", p, registry.size(name) or 0))
    found = out + stores.scan()
    return stores.dedupe(found) if dedupe else found


def candidates(
    target: Path, registry: Registry
) -> tuple[list[stores.LocalModel], list[LeftOut], stores.GGUFFacts]:
    """(compatible and much cheaper models, the others with the reason, the target's facts)."""
    tf = stores.facts(target, keep_tokens=True)
    tsize = target.stat().st_size
    me = stores.LocalModel(target.name, "target", target, tsize)
    keep: list[stores.LocalModel] = []
    out: list[LeftOut] = []
    for m in local_models(registry):
        if stores.same_file(m, me):
            continue
        if m.size * CHEAPER >= tsize:
            out.append(
                LeftOut(
                    m,
                    f"not much cheaper ({_mib(m.size)} against the target's {_mib(tsize)}, "
                    f"needs under 1/{CHEAPER})",
                )
            )
            continue
        f = stores.facts(m.path, keep_tokens=True)
        if f.problem is not None:
            out.append(LeftOut(m, f.problem))
            continue
        probs = vocab_problems(tf, f)
        if probs:
            out.append(LeftOut(m, "incompatible vocabulary: " + probs[0]))
            continue
        keep.append(m)
    return keep, out, tf


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


# --------------------------------------------------------------------------------------------
# the choice, remembered per target file


def memory_file() -> Path:
    return paths.specrun_home() / "drafts.json"


def _key(target: Path) -> tuple[str, dict[str, Any]]:
    st = target.stat()
    return str(target.resolve()), {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read() -> dict[str, Any]:
    try:
        data = json.loads(memory_file().read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def remembered(target: Path) -> tuple[bool, Path | None]:
    """(known, the draft): known is False when nothing is remembered for this very file (or the
    draft remembered is gone); the draft is None when the choice was "none pays"."""
    try:
        key, stamp = _key(target)
    except OSError:
        return False, None
    entry = _read().get(key)
    if not isinstance(entry, dict) or entry.get("target") != stamp:
        return False, None
    draft = entry.get("draft")
    if draft is None:
        return True, None
    p = Path(str(draft))
    return (True, p) if p.is_file() else (False, None)


def remember(target: Path, draft: Path | None, figures: dict[str, Any] | None = None) -> None:
    """Keep the choice for ``target`` (atomically, under a lock: two runs lose nothing)."""
    key, stamp = _key(target)
    f = memory_file()
    with locked(f, noop):
        data = _read()
        data[key] = {
            "target": stamp,
            "draft": str(draft.resolve()) if draft is not None else None,
            "figures": figures or {},
            "when": int(time.time()),
        }
        paths.write_json_atomic(f, data)
    with contextlib.suppress(OSError):
        os.chmod(f, 0o644)
