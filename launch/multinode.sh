#!/usr/bin/env bash
# Start this node's share of a multi-node training job: one torchrun agent per node, which
# starts one worker per GPU (or NPROC_PER_NODE CPU workers) running mingpt_ddp/main.py.
# All arguments are Hydra overrides for mingpt_ddp/main.py.
#
# Under Slurm run it once per node (launch/train.sbatch does this):
#     srun -N2 --ntasks-per-node=1 --kill-on-bad-exit=1 launch/multinode.sh model=gpt-mini
# Without Slurm run it on every machine, with the same HEAD_NODE and NNODES:
#     HEAD_NODE=192.168.0.1 NNODES=2 launch/multinode.sh model=gpt-mini
# The nodes meet at HEAD_NODE:RDZV_PORT (torchrun's c10d rendezvous, hosted by the agent on
# the head node). Node ranks are never handed out: the rendezvous assigns them, so the
# nodes may start in any order, within RDZV_TIMEOUT of each other, and may have different
# numbers of processes.
#
# Settings (environment variables; defaults in brackets):
#   NNODES          nodes in the job, or MIN:MAX for an elastic job [Slurm: the job's node
#                   count; otherwise 1]
#   NPROC_PER_NODE  workers on this node [the GPUs the workers' torch can use
#                   (`python -m mingpt_ddp.devices`); with no GPU: 1]. Set it to use fewer
#                   GPUs, or several CPU workers.
#   DEVICE          auto / gpu / cpu [auto: the GPUs torch sees, else CPU workers; but a node
#                   whose GPUs torch cannot use is refused in one line naming the likely cause
#                   (a torch built without CUDA, a driver older than its CUDA, a Slurm job or
#                   container given none of them)]. gpu: refuse without GPUs. cpu: train on
#                   CPUs on purpose (the workers see no GPU: CUDA_VISIBLE_DEVICES is set empty).
#   GPU_INVENTORY   directory listing the node's GPUs, one entry each, whatever the job may
#                   use [/proc/driver/nvidia/gpus; under Slurm, else the node's Gres]
#   HEAD_NODE       address or name of the node that hosts the rendezvous [Slurm: the first
#                   node of the job, `scontrol show hostnames $SLURM_JOB_NODELIST | head -1`;
#                   otherwise 127.0.0.1]
#   RDZV_PORT       TCP port of the rendezvous on HEAD_NODE [MASTER_PORT if set; under Slurm
#                   29500 + SLURM_JOB_ID % 2500, so that jobs sharing a node do not collide;
#                   otherwise 29500]. Must be open between the nodes.
#   RUN_ID          rendezvous id; every node of one job must use the same one [Slurm:
#                   SLURM_JOB_ID; otherwise "<HEAD_NODE>-<RDZV_PORT>", which machines given the
#                   same HEAD_NODE agree on]. It also names the run directory,
#                   outputs/torchrun-<RUN_ID> (outputs/slurm-<id> under Slurm): the same RUN_ID
#                   later resumes that run's snapshot, a new one starts afresh.
#   RDZV_TIMEOUT    seconds to wait for all nodes to join (and for a non-head node to reach
#                   the head) before failing [900]
#   MAX_RESTARTS    times torchrun restarts this node's workers after a failure; each restart
#                   is a new rendezvous and resumes from the latest snapshot [3]
#   IS_HEAD         1/0: whether this machine hosts the rendezvous [auto: Slurm node 0, or
#                   HEAD_NODE is this host's name or one of its addresses: then the first
#                   agent on this machine to take RDZV_PORT hosts it and any other started here
#                   joins it, so several "machines" may share one host]. Non-head nodes
#                   first check that HEAD_NODE:RDZV_PORT answers, and stop with a clear
#                   message if it does not within RDZV_TIMEOUT. Under Slurm, or when set,
#                   it is passed on to torchrun (--rdzv_conf is_host=...).
#   LOCAL_ADDR      address this node advertises to the others (rank 0's store is reached
#                   there) [this machine's address on the route to HEAD_NODE]
#   PYTHON          interpreter with torch, numpy, hydra-core, omegaconf and fsspec (the package
#                   itself runs from REPO_DIR, it need not be installed) [VENV/bin/python if VENV is set,
#                   else .venv/bin/python in the repository if present, else python3]
#   REPO_DIR        repository to run from [the one containing this script]
#   TORCHRUN_ARGS   extra torchrun options, e.g. "--redirects 3 --log-dir /tmp/logs"
#   DRY_RUN=1       print the topology line and the torchrun command, and run nothing
#   NCCL_DEBUG      [WARN]
#   GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME  the network interface of the collectives (gloo;
#                   NCCL's bootstrap and socket transport) [the interface that carries this
#                   machine's route to HEAD_NODE, e.g. ens5: "=ens5" for NCCL, which otherwise
#                   reads a prefix; GLOO_SOCKET_IFNAME follows a plain NCCL_SOCKET_IFNAME you set].
#                   Without them gloo binds what the host name resolves to (often another
#                   interface, or loopback) and NCCL its own pick. The topology line says which.
#   EFA             auto / 1 / 0 [auto: on when this node has EFA devices (`fi_info -p efa`
#                   succeeds, or /sys/class/infiniband has a device bound to the efa driver)].
#                   Exported to the workers resolved, as 1 or 0. On: exports FI_PROVIDER=efa,
#                   and FI_EFA_USE_DEVICE_RDMA=1 on instance types
#                   with RDMA read (p4d, p4de, p5*, p6*, trn1*, trn2*). A variable you exported
#                   yourself is never changed; the topology line says what was set and kept.
#   EC2_INSTANCE_TYPE  instance type for that RDMA choice [/sys/devices/virtual/dmi/id/product_name]
#   PREFLIGHT       0 / 1 / only [0; train.sbatch: 1]. 1: before training, run
#                   mingpt_ddp/tools/preflight.py through the same torchrun topology (every
#                   node's devices and versions, an all_reduce sweep, and where EFA is on
#                   (EFA above) NCCL's transport between nodes: TCP sockets fail the check);
#                   a failed check stops the job before training. only:
#                   run the checks and exit. PREFLIGHT_MIN_BUSBW (GB/s, default off) and
#                   PREFLIGHT_MAX_BYTES are read by the checks (see mingpt_ddp/tools/preflight.py).
#   PREFLIGHT_PORT  rendezvous port of the checks [RDZV_PORT + 1], so that a node that
#                   finishes them first cannot meet the head's finished round
#   OMP_NUM_THREADS [this node's cores / NPROC_PER_NODE]; TORCHINDUCTOR_COMPILE_THREADS
#                   (torch.compile's workers per process) [the same]
#   TORCH_FR_DUMP_TEMP_FILE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE  when set (train.sbatch does),
#                   its directory is created on every node, for the NCCL flight recorder's dumps
#   MINGPT_STEP_ERRORS  when set (train.sbatch does: <submit dir>/.mingpt-step/<job>/<restart>), every worker
#                   that ends with a ConfigError or RunError creates a file named after the
#                   class there, for the batch script's requeue decision
#
# Prints one line with the resolved topology, then torchrun's and the trainer's output.
# torchrun runs as mingpt_ddp/tools/torchrun.py: a failed rendezvous, a lost head, or workers
# that reported their own error end in one `error:` line instead of tracebacks.
# Exit code: the agent's. 0 done (or stopped after a snapshot); 2 a worker recorded a
# ConfigError (bad input: do not retry); 4 a worker recorded a RunError and none a ConfigError
# (worth retrying), whichever worker exited first; 1 when the head cannot be reached, the
# setup is wrong, or workers failed otherwise (a lost peer, a bug); 128+N the agent's signal.
set -euo pipefail

log() { echo "multinode: $*" >&2; }
die() { log "error: $*"; exit 1; }

# ---- where to run from, with what --------------------------------------------------------
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=${REPO_DIR:-$(dirname "$script_dir")}
cd "$REPO_DIR" || die "REPO_DIR=$REPO_DIR does not exist on $(hostname)"
[ -f mingpt_ddp/main.py ] || die "$REPO_DIR has no mingpt_ddp/main.py: set REPO_DIR to the repository"
if [ -z "${PYTHON:-}" ]; then
  if [ -n "${VENV:-}" ]; then PYTHON=$VENV/bin/python
  elif [ -x .venv/bin/python ]; then PYTHON=$REPO_DIR/.venv/bin/python
  else PYTHON=python3
  fi
fi
command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON=$PYTHON not found on $(hostname): set PYTHON or VENV"

host=$(hostname)
in_slurm=0
[ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}" ] && in_slurm=1

# ---- topology ----------------------------------------------------------------------------
if ((in_slurm)); then
  nodelist=${SLURM_JOB_NODELIST:-$SLURM_NODELIST}
  first_node=$(scontrol show hostnames "$nodelist" 2>/dev/null | head -n1 || true)
  if [ -z "$first_node" ]; then  # no scontrol here: expand "gpu-[003-008,010],cpu1" by hand
    if [[ $nodelist =~ ^([^,\[]+)\[([0-9]+) ]]; then first_node=${BASH_REMATCH[1]}${BASH_REMATCH[2]}
    else first_node=${nodelist%%,*}
    fi
  fi
  NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}
  HEAD_NODE=${HEAD_NODE:-$first_node}
  RDZV_PORT=${RDZV_PORT:-${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 2500))}}
  RUN_ID=${RUN_ID:-$SLURM_JOB_ID}
else
  NNODES=${NNODES:-1}
  HEAD_NODE=${HEAD_NODE:-127.0.0.1}
  RDZV_PORT=${RDZV_PORT:-${MASTER_PORT:-29500}}
  RUN_ID=${RUN_ID:-$HEAD_NODE-$RDZV_PORT}
fi
RDZV_TIMEOUT=${RDZV_TIMEOUT:-900}
MAX_RESTARTS=${MAX_RESTARTS:-3}
[[ $NNODES =~ ^[0-9]+(:[0-9]+)?$ ]] || die "NNODES=$NNODES: give a node count (2) or an elastic range (1:4)"
[[ $RDZV_PORT =~ ^[0-9]+$ ]] || die "RDZV_PORT=$RDZV_PORT is not a port number"
[[ $RDZV_TIMEOUT =~ ^[0-9]+$ ]] || die "RDZV_TIMEOUT=$RDZV_TIMEOUT: give whole seconds"
[[ $MAX_RESTARTS =~ ^[0-9]+$ ]] || die "MAX_RESTARTS=$MAX_RESTARTS: give a whole number"

# The node's GPUs, whatever this job may use: the NVIDIA driver lists each one in
# GPU_INVENTORY (cgroups and CUDA_VISIBLE_DEVICES do not hide them there); Slurm's node
# record (Gres=gpu:...) where the driver's list cannot be read.
node_gpus() {
  local dir=${GPU_INVENTORY:-/proc/driver/nvidia/gpus} n=0 gres entry gpu_re='^gpu(:[^:(]+)?:([0-9]+)'
  [ -d "$dir" ] && n=$(find "$dir" -mindepth 1 -maxdepth 1 | wc -l)
  if ((n == 0)) && ((in_slurm)) && command -v scontrol >/dev/null 2>&1; then
    gres=$(scontrol show node -o "${SLURMD_NODENAME:-$host}" 2>/dev/null | sed -n 's/.*[[:space:]]Gres=\([^[:space:]]*\).*/\1/p')
    for entry in ${gres//,/ }; do  # gpu:h100:8(S:0-1)
      [[ $entry =~ $gpu_re ]] && n=$((n + BASH_REMATCH[2]))
    done
  fi
  echo "$n"
}
DEVICE=${DEVICE:-auto}
for arg in "$@"; do  # the trainer's own setting asks for CPU workers as DEVICE=cpu does
  [ "$arg" = trainer.device=cpu ] && [ "$DEVICE" = auto ] && DEVICE=cpu
done
case "$DEVICE" in
  auto|gpu) ;;
  cpu) export CUDA_VISIBLE_DEVICES="" ;;  # on purpose: the workers see no GPU (and the trainer knows it was asked for)
  *) die "DEVICE=$DEVICE: give auto (GPUs when the job has them), gpu or cpu" ;;
esac
# The GPUs the workers' torch can use, asked of that torch (mingpt_ddp/tools/devices.py), not
# counted from nvidia-smi or CUDA_VISIBLE_DEVICES: where torch cannot use the node's GPUs (built
# without CUDA, a driver older than its CUDA, a job or container given none of them) those would
# be as many CPU workers. There it stops in the trainer's own line, unless DEVICE=cpu. Asked only
# where GPUs may be (a listed or requested GPU, nvidia-smi): importing torch takes seconds.
gpus=0
if [ "$DEVICE" != cpu ]; then
  inventory=$(node_gpus)
  if ((inventory > 0)) || [ "$DEVICE" = gpu ] || [ -n "${CUDA_VISIBLE_DEVICES:-}" ] || command -v nvidia-smi >/dev/null 2>&1; then
    devices_err=$(mktemp)
    if ! gpus=$("$PYTHON" -W ignore -m mingpt_ddp.devices "$inventory" 2>"$devices_err"); then
      reason=$(grep '^error: ' "$devices_err" | tail -n 1 || true)
      [ -n "$reason" ] || reason="error: cannot ask $PYTHON's torch for the GPUs: $(tail -n 1 "$devices_err")"
      rm -f "$devices_err"
      die "${reason#error: }"
    fi
    rm -f "$devices_err"
  fi
  if ((gpus == 0)) && [ "$DEVICE" = gpu ]; then
    die "DEVICE=gpu but torch sees no GPU on ${SLURMD_NODENAME:-$host} (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}, $inventory listed by the driver)"
  fi
fi
if [ -n "${NPROC_PER_NODE:-}" ]; then
  workers=$NPROC_PER_NODE; workers_from="NPROC_PER_NODE"
elif ((gpus > 0)); then
  workers=$gpus; workers_from="GPUs"
else
  workers=1; workers_from="$( [ "$DEVICE" = cpu ] && echo "DEVICE=cpu" || echo "no GPU"): 1 CPU worker; set NPROC_PER_NODE for more"
fi
[[ $workers =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE=$workers: give a positive number of workers"
device=$( ((gpus > 0)) && echo "$gpus GPU(s)" || echo "cpu" )

# The workers of each rendezvous round meet in a fresh TCPStore hosted by the new rank 0,
# rather than in one the head agent keeps for the whole job: after a restart, agents that
# saw a failure and agents that only saw a node rejoin disagree on TORCHELASTIC_RESTART_COUNT,
# so keys named after it (torch's own "attempt_N" prefix included) never meet. The trainer
# (mingpt_ddp/distributed.py) must then not prefix its keys per restart either.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

cores=$(nproc 2>/dev/null || echo 1)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / workers > 0 ? cores / workers : 1 ))}
# Inductor's compile workers per process: more than its share of cores only fights the other ranks.
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-$OMP_NUM_THREADS}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# ---- the network: this machine's address and interface toward HEAD_NODE -------------------
# From the routing table (mingpt_ddp/tools/network.py), not from the host name: on machines with
# several interfaces the host name resolves to another one, or to loopback. The collectives
# (gloo, NCCL's sockets) bind that interface and this node advertises that address.
head_local=0 route_addr="" route_iface=""
for field in $("$PYTHON" -m mingpt_ddp.network "$HEAD_NODE" 2>/dev/null || true); do
  case "$field" in
    local=1) head_local=1 ;;
    addr=?*) route_addr=${field#addr=} ;;
    iface=?*) route_iface=${field#iface=} ;;
  esac
done
net_notes=()
# A host name that resolves to loopback on this node (Debian's 127.0.1.1 line in /etc/hosts):
# the route says nothing about the network the other nodes use, and advertising 127.x would
# send them to their own loopback. Leave address and interface to torch and NCCL (the FQDN,
# their own interface choice), as without this script. An IP literal stays as given.
if ((${NNODES##*:} > 1)) && [[ $route_addr =~ ^127\.|^::1$ ]] && ! [[ $HEAD_NODE =~ ^[0-9.]+$|: ]]; then
  net_notes+=("$HEAD_NODE resolves to $route_addr here: address and interface left to torch/NCCL")
  route_addr="" route_iface="" route_loopback=1
fi
if [ -n "${GLOO_SOCKET_IFNAME:-}" ]; then
  net_notes+=("GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME kept")
elif [ -n "${NCCL_SOCKET_IFNAME:-}" ] && [[ $NCCL_SOCKET_IFNAME =~ ^=?[A-Za-z0-9_.-]+$ ]]; then
  export GLOO_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME#=}; net_notes+=("GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME from NCCL_SOCKET_IFNAME")
elif [ -n "$route_iface" ]; then
  export GLOO_SOCKET_IFNAME=$route_iface; net_notes+=("GLOO_SOCKET_IFNAME=$route_iface set")
fi
if [ -n "${NCCL_SOCKET_IFNAME:-}" ]; then
  net_notes+=("NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME kept")
elif [ -n "$route_iface" ]; then  # "=": exactly this interface (a plain value is a prefix to NCCL)
  export NCCL_SOCKET_IFNAME="=$route_iface"; net_notes+=("NCCL_SOCKET_IFNAME==$route_iface set")
fi
if [ -n "${LOCAL_ADDR:-}" ]; then
  net_notes+=("LOCAL_ADDR=$LOCAL_ADDR kept")
elif [ -n "$route_addr" ]; then
  LOCAL_ADDR=$route_addr; net_notes+=("LOCAL_ADDR=$route_addr set")
fi
if ((${route_loopback:-0})); then
  net_state="net=default ($(IFS=';'; echo "${net_notes[*]}" | sed 's/;/, /g'))"
elif [ -n "$route_iface" ]; then
  net_state="net=$route_iface $route_addr (the route to $HEAD_NODE; $(IFS=';'; echo "${net_notes[*]}" | sed 's/;/, /g'))"
else
  net_state="net=unknown (no route to $HEAD_NODE found${net_notes:+; $(IFS=';'; echo "${net_notes[*]}" | sed 's/;/, /g')})"
fi

# ---- EFA: the fabric settings, never overriding what the user exported ---------------------
efa_present() {
  local fi_info dev driver
  for fi_info in fi_info /opt/amazon/efa/bin/fi_info; do
    if command -v "$fi_info" >/dev/null 2>&1 && "$fi_info" -p efa >/dev/null 2>&1; then return 0; fi
  done
  for dev in /sys/class/infiniband/*; do
    driver=$(readlink -f "$dev/device/driver" 2>/dev/null) || continue
    [ "${driver##*/}" = efa ] && return 0
  done
  return 1
}
# Instance types whose EFA devices support RDMA read (GPUDirect RDMA for NCCL's OFI plugin).
efa_rdma_capable() {
  [[ $1 =~ ^(p4d|p4de|p5|p5e|p5en|p6[a-z0-9-]*|trn1|trn1n|trn2[a-z0-9-]*)\. ]]
}
EFA=${EFA:-auto}
case "$EFA" in
  auto) if efa_present; then efa_on=1; efa_how="auto: EFA devices found"; else efa_on=0; efa_how="auto: no EFA device"; fi ;;
  1|on) efa_on=1; efa_how="EFA=1" ;;
  0|off) efa_on=0; efa_how="EFA=0" ;;
  *) die "EFA=$EFA: give auto (on when EFA devices are present), 1 or 0" ;;
esac
efa_notes=()
export_unless_set() {  # NAME VALUE: export it, unless the user already did (then say it is theirs)
  if [ -n "${!1+x}" ]; then efa_notes+=("$1=${!1} kept"); else export "$1=$2"; efa_notes+=("$1=$2 set"); fi
}
if ((efa_on)); then
  export_unless_set FI_PROVIDER efa
  instance_type=${EC2_INSTANCE_TYPE:-$(cat /sys/devices/virtual/dmi/id/product_name 2>/dev/null || true)}
  if efa_rdma_capable "$instance_type"; then
    export_unless_set FI_EFA_USE_DEVICE_RDMA 1
    efa_notes+=("$instance_type has RDMA read")
  elif [ -n "${FI_EFA_USE_DEVICE_RDMA+x}" ]; then
    efa_notes+=("FI_EFA_USE_DEVICE_RDMA=$FI_EFA_USE_DEVICE_RDMA kept")
  else
    efa_notes+=("no RDMA read on ${instance_type:-an unknown instance type}: FI_EFA_USE_DEVICE_RDMA left unset")
  fi
  efa_state="efa=on ($efa_how; $(IFS=';'; echo "${efa_notes[*]}" | sed 's/;/, /g'))"
else
  efa_state="efa=off ($efa_how)"
fi
# Resolved for the workers: pre-flight fails when EFA is expected here (1) and NCCL's inter-node
# transport is TCP sockets (mingpt_ddp/tools/preflight.py, check_transport).
export EFA=$efa_on

# ---- pre-flight checks ------------------------------------------------------------------
PREFLIGHT=${PREFLIGHT:-0}
[[ $PREFLIGHT =~ ^(0|1|only)$ ]] || die "PREFLIGHT=$PREFLIGHT: give 1 (check, then train), only (check and exit) or 0"
PREFLIGHT_PORT=${PREFLIGHT_PORT:-$((RDZV_PORT + 1))}
[[ $PREFLIGHT_PORT =~ ^[0-9]+$ ]] || die "PREFLIGHT_PORT=$PREFLIGHT_PORT is not a port number"

# Whether this node hosts the rendezvous: Slurm's node 0 (when HEAD_NODE is the first node),
# or IS_HEAD; both are passed on to torchrun (is_host). Otherwise a node hosts it when
# HEAD_NODE is this machine's name or one of its addresses, and mingpt_ddp/tools/torchrun.py decides
# at start: the first agent on this machine to take the port hosts, any other joins it (several
# "machines" on one host). torchrun alone would compare HEAD_NODE with what the host name
# resolves to, and nobody would host where that is another interface.
rdzv_conf="join_timeout=$RDZV_TIMEOUT,read_timeout=$RDZV_TIMEOUT"
if [ -n "${IS_HEAD:-}" ]; then
  [[ $IS_HEAD =~ ^[01]$ ]] || die "IS_HEAD=$IS_HEAD: give 1 (this machine hosts the rendezvous) or 0"
  is_head=$IS_HEAD
  rdzv_conf+=",is_host=$is_head"
elif ((in_slurm)) && [ "$HEAD_NODE" = "${first_node:-}" ]; then
  is_head=$( [ "${SLURM_NODEID:-0}" = 0 ] && echo 1 || echo 0 )
  rdzv_conf+=",is_host=$is_head"
else
  is_head=$head_local
fi

where=$host
((in_slurm)) && where="${SLURMD_NODENAME:-$host} (Slurm job $SLURM_JOB_ID node ${SLURM_NODEID:-?} of ${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-?}})"
role=$( ((is_head)) && echo "hosts the rendezvous" || echo "joins" )
log "topology: node $where $role $HEAD_NODE:$RDZV_PORT | nnodes=$NNODES nproc_per_node=$workers ($workers_from; $device) | run_id=$RUN_ID max_restarts=$MAX_RESTARTS rdzv_timeout=${RDZV_TIMEOUT}s | $net_state | $efa_state | preflight=$PREFLIGHT | python=$PYTHON repo=$REPO_DIR"

# ---- the agents' command lines ---------------------------------------------------------------
torchrun_cmd() {  # PORT RDZV_ID MAX_RESTARTS: torchrun's options for this topology
  cmd=("$PYTHON" -m mingpt_ddp.torchrun
    --nnodes="$NNODES" --nproc_per_node="$workers"
    --rdzv_backend=c10d --rdzv_endpoint="$HEAD_NODE:$1" --rdzv_id="$2"
    --rdzv_conf="$rdzv_conf"
    --max-restarts="$3")
  [ -n "${LOCAL_ADDR:-}" ] && cmd+=(--local-addr="$LOCAL_ADDR")
  # shellcheck disable=SC2206  # TORCHRUN_ARGS is a list of options, split on purpose
  [ -n "${TORCHRUN_ARGS:-}" ] && cmd+=($TORCHRUN_ARGS)
  return 0
}
# The checks: their own rendezvous (id and port), never restarted: a failed check is an answer.
torchrun_cmd "$PREFLIGHT_PORT" "$RUN_ID-preflight" 0
preflight_cmd=("${cmd[@]}" -m mingpt_ddp.preflight)
torchrun_cmd "$RDZV_PORT" "$RUN_ID" "$MAX_RESTARTS"
cmd+=(mingpt_ddp/main.py "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  [ "$PREFLIGHT" != 0 ] && { printf '%q ' "${preflight_cmd[@]}"; echo; }
  [ "$PREFLIGHT" != only ] && { printf '%q ' "${cmd[@]}"; echo; }
  exit 0
fi

# ---- a non-head node first checks that it can reach the head ------------------------------
wait_for_head() {  # PORT
  "$PYTHON" - "$HEAD_NODE" "$1" "$RDZV_TIMEOUT" <<'EOF'
import socket, sys, time
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + timeout
last = "no attempt"
while True:
    left = deadline - time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=max(0.5, min(5.0, left))):
            sys.exit(0)
    except OSError as exc:
        last = exc.strerror or str(exc) or type(exc).__name__
    if time.monotonic() + 1.0 > deadline:
        print(last)
        sys.exit(1)
    time.sleep(1.0)
EOF
}
reach_head() {  # PORT: a non-head node first checks that the head answers there
  ((is_head)) && return 0
  local reason
  if ! reason=$(wait_for_head "$1"); then
    die "cannot reach the rendezvous head $HEAD_NODE:$1 from $host within RDZV_TIMEOUT=${RDZV_TIMEOUT}s (last error: ${reason:-unknown}). Check that launch/multinode.sh runs on the head with the same NNODES, RDZV_PORT and RUN_ID; that HEAD_NODE is the head's address as seen from this machine; that TCP port $1 (and the collectives' ports) is open in the firewall / security group between the machines; and that NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name the interface that carries $HEAD_NODE's network."
  fi
}

# ---- run the agents ------------------------------------------------------------------------
# Every process of this node carries this token, so that leftovers can be found if the agent dies.
export MINGPT_NODE_TOKEN="$host-$$-$RANDOM"
kill_leftover_workers() {
  local env_file pid
  for env_file in /proc/[0-9]*/environ; do
    pid=${env_file#/proc/}; pid=${pid%/environ}
    [ "$pid" = $$ ] && continue
    if { tr '\0' '\n' <"$env_file"; } 2>/dev/null | grep -qxF "MINGPT_NODE_TOKEN=$MINGPT_NODE_TOKEN"; then
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
}

# SIGUSR1 is the trainer's "save and stop" signal: Slurm delivers it to every process of the
# step, the workers handle it. The agent must not die of it, so it inherits "ignore".
trap '' USR1
# A stop signal for this script goes to the agent, which stops its workers gracefully.
# Slurm signals every process of a step, and a terminal's Ctrl-C the whole process group,
# so then the agent has it already: a second copy would cut its graceful shutdown short.
got_signal=""
agent=""
forward() {
  got_signal=$1
  if ((!in_slurm)) && [ "$1" != INT ] && [ -n "$agent" ]; then kill "-$1" "$agent" 2>/dev/null || true; fi
}
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'forward HUP' HUP

run_agent() {  # COMMAND...: one torchrun agent, to its end; sets rc
  "$@" &
  agent=$!
  while true; do
    set +e
    wait "$agent"
    rc=$?
    set -e
    kill -0 "$agent" 2>/dev/null || break  # otherwise `wait` was interrupted by a trapped signal
  done
  if ((rc > 128)) && [ -z "$got_signal" ]; then
    sig=$(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128)))
    kill_leftover_workers
    log "error: the torchrun agent on $host died of SIG$sig: this node has left the job and its workers were stopped. The other nodes' workers fail at their next collective once their connections to this node close (NCCL over InfiniBand/EFA may take up to trainer.collective_timeout_minutes); their agents then restart them, which wait up to RDZV_TIMEOUT=${RDZV_TIMEOUT}s for this node (srun --kill-on-bad-exit=1 ends the whole step at once instead)."
  elif ((rc != 0)); then
    log "torchrun on $host exited with code $rc"
  fi
}

# ---- the flight recorder's dump directory (train.sbatch sets the file prefix) -------------
fr_dump=${TORCH_FR_DUMP_TEMP_FILE:-${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-}}
if [ -n "$fr_dump" ]; then
  mkdir -p "$(dirname "$fr_dump")" 2>/dev/null \
    || log "warning: cannot create $(dirname "$fr_dump") for NCCL flight recorder dumps"
fi

if [ "$PREFLIGHT" != 0 ]; then
  reach_head "$PREFLIGHT_PORT"
  run_agent "${preflight_cmd[@]}"
  if ((rc != 0)); then
    log "pre-flight checks did not pass on $host (exit code $rc): not training"
    exit "$rc"
  fi
  [ -n "$got_signal" ] && exit "$rc"
  if [ "$PREFLIGHT" = only ]; then
    log "pre-flight checks passed on $host (PREFLIGHT=only: not training)"
    exit 0
  fi
fi
reach_head "$RDZV_PORT"
run_agent "${cmd[@]}"
exit "$rc"
