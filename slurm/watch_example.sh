#!/usr/bin/env bash
# Example: submit a training job, a watcher that merges each checkpoint while it trains, and a last pass once it
# ends. Adapt it to your training script; see docs/watch.md.
#
#   slurm/watch_example.sh TRAIN_SBATCH RUN OUTPUT [distmerge watch options]
#
#   TRAIN_SBATCH  your training job script (submitted as is: its #SBATCH lines set its resources)
#   RUN           the folder it saves checkpoints in (verl's default_local_dir, Megatron's --save, the HF
#                 Trainer's output_dir, torchtitan's dump folder ...); it need not exist yet
#   OUTPUT        folder for the merged models: RUN/<step> is merged into OUTPUT/<step>
#
# The jobs:
#   watcher  starts once training has started (--dependency=after), merges each step its trainer finishes saving,
#            and runs until the last pass cancels it (give it a --time at least training's)
#   last     starts once training has ended, whatever its state (afterany): stops the watcher (SIGTERM: the step
#            it was merging keeps its finished files) and merges, with --once, what is left, resuming that step
#
# Environment (optional):
#   TRAIN_SBATCH_OPTS  extra sbatch options for the training job
#   WATCH_SBATCH_OPTS  extra sbatch options for both watch jobs (default: --nodes=1 --time=7-0)
#   DISTMERGE_NPROC, DISTMERGE_ARGS, PYTHON, ...  as documented in slurm/merge.sbatch
set -euo pipefail

if [ "$#" -lt 3 ]; then
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
train_script=$1 run=$2 out=$3
shift 3
here="$(cd "$(dirname "$0")" && pwd)"
run=$(realpath -m "$run")
out=$(realpath -m "$out")
read -r -a train_opts <<<"${TRAIN_SBATCH_OPTS:-}"
read -r -a watch_opts <<<"${WATCH_SBATCH_OPTS:---nodes=1 --time=7-0}"

train_job=$(sbatch --parsable "${train_opts[@]}" "$train_script")
train_job=${train_job%%;*}

watch_job=$(DISTMERGE_INPUT=$run DISTMERGE_OUTPUT=$out \
  sbatch --parsable --dependency="after:$train_job" --job-name=distmerge-watch-"$train_job" \
    "${watch_opts[@]}" "$here/watch.sbatch" "$@")
watch_job=${watch_job%%;*}

last_job=$(DISTMERGE_INPUT=$run DISTMERGE_OUTPUT=$out DISTMERGE_STOP_JOB=$watch_job \
  sbatch --parsable --dependency="afterany:$train_job" --job-name=distmerge-last-"$train_job" \
    "${watch_opts[@]}" "$here/watch.sbatch" --once "$@")
last_job=${last_job%%;*}

echo "training job: $train_job"
echo "watcher job:  $watch_job (beside $train_job: merges $run/<step> -> $out/<step> as each is saved)"
echo "last pass:    $last_job (after $train_job ends: stops $watch_job, merges what is left)"
echo "watch with:   squeue -j $train_job,$watch_job,$last_job"
