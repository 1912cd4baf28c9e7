"""`python -m mingpt_ddp.preflight` with the all_reduce results of the ranks in FAULTY_RANKS
corrupted after the real collective, as a faulty GPU or link would: one wrong value per
call. Run under torchrun by test_preflight.py."""
import os
import sys

import torch
import torch.distributed as torch_dist

from mingpt_ddp.tools import preflight

real_all_reduce = torch_dist.all_reduce


def faulty_all_reduce(tensor, *args, **kwargs):
    work = real_all_reduce(tensor, *args, **kwargs)
    if tensor.dtype == torch.float32 and tensor.numel() > 1:  # the sweep's buffers, not its timings
        tensor[0] += 1
    return work


if os.environ["RANK"] in os.environ.get("FAULTY_RANKS", "").split(","):
    torch_dist.all_reduce = faulty_all_reduce
sys.exit(preflight.main())
