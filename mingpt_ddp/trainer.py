"""The training loop: one optimizer step, one evaluation, and when to save.

How a snapshot reaches its storage is checkpoint/'s business; what to train on is
char_dataset.py's; how the model is spread over the ranks (DDP or FSDP) is parallel.py's;
this file only runs the loop.

Invariants a change here must keep:

- Lockstep collectives. Every rank makes the same collectives in the same order, so every
  decision that leads to one is taken from values all ranks share: the step counter, the
  config, and the answer of the stop agreement (one all_reduce_max at every log step and at
  least every trainer.stop_check_seconds: signals, rank 0's time-based save, a failed save,
  a lost run lock). Evaluations (all_reduce_sum), saves (wait_for_main: rank 0 works, the
  others wait in the store, not in a collective), the metrics line (all_reduce_sum) and the
  end-of-run fingerprint check (every rank gathers every fingerprint, so all take the same
  answer; it runs right after the last step, before its first save, which records a failure)
  all follow from those shared values. A rank-local condition (a clock, a file, a signal seen by one rank) must
  go through the agreement first.
- Bit-identical resume. A snapshot holds everything the next step depends on: model and
  optimizer state, scaler, TrainState (epoch, step, position in the epoch, the time budget's
  plan and the LR schedule's bends), every rank's RNG state and the global batch. The data order is a function of
  (seed, epoch) and the position in the epoch, never of how many steps this process ran;
  nothing random may be drawn outside the RNG streams the snapshot restores, and a resumed
  run must take the same branches at the same steps as an uninterrupted one.
- What tokens/s measures. The StepTimer runs over optimizer steps only: evaluations and
  saves sit between timer.pause() and timer.resume(), so tokens/s and MFU are the training
  steps' alone, while wall tokens/s counts everything.
"""
from __future__ import annotations

import logging
import math
import random
import signal
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from mingpt_ddp import determinism, distributed, parallel, precision, profiling
from mingpt_ddp.char_dataset import CharCorpus, ResumableDistributedSampler, WindowDataset, epoch_offset, to_device
from mingpt_ddp.config import OptimizerConfig, TrainerConfig, snapshot_every_minutes
from mingpt_ddp.distributed import DistEnv
from mingpt_ddp.errors import ConfigError, NeedsAPerson, RunError
from mingpt_ddp.metrics import (MetricsLog, bits_per_byte, cached_peak, raise_cached_peak, datasheet_peak_flops, mfu_record,
                                window_loss_sums)
from mingpt_ddp.model import GPT
from mingpt_ddp.preemption import StopRequest, shield_compile_workers, size_compile_workers
from mingpt_ddp.checkpoint.snapshot import BackgroundSaver
from mingpt_ddp.throughput import StepTimer

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Where the run is. Together with model, optimizer, scaler and RNG: all a resume needs."""

    epoch: int = 0  # the epoch in progress (0-based)
    step: int = 0  # optimizer steps taken; also the LR schedule's position
    epoch_position: int = 0  # training windows of this epoch consumed by all ranks together
    tokens_seen: int = 0
    best_val_loss: float = float("inf")
    last_val_loss: Optional[float] = None
    planned_steps: Optional[int] = None  # steps planned from trainer.time_budget_minutes (time_budget.py)
    # Seconds of that budget spent, at this step: a resume with the same budget goes on from there.
    budget_spent_s: float = 0.0
    # Training is over and this state saved, its final evaluation not yet done: not a finished
    # run (main.finished_earlier); the next start runs only the final evaluation and saves again.
    final_eval_pending: bool = False
    # The LR schedule's bends (lr_at), kept so that a resume computes the LR the unbroken run did.
    # The step its warm-up starts from: 0, or where a finished budgeted run was continued.
    lr_warmup_from: int = 0
    # Where the horizon last moved (a time budget's revised plan): the cosine's progress at that
    # step, which the steps after it go on from.
    lr_anchor_step: Optional[int] = None
    lr_anchor_progress: float = 0.0


def is_finished(state: TrainState, cfg: TrainerConfig) -> bool:
    return (state.epoch >= cfg.max_epochs or (cfg.max_steps is not None and state.step >= cfg.max_steps)
            or (state.planned_steps is not None and state.step >= state.planned_steps))


def lr_at(step: int, cfg: OptimizerConfig, planned_steps: int, state: Optional[TrainState] = None) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at `decay_steps` (or the plan's end).
    `state`'s bends (none in a run that never moved its horizon): a continued run warms up again
    from min_lr at lr_warmup_from, and after a moved horizon the cosine goes on from its progress
    at lr_anchor_step. optimizer.decay_steps fixes the schedule: no bends."""
    if cfg.decay_steps is not None or state is None:
        state = TrainState()
    start = state.lr_warmup_from
    if step < start + cfg.warmup_steps:
        if start == 0:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * (step - start + 1) / cfg.warmup_steps
    progress = cosine_progress(step, cfg, planned_steps, state)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def cosine_progress(step: int, cfg: OptimizerConfig, planned_steps: int, state: TrainState) -> float:
    """How far (0-1) the decay is at `step` of a schedule whose end is `planned_steps`."""
    begins = state.lr_warmup_from + cfg.warmup_steps
    anchor = state.lr_anchor_step
    if anchor is not None and step >= anchor >= begins:
        done = state.lr_anchor_progress
        return min(1.0, done + (1.0 - done) * (step - anchor) / max(1, planned_steps - anchor))
    span = max(1, (cfg.decay_steps or planned_steps) - begins)
    return min(1.0, (step - begins) / span)


def move_horizon(state: TrainState, cfg: OptimizerConfig, before: int, after: int) -> None:
    """The schedule's end moves from `before` to `after` steps at state.step, the LR continuous:
    the cosine keeps its progress there and spreads the rest over the steps now left. Nothing
    to keep in warm-up (the cosine has not begun) or under optimizer.decay_steps."""
    if after != before:
        keep_progress(state, cfg, before)


def keep_progress(state: TrainState, cfg: OptimizerConfig, horizon: int) -> None:
    """Anchor the cosine at state.step with its progress under `horizon`, the end so far."""
    if cfg.decay_steps is None and state.step >= state.lr_warmup_from + cfg.warmup_steps:
        state.lr_anchor_progress = cosine_progress(state.step, cfg, horizon, state)
        state.lr_anchor_step = state.step


def warm_up_again(state: TrainState) -> None:
    """A run continued past its end (at the LR floor): warm up from here, then decay anew."""
    state.lr_warmup_from, state.lr_anchor_step, state.lr_anchor_progress = state.step, None, 0.0


def continue_schedule(state: TrainState, cfg: OptimizerConfig, horizon: int) -> Optional[str]:
    """A resume moves the LR's end away from `horizon`, the snapshot's: a run that had reached
    it (at the floor) warms up again; one before it goes on from its LR there (jumping to the
    new length's LR moved it by up to 65% of the range). Says which; None while in a warm-up
    (it goes on) or under optimizer.decay_steps (its fixed horizon does not move)."""
    if cfg.decay_steps is not None or state.step < state.lr_warmup_from + cfg.warmup_steps:
        return None
    if state.step >= horizon:
        warm_up_again(state)
        return f"the LR warms up again from step {state.step} over optimizer.warmup_steps"
    keep_progress(state, cfg, horizon)
    return "the LR decays on from where it is"


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        optim_cfg: OptimizerConfig,
        model: GPT,
        corpus: CharCorpus,
        dist: DistEnv,
        metrics: MetricsLog,
        saver: Optional[BackgroundSaver],
        snapshot_metadata: dict[str, Any],
        run_lock: Any = None,
        token_bytes: Optional[torch.Tensor] = None,
        resumed_precision: Optional[str] = None,
    ):
        """`token_bytes`: UTF-8 bytes per token id, for val_bpb (tokenizer.byte_lengths();
        default: a character corpus's, from its vocabulary). `resumed_precision`: the
        precision of the snapshot this run resumes from, which trainer.precision=auto keeps
        (see _resolve_precision)."""
        self.cfg, self.optim_cfg, self.dist = cfg, optim_cfg, dist
        self.metrics, self.saver, self.snapshot_metadata = metrics, saver, snapshot_metadata
        self.run_lock = run_lock  # rank 0's RunLock: its `lost` stops every rank at the next agreement
        self.device = dist.device
        self.model = model  # placed (or, built on the meta device, filled in) by the strategy
        self.block_size = model.cfg.block_size
        # What trainer.precision=auto measured on a CPU at start (None otherwise, and on a resume):
        # precision.RunCheck checks it against the run's own steps.
        self.precision_decision: Optional[precision.Decision] = None
        self.precision = self._resolve_precision(resumed_precision)
        profiling.mark("precision decided")
        if self.device.type == "cuda":
            # fp32 matmuls (fp32 runs, and what autocast leaves in fp32) in TF32 on Ampere+:
            # fp32's range with a 10-bit mantissa, the usual trade for training.
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.strategy = parallel.make_strategy(cfg, dist, self.model, self.precision)  # DDP or FSDP
        determinism.apply(cfg.deterministic, self.strategy.compiled)  # before the first GPU matmul
        self.optimizer = self.strategy.make_optimizer(optim_cfg)
        self.scaler = self.strategy.grad_scaler()
        self.corpus = corpus
        self.micro_batch = cfg.batch_size
        self.accum_steps = cfg.grad_accum_steps
        self.strategy.check_accumulation(self.accum_steps, cfg.grad_accum_steps)
        self.sampler = ResumableDistributedSampler(
            WindowDataset(corpus.train_tokens, self.block_size), dist.world_size, dist.rank, cfg.seed
        )
        self.val_windows = WindowDataset(corpus.val_tokens, self.block_size)
        if token_bytes is None:  # the corpus's tokenizer, or a character Vocabulary
            vocab = corpus.vocab
            token_bytes = (torch.from_numpy(vocab.byte_lengths()) if hasattr(vocab, "byte_lengths") else
                           torch.tensor([len(c.encode("utf-8")) for c in vocab.chars], dtype=torch.int32))
        self.token_bytes = token_bytes.to(self.device)
        self.state = TrainState()
        self.total_steps = self.planned_steps()
        self.flops_per_token = model.flops_per_token(self.block_size)
        self._peak_shapes = model.matmul_shapes(cfg.batch_size * self.block_size)
        peak = distributed.wait_for_main(lambda: cached_peak(self.device, self.precision.dtype, self._peak_shapes),
                                         "measuring the matmul peak")
        self.peak_flops = peak.flops
        if peak.emulated and dist.is_main:
            requested = getattr(cfg.precision, "value", cfg.precision)
            setting = (f"trainer.precision=auto chose {self.precision.name}" if requested == "auto"
                       else f"trainer.precision={requested}")
            log.warning("%s: this CPU runs %s matmuls %.0fx slower than fp32 at this model's sizes (no %s "
                        "instructions: emulated); MFU is quoted against the fp32 peak. Set trainer.precision=fp32 "
                        "to train faster here", setting, self.precision.name, peak.slowdown, self.precision.name)
        self.datasheet_peak_flops = datasheet_peak_flops(self.device, self.precision.dtype)
        profiling.mark("strategy, optimizer, matmul peak")
        self.snapshot_every_minutes = snapshot_every_minutes(cfg, self.device.type)  # null: 30 on GPUs, 10 on CPUs
        self._last_saved: Optional[tuple[dict[str, Any], Any]] = None  # (TrainState, failed_check) last saved
        self._batches_left = 0  # optimizer steps the epoch in progress had left when step_batches() began it
        self._last_save_time = time.monotonic()
        self._evaluated_at: Optional[int] = None
        self._evaluated_before = False  # a compiled model's first evaluation compiles its eval graph
        self._evaluated_windows = 0
        self._evaluated_bytes = 0
        self.last_val_bpb: Optional[float] = None
        self._last_agreement = (0, time.monotonic())  # (step, time) of the last stop agreement
        self._next_agreement = 1  # the step of the next one (the loop's measurements set it)
        self.grad_norm: Optional[torch.Tensor] = None  # the last step's, before clipping (when clipping)
        self.stopped_by: Optional[str] = None  # the signal's name once the ranks agreed to stop on one
        self.failed_check: Optional[dict[str, str]] = None  # the end-of-run check, once it failed
        # Called as callback(trainer) after every optimizer step (benchmarks, custom metrics).
        self.step_callbacks: list[Callable[["Trainer"], None]] = []
        self.horizon_moved: Optional[str] = None  # what a resume moving the LR's horizon did (load_state_dict)
        self.budget_spent: Optional[Callable[[], float]] = None  # a time budget's clock (time_budget.TimeBudget)
        self.resume_hint = "run the same command (same run directory) to resume"  # main names the directory

    def _resolve_precision(self, resumed: Optional[str]) -> precision.PrecisionPlan:
        """trainer.precision, with `auto` decided once per run: a resume keeps the snapshot's
        choice (another CPU, or a lost cache of measurements, could decide differently and
        switch fp32 and bf16 in the middle of a run) unless that choice cannot run here, or is
        bf16 emulated on this CPU (matmuls several times slower than fp32): then `auto`
        decides again. An explicit precision replaces it."""
        requested = getattr(self.cfg.precision, "value", self.cfg.precision)
        if requested == "auto" and resumed:
            try:
                plan = precision.resolve(resumed, self.device)
                slowdown = self._emulated_bf16_slowdown(plan)
                if slowdown is None:
                    self.metrics.note(f"precision {resumed}: the run's choice (trainer.precision=auto keeps what the "
                                      "snapshot was trained with; set trainer.precision=fp32/bf16/fp16 to change it)")
                    return plan
                # Chosen on a CPU with bf16 instructions, resumed on one without (a requeue onto
                # another node type): keeping it would train ~30x slower.
                self.metrics.note(f"precision {resumed} of the snapshot is emulated on this CPU (bf16 matmuls "
                                  f"{slowdown:.1f}x slower than fp32): trainer.precision=auto decides again")
            except ConfigError as exc:  # e.g. bf16 from an Ampere GPU, resumed on a V100
                self.metrics.note(f"precision {resumed} of the snapshot cannot run here ({exc}); "
                                  "trainer.precision=auto decides again")
        # Measured by rank 0 alone (seconds on a busy CPU): the others wait in the store, not in a collective.
        model = self.model

        def measure() -> str:
            self.precision_decision = distributed.wait_for_main(
                lambda: precision.cpu_decision(model, self.cfg.batch_size, self.block_size), "timing fp32 against bf16")
            return self.precision_decision.choice
        return precision.resolve(requested, self.device, measure_cpu=measure)

    def switch_precision(self, plan: precision.PrecisionPlan) -> None:
        """Train in `plan` from the next step (precision.RunCheck corrects `auto`'s choice at a
        step boundary, on every rank): fp32 and bf16 only, neither needs a loss scaler. The
        snapshots record it, so a resume keeps it; Muon orthogonalises in it; MFU is quoted
        against its peak. A compiled model compiles again for the new autocast state."""
        assert not (plan.uses_scaler or self.precision.uses_scaler), "fp16's scaler cannot start mid-run"
        self.precision = self.strategy.precision = plan
        if hasattr(self.optimizer, "ns_dtype"):
            self.optimizer.ns_dtype = plan.dtype
        peak = distributed.wait_for_main(lambda: cached_peak(self.device, plan.dtype, self._peak_shapes),
                                         "measuring the matmul peak")
        self.peak_flops = peak.flops
        self.datasheet_peak_flops = datasheet_peak_flops(self.device, plan.dtype)

    def _emulated_bf16_slowdown(self, plan: precision.PrecisionPlan) -> Optional[float]:
        """How much slower this CPU runs the model's bf16 matmuls than fp32, where that is enough
        for `auto` to drop bf16 without a pass (precision.MATMUL_LOSING); None where bf16 runs
        fast, on GPUs, and for other precisions. Rank 0 measures (milliseconds), every rank gets its answer."""
        if self.device.type != "cpu" or plan.dtype != torch.bfloat16:
            return None
        rows = self.cfg.batch_size * self.block_size
        n_embd = self.model.cfg.n_embd
        slowdown = distributed.wait_for_main(lambda: precision.bf16_matmul_slowdown(n_embd, rows),
                                             "timing bf16 matmuls against fp32")
        return slowdown if slowdown >= precision.MATMUL_LOSING else None

    def _optimizer_settings(self) -> list[dict[str, Any]]:
        """Each param group's hyperparameters as this run's config built them (the LR aside:
        the schedule sets it every step)."""
        return [{k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")}
                for group in self.optimizer.param_groups]

    def _keep_configured_settings(self, configured: list[dict[str, Any]]) -> None:
        """A resume takes the optimizer's state (moments, momentum buffers) from the snapshot but
        its settings from this run's config: optimizer.load_state_dict also restores the saved
        groups' betas, weight decay, Muon's momentum and LR ratio (muon_lr / lr), which would
        silently override a changed optimizer.* value."""
        changed = sorted({k for group, want in zip(self.optimizer.param_groups, configured)
                          for k, v in want.items() if group.get(k) != v})
        for group, want in zip(self.optimizer.param_groups, configured):
            group.update(want)
        if changed:
            self.metrics.note(f"optimizer settings from this run's config, not the snapshot's: {', '.join(changed)}")

    # ---- bookkeeping ---------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all ranks."""
        return self.micro_batch * self.accum_steps * self.dist.world_size

    def _windows_in_epoch(self, epoch: int) -> int:
        return len(WindowDataset(self.corpus.train_tokens, self.block_size, epoch_offset(self.cfg.seed, epoch, self.block_size)))

    def steps_in_epoch(self, epoch: int) -> int:
        return self._windows_in_epoch(epoch) // self.global_batch

    def planned_steps(self) -> int:
        if self.steps_in_epoch(0) == 0:
            raise ConfigError(
                f"one optimizer step needs {self.global_batch} training windows (batch_size "
                f"{self.micro_batch} x grad_accum_steps {self.accum_steps} x {self.dist.world_size} processes) "
                f"but the training split has {self._windows_in_epoch(0)} windows of {self.block_size}: "
                "lower trainer.batch_size or data.block_size, or use more text"
            )
        total = sum(self.steps_in_epoch(e) for e in range(self.cfg.max_epochs))
        caps = [c for c in (self.cfg.max_steps, self.state.planned_steps) if c is not None]
        return min([total, *caps])

    @property
    def finished(self) -> bool:
        return is_finished(self.state, self.cfg)

    @property
    def plan_pending(self) -> bool:
        """A time budget will plan the steps after the first ones: until then total_steps is
        only the epochs' cap (a horizon for the LR, not a total to show)."""
        return bool(self.cfg.time_budget_minutes) and self.state.planned_steps is None

    def set_plan(self, planned_steps: int) -> None:
        """A time budget's (revised) plan: the run ends there and the LR's decay with it,
        continuing from where it is (move_horizon). The same on every rank (broadcast)."""
        before = self.total_steps
        self.state.planned_steps = planned_steps
        self.total_steps = self.planned_steps()
        move_horizon(self.state, self.optim_cfg, before, self.total_steps)
        self.metrics.total_steps = self.total_steps

    # ---- snapshots -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs, as tensors and plain types (weights_only-loadable)."""
        return {
            **self.strategy.state_dicts(self.optimizer),  # model, optimizer (this rank's shards under FSDP)
            "scaler": self.scaler.state_dict(),
            "train_state": {**asdict(self.state), **self._budget_now()},
            "rng": distributed.all_gather_object(rng_state()),
            "world_size": self.dist.world_size,
            "global_batch": self.global_batch,
            "total_steps": self.total_steps,  # the LR horizon planned (main.lr_horizon notes a resume moving it)
            "precision": self.precision.name,  # what trainer.precision=auto chose: a resume keeps it
            # The end-of-run check this state failed (None: none failed): a new start refuses it
            # unless trainer.resume_failed_check=true (main.check_not_failed).
            "failed_check": self.failed_check,
            **self.snapshot_metadata,
        }

    def _budget_now(self) -> dict[str, float]:
        """The time budget's seconds spent as of this snapshot: its evaluation and staging count
        (the step's value left them out: each resume under-counted one evaluation)."""
        return {} if self.budget_spent is None else {"budget_spent_s": self.budget_spent()}

    def load_state_dict(self, snapshot: dict[str, Any], restart_epoch: bool = False,
                        new_validation: bool = False) -> None:
        """`restart_epoch`: the saved position in the epoch indexes windows of another corpus or
        another seed's order (a resume asked to go on after either changed): the epoch in
        progress starts again from its first window; step, schedule and RNG carry on.
        `new_validation`: the validation split is another text's, so its losses are forgotten."""
        configured = self._optimizer_settings()
        self.strategy.load_state_dicts(self.optimizer, snapshot)
        self._keep_configured_settings(configured)
        if snapshot.get("scaler"):
            self.scaler.load_state_dict(snapshot["scaler"])
        self.state = TrainState(**snapshot["train_state"])
        saved_as = (asdict(self.state), snapshot.get("failed_check"))
        if restart_epoch:
            self.state.epoch_position = 0
        if new_validation:
            self.state.best_val_loss, self.state.last_val_loss = float("inf"), None
        self._last_saved = saved_as  # saving the state as loaded would only write it again
        self.total_steps = self.planned_steps()  # a time budget's plan, when the snapshot has one
        self._resume_global_batch(snapshot)
        moved_from = snapshot.get("total_steps")  # absent in snapshots before it was recorded
        self.horizon_moved = (continue_schedule(self.state, self.optim_cfg, moved_from)
                              if moved_from is not None and moved_from != self.total_steps else None)
        rng_per_rank = snapshot["rng"]
        if len(rng_per_rank) == self.dist.world_size:
            set_rng_state(rng_per_rank[self.dist.rank])
        else:  # new ranks have no saved stream: derive one that any rerun would derive too
            seed_everything(self.cfg.seed + 1000 * self.dist.rank + self.state.step)

    def _resume_global_batch(self, snapshot: dict[str, Any]) -> None:
        """The global batch is the run's, not this launch's: keep the snapshot's, on every
        later resume too (after 2 -> 1 workers the config alone would give half of it), unless
        trainer.batch_size or trainer.grad_accum_steps were changed since the snapshot's run."""
        saved_world, saved_global = snapshot["world_size"], snapshot["global_batch"]
        saved_cfg = snapshot.get("config", {}).get("trainer", {})
        saved_choice = (saved_cfg.get("batch_size"), saved_cfg.get("grad_accum_steps"))
        if None not in saved_choice and saved_choice != (self.cfg.batch_size, self.cfg.grad_accum_steps):
            if self.global_batch != saved_global:
                self.metrics.note(
                    f"global batch changed from {saved_global} to {self.global_batch} by the override of "
                    f"trainer.batch_size/grad_accum_steps (was {saved_choice[0]} x {saved_choice[1]}); the LR schedule "
                    "and the planned steps follow the new batch"
                )
        elif saved_world != self.dist.world_size or saved_global != self.global_batch:
            self._keep_global_batch(saved_global, saved_world)
        self.strategy.check_accumulation(self.accum_steps, self.cfg.grad_accum_steps)

    def _keep_global_batch(self, global_batch: int, saved_world: int) -> None:
        """After an elastic change of world size, keep the global batch (and so the LR
        schedule and the data order): change accumulation first, else the per-process batch."""
        world = self.dist.world_size
        before = (self.micro_batch, self.accum_steps)
        if global_batch % (self.micro_batch * world) == 0:
            self.accum_steps = global_batch // (self.micro_batch * world)
        elif global_batch % world == 0:
            per_process = global_batch // world
            self.accum_steps = next(a for a in range(1, per_process + 1)
                                    if per_process % a == 0 and per_process // a <= self.cfg.batch_size)
            self.micro_batch = per_process // self.accum_steps
        else:
            raise ConfigError(
                f"the snapshot's global batch of {global_batch} sequences (world size {saved_world}) cannot be "
                f"split evenly over {world} processes: resume with a world size that divides it"
            )
        self.total_steps = self.planned_steps()
        why = (f"world size changed from {saved_world} to {world}" if saved_world != world
               else f"world size {world} as when the run's global batch was set")
        self.metrics.note(
            f"{why}: global batch {global_batch} kept; "
            f"batch_size x grad_accum_steps per process {before[0]} x {before[1]} -> "
            f"{self.micro_batch} x {self.accum_steps}"
        )

    def save(self) -> None:
        """State is copied to CPU and handed to the background writer (rank 0's; every
        rank's under FSDP). Refused on every rank once rank 0 has lost the run lock: another
        run now writes these snapshots."""
        if self._last_saved == self._save_key():  # this state is saved already (a new mark or flag is not)
            return
        lost = distributed.wait_for_main(lambda: self.run_lock.lost if self.run_lock is not None else None,
                                         "checking the run lock")
        if lost:
            raise RunError(lost)
        state = self.state_dict()  # collective (RNG states): every rank takes part
        self._last_saved = self._save_key()
        self._last_save_time = time.monotonic()
        if self.strategy.sharded_snapshots:  # every rank stages its shards (sharded_snapshot.py)
            if self.saver is not None:
                self.saver.submit(state, self.state.step)
            return
        # Rank 0 copies to host memory and writes in the background, once its previous write is
        # done (a write in progress may take long): the others wait in the store, not in a collective.
        step = self.state.step
        distributed.wait_for_main(lambda: self.saver.submit(state, step) if self.saver else None,
                                  f"saving the snapshot of step {step}")

    def _save_key(self) -> tuple[dict[str, Any], Any]:
        return asdict(self.state), self.failed_check

    # ---- the loop --------------------------------------------------------------------
    def step_batches(self) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """This rank's micro-batches of the current epoch, grouped per optimizer step,
        starting where the run left off."""
        epoch = self.state.epoch
        windows = WindowDataset(self.corpus.train_tokens, self.block_size, epoch_offset(self.cfg.seed, epoch, self.block_size))
        self.sampler.dataset = windows
        self.sampler.set_epoch(epoch)
        self.sampler.set_start(self.state.epoch_position)
        indices = self.sampler.indices()
        per_step = self.micro_batch * self.accum_steps
        self._batches_left = len(indices) // per_step  # the loop knows the epoch's last step by it
        for s in range(len(indices) // per_step):
            group = []
            for m in range(self.accum_steps):
                chunk = indices[s * per_step + m * self.micro_batch : s * per_step + (m + 1) * self.micro_batch]
                group.append(to_device(windows.gather(chunk), self.device))
            yield group

    def _optimizer_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        lr = lr_at(self.state.step, self.optim_cfg, self.total_steps, self.state)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total_loss = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with self.strategy.no_sync(last):  # gradients are reduced once per optimizer step
                with self.precision.autocast():
                    _, loss = self.strategy.train_model(x, y)
                loss = loss / len(micro_batches)
                self.scaler.scale(loss).backward()
            total_loss += loss.detach()
        if self.cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            self.grad_norm = self.strategy.clip_grad_norm_(self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return total_loss

    def eval_windows(self, final: bool = False) -> int:
        """Validation windows one evaluation reads (over all ranks): the first
        eval_batches x batch_size x world size of the split (final_eval_batches at the end;
        null: the whole split), counted with the world size the run's global batch was set
        for: a resume on another number of processes evaluates the same windows, so its
        val_loss compares with the earlier ones."""
        limit = self.cfg.final_eval_batches if final else self.cfg.eval_batches
        n = len(self.val_windows)
        return n if limit is None else min(n, limit * self.global_batch // self.cfg.grad_accum_steps)

    @torch.no_grad()
    def evaluate(self, final: bool = False) -> float:
        """Mean validation loss per token over all ranks' windows, dropout off; also logged:
        val_bpb, the same windows' loss in bits per byte of their text."""
        self.model.eval()
        # its graph compiles now, on every rank
        extended = self.strategy.compiled and not self._evaluated_before and distributed.extend_collective_timeout()
        windows = self.eval_windows(final)
        mine = torch.arange(self.dist.rank, windows, self.dist.world_size)
        # nats, targets, nats of targets that are text, their bytes, windows (metrics.window_loss_sums)
        totals = torch.zeros(5, device=self.device, dtype=torch.float64)
        # Every rank runs the same number of forward passes (FSDP gathers parameters in each),
        # each on a full micro-batch, so the compiled eval graph never sees another shape: a
        # short batch is filled up with windows that are not counted.
        for start in range(0, -(-windows // self.dist.world_size), self.micro_batch):
            chunk = mine[start:start + self.micro_batch]
            counted = len(chunk)
            filler = torch.zeros(self.micro_batch - counted, dtype=torch.long)
            x, y = to_device(self.val_windows.gather(torch.cat([chunk, filler])), self.device)
            with self.precision.autocast():
                logits, _ = self.strategy.eval_model(x)
            if counted:
                totals[:4] += window_loss_sums(logits[:counted], y[:counted], self.token_bytes)
                totals[4] += counted
        distributed.all_reduce_sum(totals)
        self.model.train()
        nats, targets, text_nats, text_bytes, counted_windows = totals.tolist()
        if extended:
            distributed.restore_collective_timeout()  # tolist() waited for the all_reduce
        self._evaluated_before = True
        val_loss = nats / targets if targets > 0 else float("nan")
        self.state.last_val_loss = val_loss
        self._evaluated_at = self.state.step
        self._evaluated_windows = int(counted_windows)
        self._evaluated_bytes = int(text_bytes)
        self.state.best_val_loss = min(self.state.best_val_loss, val_loss)
        self.last_val_bpb = bits_per_byte(text_nats, text_bytes)
        self.metrics.write({"step": self.state.step, "epoch": self.state.epoch, "val_loss": val_loss,
                            "val_bpb": self.last_val_bpb, "val_windows": self._evaluated_windows,
                            "val_bytes": self._evaluated_bytes})
        return val_loss

    def fit(self) -> Optional[float]:
        """Train until max_epochs or max_steps, or until asked to stop; return the final
        validation loss (None when stopped early by a signal). At the end of training: the
        ranks' parameters are checked and the last step saved at once (marked as failing the
        check, or flagged final_eval_pending), then evaluated and saved again. NeedsAPerson
        when the ranks' parameters differ, after that first save (the final evaluation is skipped)."""
        self.metrics.note(
            f"training {self.model.num_params(non_embedding=False):,} parameters on {self.dist.world_size} "
            f"process(es) ({self.device.type}, {self.dist.backend}, {self.precision.name}): global batch "
            f"{self.global_batch} x {self.block_size} tokens = {self.micro_batch} per process x "
            f"{self.accum_steps} accumulation x {self.dist.world_size}; "
            + ("steps planned by the time budget after the first steps" if self.plan_pending
               else f"{self.total_steps} steps planned")
        )
        if not self.finished:  # this config trains further than the end whose evaluation was pending
            self.state.final_eval_pending = False
        elif self.state.final_eval_pending:
            self.metrics.note(f"training ended at step {self.state.step} before this start: running its final "
                              "evaluation, which was pending")
        self.model.train()
        self._last_save_time = time.monotonic()
        if self.strategy.compiled:
            size_compile_workers(distributed.cpu_threads(self.cfg.cpu_threads, self.dist.local_world_size))
            shield_compile_workers()  # compile workers would die of Slurm's SIGUSR1 mid-compile
        # Held until the last snapshot is saved: a signal now asks for a stop, not a traceback.
        with StopRequest() as stop_request:
            profiling.mark("first step starts")
            try:
                self.stopped_by = self._train_loop(stop_request)
            except RuntimeError as exc:  # an op without a deterministic kernel: one line, not a traceback
                if self.cfg.deterministic and determinism.explain(exc):
                    raise determinism.explain(exc) from None
                raise
            if self.stopped_by:
                self.metrics.note(f"{self.stopped_by}: stopping after step {self.state.step}, saving the last snapshot")
            profiling.mark("last step ended")
            if self.finished:  # also when stopped at the last step
                self._save_end_of_training(stop_request)
                profiling.mark("end-of-run check, last snapshot queued")
            if self.stopped_by:
                if not self.finished:
                    stop_request.saving_last_snapshot(self._newest_saved, stopping=True, saving=self._saving)
                    self.save()
                self._wait_for_saves()
                self.metrics.note(
                    f"stopped by {self.stopped_by} at step {self.state.step} (epoch {self.state.epoch}) after a "
                    f"snapshot{' (training is over, its final evaluation pending)' if self.finished else ''}: "
                    f"{self.resume_hint}"
                )
                return None
            if self._evaluated_at != self.state.step or self._evaluated_windows < self.eval_windows(final=True):
                # said first: on a busy CPU it can take as long as the training did
                self.metrics.note(f"evaluating {self.eval_windows(final=True):,} validation windows "
                                  "(trainer.final_eval_batches) ...")
                stop_request.final_evaluation = True  # what a signal now interrupts, said as it is
                self.evaluate(final=True)
                stop_request.final_evaluation = False
            profiling.mark("final evaluation")
            self.metrics.note(f"final evaluation: {self._evaluated_windows:,} of {len(self.val_windows):,} "
                              f"validation windows of {self.block_size}, {self._evaluated_bytes:,} bytes of text")
            self.state.final_eval_pending = False
            self.save()  # the same step again, now with its final val_loss: a finished run
            self._wait_for_saves()
            profiling.mark("final snapshot saved")
        self.metrics.note(
            f"done: step {self.state.step}, epoch {self.state.epoch}, val_loss {self.state.last_val_loss:.4f} "
            f"(best {self.state.best_val_loss:.4f})"
            + (f", val_bpb {self.last_val_bpb:.4f}" if self.last_val_bpb is not None else "")
        )
        return self.state.last_val_loss

    def _save_end_of_training(self, stop_request: StopRequest) -> None:
        """Training is over: check the ranks' parameters (cheap, and independent of the final
        evaluation), then save the last step at once, flagged final_eval_pending, so that a
        kill during a long final evaluation loses nothing. A failed check is marked in that
        snapshot, and logged before it is saved (the save may fail too); then every rank raises."""
        self.failed_check = self._check_ranks_agree()
        if self.failed_check is not None and self.dist.is_main:
            log.error("%s: saving the last snapshot marked as failing this check", self.failed_check["message"])
        self.state.final_eval_pending = True
        stop_request.saving_last_snapshot(self._newest_saved, stopping=self.stopped_by is not None,
                                          saving=self._saving)
        if self.failed_check is None:
            # Where saving a step again would first remove its committed snapshot (sharded
            # snapshots), the last step is saved once, after the final evaluation, unless a
            # stop ends the run before it. (Every rank's saver says the same: lockstep.)
            if self.stopped_by or getattr(self.saver, "replaces_a_step_atomically", True):
                self.save()  # waited for after the final evaluation, which runs meanwhile
            return
        try:
            self.save()
            self._wait_for_saves()
        except RunError as exc:
            raise NeedsAPerson(
                f"{self.failed_check['message']}, and the last snapshot, marked as failing this check, could not be "
                f"saved ({exc}): the newest snapshot saved is older and unmarked: compare the nodes' environments "
                "before resuming it, or start a new run") from None
        self._raise_if_check_failed()

    def _next_epoch(self) -> None:
        self.state.epoch += 1
        self.state.epoch_position = 0

    def _train_loop(self, stop_request: StopRequest) -> Optional[str]:
        """The epochs and steps; returns the signal's name if the ranks agreed to stop. The
        last step's evaluation and snapshot are fit()'s (after the end-of-run check)."""
        window_loss = torch.zeros((), device=self.device)
        window_steps = 0
        # The first window after start includes compiling the model (when compiled).
        includes_compile = self.strategy.compiled
        timer = StepTimer(self.device)  # training steps only: evaluations and saves are paused out
        timer.resume()
        # The first agreement follows this process's first step: it measures the pace that
        # spaces the later ones (a stop signal received during start-up is acted on there).
        self._last_agreement = (self.state.step, time.monotonic())
        self._next_agreement = self.state.step + 1
        if self.strategy.compiled:  # until that agreement, which follows every rank's compile
            distributed.extend_collective_timeout()
        try:
            return self._train_steps(stop_request, timer, window_loss, window_steps, includes_compile)
        finally:
            distributed.restore_collective_timeout()

    def _train_steps(self, stop_request: StopRequest, timer: StepTimer, window_loss: torch.Tensor,
                     window_steps: int, includes_compile: bool) -> Optional[str]:
        while not self.finished:
            for n, micro_batches in enumerate(self.step_batches(), 1):
                window_loss += self._optimizer_step(micro_batches)
                trained_in = self.precision.name  # before a callback switches it (precision.RunCheck)
                window_steps += 1
                self.state.step += 1
                self.state.epoch_position += self.global_batch
                self.state.tokens_seen += self.global_batch * self.block_size
                for callback in self.step_callbacks:
                    callback(self)
                # The last step of the run: by max_steps or a time budget's plan, or the last
                # epoch's last (whose epoch is counted here, not after the loop over its batches).
                ends_epochs = n == self._batches_left and self.state.epoch + 1 >= self.cfg.max_epochs
                last_step = ends_epochs or self.finished
                save_now = bool(self.cfg.snapshot_every_steps) and self.state.step % self.cfg.snapshot_every_steps == 0
                log_step = self.state.step % self.cfg.log_every == 0
                if log_step:
                    self._log_train(window_loss, window_steps, *timer.take_window(), includes_compile, trained_in)
                    window_loss.zero_()
                    window_steps, includes_compile = 0, False
                if log_step or self.state.step >= self._next_agreement:
                    stop_signal, save_due = self._agree_on_stop_and_time_save(stop_request)
                    distributed.restore_collective_timeout()  # the agreement synced: every rank has compiled
                    if stop_signal:
                        if ends_epochs:
                            self._next_epoch()
                        return signal.Signals(stop_signal).name
                    save_now = save_now or save_due
                if last_step:  # its evaluation and snapshot are fit()'s, after the end-of-run check
                    if ends_epochs:
                        self._next_epoch()
                    return None
                if self.state.step % self.cfg.eval_every == 0 or save_now:
                    timer.pause()
                    if self.state.step % self.cfg.eval_every == 0:
                        self.evaluate()
                    if save_now:
                        self.save()
                    timer.resume()
            self._next_epoch()
            timer.pause()
            if self._evaluated_at != self.state.step:
                self.evaluate()
            if self.state.epoch % self.cfg.save_every == 0 and not self.finished:
                self.save()
            timer.resume()
        return None

    def _agree_on_stop_and_time_save(self, stop_request: StopRequest) -> tuple[int, bool]:
        """One tiny all_reduce every `log_every` steps, and at least every
        trainer.stop_check_seconds of wall time: did any rank get a stop signal (its number, 0
        if none), is a time-based snapshot due by rank 0's clock, has rank 0's saving failed
        for longer than trainer.save_retry_minutes, has rank 0 lost the run lock (then nothing
        more is saved)? Every rank acts on the same answer, so all stop after the same step.
        The slowest rank's seconds per step since the last agreement come back the same on
        every rank, and set the step of the next one."""
        now = time.monotonic()
        minutes = self.snapshot_every_minutes
        save_due = bool(minutes) and self.dist.is_main and now - self._last_save_time >= 60 * minutes
        save_failed = self.saver is not None and self.saver.failed
        lock_lost = self.run_lock is not None and self.run_lock.lost is not None
        since_step, since = self._last_agreement
        step_seconds = (now - since) / max(1, self.state.step - since_step)
        flags = torch.tensor([float(stop_request.signum), float(save_due), float(save_failed), float(lock_lost),
                              step_seconds], device=self.device)
        distributed.all_reduce_max(flags)
        stop_signal, save_due, save_failed, lock_lost, step_seconds = flags.tolist()
        self._last_agreement = (self.state.step, now)
        self._next_agreement = self.state.step + max(1, min(self.cfg.log_every,
                                                            int(self.cfg.stop_check_seconds / max(step_seconds, 1e-9))))
        if lock_lost:
            lost = self.run_lock.lost if self.run_lock is not None else None
            raise RunError(distributed.broadcast_object(lost) or "rank 0 lost the run lock")
        if save_failed:  # the failing rank's words on every rank: one `error:` line, not also "failed on rank 0"
            said = [e for e in distributed.all_gather_object(self.saver.error if self.saver else None) if e]
            raise RunError(said[0] if said else "saving snapshots failed")
        return int(stop_signal), save_due > 0

    def _wait_for_saves(self) -> None:
        """Wait for the last write (rank 0's, retried for up to trainer.save_retry_minutes,
        the others waiting in the store; under FSDP every rank's, which agree); if it could
        not be saved, every rank stops with the same error."""
        if self.strategy.sharded_snapshots:
            error = self.saver.wait() if self.saver is not None else None
        else:
            error = distributed.wait_for_main(lambda: self.saver.wait() if self.saver else None,
                                              "saving the last snapshot")
        if error:
            raise RunError(error)

    def _newest_saved(self) -> Optional[str]:
        """The newest snapshot this run has saved (rank 0 knows; under FSDP every rank)."""
        return getattr(self.saver, "last_saved", None)

    def _saving(self) -> bool:
        """Is a snapshot write still in flight (rank 0's; under FSDP every rank's)?"""
        return bool(getattr(self.saver, "saving", False))

    def _log_train(self, loss_sum: torch.Tensor, steps: int, seconds: float, wall_seconds: float,
                   includes_compile: bool = False, trained_in: Optional[str] = None) -> None:
        """One metrics line; `seconds` are the window's training seconds, `wall_seconds` its
        wall time, evaluations and saves included (see StepTimer); `trained_in` its steps' precision."""
        loss = distributed.all_reduce_sum(loss_sum.clone() / steps).item() / self.dist.world_size
        tokens = steps * self.global_batch * self.block_size
        tokens_per_s = tokens / max(seconds, 1e-9)
        reached = self.flops_per_token * tokens_per_s / self.dist.world_size
        if self.peak_flops is not None and reached > self.peak_flops and not includes_compile:
            # The peak measured at start was held down (other processes on the cores): the
            # hardware has just shown more, so MFU is quoted against that and stays <= 100%.
            self.metrics.note(f"{reached / 1e12:.3g} TFLOP/s per process reached, above the {self.peak_flops / 1e12:.3g} "
                              "measured at start (other load on the cores then?): the measured-peak MFU (mfu_measured) is quoted against it from now on")
            self.peak_flops = reached
            if self.dist.is_main:
                raise_cached_peak(self.device, self.precision.dtype, self._peak_shapes, reached)
        record = {
            "step": self.state.step,
            "epoch": self.state.epoch,
            "train_loss": loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "tokens_per_s": tokens_per_s,
            "wall_tokens_per_s": tokens / max(wall_seconds, seconds, 1e-9),
            "precision": trained_in or self.precision.name,  # auto's choice can change mid-run (RunCheck)
            **mfu_record(self.flops_per_token, tokens_per_s, self.peak_flops, self.datasheet_peak_flops,
                         self.dist.world_size),
        }
        if self.grad_norm is not None:  # computed for clipping anyway; the same on every rank
            record["grad_norm"] = self.grad_norm.item()
        if includes_compile:
            record["includes_compile"] = True  # this window's tokens/s and MFU are not steady state
        self.metrics.write(record)

    def _raise_if_check_failed(self) -> None:
        """After the snapshot that records it: every rank raises, the run ends with exit code 2
        (NeedsAPerson: not retried, a person compares the nodes)."""
        if self.failed_check is not None:
            raise NeedsAPerson(
                f"{self.failed_check['message']}: the last snapshot holds rank 0's weights, marked as failing this "
                "check (a new start refuses it): compare the nodes' environments, then resume it with "
                "trainer.resume_failed_check=true or start a new run"
            )

    def _check_ranks_agree(self) -> Optional[dict[str, str]]:
        """DDP keeps replicas identical (FSDP the shards' gathered model): prove it at the end.
        None if it holds, else the failed check as the snapshot records it. Every rank gathers
        every rank's fingerprint, so all take the same answer (and the same next collectives)."""
        prints = distributed.all_gather_object(self.strategy.fingerprint())
        if len(set(prints)) == 1:
            self.metrics.note(f"parameters identical on all {len(prints)} rank(s) (sha256 {prints[0]})")
            return None
        by_rank = ", ".join(f"rank {r}: {p}" for r, p in enumerate(prints))
        return {"check": "parameters identical on all ranks",
                "message": f"parameters differ between ranks at the end of training ({by_rank}): the replicas "
                           "diverged (different code or data on some nodes, or a hardware fault)"}
