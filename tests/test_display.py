"""The live display without a model: footer text on a fixed-width console, colour spans by token
origin, the stdout/stderr split, wrapping, and the choice of sink."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from specrun.cli.display import (
    LiveDisplay,
    PlainStream,
    TokenSpans,
    hbar,
    make_sink,
    render_footer,
    render_summary,
    summary_line,
)
from specrun.decoding.engine import Result, Step
from specrun.decoding.stats import SpecStats

GREEN, YELLOW = "\x1b[32m", "\x1b[33m"
SGR = re.compile(r"\x1b\[([0-9;]*)m")
CONTROL = re.compile(r"\x1b\[\??[0-9;]*[A-Za-z]|\r")


def _stats() -> SpecStats:
    st = SpecStats()
    for n_acc in (4, 4, 3, 2, 0, 4, 1, 4):
        st.record_pass("draft", 4, n_acc)
        st.generated += n_acc + 1
    st.decode_seconds = 0.5
    return st


def _plain(renderable, width: int = 80, **kw) -> str:
    c = Console(width=width, file=io.StringIO(), color_system=None, legacy_windows=False)
    with c.capture() as cap:
        c.print(renderable, crop=True, **kw)
    return "\n".join(line.rstrip() for line in cap.get().splitlines())


def test_footer_snapshot():
    text = _plain(
        render_footer(_stats(), drafter="draft", k=4, draft_max=4), no_wrap=True, overflow="crop"
    )
    assert text == (
        "─── specrun ────────────────────────────────────────────────────────────────────\n"
        "draft K=4/4  60.0 tok/s  accept 68.8% · last 64 68.8%  3.75 tok/pass  30 tok\n"
        "per position  1 ███▌ 88%  2 ███  75%  3 ██▌  62%  4 ██   50%   ■ draft ■ target"
    )


def test_footer_shows_k_against_the_cap_of_the_drafter_that_ran():
    """The suffix drafter may propose up to --lookup-draft-max (16) where the draft model stops
    at --draft-max (4): a 12-token lookup proposal reads 12/16, not 12/4."""
    st = _stats()
    lookup = _plain(
        render_footer(st, drafter="lookup", k=12, draft_max=4, lookup_max=16), no_wrap=True
    )
    draft = _plain(
        render_footer(st, drafter="draft", k=3, draft_max=4, lookup_max=16), no_wrap=True
    )
    assert "lookup K=12/16" in lookup and "draft K=3/4" in draft


def test_footer_without_drafts_and_narrow():
    st = SpecStats()
    st.record_pass("none", 0, 0)
    st.generated, st.decode_seconds = 1, 0.1
    text = _plain(
        render_footer(st, drafter="none", k=0, draft_max=None, legend=False),
        width=30,
        no_wrap=True,
        overflow="crop",
    )
    lines = text.splitlines()
    assert len(lines) == 3 and all(len(line) <= 30 for line in lines)
    assert lines[1].startswith("target alone  10.0 tok/s  acc")
    assert lines[2] == "per position  –"


def test_hbar():
    assert hbar(0.0, 4) == "    "
    assert hbar(1.0, 4) == "████"
    assert hbar(0.5, 4) == "██  "
    assert hbar(3 / 16, 1) == "▎"
    assert hbar(2.0, 3) == "███"  # clamped


def test_summary_fits_one_screen():
    st = _stats()
    st.prefill_tokens, st.prefill_seconds, st.llama_seconds = 31, 0.2, 0.45
    text = _plain(render_summary(Result("x", [1], "length", 31, st, 42, "draft"), 4, 80), width=80)
    lines = text.splitlines()
    assert len(lines) <= 20
    assert "60.0 tok/s" in text and "68.8% (22/32 drafted)" in text and "seed 42" in text
    assert "llama.cpp 90% · python 10%" in text


def _runs(s: str) -> list[tuple[str, str]]:
    """ANSI text -> [(colour, text)] with the colour that was active for each piece."""
    out: list[tuple[str, str]] = []
    colour = ""
    pos = 0
    for m in SGR.finditer(s):
        if m.start() > pos:
            out.append((colour, s[pos : m.start()]))
        code = m.group(1)
        colour = {"32": "green", "33": "yellow"}.get(
            code, "" if code in ("", "0", "39") else colour
        )
        pos = m.end()
    if pos < len(s):
        out.append((colour, s[pos:]))
    return out


PIECES = {
    1: b"Hel",
    2: b"lo",
    3: b" wor",
    4: b"ld",
    5: b"!\n",
    6: b"\xe6\x97",
    7: b"\xa5",
    8: b" ok",
}


def _step(tokens, flags, text, st=None):
    return Step(tokens, flags, text, "draft", 4, sum(flags), st or _stats())


def test_colour_spans_follow_token_origin():
    out, err = io.StringIO(), io.StringIO()
    d = LiveDisplay(out=out, err=err, footer=False, width=80, piece=PIECES.__getitem__)
    with d:
        d.step(_step([1, 2, 3], [True, True, False], "Hello wor"))
        d.step(_step([4, 5], [True, False], "ld!\n"))
        # a character split over two tokens, released with the second one
        d.step(_step([6], [True], ""))
        d.step(_step([7, 8], [True, False], "日 ok"))
    runs = [(c, t) for c, t in _runs(out.getvalue()) if t]
    assert "".join(t for _, t in runs) == "Hello world!\n日 ok\n"
    assert runs == [
        ("green", "Hello"),
        ("yellow", " wor"),
        ("green", "ld"),
        ("yellow", "!"),
        ("", "\n"),
        ("green", "日"),
        ("yellow", " ok"),
        ("", "\n"),
    ]
    assert err.getvalue() == ""  # no footer: nothing on stderr


def test_token_spans_text_released_late():
    spans = TokenSpans({1: b"ab", 2: b"cd", 3: b"ef"}.__getitem__)
    assert spans.feed([1, 2], [True, False], "a") == [("a", True)]  # "bcd" held back (stop string?)
    assert spans.feed([3], [True], "bcdef") == [("b", True), ("cd", False), ("ef", True)]
    assert spans.feed([], [], "") == []


def test_token_spans_without_pieces_splits_by_share():
    spans = TokenSpans(None)
    assert spans.feed([1, 2, 3, 4], [True, True, True, False], "abcdefgh") == [
        ("abcdef", True),
        ("gh", False),
    ]


def test_live_footer_on_stderr_text_on_stdout():
    out, err = io.StringIO(), io.StringIO()
    t = [0.0]
    d = LiveDisplay(
        out=out,
        err=err,
        width=40,
        piece=PIECES.__getitem__,
        draft_max=4,
        summary="full",
        clock=lambda: t[0],
    )
    with d:
        d.step(_step([1, 2, 3], [True, True, False], "Hello wor"))
        t[0] += 1.0
        d.step(_step([4, 5], [True, False], "ld!\n"))
        d.finish(Result("Hello world!\n", [1, 2, 3, 4, 5], "eos", 3, _stats(), 7, "draft"))
    plain_out = SGR.sub("", out.getvalue())
    assert plain_out == "Hello world!\n"  # stdout: the text, nothing else
    e = err.getvalue()
    assert "\x1b[?25l" in e and SGR.sub("", e).rstrip().endswith(
        "╯"
    )  # cursor hidden while live; summary last
    assert "\x1b[?25h" in e
    assert "accept" in e and "tok/s" in e and "seed 7" in e
    # the unfinished line is drawn in the region (stderr) before it reaches stdout
    assert "Hel" in SGR.sub("", e.split("\x1b[?25h")[0])


def test_long_line_goes_to_stdout_unbroken():
    """A line longer than the terminal is committed row by row with no newline added: stdout
    holds exactly the text, and the region never holds more than one row of it."""
    out, err = io.StringIO(), io.StringIO()
    pieces = {i: f"w{i:03d} ".encode() for i in range(200)}
    text = "".join(p.decode() for p in pieces.values())
    d = LiveDisplay(out=out, err=err, width=30, piece=pieces.__getitem__, clock=lambda: 0.0)
    with d:
        for i in range(0, 200, 3):
            ids = list(range(i, min(i + 3, 200)))
            d.step(
                _step(
                    ids, [True] * (len(ids) - 1) + [False], "".join(pieces[j].decode() for j in ids)
                )
            )
            assert d._line_cells <= 30
    assert SGR.sub("", out.getvalue()) == text + "\n"
    regions = [r for r in CONTROL.split(err.getvalue()) if r]
    assert regions and all(len(line) <= 30 for r in regions for line in SGR.sub("", r).split("\n"))


def test_close_on_interrupt_commits_partial_line():
    out, err = io.StringIO(), io.StringIO()
    d = LiveDisplay(out=out, err=err, width=40, piece=PIECES.__getitem__)
    with pytest.raises(KeyboardInterrupt), d:
        d.step(_step([1, 2], [True, False], "Hello"))
        raise KeyboardInterrupt
    assert SGR.sub("", out.getvalue()) == "Hello\n"  # what was generated stays printed
    e = err.getvalue()
    assert e.rfind("\x1b[?25h") > e.rfind("\x1b[?25l")  # cursor shown again
    assert e.endswith("\x1b[?25h")  # the footer was erased before


def test_no_color_output_has_no_colour():
    out, err = io.StringIO(), io.StringIO()
    with LiveDisplay(out=out, err=err, width=40, color=False, piece=PIECES.__getitem__) as d:
        d.step(_step([1, 2, 3], [True, True, False], "Hello wor"))
        d.finish(Result("Hello wor", [1, 2, 3], "length", 3, _stats(), 1, "draft"))
    assert GREEN not in out.getvalue() + err.getvalue()
    assert YELLOW not in out.getvalue() + err.getvalue()


def test_make_sink_choices(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    # redirected stdout: plain text, whatever else is asked
    assert isinstance(
        make_sink(live=None, color=None, stdout_tty=False, stderr_tty=True), PlainStream
    )
    assert isinstance(
        make_sink(live=None, color=True, stdout_tty=False, stderr_tty=False), PlainStream
    )
    # --live with redirected stdout and a terminal stderr: the footer alone
    s = make_sink(live=True, color=None, stdout_tty=False, stderr_tty=True)
    assert isinstance(s, LiveDisplay) and s.footer and not s.text_on_terminal
    # a terminal: live by default
    s = make_sink(live=None, color=None, stdout_tty=True, stderr_tty=True)
    assert isinstance(s, LiveDisplay) and s.footer and s.color and s.prints_summary
    # --no-live on a terminal: coloured text, no footer, no summary from the display
    s = make_sink(live=False, color=None, stdout_tty=True, stderr_tty=True)
    assert isinstance(s, LiveDisplay) and not s.footer and not s.prints_summary
    assert isinstance(
        make_sink(live=False, color=False, stdout_tty=True, stderr_tty=True), PlainStream
    )
    # stderr not a terminal: no footer (the contract keeps the live display to a terminal stderr)
    s = make_sink(live=True, color=None, stdout_tty=True, stderr_tty=False)
    assert isinstance(s, LiveDisplay) and not s.footer
    # NO_COLOR is honoured, --color wins over it
    monkeypatch.setenv("NO_COLOR", "1")
    s = make_sink(live=None, color=None, stdout_tty=True, stderr_tty=True)
    assert isinstance(s, LiveDisplay) and not s.color
    assert make_sink(live=None, color=True, stdout_tty=True, stderr_tty=True).color  # type: ignore[union-attr]


def test_plain_stream_and_summary_line_unchanged():
    out = io.StringIO()
    with PlainStream(out) as p:
        p.step(_step([1], [False], "Hi"))
        p.finish(Result("Hi", [1], "eos", 3, _stats(), 5, "draft"))
    assert out.getvalue() == "Hi"  # not a terminal: no newline added
    line = summary_line(Result("Hi", [1], "eos", 3, _stats(), 5, "draft"), 4)
    assert (
        line.startswith("specrun: 30 tokens in 0.50 s (60.0 tok/s)")
        and "K=4" in line
        and "seed 5" in line
    )
