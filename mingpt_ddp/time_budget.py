"""`trainer.time_budget_minutes`: plan the run's steps from the measured pace so that
training ends within the budget, and revise the plan as the pace changes.

A step callback. Until the plan is made the run trains with the step count its epochs give
(shown as "step N/? (planning)"); at the first log step after it has seen enough steps (5%
of the budget, or 50 steps) and at every log step after it (at every step once the plan ends
within log_every steps), rank 0 turns the recent pace
(the last 5% of the budget, at least 10 steps, its slowest step left out on a CPU: a load
that came and went is forgotten, one slow step changes nothing; on CUDA, where steps are
queued and the log step waits for them, it is kept) into a number of steps that fits what
is left of the budget (wall time since this launch's first step), less a reserve for the
evaluations still to come (their forward passes at that pace, with a 50% margin, taken at the
launch's usual pace where the recent one is a burst's) and 2% for
the last snapshot, and broadcasts it. A revision moves the LR's horizon with the LR
continuous (trainer.move_horizon: the cosine keeps its progress and spreads the rest over
the steps now left).

The plan, the schedule's bends and the budget's seconds spent are kept in TrainState, so
they are in every later snapshot. A resume with the same budget goes on from the time spent
(the budget's clock starts that much earlier; killed before its first plan, the time before
the kill counts too): the snapshot's plan stands, the LR continuous, until this launch has
measured its own pace, and is revised from there as in an unbroken run. A plan belongs to the budget it was made
for: resumed with another trainer.time_budget_minutes (null: max_epochs/max_steps decide)
the plan is lifted, which is how a finished budgeted run is trained further: its LR, at the
floor, warms up again over optimizer.warmup_steps and decays over the new length
(trainer.warm_up_again); a run lifted before its plan's end decays on from where it is.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import asdict
from itertools import islice
from typing import TYPE_CHECKING, Any, Callable, Optional

from mingpt_ddp import distributed
from mingpt_ddp.trainer import TrainState, continue_schedule

if TYPE_CHECKING:
    from mingpt_ddp.config import OptimizerConfig
    from mingpt_ddp.trainer import Trainer

RESERVE = 0.02  # of the budget, for the final snapshot and the end of the run
FORWARD_SHARE = 1 / 3  # a forward pass costs about a third of a training step per window
EVALUATION_MARGIN = 1.5  # evaluations reserved for, over their estimate
CALIBRATION_SHARE = 0.05  # of the budget spent measuring the pace, at most
CALIBRATION_STEPS = 50  # ... or this many steps, whichever comes first
WINDOW_SHARE = 0.05  # the pace is that of the last 5% of the budget ...
WINDOW_STEPS = 10  # ... and at least this many steps (their slowest one left out)
ANNOUNCE_CHANGE = 0.1  # a revision is logged when the plan moved by more than this since the last one logged


def _budget(minutes: Optional[float]) -> str:
    return "none" if minutes is None else f"{minutes:g} min"


def lift_changed_plan(snapshot: dict[str, Any], minutes: Optional[float],
                      optim_cfg: Optional["OptimizerConfig"] = None) -> Optional[str]:
    """Drop the snapshot's plan (its train state's planned_steps) when
    trainer.time_budget_minutes is not the budget it was planned for: with none,
    max_epochs/max_steps decide; with another, that many minutes are planned afresh from
    this launch's pace. The LR schedule (with `optim_cfg`, this run's optimizer settings)
    warms up again where the plan had ended, else decays on from its progress at this step
    over the new length. Returns a note saying so, or None when the plan stands."""
    state, saved = snapshot["train_state"], snapshot.get("config", {}).get("trainer", {})
    plan = state.get("planned_steps")
    if "time_budget_minutes" not in saved or saved["time_budget_minutes"] == minutes:
        return None
    state["budget_spent_s"] = 0.0  # another budget: its time starts now
    if plan is None:
        return None
    train = TrainState(**state)
    train.planned_steps = None
    # its LR horizon: the plan, or max_steps/max_epochs where they ended it first
    moved = continue_schedule(train, optim_cfg, snapshot.get("total_steps") or plan) if optim_cfg else None
    schedule = f"; {moved}" if moved else ""
    state.update(asdict(train))
    then = ("trainer.max_epochs/max_steps decide how far it trains" if minutes is None
            else f"{minutes:g} more minutes are planned from the pace of this launch")
    return (f"time budget changed from {_budget(saved['time_budget_minutes'])} to {_budget(minutes)}: its plan of {plan} "
            f"steps is lifted and {then} (the LR schedule follows the new length{schedule})")


def how_to_extend(state: "TrainState", minutes: Optional[float]) -> str:
    """For a run its plan has finished: how to train it further."""
    return (f"its time budget's plan of {state.planned_steps} steps is done: to train further, give another budget "
            f"(trainer.time_budget_minutes=M plans about M more minutes; it was {_budget(minutes)}) or none "
            "(trainer.time_budget_minutes=null with a higher trainer.max_steps or max_epochs)")


class TimeBudget:
    def __init__(self, minutes: float, clock: Callable[[], float] = time.monotonic):
        self.budget_s = 60.0 * minutes
        self._clock = clock
        self._launched = self._started = clock()  # _started: the budget's origin, earlier on a resume
        self._start_step: int | None = None
        self._points: deque[tuple[int, float]] = deque()  # (step, time) of the recent steps
        self._points_seen = (0, 0.0)  # (step, time) of this launch's first point: its usual pace
        self._announced: Optional[int] = None  # the plan last logged
        # CUDA steps are queued: the log step's .item() waits for the GPU time of those before it,
        # so there the slowest step is theirs too, not a hiccup, and is kept in the pace.
        self._drop_slowest = True

    def __call__(self, trainer: "Trainer") -> None:
        state = trainer.state
        if self._start_step is None:  # the first step of this process (a resume starts later)
            self._started -= state.budget_spent_s  # the time its snapshot had spent (0: another budget's)
            self._announced = state.planned_steps
            self._drop_slowest = trainer.device.type != "cuda"
            trainer.budget_spent = lambda: self._clock() - self._started  # read when a snapshot is taken
        self.observe(state.step)
        state.budget_spent_s = self._clock() - self._started  # in every snapshot from here
        # Within log_every steps of its end the plan is revised at every step: one that ended
        # before the next log step was final, and a burst there ended runs at 72% of the budget.
        # (planned_steps and step are the same on every rank: all revise, and broadcast, together.)
        ending = state.planned_steps is not None and state.planned_steps - state.step <= trainer.cfg.log_every
        if state.step != self._start_step and (state.step % trainer.cfg.log_every == 0 or ending):
            self._revise(trainer)
        if trainer.finished and state.planned_steps is not None:
            spent = self._clock() - self._started
            trainer.metrics.note(f"time budget {self.budget_s / 60:g} min: training ends at step {state.step}, "
                                 f"{spent:.1f} s ({100 * spent / self.budget_s:.0f}%) into the budget")

    def _revise(self, trainer: "Trainer") -> None:
        """Plan (or plan again) at a log step: rank 0 decides, every rank takes its plan."""
        state = trainer.state
        plan = distributed.broadcast_object(self._plan_with_evaluations(trainer) if trainer.dist.is_main else None)
        if plan is None:
            return
        before = state.planned_steps
        if plan != before:
            trainer.set_plan(plan)
        if before is None:
            trainer.metrics.note(
                f"time budget {self.budget_s / 60:g} min: {self.pace():.2f} steps/s over the last "
                f"{self._points[-1][0] - self._points[0][0]} steps -> {plan} steps planned; {trainer.total_steps} will "
                "run (revised as the pace changes; a resume with the same budget goes on from the time spent)")
            self._announced = plan
            warmup = trainer.optim_cfg.warmup_steps
            if trainer.total_steps < state.lr_warmup_from + warmup:  # the LR rises to the end: said once
                trainer.metrics.note(
                    f"time budget {self.budget_s / 60:g} min: the plan of {trainer.total_steps} steps ends within "
                    f"optimizer.warmup_steps={warmup}, so the LR never decays: lower optimizer.warmup_steps (to about "
                    f"a tenth of the plan, {max(1, trainer.total_steps // 10)}) or give a longer budget")
        elif self._announced is not None and abs(plan - self._announced) > ANNOUNCE_CHANGE * self._announced:
            trainer.metrics.note(
                f"time budget {self.budget_s / 60:g} min: {self.pace():.2f} steps/s now -> plan revised from "
                f"{self._announced} to {plan} steps; {trainer.total_steps} will run (the LR schedule follows, continuous at this step)")
            self._announced = plan

    def observe(self, step: int) -> None:
        """The end of `step` (after the first step of this process: its one-time costs, thread
        pools and allocations, made short budgets plan 15-20% too few steps)."""
        now = self._clock()
        if self._start_step is None:
            self._start_step, self._points_seen = step, (step, now)
        points = self._points
        points.append((step, now))
        window = WINDOW_SHARE * self.budget_s
        # the oldest point goes once the window holds enough without it (one step to leave out)
        while len(points) > WINDOW_STEPS + 2 and now - points[1][1] >= window:
            points.popleft()

    def _plan_with_evaluations(self, trainer: "Trainer"):
        """The plan, with the evaluations it will run (periodic, epoch ends, the final one)
        kept out of the training time. Where those of the longest plan do not fit, the plan
        ends before the last of them, if that fits (ending at its step instead, a burst of load
        that made an epoch-end evaluation look costly ended a run at 80% of its budget)."""
        step, per_step = trainer.state.step, FORWARD_SHARE / trainer.global_batch
        final = per_step * trainer.eval_windows(final=True)
        plan = self.plan(step, final)
        if plan is None:
            return None
        every = trainer.cfg.eval_every
        per_epoch = max(1, trainer.steps_in_epoch(trainer.state.epoch))
        epoch_left = per_epoch - trainer.state.epoch_position // trainer.global_batch  # steps to this epoch's end

        def evaluations(end: int) -> int:
            epoch_ends = 0 if end - step < epoch_left else 1 + (end - step - epoch_left) // per_epoch
            return end // every - step // every + epoch_ends

        def last_evaluation(end: int) -> int:  # the step of the last evaluation before the final one
            epoch_end = -1 if end - step < epoch_left else end - (end - step - epoch_left) % per_epoch
            return max(end // every * every, epoch_end)

        while True:  # each pass leaves out one more evaluation
            fits = self.plan(step, final + evaluations(plan) * per_step * trainer.eval_windows())
            below = last_evaluation(plan) - 1
            if fits >= plan or evaluations(plan) == 0 or below <= max(fits, step):
                return min(plan, fits)
            plan = below

    def pace(self) -> float:
        """Steps per second over the recent window, its slowest step left out on a CPU (on CUDA
        it holds the queued steps' GPU time: kept)."""
        pairs = [(s1 - s0, t1 - t0) for (s0, t0), (s1, t1) in zip(self._points, islice(self._points, 1, None))]
        steps, seconds = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
        if self._drop_slowest and len(pairs) > WINDOW_STEPS:
            slowest = max(pairs, key=lambda p: p[1] / max(1, p[0]))
            steps, seconds = steps - slowest[0], seconds - slowest[1]
        return steps / max(1e-9, seconds)

    def plan(self, step: int, final_eval_steps: float = 0.0):
        """The run's total steps once the pace is known; None while still measuring.
        `final_eval_steps`: the evaluations' work still to come, in training steps."""
        elapsed = self._clock() - self._started
        # the pace is this launch's: measured afresh after a resume (the snapshot's plan stands till then)
        if (self._clock() - self._launched < CALIBRATION_SHARE * self.budget_s
                and step - self._start_step < CALIBRATION_STEPS):
            return None
        pace = self.pace()
        # The evaluations at the recent pace, with a margin at the launch's own where that is
        # quicker: a burst of load is not reserved for twice (its pace and the margin on it ended
        # runs at 80% of the budget), and a load that lasts still has its evaluations' time.
        (first, started), now = self._points_seen, self._clock()
        usual = (step - first) / max(1e-9, now - started)
        evaluations_s = final_eval_steps * max(EVALUATION_MARGIN / max(pace, usual), 1.0 / pace)
        left = (1.0 - RESERVE) * self.budget_s - elapsed - evaluations_s
        return max(step, step + math.floor(left * pace))
