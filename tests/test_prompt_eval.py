"""A prompt takes the fastest kernels (llamafile's sgemm at any size: patches/...-sgemm-by-pass),
verify passes and single rows keep the row-exact ones: the switch is per pass, and it always
switches back."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def setter():  # type: ignore[no-untyped-def]
    from specrun.llama import native

    fn = native.sgemm_setter()
    if fn is None:
        pytest.skip("this llama-cpp-python build lacks specrun_set_sgemm_rows (sgemm-by-pass)")
    return fn


def test_verify_rows_stay_exact_after_a_fast_prompt(smol_target, setter) -> None:  # type: ignore[no-untyped-def]
    """After ``prefill`` (sgemm), rows decoded in batches of 2-9 equal rows decoded alone; also
    after a prefill that failed (the switch is undone in a finally)."""
    from specrun.errors import SpecrunError

    m = smol_target
    prompt = m.tokenize("The history of the lighthouse, told briefly: ", True, False)
    m.clear()
    with pytest.raises(SpecrunError):
        m.prefill(list(range(10, 10 + m.n_ctx + 1)), 0)  # past the context: refused
    m.prefill(prompt[:-1], 0)
    m.decode(prompt[-1:], len(prompt) - 1, logits_from=0)
    alone, toks = [m.logits(0).copy()], []
    for i in range(9):
        toks.append(int(np.argmax(alone[-1])))
        m.decode([toks[-1]], len(prompt) + i, logits_from=0)
        alone.append(m.logits(0).copy())
    for rows in (2, 5, 9):
        m.truncate(len(prompt))
        got = []
        for start in range(0, 9, rows):
            chunk = toks[start : start + rows]
            m.decode(chunk, len(prompt) + start, logits_from=0)
            got += [m.logits(r).copy() for r in range(len(chunk))]
        for i, (a, b) in enumerate(zip(alone[1:], got, strict=True)):
            assert np.array_equal(a, b), f"row {i} in batches of {rows}, after a fast prompt"
    m.clear()


def test_the_fast_prompt_is_another_path(smol_target, setter) -> None:  # type: ignore[no-untyped-def]
    """The prompt's path really changes (its KV differs in the last bits from the row-exact
    path's), and decode() alone never takes it: a 40-token prompt decoded twice by decode()
    gives the same last row; by prefill() the same as itself."""
    m = smol_target
    prompt = m.tokenize("Speculative decoding drafts tokens cheaply and verifies them. " * 4)
    rows = {}
    for how in ("decode", "prefill", "decode", "prefill"):
        m.clear()
        getattr(m, how)(prompt[:-1], 0)
        m.decode(prompt[-1:], len(prompt) - 1, logits_from=0)
        rows.setdefault(how, []).append(m.logits(0).copy())
    assert np.array_equal(*rows["decode"]) and np.array_equal(*rows["prefill"])
    # F16 weights: sgemm sums in another order, so the rows differ (if only in the last bits).
    assert not np.array_equal(rows["decode"][0], rows["prefill"][0])
    m.clear()
