"""The options table (docs/cli.md, linked from the README) lists every option of every command, for the commands that
have it, with its choices; and no option that does not exist. Read from the parsers themselves, so a new option
fails here until it is documented."""

from __future__ import annotations

import argparse
import re

from distmerge.front.cli import build_parser
from tests.helpers.readme_options import TABLE_PAGE, documented, readme_rows

TOP = "distmerge"  # the row's command for options of `distmerge` itself (--version)


def parser_options() -> dict[tuple[str, str], argparse.Action]:
    """(command, option string) -> its action, for every command and the top-level parser; -h left out."""
    top = build_parser()
    parsers = {TOP: top}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers.update(action.choices)
    found = {}
    for command, parser in parsers.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            for option in action.option_strings or [action.metavar or action.dest]:  # a positional: its name
                found[(command, option)] = action
    return found


def test_every_option_is_in_the_readme_table():
    """Shown to fail: with the `--lora-alpha` row taken out of the table, this listed (merge, --lora-alpha)
    and (inspect, --lora-alpha); with `inspect` taken out of the `--debug` row's commands, (inspect, --debug)."""
    rows = readme_rows(TABLE_PAGE.read_text())
    missing = [key for key in parser_options() if not documented(rows, *key)]
    assert missing == [], f"options missing from docs/cli.md's options table (option, commands): {missing}"


def test_every_choice_is_in_its_row():
    """Shown to fail: with `dcp-hf` taken out of the --format row, this listed it."""
    rows = readme_rows(TABLE_PAGE.read_text())
    absent = []
    for (command, option), action in parser_options().items():
        for choice in action.choices or ():
            if not any(re.search(rf"(?<![\w-]){re.escape(choice)}(?![\w-])", row)
                       for row in documented(rows, command, option)):
                absent.append((command, option, choice))
    assert absent == []


def test_the_table_lists_no_option_that_does_not_exist():
    """A row for a removed option, or one that names a command lacking it, misleads. Shown to fail: with
    `inspect` added to the --budget row's commands."""
    known = parser_options()
    wrong = [(command, name) for names, commands, _ in readme_rows(TABLE_PAGE.read_text())
             for name in names for command in commands if (command, name) not in known]
    assert wrong == []
