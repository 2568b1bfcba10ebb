"""The package's floors, read from the imports themselves (ast), so a change cannot quietly undo them.

    front ends   cli/                  (Typer and Rich)         imports anything below, server/ too
                 server/               (HTTP)                   `specrun serve` mounts it from cli/
    application  session, chat, probe, benchmark, chat_template prints nothing
    models       models/ (registry, files, memory)              may use llama/ (GGUF facts, quantize)
    core         decoding/ (the loop and its math)              never llama/: a Target protocol
    llama        llama/                                         the only importer of llama_cpp
    base         errors, paths

Imports point only downward (a module may also import its own folder), and the graph of all
imports, those inside functions included, has no cycle.
The core (decoding/) imports at the top of its modules, none inside a function but a short list
with reasons (CORE_FUNCTION_IMPORTS).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "specrun"

APPLICATION = {"session", "chat", "probe", "benchmark", "chat_template", "machine", "tools"}
BASE = {"errors", "paths", "defaults", "__init__"}
RANK = {
    "base": 0,
    "llama": 1,
    "decoding": 1,
    "models": 2,
    "application": 3,
    "server": 4,
    "cli": 5,
    "entry": 6,
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 2:
        parts = parts[:-1]
    return ".".join(parts)


def floor(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1 or parts[1] in BASE:
        return "base"
    if parts[1] == "__main__":  # `python -m specrun`
        return "entry"
    if parts[1] in APPLICATION:
        return "application"
    if parts[1] in RANK:
        return parts[1]
    raise AssertionError(
        f"{mod}: a module outside every floor; add it to one in tests/test_layers.py"
    )


def _targets(node: ast.Import | ast.ImportFrom, pkg: str) -> list[str]:
    """The modules one import statement imports (``pkg``: where a relative import starts)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        anchor = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    out = []
    for a in node.names:
        # `from specrun.decoding import engine` imports the module specrun.decoding.engine
        full = f"{base}.{a.name}"
        out.append(full if _is_module(full) else base)
    return out


def _package(path: Path, mod: str) -> str:
    return mod if path.name == "__init__.py" else mod.rpartition(".")[0]


def imports_of(path: Path, mod: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, at any depth."""
    return [
        (node.lineno, t)
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for t in _targets(node, _package(path, mod))
    ]


def function_imports(path: Path, mod: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import inside a function or method of the file."""
    return sorted(
        {
            (node.lineno, t)
            for fn in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for t in _targets(node, _package(path, mod))
        }
    )


def _is_module(name: str) -> bool:
    if not name.startswith("specrun"):
        return False
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    return (PKG / rel).with_suffix(".py").is_file() or (PKG / rel / "__init__.py").is_file()


FILES = sorted(p for p in PKG.rglob("*.py"))
GRAPH = {module_name(p): imports_of(p, module_name(p)) for p in FILES}

# The core imports at the top of its modules: it has no optional dependency, and of it only its
# __init__ and the light costmodel.py are on `specrun --help`'s path (cli/ imports the rest inside
# its commands), so an import inside a function there defers nothing. One that must stay anyway
# is listed here, module -> what it imports there, with why.
CORE_FUNCTION_IMPORTS: dict[str, set[str]] = {}


def test_every_module_has_a_floor() -> None:
    assert len(GRAPH) > 30
    for mod in GRAPH:
        floor(mod)


def test_imports_point_downward() -> None:
    bad = []
    for mod, imports in GRAPH.items():
        here = floor(mod)
        for line, target in imports:
            if not target.startswith("specrun.") or target == "specrun":
                continue
            there = floor(target)
            if there == here:
                same_folder = mod.split(".")[:2] == target.split(".")[:2] or here in (
                    "base",
                    "application",
                )
                if not same_folder:
                    bad.append(f"{mod}:{line} imports {target} ({here} -> {there}, a neighbour)")
            elif RANK[there] >= RANK[here]:
                bad.append(f"{mod}:{line} imports {target} ({here} -> {there}: upward)")
    assert not bad, "\n".join(bad)


def test_only_llama_imports_llama_cpp() -> None:
    bad = [
        f"{mod}:{line}"
        for mod, imports in GRAPH.items()
        for line, t in imports
        if t.split(".")[0] == "llama_cpp" and floor(mod) != "llama"
    ]
    assert not bad, f"llama_cpp imported outside llama/: {bad}"


def test_no_import_cycles() -> None:
    edges = {m: {t for _, t in imps if t in GRAPH and t != m} for m, imps in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_below_the_front_ends_nothing_prints_or_uses_rich() -> None:
    """Only a front end talks to the terminal: the application and the loop return values and take
    callbacks; no layer below the front ends draws with Rich or parses with Typer. (llama/ and
    models/ pass llama.cpp's and pip's own log through to stderr under --verbose.)"""
    bad = []
    for path in FILES:
        mod = module_name(path)
        if floor(mod) in ("cli", "server", "entry"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree) if floor(mod) in ("application", "decoding") else ():
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("print", "input")
            ):
                bad.append(f"{mod}:{node.lineno} calls {node.func.id}()")
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("stdout", "stderr")
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                bad.append(f"{mod}:{node.lineno} uses sys.{node.attr}")
        bad += [
            f"{mod}:{line} imports {t}"
            for line, t in GRAPH[mod]
            if t.split(".")[0] in ("rich", "typer")
        ]
    assert not bad, "\n".join(bad)


def test_the_core_imports_at_the_top() -> None:
    """No import inside a function in decoding/ but those CORE_FUNCTION_IMPORTS lists (and
    every one it lists is still there: an entry that outlived its import goes)."""
    found = {
        mod: function_imports(path, mod)
        for path in FILES
        if floor(mod := module_name(path)) == "decoding"
    }
    bad = [
        f"{mod}:{line} imports {target} inside a function: move it to the top (or list it, "
        "with why, in CORE_FUNCTION_IMPORTS)"
        for mod, imports in found.items()
        for line, target in imports
        if target not in CORE_FUNCTION_IMPORTS.get(mod, set())
    ]
    bad += [
        f"CORE_FUNCTION_IMPORTS lists {target} in {mod}, which no longer imports it inside a "
        "function: drop the entry"
        for mod, targets in CORE_FUNCTION_IMPORTS.items()
        for target in sorted(targets - {t for _, t in found.get(mod, [])})
    ]
    assert not bad, "\n".join(bad)


def test_the_checker_tells_an_import_in_a_function_from_one_at_the_top(tmp_path: Path) -> None:
    src = tmp_path / "specrun" / "decoding" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("import math\n\n\nclass C:\n    def f(self):\n        from . import sampling\n")
    assert function_imports(src, "specrun.decoding.x") == [(6, "specrun.decoding.sampling")]
    assert (1, "math") in imports_of(src, "specrun.decoding.x")


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The rules fail on what they forbid: an upward import read from real source text."""
    src = tmp_path / "specrun" / "decoding" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("def f():\n    from specrun.cli.main import main\n")
    imports = imports_of(src, "specrun.decoding.x")
    assert imports == [(2, "specrun.cli.main")]
    assert RANK[floor("specrun.cli.main")] > RANK[floor("specrun.decoding.x")]


def _members(path: Path, cls: str) -> set[str]:
    """A class's attributes read from source: class-level names and annotations, methods,
    properties and every ``self.X = ...`` in its methods."""
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.FunctionDef) and n in node.body:
            out.add(n.name)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            for t in n.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                    if t.value.id == "self":
                        out.add(t.attr)
                elif isinstance(t, ast.Name) and n in node.body:
                    out.add(t.id)
    return out


def test_the_llama_model_implements_the_core_protocol() -> None:
    """The engine types its models as ``decoding.target.Target``; llama/'s Model must have every
    member (read from the source, so the check needs no native build)."""
    wanted = _members(PKG / "decoding" / "target.py", "Target")
    assert {"decode", "logits", "truncate", "cached", "machine_key"} <= wanted
    missing = wanted - _members(PKG / "llama" / "model.py", "Model")
    assert not missing, f"llama.model.Model lacks {sorted(missing)} of Target"


def _loaded_after(code: str) -> set[str]:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return set(out.split())


def test_the_core_imports_without_llama_cpp() -> None:
    loaded = _loaded_after(
        "import specrun.decoding.engine, specrun.decoding.auto, specrun.decoding.calibrate"
    )
    assert "specrun.decoding.engine" in loaded
    assert not {
        m for m in loaded if m.split(".")[0] == "llama_cpp" or m.startswith("specrun.llama")
    }


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["generate", "--help"]])
def test_help_and_version_load_no_native_or_numeric_module(argv: list[str]) -> None:
    """`specrun --help` and `--version` stay fast: neither llama_cpp nor numpy is imported until
    a command runs."""
    loaded = _loaded_after(f"from specrun.cli.main import main\nassert main({argv!r}) == 0")
    assert "specrun.cli.main" in loaded
    heavy = {m for m in loaded if m.split(".")[0] in ("llama_cpp", "numpy", "fastapi", "uvicorn")}
    assert not heavy, f"{argv} imported {sorted(heavy)[:8]}"
