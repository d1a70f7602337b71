"""The options are defined once (distmerge/options/): `--help`, the API's signatures, docs/api.md and docs/cli.md's
options table cannot drift from that table, nor from each other. Each option is in all of them, with one default."""

from __future__ import annotations

import argparse
import inspect
import re

import pytest

import distmerge
from distmerge import api, options
from distmerge.errors import InputError
from distmerge.option_kinds import Kind
from distmerge.options import Opt
from tests.conftest import REPO
from tests.helpers.options import REQUIRED, subparser
from tests.helpers.readme_options import TABLE_PAGE, documented, readme_rows


def spelled(default) -> str:
    """A default as docs/cli.md and --help spell it (600.0 is "600")."""
    return str(int(default)) if isinstance(default, float) and default.is_integer() else str(default)


@pytest.mark.parametrize("command", options.COMMANDS)
def test_help_is_the_table(command):
    """Every row is an option of the command's parser under its flags, with the row's default and choices, and
    its --help shows it; the parser has no option the table lacks."""
    parser = subparser(command)
    actions = {a.dest: a for a in parser._actions if not isinstance(a, argparse._HelpAction)}
    rows = options.cli_rows(command)
    assert sorted(actions) == sorted(r.name for r in rows)
    text = parser.format_help()
    parsed = vars(parser.parse_args(REQUIRED[command]))
    for row in rows:
        action = actions[row.name]
        assert tuple(action.option_strings or [action.dest]) == row.flags
        if not row.required:
            assert parsed[row.name] == options.parsed_default(row), row.name
        assert tuple(action.choices or ()) == tuple(row.choices or ())
        assert row.flags[0] in text


@pytest.mark.parametrize("command", options.API)
def test_the_api_takes_every_option_with_the_same_default(command):
    """distmerge.<command>'s signature is the table's: each option of the command line (but CLI_ONLY's, each with
    its reason) by keyword with the same default, the required ones positionally; and the values the API builds
    from no keywords are the ones the command line parses from no options."""
    func = getattr(api, command)
    params = inspect.signature(func).parameters
    cli = {r.name for r in options.cli_rows(command)}
    assert cli - set(params) == {r.name for r in options.rows(command) if not r.api}
    assert cli - set(params) <= set(options.CLI_ONLY)
    positional = [n for n, p in params.items() if p.kind is not p.KEYWORD_ONLY]
    assert positional == {"merge": ["input", "output"], "verify": ["merged", "reference"],
                          "watch": ["input", "output"]}[command]
    for row in options.api_rows(command):
        if not row.required:
            assert params[row.name].default == row.default, row.name
    from_api = options.from_keywords(command, {n: "x" if n in ("input", "merged") else "y" for n in positional})
    from_cli = options.from_namespace(subparser(command).parse_args(REQUIRED[command]), command)
    shared = set(from_api) & set(from_cli)
    assert {n: from_api[n] for n in shared} == {n: from_cli[n] for n in shared}
    if command == "merge":
        assert distmerge.merge is api.merge


def test_readme_states_each_default():
    """Each option with a default says it in its row of docs/cli.md ("default `5GB`", "(default 600)"). Shown to fail:
    with the --lora row's "default `auto`" taken out."""
    rows = readme_rows(TABLE_PAGE.read_text())
    unstated = []
    for command in options.COMMANDS:
        for row in options.cli_rows(command):
            if row.default in (None, False):
                continue
            said = documented(rows, command, row.flags[0])
            value = re.escape(spelled(row.default))
            if not any(re.search(rf"default:? `?{value}`?(?![\w.])", line) for line in said):
                unstated.append((command, row.flags[0], spelled(row.default)))
    assert unstated == []


def test_docs_api_shows_each_keyword_with_its_default():
    """docs/api.md's signatures list every keyword of both functions with the table's default."""
    text = (REPO / "docs" / "api.md").read_text()
    for command in options.API:
        block = text[text.index(f"distmerge.{command}("):]
        block = block[: block.index(")")]
        for row in options.api_rows(command):
            shown = row.name if row.required else f"{row.name}={row.default!r}"
            assert shown in block, (command, shown)


def test_every_option_reaches_the_request():
    """An option the table gains must land somewhere: a field of the request of its own name, or a name api.py
    uses otherwise. Shown to fail: a new row of no home raises at once."""
    api.merge_request(options.with_defaults("merge", input=REPO, output=REPO))
    api.verify_request(options.with_defaults("verify", merged=REPO, reference=REPO))
    with pytest.raises(AssertionError, match="reach no field"):
        api.merge_request(options.with_defaults("merge", input=REPO, output=REPO, nowhere=1))


def test_adding_an_option_is_one_row(monkeypatch):
    """A new row is at once an option of the parser, a keyword of the API's signature, checked and parsed, and a
    field of the request when one has its name (here verify's `reference_hf_config`, as a stand-in)."""
    extra = Opt(name="new_size", flags=("--new-size",), commands=("verify",), group="run", kind="size",
                default="1MiB", metavar="SIZE", help="a new option")
    monkeypatch.setattr(options, "OPTIONS", (*options.OPTIONS, extra))
    options.rows.cache_clear()
    try:
        assert subparser("verify").parse_args([*REQUIRED["verify"], "--new-size", "2KiB"]).new_size == 2048
        assert options.signature("verify", "VerifyResult").parameters["new_size"].default == "1MiB"
        assert options.from_keywords("verify", {"merged": "a", "reference": "b"})["new_size"] == 2**20
        with pytest.raises(InputError, match="new_size='lots'"):
            options.from_keywords("verify", {"merged": "a", "reference": "b", "new_size": "lots"})
    finally:
        options.rows.cache_clear()


def test_a_format_option_brings_its_reference_twin(monkeypatch):
    """verify reads a checkpoint --reference as --merged is read: each input row it takes (--format, --hf-config and
    every format option) has a --reference- twin made from it, so a format option added to the registry is at once
    --x of merge, inspect and verify, and verify's --reference-x, given to the reference's format under the format's
    own key. Shown to fail: with options.rows leaving the twins out."""
    from distmerge.formats import registry
    from distmerge.formats.base import FormatOption

    rows = {r.name: r for r in options.rows("verify")}
    twins = {name for name, r in rows.items() if r.group == "reference"}
    assert twins == {"reference_format", "reference_hf_config", *(f"reference_{o.dest}" for o, _ in registry.options())}
    assert rows["reference_format"].choices == rows["format"].choices and rows["reference_format"].default == "auto"
    new = FormatOption(flag="--shard-tag", dest="shard_tag", help="a new format option", metavar="T")
    found = registry.options()
    monkeypatch.setattr(registry, "options", lambda: [*found, (new, ["fsdp"])])
    options.rows.cache_clear()
    try:
        args = subparser("verify").parse_args([*REQUIRED["verify"], "--shard-tag", "a", "--reference-shard-tag", "b"])
        request = api.verify_request(options.from_namespace(args, "verify"))
        assert request.merged.format_options == {"shard_tag": "a"}
        assert request.reference.format_options == {"shard_tag": "b"}
        assert options.signature("verify", "VerifyResult").parameters["reference_shard_tag"].default is None
        merge_help = subparser("merge").format_help()
        assert "--shard-tag" in merge_help and "--reference-shard-tag" not in merge_help
    finally:
        options.rows.cache_clear()


RETURNS = {"merge": "MergeResult", "verify": "VerifyResult", "watch": "WatchResult"}


def unwritten(command: str) -> list[str]:
    """How api.<command>'s written signature differs from the one the table makes: each parameter missing, extra,
    or with another kind, default or annotation (the annotations as strings: api.py's are postponed)."""
    written = inspect.signature(getattr(api, command))
    table = options.signature(command, RETURNS[command])
    got, want = written.parameters, table.parameters
    diffs = [f"missing {n}" for n in want if n not in got] + [f"extra {n}" for n in got if n not in want]
    diffs += [f"{n}: {got[n]} != {want[n]}" for n in want if n in got and str(got[n]) != str(want[n])]
    if list(got) != list(want) and not diffs:
        diffs.append(f"order {list(got)} != {list(want)}")
    if written.return_annotation != table.return_annotation:
        diffs.append(f"returns {written.return_annotation}")
    return diffs


@pytest.mark.parametrize("command", options.API)
def test_the_api_functions_are_written_with_the_tables_keywords(command):
    """distmerge.<command> takes real keywords (no **kwargs, no patched __signature__) and they are exactly the
    table's: names, order, positional or keyword-only, default and annotation."""
    func = getattr(api, command)
    assert "__signature__" not in vars(func)
    assert not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(func).parameters.values())
    assert unwritten(command) == []


def test_an_option_added_to_the_table_and_not_to_the_api_is_named(monkeypatch):
    """A row added to OPTIONS and forgotten in api.py is caught by the check above, which names it; and a call
    cannot pass it either."""
    extra = Opt(name="new_size", flags=("--new-size",), commands=("merge",), group="run", kind=Kind.SIZE,
                default="1MiB", metavar="SIZE", help="a new option")
    monkeypatch.setattr(options, "OPTIONS", (*options.OPTIONS, extra))
    options.rows.cache_clear()
    try:
        assert unwritten("merge") == ["missing new_size"]
        assert unwritten("verify") == []
        with pytest.raises(TypeError, match="new_size"):
            api.merge("a", "b", new_size="2KiB")
    finally:
        options.rows.cache_clear()
