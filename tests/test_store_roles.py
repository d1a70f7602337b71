"""A Store handed to the API is checked whole: every method of every role (output/store.py), refused in one line
naming what it lacks before anything starts, never half-way through a merge when a role is first asked for."""

from __future__ import annotations

import pytest

import distmerge
from distmerge.errors import InputError, OutputError
from distmerge.output import open_store
from distmerge.output.local import LocalStore
from distmerge.output.store import ROLES, members, store_members
from tests.conftest import input_untouched, merge_inproc, tree_bytes

# The store's members by role, as store.py's call order uses them (written here, not read from the code).
BY_ROLE = {
    "PlaceChecks": {"check_place", "check", "prepare"},
    "Locking": {"lock"},
    "Writing": {"sharing", "host", "create", "join", "write_small", "put_stream", "remove"},
    "ResumeReads": {"read", "read_range", "size", "sha256", "list"},
}
EVERY = {"url"} | set().union(*BY_ROLE.values())


def plug_in(*leave_out: str) -> type:
    """A store class of its own (no LocalStore base to inherit from), with LocalStore's methods but `leave_out`."""
    body = {n: v for n, v in vars(LocalStore).items() if n not in leave_out and n not in ("__dict__", "__weakref__")}
    return type("FolderPlugIn", (), body)


def test_the_store_is_split_by_role_and_has_fifteen_methods():
    assert {role.__name__: set(members(role)) for role in ROLES} == BY_ROLE
    assert set(store_members()) == EVERY and len(store_members()) == len(EVERY) == 17  # 15 methods, url, sharing


def test_a_plug_in_missing_methods_is_refused_before_anything_starts(fsdp_ckpts, tmp_path):
    ckpt = fsdp_ckpts["fsdp2_llama_w2"]
    store = plug_in("join", "sha256")(tmp_path / "out")
    with input_untouched(ckpt), pytest.raises(InputError) as refused:
        distmerge.merge(ckpt, store)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("output=")
    assert "lacks join, sha256 (" in message
    assert not (tmp_path / "out").exists()  # no folder, no lock: refused before the merge began


@pytest.mark.parametrize("name", sorted(EVERY))
def test_each_member_of_each_role_is_required(name, tmp_path):
    """Whichever one member a plug-in lacks, the API names that one (a Store object is told from a path by any
    member it has, so it is checked, not taken for a folder name)."""
    store = plug_in(name)(tmp_path / "out")
    if name == "url":  # set by __init__: take it off the object
        del store.url
    with pytest.raises(InputError, match=rf"lacks {name} \("):
        distmerge.merge(tmp_path, store)
    with pytest.raises(OutputError, match=rf"lacks {name} \("):  # the engine's own door, for typed callers
        open_store(store)


def test_a_whole_plug_in_of_no_base_class_merges_as_the_folder(fsdp_ckpts, tmp_path):
    ckpt = fsdp_ckpts["fsdp2_llama_w2"]
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "cli") == 0
    distmerge.merge(ckpt, plug_in()(tmp_path / "api"))
    assert tree_bytes(tmp_path / "api") == tree_bytes(tmp_path / "cli")
