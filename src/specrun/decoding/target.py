"""What the loop needs of a model: the ``Target`` protocol.

The core never imports llama_cpp: ``specrun.llama.model.Model`` implements this protocol (and the
test fakes do too), so the engine, the drafters and the cost model import and run without the
native build. Both the target and a draft model are ``Target``s; only the roles differ.

The cache invariant every implementation keeps: ``cached`` is exactly the tokens whose keys and
values the context holds, in position order; ``decode`` appends, ``truncate`` drops a tail.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# The softmax top probability of a row of logits, computed natively (None where the build lacks
# it): the --draft-p-min check without a numpy softmax.
TopProbFn = Callable[[np.ndarray], float]

# A copy of a cache's cells (``save_state``): bytes-like, its len() its size.
StateData = bytes | bytearray | mmap.mmap


class Target(Protocol):
    path: Path
    n_vocab: int
    n_ctx: int
    n_batch: int
    n_outputs_max: int  # most rows of logits one decode may return
    llama_seconds: float  # wall time spent inside the native decode, cumulative
    can_truncate: bool  # False for recurrent/hybrid caches that cannot drop a tail
    single_rows: bool  # every decode runs one row at a time (the placement asked for it)
    # Passes shared with other sequences (serve --parallel): a pass's wall time carries their rows
    # and the wait for them, so auto prices a step by ``llama_seconds``, this sequence's share.
    shared: bool
    top_prob_fn: TopProbFn | None
    load_report: dict[str, Any]

    @property
    def bos(self) -> int: ...

    @property
    def cached(self) -> Sequence[int]: ...

    @property
    def n_cached(self) -> int: ...

    def decode(self, tokens: Sequence[int], pos0: int, logits_from: int | None = None) -> None:
        """Evaluate ``tokens`` at positions ``pos0..``; logits on rows ``logits_from..`` (the
        last row alone when None)."""
        ...

    def prefill(self, tokens: Sequence[int], pos0: int) -> None:
        """``decode`` without logits, for a prompt's tokens: evaluated alike by a speculative
        run and a plain one, so an implementation may take faster, not row-exact, kernels."""
        ...

    def logits(self, row: int) -> np.ndarray:
        """Row ``row`` of the last decode's logits (a view, valid until the next decode)."""
        ...

    def truncate(self, n_keep: int) -> None: ...

    def clear(self) -> None: ...

    def piece(self, token: int) -> bytes: ...

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]: ...

    def token_text(self, token: int) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...

    def context_params(self) -> dict[str, Any]: ...

    def machine_key(self) -> str:
        """The build, CPU and backend this model runs on: a pass measured on one is not taken
        for another (calibrate.py)."""
        ...

    def save_state(self) -> tuple[tuple[int, ...], StateData]: ...

    def load_state(self, tokens: Sequence[int], data: StateData) -> None: ...
