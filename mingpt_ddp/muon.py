"""Muon for the blocks' weight matrices, AdamW for everything else, as one optimizer.

Muon (Keller Jordan, 2024; torch.optim.Muon since torch 2.9) takes SGD momentum and
replaces each matrix's update by the nearest semi-orthogonal matrix (five Newton-Schulz
iterations), so every direction of the matrix moves at the same rate. On the character
models here it reached in 250 steps a validation loss AdamW needed about twice the steps
for; at a 55 s budget on an AVX2-only CPU it reached 1.73 where AdamW reached 2.14-2.18
(docs/performance.md "A fast recipe for any text").

torch.optim.Muon is not used because it always orthogonalises in bf16, which CPUs without
bf16 instructions (AVX2 only) emulate about 30x slower than fp32 per matmul: here the
Newton-Schulz iterations run in `ns_dtype`, the precision the run trains in. Embeddings,
the tied head, LayerNorms and biases are not matrices a layer multiplies with (or not 2-D)
and stay with AdamW, in the same optimizer so the trainer, the gradient scaler and the
snapshots see one optimizer and one state dict.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

# The quintic iteration's coefficients from Keller Jordan's Muon (also torch.optim.Muon's).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An approximately semi-orthogonal matrix with g's row and column spaces (U V^T of its
    SVD, singular values pushed into about [0.7, 1.2]), in `dtype`, returned as g's dtype."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    wide = x.size(0) <= x.size(1)
    if not wide:  # iterate on the smaller Gram matrix
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.T).to(g.dtype)


class Muon(torch.optim.Optimizer):
    """Param groups with `muon: True` (2-D weight matrices) take Muon steps at
    `lr * lr_scale`; the others AdamW steps at `lr`. The trainer's LR schedule sets `lr` on
    every group, so `lr_scale` (muon_lr / lr) keeps Muon's LR in proportion."""

    def __init__(self, params: Iterable[dict[str, Any]], lr: float, betas: tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.0, momentum: float = 0.95, ns_steps: int = 5,
                 ns_dtype: torch.dtype = torch.float32, eps: float = 1e-8):
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps,
                        eps=eps, muon=False, lr_scale=1.0)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            if group["muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon orthogonalises 2-D weight matrices only")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, momentum = group["lr"] * group["lr_scale"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = orthogonalize(p.grad.lerp(buf, momentum), group["ns_steps"], self.ns_dtype)  # Nesterov
            p.mul_(1 - lr * group["weight_decay"])
            # Orthogonal updates of a tall matrix have smaller entries: scaled as in torch.optim.Muon.
            p.add_(update, alpha=-lr * math.sqrt(max(1.0, p.size(0) / p.size(1))))

    def _adamw_step(self, group: dict[str, Any]) -> None:
        (beta1, beta2), lr = group["betas"], group["lr"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = state["step"].item()
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(group["eps"])
            p.mul_(1 - lr * group["weight_decay"])
            p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))
