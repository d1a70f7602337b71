#!/usr/bin/env bash
# Run distmerge's tests under another torch:  bash launch/compat.sh VERSION [PYTEST ARGS...]
#
# Makes .venv-torch-VERSION in the repository root (once; a second run only checks) holding torch==VERSION and
# distmerge with its test extra, the torch pinned by a constraint so no dependency replaces it, then runs pytest
# there. By default on the tests that read torch's own pickles and saves:
#   tests/test_torch_versions.py tests/test_merge_fsdp.py tests/test_merge_dcp.py tests/test_verify.py
# PYTEST ARGS are passed on; when one of them names tests (a tests/ path, a .py file or a ::node id), it replaces
# that default list, e.g. `launch/compat.sh 2.11.0 tests/test_torch_versions.py -k dcp`.
# An unpinned torch from PyPI is a CUDA build of several GB; it imports and runs on the CPU as well.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: launch/compat.sh TORCH_VERSION [pytest args...]}
shift
PYTHON=${PYTHON:-python3}
venv=.venv-torch-$VERSION
if [ ! -x "$venv/bin/python" ]; then
  "$PYTHON" -m venv "$venv"
fi
log=$venv/setup.log
quiet() { "$@" >"$log" 2>&1 || { cat "$log"; echo "compat setup failed: $*" >&2; exit 1; }; }
pin=$venv/torch-pin.txt
echo "torch==$VERSION" >"$pin"
quiet "$venv/bin/python" -m pip install --upgrade pip
quiet "$venv/bin/python" -m pip install -c "$pin" "torch==$VERSION"
quiet "$venv/bin/python" -m pip install -c "$pin" -e '.[test]'
"$venv/bin/python" -c 'import torch, transformers, distmerge; print(f"compat: torch {torch.__version__}, transformers {transformers.__version__}")'
got=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
[ "$got" = "$VERSION" ] || { echo "compat: asked for torch $VERSION, $venv has $got" >&2; exit 1; }

# Fixture saves cached across runs (conftest's DISTMERGE_FIXTURE_CACHE) are keyed by the fixture scripts, not by
# torch: keep each version's own, so no run reads saves another torch made.
if [ -n "${DISTMERGE_FIXTURE_CACHE:-}" ]; then
  export DISTMERGE_FIXTURE_CACHE=$DISTMERGE_FIXTURE_CACHE/torch-$VERSION
fi

tests=(tests/test_torch_versions.py tests/test_merge_fsdp.py tests/test_merge_dcp.py tests/test_verify.py)
for arg in "$@"; do
  case $arg in
    tests/* | tests | *.py | *::*) tests=() ;;
  esac
done
exec "$venv/bin/python" -m pytest -q "${tests[@]}" "$@"
