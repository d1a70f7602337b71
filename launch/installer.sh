# Sourced by setup.sh and setup_peer.sh: `install_into VENV PIP_ARGS...` installs packages into a venv with uv, which
# does on these 2-core machines in 24 s what pip does in 76 s (setup.sh's packages, bytecode compiled as pip does,
# measured on a clean clone, pip's and uv's caches empty). uv is pinned and installed by pip into the venv.
#
# torch must stay the CPU build: an unpinned torch, or one taken from PyPI, is a CUDA build of several GB. pip takes
# `torch==X` from the folders its config names in find-links (this machine keeps its CPU wheel there); uv reads no
# pip config, so it is given those folders. Where no CPU wheel of that torch lies there (another machine, a CUDA
# TORCH_SPEC for gpu_check.sh), pip installs torch first, as it always did, and uv keeps it: TORCH_SPEC is named in
# each uv call, so nothing it resolves can replace torch.
UV_SPEC=${UV_SPEC:-uv==0.13.9}

_pip_find_links() {  # the folders of pip's find-links setting, one per line
  "$1/bin/python" -m pip config list 2>/dev/null | sed -n "s/^.*find-links='\(.*\)'$/\1/p" | tr ' ' '\n' | sort -u
}

_cpu_wheel_on_disk() {  # VENV: is there a CPU wheel of TORCH_SPEC's release in pip's find-links folders?
  local release=${TORCH_SPEC#torch==} dir
  [ "$release" != "$TORCH_SPEC" ] || return 1  # not `torch==X`: let pip decide
  for dir in $(_pip_find_links "$1"); do
    compgen -G "$dir/torch-$release+cpu-*.whl" >/dev/null && return 0
  done
  return 1
}

# install_into VENV ARGS...: ARGS as `pip install` takes them, TORCH_SPEC added. Needs `quiet` from the caller.
install_into() {
  local venv=$1 links=() dir
  shift
  if [ ! -x "$venv/bin/uv" ]; then
    quiet "$venv/bin/python" -m pip install "$UV_SPEC"
  fi
  if _cpu_wheel_on_disk "$venv"; then
    for dir in $(_pip_find_links "$venv"); do links+=(--find-links "$dir"); done
  elif ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    quiet "$venv/bin/python" -m pip install "$TORCH_SPEC"
  fi
  # --compile-bytecode: as pip does, the .pyc files made at install. These machines set PYTHONDONTWRITEBYTECODE=1,
  # so no process would ever write them, and every one would compile what it imports: torch and transformers cost
  # 10.6 CPU-s a process instead of 4.3 (measured), which made the suite 40% slower.
  quiet "$venv/bin/uv" pip install --quiet --compile-bytecode --python "$venv/bin/python" "${links[@]}" "$TORCH_SPEC" "$@"
}
