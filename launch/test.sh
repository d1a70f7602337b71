#!/usr/bin/env bash
# Set up .venv (see setup.sh) and run the whole test suite: CPU only, gloo, real torchrun jobs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
bash launch/setup_peer.sh  # .venv-peer: llm-compressor, the peer of the 4-bit tests (tests/test_quantize_fp4.py)
.venv/bin/ruff check distmerge tests  # lint first: a finding fails the run like a failed test
exec .venv/bin/python -m pytest -q "$@"
