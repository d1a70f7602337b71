#!/usr/bin/env bash
# Stop the test cluster started by slurm/ci/setup.sh: the slurmd (one per node), slurmctld, then
# munged, each by the pid in its pid file; never by process name, so other SLURM or munge daemons on
# the machine are left alone. Safe to run when nothing is running. Logs stay under the state directory.
#
#   bash slurm/ci/teardown.sh [--keep-munge]
set -euo pipefail

STATE=${DISTMERGE_SLURM_DIR:-/tmp/distmerge-slurm}
keep_munge=0
[ "${1:-}" = "--keep-munge" ] && keep_munge=1

# pid_of NAME PIDFILE: print the pid if it is alive and still that program (pids get reused).
pid_of() {
  local pid
  [ -s "$2" ] || return 0
  pid=$(cat "$2")
  if kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ]; then
    echo "$pid"
  fi
}

# stop NAME:PIDFILE...: SIGTERM to all at once (each slurmd takes ~2 s to exit; in turn they add
# up), wait up to 10 s for all, then SIGKILL what is left.
stop() {
  local spec pid pids=() names=()
  for spec in "$@"; do
    pid=$(pid_of "${spec%%:*}" "${spec#*:}")
    [ -n "$pid" ] || continue
    kill "$pid" 2>/dev/null || true
    pids+=("$pid") names+=("${spec%%:*}")
  done
  local i
  for _ in $(seq 100); do
    local left=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [ "$left" -eq 0 ] && break
    sleep 0.1
  done
  for i in "${!pids[@]}"; do
    if kill -0 "${pids[$i]}" 2>/dev/null; then
      kill -9 "${pids[$i]}" 2>/dev/null || true
      echo "slurm-ci: killed ${names[$i]} (pid ${pids[$i]}) after 10 s"
    else
      echo "slurm-ci: stopped ${names[$i]} (pid ${pids[$i]})"
    fi
  done
}

specs=("slurmctld:$STATE/run/slurmctld.pid")
for pidfile in "$STATE"/run/slurmd*.pid; do
  [ -e "$pidfile" ] && specs+=("slurmd:$pidfile")
done
stop "${specs[@]}"
# munged last: slurm daemons that are still shutting down may yet authenticate a message.
if [ "$keep_munge" -eq 0 ]; then
  stop "munged:/run/munge/munged.pid"
fi
