"""From model options to a ready Engine: resolve names, pull what is missing,
validate, load, check the pair. Shared by every front end (the CLI's commands, the server)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specrun import defaults, probe
from specrun.decoding import calibrate
from specrun.decoding.auto import AutoPolicy
from specrun.decoding.engine import MAX_DRAFT, Engine, SpecConfig
from specrun.errors import IncompatiblePairError, ModelError, SpecrunError, UsageError
from specrun.llama.gguf import validate_gguf
from specrun.models.hub import parse_hub_spec
from specrun.models.registry import Registry, ResolvedModel
from specrun.models.store import ProgressFn

DEFAULT_CTX = defaults.CTX
DEFAULT_DRAFT_MAX = defaults.DRAFT_MAX
AUTO_DRAFT_MAX = defaults.AUTO_DRAFT_MAX
MAX_CTX = (1 << 31) - 1  # llama.cpp's n_ctx is a uint32


@dataclass
class ModelOptions:
    """The model, speculation and placement options that generate, chat, bench and serve share."""

    pair: str | None = None
    model: str | None = None
    model_draft: str | None = None  # "none": no draft (as --no-draft)
    no_draft: bool = False  # no draft model: not the pair's, not one found on disk
    hf_file: str | None = None  # -m is a hub repo and this its file (llama.cpp's --hf-file)
    hf_file_draft: str | None = None
    chat_template: str | None = None  # --chat-template: a llama.cpp built-in name or Jinja text
    chat_template_file: str | None = None
    mode: str = defaults.MODE
    draft_max: int | None = None  # None: the pair's draft_max, else DEFAULT_DRAFT_MAX (auto: >= 8)
    draft_min: int = defaults.DRAFT_MIN
    draft_p_min: float = defaults.DRAFT_P_MIN
    verify: str = defaults.VERIFY
    lookup_min: int | None = None  # None: the mode's default (SpecConfig.min_match)
    lookup_max: int = defaults.LOOKUP_MAX
    lookup_cache: str | None = None
    lookup_kind: str = defaults.LOOKUP_KIND
    lookup_draft_max: int = defaults.LOOKUP_DRAFT_MAX
    ngl: int = -1  # -1: the layers that fit (--ngl auto); options.NGL_ALL: all of them
    ngl_draft: int = -1
    rpc: str | None = (
        None  # HOST:PORT[,HOST:PORT...]: llama.cpp RPC workers for the target's layers
    )
    rpc_draft: bool = (
        False  # the draft's layers on the workers too (default: the draft stays local)
    )
    tensor_split: str | None = (
        None  # shares of the offloaded layers per device, "3,1" (llama.cpp's -ts)
    )
    ctx: int = DEFAULT_CTX
    ctx_draft: int | None = None  # None: same as the target's
    threads: int | None = None
    threads_draft: int | None = None
    batch: int = defaults.BATCH
    flash_attn: str = defaults.FLASH_ATTN  # on|off|auto
    cache_type_k: str = defaults.CACHE_TYPE
    cache_type_v: str = defaults.CACHE_TYPE
    cache_type_k_draft: str | None = None  # None: as the target's
    cache_type_v_draft: str | None = None
    mem_check: bool = True
    # Sequences in one context (serve --parallel): ctx is then their total, as llama-server's -c
    # with -np, each gets ctx // n_seq, and load() gives each its own engine (llama/slots.py).
    n_seq: int = 1
    calibrate: bool = True  # auto starts from measured pass costs (calibrate.py), not priors
    verbose: bool = False

    @property
    def draft_declined(self) -> bool:
        """--no-draft or -md none: no draft model (a pair's, or one found on disk)."""
        return self.no_draft or (self.model_draft or "").strip().lower() == "none"

    @property
    def flash_attn_flag(self) -> bool | None:
        return {"on": True, "off": False}.get(self.flash_attn.lower())

    def validate(self) -> None:
        self.template_source()  # checked before any model is pulled or loaded
        if self.no_draft and (self.model_draft or "none").strip().lower() != "none":
            raise UsageError(f"--no-draft declines a draft: drop -md {self.model_draft}")
        for flag, c in (("--ctx", self.ctx), ("--ctx-draft", self.ctx_draft)):
            if c is not None and not 16 <= c <= MAX_CTX:
                raise UsageError(f"{flag} must be 16 to {MAX_CTX}, got {c}")
        for flag, v in (("--threads", self.threads), ("--threads-draft", self.threads_draft)):
            if v is not None and v < 1:
                raise UsageError(f"{flag} must be >= 1, got {v}")
        for flag, v in (("--ngl", self.ngl), ("--ngl-draft", self.ngl_draft)):
            if v < -1:
                raise UsageError(f"{flag} must be >= -1 (-1 = auto: the layers that fit), got {v}")
        if self.batch < 1:
            raise UsageError(f"--batch-size must be >= 1, got {self.batch}")
        if self.flash_attn.lower() not in ("on", "off", "auto"):
            raise UsageError(f"--flash-attn must be on, off or auto, got {self.flash_attn!r}")
        from specrun.models.memory import CACHE_TYPES, cache_type_id

        types: list[tuple[str, str | None]] = [
            ("--cache-type-k", self.cache_type_k),
            ("--cache-type-v", self.cache_type_v),
            ("--cache-type-k-draft", self.cache_type_k_draft),
            ("--cache-type-v-draft", self.cache_type_v_draft),
        ]
        for flag, name in types:
            if name is not None:
                cache_type_id(name, flag)
        if self.flash_attn.lower() == "off":
            for flag, name in (types[1], types[3]):
                if name is not None and CACHE_TYPES[name.lower()][2] > 1:
                    raise UsageError(
                        f"{flag} {name} needs flash attention: drop --flash-attn off or use f16"
                    )
        self.rpc_endpoints()
        self.tensor_split_shares()
        if self.rpc_draft and not self.rpc:
            raise UsageError(
                "--rpc-draft puts the draft on the --rpc workers: give --rpc HOST:PORT too"
            )
        self.spec_config(DEFAULT_DRAFT_MAX).validate()

    def template_source(self) -> str | None:
        """What --chat-template / --chat-template-file give (a llama.cpp built-in name or Jinja
        text; the target renders every chat with it), None for the GGUF's own template."""
        from specrun.chat_template import resolve_template

        return resolve_template(self.chat_template, self.chat_template_file)

    def rpc_endpoints(self, draft: bool = False) -> tuple[str, ...]:
        """The workers a model's layers go to ("HOST:PORT" each); the draft's only with --rpc-draft."""
        if not self.rpc or (draft and not self.rpc_draft):
            return ()
        from specrun.llama.rpc import parse_endpoints

        return tuple(str(ep) for ep in parse_endpoints(self.rpc))

    def tensor_split_shares(self) -> tuple[float, ...]:
        """--tensor-split 3,1 (or 3/1) -> (3.0, 1.0): llama.cpp's proportions, device by device."""
        if self.tensor_split is None:
            return ()
        parts = [p.strip() for p in self.tensor_split.replace("/", ",").split(",")]
        try:
            shares = tuple(float(p) for p in parts)
        except ValueError:
            raise UsageError(
                f"--tensor-split takes numbers like 3,1; got {self.tensor_split!r}"
            ) from None
        if any(not (x >= 0 and x < float("inf")) for x in shares) or not any(shares):
            raise UsageError(
                f"--tensor-split shares must be >= 0 and not all 0; got {self.tensor_split!r}"
            )
        return shares

    def load_options(self, draft: bool) -> Any:
        """llama.cpp's parameters for the target (or the draft): what runtime.Model is given."""
        from specrun.llama.model import LoadOptions
        from specrun.models.memory import cache_type_id

        ctx = (self.ctx_draft or self.ctx) if draft else self.ctx
        if self.n_seq > 1:
            from specrun.llama.slots import MAX_ROWS

            ctx = max(256, ctx // self.n_seq)
        type_k = (self.cache_type_k_draft or self.cache_type_k) if draft else self.cache_type_k
        type_v = (self.cache_type_v_draft or self.cache_type_v) if draft else self.cache_type_v
        ngl = self.ngl_draft if draft else self.ngl
        rpc = self.rpc_endpoints(draft)
        type_v_id = cache_type_id(type_v, "--cache-type-v")
        return LoadOptions(
            n_ctx=ctx,
            n_gpu_layers=ngl,
            n_threads=(self.threads_draft or self.threads) if draft else self.threads,
            n_batch=min(self.batch, ctx),
            flash_attn=self._flash_attn(ngl, type_v_id, remote=bool(rpc)),
            type_k=cache_type_id(type_k, "--cache-type-k"),
            type_v=type_v_id,
            # a verify pass: K drafts + 1; not n_batch rows of logits (every slot's: --parallel)
            n_outputs_max=MAX_DRAFT + 1 if self.n_seq == 1 else MAX_ROWS,
            n_seq=self.n_seq,
            # A draft decodes one token at a time: it keeps AMX's fast single-row kernel even
            # where the build's AMX batch kernel would crash (then one row a decode).
            amx_rows=draft,
            rpc=rpc,
            tensor_split=() if draft else self.tensor_split_shares(),
        )

    def _flash_attn(self, ngl: int, type_v: int, remote: bool = False) -> bool | None:
        """--flash-attn on/off as given; auto as runtime.auto_flash_attn decides (on the CPU: on
        where the build's kernel is row-exact)."""
        flag = self.flash_attn_flag
        if flag is not None:
            return flag
        from specrun.llama.backend import auto_flash_attn

        return auto_flash_attn(ngl, type_v, remote=remote)

    def default_draft_max(self, pair_draft_max: int | None) -> int:
        k = pair_draft_max or DEFAULT_DRAFT_MAX
        return max(k, AUTO_DRAFT_MAX) if self.mode == "auto" else k

    def spec_config(self, pair_draft_max: int | None) -> SpecConfig:
        return SpecConfig(
            mode=self.mode,
            draft_max=self.draft_max
            if self.draft_max is not None
            else self.default_draft_max(pair_draft_max),
            draft_min=self.draft_min,
            draft_p_min=self.draft_p_min,
            verify=self.verify,
            lookup_min=self.lookup_min,
            lookup_max=self.lookup_max,
            lookup_cache=self.lookup_cache,
            lookup_kind=self.lookup_kind,
            lookup_draft_max=self.lookup_draft_max,
        )


@dataclass
class Plan:
    """Which files will be loaded, decided before anything is loaded."""

    target: ResolvedModel
    draft: ResolvedModel | None
    pair_draft_max: int | None = None
    notes: list[str] = field(default_factory=list)  # for stderr, one line each (load's warn)


@dataclass
class Loaded:
    plan: Plan
    engine: Engine
    models: list = field(default_factory=list)
    # --parallel: one engine per sequence (engines[0] is engine), over llama.slots' views
    engines: list = field(default_factory=list)
    slots: list = field(default_factory=list)

    def close(self) -> None:
        for s in self.slots:
            s.close()
        for m in self.models:
            m.close()


def plan(
    opts: ModelOptions,
    registry: Registry,
    progress: ProgressFn | None = None,
    pull: bool = True,
    status: Callable[[str], None] | None = None,
) -> Plan:
    """Resolve -m/-md/--pair to local files (pulling registry models that are missing, unless
    ``pull`` is False: then a missing model is an error).

    ``-m TARGET`` with no draft named (and not a registry pair's target) takes the best draft
    found on disk for that file (``probe.best_draft_for``: probed once, then remembered), when
    the mode uses a draft model and it was not declined (--no-draft, -md none); the plan's
    ``notes`` say which. ``pull`` False probes nothing: only a remembered choice is taken.
    ``status`` hears the probe's progress."""
    uses_draft = opts.mode not in ("none", "lookup")
    declined = opts.draft_declined
    notes: list[str] = []
    if opts.pair and opts.model:
        raise UsageError("give either --pair or -m/--model, not both")

    def resolve(spec: str, hf_file: str | None) -> ResolvedModel:
        if hf_file:
            hub = parse_hub_spec(spec)
            if hub is None:
                raise UsageError(f"--hf-file needs a Hugging Face repo, got {spec!r}")
            return registry.resolve_hub(hub[0], file=hf_file, progress=progress, pull=pull)
        return registry.resolve(spec, progress=progress, pull=pull)

    if opts.model:
        target = resolve(opts.model, opts.hf_file)
        pair = registry.pair_for_target(target.name) if target.entry is not None else None
        draft_spec = None if declined else opts.model_draft or (pair.draft if pair else None)
        pair_k = pair.draft_max if pair and not opts.model_draft else None
        if draft_spec is None and uses_draft and not declined:
            found = _found_draft(target, registry, opts, pull, status, notes)
            if found is not None:
                draft_spec, pair_k = str(found[0]), found[1]
    else:
        name = opts.pair or registry.default
        if not name:
            raise UsageError("no model given: use -m PATH_OR_NAME or --pair NAME")
        if opts.pair or name in registry.pairs:
            pair = registry.pair(name)  # an unknown --pair raises here, with suggestions
            target = registry.resolve(pair.target, progress=progress, pull=pull)
            draft_spec = None if declined else opts.model_draft or pair.draft
            pair_k = pair.draft_max
        else:  # the default names a single model
            target = registry.resolve(name, progress=progress, pull=pull)
            draft_spec, pair_k = None if declined else opts.model_draft, None
    draft_file = opts.hf_file_draft if opts.model_draft and not declined else None
    draft = resolve(draft_spec, draft_file) if draft_spec and uses_draft else None
    return Plan(target=target, draft=draft, pair_draft_max=pair_k, notes=notes)


def _found_draft(
    target: ResolvedModel,
    registry: Registry,
    opts: ModelOptions,
    pull: bool,
    status: Callable[[str], None] | None,
    notes: list[str],
) -> tuple[Path, int | None] | None:
    """The draft found on disk for ``target`` (remembered, else probed when ``pull``), with a
    note that names it; None (and no note) when none is found or none pays."""
    known, choice = probe.remembered_draft(target.path)
    fresh = False
    if not known and pull:
        say = status or (lambda _m: None)
        say(f"looking for a draft for {target.name} on disk")
        try:
            choice = probe.best_draft_for(
                target.path,
                registry,
                say=lambda m: say(f"draft search: {m}"),
                n_threads=opts.threads,
            )
        except Exception as exc:  # the search is a convenience: the run goes on without it
            notes.append(f"no draft found for {target.name}: the search failed ({exc})")
            return None
        fresh = True
    if choice is None:
        return None
    path, k = choice
    fig = probe.remembered_figures(target.path)
    name = fig.get("name") or path.name
    speed = fig.get("speedup")
    how = " at ".join(
        ([f"{speed:.2f}x"] if isinstance(speed, int | float) else []) + ([f"K={k}"] if k else [])
    )
    when = "measured now" if fresh else "measured before"
    notes.append(
        f"draft: {name} found on disk for {target.name} ({how + ', ' if how else ''}{when}); "
        "--no-draft runs without it"
    )
    return Path(path), k


def _prevalidate(path: Path) -> Any:
    return validate_gguf(path)


def memory_plan(
    p: Plan, opts: ModelOptions, infos: list[Any] | None = None
) -> tuple[list[Any], list[str]]:
    """The memory each model of the plan will take where, decided before loading (or refused)."""
    from specrun.llama.backend import gpu_free_memory
    from specrun.llama.buffers import amx_holds_weights
    from specrun.llama.rpc import worker_free_memory
    from specrun.models import memory

    items = []
    for i, r in enumerate(filter(None, (p.target, p.draft))):
        info = infos[i] if infos else _prevalidate(r.path)
        is_draft = i == 1
        lo = opts.load_options(is_draft)
        type_k = (opts.cache_type_k_draft or opts.cache_type_k) if is_draft else opts.cache_type_k
        type_v = (opts.cache_type_v_draft or opts.cache_type_v) if is_draft else opts.cache_type_v
        placement = memory.Placement(
            n_ctx=lo.n_ctx,
            n_ubatch=lo.n_batch,
            type_k=type_k.lower(),
            type_v=type_v.lower(),
            flash_attn=bool(lo.flash_attn) or memory.CACHE_TYPES[type_v.lower()][2] > 1,
            n_outputs=lo.n_outputs_max or lo.n_batch,
        )
        ngl = opts.ngl_draft if is_draft else opts.ngl
        flag = "--ngl-draft" if is_draft else "--ngl"
        items.append(
            (
                r.name,
                memory.ModelShape.from_gguf(
                    info, target=not is_draft, amx=amx_holds_weights(single_rows=is_draft)
                ),
                placement,
                ngl,
                flag,
            )
        )
    local = gpu_free_memory()
    if not opts.rpc:
        return memory.plan_memory(items, memory.host_memory(), local, check=opts.mem_check)
    # The workers' devices (checked here, before llama.cpp connects) and this machine's GPUs;
    # a draft kept local draws on this machine's GPUs alone.
    remote = worker_free_memory(opts.rpc_endpoints()) + (local or 0)
    pools: list[int | None] = [remote, remote if opts.rpc_draft else local][: len(items)]
    return memory.plan_memory(items, memory.host_memory(), pools, check=opts.mem_check)


def load(
    p: Plan,
    opts: ModelOptions,
    status: Callable[[str], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> Loaded:
    """Validate, check the memory, load both models, check that they can speculate together,
    build the Engine. ``warn`` gets the memory notes (stderr lines)."""
    from specrun.llama.backend import local_gpus, unpatched_note
    from specrun.llama.model import Model
    from specrun.models import compat

    say = status or (lambda _msg: None)
    models: list[Model] = []
    try:
        infos = [_prevalidate(r.path) for r in filter(None, (p.target, p.draft))]
        planned, notes = memory_plan(p, opts, infos)
        build = unpatched_note()  # once a process: what a build without patches/ loses
        for line in p.notes + ([build] if build else []) + notes:
            (warn or (lambda _m: None))(line)

        def load_opts(i: int) -> Any:
            lo = opts.load_options(i == 1)
            if opts.mem_check and (opts.rpc_endpoints(i == 1) or local_gpus()):
                lo = replace(lo, n_gpu_layers=planned[i].placement.n_gpu_layers)
            return lo

        say(f"loading {p.target.name}")
        target = Model(p.target.path, load_opts(0), verbose=opts.verbose)
        models.append(target)
        template = opts.template_source()
        if template is not None:
            target.use_chat_template(template)
        draft = None
        if p.draft is not None:
            say(f"loading {p.draft.name}")
            draft = Model(p.draft.path, load_opts(1), verbose=opts.verbose)
            models.append(draft)
            bad = compat.problems(
                target.vocab_facts(), draft.vocab_facts(), target.token_text, draft.token_text
            )
            if bad:
                raise IncompatiblePairError(
                    f"{p.draft.name} cannot draft for {p.target.name}: {bad[0]}"
                    + (
                        f" (and {len(bad) - 1} more: see `specrun models check`)"
                        if len(bad) > 1
                        else ""
                    )
                )
        if opts.n_seq > 1:
            return _load_slots(p, opts, target, draft, models, say)
        engine = Engine(target, draft, opts.spec_config(p.pair_draft_max))
        if opts.calibrate and isinstance(engine.policy, AutoPolicy):
            calibrate_auto(engine, say)
        return Loaded(plan=p, engine=engine, models=models, engines=[engine])
    except BaseException:
        for m in models:
            m.close()
        raise


def _load_slots(
    p: Plan,
    opts: ModelOptions,
    target: Any,
    draft: Any,
    models: list[Any],
    say: Callable[[str], None],
) -> Loaded:
    """``--parallel``: an engine per sequence of the target's (and the draft's) context, each
    over its own view (llama.slots), their verify passes batched together."""
    from specrun.llama.slots import Group, Slots

    group = Group()  # the target's and the draft's passes scheduled together
    slots = [Slots(target, group)] + ([Slots(draft, group, drafts=True)] if draft else [])
    try:
        engines = []
        for s in range(opts.n_seq):
            dview = slots[1].views[s] if draft is not None else None
            engine = Engine(slots[0].views[s], dview, opts.spec_config(p.pair_draft_max))
            if opts.calibrate and isinstance(engine.policy, AutoPolicy):
                # measured once (the cache per file serves the others); never refined from what
                # a slot sees: its passes carry the other slots' rows
                calibrate_auto(engine, say if s == 0 else (lambda _m: None), refine=False)
            engines.append(engine)
    except BaseException:
        for sl in slots:
            sl.close()
        raise
    return Loaded(plan=p, engine=engines[0], models=models, engines=engines, slots=slots)


def load_engine(
    opts: ModelOptions,
    *,
    registry: Registry | None = None,
    progress: ProgressFn | None = None,
    status: Callable[[str], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> Loaded:
    """Resolve ``opts`` (pulling missing registry models, ``progress`` told how it goes) and load:
    the one call a front end needs. The caller owns the result: ``Loaded.close()``."""
    reg = registry if registry is not None else Registry.load(verbose=opts.verbose)
    return load(plan(opts, reg, progress=progress, status=status), opts, status=status, warn=warn)


def calibrate_auto(
    engine: Engine, say: Callable[[str], None] = lambda _m: None, refine: bool = True
) -> None:
    """Give auto the measured pass costs of this target and draft on this machine (cached per
    file; the first run of a model measures for well under a second on small models)."""
    assert isinstance(engine.policy, AutoPolicy)
    sizes = tuple(n for n in calibrate.SIZES if n <= engine.config.draft_max + 1)
    say("measuring pass costs")
    verify = calibrate.pass_times(engine.target, sizes)
    step = None
    if engine.draft_model is not None:  # as the engine pays it: right after a target pass
        step = calibrate.draft_step(engine.target, engine.draft_model.model)
    target = engine.target
    engine.policy.calibrate(
        verify,
        step,
        refine=(lambda seen: calibrate.refine(target, sizes, seen)) if refine else None,
    )


def describe(r: ResolvedModel | None) -> dict[str, str] | None:
    return None if r is None else {"name": r.name, "path": str(r.path)}


__all__ = [
    "ModelOptions",
    "Plan",
    "Loaded",
    "plan",
    "load",
    "load_engine",
    "describe",
    "ModelError",
]


def fit_for_options(opts: Any) -> Any:
    """``fit_ctx`` for the model or pair that ``opts`` (a ModelOptions) names, from their
    GGUF metadata, nothing loaded or pulled; None where they cannot be read yet (a registry model
    not pulled: the caller keeps its default context)."""
    from specrun.llama.backend import gpu_free_memory
    from specrun.models.memory import fit_ctx, host_memory

    try:
        p = plan(opts, Registry.load(verbose=False), pull=False)
        infos = [_prevalidate(r.path) for r in (p.target, p.draft) if r is not None]
        planned, _ = memory_plan(p, replace(opts, mem_check=False), infos)
    except (SpecrunError, OSError):
        return None
    return fit_ctx(planned, host_memory().available + (gpu_free_memory() or 0))
