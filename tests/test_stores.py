"""Other tools' stores, read as those tools lay them out, from the registry's real GGUF files:
Ollama's (manifests + sha256 blobs), LM Studio's folder and the Hugging Face cache, in a
temporary HOME; the CLI run against them as a user runs it (`.venv/bin/specrun`, a subprocess).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from specrun import paths

REAL = paths.models_dir()  # where `make install` left the registry's files (read before any env)
F16 = REAL / "smollm2-135m-instruct-f16.gguf"
Q4_0 = REAL / "smollm2-135m-instruct-q4_0.gguf"
Q4_1 = REAL / "smollm2-135m-instruct-q4_1.gguf"
F32 = REAL / "smollm2-135m-instruct-f32.gguf"
SPECRUN = Path(sys.executable).parent / "specrun"

pytestmark = pytest.mark.skipif(
    not all(p.is_file() for p in (F16, Q4_0, Q4_1, F32)),
    reason="the smollm2 files (make install) are not there",
)

_DIGESTS: dict[Path, str] = {}


def digest(p: Path) -> str:
    if p not in _DIGESTS:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        _DIGESTS[p] = h.hexdigest()
    return _DIGESTS[p]


def link(src: Path, dst: Path) -> None:
    """A hard link where the filesystem allows it (as a copy costs nothing), else a symlink."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        dst.symlink_to(src)


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def tiny_gguf(arch: str) -> bytes:
    """A header-only GGUF (no tensors) naming ``arch``."""
    kv = _gguf_string("general.architecture") + struct.pack("<I", 8) + _gguf_string(arch)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv


def ollama_add(
    root: Path, name: str, blob_src: Path | bytes, template: str = "{{ .Prompt }}"
) -> str:
    """Put a model into an Ollama store as `ollama pull` leaves it: the GGUF as blob
    sha256-<hex>, a config blob, a template blob, and manifests/HOST/NAMESPACE/MODEL/TAG."""
    from specrun.models.stores import parse_ollama_name

    parsed = parse_ollama_name(name)
    assert parsed is not None
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    if isinstance(blob_src, bytes):
        hexd = hashlib.sha256(blob_src).hexdigest()
        (blobs / f"sha256-{hexd}").write_bytes(blob_src)
        size = len(blob_src)
    else:
        hexd = digest(blob_src)
        if not (blobs / f"sha256-{hexd}").exists():
            link(blob_src, blobs / f"sha256-{hexd}")
        size = blob_src.stat().st_size

    def small_blob(data: bytes) -> dict[str, object]:
        d = hashlib.sha256(data).hexdigest()
        (blobs / f"sha256-{d}").write_bytes(data)
        return {"digest": f"sha256:{d}", "size": len(data)}

    config = small_blob(
        json.dumps({"model_format": "gguf", "model_family": "llama", "file_type": "F16"}).encode()
    )
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **config},
        "layers": [
            {
                "mediaType": "application/vnd.ollama.image.model",
                "digest": f"sha256:{hexd}",
                "size": size,
            },
            {"mediaType": "application/vnd.ollama.image.template", **small_blob(template.encode())},
            {"mediaType": "application/vnd.ollama.image.params", **small_blob(b'{"stop":[]}')},
        ],
    }
    mpath = root / "manifests" / Path(*parsed)
    mpath.parent.mkdir(parents=True, exist_ok=True)
    mpath.write_text(json.dumps(manifest))
    return hexd


def hub_add(
    cache: Path, repo: str, file: str, src: Path, commit: str = "c0ffee" * 6 + "abcd"
) -> Path:
    """Put a file into a hub cache as huggingface_hub leaves it: blobs/<sha256>, a snapshot
    symlink ../../blobs/<sha256>, refs/main."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    blob = folder / "blobs" / digest(src)
    if not blob.exists():
        link(src, blob)
    snap = folder / "snapshots" / commit / file
    snap.parent.mkdir(parents=True, exist_ok=True)
    snap.symlink_to(os.path.relpath(blob, snap.parent))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A temporary HOME with an Ollama store, an LM Studio folder and a hub cache."""
    home = tmp_path / "home"
    home.mkdir()
    for var in (
        "OLLAMA_MODELS",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "LLAMA_CACHE",
        "HF_HOME",
        "XDG_CACHE_HOME",
        "SPECRUN_MODELS",
        "XDG_CONFIG_HOME",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "specrun"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ollama = home / ".ollama" / "models"
    ollama_add(ollama, "smollm2:135m", F16)
    ollama_add(ollama, "library/smollm2:135m-instruct-q4_0", Q4_0)
    ollama_add(ollama, "mllama-ish:1b", tiny_gguf("ollama-own-arch"))
    lms = home / ".lmstudio" / "models" / "bartowski" / "SmolLM2-135M-Instruct-GGUF"
    link(Q4_1, lms / "SmolLM2-135M-Instruct-Q4_1.gguf")
    cache = home / ".cache" / "huggingface" / "hub"
    snap = hub_add(cache, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "smollm2-f32.gguf", F32)
    return {"home": home, "ollama": ollama, "lms": lms, "snap": snap}


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [str(SPECRUN), *args], capture_output=True, text=True, env=os.environ.copy(), timeout=600
    )
    if check:
        assert r.returncode == 0, r.stderr
    return r


def test_names_resolve_through_each_store(world: dict[str, Path]) -> None:
    from specrun.errors import ModelError, RegistryError
    from specrun.models.registry import Registry

    reg = Registry.load()
    blob = reg.resolve("smollm2:135m").path
    assert blob.parent == world["ollama"] / "blobs" and blob.name == f"sha256-{digest(F16)}"
    for spec in (
        "library/smollm2:135m",
        "ollama:smollm2:135m",
        "registry.ollama.ai/library/smollm2:135m",
    ):
        assert reg.resolve(spec).path == blob
    q4 = reg.resolve("smollm2:135m-instruct-q4_0").path
    assert q4.name == f"sha256-{digest(Q4_0)}"
    lms = reg.resolve("bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf")
    assert lms.path == world["lms"] / "SmolLM2-135M-Instruct-Q4_1.gguf"
    hub = reg.resolve("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/smollm2-f32.gguf").path
    assert hub == world["snap"]
    with pytest.raises(ModelError, match="no Ollama model nothing:here"):
        reg.resolve("ollama:nothing:here")
    with pytest.raises(ModelError, match="architecture 'ollama-own-arch' is unknown to llama.cpp"):
        reg.resolve("mllama-ish:1b")

    # one name in two places: an error naming both (an LM Studio folder beside the hub cache)
    twin = world["home"] / ".lmstudio" / "models" / "HuggingFaceTB" / "SmolLM2-135M-Instruct-GGUF"
    link(Q4_0, twin / "smollm2-f32.gguf")
    with pytest.raises(RegistryError, match=r"names 2 models: lmstudio: .*; hf-cache: "):
        reg.resolve("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/smollm2-f32.gguf")
    # the same file under both (one blob) is one model
    (twin / "smollm2-f32.gguf").unlink()
    link(F32, twin / "smollm2-f32.gguf")
    assert reg.resolve("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/smollm2-f32.gguf").path


def test_cli_list_all(world: dict[str, Path]) -> None:
    rows = json.loads(run("models", "list", "--all", "--json").stdout)
    local = {(r["source"], r["name"]): r for r in rows if r["kind"] == "local"}
    f16 = local[("ollama", "smollm2:135m")]
    assert f16["format"] == "F16" and f16["arch"] == "llama" and f16["size"] == F16.stat().st_size
    q4 = local[("ollama", "smollm2:135m-instruct-q4_0")]
    assert q4["format"] == "Q4_0" and q4["vocab"] == f16["vocab"] and q4["n_vocab"] == 49152
    assert (
        local[("lmstudio", "bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf")][
            "format"
        ]
        == "Q4_1"
    )
    assert (
        local[("hf-cache", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/smollm2-f32.gguf")]["format"]
        == "F32"
    )
    assert "unknown to llama.cpp" in local[("ollama", "mllama-ish:1b")]["problem"]

    out = run("models", "list", "--all").stdout
    assert "on disk" in out and "smollm2:135m" in out and "lmstudio" in out
    bad = [ln for ln in out.splitlines() if "mllama-ish:1b:" in ln]
    assert len(bad) == 1 and "llama.cpp cannot load this file" in bad[0]
    # the other stores are only read
    assert not any(world["ollama"].rglob("*.lock")) and not any(world["ollama"].rglob("*.part*"))


def test_cli_drafts_ranks_and_remembers(world: dict[str, Path]) -> None:
    r = run("models", "drafts", "smollm2:135m", "--json")
    out = json.loads(r.stdout)
    ranked = {d["name"]: d for d in out["ranked"]}
    assert set(ranked) == {
        "smollm2:135m-instruct-q4_0",
        "bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf",
    }
    for d in ranked.values():
        assert d["problem"] is None and d["probe"]["identical"] and d["probe"]["acceptance"] > 0.3
    speeds = [d["speedup"] for d in out["ranked"]]
    assert speeds == sorted(speeds, reverse=True)
    left = {d["name"]: d["reason"] for d in out["left_out"]}
    assert "not much cheaper" in left["HuggingFaceTB/SmolLM2-135M-Instruct-GGUF/smollm2-f32.gguf"]
    assert "unknown to llama.cpp" in left["mllama-ish:1b"]

    text = run("models", "drafts", "smollm2:135m", "--no-probe").stdout
    assert "left out mllama-ish:1b (ollama)" in text


def test_best_draft_for_is_remembered(world: dict[str, Path]) -> None:
    from specrun.models import drafts
    from specrun.models.registry import Registry
    from specrun.probe import best_draft_for

    reg = Registry.load()
    target = reg.resolve("smollm2:135m").path
    assert drafts.remembered(target) == (False, None)
    got = best_draft_for(target, reg)
    mem = json.loads(drafts.memory_file().read_text())
    entry = mem[str(target.resolve())]
    if got is None:  # this machine: no draft pays (batches dear); remembered as such
        assert entry["draft"] is None and drafts.remembered(target) == (True, None)
    else:
        path, _k = got
        assert entry["draft"] == str(path.resolve()) and drafts.remembered(target) == (True, path)
    said: list[str] = []
    assert best_draft_for(target, reg, say=said.append) == got
    assert said == []  # remembered: nothing probed
