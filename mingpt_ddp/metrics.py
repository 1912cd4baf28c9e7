"""What rank 0 reports: metrics.jsonl, log lines or a progress bar, and MFU's roofline."""
from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from mingpt_ddp import loggers

log = logging.getLogger("mingpt_ddp.train")


class MetricsLog:
    """One JSON object per logged step in `metrics.jsonl`, plus a human view of it.

    The human view is a progress bar when stderr is a terminal and plain periodic log lines
    otherwise (Slurm and CI logs). The same records go to the experiment trackers in
    `sinks` (loggers.py: TensorBoard, MLflow, W&B). Only rank 0 makes one with `enabled=True`.
    """

    def __init__(self, path: Optional[str], enabled: bool, total_steps: Optional[int],
                 sinks: Sequence[loggers.Sink] = ()):
        self.enabled = enabled
        self.total_steps = total_steps  # None: not known yet (a time budget plans it after the first steps)
        self.interactive = enabled and sys.stderr.isatty()
        self._clock = time.monotonic
        self._opened = self._clock()
        self._first_progress: Optional[tuple[float, int]] = None  # (time, step) of the first train record
        self._file = open(path, "a", buffering=1) if enabled and path else None
        self.sinks = list(sinks) if enabled else []

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._file:
            self._file.write(json.dumps(record) + "\n")
        loggers.fan_out(self.sinks, record)
        if "train_loss" in record:
            self._show_progress(record)
        if record.get("val_loss") is not None:
            bpb = f" | val_bpb {record['val_bpb']:.4f}" if record.get("val_bpb") is not None else ""
            self.note(f"step {record['step']} epoch {record['epoch']}: val_loss {record['val_loss']:.4f}{bpb}")

    def mark(self, step: int, event: str) -> None:
        """A record in metrics.jsonl only (not the trackers) where the run changed course, for
        tools reading it: `event` "new corpus" starts another validation split's losses."""
        if self.enabled and self._file:
            self._file.write(json.dumps({"step": step, "event": event}) + "\n")

    def _show_progress(self, r: dict[str, Any]) -> None:
        text = (
            f"step {r['step']}/{'? (planning)' if self.total_steps is None else self.total_steps} epoch {r['epoch']} | train_loss {r['train_loss']:.4f} "
            f"| lr {r['lr']:.2e} | {r['tokens_per_s']:,.0f} tok/s"
            + (f", {r['wall_tokens_per_s']:,.0f} wall tok/s" if r.get("wall_tokens_per_s") is not None else "")
            + (" (includes compiling)" if r.get("includes_compile") else "")
            + _mfu_text(r)
            + f" | {self._elapsed_and_eta(r['step'])}"
        )
        if self.interactive:
            filled = 0 if self.total_steps is None else min(30, int(30 * r["step"] / max(1, self.total_steps)))
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {text}\033[K")
            sys.stderr.flush()
        else:
            log.info(text)

    def _elapsed_and_eta(self, step: int) -> str:
        """Wall time since the log was opened, and the time left at the pace measured since
        the first logged step (evaluations and saves included: they are part of the run)."""
        now = self._clock()
        elapsed = f"elapsed {format_duration(now - self._opened)}"
        if self._first_progress is None:
            self._first_progress = (now, step)
            return f"{elapsed} eta --"
        then, first_step = self._first_progress
        if step <= first_step or now <= then or self.total_steps is None:
            return f"{elapsed} eta --"
        left = (self.total_steps - step) * (now - then) / (step - first_step)
        return f"{elapsed} eta {format_duration(max(0.0, left))}"

    def note(self, message: str) -> None:
        """A line that must stay visible (evaluations, saves), also under a progress bar."""
        if not self.enabled:
            return
        if self.interactive:
            sys.stderr.write("\n")
        log.info(message)

    def close(self, outcome: str = "finished") -> None:
        """`outcome` (finished, stopped, failed) is how the trackers' runs end."""
        if self.interactive:
            sys.stderr.write("\n")
        if self._file:
            self._file.close()
            self._file = None
        loggers.close_all(self.sinks, outcome)
        self.sinks = []


def _mfu_text(r: dict[str, Any]) -> str:
    """The progress line's MFU, naming its peak: the datasheet's where the GPU is known (as
    `mfu` is then), the measured one in brackets; only the measured one elsewhere."""
    measured = r.get("mfu_measured", r.get("mfu"))
    if r.get("mfu_datasheet") is not None:
        return (f" | MFU {100 * r['mfu_datasheet']:.1f}% of datasheet peak"
                + (f" ({100 * measured:.1f}% of measured)" if measured is not None else ""))
    return f" | MFU {100 * measured:.1f}% of measured peak" if measured is not None else ""


def format_duration(seconds: float) -> str:
    """4s, 2m05s, 1h02m: short enough for a progress line."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


_PEAK_CACHE: dict[tuple, "Peak"] = {}


def default_peak_sizes(device: torch.device) -> tuple[int, ...]:
    """Square matmul sizes that reach a device's dense peak: 1024 is far from it for bf16
    on AMX CPUs (about half), 4096 is short of it on large GPUs."""
    return (4096, 8192) if device.type == "cuda" else (1536, 2048)


MAX_MATMUL_SECONDS = 0.5  # one timed matmul of `bench peak`'s square sizes, at most
GAUGE_ROWS = 16  # rows of the one matmul that first tells how long a full-size one would take
MIN_PEAK_ROWS = 512  # a fast dtype's rate is measured on at least this many rows (or all the model has)
EMULATED_SLOWDOWN = 1.5  # a low precision this much slower than fp32 on the model's matmuls is emulated


def affordable_peak_sizes(device: torch.device, dtype: torch.dtype) -> tuple[int, ...]:
    """`default_peak_sizes`, less those whose single matmul would take over
    MAX_MATMUL_SECONDS: a CPU without fast kernels for a dtype (fp16 on most, bf16 on old
    ones) runs a 2048-size matmul for tens of seconds. A 256-size probe gives the rate; if
    no default size fits, the largest power of two from 1024 down that does."""
    sizes = default_peak_sizes(device)
    if device.type != "cpu":
        return sizes
    rate = matmul_flops(device, dtype, 256, seconds=0.01)
    fits = [n for n in sizes if 2 * n**3 / rate <= MAX_MATMUL_SECONDS]
    return tuple(fits) or next(((n,) for n in (1024, 512) if 2 * n**3 / rate <= MAX_MATMUL_SECONDS), (256,))


Shape = tuple[int, int, int]  # (rows, inner, columns) of one matmul: (m x k) @ (k x n)


def matmul_flops(device: torch.device, dtype: torch.dtype, shape: int | Shape, seconds: float = 0.2,
                 min_rows: int = 1) -> float:
    """Dense matmul rate in FLOP/s for `shape` (an int: square): the best of several
    short timing windows, `seconds` in all.

    Other work on the machine can only slow a window down, so the fastest window is the
    best estimate of what the hardware does (CPUs shared with other jobs are noisy). The
    time is bounded for any dtype: a matmul of GAUGE_ROWS rows first tells how many rows
    fit three matmuls into `seconds`; never fewer than `min_rows` (a rate on fewer would
    understate a fast dtype) unless one such matmul would take over MAX_MATMUL_SECONDS,
    and then that first matmul's rate is the answer (a dtype that slow is emulated).
    """
    m, k, n = (shape,) * 3 if isinstance(shape, int) else shape
    # A private generator: measuring must not move the global RNG, or the first trainer of a
    # process (rank 0 only) would draw other dropout masks than the same run in a sweep.
    generator = torch.Generator(device=device).manual_seed(0)
    b = torch.randn(k, n, device=device, generator=generator).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(a: torch.Tensor, out: torch.Tensor, calls: int = 1) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            torch.matmul(a, b, out=out)
        sync()
        return max(time.perf_counter() - start, 1e-6)

    gauge = min(m, GAUGE_ROWS)
    a = torch.randn(gauge, k, device=device, generator=generator).to(dtype)
    out = torch.empty(gauge, n, device=device, dtype=dtype)
    timed(a, out)  # first call: library initialisation, packing buffers
    per_row = timed(a, out) / gauge
    if per_row * gauge * 3 < seconds:  # cheap enough: the best of three, as one call may be preempted
        per_row = min(per_row, timed(a, out) / gauge, timed(a, out) / gauge)
    rows = min(m, int(seconds / 3 / per_row))
    if rows < min(m, min_rows):
        if per_row * min(m, min_rows) > MAX_MATMUL_SECONDS:  # a dtype this slow: the gauge is its rate
            return 2 * k * n / per_row
        rows = min(m, min_rows)  # costly but affordable: a few single-matmul windows
    a = torch.randn(rows, k, device=device, generator=generator).to(dtype)
    out = torch.empty(rows, n, device=device, dtype=dtype)
    once = timed(a, out)  # also this size's own first call
    per_window = max(1, int(0.03 / once))  # windows of ~30 ms: long enough to time, many of them
    best, deadline = 0.0, time.perf_counter() + seconds
    while True:
        best = max(best, 2 * rows * k * n * per_window / timed(a, out, per_window))
        if time.perf_counter() >= deadline:
            return best


@dataclass(frozen=True)
class Peak:
    """The matmul rate MFU is quoted against, and which precision reaches it."""

    flops: float
    dtype: str  # the precision whose rate `flops` is: the one in use, or fp32 where that one is emulated
    slowdown: float = 1.0  # the precision in use: its matmul time over fp32's on these shapes (CPU)

    @property
    def emulated(self) -> bool:
        """A low precision slower than fp32 on the model's own matmuls: no instructions for it
        (bf16 without AVX512-BF16/AMX, fp16 on most CPUs), so its casts and software
        arithmetic cost more than fp32 itself."""
        return self.slowdown > EMULATED_SLOWDOWN


def measured_peak(device: torch.device, dtype: torch.dtype, shapes: Optional[list[Shape]] = None,
                  seconds: float = 0.3) -> Peak:
    """This device's matmul rate in FLOP/s for `dtype` at the model's own matmul `shapes`
    (None: the square `default_peak_sizes`), measured, not looked up: the roofline MFU is
    quoted against.

    At the model's shapes the model's matmuls cannot run faster than measured, so MFU
    stays under 100%, where a peak from larger square matmuls would flatter them and one
    from smaller ones would not bound them. A table of vendor peaks would be wrong for CPUs,
    which differ per machine. On a CPU a low precision is measured against fp32 too: where
    it is slower (emulated), the peak is fp32's, the precision actually fast there. The
    best rate over the shapes and timing windows, bounded in time for every dtype, for the
    current thread count (CPU) and TF32 setting (fp32 on CUDA), cached per process.
    """
    tf32 = device.type == "cuda" and dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    shapes = sorted(set(shapes)) if shapes else None
    key = (str(device), dtype, torch.get_num_threads(), tf32, tuple(shapes or ()))
    if key not in _PEAK_CACHE:
        sizes: list = list(shapes or affordable_peak_sizes(device, dtype))

        def rate(d: torch.dtype) -> float:
            return max(matmul_flops(device, d, s, seconds / len(sizes), MIN_PEAK_ROWS) for s in sizes)

        name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
        own = rate(dtype)
        if device.type == "cuda":  # the probe's matrices (~0.8 GB at 8192) would stay cached on this GPU only
            torch.cuda.empty_cache()
        if device.type == "cpu" and dtype != torch.float32:
            fp32 = rate(torch.float32)
            if fp32 > own:
                _PEAK_CACHE[key] = Peak(fp32, "fp32", fp32 / own)
                return _PEAK_CACHE[key]
        _PEAK_CACHE[key] = Peak(own, name)
    return _PEAK_CACHE[key]


def cached_peak(device: torch.device, dtype: torch.dtype, shapes: list[Shape]) -> Peak:
    """`measured_peak` at the model's `shapes`; on a CPU measured once and kept beside the
    precision decisions (precision.peak_cache_file), under everything that decides it: the
    CPU's facts (model, flags, kernels, torch, threads), the dtype and the shapes. The
    measurement takes 0.3 s of every run's start, more than a short run's steps; a cached
    peak that a run outruns is raised to what it reached (Trainer._log_train). GPUs measure."""
    if device.type != "cpu":
        return measured_peak(device, dtype, shapes)
    from mingpt_ddp import precision  # here: precision imports what metrics does not

    key = precision.peak_key(str(dtype), sorted(set(shapes)))
    path = precision.peak_cache_file()
    cache = precision._read_json(path)
    entry = cache.get(key)
    if (isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0
            and isinstance(entry.get("slowdown", 1.0), (int, float)) and isinstance(entry.get("dtype", "fp32"), str)):
        return Peak(float(entry["flops"]), entry.get("dtype", "fp32"), float(entry.get("slowdown", 1.0)))
    peak = measured_peak(device, dtype, shapes)
    measured = {"flops": peak.flops, "dtype": peak.dtype, "slowdown": peak.slowdown,
                "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    precision.update_cache(path, key, lambda _: measured)
    return peak


def raise_cached_peak(device: torch.device, dtype: torch.dtype, shapes: list[Shape], reached: float) -> None:
    """A run outran the cached peak (measured while other load held it down): keep the rate
    it reached, so that the next runs do not quote MFU against the held-down one too."""
    if device.type != "cpu":
        return
    from mingpt_ddp import precision

    def raised(entry):
        if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] < reached:
            return {**entry, "flops": reached, "raised": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        return entry
    precision.update_cache(precision.peak_cache_file(), precision.peak_key(str(dtype), sorted(set(shapes))), raised)


def measured_peak_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.3,
                        shapes: Optional[list[Shape]] = None) -> float:
    """`measured_peak(...).flops`."""
    return measured_peak(device, dtype, shapes, seconds).flops


# Dense (no sparsity) tensor-core peaks per GPU from NVIDIA's datasheets, TFLOP/s: the
# denominators nanoGPT and the PaLM paper quote MFU against. Most specific names first.
_DATASHEET_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H100.*NVL|H200.*NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H100.*PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    (r"H100|H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM, GH200
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"L40\b", {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bA40\b", {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4}),
    (r"V100.*PCIE", {"fp16": 112.0, "fp32": 14.0}),
    (r"V100", {"fp16": 125.0, "fp32": 15.7}),
    (r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
)


def datasheet_peak_flops(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """The vendor's dense peak FLOP/s of this GPU for `dtype` (fp32 counts as TF32 when TF32
    matmuls are allowed), or None for CPUs and GPUs not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    key = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    if key == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        key = "tf32"
    for pattern, peaks in _DATASHEET_TFLOPS:
        if re.search(pattern, name, re.IGNORECASE):
            return peaks[key] * 1e12 if key in peaks else None
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_per_process: Optional[float],
        world_size: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak (measured or datasheet)
    of all ranks; NaN without a peak."""
    if peak_flops_per_process is None:
        return float("nan")
    peak = peak_flops_per_process * world_size
    return flops_per_token * tokens_per_s / peak if peak > 0 and math.isfinite(peak) else float("nan")


def mfu_record(flops_per_token: float, tokens_per_s: float, measured_peak_flops: Optional[float],
               datasheet_peak_flops: Optional[float], world_size: int) -> dict[str, float]:
    """The MFU keys of a metrics record. `mfu` is the figure people compare (nanoGPT, PaLM):
    against the GPU's datasheet peak (`mfu_datasheet`, the same number) where the GPU is in
    the table, else against the measured peak; `mfu_measured` is always against the peak
    measured at start, which is below the datasheet's on GPUs, so it reads higher."""
    measured = mfu(flops_per_token, tokens_per_s, measured_peak_flops, world_size)
    record = {"mfu": measured, "mfu_measured": measured}
    if datasheet_peak_flops is not None:
        record["mfu"] = record["mfu_datasheet"] = mfu(flops_per_token, tokens_per_s, datasheet_peak_flops,
                                                      world_size)
    return record


def window_loss_sums(logits: torch.Tensor, targets: torch.Tensor, byte_lengths: torch.Tensor) -> torch.Tensor:
    """[summed loss (nats), targets, summed loss of the targets that stand for text, their
    UTF-8 bytes] of a batch of windows, in float64: what an evaluation adds up over its
    windows and ranks. A target of no bytes would count in val_loss only; <|endoftext|>
    counts as the newline it stands for (tokenizer.byte_lengths), so bits per byte weighs the
    same text, boundaries included, whatever the tokenizer.

    No host sync (an evaluation adds these up on the device and reads them once): no boolean
    indexing, whose output size the host must wait for, and no tensor made from a host value
    (issue 30). The per-token losses are fp32, summed in float64."""
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1),
                                               reduction="none").double()
    nbytes = byte_lengths[targets.reshape(-1)].double()
    return torch.stack([losses.sum(), torch.full((), losses.numel(), dtype=torch.float64, device=losses.device),
                        torch.where(nbytes > 0, losses, 0.0).sum(), nbytes.sum()])


def bits_per_byte(text_nats: float, text_bytes: float) -> float:
    """Loss in bits per UTF-8 byte of the text: independent of how the text was cut into
    tokens, so runs with different tokenizers compare (val_loss is per token)."""
    return text_nats / (math.log(2) * text_bytes) if text_bytes > 0 else float("nan")
