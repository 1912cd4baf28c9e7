"""The GPUs torch can use on this node, as the workers will see them.

    python -m mingpt_ddp.devices [NODE_GPUS]    # prints: 8   (or 0 on a node without GPUs)

launch/multinode.sh starts one worker per GPU that torch sees, not per GPU that nvidia-smi
or CUDA_VISIBLE_DEVICES names: on a node whose torch cannot use its GPUs (a torch built
without CUDA, a driver older than torch's CUDA, a container given none of them) those would
be as many CPU workers training without a word. There, unless CPU was asked for
(CUDA_VISIBLE_DEVICES set empty, as DEVICE=cpu does), it exits 2 with the one `error:` line
the trainer would stop with (distributed.gpu_problem). NODE_GPUS: the node's GPUs where the
launcher knows better than the driver's listing (Slurm's Gres); default GPU_INVENTORY's count.
"""
from __future__ import annotations

import sys

import torch

from mingpt_ddp import distributed
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.tools import usage


USAGE = "usage: python -m mingpt_ddp.devices [NODE_GPUS]"


def main(argv: list[str]) -> int:
    try:
        _, argv = usage.options(argv, __doc__, USAGE)
        if len(argv) > 1 or (argv and not argv[0].isdigit()):
            raise ConfigError(f"NODE_GPUS is one number of GPUs ({USAGE})")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ConfigError.exit_code
    if torch.cuda.is_available():
        print(torch.cuda.device_count())
        return 0
    listed = int(argv[0]) if argv and argv[0].isdigit() else None
    problem = distributed.gpu_problem("auto", listed=listed)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    print(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
