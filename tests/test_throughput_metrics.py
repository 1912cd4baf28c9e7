"""Throughput figures that do not lie: the StepTimer's pauses, tokens/s with and without
evaluations and saves, compiled-model windows, MFU against measured and datasheet peaks, and the
bench's timing and communication modes."""
from __future__ import annotations

import os
import subprocess
import textwrap

import pytest
import torch

from conftest import REPO, TINY, TORCHRUN
from mingpt_ddp import distributed


# ---- findings 4 and 5 (issue 11 item 8): timing windows, evaluation without recompiles -----
from mingpt_ddp import metrics  # noqa: E402
from mingpt_ddp.char_dataset import CharCorpus  # noqa: E402
from mingpt_ddp.config import OptimizerConfig, Precision, TrainerConfig  # noqa: E402
from mingpt_ddp.metrics import MetricsLog  # noqa: E402
from mingpt_ddp.model import GPT, GPTConfig  # noqa: E402
from mingpt_ddp.throughput import StepTimer  # noqa: E402
from mingpt_ddp.trainer import Trainer  # noqa: E402

SINGLE = distributed.DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
                             device=torch.device("cpu"), backend="gloo")


def make_trainer(text, metrics_path=None, **trainer_kw):
    corpus = CharCorpus(text, 0.1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=corpus.vocab.size, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=0.0))
    cfg = TrainerConfig(batch_size=4, precision=Precision.fp32, **trainer_kw)
    return Trainer(cfg, OptimizerConfig(warmup_steps=0), model, corpus, SINGLE,
                   MetricsLog(metrics_path, enabled=metrics_path is not None, total_steps=0), saver=None,
                   snapshot_metadata={})


@pytest.mark.unit
def test_step_timer_counts_only_what_is_not_paused():
    now = [0.0]
    timer = StepTimer(torch.device("cpu"), clock=lambda: now[0])
    timer.resume()
    now[0] = 2.0  # training
    timer.pause()
    now[0] = 30.0  # an evaluation
    timer.resume()
    now[0] = 31.0  # training
    assert timer.take() == 3.0
    now[0] = 35.0
    assert timer.take() == 4.0  # the next window started at the previous take
    timer.pause()
    now[0] = 50.0
    assert timer.take() == 0.0


@pytest.mark.unit
def test_tokens_per_s_leaves_out_evaluations_and_saves(tmp_path, shakespeare, monkeypatch):
    """A fake clock: each training step takes 1 s, each evaluation and save 100 s. Every
    logged window of 5 steps must read 5 s; before the fix those holding an evaluation or a
    save read 105 s or more."""
    import json
    import types

    from mingpt_ddp import throughput

    now = [0.0]
    monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    path = tmp_path / "metrics.jsonl"
    trainer = make_trainer(shakespeare.read_text()[:20_000], str(path), max_steps=20, log_every=5, eval_every=3,
                           eval_batches=1, snapshot_every_steps=4)
    for name in ("evaluate", "save"):
        real = getattr(trainer, name)

        def slow(*args, real=real, **kwargs):
            now[0] += 100.0
            return real(*args, **kwargs)
        setattr(trainer, name, slow)

    def step_takes_a_second(_):
        now[0] += 1.0
    trainer.step_callbacks.append(step_takes_a_second)
    trainer.fit()
    trainer.metrics.close()
    windows = [json.loads(line) for line in path.read_text().splitlines() if "train_loss" in line]
    assert [w["step"] for w in windows] == [5, 10, 15, 20]
    for w in windows:
        assert 5 * trainer.global_batch * 16 / w["tokens_per_s"] == pytest.approx(5.0), w
        assert "includes_compile" not in w and "mfu_datasheet" not in w  # not compiled; a CPU has no datasheet


@pytest.mark.unit
def test_wall_tokens_per_s_counts_the_evaluations_and_saves_of_its_window(tmp_path, shakespeare, monkeypatch):
    """The same fake clock (steps 1 s, each evaluation and save 100 s): wall_tokens_per_s is
    the window's tokens over all of its seconds, tokens_per_s over its 5 training seconds; both
    are on the progress line (issue 23 item 4)."""
    import json
    import logging
    import types

    from mingpt_ddp import throughput

    now = [0.0]
    monkeypatch.setattr(throughput, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    path = tmp_path / "metrics.jsonl"
    trainer = make_trainer(shakespeare.read_text()[:20_000], str(path), max_steps=20, log_every=5, eval_every=3,
                           eval_batches=1, snapshot_every_steps=4)
    slow_at: list[int] = []
    for name in ("evaluate", "save"):
        real = getattr(trainer, name)

        def slow(*args, real=real, **kwargs):
            now[0] += 100.0
            slow_at.append(trainer.state.step)
            return real(*args, **kwargs)
        setattr(trainer, name, slow)

    def step_takes_a_second(_):
        now[0] += 1.0
    trainer.step_callbacks.append(step_takes_a_second)
    trainer.metrics.interactive = False
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    train_log = logging.getLogger("mingpt_ddp.train")
    train_log.addHandler(handler)
    train_log.setLevel(logging.INFO)
    try:
        trainer.fit()
    finally:
        train_log.removeHandler(handler)
    trainer.metrics.close()
    windows = [json.loads(line) for line in path.read_text().splitlines() if "train_loss" in line]
    tokens = 5 * trainer.global_batch * 16
    previous = 0
    for w in windows:
        slow_ones = sum(previous <= step < w["step"] for step in slow_at)  # those at a logged step come after its line
        assert tokens / w["tokens_per_s"] == pytest.approx(5.0), w
        assert tokens / w["wall_tokens_per_s"] == pytest.approx(5.0 + 100.0 * slow_ones), (w, slow_at)
        previous = w["step"]
    assert any(tokens / w["wall_tokens_per_s"] > 100 for w in windows)
    progress = [r for r in records if r.startswith("step 5/")]
    assert progress and f"{windows[0]['tokens_per_s']:,.0f} tok/s, {windows[0]['wall_tokens_per_s']:,.0f} wall tok/s" \
        in progress[0], progress


@pytest.mark.unit
def test_the_first_window_of_a_compiled_model_is_labelled(tmp_path, shakespeare, monkeypatch):
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model: real_compile(model, backend="eager"))
    path = tmp_path / "metrics.jsonl"
    trainer = make_trainer(shakespeare.read_text()[:20_000], str(path), max_steps=4, log_every=2, eval_every=1000,
                           eval_batches=2, compile=True)
    trainer.fit()
    trainer.metrics.close()
    import json
    windows = [json.loads(line) for line in path.read_text().splitlines() if "train_loss" in line]
    assert [w.get("includes_compile", False) for w in windows] == [True, False]


@pytest.mark.unit
def test_evaluation_runs_a_graph_compiled_once(shakespeare, monkeypatch):
    """Evaluation runs compiled (issue 23): one graph for eval mode and no_grad, compiled at
    the first evaluation and run by every later one, its short last batch included (a new
    shape would recompile). Before, evaluation ran the eager model."""
    from torch._dynamo.utils import counters

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model: real_compile(model, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    trainer = make_trainer(shakespeare.read_text()[:20_200], max_steps=2, log_every=1, eval_every=1000,
                           eval_batches=None, compile=True)
    assert len(trainer.val_windows) % trainer.micro_batch != 0  # a short last batch
    trainer._optimizer_step(next(trainer.step_batches()))
    graphs_after_training = counters["stats"]["unique_graphs"]
    assert graphs_after_training >= 1
    first = trainer.evaluate()
    assert counters["stats"]["unique_graphs"] == graphs_after_training + 1
    assert trainer.evaluate() == first
    trainer._optimizer_step(next(trainer.step_batches()))
    trainer.evaluate()
    assert counters["stats"]["unique_graphs"] == graphs_after_training + 1
    with torch.no_grad():  # the same mean as the eager model's over the same windows
        trainer.model.eval()
        n = len(trainer.val_windows)
        from mingpt_ddp.char_dataset import to_device

        x, y = to_device(trainer.val_windows.gather(torch.arange(n)), trainer.device)
        _, eager = trainer.model(x, y)
        trainer.model.train()
    assert trainer.state.last_val_loss == pytest.approx(eager.item(), rel=1e-5)


# ---- finding 8: MFU against the datasheet peak too -----------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("name, dtype, tf32, tflops", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, True, 989.4),
    ("NVIDIA H100 PCIe", torch.bfloat16, True, 756.0),
    ("NVIDIA H100 NVL", torch.float16, True, 835.5),
    ("NVIDIA H200", torch.bfloat16, True, 989.4),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, True, 312.0),
    ("NVIDIA A100-SXM4-80GB", torch.float32, True, 156.0),
    ("NVIDIA A100-SXM4-80GB", torch.float32, False, 19.5),
    ("NVIDIA L40S", torch.bfloat16, True, 362.05),
    ("NVIDIA L4", torch.bfloat16, True, 121.0),
    ("Tesla V100-SXM2-32GB", torch.float16, True, 125.0),
    ("Tesla V100-SXM2-32GB", torch.bfloat16, True, None),
    ("NVIDIA GeForce RTX 4090", torch.bfloat16, True, None),
])
def test_datasheet_peak_for_known_gpus(monkeypatch, name, dtype, tf32, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        peak = metrics.datasheet_peak_flops(torch.device("cuda", 0), dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))


@pytest.mark.unit
def test_cpu_has_no_datasheet_peak_and_mfu_without_a_peak_is_nan():
    import math
    assert metrics.datasheet_peak_flops(torch.device("cpu"), torch.float32) is None
    assert math.isnan(metrics.mfu(1e6, 1e3, None, 1))
    assert metrics.mfu(1e6, 1e3, 1e10, 2) == pytest.approx(0.05)


@pytest.mark.unit
def test_progress_line_labels_both_mfus(caplog):
    import logging
    log = MetricsLog(None, enabled=True, total_steps=10)
    log.interactive = False
    with caplog.at_level(logging.INFO, logger="mingpt_ddp.train"):
        log.write({"step": 1, "epoch": 0, "train_loss": 2.0, "lr": 1e-3, "tokens_per_s": 1000.0, "mfu": 0.38,
                   "mfu_measured": 0.45, "mfu_datasheet": 0.38, "includes_compile": True})
        log.write({"step": 2, "epoch": 0, "train_loss": 2.0, "lr": 1e-3, "tokens_per_s": 1000.0, "mfu": 0.2,
                   "mfu_measured": 0.2})
    assert "(includes compiling) | MFU 38.0% of datasheet peak (45.0% of measured) |" in caplog.text
    assert "tok/s | MFU 20.0% of measured peak |" in caplog.text


@pytest.mark.unit
def test_mfu_is_against_the_datasheet_peak_where_the_gpu_is_known(tmp_path, shakespeare):
    """Issue 30: `mfu` is the figure nanoGPT and PaLM quote (the datasheet peak) where the GPU
    is in the table; the measured-peak figure is `mfu_measured`. Elsewhere (CPUs, unknown GPUs)
    `mfu` stays against the measured peak and there is no `mfu_datasheet`."""
    import json
    path = tmp_path / "metrics.jsonl"
    trainer = make_trainer(shakespeare.read_text()[:20_000], str(path), max_steps=2, log_every=1)
    trainer.peak_flops, trainer.datasheet_peak_flops = 1e15, 2e15  # as on a GPU whose cuBLAS reaches half its datasheet
    trainer.fit()
    trainer.metrics.close()
    w = [json.loads(line) for line in path.read_text().splitlines() if "train_loss" in line][-1]
    assert w["mfu"] == w["mfu_datasheet"] == pytest.approx(w["mfu_measured"] / 2)
    assert w["mfu_measured"] == pytest.approx(trainer.flops_per_token * w["tokens_per_s"] / 1e15)
    assert metrics.mfu_record(1e6, 1e3, 1e10, None, 1) == {"mfu": 0.1, "mfu_measured": 0.1}


# ---- the bench: train timing, comm data, agreeing to stop waiting (issue 11 item 6) ------------
@pytest.mark.unit
def test_bench_train_keeps_epoch_end_evaluations_out_of_the_timed_steps(tmp_path, shakespeare, monkeypatch):
    """Few steps per epoch, so epoch ends fall among the timed steps. A fake clock: each
    optimizer step takes 1 s, each evaluation 100 s; ms/step must read 1000."""
    import types

    from mingpt_ddp.tools import bench
    from mingpt_ddp.trainer import Trainer

    text = tmp_path / "small.txt"
    text.write_text(shakespeare.read_text()[:4_000])
    now = [0.0]
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: now[0], monotonic=lambda: now[0]))
    real_step, real_evaluate = Trainer._optimizer_step, Trainer.evaluate

    def step(self, micro_batches):
        now[0] += 1.0
        return real_step(self, micro_batches)

    evaluated_at: list[int] = []

    def evaluate(self, *args, **kwargs):
        now[0] += 100.0
        evaluated_at.append(self.state.step)
        return real_evaluate(self, *args, **kwargs)
    monkeypatch.setattr(Trainer, "_optimizer_step", step)
    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    options = {**bench.OPTIONS, "steps": "12", "warmup": "1"}
    result = bench.run_train(SINGLE, options, [*TINY[:3], "trainer.batch_size=16", "trainer.precision=fp32",
                                               f"data.path={text}"])
    trainer_epochs_crossed = 13 * 16 * 32 > 0.85 * 4_000  # more windows consumed than one epoch holds
    assert trainer_epochs_crossed
    assert result["ms_per_step"] == pytest.approx(1000.0)
    assert result["mfu_datasheet"] is None and result["datasheet_peak_flops_per_process"] is None
    among = sum(1 <= s < 13 for s in evaluated_at)  # evaluations between the first and the last timed step
    assert among >= 1
    tokens = 12 * 16 * 32
    assert tokens / result["wall_tokens_per_s"] == pytest.approx(12.0 + 100.0 * among)  # issue 23 item 4


@pytest.mark.unit
def test_comm_iterations_are_at_least_nccl_tests_default():
    from mingpt_ddp.tools import bench
    assert [bench.comm_iters(s) for s in (8, 1 << 20, 64 << 20, 256 << 20)] == [100, 50, 20, 20]


@pytest.mark.dist
def test_comm_data_stays_finite_over_many_iterations(tmp_path):
    """Ones summed over 2 ranks double each iteration: inf after 128 of them."""
    import json
    out = tmp_path / "comm.json"
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", "-m", "mingpt_ddp.bench", "comm",
                           "max_bytes=64", "iters=140", "warmup=1", f"out={out}"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["timed_data_finite"] and r["wrong"] == 0 and r["iters"] == 140 for r in rows), rows


SKEWED_CLOCK = textwrap.dedent("""
    import sys, time
    from mingpt_ddp.tools import bench
    from mingpt_ddp import distributed
    dist = distributed.setup(timeout_minutes=0.5)
    if dist.rank == 1:  # this rank's clock jumps ahead after the first round: its deadline passes early
        real, calls = time.monotonic, []
        def jumpy():
            calls.append(1)
            return real() + (1e6 if len(calls) > 2 else 0)
        bench.time = type("T", (), {"monotonic": staticmethod(jumpy), "sleep": time.sleep})
    # threshold -1: never quiet, so only rank 0's deadline can end the wait
    busy = bench.wait_until_quiet(3.0, dist, threshold=-1.0)
    print(f"rank {dist.rank} left the wait: {busy}", flush=True)
    distributed.barrier()
""")


@pytest.mark.dist
def test_wait_until_quiet_ends_on_the_same_round_on_every_rank(tmp_path):
    script = tmp_path / "skew.py"
    script.write_text(SKEWED_CLOCK)
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=150)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "rank 0 left the wait" in text and "rank 1 left the wait" in text, text


