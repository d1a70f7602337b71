"""Plant each realistic bug of the catalog (catalog.py) in a temporary copy of the repository, run the tests that
should catch it there, and say which were caught. The working tree is never changed.

    python tests/mutations/run.py                 every mutation
    python tests/mutations/run.py --only NAME     those named (repeatable; a prefix picks all that start with it)
    python tests/mutations/run.py --list          the catalog, without running anything

A mutation is caught when its tests fail (pytest exits 1) with the bug planted. Before planting anything, the
tests of the mutations chosen run once on the unchanged copy and must pass: a test that fails anyway proves
nothing. The copy is made from the files git knows (tracked, and untracked but not ignored), so it holds exactly
what a clean clone plus your changes holds. Fixtures are built once for the whole run: DISTMERGE_FIXTURE_CACHE, or a
folder of the run's own. Exit status: 0 when every mutation chosen was caught, 1 otherwise (or when the unchanged
copy fails, or a mutation's snippet is no longer in its file: the catalog must follow the code).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from catalog import MUTATIONS, Mutation  # noqa: E402  (this folder is no package: the script runs from a path)

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    chosen = choose(args.only)
    if args.list:
        for m in chosen:
            print(f"{m.name:34} {m.guarantee:22} {m.file}")
        return 0
    with tempfile.TemporaryDirectory(prefix="distmerge-mutations-") as tmp:
        copy = copy_repo(Path(tmp) / "repo")
        env = test_env(copy, Path(tmp) / "fixtures")
        stale = [m.name for m in chosen if (copy / m.file).read_text().count(m.old) != 1]
        if stale:
            print(f"mutations: the snippet of {', '.join(stale)} is not once in its file: update catalog.py")
            return 1
        if not args.skip_baseline and not baseline(chosen, copy, env):
            return 1
        results = [(m, *plant_and_test(m, copy, env)) for m in chosen]
    return report(results)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="a mutation's name, or a prefix of names")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--skip-baseline", action="store_true",
                        help="do not run the tests on the unchanged copy first (when they were just seen passing)")
    return parser.parse_args(argv)


def choose(only: list[str]) -> list[Mutation]:
    if not only:
        return list(MUTATIONS)
    chosen = [m for m in MUTATIONS if any(m.name.startswith(o) for o in only)]
    if not chosen:
        sys.exit(f"mutations: no mutation named {', '.join(only)} (see --list)")
    return chosen


def copy_repo(dest: Path) -> Path:
    """The files git knows (tracked; untracked ones not ignored), copied under `dest`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def test_env(copy: Path, fixtures: Path) -> dict[str, str]:
    """The copy's code first on the path (of pytest and of every process it starts), fixtures built once."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH")]))}
    env.setdefault("DISTMERGE_FIXTURE_CACHE", str(fixtures))
    env.pop("PYTEST_ADDOPTS", None)
    return env


def pytest(tests: tuple[str, ...], copy: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    return subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)


def baseline(chosen: list[Mutation], copy: Path, env: dict[str, str]) -> bool:
    tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
    print(f"mutations: the {len(tests)} test(s) on the unchanged code first", flush=True)
    run = pytest(tests, copy, {**env, **{k: v for m in chosen for k, v in m.env.items()}})
    if run.returncode != 0:
        print(f"mutations: they fail without any bug planted (exit {run.returncode}):\n{tail(run)}")
    return run.returncode == 0


def plant_and_test(m: Mutation, copy: Path, env: dict[str, str]) -> tuple[str, float, str]:
    """(caught | missed | broken, seconds, the failing test's summary); the file is restored after."""
    path = copy / m.file
    original = path.read_text()
    path.write_text(original.replace(m.old, m.new))
    began = time.monotonic()
    try:
        run = pytest(m.tests, copy, {**env, **m.env})
    finally:
        path.write_text(original)
    took = time.monotonic() - began
    verdict = {0: "missed", 1: "caught"}.get(run.returncode, "broken")
    last = run.stdout.strip().splitlines()[-1:] or [""]
    if verdict == "missed" and " skipped" in last[0] and " passed" not in last[0]:
        verdict = "skipped"  # not run here (the SLURM tests need root): proves nothing either way
    failed = [line for line in run.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    said = [line for line in run.stdout.splitlines() if line.startswith("E ")]
    print(f"  {verdict:7} {m.name:34} {took:6.1f} s  {failed[0] if failed else ''}", flush=True)
    if said:
        print(f"          {said[0][:160]}", flush=True)
    return verdict, took, tail(run) if verdict == "broken" else ""


def tail(run: subprocess.CompletedProcess, lines: int = 25) -> str:
    return "\n".join((run.stdout + run.stderr).splitlines()[-lines:])


def report(results: list[tuple[Mutation, str, float, str]]) -> int:
    caught = sum(verdict == "caught" for _, verdict, _, _ in results)
    print(f"mutations: {caught} of {len(results)} caught")
    for m, verdict, _, why in results:
        if verdict != "caught":
            print(f"  {verdict}: {m.name} ({m.guarantee}): {m.why}\n{why}".rstrip())
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
