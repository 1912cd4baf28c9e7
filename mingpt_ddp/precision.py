"""Mixed precision: which autocast dtype to use, and whether gradients need a scaler."""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mingpt_ddp.config import Precision
from mingpt_ddp.errors import ConfigError

log = logging.getLogger(__name__)


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


def cpu_name() -> str:
    """The CPU's model name (what decides bf16 speed), from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def precision_cache_file() -> str:
    base = os.environ.get("MINGPT_DDP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mingpt_ddp")
    return os.path.join(base, "precision.json")


def step_seconds(model: torch.nn.Module, name: str, batch_size: int, block_size: int, steps: int = 3) -> float:
    """Seconds of one forward and backward pass of a copy of `model` under `name`'s autocast:
    the best of `steps` timed passes after a warm-up one. The caller's model, its gradients
    and the global random generators are left as they were."""
    probe = copy.deepcopy(model).train()
    if any(p.is_meta for p in probe.parameters()):  # built on the meta device (FSDP): time a filled-in copy
        probe.to_empty(device="cpu")
        probe.init_weights()
    plan = PrecisionPlan(name, "cpu")
    generator = torch.Generator().manual_seed(0)
    vocab = probe.cfg.vocab_size
    x = torch.randint(vocab, (batch_size, block_size), generator=generator)
    y = torch.randint(vocab, (batch_size, block_size), generator=generator)
    best = float("inf")
    with torch.random.fork_rng(devices=[]):  # dropout draws from the global generator
        for i in range(steps + 1):
            started = time.perf_counter()
            with plan.autocast():
                _, loss = probe(x, y)
            loss.backward()
            probe.zero_grad(set_to_none=True)
            if i:
                best = min(best, time.perf_counter() - started)
    return best


PROBE_FLOPS = 1.5e11  # training FLOPs per probe pass: about 1 s in fp32 on 2 cores of a current server


def probe_batch_size(model: torch.nn.Module, batch_size: int, block_size: int) -> int:
    """Sequences per probe pass: the real micro-batch, capped at PROBE_FLOPS."""
    per_sequence = model.flops_per_token(block_size) * block_size
    return max(1, min(batch_size, int(PROBE_FLOPS // per_sequence)))


def measured_cpu_choice(model: torch.nn.Module, batch_size: int, block_size: int,
                        cache_file: Optional[str] = None,
                        measure: Callable[[torch.nn.Module, str, int, int], float] = step_seconds) -> str:
    """fp32 or bf16, whichever trains this model faster on this CPU, by timing both.

    bf16 autocast is several times faster than fp32 with AMX, about 2x with AVX512-BF16 on
    wide layers, and slower than fp32 on small ones or without bf16 instructions: no CPU flag
    tells which, so time it. The probe runs the real micro-batch where a pass is cheap (bf16's
    gain grows with the rows a matmul sees, so fewer sequences would understate it on small
    models) and fewer sequences on models whose pass is costly (their matmuls are wide
    anyway): at most PROBE_FLOPS per pass, a second or two of probing on any preset. The
    answer is cached per CPU, torch version, thread count and model shape, so later runs
    start at once. bf16 must be at least 5% faster to be chosen.
    """
    cfg = model.cfg
    key = "|".join(map(str, (cpu_name(), torch.__version__, torch.get_num_threads(), cfg.n_layer, cfg.n_head,
                             cfg.n_embd, cfg.vocab_size, block_size, batch_size)))
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = cache_file or precision_cache_file()
    cache = _read_json(path)
    if isinstance(cache.get(key), dict) and cache[key].get("choice") in ("fp32", "bf16"):
        entry = cache[key]
        log.info("precision auto: %s (cached measurement for this CPU and model: fp32 %.1f ms, bf16 %.1f ms per "
                 "pass; %s)", entry["choice"], entry["fp32_ms"], entry["bf16_ms"], path)
        return entry["choice"]
    probe_batch = probe_batch_size(model, batch_size, block_size)
    seconds = {"fp32": float("inf"), "bf16": float("inf")}
    for _ in range(2):  # alternated, best of each: other load on the cores drifts over seconds
        for name in seconds:
            seconds[name] = min(seconds[name], measure(model, name, probe_batch, block_size))
    choice = "bf16" if seconds["bf16"] < 0.95 * seconds["fp32"] else "fp32"
    cache[key] = {"choice": choice, "fp32_ms": 1000 * seconds["fp32"], "bf16_ms": 1000 * seconds["bf16"],
                  "cpu": cpu_name(), "threads": torch.get_num_threads()}
    _write_json(path, cache)
    log.info("precision auto: %s (measured on this CPU, %d sequences of %d tokens: fp32 %.1f ms, bf16 %.1f ms per "
             "forward+backward; cached in %s)", choice, probe_batch, block_size, 1000 * seconds["fp32"],
             1000 * seconds["bf16"], path)
    return choice


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: measure again


def _write_json(path: str, data: dict) -> None:
    """Atomically; a cache that cannot be written only costs a measurement next time."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not cache the precision measurement in %s (%s)", path, exc)


def resolve(requested: Precision | str, device: torch.device,
            measure_cpu: Optional[Callable[[], str]] = None) -> PrecisionPlan:
    """`auto`: bf16 on GPUs with native bf16, else fp16 on GPU; on CPUs what `measure_cpu`
    finds faster (see measured_cpu_choice), or without it bf16 with AMX, else fp32."""
    name = requested.value if isinstance(requested, Precision) else str(requested)
    if name == "auto":
        if device.type == "cuda":
            name = "bf16" if gpu_has_native_bf16(device) else "fp16"
        elif measure_cpu is not None:
            name = measure_cpu()
        else:
            name = "bf16" if cpu_has_fast_bf16() else "fp32"
    if name == "bf16" and device.type == "cuda" and not gpu_has_native_bf16(device):
        raise ConfigError(
            f"trainer.precision=bf16 but {torch.cuda.get_device_name(device)} (sm_"
            f"{''.join(map(str, torch.cuda.get_device_capability(device)))}) only emulates bf16, several times "
            "slower: use trainer.precision=fp16 (or auto, which picks it there)"
        )
    return PrecisionPlan(name, device.type)
