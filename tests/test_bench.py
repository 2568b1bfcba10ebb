"""specrun bench: the suite loader, the cost-model prediction, and one short real run end to end."""

from __future__ import annotations

import json

import pytest

from specrun.benchmark import report as bench_report
from specrun.benchmark import run as bench_run
from specrun.benchmark import suite as bench_suite
from specrun.cli.main import main
from specrun.decoding.costmodel import predicted_speedup
from specrun.decoding.stats import SpecStats
from specrun.errors import UsageError
from specrun.llama.backend import system_info

SPEC_BENCH_CATEGORIES = (
    "mt_bench",
    "translation",
    "summarization",
    "qa",
    "math_reasoning",
    "rag",
    "code",
)


# -- the suite ------------------------------------------------------------------------------
def test_builtin_suite_has_every_spec_bench_category_and_code():
    where, prompts = bench_suite.load_suite("builtin")
    assert where == "builtin suite"
    by_cat: dict[str, list[bench_suite.Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    assert set(SPEC_BENCH_CATEGORIES) <= set(by_cat)
    for cat in SPEC_BENCH_CATEGORIES:
        assert len(by_cat[cat]) >= 3, cat
    assert all(len(p.turns) == 2 for p in by_cat["mt_bench"])
    for p in by_cat["summarization"]:
        passage = p.turns[0].split("\n\n", 1)[1]
        assert 150 <= len(passage.split()) <= 300
    assert any("```" in p.turns[0] for p in by_cat["code"])  # a code edit of given code
    assert all("Question:" in p.turns[0] for p in by_cat["rag"])
    assert bench_suite.order_columns(prompts) == list(SPEC_BENCH_CATEGORIES)


def test_spec_bench_lines_parse_and_limit_selects_per_category():
    text = "\n".join(
        [
            json.dumps(
                {"question_id": 1, "category": "writing", "turns": ["a", "b"], "reference": []}
            ),
            json.dumps({"question_id": 2, "category": "roleplay", "turns": ["c", "d"]}),
            "",
            json.dumps({"question_id": "t1", "category": "translation", "turns": ["e"]}),
            json.dumps({"question_id": "t2", "category": "translation", "turns": ["f"]}),
        ]
    )
    prompts = bench_suite.parse_suite(text, "x.jsonl")
    assert [p.question_id for p in prompts] == ["1", "2", "t1", "t2"]
    assert [p.column for p in prompts] == ["mt_bench", "mt_bench", "translation", "translation"]
    assert [p.question_id for p in bench_suite.select(prompts, limit=1)] == ["1", "t1"]
    assert [p.question_id for p in bench_suite.select(prompts, categories=["translation"])] == [
        "t1",
        "t2",
    ]
    with pytest.raises(UsageError, match="--categories: no prompts in nope"):
        bench_suite.select(prompts, categories=["nope"])


GOOD = json.dumps({"question_id": 1, "category": "qa", "turns": ["Why is the sky blue?"]})


@pytest.mark.parametrize(
    "bad, why",
    [
        ('{"question_id": 2, "category": "qa", "turns": ["x"', "not valid JSON"),
        ('{"question_id": 2, "turns": ["x"]}', "missing key category"),
        ('{"category": "qa"}', "missing keys question_id, turns"),
        ('{"question_id": 2, "category": "qa", "turns": []}', "turns must be a non-empty list"),
        (
            '{"question_id": 2, "category": "qa", "turns": ["", "y"]}',
            "every turn must be a non-empty string",
        ),
        ('["not", "an", "object"]', "expected a JSON object"),
        (
            '{"question_id": 1, "category": "qa", "turns": ["again"]}',
            "question_id 1 repeats line 1",
        ),
    ],
)
def test_malformed_line_is_named_by_its_number(bad, why):
    with pytest.raises(UsageError) as exc:
        bench_suite.parse_suite(GOOD + "\n" + bad + "\n", "s.jsonl")
    assert str(exc.value).startswith("s.jsonl:2: ")
    assert why in str(exc.value)


def test_cli_malformed_suite_is_one_line_and_exit_2(tmp_path, capsys):
    suite = tmp_path / "suite.jsonl"
    suite.write_text(GOOD + "\n\n" + '{"question_id": 7, "category": "qa", "turns": []}\n')
    assert main(["bench", "--suite", str(suite)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"specrun: error: {suite}:3: turns must be a non-empty list of user messages"
    assert main(["bench", "--suite", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["bench", "--draft-max", "0,2"]) == 2
    assert "--draft-max" in capsys.readouterr().err


# -- the cost model beside the measurement ---------------------------------------------------
def test_prediction_is_the_cost_model_for_a_fixed_k_draft_run():
    st = SpecStats()
    t1, k = 0.02, 4
    # 10 passes of K=4: accepted 4, 4, 3, 2, 4, 1, 0, 4, 4, 2
    for acc in (4, 4, 3, 2, 4, 1, 0, 4, 4, 2):
        st.record_pass("draft", k, acc)
        st.record_timing(k + 1, 0.03, 4 * 0.005, k)
    c, v5 = 0.005 / t1, 0.03 / t1
    want = predicted_speedup(st.per_position_acceptance(), k, c, lambda n: v5 if n == 5 else 1.0)
    assert bench_run.predict_speedup(st, t1) == pytest.approx(want)
    # passes where the drafter had nothing cost V(1) and yield one token
    st.record_pass("none", 0, 0)
    st.record_timing(1, t1, 0.0, 0)
    assert bench_run.predict_speedup(st, t1) < want
    assert bench_run.predict_speedup(st, None) is None


def test_geomean_ignores_missing():
    assert bench_report.geomean([2.0, 0.5, 0.0]) == pytest.approx(1.0)
    assert bench_report.geomean([]) is None


# -- end to end on the default pair ----------------------------------------------------------
RUN_FIELDS = (
    "mode",
    "draft_max",
    "category",
    "prompt_id",
    "tokens_per_second",
    "speedup",
    "acceptance_rate",
    "mean_accepted_length",
    "identical",
    "predicted_speedup",
    "overhead_fraction",
)


@pytest.mark.models
def test_bench_short_real_run_writes_json_markdown_and_png(tmp_path, capsys):
    # One thread: on a shared 2-core machine two OpenMP threads stall each other at every
    # barrier when a core is taken (seen: 10x slower), and this test checks fields, not speed.
    suite = tmp_path / "one.jsonl"
    suite.write_text(
        json.dumps(
            {
                "question_id": "c1",
                "category": "code",
                "turns": [
                    "Write a Python function called factorial that returns the factorial of n."
                ],
            }
        )
        + "\n"
    )
    out_json, out_md, out_png = tmp_path / "b.json", tmp_path / "b.md", tmp_path / "sub" / "b.png"
    rc = main(
        [
            "bench",
            "--suite",
            str(suite),
            "--modes",
            "none,draft,bogus",
            "--draft-max",
            "2",
            "-n",
            "24",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--ctx",
            "512",
            "--json",
            str(out_json),
            "--md",
            str(out_md),
            "--plot",
            str(out_png),
        ]
    )
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "skipping --mode bogus: --mode must be one of" in cap.err
    assert "draft" in cap.out and "overall" in cap.out and "predicted" in cap.out

    data = json.loads(out_json.read_text())
    assert data["machine"]["cpu"] and data["machine"]["physical_cores"] >= 1
    assert data["machine"]["threads"] == [1, 1]
    assert data["machine"]["llama_cpp_system_info"] == system_info()  # this build's, verbatim
    assert data["machine"]["date"]
    assert [s["mode"] for s in data["skipped"]] == ["bogus"]
    assert data["load_average_max"] is None or data["load_average_max"] >= 0
    assert data["baseline_spread"] is None  # one repeat: no spread to report
    runs = data["runs"]
    assert {(r["mode"], r["draft_max"]) for r in runs} == {("none", 0), ("draft", 2)}
    for r in runs:
        for f in RUN_FIELDS:
            assert f in r, f
        assert r["category"] == "code" and r["prompt_id"] == "c1"
        assert r["tokens_per_second"] > 0 and 0.0 <= r["overhead_fraction"] < 1.0
        assert r["identical"] is True  # greedy speculation is exactly the target's output
    (d,) = [r for r in runs if r["mode"] == "draft"]
    assert d["speedup"] > 0 and d["predicted_speedup"] > 0 and d["mean_accepted_length"] > 1.0
    assert 0.0 < d["acceptance_rate"] <= 1.0
    summary = {s["label"]: s for s in data["summary"]}
    assert set(summary) == {"none", "draft K=2"}
    assert summary["none"]["speedup"] == 1.0
    assert summary["draft K=2"]["speedup_by_category"]["code"] == pytest.approx(
        d["speedup"], rel=1e-3
    )

    md = out_md.read_text()
    assert "| mode | K | Code | overall | predicted |" in md and "| draft | 2 |" in md
    png = out_png.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


# -- the runner's method, on fake engines (no models) ---------------------------------------
class _FakeEngine:
    """Generates ``tokens`` at ``tps`` tokens per second; records what it was asked."""

    def __init__(self, mode: str, tokens: list[int], tps: float, log: list):
        self.mode, self.tokens, self.tps, self.log = mode, tokens, tps, log

    def check_prompt(self, prompt):
        if len(prompt) > 50:
            raise UsageError("the prompt is too long")

    def run(self, prompt, max_tokens, params, reuse_cache):
        from types import SimpleNamespace

        assert reuse_cache is False  # every run starts cold
        self.log.append((self.mode, len(prompt), max_tokens))
        st = SpecStats()
        n = min(max_tokens, len(self.tokens))
        for _ in range(n):
            st.record_pass("none", 0, 0)
            st.record_timing(1, 1.0 / self.tps, 0.0, 0)
        st.generated, st.decode_seconds, st.llama_seconds = n, n / self.tps, 0.9 * n / self.tps
        return SimpleNamespace(
            tokens=self.tokens[:n],
            text="reply " + self.mode,
            stats=st,
            prompt_tokens=len(prompt),
            finish_reason="length",
        )


def test_runner_alternates_configurations_compares_and_follows_turns():
    log: list = []
    engines = [
        (bench_run.Config("none", 0), _FakeEngine("none", [1, 2, 3, 4], 10.0, log)),
        (bench_run.Config("x", 2), _FakeEngine("x", [1, 2, 3, 4], 20.0, log)),
        (bench_run.Config("y", 2), _FakeEngine("y", [1, 2, 9, 9], 5.0, log)),
    ]
    prompts = [
        bench_suite.Prompt("1", "writing", ("hi", "more")),
        bench_suite.Prompt("2", "qa", ("q" * 60,)),
        bench_suite.Prompt("3", "qa", ("why",)),
    ]
    seen: list[list[dict]] = []

    def encode(messages):
        seen.append([dict(m) for m in messages])
        return [0] * sum(len(m["content"]) for m in messages)

    settings = bench_run.BenchSettings(max_tokens=4, repeats=2, all_turns=True)
    warnings: list[str] = []
    res = bench_run.run_bench(engines, prompts, encode, settings, warn=warnings.append)
    assert log[:3] == [("none", 2, 4), ("x", 2, 4), ("y", 2, 4)]  # warm-up, each once
    measured = [m for m, _, _ in log[3:]]
    assert measured[:6] == ["none", "x", "y", "x", "y", "none"]  # rotated per repeat
    # turn 2 continues after the baseline's reply to turn 1
    assert seen[2] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "reply none"},
        {"role": "user", "content": "more"},
    ]
    assert warnings == ["skipping prompt 2 (qa) turn 1: the prompt is too long"]
    assert bench_run.count_runs(prompts, 3, settings) == 4 * 3 * 2 + 3
    rows = {r.config.label: r for r in bench_report.summarize(res)}
    assert rows["x K=2"].speedup == pytest.approx(2.0)
    assert rows["y K=2"].speedup_by_column == {
        "mt_bench": pytest.approx(0.5),
        "qa": pytest.approx(0.5),
    }
    assert rows["x K=2"].identical == (6, 6) and rows["y K=2"].identical == (0, 6)
    assert rows["none"].overhead_fraction == pytest.approx(0.1)
    assert rows["x K=2"].n_prompts == 3  # two turns of prompt 1, and prompt 3


def test_baseline_spread_is_how_far_the_targets_own_repeats_ran_apart():
    class Varying(_FakeEngine):
        """The same tokens every run, at the next of ``speeds`` tok/s."""

        def __init__(self, speeds, *args):
            super().__init__(*args)
            self.speeds = list(speeds)

        def run(self, *args, **kw):
            self.tps = self.speeds.pop(0)
            return super().run(*args, **kw)

    log: list = []
    # warm-up, then prompt 1's three repeats (9..11: 20% apart), prompt 2's (8..12: 40%)
    speeds = [10.0, 10.0, 9.0, 11.0, 10.0, 12.0, 8.0]
    engines = [
        (bench_run.Config("none", 0), Varying(speeds, "none", [1, 2], 10.0, log)),
        (bench_run.Config("x", 2), _FakeEngine("x", [1, 2], 20.0, log)),
    ]
    prompts = [bench_suite.Prompt("1", "qa", ("a",)), bench_suite.Prompt("2", "qa", ("b",))]
    res = bench_run.run_bench(
        engines, prompts, lambda m: [0], bench_run.BenchSettings(max_tokens=2, repeats=3)
    )
    spread = bench_report.baseline_spread(res.runs)
    assert spread == {"median": pytest.approx(0.3), "max": pytest.approx(0.4), "prompts": 2}
    note = bench_report.spread_note(spread)
    assert note is not None and "30.0% apart" in note and "at most 40.0%" in note
    md = bench_report.markdown(bench_report.summarize(res), res.columns, "# t", note)
    assert md.rstrip().endswith("own variation.") and "Noise: the target alone" in md
    # one repeat: nothing to compare
    alone = [(bench_run.Config("none", 0), _FakeEngine("none", [1, 2], 10.0, log))]
    one = bench_run.run_bench(
        alone, prompts, lambda m: [0], bench_run.BenchSettings(max_tokens=2, repeats=1)
    )
    assert len([r for r in one.runs if r.mode == "none"]) == 2
    assert bench_report.baseline_spread(one.runs) is None and bench_report.spread_note(None) is None
