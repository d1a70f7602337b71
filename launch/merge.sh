#!/usr/bin/env bash
# torchrun wrapper for `distmerge merge` with sensible defaults, one node or many.
#
#   launch/merge.sh --input CKPT --output OUT [distmerge merge options]
#
# Environment (all optional):
#   NPROC        processes on this node (default: number of GPUs, or 2 without GPUs)
#   NNODES       nodes in the job (default 1; SLURM_NNODES when under srun)
#   MASTER_ADDR  rendezvous host (default 127.0.0.1; the first node of the SLURM job under srun)
#   MASTER_PORT  rendezvous port (default 29533)
#   PYTHON       interpreter with distmerge installed (default: .venv/bin/python if present, else python3)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON=${PYTHON:-$([ -x "$here/.venv/bin/python" ] && echo "$here/.venv/bin/python" || echo python3)}
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
NPROC=${NPROC:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 2)}
NNODES=${NNODES:-${SLURM_NNODES:-1}}
if [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29533}
if [ "$NNODES" -gt 1 ]; then
  rdzv=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${SLURM_JOB_ID:-distmerge}")
else
  rdzv=(--nnodes 1 --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
exec "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" "${rdzv[@]}" -m distmerge merge "$@"
