#!/usr/bin/env bash
# The whole job on an embedded demo, on any machine (CPU is enough):
#   1. set up .venv
#   2. train-side: a real FSDP2 checkpoint of a tiny Qwen2 (tied embeddings, vocab 1001) saved by
#      4 gloo ranks exactly as verl saves it
#   3. merge it under torchrun with 2 processes
#   4. verify: `distmerge verify` finds every tensor equal to the full state dict gathered in the saving
#      job, and the merged model loads with from_pretrained and gives the original model's logits
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
DEMO_DIR=${DEMO_DIR:-$(mktemp -d /tmp/distmerge-demo.XXXXXX)}
PY=.venv/bin/python
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore

echo "== 1/3 saving a sharded FSDP2 checkpoint with 4 ranks -> $DEMO_DIR/fsdp2_qwen2_tied_w4"
"$PY" -m torch.distributed.run --nproc-per-node 4 --nnodes 1 --master-addr 127.0.0.1 --master-port "$(port)" \
  tests/fixtures/make_fsdp.py --out "$DEMO_DIR" --case fsdp2_qwen2_tied_w4 2>&1 | grep -v '^W[0-9]' || true
ls "$DEMO_DIR/fsdp2_qwen2_tied_w4"

echo "== 2/3 merging with torchrun --nproc-per-node 2"
"$PY" -m torch.distributed.run --nproc-per-node 2 --nnodes 1 --master-addr 127.0.0.1 --master-port "$(port)" \
  -m distmerge merge --input "$DEMO_DIR/fsdp2_qwen2_tied_w4" --output "$DEMO_DIR/merged" 2>&1 | grep -v '^W[0-9]'

echo "== 3/3 verifying: distmerge verify against the state dict gathered in the saving job, then the logits"
"$PY" -m torch.distributed.run --nproc-per-node 2 --nnodes 1 --master-addr 127.0.0.1 --master-port "$(port)" \
  -m distmerge verify --merged "$DEMO_DIR/merged" \
  --reference "$DEMO_DIR/fsdp2_qwen2_tied_w4_reference/model.safetensors" 2>&1 | grep -v '^W[0-9]'
"$PY" launch/demo_check.py "$DEMO_DIR/merged" "$DEMO_DIR/fsdp2_qwen2_tied_w4_reference"
echo "merged model: $DEMO_DIR/merged"
