"""models.toml: parsed into entries (with FILE:LINE in every error) and edited in place.

The built-in registry is the packaged ``models.toml``; the user's file adds to it and wins on a
clash. Reading checks each entry (one source, known keys, types) and then the whole (derive
chains, pairs and the default name models that exist). Writing (``models check --save``,
``draft make --name``) edits the user's file with tomlkit, keeping its comments and layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.resources
import os
import re
import shutil
import tomllib
from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specrun import paths
from specrun.errors import RegistryError
from specrun.models.entries import SOURCES, ModelEntry, PairEntry, suggest
from specrun.models.hub import parse_hub_spec
from specrun.models.store import fsync_dir

_MODEL_KEYS = frozenset(
    {"package", "derive", "hf", "path", "file", "revision", "sha256", "description", "fallback"}
)
_PAIR_KEYS = frozenset({"target", "draft", "draft_max", "description"})
_TOP_KEYS = frozenset({"default", "models", "pairs"})
_TOML_POS_RE = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")


class _Source:
    """One models.toml being parsed: knows its text, so errors can carry a line number."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise RegistryError(f"registry file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise RegistryError(
                f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}"
            ) from None
        try:
            self.data = tomllib.loads(self.text)
        except tomllib.TOMLDecodeError as exc:
            msg = str(exc)
            m = _TOML_POS_RE.search(msg)
            if m:
                msg = msg[: m.start()]
                raise RegistryError(
                    f"{path}:{m.group(1)}:{m.group(2)}: invalid TOML: {msg}"
                ) from None
            raise RegistryError(f"{path}: invalid TOML: {msg}") from None
        self.lines = self.text.splitlines()

    def header_line(self, section: str, name: str) -> int | None:
        """1-based line of ``[section.name]`` (quoted or dotted spelling), if written that way."""
        for i, raw in enumerate(self.lines, 1):
            s = raw.strip()
            if not s.startswith("[") or s.startswith("[["):
                continue
            inner = s[1 : s.find("]")] if "]" in s else ""
            key = re.sub(r"[\"'\s]", "", inner)
            if key == f"{section}.{name}":
                return i
        return None

    def key_line(self, section: str, name: str, key: str | None) -> int | None:
        start = self.header_line(section, name)
        if start is None or key is None:
            return start
        pat = re.compile(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=")
        for i in range(start, len(self.lines)):
            s = self.lines[i].strip()
            if s.startswith("["):
                break
            if pat.match(s):
                return i + 1
        return start

    def error(self, section: str, name: str, msg: str, key: str | None = None) -> RegistryError:
        """``FILE:LINE: [section.name] msg``; the line is that of ``key`` when given."""
        line = self.key_line(section, name, key)
        where = f"{self.path}:{line}" if line else str(self.path)
        return RegistryError(f"{where}: [{section}.{name}] {msg}")


def _flatten(
    table: dict[str, Any], known: frozenset[str], prefix: str = ""
) -> Iterator[tuple[str, Any]]:
    """Yield (name, table) for every entry, re-joining names TOML split on dots.

    ``[models.qwen2.5-coder]`` is, to TOML, the table ``models.qwen2`` holding ``5-coder``; a key
    that is not an entry field but holds a table is taken as that dotted continuation.
    """
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if not isinstance(value, dict):
            yield name, value
            continue
        own = {k: v for k, v in value.items() if k in known or not isinstance(v, dict)}
        children = {k: v for k, v in value.items() if k not in known and isinstance(v, dict)}
        if own or not children:
            yield name, own
        yield from _flatten(children, known, name)


def _str_list(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    return None


def _parse_model(src: _Source, name: str, raw: Any) -> ModelEntry:
    if not isinstance(raw, dict):
        raise src.error("models", name, "must be a table")
    entry = _parse_source(src, name, {k: v for k, v in raw.items() if k != "fallback"})
    if "fallback" not in raw:
        return entry
    # [models.NAME.fallback]: the same file from a package, where the hub cannot be reached
    if entry.source != "hf":
        raise src.error(
            "models", name, f"'fallback' applies to an hf source, not {entry.source}", "fallback"
        )
    if entry.sha256 is None:
        raise src.error(
            "models", name, "an entry with a fallback needs sha256 (both sources must agree)"
        )
    fb_raw = raw["fallback"]
    fb_name = f"{name}.fallback"
    if not isinstance(fb_raw, dict):
        raise src.error(
            "models",
            name,
            'fallback must be a table: { package = "...", file = "..." }',
            "fallback",
        )
    for key in ("sha256", "description", "fallback"):
        if key in fb_raw:
            raise src.error("models", fb_name, f"{key!r} belongs to [models.{name}]", key)
    fb = _parse_source(src, fb_name, fb_raw)
    if fb.source != "package":
        raise src.error(
            "models", fb_name, f"a fallback must be a package source, not {fb.source}", fb.source
        )
    fb = dataclasses.replace(fb, name=name, sha256=entry.sha256, line=fb.line or entry.line)
    return dataclasses.replace(entry, fallback=fb)


def _parse_source(src: _Source, name: str, raw: dict[str, Any]) -> ModelEntry:
    for key in raw:
        if key not in _MODEL_KEYS:
            close = difflib.get_close_matches(key, sorted(_MODEL_KEYS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise src.error("models", name, f"unknown key {key!r}{hint}", key)
    sources = [s for s in SOURCES if s in raw]
    if not sources:
        raise src.error("models", name, "needs exactly one source: package, derive, hf or path")
    if len(sources) > 1:
        last = max(sources, key=lambda k: src.key_line("models", name, k) or 0)
        raise src.error(
            "models", name, f"has more than one source ({', '.join(sources)}); keep one", last
        )
    source = sources[0]
    sha = raw.get("sha256")
    if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-fA-F]{64}", sha)):
        raise src.error("models", name, "sha256 must be 64 hex digits", "sha256")
    desc = raw.get("description")
    if desc is not None and not isinstance(desc, str):
        raise src.error("models", name, "description must be a string", "description")
    common: dict[str, Any] = {
        "name": name,
        "source": source,
        "origin": src.path,
        "line": src.header_line("models", name),
        "sha256": sha.lower() if isinstance(sha, str) else None,
        "description": desc,
    }
    allowed = {"package": {"file"}, "hf": {"file", "revision"}, "derive": set(), "path": set()}[
        source
    ]
    for key in ("file", "revision"):
        if key in raw and key not in allowed:
            raise src.error("models", name, f"{key!r} does not apply to a {source} source", key)

    if source == "package":
        pkgs = _str_list(raw["package"])
        if pkgs is None:
            raise src.error(
                "models", name, "package must be a string or a list of strings", "package"
            )
        if "file" not in raw:
            raise src.error(
                "models", name, "a package source needs 'file' (the GGUF's path inside the wheel)"
            )
        files = _str_list(raw["file"])
        if files is None:
            raise src.error("models", name, "file must be a string or a list of strings", "file")
        if len(pkgs) == 1 and len(files) > 1:
            pkgs = pkgs * len(files)  # several parts inside one wheel
        if len(pkgs) != len(files):
            raise src.error(
                "models",
                name,
                f"{len(pkgs)} packages but {len(files)} files: give one file per package",
                "file",
            )
        return ModelEntry(packages=pkgs, files=files, **common)

    if source == "derive":
        d = raw["derive"]
        if not isinstance(d, dict) or set(d) - {"from", "quant"} or not {"from", "quant"} <= set(d):
            raise src.error(
                "models", name, 'derive must be { from = "MODEL", quant = "TYPE" }', "derive"
            )
        if not (
            isinstance(d["from"], str)
            and isinstance(d["quant"], str)
            and re.fullmatch(r"\w+", d["quant"])
        ):
            raise src.error(
                "models",
                name,
                'derive.from and derive.quant must be strings (e.g. quant = "Q4_0")',
                "derive",
            )
        return ModelEntry(derive_from=d["from"], quant=d["quant"].upper(), **common)

    if source == "hf":
        hub = parse_hub_spec(raw["hf"]) if isinstance(raw["hf"], str) else None
        if hub is None:
            raise src.error("models", name, 'hf must be "USER/REPO" (or "USER/REPO:QUANT")', "hf")
        repo, quant = hub
        file = raw.get("file")
        if file is not None and not (isinstance(file, str) and file):
            raise src.error("models", name, "file must be a string", "file")
        rev = raw.get("revision")
        if rev is not None and not (isinstance(rev, str) and rev):
            raise src.error("models", name, "revision must be a string", "revision")
        return ModelEntry(hf_repo=repo, hf_file=file, revision=rev, quant=quant or None, **common)

    p = raw["path"]
    if not isinstance(p, str) or not p:
        raise src.error("models", name, "path must be a string", "path")
    expanded = Path(os.path.expandvars(os.path.expanduser(p)))
    if not expanded.is_absolute():
        expanded = src.path.parent / expanded
    return ModelEntry(path=Path(os.path.normpath(expanded.absolute())), **common)


def _parse_pair(src: _Source, name: str, raw: Any) -> PairEntry:
    if not isinstance(raw, dict):
        raise src.error("pairs", name, "must be a table")
    for key in raw:
        if key not in _PAIR_KEYS:
            close = difflib.get_close_matches(key, sorted(_PAIR_KEYS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise src.error("pairs", name, f"unknown key {key!r}{hint}", key)
    for key in ("target", "draft"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise src.error("pairs", name, f'needs {key} = "MODEL"', key if key in raw else None)
    dm = raw.get("draft_max")
    if dm is not None and (not isinstance(dm, int) or isinstance(dm, bool) or dm < 1):
        raise src.error("pairs", name, "draft_max must be a positive integer", "draft_max")
    desc = raw.get("description")
    return PairEntry(
        name=name,
        target=raw["target"],
        draft=raw["draft"],
        draft_max=dm,
        origin=src.path,
        line=src.header_line("pairs", name),
        description=desc if isinstance(desc, str) else None,
    )


def builtin_registry_file() -> Path:
    return Path(str(importlib.resources.files("specrun") / "models.toml"))


@dataclass(frozen=True)
class RegistryData:
    """What the registry files say, checked: models and pairs by name, the default, the files."""

    models: dict[str, ModelEntry]
    pairs: dict[str, PairEntry]
    default: str | None
    files: tuple[Path, ...]


def read_registry(builtin: Path | None = None, user: Path | None = None) -> RegistryData:
    """The built-in registry plus the user's file (``paths.user_registry_file()``) on top."""
    sources = [_Source(builtin if builtin is not None else builtin_registry_file())]
    if user is not None:
        sources.append(_Source(user))
    else:
        upath = paths.user_registry_file()
        if os.environ.get("SPECRUN_MODELS"):
            if not upath.exists():  # (SPECRUN_MODELS=/dev/null: no user entries)
                raise RegistryError(f"SPECRUN_MODELS points to {upath}, which does not exist")
            sources.append(_Source(upath))
        elif upath.is_file():
            sources.append(_Source(upath))

    models: dict[str, ModelEntry] = {}
    pairs: dict[str, PairEntry] = {}
    default: str | None = None
    default_src: _Source | None = None
    for src in sources:
        data = src.data
        for key in data:
            if key not in _TOP_KEYS:
                raise RegistryError(
                    f"{src.path}: unknown top-level key {key!r} (expected default, [models.*], [pairs.*])"
                )
        if "default" in data:
            if not isinstance(data["default"], str):
                raise RegistryError(f"{src.path}: default must be a string naming a pair or model")
            default, default_src = data["default"], src
        for section in ("models", "pairs"):
            if not isinstance(data.get(section, {}), dict):
                raise RegistryError(f"{src.path}: {section} must be a table ([{section}.NAME])")
        for name, raw in _flatten(data.get("models", {}), _MODEL_KEYS):
            models[name] = _parse_model(src, name, raw)
        for name, raw in _flatten(data.get("pairs", {}), _PAIR_KEYS):
            pairs[name] = _parse_pair(src, name, raw)

    reg = RegistryData(
        models=models, pairs=pairs, default=default, files=tuple(s.path for s in sources)
    )
    _validate(reg, default_src)
    return reg


def _validate(reg: RegistryData, default_src: _Source | None) -> None:
    def err(path: Path | None, line: int | None, msg: str) -> RegistryError:
        where = f"{path}:{line}" if path and line else str(path)
        return RegistryError(f"{where}: {msg}")

    for e in reg.models.values():
        if e.source == "derive" and e.derive_from not in reg.models:
            raise err(
                e.origin,
                e.line,
                f"[models.{e.name}] derive.from names unknown model {e.derive_from!r}"
                + suggest(e.derive_from or "", reg.models),
            )
        seen = {e.name}
        cur = e
        while cur.source == "derive":
            nxt = reg.models[cur.derive_from or ""]
            if nxt.name in seen:
                raise err(
                    e.origin,
                    e.line,
                    f"[models.{e.name}] derive chain loops back to {nxt.name!r}",
                )
            seen.add(nxt.name)
            cur = nxt
    for p in reg.pairs.values():
        for role in ("target", "draft"):
            m = getattr(p, role)
            if m not in reg.models:
                raise err(
                    p.origin,
                    p.line,
                    f"[pairs.{p.name}] {role} names unknown model {m!r}" + suggest(m, reg.models),
                )
    if reg.default is not None and reg.default not in reg.pairs and reg.default not in reg.models:
        path = default_src.path if default_src else None
        line = None
        if default_src:
            line = next(
                (i for i, s in enumerate(default_src.lines, 1) if re.match(r"\s*default\s*=", s)),
                None,
            )
        raise err(
            path,
            line,
            f"default names no pair or model: {reg.default!r}"
            + suggest(reg.default, [*reg.pairs, *reg.models]),
        )


# --------------------------------------------------------------------------------------------
# Writing the user's registry (`models check --save`, `draft make --name`)

UserEntry = tuple[str, str, dict[str, Any]]  # (section, name, keys to set)


def _find_table(doc: Any, section: str, name: str) -> Any:
    """The ``[section.name]`` table of a tomlkit document, however the user spelled it: quoted
    (``[pairs."qwen2.5-x"]``), dotted (``[models.qwen2.5-coder]`` is models -> qwen2 -> 5-coder
    to TOML, as ``_flatten`` reads it), or inline (``mine = { ... }`` under ``[pairs]``)."""

    def walk(tbl: Any, parts: list[str]) -> Any:
        for i in range(len(parts), 0, -1):
            key = ".".join(parts[:i])
            if isinstance(tbl, MutableMapping) and key in tbl:
                found = tbl[key] if i == len(parts) else walk(tbl[key], parts[i:])
                if found is not None and isinstance(found, MutableMapping):
                    return found
        return None

    top = doc.get(section)
    return walk(top, name.split(".")) if isinstance(top, MutableMapping) else None


def _set_key(table: Any, key: str, value: Any) -> None:
    """Set ``key`` in a tomlkit table: in place (its indent and comment kept) when it is there,
    else after the table's last key, before the blank lines and comments that head what follows."""
    if key in table:
        table[key] = value
        return
    body = getattr(getattr(table, "value", table), "body", None)
    trail: list[Any] = []
    if isinstance(body, list):
        while body and body[-1][0] is None:  # whitespace and comments: they lead the next table
            trail.insert(0, body.pop())
    table[key] = value
    if isinstance(body, list):
        body.extend(trail)


def edit_registry_text(text: str, entries: Iterable[UserEntry]) -> str:
    """Set keys of ``[section.name]`` tables in models.toml text, keeping everything else.

    tomlkit keeps the user's comments, layout and quoting: a key already in the table is
    rewritten where it stands (any TOML value, a list spread over several lines too), a missing
    key goes after the table's last key, a missing table is appended at the end of the file.
    """
    import tomlkit  # deferred: keeps --help light
    from tomlkit.exceptions import TOMLKitError

    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as exc:
        raise RegistryError(f"cannot edit the registry: invalid TOML: {exc}") from None
    new: dict[tuple[str, str], dict[str, Any]] = {}
    for section, name, keys in entries:
        table = None if (section, name) in new else _find_table(doc, section, name)
        if table is None:
            new.setdefault((section, name), {}).update(keys)
            continue
        for key, value in keys.items():
            _set_key(table, key, value)
    out = tomlkit.dumps(doc)
    for (section, name), keys in new.items():
        out = out.rstrip("\n") + "\n\n" if out.strip() else ""
        out += tomlkit.dumps({section: {name: keys}}).lstrip("\n")
    return out if out.endswith("\n") else out + "\n"


def update_user_registry(entries: list[UserEntry], path: Path | None = None) -> Path:
    """Add or update entries in the user's models.toml, atomically; returns the file written.

    Under a lock, so two writers do not lose each other's entries: read, edit (see
    ``edit_registry_text``), load the result with the built-in registry under it, and only if
    that succeeds put it in place with a rename. A symlinked models.toml is written through.
    """
    from filelock import FileLock  # deferred: keeps --help light

    dest = path if path is not None else paths.user_registry_file()
    if dest.is_symlink():
        dest = dest.resolve()
    if dest.exists() and not dest.is_file():
        raise RegistryError(f"cannot write entries into {dest}: not a regular file")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(dest.with_name(f".{dest.name}.lock")))
        lock.acquire(timeout=60)
    except OSError as exc:
        raise RegistryError(f"cannot write to {dest.parent}: {exc.strerror or exc}") from None
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        old = (
            dest.read_text(encoding="utf-8")
            if dest.exists()
            else (
                "# specrun: your models and pairs; they add to the built-in registry and win on a "
                "clash.\n"
            )
        )
        new = edit_registry_text(old, entries)
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(new)
                f.flush()
                os.fsync(f.fileno())
            if dest.exists():
                shutil.copymode(dest, tmp)
        except OSError as exc:
            raise RegistryError(f"cannot write to {dest.parent}: {exc.strerror or exc}") from None
        try:
            read_registry(user=tmp)
        except RegistryError as exc:
            raise RegistryError(
                f"not writing {dest}: the edit would not load ({str(exc).replace(str(tmp), str(dest))})"
            ) from None
        try:
            os.replace(tmp, dest)
        except OSError as exc:
            raise RegistryError(f"cannot write {dest}: {exc.strerror or exc}") from None
        fsync_dir(dest.parent)
        return dest
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
        lock.release()
