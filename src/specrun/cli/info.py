"""`specrun info`: what this llama.cpp build and machine can do, and what a model or pair needs.

Nothing is pulled and no weights are loaded: sizes and the memory estimate come from the GGUF
headers, compatibility from a vocabulary-only load (milliseconds).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from importlib import metadata
from typing import Annotated, Any

import typer

from specrun.cli.options import model_options
from specrun.errors import ModelError, SpecrunError
from specrun.models import compat
from specrun.models.hub import quant_tags
from specrun.models.registry import Registry


def register(app: typer.Typer) -> None:
    app.command(
        name="info",
        short_help="What this build and machine can do, and what a model or pair will need.",
    )(info)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def build_info() -> dict[str, Any]:
    from specrun.llama import backend as runtime
    from specrun.llama import native

    sysinfo = runtime.system_info()
    # patches/' multi-column kernels, by version: 1 Q8_0, 3 K-quants too, 4 Q5_0 too
    cols = runtime.build_number("SPECRUN_COLS")
    devs = runtime.devices()
    from specrun.llama.rpc import supports_rpc

    backends = sorted({d.name.rstrip("0123456789") for d in devs}) or ["CPU"]
    # llama_supports_gpu_offload() is also true for a build with the RPC backend alone: whether
    # this machine has a GPU is whether llama.cpp registered one.
    gpu = bool(runtime.local_gpus())
    return {
        "specrun": _version("specrun"),
        "llama_cpp_python": _version("llama-cpp-python"),
        "gpu_offload": gpu,
        "rpc": supports_rpc(),
        "kind": "GPU (" + ", ".join(b for b in backends if b != "CPU") + ")" if gpu else "CPU only",
        "backends": backends,
        "mmap": runtime.supports_mmap(),
        "mlock": runtime.supports_mlock(),
        "system_info": sysinfo,
        "batch_exact_cpu": runtime.batch_exact_cpu(),
        # patches/: llamafile's sgemm takes a prompt's batches of N+ rows, never a verify pass (0: none)
        "prompt_sgemm_rows": runtime.sgemm_rows(),
        "batched_q8_0_kernel": cols >= 1,
        "batched_k_quant_kernel": cols >= 3,
        "batched_q5_0_kernel": cols >= 4,
        "row_exact_q4_k_repack": "SPECRUN_Q4_K_REPACK = 1" in sysinfo,
        "batched_f32_kernel": "SPECRUN_F32_COLS = " in sysinfo,
        "batched_f16_kernel": "SPECRUN_F16_COLS = " in sysinfo,
        "batched_bf16_kernel": "SPECRUN_BF16_COLS = " in sysinfo,
        "row_exact_flash_attn": runtime.flash_attn_row_exact(),
        # patches/: batches of 1..N rows keep a compute graph each (0: llama.cpp's one graph)
        "graphs_per_batch_size": runtime.graphs_per_batch_size(),
        "graph_direct": runtime.graph_direct(),
        # patches/: F16 KV attention by blocks of N cells in SIMD (0: llama.cpp's cell-at-a-time loop)
        "flash_attn_block": runtime.flash_attn_block(),
        # patches/: --draft-p-min's check (a row's top softmax probability) in C, not numpy
        "top_prob_in_c": native.top_prob() is not None,
        # AMX weight buffers: None (none here), "sound" (its batch kernel runs: patches/ or
        # SPECRUN_ALLOW_AMX=1) or "single rows" (it would crash: drafts decode row by row)
        "amx": _amx_state(),
        "devices": [d.__dict__ for d in devs],
    }


def _amx_state() -> str | None:
    from specrun.llama.buffers import amx_batches_sound, cpu_extra_buffer_types

    if "AMX" not in cpu_extra_buffer_types():
        return None
    return "sound" if amx_batches_sound() else "single rows"


def _model_facts(
    role: str, name: str, path: Any, info: Any, shape: Any, planned: Any, opts: Any
) -> dict[str, Any]:
    ftype = info.get("general.file_type")
    quant = quant_tags([path.name])
    return {
        "role": role,
        "name": name,
        "path": str(path),
        "file_bytes": shape.file_bytes,
        "arch": shape.arch,
        "size_label": info.get("general.size_label"),
        "quant": quant[0] if quant else (f"file_type {ftype}" if ftype is not None else None),
        "n_layer": shape.n_layer,
        "n_ctx_train": shape.n_ctx_train,
        "n_vocab": shape.n_vocab,
        "n_embd": shape.n_embd,
        "placement": {
            "n_ctx": planned.estimate.n_ctx,
            "gpu_layers": planned.placement.n_gpu_layers,
            "type_k": planned.placement.type_k,
            "type_v": planned.placement.type_v,
            # on / off as placed; auto where llama.cpp decides (a model offloaded to a local GPU)
            "flash_attn": {True: "on", False: "off"}.get(planned.placement.flash_attn, "auto"),
            "rpc": list(opts.rpc_endpoints(role == "draft")),
        },
        "estimate": planned.estimate.to_dict(),
    }


def models_info(opts: Any, explicit: bool) -> dict[str, Any]:
    """Sizes, estimate and compatibility for the model or pair the options name (nothing pulled)."""
    from specrun import session as loader
    from specrun.llama.buffers import amx_holds_weights
    from specrun.llama.model import LoadOptions, Model
    from specrun.models.memory import ModelShape, host_memory

    registry = Registry.load(verbose=opts.verbose)
    try:
        p = loader.plan(opts, registry, pull=False)
    except SpecrunError as exc:
        if explicit:
            raise
        return {"error": str(exc)}
    resolved = [r for r in (p.target, p.draft) if r is not None]
    infos = [loader._prevalidate(r.path) for r in resolved]
    try:  # what `generate` would say, without refusing here
        planned, notes = loader.memory_plan(p, opts, infos)
    except ModelError as exc:
        planned, notes = loader.memory_plan(p, replace(opts, mem_check=False), infos)
        notes = [str(exc), *notes]
    mem = host_memory()
    need = sum(x.estimate.host for x in planned)
    fits = need <= mem.available + mem.swap_free
    out: dict[str, Any] = {
        "pair_draft_max": p.pair_draft_max,
        "workers": workers_info(opts),
        "models": [
            _model_facts(
                "target" if i == 0 else "draft",
                r.name,
                r.path,
                info,
                ModelShape.from_gguf(info, target=i == 0, amx=amx_holds_weights(i > 0)),
                pl,
                opts,
            )
            for i, (r, info, pl) in enumerate(zip(resolved, infos, planned, strict=True))
        ],
        "memory": {
            "host_needed": need,
            "device_needed": sum(x.estimate.device for x in planned),
            "host_available": mem.available,
            "fits": fits,
            "notes": notes,
        },
    }
    from specrun.llama.backend import gpu_free_memory
    from specrun.models.memory import fit_ctx

    # serve's context when --ctx is not given: the trained one, fitted to free memory.
    out["ctx_fit"] = fit_ctx(planned, mem.available + (gpu_free_memory() or 0)).to_dict()
    from specrun.chat_template import describe_template

    given = opts.template_source()
    gguf = infos[0].get("tokenizer.chat_template") if infos else None
    source = given if given is not None else (str(gguf) if gguf else None)
    flag = (
        f"--chat-template-file {opts.chat_template_file}"
        if opts.chat_template_file is not None
        else "--chat-template"
    )
    out["chat_template"] = {
        "from": "option" if given is not None else ("gguf" if source else None),
        "text": describe_template(source, flag if given is not None else None),
    }
    if p.draft is not None:
        with (
            Model(p.target.path, LoadOptions(vocab_only=True)) as t,
            Model(p.draft.path, LoadOptions(vocab_only=True)) as d,
        ):
            bad = compat.problems(t.vocab_facts(), d.vocab_facts(), t.token_text, d.token_text)
        out["compatible"] = not bad
        out["problems"] = bad
    return out


def workers_info(opts: Any) -> list[dict[str, Any]]:
    """What each --rpc worker said when checked (protocol's HELLO, its devices' memory)."""
    if not opts.rpc:
        return []
    from specrun.llama.rpc import check_workers

    return [
        {
            "endpoint": str(w.endpoint),
            "protocol": ".".join(map(str, w.version)),
            "devices": [{"free": free, "total": total} for free, total in w.memory],
        }
        for w in check_workers(opts.rpc_endpoints())
    ]


def _gib(n: int | float) -> str:
    from specrun.models.memory import gib

    return gib(n)


def render_text(
    b: dict[str, Any], m: dict[str, Any], models: dict[str, Any] | None, opts: Any
) -> str:
    lines = [
        f"specrun {b['specrun']}  ·  llama-cpp-python {b['llama_cpp_python']}",
        f"build     {b['kind']}; backends {', '.join(b['backends'])}; GPU offload "
        f"{'yes' if b['gpu_offload'] else 'no (make install GPU=cuda|metal for one)'}; "
        f"RPC {'yes (specrun worker, --rpc)' if b.get('rpc') else 'no'}; "
        f"mmap {'yes' if b['mmap'] else 'no'}, mlock {'yes' if b['mlock'] else 'no'}",
        f"cpu flags {b['system_info']}",
        "exactness "
        + (
            "CPU batches are row-exact: a row decoded in a batch gets the logits it gets alone, bit for bit"
            + (
                "; batched "
                + ", ".join(
                    f
                    for f, k in (
                        ("Q8_0", "batched_q8_0_kernel"),
                        ("Q4_K, Q6_K", "batched_k_quant_kernel"),
                        ("F32", "batched_f32_kernel"),
                        ("F16", "batched_f16_kernel"),
                        ("BF16", "batched_bf16_kernel"),
                    )
                    if b.get(k)
                )
                + " rows take specrun's multi-column kernels (patches/)"
                if b["batched_q8_0_kernel"] or b.get("batched_f16_kernel")
                else ""
            )
            + (
                f"; prompt batches of {b['prompt_sgemm_rows']}+ rows take llamafile's sgemm "
                "(longer than any verify pass; patches/)"
                if b.get("prompt_sgemm_rows")
                else ""
            )
            if b["batch_exact_cpu"]
            else "built with llamafile's sgemm on every batch: batched rows sum in another order than "
            "single rows, so greedy speculation can differ from the target alone at near-ties; rebuild "
            "with make install (patches/), or with CMAKE_ARGS=-DGGML_LLAMAFILE=OFF"
        ),
        "graphs    "
        + (
            f"one compute graph kept per batch size of 1-{b['graphs_per_batch_size']} rows: "
            "a verify pass and the single row after it reuse theirs (patches/)"
            + (
                ", computed without llama.cpp's scheduler once placed (SPECRUN_GRAPH_DIRECT)"
                if b.get("graph_direct")
                else ""
            )
            if b.get("graphs_per_batch_size")
            else "llama.cpp keeps one compute graph: each change of batch size rebuilds it "
            "(every speculative step pays two; make install's build keeps one per size)"
        ),
        "attention "
        + (
            f"an F16 KV cache is attended {b['flash_attn_block']} cells at a time in SIMD, "
            "each row as alone (patches/)"
            if b.get("flash_attn_block")
            else "llama.cpp's CPU attention loop (a cell at a time)"
        ),
        *(
            [
                "amx       "
                + (
                    "Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K and IQ4_XS layer matrices in AMX buffers, "
                    "batches and single rows row-exact (the tile config loaded whole, patches/)"
                    if b["amx"] == "sound"
                    else "this build's AMX batch kernel crashes (ggml-org/llama.cpp#20824): a "
                    "draft decodes in AMX one row at a time, a target keeps out of AMX "
                    "(make install's build fixes it)"
                )
            ]
            if b.get("amx")
            else []
        ),
        "p-min     "
        + (
            "--draft-p-min's check (a row's top softmax probability) runs in C (patches/)"
            if b.get("top_prob_in_c")
            else "--draft-p-min's check runs in numpy (make install's build has it in C, "
            "about half the time a step)"
        ),
    ]
    for d in b["devices"]:
        mem = f"{_gib(d['free'])} free of {_gib(d['total'])}" if d["total"] else "memory n/a"
        lines.append(f"device    {d['name']} ({d['kind']}): {d['description']}; {mem}")
    lines.append(
        f"machine   {m['cpu']}; {m['physical_cores']} physical cores, {m['logical_cpus']} logical CPUs; "
        f"RAM {_gib(m['ram_total'])} ({_gib(m['ram_available'])} available), swap {_gib(m['swap_free'])} free"
    )
    t_threads = opts.threads or m["default_threads"]
    lines.append(
        f"threads   target {t_threads}, draft {opts.threads_draft or t_threads} "
        f"(default: physical cores)"
    )
    if models is None:
        return "\n".join(lines)
    if "error" in models:
        lines.append(f"models    {models['error']}")
        return "\n".join(lines)
    for w in models.get("workers", []):
        devs = "; ".join(
            f"device {i}: {_gib(d['free'])} free of {_gib(d['total'])}"
            for i, d in enumerate(w["devices"])
        )
        lines.append(f"worker    {w['endpoint']} (RPC protocol v{w['protocol']}): {devs}")
    lines.append("")
    for x in models["models"]:
        e, pl = x["estimate"], x["placement"]
        on = f"the RPC workers {','.join(pl['rpc'])}" if pl.get("rpc") else "the GPU"
        where = (
            f"{pl['gpu_layers']}/{x['n_layer'] + 1} layers on {on}" if pl["gpu_layers"] else "CPU"
        )
        lines.append(f"{x['role']:<6}    {x['name']}  ({x['path']})")
        lines.append(
            f"          {x['arch']}"
            + (f" {x['size_label']}" if x["size_label"] else "")
            + f", {x['quant'] or '?'}, {_gib(x['file_bytes'])}; {x['n_layer']} layers, "
            f"n_embd {x['n_embd']}, vocab {x['n_vocab']}, trained context {x['n_ctx_train']}"
        )
        lines.append(
            f"          memory at ctx {pl['n_ctx']} (K {pl['type_k']}, V {pl['type_v']}, flash attention "
            f"{pl['flash_attn']}): weights {_gib(e['weights'])} + KV {_gib(e['kv'])} "
            f"+ compute {_gib(e['compute'])} = {_gib(e['total'])}; {where}"
        )
    if "chat_template" in models:
        lines.append(f"chat      template: {models['chat_template']['text']}")
    mm = models["memory"]
    verdict = "fits" if mm["fits"] else "does NOT fit"
    lines.append(
        f"memory    {_gib(mm['host_needed'])} of RAM"
        + (
            f" + {_gib(mm['device_needed'])} of {'GPU/worker' if models.get('workers') else 'GPU'} memory"
            if mm["device_needed"]
            else ""
        )
        + f" needed, {_gib(mm['host_available'])} available: {verdict}"
    )
    for n in mm["notes"]:
        lines.append(f"          {n}")
    fit = models.get("ctx_fit")
    if fit:
        lines.append(
            f"context   trained {fit['trained']}; serve without --ctx: {fit['n_ctx']}"
            + (
                f" (the trained context needs more than {_gib(fit['budget'])} of free memory)"
                if fit["reduced"]
                else f" ({_gib(fit['need'])}, fits in free memory)"
            )
        )
    if "compatible" in models:
        if models["compatible"]:
            lines.append(
                "pair      compatible: the draft can speculate for the target"
                + (
                    f" (pair draft_max {models['pair_draft_max']})"
                    if models["pair_draft_max"]
                    else ""
                )
            )
        else:
            lines.append("pair      NOT compatible: " + "; ".join(models["problems"]))
    return "\n".join(lines)


@model_options()
def info(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")] = False,
    models: Annotated[
        bool,
        typer.Option(
            "--models/--no-models",
            help="Also the model or pair (default: the registry's default pair).",
        ),
    ] = True,
    opts: Any = None,
) -> None:
    """What this llama.cpp build and machine can do (backends, devices, memory, threads), and for a
    model or pair: sizes, layers, context, the memory it will need, and whether it is compatible.
    Nothing is pulled or loaded."""
    from specrun.machine import machine_info

    explicit = bool(opts.pair or opts.model or opts.model_draft)
    b = build_info()
    m = machine_info()
    mi = models_info(opts, explicit) if models or explicit else None
    if as_json:
        sys.stdout.write(json.dumps({"build": b, "machine": m, "models": mi}, indent=1) + "\n")
    else:
        sys.stdout.write(render_text(b, m, mi, opts) + "\n")
