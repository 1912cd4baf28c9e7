"""Benchmarks of this machine and of this trainer's real code paths.

    python -m mingpt_ddp.bench peak                                   # matmul peak per dtype
    python -m mingpt_ddp.bench train model=gpt-micro data.block_size=64 trainer.batch_size=12
    python -m mingpt_ddp.bench data data.block_size=256 trainer.batch_size=16
    python -m mingpt_ddp.bench snapshot model=gpt2 url=s3://bucket/bench
    python -m mingpt_ddp.bench precision models=all                 # fp32 vs bf16, auto's choice
    python -m mingpt_ddp.bench fixed runs=5                         # a 1-step run's fixed costs
    python -m mingpt_ddp.bench sample model=gpt-mini data.block_size=128   # KV cache vs plain loop
    torchrun --standalone --nproc_per_node=2 -m mingpt_ddp.bench comm max_bytes=64MB

Each mode prints a table (rank 0) and writes it as JSON to `out=` (default
`outputs/bench/<mode>-<time>.json`, beside the runs and out of a checkout's tracked files;
`out=none` writes nothing). Arguments are `key=value`: the bench's own
options below, and otherwise Hydra overrides of the training config (`model=...`,
`data.*`, `trainer.*`, `optimizer.*`, `experiment=...`), composed from conf/ as main.py does.

  all:      out=PATH  wait_quiet=SECONDS (CPU: first wait up to this long for other
            processes to leave the cores idle; the JSON records how busy they were anyway)
  peak:     seconds=0.5 (per dtype and size)  sizes=1536,2048 (square sizes; device default); also
            the configured model's own matmuls (model=..., data.block_size, trainer.batch_size)
  train:    steps=20 warmup=5 (optimizer steps timed / run before timing); the JSON also has
            each step's loss, the first step's seconds (compiling included) and what DDP did
  data:     steps=2000 (optimizer steps' worth of batches); also the corpus: encoding MB/s
            and MB/s per core (when this node had no token file yet; data.tokenizer=bpe includes
            training the BPE), start-up with the token file reused,
            peak RSS, and the node's memory for the corpus (PSS of the mapped token file
            summed over the node's processes)
  snapshot: url=DIR-OR-FILE (any fsspec URL; default a temporary directory)  repeat=3
  comm:     min_bytes=8 max_bytes=256MB iters=N (default: by size) warmup=5; also the transport
            each rank's collectives use (gloo: TCP on GLOO_SOCKET_IFNAME; NCCL: P2P, SHM or
            NET/<plugin>, read from NCCL's own INFO log). project=TRAIN.json (a `bench train`
            JSON of one process: its step time is the compute) hosts=2,4,8,16: DDP's step time
            at N hosts of the link just measured, step = compute + exposed comm
  precision: steps=3 (timed forward+backward passes per precision; CPU): fp32 vs bf16, what
            trainer.precision=auto decides and how long that takes; models=gpt-nano,experiment=...
            (one row each; `all`: the five presets and the two CPU recipes); avx2=true|false
            (default: true on CPUs with more than AVX2): the same columns again for an AVX2-only
            CPU, measured in a child process under ATEN_CPU_CAPABILITY=avx2
            ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
  fixed:    runs=5 text_mb=1: a run's fixed costs. `python mingpt_ddp/main.py model=gpt-nano
            trainer.max_steps=1` on a generated text of text_mb MB, as a child process, `runs`
            times after one warm-up run (which fills the token cache): the median seconds of
            each phase from launch to the first step (interpreter, imports, Hydra, process
            group, data, model, precision, ...), of the step, and from the last step to exit
            (final evaluation, snapshot, closing sample, shutdown), read from the marks the run
            writes to $MINGPT_DDP_TIMELINE (profiling.mark); other overrides go to the run
  alloc:    vocabs=char,4096,50257 steps=N text_mb=3: glibc malloc's cost in a CPU run of gpt-nano
            per vocabulary (char, or a BPE of that many tokens), each run twice as a child process:
            before (GLIBC_TUNABLES=glibc.malloc.tcache_count=7, glibc's default, which the run
            leaves alone) and after (the run's own settings, distributed.keep_freed_host_memory):
            wall, user and system CPU seconds, the kernel's share, tokens/s of the steps, peak RSS;
            a warm-up run first trains the BPE and fills the token cache
  sample:   tokens=1000 repeat=3 vocab=65 snapshot=PATH (a snapshot file or run directory; default:
            random weights of the configured model, data.block_size and a vocabulary of `vocab`):
            tokens/s of GPT.generate with the KV cache and with the plain loop (the whole cropped
            context through the model per token), `tokens` new ones from one newline-like token at
            temperature 0.8, the two side by side `repeat` times (the best of each and every
            run's ratio); threads as trainer.cpu_threads (null: this process's share of the cores)

`train` runs `Trainer.fit()` itself, timing optimizer steps with a step callback, so it
measures the loop a real run executes: data, autocast, DDP or FSDP (trainer.strategy),
clipping, optimizer, logging. It also reports the bytes of parameters, gradients and
optimizer state read off the live tensors: each rank's own (its shards under FSDP) and the
whole model's (what every DDP rank holds).
Evaluations that fall between timed steps (epoch ends, trainer.eval_every as configured) are
left out of tokens/s and kept in wall tokens/s (bench train writes no snapshots).
MFU = model FLOPs per token (GPT.flops_per_token: 6N + 12*L*T*d) x tokens/s over all
processes / (matmul peak for the precision in use x processes), reported twice: against
the measured peak, and on known GPUs against the datasheet's dense peak.
"""
from __future__ import annotations

import copy
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as torch_dist

from mingpt_ddp import config, distributed
from mingpt_ddp.checkpoint import storage
from mingpt_ddp.errors import ConfigError, UserFacingError
from mingpt_ddp.tools import usage
from mingpt_ddp.metrics import (EMULATED_SLOWDOWN, MAX_MATMUL_SECONDS, MetricsLog, default_peak_sizes, matmul_flops,
                                mfu, mfu_record)

MODES = ("peak", "train", "data", "snapshot", "comm", "precision", "fixed", "alloc", "sample")
USAGE = f"usage: python -m mingpt_ddp.bench <{'|'.join(MODES)}> [key=value ...]"
# The bench's own options (keys without a dot); everything else goes to Hydra.
OPTIONS: dict[str, Any] = {
    "out": None, "wait_quiet": 0.0, "seconds": 0.5, "sizes": None, "steps": None, "warmup": 5,
    "url": None, "repeat": 3, "min_bytes": "8", "max_bytes": "256MB", "iters": None, "models": None,
    "project": None, "hosts": "2,4,8,16",
    "avx2": None, "runs": 5, "text_mb": 1.0, "vocabs": "char,4096,50257", "tokens": 1000, "vocab": 65,
    "snapshot": None,
}


# ---- arguments and config -------------------------------------------------------------
def parse_args(argv: list[str]) -> tuple[str, dict[str, Any], list[str]]:
    """(mode, bench options, Hydra overrides) from `mode key=value ...`."""
    if not argv or argv[0] not in MODES:
        raise ConfigError(f"{USAGE} (see --help)")
    options, overrides = dict(OPTIONS), []
    for arg in argv[1:]:
        key, eq, value = arg.partition("=")
        if eq and key in OPTIONS:
            options[key] = value
        else:
            overrides.append(arg)
    return argv[0], options, overrides


def parse_bytes(text: str) -> int:
    """'8', '64KB', '256MB', '1GB' (powers of 1024, as nccl-tests' -b/-e)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text).upper())
    if not m:
        raise ConfigError(f"not a size: {text!r} (e.g. 8, 64KB, 256MB)")
    return int(m[1]) * 1024 ** "_KMG".index(m[2] or "_")


def compose(overrides: list[str]):
    cfg = config.compose(overrides, job_name="bench")
    storage.resolve_secrets(cfg, [])  # as main() does: refused or redacted wherever shown
    return cfg


def encode_threads(cfg, dist) -> int:
    """The corpus encoding's threads, as main.py gives them (trainer.cpu_threads, the node's processes)."""
    from mingpt_ddp import config

    return distributed.encode_threads(config.cpu_threads_setting(cfg.trainer), dist.local_world_size)


def build_trainer(cfg, dist, saver=None):
    """Corpus, model and Trainer as main.train composes them (no snapshot to resume)."""
    from omegaconf import OmegaConf

    from mingpt_ddp import parallel
    from mingpt_ddp.checkpoint import storage
    from mingpt_ddp.corpus.token_cache import load_corpus
    from mingpt_ddp.model import GPTConfig
    from mingpt_ddp.trainer import Trainer, seed_everything

    corpus, _, tok = load_corpus(cfg.data, dist, cfg.trainer.load_retry_minutes, threads=encode_threads(cfg, dist))
    model_cfg = GPTConfig(vocab_size=tok.size, block_size=cfg.data.block_size,  # random weights (no init_from)
                          **{k: v for k, v in OmegaConf.to_container(cfg.model, enum_to_str=True).items()
                             if k != "init_from"})
    seed_everything(cfg.trainer.seed)
    model = parallel.build_model(cfg.trainer, model_cfg)
    seed_everything(cfg.trainer.seed + dist.rank)
    metadata = {"vocab": getattr(corpus.vocab, "chars", ""), "tokenizer": tok.to_dict(),
                "model_config": dict(vars(model_cfg)),
                "config": storage.redacted_config(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))}
    return Trainer(cfg.trainer, cfg.optimizer, model, corpus, dist, MetricsLog(None, enabled=False, total_steps=0),
                   saver, metadata, token_bytes=torch.from_numpy(tok.byte_lengths()))


def bench_run_settings(cfg, total_steps: int, keep_evaluations: bool = False) -> None:
    """Run exactly `total_steps` optimizer steps, with saving (and, unless `keep_evaluations`,
    evaluation) out of the way."""
    t = cfg.trainer
    t.max_steps = total_steps
    if not keep_evaluations:
        t.eval_every = 10**9
        t.eval_batches = 1
    t.save_every = 10**9
    t.snapshot_every_steps = None
    t.snapshot_every_minutes = 0  # never (null: every 30 minutes on GPUs, 10 on CPUs)
    # Enough epochs for the steps, without making the planner walk millions of epochs.
    windows = max(1, os.path.getsize(cfg.data.path) // cfg.data.block_size) if os.path.isfile(cfg.data.path) else 1
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_epoch = max(1, int(windows * 0.85) // (t.batch_size * t.grad_accum_steps * world))
    t.max_epochs = total_steps // per_epoch + 2


# ---- machine facts and noise ----------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def cpu_features() -> dict[str, Any]:
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "amx_bf16": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()),
        "avx512_bf16": bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }


def _busy_jiffies() -> Optional[tuple[int, int]]:
    try:
        fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]) - idle, sum(fields[:8])


def _own_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class CpuNoise:
    """How busy other processes kept this node's cores while we measured (0..1).

    Busy time from /proc/stat minus the CPU time of this job's processes (summed over
    the ranks when they all run on this node). Only a sign of how noisy a figure is.
    """

    def __init__(self, dist):
        self.dist = dist
        self.start = _busy_jiffies()
        self.own = _own_cpu_seconds()

    def fraction(self) -> Optional[float]:
        end, own = _busy_jiffies(), _own_cpu_seconds() - self.own
        total_own = distributed.all_reduce_sum(torch.tensor([own], dtype=torch.float64, device=self.dist.device)).item()
        if self.start is None or end is None or self.dist.world_size != self.dist.local_world_size:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        busy, total = (end[0] - self.start[0]) / hz, (end[1] - self.start[1]) / hz
        return round(max(0.0, min(1.0, (busy - total_own) / total)), 3) if total > 0 else None


def wait_until_quiet(max_seconds: float, dist, threshold: float = 0.15) -> Optional[float]:
    """Wait (up to max_seconds) until other processes use under `threshold` of the cores.

    Rank 0 alone decides when to stop, by its clock and its reading, and tells the others:
    ranks deciding by their own clocks could leave the loop on different rounds and wait
    forever in the next round's collective.
    """
    if max_seconds <= 0 or dist.device.type != "cpu":
        return None
    deadline = time.monotonic() + max_seconds
    while True:
        probe = CpuNoise(dist)
        time.sleep(1.0)
        busy = probe.fraction()  # a collective: every rank takes part in every round
        done = busy is None or busy < threshold or time.monotonic() >= deadline
        busy, done = distributed.broadcast_object((busy, done))
        if done:
            return busy


def all_ranks_max(value: float, device: torch.device) -> float:
    """The largest `value` over all ranks (a tensor on the device: NCCL reduces only GPU tensors)."""
    return distributed.all_reduce_max(torch.tensor([value], dtype=torch.float64, device=device)).item()


def peak_rss_bytes() -> int:
    """Max resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def peak_memory_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()


def environment(dist) -> dict[str, Any]:
    env = {
        "device": str(dist.device), "device_name": device_name(dist.device), "backend": dist.backend,
        "world_size": dist.world_size, "local_world_size": dist.local_world_size,
        "threads_per_process": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "host": platform.node(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if dist.device.type == "cpu":
        env["cpu"] = cpu_features()
    return env


# ---- fixed costs ------------------------------------------------------------------------
FIXED_RUN = ("model=gpt-nano", "trainer.max_steps=1")
# Phases that end at the first step, and the one that ends the step (profiling.mark names them).
FIRST_STEP, LAST_STEP = "first step starts", "last step ended"


def fixed_cost_text(path: str, megabytes: float) -> None:
    """A deterministic English-like text of `megabytes` MB (lines of words from a small
    vocabulary): the bench needs no download and measures the same text everywhere."""
    import random

    words = ("the and of to a in that is was he for it with as his on be at by had not are but from or have an "
             "they which one you were her all she there would their we him been has when who will more no if out "
             "so said what up its about into than them can only other new some could time these two may then do "
             "first any my now such like our over man me even most made after also did many before must through "
             "ROMEO JULIET KING LEAR HAMLET thou thee thy hath doth lord good sweet night love death").split()
    rng, lines, size = random.Random(0), [], 0
    while size < megabytes * 1e6:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
        line = line[0].upper() + line[1:] + rng.choice(".,;:!?")
        lines.append(line)
        size += len(line) + 1
    Path(path).write_text("\n".join(lines)[:int(megabytes * 1e6)])


def child_env(timeline: str) -> dict[str, str]:
    """The bench's own environment for a child run of its own: without the process-group
    variables this process set (the child is a single process), with the timeline file."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
            "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["MINGPT_DDP_TIMELINE"] = timeline
    return env


def timed_run(main_py: str, args: list[str], workdir: str, n: int) -> dict[str, Any]:
    """One child run: its phases, in order, as (name, seconds since the previous mark); the
    first from launch (fork/exec included), the last ("exit") to the parent's wait()."""
    timeline = os.path.join(workdir, f"timeline{n}.jsonl")
    command = [sys.executable, main_py, *args, f"hydra.run.dir={os.path.join(workdir, f'run{n}')}"]
    load = os.getloadavg()[0]
    launched = time.time()
    proc = subprocess.run(command, capture_output=True, text=True, env=child_env(timeline), timeout=900)
    exited = time.time()
    if proc.returncode != 0:
        raise UserFacingError(f"the run failed (exit {proc.returncode}): {' '.join(command)}\n{proc.stderr[-2000:]}")
    marks = [json.loads(line) for line in Path(timeline).read_text().splitlines()]
    times = [("launch", launched)] + [(m["phase"], m["t"]) for m in marks] + [("exit", exited)]
    phases = [(name, t - before) for (_, before), (name, t) in zip(times, times[1:])]
    at = dict(times)
    return {"phases": phases, "load_avg_1min": load, "total_s": exited - launched,
            "launch_to_first_step_s": at[FIRST_STEP] - launched,
            "step_s": at[LAST_STEP] - at[FIRST_STEP],
            "last_step_to_exit_s": exited - at[LAST_STEP]}


def run_fixed(dist, options: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    if dist.world_size != 1:
        raise ConfigError("bench fixed runs its child runs itself: start it as one process, not under torchrun")
    runs = int(options["runs"])
    if runs < 1:
        raise ConfigError(f"runs={runs}: give at least 1")
    main_py = str(Path(__file__).resolve().parents[1] / "main.py")
    workdir = tempfile.mkdtemp(prefix="mingpt-bench-fixed-")
    try:
        text = os.path.join(workdir, "text.txt")
        fixed_cost_text(text, float(options["text_mb"]))
        args = [*FIXED_RUN, f"data.path={text}", f"data.cache_dir={os.path.join(workdir, 'cache')}", *overrides]
        warmup = timed_run(main_py, args, workdir, 0)  # fills the token cache (and, if empty, the precision cache)
        results = [timed_run(main_py, args, workdir, n) for n in range(1, runs + 1)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    names = [name for name, _ in results[0]["phases"]]
    median = {name: statistics.median(dict(r["phases"])[name] for r in results) for name in names}
    keys = ("launch_to_first_step_s", "step_s", "last_step_to_exit_s", "total_s")
    return {"command": f"python mingpt_ddp/main.py {' '.join(args)} hydra.run.dir=...", "runs": runs,
            "phases": [{"phase": name, "median_s": median[name],
                        "runs_s": [dict(r["phases"])[name] for r in results]} for name in names],
            **{k: statistics.median(r[k] for r in results) for k in keys},
            "per_run": [{k: r[k] for k in (*keys, "load_avg_1min")} for r in results],
            "warmup": {k: warmup[k] for k in (*keys, "load_avg_1min")},
            "load_avg_1min": statistics.median(r["load_avg_1min"] for r in results)}


# Each vocabulary's run: steps and batch sized so that the three cases take about a minute on 2 cores,
# with logits above glibc's 32 MiB mmap ceiling in all but char (batch x 128 x vocab x 4 bytes).
ALLOC_CASES = {"char": ("data.tokenizer=char", 100, 32), "4096": ("data.tokenizer=bpe data.vocab_size=4096", 60, 32),
               "50257": ("data.tokenizer=bpe data.vocab_size=50257", 15, 8)}
# A malloc tunable at glibc's own default (tcache_count: 7): the run then leaves malloc alone
# (distributed._set_malloc_options), as it did before issue 32. Not mmap_max=65536: setting any of
# mmap_max, mmap_threshold, trim_threshold or top_pad also freezes glibc's mmap threshold at 128 KiB.
GLIBC_DEFAULT_MALLOC = "glibc.malloc.tcache_count=7"


def alloc_text(path: str, megabytes: float) -> None:
    """A text of many distinct made-up words, so that a BPE reaches GPT-2's 50,257 tokens."""
    import random

    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlucmfwypvbgkjqxz") for _ in range(rng.randint(3, 10))) for _ in range(80_000)]
    out, size = [], 0
    while size < megabytes * 1e6:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "."
        out.append(line)
        size += len(line) + 1
    Path(path).write_text("\n".join(out))


def alloc_child(args: list[str], workdir: str, name: str, tunables: Optional[str]) -> dict[str, Any]:
    """One run in a child process: its wall time, rusage (user, system, peak RSS) and step pace."""
    timeline = os.path.join(workdir, f"timeline-{name}.jsonl")
    env = child_env(timeline)
    env.pop("GLIBC_TUNABLES", None)
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    main_py = str(Path(__file__).resolve().parents[1] / "main.py")
    command = [sys.executable, main_py, *args, f"hydra.run.dir={os.path.join(workdir, name)}"]
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if status != 0:
        raise UserFacingError(f"the run failed ({status}): {' '.join(command)}\n{err[-2000:]}")
    marks = {m["phase"]: m["t"] for m in map(json.loads, Path(timeline).read_text().splitlines())}
    return {"wall_s": wall, "user_s": usage.ru_utime, "sys_s": usage.ru_stime,
            "kernel_share": usage.ru_stime / max(1e-9, usage.ru_utime + usage.ru_stime),
            "peak_rss_bytes": usage.ru_maxrss * 1024, "step_s": marks[LAST_STEP] - marks[FIRST_STEP]}


def run_alloc(dist, options: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    if dist.world_size != 1:
        raise ConfigError("bench alloc runs its child runs itself: start it as one process, not under torchrun")
    names = [v.strip() for v in str(options["vocabs"]).split(",") if v.strip()]
    unknown = [n for n in names if n not in ALLOC_CASES]
    if unknown:
        raise ConfigError(f"vocabs={','.join(unknown)}: choose among {','.join(ALLOC_CASES)}")
    workdir = tempfile.mkdtemp(prefix="mingpt-bench-alloc-")
    rows = []
    try:
        text = os.path.join(workdir, "text.txt")
        alloc_text(text, float(options["text_mb"]) if options["text_mb"] != OPTIONS["text_mb"] else 3.0)
        for name in names:
            data, steps, batch = ALLOC_CASES[name]
            steps = int(options["steps"] or steps)
            args = ["model=gpt-nano", "trainer.device=cpu", "trainer.precision=fp32", f"trainer.batch_size={batch}",
                    f"trainer.max_steps={steps}", "trainer.eval_batches=2", "trainer.final_eval_batches=2",
                    "data.block_size=128", f"data.path={text}", f"data.cache_dir={os.path.join(workdir, 'cache')}",
                    *data.split(), *overrides]
            alloc_child([*args, "trainer.max_steps=1"], workdir, f"{name}-warmup", None)  # BPE, token file
            for when, tunables in (("before", GLIBC_DEFAULT_MALLOC), ("after", None)):
                r = alloc_child(args, workdir, f"{name}-{when}", tunables)
                rows.append({"vocab": name, "when": when, "steps": steps, "batch_size": batch,
                             "tokens_per_s": steps * batch * 128 / r["step_s"], **r,
                             "command": f"python mingpt_ddp/main.py {' '.join(args)}"
                                        + (f" (GLIBC_TUNABLES={tunables})" if tunables else "")})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {"rows": rows, "cpu": cpu_features()}


# ---- output -----------------------------------------------------------------------------
def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return "-" if v is None else str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print(f"# {title}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
    sys.stdout.flush()


def write_json(path: Optional[str], mode: str, result: dict[str, Any]) -> None:
    target = path if path is not None else os.path.join("outputs", "bench", f"{mode}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    if target.lower() in ("none", "null", "-", ""):
        return
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    Path(target).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {target}")


# ---- modes ------------------------------------------------------------------------------
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def run_peak(dist, options: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Dense matmul TFLOP/s per dtype: at square sizes, and at the configured model's own
    matmuls (rows = batch x block), which is what a run's MFU is quoted against. Bounded in
    time on every CPU: a size whose one matmul would take over MAX_MATMUL_SECONDS (bf16 or
    fp16 emulated in software) is rated from one matmul of a few rows, and marked."""
    device = dist.device
    sizes = [int(s) for s in str(options["sizes"]).split(",")] if options["sizes"] else list(default_peak_sizes(device))
    names = ["fp32", "tf32", "bf16", "fp16"] if device.type == "cuda" else ["fp32", "bf16"]
    seconds = float(options["seconds"])
    cfg = compose(overrides)
    d = cfg.model.n_embd
    tokens = cfg.trainer.batch_size * cfg.data.block_size
    shapes = {"qkv": (tokens, d, 3 * d), "mlp up": (tokens, d, 4 * d), "mlp down": (tokens, 4 * d, d)}
    wait_until_quiet(float(options["wait_quiet"]), dist)
    noise = CpuNoise(dist)
    rows, best, model_peak = [], {}, {}
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    try:
        for name in names:
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            for label, shape in [*((str(n), (n, n, n)) for n in sizes), *shapes.items()]:
                rate = matmul_flops(device, DTYPES[name], shape, seconds, min_rows=shape[0])
                one_matmul_s = 2 * shape[0] * shape[1] * shape[2] / rate
                rows.append({"dtype": name, "matmul": label, "shape": list(shape), "tflops": rate / 1e12,
                             "one_matmul_s": one_matmul_s, "from_gauge": one_matmul_s > MAX_MATMUL_SECONDS})
                best[name] = max(best.get(name, 0.0), rate / 1e12)
            model_peak[name] = max(r["tflops"] for r in rows if r["dtype"] == name and r["matmul"] in shapes)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
    emulated = [n for n in ("bf16", "fp16") if n in model_peak and model_peak[n] * EMULATED_SLOWDOWN < model_peak["fp32"]]
    return {"rows": rows, "peak_tflops": best, "model": {**_container(cfg.model), "tokens": tokens},
            "model_peak_tflops": model_peak, "emulated": emulated, "other_cpu_busy": noise.fraction()}


def run_train(dist, options: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    cfg = compose(overrides)
    steps, warmup = int(options["steps"] or 20), int(options["warmup"])
    if steps < 1 or warmup < 0:
        raise ConfigError("steps must be >= 1 and warmup >= 0")
    bench_run_settings(cfg, warmup + steps, keep_evaluations=True)  # as configured: in the wall time only
    wait_until_quiet(float(options["wait_quiet"]), dist)
    trainer = build_trainer(cfg, dist)
    device = trainer.device
    step_s: list[float] = []  # each optimizer step's seconds, evaluations left out
    noise: list[CpuNoise] = []
    last = [0.0]
    wall = [0.0, 0.0]  # the timed steps' start and end, evaluations between them included

    losses: list[torch.Tensor] = []  # each step's loss, on the device (read once, at the end)
    first_step_s = [0.0]  # start of fit() to the end of the first step: compiling included

    def step_keeping_loss(micro_batches, step=trainer._optimizer_step):
        loss = step(micro_batches)
        losses.append(loss.detach().clone())
        return loss

    def on_step(t) -> None:
        if t.state.step in (1, warmup, warmup + steps):
            sync(device)  # GPU work is asynchronous: only time what has finished
        if t.state.step == 1:
            first_step_s[0] = time.perf_counter() - started
        if t.state.step == warmup:
            noise.append(CpuNoise(dist))
        now = time.perf_counter()
        if t.state.step > warmup:
            step_s.append(now - last[0])
        last[0] = now
        if t.state.step == warmup:
            wall[0] = now
        if t.state.step == warmup + steps:
            wall[1] = now

    def evaluate_untimed(*args, evaluate=trainer.evaluate, **kwargs):
        """An epoch-end evaluation between timed steps (e.g. gpt2 at block 1024 on 2 GPUs
        has 15 steps per epoch): the clock restarts after it, so no timed step holds it."""
        sync(device)
        result = evaluate(*args, **kwargs)
        sync(device)
        last[0] = time.perf_counter()
        return result

    if not hasattr(trainer, "step_callbacks"):
        raise ConfigError("this Trainer has no step_callbacks (issue 7's trainer.py change): cannot time steps")
    trainer.step_callbacks.append(on_step)
    trainer.evaluate = evaluate_untimed
    trainer._optimizer_step = step_keeping_loss
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if warmup == 0:
        sync(device)
        noise.append(CpuNoise(dist))
        last[0] = wall[0] = time.perf_counter()
    started = time.perf_counter()
    trainer.fit()
    state_bytes = measured_state_bytes(trainer)
    elapsed = sum(step_s[-steps:])
    slowest = all_ranks_max(elapsed, device)
    tokens = steps * trainer.global_batch * trainer.block_size
    tokens_per_s = tokens / slowest
    wall_s = all_ranks_max(wall[1] - wall[0], device)
    memory = all_ranks_max(float(peak_memory_bytes(device)), device)
    best_tokens_per_s = tokens / steps / best_window(step_s[-steps:]) if device.type == "cpu" else None
    # the loss of every step, averaged over the ranks (one sync: FSDP's against DDP's, gpu_smoke.sh)
    step_losses = (distributed.all_reduce_sum(torch.stack(losses).float()) / dist.world_size).tolist()
    peak, peak_raised = peak_at_least_reached(trainer.peak_flops, trainer.flops_per_token,
                                              max(tokens_per_s, best_tokens_per_s or 0.0) / dist.world_size)
    return {
        "model": {k: cfg.model[k] for k in ("n_layer", "n_head", "n_embd", "dropout")},
        "parameters": trainer.model.num_params(non_embedding=False),
        "block_size": trainer.block_size,
        "batch_size": trainer.micro_batch, "grad_accum_steps": trainer.accum_steps,
        "global_batch": trainer.global_batch, "precision": trainer.precision.name,
        "compile": trainer.strategy.compiled, "log_every": cfg.trainer.log_every,
        # graphs dynamo really compiled (0 where TORCHDYNAMO_DISABLE or a fallback ran it eager)
        "compiled_graphs": _compiled_graphs() if trainer.strategy.compiled else 0,
        "steps": steps, "warmup": warmup,
        "tokens_per_s": tokens_per_s, "tokens_per_s_per_process": tokens_per_s / dist.world_size,
        # over the timed steps' wall time, evaluations among them included (trainer.eval_every as
        # configured; bench train writes no snapshots): what a run's length is planned from
        "wall_tokens_per_s": tokens / max(wall_s, slowest),
        "eval_every": cfg.trainer.eval_every,
        "ms_per_step": 1e3 * slowest / steps,
        # per-step times only mean something where the host waits for the device (CPU)
        "ms_per_step_median": 1e3 * statistics.median(step_s) if device.type == "cpu" else None,
        # on a shared machine other jobs slow some steps down: the fastest stretch of
        # consecutive steps (a fifth of them) shows what the machine does undisturbed
        "ms_per_step_best_window": 1e3 * best_window(step_s[-steps:]) if device.type == "cpu" else None,
        "tokens_per_s_best_window": best_tokens_per_s,
        "flops_per_token": trainer.flops_per_token,
        # raised to what the steps reached where they beat the start-up measurement (as the
        # trainer's log does): MFU never reads over 100%
        "peak_flops_per_process": peak, "peak_raised_to_reached": peak_raised,
        # the vendor's dense peak (known GPUs only): the MFU nanoGPT and PaLM quote, and then
        # `mfu`'s too (metrics.mfu_record); `mfu_measured` against the measured peak
        "datasheet_peak_flops_per_process": trainer.datasheet_peak_flops,
        "mfu_datasheet": None,
        **mfu_record(trainer.flops_per_token, tokens_per_s, peak, trainer.datasheet_peak_flops, dist.world_size),
        "strategy": trainer.strategy.name,
        "first_step_s": all_ranks_max(first_step_s[0], device),  # includes compiling (trainer.compile)
        "losses": step_losses,
        # what trains the model: the DDP wrapper and its process group (trainer.ddp_one_process
        # wraps one process too), or FSDP's group, or the plain model
        "process_group": torch_dist.get_backend() if torch_dist.is_initialized() else None,
        "ddp": ddp_facts(trainer.strategy.train_model),
        # parameters, gradients and optimizer state: the largest rank's own (shards under
        # FSDP), and the whole model's (what every DDP rank holds)
        "state_bytes_per_rank": state_bytes["per_rank"], "state_bytes_whole_model": state_bytes["whole_model"],
        "peak_memory_bytes": int(memory),
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "max RSS",
        "other_cpu_busy": noise[0].fraction() if noise else None,
    }


def ddp_facts(model: torch.nn.Module) -> Optional[dict[str, Any]]:
    """What DDP's own log says it did (None: the model is not DDP-wrapped): its backend and
    world size, whether its reducer rebuilt its buckets (after the first backward that reduced
    gradients through them) and how many it reduced in a sampled iteration."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return None
    data = model._get_ddp_logging_data()
    return {"backend": data.get("backend_name"), "world_size": data.get("world_size"),
            "bucket_cap_bytes": data.get("bucket_cap_bytes"),
            "buckets": len(str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "").split(",")),
            "rebuilt_buckets": bool(data.get("has_rebuilt_buckets")), "buckets_reduced": data.get("num_buckets_reduced")}


def measured_state_bytes(trainer) -> dict[str, dict[str, int]]:
    """Bytes of parameters, gradients and optimizer state read off the live tensors, after
    one more forward and backward (gradients exist only within a step): the largest rank's
    local share, and the whole model's."""
    from mingpt_ddp.char_dataset import to_device

    windows = torch.arange(min(trainer.micro_batch, len(trainer.val_windows)))
    x, y = to_device(trainer.val_windows.gather(windows), trainer.device)
    with trainer.precision.autocast():
        _, loss = trainer.strategy.train_model(x, y)
    trainer.scaler.scale(loss).backward()
    mine = trainer.strategy.state_bytes(trainer.optimizer)
    whole = trainer.strategy.state_bytes(trainer.optimizer, local=False)
    trainer.optimizer.zero_grad(set_to_none=True)
    return {"per_rank": {k: int(all_ranks_max(float(v), trainer.device)) for k, v in mine.items()},
            "whole_model": whole}


def peak_at_least_reached(peak: Optional[float], flops_per_token: float,
                          tokens_per_s_per_process: float) -> tuple[Optional[float], bool]:
    """(the peak to quote MFU against, whether it was raised): a measured start-up peak held
    down by others' load can sit below what the steps then reach; the reached rate is the
    better lower bound of the peak."""
    reached = flops_per_token * tokens_per_s_per_process
    if peak is not None and reached > peak:
        return reached, True
    return peak, False


def best_window(step_s: list[float]) -> float:
    """Mean step time of the fastest run of len/5 consecutive steps (at least 1)."""
    k = max(1, len(step_s) // 5)
    return min(sum(step_s[i:i + k]) / k for i in range(len(step_s) - k + 1))


def mapped_file_memory(path: str) -> Optional[tuple[int, int]]:
    """(resident, proportional) bytes of this process's mappings of `path`, from Linux's
    /proc/self/smaps: PSS splits each shared page between the processes mapping it, so the
    PSS summed over a node's processes is the node's memory for that file."""
    try:
        with open("/proc/self/smaps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rss = pss = 0
    inside = False
    for line in lines:
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(path)
        elif inside and line.startswith(("Rss:", "Pss:")):
            kib = int(line.split()[1]) * 1024
            rss, pss = (rss + kib, pss) if line.startswith("Rss:") else (rss, pss + kib)
    return rss, pss


def run_data(dist, options: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """The corpus (encoding, or reusing, this node's token file; start-up; memory per node)
    and the trainer's own batch building (sampler order, window gather, host-to-device copy)."""
    from mingpt_ddp.corpus import token_cache
    from mingpt_ddp.corpus.token_cache import load_corpus

    cfg = compose(overrides)
    steps = int(options["steps"] or 2000)
    bench_run_settings(cfg, steps)
    wait_until_quiet(float(options["wait_quiet"]), dist)
    start, cpu_start = time.perf_counter(), _own_cpu_seconds()
    _, token_file, tok = load_corpus(cfg.data, dist, cfg.trainer.load_retry_minutes,
                                     threads=encode_threads(cfg, dist))  # encodes unless cached
    first_load_s = time.perf_counter() - start
    first_load_cpu_s = _own_cpu_seconds() - cpu_start  # all of this process's threads: robust to other jobs
    # A first Trainer takes the one-off costs of a process (peak FLOP/s, first kernels), the
    # same for any corpus; what follows is what differs between corpora when the token file exists.
    build_trainer(cfg, dist)
    start = time.perf_counter()
    load_corpus(cfg.data, dist, cfg.trainer.load_retry_minutes, threads=encode_threads(cfg, dist))
    cached_load_s = time.perf_counter() - start
    trainer = build_trainer(cfg, dist)
    device = trainer.device
    noise = CpuNoise(dist)
    if not hasattr(trainer, "step_batches"):
        raise ConfigError("this Trainer has no public step_batches() (issue 7's trainer.py change)")
    batches_start = time.perf_counter()
    batches = trainer.step_batches()
    first = next(batches)
    sync(device)
    first_s = time.perf_counter() - batches_start
    startup_s = all_ranks_max(time.perf_counter() - start, device)
    done, samples = 1, sum(len(x) for x, _ in first)
    while done < steps:
        try:
            group = next(batches)
        except StopIteration:  # end of the epoch: the next one starts over
            batches = trainer.step_batches()
            continue
        samples += sum(len(x) for x, _ in group)
        done += 1
    sync(device)
    elapsed = time.perf_counter() - batches_start
    slowest = all_ranks_max(elapsed, device)
    per_rank = samples / slowest
    # Every page of the token file read once by every rank (an epoch does as much): the
    # node's memory for the corpus is then what the ranks' mappings add up to.
    trainer.corpus.tokens.numpy().max()  # (a sum would widen the whole corpus to int64; torch has no uint16 max)
    mapped = mapped_file_memory(os.path.join(token_cache.tokens_dir(cfg.data.cache_dir), token_file.name))
    node_pss = None
    if mapped is not None:
        node_pss = distributed.all_reduce_sum(torch.tensor([float(mapped[1])], dtype=torch.float64,
                                                           device=device)).item()
    one_node = dist.world_size == dist.local_world_size
    return {
        "block_size": trainer.block_size, "batch_size": trainer.micro_batch,
        "grad_accum_steps": trainer.accum_steps, "steps": steps,
        "samples_per_s": per_rank * dist.world_size, "samples_per_s_per_process": per_rank,
        "tokens_per_s": per_rank * dist.world_size * trainer.block_size,
        "us_per_step_batch": 1e6 * slowest / steps,
        "epoch_start_ms": 1e3 * first_s,
        "corpus": cfg.data.path, "corpus_bytes": token_file.corpus_bytes,
        "token_file_bytes": token_file.length * np.dtype(token_file.dtype).itemsize, "token_dtype": token_file.dtype,
        "tokenizer": tok.describe(), "bytes_per_token": token_file.corpus_bytes / token_file.length,
        "encoded": token_file.encode_s is not None, "first_load_s": first_load_s,
        "encode_MBps": token_file.corpus_bytes / 1e6 / token_file.encode_s if token_file.encode_s else None,
        # the threads the encoding used (char encodes on one; bpe and gpt2 as a run would, encode_threads)
        "encode_cores": 1 if tok.kind == "char" else encode_threads(cfg, dist),
        # MB per second of CPU time (what one core does, whatever else shares the machine)
        "encode_MB_per_cpu_s": token_file.corpus_bytes / 1e6 / first_load_cpu_s if token_file.encode_s else None,
        "cached_load_s": cached_load_s,
        # token file reused -> corpus mapped, Trainer built, first step's batches ready
        "startup_s": startup_s,
        "peak_rss_bytes": int(all_ranks_max(float(peak_rss_bytes()), device)),
        "token_map_rss_bytes": mapped[0] if mapped else None,
        "node_token_map_pss_bytes": int(node_pss) if node_pss is not None and one_node else None,
        "other_cpu_busy": noise.fraction(),
    }


def run_snapshot(dist, options: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Save/load times of one snapshot of this config, and what a save blocks training for."""
    from mingpt_ddp.checkpoint import storage
    from mingpt_ddp.checkpoint.snapshot import BackgroundSaver, SnapshotStore, decode, encode, to_cpu

    cfg = compose(overrides)
    repeat = max(1, int(options["repeat"]))
    bench_run_settings(cfg, 1)
    own_dir = None
    url = options["url"]
    if not url:
        own_dir = distributed.broadcast_object(tempfile.mkdtemp(prefix="mingpt-bench-") if dist.is_main else None)
        url = own_dir
    path = url if url.endswith(".pt") else url.rstrip("/") + "/bench-snapshot.pt"
    store_options = storage.resolve_options(cfg.trainer.storage_options, "trainer.storage_options")
    store = SnapshotStore(path, keep_last=1, storage_options=store_options,
                          retry_minutes=cfg.trainer.load_retry_minutes)
    distributed.on_main_then_share(store.check_writable, dist)
    trainer = build_trainer(cfg, dist)
    trainer.fit()  # one optimizer step: the optimizer state exists, as in any real snapshot
    saver = BackgroundSaver(store, cfg.trainer.save_retry_minutes) if dist.is_main else None
    wait_until_quiet(float(options["wait_quiet"]), dist)
    noise = CpuNoise(dist)
    rows: list[dict[str, float]] = []
    for i in range(repeat):
        t0 = time.perf_counter()
        state = trainer.state_dict()  # what Trainer.save does before handing over to the writer
        t1 = time.perf_counter()
        if saver is not None:  # only rank 0 copies and writes, as in training
            saver.submit(state, trainer.state.step)  # the copy to host memory; the write goes on in the background
        t2 = time.perf_counter()
        error = saver.wait() if saver is not None else None
        t3 = time.perf_counter()
        if distributed.broadcast_object(error):
            raise ConfigError(error or "saving the snapshot failed")
        row = {"state_dict_s": t1 - t0, "copy_to_cpu_s": t2 - t1, "blocking_s": t2 - t0,
               "background_write_s": t3 - t2}
        if dist.is_main:
            on_cpu = to_cpu(state)
            t4 = time.perf_counter()
            blob = encode(on_cpu, trainer.state.step)
            t5 = time.perf_counter()
            written = store.save(blob, trainer.state.step)
            t6 = time.perf_counter()
            raw = store.fs.cat_file(store.step_path(trainer.state.step))
            t7 = time.perf_counter()
            decode(raw, written)
            t8 = time.perf_counter()
            loaded = store.load_latest()
            t9 = time.perf_counter()
            assert loaded is not None
            row.update(encode_s=t5 - t4, write_s=t6 - t5, save_s=t6 - t4, read_s=t7 - t6, decode_s=t8 - t7,
                       load_s=t9 - t8, bytes=len(blob))
            if store.is_local:  # what the background writer does on local/FSx paths: no bytes built
                del blob
                t10 = time.perf_counter()
                store.save(on_cpu, trainer.state.step)
                row.update(streamed_save_s=time.perf_counter() - t10)
        rows.append(row)
        distributed.barrier()
    if dist.is_main:
        for p in store.candidates():
            store.fs.rm(p)
        if own_dir:
            shutil.rmtree(own_dir, ignore_errors=True)
    best = {k: min(r[k] for r in rows) for k in rows[0]}
    return {"url": path, "parameters": trainer.model.num_params(non_embedding=False), "repeat": repeat,
            "best": best, "runs": rows, "other_cpu_busy": noise.fraction()}


def comm_iters(size: int) -> int:
    """Timed iterations per size: more for small messages, and never fewer than nccl-tests'
    default of 20 (5 at 64 MiB and up gave figures that moved by tens of percent)."""
    return 100 if size <= 1 << 16 else 50 if size <= 1 << 20 else 20


class Stopwatch:
    """Seconds between start() and stop(): CUDA events on GPUs (the device's own clock, as
    nccl-tests times), the host clock after the work on CPUs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return time.perf_counter() - self._t0


NCCL_LOG_DIR = "MINGPT_NCCL_LOG_DIR"  # where nccl_log_to_files() sent NCCL's INFO log


def nccl_log_to_files() -> None:
    """Before NCCL starts (GPUs only): NCCL's INFO log into one file per process, read back
    after the collectives to say which transport NCCL chose. Where NCCL_DEBUG_FILE is the
    user's own, nothing changes (and the transport is not reported)."""
    if not torch.cuda.is_available() or os.environ.get("NCCL_DEBUG_FILE"):
        return
    log_dir = tempfile.mkdtemp(prefix="mingpt-nccl-")
    os.environ.update({NCCL_LOG_DIR: log_dir, "NCCL_DEBUG": "INFO",
                       "NCCL_DEBUG_FILE": os.path.join(log_dir, f"nccl.{os.getpid()}.log")})


def _compiled_graphs() -> int:
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def nccl_transport(log: str) -> dict[str, Any]:
    """What NCCL's INFO log says it chose: its version, the transports of its channels
    ("P2P" GPU peer access over NVLink/PCIe, "SHM" shared memory, "NET/<network>" between
    nodes), the network plugin (and the libfabric provider under aws-ofi-nccl)."""
    kinds: dict[str, int] = {}
    for kind, sub in re.findall(r" via (\w+)(?:/([^/\n]+))?", log):
        name = f"NET/{sub}" if kind == "NET" and sub else kind
        kinds[name] = kinds.get(name, 0) + 1
    version = re.search(r"NCCL version ([\w.+-]+)", log)
    network = re.search(r"Using network (.+)", log)
    provider = re.search(r"NET/OFI Selected [Pp]rovider is (\w+)", log)
    plugin = re.search(r"NET/OFI Initializing (aws-ofi-nccl [\w.-]+)", log)
    return {"nccl": version and version[1], "channels": kinds, "network": network and network[1].strip(),
            "provider": provider and provider[1], "plugin": plugin and plugin[1]}


def describe_transport(t: dict[str, Any]) -> str:
    """One line for a rank's transport, with the sign of lost GPU peer access."""
    if t["backend"] == "gloo":
        ifname = t.get("gloo_socket_ifname")
        return f"gloo over TCP on {f'interface {ifname} (GLOO_SOCKET_IFNAME)' if ifname else 'the address the host name resolves to (GLOO_SOCKET_IFNAME unset)'}"
    if "channels" not in t:
        return f"NCCL: {t.get('unknown', 'transport unknown')}"
    parts = [f"{k} x{n}" for k, n in sorted(t["channels"].items())] or ["no channel set up (one rank)"]
    line = f"NCCL {t['nccl'] or '?'}: " + ", ".join(parts)
    if t["network"]:
        line += f"; network {t['network']}" + (f" ({t['plugin']}, provider {t['provider']})" if t["plugin"] or t["provider"] else "")
    if "SHM" in t["channels"] and "P2P" not in t["channels"]:
        line += ("; GPUs of a node talk through host shared memory, not peer access: each rank sees only its "
                 "own GPU (srun --gpus-per-task=1, cgroup device isolation) or P2P is disabled (NCCL_P2P_DISABLE)")
    return line


def own_transport(dist) -> dict[str, Any]:
    """This rank's transport, as far as it can be known."""
    found: dict[str, Any] = {"rank": dist.rank, "host": platform.node(), "backend": dist.backend}
    if dist.backend == "gloo":
        found["gloo_socket_ifname"] = os.environ.get("GLOO_SOCKET_IFNAME")
        return found
    log_file = os.environ.get("NCCL_DEBUG_FILE", "")
    if not os.environ.get(NCCL_LOG_DIR) or not os.path.isfile(log_file):
        found["unknown"] = "transport unknown (NCCL_DEBUG_FILE is set by you: look for ' via ' lines there)"
        return found
    with open(log_file, errors="replace") as f:
        found.update(nccl_transport(f.read()))
    return found


def run_comm(dist, options: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """all_reduce bandwidth over the process group, as nccl-tests' all_reduce_perf reports it;
    the transport behind it; and, given a one-process `bench train` JSON, DDP's step time
    projected to N hosts of this link."""
    if overrides:
        raise ConfigError(f"comm takes no config overrides: {overrides}")
    compute = load_compute(options["project"]) if options["project"] else None
    hosts = parse_hosts(options["hosts"])
    own_group = not torch_dist.is_initialized()
    if own_group:  # one process: a group of one still measures the call's own cost
        torch_dist.init_process_group(dist.backend, store=torch_dist.HashStore(), rank=0, world_size=1)
    n = torch_dist.get_world_size()
    if compute is not None and n < 2:
        raise ConfigError("project= needs the all_reduce measured over 2 or more ranks, one per host across the "
                          "link (torchrun --nnodes=2 --nproc_per_node=1 ...)")
    lo, hi = parse_bytes(options["min_bytes"]), parse_bytes(options["max_bytes"])
    warmup = int(options["warmup"])
    sizes, s = [], max(4, lo)
    while s <= hi:
        sizes.append(s)
        s *= 2
    wait_until_quiet(float(options["wait_quiet"]), dist)
    noise = CpuNoise(dist)
    rows = []
    stopwatch = Stopwatch(dist.device)
    for size in sizes:
        count = max(1, size // 4)
        iters = int(options["iters"] or comm_iters(size))
        # Zeros stay zeros under any number of summing all-reduces; ones doubled (x ranks)
        # every iteration and reached inf after ~40 iterations on 8 ranks.
        buf = torch.zeros(count, dtype=torch.float32, device=dist.device)
        for _ in range(warmup):
            torch_dist.all_reduce(buf)
        sync(dist.device)
        torch_dist.barrier()
        stopwatch.start()
        for _ in range(iters):
            torch_dist.all_reduce(buf)
        seconds = stopwatch.stop() / iters
        seconds = all_ranks_max(seconds, dist.device) if not own_group else seconds
        finite = bool(torch.isfinite(buf).all().item())
        buf.fill_(torch_dist.get_rank() + 1)  # check the sum, as nccl-tests counts #wrong
        torch_dist.all_reduce(buf)
        wrong = int((buf != n * (n + 1) / 2).sum().item())
        algbw = count * 4 / seconds / 1e9
        rows.append({"size": count * 4, "count": count, "type": "float", "redop": "sum", "time_us": seconds * 1e6,
                     "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (n - 1) / n, "wrong": wrong,
                     "iters": iters, "timed_data_finite": finite})
    transport = distributed.all_gather_object(own_transport(dist))
    if own_group:
        torch_dist.destroy_process_group()
    result = {"ranks": n, "rows": rows, "avg_busbw_GBps": statistics.mean(r["busbw_GBps"] for r in rows),
              "other_cpu_busy": noise.fraction(), "transport": transport}
    if compute is not None:
        result["projection"] = {"compute": compute,
                                "hosts": [project_ddp_step(compute, rows, h) for h in hosts]}
    return result


# ---- DDP's step time at N hosts of a link, from its measured busbw --------------------------
BACKWARD_SHARE = 2 / 3  # of a training step's compute: backward is ~2x the forward's FLOPs
FIRST_BUCKET_BYTES = 1 << 20  # DDP's first (rebuilt) bucket: torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


def parse_hosts(text: str) -> list[int]:
    try:
        hosts = [int(h) for h in str(text).split(",") if h.strip()]
    except ValueError:
        hosts = []
    if not hosts or min(hosts) < 2:
        raise ConfigError(f"hosts={text}: give host counts of 2 or more, e.g. hosts=2,4,8")
    return hosts


def load_compute(path: str) -> dict[str, Any]:
    """What the projection needs from a `bench train` JSON of one process: the step time
    (compute alone, no gradient exchange), the gradient bytes and DDP's bucket size."""
    try:
        train = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"project={path}: cannot read a bench train JSON there ({exc})") from None
    if train.get("mode") != "train" or train.get("env", {}).get("world_size") != 1:
        raise ConfigError(f"project={path}: give the JSON of `python -m mingpt_ddp.bench train ... out={path}` "
                          "run as one process (its step time is the compute without any gradient exchange)")
    if train.get("strategy", "ddp") != "ddp":
        raise ConfigError(f"project={path}: the projection models DDP's all_reduce; this run used {train['strategy']}")
    cfg = compose(train.get("overrides", []))
    step_ms = train.get("ms_per_step_median") or train["ms_per_step"]
    return {"step_ms": step_ms, "gradient_bytes": int(train["state_bytes_whole_model"]["gradients"]),
            "bucket_bytes": int(config.ddp_bucket_cap_mb(cfg.trainer, torch.device(train["env"].get("device", "cpu")).type) * 2**20),
            "parameters": train["parameters"],
            "source": path}


def busbw_at(rows: list[dict[str, Any]], size: int) -> float:
    """Measured busbw at `size` bytes, interpolated on a log scale between the sizes measured
    (the nearest end outside them)."""
    import math

    pts = sorted((r["size"], r["busbw_GBps"]) for r in rows if r["busbw_GBps"] > 0)
    if size <= pts[0][0]:
        return pts[0][1] * size / pts[0][0]  # below the smallest size the time stays latency-bound
    for (s0, b0), (s1, b1) in zip(pts, pts[1:]):
        if size <= s1:
            w = math.log(size / s0) / math.log(s1 / s0)
            return b0 + w * (b1 - b0)
    return pts[-1][1]


def project_ddp_step(compute: dict[str, Any], rows: list[dict[str, Any]], hosts: int) -> dict[str, Any]:
    """DDP's step time at `hosts` hosts of this link: step = compute + exposed comm.

    The gradients leave in DDP's buckets (the first 1 MiB, then the configured size), in
    the order backward produces them; each bucket's ring all_reduce moves 2(N-1)/N of its
    bytes over every host's link and takes that over the busbw measured at its size (a
    ring's busbw does not depend on N). A bucket's all_reduce starts when backward has
    produced the bucket (gradients taken to arrive evenly over the backward, BACKWARD_SHARE
    of the step) and the previous one has finished; what runs past the end of the backward
    is exposed. Latency that grows with N (2(N-1) hops) is left out.
    """
    compute_s, grad, cap = compute["step_ms"] / 1e3, compute["gradient_bytes"], compute["bucket_bytes"]
    buckets, left = [], grad
    for limit in [min(FIRST_BUCKET_BYTES, cap)] + [cap] * (grad // max(1, cap) + 1):
        if left <= 0:
            break
        buckets.append(min(limit, left))
        left -= buckets[-1]
    backward_s = compute_s * BACKWARD_SHARE
    backward_start = compute_s * (1 - BACKWARD_SHARE) / 2  # forward first; the optimizer step after
    done, end, comm_s = 0, 0.0, 0.0
    for size in buckets:
        done += size
        ready = backward_start + backward_s * done / grad
        seconds = size * 2 * (hosts - 1) / hosts / (busbw_at(rows, size) * 1e9)
        end = max(ready, end) + seconds
        comm_s += seconds
    exposed_s = max(0.0, end - (backward_start + backward_s))
    return {"hosts": hosts, "buckets": len(buckets), "comm_ms": 1e3 * comm_s, "exposed_ms": 1e3 * exposed_s,
            "compute_ms": 1e3 * compute_s, "step_ms": 1e3 * (compute_s + exposed_s)}


PRECISION_TABLE = ("gpt-nano", "gpt-micro", "gpt-mini", "gopher-44m", "gpt2", "experiment=char_cpu_fast",
                   "experiment=shakespeare_char_cpu")
# What makes a CPU with AVX-512 (and AMX) run like an AVX2-only one (AMD Zen 2/3, most
# laptops): ATen's AVX2 kernels, oneDNN and MKL limited to AVX2, so bf16 has no instructions.
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
SLOW_PASS_SECONDS = 10.0  # a pass of a precision the matmul probe finds several times slower: at most this long


def precision_row(model, batch: int, block: int, steps: int) -> dict[str, Any]:
    """fp32 and bf16 forward+backward seconds at `batch` x `block`, and what auto decides and
    how long that took (cold cache). bf16 where its matmuls are slower (emulated): one pass
    of as many sequences as fit into SLOW_PASS_SECONDS at their slowdown, or none."""
    from mingpt_ddp import precision

    fp32 = precision.step_seconds(model, "fp32", batch, block, steps)
    slowdown = precision.bf16_matmul_slowdown(model.cfg.n_embd, batch * block)
    row: dict[str, Any] = {"fp32_tokens_per_s": batch * block / fp32, "bf16_matmul_slowdown": slowdown}
    # Full timed passes only where bf16's matmuls are faster (so its passes cost less than
    # fp32's, already paid); else one pass, of as many sequences as fit the bound. gpt2
    # under the AVX2 emulation showed 2.9x slower matmuls and four 90 s bf16 passes.
    sequences = batch if slowdown < 1.0 else int(SLOW_PASS_SECONDS / (fp32 / batch * slowdown))
    if slowdown < 1.0:
        bf16 = precision.step_seconds(model, "bf16", batch, block, steps)
    elif sequences >= 1:
        sequences = min(sequences, batch)
        bf16 = precision.pass_seconds(copy.deepcopy(model).train(), "bf16", sequences, block) * batch / sequences
    else:
        bf16 = None
    row.update(bf16_sequences=min(sequences, batch), bf16_tokens_per_s=batch * block / bf16 if bf16 else None,
               bf16_vs_fp32=fp32 / bf16 if bf16 else 1 / slowdown)
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        row["auto_choice"] = precision.measured_cpu_choice(model, batch, block, os.path.join(scratch, "p.json"))
        row["auto_seconds"] = time.perf_counter() - started
    row["faster"] = "bf16" if row["bf16_vs_fp32"] > 1 else "fp32"
    return row


def run_precision(dist, options: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """What `trainer.precision=auto` decides on this CPU and how long deciding took (cold
    cache), and the fp32/bf16 forward+backward speeds behind it at the configured batch.
    `models=` takes presets and experiments (comma-separated; `all`: PRECISION_TABLE) for one
    row each. On a CPU with more than AVX2, `avx2=true` (the default there) measures the same
    again in a child process under AVX2_ENV: the columns of an AVX2-only CPU."""
    if dist.device.type != "cpu":
        raise ConfigError("bench precision measures CPUs: on GPUs `auto` is bf16 with native bf16, else fp16")
    models = options["models"]
    entries = PRECISION_TABLE if models == "all" else (models.split(",") if models else [None])
    emulate = str(options["avx2"]).lower() in ("1", "true", "yes") if options["avx2"] is not None else \
        torch.backends.cpu.get_cpu_capability() != "AVX2" and "ATEN_CPU_CAPABILITY" not in os.environ
    wait_until_quiet(float(options["wait_quiet"]), dist)
    noise = CpuNoise(dist)
    steps = int(options["steps"] or 3)
    rows = []
    for entry in entries:
        chosen = [] if entry is None else [entry if "=" in entry else f"model={entry}"]
        cfg = compose([*overrides, *chosen, "trainer.precision=fp32"])
        model = build_trainer(cfg, dist).model
        batch, block = cfg.trainer.batch_size, cfg.data.block_size
        rows.append({"config": entry or "as configured", "model": dict(_container(cfg.model)),
                     "parameters": model.num_params(non_embedding=False), "batch_size": batch, "block_size": block,
                     **precision_row(model, batch, block, steps)})
        del model
    result = {"rows": rows, "other_cpu_busy": noise.fraction()}
    if emulate:
        result["avx2_rows"] = avx2_precision_rows(options, overrides)
    return result


def avx2_precision_rows(options: dict[str, Any], overrides: list[str]) -> list[dict[str, Any]]:
    """`bench precision` again in a child process whose torch, oneDNN and MKL use AVX2 at most."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "avx2.json")
        args = [f"{k}={v}" for k, v in options.items() if v is not None and k not in ("out", "avx2", "wait_quiet")]
        proc = subprocess.run([sys.executable, "-m", "mingpt_ddp.bench", "precision", *args, *overrides, "avx2=false",
                               f"out={out}"], env={**os.environ, **AVX2_ENV}, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ConfigError(f"the AVX2-emulated run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        child = json.loads(Path(out).read_text())
    if child["env"]["cpu"]["capability"] != "AVX2":
        raise ConfigError(f"ATEN_CPU_CAPABILITY=avx2 left torch at {child['env']['cpu']['capability']}")
    return child["rows"]


def _auto(row: dict[str, Any]) -> str:
    return row["auto_choice"] + ("" if row["auto_choice"] == row["faster"] else "!")


def _container(node) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node)


# ---- sampling ---------------------------------------------------------------------------
def sample_model(options: dict[str, Any], overrides: list[str]):
    """(model, where from): a snapshot's, or random weights of the configured model."""
    from mingpt_ddp.model import GPT, GPTConfig

    if options["snapshot"]:
        from mingpt_ddp.tools import trained

        found = trained.load_latest(options["snapshot"])
        if found is None:
            raise ConfigError(f"no snapshot at {options['snapshot']}: give a snapshot file or a run directory")
        snapshot, where = found
        model = GPT(GPTConfig(**snapshot["model_config"]))
        model.load_state_dict(snapshot["model"])
        return model.eval(), storage.redact(where)
    cfg = compose(overrides)
    torch.manual_seed(0)
    from omegaconf import OmegaConf

    fields = GPTConfig.__dataclass_fields__
    model_cfg = GPTConfig(vocab_size=int(options["vocab"]), block_size=cfg.data.block_size,
                          **{k: v for k, v in OmegaConf.to_container(cfg.model, enum_to_str=True).items() if k in fields})
    return GPT(model_cfg).eval(), f"random weights, vocabulary {options['vocab']}"


def run_sample(dist, options: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """GPT.generate's tokens/s with the KV cache against the plain loop, side by side."""
    model, source = sample_model(options, overrides)
    model.to(dist.device)
    tokens, repeat = int(options["tokens"]), int(options["repeat"])
    start = torch.zeros((1, 1), dtype=torch.long, device=dist.device)
    wait_until_quiet(float(options["wait_quiet"]), dist)
    noise = CpuNoise(dist)

    def seconds(use_cache: bool, n: int) -> float:
        generator = torch.Generator(device=dist.device).manual_seed(0)
        sync(dist.device)
        started = time.perf_counter()
        model.generate(start, n, temperature=0.8, generator=generator, use_cache=use_cache)
        sync(dist.device)
        return time.perf_counter() - started

    seconds(True, 20), seconds(False, 20)  # warm-up: first calls allocate and pick kernels
    runs = []
    for _ in range(repeat):
        cached, plain = seconds(True, tokens), seconds(False, tokens)
        runs.append({"cached_tokens_per_s": tokens / cached, "plain_tokens_per_s": tokens / plain,
                     "ratio": plain / cached})
    best_cached = max(r["cached_tokens_per_s"] for r in runs)
    best_plain = max(r["plain_tokens_per_s"] for r in runs)
    return {"model": {**{k: getattr(model.cfg, k) for k in ("n_layer", "n_head", "n_embd", "block_size",
                                                            "vocab_size")}},
            "source": source, "tokens": tokens, "runs": runs, "best_cached_tokens_per_s": best_cached,
            "best_plain_tokens_per_s": best_plain, "best_ratio": best_cached / best_plain,
            "ratios": [r["ratio"] for r in runs], "cpu_flags": cpu_flags(), "other_cpu_busy": noise.fraction()}


def cpu_flags() -> Optional[str]:
    """The CPU's SIMD flags (avx2, avx512*, amx*) from /proc/cpuinfo: what its kernels may use."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return " ".join(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return None


RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "fixed": run_fixed,
    "peak": run_peak, "train": run_train, "data": run_data, "snapshot": run_snapshot, "comm": run_comm,
    "precision": run_precision, "alloc": run_alloc, "sample": run_sample,
}


def report(mode: str, result: dict[str, Any]) -> None:
    """The human table for one mode's result."""
    env = result["env"]
    where = (f"{env['device_name']} | {env['world_size']} process(es) x {env['threads_per_process']} thread(s) | "
             f"torch {env['torch']} | {env['backend']}")
    busy = result.get("other_cpu_busy")
    noise = f" | other processes kept {100 * busy:.0f}% of the cores busy" if busy is not None else ""
    if mode == "peak":
        m = result["model"]
        print_table(f"matmul peak: {where}{noise}", ["dtype", "matmul", "m x k x n", "TFLOP/s", "one matmul s"],
                    [[r["dtype"], r["matmul"], "x".join(map(str, r["shape"])), r["tflops"],
                      f"{r['one_matmul_s']:.3g}" + (" (rated from a few rows)" if r["from_gauge"] else "")]
                     for r in result["rows"]])
        print("best: " + ", ".join(f"{k} {v:.3f} TFLOP/s" for k, v in result["peak_tflops"].items()))
        print(f"at the model's matmuls ({m['n_layer']}L/{m['n_embd']}d, {m['tokens']} tokens per micro-batch; what "
              "its MFU is quoted against): " + ", ".join(f"{k} {v:.3f}" for k, v in result["model_peak_tflops"].items())
              + " TFLOP/s" + "".join(f"; {n} is emulated here (slower than fp32): MFU in {n} is quoted against fp32"
                                     for n in result["emulated"]))
    elif mode == "train":
        m = result["model"]
        print_table(
            f"train: {m['n_layer']}L/{m['n_embd']}d, block {result['block_size']}, batch {result['batch_size']}"
            f"x{result['grad_accum_steps']}x{env['world_size']}, {result['precision']}"
            f"{', compiled' if result['compile'] else ''}, {result['steps']} steps after {result['warmup']}: {where}{noise}",
            ["tokens/s", "tokens/s/proc", "ms/step", "wall-tokens/s", "median ms", "best-window ms", "MFU%(measured)",
             "MFU%(datasheet)", "FLOP/token", "measured TFLOP/s", "datasheet TFLOP/s", "peak mem MiB"],
            [[result["tokens_per_s"], result["tokens_per_s_per_process"], result["ms_per_step"], result["wall_tokens_per_s"],
              result["ms_per_step_median"], result["ms_per_step_best_window"], 100 * result["mfu_measured"],
              100 * result["mfu_datasheet"] if result.get("mfu_datasheet") is not None else None,
              result["flops_per_token"], result["peak_flops_per_process"] / 1e12,
              (result["datasheet_peak_flops_per_process"] or 0) / 1e12 or None,
              result["peak_memory_bytes"] / 2**20]],
        )
        best = result["tokens_per_s_best_window"]
        if best:
            print(f"best window of {max(1, result['steps'] // 5)} steps: {best:,.0f} tokens/s, MFU "
                  f"{100 * mfu(result['flops_per_token'], best, result['peak_flops_per_process'], env['world_size']):.1f}%"
                  " of the measured peak")
        if result.get("peak_raised_to_reached"):
            print("# the steps beat the start-up peak measurement (others' load held it down): MFU is quoted "
                  "against the rate reached")
        print(f"# tokens/s: the timed steps alone; wall-tokens/s: their wall time, evaluations among them included "
              f"(trainer.eval_every={result['eval_every']}; no snapshots are written by bench train)")
        mib = {name: [v / 2**20 for v in (*b.values(), sum(b.values()))] for name, b in
               (("per rank", result["state_bytes_per_rank"]), ("whole model", result["state_bytes_whole_model"]))}
        print_table(f"memory, trainer.strategy={result['strategy']}: bytes read off the tensors after a step (per rank: "
                    "its own shards; whole model: what every DDP rank holds)",
                    ["", "parameters MiB", "gradients MiB", "optimizer MiB", "total MiB"],
                    [[name, *values] for name, values in mib.items()])
    elif mode == "precision":
        avx2 = result.get("avx2_rows")
        columns = ["config", "layers/dim", "batch x block", "fp32 tok/s", "bf16 tok/s", "bf16/fp32", "auto", "auto s"]
        rows = [[r["config"], f"{r['model']['n_layer']}L/{r['model']['n_embd']}d", f"{r['batch_size']}x{r['block_size']}",
                 r["fp32_tokens_per_s"], r["bf16_tokens_per_s"], r["bf16_vs_fp32"], _auto(r), r["auto_seconds"]]
                for r in result["rows"]]
        if avx2:
            columns += ["AVX2: fp32 tok/s", "bf16 tok/s", "bf16/fp32", "auto", "auto s"]
            for row, r in zip(rows, avx2):
                row += [r["fp32_tokens_per_s"], r["bf16_tokens_per_s"], r["bf16_vs_fp32"], _auto(r), r["auto_seconds"]]
        print_table(f"precision, forward+backward at each config's batch: {where}{noise}"
                    + (" | AVX2: the same under " + " ".join(f"{k}={v}" for k, v in AVX2_ENV.items()) if avx2 else ""),
                    columns, rows)
        print("auto: what trainer.precision=auto chose and the seconds it took to decide (cold cache); '!' where it is "
              "not the faster of the two at the batch above; bf16 tok/s '-': not run, a pass would take over "
              f"{SLOW_PASS_SECONDS:g} s (bf16/fp32 from the matmul probe)")
    elif mode == "data":
        print_table(
            f"data: block {result['block_size']}, batch {result['batch_size']}x{result['grad_accum_steps']}, "
            f"{result['steps']} step batches: {where}{noise}",
            ["samples/s", "samples/s/proc", "tokens/s", "us/step batch", "epoch start ms"],
            [[result["samples_per_s"], result["samples_per_s_per_process"], result["tokens_per_s"],
              result["us_per_step_batch"], result["epoch_start_ms"]]],
        )
        mib = lambda v: None if v is None else v / 2**20  # noqa: E731
        print_table(
            f"corpus {result['corpus']}: {result['corpus_bytes'] / 1e6:,.1f} MB -> {result['token_dtype']} token file, "
            f"{result['tokenizer']}, {result['bytes_per_token']:.2f} bytes/token "
            f"({'encoded now' if result['encoded'] else 'reused'}; encoding on {result['encode_cores']} core(s))",
            ["encode MB/s", "MB/s per core", "MB per CPU-s", "first load s", "cached load s", "start-up s", "peak RSS MiB", "map RSS MiB/proc",
             "map PSS MiB/node"],
            [[result["encode_MBps"], result["encode_MBps"] and result["encode_MBps"] / result["encode_cores"],
              result["encode_MB_per_cpu_s"], result["first_load_s"], result["cached_load_s"], result["startup_s"],
              mib(result["peak_rss_bytes"]), mib(result["token_map_rss_bytes"]),
              mib(result["node_token_map_pss_bytes"])]],
        )
    elif mode == "snapshot":
        b = result["best"]
        print_table(
            f"snapshot: {result['parameters']:,} parameters -> {result['url']} (best of {result['repeat']}): {where}{noise}",
            ["MB", "blocks training s", "state_dict s", "copy to CPU s", "background write s", "encode s",
             "write s", "save s", "streamed save s", "read s", "decode s", "load_latest s"],
            [[b.get("bytes", 0) / 1e6, b["blocking_s"], b["state_dict_s"], b["copy_to_cpu_s"],
              b["background_write_s"], b.get("encode_s"), b.get("write_s"), b.get("save_s"),
              b.get("streamed_save_s"), b.get("read_s"), b.get("decode_s"), b.get("load_s")]],
        )
    elif mode == "fixed":
        first = [p["phase"] for p in result["phases"]].index(FIRST_STEP)
        last = [p["phase"] for p in result["phases"]].index(LAST_STEP)

        def part(p: dict[str, Any], i: int) -> str:
            return "to the first step" if i <= first else "the step" if i <= last else "to exit"
        print_table(f"fixed costs of a 1-step run, median of {result['runs']} (load average {result['load_avg_1min']:.2f}): "
                    f"{where}", ["part", "phase ending", "median s", "runs s"],
                    [[part(p, i), p["phase"], p["median_s"], " ".join(f"{s:.2f}" for s in p["runs_s"])]
                     for i, p in enumerate(result["phases"])])
        print(f"launch to first step {result['launch_to_first_step_s']:.2f} s | step {result['step_s']:.2f} s | "
              f"last step to exit {result['last_step_to_exit_s']:.2f} s | total {result['total_s']:.2f} s "
              f"(warm-up run: {result['warmup']['total_s']:.2f} s)")
        print(f"command: {result['command']}")
    elif mode == "alloc":
        print_table(f"malloc's cost in a CPU run of gpt-nano, block 128: {where}{noise}",
                    ["vocab", "malloc", "steps x batch", "wall s", "user s", "sys s", "kernel %", "tok/s",
                     "peak RSS MiB"],
                    [[r["vocab"], "glibc default" if r["when"] == "before" else "kept (now)", f"{r['steps']}x{r['batch_size']}",
                      r["wall_s"], r["user_s"], r["sys_s"], 100 * r["kernel_share"], r["tokens_per_s"],
                      r["peak_rss_bytes"] / 2**20] for r in result["rows"]])
        print(f"cpu: {result['cpu']}")
        for r in result["rows"]:
            print(f"command ({r['vocab']}, {r['when']}): {r['command']}")
    elif mode == "sample":
        m = result["model"]
        print_table(f"sampling {result['tokens']} tokens, {m['n_layer']}L/{m['n_embd']}d, block {m['block_size']}, "
                    f"vocabulary {m['vocab_size']} ({result['source']}), temperature 0.8: {where}{noise}",
                    ["run", "KV cache tok/s", "plain loop tok/s", "cache/plain"],
                    [[i + 1, r["cached_tokens_per_s"], r["plain_tokens_per_s"], r["ratio"]]
                     for i, r in enumerate(result["runs"])])
        ratios = result["ratios"]
        print(f"best: KV cache {result['best_cached_tokens_per_s']:.1f} tok/s, plain loop "
              f"{result['best_plain_tokens_per_s']:.1f} tok/s: {result['best_ratio']:.2f}x; side-by-side ratios "
              f"{min(ratios):.2f}-{max(ratios):.2f}x")
        cpu = env.get("cpu", {})
        print(f"cpu: {env['device_name']}, torch's kernels {cpu.get('capability')}, flags {result['cpu_flags']}")
    elif mode == "comm":
        print_table(
            f"all_reduce (in place, float sum) over {result['ranks']} rank(s): {where}{noise}",
            ["size(B)", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"],
            [[r["size"], r["count"], r["type"], r["redop"], r["time_us"], r["algbw_GBps"], r["busbw_GBps"],
              r["wrong"]] for r in result["rows"]],
        )
        print(f"# Avg bus bandwidth: {result['avg_busbw_GBps']:.3f} GB/s")
        seen: dict[str, list[int]] = {}
        for t in result.get("transport", []):
            seen.setdefault(f"{t['host']}: {describe_transport(t)}", []).append(t["rank"])
        for line, ranks in seen.items():
            print(f"# transport, rank(s) {','.join(map(str, ranks))} on {line}")
        if "projection" in result:
            c = result["projection"]["compute"]
            print(f"# DDP projection: compute {c['step_ms']:.1f} ms/step ({c['source']}), gradients "
                  f"{c['gradient_bytes'] / 1e6:.2f} MB in buckets of {c['bucket_bytes'] / 2**20:g} MiB")
            for p in result["projection"]["hosts"]:
                print(f"at {p['hosts']} hosts of this link, step = compute + exposed comm = {p['compute_ms']:.1f} + "
                      f"{p['exposed_ms']:.1f} = {p['step_ms']:.1f} ms (all_reduce {p['comm_ms']:.1f} ms in "
                      f"{p['buckets']} bucket(s), {p['comm_ms'] - p['exposed_ms']:.1f} ms of it behind the backward)")


def _int_setting(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        return text  # refused by distributed.cpu_threads, naming the key


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    argv = ["--help"] if argv[:1] == ["help"] else argv
    try:
        _, argv = usage.options(argv, __doc__, USAGE)
        mode, options, overrides = parse_args(argv)
        if mode == "comm":
            nccl_log_to_files()  # before NCCL starts
        # trainer.device among the overrides decides as it does for a run (cpu: on purpose)
        device = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.device=")), "auto")
        threads = next((o.split("=", 1)[1] for o in overrides if o.startswith("trainer.cpu_threads=")), "null")
        dist = distributed.setup(device=device, threads=None if threads in ("null", "") else _int_setting(threads))
        result = RUNNERS[mode](dist, options, overrides)
    except UserFacingError as exc:
        rank = int(os.environ.get("RANK", "0"))
        if distributed.first_to_report(str(exc), "bench"):  # once, by a rank that hit it
            print(f"{f'[rank {rank}] ' if rank else ''}error: {storage.redact(str(exc))}", file=sys.stderr, flush=True)
        return ConfigError.exit_code
    result = {"mode": mode, "env": environment(dist), "options": {k: v for k, v in options.items() if v is not None},
              "overrides": overrides, **result}
    if dist.is_main:
        report(mode, result)
        write_json(options["out"], mode, result)
    # No rank leaves (and closes its connections) while another still reports; then the
    # group is destroyed while Python is whole, as main.py does: left to interpreter exit,
    # gloo can abort a finished run (see distributed.shutdown).
    distributed.shutdown(clean=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
