#!/usr/bin/env bash
# Stop the cluster that start.sh started in DIR: cancel its jobs, then stop slurmd,
# slurmctld, slurmdbd, mariadbd and munged by the PIDs in DIR/run/NAME.pid, and
# only where that PID still runs NAME with DIR in its command line or environment
# (a recycled PID is never signalled). Configs, logs, state and the munge key are
# kept; delete DIR yourself for a clean slate.
#
#   usage: stop.sh [DIR]        DIR defaults to /tmp/expgpu-slurm
set -uo pipefail

DIR=$(realpath -m "${1:-/tmp/expgpu-slurm}")
export SLURM_CONF=$DIR/slurm.conf
log() { echo "slurm-local: $*" >&2; }
ours() { # ours NAME [PIDFILE]: print the pid in DIR/run/PIDFILE.pid if it is a live NAME of this DIR
  local pid
  pid=$(cat "$DIR/run/${2:-$1}.pid" 2>/dev/null) && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$1" ]] &&
    cat "/proc/$pid/cmdline" "/proc/$pid/environ" 2>/dev/null | tr '\0' '\n' | grep -qF -- "$DIR/" && echo "$pid"
}
stop_all() { # stop_all NAME:PIDFILE...: SIGTERM to each at once, up to 20 s for them all, then SIGKILL
  # (each daemon takes 1-2 s to exit: one after another, a cluster took ~9 s to stop)
  local spec pid pids=() names=()
  for spec in "$@"; do
    if pid=$(ours "${spec%%:*}" "${spec#*:}"); then
      log "stopping ${spec%%:*} (pid $pid)"
      kill -TERM "$pid" 2>/dev/null
      pids+=("$pid"); names+=("${spec%%:*}")
    fi
    rm -f "$DIR/run/${spec#*:}.pid"
  done
  for _ in $(seq 200); do
    local left=0
    for pid in "${pids[@]}"; do [[ -e /proc/$pid ]] && left=1; done
    ((left)) || return 0
    sleep 0.1
  done
  for i in "${!pids[@]}"; do
    if [[ -e /proc/${pids[$i]} ]]; then
      log "${names[$i]} (pid ${pids[$i]}) ignored SIGTERM, sending SIGKILL"; kill -KILL "${pids[$i]}" 2>/dev/null
    fi
  done
  sleep 0.2
}

# Job processes run under slurmstepd, which outlives slurmd: let slurm end them first.
if ours slurmctld >/dev/null && command -v squeue >/dev/null; then
  jobs=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
  if [[ -n ${jobs// /} ]]; then
    log "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null
    for _ in $(seq 150); do [[ -z $(squeue -h -t R,CG,S 2>/dev/null) ]] && break; sleep 0.2; done
  fi
fi

# The SLURM daemons together (one slurmd per node: slurmd.pid, or slurmd-NODE.pid in
# multiple-slurmd mode), while the database and munge they talk to on their way out still run.
daemons=()
for f in "$DIR"/run/slurmd.pid "$DIR"/run/slurmd-*.pid; do
  [[ -e $f ]] && daemons+=("slurmd:$(basename "$f" .pid)")
done
stop_all "${daemons[@]}" slurmctld:slurmctld slurmdbd:slurmdbd
stop_all mariadbd:mariadbd munged:munged
log "stopped ($DIR)"
