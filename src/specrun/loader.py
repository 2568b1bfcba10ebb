"""From command-line model options to a ready Engine: resolve names, pull what is missing,
validate, load, check the pair. Shared by generate, chat, bench and models check."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .engine import Engine, SpecConfig
from .errors import IncompatiblePairError, ModelError, UsageError
from .registry import ProgressFn, Registry, ResolvedModel

DEFAULT_CTX = 4096
DEFAULT_DRAFT_MAX = 4


@dataclass
class ModelOptions:
    """Everything CONTRACT.md lists under 'Model options'."""

    pair: str | None = None
    model: str | None = None
    model_draft: str | None = None
    mode: str = "auto"
    draft_max: int | None = None  # None: the pair's draft_max, else DEFAULT_DRAFT_MAX
    draft_min: int = 0
    draft_p_min: float = 0.6  # measured: fewer wasted draft steps at greedy on the default pair
    verify: str = "rejection"
    lookup_min: int = 1
    lookup_max: int = 4
    lookup_cache: str | None = None
    ngl: int = -1
    ngl_draft: int = -1
    ctx: int = DEFAULT_CTX
    ctx_draft: int | None = None  # None: same as the target's
    threads: int | None = None
    threads_draft: int | None = None
    batch: int = 512
    flash_attn: bool | None = None
    verbose: bool = False

    def validate(self) -> None:
        if self.draft_max is not None and self.draft_max < 1:
            raise UsageError(f"--draft-max must be >= 1, got {self.draft_max}")
        if self.ctx < 16:
            raise UsageError(f"--ctx must be >= 16, got {self.ctx}")
        if self.ctx_draft is not None and self.ctx_draft < 16:
            raise UsageError(f"--ctx-draft must be >= 16, got {self.ctx_draft}")
        for flag, v in (("--threads", self.threads), ("--threads-draft", self.threads_draft)):
            if v is not None and v < 1:
                raise UsageError(f"{flag} must be >= 1, got {v}")
        for flag, v in (("--ngl", self.ngl), ("--ngl-draft", self.ngl_draft)):
            if v < -1:
                raise UsageError(f"{flag} must be >= -1 (-1 = all layers), got {v}")
        if self.batch < 1:
            raise UsageError(f"--batch-size must be >= 1, got {self.batch}")
        self.spec_config(DEFAULT_DRAFT_MAX).validate()

    def spec_config(self, pair_draft_max: int | None) -> SpecConfig:
        return SpecConfig(
            mode=self.mode,
            draft_max=self.draft_max or pair_draft_max or DEFAULT_DRAFT_MAX,
            draft_min=self.draft_min,
            draft_p_min=self.draft_p_min,
            verify=self.verify,
            lookup_min=self.lookup_min,
            lookup_max=self.lookup_max,
            lookup_cache=self.lookup_cache,
        )


@dataclass
class Plan:
    """Which files will be loaded, decided before anything is loaded."""

    target: ResolvedModel
    draft: ResolvedModel | None
    pair_draft_max: int | None = None


@dataclass
class Loaded:
    plan: Plan
    engine: Engine
    models: list = field(default_factory=list)

    def close(self) -> None:
        for m in self.models:
            m.close()


def plan(opts: ModelOptions, registry: Registry, progress: ProgressFn | None = None) -> Plan:
    """Resolve -m/-md/--pair to local files (pulling registry models that are missing)."""
    uses_draft = opts.mode not in ("none", "lookup")
    if opts.pair and opts.model:
        raise UsageError("give either --pair or -m/--model, not both")
    if opts.model:
        target = registry.resolve(opts.model, progress=progress)
        pair = registry.pair_for_target(target.name) if target.entry is not None else None
        draft_spec = opts.model_draft or (pair.draft if pair else None)
        pair_k = pair.draft_max if pair and not opts.model_draft else None
    else:
        name = opts.pair or registry.default
        if not name:
            raise UsageError("no model given: use -m PATH_OR_NAME or --pair NAME")
        if opts.pair or name in registry.pairs:
            pair = registry.pair(name)  # an unknown --pair raises here, with suggestions
            target = registry.resolve(pair.target, progress=progress)
            draft_spec = opts.model_draft or pair.draft
            pair_k = pair.draft_max
        else:  # the default names a single model
            target = registry.resolve(name, progress=progress)
            draft_spec, pair_k = opts.model_draft, None
    draft = registry.resolve(draft_spec, progress=progress) if draft_spec and uses_draft else None
    return Plan(target=target, draft=draft, pair_draft_max=pair_k)


def _prevalidate(path: Path) -> None:
    from .gguf import validate_gguf

    validate_gguf(path)


def load(
    p: Plan,
    opts: ModelOptions,
    status: Callable[[str], None] | None = None,
) -> Loaded:
    """Validate and load both models, check that they can speculate together, build the Engine."""
    from . import compat
    from .runtime import LoadOptions, Model

    say = status or (lambda _msg: None)
    models: list[Model] = []
    try:
        for r in filter(None, (p.target, p.draft)):
            _prevalidate(r.path)
        say(f"loading {p.target.name}")
        target = Model(
            p.target.path,
            LoadOptions(n_ctx=opts.ctx, n_gpu_layers=opts.ngl, n_threads=opts.threads,
                        n_batch=min(opts.batch, opts.ctx), flash_attn=opts.flash_attn),
            verbose=opts.verbose,
        )
        models.append(target)
        draft = None
        if p.draft is not None:
            say(f"loading {p.draft.name}")
            ctx_d = opts.ctx_draft or opts.ctx
            draft = Model(
                p.draft.path,
                LoadOptions(n_ctx=ctx_d, n_gpu_layers=opts.ngl_draft,
                            n_threads=opts.threads_draft or opts.threads,
                            n_batch=min(opts.batch, ctx_d), flash_attn=opts.flash_attn),
                verbose=opts.verbose,
            )
            models.append(draft)
            bad = compat.problems(target.vocab_facts(), draft.vocab_facts(), target.token_text, draft.token_text)
            if bad:
                raise IncompatiblePairError(
                    f"{p.draft.name} cannot draft for {p.target.name}: {bad[0]}"
                    + (f" (and {len(bad) - 1} more: see `specrun models check`)" if len(bad) > 1 else "")
                )
        engine = Engine(target, draft, opts.spec_config(p.pair_draft_max))
        return Loaded(plan=p, engine=engine, models=models)
    except BaseException:
        for m in models:
            m.close()
        raise


def describe(r: ResolvedModel | None) -> dict[str, str] | None:
    return None if r is None else {"name": r.name, "path": str(r.path)}


__all__ = ["ModelOptions", "Plan", "Loaded", "plan", "load", "describe", "ModelError"]
