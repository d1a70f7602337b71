#!/usr/bin/env bash
# Create .venv-peer: llm-compressor 0.14, the peer that tests/test_quantize_fp4.py compares distmerge's 4-bit bytes with
# (its model_free_ptq runs in a subprocess: tests/bench/peer_model_free_ptq.py). A venv of its own, kept beside .venv
# and reused like it: llm-compressor 0.14 pins transformers <= 5.17 and compressed-tensors 0.19, which the main
# environment's newer transformers rules out. torch is the same pinned CPU wheel as setup.sh's (installer.sh names it
# in the same call as llm-compressor, so that the resolver keeps it). Idempotent: once made, a run only checks the
# versions. Making it takes about 17 s (uv, caches empty; it was 65 s with pip); a run that finds it made, under a
# second.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PEER_SPEC=${PEER_SPEC:-llmcompressor==0.14.0}
venv=.venv-peer
stamp="$venv/distmerge-peer.txt"
check() {  # the versions installed (cheap); the import itself is checked once, after installing
  "$venv/bin/python" -c 'from importlib.metadata import version as v
print("peer ok: llmcompressor %s, compressed-tensors %s, torch %s" % tuple(map(v, ["llmcompressor",
      "compressed-tensors", "torch"])))' 2>/dev/null
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$TORCH_SPEC $PEER_SPEC" ] && check; then
  exit 0
fi
rm -rf "$venv"
"$PYTHON" -m venv "$venv"
log=$venv/setup.log
quiet() { "$@" >"$log" 2>&1 || { cat "$log"; echo "peer setup failed: $*" >&2; exit 1; }; }
. launch/installer.sh  # install_into: uv, with torch kept the CPU build
install_into "$venv" "$PEER_SPEC"
quiet "$venv/bin/python" -c 'from llmcompressor import model_free_ptq'
echo "$TORCH_SPEC $PEER_SPEC" > "$stamp"
check
