"""Row exactness on every weight format people run: a row verified inside a batch gets, bit for
bit, the logits it gets when decoded alone. Greedy speculation equals the target alone only if
this holds; it is what the build (patches/, Makefile) is chosen for.

The formats come from the registry (SmolLM2 F32, F16, Q8_0, Q4_K_M, Q4_0, Q4_1), and BF16, Q5_K_M,
Q6_K and IQ4_XS are derived once from its F32 into $SPECRUN_HOME/derived."""

from __future__ import annotations

import os

import pytest
from conftest import SMOL_TARGET, THREADS, assert_rows_exact, build_number_with

from specrun.llama.backend import batch_exact_cpu, system_info
from specrun.llama.buffers import amx_batches_sound, cpu_extra_buffer_types
from specrun.llama.model import LoadOptions, Model
from specrun.llama.quantize import quantize
from specrun.paths import specrun_home

pytestmark = pytest.mark.models

AMX_HERE = "AMX" in cpu_extra_buffer_types() and amx_batches_sound()
FORMATS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"]
TEXT = (
    "The history of the printing press begins in the fifteenth century, when a goldsmith in "
    "Mainz combined a screw press with movable metal type. "
)


REGISTRY = {
    "F32": SMOL_TARGET,
    "Q4_0": "smollm2-135m-instruct-q4_0",
    "Q4_1": "smollm2-135m-instruct-q4_1",
    "F16": "smollm2-135m-instruct-f16",
    "Q8_0": "smollm2-135m-instruct-q8_0",
    "Q4_K_M": "smollm2-135m-instruct-q4_k_m",
}


def derived(model_path, fmt: str):
    if fmt in REGISTRY:
        return model_path(REGISTRY[fmt])
    src = model_path(SMOL_TARGET)
    out = specrun_home() / "derived" / f"{src.stem}.{fmt}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + f".{os.getpid()}.part")
        quantize(src, tmp, fmt)
        os.replace(tmp, out)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_rows_equal_single_rows(model_path, fmt):
    path = derived(model_path, fmt)
    # As the command line loads a target: default buffers (CPU_REPACK where llama.cpp repacks).
    m = Model(path, LoadOptions(n_ctx=1024, n_threads=THREADS, n_outputs_max=16))
    try:
        if fmt in ("Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS") and AMX_HERE:
            # On an AMX CPU with the fixed build: these rows go through AMX's kernels (the
            # K-quant and IQ4_XS files' FFN-down layers, whose rows are whole 256-value blocks).
            assert "AMX" in m.load_report["weight_buffers"], m.load_report
        if fmt == "F16" and AMX_HERE:  # AMX's F16 kernel has no tiles: slow batches
            assert "AMX" not in m.load_report["weight_buffers"], m.load_report
        prompt = m.tokenize(TEXT * 3, add_special=True)  # past a few hundred positions
        assert_rows_exact(
            m, prompt, (2, 3, 4, 5, 9), f"{fmt} (weights in {m.load_report.get('weight_buffers')})"
        )
    finally:
        m.close()


@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_K_M"])
def test_flash_attention_rows_are_exact_past_512_cached_cells(model_path, fmt):
    """With flash attention (on by default for a CPU model where the build says its kernel is
    row-exact), past the 512 cached cells where upstream's kernel splits a single row's pass
    over the cache across threads: a row alone and in a batch get the same logits. Upstream
    parted by up to 5.7e-1 (Q4_K_M) at 561 tokens."""
    from specrun.llama.backend import flash_attn_row_exact

    if not flash_attn_row_exact():
        pytest.skip("this llama.cpp build's flash attention is not the row-exact one (patches/)")
    path = derived(model_path, fmt)
    m = Model(path, LoadOptions(n_ctx=2048, n_threads=THREADS, n_outputs_max=16, flash_attn=True))
    try:
        assert m.load_report.get("flash_attn") == "enabled", m.load_report
        prompt = m.tokenize(TEXT * 20, add_special=True)
        assert len(prompt) > 512
        assert_rows_exact(m, prompt, (2, 5, 9), f"{fmt} with flash attention")
    finally:
        m.close()


def test_flash_attention_by_blocks_agrees_with_attention_without_it(model_path):
    """The build's F16 KV attention by blocks of cells (patches/, SPECRUN_FA_BLOCK) computes
    attention, not only the same numbers alone and in a batch: past 512 cached cells (blocks
    rescaled to a new maximum many times), an F16 target's logits with flash attention are within
    float rounding of its logits without it (softmax(KQ) V as llama.cpp's separate ops do it).
    Measured on a 2-core Zen 3: mean difference 0.008, largest 0.04, logits up to 32; llama.cpp's
    own loop (an F16 accumulator) 0.028 and 0.15."""
    import numpy as np

    from specrun.llama.backend import flash_attn_block

    if not flash_attn_block():
        pytest.skip("this build attends with llama.cpp's own CPU loop (patches/: AVX2+F16C+FMA)")
    path = derived(model_path, "F16")
    out = {}
    for fa in (True, False):
        m = Model(path, LoadOptions(n_ctx=2048, n_threads=THREADS, n_outputs_max=16, flash_attn=fa))
        try:
            prompt = m.tokenize(TEXT * 20, add_special=True)
            assert len(prompt) > 512
            m.decode(prompt[:-5], 0, None)
            m.decode(prompt[-5:], len(prompt) - 5, 0)
            out[fa] = np.stack([m.logits(r) for r in range(5)])  # copies
        finally:
            m.close()
    diff = np.abs(out[True] - out[False])
    assert (out[True].argmax(axis=1) == out[False].argmax(axis=1)).all()
    assert diff.mean() < 0.02 and diff.max() < 0.15, (diff.mean(), diff.max())


@pytest.mark.parametrize("fmt", ["F32", "F16", "Q8_0", "Q4_K_M"])
def test_a_prompt_cut_in_two_long_batches_is_computed_as_whole(model_path, fmt):
    """Batches longer than any verify pass (a prompt's) may take llamafile's sgemm (patches/:
    the build says SPECRUN_SGEMM_ROWS) and flash attention's tiled path: each sums a row alike
    in any such batch, so a prompt decoded in two batches of 66+ rows leaves the same cache as
    the prompt decoded whole (the next row's logits, bit for bit), as a server's prefix reuse
    and chunks of --batch-size need."""
    import numpy as np

    from specrun.llama.backend import MAX_VERIFY_ROWS

    path = derived(model_path, fmt)
    m = Model(path, LoadOptions(n_ctx=1024, n_threads=THREADS, n_outputs_max=16))
    try:
        prompt = m.tokenize(TEXT * 8, add_special=True)
        cut = len(prompt) // 2
        assert min(cut, len(prompt) - cut - 1) > MAX_VERIFY_ROWS
        m.decode(prompt[:-1], 0, None)
        m.decode(prompt[-1:], len(prompt) - 1, 0)
        whole = m.logits(0).copy()
        m.clear()
        m.decode(prompt[:cut], 0, None)
        m.decode(prompt[cut:-1], cut, None)
        m.decode(prompt[-1:], len(prompt) - 1, 0)
        parted = m.logits(0)
        assert np.array_equal(whole, parted), f"{fmt}: up to {np.max(np.abs(whole - parted)):.1e}"
    finally:
        m.close()


@pytest.mark.skipif(
    "SPECRUN_SGEMM_ROWS" not in system_info(), reason="a build without llamafile's sgemm on prompts"
)
def test_sgemm_takes_only_batches_longer_than_a_verify_pass():
    """The build reports the bound (`specrun info`'s system line, so a calibration is keyed by
    it): 66 rows, one more than the longest verify pass; SPECRUN_SGEMM_ROWS raises it (never
    under 66) or, at 0, keeps sgemm off. Row-exact either way."""
    assert batch_exact_cpu()
    assert build_number_with("SPECRUN_SGEMM_ROWS", None) == 66
    assert build_number_with("SPECRUN_SGEMM_ROWS", "0") == 0
    assert build_number_with("SPECRUN_SGEMM_ROWS", "2") == 66
    assert build_number_with("SPECRUN_SGEMM_ROWS", "5000") == 5000


def test_the_exact_bound_is_the_longest_verify_pass():
    from specrun.decoding.engine import MAX_DRAFT
    from specrun.llama.backend import MAX_VERIFY_ROWS

    assert MAX_VERIFY_ROWS == MAX_DRAFT + 1
