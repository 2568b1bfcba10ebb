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
