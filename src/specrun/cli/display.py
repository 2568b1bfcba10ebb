"""What the user sees: streamed text on stdout, statistics on stderr. Consumes engine events;
never touches model state. How it reaches the terminal (cursor, cells, the redrawn region) is
terminal.py's.

Three sinks share one interface (``step(ev)``, ``finish(result)``, a context manager):
- ``PlainStream``: text only (stdout redirected, ``--no-live --no-color``).
- ``LiveDisplay``: text coloured by origin (accepted draft tokens vs. the target's own) and, when
  stderr is a terminal, a footer with live acceptance figures, then a one-screen summary.

How the live display streams without flicker or slowdown: committed text is written once to
stdout and never redrawn. Only a small *region* on stderr is redrawn: the unfinished last line
of text (at most one terminal row) and the footer. A line is committed to stdout as soon as it
ends or fills a row, so each redraw costs O(width), however long the output grows. Redraws are
rate-limited (text ~30 Hz, footer figures ~8 Hz) and done in the loop's own thread between
target passes: no thread, no lock, nothing competing with the decode.
"""

from __future__ import annotations

import codecs
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Group
from rich.panel import Panel
from rich.style import Style
from rich.table import Table
from rich.text import Text

from specrun.cli import terminal
from specrun.cli.console import console
from specrun.decoding.engine import Result, Step

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.text import Text

    from specrun.decoding.stats import SpecStats

DRAFT_STYLE = "green"  # tokens that came from an accepted draft
TARGET_STYLE = "yellow"  # tokens the target produced itself (corrections and bonus tokens)
WINDOW = 64  # the footer's "recent" acceptance: SpecStats keeps the last 64 drafting passes


class PlainStream:
    """Text to stdout as it is committed; nothing else. Used when stdout is not a terminal too."""

    prints_summary = False

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout

    def step(self, ev: Step) -> None:
        if ev.text:
            self.out.write(ev.text)
            self.out.flush()

    def finish(self, result: Result) -> None:
        if result.text and not result.text.endswith("\n") and self.out.isatty():
            self.out.write("\n")
        self.out.flush()

    def close(self) -> None:
        self.out.flush()

    def __enter__(self) -> PlainStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def summary_line(result: Result, draft_max: int | None = None) -> str:
    s = result.stats
    parts = [
        f"{s.generated} tokens in {s.decode_seconds:.2f} s ({s.tokens_per_second:.1f} tok/s)",
        f"prefill {s.prefill_tokens} tokens in {s.prefill_seconds:.2f} s",
        f"mode {result.mode}" + (f" K={draft_max}" if draft_max and result.mode != "none" else ""),
    ]
    if s.drafted:
        parts.append(
            f"acceptance {100 * s.acceptance_rate:.1f}% ({s.accepted}/{s.drafted})"
            f", {s.mean_accepted_length:.2f} tokens/pass"
        )
    parts.append(f"finish {result.finish_reason}")
    parts.append(f"seed {result.seed}")
    return "specrun: " + ", ".join(parts)


# -- choosing a sink ---------------------------------------------------------------------------
def use_color(color: bool | None) -> bool:
    """--color/--no-color win; otherwise colour unless NO_COLOR is set (https://no-color.org)."""
    if color is not None:
        return color
    return not os.environ.get("NO_COLOR")


def make_sink(
    *,
    live: bool | None,
    color: bool | None,
    stdout_tty: bool,
    stderr_tty: bool,
    summary: str = "full",
    draft_max: int | None = None,
    mode: str | None = None,
    piece: Callable[[int], bytes] | None = None,
    lookup_max: int | None = None,
) -> PlainStream | LiveDisplay:
    """The display for one generation.

    - stdout a terminal: coloured text; the live footer too when stderr is a terminal (default;
      ``live=False`` turns it off). ``color=False`` (or NO_COLOR) with no footer: ``PlainStream``.
    - stdout redirected: plain text only; ``live=True`` still shows the footer on a terminal
      stderr. ``summary`` ("full" | "line" | "none") is what the live display prints at the end.
    """
    footer = stderr_tty and (live if live is not None else stdout_tty)
    colored = stdout_tty and use_color(color)
    if not footer and not colored:
        return PlainStream()
    return LiveDisplay(
        footer=footer,
        text_on_terminal=stdout_tty,
        color=use_color(color),
        summary=summary if footer else "none",
        draft_max=draft_max,
        mode=mode,
        piece=piece,
        lookup_max=lookup_max,
    )


# -- colour spans ------------------------------------------------------------------------------
class TokenSpans:
    """Maps released text back to the tokens it came from, to colour it by origin.

    The engine releases text later than tokens (a UTF-8 character split over tokens, a possible
    stop string), but always in order. So each token's characters are counted here with the same
    incremental UTF-8 decoder the engine uses, queued as (from_draft, n_chars) runs, and released
    text consumes the queue from the front.
    """

    def __init__(self, piece: Callable[[int], bytes] | None) -> None:
        self.piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._runs: deque[list[Any]] = deque()  # [from_draft, n_chars]

    def feed(self, tokens: list[int], flags: list[bool], text: str) -> list[tuple[str, bool]]:
        if self.piece is None:
            # No way to split the text per token: colour the accepted share of it as draft.
            n_acc = sum(flags)
            cut = round(len(text) * n_acc / len(flags)) if flags else 0
            return [r for r in ((text[:cut], True), (text[cut:], False)) if r[0]]
        for tok, flag in zip(tokens, flags, strict=True):
            self._push(flag, len(self._decoder.decode(self.piece(tok))))
        if not tokens:  # the engine's end-of-stream flush
            self._push(False, len(self._decoder.decode(b"", final=True)))
        return self._take(text)

    def _push(self, flag: bool, n: int) -> None:
        if n <= 0:
            return
        if self._runs and self._runs[-1][0] == flag:
            self._runs[-1][1] += n
        else:
            self._runs.append([flag, n])

    def _take(self, text: str) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        i = 0
        while i < len(text):
            if not self._runs:  # should not happen; never drop text over it
                out.append((text[i:], False))
                break
            run = self._runs[0]
            n = min(run[1], len(text) - i)
            out.append((text[i : i + n], run[0]))
            i += n
            run[1] -= n
            if run[1] == 0:
                self._runs.popleft()
        return out


# -- footer and summary ------------------------------------------------------------------------
_EIGHTHS = " ▏▎▍▌▋▊▉"


def sink_for(
    engine: Any,
    *,
    live: bool | None,
    color: bool | None,
    stdout_tty: bool,
    stderr_tty: bool,
    summary: str,
) -> PlainStream | LiveDisplay:
    """``make_sink`` for a generation of ``engine``: its caps (the draft model's K, lookup's),
    its mode and its target's token pieces."""
    return make_sink(
        live=live,
        color=color,
        stdout_tty=stdout_tty,
        stderr_tty=stderr_tty,
        summary=summary,
        draft_max=engine.config.draft_max,
        lookup_max=engine.k_cap,
        mode=engine.mode,
        piece=engine.target.piece,
    )


def hbar(frac: float, width: int) -> str:
    """A horizontal bar of ``width`` cells filled to ``frac`` in eighths of a cell."""
    frac = min(max(frac, 0.0), 1.0)
    eighths = round(frac * width * 8)
    full, part = divmod(eighths, 8)
    bar = "█" * full + (_EIGHTHS[part] if part else "")
    return bar.ljust(width)


def render_footer(
    stats: SpecStats,
    *,
    drafter: str,
    k: int,
    draft_max: int | None,
    legend: bool = True,
    lookup_max: int | None = None,
) -> Text:
    """The live footer: three lines (a rule, the figures, per-position acceptance). K is shown
    against the cap of the drafter that ran: ``draft_max`` for the draft model, ``lookup_max``
    (the suffix drafter may propose longer) for lookup."""
    t = Text(no_wrap=True, overflow="crop", end="")
    t.append("─" * 3 + " specrun " + "─" * 200, style="dim")
    t.append("\n")
    cap = lookup_max if drafter == "lookup" and lookup_max else draft_max
    mode = "target alone" if drafter == "none" else f"{drafter} K={k}" + (f"/{cap}" if cap else "")
    t.append(mode, style="bold")
    t.append("  ")
    t.append(f"{stats.tokens_per_second:.1f}", style="bold")
    t.append(" tok/s  accept ")
    if stats.drafted:
        t.append(f"{100 * stats.acceptance_rate:.1f}%", style="bold")
        t.append(f" · last {WINDOW} ")
        t.append(f"{100 * stats.window_acceptance_rate:.1f}%", style="bold")
    else:
        t.append("–")
    t.append("  ")
    t.append(f"{stats.mean_accepted_length:.2f}", style="bold")
    t.append(" tok/pass  ")
    t.append(f"{stats.generated} tok", style="dim")
    t.append("\n")
    rates = stats.per_position_acceptance()
    t.append("per position", style="dim")
    if not rates:
        t.append("  –")
    for i, r in enumerate(rates, 1):
        t.append(f"  {i} ")
        t.append(hbar(r, 4), style=DRAFT_STYLE)
        t.append(f"{100 * r:3.0f}%")
    if legend:
        t.append("   ")
        t.append("■ draft", style=DRAFT_STYLE)
        t.append(" ")
        t.append("■ target", style=TARGET_STYLE)
    return t


def render_summary(result: Result, draft_max: int | None = None, width: int = 90) -> RenderableType:
    """The end-of-run summary: one screen at most (K + 10 lines or so), ``width`` columns."""
    s = result.stats
    d = s.to_dict()
    head = Table.grid(padding=(0, 2))
    head.add_column(style="dim")
    head.add_column()
    head.add_row(
        "generated",
        f"{s.generated} tokens in {s.decode_seconds:.2f} s · "
        f"[bold]{s.tokens_per_second:.1f} tok/s[/] · finish {result.finish_reason}",
    )
    head.add_row("prefill", f"{s.prefill_tokens} tokens in {s.prefill_seconds:.2f} s")
    k_txt = f" K={draft_max}" if draft_max and result.mode != "none" else ""
    head.add_row("mode", f"{result.mode}{k_txt} · seed {result.seed}")
    if s.drafted:
        head.add_row(
            "acceptance",
            f"[bold]{100 * s.acceptance_rate:.1f}%[/] ({s.accepted}/{s.drafted} drafted) · "
            f"{s.mean_accepted_length:.2f} tokens per target pass ({s.target_passes} passes)",
        )
    else:
        head.add_row("acceptance", f"no drafts · {s.target_passes} target passes")
    if s.decode_seconds > 0:
        ov = float(d["overhead_fraction"])  # type: ignore[arg-type]
        head.add_row("time", f"llama.cpp {100 * (1 - ov):.0f}% · python {100 * ov:.0f}%")
    parts: list[RenderableType] = [head]
    rates = s.per_position_acceptance()
    if rates or len(s.histogram) > 1:
        bw = max(4, min(20, (width - 34) // 2))  # bar width: both tables side by side
        grid = Table(box=None, padding=(0, 1), show_edge=False, pad_edge=False)
        grid.add_column("pos", justify="right", style="dim")
        grid.add_column("accepted", min_width=bw)
        grid.add_column("", justify="right")
        grid.add_column("   n", justify="right", style="dim")
        grid.add_column("passes with n accepted", min_width=bw)
        grid.add_column("", justify="right")
        hist = s.histogram
        top = max(hist) if hist else 0
        for i in range(max(len(rates), len(hist))):
            row: list[RenderableType] = ["", "", ""]
            if i < len(rates):
                row = [
                    str(i + 1),
                    Text(hbar(rates[i], bw), style=DRAFT_STYLE),
                    f"{100 * rates[i]:.0f}%",
                ]
            if i < len(hist):
                row += [
                    str(i),
                    Text(hbar(hist[i] / top if top else 0, bw), style=TARGET_STYLE),
                    str(hist[i]),
                ]
            else:
                row += ["", "", ""]
            grid.add_row(*row)
        parts += [Text(""), grid]
    if s.modes_used and len(s.modes_used) > 1:
        used = ", ".join(f"{m} ×{n}" for m, n in sorted(s.modes_used.items()))
        parts += [Text(f"passes by drafter:K  {used}", style="dim")]
    return Panel(
        Group(*parts), title="specrun", title_align="left", expand=False, border_style="dim"
    )


# -- the live display --------------------------------------------------------------------------
class LiveDisplay:
    """Coloured streaming text plus a live footer; see the module docstring for how it draws."""

    prints_summary: bool

    def __init__(
        self,
        *,
        out: TextIO | None = None,
        err: TextIO | None = None,
        footer: bool = True,
        text_on_terminal: bool = True,
        color: bool = True,
        summary: str = "full",
        draft_max: int | None = None,
        mode: str | None = None,
        piece: Callable[[int], bytes] | None = None,
        lookup_max: int | None = None,
        width: int | None = None,
        text_hz: float = 30.0,
        footer_hz: float = 8.0,
        clock: Callable[[], float] = time.perf_counter,
        mute_input: bool = True,
    ) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.footer = footer
        self.text_on_terminal = text_on_terminal
        self.color = color
        self.summary = summary
        self.prints_summary = footer and summary != "none"
        self.draft_max = draft_max
        self.lookup_max = lookup_max
        self.mode = mode
        self.spans = TokenSpans(piece)
        self._width = width
        self._text_interval = 1.0 / text_hz
        self._footer_interval = 1.0 / footer_hz
        self._clock = clock
        self.console: Console = console(
            file=self.err, force_terminal=True, no_color=not color, emoji=False, width=width
        )
        cs = self.console._color_system if color else None
        styles = {True: Style.parse(DRAFT_STYLE), False: Style.parse(TARGET_STYLE)}
        self._sgr: dict[bool, tuple[str, str]] = {}
        for flag, st in styles.items():
            probe = st.render("\0", color_system=cs) if cs is not None else "\0"
            pre, _, post = probe.partition("\0")
            self._sgr[flag] = (pre, post)
        self.region = terminal.Region(self.err)  # the unfinished line and the footer
        self._echo = terminal.EchoMute()
        self._line: list[tuple[str, bool]] = []  # the unfinished last line: not yet on stdout
        self._line_cells = 0
        self._ends_with_newline = True
        self._any_text = False
        self._footer_lines: list[str] = []
        self._last_draw = -1e9
        self._last_footer = -1e9
        self._stats: SpecStats | None = None
        self._drafter = mode or "none"
        self._k = 0
        self._closed = False
        self._started = False
        self._mute_input = mute_input and footer

    # -- public interface -----------------------------------------------------------------
    def __enter__(self) -> LiveDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(self, ev: Step) -> None:
        if self._closed:
            return
        if not self._started:
            self._started = True
            if self.footer:
                self.region.cursor(visible=False)
                if self._mute_input:
                    self._echo.mute()
        self._stats = ev.stats
        if ev.tokens:
            self._drafter, self._k = ev.drafter, ev.k
        runs = self.spans.feed(ev.tokens, ev.from_draft, ev.text)
        if runs:
            self._add_text(runs)
        if self.footer:
            now = self._clock()
            if self.region.height == 0 or now - self._last_draw >= self._text_interval:
                self._redraw(now)

    def finish(self, result: Result) -> None:
        self._stats = result.stats
        self.close()
        if self.summary == "full":
            w = min(self._cols(), 90)
            self.console.print(render_summary(result, self.draft_max, w), width=w)
        elif self.summary == "line":
            self.console.print(summary_line(result, self.draft_max), style="dim", markup=False)

    def close(self) -> None:
        """Erase the footer, put the unfinished line on stdout, end with a newline, show the
        cursor. Safe to call twice; runs on Ctrl-C through the context manager."""
        if self._closed:
            return
        self._closed = True
        if self.footer:
            self.region.clear()
        if self._line:
            self._write_out(self._line)
            self._line, self._line_cells = [], 0
        if self._any_text and not self._ends_with_newline and self.text_on_terminal:
            self.out.write("\n")
        try:
            self.out.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass
        if self.footer and self._started:
            self.region.cursor(visible=True)
        self._echo.restore()

    # -- text -----------------------------------------------------------------------------
    def _add_text(self, runs: list[tuple[str, bool]]) -> None:
        if not self.text_on_terminal:
            text = "".join(t for t, _ in runs)
            self.out.write(text)
            self.out.flush()
            self._any_text = True
            self._ends_with_newline = text.endswith("\n")
            return
        for text, flag in runs:
            text = text.translate(terminal.CONTROL)
            if not text:
                continue
            self._any_text = True
            self._ends_with_newline = text.endswith("\n")
            lines = text.split("\n")
            for j, part in enumerate(lines):
                if "\t" in part:
                    part = self._expand_tabs(part)
                if part:
                    self._line.append((part, flag))
                    self._line_cells += terminal.cells(part)
                if j < len(lines) - 1:  # a finished line: straight to stdout
                    self._line.append(("\n", flag))
                    self._commit(len(self._line), 0)
        if self._line_cells > self._cols():
            self._commit_full_rows()
        elif not self.footer and self._line:
            self._commit(len(self._line), 0)  # no region to hold the line in

    def _expand_tabs(self, part: str) -> str:
        """Tabs become spaces (the region's arithmetic counts cells)."""
        if self._line_cells > self._cols():
            self._commit_full_rows()
        width = self._cols()
        return terminal.expand_tabs(part, self._line_cells % width, width)

    def _commit_full_rows(self) -> None:
        """Move every row but the last of the unfinished line to stdout, wrapping as a terminal
        does, so the line left in the region fits one row and stdout gets exactly the text, no
        added newlines."""
        start = terminal.last_row_start(self._line, self._cols())
        if start is not None:
            self._commit(*start)

    def _commit(self, ri: int, ci: int) -> None:
        """Write ``_line`` up to (run ri, char ci) to stdout; keep the rest."""
        head = self._line[:ri]
        rest = self._line[ri:]
        if ci and rest:
            text, flag = rest[0]
            head.append((text[:ci], flag))
            rest = [(text[ci:], flag), *rest[1:]]
        if self.footer:
            self.region.clear(open_frame=True)  # step() redraws and ends the frame
        self._write_out(head)
        self._line = rest
        self._line_cells = sum(terminal.cells(t) for t, _ in rest)
        # The region is now erased; step() redraws it before returning (height 0 forces it).

    def _ansi(self, runs: list[tuple[str, bool]]) -> str:
        parts = []
        for text, flag in runs:
            pre, post = self._sgr[flag]
            if "\n" in text and pre:
                # Close the colour before a newline: a terminal's scroll fills with it otherwise.
                text = text.replace("\n", post + "\n" + pre)
            parts.append(pre + text + post)
        return "".join(parts)

    def _write_out(self, runs: list[tuple[str, bool]]) -> None:
        if runs:
            self.out.write(self._ansi(runs))
            self.out.flush()

    # -- the region on stderr ---------------------------------------------------------------
    def _cols(self) -> int:
        return max(self._width or self.console.width, 10)

    def _redraw(self, now: float) -> None:
        if self._line_cells > self._cols():
            self._commit_full_rows()  # the terminal got narrower
        if self._stats is not None and (
            now - self._last_footer >= self._footer_interval or not self._footer_lines
        ):
            self._footer_lines = self._render_lines()
            self._last_footer = now
        lines = ([self._ansi(self._line)] if self.text_on_terminal else []) + self._footer_lines
        self.region.draw(lines)
        self._last_draw = now

    def _render_lines(self) -> list[str]:
        assert self._stats is not None
        footer = render_footer(
            self._stats,
            drafter=self._drafter,
            k=self._k,
            draft_max=self.draft_max,
            legend=self.text_on_terminal and self.color,
            lookup_max=self.lookup_max,
        )
        with self.console.capture() as cap:
            self.console.print(footer, width=self._cols(), crop=True, no_wrap=True, overflow="crop")
        return cap.get().rstrip("\n").split("\n")
