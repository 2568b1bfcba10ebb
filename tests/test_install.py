"""Installs that take nothing away: what specrun needs of a llama-cpp-python it did not build
(the C API, checked at run time), the one line a build without patches/ gets, and the llama.cpp
libraries a process runs on (its own, whatever LD_LIBRARY_PATH says)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specrun.errors import SpecrunError
from specrun.llama import backend, libs

ROOT = Path(__file__).resolve().parent.parent


def test_required_api_names_everything_specrun_calls():
    used: set[str] = set()
    for f in (ROOT / "src" / "specrun" / "llama").glob("*.py"):
        used |= set(re.findall(r"\bll\.(llama_\w+)", f.read_text()))
    used.discard("llama_cpp")
    assert used <= set(backend.REQUIRED_API), sorted(used - set(backend.REQUIRED_API))


def test_this_build_has_the_api():
    assert backend.missing_api() == []


def test_a_build_without_the_api_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(backend, "REQUIRED_API", (*backend.REQUIRED_API, "llama_no_such_function"))
    monkeypatch.setattr(
        backend, "REQUIRED_FIELDS", {"llama_context_params": ("n_ctx", "no_such_field")}
    )
    with pytest.raises(SpecrunError) as exc:
        backend.check_build()
    msg = str(exc.value)
    assert "\n" not in msg
    assert "llama_no_such_function" in msg and "llama_context_params.no_such_field" in msg
    assert "specrun needs llama-cpp-python" in msg


def test_the_requirement_is_pyprojects():
    from importlib import metadata

    req = backend.llama_cpp_requirement()
    assert req.startswith("llama-cpp-python")
    assert any(r.replace(" ", "").startswith(req) for r in metadata.requires("specrun") or [])


def _sysinfo(monkeypatch, text: str) -> None:
    monkeypatch.setattr(backend, "system_info", lambda: text)
    monkeypatch.setattr(backend, "_noted", False)


def test_an_unpatched_build_says_what_it_loses_once(monkeypatch):
    _sysinfo(monkeypatch, "CPU : AVX2 = 1 | LLAMAFILE = 1 | OPENMP = 1")
    note = backend.unpatched_note()
    assert note is not None and "\n" not in note
    assert "not bit-exact" in note and "greedy output may part from the target's" in note
    assert backend.unpatched_note() is None  # once a process
    assert backend.unpatched_note(once=False) == note


def test_an_unpatched_build_without_sgemm_loses_speed_only(monkeypatch):
    _sysinfo(monkeypatch, "CPU : AVX2 = 1 | OPENMP = 1")
    note = backend.unpatched_note()
    assert note is not None and "rows stay exact" in note


def test_a_patched_build_says_nothing(monkeypatch):
    _sysinfo(
        monkeypatch, "CPU : AVX2 = 1 | LLAMAFILE = 1 | SPECRUN_SGEMM_ROWS = 66 | SPECRUN_COLS = 4"
    )
    assert backend.unpatched_note() is None


def test_this_process_runs_on_its_own_libraries():
    backend.init_backend()
    mapped = libs.mapped()
    if sys.platform.startswith("linux"):
        assert any(p.name.startswith("libllama") for p in mapped)
    assert libs.foreign() == []


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_LIBRARY_PATH, /proc")


def _other_build(tmp_path: Path) -> Path:
    """A second copy of llama_cpp's libraries, as another llama.cpp build on LD_LIBRARY_PATH."""
    own = libs.lib_dir()
    assert own is not None
    other = tmp_path / "other-llama.cpp"
    other.mkdir()
    for f in own.iterdir():
        if f.name.startswith("lib") and ".so" in f.name:
            shutil.copy2(f, other / f.name)
    return other


def _run(code: str, other: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, LD_LIBRARY_PATH=str(other))
    env.pop("LLAMA_CPP_LIB_PATH", None)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


@linux
def test_ld_library_path_does_not_swap_the_libraries(tmp_path):
    """With another build's libggml first on LD_LIBRARY_PATH, specrun still maps its own: they
    are loaded by absolute path before llama_cpp loads libllama."""
    other = _other_build(tmp_path)
    res = _run(
        "from specrun.llama import backend, libs\n"
        "backend.init_backend()\n"
        "print(backend.system_info() != '')\n"
        "print('\\n'.join(str(p) for p in libs.mapped()))\n",
        other,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.split()
    assert lines[0] == "True"
    mapped = [Path(p) for p in lines[1:]]
    assert any(p.name.startswith("libggml-base") for p in mapped), mapped
    assert not [p for p in mapped if p.parent == other], mapped


@linux
def test_libraries_loaded_from_elsewhere_are_refused_in_one_line(tmp_path):
    """llama_cpp imported before specrun could load its own: the foreign library is named."""
    other = _other_build(tmp_path)
    res = _run(
        "import llama_cpp\n"
        "from specrun.errors import SpecrunError\n"
        "from specrun.llama import backend\n"
        "try:\n"
        "    backend.init_backend()\n"
        "except SpecrunError as exc:\n"
        "    print(exc)\n",
        other,
    )
    assert res.returncode == 0, res.stderr
    msg = res.stdout.strip()
    assert "\n" not in msg and str(other) in msg and "LD_LIBRARY_PATH" in msg, msg
