"""Shared fixtures: the real models of the built-in pairs, loaded once per test session.

`make test` runs `make install` first, which pulls the default pair; the fixtures pull whatever
else they need through the registry (a model already present costs nothing).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# A test run started in the background by a shell without job control (`make test &` in a
# script) inherits SIGINT ignored, and so would every child it starts: the tests that press
# Ctrl-C on a child then saw it ignored (exit 0, not 130). Children of a process that handles
# SIGINT start with the default action.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parent.parent
SPECRUN = str(Path(sys.executable).with_name("specrun"))

SMOL_TARGET = "smollm2-135m-instruct-f32"
DEFAULT_TARGET = "smollm2-135m-instruct-f16"  # the default pair's target (an F16, as people run)
SMOL_DRAFT = "smollm2-135m-instruct-q4_0"
SMOL_Q4_1 = "smollm2-135m-instruct-q4_1"
GEMMA_TARGET = "gemma-3-270m-f32"
GEMMA_DRAFT = "gemma-3-270m-q4_k_m"

THREADS = int(os.environ.get("SPECRUN_TEST_THREADS", "2"))

# A test that takes one of these fixtures loads (or pulls) a real model: it gets the `models`
# marker, so `make test-fast` (-m "not models and not slow") leaves it out. A test that runs the
# command line on a real model without them says @pytest.mark.models itself.
MODEL_FIXTURES = {
    "model_path",
    "smol_target",
    "smol_draft",
    "gemma_target",
    "gemma_draft",
    "pairs",
    "self_draft",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.models)


@pytest.fixture(scope="session")
def registry():
    from specrun.models.registry import Registry

    return Registry.load()


@pytest.fixture(scope="session")
def model_path(registry):
    """model_path(name) -> local GGUF path of a registry model, pulled if missing."""

    def get(name: str) -> Path:
        return registry.ensure(name)

    return get


def _load(path: Path, n_ctx: int = 2048, draft: bool = False):
    from specrun.llama.model import LoadOptions, Model

    # Drafts as the command line loads them (on a CPU with AMX: one row per decode).
    return Model(path, LoadOptions(n_ctx=n_ctx, n_threads=THREADS, amx_rows=draft))


@pytest.fixture(scope="session")
def smol_target(model_path):
    m = _load(model_path(SMOL_TARGET))
    yield m
    m.close()


@pytest.fixture(scope="session")
def smol_draft(model_path):
    m = _load(model_path(SMOL_DRAFT), draft=True)
    yield m
    m.close()


@pytest.fixture(scope="session")
def gemma_target(model_path):
    m = _load(model_path(GEMMA_TARGET))
    yield m
    m.close()


@pytest.fixture(scope="session")
def gemma_draft(model_path):
    m = _load(model_path(GEMMA_DRAFT), draft=True)
    yield m
    m.close()


@pytest.fixture(scope="session")
def pairs(smol_target, smol_draft, gemma_target, gemma_draft):
    return {"smollm2": (smol_target, smol_draft), "gemma3": (gemma_target, gemma_draft)}


def build_number_with(name: str, value: str | None) -> int:
    """What the build reports for ``name`` in its system info (``backend.build_number``) in a
    fresh process whose environment variable of the same name is ``value`` (unset for None)."""
    code = f"from specrun.llama.backend import build_number; print(build_number({name!r}))"
    env = {k: v for k, v in os.environ.items() if k != name}
    if value is not None:
        env[name] = value
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.strip().splitlines()[-1])


def assert_same_as_target(got, want, label: str) -> None:
    """A speculative run said exactly what the target alone said, in no more target passes."""
    assert got.tokens == want.tokens, f"{label} diverged"
    assert got.text == want.text
    assert got.finish_reason == want.finish_reason
    assert got.stats.target_passes <= want.stats.target_passes


def assert_rows_exact(model, prompt: list[int], sizes, label: str, n: int = 12) -> None:
    """What greedy exactness rests on: ``n`` rows decoded after ``prompt`` one at a time, then
    again in batches of each size, get the same logits bit for bit. Leaves the cache empty."""
    import numpy as np

    p = len(prompt)
    model.clear()
    model.decode(prompt, 0, logits_from=p - 1)
    alone, toks = [model.logits(-1).copy()], []
    for i in range(n):
        toks.append(int(np.argmax(alone[-1])))
        model.decode([toks[-1]], p + i, logits_from=0)
        alone.append(model.logits(0).copy())
    for rows in sizes:
        model.truncate(p)
        pos, batched = p, []
        for start in range(0, n, rows):
            chunk = toks[start : start + rows]
            model.decode(chunk, pos, logits_from=0)
            batched += [model.logits(r).copy() for r in range(len(chunk))]
            pos += len(chunk)
        for i, (a, b) in enumerate(zip(alone[1:], batched, strict=True)):
            assert np.array_equal(a, b), (
                f"{label}: row {i} in batches of {rows} differs from one-at-a-time decoding by "
                f"up to {np.max(np.abs(a - b)):.1e}"
            )
    model.clear()
