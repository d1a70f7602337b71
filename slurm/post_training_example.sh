#!/usr/bin/env bash
# Example: submit a training job, and the merge of its final checkpoint as a job that starts only
# if training succeeds. Adapt it to your training script; see docs/slurm.md.
#
#   slurm/post_training_example.sh TRAIN_SBATCH CHECKPOINT OUTPUT [distmerge merge options]
#
#   TRAIN_SBATCH  your training job script (submitted as is: its #SBATCH lines set its resources)
#   CHECKPOINT    the folder training leaves behind, e.g. ckpts/global_step_1000/actor (it need not
#                 exist yet: it is only read when the merge job starts)
#   OUTPUT        folder for the merged model
#
# Environment (optional):
#   TRAIN_SBATCH_OPTS  extra sbatch options for the training job, e.g. "--nodes=4 --gpus-per-node=8"
#   MERGE_SBATCH_OPTS  extra sbatch options for the merge job (default: --nodes=1 --exclusive)
#   DISTMERGE_NPROC, DISTMERGE_ARGS, PYTHON, ...  as documented in slurm/merge.sbatch
set -euo pipefail

if [ "$#" -lt 3 ]; then
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
train_script=$1 ckpt=$2 out=$3
shift 3
here="$(cd "$(dirname "$0")" && pwd)"
# Absolute paths: each job starts in the folder it was submitted from, which may not be this one
# for jobs you resubmit later.
ckpt=$(realpath -m "$ckpt")
out=$(realpath -m "$out")
read -r -a train_opts <<<"${TRAIN_SBATCH_OPTS:-}"
read -r -a merge_opts <<<"${MERGE_SBATCH_OPTS:---nodes=1 --exclusive}"

# --parsable prints just the job id (with ";cluster" on multi-cluster sites: keep the id).
train_job=$(sbatch --parsable "${train_opts[@]}" "$train_script")
train_job=${train_job%%;*}

# afterok: the merge starts only once training has ended with exit code 0.
# --kill-on-invalid-dep=yes: if training fails, the merge is cancelled at once instead of staying
# pending forever with Reason=DependencyNeverSatisfied.
# sbatch records the environment when it submits, so DISTMERGE_INPUT/OUTPUT are set here, now.
merge_job=$(DISTMERGE_INPUT=$ckpt DISTMERGE_OUTPUT=$out \
  sbatch --parsable --dependency="afterok:$train_job" --kill-on-invalid-dep=yes \
    --job-name=distmerge-after-"$train_job" "${merge_opts[@]}" "$here/merge.sbatch" "$@")
merge_job=${merge_job%%;*}

echo "training job: $train_job"
echo "merge job:    $merge_job (runs after $train_job succeeds; merges $ckpt -> $out)"
echo "watch with:   squeue -j $train_job,$merge_job"
