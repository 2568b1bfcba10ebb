"""Every script under bench/ imports (its module-level set-up runs) and has a main: a layout move
that left one reading a file from its old place broke bench/modes_compare.py, and with it
bench/server_compare.py, unseen until a benchmark was run. Helper modules (no ``__main__``
block, e.g. llama_ngram.py) must import."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py"))


def test_bench_has_scripts():
    assert {"modes_compare", "server_compare", "verify_cost"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_bench_script_imports(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [name])
    mod = importlib.import_module(name)
    if "__main__" in (BENCH / f"{name}.py").read_text(encoding="utf-8"):
        assert callable(getattr(mod, "main", None)), f"bench/{name}.py has no main()"


def test_verify_cost_reads_a_build_s_environment_settings(monkeypatch):
    """--specrun-env 'NAME=VALUE ...': specrun's build again under those settings; anything
    else is refused in one line, before a child runs."""
    monkeypatch.syspath_prepend(str(BENCH))
    verify_cost = importlib.import_module("verify_cost")
    got = verify_cost._settings("SPECRUN_SPLIT_ROWS=0  SPECRUN_F16_ROW_COLS=0 EMPTY=")
    assert got == [("SPECRUN_SPLIT_ROWS", "0"), ("SPECRUN_F16_ROW_COLS", "0"), ("EMPTY", "")]
    for bad in ("SPECRUN_SPLIT_ROWS", "=1", "   "):
        with pytest.raises(SystemExit, match="--specrun-env"):
            verify_cost._settings(bad)
