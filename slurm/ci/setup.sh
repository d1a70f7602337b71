#!/usr/bin/env bash
# Bring up a real SLURM cluster on this one machine (munged, slurmctld, one or two slurmd), for tests.
#
#   sudo bash slurm/ci/setup.sh      # as root; idempotent; undo with slurm/ci/teardown.sh
#
# Debian's packages start nothing on install (no systemd in containers/VMs), so this script starts
# munged, slurmctld and slurmd itself, as daemons with pid files under the state directory.
# A second run reuses a healthy cluster with the same configuration, and otherwise restarts it.
#
# Environment (all optional):
#   DISTMERGE_SLURM_DIR   state, spool, pid files and logs (default /tmp/distmerge-slurm)
#   DISTMERGE_SLURM_NODES 1 (default) or 2: with 2, a second slurmd on this same machine serves a
#                         node named "localhost", so multi-node jobs (srun over 2 nodes, torchrun's
#                         c10d rendezvous between them) can be tested for real on one machine
#   SLURM_PARTITION       partition name (default debug)
#   SLURM_SETUP_TIMEOUT   seconds to wait for the nodes to become idle (default 60)
set -euo pipefail

STATE=${DISTMERGE_SLURM_DIR:-/tmp/distmerge-slurm}
NODES=${DISTMERGE_SLURM_NODES:-1}
PARTITION=${SLURM_PARTITION:-debug}
TIMEOUT=${SLURM_SETUP_TIMEOUT:-60}
# The Debian packages (and every client command) read this path unless SLURM_CONF says otherwise;
# writing it here means sbatch/sinfo/srun need no extra environment, inside jobs or out.
CONF=/etc/slurm/slurm.conf
MARK="# written by distmerge slurm/ci/setup.sh"

say() { echo "slurm-ci: $*"; }
die() { echo "slurm-ci: error: $*" >&2; exit 1; }

case "$NODES" in 1|2) ;; *) die "DISTMERGE_SLURM_NODES must be 1 or 2, not '$NODES'" ;; esac
[ "$(id -u)" -eq 0 ] || die "must run as root (it installs packages and starts daemons)"

# ---------------------------------------------------------------- packages
need_install=0
for bin in slurmctld slurmd sbatch munged; do
  command -v "$bin" >/dev/null 2>&1 || need_install=1
done
if [ "$need_install" -eq 1 ]; then
  command -v apt-get >/dev/null 2>&1 || die "slurm is not installed and apt-get is not available"
  say "installing slurmctld slurmd slurm-client munge with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  # Package lists may be missing or stale on a fresh image; one update before the install is enough.
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >"${TMPDIR:-/tmp}/slurm-ci-apt.log" 2>&1 \
    || { tail -n 30 "${TMPDIR:-/tmp}/slurm-ci-apt.log" >&2; die "apt-get install failed"; }
fi

mkdir -p "$STATE"/{log,run,state,spool}

# ---------------------------------------------------------------- munge
# slurmctld/slurmd authenticate every RPC with munge, so it must be up first.
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_ok; then
  if [ ! -s /etc/munge/munge.key ]; then
    say "creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null 2>&1; then
      mungekey --create --keyfile /etc/munge/munge.key
    else
      create-munge-key -f
    fi
  fi
  # munged refuses keys or directories that other users could read or write.
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  # /run is a tmpfs nobody prepared for us: no init system ran the package's tmpfiles rules.
  install -d -o munge -g munge -m 0755 /run/munge
  # A munged that is alive but not answering (or a stale one) is stopped before starting afresh.
  if [ -s /run/munge/munged.pid ] && kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; then
    kill "$(cat /run/munge/munged.pid)" || true
    sleep 1
  fi
  # --force: start even if a socket or pid file survives from an earlier run.
  runuser -u munge -- munged --force
  for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
  munge_ok || die "munged does not answer (see /var/log/munge/munged.log)"
  say "munged started (pid $(cat /run/munge/munged.pid))"
else
  say "munged already running"
fi

# ---------------------------------------------------------------- slurm.conf
host=$(hostname -s)
# slurmd -C prints this machine's real layout; slurmd refuses to serve a node line that claims more.
hw=$(slurmd -C | head -n 1)
case "$hw" in NodeName=*) ;; *) die "unexpected 'slurmd -C' output: $hw" ;; esac
hw=${hw#NodeName=* }  # keep CPUs=... RealMemory=...; the name is set below
# Node names double as host names: jobs turn them into addresses (scontrol show hostnames ->
# MASTER_ADDR), so the second node is called "localhost", which resolves everywhere. Each slurmd
# listens on its own port; both describe the same hardware, which slurm accepts (it only checks that
# a node has at least what it claims).
nodes_conf="NodeName=$host Port=6818 $hw State=UNKNOWN"
node_names=$host
if [ "$NODES" -eq 2 ]; then
  nodes_conf+=$'\n'"NodeName=localhost NodeAddr=127.0.0.1 Port=6819 $hw State=UNKNOWN"
  node_names+=",localhost"
fi
if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
  die "$CONF exists and was not written by this script; refusing to replace a real cluster's config"
fi
new_conf=$(cat <<CONFEOF
$MARK
# A test cluster on this one machine (one or two slurmd); see docs/slurm.md.
ClusterName=distmerge-ci
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/state
# %n: one spool, pid file and log per node name, since with 2 nodes both slurmd run here.
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
# No cgroup setup here (containers, VMs without systemd): track and launch tasks the plain way.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# No slurmdbd: no accounting (so no sacct either).
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Finished jobs are forgotten after 5 s. sbatch --wait lengthens its poll interval (2 s, then up to
# 32 s) only while it stays under MinJobAge/2: with the default 300, a short job is noticed ~30 s late.
MinJobAge=5
# Reject impossible requests at submission instead of leaving them pending forever.
EnforcePartLimits=ALL
# No mail on this machine; the default mailer may not exist.
MailProg=/bin/true
# Allocate cores, not whole nodes: small jobs can share the node, as on most real clusters.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
$nodes_conf
PartitionName=$PARTITION Nodes=$node_names Default=YES MaxTime=INFINITE State=UP
CONFEOF
)

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
# Prints the states of all nodes, one per line ("idle" when ready).
node_states() { sinfo -h -N -o '%t' 2>/dev/null; }
all_idle() {
  local states
  states=$(node_states) || return 1
  [ "$(grep -c . <<<"$states")" -eq "$NODES" ] && ! grep -qv '^idle$' <<<"$states"
}

up=1
[ -e "$CONF" ] && [ "$(cat "$CONF")" = "$new_conf" ] || up=0
alive "$STATE/run/slurmctld.pid" || up=0
for name in ${node_names//,/ }; do alive "$STATE/run/slurmd-$name.pid" || up=0; done
if [ "$up" -eq 1 ] && all_idle; then
  say "cluster already up and idle; reusing it"
  sinfo -N
  exit 0
fi

# Anything half-running (other config, a crashed daemon, a drained node) is stopped and restarted.
bash "$(dirname "$0")/teardown.sh" --keep-munge >/dev/null
mkdir -p "$(dirname "$CONF")"
printf '%s\n' "$new_conf" >"$CONF"
say "wrote $CONF ($NODES node(s): $node_names; $hw)"

# -c: start from empty state; a test cluster has no jobs worth recovering from a previous run.
slurmctld -c
for name in ${node_names//,/ }; do
  slurmd -N "$name"
done
say "started slurmctld and slurmd for $node_names"

deadline=$((SECONDS + TIMEOUT))
until all_idle; do
  # A node that registered as down (e.g. after an unclean stop) is returned to service.
  if node_states | grep -qE '^(down|drain|drng)'; then
    scontrol update NodeName="$node_names" State=RESUME >/dev/null 2>&1 || true
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    sinfo -N >&2 || true
    tail -n 20 "$STATE"/log/*.log >&2 || true
    die "nodes not idle after ${TIMEOUT}s"
  fi
  sleep 0.5
done
say "cluster up: $NODES node(s) idle in partition $PARTITION (logs in $STATE/log)"
sinfo -N
