#!/usr/bin/env bash
# torchrun wrapper for `distmerge merge` with sensible defaults, one node or many.
#
#   launch/merge.sh --input CKPT --output OUT [distmerge merge options]
#
# Run it once per node: directly on one machine, or under `srun --ntasks-per-node=1` for several
# nodes (slurm/merge.sbatch does that). Environment (all optional):
#   NPROC        processes on this node (default: number of GPUs, or 2 without GPUs)
#   NNODES       nodes taking part (default: the srun step's node count, SLURM_STEP_NUM_NODES, else 1)
#   MASTER_ADDR  rendezvous host for several nodes (default: first node of the srun step)
#   MASTER_PORT  rendezvous port (several nodes: default 15000 + SLURM_JOB_ID % 15000, else 29533;
#                one node: default a free port picked by torchrun --standalone)
#   PYTHON       interpreter with distmerge installed (default: .venv/bin/python if present, else python3)
#   DISTMERGE_COMMAND  the distmerge command to run (default merge; slurm/watch.sbatch: watch)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON=${PYTHON:-$([ -x "$here/.venv/bin/python" ] && echo "$here/.venv/bin/python" || echo python3)}
# The step's node count, not the job's (SLURM_NNODES): run without srun inside a multi-node
# allocation, this script starts one torchrun only, which must not wait for nodes that never come.
NNODES=${NNODES:-${SLURM_STEP_NUM_NODES:-1}}

if [ "$NNODES" -gt 1 ]; then
  if [ -z "${MASTER_ADDR:-}" ]; then
    nodelist=${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-}}
    [ -n "$nodelist" ] || { echo "launch/merge.sh: error: NNODES=$NNODES needs MASTER_ADDR (or run under srun)" >&2; exit 2; }
    # Every node computes the same first host, so all of them agree on the rendezvous endpoint.
    MASTER_ADDR=$(scontrol show hostnames "$nodelist" | head -n 1)
  fi
  # A port per job: two multi-node merges whose first node is the same machine must not collide.
  # 15000-29999 stays below Linux's ephemeral range (32768+), where the OS hands out client ports.
  if [ -n "${SLURM_JOB_ID:-}" ]; then
    MASTER_PORT=${MASTER_PORT:-$((15000 + SLURM_JOB_ID % 15000))}
  fi
  MASTER_PORT=${MASTER_PORT:-29533}
  # c10d rendezvous: the agent on MASTER_ADDR hosts the store, the others join it; the id keeps
  # agents of different steps of one job apart.
  rdzv=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
        --rdzv-id "${SLURM_JOB_ID:-distmerge}.${SLURM_STEP_ID:-0}")
elif [ -n "${MASTER_PORT:-}" ]; then
  rdzv=(--nnodes 1 --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "$MASTER_PORT")
else
  # One node: let torchrun pick a free port, so merges sharing a machine (or a test run) never
  # fight over a fixed one.
  rdzv=(--standalone --nnodes 1)
fi
if [ -z "${NPROC:-}" ]; then
  # Importing torch costs seconds on every node, so only ask for the GPU count when it is needed.
  gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  NPROC=$([ "$gpus" -gt 0 ] && echo "$gpus" || echo 2)
fi
# torchrun follows a failure with its own traceback and summary: repeat distmerge's error line last, so the
# end of the log (what a scheduler shows, what `tail -1` reads) says what went wrong.
log=$(mktemp "${TMPDIR:-/tmp}/distmerge-merge.XXXXXX")
trap 'rm -f "$log"' EXIT
set +e
{ "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" "${rdzv[@]}" -m distmerge "${DISTMERGE_COMMAND:-merge}" "$@" 2>&1 1>&3 3>&- |
    tee "$log" >&2 3>&-; } 3>&1
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  line=$(grep -E '^distmerge( merge| watch)?: error:' "$log" | tail -n 1 || true)
  if [ -n "$line" ]; then echo "$line" >&2; fi
fi
exit "$status"
