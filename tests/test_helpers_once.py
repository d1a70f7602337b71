"""The small helpers every part needs are written once, each in the lowest layer its users share: the natural sort
key (natural_order.py), union-find (disjoint_sets.py), the output/name join and the JSON record reader (output/)."""

from __future__ import annotations

import ast
from pathlib import Path

from distmerge.disjoint_sets import DisjointSets
from distmerge.natural_order import natural_key
from distmerge.output import beneath, read_json
from distmerge.output.local import LocalStore

PACKAGE = Path(__file__).resolve().parents[1] / "distmerge"
# A helper's names, and the one module allowed to define it. engine/plan.py's natural_key is the lead's to replace
# by an import of natural_order's (the file is being changed for multi-node work).
HELPERS = {"natural_key": "natural_order.py", "_natural": None, "root": "disjoint_sets.py",
           "_read_json": None, "_json": None}
PENDING: set[tuple[str, str]] = set()  # copies yet to go: none


def test_names_sort_as_a_person_reads_them():
    names = ["layers.10.w", "layers.2.w", "layers.2.b", "embed", "layers.1.experts.12.w3", "layers.1.experts.3.w1"]
    assert sorted(names, key=natural_key) == ["embed", "layers.1.experts.3.w1", "layers.1.experts.12.w3",
                                              "layers.2.b", "layers.2.w", "layers.10.w"]
    assert sorted(["a.1", "a.b", "proj10.x", "proj2.x"], key=natural_key) == ["a.1", "a.b", "proj2.x", "proj10.x"]


def test_disjoint_sets_group_in_the_order_first_seen():
    sets = DisjointSets(range(6))
    sets.join(4, 1)
    sets.join(5, 3)
    sets.join(3, 1)
    assert sets.groups() == [[0], [1, 3, 4, 5], [2]]
    assert sets.root(5) == sets.root(4) != sets.root(0)
    names: DisjointSets[str] = DisjointSets()
    names.join("k", "q")
    names.join("v", "k")
    names.root("o")
    assert names.groups() == [["k", "q", "v"], ["o"]]


def test_an_output_name_is_joined_to_a_folder_or_a_url(tmp_path):
    assert beneath("s3://bucket/run/", "global_step_2/actor") == "s3://bucket/run/global_step_2/actor"
    assert beneath(tmp_path, "global_step_2/actor") == tmp_path / "global_step_2" / "actor"


def test_a_json_record_is_an_object_or_none(tmp_path):
    (tmp_path / "a.json").write_text('{"x": 1}')
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "half.json").write_text('{"x": ')
    store = LocalStore(tmp_path)
    assert read_json(store, "a.json") == {"x": 1}
    assert [read_json(store, n) for n in ("list.json", "half.json", "missing.json")] == [None, None, None]


def test_each_helper_is_defined_once():
    """Shown to fail on the code before #44: four natural sort keys, three union-finds (a nested `root`), two JSON
    readers."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in HELPERS and HELPERS[node.name] != rel:
                found.add((rel, node.name))
    assert found - PENDING == set()
