"""`trainer.time_budget_minutes`: plan the run's steps from the measured pace so that
training ends within the budget.

A step callback. Until the plan is made the run trains with the step count its epochs give;
at the first log step after it has seen enough steps (5% of the budget, or 50 steps), rank 0
turns the pace since training started into a number of steps that fits what is left of the
budget, less a reserve for the evaluations still to come (their forward passes at the
measured pace, with a 50% margin) and 2% for the last snapshot, and broadcasts it. The
plan is kept in TrainState, so it is in every later snapshot: a resume continues the same
schedule (the cosine horizon is the plan) instead of planning again on another machine.
A plan belongs to the budget it was made for: resumed with another trainer.time_budget_minutes
(null: max_epochs/max_steps decide) the plan is lifted, which is how a finished budgeted run
is trained further.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from mingpt_ddp import distributed

if TYPE_CHECKING:
    from mingpt_ddp.trainer import Trainer, TrainState

RESERVE = 0.02  # of the budget, for the final snapshot and the end of the run
FORWARD_SHARE = 1 / 3  # a forward pass costs about a third of a training step per window
EVALUATION_MARGIN = 1.5  # evaluations reserved for, over their estimate
CALIBRATION_SHARE = 0.05  # of the budget spent measuring the pace, at most
CALIBRATION_STEPS = 50  # ... or this many steps, whichever comes first


def _budget(minutes: Optional[float]) -> str:
    return "none" if minutes is None else f"{minutes:g} min"


def lift_changed_plan(snapshot: dict[str, Any], minutes: Optional[float]) -> Optional[str]:
    """Drop the snapshot's plan (its train state's planned_steps) when
    trainer.time_budget_minutes is not the budget it was planned for: with none,
    max_epochs/max_steps decide; with another, that many minutes are planned afresh from
    this launch's pace. Returns a note saying so, or None when the plan stands."""
    state, saved = snapshot["train_state"], snapshot.get("config", {}).get("trainer", {})
    plan = state.get("planned_steps")
    if plan is None or "time_budget_minutes" not in saved or saved["time_budget_minutes"] == minutes:
        return None
    state["planned_steps"] = None
    then = ("trainer.max_epochs/max_steps decide how far it trains" if minutes is None
            else f"{minutes:g} more minutes are planned from the pace of this launch")
    return (f"time budget changed from {_budget(saved['time_budget_minutes'])} to {_budget(minutes)}: its plan of {plan} "
            f"steps is lifted and {then} (the LR schedule follows the new length)")


def how_to_extend(state: "TrainState", minutes: Optional[float]) -> str:
    """For a run its plan has finished: how to train it further."""
    return (f"its time budget's plan of {state.planned_steps} steps is done: to train further, give another budget "
            f"(trainer.time_budget_minutes=M plans about M more minutes; it was {_budget(minutes)}) or none "
            "(trainer.time_budget_minutes=null with a higher trainer.max_steps or max_epochs)")


class TimeBudget:
    def __init__(self, minutes: float, clock: Callable[[], float] = time.monotonic):
        self.budget_s = 60.0 * minutes
        self._clock = clock
        self._started = clock()
        self._start_step: int | None = None
        self._pace_started: float | None = None  # when the pace measurement began (default: at start)

    def __call__(self, trainer: "Trainer") -> None:
        state = trainer.state
        if state.planned_steps is not None:
            return
        if self._start_step is None:  # the first step of this process (a resume starts later)
            # The pace counts from the end of this step: its one-time costs (thread pools,
            # allocations) made short budgets plan 15-20% too few steps.
            self._start_step, self._pace_started = state.step, self._clock()
            return
        if state.step % trainer.cfg.log_every:
            return
        plan = distributed.broadcast_object(self._plan_with_evaluations(trainer) if trainer.dist.is_main else None)
        if plan is None:
            return
        state.planned_steps = plan
        trainer.total_steps = trainer.planned_steps()
        trainer.metrics.total_steps = trainer.total_steps
        trainer.metrics.note(
            f"time budget {self.budget_s / 60:g} min: {self.steps_per_s(state.step):.2f} steps/s over "
            f"{state.step - self._start_step} steps after the first -> {plan} steps planned; {trainer.total_steps} will run "
            "(the plan is saved with the snapshots, so a resume keeps it)"
        )

    def _plan_with_evaluations(self, trainer: "Trainer"):
        """The plan, with the evaluations it will run (periodic, epoch ends, the final one)
        kept out of the training time: planned once, then again with those of the first plan."""
        step, per_step = trainer.state.step, FORWARD_SHARE / trainer.global_batch
        final = per_step * trainer.eval_windows(final=True)
        first = self.plan(step, final)
        if first is None:
            return None
        evaluations = (first // trainer.cfg.eval_every - step // trainer.cfg.eval_every
                       + (first - step) // max(1, trainer.steps_in_epoch(trainer.state.epoch)))
        return self.plan(step, final + evaluations * per_step * trainer.eval_windows())

    def steps_per_s(self, step: int) -> float:
        since = self._started if self._pace_started is None else self._pace_started
        return (step - self._start_step) / max(1e-9, self._clock() - since)

    def plan(self, step: int, final_eval_steps: float = 0.0):
        """The run's total steps once the pace is known; None while still measuring.
        `final_eval_steps`: the final evaluation's work, in training steps."""
        elapsed = self._clock() - self._started
        if elapsed < CALIBRATION_SHARE * self.budget_s and step - self._start_step < CALIBRATION_STEPS:
            return None
        pace = self.steps_per_s(step)
        left = (1.0 - RESERVE) * self.budget_s - elapsed - EVALUATION_MARGIN * final_eval_steps / pace
        return max(step, step + math.floor(left * pace))
