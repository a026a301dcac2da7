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
stop_one() { # stop_one NAME [PIDFILE]: SIGTERM, up to 20 s, then SIGKILL
  local pid
  if pid=$(ours "$1" "${2:-$1}"); then
    log "stopping $1 (pid $pid)"
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 200); do [[ -e /proc/$pid ]] || break; sleep 0.1; done
    if [[ -e /proc/$pid ]]; then log "$1 (pid $pid) ignored SIGTERM, sending SIGKILL"; kill -KILL "$pid" 2>/dev/null; sleep 0.2; fi
  fi
  rm -f "$DIR/run/${2:-$1}.pid"
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

# one slurmd per node: slurmd.pid, or slurmd-NODE.pid in multiple-slurmd mode
for f in "$DIR"/run/slurmd.pid "$DIR"/run/slurmd-*.pid; do
  [[ -e $f ]] && stop_one slurmd "$(basename "$f" .pid)"
done
for name in slurmctld slurmdbd mariadbd munged; do stop_one "$name"; done
log "stopped ($DIR)"
