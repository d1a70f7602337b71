"""The mutation catalog (tests/mutations/catalog.py) follows the code: each planted bug's snippet is in its file
exactly once, and each test said to catch it exists. A stale entry would make `tests/mutations/run.py` refuse to
run, and nothing else in the suite would notice."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _catalog():
    spec = importlib.util.spec_from_file_location("mutation_catalog", REPO / "tests" / "mutations" / "catalog.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.MUTATIONS


MUTATIONS = _catalog()


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_each_snippet_is_once_in_its_file(mutation):
    assert (REPO / mutation.file).read_text().count(mutation.old) == 1, f"{mutation.file}: {mutation.old!r}"
    assert mutation.new != mutation.old


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_each_catching_test_exists(mutation):
    for test in mutation.tests:
        path, _, name = test.partition("::")
        assert (REPO / path).is_file(), test
        if name:
            defined = {n.name for n in ast.walk(ast.parse((REPO / path).read_text()))
                       if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            assert name.split("[")[0] in defined, test


def test_names_are_unique():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names))
