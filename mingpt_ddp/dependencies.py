"""A missing third-party package, or a torch older than the code needs, said once per node
in one line instead of a traceback from every rank (e.g. a checkout mounted into a container
image that has torch but not hydra-core, or an older torch). Standard library only: it runs
before any dependency is imported (the package's __init__ checks torch's version).
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import itertools
import os
import re
import socket
import sys
from typing import Optional

from mingpt_ddp.errors import ConfigError, record  # standard library only

# import name -> pip requirement (floors as in pyproject.toml)
PACKAGES = {
    "hydra": "hydra-core>=1.3",
    "omegaconf": "omegaconf>=2.3",
    "fsspec": "fsspec>=2023.6",
    "s3fs": "s3fs>=2024.12",
    "torch": "torch>=2.9",
    "numpy": "numpy",
    "yaml": "PyYAML",
    "antlr4": "antlr4-python3-runtime",
}
EXIT_CODE = ConfigError.exit_code  # the user can fix it

# The oldest torch release with every torch API this code uses (pyproject.toml says the
# same; tests/test_torch_floor.py ties them together). What needs which release:
#   2.9  torch.distributed.checkpoint.staging.DefaultStager/StagingOptions (sharded_snapshot.py)
#   2.6  torch.distributed.fsdp.fully_shard/MixedPrecisionPolicy as public names (parallel.py);
#        broadcast_object_list(group_src=...) (sharded_snapshot.py)
TORCH_FLOOR = (2, 9)


def missing_message(module: str) -> str:
    top = module.split(".")[0]
    requirement = PACKAGES.get(top, top)
    pip_name = requirement.split(">")[0]
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    where = f" on {socket.gethostname()}" if rank != "0" else ""
    return (f"error: {sys.executable}{where} lacks the Python package {pip_name} (import {top} failed): "
            f"install it with `{sys.executable} -m pip install '{requirement}'` (in a container image: "
            "add it to the image, without replacing the image's torch), or point PYTHON at an "
            "environment that has it")


def require(*modules: str) -> None:
    """Exit with one `error:` line (code 2) when one of `modules` cannot be imported here.

    Checked with find_spec, before importing anything. Printed by each node's local rank 0
    (every rank of a node shares its Python), so a node whose image differs still speaks.
    """
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            message = missing_message(module)
            record(ConfigError, message.removeprefix("error: "))
            if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":  # torchrun, or plain srun
                print(message, file=sys.stderr, flush=True)
            sys.exit(EXIT_CODE)


def release(version: str) -> tuple[int, ...]:
    """(2, 9, 1) from "2.9.1+cu128"; NVIDIA's "2.9.0a0+git..." builds of the 2.9 branch count as 2.9."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) < len(part):  # "0a0", "0rc1", "0.dev2024": the release ends here
            break
    return tuple(numbers)


def torch_too_old_message(version: str, floor: tuple[int, ...] = TORCH_FLOOR) -> Optional[str]:
    """The one line for a torch older than `floor`, or None when it is recent enough."""
    if release(version) >= floor:
        return None
    needed = ".".join(map(str, floor))
    return (f"error: {sys.executable} has torch {version}, older than the torch>={needed} this trainer needs "
            f"(FSDP2 and sharded-snapshot APIs): install it with `{sys.executable} -m pip install 'torch>={needed}'`, "
            f"or in a container use an image with torch {needed} or newer (launch/Dockerfile's default has one)")


def torch_version(spec: importlib.machinery.ModuleSpec) -> str:
    """The version of the torch `spec` finds, read from its version.py without importing torch:
    the torchrun agent (mingpt_ddp.tools.torchrun) imports torch itself, with c10's C++ log level
    set first (c10 reads it once, at torch's first import)."""
    for location in spec.submodule_search_locations or []:
        try:
            with open(os.path.join(location, "version.py"), encoding="utf-8") as f:
                found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
        except OSError:
            continue
        if found:
            return found.group(1)
    import torch  # a build without version.py

    return str(torch.__version__)


def require_torch() -> None:
    """Exit with one `error:` line (code 2) when the importable torch is older than TORCH_FLOOR.

    Run by the package's __init__, before anything else of the package: an older torch
    would otherwise start training and fail at the first API it lacks, possibly hours in
    (the first sharded save). Without torch at all, require("torch") says so later.
    """
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return
    message = torch_too_old_message(torch_version(spec))
    if message is None:
        return
    record(ConfigError, message.removeprefix("error: "))
    if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":
        print(message, file=sys.stderr, flush=True)
    sys.exit(EXIT_CODE)
