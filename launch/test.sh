#!/usr/bin/env bash
# Set up .venv (see setup.sh) and run the whole test suite: CPU only, gloo, real torchrun jobs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
bash launch/setup_peer.sh  # .venv-peer: llm-compressor, the peer of the 4-bit tests (tests/test_quantize_fp4.py)
.venv/bin/ruff check distmerge tests  # lint first: a finding fails the run like a failed test
# The project's own .pyc files, made once: these machines set PYTHONDONTWRITEBYTECODE=1, so otherwise each of the
# suite's hundreds of processes compiles the distmerge modules it imports (up to 0.4 CPU-s each)
.venv/bin/python -m compileall -q distmerge tests >/dev/null
# Two test processes (pytest-xdist), a test file's tests in one of them (--dist loadfile: its module fixtures made
# once). The fixture families are built once for both, into .fixtures/ (keyed by the code that makes them, so a
# change rebuilds its family; DISTMERGE_FIXTURE_CACHE names another folder).
export DISTMERGE_FIXTURE_CACHE=${DISTMERGE_FIXTURE_CACHE:-$PWD/.fixtures}
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
