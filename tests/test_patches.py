"""patches/: the series (order and notes), the one pin (patches/PIN) that every build file reads,
and the build stamp that the Makefile derives from them."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "patches"
PIN = (PATCHES / "PIN").read_text().strip()
NOTES = ("purpose", "needs", "tests", "upstream", "cpu")


def series() -> list[tuple[str, dict[str, str]]]:
    """patches/series: (patch, its notes) in order; a note's continuation lines joined."""
    out: list[tuple[str, dict[str, str]]] = []
    key = None
    for line in (PATCHES / "series").read_text().splitlines():
        if not line.strip():
            key = None
            continue
        if not line.lstrip().startswith("#"):
            out.append((line.strip(), {}))
            key = None
            continue
        if not out:
            continue  # the header
        m = re.match(r"#\s{3}(\w+):\s*(.*)", line)
        if m:
            key = m.group(1)
            out[-1][1][key] = m.group(2)
        elif key is not None:
            out[-1][1][key] += " " + line.lstrip("#").strip()
    return out


def test_the_pin_is_a_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", PIN), PIN


def test_the_series_names_every_patch_once_with_its_notes():
    names = [name for name, _ in series()]
    assert sorted(names) == sorted(p.name for p in PATCHES.glob("*.patch"))
    assert len(set(names)) == len(names)
    for name, notes in series():
        assert set(notes) == set(NOTES), (name, sorted(notes))
        assert all(notes[k] for k in NOTES), name


def test_the_tests_and_patches_the_notes_name_exist():
    stems = {
        name.removeprefix(f"llama-cpp-python-{PIN}-").removesuffix(".patch") for name, _ in series()
    }
    seen: set[str] = set()
    for name, notes in series():
        for t in re.findall(r"tests/\w+\.py", notes["tests"]):
            assert (ROOT / t).is_file(), (name, t)
        for need in re.findall(r"[a-z0-9_]+(?:-[a-z0-9_]+)+", notes["needs"]):
            assert need in stems, (name, need)
            assert need in seen or "every patch above" in notes["needs"], (name, need)
        seen.add(name.removeprefix(f"llama-cpp-python-{PIN}-").removesuffix(".patch"))


def test_the_scripts_read_the_series_in_order():
    out = subprocess.run(
        ["sh", "-c", f'ROOT="{ROOT}"; . "{ROOT}/scripts/patches.sh"; echo "$PIN"; echo "$SERIES"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [PIN, *[name for name, _ in series()]]
    for script in ("build-llama.sh", "patches-check.sh", "patches.sh"):
        subprocess.run(["sh", "-n", str(ROOT / "scripts" / script)], check=True)


def test_the_pin_is_written_only_in_patches_pin():
    """Build files read the pin; they do not repeat it (a patch file's name may carry it)."""
    for f in [ROOT / "Makefile", ROOT / "pyproject.toml", *sorted((ROOT / "scripts").iterdir())]:
        text = re.sub(rf"llama-cpp-python-{re.escape(PIN)}-[\w.-]+\.patch", "", f.read_text())
        assert PIN not in text, f


def test_pyproject_takes_a_range_that_holds_the_pin():
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if d.startswith("llama-cpp-python")]
    assert PIN in req.specifier, req
    assert not any(s.operator == "==" for s in req.specifier), "a pin would replace a GPU build"


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("cksum") is None, reason="no make")
@pytest.mark.parametrize("gpu", ["", "cuda"])
def test_the_build_stamp_is_the_pin_flags_and_the_series_checksum(gpu):
    """The stamp that decides a rebuild: the pin, the CMake flags and the checksum of the patches
    concatenated in the series' order (the same as before patches/series: no build redone)."""
    stamp = subprocess.run(
        [
            "make",
            "-s",
            "-C",
            str(ROOT),
            f"GPU={gpu}",
            "--eval",
            'stamp: ; @echo "$(LLAMA_BUILD)"',
            "stamp",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    blob = b"".join((PATCHES / name).read_bytes() for name, _ in series())
    cksum = subprocess.run(["cksum"], input=blob, capture_output=True, check=True).stdout.split()[0]
    flags = "-DGGML_LLAMAFILE=ON -DGGML_RPC=ON" + (" -DGGML_CUDA=on" if gpu else "")
    assert stamp == f"llama-cpp-python=={PIN} CMAKE_ARGS={flags} patches={cksum.decode()}"


def test_a_patched_build_is_the_pinned_release():
    from specrun.llama import backend

    if "SPECRUN_" not in backend.system_info():
        pytest.skip("this llama.cpp build lacks patches/")
    assert backend.llama_cpp_version() == PIN
