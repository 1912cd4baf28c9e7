#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for the tests (the comments below say
# why each piece is the way it is).
#
#   tests/slurm_cluster.sh up   [DIR]   install if needed, start munged, slurmctld, slurmd n1/n2
#   tests/slurm_cluster.sh env  [DIR]   print `export SLURM_CONF=...` for the clients
#   tests/slurm_cluster.sh down [DIR]   stop what `up` started (by PID) and undo /etc/hosts
#   tests/slurm_cluster.sh status [DIR]
#
# Everything lives in DIR (default $SLURM_CLUSTER_DIR, else ${TMPDIR:-/tmp}/mingpt-ddp-slurm):
# slurm.conf, state, spool, logs, pid files, and a private munged with its own socket and
# key, so nothing under /etc/slurm or /run/munge is touched. The one system-wide change is
# two lines in /etc/hosts ("127.0.10.1 n1", "127.0.10.2 n2", tagged with DIR), removed by
# `down`. Clients need SLURM_CONF=DIR/slurm.conf (`eval "$(tests/slurm_cluster.sh env DIR)"`).
#
# The two "nodes" are two slurmd processes (Debian's slurmd is built with multiple-slurmd
# support), each in its own UTS namespace so that `hostname` inside a job step prints n1 / n2,
# each with its own loopback address. `up` is idempotent: a running cluster in DIR is reused.
# Ports are taken free at first bring-up (override: SLURM_CTLD_PORT, SLURM_N1_PORT,
# SLURM_N2_PORT); job ids start at a random FirstJobId so that two clusters on one machine
# derive different per-job rendezvous ports.
#
# Needs root (daemons, /etc/hosts, apt-get). Exit code 3 means "Slurm cannot be had here"
# (not root, or installing failed): callers skip instead of failing.
set -euo pipefail

cmd=${1:-}
DIR=${2:-${SLURM_CLUSTER_DIR:-${TMPDIR:-/tmp}/mingpt-ddp-slurm}}
NODES=(n1 n2)
declare -A ADDR=([n1]=127.0.10.1 [n2]=127.0.10.2)
TAG="# mingpt-ddp test slurm cluster $DIR"

say() { echo "slurm_cluster: $*" >&2; }
die() { say "$*"; exit "${2:-1}"; }

alive() {  # alive PIDFILE: the process named in PIDFILE runs (zombies count as stopped)
  local pid state
  [ -s "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
  [ "$state" != Z ]
}

free_port() {
  python3 - <<'EOF'
import socket
s = socket.socket()
s.bind(("", 0))
print(s.getsockname()[1])
EOF
}

port_busy() {
  python3 - "$1" <<'EOF'
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("", int(sys.argv[1])))
except OSError:
    sys.exit(0)
sys.exit(1)
EOF
}

install_packages() {
  local missing=()
  for bin in slurmctld slurmd srun sbatch scontrol munged unmunge; do
    command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
  done
  ((${#missing[@]} == 0)) && return 0
  [ "$(id -u)" = 0 ] || die "missing ${missing[*]} and not root: cannot install Slurm" 3
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install Slurm and munge" 3
  say "installing slurmctld slurmd slurm-client munge (missing: ${missing[*]})"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge; } >"${TMPDIR:-/tmp}/mingpt-slurm-apt.log" 2>&1 \
    || die "apt-get install failed (see ${TMPDIR:-/tmp}/mingpt-slurm-apt.log)" 3
}

hosts_add() {
  local node
  grep -qF "$TAG" /etc/hosts 2>/dev/null && return 0
  for node in "${NODES[@]}"; do
    printf '%s %s %s\n' "${ADDR[$node]}" "$node" "$TAG" >>/etc/hosts
  done
}

hosts_remove() {
  # Rewritten in place (not replaced): /etc/hosts may be a bind mount.
  grep -qF "$TAG" /etc/hosts 2>/dev/null || return 0
  local kept
  kept=$(grep -vF "$TAG" /etc/hosts || true)
  printf '%s\n' "$kept" >/etc/hosts
}

write_config() {
  [ -f "$DIR/slurm.conf" ] && return 0
  local ctld=${SLURM_CTLD_PORT:-$(free_port)} p1=${SLURM_N1_PORT:-$(free_port)} p2=${SLURM_N2_PORT:-$(free_port)}
  local first_job=$(( (RANDOM * 32768 + RANDOM) % 900000 + 1000 ))
  cat >"$DIR/slurm.conf" <<EOF
# Written by tests/slurm_cluster.sh: a two-node test cluster on one machine.
ClusterName=mingpt-ci
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$ctld
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A private munged; cred_expire also sets how long a requeued job waits to run again.
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=5
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# A requeued job starts as soon as it is eligible, not at the next 30-60 s scheduling pass.
SchedulerParameters=batch_sched_delay=0,sched_interval=1,bf_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=300
FirstJobId=$first_job
JobRequeue=1
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
NodeName=n1 NodeHostname=n1 NodeAddr=${ADDR[n1]} Port=$p1 CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=2000 State=UNKNOWN
NodeName=n2 NodeHostname=n2 NodeAddr=${ADDR[n2]} Port=$p2 CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
}

conf_value() { sed -n "s/^$1=\([^ ]*\).*/\1/p" "$DIR/slurm.conf" | head -1; }

start_munge() {
  local m=$DIR/munge
  export SLURM_CONF=$DIR/slurm.conf
  if alive "$m/munged.pid"; then return 0; fi
  id munge >/dev/null 2>&1 || die "no user 'munge' (is the munge package installed?)" 3
  install -d -m 0755 -o munge -g munge "$m"  # clients need x on the socket dir
  if [ ! -s "$m/munge.key" ]; then
    head -c 1024 /dev/urandom >"$m/munge.key"
    chown munge:munge "$m/munge.key"
    chmod 0600 "$m/munge.key"
  fi
  runuser -u munge -- /usr/sbin/munged --socket="$m/munge.socket" --key-file="$m/munge.key" \
    --pid-file="$m/munged.pid" --log-file="$m/munged.log" --seed-file="$m/munged.seed" \
    || die "munged did not start (see $m/munged.log)"
  for _ in $(seq 50); do
    munge -S "$m/munge.socket" -n 2>/dev/null | unmunge -S "$m/munge.socket" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "munged does not answer on $m/munge.socket (see $m/munged.log)"
}

wait_idle() {
  local states
  for _ in $(seq 150); do
    states=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | tr '\n' ' ')
    if [ "$(sinfo -h -N -o %T 2>/dev/null | sort -u)" = idle ]; then return 0; fi
    sleep 0.2
  done
  die "nodes not idle after 30 s: ${states:-no answer from slurmctld} (logs in $DIR/log)"
}

up() {
  install_packages
  [ "$(id -u)" = 0 ] || die "need root to run the Slurm daemons" 3
  mkdir -p "$DIR"
  chmod 0755 "$DIR"  # munged (user munge) must reach $DIR/munge
  mkdir -p "$DIR/state" "$DIR/log" "$DIR/run" "${NODES[@]/#/$DIR/spool/}"
  write_config
  export SLURM_CONF=$DIR/slurm.conf
  hosts_add
  start_munge
  if ! alive "$DIR/run/slurmctld.pid"; then
    local port
    port=$(conf_value SlurmctldPort)
    if port_busy "$port"; then die "port $port (SlurmctldPort) is in use: another slurmctld? stop it or remove $DIR"; fi
    slurmctld -i -f "$SLURM_CONF" || die "slurmctld did not start (see $DIR/log/slurmctld.log)"
  fi
  local node uts=1
  if ! unshare --uts true 2>/dev/null; then
    uts=0
    say "warning: no UTS namespaces here (unshare --uts): job steps see this machine's host name, not n1/n2"
  fi
  for node in "${NODES[@]}"; do
    alive "$DIR/run/slurmd-$node.pid" && continue
    if ((uts)); then
      # Own UTS namespace: `hostname` in job steps prints the node name, as on a real cluster.
      unshare --uts sh -c "hostname $node && exec slurmd -N $node -f '$SLURM_CONF'" \
        || die "slurmd $node did not start (see $DIR/log/slurmd-$node.log)"
    else
      slurmd -N "$node" -f "$SLURM_CONF" || die "slurmd $node did not start (see $DIR/log/slurmd-$node.log)"
    fi
  done
  wait_idle
  say "up: nodes ${NODES[*]} idle; export SLURM_CONF=$SLURM_CONF"
}

stop_pidfile() {  # stop_pidfile FILE NAME: SIGTERM, then SIGKILL after 5 s
  local pid
  alive "$1" || return 0
  pid=$(cat "$1")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 50); do alive "$1" || return 0; sleep 0.1; done
  say "$2 (pid $pid) ignored SIGTERM: SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
}

cancel_jobs() {  # cancel what is still queued or running, and give the steps time to end
  local jobs
  export SLURM_CONF=$DIR/slurm.conf
  jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ') || return 0
  [ -n "${jobs// /}" ] || return 0
  say "cancelling jobs $jobs"
  # shellcheck disable=SC2086
  scancel $jobs 2>/dev/null || true
  for _ in $(seq 60); do
    [ -z "$(squeue -h -o %i 2>/dev/null)" ] && return 0
    sleep 0.25
  done
}

kill_stepds() {  # job step daemons outlive slurmd if a step was still ending; theirs is cwd $DIR/...
  local proc pid cwd
  for proc in /proc/[0-9]*; do
    pid=${proc#/proc/}
    cwd=$(readlink "$proc/cwd" 2>/dev/null) || continue
    case "$cwd" in
      "$DIR"|"$DIR"/*) [ "$pid" != $$ ] && grep -q '^slurmstepd' "$proc/cmdline" 2>/dev/null && kill -KILL "$pid" 2>/dev/null ;;
    esac
  done
  return 0
}

down() {
  local node
  if [ -d "$DIR" ]; then
    alive "$DIR/run/slurmctld.pid" && cancel_jobs
    for node in "${NODES[@]}"; do stop_pidfile "$DIR/run/slurmd-$node.pid" "slurmd $node"; done
    stop_pidfile "$DIR/run/slurmctld.pid" slurmctld
    kill_stepds
    stop_pidfile "$DIR/munge/munged.pid" munged
  fi
  hosts_remove
  say "down: $DIR"
}

status() {
  local f rc=0
  for f in "$DIR/munge/munged.pid" "$DIR/run/slurmctld.pid" "${NODES[@]/#/$DIR/run/slurmd-}"; do
    f=${f%.pid}.pid
    if alive "$f"; then echo "running: $f ($(cat "$f"))"; else echo "stopped: $f"; rc=1; fi
  done
  return $rc
}

case "$cmd" in
  up) up ;;
  down) down ;;
  env) echo "export SLURM_CONF=$DIR/slurm.conf" ;;
  status) status ;;
  *) die "usage: $0 up|down|env|status [DIR]" 2 ;;
esac
