"""README.md and the pages under docs/: links resolve, every page is reachable, code runs.

- Every relative link (and image) in README.md and docs/*.md names a file that exists, and
  its ``#anchor``, if any, names a heading of that page under GitHub's slug rules (link
  text that wraps onto the next line included).
- Every page opens with its title (``# ...``) and every page under docs/ is reachable
  from README.md by following links.
- Every python code block runs, in order, one namespace per page (a page's later blocks
  use the names its earlier ones made). A block that cannot run here (it needs a GPU,
  the network or several processes) says so on the line just above its fence::

      <!-- docs-test: not run (needs a GPU): what it shows -->

  Those blocks are counted per page and the counts are pinned in ``NOT_RUN``: no block
  is skipped without a line here saying so.
- A python block followed by a paragraph ending in "prints:" and a ``text`` block must
  print exactly that text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

NOT_RUN_REASONS = ("needs a GPU", "needs network", "needs several processes")
# Page (relative to the repository) -> how many of its python blocks are marked not run.
NOT_RUN = {"docs/distributed.md": 2}

_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^`\s]*)(.*)$")
_NOT_RUN_MARK = re.compile(r"^<!-- docs-test: not run \(([^)]*)\)(?::\s*(.*?))? -->$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@dataclasses.dataclass
class Block:
    """A fenced code block: where it starts, its language, its text, the prose above it."""

    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    before: str  # the lines between the previous block (or the page's start) and this fence


@dataclasses.dataclass
class Page:
    blocks: list[Block]
    prose: list[tuple[int, str]]  # (1-based line, text) of every line outside code blocks


def parse(text: str) -> Page:
    """Splits Markdown into fenced code blocks and the prose lines around them."""
    blocks, prose, before = [], [], []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            before.append(lines[i])
            i += 1
            continue
        fence, lang = m.group(1), m.group(2)
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith(fence[0] * len(fence)):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"line {start}: code block never closed")
        blocks.append(Block(start, lang, "\n".join(body) + "\n", "\n".join(before)))
        before = []
        i += 1
    return Page(blocks, prose)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text, lower case, punctuation dropped,
    spaces to hyphens (links keep their text, code spans their content)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Page) -> set[str]:
    """Every heading's anchor; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in page.prose:
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _paragraphs(page: Page) -> list[tuple[int, str]]:
    """(first line, text) of each run of consecutive non-blank prose lines: a link's text
    or a code span may wrap onto the next line."""
    out: list[tuple[int, str]] = []
    previous = None
    for number, line in page.prose:
        if line.strip() and previous == number - 1 and out:
            out[-1] = (out[-1][0], out[-1][1] + "\n" + line)
        elif line.strip():
            out.append((number, line))
        previous = number if line.strip() else None
    return out


def links(page: Page) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link and image in the prose, code spans left out;
    the line is where the link starts."""
    found = []
    for first, text in _paragraphs(page):
        # Code spans become as many newlines as they held, so line numbers stay right.
        text = _INLINE_CODE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for m in _LINK.finditer(text):
            found.append((first + text.count("\n", 0, m.start()), m.group(1)))
    return found


def broken_links(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """What is wrong with each relative link of the page at ``path``, as readable lines."""
    page = parse(path.read_text())
    problems = []
    for number, target in links(page):
        if re.match(r"^[a-zA-Z][a-zA-Z+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: {file_part} does not exist")
            continue
        if anchor:
            if dest.suffix != ".md":
                problems.append(f"{where}: an anchor into a file that is not Markdown")
            elif anchor not in anchors(parse(dest.read_text())):
                problems.append(f"{where}: no heading of {dest.name} has the anchor #{anchor}")
    return problems


def reachable(start: pathlib.Path) -> set[pathlib.Path]:
    """Every Markdown page reached from ``start`` by following relative links (resolved)."""
    seen, todo = set(), [start.resolve()]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for _, target in links(parse(path.read_text())):
            file_part = target.partition("#")[0]
            if file_part.endswith(".md") and not re.match(r"^[a-zA-Z][a-zA-Z+.-]*:", file_part):
                dest = (path.parent / file_part).resolve()
                if dest.exists():
                    todo.append(dest)
    return seen


@dataclasses.dataclass
class RunResult:
    ran: int
    not_run: list[tuple[int, str]]  # (line, reason)


def not_run_reason(block: Block) -> str | None:
    """The reason a block is marked not run, or None; a malformed mark raises."""
    last = next((line.strip() for line in reversed(block.before.splitlines()) if line.strip()), "")
    if not last.startswith("<!-- docs-test"):
        return None
    m = _NOT_RUN_MARK.match(last)
    if not m:
        raise ValueError(f"line {block.line}: malformed mark {last!r}; write "
                         f"'<!-- docs-test: not run (REASON): what it shows -->'")
    if m.group(1) not in NOT_RUN_REASONS:
        raise ValueError(f"line {block.line}: {m.group(1)!r} is not a reason to leave a block "
                         f"unrun; the reasons are {NOT_RUN_REASONS}")
    if block.lang != "python":
        raise ValueError(f"line {block.line}: a not-run mark above a {block.lang or 'plain'} "
                         f"block; only python blocks run")
    return m.group(1)


def run_python_blocks(text: str, filename: str) -> RunResult:
    """Runs the page's python blocks in order in one namespace; checks "prints:" blocks."""
    page = parse(text)
    namespace: dict = {"__name__": "__docs__"}
    result = RunResult(0, [])
    last_output: tuple[Block, str] | None = None
    for block in page.blocks:
        reason = not_run_reason(block)
        if block.lang == "text" and block.before.strip().endswith("prints:"):
            if last_output is None:
                raise AssertionError(f"{filename}:{block.line}: a 'prints:' block follows no "
                                     f"python block that ran")
            source, printed = last_output
            assert printed == block.body, (
                f"{filename}:{source.line}: the block prints\n{printed}\nwhere the page shows\n"
                f"{block.body}")
            continue
        last_output = None
        if block.lang != "python":
            continue
        if reason is not None:
            result.not_run.append((block.line, reason))
            continue
        # Padded with newlines so that a traceback names the page's own line numbers.
        code = compile("\n" * block.line + block.body, filename, "exec")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code, namespace)
        result.ran += 1
        last_output = (block, out.getvalue())
    return result


def _name(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


# -- the pages ------------------------------------------------------------------------


@pytest.mark.parametrize("path", PAGES, ids=_name)
def test_relative_links_resolve(path):
    assert broken_links(path) == []




@pytest.mark.parametrize("path", PAGES, ids=_name)
def test_every_page_opens_with_its_title(path):
    first = path.read_text().splitlines()[0]
    assert re.match(r"^# \S", first), f"{_name(path)} opens with {first!r}, not a '# Title' line"


def test_every_docs_page_is_reachable_from_readme():
    seen = reachable(ROOT / "README.md")
    assert [_name(p) for p in PAGES if p.resolve() not in seen] == []


@pytest.mark.parametrize("path", PAGES, ids=_name)
def test_python_blocks_run(path):
    result = run_python_blocks(path.read_text(), _name(path))
    assert len(result.not_run) == NOT_RUN.get(_name(path), 0), (
        f"blocks marked not run: {result.not_run}; NOT_RUN pins {NOT_RUN.get(_name(path), 0)}")
    assert result.ran + len(result.not_run) == sum(
        b.lang == "python" for b in parse(path.read_text()).blocks)


def test_readme_has_a_quickstart_that_runs():
    assert run_python_blocks((ROOT / "README.md").read_text(), "README.md").ran >= 1


def test_not_run_pins_name_pages_that_exist():
    assert all((ROOT / page).is_file() for page in NOT_RUN)


# -- the checker itself ---------------------------------------------------------------


def test_slugs_follow_githubs_rules():
    assert github_slug("Code that calls `torch.autocast`: `patch_torch`") == \
        "code-that-calls-torchautocast-patch_torch"
    assert github_slug("On a GPU (H100), 2026-11-26") == "on-a-gpu-h100-2026-11-26"
    assert github_slug("Weight casts: the cache and `cast_cache()`") == \
        "weight-casts-the-cache-and-cast_cache"
    assert github_slug("Custom autograd Functions, checkpointing, torch.func") == \
        "custom-autograd-functions-checkpointing-torchfunc"
    assert anchors(parse("# A\n## A\n```\n# not a heading\n```\n### A!\n")) == {"a", "a-1", "a-2"}


def test_broken_links_and_anchors_are_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Real heading\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#real-heading) [self](#top) `[code](missing.md)`\n"
        "# Top\n[gone](missing.md) [bad anchor](other.md#nope) ![img](pic.png)\n"
        "```\n[in a block](missing-too.md)\n```\n"
        "[web](https://example.com/x.md)\n"
    )
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 3, problems
    assert "missing.md does not exist" in problems[0]
    assert "#nope" in problems[1]
    assert "pic.png does not exist" in problems[2]


def test_a_link_whose_text_wraps_is_checked_and_located(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\nSee [the\nother page](gone.md) and `a code\nspan [x](no.md)`,\n"
                    "then [a](#nope).\n")
    problems = broken_links(page, root=tmp_path)
    assert problems == ["page.md:3: gone.md: gone.md does not exist",
                        "page.md:6: #nope: no heading of page.md has the anchor #nope"], problems


def test_a_page_no_link_reaches_is_not_reachable(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("[a](docs/a.md) [web](https://example.com/c.md)\n")
    (tmp_path / "docs" / "a.md").write_text("# A\n[back](../README.md#top) [gone](missing.md)\n")
    (tmp_path / "docs" / "b.md").write_text("# B\n[a](a.md)\n")   # links out, nothing links in
    seen = reachable(tmp_path / "README.md")
    assert seen == {(tmp_path / "README.md").resolve(), (tmp_path / "docs" / "a.md").resolve()}


def test_a_block_that_fails_fails_the_page():
    with pytest.raises(ZeroDivisionError):
        run_python_blocks("```python\nx = 1\n```\n\n```python\n1 / 0\n```\n", "page.md")


def test_a_marked_block_is_counted_not_run():
    text = ("```python\nx = 1\n```\n\n<!-- docs-test: not run (needs a GPU): on CUDA -->\n"
            "```python\nraise SystemExit('must not run')\n```\n")
    result = run_python_blocks(text, "page.md")
    assert (result.ran, result.not_run) == (1, [(6, "needs a GPU")])


@pytest.mark.parametrize("mark", [
    "<!-- docs-test: not run (slow): takes a minute -->",      # not an accepted reason
    "<!-- docs-test: skip -->",                                # malformed
])
def test_a_mark_without_an_accepted_reason_raises(mark):
    with pytest.raises(ValueError):
        run_python_blocks(f"{mark}\n```python\nx = 1\n```\n", "page.md")


def test_a_mark_above_a_block_that_never_runs_raises():
    with pytest.raises(ValueError):
        run_python_blocks("<!-- docs-test: not run (needs a GPU) -->\n```bash\nls\n```\n", "page.md")


def test_printed_output_is_compared():
    page = "```python\nprint('a')\n```\n\nprints:\n\n```text\n{}\n```\n"
    run_python_blocks(page.format("a"), "page.md")
    with pytest.raises(AssertionError):
        run_python_blocks(page.format("b"), "page.md")
