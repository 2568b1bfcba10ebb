"""What the server tells its operator: a Rich live status line on a terminal (requests served,
queue, acceptance, tok/s), plain log lines (one per request) otherwise. stderr only."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from rich.console import Console
from rich.live import Live


class Status:
    def __init__(self, tty: bool | None = None) -> None:
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.served = 0
        self.errors = 0
        self.cancelled = 0
        self.worker: Any = None
        self.metrics: Any = None
        self.url = ""
        self.state = "loading"
        self._live: Any = None
        self._lock = threading.Lock()
        self._console: Any = None
        if self.tty:
            self._console = Console(stderr=True, highlight=False)

    # -- lines ----------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        with self._lock:
            try:
                if self._console is not None:
                    self._console.print(f"specrun serve: {msg}", markup=False, highlight=False)
                else:
                    print(f"specrun serve: {msg}", file=sys.stderr, flush=True)
            except (OSError, ValueError):  # stderr closed or gone: the server keeps serving
                pass

    def say(self, msg: str) -> None:
        """Loading progress: the live line on a terminal, a log line otherwise."""
        self.state = msg
        if self._live is None:
            self.log(msg)

    def start(self) -> None:
        if self._console is None:
            return

        class _Line:
            def __rich__(inner) -> str:  # noqa: N805
                return self.line()

        self._live = Live(_Line(), console=self._console, refresh_per_second=2, transient=True)
        self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def line(self) -> str:
        w = self.worker
        if w is None:
            return f"[bold]specrun serve[/] {self.url.removeprefix('http://')} {self.state}…"
        t = self.metrics.totals if self.metrics is not None else {}
        acc = f"{t['accepted'] / t['drafted']:.0%}" if t.get("drafted") else "-"
        tps = f"{t['gen'] / t['gen_s']:.1f}" if t.get("gen_s") else "-"
        n = len(w.running)
        busy = (
            (f"generating {n}/{len(w.slots)}" if len(w.slots) > 1 else "generating")
            if n
            else "idle"
        )
        where = self.url.removeprefix("http://")
        errors = f" · {self.errors} errors" if self.errors else ""
        return (
            f"[bold]specrun serve[/] {where} {busy} · {self.served} served · queue {w.waiting} · "
            f"accept {acc} · {tps} tok/s{errors}"
        )

    # -- events ---------------------------------------------------------------------------
    def done(
        self,
        endpoint: str,
        prompt: int,
        cached: int,
        results: list[Any],
        state: str,
        seconds: float,
    ) -> None:
        if state == "done":
            self.served += 1
        elif state == "cancelled":
            self.cancelled += 1
        else:
            self.errors += 1
        if self._live is not None and state == "done":
            return  # the live line carries it
        gen = sum(len(r.tokens) for r in results)
        dec = sum(r.stats.decode_seconds for r in results)
        drafted = sum(r.stats.drafted for r in results)
        acc = sum(r.stats.accepted for r in results)
        mode = results[0].mode if results else "-"
        self.log(
            f"{endpoint} {state}: prompt {prompt} (cached {cached}), {gen} tokens, "
            f"{gen / dec if dec > 0 else 0.0:.1f} tok/s, mode {mode}, accepted {acc}/{drafted}, "
            f"{seconds:.2f} s"
        )


def now() -> float:
    return time.perf_counter()
