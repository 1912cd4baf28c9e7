"""A missing third-party package, said once per node in one line instead of an ImportError
traceback from every rank (e.g. a checkout mounted into a container image that has torch
but not hydra-core). Standard library only: it runs before any dependency is imported.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import sys

# import name -> pip requirement (floors as in pyproject.toml)
PACKAGES = {
    "hydra": "hydra-core>=1.3",
    "omegaconf": "omegaconf>=2.3",
    "fsspec": "fsspec>=2023.6",
    "s3fs": "s3fs>=2024.12",
    "torch": "torch>=2.4",
    "numpy": "numpy",
    "yaml": "PyYAML",
    "antlr4": "antlr4-python3-runtime",
}
EXIT_CODE = 2  # as ConfigError: the user can fix it


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
            if os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0":  # torchrun, or plain srun
                print(missing_message(module), file=sys.stderr, flush=True)
            sys.exit(EXIT_CODE)
