"""The ``derive`` source: a model re-quantized locally from another registry entry.

llama.cpp's quantizer runs in a child process (``quantize_file``), writing a part file that is
checked and renamed into place under the destination's lock, as every fetcher writes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from specrun.errors import ModelError, PullError
from specrun.models.entries import ModelEntry
from specrun.models.store import (
    ProgressFn,
    clean_stale,
    fsync_dir,
    has_magic,
    locked,
    part_path,
    sha256_file,
    write_error,
)


def pull(
    e: ModelEntry,
    dest: Path,
    progress: ProgressFn,
    source: Callable[[], Path],
    force: bool = False,
) -> Path:
    """Quantize ``e``'s source model into ``dest``. ``source`` gives the source's file (pulling it
    when missing); it is asked only once the lock is held and ``dest`` is not there yet."""
    with locked(dest, progress):
        if dest.is_file() and not force:
            return dest
        src = source()
        clean_stale(dest)
        part = part_path(dest)
        try:
            progress(f"quantizing {e.derive_from} to {e.quant}", 0, None)
            quantize_file(src, part, e.quant or "")
            if not part.is_file():
                raise PullError(f"quantizing {e.derive_from} to {e.quant} wrote no file")
            try:
                with open(part, "rb+") as f:
                    os.fsync(f.fileno())
            except OSError as exc:
                raise write_error(dest.parent, exc) from None
            if not has_magic(part):
                raise PullError(
                    f"quantizing {e.derive_from} to {e.quant} did not produce a GGUF file"
                )
            if e.sha256 is not None:
                got = sha256_file(part, progress, f"verifying {e.name}")
                if got != e.sha256:
                    raise PullError(
                        f"checksum mismatch for {e.name}: expected sha256 {e.sha256}, got {got}; "
                        "nothing was saved"
                    )
            try:
                os.replace(part, dest)
            except OSError as exc:
                raise write_error(dest.parent, exc) from None
            fsync_dir(dest.parent)
            return dest
        finally:
            with contextlib.suppress(OSError):
                part.unlink()


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
        raise write_error(part.parent, exc) from None
    pkg_root = str(Path(__file__).resolve().parents[2])  # the folder holding specrun/
    cmd = [
        sys.executable,
        "-c",
        _QUANTIZE_CHILD,
        pkg_root,
        str(src),
        str(part),
        quant,
        str(threads or 0),
        str(os.getpid()),
    ]
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
        raise write_error(part.parent, disk)
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
