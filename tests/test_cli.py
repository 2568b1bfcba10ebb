"""specrun generate end to end, in a subprocess, as a shell script would run it."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import DEFAULT_TARGET, SPECRUN

pytestmark = pytest.mark.models

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")
BASE = [SPECRUN, "generate", "--threads", "2", "--ctx", "1024"]


def run(args, input=None, env=None, timeout=300):
    e = dict(os.environ)
    e.pop("NO_COLOR", None)
    e.update(env or {})
    return subprocess.run(args, input=input, capture_output=True, timeout=timeout, env=e)


@pytest.fixture(scope="module", autouse=True)
def _default_pair_present(model_path):
    from conftest import SMOL_DRAFT, SMOL_TARGET

    model_path(SMOL_TARGET)
    model_path(SMOL_DRAFT)


def test_piped_stdin_streams_plain_text():
    p = run(BASE + ["-n", "24", "--mode", "draft"], input=b"Name three colours.")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip(), "no text on stdout"
    assert not ANSI.search(p.stdout)
    # stderr is not a terminal and --stats was not given: no statistics, no spinner.
    assert b"tok/s" not in p.stderr and not ANSI.search(p.stderr)


def test_prompt_file_and_dash(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("Say hello.")
    a = run(BASE + ["-n", "12", "-p", str(f), "--seed", "1"])
    b = run(BASE + ["-n", "12", "-p", "-", "--seed", "1"], input=b"Say hello.")
    c = run(BASE + ["-n", "12", "--prompt", "Say hello.", "--seed", "1"])
    assert a.returncode == b.returncode == c.returncode == 0
    assert a.stdout == b.stdout == c.stdout


def test_stats_line_on_request():
    p = run(BASE + ["-n", "16", "--prompt", "Hi", "--stats", "--seed", "7"])
    assert p.returncode == 0
    line = p.stderr.decode().strip().splitlines()[-1]
    assert "tok/s" in line and "seed 7" in line


SCHEMA = {
    "text": str,
    "tokens": list,
    "finish_reason": str,
    "prompt_tokens": int,
    "generated_tokens": int,
    "mode": str,
    "target": dict,
    "draft": dict,
    "sampling": dict,
    "stats": dict,
}
STATS = {
    "drafted": int,
    "accepted": int,
    "acceptance_rate": float,
    "target_passes": int,
    "mean_accepted_length": float,
    "per_position_acceptance": list,
    "accepted_length_histogram": list,
    "prefill_seconds": float,
    "decode_seconds": float,
    "tokens_per_second": float,
}


def check_schema(obj, schema):
    for key, typ in schema.items():
        assert key in obj, f"missing {key}"
        if typ is float:
            assert isinstance(obj[key], (int, float)), key
        else:
            assert isinstance(obj[key], typ), (key, obj[key])


def test_json_matches_the_contract():
    p = run(
        BASE
        + [
            "-n",
            "40",
            "--prompt",
            "Write a haiku about rain.",
            "--json",
            "--mode",
            "draft",
            "--seed",
            "42",
        ]
    )
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)  # exactly one JSON object, nothing else on stdout
    check_schema(obj, SCHEMA)
    check_schema(obj["stats"], STATS)
    s = obj["stats"]
    assert obj["mode"] == "draft"
    assert obj["generated_tokens"] == len(obj["tokens"]) <= 40
    assert obj["finish_reason"] in ("length", "stop", "eos")
    assert obj["sampling"]["seed"] == 42 and obj["sampling"]["temp"] == 0.0
    assert set(obj["target"]) == {"name", "path"} and Path(obj["target"]["path"]).exists()
    assert obj["target"]["name"] == DEFAULT_TARGET
    assert obj["draft"]["name"] == "smollm2-135m-instruct-q4_0"
    assert s["acceptance_rate"] == pytest.approx(s["accepted"] / s["drafted"], abs=1e-3)
    assert s["mean_accepted_length"] == pytest.approx(
        obj["generated_tokens"] / s["target_passes"], abs=1e-3
    )
    assert s["tokens_per_second"] == pytest.approx(
        obj["generated_tokens"] / s["decode_seconds"], rel=0.02
    )
    assert sum(s["accepted_length_histogram"]) == s["target_passes"]


def test_json_n_completions_seeds():
    p = run(
        BASE
        + [
            "-n",
            "8",
            "--prompt",
            "Tell me a word.",
            "--json",
            "-N",
            "3",
            "--temp",
            "0.9",
            "--seed",
            "5",
            "--mode",
            "draft",
        ]
    )
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert obj["sampling"]["seed"] == 5
    comps = obj["completions"]
    assert [c["seed"] for c in comps] == [5, 6, 7]
    for c in comps:
        check_schema(c, {"text": str, "tokens": list, "finish_reason": str, "stats": dict})
    # Completion i with seed S+i is the same as a single run with that seed.
    single = json.loads(
        run(
            BASE
            + [
                "-n",
                "8",
                "--prompt",
                "Tell me a word.",
                "--json",
                "--temp",
                "0.9",
                "--seed",
                "6",
                "--mode",
                "draft",
            ]
        ).stdout
    )
    assert single["tokens"] == comps[1]["tokens"]


def test_json_none_mode_is_plain_decoding():
    p = run(BASE + ["-n", "16", "--prompt", "Count to five.", "--json", "--mode", "none"])
    obj = json.loads(p.stdout)
    assert obj["mode"] == "none" and obj["draft"] is None
    assert obj["stats"]["drafted"] == 0 and obj["stats"]["mean_accepted_length"] == 1.0


def test_incompatible_pair_fails_cleanly():
    p = run(
        BASE
        + [
            "-m",
            "smollm2-135m-instruct-f32",
            "-md",
            "gemma-3-270m-q4_k_m",
            "--mode",
            "draft",
            "--prompt",
            "hi",
            "-n",
            "4",
        ]
    )
    assert p.returncode == 1
    err = p.stderr.decode().strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "cannot draft for" in err and "vocabulary" in err
    assert p.stdout == b""


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["--draft-max", "0"], 2, "--draft-max"),
        (["--temp", "-1"], 2, "--temp"),
        (["--top-p", "2"], 2, "--top-p"),
        (["--mode", "warp"], 2, "--mode"),
        (["--no-such-flag"], 2, "No such option"),
        (["-m", "/nonexistent/model.gguf"], 1, "not found"),
        (["-m", "smollm2-135m-instruct-f3"], 1, "smollm2-135m-instruct-f32"),
    ],
)
def test_bad_input_is_one_line_and_an_exit_code(args, code, needle):
    p = run(BASE + ["--prompt", "hi", "-n", "4"] + args)
    err = p.stderr.decode()
    assert p.returncode == code, err
    assert "Traceback" not in err and needle in err


def test_empty_prompt_is_a_usage_error():
    p = run(BASE + ["-n", "4"], input=b"   \n")
    assert p.returncode == 2 and b"empty" in p.stderr


def test_ctrl_c_exits_130_and_keeps_the_text():
    proc = subprocess.Popen(
        BASE
        + [
            "-n",
            "2000",
            "--prompt",
            "Write a long essay about the sea.",
            "--mode",
            "none",
            "--ctx",
            "4096",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    # The first streamed byte, then more text streamed and not yet read (not a fixed sleep: on a
    # busy machine 0.3 s once passed without another token), then the interrupt: what was
    # streamed before it must reach stdout. Unbuffered reads, so that select sees what waits.
    fd = proc.stdout.fileno()
    first = os.read(fd, 1)
    assert first
    ready, _, _ = select.select([fd], [], [], 60)
    assert ready, "no more text within 60 s"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert b"Traceback" not in err
    assert out, "the text streamed before Ctrl-C was lost"


def test_broken_pipe_is_quiet():
    p = subprocess.run(
        f"{SPECRUN} generate --threads 2 --prompt 'Write a long story.' -n 400 --mode none | head -c 10",
        shell=True,
        capture_output=True,
        timeout=300,
    )
    assert len(p.stdout) == 10
    assert b"Traceback" not in p.stderr and b"BrokenPipe" not in p.stderr


def test_chat_template_flags_render_the_chat_as_its_raw_text(tmp_path):
    """--chat-template NAME (llama.cpp's built-in format) and --chat-template-file FILE (Jinja)
    feed the target the tokens of that rendering: the same prompt tokens and, greedy, the same
    reply as the rendered text given with --raw. `info` says which template is in use."""
    common = BASE + ["-n", "12", "--temp", "0", "--mode", "none", "--json"]
    rendered = "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n"
    f = tmp_path / "gemma-like.jinja"
    f.write_text(
        "{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
        "{{ m.content }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
        encoding="utf-8",
    )
    runs = {
        "name": run(common + ["--chat-template", "gemma", "--prompt", "Name a colour."]),
        "file": run(common + ["--chat-template-file", str(f), "--prompt", "Name a colour."]),
        "raw": run(common + ["--raw", "--prompt", rendered]),
        "gguf": run(common + ["--prompt", "Name a colour."]),
    }
    out = {}
    for k, p in runs.items():
        assert p.returncode == 0, (k, p.stderr)
        out[k] = json.loads(p.stdout)
    for k in ("name", "file"):
        assert (out[k]["prompt_tokens"], out[k]["tokens"]) == (
            out["raw"]["prompt_tokens"],
            out["raw"]["tokens"],
        ), k
    assert out["gguf"]["prompt_tokens"] != out["name"]["prompt_tokens"]  # the GGUF's own ChatML
    # a contradiction, and a bad template: one line each, exit 2, before any model loads
    for args, msg in (
        (["--raw", "--chat-template", "chatml"], b"--raw renders no chat template"),
        (["--chat-template", "chatm"], b"--chat-template 'chatm' is neither a Jinja template"),
        (["--chat-template-file", str(tmp_path / "no.jinja")], b"chat template file not found"),
    ):
        p = run(BASE + args + ["--prompt", "hi"])
        assert p.returncode == 2 and p.stderr.startswith(b"specrun: error: " + msg), p.stderr
        assert p.stderr.count(b"\n") == 1
    # from the environment, --raw on the command line wins over it
    p = run(BASE + ["--raw", "-n", "2", "--prompt", "hi"], env={"SPECRUN_CHAT_TEMPLATE": "chatml"})
    assert p.returncode == 0, p.stderr
    p = run([SPECRUN, "info", "--json", "--chat-template", "chatml"])
    assert p.returncode == 0, p.stderr
    tmpl = json.loads(p.stdout)["models"]["chat_template"]
    assert tmpl["from"] == "option" and "'chatml', llama.cpp's built-in format" in tmpl["text"]
    # the file on the command line beats a name from the environment, as any rival option does
    p = run(
        [SPECRUN, "info", "--json", "--chat-template-file", str(f)],
        env={"SPECRUN_CHAT_TEMPLATE": "chatml"},
    )
    assert p.returncode == 0, p.stderr
    text = json.loads(p.stdout)["models"]["chat_template"]["text"]
    assert text.startswith(f"--chat-template-file {f}: Jinja, ")
