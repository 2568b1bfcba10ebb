"""How much memory a model will take, decided from its GGUF header before llama.cpp loads it.

llama.cpp allocates three things per model: the weights (mmapped from the file; on the GPU for the
offloaded layers), the KV cache (n_ctx cells x layers x KV width, in the chosen cache types) and
the compute buffers (scratch for one micro-batch's graph). The estimate adds these up per place
(host RAM, GPU memory) so that a model that will not fit is refused with the figure that matters
(and what to change) instead of dying halfway through the load. It is checked against llama.cpp's
own log of its buffer sizes in tests/test_memory.py.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace

from specrun.errors import ModelError, UsageError
from specrun.llama.buffers import amx_bytes, amx_fits, layer_placement
from specrun.llama.gguf import GGUFInfo, OmittedValue, matrix_bytes

# llama.cpp's KV cache types (ggml type id, bytes per block, elements per block): `--cache-type-k`.
CACHE_TYPES: dict[str, tuple[int, int, int]] = {
    "f32": (0, 4, 1),
    "f16": (1, 2, 1),
    "bf16": (30, 2, 1),
    "q8_0": (8, 34, 32),
    "q4_0": (2, 18, 32),
    "q4_1": (3, 20, 32),
    "iq4_nl": (20, 18, 32),
    "q5_0": (6, 22, 32),
    "q5_1": (7, 24, 32),
}
DEFAULT_CACHE_TYPE = "f16"
CTX_PAD = 256  # llama.cpp rounds n_ctx up to a multiple of this
REPACKED_TYPES = ("Q4_0", "Q4_K", "IQ4_NL")
# What a target's weights may be repacked as: only the types whose repacked kernels are row-exact
# with specrun's build (buffers.row_exact_repack, kept in step by tests/test_memory.py; a build
# without patches/ repacks fewer, and this estimate is then an upper bound).
TARGET_REPACKED_TYPES = ("Q4_0", "Q4_K")
GIB = 1024**3
MIB = 1024**2


def _copied_bytes(info: GGUFInfo, target: bool, amx: bool) -> int:
    """Weight bytes the CPU backend copies beside the mapped file: repacked layer matrices
    (CPU_REPACK) and, with ``amx``, AMX's packed ones, as buffers.weight_buffers places them."""
    repacked = TARGET_REPACKED_TYPES if target else REPACKED_TYPES
    if not amx:
        return sum(info.layer_bytes_by_type.get(t, 0) for t in repacked)

    stands, wheres = layer_placement(info.layer_matrices, target, True, True)
    total = 0
    for (_n, t, rows, cols), where in zip(info.layer_matrices, wheres, strict=True):
        # llama.cpp's own placement repacks by type; a placement by name repacks what it names
        repacks = t in repacked if stands else where == "CPU_REPACK"
        if where == "AMX":
            total += amx_bytes(t, rows, cols)
        elif repacks:
            total += matrix_bytes(t, rows, cols)
    out = info.output_matrix  # llama.cpp's own placement puts it in AMX too, where AMX takes it
    if stands and out is not None and amx_fits(*out):
        total += amx_bytes(*out)
    return total


def cache_type_id(name: str, flag: str) -> int:
    key = name.lower()
    if key not in CACHE_TYPES:
        raise UsageError(f"{flag} must be one of {', '.join(CACHE_TYPES)}, got {name!r}")
    return CACHE_TYPES[key][0]


def _type_bytes(name: str, n: int) -> float:
    _, block_bytes, block_elems = CACHE_TYPES[name]
    return n * block_bytes / block_elems


def padded_ctx(n_ctx: int) -> int:
    return max(CTX_PAD, math.ceil(n_ctx / CTX_PAD) * CTX_PAD)


def _int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, tuple) and value and all(isinstance(v, int) for v in value):
        return max(int(v) for v in value)
    return None


def _per_layer(value: object, n_layer: int) -> list[int] | None:
    if (
        isinstance(value, tuple)
        and len(value) == n_layer
        and all(isinstance(v, int) for v in value)
    ):
        return [int(v) for v in value]
    v = _int(value)
    return None if v is None else [v] * n_layer


@dataclass(frozen=True)
class ModelShape:
    """The hyperparameters that size a model's buffers, read from its GGUF metadata."""

    arch: str
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: int
    n_vocab: int
    kv_width: tuple[int, ...]  # per layer: n_head_kv * (key_length + value_length)
    weight_bytes: int  # the tensor data section of the file
    file_bytes: int
    # Layer matrices the CPU backend copies into its interleaved layout (ggml's CPU_REPACK
    # buffer, beside the mmapped file): Q4_0, Q4_K and IQ4_NL with AVX2/NEON.
    repack_bytes: int = 0

    @classmethod
    def from_gguf(cls, info: GGUFInfo, target: bool = True, amx: bool = False) -> ModelShape:
        """``target``: placed as a target is (runtime._weight_buffers: only row-exact repacking);
        False for a draft, which llama.cpp repacks as it likes. ``amx``: the CPU keeps copies of
        the matrices AMX takes in its packed layout (buffers.amx_holds_weights), the output
        projection's too where llama.cpp's own placement stands (weight_buffers)."""
        arch = info.architecture or "?"
        a = arch + "."
        n_layer = _int(info.get(a + "block_count"))
        n_embd = _int(info.get(a + "embedding_length"))
        n_head = _int(info.get(a + "attention.head_count"))
        if not n_layer or not n_embd or not n_head:
            raise ModelError(
                f"{info.path}: no {a}block_count / embedding_length / attention.head_count in its "
                "metadata, so its memory cannot be estimated"
            )
        heads_kv = (
            _per_layer(info.get(a + "attention.head_count_kv", n_head), n_layer)
            or [n_head] * n_layer
        )
        head_dim = n_embd // n_head
        k_len = _int(info.get(a + "attention.key_length")) or head_dim
        v_len = _int(info.get(a + "attention.value_length")) or head_dim
        tokens = info.get("tokenizer.ggml.tokens")
        if isinstance(tokens, OmittedValue):
            n_vocab = tokens.length
        elif isinstance(tokens, tuple):
            n_vocab = len(tokens)
        else:
            n_vocab = _int(info.get(a + "vocab_size")) or 0
        data = (
            info.file_size - info.tensor_data_offset
            if info.tensor_data_offset >= 0
            else info.file_size
        )
        return cls(
            arch=arch,
            n_layer=n_layer,
            n_ctx_train=_int(info.get(a + "context_length")) or 0,
            n_embd=n_embd,
            n_head=n_head,
            n_vocab=n_vocab,
            kv_width=tuple(h * (k_len + v_len) for h in heads_kv),
            weight_bytes=data,
            file_bytes=info.file_size,
            repack_bytes=_copied_bytes(info, target, amx),
        )

    def kv_bytes(
        self,
        n_ctx: int,
        type_k: str = DEFAULT_CACHE_TYPE,
        type_v: str = DEFAULT_CACHE_TYPE,
        layers: int | None = None,
    ) -> int:
        """The KV cache of ``n_ctx`` cells (padded as llama.cpp does) over the first ``layers``."""
        cells = padded_ctx(n_ctx)
        widths = self.kv_width[: self.n_layer if layers is None else layers]
        # K and V are the same width for the models here; split the per-layer width evenly.
        total = 0.0
        for w in widths:
            total += _type_bytes(type_k, cells * w // 2) + _type_bytes(type_v, cells * w // 2)
        return int(total)


@dataclass(frozen=True)
class Placement:
    """How one model is to be loaded: what the estimate depends on."""

    n_ctx: int
    n_ubatch: int = 512
    n_gpu_layers: int = 0  # layers actually offloaded (0 on a CPU-only build)
    type_k: str = DEFAULT_CACHE_TYPE
    type_v: str = DEFAULT_CACHE_TYPE
    flash_attn: bool = False
    n_outputs: int = 65  # n_outputs_max: rows of logits one decode may ask for (K drafts + 1)


@dataclass(frozen=True)
class Estimate:
    weights: int
    repack: int  # CPU copies of repacked layer matrices (on top of the mmapped weights)
    kv: int
    compute: int
    host: int  # bytes in RAM
    device: int  # bytes in GPU memory
    n_ctx: int
    n_gpu_layers: int

    @property
    def total(self) -> int:
        return self.host + self.device

    def to_dict(self) -> dict[str, int]:
        d = asdict(self)
        d["total"] = self.total
        return d


def compute_bytes(shape: ModelShape, p: Placement) -> int:
    """llama.cpp's compute buffer for one micro-batch of ``n_ubatch`` tokens, plus its output rows.

    An upper bound made of the graph's big tensors, added up (llama.cpp's allocator reuses some of
    them, so the real buffer is smaller): the logits of the rows that may ask for them
    (``min(n_ubatch, n_outputs_max)``: 65 here, not n_ubatch: that is what n_outputs_max saves),
    the attention scores (n_head x n_ubatch x n_ctx floats, none with flash attention), the mask,
    and the activations; plus the output buffer the logits are copied to. Calibrated against
    llama.cpp's "compute buffer size" log for SmolLM2 and Gemma 3 at n_ctx 512-16384, n_ubatch
    64/512, flash attention on/off (tests/test_memory.py keeps it within 1-3x of the real one).
    """
    cells = padded_ctx(p.n_ctx)
    ub = max(1, min(p.n_ubatch, cells))
    logits = 4 * min(ub, p.n_outputs) * shape.n_vocab
    scores = 0 if p.flash_attn else 4 * shape.n_head * ub * cells
    mask = 4 * ub * cells
    activations = 4 * ub * shape.n_embd * 8 + 2 * MIB
    outputs = 4 * shape.n_vocab * p.n_outputs
    return int(logits + scores + mask + activations + outputs)


def estimate(shape: ModelShape, p: Placement) -> Estimate:
    layers_dev = max(0, min(p.n_gpu_layers, shape.n_layer + 1))
    repeating = min(layers_dev, shape.n_layer)
    # Weights: the repeating layers carry almost all of them; the output layer (llama.cpp counts it
    # as layer n_layer) is charged with the per-layer share too, which errs on the safe side.
    per_layer = shape.weight_bytes / (shape.n_layer + 1)
    w_dev = int(per_layer * layers_dev)
    repack = int(shape.repack_bytes * (shape.n_layer - repeating) / shape.n_layer)
    kv_total = shape.kv_bytes(p.n_ctx, p.type_k, p.type_v)
    kv_dev = shape.kv_bytes(p.n_ctx, p.type_k, p.type_v, layers=repeating) if repeating else 0
    comp = compute_bytes(shape, p)
    # With any layer offloaded the graph runs on the GPU; the logits rows still land in RAM.
    outputs = 4 * shape.n_vocab * p.n_outputs
    comp_dev = comp - outputs if layers_dev else 0
    return Estimate(
        weights=shape.weight_bytes,
        repack=repack,
        kv=kv_total,
        compute=comp,
        host=(shape.weight_bytes - w_dev) + repack + (kv_total - kv_dev) + (comp - comp_dev),
        device=w_dev + kv_dev + comp_dev,
        n_ctx=padded_ctx(p.n_ctx),
        n_gpu_layers=layers_dev,
    )


def layers_that_fit(shape: ModelShape, p: Placement, free_device: int) -> int:
    """The most layers (0..n_layer+1) whose estimate fits in ``free_device`` bytes."""
    best = 0
    for n in range(shape.n_layer + 2):
        e = estimate(shape, Placement(**{**asdict(p), "n_gpu_layers": n}))
        if e.device <= free_device:
            best = n
        else:
            break
    return best


@dataclass(frozen=True)
class HostMemory:
    total: int
    available: int
    swap_free: int


def host_memory() -> HostMemory:
    """RAM from /proc/meminfo (Linux); elsewhere the physical total and no swap."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    fields[key] = int(parts[0]) * 1024
    except OSError:
        pass
    if "MemTotal" in fields:
        return HostMemory(
            total=fields["MemTotal"],
            available=fields.get("MemAvailable", fields.get("MemFree", 0)),
            swap_free=fields.get("SwapFree", 0),
        )
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        total = 0
    return HostMemory(total=total, available=total, swap_free=0)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def check_host(estimates: list[tuple[str, Estimate]], mem: HostMemory) -> str | None:
    """Raise when the models cannot fit in RAM (+ swap); a warning line when they need swap."""
    if mem.total <= 0:
        return None
    need = sum(e.host for _, e in estimates)
    # Weights are mmapped: pages of a file already in the page cache are counted "available",
    # and cold pages can be dropped again, so they strain RAM less than the KV cache does.
    if need > mem.available + mem.swap_free:
        biggest = max(estimates, key=lambda ne: ne[1].kv)
        name, e = biggest
        hint = (
            f"; the KV cache of {name} alone is {gib(e.kv)} at {e.n_ctx} tokens: try a smaller --ctx"
            + (" / --ctx-draft" if len(estimates) > 1 else "")
            + " or a quantized --cache-type-k/-v"
            if e.kv > need / 4
            else ""
        )
        parts = ", ".join(f"{n} {gib(x.host)}" for n, x in estimates)
        raise ModelError(
            f"not enough memory: loading needs about {gib(need)} of RAM ({parts}), "
            f"{gib(mem.available)} is available{hint}"
        )
    if need > mem.available:
        return (
            f"warning: loading needs about {gib(need)} of RAM and {gib(mem.available)} is available; "
            "it will swap"
        )
    return None


@dataclass(frozen=True)
class Planned:
    """One model's placement after the fit check, and what it will take."""

    name: str
    shape: ModelShape
    placement: Placement  # n_gpu_layers: the layers that will really be offloaded
    estimate: Estimate


def plan_memory(
    items: list[tuple[str, ModelShape, Placement, int, str]],
    host: HostMemory,
    gpu_free: int | None | list[int | None],
    check: bool = True,
) -> tuple[list[Planned], list[str]]:
    """Decide GPU layers and check that everything fits, before anything is loaded.

    ``items``: (name, shape, placement, requested --ngl, its flag), the target first: it gets the
    GPU memory first. ``gpu_free``: free bytes over the devices layers can be offloaded to (GPUs,
    RPC workers), None when there are none; a list: one such figure per item, for models placed
    on different devices (a target on RPC workers, its draft on this machine). ``--ngl -1``
    (all) takes the layers that fit and says so when that is not all of them; an explicit ``--ngl N`` that does not fit is refused with the number that would.
    Returns the plan and warning lines for stderr.
    """
    notes: list[str] = []
    pools = gpu_free if isinstance(gpu_free, list) else None
    left = None if isinstance(gpu_free, list) else gpu_free
    out: list[Planned] = []
    for i, (name, shape, pl, ngl, flag) in enumerate(items):
        if pools is not None:
            left = pools[i]
        all_layers = shape.n_layer + 1
        asked = "all" if ngl > all_layers else ngl  # --ngl all (or 999, as often written)
        want = all_layers if ngl < 0 else min(ngl, all_layers)
        if left is None:
            if ngl > 0:
                notes.append(
                    f"warning: there is no GPU here to offload to, so {flag} {asked} is ignored "
                    f"and {name} runs on the CPU (GPU builds: make install GPU=cuda|metal; "
                    "other machines: --rpc)"
                )
            want = 0
        elif check and want:
            fits = layers_that_fit(shape, replace(pl, n_gpu_layers=want), left)
            if fits < want:
                need = estimate(shape, replace(pl, n_gpu_layers=want)).device
                if ngl >= 0:
                    raise ModelError(
                        f"{flag} {asked}: {name} needs about {gib(need)} of GPU memory and "
                        f"{gib(left)} is free; {flag} {fits} fits"
                    )
                notes.append(
                    f"note: {fits} of {all_layers} layers of {name} fit in GPU memory "
                    f"({gib(left)} free); the rest run on the CPU"
                )
                want = fits
        placed = replace(pl, n_gpu_layers=want)
        e = estimate(shape, placed)
        if left is not None:
            left = max(0, left - e.device)
        out.append(Planned(name=name, shape=shape, placement=placed, estimate=e))
    if check:
        warn = check_host([(p.name, p.estimate) for p in out], host)
        if warn:
            notes.append(warn)
    return out, notes


FIT_STEP = 256  # a fitted context is a multiple of this
FIT_MIN = 512
FIT_SHARE = 0.85  # of the free memory a fitted context may take (the rest: the OS, other users)


@dataclass(frozen=True)
class CtxFit:
    """The context a server gets when none is asked for: the target's trained context, or less
    where that does not fit in free memory (llama-server's --fit)."""

    n_ctx: int
    trained: int
    budget: int  # bytes the models may take
    need: int  # bytes they take at n_ctx

    @property
    def reduced(self) -> bool:
        return self.n_ctx < self.trained

    def to_dict(self) -> dict[str, int | bool]:
        return {**asdict(self), "reduced": self.reduced}


def fit_ctx(planned: list[Planned], free: int, fallback: int = 4096) -> CtxFit:
    """The largest context, at most the target's trained one (``planned[0]``), for which every
    model of the plan (the draft at the same context, as when --ctx-draft is not given) fits in
    ``FIT_SHARE`` of ``free`` bytes (RAM available plus the free GPU memory the plan offloads
    to). A model whose trained context is unknown gets ``fallback``; at worst ``FIT_MIN``."""
    trained = planned[0].shape.n_ctx_train or fallback
    budget = int(free * FIT_SHARE)

    def need(n_ctx: int) -> int:
        return sum(estimate(p.shape, replace(p.placement, n_ctx=n_ctx)).total for p in planned)

    if need(trained) <= budget:
        return CtxFit(trained, trained, budget, need(trained))
    lo, hi = FIT_MIN // FIT_STEP, max(FIT_MIN, trained) // FIT_STEP
    while lo < hi:  # the largest multiple of FIT_STEP that fits
        mid = (lo + hi + 1) // 2
        if need(mid * FIT_STEP) <= budget:
            lo = mid
        else:
            hi = mid - 1
    n = min(trained, lo * FIT_STEP)
    return CtxFit(n, trained, budget, need(n))


__all__ = [
    "CACHE_TYPES",
    "CtxFit",
    "fit_ctx",
    "Estimate",
    "HostMemory",
    "ModelShape",
    "Placement",
    "cache_type_id",
    "check_host",
    "compute_bytes",
    "estimate",
    "gib",
    "host_memory",
    "layers_that_fit",
    "padded_ctx",
    "plan_memory",
    "Planned",
]
