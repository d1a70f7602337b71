#!/usr/bin/env bash
# Create .venv-peer: llm-compressor 0.14, the peer that tests/test_quantize_fp4.py compares distmerge's 4-bit bytes with
# (its model_free_ptq runs in a subprocess: tests/bench/peer_model_free_ptq.py). A venv of its own, kept beside .venv
# and reused like it: llm-compressor 0.14 pins transformers <= 5.17 and compressed-tensors 0.19, which the main
# environment's newer transformers rules out. torch is the same pinned CPU wheel as setup.sh's, named in the same pip
# call as llm-compressor so that its resolver keeps it. Idempotent: once made, a run only checks the versions.
# Making it took 2 min 20 s to 3 min on this project's 2-core VMs (shared with other jobs; pip's cache warm); a run
# that finds it made takes under a second.
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
quiet "$venv/bin/python" -m pip install --upgrade pip
quiet "$venv/bin/python" -m pip install "$TORCH_SPEC"
quiet "$venv/bin/python" -m pip install "$PEER_SPEC" "$TORCH_SPEC"
quiet "$venv/bin/python" -c 'from llmcompressor import model_free_ptq'
echo "$TORCH_SPEC $PEER_SPEC" > "$stamp"
check
