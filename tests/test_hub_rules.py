"""Issue 21: which hub file a reference means (llama.cpp's rule), Ollama's hf.co/ form, and where
files live (LLAMA_CACHE, XDG_CACHE_HOME). No models, no network."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrun import paths
from specrun.models.hub import hf_cache_dir, parse_hub_spec, pick_gguf


def test_bare_repo_prefers_q4_k_m_then_q8_0_then_the_first_model_file() -> None:
    files = ["a-F16.gguf", "a-Q8_0.gguf", "a-Q4_K_M.gguf", "README.md"]
    assert pick_gguf(files, None) == "a-Q4_K_M.gguf"
    assert pick_gguf(files[:2], None) == "a-Q8_0.gguf"
    assert pick_gguf(files[:1], None) == "a-F16.gguf"
    assert pick_gguf(files[:1], None, fallback=False) is None
    assert pick_gguf(["README.md"], None) is None


def test_tag_must_be_followed_by_a_dot_or_a_dash() -> None:
    files = ["m-Q4_K_M.gguf", "m-Q4_K_M_L.gguf", "m-Q4_K.gguf", "Q6_K/m-Q6_K-00001-of-00002.gguf"]
    assert pick_gguf(files, "Q4_K") == "m-Q4_K.gguf"  # not m-Q4_K_M.gguf
    assert pick_gguf(files, "q4_k_m") == "m-Q4_K_M.gguf"
    assert pick_gguf(files, "Q6_K") == "Q6_K/m-Q6_K-00001-of-00002.gguf"  # in a folder
    assert pick_gguf(["m-Q8_0-00002-of-00002.gguf", "m-Q8_0-00001-of-00002.gguf"], "Q8_0") == (
        "m-Q8_0-00001-of-00002.gguf"
    )  # a split file by its first part


@pytest.mark.parametrize(
    "other",
    [
        "mmproj-m-Q4_K_M.gguf",
        "m-Q4_K_M-imatrix.gguf",
        "mtp-m-Q4_K_M.gguf",
        "eagle3-m-Q4_K_M.gguf",
        "dflash-m-Q4_K_M.gguf",
        "dspark-m-Q4_K_M.gguf",
        "sub/mtp-m-Q4_K_M.gguf",
    ],
)
def test_files_that_are_not_the_model_are_skipped(other: str) -> None:
    assert pick_gguf([other, "m-Q4_K_M.gguf"], None) == "m-Q4_K_M.gguf"
    assert pick_gguf([other, "m-Q4_K_M.gguf"], "Q4_K_M") == "m-Q4_K_M.gguf"
    assert pick_gguf([other], None) is None


def test_ollama_hf_co_references() -> None:
    assert parse_hub_spec("bartowski/Qwen2.5-0.5B-Instruct-GGUF") == (
        "bartowski/Qwen2.5-0.5B-Instruct-GGUF",
        None,
    )
    assert parse_hub_spec("user/repo:q4_k_m") == ("user/repo", "Q4_K_M")
    assert parse_hub_spec("hf.co/user/repo:IQ3_M") == ("user/repo", "IQ3_M")
    assert parse_hub_spec("huggingface.co/user/repo") == ("user/repo", None)
    assert parse_hub_spec("hf.co/user/repo:latest") == ("user/repo", None)  # Ollama's default tag
    for bad in ("repo", "hf.co/repo", "a/b/c", "/abs/path.gguf", "user/repo:"):
        assert parse_hub_spec(bad) is None, bad


def test_llama_cache_first_then_the_hub_s_own_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in (
        "LLAMA_CACHE",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_HOME",
        "XDG_CACHE_HOME",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf_cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert hf_cache_dir() == tmp_path / "hfhome" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    assert hf_cache_dir() == tmp_path / "hubcache"
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "llama"))
    assert hf_cache_dir() == tmp_path / "llama"


def test_specrun_home_follows_xdg_cache_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("SPECRUN_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert paths.specrun_home() == tmp_path / ".cache" / "specrun"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.models_dir() == tmp_path / "xdg" / "specrun" / "models"
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "mine"))
    assert paths.specrun_home() == tmp_path / "mine"


def test_models_list_shows_the_xdg_home(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SPECRUN_", "XDG_", "HF_", "LLAMA_"))
    }
    env |= {"XDG_CACHE_HOME": str(tmp_path / "xdg"), "LLAMA_CACHE": str(tmp_path / "llama")}
    specrun = str(Path(sys.executable).with_name("specrun"))
    p = subprocess.run(
        [specrun, "models", "list", "--json"],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout) if r["kind"] == "model"}
    assert rows["smollm2-135m-instruct-q4_1"]["path"] == str(
        tmp_path / "xdg" / "specrun" / "models" / "smollm2-135m-instruct-q4_1.gguf"
    )
    assert not rows["smollm2-135m-instruct-q4_1"]["present"]


def test_models_rm_uses_the_hub_s_delete_strategy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two files of a repo with the same bytes share one blob: removing one keeps the blob for
    the other (huggingface-hub's scan_cache_dir(...).delete_files), removing both frees it."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hub_server import HubServer

    from specrun.cli.main import main
    from specrun.models.registry import Registry

    for var in (
        "HF_HUB_OFFLINE",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_HOME",
        "SPECRUN_MODELS",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LLAMA_CACHE", str(tmp_path / "llama"))
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "home"))
    user = tmp_path / "models.toml"
    user.write_text(
        '[models.a]\nhf = "user/twin"\nfile = "a-Q8_0.gguf"\n\n'
        '[models.b]\nhf = "hf.co/user/twin"\nfile = "b-Q8_0.gguf"\n'
    )
    monkeypatch.setenv("SPECRUN_MODELS", str(user))
    data = b"GGUF" + b"x" * 4096
    with HubServer() as hub:
        hub.add_repo(
            "user/twin", {"a-Q8_0.gguf": data, "b-Q8_0.gguf": data, "c-Q4_0.gguf": b"GGUF c"}
        )
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        for name in ("a", "b", "user/twin:Q4_0"):
            assert main(["models", "pull", name]) == 0
    capsys.readouterr()
    blobs = tmp_path / "llama" / "models--user--twin" / "blobs"
    assert len(list(blobs.iterdir())) == 2
    a, b = Registry.load().local_path("a"), Registry.load().local_path("b")

    assert main(["models", "rm", "a"]) == 0
    assert capsys.readouterr().out == f"removed {a}\n"  # the link only: b still uses the blob
    assert not a.exists() and b.read_bytes() == data and len(list(blobs.iterdir())) == 2

    assert main(["models", "rm", "b"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"removed {b}" and len(out) == 2 and out[1].startswith(f"removed {blobs}/")
    assert len(list(blobs.iterdir())) == 1  # c's blob is untouched
    assert not Registry.load().is_present("b")
    # a hub reference, as it was pulled
    assert main(["models", "rm", "hf.co/user/twin:q4_0"]) == 0
    assert capsys.readouterr().out.startswith("removed ") and list(blobs.iterdir()) == []
    assert main(["models", "rm", "user/twin:Q4_0"]) == 0
    assert "nothing to remove" in capsys.readouterr().err


def test_the_huggingface_hub_floor_has_what_the_code_calls() -> None:
    """pyproject's floor is the first release with every hub function specrun calls (checked
    against that release itself, huggingface-hub 1.32.0, when the floor was set); the installed
    one must be at least that, and have them."""
    import inspect
    import re
    import tomllib
    from importlib.metadata import version

    from huggingface_hub import file_download
    from huggingface_hub.utils import HFCacheInfo

    deps = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    spec = next(d for d in deps["project"]["dependencies"] if d.startswith("huggingface-hub"))
    floor = tuple(int(x) for x in re.search(r">=([\d.]+)", spec).group(1).split("."))  # type: ignore[union-attr]
    assert floor >= (1, 32)  # delete_files arrived in 1.32.0; http_get's tqdm_class in 1.1.0
    installed = tuple(int(x) for x in re.findall(r"\d+", version("huggingface_hub"))[:2])
    assert installed >= floor[:2]
    assert hasattr(HFCacheInfo, "delete_files")
    params = inspect.signature(file_download.http_get).parameters
    assert {"resume_size", "headers", "expected_size", "displayed_filename", "tqdm_class"} <= set(
        params
    )
    assert "xet_file_data" in inspect.signature(file_download.HfFileMetadata).parameters


def test_readme_tables_name_every_flag() -> None:
    """Each shared option, and each llama.cpp spelling accepted for it, is in the tables of the
    README or docs/usage.md (where the README sends users for the full option tables)."""
    from specrun.cli.options import ALIASES, MODEL_OPTIONS, SAMPLING_OPTIONS

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text() + (root / "docs" / "usage.md").read_text()
    tables = "\n".join(line for line in readme.splitlines() if line.startswith("|"))
    flags = [
        d.split("/")[0] for _n, _t, o, _d in MODEL_OPTIONS + SAMPLING_OPTIONS for d in o.param_decls
    ]
    flags += [
        a
        for names in ALIASES.values()
        for a in names
        if a not in ("--gpu-layers", "--gpu-layers-draft")
    ]
    missing = [f for f in flags if f not in tables]
    assert not missing, missing
    for word in ("llama.cpp", "Ollama", "hf.co/USER/REPO", "--spec-type", "num_ctx", "num_predict"):
        assert word in tables, word
