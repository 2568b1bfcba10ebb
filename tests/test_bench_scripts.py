"""bench/ holds the maintained measuring scripts and nothing else: each imports (its module-level
set-up runs: a layout move that left one reading a file from its old place once broke
bench/modes_compare.py, and with it server_compare.py, unseen until a benchmark was run) and has
a main; none reaches another through sys.path (what they share is specrun.benchmark.harness);
models load through session, as the command line loads them; prompts come from the one set."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py"))
MAINTAINED = {
    "grammar_overhead",
    "infill_compare",
    "modes_compare",
    "record_greedy",
    "rpc_compare",
    "serve_load",
    "serve_ttft",
    "server_compare",
    "prompt_eval",
    "structured_compare",
    "suffix_sim",
    "verify_cost",
}
# verify_cost times one model file's kernels, also placed as llama.cpp places them
# (LoadOptions(exact_rows=False)) and under other builds' libraries: a placement session does
# not offer by design, so it builds its one Model itself.
OWN_LOADER = {"verify_cost"}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _tree(name: str) -> ast.Module:
    return ast.parse((BENCH / f"{name}.py").read_text(encoding="utf-8"))


def test_bench_holds_the_maintained_scripts_only():
    assert set(SCRIPTS) == MAINTAINED
    assert sorted(p.name for p in BENCH.iterdir() if p.suffix != ".py") in ([], ["__pycache__"])


@pytest.mark.parametrize("name", SCRIPTS)
def test_bench_script_imports_and_has_a_main(name, monkeypatch):
    monkeypatch.setattr(sys, "argv", [name])
    mod = _load(name)
    assert callable(getattr(mod, "main", None)), f"bench/{name}.py has no main()"


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_script_reaches_another(name):
    """No sys.path edits, no import of a sibling script: shared code lives in specrun.benchmark."""
    tree = _tree(name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "path":
            assert not (isinstance(node.value, ast.Name) and node.value.id == "sys"), (
                f"bench/{name}.py touches sys.path"
            )
        if isinstance(node, ast.ImportFrom) and node.module:
            assert node.module.split(".")[0] not in SCRIPTS, f"bench/{name}.py imports a script"
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] not in SCRIPTS, f"bench/{name}.py imports a script"


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - OWN_LOADER))
def test_models_load_through_session(name):
    """No Model(...), LoadOptions(...) or Registry.load() by hand: harness.load_pair (session)."""
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Call):
            f = node.func
            called = f.id if isinstance(f, ast.Name) else ast.unparse(f)
            assert called not in ("Model", "LoadOptions", "Registry.load"), (
                f"bench/{name}.py builds a model by hand ({called})"
            )


def test_one_prompt_set():
    from specrun.benchmark import harness
    from specrun.benchmark.suite import load_suite

    assert set(harness.PROMPTS) == {"code", "code2", "code-edit", "summarize", "qa", "story"}
    where, prompts = load_suite(harness.WORKLOADS)
    assert Path(where).name == "workloads.jsonl"
    assert {p.category for p in prompts} >= {harness.SINGLE, "sql", "json_extract", "code_edit"}
    assert set(_load("serve_load").BUILTIN) <= set(harness.PROMPTS)
    assert set(_load("rpc_compare").PROMPT_NAMES) <= set(harness.PROMPTS)
    for name in SCRIPTS:  # no script keeps a prompt table of its own
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    assert not (isinstance(t, ast.Name) and t.id in ("PROMPTS", "PASSAGE")), name


def test_verify_cost_reads_a_build_s_environment_settings():
    """--specrun-env 'NAME=VALUE ...': specrun's build again under those settings; anything
    else is refused in one line, before a child runs."""
    verify_cost = _load("verify_cost")
    got = verify_cost._settings("SPECRUN_SPLIT_ROWS=0  SPECRUN_F16_ROW_COLS=0 EMPTY=")
    assert got == [("SPECRUN_SPLIT_ROWS", "0"), ("SPECRUN_F16_ROW_COLS", "0"), ("EMPTY", "")]
    for bad in ("SPECRUN_SPLIT_ROWS", "=1", "   "):
        with pytest.raises(SystemExit, match="--specrun-env"):
            verify_cost._settings(bad)
