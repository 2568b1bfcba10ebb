"""Logit biases and repetition penalties: llama.cpp's ``logit_bias`` and ``penalties`` samplers.

Both change the *target's* distribution, so the engine applies them to every row it verifies,
row j with the history up to that row (the prompt, the tokens kept so far and the drafts d_1..d_j
before it). The accept test then compares the draft against the penalised target, and speculation
stays exact against the target decoding alone with the same settings: greedy takes the argmax of
the transformed row, sampling transforms the transformed row (sampling.transform).

What each does, as llama.cpp (src/llama-sampling.cpp) and llama-server apply them, in this order:

- ``logit_bias``: ``logit[id] += bias`` (-inf forbids the token); ``ignore_eos`` adds -inf to every
  end-of-generation token (llama-server builds it as a logit bias too);
- ``penalties`` (``llama_sampler_penalties_apply``), over the last ``repeat_last_n`` tokens of the
  history (the prompt included: llama-server accepts the prompt into its sampler; -1: the whole
  history, 0: off): a token seen ``c`` times there has its logit divided by ``repeat_penalty``
  when positive, multiplied when not, and then ``c * frequency_penalty + (c > 0) *
  presence_penalty`` subtracted (OpenAI's definitions).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from specrun.decoding.sampling import SamplingParams


def penalises(params: SamplingParams) -> bool:
    """Whether the penalties sampler changes anything (llama.cpp's early return)."""
    return params.repeat_last_n != 0 and (
        params.repeat_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def active(params: SamplingParams) -> bool:
    """Whether the rows need transforming at all."""
    return bool(params.logit_bias) or params.ignore_eos or penalises(params)


class RowTransform:
    """The bias and penalties of one verify pass: ``apply`` a row, then ``push`` the draft token
    that the next row follows."""

    def __init__(
        self, params: SamplingParams, history: Sequence[int], eog: Sequence[int] = ()
    ) -> None:
        bias: dict[int, float] = {}
        for tok, b in params.logit_bias:
            bias[tok] = bias.get(tok, 0.0) + b
        if params.ignore_eos:
            for tok in eog:
                bias[tok] = -np.inf
        self.bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self.bias = np.fromiter(bias.values(), dtype=np.float64, count=len(bias))
        self.on = penalises(params)
        self.repeat = params.repeat_penalty
        self.freq = params.frequency_penalty
        self.pres = params.presence_penalty
        n = params.repeat_last_n
        self.n = 1 << 62 if n < 0 else n  # -1: the whole history (at most the context)
        self.window: deque[int] = deque(history[-self.n :] if self.on and self.n > 0 else ())
        self.counts: Counter[int] = Counter(self.window)

    def push(self, token: int) -> None:
        if not self.on:
            return
        self.window.append(token)
        self.counts[token] += 1
        if len(self.window) > self.n:
            old = self.window.popleft()
            self.counts[old] -= 1
            if not self.counts[old]:
                del self.counts[old]

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A transformed copy of ``logits`` (the row itself is left as the model wrote it)."""
        out = np.array(logits, dtype=np.float32, copy=True)
        n_vocab = out.shape[0]
        if self.bias_ids.size:
            ok = self.bias_ids < n_vocab
            ids = self.bias_ids[ok]
            out[ids] = (out[ids].astype(np.float64) + self.bias[ok]).astype(np.float32)
        if self.on and self.counts:
            ids = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
            c = np.fromiter(self.counts.values(), dtype=np.float64, count=len(self.counts))
            keep = ids < n_vocab
            ids, c = ids[keep], c[keep]
            lg = out[ids].astype(np.float64)
            lg = np.where(lg <= 0.0, lg * self.repeat, lg / self.repeat)
            lg = lg - (c * self.freq + (c > 0) * self.pres)
            out[ids] = lg.astype(np.float32)
        return out


def eog_ids(target: object) -> list[int]:
    """Every end-of-generation token of ``target``'s vocabulary (``ignore_eos``)."""
    is_eog = target.is_eog  # type: ignore[attr-defined]
    n = int(target.n_vocab)  # type: ignore[attr-defined]
    return [t for t in range(n) if is_eog(t)]
