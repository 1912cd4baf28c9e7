"""trainer.time_budget_minutes: steps planned from the measured pace, kept across a resume."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from conftest import MAIN, PYTHON, REPO, TINY, load_snapshot, read_metrics
from mingpt_ddp.time_budget import CALIBRATION_STEPS, TimeBudget


@pytest.mark.unit
def test_the_plan_fits_what_is_left_of_the_budget_after_calibrating():
    now = [0.0]
    budget = TimeBudget(10, clock=lambda: now[0])  # 600 s
    budget._start_step = 0
    now[0] = 10.0
    assert budget.plan(20) is None  # 10 s < 5% of the budget and 20 < CALIBRATION_STEPS steps
    now[0] = 30.0
    # 50 steps in 30 s; 98% of 600 s = 588 s, 558 s left at 5/3 steps/s: 930 more steps.
    assert budget.plan(50) == 980
    # A final evaluation worth 30 steps (18 s at this pace) is reserved with a 50% margin: 45 steps fewer.
    assert budget.plan(50, final_eval_steps=30) == 935
    now[0] = 0.0
    slow = TimeBudget(1, clock=lambda: now[0])
    slow._start_step = 0
    now[0] = 70.0  # 3 steps took longer than the whole budget: the plan is where the run is
    assert slow.plan(3) == 3


@pytest.mark.unit
def test_calibration_ends_after_enough_steps_even_on_a_long_budget():
    now = [0.0]
    budget = TimeBudget(600, clock=lambda: now[0])
    budget._start_step = 0
    now[0] = 5.0
    assert budget.plan(CALIBRATION_STEPS - 1) is None
    assert budget.plan(CALIBRATION_STEPS) is not None


@pytest.mark.dist
def test_a_budgeted_run_stops_at_its_plan_and_a_resume_keeps_the_plan(tmp_path, small_corpus):
    run_dir = tmp_path / "run"
    args = [*TINY, f"data.path={small_corpus}", "trainer.max_epochs=1000", "trainer.time_budget_minutes=0.4",
            f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    log = tmp_path / "first.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([PYTHON, MAIN, *args], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 400
    while "steps planned;" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    text = log.read_text()
    assert "time budget 0.4 min:" in text, text
    plan = int(text.split(" steps planned;")[0].rsplit("-> ", 1)[1])
    proc.send_signal(signal.SIGTERM)  # stop after the plan was made; the snapshot carries it
    assert proc.wait(timeout=300) == 0, log.read_text()
    stopped = load_snapshot(run_dir / "snapshot.pt")["train_state"]
    assert stopped["planned_steps"] == plan and stopped["step"] < plan

    resumed = subprocess.run([PYTHON, MAIN, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "time budget" not in resumed.stdout + resumed.stderr  # not planned again
    final = load_snapshot(run_dir / "snapshot.pt")["train_state"]
    assert final["step"] == plan and final["planned_steps"] == plan
    assert read_metrics(run_dir)[-1]["step"] == plan

    # Finished by its plan: the message says how to go on, and doing so works. Without a
    # budget, max_steps decides (the plan is lifted); a new budget plans again.
    again = subprocess.run([PYTHON, MAIN, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    text = again.stdout + again.stderr
    assert again.returncode == 0 and "run already finished" in text, text
    assert f"its time budget's plan of {plan} steps" in text and "trainer.time_budget_minutes=null" in text, text
    lifted = subprocess.run([PYTHON, MAIN, *args, "trainer.time_budget_minutes=null", f"trainer.max_steps={plan + 10}"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    text = lifted.stdout + lifted.stderr
    assert lifted.returncode == 0, text
    assert "time budget changed from 0.4 min to none" in text, text
    final = load_snapshot(run_dir / "snapshot.pt")["train_state"]
    assert final["step"] == plan + 10 and final["planned_steps"] is None, text
