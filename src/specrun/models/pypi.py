"""Wheels fetched straight from a package index, for environments without pip.

A ``uv tool install`` (or any venv made without pip) has no ``python -m pip``; there the
``package`` source downloads the wheels itself: the project's page on the simple index (PEP 691
JSON, else the PEP 503 HTML page), the newest wheel that the requirement admits and that runs
anywhere (platform ``any``: a model wheel holds data, no code to build), checked against the
index's sha256. It reads what pip's environment says: ``PIP_INDEX_URL`` (else uv's
``UV_DEFAULT_INDEX``/``UV_INDEX_URL``, else https://pypi.org/simple/), ``PIP_EXTRA_INDEX_URL``,
``PIP_FIND_LINKS`` (folders or pages of wheels) and ``PIP_NO_INDEX``; proxies through
urllib's ``HTTP(S)_PROXY``. A pip configuration file is pip's own and not read here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urljoin, urlsplit

from specrun.errors import PullError
from specrun.models.store import CHUNK, DISK_ERRNOS, ProgressFn, write_error

if TYPE_CHECKING:
    from packaging.requirements import Requirement

DEFAULT_INDEX = "https://pypi.org/simple/"
_ACCEPT = (
    "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, "
    "text/html;q=0.01"
)
_TIMEOUT = 60.0


@dataclass(frozen=True)
class _Link:
    filename: str
    url: str  # http(s)://, file:// or a local path
    sha256: str | None
    yanked: bool = False


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def index_urls() -> list[str]:
    """The indexes to ask, in order, as pip's environment names them."""
    if _env_true("PIP_NO_INDEX"):
        return []
    env = os.environ
    main = env.get("PIP_INDEX_URL") or env.get("UV_DEFAULT_INDEX") or env.get("UV_INDEX_URL")
    extra = env.get("PIP_EXTRA_INDEX_URL", "").split()
    return [u.rstrip("/") + "/" for u in [main or DEFAULT_INDEX, *extra]]


def find_links() -> list[str]:
    return os.environ.get("PIP_FIND_LINKS", "").split()


def norm(name: str) -> str:
    """PEP 503's normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def download(specs: list[str], dest: Path, progress: ProgressFn) -> dict[str, Path]:
    """Download one wheel per requirement into ``dest``; spec -> wheel path."""
    from packaging.requirements import InvalidRequirement, Requirement  # deferred: --help

    out: dict[str, Path] = {}
    for spec in specs:
        try:
            req = Requirement(spec)
        except InvalidRequirement as exc:
            raise PullError(f"not a requirement: {spec!r} ({exc})") from None
        link = _best_link(req, spec)
        out[spec] = _fetch(link, dest, progress)
    return out


def _best_link(req: Requirement, spec: str) -> _Link:
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename  # deferred: --help
    from packaging.version import Version

    pinned = any(s.operator in ("==", "===") for s in req.specifier)
    want = norm(req.name)
    links, asked = _links(want)
    best: tuple[Version, _Link] | None = None
    for link in links:
        try:
            name, version, _build, tags = parse_wheel_filename(link.filename)
        except InvalidWheelFilename:
            continue
        if norm(name) != want or not any(t.platform == "any" for t in tags):
            continue
        if link.yanked and not pinned:
            continue
        if not req.specifier.contains(version, prereleases=True):
            continue
        if best is None or version > best[0]:
            best = (version, link)
    if best is None:
        where = ", ".join(asked) if asked else "no index (PIP_NO_INDEX, no PIP_FIND_LINKS)"
        raise PullError(f"no wheel for {spec} on {where}")
    return best[1]


def _links(project: str) -> tuple[list[_Link], list[str]]:
    """Every file the find-links and the indexes list for ``project``; and where it looked."""
    links: list[_Link] = []
    asked: list[str] = []
    for fl in find_links():
        asked.append(fl)
        local = Path(unquote(urlsplit(fl).path)) if fl.startswith("file:") else Path(fl)
        if not re.match(r"^https?://", fl):
            if local.is_dir():
                links += [_Link(p.name, str(p), None) for p in sorted(local.glob("*.whl"))]
            continue
        with contextlib.suppress(PullError):
            links += _page(fl, required=False)
    for index in index_urls():
        asked.append(index)
        links += _page(urljoin(index, project + "/"), required=False)
    return links, asked


def _open(url: str, accept: str | None = None):  # type: ignore[no-untyped-def]
    headers = {"User-Agent": "specrun (urllib)"}
    if accept:
        headers["Accept"] = accept
    try:
        return urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=_TIMEOUT
        )
    except urllib.error.HTTPError:
        raise
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise PullError(f"cannot reach {_host(url)}: {reason}") from None


def _host(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.netloc else url


def _page(url: str, required: bool) -> list[_Link]:
    """The files a simple-index page (JSON or HTML) lists; [] for a 404 unless ``required``."""
    try:
        with _open(url, _ACCEPT) as resp:
            ctype = resp.headers.get("Content-Type", "")
            body = resp.read()
            final = resp.geturl()
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and not required:
            return []
        raise PullError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    if "json" in ctype:
        try:
            data = json.loads(body)
            return [
                _Link(
                    f["filename"],
                    urljoin(final, f["url"]),
                    (f.get("hashes") or {}).get("sha256"),
                    bool(f.get("yanked")),
                )
                for f in data.get("files", [])
            ]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PullError(f"{url}: not a simple-index JSON page ({exc})") from None
    parser = _Anchors()
    parser.feed(body.decode("utf-8", "replace"))
    out = []
    for href, yanked in parser.links:
        full = urljoin(final, href)
        split = urlsplit(full)
        m = re.search(r"sha256=([0-9a-fA-F]{64})", split.fragment)
        name = unquote(split.path.rsplit("/", 1)[-1])
        out.append(_Link(name, full.split("#", 1)[0], m.group(1).lower() if m else None, yanked))
    return out


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, bool]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            a = dict(attrs)
            if a.get("href"):
                self.links.append((a["href"] or "", "data-yanked" in a))


def _fetch(link: _Link, dest: Path, progress: ProgressFn) -> Path:
    """The wheel in ``dest``: copied from a folder, else downloaded; checked against its sha256."""
    out = dest / link.filename
    part = dest / f".{link.filename}.part"
    desc = f"downloading {link.filename}"
    h = hashlib.sha256()
    try:
        with open(part, "wb") as f:
            if not re.match(r"^(https?|file):", link.url):
                with open(link.url, "rb") as src:
                    total: int | None = os.fstat(src.fileno()).st_size
                    _copy(src, f, h, progress, desc, total)
            else:
                try:
                    with _open(link.url) as resp:
                        length = resp.headers.get("Content-Length")
                        total = int(length) if length and length.isdigit() else None
                        _copy(resp, f, h, progress, desc, total)
                except urllib.error.HTTPError as exc:
                    raise PullError(f"{link.url}: HTTP {exc.code} {exc.reason}") from None
    except OSError as exc:
        with contextlib.suppress(OSError):
            part.unlink()
        if exc.errno in DISK_ERRNOS:
            raise write_error(dest, exc) from None
        raise PullError(f"cannot download {link.filename}: {exc.strerror or exc}") from None
    if link.sha256 is not None and h.hexdigest() != link.sha256.lower():
        part.unlink()
        raise PullError(
            f"{link.filename} arrived corrupt: sha256 {h.hexdigest()}, the index says {link.sha256}"
        )
    shutil.move(part, out)
    return out


def _copy(src, f, h, progress: ProgressFn, desc: str, total: int | None) -> None:  # type: ignore[no-untyped-def]
    done = 0
    progress(desc, 0, total)
    while chunk := src.read(CHUNK):
        f.write(chunk)
        h.update(chunk)
        done += len(chunk)
        progress(desc, done, total)
