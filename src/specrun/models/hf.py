"""The ``hf`` source: a GGUF from the Hugging Face hub, kept in huggingface-hub's own cache.

The destination is the hub cache (``hub.hf_cache_dir()``), shared with llama.cpp's ``-hf`` and
huggingface-hub. A present file resolves without any network call; a missing one is downloaded,
continuing what an interrupted pull left (``_resume_blob``). huggingface_hub is imported lazily:
``models list`` need not pay for it.
"""

from __future__ import annotations

import errno
import inspect
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from specrun.errors import PullError, RegistryError
from specrun.models.entries import ModelEntry
from specrun.models.hub import (
    DEFAULT_HF_QUANT,
    cached_choice,
    hf_offline,
    pick_gguf,
    quant_tags,
    repo_folder,
    split_parts,
)
from specrun.models.store import (
    DISK_ERRNOS,
    ProgressFn,
    fsync_dir,
    has_magic,
    noop,
    sha256_file,
    write_error,
)


class HubUnreachable(PullError):
    """The hub could not be reached (offline, no connection, a timeout): an entry's ``fallback``
    source may serve instead. Any other failure (no such file, a checksum mismatch) is not this."""


_UNREACHABLE_KINDS = (
    "ConnectError",
    "ConnectionError",
    "ConnectTimeout",
    "ReadTimeout",
    "TimeoutException",
    "Timeout",
    "ProxyError",
    "NetworkError",
    "OfflineModeIsEnabled",
    "LocalEntryNotFoundError",
    "gaierror",
)
_UNREACHABLE_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ENETUNREACH,
        errno.EHOSTUNREACH,
        errno.ETIMEDOUT,
        errno.ENETDOWN,
    }
)


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the hub could not be reached at all."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if type(cur).__name__ in _UNREACHABLE_KINDS:
            return True
        if isinstance(cur, OSError) and cur.errno in _UNREACHABLE_ERRNOS:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def repo_file(e: ModelEntry, cache: Path) -> str | None:
    """The repo file of an hf entry: named, or picked by quant tag from the cached snapshot."""
    if e.hf_file:
        return e.hf_file
    return cached_choice(cache, e.hf_repo or "", e.revision, e.quant)


def pull(e: ModelEntry, cache: Path, progress: ProgressFn, force: bool = False) -> Path:
    """``e``'s file in the hub cache ``cache`` (every part of a split file), downloaded when
    missing (or when ``force``); its first part's path."""
    repo = e.hf_repo or ""
    file = e.hf_file
    if file is None:
        file = repo_file(e, cache)
        if (file is None or force) and not hf_offline():
            file = _pick_online(cache, repo, e.revision, e.quant)
    if file is None:
        raise HubUnreachable(
            f"no {e.quant or DEFAULT_HF_QUANT} GGUF of {repo} in the Hugging Face cache and "
            "HF_HUB_OFFLINE is set"
        )
    parts = split_parts(file)
    got: list[Path] = []
    for i, part in enumerate(parts, 1):
        cached = None if force else _try_cache(cache, repo, part, e.revision)
        if cached is None:
            if hf_offline():
                raise HubUnreachable(
                    f"{repo}/{part} is not in the Hugging Face cache ({cache}) and "
                    "HF_HUB_OFFLINE is set"
                )
            desc = f"downloading {part}" + (f" ({i}/{len(parts)})" if len(parts) > 1 else "")
            cached = _download(cache, repo, part, e.revision, progress, desc, force)
        got.append(cached)
    first = got[0]
    if not has_magic(first):
        raise PullError(f"{repo}/{file} is not a GGUF file")
    if e.sha256 is not None and len(got) == 1:
        # LFS blobs are named by their sha256: compare names before hashing gigabytes.
        blob = first.resolve().name
        actual = (
            blob
            if re.fullmatch(r"[0-9a-f]{64}", blob)
            else sha256_file(first, progress, f"verifying {e.name}")
        )
        if actual != e.sha256:
            raise PullError(
                f"checksum mismatch for {e.name} ({repo}/{file}): expected sha256 {e.sha256}, "
                f"got {actual}"
            )
    return first


def _download(
    cache: Path,
    repo: str,
    filename: str,
    revision: str | None,
    progress: ProgressFn,
    desc: str,
    force: bool,
) -> Path:
    from huggingface_hub import hf_hub_download

    kwargs: dict[str, Any] = {
        "repo_id": repo,
        "filename": filename,
        "revision": revision,
        "cache_dir": str(cache),
        "endpoint": _endpoint(),
        "force_download": force,
    }
    if progress is not noop and "tqdm_class" in inspect.signature(hf_hub_download).parameters:
        kwargs["tqdm_class"] = _tqdm_bridge(progress, desc)
    else:
        progress(desc, 0, None)
    try:
        if not force:
            _resume_blob(cache, repo, filename, revision, progress, desc)
        return Path(hf_hub_download(**kwargs))
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # huggingface_hub / httpx errors: one line for the user
        raise _error(cache, repo, exc, filename) from None


def _pick_online(cache: Path, repo: str, revision: str | None, quant: str | None) -> str:
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=_endpoint()).model_info(repo, revision=revision)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:
        raise _error(cache, repo, exc) from None
    files = [s.rfilename for s in (info.siblings or [])]
    chosen = pick_gguf(files, quant)
    if chosen is None:
        tags = quant_tags(files)
        have = f" (it has: {', '.join(tags)})" if tags else " (it has no GGUF files)"
        what = f"{quant} GGUF" if quant else "GGUF model file"
        raise PullError(f"no {what} in Hugging Face repo {repo}{have}")
    return chosen


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or None


def _try_cache(cache: Path, repo: str, filename: str, revision: str | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    got = try_to_load_from_cache(repo, filename, cache_dir=str(cache), revision=revision or "main")
    return Path(got) if isinstance(got, str) and os.path.isfile(got) else None


def _error(cache: Path, repo: str, exc: Exception, filename: str | None = None) -> PullError:
    kind = type(exc).__name__
    what = f"{repo}/{filename}" if filename else repo
    if kind == "RepositoryNotFoundError":
        return PullError(f"Hugging Face repo not found (or private/gated without HF_TOKEN): {repo}")
    if kind in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
        return PullError(f"no file {filename} in Hugging Face repo {repo}")
    if kind == "RevisionNotFoundError":
        return PullError(f"revision not found in Hugging Face repo {repo}")
    if kind in ("GatedRepoError",):
        return PullError(f"Hugging Face repo {repo} is gated: accept its terms and set HF_TOKEN")
    if kind in ("LocalEntryNotFoundError", "OfflineModeIsEnabled"):
        return HubUnreachable(
            f"{what} is not in the Hugging Face cache and the hub cannot be reached (offline)"
        )
    if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
        return write_error(cache, exc)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else kind
    if _unreachable(exc):
        return HubUnreachable(f"cannot reach the Hugging Face hub for {what}: {first}")
    return PullError(f"cannot download {what} from the Hugging Face hub: {first}")


def _tqdm_bridge(progress: ProgressFn, desc: str) -> type:
    """A tqdm class that reports to ``progress`` and draws nothing."""
    from tqdm.auto import tqdm

    class _Bridge(tqdm):  # type: ignore[misc, type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self._done = int(kwargs.get("initial") or 0)
            self._tot = kwargs.get("total")
            progress(desc, self._done, self._tot)

        def update(self, n: float | None = 1) -> bool | None:
            self._done += int(n or 0)
            progress(desc, self._done, self._tot)
            return None

    return _Bridge


def _resume_blob(
    cache: Path, repo: str, filename: str, revision: str | None, progress: ProgressFn, desc: str
) -> None:
    """Put the file's blob into huggingface-hub's cache, continuing what an interrupted pull left.

    huggingface_hub 2.x downloads into a process-unique ``.incomplete`` file and starts from byte 0
    every time (it resumes only within one process), so an interrupted multi-GB pull started over.
    Here one ``blobs/<etag>.specrun.incomplete`` per file is continued with an HTTP Range request
    (under a lock), checked (size, and the sha256 where the etag is one, as for LFS files) and
    renamed to ``blobs/<etag>``; ``hf_hub_download`` then finds the blob and only links it into
    the snapshot. A file without etag or size, or a Xet one (hf_xet resumes by itself), is left
    to ``hf_hub_download``.
    """
    from filelock import FileLock, Timeout
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo, filename, revision=revision, endpoint=_endpoint())
    meta = get_hf_file_metadata(url)
    etag, size = meta.etag, meta.size
    if not etag or not size or meta.xet_file_data is not None or not re.fullmatch(r"[\w.-]+", etag):
        return
    folder = repo_folder(cache, repo)
    blob = folder / "blobs" / etag
    if blob.is_file():
        return
    part = blob.with_name(f"{etag}.specrun.incomplete")
    lock_path = cache / ".locks" / folder.name / f"{etag}.specrun.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0.2)
    except Timeout:  # another pull of this file is running
        progress(f"waiting for another pull of {filename}", 0, None)
        lock.acquire()
    try:
        if blob.is_file():
            return
        headers = build_hf_headers()
        location = meta.location or url
        if urlsplit(location).hostname != urlsplit(url).hostname:
            headers.pop("authorization", None)  # a signed CDN URL: the token stays with the hub
        have = part.stat().st_size if part.is_file() else 0
        if have > size:
            have = 0
        with open(part, "r+b" if part.is_file() else "wb") as f:
            f.seek(have)
            f.truncate()
            bridge = _tqdm_bridge(progress, desc) if progress is not noop else None
            if bridge is None:
                progress(desc, have, size)
            http_get(
                location,
                f,
                resume_size=have,
                headers=headers,
                expected_size=size,
                displayed_filename=filename,
                tqdm_class=bridge,
            )
            f.flush()
            os.fsync(f.fileno())
        got = part.stat().st_size
        if got != size:
            raise PullError(f"downloaded {got} bytes of {repo}/{filename}, expected {size}")
        if re.fullmatch(r"[0-9a-f]{64}", etag):
            actual = sha256_file(part, progress, f"verifying {filename}")
            if actual != etag:
                part.unlink()
                raise PullError(
                    f"{repo}/{filename} arrived corrupt (sha256 {actual}, expected {etag}); "
                    "nothing was saved, run the pull again"
                )
        os.replace(part, blob)
        fsync_dir(blob.parent)
    finally:
        lock.release()


def delete_files(cache: Path, repo: str, paths: list[Path]) -> list[Path]:
    """Delete cached hub files with huggingface-hub's own strategy (``scan_cache_dir`` then
    ``delete_files``): the snapshot entries go, and a blob only when no other cached file of any
    revision links to it. Returns what was deleted."""
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir(cache)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # CacheNotFound, an unreadable folder
        raise RegistryError(f"cannot read the Hugging Face cache {cache}: {exc}") from None
    wanted = {p.absolute() for p in paths}
    files = [
        f
        for r in info.repos
        if r.repo_type == "model" and r.repo_id == repo
        for rev in r.revisions
        for f in rev.files
        if f.file_path.absolute() in wanted
    ]
    if not files:
        return []
    strategy = info.delete_files(*files)
    strategy.execute()  # logs what it could not delete and goes on: look for yourself
    left = [p for p in sorted(strategy.files) if p.is_symlink() or p.exists()]
    if left:
        raise RegistryError(f"cannot remove {left[0]} (check the folder's permissions)")
    return sorted(strategy.files) + sorted(b for b in strategy.blobs if not b.exists())
