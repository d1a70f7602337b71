"""The CLI's subcommands' parsers and the options each must have (test_options_agree.py, test_output_options.py)."""

from __future__ import annotations

import argparse

from distmerge.front.cli import build_parser

REQUIRED = {"merge": ["--input", "x", "--output", "y"], "inspect": ["x"],
            "verify": ["--merged", "x", "--reference", "y"], "watch": ["--input", "x", "--output", "y"]}


def subparser(command: str) -> argparse.ArgumentParser:
    return next(a for a in build_parser()._actions if a.dest == "command").choices[command]
