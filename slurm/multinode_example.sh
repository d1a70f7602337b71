#!/usr/bin/env bash
# Example: merge a checkpoint that a training job left on its nodes' own disks (verl's rank files, DCP's
# __R_0.distcp, DeepSpeed's node-local saves: each node holds its ranks' files at the same path), on those same
# nodes, with no copy step. One torchrun per node through srun (slurm/merge.sbatch), rendezvous on the job's
# first node; each node reads its own files and what another node's processes need crosses the network.
# The output must be a folder every node sees (or a bucket): a node-local output is refused before anything is
# written. See docs/multinode.md.
#
#   slurm/multinode_example.sh TRAIN_JOB_ID CHECKPOINT OUTPUT [distmerge merge options]
#
#   TRAIN_JOB_ID  the finished training job: the merge runs on the nodes it ran on (sacct's NodeList)
#   CHECKPOINT    the checkpoint's path, the same on every node (e.g. /local/ckpts/global_step_1000/actor)
#   OUTPUT        folder for the merged model, on a shared file system
#
# Environment (optional): MERGE_SBATCH_OPTS (default --exclusive), DISTMERGE_NPROC, DISTMERGE_ARGS, PYTHON, ...
# as documented in slurm/merge.sbatch.
set -euo pipefail

if [ "$#" -lt 3 ]; then
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
train_job=$1 ckpt=$2 out=$3
shift 3
here="$(cd "$(dirname "$0")" && pwd)"
nodes=$(sacct -j "$train_job" -X -n -P -o NodeList | head -n 1)
[ -n "$nodes" ] && [ "$nodes" != "None assigned" ] || {
  echo "multinode_example.sh: error: sacct knows no nodes of job $train_job: is it the training job's id?" >&2
  exit 2
}
count=$(scontrol show hostnames "$nodes" | wc -l)
read -r -a merge_opts <<<"${MERGE_SBATCH_OPTS:---exclusive}"
echo "multinode_example.sh: merging $ckpt where job $train_job left it: $count node(s) ($nodes)"
exec sbatch --nodes="$count" --nodelist="$nodes" "${merge_opts[@]}" "$here/merge.sbatch" \
  --input "$ckpt" --output "$(realpath -m "$out")" "$@"
