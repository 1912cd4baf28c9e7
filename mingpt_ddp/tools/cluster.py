"""What the Slurm cluster's nodes offer, for the submitit launcher's defaults
(conf/hydra/launcher/slurm.yaml): CPUs per task = a node's CPUs / tasks per node.

Without it submitit asks for no CPU count and Slurm gives each task one CPU, so a GPU rank
shares a core with NCCL's proxy threads and inductor's compile workers.
"""
from __future__ import annotations

import functools
import subprocess
from typing import Optional

from omegaconf import OmegaConf

RESOLVER = "mingpt_cpus_per_task"


@functools.lru_cache(maxsize=None)
def node_cpus(partition: Optional[str]) -> Optional[int]:
    """CPUs of the smallest node of `partition` (None: the default partition), from sinfo;
    None when sinfo is not here or says nothing."""
    cmd = ["sinfo", "-h", "-N", "-o", "%c %P"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    counts = []
    for line in out.stdout.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0].isdigit() and (partition or fields[1].endswith("*")):
            counts.append(int(fields[0]))
    return min(counts) if counts else None


def cpus_per_task(partition: Optional[str], tasks_per_node: int) -> Optional[int]:
    cpus = node_cpus(partition or None)
    return max(1, cpus // max(1, int(tasks_per_node))) if cpus else None


def register_resolvers() -> None:
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, cpus_per_task)
