"""The memory estimate (memory.py) against llama.cpp's own accounting, and the fit decisions.

llama.cpp logs the size of every buffer it allocates while loading ("KV buffer size = ...",
"compute buffer size = ...", "model buffer size = ..."); runtime.Model keeps those lines, so the
estimate made from the GGUF header alone is checked here against what llama.cpp really took.
"""

from __future__ import annotations

import subprocess

import pytest
from conftest import GEMMA_DRAFT, GEMMA_TARGET, SMOL_DRAFT, SMOL_TARGET, SPECRUN, THREADS

from specrun.errors import ModelError
from specrun.llama.buffers import amx_holds_weights
from specrun.llama.gguf import validate_gguf
from specrun.llama.model import LoadOptions, Model
from specrun.models import memory
from specrun.models.memory import HostMemory, ModelShape, Placement, estimate, plan_memory

MIB = 1024 * 1024


@pytest.mark.parametrize("name", [SMOL_TARGET, SMOL_DRAFT, GEMMA_TARGET, GEMMA_DRAFT])
@pytest.mark.parametrize(
    "n_ctx,type_k,type_v,flash",
    [(512, "f16", "f16", False), (2048, "q8_0", "f16", False), (1000, "q4_0", "q8_0", True)],
)
@pytest.mark.parametrize("role", ["target", "draft"])
def test_estimate_matches_llama_cpp_buffers(model_path, name, n_ctx, type_k, type_v, flash, role):
    """Loaded as a target (only row-exact repacking) and as a draft (llama.cpp's own)."""
    if role == "draft" and n_ctx != 512:
        pytest.skip("one context suffices for the draft placement")
    path = model_path(name)
    # Loaded below without amx_rows: on an AMX CPU, in AMX only where its batch kernel is sound.
    shape = ModelShape.from_gguf(
        validate_gguf(path), target=role == "target", amx=amx_holds_weights(False)
    )
    p = Placement(
        n_ctx=n_ctx, n_ubatch=256, type_k=type_k, type_v=type_v, flash_attn=flash, n_outputs=65
    )
    est = estimate(shape, p)
    opts = LoadOptions(
        n_ctx=n_ctx,
        n_threads=THREADS,
        n_batch=256,
        flash_attn=flash,
        type_k=memory.CACHE_TYPES[type_k][0],
        type_v=memory.CACHE_TYPES[type_v][0],
        n_outputs_max=65,
        exact_rows=role == "target",
    )
    with Model(path, opts) as m:
        got = m.context_params()
    buf = got["buffers_mib"]
    # The KV cache is exact arithmetic: cells x layers x width x type size.
    assert got["n_ctx"] == est.n_ctx
    assert got["type_k"] == type_k and got["type_v"] == type_v
    assert buf["kv"] * MIB == pytest.approx(est.kv, rel=0.01), (buf, est)
    # Weights: the file's tensor data, plus the CPU's repacked copies of some layer matrices.
    assert buf["model"] * MIB == pytest.approx(est.weights + est.repack, rel=0.03), (buf, est)
    # Compute + output buffers: an upper bound, and not a wild one.
    actual = (buf.get("compute", 0) + buf.get("output", 0)) * MIB
    assert actual <= est.compute <= 3 * actual + 16 * MIB, (buf, est)


def _shape(n_layer=30, weights=500 * MIB) -> ModelShape:
    return ModelShape(
        arch="llama",
        n_layer=n_layer,
        n_ctx_train=8192,
        n_embd=576,
        n_head=9,
        n_vocab=49152,
        kv_width=(3 * 128,) * n_layer,
        weight_bytes=weights,
        file_bytes=weights + MIB,
    )


BIG_HOST = HostMemory(total=64 << 30, available=60 << 30, swap_free=0)


def test_explicit_ngl_that_does_not_fit_is_refused_with_what_fits():
    s = _shape()
    with pytest.raises(ModelError) as ei:
        plan_memory([("big", s, Placement(n_ctx=4096), 31, "--ngl")], BIG_HOST, gpu_free=200 * MIB)
    msg = str(ei.value)
    assert "--ngl 31" in msg and "GPU memory" in msg
    fits = memory.layers_that_fit(s, Placement(n_ctx=4096), 200 * MIB)
    assert 0 < fits < 31 and f"--ngl {fits} fits" in msg
    # ... and that number really fits.
    assert estimate(s, Placement(n_ctx=4096, n_gpu_layers=fits)).device <= 200 * MIB
    assert estimate(s, Placement(n_ctx=4096, n_gpu_layers=fits + 1)).device > 200 * MIB


def test_all_layers_takes_what_fits_and_says_so():
    s = _shape()
    planned, notes = plan_memory(
        [("big", s, Placement(n_ctx=4096), -1, "--ngl")], BIG_HOST, gpu_free=200 * MIB
    )
    n = planned[0].placement.n_gpu_layers
    assert 0 < n < 31
    assert any(f"{n} of 31 layers of big fit in GPU memory" in x for x in notes)
    # Plenty of GPU memory: everything goes, silently.
    planned, notes = plan_memory(
        [("big", s, Placement(n_ctx=4096), -1, "--ngl")], BIG_HOST, gpu_free=8 << 30
    )
    assert planned[0].placement.n_gpu_layers == 31 and not notes


def test_target_gets_the_gpu_first_and_the_draft_what_is_left():
    t, d = _shape(weights=600 * MIB), _shape(weights=150 * MIB)
    planned, _ = plan_memory(
        [
            ("t", t, Placement(n_ctx=2048), -1, "--ngl"),
            ("d", d, Placement(n_ctx=2048), -1, "--ngl-draft"),
        ],
        BIG_HOST,
        gpu_free=850 * MIB,
    )
    assert planned[0].placement.n_gpu_layers == 31
    assert 0 < planned[1].placement.n_gpu_layers < 31
    assert sum(p.estimate.device for p in planned) <= 850 * MIB


def test_cpu_only_build_ignores_ngl_with_a_warning():
    s = _shape()
    planned, notes = plan_memory(
        [("m", s, Placement(n_ctx=2048), 99, "--ngl")], BIG_HOST, gpu_free=None
    )
    assert planned[0].placement.n_gpu_layers == 0 and planned[0].estimate.device == 0
    # 99 is more layers than the model has: said as llama.cpp's `all`, what it means
    assert any("no GPU here to offload to" in x and "--ngl all" in x for x in notes)
    # The default (-1, all) says nothing on a CPU build.
    _, notes = plan_memory([("m", s, Placement(n_ctx=2048), -1, "--ngl")], BIG_HOST, gpu_free=None)
    assert notes == []


def test_a_target_on_rpc_workers_and_its_draft_here_draw_on_their_own_memory():
    s = _shape()
    items = [
        ("t", s, Placement(n_ctx=2048), -1, "--ngl"),
        ("d", s, Placement(n_ctx=2048), -1, "--ngl-draft"),
    ]
    planned, notes = plan_memory(items, BIG_HOST, gpu_free=[64 * 1024 * MIB, None])
    assert (
        planned[0].placement.n_gpu_layers == s.n_layer + 1
        and planned[1].placement.n_gpu_layers == 0
    )
    assert notes == []


def test_host_memory_refusal_names_the_kv_cache_and_ctx():
    s = _shape()
    small = HostMemory(total=4 << 30, available=2 << 30, swap_free=0)
    with pytest.raises(ModelError) as ei:
        plan_memory([("m", s, Placement(n_ctx=200_000), -1, "--ngl")], small, gpu_free=None)
    msg = str(ei.value)
    assert "not enough memory" in msg and "--ctx" in msg and "KV cache" in msg
    # Fits only with swap: a warning, not a refusal.
    need = estimate(s, Placement(n_ctx=4096)).host
    tight = HostMemory(total=8 << 30, available=need - MIB, swap_free=1 << 30)
    _, notes = plan_memory([("m", s, Placement(n_ctx=4096), -1, "--ngl")], tight, gpu_free=None)
    assert any("swap" in x for x in notes)
    # --no-mem-check: no refusal.
    plan_memory(
        [("m", s, Placement(n_ctx=200_000), -1, "--ngl")], small, gpu_free=None, check=False
    )


def test_quantized_cache_shrinks_the_kv_estimate():
    s = _shape()
    f16 = s.kv_bytes(4096)
    assert s.kv_bytes(4096, "q8_0", "q8_0") == pytest.approx(f16 * 34 / 64, rel=1e-6)
    assert s.kv_bytes(4096, "f32", "f32") == 2 * f16
    assert s.kv_bytes(100) == s.kv_bytes(256)  # llama.cpp pads the context to 256 cells


@pytest.mark.models  # reads the pair's files (pulled by make install)
def test_cli_refuses_a_context_that_cannot_fit_before_loading(tmp_path):
    r = subprocess.run(
        [
            SPECRUN,
            "generate",
            "--prompt",
            "hi",
            "-n",
            "1",
            "--ctx",
            "200000000",
            "--mode",
            "none",
            "-t",
            str(THREADS),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "not enough memory" in lines[0] and "--ctx" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_target_repacking_is_the_runtimes():
    from specrun.llama.buffers import row_exact_repack

    assert memory.TARGET_REPACKED_TYPES == row_exact_repack()


def test_q4_k_is_repacked_for_a_target_only_where_the_build_says_so(monkeypatch):
    """A target's Q4_K layers go to CPU_REPACK only with patches/' row-exact Q4_K gemv, which the
    build reports as SPECRUN_Q4_K_REPACK; any other llama.cpp (an unpatched one, ARM's kernels)
    keeps them in plain buffers."""
    from specrun.llama import buffers

    monkeypatch.setattr(buffers, "system_info", lambda: "CPU : AVX2 = 1 | REPACK = 1 |")
    assert buffers.row_exact_repack() == ("Q4_0",)
    monkeypatch.setattr(
        buffers, "system_info", lambda: "CPU : AVX2 = 1 | SPECRUN_Q4_K_REPACK = 1 | REPACK = 1 |"
    )
    assert buffers.row_exact_repack() == ("Q4_0", "Q4_K")


def test_amx_copies_are_counted(model_path):
    """Whatever this CPU: with AMX holding weights, the estimate counts its packed copies of the
    layer matrices it takes (Q4_0: the file's bytes; Q8_0: 4 more a block) and of the output
    projection (SmolLM2's tied Q8_0 token_embd), as llama.cpp's "AMX model buffer" reports them
    on an AMX CPU (89.02 MiB for this file); F16 stays out of AMX, so nothing is copied."""
    info = validate_gguf(model_path(SMOL_DRAFT))
    assert info.output_matrix == ("Q8_0", 49152, 576)
    layers = info.layer_bytes_by_type["Q4_0"]
    assert ModelShape.from_gguf(info, target=True, amx=True).repack_bytes == (
        layers + 49152 * (576 // 32) * (34 + 4)
    )
    assert round(ModelShape.from_gguf(info, amx=True).repack_bytes / MIB, 2) == 89.02
    assert ModelShape.from_gguf(info, target=True, amx=False).repack_bytes == layers
    f16 = validate_gguf(model_path("smollm2-135m-instruct-f16"))
    assert ModelShape.from_gguf(f16, target=True, amx=True).repack_bytes == 0
