"""Mixed precision: which autocast dtype to use, and whether gradients need a scaler."""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import platform
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

try:
    import fcntl
except ImportError:  # not POSIX: updates are not serialised
    fcntl = None  # type: ignore[assignment]

from mingpt_ddp import distributed
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
    """The CPU's model name, from /proc/cpuinfo where there is one. In virtual machines it
    is often generic ("AMD EPYC" for CPUs with and without AVX512-BF16): not a key alone."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def _cpuinfo_field(name: str) -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == name:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# CPU flags that decide how fast bf16 (and fp16) matmuls are: x86 ("flags") and Arm ("Features").
SPEED_FLAGS = re.compile(r"avx|amx|fma|f16c|bf16|fp16|fphp|vnni|sve|i8mm|asimd|neon")
# Environment variables that change which kernels torch, oneDNN and MKL use (the AVX2 emulation).
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
              "MKL_DEBUG_CPU_TYPE")


def cpu_facts() -> dict:
    """What decides whether bf16 beats fp32 on this CPU, as far as it can be read: the
    model name, the instruction-set flags, the kernels torch dispatches to (and the
    environment that limits them), torch's version and the thread count."""
    flags = (_cpuinfo_field("flags") or _cpuinfo_field("Features")).split()
    return {
        "cpu": cpu_name(),
        "flags": sorted(f for f in set(flags) if SPEED_FLAGS.search(f)),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "env": {k: os.environ[k] for k in KERNEL_ENV if k in os.environ},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def decision_key(facts: dict, model_cfg, batch_size: int, block_size: int) -> str:
    """The cache key of one decision: the CPU's facts and the model's shape at its batch."""
    shape = [model_cfg.n_layer, model_cfg.n_head, model_cfg.n_embd, model_cfg.vocab_size, block_size, batch_size]
    return hashlib.sha256(json.dumps([facts, shape], sort_keys=True).encode()).hexdigest()[:16]


def _cache_dir() -> str:
    return os.environ.get("MINGPT_DDP_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mingpt_ddp")


def precision_cache_file() -> str:
    return os.path.join(_cache_dir(), "precision.json")


def peak_cache_file() -> str:
    """This CPU's matmul peaks (metrics.cached_peak), beside the precision decisions."""
    return os.path.join(_cache_dir(), "matmul_peak.json")


def peak_key(dtype: str, shapes: list) -> str:
    """The cache key of one CPU matmul peak: the CPU's facts, the dtype, the matmul shapes."""
    return hashlib.sha256(json.dumps([cpu_facts(), dtype, [list(s) for s in shapes]], sort_keys=True)
                          .encode()).hexdigest()[:16]


def probe_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A training-mode copy of `model` to time; one built on the meta device (FSDP) is
    filled in on the CPU first."""
    probe = copy.deepcopy(model).train()
    if any(p.is_meta for p in probe.parameters()):
        probe.to_empty(device="cpu")
        probe.init_weights()
    return probe


def step_seconds(model: torch.nn.Module, name: str, batch_size: int, block_size: int, steps: int = 3) -> float:
    """Seconds of one forward and backward pass of a copy of `model` under `name`'s autocast:
    the best of `steps` timed passes after a warm-up one. The caller's model, its gradients
    and the global random generators are left as they were."""
    probe = probe_copy(model)
    pass_seconds(probe, name, batch_size, block_size)
    return min(pass_seconds(probe, name, batch_size, block_size) for _ in range(steps))


def pass_seconds(model: torch.nn.Module, name: str, batch_size: int, block_size: int) -> float:
    """Seconds of one forward and backward pass of `model` (a probe's copy, or the model
    with its gradients set aside: they are cleared after) on fixed random tokens, global
    generators untouched."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    x = torch.randint(vocab, (batch_size, block_size), generator=generator)
    y = torch.randint(vocab, (batch_size, block_size), generator=generator)
    with torch.random.fork_rng(devices=[]):  # dropout draws from the global generator
        started = time.perf_counter()
        with PrecisionPlan(name, "cpu").autocast():
            _, loss = model(x, y)
        loss.backward()
        seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return seconds


MATMUL_PROBE_FLOPS = 3e8  # the pre-probe's fp32 matmul: a few ms of one core; bf16 emulated: 3-40x (30x on real AVX2)
MATMUL_ROWS = (64, 1024)  # its rows: fewer hide emulated bf16 (2-3x at 16 rows of 768-1024 dims) and, on narrow
# layers, bf16's gain (a 64 x 48 @ 48 x 192 one read bf16 2x slower where gpt-nano's passes are 1.2x faster in bf16)
MATMUL_LOSING = 2.0  # bf16 matmuls this much slower than fp32: no bf16 pass is run at all
WARMUP_LOSING = 3.0  # a first (warm-up) bf16 pass this much slower than fp32's first ends the probe
LOSING = 1.5  # a timed bf16 pass this much slower than fp32's ends the probe
PASS_SECONDS = 0.2  # the fp32 probe pass aimed for (fewer sequences than the batch on costly models)
DECISION_SECONDS = 2.0  # the whole decision's deadline: no step starts that is not expected to end before it
SAFETY = 2.0  # a step starts only if twice its expected seconds fit before the deadline
ROUNDS = 3  # fp32 and bf16 passes alternated: a warm-up round, then the best of two
# When a measurement is trusted (cached), see _distrust. Load only ever slows a pass down, so
# only the precision that lost can have lost to load:
MAX_WAIT = 0.15  # its pass's threads waited this share of their runnable time for a core (others' load)
MAX_SPREAD = 1.3  # its timed passes differ this much (load came and went; where waits cannot be read)
UNBELIEVABLE = 3.0  # a bf16 pass this much slower than fp32's where bf16 matmuls are faster: load, not speed
RUN_FASTER = 1.5  # a run's steps this much faster than its cached passes predict: they were timed under load
RUN_CHECK_WINDOWS = 10  # log windows a run waits for a quiet one to check its precision in, at most

_clock = time.perf_counter  # the decision's clock (a fake one in tests)


def cpu_wait() -> Optional[tuple[float, float]]:
    """(seconds run, seconds waited for a core while runnable), summed over this process's
    threads since they started (Linux: /proc/self/task/*/schedstat), or None where that
    cannot be read. The share waited over a pass says whether it had the cores: its waits
    are other processes' load, as long as its own threads fit its cores. Where torch runs
    more threads than the cores it may use (os.sched_getaffinity), they wait for each other
    and the two cannot be told apart: None then, and the spread of the passes is the
    evidence (_distrust). Counted: runnable time without a core (others' load, own
    oversubscription; on kernels that keep throttled tasks queued, a CPU quota's (cgroup
    cpu.max) throttling too, which is then read as load). Not counted: time blocked or asleep."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    if torch.get_num_threads() > cores:
        return None
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    run = wait = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
                fields = f.read().split()
            run, wait = run + int(fields[0]), wait + int(fields[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return (run / 1e9, wait / 1e9) if run else None


_cpu_wait = cpu_wait  # replaceable in tests, as _clock


def wait_share(before: Optional[tuple[float, float]], after: Optional[tuple[float, float]]) -> Optional[float]:
    """The share of the runnable time between two cpu_wait() readings spent waiting for a core."""
    if before is None or after is None:
        return None
    run, wait = after[0] - before[0], after[1] - before[1]
    return wait / (run + wait) if run + wait > 0 else 0.0


def bf16_matmul_slowdown(n_embd: int, rows: int) -> float:
    """bf16's seconds over fp32's on the model's MLP matmul, (rows x d) @ (d x 4d) with the
    micro-batch's rows, 64-1024 of them (MATMUL_PROBE_FLOPS at most above 64), on one thread and timed in that thread's CPU time, so that others' load
    on the cores does not blur it: under 0.1 s even where bf16 is emulated in software
    (3-8x slower than fp32 under the AVX2 emulation, 30x on real AVX2-only CPUs; 0.4-0.6x with
    AVX512-BF16, measured at 128-1024 dims)."""
    low, high = MATMUL_ROWS
    rows = int(max(1, min(rows, high, max(low, MATMUL_PROBE_FLOPS // (8 * n_embd * n_embd)))))
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rows, n_embd, generator=generator)
    b = torch.randn(4 * n_embd, n_embd, generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = {}
        for dtype, calls in ((torch.float32, 5), (torch.bfloat16, 3)):
            x, w = a.to(dtype), b.to(dtype)
            torch.nn.functional.linear(x, w)  # the first call initialises the kernels
            times: list[float] = []
            while len(times) < calls and sum(times) < 0.05:
                started = time.thread_time()
                torch.nn.functional.linear(x, w)
                times.append(time.thread_time() - started)
            best[dtype] = max(min(times), 1e-7)
    finally:
        torch.set_num_threads(threads)
    return best[torch.bfloat16] / best[torch.float32]


def probe_shape(model: torch.nn.Module, batch_size: int, block_size: int, seconds_per_flop: float) -> tuple[int, int]:
    """(sequences, tokens each) of a probe pass: the real micro-batch (bf16's gain grows with
    the rows a matmul sees, so fewer would understate it on small models), or fewer
    sequences, and on the largest models shorter ones (not under 64 tokens), where an fp32
    pass would take over PASS_SECONDS at `seconds_per_flop` (measured on one sequence)."""
    affordable = PASS_SECONDS / seconds_per_flop
    sequences = max(1, min(batch_size, int(affordable // (model.flops_per_token(block_size) * block_size))))
    tokens = block_size
    while sequences == 1 and tokens > 64 and model.flops_per_token(tokens) * tokens > affordable:
        tokens = max(64, tokens // 2)
    return sequences, tokens


def one_block_pass_seconds(model: torch.nn.Module, tokens: int) -> float:
    """An fp32 forward and backward pass of one sequence of `tokens` through the model's
    first block, timed, scaled by parameters to the whole model: what a whole pass of that
    sequence is expected to take. On small sequences a pass's time goes mostly with the
    parameters (read, gradients written), on long ones with FLOPs, which also go with them."""
    block = model.blocks[0]
    x = torch.randn(1, tokens, model.cfg.n_embd, generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng(devices=[]):
        started = time.perf_counter()
        block(x).sum().backward()
        seconds = time.perf_counter() - started
    block.zero_grad(set_to_none=True)
    whole, one = (sum(p.numel() for p in m.parameters()) for m in (model, block))
    return seconds * whole / one


@dataclass
class Decision:
    """What trainer.precision=auto decided on a CPU and on what evidence: `entry` holds the
    measurement (the cache entry's fields); `source` is "cached" (read from the cache),
    "measured" (trusted, so cached now) or "untrusted" (not cached: see _distrust)."""
    choice: str
    source: str
    entry: dict
    path: str

    @property
    def doubt(self) -> Optional[str]:
        """Why the run should measure again once its own steps show a quiet machine, or None."""
        if self.source == "untrusted":
            return f"the measurement at start was not trusted ({self.entry.get('untrusted')})"
        if self.source == "cached" and "trusted" not in self.entry:
            return "the cached decision was made by an older version, which did not check the machine's load"
        return None


def measured_cpu_choice(model: torch.nn.Module, batch_size: int, block_size: int,
                        cache_file: Optional[str] = None,
                        measure: Callable[[torch.nn.Module, str, int, int], float] = pass_seconds,
                        matmul_probe: Callable[[int, int], float] = bf16_matmul_slowdown,
                        calibrate: Callable[[torch.nn.Module, int], float] = one_block_pass_seconds) -> str:
    """fp32 or bf16, whichever trains this model faster on this CPU (cpu_decision's choice)."""
    return cpu_decision(model, batch_size, block_size, cache_file, measure, matmul_probe, calibrate).choice


def cpu_decision(model: torch.nn.Module, batch_size: int, block_size: int,
                 cache_file: Optional[str] = None,
                 measure: Callable[[torch.nn.Module, str, int, int], float] = pass_seconds,
                 matmul_probe: Callable[[int, int], float] = bf16_matmul_slowdown,
                 calibrate: Callable[[torch.nn.Module, int], float] = one_block_pass_seconds,
                 use_cache: bool = True, announce: bool = True) -> Decision:
    """fp32 or bf16, whichever trains this model faster on this CPU, decided within
    DECISION_SECONDS (2 s) of starting on any CPU and model, once per CPU, torch version,
    thread count and model shape.

    bf16 autocast is several times faster than fp32 with AMX, about 2x with AVX512-BF16 on
    wide layers, slower than fp32 on small ones, and emulated in software, 30x slower per
    matmul, on CPUs without bf16 instructions (AVX2 only: most AMD Zen 2/3 and laptops). No
    flag tells which, so it is timed, in steps that each stop as soon as bf16 is clearly out:

    1. The model's MLP matmul in fp32 and bf16 on one core (milliseconds, see bf16_matmul_slowdown):
       bf16 MATMUL_LOSING times slower means no bf16 instructions, and fp32 without a model pass.
    2. Forward and backward passes of the model (its gradients and mode restored after): one
       short sequence through one block in fp32 (one_block_pass_seconds: a fraction of a whole
       pass, however large the model) to size the others, then fp32 and bf16 alternated
       (others' load on the cores drifts over seconds): a warm-up round, then up to two timed
       ones. bf16 is dropped at its first pass LOSING (warm-up: WARMUP_LOSING, unless its
       matmuls were faster) times slower than fp32's in the same round, if that pass is
       credible (it had the cores, and is not UNBELIEVABLE: see _distrust). The passes use
       the real micro-batch, or less where an fp32 pass would take over PASS_SECONDS
       (probe_shape). bf16 must be 5% faster to win.

    One deadline bounds it all: no pass starts unless SAFETY times its expected seconds (the
    first from the block's, then the last pass of its precision, bf16's first from fp32's
    times the matmul slowdown) end before DECISION_SECONDS. So it ends within 3 s unless a
    pass runs three times slower than expected (or one block's pass takes a second). Cut short before a timed round,
    the passes so far (or the matmuls alone) decide.

    The answer is cached, under everything that decides it (cpu_facts, the model's shape),
    only when the measurement is trusted: not cut short, and the precision that lost lost on
    passes that had the cores, that agree with each other, and that its matmuls make
    believable (_distrust). Load only ever slows a pass, so load can make only the loser look
    worse than it is. A bf16 pass UNBELIEVABLE times slower than fp32's where bf16 matmuls
    are faster is load: then the matmuls decide. An untrusted decision is used, not cached;
    the run measures again once its own steps show a quiet machine (RunCheck). A cached
    entry whose figures are not believable (made by an older version) is measured again.

    `measure` (one pass's seconds), `matmul_probe` and `calibrate` are the timers, replaceable
    in tests (and _clock, _cpu_wait). `use_cache=False`: measure again whatever is cached
    (an untrusted answer then leaves the cache as it was: no evidence against a trusted entry);
    `announce=False`: the measurement's line at debug level (RunCheck logs its own).
    """
    say = log.info if announce else log.debug
    facts = cpu_facts()
    key = decision_key(facts, model.cfg, batch_size, block_size)
    path = cache_file or precision_cache_file()
    cache = _read_json(path)
    entry = cache.get(key)
    if use_cache and isinstance(entry, dict) and entry.get("choice") in ("fp32", "bf16"):
        unbelievable = _unbelievable(_cached_times(entry), entry.get("bf16_matmul_slowdown"))
        if unbelievable is None:
            log.info("precision auto: %s (cached for this CPU, torch, thread count and model: %s; %s)",
                     entry["choice"], entry.get("why", ""), path)
            return Decision(entry["choice"], "cached", entry, path)
        log.info("precision auto: the cached %s is not believable (%s): measuring again", entry["choice"], unbelievable)
    started = _clock()
    deadline = started + DECISION_SECONDS
    slowdown = matmul_probe(model.cfg.n_embd, batch_size * block_size)
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    waits: dict[str, list[Optional[float]]] = {"fp32": [], "bf16": []}
    complete, shape, doubt = True, [0, 0], None
    if slowdown >= MATMUL_LOSING:
        choice = "fp32"
        why = f"bf16 matmuls {slowdown:.1f}x slower than fp32 at this width (no fast bf16 instructions, or layers too narrow to gain); no pass run"
    else:
        # The model itself where it has weights (a copy of a large one costs much of the deadline);
        # one built on the meta device (FSDP) is filled in on a copy first.
        probe = probe_copy(model) if any(p.is_meta for p in model.parameters()) else model
        with _own_gradients(probe):
            choice, why, complete = _timed_passes(probe, batch_size, block_size, slowdown, measure, calibrate,
                                                  times, waits, shape, deadline)
        unbelievable = _unbelievable(times, slowdown)
        if unbelievable:
            choice = "bf16" if slowdown < 0.75 else "fp32"
            why, doubt = f"by the matmuls alone, bf16 at {1 / slowdown:.2f}x fp32's speed", unbelievable
        elif not complete:
            doubt = f"cut short by the {DECISION_SECONDS:g} s limit (a busy or slow machine)"
        else:
            doubt = _distrust(times, waits, choice)
        sized = waits.get("calibration", [None])[0]
        if doubt is None and shape != [batch_size, block_size] and sized is not None and sized > MAX_WAIT:
            # fewer rows than the run's understate bf16's gain: sized under load, the passes may be too small
            doubt = (f"the passes were sized ({shape[0]} sequences of {shape[1]} tokens, not {batch_size} of "
                     f"{block_size}) while the calibration waited {sized:.0%} of its time for a core")
    entry = {"choice": choice, "why": why, "fp32_ms": [round(1e3 * t, 1) for t in times["fp32"]],
             "bf16_ms": [round(1e3 * t, 1) for t in times["bf16"]], "bf16_matmul_slowdown": round(slowdown, 2),
             "wait_share": {k: [None if w is None else round(w, 2) for w in v] for k, v in waits.items()},
             "probe": shape, "decided_in_s": round(_clock() - started, 2), "trusted": doubt is None, **facts}
    if doubt is None:
        update_cache(path, key, lambda _: entry)
        say("precision auto: %s (measured on this CPU in %.1f s: %s; cached in %s)", choice,
            entry["decided_in_s"], why, path)
        return Decision(choice, "measured", entry, path)
    entry["untrusted"] = doubt
    if use_cache and key in cache:  # the entry there was not believable (or damaged): not kept either.
        update_cache(path, key, lambda _: None)  # A re-measurement (use_cache=False) leaves the cache as it was.
    say("precision auto: %s (measured on this CPU in %.1f s: %s; not cached: %s; the run measures again "
        "once its steps show a quiet machine)", choice, entry["decided_in_s"], why, doubt)
    return Decision(choice, "untrusted", entry, path)


def _cached_times(entry: dict) -> dict[str, list[float]]:
    try:
        return {name: [ms / 1e3 for ms in entry.get(f"{name}_ms") or []] for name in ("fp32", "bf16")}
    except TypeError:
        return {"fp32": [], "bf16": []}


def _best(seconds: list[float]) -> float:
    """A precision's best timed pass (its warm-up only where no timed one ran)."""
    return min(seconds[1:] or seconds)


def _unbelievable(times: dict[str, list[float]], slowdown: Optional[float]) -> Optional[str]:
    """Why bf16's passes cannot be its speed, or None: UNBELIEVABLE times slower than fp32's
    where bf16's matmuls (timed in their thread's CPU time, which others' load does not
    stretch) are faster than fp32's. Casts and small ops cost bf16 a little on small models,
    never several times what the matmuls gain."""
    if not times["fp32"] or not times["bf16"] or not isinstance(slowdown, (int, float)) or slowdown >= 1.0:
        return None
    ratio = _best(times["bf16"]) / max(_best(times["fp32"]), 1e-9)
    if ratio <= UNBELIEVABLE:
        return None
    return (f"bf16 passes {ratio:.1f}x slower than fp32's where bf16 matmuls are {1 / max(slowdown, 1e-9):.1f}x "
            "faster: load, not speed")


def _distrust(times: dict[str, list[float]], waits: dict[str, list[Optional[float]]], choice: str) -> Optional[str]:
    """Why a finished measurement is not to be cached, or None. Load only ever slows a pass,
    so only the precision that lost can have lost to it: its best timed pass waited over
    MAX_WAIT of its runnable time for a core (others took the cores), or a timed pass took
    over MAX_SPREAD times its fastest pass, warm-up included (load came and went: its best
    may be held down too; where waits cannot be read, this is the evidence, so a loser with its
    warm-up pass alone and no wait reading is not trusted)."""
    loser = "fp32" if choice == "bf16" else "bf16"
    seconds = times[loser]
    if not seconds:
        return None
    first = 1 if len(seconds) > 1 else 0
    best = min(range(first, len(seconds)), key=seconds.__getitem__)
    waited = waits[loser][best] if best < len(waits[loser]) else None
    if len(seconds) == 1 and waited is None:  # no second pass to compare, no wait read: no evidence either way
        return (f"{loser} lost on its warm-up pass alone ({1e3 * seconds[0]:.0f} ms), whose wait for a core "
                "could not be read")
    if waited is not None and waited > MAX_WAIT:
        return (f"{loser}'s best pass ({1e3 * seconds[best]:.0f} ms) waited {waited:.0%} of its time for a core: "
                "other load on the cores")
    # Its warm-up pass, which also sets its kernels up, is never faster than a timed one unless load came.
    timed = seconds[first:]
    if max(timed) > MAX_SPREAD * min(seconds):
        return (f"{loser}'s passes differ {max(timed) / min(seconds):.2f}x "
                f"({', '.join(f'{1e3 * t:.0f}' for t in seconds)} ms, the first a warm-up): load came and went")
    return None


@contextlib.contextmanager
def _own_gradients(model: torch.nn.Module):
    """The probe's passes run on the model itself (a copy of a large one costs a good part
    of the time limit): its gradients and train/eval mode are put back after."""
    params = list(model.parameters())
    grads, training = [p.grad for p in params], model.training
    for p in params:
        p.grad = None
    model.train()
    try:
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        model.train(training)


def _timed_passes(model: torch.nn.Module, batch_size: int, block_size: int, slowdown: float,
                  measure: Callable[[torch.nn.Module, str, int, int], float],
                  calibrate: Callable[[torch.nn.Module, int], float],
                  times: dict[str, list[float]], waits: dict[str, list[Optional[float]]], shape: list[int],
                  deadline: float) -> tuple[str, str, bool]:
    """Step 2 of cpu_decision: (choice, why, complete), the passes' seconds added to `times`
    and the share of each that its threads waited for a core to `waits`, the probe's
    (sequences, tokens) put in `shape`. Not complete: stopped by the deadline before a timed
    round of both."""
    def fits(seconds: float) -> bool:
        return SAFETY * seconds <= deadline - _clock()

    tokens = min(block_size, 64)  # one short sequence: how fast fp32 passes go, to size the others
    before = _cpu_wait()
    seconds_per_flop = calibrate(model, tokens) / (model.flops_per_token(tokens) * tokens)
    waits["calibration"] = [wait_share(before, _cpu_wait())]
    shape[:] = probe_shape(model, batch_size, block_size, seconds_per_flop)
    sequences, tokens = shape
    first = seconds_per_flop * model.flops_per_token(tokens) * tokens * sequences  # the first fp32 pass, expected
    for round_ in range(ROUNDS):
        for name in ("fp32", "bf16"):
            fp32 = times["fp32"][-1] if times["fp32"] else first
            expected = times[name][-1] if times[name] else fp32 * max(slowdown, 0.5)
            if not fits(expected):
                if not times["bf16"]:  # the machine is slow or busy: the matmul probe decides
                    return _by_matmuls(slowdown, f"{sequences} sequences of {tokens} tokens")
                return (*_faster(times, f"stopped at the {DECISION_SECONDS:g} s deadline"), round_ > 1)
            before = _cpu_wait()
            seconds = measure(model, name, sequences, tokens)
            times[name].append(seconds)
            waits[name].append(wait_share(before, _cpu_wait()))
            # A slow bf16 warm-up where its matmuls are faster is its kernels' set-up (up to a second
            # on a busy machine): the timed rounds decide. Where they are not, it ends the probe,
            # unless load made it slow (it waited for the cores, or it is not believable): the
            # next rounds decide, and whether the answer is trusted (_distrust).
            warmup = round_ == 0
            ratio = seconds / times["fp32"][-1]
            credible = (waits[name][-1] is None or waits[name][-1] <= MAX_WAIT) and not (
                slowdown < 1.0 and ratio > UNBELIEVABLE)
            if name == "bf16" and ratio > (WARMUP_LOSING if warmup else LOSING) \
                    and not (warmup and slowdown < 1.0) and credible:
                return "fp32", (f"a bf16 pass took {ratio:.1f}x fp32's "
                                f"({1e3 * seconds:.0f} ms against {1e3 * times['fp32'][-1]:.0f} ms); probe stopped"), True
    return (*_faster(times, f"{sequences} sequences of {tokens} tokens"), True)


def _by_matmuls(slowdown: float, what: str) -> tuple[str, str, bool]:
    """The deadline left no room for model passes (a slow or busy machine, a large model)."""
    choice = "bf16" if slowdown < 0.75 else "fp32"
    return choice, (f"{what} too slow for the {DECISION_SECONDS:g} s limit (a busy or slow machine): by the "
                    f"matmuls alone, bf16 at {1 / slowdown:.2f}x fp32's speed"), False


def _faster(times: dict[str, list[float]], note: str) -> tuple[str, str]:
    """bf16 if its best timed pass (warm-ups only where nothing else ran) is 5% faster."""
    best = {name: _best(t) for name, t in times.items()}
    choice = "bf16" if best["bf16"] < 0.95 * best["fp32"] else "fp32"
    return choice, f"fp32 {1e3 * best['fp32']:.1f} ms, bf16 {1e3 * best['bf16']:.1f} ms per forward+backward, {note}"


class RunCheck:
    """A step callback: trainer.precision=auto's CPU decision checked against the run's own
    steps, once, and corrected.

    A decision is checked when its measurement was not trusted (not cached: load at start),
    when it came from a cache entry of an older version (made without load checks), or when
    the run's steady steps are RUN_FASTER times faster than the cached passes of its
    precision say they can be (an entry timed under load the checks missed; only where the
    passes ran the real micro-batch, so that a step, which adds the optimizer to a pass,
    cannot honestly be faster, and the model is not compiled: the passes are eager). From the second log window on, at the first one whose steps
    had the cores (rank 0's threads waited under MAX_WAIT of their runnable time; up to
    RUN_CHECK_WINDOWS windows), rank 0 measures again at the step boundary (cpu_decision,
    cache bypassed: bounded as at start, on the model itself, the global generators left as
    they were) while the others wait for its answer in the store. A trusted answer is cached;
    if it differs, every rank switches autocast from the next step (fp32 and bf16 need no
    loss scaler; Trainer.switch_precision), unless the run is deterministic: then only the
    cache is corrected, for the next runs. One line says what was found. Where the strategy
    fixed the compute dtype (FSDP) there is no check (for_trainer)."""

    def __init__(self, decision: Decision, clock: Callable[[], float] = time.perf_counter,
                 measure_again: Optional[Callable[[torch.nn.Module, int, int, str], Decision]] = None):
        """`clock` and `measure_again` (model, batch, block, cache file -> Decision) replaceable in tests."""
        self.decision = decision
        self._clock = clock
        self._measure_again = measure_again or (lambda model, batch, block, path: cpu_decision(
            model, batch, block, path, use_cache=False, announce=False))
        self._last: Optional[float] = None  # when the previous step ended
        self._intervals: list[float] = []  # this log window's step times
        self._wait = None  # rank 0's cpu_wait() at the window's start
        self._windows = 0  # log windows ended in this process (the first: warm-up)
        self.done = False

    @classmethod
    def for_trainer(cls, trainer) -> Optional["RunCheck"]:
        """The check for a run whose precision `auto` decided on a CPU at start (not a resume's)."""
        decision = getattr(trainer, "precision_decision", None)
        if decision is None or (decision.doubt is None and not _predicts_steps(decision.entry, trainer)):
            return None  # nothing to check it by
        if trainer.strategy.fixed_precision:
            # FSDP cannot switch, and timing its sharded model needs a whole unsharded copy built
            # mid-run (GPT.__init__ draws from rank 0's generator): it keeps auto's choice. An untrusted
            # one is not cached, a doubtful entry is kept: the next run without FSDP checks them.
            return None
        return cls(decision)

    def __call__(self, trainer) -> None:
        if self.done:
            return
        now = self._clock()
        if self._last is not None:
            self._intervals.append(now - self._last)
        self._last = now
        if trainer.state.step % trainer.cfg.log_every:
            return
        self._windows += 1
        intervals, self._intervals = self._intervals, []
        started, self._wait = self._wait, _cpu_wait() if trainer.dist.is_main else None
        if self._windows < 2:  # the first window warms up (allocations, thread pools)
            return
        verdict = distributed.wait_for_main(lambda: self._verdict(trainer, intervals, wait_share(started, self._wait)),
                                             "checking trainer.precision=auto against the run's steps")
        if verdict is None:
            return
        self.done = True
        choice, note = verdict
        if note:
            trainer.metrics.note(note)
        if choice is not None and choice != trainer.precision.name:
            trainer.switch_precision(PrecisionPlan(choice, trainer.device.type))
        self._last = self._clock()  # the measurement is no step

    def _verdict(self, trainer, intervals: list[float], share: Optional[float]):
        """Rank 0: None to look again at the next log window; else (the precision to switch
        to, or None) and the line to log (or None)."""
        if (share is not None and share > MAX_WAIT) or not intervals:  # others' load: not now
            if self._windows <= RUN_CHECK_WINDOWS:
                return None
            return None, (f"precision auto: {trainer.precision.name} kept unchecked ({self.decision.doubt}): other "
                          f"load on the cores in each of {RUN_CHECK_WINDOWS} log windows" if self.decision.doubt else None)
        step_s = sorted(intervals)[len(intervals) // 2]  # the median: an evaluation or save between steps is no step
        reason = self.decision.doubt or self._outrun(step_s, trainer)
        if reason is None:
            return None, None
        current, step = trainer.precision.name, trainer.state.step
        with torch.random.fork_rng(devices=[]):  # the run's own random stream is not the check's to move
            new = self._measure_again(trainer.model, trainer.cfg.batch_size, trainer.block_size, self.decision.path)
        head = f"precision auto: checked at step {step} ({reason}) by measuring again"
        if new.source != "measured":
            return None, f"{head}: not trusted either ({new.entry.get('untrusted')}); {current} kept, nothing cached"
        if new.choice == current:
            return None, f"{head}: {current} confirmed ({new.entry['why']}); cached"
        blocker = ("trainer.deterministic=true: a run does not change its numerics by timing"
                   if trainer.cfg.deterministic else None)
        if blocker:
            return None, (f"{head}: {new.choice} is faster here ({new.entry['why']}); cached for the next runs, this "
                          f"run stays in {current} ({blocker})")
        return new.choice, (f"{head}: {new.choice} is faster here ({new.entry['why']}): switching from {current} "
                            f"from step {step + 1}; cached")

    def _outrun(self, step_s: float, trainer) -> Optional[str]:
        """Why the decision's passes look timed under load, or None: the run's steps are
        RUN_FASTER times faster than the passes of its precision, where they ran the real micro-batch."""
        entry, name = self.decision.entry, trainer.precision.name
        if not _predicts_steps(entry, trainer):
            return None
        floor = _best(_cached_times(entry)[name]) * trainer.accum_steps
        if step_s * RUN_FASTER > floor:
            return None
        return (f"this run's {name} steps take {1e3 * step_s:.0f} ms where the decision's {name} passes took "
                f"{1e3 * floor:.0f} ms per step: they were timed under load")


def _predicts_steps(entry: dict, trainer) -> bool:
    """Whether the decision's passes of the run's precision ran the run's own micro-batch, as
    the run does: eager passes say nothing of a compiled model's steps (trainer.compile)."""
    return bool(_cached_times(entry).get(trainer.precision.name)) and not trainer.strategy.compiled and \
        entry.get("probe") == [trainer.cfg.batch_size, trainer.block_size]


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: measure again


def update_cache(path: str, key: str, change: Callable[[Any], Any]) -> None:
    """Set or delete one entry of a JSON cache that other processes update too (runs, ranks of
    other runs, bench): under an flock on `path`.lock, the file is read again, its `key` set to
    change(the entry there, or None), or deleted where that is None, and written atomically, so
    that no writer drops another's entries. A cache that cannot be written only costs a
    measurement next time."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with os.fdopen(_open_lock(f"{path}.lock"), "rb") as lock:
            if fcntl is not None:
                try:
                    fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
                except OSError as exc:  # a filesystem without flock: unserialised, as before
                    log.debug("no lock on %s.lock (%s)", path, exc)
            data = _read_json(path)
            old = data.get(key)
            new = change(old)
            if new is old:
                return
            if new is None:
                del data[key]
            else:
                data[key] = new
            _write_json(path, data)
    except OSError as exc:
        log.warning("could not cache a measurement in %s (%s)", path, exc)


def _open_lock(path: str) -> int:
    """The lock file, for writing where this user may (NFS's flock, emulated by POSIX locks,
    needs it), else read-only: in a cache directory a group shares, another user's 0644 lock
    file refused opening for append (flock needs no write access on a local filesystem)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:
        return os.open(path, os.O_RDONLY)


def _write_json(path: str, data: dict) -> None:
    """Atomically (update_cache holds the lock)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


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
