"""A draft found on disk for a target named alone (`-m TARGET`, no draft): generate takes the best
one (probed once, remembered per target file), says which on stderr in one line, and says exactly
what the target alone says; `-md none`, `--no-draft` and SPECRUN_NO_DRAFT decline it and probe
nothing. End to end on the registry's real SmolLM2 files, laid out in a temporary HOME as the
Hugging Face cache (the target) and LM Studio (the draft) keep them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from specrun import paths

REAL = paths.models_dir()  # where `make install` left the registry's files (read before any env)
F16 = REAL / "smollm2-135m-instruct-f16.gguf"
Q4_0 = REAL / "smollm2-135m-instruct-q4_0.gguf"
CALIBRATION = paths.specrun_home() / "calibration.json"
SPECRUN = Path(sys.executable).parent / "specrun"
PROMPT = "List five facts about the Moon."
DRAFT_NAME = "bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_0.gguf"

pytestmark = [
    pytest.mark.models,
    pytest.mark.skipif(
        not (F16.is_file() and Q4_0.is_file()),
        reason="the smollm2 files (make install) are not there",
    ),
]


def _layout(root: Path) -> dict[str, Path]:
    """A HOME with the F16 in the hub cache (blobs/, a snapshot symlink, refs/main) and its Q4_0
    in LM Studio's folder. The blobs link to the real files, so the pass costs measured for them
    (``calibration.json``, keyed by the resolved path) are found, copied, not measured again."""
    home = root / "home"
    repo = home / ".cache" / "huggingface" / "hub" / "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    commit = "c0ffee" * 6 + "abcd"
    blob = repo / "blobs" / "f16blob"
    blob.parent.mkdir(parents=True)
    blob.symlink_to(F16)
    target = repo / "snapshots" / commit / "smollm2-135m-instruct-f16.gguf"
    target.parent.mkdir(parents=True)
    target.symlink_to(os.path.relpath(blob, target.parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    draft = home / ".lmstudio" / "models" / DRAFT_NAME
    draft.parent.mkdir(parents=True)
    draft.symlink_to(Q4_0)
    spec_home = root / "specrun"
    spec_home.mkdir()
    if CALIBRATION.is_file():
        shutil.copyfile(CALIBRATION, spec_home / "calibration.json")
    return {"home": home, "specrun": spec_home, "target": target, "draft": draft}


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _layout(tmp_path_factory.mktemp("found-draft"))


@pytest.fixture
def world(layout: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """The layout's HOME and SPECRUN_HOME, with nothing remembered (no drafts.json)."""
    for var in (
        "OLLAMA_MODELS",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "LLAMA_CACHE",
        "HF_HOME",
        "XDG_CACHE_HOME",
        "SPECRUN_MODELS",
        "XDG_CONFIG_HOME",
        "SPECRUN_NO_DRAFT",
        "SPECRUN_MODEL_DRAFT",
        "SPECRUN_MODE",
        "SPECRUN_PAIR",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(layout["home"]))
    monkeypatch.setenv("SPECRUN_HOME", str(layout["specrun"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (layout["specrun"] / "drafts.json").unlink(missing_ok=True)
    return layout


def generate(target: Path, *args: str, env: dict[str, str] | None = None) -> tuple[Any, str]:
    r = subprocess.run(
        [str(SPECRUN), "generate", "-m", str(target), "--prompt", PROMPT, "-n", "24"]
        + ["--temp", "0", "--json", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def found_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "found on disk" in ln]


def test_the_draft_found_on_disk_drafts_and_the_text_is_the_targets(
    world: dict[str, Path],
) -> None:
    from specrun.models import drafts

    target, draft = world["target"], world["draft"]
    alone, _ = generate(target, "--mode", "none")
    assert alone["draft"] is None and len(alone["tokens"]) == 24

    # The first run probes the model on disk and remembers what it found for this target file.
    out, err = generate(target)
    entry = json.loads(drafts.memory_file().read_text())[str(target.resolve())]
    assert out["tokens"] == alone["tokens"]
    if entry["draft"] is None:  # this machine: the probe measured no speed-up (batches dear)
        assert out["draft"] is None and found_lines(err) == []
    else:
        assert Path(entry["draft"]) == draft.resolve() and entry["figures"]["name"] == DRAFT_NAME
        assert Path(out["draft"]["path"]).resolve() == draft.resolve()
        assert len(found_lines(err)) == 1 and DRAFT_NAME in found_lines(err)[0]

    # The choice as a machine where the Q4_0 pays leaves it: every later run takes it unprobed.
    drafts.remember(target, draft, {"name": DRAFT_NAME, "speedup": 1.3, "draft_max": 3})
    kept = drafts.memory_file().read_text()
    for mode in ("auto", "draft"):
        out, err = generate(target, "--mode", mode)
        assert Path(out["draft"]["path"]).resolve() == draft.resolve(), err
        lines = found_lines(err)
        assert len(lines) == 1 and DRAFT_NAME in lines[0] and "1.30x at K=3" in lines[0], err
        assert out["tokens"] == alone["tokens"]
        if mode == "draft":
            assert out["stats"]["drafted"] > 0 and out["stats"]["accepted"] > 0
    assert drafts.memory_file().read_text() == kept  # answered from memory: nothing probed

    # Declined (here from the environment): no draft and no line, whatever is remembered.
    out, err = generate(target, env={"SPECRUN_NO_DRAFT": "1"})
    assert out["draft"] is None and found_lines(err) == [] and out["tokens"] == alone["tokens"]


def test_declining_probes_nothing(world: dict[str, Path]) -> None:
    from specrun.models import drafts

    for args in (["--no-draft"], ["-md", "none"]):
        out, err = generate(world["target"], *args)
        assert out["draft"] is None and found_lines(err) == [], args
    assert not drafts.memory_file().exists()  # no search was made, so nothing was remembered
