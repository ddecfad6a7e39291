"""The Markdown table helper: layout, alignment, escaping, validation, and its command line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch_amp import _markdown

SCRIPT = Path(_markdown.__file__)


def _cells(line: str) -> list[str]:
    """A table line's cells, unescaped: split on '|' not preceded by a backslash."""
    assert line.startswith("| ") and line.endswith(" |"), line
    return [c.replace("\\|", "|") for c in re.split(r" (?<!\\)\| ", line[2:-2])]


def test_a_table_is_a_header_a_rule_and_one_line_per_row():
    got = _markdown.table(["run", "ms", "share"], [["fp32", 1.5, "0%"], ["ours", 1.25, "100%"]], align="lrc")
    assert got.splitlines() == [
        "| run | ms | share |",
        "|---|---:|:---:|",
        "| fp32 | 1.5 | 0% |",
        "| ours | 1.25 | 100% |",
    ]


def test_without_align_every_column_is_left_to_the_renderer():
    assert _markdown.header(["a", "b"]).splitlines()[1] == "|---|---|"


def test_header_and_rows_printed_one_at_a_time_make_the_same_table():
    rows = [["fp32", 3], ["ours", 2]]
    streamed = "\n".join([_markdown.header(["run", "n"], "lr")] + [_markdown.row(r) for r in rows])
    assert streamed == _markdown.table(["run", "n"], rows, "lr")


def test_a_pipe_or_a_line_break_in_a_cell_cannot_break_the_table():
    line = _markdown.row(["a|b", "two\nlines"])
    assert line == "| a\\|b | two lines |"
    assert _cells(line) == ["a|b", "two lines"]


def test_no_rows_is_a_header_alone():
    assert _markdown.table(["op"], []) == "| op |\n|---|"


@pytest.mark.parametrize("align", ["l", "lrr", "lx", ""])
def test_a_bad_align_names_the_columns(align):
    with pytest.raises(ValueError, match=r"one of l, r, c for each of the 2 columns \['a', 'b'\]"):
        _markdown.table(["a", "b"], [[1, 2]], align=align)


def test_a_row_of_the_wrong_length_is_named():
    with pytest.raises(ValueError, match=r"row 1 has 1 cells for the 2 columns"):
        _markdown.table(["a", "b"], [[1, 2], [3]])


_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\\"), max_size=12)


@settings(deadline=None, max_examples=60)
@given(st.integers(1, 4).flatmap(lambda n: st.tuples(st.lists(_text, min_size=n, max_size=n),
                                                      st.lists(st.lists(_text, min_size=n, max_size=n), max_size=4))))
def test_every_cell_reads_back_from_its_line(case):
    names, rows = case
    lines = _markdown.table(names, rows).splitlines()
    assert len(lines) == 2 + len(rows)
    for line, cells in zip([lines[0]] + lines[2:], [names] + rows):
        assert _cells(line) == [" ".join(c.splitlines()) for c in cells]  # line breaks become spaces


def test_the_command_line_prints_tab_separated_stdin_as_a_table():
    # Run as a file, as the shell scripts do: only the standard library is imported.
    out = subprocess.run([sys.executable, str(SCRIPT), "--align", "lr"], input="torch\tresult\n2.13.0\t5 passed\n",
                         capture_output=True, text=True, check=True).stdout
    assert out == "| torch | result |\n|---|---:|\n| 2.13.0 | 5 passed |\n"


def test_the_command_line_rejects_a_bad_table_with_a_usage_error():
    res = subprocess.run([sys.executable, str(SCRIPT)], input="a\tb\n1\n", capture_output=True, text=True)
    assert res.returncode == 2 and "row 0 has 1 cells" in res.stderr
    res = subprocess.run([sys.executable, str(SCRIPT)], input="", capture_output=True, text=True)
    assert res.returncode == 2 and "no lines on stdin" in res.stderr


def test_the_module_imports_only_the_standard_library():
    res = subprocess.run([sys.executable, "-c", f"import runpy, sys; runpy.run_path({str(SCRIPT)!r}); "
                          "print(sorted(m for m in ('torch', 'dispatch_amp') if m in sys.modules))"],
                         capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"
