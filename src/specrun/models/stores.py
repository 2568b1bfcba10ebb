"""GGUF files other tools keep: Ollama's store, LM Studio's folder, the Hugging Face cache.

Read, never written. What a user types after ``-m`` is looked up in each (``lookup``); every
GGUF in them is listed by ``scan`` (``specrun models list --all``). The layouts, as those tools
write them:

- **Ollama** (``$OLLAMA_MODELS``, else ``~/.ollama/models``): ``manifests/HOST/NAMESPACE/MODEL/TAG``
  is an OCI-style JSON manifest whose layer of ``mediaType``
  ``application/vnd.ollama.image.model`` names the GGUF blob by digest, ``sha256:<hex>`` ->
  ``blobs/sha256-<hex>``. A name is ``[HOST/][NAMESPACE/]MODEL[:TAG]`` with the defaults
  ``registry.ollama.ai``, ``library`` and ``latest`` (``qwen2.5:0.5b``, ``library/llama3.2:1b``,
  ``hf.co/USER/REPO:Q4_K_M``); ``ollama:NAME`` asks Ollama's store alone.
- **LM Studio** (``~/.lmstudio/models``, and the older ``~/.cache/lm-studio/models``):
  ``PUBLISHER/REPO/FILE.gguf``, named so.
- **Hugging Face cache** (``hub.hf_cache_dir()``): ``models--ORG--REPO/snapshots/REV/FILE``,
  named ``ORG/REPO/FILE.gguf`` (``ORG/REPO[:QUANT]`` resolves through the registry's hub path,
  which looks in this cache first).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specrun.errors import ModelError
from specrun.llama.gguf import TOKENS_KEY, validate_gguf
from specrun.models.archs import FILE_TYPES, LLAMA_ARCHS
from specrun.models.hub import (
    hf_cache_dir,
    is_model_gguf,
    split_parts,
)

OLLAMA_HOST = "registry.ollama.ai"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_OLLAMA_PART_RE = re.compile(r"^[A-Za-z0-9][\w.-]*$")
_SPLIT_LATER_RE = re.compile(r"-(\d{5})-of-\d{5}\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class LocalModel:
    """A GGUF found in another tool's store (or the registry's), and what to type to use it."""

    name: str  # what -m takes
    source: str  # "registry" | "ollama" | "lmstudio" | "hf-cache"
    path: Path  # the GGUF (a split file's first part)
    size: int  # bytes, every part
    digest: str | None = None  # sha256 where the store names its files by it (Ollama, hub)

    @property
    def where(self) -> str:
        return f"{self.source}: {self.name} ({self.path})"


# --------------------------------------------------------------------------------------------
# where the stores are


def ollama_root() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(os.path.expanduser(env)) if env else Path.home() / ".ollama" / "models"


def lmstudio_roots() -> list[Path]:
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


# --------------------------------------------------------------------------------------------
# Ollama


def parse_ollama_name(spec: str) -> tuple[str, str, str, str] | None:
    """``[HOST/][NAMESPACE/]MODEL[:TAG]`` -> (host, namespace, model, tag) with Ollama's
    defaults; None when it cannot be an Ollama name."""
    name, _, tag = spec.partition(":")
    if ":" in tag or (tag and not _OLLAMA_PART_RE.match(tag)):
        return None
    parts = name.split("/")
    if not 1 <= len(parts) <= 3 or not all(_OLLAMA_PART_RE.match(p) for p in parts):
        return None
    if len(parts) == 1:
        parts = [OLLAMA_HOST, "library", parts[0]]
    elif len(parts) == 2:
        parts = [OLLAMA_HOST, parts[0], parts[1]]
    return parts[0], parts[1], parts[2], tag or "latest"


def ollama_display_name(host: str, namespace: str, model: str, tag: str) -> str:
    """The short name Ollama's ``ollama list`` shows."""
    if host == OLLAMA_HOST:
        base = model if namespace == "library" else f"{namespace}/{model}"
    else:
        base = f"{host}/{namespace}/{model}"
    return f"{base}:{tag}"


def _ci_child(folder: Path, name: str) -> Path | None:
    """``folder/name``, matched case-insensitively as Ollama matches names."""
    exact = folder / name
    if exact.exists():
        return exact
    with contextlib.suppress(OSError):
        for child in folder.iterdir():
            if child.name.lower() == name.lower():
                return child
    return None


def _ollama_blob(root: Path, manifest: Path) -> tuple[Path, str] | None:
    """The model layer's blob of a manifest, and its digest; None when it names none."""
    try:
        data: Any = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    layers = data.get("layers") if isinstance(data, dict) else None
    for layer in layers if isinstance(layers, list) else []:
        if not isinstance(layer, dict) or layer.get("mediaType") != OLLAMA_MODEL_LAYER:
            continue
        digest = layer.get("digest")
        m = re.fullmatch(r"sha256[:-]([0-9a-f]{64})", digest if isinstance(digest, str) else "")
        if m:
            return root / "blobs" / f"sha256-{m.group(1)}", m.group(1)
    return None


def _ollama_model(root: Path, parts: tuple[str, str, str, str], manifest: Path) -> LocalModel:
    blob = _ollama_blob(root, manifest)
    name = ollama_display_name(*parts)
    if blob is None:
        raise ModelError(f"Ollama's manifest for {name} ({manifest}) names no model layer")
    path, digest = blob
    if not path.is_file():
        raise ModelError(f"Ollama's blob for {name} is missing: {path}")
    return LocalModel(name, "ollama", path, path.stat().st_size, digest)


def lookup_ollama(spec: str) -> LocalModel | None:
    parts = parse_ollama_name(spec)
    if parts is None:
        return None
    folder: Path | None = ollama_root() / "manifests"
    for p in parts:
        folder = _ci_child(folder, p) if folder is not None else None
    if folder is None or not folder.is_file():
        return None
    return _ollama_model(ollama_root(), parts, folder)


def scan_ollama() -> list[LocalModel]:
    root = ollama_root()
    manifests = root / "manifests"
    out: list[LocalModel] = []
    if not manifests.is_dir():
        return out
    for manifest in sorted(manifests.glob("*/*/*/*")):
        if not manifest.is_file():
            continue
        rel = manifest.relative_to(manifests).parts
        with contextlib.suppress(ModelError):
            out.append(_ollama_model(root, (rel[0], rel[1], rel[2], rel[3]), manifest))
    return out


# --------------------------------------------------------------------------------------------
# LM Studio and the Hugging Face cache: ORG/REPO/FILE.gguf


def _file_spec(spec: str) -> str | None:
    """``ORG/REPO/FILE[.gguf]`` (FILE may sit in a folder) -> the path with ``.gguf``."""
    if spec.count("/") < 2 or spec.startswith(("/", ".", "~")) or "\\" in spec or ".." in spec:
        return None
    return spec if spec.lower().endswith(".gguf") else spec + ".gguf"


def _split_size(path: Path) -> int:
    parts = split_parts(path.name)
    return sum((path.parent / p).stat().st_size for p in parts if (path.parent / p).is_file())


def lookup_lmstudio(spec: str) -> LocalModel | None:
    rel = _file_spec(spec)
    if rel is None:
        return None
    for root in lmstudio_roots():
        p = root / rel
        if p.is_file():
            return LocalModel(rel, "lmstudio", p, _split_size(p))
    return None


def scan_lmstudio() -> list[LocalModel]:
    out: list[LocalModel] = []
    seen: set[str] = set()
    for root in lmstudio_roots():
        if not root.is_dir():
            continue
        for p in sorted(root.glob("*/*/**/*.gguf")):
            rel = p.relative_to(root).as_posix()
            if rel in seen or not _listable(p):
                continue
            seen.add(rel)
            out.append(LocalModel(rel, "lmstudio", p, _split_size(p)))
    return out


def _listable(p: Path) -> bool:
    """A model file (not a projector, not a split file's later part) that is there."""
    m = _SPLIT_LATER_RE.search(p.name)
    return is_model_gguf(p.name) and not (m and int(m.group(1)) != 1) and p.is_file()


def _hub_repo(folder: Path) -> str | None:
    if not folder.name.startswith("models--"):
        return None
    return folder.name[len("models--") :].replace("--", "/", 1)


def _hub_snapshots(folder: Path) -> list[Path]:
    """The repo's snapshots, the one ``refs/main`` names first."""
    snaps = sorted((folder / "snapshots").glob("*"))
    with contextlib.suppress(OSError):
        main = (folder / "refs" / "main").read_text().strip()
        snaps.sort(key=lambda s: s.name != main)
    return [s for s in snaps if s.is_dir()]


def _hub_model(repo: str, rel: str, p: Path) -> LocalModel:
    blob = p.resolve().name
    digest = blob if re.fullmatch(r"[0-9a-f]{64}", blob) else None
    return LocalModel(f"{repo}/{rel}", "hf-cache", p, _split_size(p), digest)


def lookup_hf_cache(spec: str) -> LocalModel | None:
    rel = _file_spec(spec)
    if rel is None:
        return None
    org, repo, file = rel.split("/", 2)
    folder = hf_cache_dir() / f"models--{org}--{repo}"
    for snap in _hub_snapshots(folder) if folder.is_dir() else []:
        if (snap / file).is_file():
            return _hub_model(f"{org}/{repo}", file, snap / file)
    return None


def scan_hf_cache() -> list[LocalModel]:
    cache = hf_cache_dir()
    out: list[LocalModel] = []
    if not cache.is_dir():
        return out
    for folder in sorted(cache.glob("models--*")):
        repo = _hub_repo(folder)
        if repo is None:
            continue
        seen: set[str] = set()
        for snap in _hub_snapshots(folder):
            for p in sorted(snap.rglob("*.gguf")):
                rel = p.relative_to(snap).as_posix()
                if rel not in seen and _listable(p):
                    seen.add(rel)
                    out.append(_hub_model(repo, rel, p))
    return out


# --------------------------------------------------------------------------------------------
# all of them


def lookup(spec: str) -> list[LocalModel]:
    """Every store's model that ``spec`` names (``ollama:NAME`` asks Ollama's store alone), the
    same file found twice (one blob by digest, or one inode) counted once."""
    if spec.startswith("ollama:"):
        found = lookup_ollama(spec[len("ollama:") :])
        return [found] if found is not None else []
    hits = [f(spec) for f in (lookup_ollama, lookup_lmstudio, lookup_hf_cache)]
    return dedupe([h for h in hits if h is not None])


def scan() -> list[LocalModel]:
    return [*scan_ollama(), *scan_lmstudio(), *scan_hf_cache()]


def same_file(a: LocalModel, b: LocalModel) -> bool:
    if a.digest is not None and a.digest == b.digest:
        return True
    try:
        return os.path.samefile(a.path, b.path)
    except OSError:
        return False


def dedupe(models: list[LocalModel]) -> list[LocalModel]:
    out: list[LocalModel] = []
    for m in models:
        if not any(same_file(m, o) for o in out):
            out.append(m)
    return out


# --------------------------------------------------------------------------------------------
# what a file is: format, architecture, vocabulary


@dataclass(frozen=True)
class GGUFFacts:
    """What ``models list --all`` shows of a file and ``models drafts`` filters on."""

    format: str | None  # Q4_K_M, F16, ... (general.file_type)
    arch: str | None
    n_vocab: int | None
    vocab: str | None  # a fingerprint of the token texts: N:sha256[:10]
    tokenizer: str | None  # tokenizer.ggml.model
    add_bos: bool | None
    add_eos: bool | None
    bos: int | None
    eos: int | None
    tokens: tuple[str, ...] = ()
    problem: str | None = None  # why llama.cpp cannot load it, in one line

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "arch": self.arch,
            "n_vocab": self.n_vocab,
            "vocab": self.vocab,
            "problem": self.problem,
        }


def facts(path: Path, keep_tokens: bool = False) -> GGUFFacts:
    """Read the GGUF's header with the validator (llama/gguf.py): never raises; a file that
    llama.cpp cannot load gets ``problem``."""
    try:
        info = validate_gguf(path, check_tensors=False, load_arrays=[TOKENS_KEY])
    except ModelError as exc:
        return GGUFFacts(None, None, None, None, None, None, None, None, None, problem=str(exc))
    md = info.metadata
    tokens_raw = md.get(TOKENS_KEY)
    tokens = tuple(str(t) for t in tokens_raw) if isinstance(tokens_raw, tuple) else ()
    h = hashlib.sha256()
    for t in tokens:
        b = t.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(4, "little") + b)
    ftype = md.get("general.file_type")
    arch = info.architecture

    def opt_int(key: str) -> int | None:
        v = md.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    def opt_bool(key: str) -> bool | None:
        v = md.get(key)
        return v if isinstance(v, bool) else None

    problem = None
    if arch is not None and arch not in LLAMA_ARCHS:
        problem = (
            f"architecture {arch!r} is unknown to llama.cpp (a name of the tool that wrote it): "
            "llama.cpp cannot load this file"
        )
    tok_model = md.get("tokenizer.ggml.model")
    return GGUFFacts(
        format=FILE_TYPES.get(ftype, f"file_type {ftype}") if isinstance(ftype, int) else None,
        arch=arch,
        n_vocab=len(tokens) if tokens else None,
        vocab=f"{len(tokens)}:{h.hexdigest()[:10]}" if tokens else None,
        tokenizer=tok_model if isinstance(tok_model, str) else None,
        add_bos=opt_bool("tokenizer.ggml.add_bos_token"),
        add_eos=opt_bool("tokenizer.ggml.add_eos_token"),
        bos=opt_int("tokenizer.ggml.bos_token_id"),
        eos=opt_int("tokenizer.ggml.eos_token_id"),
        tokens=tokens if keep_tokens else (),
        problem=problem,
    )


def check_loadable(m: LocalModel) -> None:
    """Raise the one-line error for a file llama.cpp would refuse (or abort on)."""
    f = facts(m.path)
    if f.problem is not None:
        raise ModelError(f"{m.name} ({m.source}, {m.path}): {f.problem}")
