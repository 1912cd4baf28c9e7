"""mingpt-ddp: a minGPT trainer for multi-node PyTorch DDP."""
from mingpt_ddp.dependencies import require_torch as _require_torch

# Before anything else of the package: an older torch is one line naming the release needed,
# not a failure at the first API it lacks (every entry point imports this package first).
_require_torch()

# Old command names only: `python -m mingpt_ddp.bench` (sample, export, preflight, plot, prepare,
# network, torchrun, ...) finds mingpt_ddp/tools/bench.py. Code imports mingpt_ddp.tools.X.
__path__.append(__path__[0] + "/tools")
