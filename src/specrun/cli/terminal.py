"""The terminal as the live display drives it (display.py decides what to show; this is how it
reaches the screen): escape sequences, a region of rows on stderr erased and redrawn in place
as one frame, a terminal's arithmetic of cells, tab stops and wrapping, and keystroke echo
muted while the region is up.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

from rich.cells import cell_len

HIDE_CURSOR = "\x1b[?25l"
SHOW_CURSOR = "\x1b[?25h"
# Synchronized output (DEC mode 2026): the terminal shows an erase-and-redraw as one frame.
# Terminals without it ignore the private mode.
SYNC_BEGIN = "\x1b[?2026h"
SYNC_END = "\x1b[?2026l"
# Control characters a model may emit that would move the cursor or restyle the terminal
# (a str.translate table: dropped, ESC shown as a symbol; tab and newline kept).
CONTROL = {c: None for c in range(32) if c not in (9, 10)} | {0x7F: None, 0x1B: "\u241b"}


def erase(height: int) -> str:
    """The sequence that clears ``height`` rows, the cursor on the last, and leaves it at the
    start of the first."""
    if not height:
        return ""
    return "\r\x1b[2K" + "\x1b[1A\x1b[2K" * (height - 1)


def cells(text: str) -> int:
    """The columns ``text`` takes on a terminal (wide characters two, combining marks none)."""
    return int(cell_len(text))


def expand_tabs(part: str, col: int, width: int) -> str:
    """Tabs as spaces, the text starting at column ``col`` of rows ``width`` wide: stops every 8
    columns of the row, a tab at the margin stopping there, as a terminal sets them."""
    out = []
    for ch in part:
        if ch == "\t":
            if col >= width:
                col = 0
            n = min(8 - col % 8, width - col)
            out.append(" " * n)
        else:
            n = cells(ch)
            if col + n > width:
                col = 0
            out.append(ch)
        col += n
    return "".join(out)


def last_row_start(runs: list[tuple[str, bool]], width: int) -> tuple[int, int] | None:
    """Where the last row of a line of text runs starts when a terminal ``width`` wide wraps
    it ((run index, char index); a wide character that does not fit goes to the next row);
    None when it fits one row."""
    col = 0
    start = None
    for ri, (text, _) in enumerate(runs):
        for ci, ch in enumerate(text):
            w = cells(ch)
            if w == 0:
                continue
            if col + w > width:
                start = (ri, ci)
                col = 0
            col += w
    return start


class Region:
    """Rows at the bottom of stderr, redrawn in place: ``draw`` erases what it drew last and
    draws the new lines as one frame; ``clear`` erases them."""

    def __init__(self, err: TextIO) -> None:
        self.err = err
        self.height = 0  # rows drawn

    def write(self, s: str) -> None:
        if s:
            self.err.write(s)
            self.err.flush()

    def cursor(self, visible: bool) -> None:
        self.write(SHOW_CURSOR if visible else HIDE_CURSOR)

    def draw(self, lines: list[str]) -> None:
        self.write(SYNC_BEGIN + erase(self.height) + "\n".join(lines) + SYNC_END)
        self.height = len(lines)

    def clear(self, open_frame: bool = False) -> None:
        """Erase the region; with ``open_frame`` inside a frame that the next ``draw`` ends
        (text written to stdout meanwhile shows with the redraw, not before)."""
        if self.height:
            self.write((SYNC_BEGIN if open_frame else "") + erase(self.height))
            self.height = 0


class EchoMute:
    """While a region is drawn, keystrokes must not echo into it (a typed key or the "^C" of
    Ctrl-C would shift its rows and the next erase would miss). Typed text stays queued for
    whatever reads the terminal next (chat's prompt)."""

    def __init__(self) -> None:
        self._saved: tuple[int, list[Any]] | None = None

    def mute(self) -> None:
        try:
            import termios

            fd = sys.stdin.fileno()
            if not os.isatty(fd):
                return
            old = termios.tcgetattr(fd)
            new = list(old)
            new[3] &= ~(termios.ECHO | getattr(termios, "ECHOCTL", 0))
            termios.tcsetattr(fd, termios.TCSANOW, new)
            self._saved = (fd, old)
        except Exception:  # termios.error, no termios, a closed stdin: echo stays as it was
            pass

    def restore(self) -> None:
        if self._saved is None:
            return
        fd, old = self._saved
        self._saved = None
        try:
            import termios

            termios.tcsetattr(fd, termios.TCSANOW, old)
        except Exception:
            pass
