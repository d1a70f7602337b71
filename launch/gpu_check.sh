#!/usr/bin/env bash
# distmerge's GPU path, checked against its CPU path in one command (docs/gpu.md):
#
#   bash launch/gpu_check.sh                 on a machine with CUDA: NCCL, --device cuda
#   bash launch/gpu_check.sh --dry-run       anywhere: the same steps with --device cpu and gloo, a small
#                                            checkpoint, no nvidia-smi (CI runs this: tests/test_gpu_check.py)
#   bash launch/gpu_check.sh --compare A B   only the comparison step, on two merged folders
#
# Steps: build the FSDP, DCP and Megatron test fixtures (tests/fixtures/build.py) and a benchmark checkpoint
# (tests/bench/make_ckpt.py: about 4 GB, 40 MB in a dry run), all on the CPU as CI makes them; then for each
# checkpoint merge it once with one CPU process (--device cpu, the reference path) and once under torchrun
# with N processes on the GPU path (--device cuda, NCCL; fixtures with --verify-against their trained
# weights, which runs `distmerge verify` on the GPU in the same processes), compare the two outputs byte
# for byte, and run `distmerge verify --device cuda` of the big GPU output against the CPU one, and of the big
# checkpoint itself (merged in memory on the GPU, nothing written) against the CPU output. Prints each
# step's time and nvidia-smi (before, and GPU memory at its peak). Also the API inside a running job (step 2b):
# distmerge.merge / verify on the job's own NCCL group with a gloo side group, compared with the CPU merge.
# --quantize cases (FP8, and 4-bit nvfp4 / mxfp4) check that the quantized bytes are the same on the GPU as on the CPU;
# when vLLM is installed, the benchmark checkpoint merged with --quantize (each layout) is loaded by vLLM
# (launch/vllm_fp8.py).
# Exit 0 when everything is identical and passes, 1 on any difference or failed step, 2 when it cannot run
# (no CUDA, bad arguments).
#
# N = the number of GPUs, but at least 2 even on one GPU: recent NCCL refuses two ranks on one device,
# and then the check says so and goes on with 1 process.
#
# Options and environment (all optional):
#   --dry-run, DISTMERGE_GPU_CHECK_DRY_RUN=1   the CPU rehearsal described above
#   --fixtures KIND=DIR     reuse fixtures tests/fixtures/build.py already wrote for KIND (fsdp, dcp, megatron)
#   --work DIR              work folder (default: a fresh /tmp/distmerge-gpu-check.XXXXXX, removed at the end
#                           when everything passed); GPU_CHECK_SIZE: benchmark bytes (4GB, dry run 40MB)
#   --keep                  keep the work folder
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
START=$SECONDS
LIMIT_S=480  # the budget this check is sized for on one H200 machine (16 cores)

say() { printf '%s\n' "$*"; }
die() { say "gpu_check: error: $*" >&2; exit 2; }

# -- the comparison step: byte for byte, every file including the hidden completion records -------------
compare_folders() {  # LABEL GPU_OUT CPU_OUT: one line (plus one per difference); status 1 when they differ
  local label=$1 a=$2 b=$3 problems="" line
  for d in "$a" "$b"; do
    [ -f "$d/model.safetensors.index.json" ] || problems+="    $d: no model.safetensors.index.json (not a finished merge)"$'\n'
  done
  if [ -z "$problems" ]; then
    while IFS= read -r line; do
      case "$line" in
        "Files "*" differ")  # name where the first byte differs
          line=${line#Files }; line=${line% differ}
          problems+="    $(cmp "${line%% and *}" "${line#* and }" 2>&1 | head -n 1 || true)"$'\n' ;;
        *) problems+="    $line"$'\n' ;;
      esac
    done < <(diff -rq "$a" "$b" 2>&1 || true)
  fi
  if [ "$(realpath -m "$a")" = "$(realpath -m "$b")" ]; then problems="    both sides are the same folder"$'\n'; fi
  local files bytes
  files=$(find "$a" -type f 2>/dev/null | wc -l)
  bytes=$(du -sb "$a" 2>/dev/null | cut -f1)
  if [ -z "$problems" ]; then
    say "compare  $label: IDENTICAL ($files files, ${bytes:-0} bytes)"
    return 0
  fi
  say "compare  $label: DIFFERENT"
  printf '%s' "$problems"
  return 1
}

DRY=${DISTMERGE_GPU_CHECK_DRY_RUN:-0}
WORK="" KEEP=0
declare -A GIVEN=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --compare) [ $# -eq 3 ] || die "--compare needs two folders"; compare_folders "$2 vs $3" "$2" "$3"; exit $? ;;
    --fixtures) [ $# -ge 2 ] && [[ "$2" == *=* ]] || die "--fixtures needs KIND=DIR"; GIVEN[${2%%=*}]=${2#*=}; shift ;;
    --work) [ $# -ge 2 ] || die "--work needs a folder"; WORK=$2; shift ;;
    --keep) KEEP=1 ;;
    -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done

if [ ! -x .venv/bin/python ]; then
  bash launch/setup.sh
fi
PY=.venv/bin/python
export PYTHONWARNINGS=ignore LOGLEVEL=${LOGLEVEL:-ERROR} TRANSFORMERS_VERBOSITY=error

if [ "$DRY" = 1 ]; then
  DEV=cpu BACKEND=gloo NPROC=2 SIZE=${GPU_CHECK_SIZE:-40000000} BENCH_WORLD=2 GPUS=0
  say "== gpu_check DRY RUN: the GPU steps with --device cpu and gloo, a $((SIZE / 1000000)) MB checkpoint"
else
  GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
  if [ "$GPUS" -eq 0 ]; then
    die "$("$PY" -c 'import torch; print(f"torch {torch.__version__}")') sees no CUDA device: run this on a GPU \
machine with a CUDA build of torch (TORCH_SPEC=... bash launch/setup.sh), or use --dry-run"
  fi
  DEV=cuda BACKEND=nccl NPROC=$((GPUS > 2 ? GPUS : 2)) SIZE=${GPU_CHECK_SIZE:-4000000000} BENCH_WORLD=8
  say "== gpu_check: $GPUS GPU(s), NCCL, $NPROC processes, a $((SIZE / 1000000)) MB checkpoint"
  nvidia-smi || true
fi

CREATED=0
if [ -z "$WORK" ]; then
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/distmerge-gpu-check.XXXXXX")
  CREATED=1
fi
mkdir -p "$WORK/logs" "$WORK/out"
say "work folder: $WORK"
SMI_PID=""
cleanup() {
  if [ -n "$SMI_PID" ]; then kill "$SMI_PID" 2>/dev/null || true; fi
  # Each build runs in a process group of its own (setsid): SIGTERM to the group reaches the builder and the
  # torchrun agents, and the agents stop their workers.
  for pid in ${BG_PIDS:-}; do kill -TERM -- "-$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM
if [ "$DRY" != 1 ] && command -v nvidia-smi >/dev/null; then  # GPU memory over the whole run, for its peak
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader,nounits -lms 250 \
    >"$WORK/logs/nvidia-smi.csv" 2>/dev/null &
  SMI_PID=$!
fi

FAILED=0
declare -a TIMES=()
show_failure() {  # NAME STATUS LOG
  say "FAILED   $1 (exit $2), last lines of $3:"
  tail -n 15 "$3" | sed 's/^/    /'
}
timed() {  # NAME LOG CMD...: run, record seconds; on failure print the log's tail (unless QUIET_FAILURE=1)
  local name=$1 log=$2 t0=$SECONDS status=0
  shift 2
  timeout -k 15 "${STEP_TIMEOUT:-300}" "$@" >"$log" 2>&1 || status=$?
  TIMES+=("$(printf '%-42s %5d s' "$name" $((SECONDS - t0)))")
  if [ "$status" -ne 0 ] && [ "${QUIET_FAILURE:-0}" != 1 ]; then show_failure "$name" "$status" "$log"; fi
  return "$status"
}
label() {  # NPROC: how the path under test ran (one process has no exchange, so no backend)
  if [ "$1" -eq 1 ]; then printf '%s x1' "$DEV"; else printf '%s/%s x%s' "$DEV" "$BACKEND" "$1"; fi
}

# -- 1. checkpoints, all built at once, on the CPU as CI builds them -------------------------------------
declare -A FIXDIR=() BUILD_PID=()
BG_PIDS=""
for kind in fsdp dcp megatron; do
  if [ -n "${GIVEN[$kind]:-}" ]; then
    FIXDIR[$kind]=${GIVEN[$kind]}
    continue
  fi
  FIXDIR[$kind]=$WORK/fixtures/$kind
  CUDA_VISIBLE_DEVICES="" setsid timeout -k 15 400 "$PY" -m tests.fixtures.build "${FIXDIR[$kind]}" "$kind" \
    >"$WORK/logs/build-$kind.log" 2>&1 &
  BUILD_PID[$kind]=$!
  BG_PIDS+=" $!"
done
BENCH=$WORK/bench/ckpt
CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 setsid timeout -k 15 400 "$PY" -m torch.distributed.run --standalone \
  --nproc-per-node "$BENCH_WORLD" tests/bench/make_ckpt.py --out "$BENCH" --size "$SIZE" \
  >"$WORK/logs/build-bench.log" 2>&1 &
BENCH_PID=$!
BG_PIDS+=" $!"
built() {  # KIND PID: wait for a background build (they all started at once)
  local t0=$SECONDS status=0
  wait "$2" || status=$?
  TIMES+=("$(printf '%-42s %5d s' "build $1 (ready at)" $((SECONDS - START)))")
  if [ "$status" -ne 0 ]; then
    say "FAILED   build $1 (exit $status), last lines of $WORK/logs/build-$1.log:"
    tail -n 20 "$WORK/logs/build-$1.log" | sed 's/^/    /'
    exit 1
  fi
  say "built    $1 $(tail -n 1 "$WORK/logs/build-$1.log") (waited $((SECONDS - t0)) s)"
}

# -- 2. merge each checkpoint on both paths, compare --------------------------------------------------------
# kind case [merge options]: what each case exercises on the GPU path is in docs/gpu.md.
if [ "$DRY" = 1 ]; then
  CASES=("fsdp fsdp2_llama_shard1_w4" "fsdp fsdp2_llama_shard1_w4 --quantize fp8-block" "dcp dcp_llama_wrapped_w4"
         "megatron megatron_tp2pp2")
else
  CASES=("fsdp fsdp2_llama_shard1_w4" "fsdp fsdp2_llama_bf16_w4" "fsdp fsdp2_llama_hsdp_2x2"
         "fsdp fsdp2_qwen2_tied_w4 --dtype bf16" "fsdp fsdp2_llama_lora_w2 --lora merge"
         "dcp dcp_llama_wrapped_w4" "dcp dcp_llama_hfwriter_w4"
         "megatron megatron_tp2pp2" "megatron megatron_moe_tp2ep2" "megatron megatron_dist_qwen3_tp2"
         "fsdp fsdp2_llama_bf16_w4 --quantize fp8-block" "megatron megatron_moe_tp2ep2 --quantize fp8-channel"
         "fsdp fsdp2_llama_bf16_w4 --quantize nvfp4" "megatron megatron_moe_tp2ep2 --quantize mxfp4")
fi

gpu_path() {  # NAME OUT NPROC ARGS...: torchrun on the path under test
  local name=$1 out=$2 n=$3
  shift 3
  rm -rf "$out"
  STEP_TIMEOUT=${STEP_TIMEOUT:-240} timed "$name $(label "$n")" "$WORK/logs/$name.gpu-path.log" \
    "$PY" -m torch.distributed.run --standalone \
    --nproc-per-node "$n" -m distmerge "$@" --device "$DEV" --timeout 120
}

check_case() {  # KIND CASE [OPTIONS...]
  local kind=$1 case=$2
  shift 2
  local ckpt=${FIXDIR[$kind]}/$case ref=${FIXDIR[$kind]}/${case}_reference
  local -a opts=("$@") against=()
  if [ "$kind" = megatron ]; then opts+=(--hf-config "$ref/huggingface"); fi
  # --lora merge is PEFT's fuse, not bit-equal to the saved merge_and_unload (1e-6): compared by bytes only.
  if [[ " ${opts[*]} " != *" --lora merge "* ]]; then against=(--verify-against "$ref/model.safetensors"); fi
  local name=$case  # a case merged with --quantize X is named CASE.X: its outputs sit beside the plain ones
  if [[ " ${opts[*]} " == *" --quantize "* ]]; then name="$case.$(sed 's/.* --quantize \([^ ]*\).*/\1/' <<<" ${opts[*]} ")"; fi
  local cpu_out=$WORK/out/$name.cpu-path gpu_out=$WORK/out/$name.gpu-path log=$WORK/logs/$name.gpu-path.log
  rm -rf "$cpu_out"
  timed "$name cpu x1" "$WORK/logs/$name.cpu-path.log" "$PY" -m distmerge merge -i "$ckpt" -o "$cpu_out" \
    --device cpu "${opts[@]}" || { FAILED=1; return; }
  # More processes than GPUs is a probe: recent NCCL refuses two ranks on one GPU, which ends the run with
  # distmerge's "NCCL could not start" line (or, should NCCL fail another way, some NCCL message).
  local probing=0 status=0
  if [ "$DEV" = cuda ] && [ "$NPROC" -gt "$GPUS" ]; then probing=1; fi
  QUIET_FAILURE=$probing gpu_path "$name" "$gpu_out" "$NPROC" merge -i "$ckpt" -o "$gpu_out" "${opts[@]}" \
    "${against[@]}" || status=$?
  if [ "$status" -ne 0 ] && [ "$probing" = 1 ] && grep -qi "nccl" "$log"; then
    say "note     NCCL refused $NPROC processes on $GPUS GPU(s): $(grep -i -m 1 'nccl' "$log" | cut -c1-300)"
    NPROC=$GPUS
    say "note     going on with $NPROC process(es): no NCCL exchange is checked (docs/gpu.md)"
    status=0
    gpu_path "$name" "$gpu_out" "$NPROC" merge -i "$ckpt" -o "$gpu_out" "${opts[@]}" "${against[@]}" || status=$?
  elif [ "$status" -ne 0 ] && [ "$probing" = 1 ]; then
    show_failure "$name $(label "$NPROC")" "$status" "$log"
  fi
  if [ "$status" -ne 0 ]; then FAILED=1; return; fi
  local summary verdict
  summary=$(grep -m 1 '^distmerge: ' "$log" | sed 's/ -> .*//' || true)
  verdict=$(grep -m 1 '^verify: ' "$log" || echo "verify: not run (bytes compared only)")
  say "merge    $case [${opts[*]}]: ${summary#distmerge: }; $verdict"
  compare_folders "$name ($(label "$NPROC") vs cpu x1)" "$gpu_out" "$cpu_out" || FAILED=1
}

for kind in fsdp dcp megatron; do
  if [ -n "${BUILD_PID[$kind]:-}" ]; then built "$kind" "${BUILD_PID[$kind]}"; fi
  for spec in "${CASES[@]}"; do
    read -r -a words <<<"$spec"
    if [ "${words[0]}" = "$kind" ]; then check_case "${words[@]}"; fi
  done
done

# -- 2b. the API inside a running job (tests/jobs/api_in_job.py, docs/api.md): the job starts its own group (NCCL on
# the GPUs, with distmerge's gloo side group for the small messages; gloo in a dry run), takes a training step,
# calls distmerge.merge and distmerge.verify twice (the second pair with device='cpu': the fragments then travel
# in the side group), and checks that the process is as it was (current GPU, allocated GPU memory, RNG, groups,
# signal handlers...) and that training goes on; both outputs are compared with the cpu x1 merge of the case.
in_job() {
  local case=fsdp2_llama_shard1_w4 out=$WORK/out/api_in_job
  local ckpt=${FIXDIR[fsdp]}/$case ref=$WORK/out/$case.cpu-path log=$WORK/logs/api_in_job.log
  if [ ! -f "$ref/model.safetensors.index.json" ]; then
    say "FAILED   in-job api: no cpu x1 merge of $case to compare with"
    FAILED=1
    return
  fi
  rm -rf "$out"
  if PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" STEP_TIMEOUT=${STEP_TIMEOUT:-240} \
       timed "in-job api $(label "$NPROC")" "$log" "$PY" -m torch.distributed.run --standalone \
       --nproc-per-node "$NPROC" tests/jobs/api_in_job.py "$ckpt" "$out" "$ref" "$BACKEND"; then
    say "in-job   $case on $(label "$NPROC"): $(grep -m 1 '^rank 0: ' "$log")"
    compare_folders "in-job $case ($(label "$NPROC") vs cpu x1)" "$out/first" "$ref" || FAILED=1
    compare_folders "in-job $case (side group vs cpu x1)" "$out/second" "$ref" || FAILED=1
  else
    FAILED=1
  fi
}
in_job

# -- 3. the benchmark checkpoint: both paths, bytes, then `distmerge verify` on the GPU --------------------
built bench "$BENCH_PID"
CPU_OUT=$WORK/out/bench.cpu-path GPU_OUT=$WORK/out/bench.gpu-path
rm -rf "$CPU_OUT"
if timed "bench cpu x1" "$WORK/logs/bench.cpu-path.log" "$PY" -m distmerge merge -i "$BENCH" -o "$CPU_OUT" \
     --device cpu --quiet &&
   gpu_path bench "$GPU_OUT" "$NPROC" merge -i "$BENCH" -o "$GPU_OUT"; then
  say "merge    bench: $(grep -m 1 '^distmerge: ' "$WORK/logs/bench.gpu-path.log" | sed 's/^distmerge: //; s/ -> .*//')"
  compare_folders "bench ($(label "$NPROC") vs cpu x1)" "$GPU_OUT" "$CPU_OUT" || FAILED=1
  if timed "bench verify $(label "$NPROC")" "$WORK/logs/bench.verify.log" "$PY" -m torch.distributed.run --standalone \
       --nproc-per-node "$NPROC" -m distmerge verify --merged "$GPU_OUT" \
       --reference "$CPU_OUT" --device "$DEV" --timeout 120 --json "$WORK/logs/bench.verify.json"; then
    say "verify   bench on $(label "$NPROC"): $(grep -m 1 '^verify: ' "$WORK/logs/bench.verify.log")"
  else
    FAILED=1
  fi
  # the checkpoint itself merged in memory on the GPU path (targets built and compared there), nothing written
  if timed "bench verify ckpt $(label "$NPROC")" "$WORK/logs/bench.verify-ckpt.log" "$PY" -m torch.distributed.run \
       --standalone --nproc-per-node "$NPROC" -m distmerge verify --merged "$BENCH" \
       --reference "$CPU_OUT" --device "$DEV" --timeout 120 --json "$WORK/logs/bench.verify-ckpt.json"; then
    say "verify   bench checkpoint in memory on $(label "$NPROC"): $(grep -m 1 '^verify: ' \
      "$WORK/logs/bench.verify-ckpt.log")"
  else
    FAILED=1
  fi
else
  FAILED=1
fi

# -- 3b. FP8 for serving: the benchmark checkpoint merged in bf16 with --quantize on the path under test, loaded
# by vLLM when it is installed (its FP8 kernels want dimensions in whole 128-blocks: the fixtures' are smaller)
if [ "$DRY" = 1 ]; then
  say "vllm     skipped in a dry run: vLLM serves FP8 on the GPU"
elif ! "$PY" -c 'import vllm' >/dev/null 2>&1; then
  say "vllm     not installed in $PY: the vLLM load of the FP8 outputs is skipped (pip install vllm to add it)"
else
  for spec in "fp8-block fp8" "fp8-channel compressed-tensors" "nvfp4 compressed-tensors" "mxfp4 compressed-tensors"; do
    read -r scheme method <<<"$spec"
    FP8_OUT=$WORK/out/bench.$scheme
    if gpu_path "bench.$scheme" "$FP8_OUT" "$NPROC" merge -i "$BENCH" -o "$FP8_OUT" --dtype bf16 --quantize "$scheme" &&
       timed "vllm load bench.$scheme" "$WORK/logs/bench.$scheme.vllm.log" "$PY" launch/vllm_fp8.py "$FP8_OUT" \
         "$method"; then
      say "vllm     bench.$scheme: $(grep -m 1 '^vllm loaded' "$WORK/logs/bench.$scheme.vllm.log" | sed 's/^vllm //')"
    else
      FAILED=1
    fi
  done
fi

# -- 4. timings, GPU memory, verdict ------------------------------------------------------------------------
say "== timings"
printf '  %s\n' "${TIMES[@]}"
if [ -n "$SMI_PID" ]; then
  kill "$SMI_PID" 2>/dev/null || true
  wait "$SMI_PID" 2>/dev/null || true
  SMI_PID=""
  say "== nvidia-smi: peak memory used per GPU during the check (MiB)"
  sort -t, -k1,1n -k2,2nr "$WORK/logs/nvidia-smi.csv" | awk -F', *' '!seen[$1]++ {print "  GPU " $1 ": " $2 " MiB"}'
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv || true
fi
TOTAL=$((SECONDS - START))
say "total    $TOTAL s (sized for ${LIMIT_S} s on one H200 machine)"
if [ "$DRY" != 1 ] && [ "$TOTAL" -gt "$LIMIT_S" ]; then say "note     over the ${LIMIT_S} s budget: see the timings above"; fi
if [ "$FAILED" -ne 0 ]; then
  say "gpu_check: FAIL (outputs and logs kept in $WORK)"
  exit 1
fi
say "gpu_check: PASS: $(label "$NPROC") byte-identical to cpu x1 on ${#CASES[@]} fixtures and the benchmark checkpoint"
if [ "$CREATED" = 1 ] && [ "$KEEP" = 0 ]; then
  rm -rf "$WORK"
fi
