"""Model files on disk: the store folder, atomic writes, locks, and the errors a disk gives.

Every write goes to ``NAME.gguf.part-<pid>`` beside the destination, is fsynced and then renamed
into place, under a lock on ``NAME.gguf.lock``: an interrupted pull never leaves a file at the
final path, and two concurrent pulls of one model neither corrupt nor duplicate it. The fetchers
(``pip``, ``derive``, ``hf``) all write through here.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from specrun import paths
from specrun.errors import PullError

ProgressFn = Callable[[str, int, "int | None"], None]  # (description, bytes_done, bytes_total)

GGUF_MAGIC = b"GGUF"
CHUNK = 1 << 20


def noop(_desc: str, _done: int, _total: int | None) -> None:
    """A ProgressFn that reports nowhere."""


def store_path(name: str) -> Path:
    """Where a pulled or derived model ``name`` lives: ``$SPECRUN_HOME/models/NAME.gguf``."""
    return paths.models_dir() / f"{name}.gguf"


# Errors that say the disk, not the data, is the problem: reported as "cannot write to DIR".
DISK_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.ENOTDIR}
)


def write_error(where: Path, exc: OSError) -> PullError:
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        reason = "No space left on device"
    return PullError(f"cannot write to {where}: {reason}")


def fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def has_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def sha256_file(path: Path, progress: ProgressFn = noop, desc: str = "") -> str:
    h = hashlib.sha256()
    total = path.stat().st_size
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            done += len(chunk)
            progress(desc, done, total)
    return h.hexdigest()


def part_path(dest: Path) -> Path:
    return dest.with_name(f"{dest.name}.part-{os.getpid()}")


def clean_stale(dest: Path) -> None:
    """Remove leftovers of interrupted pulls. Called with the lock held, so none is live."""
    for p in dest.parent.glob(f"{glob_escape(dest.name)}.part-*"):
        with contextlib.suppress(OSError):
            p.unlink()
    for p in dest.parent.glob(f".{glob_escape(dest.name)}.pip-*"):
        shutil.rmtree(p, ignore_errors=True)


def glob_escape(s: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", s)


@contextlib.contextmanager
def locked(dest: Path, progress: ProgressFn) -> Iterator[None]:
    """Hold ``DEST.lock``; a second puller of the same model waits here, then finds it present."""
    from filelock import FileLock, Timeout  # deferred: keeps --help light

    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(dest.parent, exc) from None
    lock = FileLock(str(dest) + ".lock")
    try:
        try:
            lock.acquire(timeout=0.2)
        except Timeout:
            progress(f"waiting for another pull of {dest.stem}", 0, None)
            lock.acquire()
    except OSError as exc:
        raise write_error(dest.parent, exc) from None
    try:
        yield
    finally:
        lock.release()


class AtomicWriter:
    """Write to ``DEST.part-<pid>``, hashing as it goes; ``commit`` fsyncs, checks and renames."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.part = part_path(dest)
        self.sha = hashlib.sha256()
        self.head = b""
        self.size = 0
        try:
            self.f: IO[bytes] = open(self.part, "wb")  # noqa: SIM115 - closed in commit/abort
        except OSError as exc:
            raise write_error(dest.parent, exc) from None

    def write(self, chunk: bytes) -> None:
        if len(self.head) < 4:
            self.head = (self.head + chunk[:4])[:4]
        self.sha.update(chunk)
        try:
            self.f.write(chunk)
        except OSError as exc:
            raise write_error(self.dest.parent, exc) from None
        self.size += len(chunk)

    def commit(self, what: str, sha256: str | None) -> Path:
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
        except OSError as exc:
            raise write_error(self.dest.parent, exc) from None
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
            raise write_error(self.dest.parent, exc) from None
        fsync_dir(self.dest.parent)
        return self.dest

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.f.close()
        with contextlib.suppress(OSError):
            self.part.unlink()
