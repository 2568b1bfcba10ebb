"""Issue 21: the hands of llama.cpp, Ollama and `llm` users, as whole commands.

llama.cpp's current flag names (--spec-*, -hf/-hfd, -f, --ngl auto|all), a positional prompt and
piped text beside it (`llm`), Ollama's hf.co/ references, LLAMA_CACHE, SPECRUN_* environment
defaults and --json-stream. Runs that generate use the smallest model, a short prompt and a token
or two; everything that can be seen without loading a model is checked with `specrun info`,
which resolves and plans but loads nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEFAULT_TARGET, SMOL_DRAFT, SMOL_Q4_1, SMOL_TARGET, SPECRUN

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hub_server import HubServer  # noqa: E402

pytestmark = pytest.mark.models

GEN = [SPECRUN, "generate", "-t", "1", "--ctx", "256", "-m", SMOL_Q4_1, "--mode", "none", "--json"]


def run(args, input=None, env=None, drop=(), timeout=300):
    e = {k: v for k, v in os.environ.items() if not k.startswith("SPECRUN_") or k == "SPECRUN_HOME"}
    for k in drop:
        e.pop(k, None)
    e.update(env or {})
    return subprocess.run(
        args,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
    )


def one_line_error(p, code=2):
    err = p.stderr.strip()
    assert p.returncode == code, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module", autouse=True)
def _models_present(model_path):
    for name in (SMOL_Q4_1, SMOL_TARGET, SMOL_DRAFT):
        model_path(name)


def info(*args, env=None):
    p = run([SPECRUN, "info", "--json", *args], env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["models"]


# ---------------------------------------------------------------------------------------------
# prompts: positional, -f FILE, piped text beside a prompt


def test_positional_prompt_file_flag_and_piped_text_before_the_prompt(tmp_path):
    both = "Name a colour.\nAnswer in one word."
    f = tmp_path / "prompt.txt"
    f.write_text(both)
    want = run(GEN + ["-n", "2", "--prompt", both])
    assert want.returncode == 0, want.stderr
    want = json.loads(want.stdout)
    piped = run(GEN + ["-n", "2", "Answer in one word."], input="Name a colour.")  # `llm` style
    by_f = run(GEN + ["-n", "2", "-f", str(f)])  # llama.cpp's -f FILE
    for p in (piped, by_f):
        assert p.returncode == 0, p.stderr
        got = json.loads(p.stdout)
        assert (got["prompt_tokens"], got["tokens"]) == (want["prompt_tokens"], want["tokens"])
    # a prompt given twice, or a prompt and a file, is a usage error; nothing is loaded
    assert "not both" in one_line_error(run(GEN + ["a", "--prompt", "b"]))
    assert "not both" in one_line_error(run(GEN + ["a", "-f", str(f)]))


# ---------------------------------------------------------------------------------------------
# llama.cpp's speculative flags


def test_spec_flags_are_aliases_and_spec_type_chooses_the_mode():
    p = run(
        [
            SPECRUN,
            "generate",
            "-t",
            "1",
            "--ctx",
            "256",
            "-n",
            "3",
            "--json",
            "--prompt",
            "Hi",
            "--spec-type",
            "draft-simple",
            "--spec-draft-n-max",
            "3",
            "--spec-draft-n-min",
            "0",
            "--spec-draft-p-min",
            "0.5",
        ]
    )
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert obj["mode"] == "draft" and obj["draft_max"] == 3
    assert obj["draft"]["name"] == SMOL_DRAFT


@pytest.mark.parametrize(
    "spec_type,mode",
    [
        ("none", "none"),
        ("draft-simple", "draft"),
        ("ngram-simple", "lookup"),
        ("ngram-map-k", "lookup"),
        ("ngram-map-k4v", "lookup"),
        ("ngram-mod", "lookup"),
        ("ngram-cache", "lookup"),
        ("ngram-mod,draft-simple", "hybrid"),
        ("none,ngram-simple", "lookup"),
    ],
)
def test_spec_type_maps_onto_mode(spec_type, mode):
    from specrun.cli.options import mode_for_spec_type

    assert mode_for_spec_type(spec_type) == mode


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--spec-type", "draft-mtp"], "--spec-type draft-mtp: specrun has no"),
        (["--spec-type", "draft-eagle3"], "--spec-type draft-eagle3: specrun has no"),
        (["--spec-type", "ngram-simple,draft-dflash"], "--spec-type draft-dflash: specrun has no"),
        (["--spec-type", "draft-dspark"], "--spec-type draft-dspark: specrun has no"),
        (["--spec-type", "eagle"], "--spec-type: unknown type 'eagle'"),
        (
            ["--spec-type", "ngram-simple", "--mode", "draft"],
            "--spec-type ngram-simple means --mode lookup",
        ),
        (["--ngl", "most"], "--ngl takes a number of layers, auto or all"),
        (["-ngld", "x"], "--ngl-draft takes a number of layers, auto or all"),
        (["-hf", "not-a-repo"], "-hf takes a Hugging Face repo"),
        (["-hf", "a/b", "-m", "x.gguf"], "give either -hf or -m"),
        (["--hf-file", "x.gguf"], "give -hf USER/REPO too"),
        (["--chat-template-kwargs", "[1]"], "--chat-template-kwargs takes a JSON object"),
        (["--chat-template-kwargs", "{nope"], "--chat-template-kwargs takes a JSON object"),
    ],
)
def test_refused_by_name_in_one_line(args, needle):
    p = run([SPECRUN, "generate", "--prompt", "hi", *args])
    assert needle in one_line_error(p)


def test_ngl_auto_and_all_as_llama_cpp_takes_them():
    from specrun.cli.options import NGL_ALL, parse_ngl

    assert [parse_ngl(v, "--ngl") for v in ("auto", "ALL", "0", "12", -1)] == [
        -1,
        NGL_ALL,
        0,
        12,
        -1,
    ]
    for value in ("auto", "all", "-1", "0"):
        m = info("-m", SMOL_Q4_1, "--ngl", value)
        assert m["models"][0]["placement"]["gpu_layers"] == 0  # a CPU build places nothing on a GPU
    m = info(
        "-m", SMOL_Q4_1, "--n-gpu-layers", "all", "--ctx-size", "512"
    )  # llama.cpp's long names
    assert m["models"][0]["placement"]["n_ctx"] == 512
    notes = info("-m", SMOL_Q4_1, "--ngl", "all")["memory"]["notes"]
    from specrun.llama.backend import local_gpus

    if not local_gpus():
        assert any("--ngl all is ignored" in n for n in notes), notes


# ---------------------------------------------------------------------------------------------
# environment defaults


def test_environment_defaults_and_the_command_line_wins():
    m = info(env={"SPECRUN_MODEL": SMOL_Q4_1, "SPECRUN_CTX": "1024"})
    assert m["models"][0]["name"] == SMOL_Q4_1 and m["models"][0]["placement"]["n_ctx"] == 1024
    assert (
        info("--ctx", "512", env={"SPECRUN_CTX": "1024"})["models"][0]["placement"]["n_ctx"] == 512
    )
    # SPECRUN_PAIR from the environment and -m on the command line: -m, not a clash
    m = info("-m", SMOL_Q4_1, env={"SPECRUN_PAIR": "smollm2-135m"})
    assert [x["name"] for x in m["models"]] == [SMOL_Q4_1]
    m = info(env={"SPECRUN_PAIR": "smollm2-135m"})
    assert [x["name"] for x in m["models"]] == [DEFAULT_TARGET, SMOL_DRAFT]
    # both typed: still refused
    p = run([SPECRUN, "info", "--pair", "smollm2-135m", "-m", SMOL_Q4_1])
    assert "not both" in one_line_error(p)
    # a bad value from the environment is as clear as one typed
    p = run([SPECRUN, "info", "-m", SMOL_Q4_1], env={"SPECRUN_NGL": "lots"})
    assert "--ngl takes a number" in one_line_error(p)
    helptext = run([SPECRUN, "generate", "--help"], env={"COLUMNS": "200"}).stdout
    for var in (
        "SPECRUN_MODEL",
        "SPECRUN_PAIR",
        "SPECRUN_MODEL_DRAFT",
        "SPECRUN_MODE",
        "SPECRUN_CTX",
        "SPECRUN_NGL",
        "SPECRUN_TEMP",
        "SPECRUN_SEED",
        "SPECRUN_SPEC_TYPE",
    ):
        assert var in helptext, var


# ---------------------------------------------------------------------------------------------
# --json-stream


def test_json_stream_one_object_per_pass_then_the_result():
    p = run(
        [
            SPECRUN,
            "generate",
            "-t",
            "1",
            "--ctx",
            "256",
            "-n",
            "6",
            "--json-stream",
            "--mode",
            "draft",
            "--draft-p-min",
            "0",
            "--seed",
            "3",
            "--prompt",
            "Count from one to ten.",
        ]
    )
    assert p.returncode == 0, p.stderr
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    steps, final = lines[:-1], lines[-1]
    assert steps and all(s["event"] == "step" for s in steps) and final["event"] == "done"
    assert [t for s in steps for t in s["tokens"]] == final["tokens"]
    assert "".join(s["text"] for s in steps) == final["text"]
    assert all(len(s["from_draft"]) == len(s["tokens"]) for s in steps)
    assert sum(sum(s["from_draft"]) for s in steps) == final["stats"]["accepted"]
    assert final["stats"]["target_passes"] == len(steps)
    assert final["mode"] == "draft" and "finish_reason" in final
    assert "not both" in one_line_error(
        run([SPECRUN, "generate", "--prompt", "x", "--json", "--json-stream"])
    )


# ---------------------------------------------------------------------------------------------
# the hub: -hf/-hfd/--hf-file, hf.co/ references, LLAMA_CACHE


def test_hf_flags_ollama_references_and_llama_cache(tmp_path, model_path):
    data = model_path(SMOL_Q4_1).read_bytes()
    cache = tmp_path / "llama-cache"
    env = {
        "LLAMA_CACHE": str(cache),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    with HubServer() as hub:
        # no Q4_K_M or Q8_0 here: a bare USER/REPO takes the first model file, never the
        # projector, the importance matrix or a speculative sidecar listed before it
        hub.add_repo(
            "user/smol",
            {
                "mmproj-smol-F16.gguf": b"GGUF projector",
                "imatrix.gguf": b"GGUF",
                "mtp-smol-Q4_1.gguf": b"GGUF head",
                "smol-Q4_1.gguf": data,
            },
        )
        env["HF_ENDPOINT"] = hub.url
        p = run(
            [
                SPECRUN,
                "generate",
                "-hf",
                "user/smol",
                "--mode",
                "none",
                "-n",
                "1",
                "-t",
                "1",
                "--ctx",
                "256",
                "--json",
                "--prompt",
                "Hi",
            ],
            env=env,
        )  # pulls it
        assert p.returncode == 0, p.stderr
        m = json.loads(p.stdout)["target"]
        assert Path(m["path"]).name == "smol-Q4_1.gguf" and m["name"] == "user/smol"
        assert Path(m["path"]).is_relative_to(cache)  # llama.cpp's cache, in the hub's layout
        assert (cache / "models--user--smol" / "snapshots").is_dir()
        before = len(hub.requests)
        for args in (
            ["-m", "hf.co/user/smol:q4_1"],
            ["--hf-repo", "user/smol:Q4_1"],
            ["-hf", "user/smol:Q8_0", "--hf-file", "smol-Q4_1.gguf"],
        ):
            assert Path(info(*args, env=env)["models"][0]["path"]).name == "smol-Q4_1.gguf", args
        got = info(
            "-hf", "user/smol:Q4_1", "-hfd", "hf.co/user/smol:Q4_1", "--mode", "draft", env=env
        )
        assert [Path(x["path"]).name for x in got["models"]] == ["smol-Q4_1.gguf"] * 2
        assert not any("/resolve/" in path for _m, path in hub.requests[before:])  # from the cache
        p = run([SPECRUN, "models", "pull", "hf.co/user/smol:Q2_K"], env=env)
        assert "no Q2_K GGUF in Hugging Face repo user/smol" in one_line_error(p, 1)


@pytest.mark.parametrize(
    "argv",
    [
        ["models", "check", "--pair", "smollm2-135m", "--no-probe"],
        ["draft", "make", "-m", SMOL_Q4_1],
    ],
)
def test_ngl_words_on_the_commands_with_their_own_ngl(argv):
    p = run([SPECRUN, *argv, "-ngl", "lots"])
    assert "--ngl takes a number of layers, auto or all" in one_line_error(p)
    p = run([SPECRUN, "models", "check", "--pair", "smollm2-135m", "--no-probe", "--ngl", "all"])
    assert p.returncode == 0, p.stderr
