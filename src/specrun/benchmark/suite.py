"""The bench's prompts: the built-in suite or a Spec-Bench JSON-lines file, selected and grouped
into Spec-Bench's columns."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specrun.errors import UsageError

BUILTIN = "builtin"
# Spec-Bench's leaderboard columns, in its order, then code. MT-bench's own categories (the
# first 80 questions of Spec-Bench's question.jsonl) all count as multi-turn conversation.
COLUMNS = {
    "mt_bench": "MT",
    "translation": "Trans",
    "summarization": "Sum",
    "qa": "QA",
    "math_reasoning": "Math",
    "rag": "RAG",
    "code": "Code",
}
MT_BENCH = {
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
}


# -- the suite ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    question_id: str
    category: str
    turns: tuple[str, ...]

    @property
    def column(self) -> str:
        return column_of(self.category)


def column_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


def load_suite(spec: str) -> tuple[str, list[Prompt]]:
    """``builtin`` or a Spec-Bench JSON-lines file -> (where, prompts). Errors name the line."""
    if spec == BUILTIN:
        where = "builtin suite"
        text = resources.files("specrun").joinpath("data/suite.jsonl").read_text(encoding="utf-8")
    else:
        path = Path(spec)
        where = str(path)
        if path.is_dir():
            raise UsageError(f"--suite: {path} is a directory, not a JSON-lines file")
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"--suite: no such file: {path} (or use --suite builtin)") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"--suite: {path} is not UTF-8 text (byte {exc.start})") from None
        except OSError as exc:
            raise UsageError(f"--suite: cannot read {path}: {exc.strerror}") from None
    return where, parse_suite(text, where)


def parse_suite(text: str, where: str = "suite") -> list[Prompt]:
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue

        def bad(why: str, lineno: int = lineno) -> UsageError:
            return UsageError(f"{where}:{lineno}: {why}")

        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise bad(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise bad(f"expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in ("question_id", "category", "turns") if k not in obj]
        if missing:
            raise bad(
                f"missing key{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                "(Spec-Bench format: question_id, category, turns)"
            )
        qid, cat, turns = obj["question_id"], obj["category"], obj["turns"]
        if isinstance(qid, bool) or not isinstance(qid, int | str) or str(qid) == "":
            raise bad("question_id must be a number or a non-empty string")
        if not isinstance(cat, str) or not cat.strip():
            raise bad("category must be a non-empty string")
        if not isinstance(turns, list) or not turns:
            raise bad("turns must be a non-empty list of user messages")
        if not all(isinstance(t, str) and t.strip() for t in turns):
            raise bad("every turn must be a non-empty string")
        key = str(qid)
        if key in seen:
            raise bad(f"question_id {key} repeats line {seen[key]}")
        seen[key] = lineno
        prompts.append(Prompt(key, cat.strip(), tuple(turns)))
    if not prompts:
        raise UsageError(f"{where}: no prompts in the suite")
    return prompts


def select(
    prompts: Sequence[Prompt], limit: int | None = None, categories: Sequence[str] | None = None
) -> list[Prompt]:
    """The first ``limit`` prompts of each category (by the column it reports under)."""
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be >= 1, got {limit}")
    if categories:
        known = {p.category for p in prompts} | {p.column for p in prompts}
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise UsageError(
                f"--categories: no prompts in {', '.join(unknown)} "
                f"(the suite has {', '.join(order_columns(prompts))})"
            )
    out: list[Prompt] = []
    count: dict[str, int] = {}
    for p in prompts:
        if categories and p.category not in categories and p.column not in categories:
            continue
        if limit is not None and count.get(p.column, 0) >= limit:
            continue
        count[p.column] = count.get(p.column, 0) + 1
        out.append(p)
    return out


def order_columns(prompts: Sequence[Prompt]) -> list[str]:
    present = list(dict.fromkeys(p.column for p in prompts))
    return [c for c in COLUMNS if c in present] + [c for c in present if c not in COLUMNS]
