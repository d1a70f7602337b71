"""Shared fixtures: real sharded checkpoints, made once per test session by real FSDP jobs."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from distmerge import catalog
from distmerge.front.cli import main as distmerge_main
from tests.helpers import gloo_pool
from tests.helpers.ports import free_port  # noqa: F401 - the tests' ports (helpers/ports.py)

# Tests call families.base.claim and families.transforms.apply directly, below the places that install the catalog.
catalog.install()

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def fsdp_ckpts(tmp_path_factory) -> dict[str, Path]:
    """{case: checkpoint folder}; each case's reference sits beside it as `{case}_reference/`."""
    from tests.fixtures.build import build_fsdp_fixtures

    return built_once("fsdp", build_fsdp_fixtures, tmp_path_factory)


@pytest.fixture(scope="session")
def dcp_ckpts(tmp_path_factory) -> dict[str, Path]:
    """Real dcp.save folders and HuggingFaceStorageWriter shards (tests/fixtures/make_dcp.py)."""
    from tests.fixtures.build import build_dcp_fixtures

    return built_once("dcp", build_dcp_fixtures, tmp_path_factory)


@pytest.fixture(scope="session")
def ds_ckpts(tmp_path_factory) -> dict[str, Path]:
    """Real DeepSpeed ZeRO saves by deepspeed.initialize and the HF Trainer (tests/fixtures/make_deepspeed.py)."""
    from tests.fixtures.deepspeed_cases import build_deepspeed_fixtures

    return built_once("deepspeed", build_deepspeed_fixtures, tmp_path_factory)


@pytest.fixture(scope="session")
def megatron_ckpts(tmp_path_factory) -> dict[str, Path]:
    """Real megatron-core saves (tests/fixtures/make_megatron.py); references beside them, as for FSDP."""
    from tests.fixtures.build import build_megatron_fixtures

    return built_once("megatron", build_megatron_fixtures, tmp_path_factory)


@pytest.fixture(scope="session")
def tt_ckpts(tmp_path_factory) -> dict[str, Path]:
    """Real torchtitan dumps saved by its own CheckpointManager (tests/fixtures/make_torchtitan.py); references
    beside them in `{case}_reference/`."""
    from tests.fixtures.make_torchtitan import build_torchtitan_fixtures

    return built_once("torchtitan", build_torchtitan_fixtures, tmp_path_factory)


@pytest.fixture(scope="session")
def critic_ckpts(tmp_path_factory) -> dict[str, Path]:
    """PPO critics (value models) as verl builds them, FSDP2 and megatron-core (tests/fixtures/make_critic.py)."""
    from tests.fixtures.make_critic import build_critic_fixtures

    return built_once("critic", build_critic_fixtures, tmp_path_factory)


@pytest.fixture(scope="session")
def lora_only_ckpts(tmp_path_factory) -> dict[str, Path]:
    """verl save_lora_only FSDP2 saves (LoRA A/B only) and their base model folder (fixtures/make_lora_only.py)."""
    from tests.fixtures.make_lora_only import build_lora_only_fixtures

    return built_once("lora_only", build_lora_only_fixtures, tmp_path_factory)


@pytest.fixture(scope="session")
def mla_ckpts(tmp_path_factory) -> dict[str, Path]:
    """Real megatron-core saves of a tiny DeepSeek-V3 (MLA + MoE, tests/fixtures/make_megatron_mla.py)."""
    from tests.fixtures.make_megatron_mla import build_mla_fixtures

    return built_once("mla", build_mla_fixtures, tmp_path_factory)


@pytest.fixture(scope="session")
def twin_ckpts(megatron_ckpts, tmp_path_factory) -> dict[str, Path]:
    """FSDP2 and DCP saves of the weights megatron_tp2pp2 (and every Megatron llama case) was made from
    (tests/fixtures/make_twins.py): one model saved under two strategies; references beside them."""
    from tests.fixtures.make_twins import build_twin_fixtures

    source = reference_dir(megatron_ckpts["megatron_tp2pp2"])
    return built_once("twins", lambda root: build_twin_fixtures(root, source), tmp_path_factory)


# The scripts each fixture family is made by: a change to any of them rebuilds that family's cached saves.
FIXTURE_SOURCES = {
    "fsdp": ("build.py", "make_fsdp.py", "make_lora.py"),
    "lora_only": ("build.py", "make_fsdp.py", "make_lora.py", "make_lora_only.py"),
    "dcp": ("build.py", "make_dcp.py", "make_fsdp.py"),
    "megatron": ("build.py", "make_megatron.py", "megatron_models.py", "megatron_moe.py"),
    "deepspeed": ("deepspeed_cases.py", "make_deepspeed.py", "make_fsdp.py"),
    "torchtitan": ("make_torchtitan.py", "torchtitan_cases.py", "torchtitan_deepseek.py"),
    "vl": ("make_vl.py", "make_fsdp.py"),
    "mla": ("build.py", "make_megatron_mla.py", "make_fsdp.py", "make_megatron.py", "megatron_models.py",
            "megatron_moe.py"),
    "twins": ("make_twins.py", "build.py", "make_megatron.py", "megatron_models.py", "megatron_moe.py"),
    "critic": ("build.py", "make_critic.py", "make_fsdp.py", "make_megatron.py", "megatron_models.py",
               "megatron_moe.py"),
    "many_ranks": ("many_ranks.py", "../bench/make_dcp_scale.py", "../bench/bench_scale.py",
                   "../bench/make_megatron_dist_scale.py", "make_megatron.py", "megatron_models.py", "megatron_moe.py"),
}


def built_once(name: str, build, tmp_path_factory) -> dict[str, Path]:
    """Build a fixture family in a fresh temp folder, or, when DISTMERGE_FIXTURE_CACHE names a folder, once per
    version of the scripts that make it and then reuse it: across the suite's two test processes (launch/test.sh
    sets it: one builds, the other waits on the lock), and across runs. Tests copy a fixture before damaging it, so
    the cached saves stay as the jobs wrote them."""
    cache = os.environ.get("DISTMERGE_FIXTURE_CACHE")
    if not cache:
        return build(tmp_path_factory.mktemp(name))
    digest = hashlib.sha256()
    for source in FIXTURE_SOURCES[name]:
        digest.update(source.encode() + (REPO / "tests" / "fixtures" / source).read_bytes())
    root = Path(cache) / f"{name}-{digest.hexdigest()[:12]}"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several pytest runs at once: one builds, the others wait
        listing = root / ".cases.json"
        if listing.exists():
            return {case: root / rel for case, rel in json.loads(listing.read_text()).items()}
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        cases = build(root)
        listing.write_text(json.dumps({case: str(path.relative_to(root)) for case, path in cases.items()}))
        return cases


@pytest.fixture(scope="session")
def many_rank_ckpts(tmp_path_factory) -> dict[str, Path]:
    """Many-rank saves of dcp, torchtitan and megatron-dist by the bench's makers (tests/fixtures/many_ranks.py)."""
    from tests.fixtures.many_ranks import build_many_rank_fixtures

    return built_once("many_ranks", build_many_rank_fixtures, tmp_path_factory)


@pytest.fixture(scope="session")
def vl_ckpts(tmp_path_factory) -> dict[str, Path]:
    """A real FSDP2 save of a tiny Qwen2.5-VL (tests/fixtures/make_vl.py); save_pretrained's output beside it."""
    from tests.fixtures.make_vl import build_vl_fixtures

    return built_once("vl", build_vl_fixtures, tmp_path_factory)


# The fixture families each test process builds first when the suite runs in several (launch/test.sh: two), before
# its first test: the families the collected tests use, in shares of about equal build time (seconds of wall time,
# one process, forked workers: megatron 19, deepspeed 19, many_ranks 19, torchtitan 16, mla 13, fsdp 7, critic 6,
# dcp 2, lora_only 2, vl 1). Without it, whichever process asked first built every family while the other waited
# for the one it needed (fsdp, needed first by both, took its turn behind others).
BUILD_SHARES = (("fsdp_ckpts", "dcp_ckpts", "ds_ckpts", "tt_ckpts", "vl_ckpts", "lora_only_ckpts"),
                ("megatron_ckpts", "mla_ckpts", "critic_ckpts", "twin_ckpts", "many_rank_ckpts"))


def pytest_collection_modifyitems(config, items) -> None:
    config.stash[_USED] = {name for item in items for name in getattr(item, "fixturenames", ())}


_USED = pytest.StashKey[set]()


@pytest.fixture(scope="session", autouse=True)
def families_built_side_by_side(request) -> None:
    """In a test process of several (pytest-xdist, a shared DISTMERGE_FIXTURE_CACHE): its share of the families
    the session's tests use (BUILD_SHARES), built before its first test, while the other processes build theirs."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not os.environ.get("DISTMERGE_FIXTURE_CACHE"):
        return
    used = request.config.stash.get(_USED, set())
    order = [name for share in BUILD_SHARES for name in share]
    mine = order[int(worker[2:]) % count::count] if count != len(BUILD_SHARES) else BUILD_SHARES[int(worker[2:])]
    for name in mine:
        if name in used:
            # a family that fails to build fails its own tests (pytest keeps the error for them), not every test
            with contextlib.suppress(Exception):
                request.getfixturevalue(name)


def reference_dir(ckpt: Path) -> Path:
    return ckpt.parent / f"{ckpt.name}_reference"


def merge_inproc(*args: str) -> int:
    """One process, no torchrun: the same code path as `python -m distmerge`. Whether it succeeds or refuses,
    the input tree is exactly as before (tree_digest of --input and --hf-config: every format, every test)."""
    with input_untouched(*merge_inputs(args)):
        return distmerge_main(["merge", "--quiet", *map(str, args)])




def torchrun(nproc: int, *args: str, timeout: float = 240, launcher: tuple[str, ...] = (),
             env: dict[str, str] | None = None, real: bool = False) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m distmerge ...` on loopback; `launcher`: more torchrun options (e.g.
    --log-dir), `env`: more environment variables. Run by the session's N processes (tests/helpers/gloo_pool.py:
    the same ranks and gloo group, without starting torch N + 1 times) unless `real`, a launcher option or an
    environment is given, or the command fails (then real torchrun runs it again: its output is torchrun's).
    DISTMERGE_REAL_TORCHRUN=1 runs every job under real torchrun."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *launcher, "-m", "distmerge",
        *map(str, args),
    ]
    pooled = not (real or launcher or env or os.environ.get("DISTMERGE_REAL_TORCHRUN") == "1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    with input_untouched(*(merge_inputs(args) if args and args[0] == "merge" else [])):
        done = gloo_pool.pool(nproc, REPO).run(list(map(str, args)), {}, free_port()) if pooled else None
        return done or subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def load_merged(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(out / name, framework="pt") as f:
            for key in f.keys():
                assert index["weight_map"][key] == name
                tensors[key] = f.get_tensor(key)
    assert set(tensors) == set(index["weight_map"])
    return tensors


def load_reference(ckpt: Path) -> dict[str, torch.Tensor]:
    with safe_open(reference_dir(ckpt) / "model.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def expected_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """The reference state dict as a merged model should hold it: no tied head when the config ties."""
    ref = load_reference(ckpt)
    config = json.loads((ckpt / "huggingface" / "config.json").read_text())
    if config.get("tie_word_embeddings", True):
        ref.pop("lm_head.weight", None)
    return ref


def assert_exact(merged: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(merged) == sorted(expected), "keys differ"
    for key, ref in expected.items():
        assert merged[key].dtype == ref.dtype, key
        assert torch.equal(merged[key], ref), key


def tree_bytes(folder: Path) -> dict[str, bytes]:
    """The top-level files of an output folder, to compare two merges' outputs byte for byte."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def tree_digest(root: Path) -> dict[str, str]:
    """Everything under root, at any depth (`huggingface/`, Megatron's `iter_*/mp_rank_*/` and DCP's hidden
    `.metadata` included): relative path -> kind and content. Files by sha256 of their bytes, links by their
    target (never followed), folders by being there, anything else by its type; permission bits and mtime_ns
    too, since a chmod, a rewrite of the same bytes or a temporary file made and removed in a folder are all
    modifications. The root itself counts, so a link swapped in for the input folder shows."""
    if not os.path.lexists(root):
        return {}
    digest = {".": _entry_digest(root)}
    for folder, dirs, files in os.walk(root):  # does not descend into linked folders (followlinks=False)
        for name in sorted(dirs + files):
            path = Path(folder, name)
            digest[str(path.relative_to(root))] = _entry_digest(path)
    return digest


def _entry_digest(path: Path) -> str:
    st = path.lstat()
    mode = f"{stat.S_IMODE(st.st_mode):o} {st.st_mtime_ns}"
    if stat.S_ISLNK(st.st_mode):
        return f"link -> {os.readlink(path)}"
    if stat.S_ISDIR(st.st_mode):
        return f"dir {mode}"
    if stat.S_ISREG(st.st_mode):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return f"file {mode} {st.st_size} {h.hexdigest()}"
    return f"other {stat.S_IFMT(st.st_mode):o} {mode}"


@contextmanager
def input_untouched(*roots: Path):
    """Assert that nothing under each root changed across the block: every file, folder and link (tree_digest).
    The fixtures are a few MB each, so hashing before and after every merge costs milliseconds."""
    before = [tree_digest(r) for r in roots]
    yield
    for root, was in zip(roots, before, strict=True):
        now = tree_digest(root)
        changed = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
        assert not changed, f"the merge modified its input {root}: {changed[:10]}"


def merge_inputs(args) -> list[Path]:
    """The folders a merge command reads (--input, and --hf-config unless the output lies inside it)."""
    args = [str(a) for a in args]
    named = {flag: Path(args[i + 1]) for i, flag in enumerate(args[:-1]) if flag in ("--input", "--hf-config",
                                                                                    "--output")}
    out = named.get("--output")
    config = named.get("--hf-config")
    if config is not None and out is not None and out.resolve().is_relative_to(config.resolve()):
        config = None
    inputs = [Path(args[i + 1]) for i, flag in enumerate(args[:-1]) if flag in ("--input", "-i")]  # an average's
    return [*inputs, *([config] if config is not None else [])]


def assert_refused(ckpt: Path, out: Path, words: str, capsys, *args: str) -> None:
    """A merge of a bad input: exit 1, one error line that says `words`, no index, the input untouched (every
    file, folder and link under it: tree_digest)."""
    assert merge_inproc("--input", ckpt, "--output", out, *args) == 1  # which checks the input is untouched
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("distmerge: error: "), lines
    assert words in lines[0], lines[0]
    assert not (out / "model.safetensors.index.json").exists()


def assert_reference_logits(merged: Path, ckpt: Path) -> None:
    """from_pretrained(merged) gives the logits the original model gave in the saving job."""
    from transformers import AutoModelForCausalLM

    ref = torch.load(reference_dir(ckpt) / "logits.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits.float()
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5)


def merge_each(ckpts: dict[str, Path], cases: list[str], root: Path) -> dict[str, Path]:
    """Every case merged once by one process, into root/case (module fixtures reuse these); each input's whole
    tree is the same after its merge as before (merge_inproc checks)."""
    for case in cases:
        assert merge_inproc("--input", ckpts[case], "--output", root / case) == 0, case
    return {case: root / case for case in cases}


# Fixtures several test modules take, defined with their helpers (tests/helpers) and imported last, as those import
# this module's helpers; a module's own fixture of the same name (test_output_lock.py's s3, test_hostile_structures.py's
# outside) takes precedence there.
from tests.helpers.hostile_files import outside  # noqa: E402, F401
from tests.helpers.s3 import s3  # noqa: E402, F401
from tests.helpers.verl_cli import hub  # noqa: E402, F401
