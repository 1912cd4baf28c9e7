"""trainer.deterministic: the same bits from the same state, on GPUs too.

Without it a resumed GPU run continues with the same data, order and step as an
uninterrupted one, but not bitwise: cuBLAS, cuDNN, atomics in some backward kernels and
inductor's autotuning may each sum in another order. With it every known source is pinned:
deterministic kernels or a clear error (torch.use_deterministic_algorithms), a fixed cuBLAS
workspace (CUBLAS_WORKSPACE_CONFIG, read before the first cuBLAS call), cuDNN's deterministic
algorithms without benchmarking, and inductor's deterministic mode (no autotuning that
changes numerics). NCCL's reductions are deterministic for the same world size, GPUs and
NCCL settings.
"""
from __future__ import annotations

import os

import torch

from mingpt_ddp.errors import ConfigError

CUBLAS_WORKSPACE = ":4096:8"  # what PyTorch's reproducibility notes give for deterministic cuBLAS


def inductor_has_deterministic_mode() -> bool:
    """torch._inductor.config.deterministic (a private config; torch 2.9 lacks it)."""
    try:
        import torch._inductor.config as inductor_config
    except ImportError:
        return False
    return hasattr(inductor_config, "deterministic")


def apply(enabled: bool, compiled: bool) -> None:
    """Set this process's determinism switches to `enabled` (before the first GPU matmul);
    refuse `compiled` runs where inductor cannot be made deterministic."""
    if enabled:
        if compiled and not inductor_has_deterministic_mode():
            raise ConfigError(f"trainer.deterministic=true with torch.compile needs inductor's deterministic mode, which "
                              f"torch {torch.__version__} lacks: set trainer.compile=false, or use a newer torch")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = False
    if inductor_has_deterministic_mode():
        import torch._inductor.config as inductor_config

        inductor_config.deterministic = enabled


def explain(exc: RuntimeError) -> ConfigError | None:
    """The one-line error for an op without a deterministic kernel under trainer.deterministic=true,
    or for inductor refusing a benchmark in its deterministic mode (torch >= 2.10, compiled)."""
    text = str(exc)
    if "In the deterministic mode of Inductor" in text:
        return ConfigError("trainer.deterministic=true: inductor's deterministic mode refused to benchmark a "
                           "kernel choice while compiling: set trainer.compile=false (or "
                           "trainer.deterministic=false)")
    if "does not have a deterministic implementation" not in text:
        return None
    return ConfigError(f"trainer.deterministic=true: {text.splitlines()[0].split('. ')[0]}: set "
                       "trainer.deterministic=false (resumes then keep data order and step, not every bit)")
