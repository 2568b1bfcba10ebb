"""patches/...-row-split.patch: how a matmul of one or a few activation columns is cut among the
threads (SPECRUN_SPLIT_ROWS: up to that many columns, chunks of weight rows as a single column's),
and a single F16 column by the multi-column kernel (SPECRUN_F16_ROW_COLS). Neither may change a
logit: the same kernel sums every (row, column) pair either way, and the multi-column kernel sums
a pair as upstream's ggml_vec_dot_f16 does. Each setting is read once per process, so each runs in
a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import DEFAULT_TARGET, THREADS, build_number_with

from specrun.llama.backend import system_info

Q4_K_M = "smollm2-135m-instruct-q4_k_m"

PATCHED = "SPECRUN_SPLIT_ROWS" in system_info()
SWITCHES = ("SPECRUN_SPLIT_ROWS", "SPECRUN_F16_ROW_COLS")

DUMP = textwrap.dedent(
    """
    import sys
    import numpy as np
    from specrun.llama.model import LoadOptions, Model
    path, out, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    m = Model(path, LoadOptions(n_ctx=512, n_threads=threads, n_outputs_max=16))
    toks = m.tokenize(
        "The history of the printing press begins in the fifteenth century, when a goldsmith "
        "in Mainz combined a screw press with movable metal type.", add_special=True)
    n = len(toks)
    m.decode(toks[:-1], 0)
    rows = []
    m.decode([toks[-1]], n - 1, logits_from=0)  # one row
    rows.append(m.logits(0).copy())
    m.truncate(n - 1)
    m.decode([toks[-1], 1, 2, 3], n - 1, logits_from=0)  # four rows: a verify pass
    rows += [m.logits(i).copy() for i in range(4)]
    np.save(out, np.stack(rows))
    """
)


def _logits(path, tmp_path, env: dict[str, str]) -> np.ndarray:
    out = tmp_path / f"rows-{len(list(tmp_path.iterdir()))}.npy"
    full = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    full.update(env)
    r = subprocess.run(
        [sys.executable, "-c", DUMP, str(path), str(out), str(THREADS)],
        capture_output=True, text=True, timeout=300, env=full,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return np.load(out)


@pytest.mark.skipif(not PATCHED, reason="a build without patches/'s row split")
def test_the_build_reports_its_split_and_its_single_f16_rows():
    """Up to 32 columns split as one by default, SPECRUN_SPLIT_ROWS (0-256) sets it; a single F16
    column by the multi-column kernel unless SPECRUN_F16_ROW_COLS=0. The CPU backend reports both
    (`specrun info`'s system line, so a calibration is keyed by them)."""
    assert build_number_with("SPECRUN_SPLIT_ROWS", None) == 32
    assert build_number_with("SPECRUN_SPLIT_ROWS", "0") == 0
    assert build_number_with("SPECRUN_SPLIT_ROWS", "1000") == 256
    assert build_number_with("SPECRUN_SPLIT_ROWS", "-3") == 0
    if "SPECRUN_F16_ROW_COLS" in system_info():
        assert build_number_with("SPECRUN_F16_ROW_COLS", None) == 1
        assert build_number_with("SPECRUN_F16_ROW_COLS", "0") == 0


@pytest.mark.models
@pytest.mark.skipif(not PATCHED, reason="a build without patches/'s row split")
@pytest.mark.parametrize("name", [DEFAULT_TARGET, Q4_K_M])
def test_the_split_and_the_single_row_kernel_leave_every_logit_as_it_was(
    model_path, tmp_path, name
):
    """A row alone and the four rows of a verify pass, under upstream's split and single-row F16
    kernel (SPECRUN_SPLIT_ROWS=0, SPECRUN_F16_ROW_COLS=0) and under this build's: the same logits
    bit for bit, and each batch row the row alone's (the first)."""
    path = model_path(name)
    upstream = _logits(path, tmp_path, {"SPECRUN_SPLIT_ROWS": "0", "SPECRUN_F16_ROW_COLS": "0"})
    ours = _logits(path, tmp_path, {})
    assert np.array_equal(upstream, ours)
    assert np.array_equal(ours[0], ours[1])  # the pending token's row, alone and in the batch
    if name == DEFAULT_TARGET:  # each switch alone
        for env in ({"SPECRUN_SPLIT_ROWS": "0"}, {"SPECRUN_F16_ROW_COLS": "0"}):
            assert np.array_equal(_logits(path, tmp_path, env), ours), env
