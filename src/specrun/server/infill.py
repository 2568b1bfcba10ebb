"""The prompt of an ``/infill`` request, built as llama-server's ``format_prompt_infill`` builds it.

Repo-level fill-in-the-middle (Qwen2.5-Coder's format, arXiv 2409.12186) where the vocabulary has
the repository and file-separator tokens::

    <FIM_REP>myproject\\n
    <FIM_SEP>{chunk 0 filename}\\n{chunk 0 text}
    ...
    <FIM_SEP>filename\\n
    <FIM_PRE>{input_prefix}{prompt}<FIM_SUF>{input_suffix}<FIM_MID>

(the prompt, llama.vim's text of the cursor's line before the cursor, right after the prefix, where
llama-server's code puts it; its README draws it after ``<FIM_MID>``), else each extra chunk after llama-server's separator text ``\\n\\n--- snippet ---\\n\\n``. SPM order
(``spm``: suffix before prefix) puts ``<FIM_SUF>suffix`` first. The prefix keeps at most its last
3/4 of a batch and the suffix its first (batch/4 - 2 - the prompt's tokens); the extra context
keeps its *last* ``n_ctx - n_batch - 2 n_predict`` tokens (n_predict the server's default, -1),
llama-server's own limits, so that an editor's requests look alike to both servers. specrun then
drops more of the extra context's front where the whole would not leave a position to generate.
The prefix, suffix and extra text are read with special tokens as plain text (a file that contains
``<|fim_middle|>`` does not steer the model); the prompt with them parsed, as llama-server reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specrun.llama.fim import NULL, FimTokens

SNIPPET = "\n\n--- snippet ---\n\n"  # llama-server's chunk separator without <FIM_SEP>
REPO = "myproject\n"  # llama-server's repository name (its TODO: an input)
FILE = "filename\n"  # llama-server's name of the file being edited (its TODO)


@dataclass
class Infill:
    tokens: list[int]
    truncated: bool  # some of the prefix, suffix or extra context did not fit
    n_extra: int  # extra-context tokens kept
    n_extra_dropped: int


def _mixed(model: Any, v: Any, add_special: bool, parse_special: bool) -> list[int]:
    """llama-server's ``tokenize_mixed``: a string, or an array of strings and token ids."""
    if isinstance(v, str):
        return list(model.tokenize(v, add_special, parse_special)) if v else []
    out: list[int] = []
    for i, p in enumerate(v):
        if isinstance(p, str):
            out += model.tokenize(p, add_special and i == 0, parse_special) if p else []
        else:
            out.append(int(p))
    return out


def format_infill(
    model: Any,
    fim: FimTokens,
    prefix: str | list[Any],
    suffix: str | list[Any],
    extra: list[dict[str, str]],
    prompt_tokens: list[int],
    *,
    n_batch: int,
    n_ctx: int,
    n_predict: int = -1,
    spm: bool = False,
) -> Infill:
    tok = model.tokenize
    extra_tokens: list[int] = []
    if fim.rep != NULL:
        extra_tokens += [fim.rep, *tok(REPO, False, False)]
    for chunk in extra:
        if fim.sep != NULL:
            extra_tokens += [fim.sep, *tok(chunk.get("filename", "tmp") + "\n", False, False)]
        else:
            extra_tokens += tok(SNIPPET, False, False)
        text = chunk.get("text", "")
        extra_tokens += tok(text, False, False) if text else []
    if fim.sep != NULL:
        extra_tokens += [fim.sep, *tok(FILE, False, False)]

    pre = _mixed(model, prefix, False, False)
    suf = _mixed(model, suffix, False, False)
    n_prefix_take = min(len(pre), 3 * (n_batch // 4))
    n_suffix_take = min(len(suf), max(0, n_batch // 4 - (2 + len(prompt_tokens))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))

    truncated = n_prefix_take < len(pre) or n_suffix_take < len(suf)
    pre = [fim.pre, *pre[len(pre) - n_prefix_take :], *prompt_tokens]
    suf = [fim.suf, *suf[:n_suffix_take]]
    first, second = (suf, pre) if spm else (pre, suf)
    if fim.add_bos:
        first = [fim.bos, *first]
    core = len(first) + len(second) + 1  # + <FIM_MID>
    # specrun's own limit on top: the whole leaves at least one position to generate into.
    n_extra_take = max(0, min(n_extra_take, n_ctx - 1 - core))
    kept = extra_tokens[len(extra_tokens) - n_extra_take :] if n_extra_take else []
    truncated = truncated or n_extra_take < len(extra_tokens)
    return Infill(
        tokens=[*kept, *first, *second, fim.mid],
        truncated=truncated,
        n_extra=n_extra_take,
        n_extra_dropped=len(extra_tokens) - n_extra_take,
    )
