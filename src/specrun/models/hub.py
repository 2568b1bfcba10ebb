"""Hugging Face hub references and the hub cache's layout, as llama.cpp's ``-hf`` reads them.

What a ``USER/REPO[:QUANT]`` names, which file of a repo is the model, and where the hub cache
keeps it: strings and folders only, no network and no huggingface_hub (``hf`` fetches).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

from specrun import paths

DEFAULT_HF_QUANT = "Q4_K_M"  # what llama.cpp's -hf picks when no tag is given
DEFAULT_HF_QUANTS = (DEFAULT_HF_QUANT, "Q8_0")  # llama.cpp's -hf preference without a tag

# Files in a GGUF repo that are not the model itself (llama.cpp's gguf_filename_is_model): the
# vision projector, an importance matrix, and the speculative sidecars (MTP heads, EAGLE-3,
# DFlash and DSpark drafters). Matched in the file's name, case-sensitively, as llama.cpp does.
NOT_A_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")

_SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_HUB_SPEC_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(?::[\w.-]+)?$")
_QUANT_TAG_RE = re.compile(
    r"(?<![a-z0-9])((?:i?q\d[a-z0-9_]*)|bf16|f16|f32)(?=[.-])", re.IGNORECASE
)
_HUB_HOSTS = ("hf.co/", "huggingface.co/", "https://hf.co/", "https://huggingface.co/")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hf_offline() -> bool:
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (the library reads it at import).

    As llama.cpp's ``-hf`` looks for it (common/hf-cache.cpp): ``$LLAMA_CACHE`` first, then
    huggingface-hub's own ``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``$XDG_CACHE_HOME/huggingface/hub``,
    ``~/.cache/huggingface/hub``; so specrun, llama.cpp and huggingface-hub share one download.
    """
    env = os.environ
    for var in ("LLAMA_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(os.path.expandvars(os.path.expanduser(env[var])))
    if env.get("HF_HOME"):
        return Path(os.path.expandvars(os.path.expanduser(env["HF_HOME"]))) / "hub"
    return paths.cache_home() / "huggingface" / "hub"


def split_parts(filename: str) -> list[str]:
    """All parts of a split GGUF given its first part; [filename] when it is not split."""
    m = _SPLIT_RE.search(filename)
    if not m:
        return [filename]
    n = int(m.group(2))
    stem = filename[: m.start()]
    return [f"{stem}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]


def is_model_gguf(path: str) -> bool:
    base = path.rsplit("/", 1)[-1]
    return base.endswith(".gguf") and not any(k in base for k in NOT_A_MODEL)


def pick_gguf(files: Iterable[str], quant: str | None, fallback: bool = True) -> str | None:
    """llama.cpp's -hf rule (common/download.cpp, find_best_model), in the repo's file order.

    With a tag: the first model file whose path holds the tag followed by ``.`` or ``-``
    (case-insensitive). Without one: Q4_K_M, then Q8_0 that way, then (when ``fallback``) the
    first model file. Files that are not the model (``NOT_A_MODEL``) and the second and later
    parts of a split file are never picked.
    """
    cands = []
    for f in files:
        if not is_model_gguf(f):
            continue
        m = _SPLIT_RE.search(f)
        if m and int(m.group(1)) != 1:
            continue
        cands.append(f)
    for tag in [quant] if quant else DEFAULT_HF_QUANTS:
        pattern = re.compile(re.escape(tag) + r"[.-]", re.IGNORECASE)
        hit = next((f for f in cands if pattern.search(f)), None)
        if hit is not None:
            return hit
    if quant is None and fallback and cands:
        return cands[0]
    return None


def parse_hub_spec(spec: str) -> tuple[str, str | None] | None:
    """``USER/REPO[:QUANT]`` (llama.cpp's -hf) or Ollama's ``hf.co/USER/REPO[:QUANT]`` ->
    (repo, QUANT or None); None when ``spec`` is neither. Ollama's ``:latest`` means no tag."""
    for host in _HUB_HOSTS:
        if spec.lower().startswith(host):
            spec = spec[len(host) :]
            break
    if not _HUB_SPEC_RE.match(spec):
        return None
    repo, _, quant = spec.partition(":")
    return repo, (quant.upper() if quant and quant.lower() != "latest" else None)


def quant_tags(files: Iterable[str]) -> list[str]:
    """The quant tags (Q4_K_M, F16, ...) that the names of these GGUF files carry, sorted."""
    tags = {
        m.group(1).upper()
        for f in files
        if f.lower().endswith(".gguf")
        for m in _QUANT_TAG_RE.finditer(f)
    }
    return sorted(tags)


# --------------------------------------------------------------------------------------------
# The cache's layout: models--USER--REPO/{refs,snapshots,blobs}


def repo_folder(cache: Path, repo: str) -> Path:
    return cache / ("models--" + repo.replace("/", "--"))


def cached_snapshot(cache: Path, repo: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of ``repo`` at ``revision`` (a ref or a commit), if any."""
    folder = repo_folder(cache, repo)
    rev = revision or "main"
    ref = folder / "refs" / rev
    with contextlib.suppress(OSError):
        if ref.is_file():
            rev = ref.read_text().strip()
    snap = folder / "snapshots" / rev
    return snap if snap.is_dir() else None


def cached_files(cache: Path, repo: str, revision: str | None) -> list[str]:
    snap = cached_snapshot(cache, repo, revision)
    if snap is None:
        return []
    out = []
    for root, _dirs, names in os.walk(snap):
        for n in names:
            p = Path(root) / n
            if p.is_file():  # a dangling link is not a cached file
                out.append(p.relative_to(snap).as_posix())
    return sorted(out)


def cached_choice(cache: Path, repo: str, revision: str | None, quant: str | None) -> str | None:
    """The repo file a quant tag (or none) names, picked from the cached snapshot alone."""
    cached = cached_files(cache, repo, revision)
    if hf_offline():  # all there is: llama.cpp's whole rule over the cached files
        return pick_gguf(cached, quant)
    # Online, a cached file answers only when it is what the repo's whole listing would give:
    # the tag's file, or for a bare USER/REPO a cached Q4_K_M (the first choice); a cached Q8_0
    # may have been pulled by tag from a repo that also has a Q4_K_M.
    return pick_gguf(cached, quant or DEFAULT_HF_QUANT, fallback=False)


def cached_parts(cache: Path, repo: str, revision: str | None, file: str | None) -> list[Path]:
    """The snapshot paths of every part of ``file`` when all are cached, else []."""
    snap = cached_snapshot(cache, repo, revision)
    if not file or snap is None:
        return []
    parts = [snap / p for p in split_parts(file)]
    return parts if all(p.is_file() for p in parts) else []
