"""Mixed precision: which autocast dtype to use, and whether gradients need a scaler."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mingpt_ddp.config import Precision
from mingpt_ddp.errors import ConfigError


@dataclass(frozen=True)
class PrecisionPlan:
    name: str  # fp32 | bf16 | fp16, never auto
    device_type: str

    @property
    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.name]

    @property
    def uses_scaler(self) -> bool:
        """fp16 gradients underflow without loss scaling; bf16 has fp32's range."""
        return self.name == "fp16"

    def autocast(self):
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler that is a no-op pass-through unless fp16 needs it."""
        return torch.amp.GradScaler(self.device_type, enabled=self.uses_scaler)


def gpu_has_native_bf16(device: torch.device) -> bool:
    """Ampere (sm_80) and newer, and ROCm GPUs. torch.cuda.is_bf16_supported() also says
    yes for older GPUs that only emulate bf16, slowly (V100, T4): those get fp16."""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device)[0] >= 8


def cpu_has_fast_bf16() -> bool:
    """AMX (Intel Xeon Sapphire Rapids and later) multiplies bf16 matrices several times
    faster than fp32. Without it (AVX512-BF16 alone, AVX2, most Arm) bf16 autocast gains
    little or loses to the casts it adds, so `auto` keeps fp32 there."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(amx is not None and amx())


def resolve(requested: Precision | str, device: torch.device) -> PrecisionPlan:
    """`auto`: bf16 on GPUs with native bf16, else fp16 on GPU; bf16 on CPUs with AMX, else fp32."""
    name = requested.value if isinstance(requested, Precision) else str(requested)
    if name == "auto":
        if device.type == "cuda":
            name = "bf16" if gpu_has_native_bf16(device) else "fp16"
        else:
            name = "bf16" if cpu_has_fast_bf16() else "fp32"
    if name == "bf16" and device.type == "cuda" and not gpu_has_native_bf16(device):
        raise ConfigError(
            f"trainer.precision=bf16 but {torch.cuda.get_device_name(device)} (sm_"
            f"{''.join(map(str, torch.cuda.get_device_capability(device)))}) only emulates bf16, several times "
            "slower: use trainer.precision=fp16 (or auto, which picks it there)"
        )
    return PrecisionPlan(name, device.type)
