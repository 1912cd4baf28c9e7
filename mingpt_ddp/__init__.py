"""mingpt-ddp: a minGPT trainer for multi-node PyTorch DDP.

The training path sits in this directory; checkpoint/ holds where snapshots live and who may
write them, corpus/ turns files into token ids, tools/ the commands off the training path.
"""
import os as _os

from mingpt_ddp.dependencies import require_torch as _require_torch

# Before anything else of the package: an older torch is one line naming the release needed,
# not a failure at the first API it lacks (every entry point imports this package first).
_require_torch()

# `python -m mingpt_ddp.bench` (sample, export, plot, preflight, prepare, torchrun, network...)
# worked before the tools moved into tools/, and scripts and docs use those names: the package
# also looks in tools/ for a name it does not have itself. Code imports mingpt_ddp.tools.<name>.
__path__.append(_os.path.join(_os.path.dirname(__file__), "tools"))
