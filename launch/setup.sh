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
log=.venv/setup.log
quiet() { "$@" >"$log" 2>&1 || { cat "$log"; echo "setup failed: $*" >&2; exit 1; }; }
. launch/installer.sh  # install_into: uv, with torch kept the CPU build
# '.[test,plot,quantize,s3]' includes matplotlib, which the tests of `verify --plot` need (the 'plot' extra, optional for
# users), compressed-tensors, which `--quantize fp8-channel`, `nvfp4` and `mxfp4` need and their tests read the output
# back with (the 'quantize' extra), and moto's S3 server, which tests/test_s3.py starts on 127.0.0.1 for the
# object-store tests (boto3: the 's3' extra).
# The DeepSpeed fixtures save real ZeRO checkpoints with DeepSpeed's engine and the HF Trainer (without its
# shared-memory comm kernel: nothing is compiled, tests/fixtures/deepspeed_cases.py); tyro and tensorboard are
# torchtitan's.
install_into .venv -e '.[test,plot,quantize,s3]' "${DEEPSPEED_SPEC:-deepspeed==0.19.8}" tyro tensorboard
# The Megatron test fixtures save real checkpoints with megatron-core, the torchtitan ones with torchtitan's own
# CheckpointManager; --no-deps keeps the pinned torch (megatron-core's import needs only numpy and packaging, which
# the line above brought; triton and datasets, imported by torchtitan modules the fixtures never run, are stubbed in
# tests/fixtures/torchtitan_cases.py).
install_into .venv --no-deps "${MEGATRON_SPEC:-megatron-core==0.16.1}" "${TORCHTITAN_SPEC:-torchtitan==0.3.0}" \
  spmd_types==0.2.3 torchdata==0.11.0
.venv/bin/python -c 'import torch, transformers, safetensors, matplotlib, boto3, moto.server, distmerge; print(f"setup ok: torch {torch.__version__}, transformers {transformers.__version__}, distmerge {distmerge.__version__}")'
