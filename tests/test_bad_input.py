"""The catalogue of bad input (issue 8): each case is one line on stderr, a non-zero exit, no
traceback, and nothing the user had is touched."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import SPECRUN

BASE = [SPECRUN, "generate", "--threads", "2", "-n", "4"]


def run(args, input=None, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(args, input=input, capture_output=True, timeout=120, env=e)


def one_line_error(p, code):
    err = p.stderr.decode("utf-8", "replace").strip()
    assert p.returncode == code, err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert p.stdout == b""
    return err


@pytest.fixture()
def truncated_gguf(tmp_path, model_path):
    from conftest import SMOL_Q4_1

    src = model_path(SMOL_Q4_1)
    dst = tmp_path / "cut.gguf"
    with open(src, "rb") as fh:
        dst.write_bytes(fh.read(5_000_000))
    return dst


@pytest.mark.parametrize("what", ["directory", "devnull", "not_gguf", "missing"])
def test_bad_model_files(tmp_path, what):
    path = {
        "directory": tmp_path,
        "devnull": "/dev/null",
        "not_gguf": tmp_path / "x.gguf",
        "missing": tmp_path / "nope.gguf",
    }[what]
    if what == "not_gguf":
        path.write_bytes(b"PK\x03\x04 this is a zip file, not a model" * 10)
    err = one_line_error(run(BASE + ["-m", str(path), "--mode", "none", "--prompt", "hi"]), 1)
    assert str(path) in err or os.path.basename(str(path)) in err


@pytest.mark.models
def test_truncated_gguf_is_an_error_not_a_crash(truncated_gguf):
    before = truncated_gguf.read_bytes()
    err = one_line_error(
        run(BASE + ["-m", str(truncated_gguf), "--mode", "none", "--prompt", "hi"]), 1
    )
    assert "truncated" in err
    assert truncated_gguf.read_bytes() == before  # nothing the user had is changed


@pytest.mark.models
def test_prompt_longer_than_the_context_says_by_how_much():
    err = one_line_error(
        run(BASE + ["--ctx", "64", "--mode", "none", "--prompt", "word " * 600]), 1
    )
    assert "too many" in err and "--ctx" in err


@pytest.mark.models
def test_invalid_utf8_prompt_is_decoded_with_replacement_and_said(tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes(b"Say hello \xff\xfe in French.")
    p = run(BASE + ["-p", str(f), "--mode", "none"])
    assert p.returncode == 0
    err = p.stderr.decode()
    assert "not valid UTF-8" in err and "replacement" in err


def test_binary_stdin_is_refused():
    err = one_line_error(run(BASE + ["--mode", "none"], input=b"\x00\x01\x02binary\x00"), 2)
    assert "binary" in err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--ctx", "1"], "--ctx"),
        (["--top-p", "0"], "--top-p"),
        (["--min-p", "1.5"], "--min-p"),
        (["--draft-min", "9", "--draft-max", "4"], "--draft-min"),
        (["-n", "-3"], "--max-tokens"),
        (["--threads", "0"], "--threads"),
        (["--ngl", "-5"], "--ngl"),
        (["--lookup-min", "5", "--lookup-max", "2"], "--lookup"),
    ],
)
def test_nonsense_option_values_are_usage_errors(args, needle):
    err = one_line_error(run(BASE + ["--prompt", "hi"] + args), 2)
    assert needle in err


def test_unknown_pair_suggests():
    err = one_line_error(run(BASE + ["--pair", "smollm2-135", "--prompt", "hi"]), 1)
    assert "smollm2-135m" in err


def test_malformed_user_registry_names_file_and_line(tmp_path):
    bad = tmp_path / "models.toml"
    bad.write_text('[models.x]\npath = "a.gguf"\n[pairs.p\ntarget = "x"\n')
    err = one_line_error(run(BASE + ["--prompt", "hi"], env={"SPECRUN_MODELS": str(bad)}), 1)
    assert f"{bad}:3:" in err  # file:line:column
    assert bad.read_text().startswith("[models.x]")  # untouched
