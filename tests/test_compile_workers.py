"""Stop signals and torch.compile's worker processes (issue 23 item 10). Slurm signals every
process of a step; inductor's compile sidecar and its workers (started where Triton is, i.e.
on GPUs) would die of SIGUSR1/SIGTERM by default, so a compile in progress fails or hangs.
The trainer starts them with the stop signals blocked. This CPU build of torch has no Triton
and starts no workers itself: the test has inductor start the ones a GPU build starts."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO
from mingpt_ddp import distributed


SCRIPT = """import os, signal, sys, time
import torch._inductor.async_compile as ac
ac.has_triton_package = lambda: True  # a CPU build has no Triton: start the workers a GPU build starts
from mingpt_ddp import preemption

got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
if sys.argv[1] == "shielded":
    preemption.shield_compile_workers()
else:
    ac.maybe_warm_pool()
pool = ac.AsyncCompile.process_pool()
print("first job:", pool.submit(ac.AsyncCompile._get_ready).result(timeout=300), flush=True)

def parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]) if fields[0] != "Z" else None
    except OSError:
        return None

def descendants(pid):
    pids = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c in pids if parent_of(c) == p]
        found += kids
        frontier += kids
    return found

workers = descendants(os.getpid())
print("compile processes:", len(workers), flush=True)
os.killpg(os.getpgid(0), signal.SIGUSR1)
time.sleep(2)
alive = [p for p in workers if parent_of(p) is not None]
print("trainer handler got", got, "| alive after SIGUSR1:", len(alive), "of", len(workers), flush=True)
try:
    print("second job:", pool.submit(ac.AsyncCompile._get_ready).result(timeout=float(sys.argv[2])), flush=True)
except Exception as exc:
    print("second job failed:", type(exc).__name__, exc, flush=True)
os._exit(0)
"""


def run(tmp_path, how: str, wait_s: float) -> str:
    path = tmp_path / "workers.py"
    path.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(path), how, str(wait_s)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=300, start_new_session=True)  # its own process group
    return proc.stdout + proc.stderr


@pytest.mark.dist
def test_sigusr1_to_the_process_group_spares_shielded_compile_workers(tmp_path):
    text = run(tmp_path, "shielded", 120)
    assert "compile processes: " in text, text
    assert "trainer handler got [10]" in text, text  # the trainer still gets its stop signal
    total = int(text.split("compile processes: ")[1].split()[0])
    assert total >= 2 and f"alive after SIGUSR1: {total} of {total}" in text, text
    assert "second job: ready" in text, text


@pytest.mark.dist
def test_without_the_shield_the_same_signal_kills_them(tmp_path):
    """What the trainer did before: the workers die and the next compile job never returns."""
    text = run(tmp_path, "unshielded", 5)
    assert "alive after SIGUSR1: 0 of" in text and "second job failed" in text, text


@pytest.mark.unit
def test_a_compiled_trainer_shields_its_workers_before_training(shakespeare, monkeypatch):
    import torch

    from mingpt_ddp import trainer as trainer_module
    from test_throughput_metrics import make_trainer

    shielded = []
    monkeypatch.setattr(trainer_module, "shield_compile_workers", lambda: shielded.append(True))
    monkeypatch.setattr(trainer_module, "size_compile_workers", lambda n: shielded.append(n))  # issue 30
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model: real_compile(model, backend="eager"))
    make_trainer(shakespeare.read_text()[:20_000], max_steps=1, log_every=1, eval_batches=1, compile=True).fit()
    assert shielded == [distributed.cpu_threads_per_process(1), True]  # sized, then started
    make_trainer(shakespeare.read_text()[:20_000], max_steps=1, log_every=1, eval_batches=1, compile=False).fit()
    assert shielded == [distributed.cpu_threads_per_process(1), True]


@pytest.mark.unit
def test_compile_workers_per_rank_are_its_share_of_the_cores_unless_set(monkeypatch):
    """Issue 30: plain torchrun started min(32, cores) inductor workers in every rank."""
    import torch._inductor.config as inductor_config

    from mingpt_ddp.preemption import size_compile_workers

    monkeypatch.setattr(inductor_config, "compile_threads", inductor_config.compile_threads)
    env = {}
    assert size_compile_workers(6, env) == 6 and env == {"TORCHINDUCTOR_COMPILE_THREADS": "6"}
    assert inductor_config.compile_threads == 6
    assert size_compile_workers(200, {}) == 32 and size_compile_workers(0, {}) == 1
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "3"}
    inductor_config.compile_threads = 3
    assert size_compile_workers(6, env) is None and inductor_config.compile_threads == 3


@pytest.mark.unit
def test_collectives_issued_while_ranks_may_compile_wait_longer(tmp_path, monkeypatch):
    """Issue 30: trainer.collective_timeout_minutes (5) also bounded the first step's all-reduce,
    which waits for the slowest rank's compile. A one-process gloo group: its timeout is
    lengthened, then put back; never shortened."""
    import datetime

    import torch
    import torch.distributed as torch_dist

    five = datetime.timedelta(minutes=5)
    torch_dist.init_process_group("gloo", store=torch_dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                                  world_size=1, timeout=five)
    try:
        monkeypatch.setattr(distributed, "_collective_timeout", five)
        backend = torch_dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert distributed.extend_collective_timeout() is True
        assert backend.options._timeout == datetime.timedelta(minutes=distributed.COMPILE_COLLECTIVE_TIMEOUT_MINUTES)
        # Nested (a resume at an epoch's end evaluates inside the first step's extension): not
        # this caller's to restore, so the evaluation does not end the step's longer timeout.
        assert distributed.extend_collective_timeout() is False
        distributed.restore_collective_timeout()
        assert backend.options._timeout == five
        distributed.extend_collective_timeout(1)
        assert backend.options._timeout == five
    finally:
        distributed.restore_collective_timeout()
        torch_dist.destroy_process_group()


@pytest.mark.unit
@pytest.mark.parametrize("compiled", [True, False])
def test_a_compiled_trainer_waits_longer_until_every_rank_compiled(shakespeare, monkeypatch, compiled):
    """The first step and the first evaluation (each compiles a graph) run under the longer
    timeout, put back after the host synced on their collectives (the first stop agreement,
    the evaluation's totals)."""
    import torch

    from mingpt_ddp import trainer as trainer_module
    from test_throughput_metrics import make_trainer

    events = []
    monkeypatch.setattr(trainer_module, "shield_compile_workers", lambda: None)
    monkeypatch.setattr(trainer_module, "size_compile_workers", lambda n: None)
    monkeypatch.setattr(distributed, "extend_collective_timeout", lambda: events.append("extend") or True)
    monkeypatch.setattr(distributed, "restore_collective_timeout", lambda: events.append("restore"))
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model: real_compile(model, backend="eager"))
    trainer = make_trainer(shakespeare.read_text()[:20_000], max_steps=4, log_every=4, eval_every=2, eval_batches=1,
                           compile=compiled)
    real_evaluate = trainer.evaluate
    trainer.evaluate = lambda *a, **k: (events.append("evaluate"), real_evaluate(*a, **k))[1]
    trainer.step_callbacks.append(lambda t: events.append("step"))
    trainer.fit()
    extended = [i for i, e in enumerate(events) if e == "extend"]
    if not compiled:
        assert not extended
        return
    assert events[:3] == ["extend", "step", "restore"], events
    assert len(extended) == 2 and events[extended[1] - 1] == "evaluate"  # the first evaluation only
    assert events[extended[1] + 1] == "restore"
