"""Pre-flight checks of every node and of the network, before a long run.

    PREFLIGHT=1 launch/multinode.sh ...          # or PREFLIGHT=only; train.sbatch passes it on
    torchrun --nnodes=2 --nproc_per_node=8 ... -m mingpt_ddp.preflight

Runs on every rank of the job's own torchrun topology. Each node reports its host, devices
(GPU count, model and memory, or CPU cores), torch/CUDA/NCCL versions and the FI_*/NCCL_*
variables its workers actually see (under Pyxis the image's ENV wins over the job's
exports); then an all_reduce sweep over all ranks (`bench comm`) prints size/algbw/busbw as
nccl-tests do, and the transport each rank's collectives use (NCCL: P2P, SHM or NET/<plugin>
with its provider, from NCCL's own log; gloo: the interface).
It exits 0 when everything holds, else with code 2 and one `error:` line (rank 0) naming
the node and what is wrong:

- a node whose NVIDIA driver lists GPUs that torch cannot use (a torch built without CUDA, a
  driver older than torch's CUDA, a container or job given none of them), unless CPU was asked
  for (DEVICE=cpu, CUDA_VISIBLE_DEVICES set empty): the line the trainer would stop with;
- a node has fewer GPUs than workers (or none while the others have some);
- torch, CUDA, NCCL or Python versions differ between nodes;
- the all_reduce gave wrong sums or non-finite values on any rank (the first such rank and
  its node are named), or its busbw at the largest size is below PREFLIGHT_MIN_BUSBW
  (GB/s; unset: not checked);
- a node expects EFA (EFA=1, as launch/multinode.sh resolves EFA=auto; by hand, EFA unset:
  an EFA device) but NCCL connected it to the other nodes over TCP sockets (NET/Socket).

PREFLIGHT_MAX_BYTES sets the largest all_reduce [256MB with GPUs, 4MB on CPUs].
"""
from __future__ import annotations

import datetime
import glob
import os
import platform
import shutil
import socket
import subprocess
import sys
from typing import Any, Optional

import torch
import torch.distributed as torch_dist

from mingpt_ddp.tools import bench
from mingpt_ddp import distributed
from mingpt_ddp.distributed import DistEnv
from mingpt_ddp.errors import ConfigError, UserFacingError, record
from mingpt_ddp.tools import usage

TIMEOUT = datetime.timedelta(minutes=10)


# The fabric settings a worker runs with. Reported as the process sees them: under Pyxis the
# image's ENV lines win over what the job exported, so what launch/multinode.sh exported may
# not be what runs.
FABRIC_ENV_PREFIXES = ("FI_", "NCCL_", "OFI_NCCL_", "GLOO_SOCKET_IFNAME")


def fabric_environment() -> dict[str, str]:
    """The FI_*, NCCL_*, OFI_NCCL_* and GLOO_SOCKET_IFNAME variables of this process."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(FABRIC_ENV_PREFIXES)}


def efa_expected(env: Optional[dict[str, str]] = None, sysfs: str = "/sys/class/infiniband") -> bool:
    """Whether this node's collectives should leave it over EFA: EFA=1/on (launch/multinode.sh
    exports its resolved choice), not for EFA=0/off; else (run by hand, EFA unset or auto) as
    multinode.sh's auto decides: a device in `sysfs` bound to the efa driver, or `fi_info -p
    efa` succeeding."""
    env = os.environ if env is None else env
    value = env.get("EFA", "auto").strip().lower()
    if value in ("1", "on"):
        return True
    if value in ("0", "off"):
        return False
    if any(os.path.basename(os.path.realpath(os.path.join(dev, "device", "driver"))) == "efa"
           for dev in glob.glob(os.path.join(sysfs, "*"))):
        return True
    for fi_info in (shutil.which("fi_info", path=env.get("PATH")), "/opt/amazon/efa/bin/fi_info"):
        if fi_info and os.access(fi_info, os.X_OK):
            try:
                if subprocess.run([fi_info, "-p", "efa"], capture_output=True, timeout=20).returncode == 0:
                    return True
            except (OSError, subprocess.TimeoutExpired):
                pass
    return False


def node_facts(local_world_size: int, fabric: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """What this process sees of its node."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    props = [torch.cuda.get_device_properties(i) for i in range(gpus)]
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if gpus else None
    except (AttributeError, RuntimeError):
        nccl = None
    return {
        "host": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        "workers": local_world_size,
        "gpus": gpus,
        "gpu_models": sorted({p.name for p in props}),
        "gpu_memory_gib": round(min((p.total_memory for p in props), default=0) / 2**30, 1),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "python": platform.python_version(),
        "fabric_env": fabric_environment() if fabric is None else fabric,
        "efa": efa_expected(),
        # A node whose driver lists GPUs that torch cannot use, unless CPU was asked for (DEVICE=cpu):
        # the same line main.py stops with (distributed.gpu_problem), else None.
        "gpu_problem": None if gpus else distributed.gpu_problem("auto"),
    }


def describe(f: dict[str, Any]) -> str:
    devices = (f"{f['gpus']} x {'/'.join(f['gpu_models'])} ({f['gpu_memory_gib']} GiB)" if f["gpus"]
               else f"CPU, {f['cpu_cores']} cores")
    fabric = " ".join(f"{k}={v}" for k, v in f.get("fabric_env", {}).items()) or "no FI_*/NCCL_* variables"
    return (f"node {f['host']}: {f['workers']} worker(s) | {devices} | torch {f['torch']} CUDA {f['cuda'] or '-'} "
            f"NCCL {f['nccl'] or '-'} | Python {f['python']} | workers see: {fabric}")


def versions(f: dict[str, Any]) -> str:
    return f"torch {f['torch']} / CUDA {f['cuda'] or '-'} / NCCL {f['nccl'] or '-'} / Python {f['python']}"


def per_node(facts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per host, in rank order (every rank of a node reports the same)."""
    nodes: dict[str, dict[str, Any]] = {}
    for f in facts:
        nodes.setdefault(f["host"], f)
    return list(nodes.values())


def check_nodes(nodes: list[dict[str, Any]]) -> Optional[str]:
    """The first problem with the nodes, as one sentence naming the node; None when all hold."""
    for n in nodes:
        if n.get("gpu_problem"):
            return n["gpu_problem"]
    with_gpus = [n for n in nodes if n["gpus"]]
    for n in nodes:
        if with_gpus and n["gpus"] < n["workers"]:
            where = f"node {n['host']} has {n['gpus']} GPU(s) for {n['workers']} worker(s)"
            if not n["gpus"]:
                where += f" while node {with_gpus[0]['host']} has {with_gpus[0]['gpus']}"
            return (f"{where}: start one worker per GPU (NPROC_PER_NODE={n['gpus']} or unset), or check "
                    f"CUDA_VISIBLE_DEVICES, the job's --gpus-per-node and `nvidia-smi` on {n['host']}")
    reference = nodes[0]
    for n in nodes[1:]:
        if versions(n) != versions(reference):
            return (f"versions differ between nodes: {n['host']} has {versions(n)}, {reference['host']} has "
                    f"{versions(reference)}: run every node from the same image or environment (PYTHON, "
                    "CONTAINER_IMAGE)")
    return None


def own_failure(result: dict[str, Any]) -> Optional[dict[str, Any]]:
    """This rank's first all_reduce size whose check sum came out wrong, else the first whose
    timed data was no longer finite; None when all held. Each rank sees only its own copy
    of the result: a faulty GPU or link shows in its rank's sums alone (while non-finite
    values spread to every rank through the sums that follow)."""
    rows = [r for r in result["rows"] if r["wrong"]] or [r for r in result["rows"]
                                                        if not r.get("timed_data_finite", True)]
    return {"size": rows[0]["size"], "wrong": rows[0]["wrong"]} if rows else None


def check_comm(result: dict[str, Any], facts: list[dict[str, Any]], min_busbw: Optional[float],
               failures: list[Optional[dict[str, Any]]]) -> Optional[str]:
    """A wrong or non-finite result on any rank (`failures`: own_failure of every rank, in
    rank order; the first rank with a wrong sum is named, else the first with non-finite
    values), or busbw at the largest size below `min_busbw` GB/s. `facts`: node_facts of
    every rank, in rank order."""
    hosts = ", ".join(n["host"] for n in per_node(facts))
    failed = [(rank, f) for rank, f in enumerate(failures) if f is not None and f["wrong"]]
    failed = failed or [(rank, f) for rank, f in enumerate(failures) if f is not None]
    if failed:
        rank, f = failed[0]
        what = f"{f['wrong']} wrong value(s)" if f["wrong"] else "non-finite values (inf/NaN)"
        others = f" (and on {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        return (f"all_reduce over {result['ranks']} ranks on {hosts} gave {what} at {f['size']} bytes on rank {rank} "
                f"(node {facts[rank]['host']}){others}: a faulty GPU or link; rerun with NCCL_DEBUG=INFO, check "
                f"`nvidia-smi -q` on {facts[rank]['host']} for ECC errors and replace the node")
    last = result["rows"][-1]
    if min_busbw is not None and result["ranks"] > 1 and last["busbw_GBps"] < min_busbw:
        return (f"all_reduce busbw {last['busbw_GBps']:.3f} GB/s at {last['size']:,} bytes over {result['ranks']} "
                f"ranks on {hosts} is below PREFLIGHT_MIN_BUSBW={min_busbw:g} GB/s: check that NCCL uses EFA "
                "(NCCL_DEBUG=INFO names the OFI/EFA provider), the instance types, and rerun `bench comm` "
                "on node pairs to find a slow one")
    return None


def check_transport(transport: list[dict[str, Any]], facts: list[dict[str, Any]]) -> Optional[str]:
    """A rank whose node expects EFA (facts' "efa") but whose NCCL channels to other nodes are
    TCP sockets: NCCL names its network transport in each channel's INFO line, "Channel 00/0 :
    0[0] -> 8[0] [send] via NET/<network>/<device>" (src/transport/net.cc, with the network's
    name: "Socket" for NCCL's own TCP transport, src/transport/net_socket.cc; "Libfabric" or
    "AWS Libfabric" for aws-ofi-nccl), read by bench.nccl_transport from the sweep's own log.
    No NET channel (one node) is no fallback; a log that could not be read is not judged."""
    for t in transport:
        if not facts[t["rank"]].get("efa") or t.get("backend") != "nccl":
            continue
        sockets = t.get("channels", {}).get("NET/Socket", 0)
        provider = t.get("provider")
        if provider and provider.lower() != "efa" and any(k.startswith("NET/") for k in t.get("channels", {})):
            return (f"node {t['host']} (rank {t['rank']}) has EFA but aws-ofi-nccl runs on libfabric's {provider!r} "
                    f"provider, not efa ({bench.describe_transport(t)}): unset FI_PROVIDER or set FI_PROVIDER=efa, "
                    "check that `fi_info -p efa` lists devices inside the container; or set EFA=0 to train "
                    "without EFA on purpose")
        if sockets:
            return (f"node {t['host']} (rank {t['rank']}) has EFA but NCCL connects it to the other nodes over TCP "
                    f"sockets ({bench.describe_transport(t)}): NCCL did not load the aws-ofi-nccl plugin, or "
                    "libfabric found no EFA device. Check that the image or environment has aws-ofi-nccl "
                    "(libnccl-net*.so on LD_LIBRARY_PATH, or NCCL_NET_PLUGIN), that `fi_info -p efa` lists devices "
                    "inside the container, and that the security group allows all traffic to itself; or set EFA=0 "
                    "to train over TCP on purpose")
    return None


def settings() -> tuple[Optional[float], str]:
    """(PREFLIGHT_MIN_BUSBW or None, PREFLIGHT_MAX_BYTES)."""
    raw = os.environ.get("PREFLIGHT_MIN_BUSBW", "").strip()
    try:
        min_busbw = float(raw) if raw else None
    except ValueError:
        raise ConfigError(f"PREFLIGHT_MIN_BUSBW={raw}: give GB/s as a number, or leave it unset") from None
    max_bytes = os.environ.get("PREFLIGHT_MAX_BYTES") or ("256MB" if torch.cuda.is_available() else "4MB")
    try:
        bench.parse_bytes(max_bytes)
    except (ValueError, ConfigError):
        raise ConfigError(f"PREFLIGHT_MAX_BYTES={max_bytes}: give a size such as 64MB") from None
    return min_busbw, max_bytes


def join() -> DistEnv:
    """The process group: gloo for the facts (CPU objects), NCCL for CUDA tensors.

    No collective touches a GPU before the device counts are checked, so a node with too few
    GPUs is reported instead of failing inside NCCL.
    """
    rank, local_rank, world_size, local_world_size = distributed.read_topology()
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank % torch.cuda.device_count()), "cpu:gloo,cuda:nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world_size > 1:
        torch_dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                      timeout=TIMEOUT)
    return DistEnv(rank, local_rank, world_size, local_world_size, device, backend.split(":")[-1])


def run() -> Optional[str]:
    """The checks; the problem found (same on every rank), or None."""
    min_busbw, max_bytes = settings()
    fabric = fabric_environment()  # as launched, before NCCL's log is sent to a file to name its transport
    bench.nccl_log_to_files()
    dist = join()
    facts = distributed.all_gather_object(node_facts(dist.local_world_size, fabric))
    nodes = per_node(facts)
    if dist.is_main:
        print(f"preflight: {len(nodes)} node(s), {dist.world_size} rank(s)")
        for n in nodes:
            print(f"preflight: {describe(n)}", flush=True)
    problem = check_nodes(nodes)
    if problem is None:
        if dist.device.type == "cuda":
            torch.cuda.set_device(dist.device)
        # Seven sizes up to the largest: enough to see the bandwidth curve flatten, quick on CPUs.
        options = {**bench.OPTIONS, "min_bytes": str(max(8, bench.parse_bytes(max_bytes) // 64)), "max_bytes": max_bytes}
        result = bench.run_comm(dist, options, [])
        if dist.is_main:
            bench.report("comm", {**result, "env": bench.environment(dist)})
        failures = distributed.all_gather_object(own_failure(result))  # every rank's own check, not rank 0's
        problem = check_comm(result, facts, min_busbw, failures) or check_transport(result["transport"], facts)
        unread = [t for t in result["transport"] if facts[t["rank"]].get("efa") and "unknown" in t]
        if problem is None and unread and dist.is_main:
            print(f"preflight: warning: EFA expected but NCCL's transport not checked on rank(s) "
                  f"{','.join(str(t['rank']) for t in unread)}: {unread[0]['unknown']}", flush=True)
        if problem is None and dist.is_main:
            last = result["rows"][-1]
            print(f"preflight: passed: {len(nodes)} node(s), {dist.world_size} rank(s), busbw "
                  f"{last['busbw_GBps']:.3f} GB/s at {last['size']:,} bytes"
                  + (f" (PREFLIGHT_MIN_BUSBW={min_busbw:g})" if min_busbw is not None else ""), flush=True)
    # The verdict is an object collective (gloo, CPU): it also keeps every rank here until rank 0
    # has reported. No barrier: with too few GPUs it would run NCCL on a shared device.
    problem = distributed.broadcast_object(problem)
    distributed.teardown()
    return problem


USAGE = "usage: [PREFLIGHT_MIN_BUSBW=GB/s] torchrun ... -m mingpt_ddp.preflight   (no arguments)"


def main(argv: Optional[list[str]] = None) -> int:
    try:
        _, argv = usage.options(sys.argv[1:] if argv is None else argv, __doc__, USAGE)
        if argv:
            raise ConfigError(f"preflight takes no arguments, got {argv[0]!r} ({USAGE})")
    except ConfigError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return ConfigError.exit_code
    try:
        problem = run()
    except UserFacingError as exc:
        problem = str(exc)
    if problem is None:
        return 0
    record(ConfigError, f"preflight: {problem}")
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: preflight: {problem}", file=sys.stderr, flush=True)
    return ConfigError.exit_code


if __name__ == "__main__":
    sys.exit(main())
