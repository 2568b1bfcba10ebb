"""Models on CPUs with AMX.

llama.cpp 0.3.36's AMX matmul has two kernels: one row (AVX512-VNNI, ~2x faster than the
repacked or plain kernels for Q4_0 and Q8_0) and 2+ rows (AMX tiles). Upstream's tiles ran with
a garbage tile configuration under GCC 12 (SIGILL or SIGSEGV: ggml-org/llama.cpp#20824);
patches/ loads it whole (the build reports SPECRUN_AMX_TILECFG), and every model keeps AMX, a
target too: the two kernels agree bit for bit. Passes of up to SPECRUN_VNNI_ROWS rows of Q8_0
/ Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K / IQ4_XS take the one-row kernels' arithmetic (patches/: a
2-row pass 1.09 rows instead of the tiles' 1.33 on Q8_0), the same sums. Without the fix a draft keeps AMX
and decodes one row per llama_decode (LoadOptions.amx_rows, Model.single_rows), a target keeps
out of AMX.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import DEFAULT_TARGET, SMOL_DRAFT, THREADS, assert_rows_exact, build_number_with

from specrun.llama import buffers
from specrun.llama import model as model_mod
from specrun.llama.model import LoadOptions, Model

Q8_0 = "smollm2-135m-instruct-q8_0"
Q4_K_M = "smollm2-135m-instruct-q4_k_m"


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
    return "AMX" in buffers.cpu_extra_buffer_types()


needs_amx = pytest.mark.skipif(not _has_amx(), reason="the CPU backend offers no AMX buffers here")


class _Params:
    use_extra_bufts = True
    tensor_buft_overrides = None


def _overrides(params) -> list[tuple[str, int]]:
    import ctypes

    if not params.tensor_buft_overrides:
        return []
    arr = ctypes.cast(params.tensor_buft_overrides, ctypes.POINTER(buffers._BuftOverride))
    out, i = [], 0
    while arr[i].pattern:
        out.append((arr[i].pattern.decode(), arr[i].buft))
        i += 1
    return out


def _no_amx_for_q4_k(tname: str, rows: int, cols: int, real=buffers.amx_fits) -> bool:
    """As if AMX could not take the Q4_K matrices (as it cannot one whose row is not a whole
    number of 256-value super blocks): the rest of a Q4_K_M file (Q6_K, Q8_0) it takes."""
    return tname != "Q4_K" and real(tname, rows, cols)


@pytest.mark.parametrize("sound", [True, False])
def test_placement_on_an_amx_cpu(model_path, monkeypatch, sound):
    """Whatever this CPU (a fake AMX): where the build's AMX batch kernel is sound, llama.cpp's
    own placement stands for a target whose types AMX or a row-exact repacking take; where it
    would part rows (Q4_K neither in AMX nor row-exact repacked) the matrices that AMX takes go
    there by name and the rest stay plain. Where the kernel would crash, a target's weights keep
    out of AMX (Q4_K repacked, by name); a draft keeps llama.cpp's placement either way."""
    monkeypatch.setattr(buffers, "cpu_extra_buffer_types", lambda: {"AMX": 11, "CPU_REPACK": 22})
    monkeypatch.setattr(buffers, "amx_batches_sound", lambda: sound)
    monkeypatch.setattr(buffers, "row_exact_repack", lambda: ("Q4_0", "Q4_K"))
    path = model_path(Q4_K_M)  # SmolLM2's: Q5_0 mostly, Q4_K / Q6_K ffn_down, Q8_0 attn_v

    draft = _Params()
    assert buffers.weight_buffers(path, draft, False, True, False) is None
    assert draft.use_extra_bufts is True

    p = _Params()
    keep = buffers.weight_buffers(path, p, False, False, True)
    if not sound:
        got = _overrides(p)
        assert keep is not None and p.use_extra_bufts is False
        assert got and {b for _pat, b in got} == {22}
        assert all("ffn_down" in pat for pat, _b in got)  # the Q4_K ones, repacked
        return
    assert keep is None and p.use_extra_bufts is True and not _overrides(p)

    monkeypatch.setattr(buffers, "row_exact_repack", lambda: ("Q4_0",))
    monkeypatch.setattr(buffers, "amx_fits", _no_amx_for_q4_k)
    p = _Params()
    keep = buffers.weight_buffers(path, p, False, False, True)
    assert keep is not None and p.use_extra_bufts is False
    got = _overrides(p)
    assert got and {b for _pat, b in got} == {11}
    layers = {
        pat.split(")")[-1]: set(re.search(r"\(([\d|]+)\)", pat).group(1).split("|"))
        for pat, _b in got
    }
    assert set(layers) == {"\\.attn_v\\.weight$", "\\.ffn_down\\.weight$"}, layers
    assert len(layers["\\.attn_v\\.weight$"]) == 14  # the Q8_0 ones (the rest Q5_0)
    assert {"0", "1", "2", "5"} <= layers["\\.ffn_down\\.weight$"]  # Q6_K's
    assert not {"3", "4"} & layers["\\.ffn_down\\.weight$"]  # Q4_K's: plain


@pytest.mark.parametrize("sound", [True, False])
def test_f16_weights_stay_out_of_amx(model_path, monkeypatch, sound):
    """llama.cpp would put F16 layer matrices in AMX too, whose F16 kernel (no tiles) costs a
    5-row pass 1.9 rows where plain buffers cost 1.2: no model, target or draft, keeps them
    there (extra buffer types off, nothing put back by name)."""
    monkeypatch.setattr(buffers, "cpu_extra_buffer_types", lambda: {"AMX": 11, "CPU_REPACK": 22})
    monkeypatch.setattr(buffers, "amx_batches_sound", lambda: sound)
    path = model_path(DEFAULT_TARGET)
    for single_rows, exact in ((False, True), (True, False)):
        p = _Params()
        buffers.weight_buffers(path, p, False, single_rows, exact)
        assert p.use_extra_bufts is False and not _overrides(p)


@needs_amx
def test_amx_models_decode_batches_exactly_in_a_fixed_build(model_path):
    """On an AMX CPU with the fixed build: a Q4_0 draft and a Q8_0 target keep their weights in
    AMX, decode batches whole (no crash: a subprocess), and the target's rows in batches equal
    its rows alone (2-9 rows: the VNNI kernel by chunks of 4, patches/...-amx-vnni-rows.patch;
    10 and 16: the AMX tiles). Without the fix: the draft goes row by row, the target keeps out
    of AMX."""
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import assert_rows_exact
        from specrun.llama.model import LoadOptions, Model
        d = Model({str(model_path(SMOL_DRAFT))!r}, LoadOptions(n_ctx=512, n_threads={THREADS}, amx_rows=True))
        t = Model({str(model_path(Q8_0))!r}, LoadOptions(n_ctx=512, n_threads={THREADS}, n_outputs_max=16))
        toks = d.tokenize("one two three four five six seven eight nine ten eleven", add_special=True)
        d.decode(toks, 0, logits_from=len(toks) - 5)
        assert_rows_exact(t, toks, (2, 3, 4, 5, 9, 10, 16), "Q8_0 target")
        print(json.dumps(dict(draft=d.load_report["weight_buffers"], rows=d.single_rows,
                              target=t.load_report["weight_buffers"], target_rows=t.single_rows)))
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "SPECRUN_ALLOW_AMX"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert "AMX" in got["draft"] and got["target_rows"] is False
    if buffers.amx_batches_sound():
        assert got["rows"] is False and "AMX" in got["target"]
    else:
        assert got["rows"] is True and "AMX" not in got["target"]


@needs_amx
def test_amx_matrices_placed_by_name_are_row_exact(model_path, monkeypatch):
    """The by-name path (what a target takes where llama.cpp's own placement would part rows):
    a Q4_K_M target's layer matrices in AMX through overrides, its rows exact in batches."""
    if not buffers.amx_batches_sound():
        pytest.skip("this build's AMX batch kernel is not the fixed one (patches/)")
    monkeypatch.setattr(buffers, "row_exact_repack", lambda: ("Q4_0",))
    monkeypatch.setattr(buffers, "amx_fits", _no_amx_for_q4_k)
    m = Model(model_path(Q4_K_M), LoadOptions(n_ctx=512, n_threads=THREADS, n_outputs_max=16))
    try:
        assert "AMX" in m.load_report["weight_buffers"], m.load_report
        assert "CPU_REPACK" not in m.load_report["weight_buffers"]
        toks = m.tokenize("The printing press came to Mainz in the fifteenth century.", True)
        assert_rows_exact(m, toks, (2, 3, 5, 9), "Q4_K_M in AMX by name")
    finally:
        m.close()


def test_single_rows_follow_the_build(model_path, monkeypatch):
    """Model.single_rows: only a model asked to (amx_rows) whose weights are in AMX, and only
    where the build's AMX batch kernel is not sound."""
    monkeypatch.setattr(model_mod, "amx_batches_sound", lambda: False)
    d = Model(model_path(SMOL_DRAFT), LoadOptions(n_ctx=256, n_threads=THREADS, amx_rows=True))
    try:
        assert d.single_rows is ("AMX" in d.load_report["weight_buffers"])
    finally:
        d.close()


def test_the_user_has_the_last_word_on_amx(monkeypatch):
    """SPECRUN_ALLOW_AMX=1 / 0 say the build's AMX batch kernel is / is not sound, whatever the
    build reports; unset, the build's flag (patches/) decides."""
    monkeypatch.setattr(buffers, "system_info", lambda: "AMX_INT8 = 1 | SPECRUN_AMX_TILECFG = 1 |")
    monkeypatch.delenv("SPECRUN_ALLOW_AMX", raising=False)
    assert buffers.amx_batches_sound() is True
    monkeypatch.setenv("SPECRUN_ALLOW_AMX", "0")
    assert buffers.amx_batches_sound() is False
    monkeypatch.setattr(buffers, "system_info", lambda: "AMX_INT8 = 1 |")
    assert buffers.amx_batches_sound() is False
    monkeypatch.setenv("SPECRUN_ALLOW_AMX", "1")
    assert buffers.amx_batches_sound() is True
    monkeypatch.delenv("SPECRUN_ALLOW_AMX")
    assert buffers.amx_batches_sound() is False


@needs_amx
def test_the_build_reports_how_many_rows_take_the_one_row_kernel():
    """patches/...-amx-vnni-rows.patch: passes of up to SPECRUN_VNNI_ROWS rows on AMX weights
    (every type AMX takes) take the one-row VNNI kernels' arithmetic (9 unless set; 1 is
    upstream's split), and the CPU backend says how many (`specrun info`'s system line, a
    calibration's key)."""
    seen = {env: build_number_with("SPECRUN_VNNI_ROWS", env) for env in (None, "1", "40")}
    assert seen == {None: 9, "1": 1, "40": 16}
