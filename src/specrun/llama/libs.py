"""Which llama.cpp libraries this process runs on: the ones llama-cpp-python was built with.

llama_cpp loads ``libllama.so`` by its absolute path, but the libraries that one needs
(``libggml.so.0``, ``libggml-base.so.0``, a backend's ``libggml-cuda.so.0`` ...) the dynamic
loader looks up by name, and ``LD_LIBRARY_PATH`` comes before the ``$ORIGIN`` RUNPATH that points
at llama_cpp's own ``lib/``: with another llama.cpp build on it (common among llama.cpp users),
specrun ran that build's ggml, without specrun's patches (rows not bit-exact) and at its speed.
``preload`` loads llama_cpp's own ``libggml*`` first, by absolute path and in dependency order,
so the loader finds them already loaded (by soname) when ``libllama`` asks; ``foreign`` reads
``/proc/self/maps`` afterwards and names any llama.cpp library mapped from elsewhere, which
``backend.init_backend`` refuses. Linux only (elsewhere both do nothing).

The directory that counts as llama_cpp's own is ``LLAMA_CPP_LIB_PATH`` where that is set
(llama_cpp's own switch to another build's libllama), else the ``lib/`` beside the llama_cpp
package Python would import.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys
from pathlib import Path

_LLAMA_LIB = re.compile(r"^lib(ggml|llama|mtmd)[\w.-]*\.so(\.\d+)*$")
_SONAME_FILE = re.compile(r"^(libggml[\w-]*)\.so\.\d+$")  # libggml-base.so.0: its soname
_preloaded: list[ctypes.CDLL] = []  # kept: never unloaded


def lib_dir() -> Path | None:
    """The directory llama_cpp loads ``libllama`` from (without importing llama_cpp)."""
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        return Path(override)
    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def _ggml_files(d: Path) -> list[Path]:
    """``d``'s libggml libraries, one file each (the one named as its soname where there is
    one: ``libggml-base.so.0``, else ``libggml-base.so``), in the order they depend on each
    other: ggml-base, the backends (cpu, rpc, cuda, metal, ...), then ggml, which needs them."""
    by_stem: dict[str, Path] = {}
    try:
        entries = sorted(d.iterdir())
    except OSError:
        return []
    for f in entries:
        m = _SONAME_FILE.match(f.name)
        if m:
            by_stem[m.group(1)] = f
    for f in entries:
        if f.name.startswith("libggml") and f.name.endswith(".so"):
            by_stem.setdefault(f.name[: -len(".so")], f)

    def rank(stem: str) -> tuple[int, str]:
        return (0 if stem == "libggml-base" else 2 if stem == "libggml" else 1, stem)

    return [by_stem[s] for s in sorted(by_stem, key=rank)]


def preload() -> list[Path]:
    """Load llama_cpp's own libggml libraries by absolute path (RTLD_GLOBAL), before llama_cpp
    loads libllama, so that ``LD_LIBRARY_PATH`` cannot put another build's in their place. A
    no-op once llama_cpp is imported (too late: ``foreign`` then tells) and off Linux. Returns
    the files loaded."""
    if not sys.platform.startswith("linux") or "llama_cpp" in sys.modules or _preloaded:
        return []
    d = lib_dir()
    if d is None:
        return []
    done = []
    for f in _ggml_files(d):
        try:
            _preloaded.append(ctypes.CDLL(str(f), mode=ctypes.RTLD_GLOBAL))
        except OSError:  # llama_cpp's own load says what is wrong with it
            break
        done.append(f)
    return done


def mapped() -> list[Path]:
    """The llama.cpp libraries (libggml*, libllama*, libmtmd*) this process has mapped, from
    /proc/self/maps; [] where that cannot be read."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    out: dict[str, None] = {}
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            path = parts[5].removesuffix(" (deleted)")
            if _LLAMA_LIB.match(os.path.basename(path)):
                out[path] = None
    return [Path(p) for p in out]


def foreign() -> list[Path]:
    """The llama.cpp libraries mapped from outside llama_cpp's own directory (``lib_dir``)."""
    d = lib_dir()
    if d is None:
        return []
    own = os.path.realpath(d)
    return [p for p in mapped() if os.path.dirname(os.path.realpath(p)) != own]
