"""`specrun models check --pair/-m/-md`, `specrun draft make`, and what the registry still lacked:
writing the user's models.toml, hub revisions and HF_TOKEN, resumed hub downloads.

Registry behaviour already covered by test_registry.py (file:line errors, suggestions from
Registry.model/pair, concurrent package pulls, `rm` of a path model) is not repeated here.
Model tests run the probe small (-n 16, K <= 4) and on one thread: on a CPU shared with other
jobs, llama.cpp's threads spin-waiting for each other cost far more than the second core gains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hub_server  # noqa: E402
from hub_server import HubServer  # noqa: E402
from test_registry import _pull_in_subprocess, _wait_for, env, sha, user_registry  # noqa: E402

from specrun.cli.main import main  # noqa: E402
from specrun.errors import PullError, RegistryError  # noqa: E402
from specrun.models.registry import Registry, ResolvedModel  # noqa: E402
from specrun.models.toml import edit_registry_text, update_user_registry  # noqa: E402

REUSED_FIXTURES = (env,)  # test_registry's clean world: own SPECRUN_HOME, HF_HOME, no network
SPECRUN = str(Path(sys.executable).with_name("specrun"))
SMOL_TARGET = "smollm2-135m-instruct-f32"
GEMMA_DRAFT = "gemma-3-270m-q4_k_m"
SMALL_PROBE = ["-n", "16", "--draft-max", "4", "-t", "1"]


# ---------------------------------------------------------------------------------------------
# writing the user's models.toml


USER_TOML = """\
# my models: keep this comment
default = "mine"   # and this one

[models.mine-target]
path = "/models/t.gguf"
description = "my target"

# a pair I tuned by hand
[pairs.mine]
target = "mine-target"
draft = "mine-target"
  draft_max = 3   # indented, with a comment

[pairs."qwen2.5-x"]
target = "mine-target"
draft = "mine-target"
"""


def test_edit_keeps_everything_else() -> None:
    new = edit_registry_text(
        USER_TOML,
        [
            ("pairs", "mine", {"draft_max": 6}),
            ("pairs", "qwen2.5-x", {"draft_max": 2}),
            ("models", "mine-draft", {"path": '/models/d "q4".gguf'}),
            ("pairs", "new.pair", {"target": "mine-target", "draft": "mine-draft"}),
        ],
    )
    data = tomllib.loads(new)
    assert data["pairs"]["mine"] == {
        "target": "mine-target",
        "draft": "mine-target",
        "draft_max": 6,
    }
    assert data["pairs"]["qwen2.5-x"]["draft_max"] == 2
    assert data["models"]["mine-draft"] == {"path": '/models/d "q4".gguf'}
    assert data["pairs"]["new.pair"] == {"target": "mine-target", "draft": "mine-draft"}
    # what was not touched is still there, byte for byte, in its place
    for line in USER_TOML.splitlines():
        if "draft_max" not in line:
            assert line in new.splitlines(), line
    # rewritten in place, indent and comment kept (tomlkit)
    assert "  draft_max = 6   # indented, with a comment" in new.splitlines()
    # a key added to a table goes after its last key, not after the next table's heading comment
    lines = new.splitlines()
    assert lines[lines.index('[pairs."qwen2.5-x"]') + 3] == "draft_max = 2"


def test_edit_any_toml_value_the_user_wrote() -> None:
    """Issue 21: what a line editor could not do: values over several lines, inline tables,
    dotted table names, a key added before the comment that heads the next table."""
    text = textwrap.dedent(
        """\
        [models.qwen2.5-coder]   # dotted: models -> qwen2 -> 5-coder to TOML
        package = [
            "part1==1.0",  # first part
            "part2==1.0",
        ]
        file = ["a.part00", "b.part01"]

        # my pairs, written inline
        [pairs]
        quick = { target = "qwen2.5-coder", draft = "qwen2.5-coder" }
        """
    )
    new = edit_registry_text(
        text,
        [
            (
                "models",
                "qwen2.5-coder",
                {"package": ["part1==2.0", "part2==2.0"], "sha256": "ab" * 32},
            ),
            ("pairs", "quick", {"draft_max": 5}),
        ],
    )
    data = tomllib.loads(new)
    assert data["models"]["qwen2"]["5-coder"]["package"] == ["part1==2.0", "part2==2.0"]
    assert data["models"]["qwen2"]["5-coder"]["sha256"] == "ab" * 32
    assert data["pairs"]["quick"] == {
        "target": "qwen2.5-coder",
        "draft": "qwen2.5-coder",
        "draft_max": 5,
    }
    lines = new.splitlines()
    assert lines[0] == "[models.qwen2.5-coder]   # dotted: models -> qwen2 -> 5-coder to TOML"
    assert lines.index("# my pairs, written inline") > lines.index(f'sha256 = "{"ab" * 32}"')
    assert new.count("[models.") == 1 and "[pairs]" in lines  # no second table for either


def test_update_user_registry_validates_locks_and_replaces(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = user_registry(env, monkeypatch, USER_TOML)
    f.chmod(0o600)
    before = f.read_text()
    # an edit that would not load is refused, naming the real file; nothing is written
    with pytest.raises(RegistryError, match=rf"not writing {f}: .*{f}:\d+: .*unknown model 'nope'"):
        update_user_registry([("pairs", "bad", {"target": "nope", "draft": "mine-target"})])
    assert f.read_text() == before
    assert sorted(p.name for p in f.parent.iterdir()) == [".models.toml.lock", "models.toml"]

    # writers in several processes at once: every entry lands (the lock), the file stays valid
    code = textwrap.dedent(
        """
        import sys
        from specrun.models.toml import update_user_registry
        n = sys.argv[1]
        update_user_registry([("pairs", f"p{n}", {"target": "mine-target", "draft": "mine-target",
                                                   "draft_max": int(n) + 1})])
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)]) for i in range(4)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0, 0]
    reg = Registry.load()
    assert [reg.pair(f"p{i}").draft_max for i in range(4)] == [1, 2, 3, 4]
    assert f.read_text().startswith(before)  # appended; the user's text is untouched
    assert f.stat().st_mode & 0o777 == 0o600

    # a symlinked models.toml (dotfiles) is written through, the link stays a link
    real = env / "dotfiles" / "models.toml"
    real.parent.mkdir()
    real.write_text(f.read_text())
    f.unlink()
    f.symlink_to(real)
    update_user_registry([("pairs", "mine", {"draft_max": 8})])
    assert f.is_symlink() and Registry.load().pair("mine").draft_max == 8


def test_save_pair_adds_models_for_files(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specrun.cli.models import save_pair

    f = user_registry(env, monkeypatch, "# mine\n")
    gguf = env / "d.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    reg = Registry.load()
    target = ResolvedModel(SMOL_TARGET, env / "t.gguf", reg.model(SMOL_TARGET))
    draft = ResolvedModel("d", gguf, None)
    saved = save_pair(reg, "mine", target, draft, 3)
    assert saved | {"file": str(f), "pair": "mine", "draft": "mine-draft", "draft_max": 3} == saved
    reg = Registry.load()
    assert (reg.pair("mine").target, reg.pair("mine").draft) == (SMOL_TARGET, "mine-draft")
    assert reg.model("mine-draft").path == gguf and reg.model("mine-draft").source == "path"
    # again with the same file: the model is reused, draft_max updated
    save_pair(reg, "mine", target, draft, 5)
    assert Registry.load().pair("mine").draft_max == 5
    assert f.read_text().count("[models.mine-draft]") == 1
    # a name already taken by another model is an error, not an overwrite
    other = env / "other.gguf"
    other.write_bytes(b"GGUF")
    with pytest.raises(
        RegistryError, match="already has a model 'mine-draft'.*choose another --name"
    ):
        save_pair(reg, "mine", target, ResolvedModel("o", other, None), 2)


# ---------------------------------------------------------------------------------------------
# the CLI without models: usage, suggestions, files mode


def test_check_usage_errors_and_suggestions(
    env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = [
        (["models", "check", "--save"], 2, "need --pair NAME or -m TARGET"),
        (["models", "check", "-m", "x.gguf", "-md", "y.gguf", "--save"], 2, "needs --name NAME"),
        (["models", "check", "--pair", "p", "--name", "n"], 2, "--name goes with --save"),
        (["models", "check", "--pair", "p", "m1"], 2, "either model names or --pair/-m"),
        (["models", "check", "--pair", "p", "-m", "m"], 2, "either --pair or -m"),
        (["models", "check", "--pair", "p", "--save", "--no-probe"], 2, "drop --no-probe"),
        (
            ["models", "check", "--pair", "smollm-135m"],
            1,
            "unknown pair 'smollm-135m'; did you mean smollm2-135m",
        ),
        (
            ["models", "check", "-m", "smolm2-135m-instruct-f32", "-md", "x"],
            1,
            "unknown model 'smolm2-135m-instruct-f32'; did you mean smollm2-135m-instruct-f32",
        ),
        (
            ["draft", "make", "-m", "smolm2-135m-instruct-f32"],
            1,
            "did you mean smollm2-135m-instruct-f32",
        ),
        (
            ["draft", "make", "-m", "x", "--sweep", "Q4_0,Q5_9"],
            2,
            "unknown quantization type 'Q5_9'",
        ),
    ]
    for argv, code, message in cases:
        assert main(argv) == code, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)

    # files mode (no --pair/-m) is the integrity check it always was; a broken file names its line
    f = user_registry(env, monkeypatch, '[models.a]\npath = "a.gguf"\nsha256 = oops\n')
    assert main(["models", "check"]) == 1
    assert capsys.readouterr().err.startswith(f"specrun: error: {f}:3:")


def test_rm_of_a_pair_never_touches_path_models(
    env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = env / "a.gguf", env / "b.gguf"
    for p in (a, b):
        p.write_bytes(b"GGUF" + b"\0" * 16)
    user_registry(
        env,
        monkeypatch,
        f'[models.a]\npath = "{a}"\n[models.b]\npath = "{b}"\n'
        '[pairs.ab]\ntarget = "a"\ndraft = "b"\n',
    )
    assert main(["models", "rm", "ab"]) == 0
    assert "nothing to remove" in capsys.readouterr().err
    assert a.is_file() and b.is_file()


# ---------------------------------------------------------------------------------------------
# the hub: revision, HF_TOKEN, resumed and concurrent downloads (a local stand-in)


Seen = tuple[str, str, "str | None", "str | None"]


@pytest.fixture
def headers_seen(monkeypatch: pytest.MonkeyPatch) -> list[Seen]:
    """(method, path, Range, Authorization) of every request the stand-in hub answers."""
    seen: list[Seen] = []
    route = hub_server._Handler._route

    def spy(self, head):  # type: ignore[no-untyped-def]
        seen.append(
            (self.command, self.path, self.headers.get("Range"), self.headers.get("Authorization"))
        )
        return route(self, head)

    monkeypatch.setattr(hub_server._Handler, "_route", spy)
    return seen


def test_hf_revision_and_token(
    env: Path, monkeypatch: pytest.MonkeyPatch, headers_seen: list[Seen]
) -> None:
    data = b"GGUF" + b"r" * 4000
    with HubServer() as hub:
        commit = hub.add_repo("user/pinned", {"m-Q8_0.gguf": data})
        user_registry(
            env,
            monkeypatch,
            f"""
            [models.pinned]
            hf = "user/pinned"
            file = "m-Q8_0.gguf"
            revision = "{commit}"

            [models.badrev]
            hf = "user/pinned"
            file = "m-Q8_0.gguf"
            revision = "v9"
        """,
        )
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_test_secret")
        reg = Registry.load()
        path = reg.pull("pinned")
        assert path.read_bytes() == data and path.parent.name == commit
        assert reg.local_path("pinned") == path and reg.is_present("pinned")
        resolves = [h for h in headers_seen if "/resolve/" in h[1]]
        assert resolves and all(f"/resolve/{commit}/" in h[1] for h in resolves)
        assert all(h[3] == "Bearer hf_test_secret" for h in resolves)
        with pytest.raises(PullError, match="revision not found in Hugging Face repo user/pinned"):
            reg.pull("badrev")


def test_hf_interrupted_pull_resumes(
    env: Path, monkeypatch: pytest.MonkeyPatch, headers_seen: list[Seen]
) -> None:
    # huggingface_hub writes in 10 MiB chunks: stall past the first so something reached the disk
    big = b"GGUF" + os.urandom(12 * 1024 * 1024)
    user_registry(env, monkeypatch, '[models.big]\nhf = "user/big"\nfile = "big-Q4_K_M.gguf"\n')
    blobs = env / "hf" / "hub" / "models--user--big" / "blobs"
    with HubServer() as hub:
        hub.add_repo("user/big", {"big-Q4_K_M.gguf": big})
        hub.stall_after = 11 * 1024 * 1024
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        proc = _pull_in_subprocess("big")
        _wait_for(hub.stalled.is_set)
        _wait_for(
            lambda: any(p.stat().st_size >= 10 * 1024 * 1024 for p in blobs.glob("*.incomplete"))
        )
        proc.kill()
        proc.communicate()
        hub.release()
        reg = Registry.load()
        assert not reg.is_present("big")
        path = reg.pull("big")
        assert path.read_bytes() == big
        gets = [h for h in headers_seen if h[0] == "GET" and "/resolve/" in h[1]]
        assert gets[-1][2] == f"bytes={10 * 1024 * 1024}-"  # continued, not started over
        assert sorted(p.name for p in blobs.iterdir()) == [sha(big)]  # no part file left behind


def test_hf_concurrent_pulls_download_once(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = b"GGUF" + os.urandom(1024 * 1024)
    user_registry(env, monkeypatch, '[models.twice]\nhf = "user/twice"\nfile = "t-Q4_0.gguf"\n')
    with HubServer() as hub:
        hub.add_repo("user/twice", {"t-Q4_0.gguf": data})
        hub.delay = 0.1  # 16 chunks: the first pull holds the file for ~1.6 s
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        first = _pull_in_subprocess("twice")
        _wait_for(hub.started.is_set)
        second = _pull_in_subprocess("twice")
        out1, err1 = first.communicate(timeout=60)
        out2, err2 = second.communicate(timeout=60)
        assert (first.returncode, second.returncode) == (0, 0), err1 + err2
        assert out1 == out2 and Path(out1.strip()).read_bytes() == data
        assert sum(m == "GET" and "/resolve/" in p for m, p in hub.requests) == 1


# ---------------------------------------------------------------------------------------------
# with the real models


@pytest.fixture
def user_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty user registry in tmp (the real models stay where `make install` put them)."""
    f = tmp_path / "models.toml"
    f.write_text("# my registry\n")
    monkeypatch.setenv("SPECRUN_MODELS", str(f))
    return f


def _specrun(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SPECRUN, *args], capture_output=True, text=True, timeout=300, env=os.environ.copy()
    )


@pytest.mark.models
def test_check_default_pair_recommends_k_and_saves(user_file: Path) -> None:
    run = _specrun("models", "check", "--pair", "smollm2-135m", "--json", "--save", *SMALL_PROBE)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["compatible"] is True and out["problems"] == []
    p = out["probe"]
    k = p["best_k"]
    assert 0 <= k <= 4 and len(p["predicted_by_k"]) == 5 and len(p["cum_acceptance"]) == 4
    assert p["predicted"] == max(p["predicted_by_k"]) and p["predicted_by_k"][0] == 1.0
    assert 0.0 < p["acceptance"] <= 1.0 and p["t1"] > 0 and p["c"] > 0
    # the recommended K is measured; when K = 0 wins, the best K >= 1 is, to show the loss
    assert p["measured"] is not None and p["measured_k"] >= 1
    assert k == 0 or p["measured_k"] == k
    assert p["identical"] is True  # greedy speculation said what the target alone said
    reg = Registry.load()
    if k:  # it pays on this machine: the pair now carries the measured K
        assert out["recommended_draft_max"] == k and out["saved"]["draft_max"] == k
        assert (
            reg.pair("smollm2-135m").draft_max == k and reg.pair("smollm2-135m").origin == user_file
        )
    else:  # drafting does not pay here (a busy CPU): nothing is written
        assert out["saved"] is None and "not saved" in run.stderr
        assert user_file.read_text() == "# my registry\n"


@pytest.mark.models
def test_check_smollm2_with_gemma_names_every_rule(
    user_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _specrun("models", "check", "-m", SMOL_TARGET, "-md", GEMMA_DRAFT, "--json")
    assert run.returncode == 1
    out = json.loads(run.stdout)
    assert out["compatible"] is False and out["probe"] is None
    rules = " | ".join(out["problems"])
    for rule in (
        "vocabulary type differs",
        "vocabulary sizes differ",
        "BOS token id differs",
        "EOS token id differs",
        "add-BOS flag differs",
        "differs from the target's at token",
    ):
        assert rule in rules
    assert run.stderr.startswith("specrun: error: ") and run.stderr.count("\n") == 1

    assert main(["models", "check", "-m", SMOL_TARGET, "-md", GEMMA_DRAFT]) == 1
    text = capsys.readouterr().out
    assert f"{GEMMA_DRAFT} cannot draft for {SMOL_TARGET}: incompatible (6 rules fail)" in text
    assert text.count("\n  - ") == 6


@pytest.mark.models
def test_draft_make_registers_a_draft_that_speculates_exactly(
    user_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from specrun.decoding.engine import Engine, SpecConfig
    from specrun.llama.model import LoadOptions, Model
    from specrun.probe import compatibility, encode

    out_file = tmp_path / "drafts" / "smol-q4_0.gguf"
    argv = [
        "draft",
        "make",
        "-m",
        SMOL_TARGET,
        "--quant",
        "q4_0",
        "-o",
        str(out_file),
        "--no-probe",
        "--name",
        "mine",
        "--json",
    ]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["quant"] for d in doc["drafts"]] == ["Q4_0"] and doc["drafts"][0]["compatible"]
    assert doc["registered"]["pair"] == "mine"
    assert sorted(p.name for p in out_file.parent.iterdir()) == ["smol-q4_0.gguf"]  # no part file

    text = user_file.read_text()
    assert text.startswith("# my registry\n")
    reg = Registry.load()
    assert reg.model("mine-draft").source == "path" and reg.model("mine-draft").path == out_file
    assert (reg.pair("mine").target, reg.pair("mine").draft) == (SMOL_TARGET, "mine-draft")
    assert main(["models", "rm", "mine-draft"]) == 1 and out_file.is_file()  # never a path model
    assert main(argv) == 2 and "exists; use --force" in capsys.readouterr().err

    opts = LoadOptions(n_ctx=512, n_threads=1)
    with Model(reg.ensure(SMOL_TARGET), opts) as target, Model(out_file, opts) as draft:
        assert compatibility(target, draft) == []
        toks = encode(target, "Write a haiku about speculative decoding.")
        alone = Engine(target, None, SpecConfig(mode="none")).run(
            toks, max_tokens=48, reuse_cache=False
        )
        spec = Engine(target, draft, SpecConfig(mode="draft", draft_max=4, draft_p_min=0.0)).run(
            toks, max_tokens=48, reuse_cache=False
        )
        assert spec.tokens == alone.tokens and len(alone.tokens) >= 8
        assert spec.stats.drafted > 0


@pytest.mark.models
def test_draft_make_sweep_is_one_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from specrun.cli.draft import sweep_table

    argv = [
        "draft",
        "make",
        "-m",
        SMOL_TARGET,
        "--sweep",
        "Q8_0,Q4_0",
        "-o",
        str(tmp_path),
        "--json",
        "-n",
        "8",
        "--draft-max",
        "2",
        "-t",
        "1",
    ]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["quant"] for d in doc["drafts"]] == ["Q8_0", "Q4_0"]
    assert {p.name for p in tmp_path.iterdir()} == {
        f"{SMOL_TARGET}-q8_0.gguf",
        f"{SMOL_TARGET}-q4_0.gguf",
    }
    sizes = [d["draft"]["size"] for d in doc["drafts"]]
    assert sizes[0] > sizes[1] > 0
    for d in doc["drafts"]:
        assert d["compatible"] and d["probe"]["identical"] and d["probe"]["measured"] is not None
    assert doc["best"] in ("Q8_0", "Q4_0") and doc["registered"] is None

    from rich.console import Console

    con = Console(width=160, record=True)
    con.print(sweep_table(doc["drafts"], SMOL_TARGET))
    table = con.export_text()
    for col in ("quant", "size", "acceptance", "c", "best K", "predicted", "measured"):
        assert col in table
    assert "Q8_0" in table and "Q4_0" in table


def test_probe_table_and_best_pick_without_models() -> None:
    """The human output of a probe, and how `draft make --sweep` ranks its drafts."""
    from rich.console import Console

    from specrun.cli.draft import pick_best
    from specrun.cli.models import print_check

    def probe(k: int, measured: float) -> dict[str, object]:
        return {
            "acceptance": 0.5,
            "cum_acceptance": [0.7, 0.5],
            "t1": 0.03,
            "draft_step": 0.01,
            "c": 0.33,
            "verify_slope": 0.25,
            "best_k": k,
            "v_best": 1 + 0.25 * k,
            "predicted": 1.1,
            "predicted_by_k": [1.0, 1.1, 0.9],
            "measured_k": k or 1,
            "measured": measured,
            "baseline_tps": 30.0,
            "spec_tps": 30.0 * measured,
            "identical": True,
            "settings": {"learn_k": 2, "max_tokens": 48, "prompts": 3},
        }

    def result(q: str, k: int, measured: float) -> dict[str, object]:
        return {
            "quant": q,
            "target": {"name": "t"},
            "draft": {"name": f"d-{q}", "size": 1},
            "compatible": True,
            "problems": [],
            "probe": probe(k, measured),
        }

    con = Console(width=120, record=True)
    print_check(con, result("Q4_0", 0, 0.9))
    text = con.export_text()
    assert "d-Q4_0 can draft for t: compatible" in text
    assert "0 (drafting does not pay here)" in text and "0.90x at K=1" in text
    assert "(K=1: 1.10x)" in text and "identical to the target alone" in text

    runs = [result("Q8_0", 3, 1.2), result("Q4_0", 0, 0.9), result("Q2_K", 1, 1.3)]
    assert pick_best(runs)["quant"] == "Q2_K"  # type: ignore[index]
    runs[2]["compatible"] = False
    assert pick_best(runs)["quant"] == "Q8_0"  # type: ignore[index]
