"""`distmerge import` from and into object stores (`s3://bucket/prefix`), against the S3 test server (moto, started
by tests/helpers/s3.py; parts cut to 64 KiB so the tiny model's files are multipart uploads of several parts).

- A Hugging Face folder in a bucket imported into a bucket (and into a folder) gives, object for object, the bytes
  of the import of the same folder on disk; so does a checkpoint in a bucket (read by the merge engine).
- Two processes writing into a bucket write what one writes into a folder (each file sent by its owner alone:
  an object store takes each part from one writer).
- A failed upload leaves nothing that looks like an import: no tracker, no upload left open.
- Locations that cannot be read or written are one line and exit 1, with nothing written and never a local folder
  named `s3:` or `gs:` (the bug this file was written for: the locations were Paths, `s3://b/p` became `s3:/b/p`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from distmerge.errors import OutputError
from distmerge.output import s3 as object_store
from tests.conftest import input_untouched, torchrun
from tests.helpers.importing import folder_bytes, import_inproc, save_hf_model
from tests.helpers.s3 import PART
from tests.s3_server import download_tree, upload_tree

LAYOUT = ("--tp", "2", "--pp", "2")
TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def on_disk(s3, tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    """The tiny llama saved by transformers (also uploaded to s3://ckpt/hf-llama), and its import from disk to
    disk: the bytes every other route must give."""
    _, s3c = s3
    root = tmp_path_factory.mktemp("import-s3")
    hf = save_hf_model("llama", root / "hf")
    upload_tree(s3c, hf, "ckpt", "hf-llama")
    assert import_inproc("--input", hf, "--output", root / "disk", *LAYOUT) == 0
    return hf, folder_bytes(root / "disk")


def no_open_uploads(s3c) -> bool:
    return s3c.list_multipart_uploads(Bucket="models").get("Uploads") is None


@pytest.mark.parametrize("route", ["s3-s3", "s3-disk"])
def test_a_folder_in_a_bucket_imports_as_on_disk(s3, on_disk, route, tmp_path, monkeypatch):
    """Object for object the disk import's bytes, with several files of several parts each; nothing in the cwd."""
    _, s3c = s3
    _, want = on_disk
    monkeypatch.chdir(tmp_path)
    output = f"s3://models/{route}" if route == "s3-s3" else tmp_path / "out"
    assert import_inproc("--input", "s3://ckpt/hf-llama", "--output", output, *LAYOUT) == 0
    got = download_tree(s3c, "models", route) if route == "s3-s3" else folder_bytes(tmp_path / "out")
    assert sorted(got) == sorted(want)
    assert [n for n in got if got[n] != want[n]] == []
    assert max(len(b) for b in want.values()) > 2 * PART  # the largest file was sent in several parts
    assert no_open_uploads(s3c)
    assert [p.name for p in tmp_path.iterdir()] == ([] if route == "s3-s3" else ["out"])


def test_torchtitan_from_a_bucket_into_a_bucket_is_the_disk_import(s3, on_disk, tmp_path):
    """--to torchtitan: its own plan and last file (step-0/.metadata), through the same store."""
    _, s3c = s3
    hf, _ = on_disk
    assert import_inproc("--input", hf, "--output", tmp_path / "disk", "--to", "torchtitan") == 0
    assert import_inproc("--input", "s3://ckpt/hf-llama", "--output", "s3://models/titan", "--to", "torchtitan") == 0
    want = folder_bytes(tmp_path / "disk")
    assert "step-0/.metadata" in want
    assert download_tree(s3c, "models", "titan") == want


@pytest.mark.torchrun
def test_two_processes_write_into_a_bucket_what_one_writes_into_a_folder(s3, on_disk, tmp_path):
    _, s3c = s3
    hf, want = on_disk
    with input_untouched(hf):
        done = torchrun(2, "import", "--quiet", "--input", hf, "--output", "s3://models/n2", *LAYOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert download_tree(s3c, "models", "n2") == want
    assert no_open_uploads(s3c)


def test_a_checkpoint_in_a_bucket_imports_as_on_disk(s3, dcp_ckpts, tmp_path, capsys):
    """A training checkpoint (DCP, two ranks) in a bucket, read by the merge engine in one pass: the disk import's
    bytes. Into a bucket it is refused in one line before it is read (the engine hands its tensors out in its own
    order, an upload takes its parts in file order)."""
    _, s3c = s3
    ckpt = dcp_ckpts["dcp_llama_w2"]
    upload_tree(s3c, ckpt, "ckpt", "dcp-llama")
    assert import_inproc("--input", ckpt, "--output", tmp_path / "disk") == 0
    assert import_inproc("--input", "s3://ckpt/dcp-llama", "--output", tmp_path / "bucket") == 0
    assert folder_bytes(tmp_path / "bucket") == folder_bytes(tmp_path / "disk")
    capsys.readouterr()
    assert import_inproc("--input", "s3://ckpt/dcp-llama", "--output", "s3://models/from-dcp") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "writes a training checkpoint into a folder, not into s3://models/from-dcp" in err[0]
    assert download_tree(s3c, "models", "from-dcp") == {}


def test_a_failed_upload_leaves_nothing_that_looks_like_an_import(s3, on_disk, capsys, monkeypatch):
    """A part refused by the store: exit 1 in one line, no tracker, no upload left open; then --overwrite imports
    the same bytes over what is left."""
    _, s3c = s3
    _, want = on_disk
    real = object_store.ObjectStore.call
    sent = []

    def failing(self, what, name, method, **kwargs):
        if method == "upload_part":
            sent.append(name)
            if len(sent) == 3:
                raise OutputError(f"cannot write {self.loc.url(name)}: SlowDown (injected)")
        return real(self, what, name, method, **kwargs)

    monkeypatch.setattr(object_store.ObjectStore, "call", failing)
    assert import_inproc("--input", "s3://ckpt/hf-llama", "--output", "s3://models/failed", *LAYOUT) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SlowDown (injected)" in err[0], err
    left = download_tree(s3c, "models", "failed")
    assert TRACKER not in left and "release/.metadata" not in left, sorted(left)
    assert no_open_uploads(s3c)
    monkeypatch.setattr(object_store.ObjectStore, "call", real)
    assert import_inproc("--input", "s3://ckpt/hf-llama", "--output", "s3://models/failed", *LAYOUT,
                         "--overwrite") == 0
    assert {n: b for n, b in download_tree(s3c, "models", "failed").items() if n != ".distmerge.lock"} == want


@pytest.mark.parametrize(("where", "words"), [
    (("--input", "s3://ckpt/no-such-model"), "input s3://ckpt/no-such-model does not exist (no object under it)"),
    (("--output", "gs://models/m"), "output gs://models/m: distmerge reads and writes s3:// object stores and "
                                    "folders, not gs://"),
    (("--input", "gs://ckpt/hf-llama"), "input gs://ckpt/hf-llama: distmerge reads local folders and s3:// URLs"),
    (("--output", "s3://no-such-bucket/m"), "cannot reach the bucket of s3://no-such-bucket/m: it does not exist"),
    (("--output", "s3://ckpt/hf-llama/imported"), "output s3://ckpt/hf-llama/imported and input s3://ckpt/hf-llama "
                                                  "overlap: choose another prefix"),
    (("--hf-config", "s3://ckpt/hf-llama"), "--hf-config s3://ckpt/hf-llama: config.json's folder is read from "
                                            "this machine's disk"),
])
def test_a_location_that_cannot_be_used_is_one_line(s3, on_disk, tmp_path, capsys, monkeypatch, where,
                                                   words):
    """One line, exit 1, nothing written: no folder in the cwd (`s3:`, `gs:`), no object in the output bucket."""
    _, s3c = s3
    monkeypatch.chdir(tmp_path)
    given = {"--input": "s3://ckpt/hf-llama", "--output": "s3://models/refused", where[0]: where[1]}
    assert import_inproc(*[a for flag, value in given.items() for a in (flag, value)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert list(tmp_path.iterdir()) == []
    assert download_tree(s3c, "models", "refused") == download_tree(s3c, "ckpt", "hf-llama/imported") == {}
