"""Draft models on CPUs with AMX: weights stay in llama.cpp's AMX buffers and every decode goes
one row at a time (runtime.LoadOptions.amx_rows).

llama.cpp 0.3.36's AMX matmul has two kernels: one row (AVX512-VNNI, sound, ~2x faster than
the repacked or plain kernels for a Q4_0 draft) and 2+ rows (AMX tiles, which segfault:
ggml-org/llama.cpp#20824). A draft decodes one token per step, so it keeps the fast kernel and
its few batches (the prompt, a catch-up) are split into single rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import SMOL_DRAFT, SMOL_TARGET, THREADS


def test_split_decode_keeps_every_row_asked_for(smol_draft, monkeypatch):
    """Whatever the CPU: a batch decoded row by row gives the rows that asked for logits, the
    same numbers as decoding those tokens one call at a time, and the KV cache ends the same."""
    m = smol_draft
    monkeypatch.setattr(m, "single_rows", True)
    toks = m.tokenize("def add(a, b):\n    return a + b\n\nprint(add(2, 3))", add_special=True)
    n = len(toks)
    m.clear()
    m.decode(toks, 0, logits_from=n - 3)
    got = [m.logits(r).copy() for r in (n - 3, n - 2, n - 1)]
    assert np.array_equal(m.logits(-1), got[-1])
    with pytest.raises(Exception, match="no logits"):
        m.logits(n - 4)
    m.decode([toks[0]], n, logits_from=0)
    after = m.logits(0).copy()

    m.clear()
    want = []
    for i, t in enumerate(toks):
        m.decode([t], i, logits_from=0 if i >= n - 3 else None)
        if i >= n - 3:
            want.append(m.logits(0).copy())
    m.decode([toks[0]], n, logits_from=0)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)
    assert np.array_equal(after, m.logits(0))  # the cache held the same n tokens
    m.clear()


def test_split_decode_with_only_the_last_row(smol_draft, monkeypatch):
    m = smol_draft
    monkeypatch.setattr(m, "single_rows", True)
    toks = m.tokenize("The quick brown fox", add_special=True)
    m.clear()
    m.decode(toks, 0, logits_from=len(toks) - 1)
    last = m.logits(len(toks) - 1)
    assert np.array_equal(last, m.logits(-1))
    m.decode(toks, len(toks))  # no logits asked for: none kept
    with pytest.raises(Exception, match="no logits"):
        m.logits(-1)
    m.clear()


def _has_amx() -> bool:
    from specrun.llama.buffers import cpu_extra_buffer_types

    return "AMX" in cpu_extra_buffer_types()


@pytest.mark.skipif(not _has_amx(), reason="the CPU backend offers no AMX buffers here")
def test_amx_draft_decodes_batches_without_crashing(model_path):
    """On an AMX CPU: the draft's weights are in AMX buffers and a batch is split (a crash in
    llama.cpp would kill the process, hence the subprocess); the target keeps weights out."""
    code = textwrap.dedent(f"""
        import json
        from specrun.llama.model import LoadOptions, Model
        d = Model({str(model_path(SMOL_DRAFT))!r}, LoadOptions(n_ctx=256, n_threads={THREADS}, amx_rows=True))
        t = Model({str(model_path(SMOL_TARGET))!r}, LoadOptions(n_ctx=256, n_threads={THREADS}))
        toks = d.tokenize("one two three four five six seven", add_special=True)
        d.decode(toks, 0, logits_from=len(toks) - 5)
        t.decode(toks, 0, logits_from=len(toks) - 5)
        print(json.dumps(dict(draft=d.load_report["weight_buffers"], rows=d.single_rows,
                              target_rows=t.single_rows, top=int(d.logits(-1).argmax()))))
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SPECRUN_ALLOW_AMX": "0"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert "AMX" in got["draft"] and got["rows"] is True and got["target_rows"] is False
