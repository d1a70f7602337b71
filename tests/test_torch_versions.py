"""Real FSDP1/FSDP2/HSDP/DCP saves written by other torch versions (tests/data/torch_versions/, made by its
make_saves.py; README.md there says how) merge with the torch installed here: every tensor equals the full state
dict the saving job gathered itself, and two torchrun processes write the same bytes as one."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_exact, load_merged, load_reference, merge_inproc, torchrun, tree_bytes
from tests.hostile_pickles import records_of, write_zip

DATA = Path(__file__).parent / "data" / "torch_versions"
VERSIONS = ("2.6.0", "2.8.0", "2.11.0", "2.13.0", "2.14.1")
CASES = ("fsdp2_w4", "hsdp_2x2", "fsdp1_mesh_w4", "fsdp1_nomesh_w4", "dcp_w4")
# "torch-2.6.0/fsdp2_w4": every save in the tree, references left out.
SAVES = sorted(
    f"{p.parent.name}/{p.name}" for p in DATA.glob("torch-*/*") if p.is_dir() and not p.name.endswith("_reference")
)
# The N=2 runs cost a torchrun each: every save of the torches verl and older stacks pin (2.6, 2.11), the
# mesh-heavy HSDP save and the DCP save of the others.
TORCHRUN_SAVES = [s for s in SAVES if s.startswith(("torch-2.6.0/", "torch-2.11.0/")) or s.endswith(("/hsdp_2x2",
                                                                                                        "/dcp_w4"))]


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("distmerge: error: ")]
    return (errors or lines or ["(no output)"])[-1]


@pytest.fixture(scope="module")
def merged_n1(tmp_path_factory):
    """merge(save, capsys) -> output folder of a one-process merge, made once per save (a failed merge fails
    every test that needs it, with the error line it printed)."""
    root = tmp_path_factory.mktemp("torch_versions")
    done: dict[str, Path | str] = {}

    def merge(save: str, capsys) -> Path:
        if save not in done:
            out = root / save.replace("/", "-")
            capsys.readouterr()
            code = merge_inproc("--input", DATA / save, "--output", out, "--max-shard-size", "4KB")
            err = capsys.readouterr().err
            done[save] = out if code == 0 else f"exit {code}: {one_line_error(err)}"
        result = done[save]
        if isinstance(result, str):
            pytest.fail(f"merge of {save} failed: {result}")
        return result

    return merge


def test_every_version_and_case_is_saved():
    """A missing or misnamed folder must fail here rather than parametrize to nothing. A case some torch cannot
    write would be left out of the tree and named in README.md; none is today."""
    readme = (DATA / "README.md").read_text()
    for version in VERSIONS:
        assert f"torch-{version}" in readme, version
        for case in CASES:
            save = DATA / f"torch-{version}" / case
            assert (save / "huggingface" / "config.json").is_file(), save
            assert (DATA / f"torch-{version}" / f"{case}_reference" / "model.safetensors").is_file(), save
    assert {re.sub(r"^torch-", "", p.name) for p in DATA.glob("torch-*")} == set(VERSIONS)


@pytest.mark.parametrize("save", SAVES)
def test_merged_equals_reference(save, merged_n1, capsys):
    out = merged_n1(save, capsys)
    # The model is untied, so the merged names are exactly the reference's (lm_head.weight included).
    assert_exact(load_merged(out), load_reference(DATA / save))


@pytest.mark.torchrun
@pytest.mark.parametrize("save", TORCHRUN_SAVES)
def test_torchrun_n2_is_byte_identical(save, merged_n1, capsys, tmp_path):
    one = merged_n1(save, capsys)
    run = torchrun(
        2, "merge", "--input", DATA / save, "--output", tmp_path / "n2", "--max-shard-size", "4KB", "--quiet"
    )
    assert run.returncode == 0, one_line_error(run.stderr)
    files = tree_bytes(one)
    assert len([n for n in files if n.endswith(".safetensors")]) > 1  # both ranks wrote files
    assert tree_bytes(tmp_path / "n2") == files


def swap_relabelled(folder: Path, a: int, b: int) -> None:
    """Exchange two rank files and rewrite the folder name torch.save put inside each archive (same length:
    offsets and CRCs stay valid), so neither name nor archive says which rank saved it."""
    pa, pb = (folder / f"model_world_size_4_rank_{r}.pt" for r in (a, b))
    da, db = pa.read_bytes(), pb.read_bytes()
    ta, tb = f"{pa.stem}/".encode(), f"{pb.stem}/".encode()
    pa.write_bytes(db.replace(tb, ta))
    pb.write_bytes(da.replace(ta, tb))


@pytest.mark.parametrize("version", ["2.6.0", "2.11.0", "2.13.0"])
def test_swapped_rank_files_are_refused_on_every_mesh_form(version, tmp_path, capsys):
    """Torch 2.6 and 2.8 pickle no `_rank` in the mesh: the saver's recorded coordinate on the mesh tensor tells
    instead (before, a relabelled swap of a 2.6 save merged a wrong model, exit 0); 2.11 and 2.13 record `_rank`."""
    ckpt = Path(shutil.copytree(DATA / f"torch-{version}" / "fsdp2_w4", tmp_path / "ckpt"))
    swap_relabelled(ckpt, 0, 1)
    capsys.readouterr()
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out") != 0
    line = one_line_error(capsys.readouterr().err)
    assert "saved by rank 1 (its device mesh says so), not by rank 0" in line, line
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_a_torch_class_of_an_unknown_release_is_named_with_the_known_range(tmp_path, capsys):
    """A rank file whose pickle names a torch.distributed class distmerge has no form for (as a future torch
    might) is one line naming the class and the releases distmerge reads, never an internal error."""
    ckpt = Path(shutil.copytree(DATA / "torch-2.13.0" / "fsdp2_w4", tmp_path / "ckpt"))
    target = ckpt / "model_world_size_4_rank_2.pt"
    records = records_of(target)
    at = next(i for i, r in enumerate(records) if r.name.endswith("data.pkl"))
    old, new = b"placement_types\nShard\n", b"placement_types\nShaxd\n"  # a class torch never had
    assert old in records[at].data
    records[at] = dataclasses.replace(records[at], data=records[at].data.replace(old, new))
    write_zip(target, records)
    capsys.readouterr()
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out") != 0
    line = one_line_error(capsys.readouterr().err)
    assert "torch.distributed.tensor.placement_types.Shaxd is not allowed" in line, line
    assert "torch 2.6 to 2.14" in line and "internal error" not in line, line


def test_merging_rank_files_imports_no_dtensor(tmp_path):
    """The rank files are read into records: torch.distributed.tensor (and sympy, ~0.35-0.8 s per process) is
    never imported on the merge path."""
    script = (
        "import sys\n"
        "from distmerge.front.cli import main\n"
        "code = main(['merge', '-i', sys.argv[1], '-o', sys.argv[2], '-q'])\n"
        "print(code, 'torch.distributed.tensor' in sys.modules, 'sympy' in sys.modules)\n"
    )
    args = [sys.executable, "-c", script, str(DATA / "torch-2.11.0" / "hsdp_2x2"), str(tmp_path / "out")]
    run = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["0", "False", "False"], run.stdout + run.stderr[-2000:]


def test_a_non_contiguous_local_tensor_is_read_through_its_strides(fsdp_ckpts, tmp_path, capsys):
    """torch.save keeps a view's strides: such a local tensor has no single byte run in the file and is read
    through a mapped view of its storage record (torch_save.mapped_views), equal to the contiguous original."""
    import torch
    import torch.distributed.tensor  # noqa: F401 - torch.load rebuilds DTensors only once it is imported

    ckpt = Path(shutil.copytree(fsdp_ckpts["fsdp2_llama_w1"], tmp_path / "ckpt"))
    rank_file = ckpt / "model_world_size_1_rank_0.pt"
    state = torch.load(rank_file, weights_only=True)
    value = state["model.layers.0.mlp.up_proj.weight"]
    value._local_tensor = value._local_tensor.t().contiguous().t()  # the same values, column-major
    assert not value._local_tensor.is_contiguous()
    torch.save(state, rank_file)
    assert merge_inproc("--input", ckpt, "--output", tmp_path / "out") == 0
    assert_exact(load_merged(tmp_path / "out"), load_reference(fsdp_ckpts["fsdp2_llama_w1"]))


def test_strided_views_map_a_file_and_read_an_object(tmp_path):
    """What torch_save.mapped_views does is asked of the opened file (source.InFile.map): a local file is mapped (no
    byte read until a view is used; performance as before the Source seam), a file that cannot be mapped (an
    object of an object store) has each view's bytes read. Shown to fail with LocalSource files mapping nothing
    (every view read whole) and with mapped_views mapping whatever the file says."""
    import torch

    from distmerge.formats.torch_private import torch_save
    from distmerge.input.local import LocalSource

    value = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # column-major: no single byte run
    torch.save({"w": value}, tmp_path / "a.pt")
    reads: list[int] = []

    class Counted(LocalSource):
        mappable = True

        def open(self, path):
            found = super().open(path)
            real_pread, mapped = found.pread, found.map() if self.mappable else None
            found.pread = lambda n, at: reads.append(n) or real_pread(n, at)
            found.map = lambda: mapped
            return found

    src = Counted(tmp_path)
    saved = torch_save.read(src, tmp_path / "a.pt")
    reads.clear()
    views = torch_save.mapped_views(src, tmp_path / "a.pt", saved.storage_offsets, {"w": saved.value["w"]})
    assert torch.equal(views["w"], value) and reads == []
    Counted.mappable = False
    views = torch_save.mapped_views(src, tmp_path / "a.pt", saved.storage_offsets, {"w": saved.value["w"]})
    assert torch.equal(views["w"], value) and reads == [48]
