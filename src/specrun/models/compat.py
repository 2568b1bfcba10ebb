"""Can a draft model speculate for a target? llama.cpp's rules (common/speculative.cpp).

Pure logic over vocabulary facts, so it is testable without models and reports every failing
rule, not just the first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

VOCAB_MAX_SIZE_DIFFERENCE = 128  # llama.cpp SPEC_VOCAB_MAX_SIZE_DIFFERENCE
VOCAB_CHECK_START_TOKEN_ID = 5  # llama.cpp SPEC_VOCAB_CHECK_START_TOKEN_ID

VOCAB_TYPES = {0: "none", 1: "SPM", 2: "BPE", 3: "WPM", 4: "UGM", 5: "RWKV", 6: "PLaMo2"}


class Facts(Protocol):
    @property
    def vocab_type(self) -> int: ...
    @property
    def n_vocab(self) -> int: ...
    @property
    def add_bos(self) -> bool: ...
    @property
    def add_eos(self) -> bool: ...
    @property
    def bos(self) -> int: ...
    @property
    def eos(self) -> int: ...


def problems(
    target: Facts,
    draft: Facts,
    target_text: Callable[[int], bytes],
    draft_text: Callable[[int], bytes],
) -> list[str]:
    """Every rule the pair breaks, as readable sentences; empty when compatible."""
    out: list[str] = []
    if target.vocab_type != draft.vocab_type:
        out.append(
            f"vocabulary type differs: target {VOCAB_TYPES.get(target.vocab_type, target.vocab_type)}, "
            f"draft {VOCAB_TYPES.get(draft.vocab_type, draft.vocab_type)}"
        )
    if target.add_bos != draft.add_bos:
        out.append(f"add-BOS flag differs: target {target.add_bos}, draft {draft.add_bos}")
    if target.add_eos != draft.add_eos:
        out.append(f"add-EOS flag differs: target {target.add_eos}, draft {draft.add_eos}")
    if target.bos != draft.bos:
        out.append(f"BOS token id differs: target {target.bos}, draft {draft.bos}")
    if target.eos != draft.eos:
        out.append(f"EOS token id differs: target {target.eos}, draft {draft.eos}")
    diff = abs(target.n_vocab - draft.n_vocab)
    if diff > VOCAB_MAX_SIZE_DIFFERENCE:
        out.append(
            f"vocabulary sizes differ by {diff} (> {VOCAB_MAX_SIZE_DIFFERENCE}): "
            f"target {target.n_vocab}, draft {draft.n_vocab}"
        )
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(target.n_vocab, draft.n_vocab)):
        a, b = target_text(i), draft_text(i)
        if a != b:
            out.append(
                f"draft vocabulary differs from the target's at token {i}: {_show(b)} vs {_show(a)}"
            )
            break
    return out


def _show(text: bytes) -> str:
    return repr(text.decode("utf-8", errors="replace"))
