"""Option plumbing: every model option on every command, and each one reaching llama.cpp's params.

The end-to-end check runs the real CLI with `--json`, whose "runtime" object is read back from the
llama.cpp contexts (llama_n_ctx, llama_n_threads, ...) and from llama.cpp's own load log (flash
attention, KV cache types, offloaded layers): not what specrun meant to pass, what llama.cpp took.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import SMOL_TARGET, SPECRUN, THREADS

from specrun.cli.options import MODEL_OPTIONS, SAMPLING_OPTIONS
from specrun.llama.model import LoadOptions, Model
from specrun.models.memory import CACHE_TYPES
from specrun.session import ModelOptions


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SPECRUN, *args], capture_output=True, text=True, timeout=timeout)


def _flags(opt) -> list[str]:
    return [d for d in opt.param_decls if d.startswith("--")]


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "info"])
def test_every_shared_option_is_offered(command):
    help_text = _run(command, "--help").stdout
    own_sweep = {"mode", "draft_max", "lookup_cache"} if command == "bench" else set()
    table = MODEL_OPTIONS + (SAMPLING_OPTIONS if command != "info" else [])
    for name, _t, opt, _d in table:
        if name in own_sweep:
            continue
        for flag in _flags(opt):
            flag = flag.split("/")[0]
            assert flag in help_text, f"{command} lacks {flag}"


def test_model_options_become_llama_params_per_model():
    o = ModelOptions(
        ctx=1000,
        ctx_draft=300,
        threads=1,
        threads_draft=2,
        batch=64,
        flash_attn="off",
        cache_type_k="q8_0",
        cache_type_v="f16",
        cache_type_k_draft="q4_0",
        ngl=5,
        ngl_draft=0,
    )
    o.validate()
    t, d = o.load_options(False), o.load_options(True)
    assert (t.n_ctx, t.n_threads, t.n_batch, t.n_gpu_layers, t.flash_attn) == (
        1000,
        1,
        64,
        5,
        False,
    )
    assert (d.n_ctx, d.n_threads, d.n_batch, d.n_gpu_layers, d.flash_attn) == (300, 2, 64, 0, False)
    assert (t.type_k, t.type_v) == (CACHE_TYPES["q8_0"][0], CACHE_TYPES["f16"][0])
    assert (d.type_k, d.type_v) == (
        CACHE_TYPES["q4_0"][0],
        CACHE_TYPES["f16"][0],
    )  # V: as the target's
    # Defaults: the draft follows the target; flash attention auto is on for a model on the CPU
    # where the build's kernel is row-exact (make install's: patches/), else off; llama.cpp's
    # choice (None) for one offloaded to a GPU, on for a quantized V cache.
    # (A GPU here, not llama_supports_gpu_offload(): a build with RPC says True on any machine.)
    from specrun.llama.backend import flash_attn_row_exact, local_gpus

    cpu_fa = flash_attn_row_exact()
    o = ModelOptions(ctx=2048, threads=3)
    d = o.load_options(True)
    assert (d.n_ctx, d.n_threads) == (2048, 3)
    assert d.flash_attn is (None if local_gpus() else cpu_fa)
    assert ModelOptions(ngl=0).load_options(False).flash_attn is cpu_fa
    assert ModelOptions(cache_type_v="q8_0").load_options(False).flash_attn is True


def test_runtime_params_are_what_llama_cpp_took(model_path):
    opts = LoadOptions(
        n_ctx=700,
        n_threads=1,
        n_batch=128,
        flash_attn=True,
        type_k=CACHE_TYPES["q8_0"][0],
        type_v=CACHE_TYPES["q4_0"][0],
        n_outputs_max=9,
    )
    with Model(model_path(SMOL_TARGET), opts) as m:
        got = m.context_params()
    assert got["n_ctx"] == 768  # padded to 256 by llama.cpp
    assert (got["n_batch"], got["n_ubatch"], got["n_threads"], got["n_threads_batch"]) == (
        128,
        128,
        1,
        1,
    )
    assert (got["type_k"], got["type_v"], got["flash_attn"]) == ("q8_0", "q4_0", "enabled")
    assert got["n_outputs_max"] == 9 and got["gpu_layers"] == 0


@pytest.mark.models
def test_cli_options_reach_llama_cpp():
    r = _run(
        "generate",
        "--prompt",
        "Count to three.",
        "-n",
        "4",
        "--json",
        "--mode",
        "draft",
        "--ctx",
        "600",
        "--ctx-draft",
        "300",
        "-t",
        "1",
        "--threads-draft",
        str(THREADS),
        "-b",
        "64",
        "--flash-attn",
        "off",
        "-ctk",
        "q8_0",
        "-ctkd",
        "q4_0",
        "--ngl",
        "0",
    )
    assert r.returncode == 0, r.stderr
    rt = json.loads(r.stdout)["runtime"]
    t, d = rt["target"], rt["draft"]
    assert (
        t["n_ctx"],
        t["n_threads"],
        t["n_batch"],
        t["flash_attn"],
        t["type_k"],
        t["type_v"],
    ) == (768, 1, 64, "disabled", "q8_0", "f16")
    assert (d["n_ctx"], d["n_threads"], d["n_batch"], d["type_k"], d["type_v"]) == (
        512,
        THREADS,
        64,
        "q4_0",
        "f16",
    )
    assert t["buffers_mib"]["kv"] > 0 and d["buffers_mib"]["kv"] > 0  # buffers are reported


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--cache-type-k", "q9"], "--cache-type-k must be one of"),
        (["--cache-type-v-draft", "x"], "--cache-type-v-draft must be one of"),
        (["--flash-attn", "maybe"], "--flash-attn must be on, off or auto"),
        (["--flash-attn", "off", "--cache-type-v", "q8_0"], "needs flash attention"),
        (["--draft-max", "65"], "--draft-max must be 1 to 64"),
        (["--ctx", "5000000000"], "--ctx must be 16 to"),
        (["-b", "0"], "--batch-size must be >= 1"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "chat", "info"])
def test_bad_placement_values_are_usage_errors(command, args, needle):
    extra = ["--prompt", "hi"] if command == "generate" else []
    r = _run(command, *extra, *args, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len([x for x in r.stderr.splitlines() if x.strip()]) == 1, r.stderr


@pytest.mark.models  # reads the pair's files (pulled by make install)
def test_info_reports_build_machine_and_pair():
    r = _run("info", "--json")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    b, m, mi = obj["build"], obj["machine"], obj["models"]
    assert b["gpu_offload"] in (True, False) and b["devices"] and b["system_info"]
    assert m["physical_cores"] >= 1 and m["ram_total"] > 0
    # make install's build carries patches/: the row-exact multi-column Q8_0, Q5_0, Q4_K, Q6_K,
    # F32, F16 and BF16 kernels and the row-exact repacked Q4_K gemv.
    if "AVX2 = 1" in b["system_info"] and "F16C = 1" in b["system_info"]:
        assert b["batched_q8_0_kernel"] and b["batched_k_quant_kernel"], b["system_info"]
        assert b["batched_q5_0_kernel"] and b["row_exact_q4_k_repack"], b["system_info"]
        assert b["row_exact_flash_attn"], b["system_info"]
        assert b["batched_f16_kernel"] and b["batched_f32_kernel"], b["system_info"]
    # ... its F16 KV attention by blocks of 32 cells (AVX2 + F16C + FMA)
    if all(f"{f} = 1" in b["system_info"] for f in ("AVX2", "F16C", "FMA")):
        assert b["flash_attn_block"] == 32, b["system_info"]
    # ... and a compute graph kept per batch size (1-17 rows), whatever the CPU
    assert b["graphs_per_batch_size"] == 17, b["system_info"]
    # ... computed without the scheduler once placed, unless the environment turns it off
    assert b["graph_direct"] is (os.environ.get("SPECRUN_GRAPH_DIRECT", "1") != "0"), b
    # ... and --draft-p-min's check in C (specrun_top_prob), whatever the CPU
    assert b["top_prob_in_c"] is True
    # ... and, on a CPU with AMX, the AMX tile config loaded whole (its batch kernel sound)
    assert b["amx"] == ("sound" if "AMX_INT8 = 1" in b["system_info"] else None), b
    # BF16: with AVX512-BF16, or AVX2 without AVX-512 (AVX-512 alone sums a BF16 row another way)
    sysinfo = b["system_info"]
    if "AVX512_BF16 = 1" in sysinfo or (
        "AVX2 = 1" in sysinfo and "F16C = 1" in sysinfo and "AVX512 = 1" not in sysinfo
    ):
        assert b["batched_bf16_kernel"], b["system_info"]
    roles = [x["role"] for x in mi["models"]]
    assert roles == ["target", "draft"] and mi["compatible"] is True
    t = mi["models"][0]
    assert t["n_layer"] == 30 and t["n_vocab"] == 49152 and t["estimate"]["kv"] > 0
    assert t["placement"]["n_ctx"] == 4096 and mi["memory"]["fits"] is True
    from specrun.llama.backend import flash_attn_row_exact, local_gpus

    # Flash attention as placed: auto is on for a model on the CPU where the build's kernel is
    # row-exact, else off.
    cpu_fa = "on" if flash_attn_row_exact() else "off"
    assert t["placement"]["flash_attn"] == ("auto" if local_gpus() else cpu_fa)
    # The text form says the same in words.
    r = _run("info", "--ctx", "1024")
    assert r.returncode == 0, r.stderr
    assert "compatible" in r.stdout and "memory at ctx 1024" in r.stdout and "threads" in r.stdout
    assert f"flash attention {t['placement']['flash_attn']})" in r.stdout
    r = _run("info", "--json", "--flash-attn", "on")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["models"]["models"][0]["placement"]["flash_attn"] == "on"


@pytest.mark.models  # reads the pair's files (pulled by make install)
def test_info_on_an_incompatible_pair_says_why():
    r = _run("info", "-m", "smollm2-135m-instruct-q4_1", "-md", "gemma-3-270m-q4_k_m", "--json")
    assert r.returncode == 0, r.stderr
    mi = json.loads(r.stdout)["models"]
    assert mi["compatible"] is False and mi["problems"]


def test_version_names_specrun_and_llama_cpp_python():
    from importlib import metadata

    from specrun import __version__

    want = f"specrun {__version__} (llama-cpp-python {metadata.version('llama-cpp-python')})\n"
    for flag in ("--version", "-V"):
        r = _run(flag)
        assert (r.returncode, r.stdout, r.stderr) == (0, want, "")
