"""Measured pass costs (calibrate.py): auto prices its first bets from what the target's batches
really cost here, and the measurement is made once per model file and machine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_lookup_policy import FakeDraftModel, FakeLookup, drive

from specrun.decoding import calibrate
from specrun.decoding.auto import AutoPolicy
from specrun.decoding.sampling import SamplingParams


def first_choices(policy, n, accept_rate, t1, slope, draft_step_s=0.004, seed=0):
    return drive(
        policy,
        n,
        accept_rate=accept_rate,
        draft_step_s=draft_step_s,
        t1=t1,
        slope=slope,
        rng=np.random.default_rng(seed),
    )


def test_expensive_batches_are_recognised_before_the_first_bet():
    """V(n) = n (every row as dear as a whole step): no draft can pay. Uncalibrated, auto bets on
    its prior (V(5) ~ 1.4) and loses for a while; calibrated, it decodes plainly from step one."""
    t1 = 0.010
    measured = {n: t1 * n for n in calibrate.SIZES}
    cold = AutoPolicy(8, None, FakeDraftModel())
    cal = AutoPolicy(8, None, FakeDraftModel())
    cal.calibrate(measured, 0.004)
    cold_steps = first_choices(cold, 12, 0.9, t1, 1.0)
    cal_steps = first_choices(cal, 12, 0.9, t1, 1.0)
    assert sum(k for _name, k in cold_steps) > 0  # the prior bets
    assert all(k == 0 for _name, k in cal_steps), cal_steps


def test_cheap_batches_let_it_draft_at_once():
    t1 = 0.010
    cal = AutoPolicy(8, None, FakeDraftModel())
    cal.calibrate({n: t1 * (1 + 0.05 * (n - 1)) for n in calibrate.SIZES}, 0.001)
    name, prop = cal.draft([0] * 10, 8, SamplingParams(), np.random.default_rng(0), True)
    assert name == "draft" and len(prop) >= 2


def test_calibration_survives_a_reset_and_interpolates():
    policy = AutoPolicy(8, FakeLookup(), None)
    policy.calibrate({1: 0.01, 2: 0.015, 3: 0.02, 5: 0.03, 9: 0.05})
    policy.reset()  # a new text keeps what the machine costs
    v = policy.costs.verify_cost()
    assert v(1) == 1.0 and v(5) == pytest.approx(3.0) and v(9) == pytest.approx(5.0)
    assert v(4) == pytest.approx(2.5) and v(7) == pytest.approx(4.0)  # between measured sizes


class FakeModel:
    """Enough of runtime.Model for the cache: a file, its context's settings, timed decodes."""

    def __init__(self, path, threads=2):
        self.path = path
        self.threads = threads
        self.single_rows = False
        self.n_batch, self.n_outputs_max, self.n_ctx, self.bos = 512, 65, 4096, 1
        self.decoded: list[int] = []
        self.load_report: dict = {}

    def machine_key(self):
        """The real build's key (Model.machine_key reads the same functions)."""
        from specrun.llama import backend

        return backend.build_id() + backend.cpu_name()

    def context_params(self):
        return {
            "n_threads": self.threads,
            "n_threads_batch": self.threads,
            "gpu_layers": 0,
            "flash_attn": "disabled",
            "type_k": "f16",
        }

    def clear(self):
        pass

    def truncate(self, n):
        pass

    def decode(self, tokens, pos0, logits_from=None):
        self.decoded.append(len(tokens))


def test_pass_times_are_measured_once_per_file_and_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "home"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    m = FakeModel(gguf)
    first = calibrate.pass_times(m)
    assert sorted(first) == list(calibrate.SIZES) and all(t > 0 for t in first.values())
    # the context once (calibrate.AT tokens), then every size, a warm-up round and REPS rounds,
    # then single rows one after another (one warm-up and RUN timed)
    assert m.decoded[0] == calibrate.AT
    rounds = len(calibrate.SIZES) * (calibrate.REPS + 1)
    assert len(m.decoded) == 1 + rounds + calibrate.RUN + 1
    assert m.decoded[1 + rounds :] == [1] * (calibrate.RUN + 1)
    m.decoded.clear()
    assert calibrate.pass_times(m) == first and m.decoded == []  # from the cache
    calibrate.pass_times(FakeModel(gguf, threads=1))  # another setting: measured anew
    assert len(json.loads(calibrate.cache_file().read_text())) == 2
    gguf.write_bytes(b"GGUF" + b"\1" * 80)  # the file changed: measured anew
    m.decoded.clear()
    calibrate.pass_times(m)
    assert m.decoded
    m.decoded.clear()  # llama.cpp rebuilt (other kernels, the same features): measured anew
    from specrun.llama import backend

    monkeypatch.setattr(backend, "build_id", lambda: "libggml-cpu.so:1:2")
    calibrate.pass_times(m)
    assert m.decoded


def test_a_draft_step_is_timed_right_after_a_target_row_once_per_pair(tmp_path, monkeypatch):
    """A draft step is priced as the engine pays it: every timed draft row follows a target row
    (a draft attempt starts right after a target pass), never another draft row. Measured once per
    pair of files and settings; another target, or another setting of the draft, measures anew."""
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "home"))
    log: list[str] = []

    class Logged(FakeModel):
        def __init__(self, path, tag, threads=2):
            super().__init__(path, threads)
            self.tag = tag

        def decode(self, tokens, pos0, logits_from=None):
            super().decode(tokens, pos0, logits_from)
            log.append(self.tag if len(tokens) == 1 else self.tag + "*")

    files = []
    for name in ("t.gguf", "d.gguf", "t2.gguf"):
        f = tmp_path / name
        f.write_bytes(b"GGUF" + name.encode() * 20)
        files.append(f)
    target, draft = Logged(files[0], "T"), Logged(files[1], "D")
    step = calibrate.draft_step(target, draft)
    assert step > 0
    assert log[:2] == ["T*", "D*"]  # the context, once each
    rows = log[2:]
    assert (
        rows
        and set(rows) == {"T", "D"}
        and all(rows[i - 1] == "T" for i, r in enumerate(rows) if r == "D")
    )
    log.clear()
    assert calibrate.draft_step(target, draft) == step and log == []  # from the cache
    calibrate.draft_step(Logged(files[2], "T"), draft)  # another target
    assert log
    log.clear()
    calibrate.draft_step(target, Logged(files[1], "D", threads=1))  # the draft on 1 thread
    assert log


def test_a_corrupt_cache_is_measured_over(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path))
    calibrate.cache_file().write_text("{not json")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    assert calibrate.pass_times(FakeModel(gguf))
    assert isinstance(json.loads(calibrate.cache_file().read_text()), dict)


@pytest.mark.models
def test_real_pass_times_grow_with_rows_and_leave_the_cache_empty(smol_target):
    times = calibrate.measure(smol_target, (1, 5, 9), reps=2)
    assert times[1] < times[9]
    # The cache is empty again: a decode at position 0 works and a prompt starts clean.
    toks = smol_target.tokenize("Hello there", add_special=True)
    smol_target.decode(toks, 0, logits_from=len(toks) - 1)
    smol_target.clear()


@pytest.mark.models
def test_a_real_draft_step_after_a_target_row_leaves_both_caches_empty(smol_target, smol_draft):
    step = calibrate.measure_draft(smol_target, smol_draft, reps=2, at=32)
    assert 0 < step < 1.0
    for m in (smol_target, smol_draft):
        assert len(m.cached) == 0
        toks = m.tokenize("Hello there", add_special=True)
        m.decode(toks, 0, logits_from=len(toks) - 1)
        m.clear()


def test_a_runs_passes_refine_the_cached_measurement(tmp_path, monkeypatch):
    """What runs pay moves the cached V(n) (a calibration measured under load, or in an unlucky
    process, is not kept for every later run): sizes seen often enough move halfway, sizes not
    seen keep their V(n) against the moved single row, too few passes change nothing."""
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    m = FakeModel(gguf)
    key = calibrate._key(m, calibrate.SIZES)
    cached = {"1": 0.010, "2": 0.020, "3": 0.024, "5": 0.030, "9": 0.040}
    calibrate.cache_file().write_text(json.dumps({key: cached}))
    calibrate.refine(m, calibrate.SIZES, {1: (0.012, 2), 3: (0.018, 20)})  # one row seen twice
    assert json.loads(calibrate.cache_file().read_text())[key] == cached
    calibrate.refine(m, calibrate.SIZES, {1: (0.012, 40), 3: (0.018, 20), 5: (0.03, 1)})
    got = {int(n): t for n, t in json.loads(calibrate.cache_file().read_text())[key].items()}
    assert got[1] == pytest.approx(0.011)  # halfway to 12 ms
    assert got[3] / got[1] == pytest.approx((2.4 + 1.5) / 2)  # V(3) halfway from 2.4 to 1.5
    assert got[5] / got[1] == pytest.approx(3.0) and got[9] / got[1] == pytest.approx(4.0)
    # the next run starts from it, with V(3) 1.95 < V(2) 2.0 pooled (monotone)
    assert calibrate.pass_times(m) == calibrate.monotone(got) and m.decoded == []


def test_more_rows_never_cost_less():
    """Adjacent violators pool to their mean; an ordered measurement is kept as it is."""
    got = calibrate.monotone({1: 10.0, 2: 22.0, 3: 11.4, 5: 21.0, 9: 40.0})
    assert got == pytest.approx({1: 10.0, 2: 16.7, 3: 16.7, 5: 21.0, 9: 40.0})
    assert calibrate.monotone({1: 1.0, 2: 3.0, 3: 2.0, 5: 1.0}) == pytest.approx(
        {1: 1.0, 2: 2.0, 3: 2.0, 5: 2.0}
    )
    ordered = {1: 10.0, 2: 15.0, 3: 16.0, 5: 19.0}
    assert calibrate.monotone(ordered) == ordered


def test_a_measurement_on_a_busy_machine_is_not_cached(tmp_path, monkeypatch):
    """A measurement whose interleaved halves disagree (a busy machine: every other 2-row pass
    four times as slow) is measured again, then used for the run alone: nothing is cached, and
    the next run measures anew. A steady one is cached at the first try."""
    import time

    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)

    class Busy(FakeModel):
        def __init__(self, path, busy):
            super().__init__(path)
            self.busy, self.pairs = busy, 0

        def decode(self, tokens, pos0, logits_from=None):
            super().decode(tokens, pos0, logits_from)
            if len(tokens) == 2:
                self.pairs += 1
                time.sleep(0.004 if self.busy and self.pairs % 2 else 0.001)

    busy = Busy(gguf, True)
    rounds = calibrate.measure_rounds(busy, (1, 2))
    assert not calibrate.steady(rounds)
    busy.decoded.clear()
    got = calibrate.pass_times(busy, (1, 2))
    assert got[2] > 0 and busy.decoded.count(2) == calibrate.TRIES * (calibrate.REPS + 1)
    assert (
        not calibrate.cache_file().exists() or json.loads(calibrate.cache_file().read_text()) == {}
    )
    busy.decoded.clear()
    calibrate.pass_times(busy, (1, 2))
    assert busy.decoded  # measured again: nothing was kept
    calm = Busy(gguf, False)
    assert calibrate.steady(calibrate.measure_rounds(calm, (1, 2)))
    calm.decoded.clear()
    calibrate.pass_times(calm, (1, 2))
    assert calm.decoded.count(2) == calibrate.REPS + 1  # one try
    calm.decoded.clear()
    calibrate.pass_times(calm, (1, 2))
    assert calm.decoded == []  # cached


def test_auto_hands_its_pass_costs_to_the_calibration_at_a_texts_end():
    t1 = 0.010
    seen = []
    policy = AutoPolicy(8, FakeLookup(), None)
    policy.calibrate({n: t1 * (1 + 0.5 * (n - 1)) for n in calibrate.SIZES}, None, seen.append)
    first_choices(policy, 30, 0.0, t1, 0.2)
    policy.finish([0] * 40)
    (costs,) = seen
    assert costs[1][1] >= 20 and costs[1][0] == pytest.approx(t1, rel=0.05)


def test_a_generation_under_auto_refines_its_targets_calibration(monkeypatch):
    """The wiring: calibrate_auto (as every front end starts auto) hands the policy a refine for
    this target and these sizes, and a generation's end calls it with what its passes cost."""
    from fakes import FakeModel as FakeTarget
    from fakes import cycle_rule, text_tokens

    from specrun.decoding.engine import Engine, SpecConfig
    from specrun.session import calibrate_auto

    target = FakeTarget(cycle_rule("the cat sat on the mat, "))
    eng = Engine(target, None, SpecConfig(mode="auto", draft_max=4))
    monkeypatch.setattr(
        calibrate,
        "pass_times",
        lambda model, sizes=calibrate.SIZES, refresh=False: {
            n: 0.01 * (1 + 0.2 * (n - 1)) for n in sizes
        },
    )
    calls = []
    monkeypatch.setattr(calibrate, "refine", lambda *a: calls.append(a))
    calibrate_auto(eng)
    res = eng.run([1, *text_tokens("the cat")], max_tokens=40, params=SamplingParams(temp=0.0))
    ((model, sizes, seen),) = calls
    assert model is target and sizes == (1, 2, 3, 5)
    # every target pass of the run, by its rows, with the policy's estimate of its seconds
    assert sum(k for _secs, k in seen.values()) == res.stats.target_passes > 0
    assert all(secs > 0 for secs, _k in seen.values())
