#!/usr/bin/env bash
# Start a real single-node SLURM cluster on localhost (munged + slurmctld + slurmd,
# optionally MariaDB + slurmdbd for sacct). Idempotent: installs missing Debian
# packages, writes configs, starts only daemons that are not running, waits until
# the node is idle.
#
#   usage: start.sh [DIR]        DIR defaults to /tmp/expgpu-slurm
#   stdout: the partition name (one line); progress goes to stderr
#   then:   export SLURM_CONF=DIR/slurm.conf   (or: source DIR/env.sh)
#
# Knobs (env): SLURM_LOCAL_CPUS (8), SLURM_LOCAL_GPUS (4 fake GPUs; 0 = none),
#   SLURM_LOCAL_MEM_MB (detected), SLURM_LOCAL_PARTITION (debug),
#   SLURM_LOCAL_ACCOUNTING (0; 1 = MariaDB + slurmdbd so sacct works),
#   SLURM_LOCAL_PORT_BASE (6817: slurmctld, +1 slurmd, +2 slurmdbd, +3 MariaDB, +10+i slurmd of node i),
#   SLURM_LOCAL_NODES (1; 2 = two nodes on this machine, one slurmd each: SLURM's
#   multiple-slurmd mode), SLURM_LOCAL_NODE_NAMES (names that resolve to this machine;
#   default: `hostname -s`, then localhost)
set -euo pipefail

DIR=$(realpath -m "${1:-/tmp/expgpu-slurm}")
CPUS=${SLURM_LOCAL_CPUS:-8}
GPUS=${SLURM_LOCAL_GPUS:-4}
PART=${SLURM_LOCAL_PARTITION:-debug}
ACCT=${SLURM_LOCAL_ACCOUNTING:-0}
PORT=${SLURM_LOCAL_PORT_BASE:-6817}
CONF=$DIR/slurm.conf
SOCK=$DIR/munge/munge.socket
SQL=(mariadb --no-defaults -S "$DIR/mysql/mysqld.sock" -uroot)
log() { echo "slurm-local: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
alive() { # alive NAME [PIDFILE]: DIR/run/PIDFILE.pid holds a live NAME whose cmdline or environment names DIR
  local pid
  pid=$(cat "$DIR/run/${2:-$1}.pid" 2>/dev/null) && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$1" ]] &&
    cat "/proc/$pid/cmdline" "/proc/$pid/environ" 2>/dev/null | tr '\0' '\n' | grep -qF -- "$DIR/"
}
retry() { # retry TRIES CMD...: run CMD every 0.2 s until it succeeds
  local n=$1 i; shift
  for ((i = 0; i < n; i++)); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  return 1
}

[[ $(id -u) == 0 ]] || die "must run as root (apt-get, SlurmUser=root, mknod)"

# 1. packages -------------------------------------------------------------------
"$(dirname "$0")/install.sh" "$([[ $ACCT == 1 ]] && echo accounting)" || die "installing packages failed"

# 2. files ----------------------------------------------------------------------
mkdir -p "$DIR"/{munge,log,state,spool,run,dev}
chmod 755 "$DIR" "$DIR/munge"   # munged wants an o+x socket directory
[[ -s $DIR/munge/munge.key ]] || dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$DIR/munge/munge.key"

NODES=${SLURM_LOCAL_NODES:-1}
[[ $NODES =~ ^[1-9][0-9]*$ ]] || die "SLURM_LOCAL_NODES='$NODES' is not a node count >= 1"
# Jobs use node names as host names (MASTER_ADDR is the first one), so every name must
# resolve to this machine: the short host name and localhost do everywhere.
read -r -a NAMES <<< "${SLURM_LOCAL_NODE_NAMES:-$(hostname -s) localhost}"
((${#NAMES[@]} >= NODES)) || die "SLURM_LOCAL_NODES=$NODES needs $NODES names that resolve to this machine in SLURM_LOCAL_NODE_NAMES (have: ${NAMES[*]})"
NAMES=("${NAMES[@]:0:NODES}")
for n in "${NAMES[@]}"; do getent hosts "$n" >/dev/null || die "node name '$n' does not resolve (getent hosts $n)"; done
NODE=${NAMES[0]}
ALL=$(IFS=,; echo "${NAMES[*]}")
MEM=${SLURM_LOCAL_MEM_MB:-$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')}
MEM=${MEM:-4000}

# Fake GPUs: slurm drops file-less gpu GRES (node goes INVAL) and only sets
# CUDA_VISIBLE_DEVICES when File= names character devices, so make some.
NODE_GRES="" GRES=""
if ((GPUS > 0)); then
  for ((i = 0; i < GPUS; i++)); do
    f=$DIR/dev/nvidia$i
    [[ -c $f ]] || { rm -f "$f"; mknod "$f" c 195 "$i" || { log "mknod failed: plain file, no CUDA_VISIBLE_DEVICES"; touch "$f"; }; }
  done
  NODE_GRES="Gres=gpu:$GPUS"
  # every node may name the same device files: nothing opens them (TaskPlugin=task/none)
  GRES="NodeName=$ALL Name=gpu File=$DIR/dev/nvidia[0-$((GPUS - 1))]"
fi
if ((NODES == 1)); then
  SLURMD_FILES="SlurmdPidFile=$DIR/run/slurmd.pid
SlurmdLogFile=$DIR/log/slurmd.log
SlurmdSpoolDir=$DIR/spool"
  NODE_LINES="NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM $NODE_GRES State=UNKNOWN"
else   # multiple-slurmd mode: one slurmd per node on its own port; %n is the node name
  SLURMD_FILES="SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmdSpoolDir=$DIR/spool/%n"
  NODE_LINES=""
  for ((i = 0; i < NODES; i++)); do
    NODE_LINES+="NodeName=${NAMES[i]} NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=$((PORT + 10 + i)) CPUs=$CPUS RealMemory=$MEM $NODE_GRES State=UNKNOWN
"
  done
fi
ACCT_CONF="AccountingStorageType=accounting_storage/none"
if [[ $ACCT == 1 ]]; then
  ACCT_CONF="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 2))
AccountingStorageTRES=gres/gpu
# slurmctld/sacct talk to slurmdbd through the munge socket named here, not AuthInfo's
AccountingStoragePass=$SOCK"
fi

cat > "$CONF.new" <<EOF
# written by scripts/slurm-local/start.sh
ClusterName=local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
# own munged socket; cred_expire is also the delay before a requeued job may restart (default 120 s)
AuthInfo=socket=$SOCK,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
$SLURMD_FILES
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
$ACCT_CONF
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# trust the CPUs/RealMemory below even where they exceed the hardware
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=10
GresTypes=gpu
$NODE_LINES
PartitionName=$PART Nodes=$ALL Default=YES MaxTime=INFINITE State=UP
EOF
echo "$GRES" > "$CONF.gres.new"
if alive slurmctld && ! { cmp -s "$CONF.new" "$CONF" && cmp -s "$CONF.gres.new" "$DIR/gres.conf"; }; then
  log "WARNING: the running cluster uses other settings; keeping them (stop.sh first to apply new ones)"
  rm -f "$CONF.new" "$CONF.gres.new"
  PART=$(sed -n 's/^PartitionName=\([^ ]*\).*/\1/p' "$CONF")
  if grep -q '^AccountingStorageType=accounting_storage/slurmdbd' "$CONF"; then ACCT=1; else ACCT=0; fi
else
  mv "$CONF.new" "$CONF"; mv "$CONF.gres.new" "$DIR/gres.conf"
fi
echo "export SLURM_CONF=$CONF" > "$DIR/env.sh"
export SLURM_CONF=$CONF

# 3. daemons (each writes its own pid file under DIR/run; stop.sh uses them) ---
if ! alive munged; then
  log "starting munged"
  munged --socket="$SOCK" --key-file="$DIR/munge/munge.key" --pid-file="$DIR/run/munged.pid" \
         --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
fi
retry 50 bash -c "munge -n -S '$SOCK' | unmunge -S '$SOCK'" || die "munged not answering ($DIR/log/munged.log)"

if [[ $ACCT == 1 ]]; then
  if ! alive mariadbd; then
    if [[ ! -d $DIR/mysql/data/mysql ]]; then
      log "initialising MariaDB in $DIR/mysql"
      mkdir -p "$DIR/mysql"
      mariadb-install-db --no-defaults --datadir="$DIR/mysql/data" --user=root \
        --auth-root-authentication-method=socket --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 ||
        die "mariadb-install-db failed ($DIR/log/mariadb-install.log)"
    fi
    log "starting mariadbd"
    setsid -f mariadbd --no-defaults --datadir="$DIR/mysql/data" --user=root --socket="$DIR/mysql/mysqld.sock" \
      --pid-file="$DIR/run/mariadbd.pid" --bind-address=127.0.0.1 --port=$((PORT + 3)) --skip-log-bin \
      --innodb-buffer-pool-size=64M --log-error="$DIR/log/mariadbd.log" </dev/null >/dev/null 2>&1
  fi
  retry 150 "${SQL[@]}" -e 'select 1' || die "mariadbd not answering ($DIR/log/mariadbd.log)"
  "${SQL[@]}" -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
                  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
  cat > "$DIR/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$SOCK
DbdHost=$NODE
DbdAddr=127.0.0.1
DbdPort=$((PORT + 2))
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((PORT + 3))
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$DIR/slurmdbd.conf"
  if ! alive slurmdbd; then log "starting slurmdbd"; slurmdbd; fi   # reads DIR/slurmdbd.conf via SLURM_CONF
  retry 100 sacctmgr -n list cluster || die "slurmdbd not answering ($DIR/log/slurmdbd.log)"
  sacctmgr -n -P list cluster format=cluster | grep -qx local || sacctmgr -i add cluster local >/dev/null
fi

if ! alive slurmctld; then
  log "starting slurmctld"
  slurmctld -f "$CONF" || die "slurmctld failed ($DIR/log/slurmctld.log)"
fi
retry 50 scontrol ping || die "slurmctld not answering ($DIR/log/slurmctld.log)"

for n in "${NAMES[@]}"; do
  if ((NODES == 1)); then pidname=slurmd; else pidname=slurmd-$n; fi
  if ! alive slurmd "$pidname"; then
    log "starting slurmd for node $n"
    slurmd -f "$CONF" -N "$n" || die "slurmd failed ($DIR/log/$pidname.log)"
  fi
done

# 4. wait until the node is idle (an exact "idle": "idle*" means not responding) --
up() { [[ $1 == idle || $1 == mix || $1 == alloc ]]; }
for n in "${NAMES[@]}"; do
  state=""
  for _ in $(seq 120); do
    state=$(sinfo -h -n "$n" -o %t 2>/dev/null || true)
    up "$state" && break
    case $state in
      drain*|drng|down*|inval) scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  up "$state" || die "node $n is '$state' ($DIR/log/slurmd*.log, $DIR/log/slurmctld.log)"
done
log "ready: $NODES node(s) $ALL, $CPUS CPUs, $MEM MB, $GPUS fake GPUs each, accounting=$ACCT; export SLURM_CONF=$CONF"
echo "$PART"
