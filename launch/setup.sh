#!/usr/bin/env bash
# Create .venv with everything distmerge and its tests need. Idempotent: a second run only checks.
# torch is pinned to the CPU wheel these machines carry; an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -c 'import torch, transformers, safetensors, distmerge; print(f"setup ok: torch {torch.__version__}, transformers {transformers.__version__}, distmerge {distmerge.__version__}")'
