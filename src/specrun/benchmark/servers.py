"""HTTP servers that benchmark scripts start on 127.0.0.1 and stop after: `specrun serve`,
llama.cpp's `llama-server`, or anything that answers ``/health``."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post_json(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return dict(json.loads(r.read()))


class ServerProcess:
    """``cmd`` (with ``{port}`` replaced by a free port) started, waited for until ``/health``
    answers 200; its output to ``log``; ``stop()`` sends SIGINT, then kills."""

    def __init__(self, cmd: list[str], log: str, timeout: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")  # noqa: SIM115 - closed by stop()
        argv = [a.replace("{port}", str(self.port)) for a in cmd]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        end = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited (code {self.proc.returncode}): see {log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.time() > end:
                self.stop()
                raise RuntimeError(f"{argv[0]} not ready in {timeout:.0f} s: see {log}")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
