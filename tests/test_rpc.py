"""The target on llama.cpp RPC workers (`specrun worker`, `--rpc`): the same output as at home.

Every worker here is started by the test on 127.0.0.1 and stopped by it. In-process tests load
the target over two workers and over this machine + one worker, and check what greedy exactness
rests on (batched rows equal single rows on a worker's CPU, bit for bit) and that every mode says
what the local target alone says; sampled runs give the local run's tokens seed for seed, and
the first token's distribution is the target's. The command-line tests cover the failures: an
address nobody listens on, a worker of another protocol version, one that never answers, one
killed mid-run, a port already taken, and the warning of a worker bound beyond loopback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    DEFAULT_TARGET,
    SMOL_DRAFT,
    SPECRUN,
    THREADS,
    assert_rows_exact,
    assert_same_as_target,
)
from test_sampling import gof

from specrun.decoding import sampling as S
from specrun.decoding.engine import Engine, SpecConfig
from specrun.decoding.sampling import SamplingParams
from specrun.errors import UsageError
from specrun.llama import rpc
from specrun.llama.model import LoadOptions, Model
from specrun.session import ModelOptions

pytestmark = [
    pytest.mark.models,
    pytest.mark.skipif(not rpc.supports_rpc(), reason="built without GGML_RPC"),
]

GREEDY = SamplingParams(temp=0.0)
N = 32
PROMPTS = {
    "quote": "The Great Barrier Reef is the world's largest coral reef system, made of over 2,900 "
    "individual reefs. It was selected as a World Heritage Site in 1981.\n\n"
    'The first sentence of the text above, quoted exactly:\n"',
    "story": "Once upon a time, in a village by the sea, there lived an old lighthouse keeper named",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Worker:
    """`specrun worker` in a subprocess, ready when it answers the protocol's HELLO."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, wait: bool = True):
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(
            prefix="specrun-worker-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            [
                SPECRUN,
                "worker",
                "--host",
                host,
                "--port",
                str(self.port),
                "--threads",
                str(THREADS),
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
        )
        if wait:
            self.wait_ready()

    def stderr(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_ready(self, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while "serving" not in self.stderr():
            assert self.proc.poll() is None, (
                f"worker exited {self.proc.returncode}: {self.stderr()}"
            )
            assert time.monotonic() < end, f"worker not up after {timeout} s: {self.stderr()}"
            time.sleep(0.2)
        while True:  # listening once llama.cpp's server bound the port
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                assert time.monotonic() < end, (
                    f"worker not listening after {timeout} s: {self.stderr()}"
                )
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture(scope="module")
def workers():
    ws = [Worker(), Worker()]
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture(scope="module")
def local_target(model_path):
    # Flash attention off, as auto places a target on workers (on for a CPU model here, where the
    # build's kernel is row-exact: another attention kernel, other logits than the workers').
    m = Model(
        model_path(DEFAULT_TARGET), LoadOptions(n_ctx=1024, n_threads=THREADS, flash_attn=False)
    )
    yield m
    m.close()


@pytest.fixture(scope="module")
def two_worker_target(model_path, workers):
    """The whole target on the two workers, split by their free memory (llama.cpp's default)."""
    opts = LoadOptions(n_ctx=1024, n_threads=THREADS, rpc=tuple(w.endpoint for w in workers))
    m = Model(model_path(DEFAULT_TARGET), opts)
    yield m
    m.close()  # before the workers stop: freeing remote buffers talks to them


@pytest.fixture(scope="module")
def draft(model_path):
    m = Model(model_path(SMOL_DRAFT), LoadOptions(n_ctx=1024, n_threads=THREADS, amx_rows=True))
    yield m
    m.close()


@pytest.fixture(scope="module")
def baselines(local_target):
    alone = Engine(local_target, None, SpecConfig(mode="none"))
    return {
        k: alone.run(
            local_target.tokenize(t, add_special=True),
            max_tokens=N,
            params=GREEDY,
            reuse_cache=False,
        )
        for k, t in PROMPTS.items()
    }


# -- the protocol and the options ------------------------------------------------------------


def test_a_worker_of_this_build_speaks_the_version_the_check_expects(workers):
    info = rpc.check_worker(rpc.parse_endpoints(workers[0].endpoint)[0])
    assert info.version == (rpc.PROTO_MAJOR, rpc.PROTO_MINOR, rpc.PROTO_PATCH)
    assert len(info.memory) == 1 and 0 < info.memory[0][0] <= info.memory[0][1]


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "empty address"),
        ("a:1,,b:2", "empty address"),
        ("host:port", "not a number"),
        ("host:0", "1 to 65535"),
        ("h:1,h:1", "given twice"),
        ("[::1]:5", "not HOST:PORT"),
    ],
)
def test_bad_rpc_addresses_are_usage_errors(text, needle):
    with pytest.raises(UsageError, match=needle):
        rpc.parse_endpoints(text)


def test_rpc_options_reach_the_load_options():
    o = ModelOptions(rpc="127.0.0.1:50052,10.0.0.2", tensor_split="3,1")
    o.validate()
    t, d = o.load_options(False), o.load_options(True)
    assert t.rpc == ("127.0.0.1:50052", "10.0.0.2:50052") and t.tensor_split == (3.0, 1.0)
    assert d.rpc == () and d.tensor_split == ()  # the draft stays here unless --rpc-draft
    # A worker's devices say "GPU" whatever they are: flash attention stays off (row-exact).
    assert t.flash_attn is False
    o = ModelOptions(rpc="127.0.0.1:50052", rpc_draft=True)
    assert o.load_options(True).rpc == ("127.0.0.1:50052",)
    for bad, needle in (
        ({"rpc_draft": True}, "give --rpc"),
        ({"tensor_split": "1,x"}, "numbers"),
        ({"tensor_split": "0,0"}, "not all 0"),
        ({"tensor_split": "-1,2"}, ">= 0"),
    ):
        with pytest.raises(UsageError, match=needle):
            ModelOptions(**bad).validate()


# -- the target on workers: exact --------------------------------------------------------------


def test_a_worker_scores_batched_rows_as_single_rows(two_worker_target):
    assert two_worker_target.context_params()["gpu_layers"] == two_worker_target.n_layer + 1
    prompt = two_worker_target.tokenize(PROMPTS["story"], add_special=True)
    assert_rows_exact(two_worker_target, prompt, (2, 5, 9), "target on two workers")


def test_logits_on_workers_equal_local_logits(two_worker_target, local_target):
    prompt = local_target.tokenize(PROMPTS["quote"], add_special=True)
    for m in (two_worker_target, local_target):
        m.clear()
        m.decode(prompt, 0, logits_from=0)
    for row in range(len(prompt)):
        assert np.array_equal(two_worker_target.logits(row), local_target.logits(row)), row
    for m in (two_worker_target, local_target):
        m.clear()


@pytest.mark.parametrize("mode", ["none", "draft", "lookup", "auto"])
def test_greedy_over_two_workers_is_the_local_target(mode, two_worker_target, draft, baselines):
    eng = Engine(
        two_worker_target,
        draft if mode in ("draft", "auto") else None,
        SpecConfig(mode=mode, draft_max=4),
    )
    for key, text in PROMPTS.items():
        got = eng.run(
            two_worker_target.tokenize(text, add_special=True),
            max_tokens=N,
            params=GREEDY,
            reuse_cache=False,
        )
        assert_same_as_target(got, baselines[key], f"{mode} over two workers, {key}")


def test_greedy_over_this_machine_and_one_worker(model_path, workers, draft, baselines):
    """--ngl 16 of 31: the last 15 layers and the output on the worker, the rest here."""
    opts = LoadOptions(n_ctx=1024, n_threads=THREADS, rpc=(workers[0].endpoint,), n_gpu_layers=16)
    with Model(model_path(DEFAULT_TARGET), opts) as m:
        assert m.context_params()["gpu_layers"] == 16
        for mode in ("none", "auto"):
            eng = Engine(m, draft if mode == "auto" else None, SpecConfig(mode=mode, draft_max=4))
            for key, text in PROMPTS.items():
                got = eng.run(
                    m.tokenize(text, add_special=True),
                    max_tokens=N,
                    params=GREEDY,
                    reuse_cache=False,
                )
                assert_same_as_target(got, baselines[key], f"{mode} over here + one worker, {key}")


def test_sampled_over_workers_is_the_local_run_and_the_targets_distribution(
    two_worker_target, local_target, draft
):
    """Seed for seed the same tokens as the local pair (the logits are the same numbers, so
    every accept/reject draw is too); over 100 seeds the first token follows the target's own
    distribution at temp 1 (chi-square, as the local sampling tests)."""
    params = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)
    prompt = local_target.tokenize(PROMPTS["story"], add_special=True)
    remote = Engine(two_worker_target, draft, SpecConfig(mode="draft", draft_max=3))
    for seed in range(4):
        p = SamplingParams(**{**params.__dict__, "seed": seed})
        local = Engine(local_target, draft, SpecConfig(mode="draft", draft_max=3))
        want = local.run(prompt, max_tokens=12, params=p, reuse_cache=False)
        got = remote.run(prompt, max_tokens=12, params=p, reuse_cache=False)
        assert got.tokens == want.tokens, seed
    local_target.clear()
    local_target.decode(prompt, 0, logits_from=len(prompt) - 1)
    dist = S.transform(local_target.logits(-1), params)
    probs = np.zeros(local_target.n_vocab)
    probs[dist.ids] = dist.probs
    local_target.clear()
    firsts = Counter(
        remote.run(
            prompt,
            max_tokens=1,
            params=SamplingParams(**{**params.__dict__, "seed": 1000 + s}),
            reuse_cache=False,
        ).tokens[0]
        for s in range(100)
    )
    counts = np.zeros(len(probs))
    for tok, c in firsts.items():
        counts[tok] = c
    stat, df, p_value = gof(counts, probs)
    assert df >= 3 and p_value > 1e-3, (stat, df, p_value)


# -- the command line: one line for every failure -----------------------------------------------


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SPECRUN, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def _one_line(p: subprocess.CompletedProcess[str]) -> str:
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


def test_an_unreachable_worker_is_one_line_and_exit_1():
    port = free_port()
    t0 = time.monotonic()
    p = _run("generate", "--prompt", "hi", "-n", "4", "--rpc", f"127.0.0.1:{port}", timeout=120)
    assert p.returncode == 1 and p.stdout == ""
    line = _one_line(p)
    assert f"127.0.0.1:{port}" in line and "refused" in line
    assert time.monotonic() - t0 < 60
    p = _run("generate", "--prompt", "hi", "--rpc", "127.0.0.1:0")
    assert p.returncode == 2 and "1 to 65535" in _one_line(p)
    p = _run("generate", "--prompt", "hi", "--rpc-draft")
    assert p.returncode == 2 and "--rpc" in _one_line(p)


class FakeWorker:
    """A server on 127.0.0.1 that answers HELLO as a worker of another protocol version (or not
    at all), to see the check refuse it before llama.cpp would abort on it."""

    def __init__(self, reply: bytes | None):
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(4)
        self.port = self.srv.getsockname()[1]
        self.reply, self.conns = reply, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(c)
            if self.reply is not None:
                c.recv(1 + 8 + 24)
                c.sendall(struct.pack("<Q", len(self.reply)) + self.reply)

    def close(self) -> None:
        self.srv.close()
        for c in self.conns:
            c.close()


def test_a_worker_of_another_version_or_none_that_answers_is_refused_before_llama_cpp():
    old = FakeWorker(bytes([3, 0, 0]))  # protocol v3 answered HELLO with three bytes
    try:
        p = _run(
            "generate", "--prompt", "hi", "-n", "4", "--rpc", f"127.0.0.1:{old.port}", timeout=120
        )
        assert p.returncode == 1 and "protocol v3.0.0" in _one_line(p), p.stderr
    finally:
        old.close()
    silent = FakeWorker(None)
    try:
        p = _run("info", "--rpc", f"127.0.0.1:{silent.port}", timeout=120)
        assert p.returncode == 1 and "did not answer" in _one_line(p), p.stderr
    finally:
        silent.close()


@pytest.fixture()
def cli_workers():
    ws = [Worker(), Worker()]
    yield ws
    for w in ws:
        w.stop()


def test_cli_over_two_workers_says_what_the_target_alone_says_and_info_sees_them(cli_workers):
    rpc_arg = ",".join(w.endpoint for w in cli_workers)
    common = [
        "--prompt",
        PROMPTS["quote"],
        "--raw",
        "-n",
        "24",
        "--temp",
        "0",
        "--json",
        "-t",
        str(THREADS),
    ]
    here = _run("generate", *common, "--mode", "none")
    assert here.returncode == 0, here.stderr
    there = _run("generate", *common, "--mode", "auto", "--rpc", rpc_arg)
    assert there.returncode == 0, there.stderr
    a, b = json.loads(here.stdout), json.loads(there.stdout)
    assert b["tokens"] == a["tokens"]
    t = b["runtime"]["target"]
    assert (
        t["rpc"] == rpc_arg.split(",") and t["gpu_layers"] == 31 and t["flash_attn"] == "disabled"
    )
    assert b["runtime"]["draft"]["rpc"] == [] and b["runtime"]["draft"]["gpu_layers"] == 0
    p = _run("info", "--json", "--rpc", rpc_arg)
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert [w["endpoint"] for w in info["models"]["workers"]] == rpc_arg.split(",")
    assert all(w["devices"][0]["total"] > 0 for w in info["models"]["workers"])
    target, draft = info["models"]["models"]
    assert (
        target["placement"]["rpc"] == rpc_arg.split(",") and target["placement"]["gpu_layers"] == 31
    )
    assert draft["placement"]["rpc"] == [] and draft["placement"]["gpu_layers"] == 0
    assert info["build"]["rpc"] is True


def test_a_worker_killed_mid_run_ends_it_with_one_line_naming_it(cli_workers):
    rpc_arg = ",".join(w.endpoint for w in cli_workers)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(
            [
                SPECRUN,
                "generate",
                "--prompt",
                PROMPTS["story"],
                "--raw",
                "-n",
                "2000",
                "--temp",
                "0",
                "--mode",
                "none",
                "--rpc",
                rpc_arg,
                "-t",
                str(THREADS),
            ],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
        try:
            end = time.monotonic() + 240
            while os.fstat(out.fileno()).st_size < 20:  # text is streaming
                assert p.poll() is None, "finished before the worker was killed"
                assert time.monotonic() < end
                time.sleep(0.1)
            cli_workers[1].proc.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            rc = p.wait(timeout=60)
            took = time.monotonic() - t0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        out.seek(0)
        err.seek(0)
        text, stderr = out.read(), err.read()
    assert rc == 1, (rc, stderr)
    assert took < 30, took
    assert len(text) >= 20  # what was generated stays printed
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert (
        len(lines) == 1 and cli_workers[1].endpoint in lines[0] and "specrun: error:" in lines[0]
    ), stderr


def test_a_worker_beyond_loopback_warns_and_a_taken_port_is_one_line():
    w = Worker(host="0.0.0.0")  # listens, and is stopped at once: nothing is sent to it
    try:
        assert "NO authentication" in w.stderr()
        taken = _run("worker", "--port", str(w.port), timeout=60)
        assert taken.returncode == 1 and "cannot listen" in _one_line(taken)
    finally:
        w.stop()
    loop = Worker()
    try:
        assert "authentication" not in loop.stderr()
    finally:
        loop.stop()
    p = _run("worker", "--host", "no such host", timeout=60)
    assert p.returncode == 2 and "--host" in _one_line(p)
