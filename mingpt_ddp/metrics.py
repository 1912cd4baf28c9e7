"""What rank 0 reports: metrics.jsonl, log lines or a progress bar, and MFU's roofline."""
from __future__ import annotations

import json
import logging
import math
import sys
import time
from typing import Any, Optional

import torch

log = logging.getLogger("mingpt_ddp.train")


class MetricsLog:
    """One JSON object per logged step in `metrics.jsonl`, plus a human view of it.

    The human view is a progress bar when stderr is a terminal and plain periodic log lines
    otherwise (Slurm and CI logs). Only rank 0 makes one with `enabled=True`.
    """

    def __init__(self, path: Optional[str], enabled: bool, total_steps: int):
        self.enabled = enabled
        self.total_steps = total_steps
        self.interactive = enabled and sys.stderr.isatty()
        self._file = open(path, "a", buffering=1) if enabled and path else None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._file:
            self._file.write(json.dumps(record) + "\n")
        if "train_loss" in record:
            self._show_progress(record)
        if record.get("val_loss") is not None:
            self.note(f"step {record['step']} epoch {record['epoch']}: val_loss {record['val_loss']:.4f}")

    def _show_progress(self, r: dict[str, Any]) -> None:
        text = (
            f"step {r['step']}/{self.total_steps} epoch {r['epoch']} | train_loss {r['train_loss']:.4f} "
            f"| lr {r['lr']:.2e} | {r['tokens_per_s']:,.0f} tok/s"
            + (f" | MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "")
        )
        if self.interactive:
            filled = int(30 * r["step"] / max(1, self.total_steps))
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {text}\033[K")
            sys.stderr.flush()
        else:
            log.info(text)

    def note(self, message: str) -> None:
        """A line that must stay visible (evaluations, saves), also under a progress bar."""
        if not self.enabled:
            return
        if self.interactive:
            sys.stderr.write("\n")
        log.info(message)

    def close(self) -> None:
        if self.interactive:
            sys.stderr.write("\n")
        if self._file:
            self._file.close()
            self._file = None


_PEAK_CACHE: dict[tuple[str, torch.dtype], float] = {}


def measured_peak_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """This device's dense matmul rate in FLOP/s for `dtype`, measured, not looked up.

    The roofline that MFU is quoted against: a table of vendor peaks would be wrong for
    CPUs, which differ per machine, and optimistic for GPUs (clocks, power limits).
    """
    key = (str(device), dtype)
    if key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    iters, start = 0, time.perf_counter()
    while True:
        for _ in range(4):
            a @ b
        iters += 4
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    _PEAK_CACHE[key] = 2 * n**3 * iters / elapsed
    return _PEAK_CACHE[key]


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_per_process: float, world_size: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the measured peak of all ranks."""
    peak = peak_flops_per_process * world_size
    return flops_per_token * tokens_per_s / peak if peak > 0 and math.isfinite(peak) else float("nan")
