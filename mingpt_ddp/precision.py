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


def resolve(requested: Precision | str, device: torch.device) -> PrecisionPlan:
    """`auto`: bf16 on GPUs that support it, else fp16 on GPU; fp32 on CPU."""
    name = requested.value if isinstance(requested, Precision) else str(requested)
    if name == "auto":
        if device.type == "cuda":
            name = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            name = "fp32"
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("trainer.precision=bf16 but this GPU has no bf16 support: use fp16 or auto")
    return PrecisionPlan(name, device.type)
