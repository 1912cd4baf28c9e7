"""A torch.profiler trace of a few training steps, for ``trainer.profile=true``.

Hooked into the loop as a step callback on rank 0: it records the steps after step
``profile_steps[0]`` up to step ``profile_steps[1]`` (as the log counts steps), marking
each, and then writes ``<run dir>/profile/rank0.steps<first>-<last>.pt.trace.json`` (Chrome
trace format: ui.perfetto.dev, chrome://tracing, TensorBoard's profiler plugin); at the end
of the run, a table of the most expensive operators next to it. A short window keeps the
trace small and leaves the first steps (allocation, warm-up, torch.compile) out.

Also where a run's time goes outside its steps (``mark``): the phases from process start to
the first step and from the last step to exit, for ``python -m mingpt_ddp.bench fixed``.
Standard library only at import, so main.py marks its start before torch is imported.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from typing import TYPE_CHECKING, Any, Iterator, Optional

if TYPE_CHECKING:
    import torch

    from mingpt_ddp.config import TrainerConfig

log = logging.getLogger(__name__)

# The file that `mark` appends to (bench fixed sets it for its child runs); unset: marks cost nothing.
TIMELINE_ENV = "MINGPT_DDP_TIMELINE"
_timeline = os.environ.get(TIMELINE_ENV)


def mark(phase: str) -> None:
    """`phase` ended now: one JSON line {"phase", "t" (time.time()), "rank"} appended to the file
    $MINGPT_DDP_TIMELINE names, written at once (a run that dies still shows how far it got)."""
    if _timeline:
        line = json.dumps({"phase": phase, "t": time.time(), "rank": int(os.environ.get("RANK", "0"))})
        with open(_timeline, "a") as f:
            f.write(line + "\n")



class StepProfiler:
    """Step callback that profiles the steps after `first` up to and including `last`."""

    def __init__(self, first: int, last: int, out_dir: str, device: torch.device):
        import torch

        self.first, self.last, self.out_dir = first, last, out_dir
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler: Optional[torch.profiler.profile] = None
        self.started_at: Optional[int] = None
        self.stopped_at: Optional[int] = None
        self.trace_path: Optional[str] = None

    def __call__(self, trainer: Any) -> None:  # a Trainer (trainer.py marks its phases here: no import back)
        step = trainer.state.step
        if self.started_at is None:
            if self.first - 1 <= step < self.last:  # a run resumed inside the window profiles the rest of it
                self._start(step)
        elif self.stopped_at is None:
            self.profiler.step()  # "ProfilerStep#N" spans mark each step in the trace
            if step >= self.last:
                self.stop(step)

    def _start(self, step: int) -> None:
        # One step of warm-up before the window when there is one: the profiler's own start-up
        # (CUPTI on GPUs) then does not distort the first profiled step.
        import torch

        warmup = 1 if step == self.first - 1 else 0
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*warmup.*")
            self.profiler = torch.profiler.profile(
                activities=self.activities, record_shapes=True,
                schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=self.last - step - warmup, repeat=1),
            )
        self.profiler.start()
        self.started_at = step + warmup

    def stop(self, step: int) -> None:
        """End the window and write the trace; the operator table waits for `write_summary`
        (it takes seconds, which would show in the tokens/s of the next log line)."""
        if self.profiler is None or self.stopped_at is not None:
            return
        self.profiler.stop()
        self.stopped_at = step
        os.makedirs(self.out_dir, exist_ok=True)
        self.trace_path = os.path.join(self.out_dir, f"rank0.steps{self.started_at}-{step}.pt.trace.json")
        self.profiler.export_chrome_trace(self.trace_path)

    def write_summary(self) -> Optional[str]:
        """The 30 most expensive operators, as a table next to the trace; returns its path."""
        if self.trace_path is None:
            return None
        sort_by = "self_cuda_time_total" if len(self.activities) > 1 else "self_cpu_time_total"
        path = self.trace_path.replace(".pt.trace.json", ".txt")
        with open(path, "w") as f:
            f.write(self.profiler.key_averages().table(sort_by=sort_by, row_limit=30) + "\n")
        self.profiler = None
        return path


@contextlib.contextmanager
def profile_steps(trainer: Any, cfg: "TrainerConfig", run_dir: str) -> Iterator[Optional[StepProfiler]]:
    """With trainer.profile=true, profile rank 0's steps in cfg.profile_steps around the block."""
    if not (cfg.profile and trainer.dist.is_main):
        yield None
        return
    first, last = cfg.profile_steps
    profiler = StepProfiler(first, last, os.path.join(run_dir, "profile"), trainer.device)
    trainer.step_callbacks.append(profiler)
    if first == 0 and trainer.state.step == 0:  # from the very first step: start before it
        profiler._start(0)
    try:
        yield profiler
    finally:
        trainer.step_callbacks.remove(profiler)
        profiler.stop(trainer.state.step)  # the run ended inside the window
        table = profiler.write_summary()
        if table:
            trainer.metrics.note(f"profiler trace of steps {profiler.started_at}-{profiler.stopped_at} on rank 0: "
                                 f"{profiler.trace_path} (open it in https://ui.perfetto.dev), top operators in {table}")
        else:
            log.warning("trainer.profile=true recorded nothing: the run ended at step %d, before "
                        "trainer.profile_steps=%s began", trainer.state.step, [first, last])
