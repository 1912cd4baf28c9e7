"""Where this process stands in the job: rank, device, backend and the process group.

Reads torchrun's environment, or Slurm's when srun starts one task per process without
torchrun (as Hydra's submitit launcher does), or runs as a single process.
"""
from __future__ import annotations

import atexit
import datetime
import hashlib
import itertools
import logging
import os
import pickle
import re
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, TypeVar

import torch
import torch.distributed as torch_dist

from mingpt_ddp.config import DEFAULT_COLLECTIVE_TIMEOUT_MINUTES, RANK0_WAIT_MARGIN_MINUTES
from mingpt_ddp.errors import ConfigError, RunError, UserFacingError, by_name

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: Optional[int] = None) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def first_hostname(nodelist: str) -> str:
    """The first host of a Slurm hostlist: "gpu-[007-008,010],cpu1" -> "gpu-007".

    Each bracket group stands for its first value ("rack[1-2]-n[01-04]" -> "rack1-n01");
    parsed here rather than with `scontrol show hostnames`, which a container may lack.
    """
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first host ends at the first comma outside brackets
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    first = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m[1])[0], nodelist[:end].strip())
    return first or "127.0.0.1"


def _slurm_first_node() -> str:
    """The rendezvous host: the first node of this step (srun on a subset of the job's nodes
    may not include the job's first node), else of the job."""
    return first_hostname(os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
                          or os.environ.get("SLURM_NODELIST", ""))


def _slurm_tasks_on_this_node(ntasks: int) -> int:
    """This node's share of the step's tasks, from SLURM_STEP_TASKS_PER_NODE ("2(x3),1")."""
    layout = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE", "")
    per_node: list[int] = []
    for part in filter(None, layout.split(",")):
        count, _, repeat = part.partition("(x")
        per_node += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    node = _env_int("SLURM_NODEID", 0)
    if node < len(per_node):
        return per_node[node]
    return max(1, ntasks // max(1, _env_int("SLURM_NNODES", 1)))


def read_topology() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun, Slurm, or alone.

    Under srun without torchrun (one Slurm task per process), RANK/WORLD_SIZE/LOCAL_RANK
    and MASTER_ADDR/MASTER_PORT are derived from SLURM_* and exported for env:// init.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
        local_rank = _env_int("LOCAL_RANK", 0)
        local_world = _env_int("LOCAL_WORLD_SIZE", world)
        return rank, local_rank, world, local_world
    ntasks = _env_int("SLURM_STEP_NUM_TASKS", None) or _env_int("SLURM_NTASKS", 1)
    if "SLURM_PROCID" in os.environ and ntasks > 1 and "SLURM_STEP_ID" in os.environ:
        rank, local_rank = _env_int("SLURM_PROCID"), _env_int("SLURM_LOCALID", 0)
        local_world = _slurm_tasks_on_this_node(ntasks)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(ntasks), LOCAL_RANK=str(local_rank),
                          LOCAL_WORLD_SIZE=str(local_world))
        os.environ.setdefault("MASTER_ADDR", _slurm_first_node())
        # A per-job port (several jobs may share a node), below Linux's ephemeral range.
        os.environ.setdefault("MASTER_PORT", str(20000 + _env_int("SLURM_JOB_ID", 0) % 10000))
        return rank, local_rank, ntasks, local_world
    return 0, 0, 1, 1


def node_id() -> str:
    """Which node (in the sense of LOCAL_RANK: the processes one launcher started) this
    process belongs to: torchrun's agent (GROUP_RANK), Slurm's node (SLURM_NODEID), else
    the host and its boot. Host names alone are shared by containers with host networking
    and are generic in many images."""
    if os.environ.get("GROUP_RANK", "") != "" and "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun-agent-{os.environ['GROUP_RANK']}"
    if os.environ.get("SLURM_NODEID", "") != "" and "SLURM_PROCID" in os.environ:
        return f"slurm-node-{os.environ['SLURM_NODEID']}"
    return _host_and_boot()


def _host_and_boot() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{os.uname().nodename}/{boot}"


# Where the NVIDIA driver lists the node's GPUs, one entry each, whatever this process may use
# (CUDA_VISIBLE_DEVICES and cgroups do not hide them there; a container's NVIDIA runtime shows
# the GPUs it was given). GPU_INVENTORY points elsewhere (tests; launch/multinode.sh reads it too).
GPU_INVENTORY = "/proc/driver/nvidia/gpus"
DEVICES = ("auto", "cuda", "cpu")  # trainer.device


def node_gpus(env: Mapping[str, str] = os.environ) -> int:
    """The GPUs the NVIDIA driver lists on this node (0 without a driver or its listing)."""
    try:
        return len(os.listdir(env.get("GPU_INVENTORY") or GPU_INVENTORY))
    except OSError:
        return 0


def cpu_asked_for(device: str, env: Mapping[str, str] = os.environ) -> bool:
    """CPU on purpose: trainer.device=cpu, or (trainer.device=auto) CUDA_VISIBLE_DEVICES set
    empty (or -1), as launch/multinode.sh's DEVICE=cpu does; trainer.device=cuda never."""
    return device == "cpu" or (device == "auto" and env.get("CUDA_VISIBLE_DEVICES") in ("", "-1"))


def cuda_init_error() -> str:
    """The first line of why CUDA cannot start in this process ("" if it can): torch's own
    reason, which torch.cuda.is_available() only logs as a warning once."""
    try:
        torch.cuda.init()
    except Exception as exc:  # AssertionError without CUDA, RuntimeError from the driver
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return ""


def why_no_gpu(listed: int, torch_version: str, cuda_version: Optional[str], init_error: str,
               visible: Optional[str]) -> str:
    """The likely cause, and its fix, of a torch that sees none of the node's `listed` GPUs.

    From torch's reasons (c10/cuda/CUDAFunctions.cpp device_count_impl): "Found no NVIDIA
    driver" (the process has no libcuda: a container started without the NVIDIA runtime),
    "driver ... too old" (cudaErrorInsufficientDriver), "No CUDA GPUs are available"
    (cudaErrorNoDevice: none given to this job or container, or hidden)."""
    if cuda_version is None:
        return (f"this torch ({torch_version}) is built without CUDA: install a CUDA build of torch (the one "
                "the tests run, e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128) "
                "or run in the image that has one")
    if "too old" in init_error or "insufficient" in init_error.lower():
        return (f"the NVIDIA driver is older than this torch's CUDA {cuda_version} needs ({init_error.split('. ')[0]}): "
                "install a torch built for the driver's CUDA (`nvidia-smi` shows it) or update the driver")
    if visible is not None and visible not in ("", "-1"):
        hidden = f"CUDA_VISIBLE_DEVICES={visible} names none of them, or "
    else:
        hidden = ""
    if "no NVIDIA driver" in init_error:
        return (f"this process has no NVIDIA driver library ({init_error.split('. ')[0]}): {hidden}the container was "
                "started without GPUs (docker run --gpus all; enroot/Pyxis with the NVIDIA hook)")
    return (f"CUDA {cuda_version} cannot use them ({init_error or 'no device'}): {hidden}this job or container was given "
            f"none of them (Slurm: --gpus-per-node={listed}; docker run --gpus all)")


def gpu_problem(device: str, env: Mapping[str, str] = os.environ, listed: Optional[int] = None) -> Optional[str]:
    """Why this process must not train on CPU though torch sees no GPU, else None: the node
    has GPUs (or trainer.device=cuda asked for one) and CPU was not asked for. On such a
    node a CPU rank would train gpt2 on CPUs, or mix gloo with the NCCL of other nodes."""
    if cpu_asked_for(device, env):
        return None
    listed = node_gpus(env) if listed is None else listed
    if not listed and device != "cuda":
        return None
    host = env.get("SLURMD_NODENAME") or os.uname().nodename
    what = f"node {host} has {listed} GPU(s) but torch sees none" if listed else f"trainer.device=cuda but torch on {host} sees no GPU"
    cause = why_no_gpu(listed, torch.__version__, torch.version.cuda or torch.version.hip, cuda_init_error(),
                       env.get("CUDA_VISIBLE_DEVICES"))
    return (f"{what}: {cause}; to train on CPUs on purpose: trainer.device=cpu, or CUDA_VISIBLE_DEVICES= "
            "(launch/multinode.sh: DEVICE=cpu)")


def pick_device(local_rank: int, local_world_size: int = 1, device: str = "auto",
                env: Mapping[str, str] = os.environ) -> tuple[torch.device, str]:
    """cuda:(LOCAL_RANK mod visible GPUs) with NCCL where CUDA is available, else CPU with
    gloo; a ConfigError where that CPU was not asked for on a node with GPUs (gpu_problem).

    The modulo covers both launch styles: torchrun (each worker sees all of the node's GPUs,
    LOCAL_RANK picks one) and srun with --gpus-per-task=1 or GPU binding (each task sees only
    its own GPU, as cuda:0, while SLURM_LOCALID still counts up to 7; or a wrapper sets
    CUDA_VISIBLE_DEVICES=$LOCAL_RANK per worker). More workers than GPUs would put two ranks on
    one GPU, which NCCL refuses at its first collective (ncclInvalidUsage): setup() compares
    the GPUs themselves across ranks (agree_on_device), whatever the launch style, before it.
    """
    if device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count()), "nccl"
    problem = gpu_problem(device, env)
    if problem:
        raise ConfigError(problem)
    return torch.device("cpu"), "gloo"


def _launched_per_slurm_task(env: Mapping[str, str]) -> bool:
    """srun started this process itself (one Slurm task per process), not torchrun."""
    return "SLURM_PROCID" in env and "TORCHELASTIC_RUN_ID" not in env


def cpu_threads_per_process(local_world_size: int, env: Mapping[str, str] = os.environ) -> int:
    """This process's share of the node's cores, without oversubscribing or dividing twice.

    torchrun's workers inherit one affinity mask, so it is split between them. A process
    srun started as its own task already has its share when srun binds CPUs (the mask is
    the task's cores) or when SLURM_CPUS_PER_TASK says how many are its own; only an
    unbound task seeing the whole node's cores splits them.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if _launched_per_slurm_task(env):
        per_task = env.get("SLURM_CPUS_PER_TASK", "")
        if per_task.isdigit() and int(per_task) > 0:
            return min(cores, int(per_task))
        if cores < (os.cpu_count() or cores):  # bound to a subset of the node: this task's share
            return cores
    return max(1, cores // max(1, local_world_size))


def cpu_threads(setting: Optional[int], local_world_size: int, env: Mapping[str, str] = os.environ,
                key: str = "trainer.cpu_threads") -> int:
    """This process's intra-op threads: trainer.cpu_threads (per process) where set, else its
    share of the cores (cpu_threads_per_process). A ConfigError naming `key` (the sample
    tool's is cpu_threads) for a count below 1."""
    share = cpu_threads_per_process(local_world_size, env)
    if setting is None:
        return share
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ConfigError(f"{key}={setting} must be a number of threads per process, 1 or more: "
                          f"e.g. {key}={share} (this process's share of the cores), or null for that share")
    return setting


def encode_threads(setting: Optional[int], local_world_size: int, env: Mapping[str, str] = os.environ) -> int:
    """Threads for a corpus's encoding (and BPE training), which one process per node does
    while the node's other processes wait for it (on_main_then_share(once_per_node=True),
    idle in the store or a collective): trainer.cpu_threads times the node's processes where
    set, else all the cores this process may use (its affinity, which torchrun's workers
    share); never more than those cores. Validates `setting` as cpu_threads does."""
    per_process = cpu_threads(setting, local_world_size, env)
    cores = _usable_cores()
    return cores if setting is None else max(1, min(cores, per_process * max(1, local_world_size)))


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
# glibc's older variables for the same settings: a user who set one chose malloc's behaviour.
USERS_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_heap_kept: Optional[bool] = None  # keep_freed_host_memory's answer, once per process


def keep_freed_host_memory() -> bool:
    """Keep the memory a CPU step frees for the next step: no mmap per large block, no trim.

    glibc gives each allocation above its mmap threshold (dynamic, at most 32 MiB) its own
    mmap, unmapped at free, so every step's logits (64 MiB for gpt-nano at a 4,096-token
    vocabulary, 0.8 GB at GPT-2's 50,257) were mapped, zeroed page by page and unmapped again:
    a third of a BPE run's CPU time in the kernel (issue 32). With mmap off (M_MMAP_MAX=0: a
    threshold cannot exceed 32 MiB) large blocks come from the heap (a thread's arena too
    small for one falls back to the main arena), and with trimming off (M_TRIM_THRESHOLD)
    the heap keeps its peak: the run's peak RSS, not more, stays resident. Host memory only
    (CUDA's allocator is its own). Left alone where the user chose (GLIBC_TUNABLES with
    glibc.malloc settings, glibc's MALLOC_*_ variables for them, or another malloc preloaded) and where glibc is absent (musl,
    macOS). Whether the settings were applied; once per process."""
    global _heap_kept
    if _heap_kept is None:
        _heap_kept = _set_malloc_options()
    return _heap_kept


def _set_malloc_options(env: Mapping[str, str] = os.environ) -> bool:
    try:
        glibc = (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (AttributeError, ValueError, OSError):
        glibc = False
    if not glibc:
        log.debug("host memory: not glibc, malloc left as it is")
        return False
    chosen = [name for name in USERS_MALLOC_ENV if name in env]
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", "") or "malloc" in env.get("LD_PRELOAD", "") or chosen:
        log.debug("host memory: malloc settings chosen by the environment (GLIBC_TUNABLES, LD_PRELOAD, %s), left alone",
                  ", ".join(USERS_MALLOC_ENV))
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # -1 as trim threshold: glibc takes it as the largest size, never trim.
    applied = all(mallopt(param, value) == 1 for param, value in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)))
    log.debug("host memory: glibc malloc keeps freed memory (M_MMAP_MAX=0, M_TRIM_THRESHOLD=-1): %s", applied)
    return applied


def size_thread_pools(n: int, asked: bool, rank: int, key: str = "trainer.cpu_threads") -> None:
    """n intra-op threads (OMP_NUM_THREADS, which torchrun sets to 1 for its workers, is
    overridden); asked (`key`: trainer.cpu_threads, the sample tool's cpu_threads): the
    inter-op pool too, and a warning where n is more than the cores this process may use."""
    torch.set_num_threads(n)
    if not asked:
        return
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:  # its pool has started already (torch allows setting it once)
        pass
    cores = _usable_cores()
    if n > cores and rank == 0:
        log.warning("%s=%d is more than the %d cores this process may use: its threads will wait for "
                    "each other; set %s=%d or less", key, n, cores, key, cores)


def _process_group_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """The rendezvous store, with keys private to this restart generation.

    After torchrun restarts killed workers, the new workers could read the previous
    generation's gloo addresses from the agent's store; a prefix per restart keeps each
    generation's keys apart (seen failing intermittently on CPU/gloo without it).
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = torch_dist.TCPStore(
        host, port, world_size, is_master=(rank == 0 and not agent_hosts_store), timeout=timeout
    )
    if not agent_hosts_store:
        # Each round made its own store (launch/multinode.sh sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE):
        # nothing stale to hide, and restart counts can differ between nodes.
        return store
    generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return torch_dist.PrefixStore(f"mingpt_ddp/generation_{generation}", store)


_current: Optional[DistEnv] = None
_torch_threads = 1  # torch's own thread count, before setup() sized it (a GPU sweep's null points get it back)
_store: Optional[torch_dist.Store] = None  # the rendezvous store: error reports, waits for rank 0
_rank0_wait_minutes = 15.0 + RANK0_WAIT_MARGIN_MINUTES  # set by setup()
_rounds = itertools.count()  # the store waits of this process, numbered alike on every rank
_runners: Optional[list[int]] = None  # the ranks that are their node's local rank 0


def process_group_options(device: torch.device) -> dict[str, Any]:
    """init_process_group options for `device`: on CUDA, `device_id` binds the group to this
    rank's GPU, so NCCL builds its communicator at start (errors show there, not at the first
    step) and barriers and object collectives use the right device."""
    return {"device_id": device} if device.type == "cuda" else {}


def setup(timeout_minutes: float = DEFAULT_COLLECTIVE_TIMEOUT_MINUTES,
          rank0_wait_minutes: Optional[float] = None, device: str = "auto",
          threads: Optional[int] = None) -> DistEnv:
    """Pick the device (`device`: trainer.device, auto/cuda/cpu), size the CPU thread pool
    (`threads`: trainer.cpu_threads; null: this process's share of the cores on CPU, torch's
    own count on GPUs), keep freed host memory on CPU (keep_freed_host_memory) and join the process group, whose collectives (and the rendezvous) give up after
    `timeout_minutes`. Waits for work only rank 0 does (wait_for_main) give up after
    `rank0_wait_minutes`. Every rank raises the same ConfigError when any rank cannot take
    its device, or when the ranks' devices cannot form one group (agree_on_device).

    Once per process: the sweep points of a multirun reuse the same process group, which
    is torn down when the process exits.
    """
    global _current, _store, _rank0_wait_minutes, _collective_timeout, _torch_threads
    if rank0_wait_minutes is not None:
        _rank0_wait_minutes = rank0_wait_minutes
    if _current is not None:  # a sweep's later point: its own trainer.cpu_threads
        if _current.device.type != "cuda" or threads is not None:
            size_thread_pools(cpu_threads(threads, _current.local_world_size), threads is not None, _current.rank)
        else:  # null on a GPU: torch's own count, as a fresh process has
            torch.set_num_threads(_torch_threads)
        return _current
    _torch_threads = torch.get_num_threads()
    rank, local_rank, world_size, local_world_size = read_topology()
    n_threads = cpu_threads(threads, local_world_size)  # a bad trainer.cpu_threads: before anything starts
    device_, backend, problem = torch.device("cpu"), "", None
    try:
        device_, backend = pick_device(local_rank, local_world_size, device)
    except ConfigError as exc:
        if world_size == 1:
            raise
        problem = str(exc)
    if device_.type == "cuda":
        torch.cuda.set_device(device_)
    else:
        keep_freed_host_memory()
    if device_.type != "cuda" or threads is not None:
        size_thread_pools(n_threads, threads is not None, rank)
    # Every process says it (before rank 0 alone speaks): oversubscribed cores show up here.
    log.info("rank %d (local %d of %d): %s, %d CPU threads", rank, local_rank, local_world_size,
             device_ if problem is None else "no usable device", torch.get_num_threads())
    if world_size > 1 and not torch_dist.is_initialized():
        timeout = _collective_timeout = datetime.timedelta(minutes=timeout_minutes)
        _store = _process_group_store(rank, world_size, timeout)
        agree_on_device(_store, rank, world_size, backend, problem, _gpu_identity(device_),
                        f"rank {rank} on {os.environ.get('SLURMD_NODENAME') or os.uname().nodename} ({device_})",
                        timeout.total_seconds())
        torch_dist.init_process_group(
            backend, store=_store, rank=rank, world_size=world_size, timeout=timeout,
            **process_group_options(device_),
        )
        atexit.register(teardown)
    _current = DistEnv(rank, local_rank, world_size, local_world_size, device_, backend)
    return _current


def _gpu_identity(device: torch.device) -> Optional[str]:
    """This rank's GPU as NCCL tells ranks apart: the host (NCCL's host hash: its name and
    boot, or NCCL_HOSTID) and the device itself (its UUID and PCI address, whatever
    CUDA_VISIBLE_DEVICES calls it: ROCm gives every GPU without a unique id the UUID "GPU-XX").
    None where NCCL lets ranks share a GPU (NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL >= 2.30)."""
    if device.type != "cuda" or os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1":
        return None
    try:
        props = torch.cuda.get_device_properties(device)
        gpu = f"{props.uuid}@{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}"
    except (AttributeError, RuntimeError):
        gpu = f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}#{device.index}"
    return f"{os.environ.get('NCCL_HOSTID') or _host_and_boot()}/{gpu}"


def agree_on_device(store: Any, rank: int, world_size: int, backend: str, problem: Optional[str],
                    gpu: Optional[str], where: str, timeout_s: float) -> None:
    """Before the process group: every rank raises the same ConfigError when any rank could
    not take its device (`problem`), when some ranks would join with gloo and others with
    NCCL (they would wait for each other until the timeout, then look like a lost peer), or
    when two ranks of one host use the same GPU (`gpu`: NCCL refuses that, "Duplicate GPU
    detected"). In the rendezvous store, a few operations per rank; `where` names this rank."""
    key = "mingpt_ddp/device/"
    if problem is not None:
        store.append(key + "problem_ranks", f"{rank} ")
        if store.add(key + "problems", 1) == 1:
            store.set(key + "problem", problem)
    else:
        if store.add(f"{key}backend/{backend}", 1) == 1:
            store.set(f"{key}backend/{backend}/first", where)
        if gpu is not None:
            gpu_key = key + "gpu/" + hashlib.sha256(gpu.encode()).hexdigest()[:32]
            if store.add(gpu_key, 1) == 1:
                store.set(gpu_key + "/first", where)
            elif store.add(key + "shared", 1) == 1:
                store.set(key + "shared_by", where)
                store.set(key + "shared_gpu", gpu_key)
    if store.add(key + "arrived", 1) == world_size:
        store.set(key + "done", "1")
    try:
        store.wait([key + "done"], datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, torch_dist.DistError):  # DistStoreError: the wait ran out
        raise LostPeers(f"waited {timeout_s / 60:g} minutes for the other ranks to pick their devices: a rank "
                        "did not start or its node has gone; run the same command to resume") from None
    error = _device_disagreement(store, key, world_size)
    if error is not None:
        # Every rank has read it before rank 0 goes on to exit (it may host the store).
        store.add(key + "read", 1)
        deadline = time.monotonic() + 10.0
        while rank == 0 and time.monotonic() < deadline and store.add(key + "read", 0) < world_size:
            time.sleep(0.05)
        raise ConfigError(error)


def _device_disagreement(store: Any, key: str, world_size: int) -> Optional[str]:
    """agree_on_device's verdict, read from the store once every rank has voted."""
    if store.add(key + "problems", 0):
        ranks = store.get(key + "problem_ranks").decode().split()
        message = store.get(key + "problem").decode()
        if len(ranks) == world_size:
            return message
        return f"on rank(s) {', '.join(sorted(ranks, key=int))} of {world_size}: {message}"
    backends = {b: store.add(f"{key}backend/{b}", 0) for b in ("gloo", "nccl")}
    if all(backends.values()):
        return (f"the ranks disagree on their device: {backends['gloo']} would train on CPU with gloo (first: "
                f"{store.get(key + 'backend/gloo/first').decode()}) and {backends['nccl']} on GPUs with NCCL (first: "
                f"{store.get(key + 'backend/nccl/first').decode()}), which cannot form one process group: give "
                "every node GPUs that torch can use, or set trainer.device=cpu on all of them")
    if store.add(key + "shared", 0):
        first = store.get(store.get(key + "shared_gpu").decode() + "/first").decode()
        return (f"{store.get(key + 'shared_by').decode()} uses the same GPU as {first}: NCCL refuses two ranks on "
                "one GPU (ncclInvalidUsage); start one process per GPU (Slurm: --gpus-per-task=1, or as "
                "many tasks per node as GPUs), or trainer.device=cpu for CPU processes")
    return None


def first_to_report(message: str, context: str = "", wait_s: float = 5.0, rank0_grace_s: float = 2.0) -> bool:
    """Whether this rank should print `message`: once per job, by rank 0 when it hit it too.

    A user-facing error is usually raised alike on every rank, sometimes on one rank only (its own
    disk, its own GPU). Rank 0 always prints its own; the other ranks count the message in the
    rendezvous store, and the first of them prints it only if rank 0 has not reported the same
    message within `rank0_grace_s`. So an error every rank hit is printed once, by rank 0
    (whichever rank got there first), and one that only rank 3 hit is printed by rank 3
    within seconds. Before the process group exists (no store) errors come from the config,
    the same everywhere: rank 0 speaks. If the store does not answer within `wait_s` (its
    host has gone), print rather than stay silent.
    """
    rank = _current.rank if _current is not None else _env_int("RANK", 0)
    if _store is None:
        return rank == 0
    key = "mingpt_ddp/error/" + hashlib.sha256(f"{context}\0{message}".encode()).hexdigest()[:32]
    rank0_key = key + "/rank0"
    answer: list[int] = []

    def count() -> None:
        try:
            if rank == 0:
                _store.set(rank0_key, "1")
                answer.append(1)
                return
            if _store.add(key, 1) != 1:
                answer.append(0)  # another rank speaks for this message
                return
            deadline = time.monotonic() + rank0_grace_s
            while time.monotonic() < deadline:
                if _store.check([rank0_key]):
                    answer.append(0)  # rank 0 has it: it prints
                    return
                time.sleep(0.05)
            answer.append(1)
        except Exception:  # store gone: fall back to printing
            pass

    worker = threading.Thread(target=count, daemon=True, name="error-report")
    worker.start()
    worker.join(wait_s + rank0_grace_s)
    return not answer or answer[0] == 1


# A rank's exit code when a collective failed because another rank or the network went away:
# not a bug (no traceback) and not bad input (2): a restart (torchrun, a Slurm requeue) resumes.
LOST_PEERS_EXIT_CODE = 3


class LostPeers(Exception):
    """Another process of the job has gone (the node hosting the rendezvous store, a rank this
    one waited on): a symptom, not this rank's failure. Ends like a failed collective, exit 3
    with no class recorded, so the launchers judge the process that died (a crash, a lost
    node) and not a RunError that only reports it (which train.sbatch would requeue at once)."""


def communication_failure(exc: BaseException) -> Optional[str]:
    """One line for a collective or the job's store failing because another rank or the
    network went away (a node died, a link went down, a peer timed out); None for anything
    else. c10d raises DistError (NCCL, the store); gloo raises a RuntimeError from its TCP
    transport ("Connection closed by peer", "Timed out waiting ... for recv")."""
    if isinstance(exc, LostPeers):
        return str(exc)
    text = str(exc).strip()
    if not (isinstance(exc, torch_dist.DistError) or (isinstance(exc, RuntimeError) and "gloo/transport" in text)):
        return None
    if any(code in text for code in NCCL_NOT_A_LOST_PEER):
        return None  # this rank's own failure: nccl_refused, or a bug / a GPU fault with its traceback
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(exc).__name__)  # "[file.cc:553] "
    first = first.split(". ")[0].rstrip(".")
    return (f"lost contact with the other ranks: {first}. A node left the job or the network between the nodes "
            "failed; restarted (torchrun --max-restarts, a Slurm requeue, or by hand) the job resumes from its "
            "newest snapshot")


# NCCL's errors that no peer caused (torch's getNcclErrorDetailStr names the code in the
# DistBackendError's text: "NCCL error in: ...\nncclInvalidUsage: ...\nLast error:\n..."):
# invalid usage or arguments (two ranks on one GPU, a network plugin NCCL_NET names that is not
# there), and a CUDA call that failed on this rank. ncclRemoteError and ncclSystemError (a
# peer that exited, a socket that failed) stay lost peers.
NCCL_NOT_A_LOST_PEER = ("ncclInvalidUsage", "ncclInvalidArgument", "ncclUnhandledCudaError")
NCCL_USAGE_ERRORS = ("ncclInvalidUsage", "ncclInvalidArgument")


def nccl_refused(exc: BaseException) -> Optional[str]:
    """One line for NCCL refusing this job's setup (ncclInvalidUsage, ncclInvalidArgument):
    a ConfigError, as running it again would fail the same way; None for anything else."""
    text = str(exc)
    code = next((c for c in NCCL_USAGE_ERRORS if c in text), None)
    if code is None or not isinstance(exc, torch_dist.DistError):
        return None
    _, _, last = text.partition("Last error:")
    detail = next((line.strip() for line in last.splitlines() if line.strip()), "")
    return (f"NCCL refused this job's setup ({code}{': ' + detail if detail else ''}): two ranks on one GPU (one "
            "process per GPU), or an NCCL_* setting (NCCL_NET, NCCL_SOCKET_IFNAME) naming what this node lacks; "
            "NCCL_DEBUG=WARN says more")


def release_cached_memory() -> None:
    """Give cached memory back between the points of a sweep: the accelerator's, and the
    host heap that keep_freed_host_memory keeps (else every later point holds the largest
    point's peak RSS)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if _heap_kept:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)


def teardown() -> None:
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def shutdown(clean: bool) -> None:
    """Leave the process group in a defined order before the interpreter exits.

    Left to ``atexit`` or to the interpreter's finalisation, gloo's worker threads can
    still hold the last collectives' work objects (tensors with Python references) and
    try to take the GIL while Python is being torn down: the process then dies with
    ``terminate called without an active exception`` (SIGABRT) after a run that
    finished. Here, while Python is fully alive: drop unreachable objects still
    referencing the group (DDP's reducer), wait until every rank is done with its
    collectives (`clean`: only when all ranks got here the same way, else a rank that
    failed alone would wait on the others forever), then destroy the group.
    """
    import gc

    gc.collect()
    if not torch_dist.is_initialized():
        return
    if clean and _waits_in_store():  # rank 0 may still be finishing (a preview, trackers uploading): not in NCCL's timeout
        try:
            _store_barrier()
        except Exception as exc:  # the store's host has gone: nobody left to wait for
            log.warning("leaving without waiting for the other ranks: %s", exc)
            clean = False
    if clean:
        torch_dist.barrier()
    torch_dist.destroy_process_group()
    gc.collect()


def barrier() -> None:
    if torch_dist.is_initialized():
        torch_dist.barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank `src`'s object on every rank (the object itself when not distributed)."""
    if not torch_dist.is_initialized():
        return obj
    holder = [obj]
    torch_dist.broadcast_object_list(holder, src=src)
    return holder[0]


BROADCAST_CHUNK_BYTES = 64 << 20


def broadcast_bytes(data: Optional[bytes], size: int, src: int = 0) -> Any:
    """Rank `src`'s `size` bytes on every rank (`data` there; None elsewhere), sent in chunks
    of BROADCAST_CHUNK_BYTES: beside the bytes themselves each rank holds one chunk, on the
    process group's device (NCCL sends CUDA tensors only), never a pickled copy of the
    whole. Returns `data` on `src`, a bytes-like buffer elsewhere."""
    if not torch_dist.is_initialized():
        return data
    mine = torch_dist.get_rank() == src
    host = None if mine else torch.empty(size, dtype=torch.uint8)
    device = _current.device if _current is not None else torch.device("cpu")
    chunk = torch.empty(min(size, BROADCAST_CHUNK_BYTES), dtype=torch.uint8, device=device)
    view = memoryview(data) if mine else None
    for start in range(0, size, BROADCAST_CHUNK_BYTES):
        n = min(BROADCAST_CHUNK_BYTES, size - start)
        if mine:
            with warnings.catch_warnings():  # only read from: the buffer of immutable bytes is fine
                warnings.simplefilter("ignore", UserWarning)
                chunk[:n].copy_(torch.frombuffer(view[start:start + n], dtype=torch.uint8))
        torch_dist.broadcast(chunk[:n], src=src)
        if not mine:
            host[start:start + n].copy_(chunk[:n])
    return data if mine else memoryview(host.numpy())


def all_gather_object(obj: Any) -> list:
    if not torch_dist.is_initialized():
        return [obj]
    out: list = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(out, obj)
    return out


# ---- waiting for work only some ranks do: in the rendezvous store, not in a collective ------
def _waits_in_store() -> bool:
    return _store is not None and _current is not None and _current.is_distributed


def _outcome(fn: Callable[[], T]) -> tuple[tuple[str, Any], Optional[BaseException]]:
    """(("ok", result) | ("error", (class name, message)) | ("bug", text), the exception to re-raise here)."""
    try:
        return ("ok", fn()), None
    except UserFacingError as exc:
        return ("error", (type(exc).__name__, str(exc))), exc
    except BaseException as exc:  # noqa: BLE001: re-raised by the caller, told to the others first
        return ("bug", f"{type(exc).__name__}: {exc}"), exc


def _post(key: str, outcome: tuple[str, Any], readers: int) -> None:
    """Publish `outcome` under `key`; after a failure, give the `readers` a few seconds to read
    it before this rank goes on to exit (under plain srun rank 0 hosts the store)."""
    _store.set(key, pickle.dumps(outcome))
    if outcome[0] == "ok" or readers == 0:
        return
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and _store.add(key + "/read", 0) < readers:
        time.sleep(0.05)


def _await(keys: list[str], what: str, hint: str = "") -> list[tuple[str, Any]]:
    """The outcomes under `keys`, waiting up to the rank-0 wait. Polled (check, then a short
    sleep, doubling up to 0.5 s) rather than a blocking store wait, so signal handlers run.
    `hint` replaces the default advice (a hung node) where slow work is the likelier cause."""
    deadline = time.monotonic() + 60 * _rank0_wait_minutes
    delay = 0.002
    try:
        while not _store.check(keys):
            if time.monotonic() >= deadline:
                raise RunError(
                    f"waited {_rank0_wait_minutes:g} minutes for {what} (trainer.save_retry_minutes or "
                    "load_retry_minutes plus 5): " + (hint or "its storage or its process hangs; check that node, "
                                                      "then run the same command to resume from the newest snapshot"))
            time.sleep(delay)
            delay = min(2 * delay, 0.5)
        outcomes = [pickle.loads(_store.get(key)) for key in keys]
        for key in keys:
            _store.add(key + "/read", 1)
    except UserFacingError:
        raise
    except Exception as exc:
        raise LostPeers(f"lost the job's rendezvous store while waiting for {what} ({type(exc).__name__}): "
                        "the node that hosts it has gone; run the same command to resume") from None
    return outcomes


def _raise_outcome(outcome: tuple[str, Any], who: str) -> Any:
    kind, value = outcome
    if kind == "error":
        name, message = value
        raise by_name(name)(message)
    if kind == "bug":
        raise RuntimeError(f"{who} failed: {value}")
    return value


def _first_failure_or_result(outcomes: list[tuple[int, tuple[str, Any]]], me: int,
                             mine: Optional[BaseException]) -> Any:
    """The first runner's result, unless a runner failed: then every rank raises the first
    failure (a user-facing error before a bug), the rank that had it its own exception."""
    for kind in ("error", "bug"):
        for rank, outcome in outcomes:
            if outcome[0] == kind:
                if rank == me and mine is not None:
                    raise mine
                _raise_outcome(outcome, f"rank {rank}")
    return outcomes[0][1][1]


def _share_by_collective(fn: Callable[[], T], runs_here: bool) -> T:
    """The runners' outcomes by a collective: for a process group made without setup()'s
    store (alone, it is just `fn`)."""
    outcome, exc = _outcome(fn) if runs_here else (("ok", None), None)
    if not torch_dist.is_initialized():
        if exc is not None:
            raise exc
        return outcome[1]
    outcomes = all_gather_object(outcome)
    return _first_failure_or_result(list(enumerate(outcomes)), torch_dist.get_rank(), exc)


def wait_for_main(work: Callable[[], T], what: str) -> T:
    """`work` on rank 0 only; every rank gets its result (or raises its error).

    The other ranks wait in the rendezvous store, not in a collective of the training
    process group: rank 0's work may take as long as a save retried for
    trainer.save_retry_minutes, while the training group's (NCCL's) timeout,
    trainer.collective_timeout_minutes, stays minutes, so that a hung GPU or a lost node
    ends the job soon. `what` says what rank 0 is doing, for the message if it never ends.
    """
    if not _waits_in_store():
        return _share_by_collective(work, not torch_dist.is_initialized() or torch_dist.get_rank() == 0)
    key = f"mingpt_ddp/rank0/{next(_rounds)}"
    if _current.is_main:
        outcome, exc = _outcome(work)
        _post(key, outcome, readers=_current.world_size - 1)
        if exc is not None:
            raise exc
        return outcome[1]
    return _raise_outcome(_await([key], f"rank 0 {what}")[0], "rank 0")


def _runner_ranks() -> list[int]:
    """The ranks that are local rank 0 of their node (one collective, the first time)."""
    global _runners
    if _runners is None:
        _runners = [r for r, first in enumerate(all_gather_object(_current.local_rank == 0)) if first]
    return _runners


def on_main_then_share(fn: Callable[[], T], dist: DistEnv, *, once_per_node: bool = False) -> T:
    """Run `fn` on rank 0 (or on each node's local rank 0) and share the outcome.

    For work only one process may do (write to the filesystem, download, encode a corpus):
    every rank gets rank 0's result, or raises the same user-facing error if any runner failed,
    so nobody waits forever on a rank that gave up. The others wait in the rendezvous store
    (as in wait_for_main), so slow work does not run into the training group's timeout.
    """
    if not once_per_node:
        return wait_for_main(fn, "preparing the run")
    if not _waits_in_store():
        return _share_by_collective(fn, dist.local_rank == 0)
    runners = _runner_ranks()
    base = f"mingpt_ddp/node0/{next(_rounds)}"
    mine: Optional[BaseException] = None
    if dist.local_rank == 0:
        outcome, mine = _outcome(fn)
        _post(f"{base}/{dist.rank}", outcome, readers=0)
    outcomes = _await([f"{base}/{r}" for r in runners], "each node's first process preparing its data",
                      hint="a corpus that takes longer to encode is prepared ahead, once per node-local cache or "
                           "once for a shared one: python -m mingpt_ddp.prepare <the same data.* overrides> (or "
                           "raise trainer.load_retry_minutes); if it is not that, check that node's storage")
    return _first_failure_or_result(list(zip(runners, outcomes)), dist.rank, mine)


def _store_barrier() -> None:
    """Every rank has got here, waited for in the store (up to the rank-0 wait)."""
    key = f"mingpt_ddp/barrier/{next(_rounds)}"
    _store.add(key, 1)
    deadline = time.monotonic() + 60 * _rank0_wait_minutes
    delay = 0.002
    while _store.add(key, 0) < _current.world_size:
        if time.monotonic() >= deadline:
            raise RunError(f"waited {_rank0_wait_minutes:g} minutes for the other ranks to finish")
        time.sleep(delay)
        delay = min(2 * delay, 0.5)


# The training group's collectives while the ranks may still be compiling (issue 30): a cold
# compile can take minutes longer on one rank than on another (its cache, its node's load),
# while the others already wait in the first step's all-reduce.
COMPILE_COLLECTIVE_TIMEOUT_MINUTES = 30.0
_collective_timeout: Optional[datetime.timedelta] = None  # the configured one, set by setup()
_extended = False


def extend_collective_timeout(minutes: float = COMPILE_COLLECTIVE_TIMEOUT_MINUTES) -> bool:
    """The training group's collectives issued from now on wait at least `minutes` (until
    restore_collective_timeout()). _set_pg_timeout sets the backends' default timeout, which
    each collective takes when it is issued (ProcessGroupNCCL's watchdog times a work item by
    its own timeout), so issued ones keep it after the restore; torch's own
    torch.distributed.breakpoint() lengthens a group's timeout the same way. Restore only
    after a host sync on the long collectives, so that none issued later runs while a rank
    may still be compiling. Returns whether this call lengthened it: only that caller restores
    (an evaluation inside the first step's extension must not end it: a resume at an epoch's
    end evaluates before its first step)."""
    global _extended
    setter = getattr(torch_dist.distributed_c10d, "_set_pg_timeout", None)
    if (_extended or setter is None or not torch_dist.is_initialized() or _collective_timeout is None
            or minutes * 60 <= _collective_timeout.total_seconds()):
        return False
    setter(datetime.timedelta(minutes=minutes))
    _extended = True
    return True


def restore_collective_timeout() -> None:
    """Back to trainer.collective_timeout_minutes (a no-op where it was not extended)."""
    global _extended
    if _extended and torch_dist.is_initialized():
        torch_dist.distributed_c10d._set_pg_timeout(_collective_timeout)
    _extended = False


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if torch_dist.is_initialized():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    if torch_dist.is_initialized():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
    return tensor


def on_every_rank(fn: Callable[[], T], dist: DistEnv) -> T:
    """Run `fn` on every rank; if it raised a ConfigError or RunError on any rank, raise it on all.

    For steps that can fail on some ranks only (a node's own disk or cache): without this,
    the failing ranks would leave (or, in a sweep, go on to the next point) while the
    others wait in the next collective.
    """
    result, error = None, None
    try:
        result = fn()
    except UserFacingError as exc:
        error = (type(exc).__name__, str(exc))
    errors = [(rank, e) for rank, e in enumerate(all_gather_object(error)) if e is not None]
    if errors:
        error_type, message = by_name(errors[0][1][0]), errors[0][1][1]
        if len(errors) == dist.world_size:
            raise error_type(message)
        raise error_type(f"on rank(s) {', '.join(str(r) for r, _ in errors)} of {dist.world_size}: {message}")
    return result
