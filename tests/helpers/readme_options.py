"""The options docs/cli.md's table documents (test_readme_options.py, test_options_agree.py)."""

from __future__ import annotations

import re
from pathlib import Path

TABLE_PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
HEADER = "| option | commands | meaning |"


def readme_rows(text: str) -> list[tuple[list[str], set[str], str]]:
    """The table's rows: (option strings and positional names of column 1, commands of column 2, whole row)."""
    lines = text.splitlines()
    start = lines.index(HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        names = [code.split()[0] for code in re.findall(r"`([^`]+)`", cells[0])]
        rows.append((names, {c.strip() for c in cells[1].split(",")}, line.replace("\\|", " ")))
    return rows


def documented(rows, command: str, option: str) -> list[str]:
    return [row for names, commands, row in rows if option in names and command in commands]
