"""Local stand-ins for the Hugging Face hub and a PyPI simple index, for registry tests.

One stdlib HTTP server on 127.0.0.1 (random port) speaks enough of both for huggingface_hub's
``hf_hub_download`` / ``HfApi.model_info`` and for ``pip download``:

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``: JSON with sha, siblings
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: X-Repo-Commit, ETag, Content-Length, Range
- ``GET /simple/{project}/``: a PEP 503 page linking the wheels, or PEP 691 JSON when the
  Accept header asks for it (and ``simple_json`` is on); ``GET /files/{wheel}``

Downloads can be throttled (``delay`` seconds per 64 KiB chunk) or stalled after ``stall_after``
bytes until ``release()``; every request is logged so tests can assert that none was made.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

CHUNK = 64 * 1024


def make_wheel(directory: Path, project: str, version: str, files: dict[str, bytes]) -> Path:
    """Write a minimal valid pure-Python wheel holding ``files`` (archive name -> bytes)."""
    dist = re.sub(r"[-_.]+", "_", project)
    info = f"{dist}-{version}.dist-info"
    path = Path(directory) / f"{dist}-{version}-py3-none-any.whl"
    contents = {f"{dist}/__init__.py": b"", **files}
    contents[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode()
    )
    contents[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: specrun-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for arc, data in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{arc},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    contents[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    Path(directory).mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        for arc, data in contents.items():
            z.writestr(arc, data)
    return path


class HubServer:
    """A thread-served fake hub + simple index. Use as a context manager."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, str] = {}
        self.wheels: dict[str, bytes] = {}  # wheel filename -> bytes
        self.requests: list[tuple[str, str]] = []
        self.simple_json = True  # answer PEP 691 JSON to a client that asks for it
        self.delay = 0.0
        self.stall_after: int | None = None
        self.started = threading.Event()  # set when a body download has begun
        self.stalled = threading.Event()  # set when a download reached stall_after
        self._release = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- content --------------------------------------------------------------------------------

    def add_repo(self, repo: str, files: dict[str, bytes], commit: str | None = None) -> str:
        self.repos[repo] = dict(files)
        self.commits[repo] = commit or hashlib.sha1(repo.encode()).hexdigest()
        return self.commits[repo]

    def add_wheel(self, path: Path) -> None:
        self.wheels[path.name] = path.read_bytes()

    def release(self) -> None:
        self._release.set()

    def count(self, fragment: str) -> int:
        return sum(fragment in path for _m, path in self.requests)

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._httpd is not None
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HubServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        server = self

        class Handler(_Handler):
            hub = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._release.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass

    # -- helpers ------------------------------------------------------------------------------

    def _send(
        self,
        code: int,
        body: bytes = b"",
        ctype: str = "application/json",
        headers: dict[str, str] | None = None,
        head: bool = False,
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(
        self,
        code: int,
        hf_code: str,
        msg: str,
        head: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        h = {"X-Error-Code": hf_code, "X-Error-Message": msg, **(headers or {})}
        self._send(code, json.dumps({"error": msg}).encode(), headers=h, head=head)

    def _stream(self, data: bytes, start: int) -> None:
        hub = self.hub
        hub.started.set()
        sent = 0
        pos = start
        while pos < len(data):
            if hub.stall_after is not None and sent >= hub.stall_after:
                hub.stalled.set()
                hub._release.wait(timeout=60)
                hub.stall_after = None
            chunk = data[pos : pos + CHUNK]
            try:
                self.wfile.write(chunk)
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                return
            pos += len(chunk)
            sent += len(chunk)
            if hub.delay:
                time.sleep(hub.delay)

    def _serve_bytes(self, data: bytes, headers: dict[str, str], head: bool, ctype: str) -> None:
        start = 0
        rng = self.headers.get("Range")
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
        code = 200
        if m:
            start = int(m.group(1))
            code = 206
            headers = {**headers, "Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("Accept-Ranges", "bytes")
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self._stream(data, start)

    # -- routes -------------------------------------------------------------------------------

    def do_HEAD(self) -> None:  # noqa: N802 - stdlib name
        self._route(head=True)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        self._route(head=False)

    def _route(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append((self.command, path))
        hub = self.hub

        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?/?", path)
        if m:
            repo = m.group(1)
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound", "Repository not found", head)
            body = {
                "id": repo,
                "modelId": repo,
                "sha": hub.commits[repo],
                "private": False,
                "siblings": [{"rfilename": f} for f in sorted(hub.repos[repo])],
                "tags": ["gguf"],
                "downloads": 0,
                "likes": 0,
            }
            return self._send(200, json.dumps(body).encode(), head=head)

        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            repo, rev, file = m.groups()
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound", "Repository not found", head)
            commit = hub.commits[repo]
            if rev not in ("main", commit):
                return self._error(404, "RevisionNotFound", "Invalid rev id", head)
            if file not in hub.repos[repo]:
                return self._error(
                    404, "EntryNotFound", "Entry not found", head, {"X-Repo-Commit": commit}
                )
            data = hub.repos[repo][file]
            sha = hashlib.sha256(data).hexdigest()
            headers = {
                "X-Repo-Commit": commit,
                "ETag": f'"{sha}"',
                "X-Linked-Etag": f'"{sha}"',
                "X-Linked-Size": str(len(data)),
            }
            return self._serve_bytes(data, headers, head, "application/octet-stream")

        m = re.fullmatch(r"/simple/([^/]+)/?", path)
        if m:
            want = re.sub(r"[-_.]+", "-", m.group(1)).lower()
            links = []
            for name, data in sorted(hub.wheels.items()):
                if re.sub(r"[-_.]+", "-", name.split("-", 1)[0]).lower() == want:
                    sha = hashlib.sha256(data).hexdigest()
                    links.append(f'<a href="/files/{name}#sha256={sha}">{name}</a><br>')
            if not links:
                return self._send(404, b"not found", "text/html", head=head)
            if hub.simple_json and "application/vnd.pypi.simple.v1+json" in (
                self.headers.get("Accept") or ""
            ):
                files = [
                    {
                        "filename": name,
                        "url": f"/files/{name}",
                        "hashes": {"sha256": hashlib.sha256(data).hexdigest()},
                    }
                    for name, data in sorted(hub.wheels.items())
                    if re.sub(r"[-_.]+", "-", name.split("-", 1)[0]).lower() == want
                ]
                body = {"meta": {"api-version": "1.0"}, "name": want, "files": files}
                ctype = "application/vnd.pypi.simple.v1+json"
                return self._send(200, json.dumps(body).encode(), ctype, head=head)
            page = "<!DOCTYPE html><html><body>" + "".join(links) + "</body></html>"
            return self._send(200, page.encode(), "text/html", head=head)

        m = re.fullmatch(r"/files/([^/]+)", path)
        if m and m.group(1) in hub.wheels:
            return self._serve_bytes(hub.wheels[m.group(1)], {}, head, "application/octet-stream")

        return self._send(404, b"{}", head=head)
