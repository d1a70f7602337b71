#!/usr/bin/env bash
# The whole job on an embedded demo, on any machine (CPU is enough):
#   1. set up .venv
#   2. train-side: a real sharded checkpoint saved by 4 gloo ranks:
#        bash launch/demo.sh            FSDP2, a tiny Qwen2 (tied embeddings, vocab 1001), as verl saves it
#        bash launch/demo.sh megatron   Megatron-LM TP=2 x PP=2, a tiny Llama (GQA, vocab padded 1001 -> 1024),
#                                       saved by megatron-core as Megatron-LM's legacy checkpointing does
#   3. merge it under torchrun with 2 processes
#   4. verify: `distmerge verify` finds every tensor equal to the reference the saving job wrote, and the
#      merged model loads with from_pretrained and gives the original model's logits
set -euo pipefail
cd "$(dirname "$0")/.."
KIND=${1:-fsdp}
case "$KIND" in
  fsdp) SCRIPT=tests/fixtures/make_fsdp.py CASE=fsdp2_qwen2_tied_w4 WHAT="a sharded FSDP2 checkpoint" ;;
  megatron) SCRIPT=tests/fixtures/make_megatron.py CASE=megatron_tp2pp2 WHAT="a Megatron-LM TP=2 x PP=2 checkpoint" ;;
  *) echo "usage: bash launch/demo.sh [fsdp|megatron]" >&2; exit 2 ;;
esac
bash launch/setup.sh
DEMO_DIR=${DEMO_DIR:-$(mktemp -d /tmp/distmerge-demo.XXXXXX)}
PY=.venv/bin/python
REF="$DEMO_DIR/${CASE}_reference"
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
# Megatron-LM saves no Hugging Face config: the user names the model's (here: the one the weights came from).
EXTRA=()
[ "$KIND" = megatron ] && EXTRA=(--hf-config "$REF/huggingface")

echo "== 1/3 saving $WHAT with 4 ranks -> $DEMO_DIR/$CASE"
"$PY" -m torch.distributed.run --nproc-per-node 4 --nnodes 1 --master-addr 127.0.0.1 --master-port "$(port)" \
  "$SCRIPT" --out "$DEMO_DIR" --case "$CASE" 2>&1 | { grep -v '^W[0-9]' || true; }
ls -R "$DEMO_DIR/$CASE" | head -12

echo "== 2/3 merging with torchrun --nproc-per-node 2"
"$PY" -m torch.distributed.run --nproc-per-node 2 --nnodes 1 --master-addr 127.0.0.1 --master-port "$(port)" \
  -m distmerge merge --input "$DEMO_DIR/$CASE" --output "$DEMO_DIR/merged" "${EXTRA[@]}" 2>&1 | { grep -v '^W[0-9]' || true; }

echo "== 3/3 verifying: distmerge verify against the reference the saving job wrote, then the logits"
"$PY" -m torch.distributed.run --nproc-per-node 2 --nnodes 1 --master-addr 127.0.0.1 --master-port "$(port)" \
  -m distmerge verify --merged "$DEMO_DIR/merged" --reference "$REF/model.safetensors" 2>&1 | { grep -v '^W[0-9]' || true; }
"$PY" launch/demo_check.py "$DEMO_DIR/merged" "$REF"
echo "merged model: $DEMO_DIR/merged"
