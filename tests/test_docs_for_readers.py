"""The pages a user reads stay pages for users: the README is short, and the user docs (docs/*.md, not docs/dev/)
hold no lab notes. Issue numbers, commit hashes and dated re-checks say how the project got here, which the
maintainers' pages (docs/dev/) keep; a user needs what holds today."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO

README_LIMIT = 12_000  # bytes: the first page a user reads, with details in docs/
DEV = REPO / "docs" / "dev"

# An issue reference: "#35", "verl#3050", "issue 27", "issues 26 and 27". A heading's anchor ("(#4-bit-...)") or an
# HTML entity ("&#8594;") is not one.
ISSUE = re.compile(r"\b[Ii]ssues? #?\d+\b|(?<![&(])(?:\b[\w-]+)?#\d+(?![\w-])")
# A commit hash: 7 to 40 hex digits holding both a digit and a letter, so plain numbers and words are not hashes.
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
# A dated re-check outside a transcript: an ISO date in the prose or a table (a program's output may show a date).
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def user_docs() -> list[Path]:
    return sorted((REPO / "docs").glob("*.md"))


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of a page's text outside its fenced blocks (transcripts and code)."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def lab_notes(path: Path) -> list[str]:
    """Each issue number and commit hash of a page, and each date in its prose, as 'page:line: match'."""
    text = path.read_text()
    found = [(m, ISSUE) for m in ISSUE.finditer(text)] + [(m, COMMIT) for m in COMMIT.finditer(text)]
    notes = [f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}" for m, _ in found]
    notes += [f"{path.name}:{number}: {m.group()}" for number, line in prose_lines(text) for m in DATE.finditer(line)]
    return sorted(notes)


def test_the_readme_is_short():
    """Counted in bytes, as `wc -c` counts (the box-drawing characters of a transcript are 3 each). Shown to fail
    on the README of before docs/cli.md (33,079 bytes)."""
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md has {size} bytes, more than {README_LIMIT} bytes: move details to docs/"


def test_user_docs_hold_no_issue_numbers_commit_hashes_or_dates():
    """Shown to fail on the docs of before docs/dev/ (119 lab notes), and with `(issue #35)` put back into the README,
    `b178a3c` into docs/watch.md, `re-checked 2026-12-01` into docs/reliability.md."""
    notes = [note for page in [REPO / "README.md", *user_docs()] for note in lab_notes(page)]
    assert notes == [], "lab notes in user docs (they belong in docs/dev/):\n" + "\n".join(notes)


def test_the_patterns_find_lab_notes_and_spare_the_rest(tmp_path):
    """The patterns are checked on lines written here: a check whose pattern matches nothing would always pass."""
    def notes_in(text: str) -> list[str]:
        page = tmp_path / "page.md"
        page.write_text(text)
        return sorted(note.split(": ", 1)[1] for note in lab_notes(page))

    found = notes_in("a fix (issue #35), issue 27 and #12; verl#3050 wrote 0\nverl `b178a3c`, torch `d98e8a6`\n"
                     "re-checked 2026-12-01\n```\nstarted 2026-12-05 07:59:09 UTC\n```\n")
    assert found == sorted(["issue #35", "issue 27", "#12", "verl#3050", "b178a3c", "d98e8a6", "2026-12-01"])
    spared = notes_in("[4-bit](#4-bit-nvfp4-and-mxfp4), [it](quantize.md#4-bit-nvfp4) &#8594; 40185634 bytes, "
                      "0.9999856748116313, e4m3fn, deadbeef, facade, 1,137 units, a 64-digit sha256 "
                      "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855\n")
    assert spared == []


def test_the_maintainers_pages_exist():
    """The lab notes moved, not lost: the history pages and the house style are in docs/dev/."""
    for name in ("benchmarks-history.md", "history.md", "reliability-notes.md", "style.md"):
        assert (DEV / name).is_file(), name
