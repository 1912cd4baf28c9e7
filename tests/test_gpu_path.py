"""The GPU/cluster code paths (issue 12), tested on CPU by separating the logic from the
hardware: patched device counts, names and capabilities, Slurm environments, and real
torchrun workers with gloo where processes have to take part."""
from __future__ import annotations

import os
import subprocess
import textwrap
import time

import pytest
import torch

from conftest import REPO, TINY, TORCHRUN, output, run_cli
from mingpt_ddp import config, distributed, precision
from mingpt_ddp.errors import ConfigError


# ---- finding 1: the device of a rank -----------------------------------------------------
@pytest.mark.parametrize("visible, local_rank, expected", [
    (8, 3, 3),  # torchrun: every worker sees the node's 8 GPUs
    (1, 5, 0),  # srun --gpus-per-task=1: each task sees its own GPU as cuda:0
    (4, 6, 2),  # two tasks per GPU
])
def test_device_is_local_rank_modulo_visible_gpus(monkeypatch, visible, local_rank, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    device, backend = distributed.pick_device(local_rank)
    assert device == torch.device("cuda", expected) and device.index == expected and backend == "nccl"


def test_process_group_is_bound_to_the_gpu_only_on_cuda():
    cuda = torch.device("cuda", 2)
    assert distributed.process_group_options(cuda) == {"device_id": cuda}
    assert distributed.process_group_options(torch.device("cpu")) == {}


def test_a_config_error_on_rank_1_only_is_printed_by_rank_1_and_ends_the_job_fast(tmp_path, small_corpus):
    """A per-rank cache directory: rank 1 alone sees a data.cache_dir other than its node's
    local rank 0 and raises. Before the fix rank 1 exited 2 without a word."""
    start = time.monotonic()
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path / 'run'}", f"data.path={small_corpus}", "trainer.max_steps=2",
                    f"data.cache_dir={tmp_path}/cache_${{oc.env:RANK}}"], nproc=2, timeout=120)
    elapsed = time.monotonic() - start
    text = output(proc)
    assert proc.returncode != 0, text
    # Every rank stops with it (a sweep must not go on with one rank missing), printed once and
    # naming the rank that hit it.
    assert text.count(f"error: on rank(s) 1 of 2: this process's data.cache_dir is {tmp_path}/cache_1 but this "
                      f"node's local rank 0 used {tmp_path}/cache_0") == 1, text
    assert "done:" not in text
    assert elapsed < 60, f"{elapsed:.0f} s"


def test_an_error_every_rank_hits_is_printed_once(tmp_path, small_corpus):
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path / 'run'}", f"data.path={small_corpus}", "data.block_size=5000"],
                   nproc=2, timeout=120)
    text = output(proc)
    assert proc.returncode != 0
    assert text.count("error: data.block_size=5000 is larger than the validation split") == 1, text
    assert "[rank 1] error" not in text, text  # rank 0 speaks for an error it hit too


def test_rank_0_speaks_for_an_error_every_rank_hit_even_when_another_rank_counts_first(monkeypatch):
    """The store decides who prints: rank 0 always prints its own error; another rank stays
    quiet once rank 0 has reported the same message, and speaks after a grace period only if
    rank 0 never does (an error of its own)."""
    store = torch.distributed.HashStore()
    monkeypatch.setattr(distributed, "_store", store)
    monkeypatch.setattr(distributed, "_current", None)
    monkeypatch.setenv("RANK", "1")
    started = time.monotonic()
    assert distributed.first_to_report("only mine", rank0_grace_s=0.3)  # rank 0 never reports it
    assert time.monotonic() - started >= 0.3
    assert not distributed.first_to_report("only mine", rank0_grace_s=0.3)  # printed already
    monkeypatch.setenv("RANK", "0")
    assert distributed.first_to_report("everyone's")
    monkeypatch.setenv("RANK", "1")
    assert not distributed.first_to_report("everyone's", rank0_grace_s=0.3)


# ---- finding 2: the collective timeout -----------------------------------------------------
def trainer_cfg(**values):
    base = {"save_retry_minutes": 15.0, "load_retry_minutes": 2.0, "collective_timeout_minutes": 5.0}
    return type("T", (), {**base, **values})()


def test_collective_timeout_is_minutes_and_waits_for_rank_0_cover_its_retries():
    """The training group's timeout no longer has to outlast rank 0's save retries (the
    others wait for those in the store, tests/test_rank0_waits.py)."""
    assert config.TrainerConfig().collective_timeout_minutes == 5.0
    assert config.collective_timeout_minutes(trainer_cfg()) == 5.0
    assert config.collective_timeout_minutes(trainer_cfg(collective_timeout_minutes=0.5)) == 0.5
    assert config.rank0_wait_minutes(trainer_cfg()) == 20.0
    assert config.rank0_wait_minutes(trainer_cfg(save_retry_minutes=1, load_retry_minutes=10)) == 15.0
    with pytest.raises(ConfigError, match=r"trainer.collective_timeout_minutes=0 must be positive"):
        config.collective_timeout_minutes(trainer_cfg(collective_timeout_minutes=0))


def test_a_collective_timeout_that_is_not_positive_is_one_clear_error(tmp_path, small_corpus):
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path / 'run'}", f"data.path={small_corpus}",
                    "trainer.collective_timeout_minutes=0"], timeout=120)
    assert proc.returncode == 2 and "Traceback" not in output(proc), output(proc)
    assert output(proc).count("error: trainer.collective_timeout_minutes=0.0 must be positive") == 1, output(proc)


STALLED_BARRIER = textwrap.dedent("""
    import os, sys, time
    from mingpt_ddp import distributed
    dist = distributed.setup(timeout_minutes=float(sys.argv[1]))
    if dist.rank == 1:
        time.sleep(60)  # never joins the barrier
        sys.exit(0)
    start = time.monotonic()
    try:
        distributed.barrier()
    except Exception as exc:
        print(f"barrier gave up after {time.monotonic() - start:.1f} s: {type(exc).__name__}", flush=True)
        os._exit(3)
    print("barrier passed", flush=True)
""")


def test_the_collective_timeout_reaches_the_process_group(tmp_path):
    """setup(timeout_minutes) is what init_process_group gets: a barrier that one rank never
    joins gives up after it (0.1 min here), not after the 30-minute default."""
    script = tmp_path / "stall.py"
    script.write_text(STALLED_BARRIER)
    start = time.monotonic()
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), "0.1"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=120)
    text = proc.stdout + proc.stderr
    assert "barrier gave up after" in text, text
    seconds = float(text.split("barrier gave up after ")[1].split(" s")[0])
    assert 4 <= seconds < 40, text
    assert time.monotonic() - start < 100


# ---- finding 10: bf16 on GPUs that only emulate it -----------------------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    def make(capability, name="Tesla V100-SXM2-32GB"):
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    return make


def test_bf16_is_refused_on_a_gpu_that_only_emulates_it(fake_gpu):
    fake_gpu((7, 0))
    with pytest.raises(ConfigError, match=r"Tesla V100-SXM2-32GB \(sm_70\) only emulates bf16.*trainer.precision=fp16"):
        precision.resolve("bf16", torch.device("cuda", 0))
    assert precision.resolve("auto", torch.device("cuda", 0)).name == "fp16"


def test_bf16_is_accepted_on_ampere_and_newer(fake_gpu):
    fake_gpu((9, 0), "NVIDIA H100 80GB HBM3")
    assert precision.resolve("bf16", torch.device("cuda", 0)).name == "bf16"
    assert precision.resolve("auto", torch.device("cuda", 0)).name == "bf16"


# ---- finding 11: the rendezvous host under plain srun ----------------------------------------
@pytest.mark.parametrize("nodelist, first", [
    ("gpu-[007-008]", "gpu-007"),
    ("gpu-[010,003-004],cpu1", "gpu-010"),
    ("n1,n2", "n1"),
    ("rack[2-3]-node[05-06]", "rack2-node05"),
    ("node17", "node17"),
    ("", "127.0.0.1"),
])
def test_first_host_of_a_slurm_hostlist(nodelist, first):
    assert distributed.first_hostname(nodelist) == first


def test_a_step_on_a_subset_of_nodes_dials_its_own_first_node(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(var, "")  # recorded, so what read_topology exports is undone after the test
        monkeypatch.delenv(var)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-[001-004]")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu-[003-004]")
    for var, value in dict(SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_ID="0",
                           SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_NODEID="1", SLURM_JOB_ID="77").items():
        monkeypatch.setenv(var, value)
    assert distributed.read_topology() == (1, 0, 2, 1)
    assert os.environ["MASTER_ADDR"] == "gpu-003"


# ---- issue 11 item 7: CPU threads per process -------------------------------------------------
@pytest.mark.parametrize("env, affinity, node_cores, local_world, threads", [
    ({"TORCHELASTIC_RUN_ID": "x"}, 16, 16, 2, 8),  # torchrun: workers share one mask
    ({"SLURM_PROCID": "0", "SLURM_CPUS_PER_TASK": "8"}, 8, 32, 4, 8),  # srun, bound: the task's own cores
    ({"SLURM_PROCID": "0", "SLURM_CPUS_PER_TASK": "8"}, 32, 32, 4, 8),  # srun, unbound: its share
    ({"SLURM_PROCID": "0"}, 8, 32, 4, 8),  # srun binding without --cpus-per-task
    ({"SLURM_PROCID": "0"}, 32, 32, 4, 8),  # srun --cpu-bind=none, whole node
    ({"SLURM_PROCID": "0", "TORCHELASTIC_RUN_ID": "x", "SLURM_CPUS_PER_TASK": "32"}, 32, 64, 8, 4),  # torchrun in srun
    ({}, 4, 4, 1, 4),  # alone
])
def test_cpu_threads_are_not_divided_twice(monkeypatch, env, affinity, node_cores, local_world, threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(os, "cpu_count", lambda: node_cores)
    assert distributed.cpu_threads_per_process(local_world, env) == threads


def test_each_process_logs_its_thread_count(tmp_path, small_corpus):
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path / 'run'}", f"data.path={small_corpus}", "trainer.max_steps=1"],
                   nproc=2, timeout=180)
    text = output(proc)
    assert proc.returncode == 0, text
    for rank in (0, 1):
        assert f"rank {rank} (local {rank} of 2): cpu, " in text and "CPU threads" in text, text


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


def test_cpu_has_no_datasheet_peak_and_mfu_without_a_peak_is_nan():
    import math
    assert metrics.datasheet_peak_flops(torch.device("cpu"), torch.float32) is None
    assert math.isnan(metrics.mfu(1e6, 1e3, None, 1))
    assert metrics.mfu(1e6, 1e3, 1e10, 2) == pytest.approx(0.05)


def test_progress_line_labels_both_mfus(caplog):
    import logging
    log = MetricsLog(None, enabled=True, total_steps=10)
    log.interactive = False
    with caplog.at_level(logging.INFO, logger="mingpt_ddp.train"):
        log.write({"step": 1, "epoch": 0, "train_loss": 2.0, "lr": 1e-3, "tokens_per_s": 1000.0, "mfu": 0.45,
                   "mfu_datasheet": 0.38, "includes_compile": True})
    assert "(includes compiling) | MFU 45.0% of measured peak, 38.0% of datasheet peak" in caplog.text


# ---- the bench: train timing, comm data, agreeing to stop waiting (issue 11 item 6) ------------
def test_bench_train_keeps_epoch_end_evaluations_out_of_the_timed_steps(tmp_path, shakespeare, monkeypatch):
    """Few steps per epoch, so epoch ends fall among the timed steps. A fake clock: each
    optimizer step takes 1 s, each evaluation 100 s; ms/step must read 1000."""
    import types

    from mingpt_ddp import bench
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


def test_comm_iterations_are_at_least_nccl_tests_default():
    from mingpt_ddp import bench
    assert [bench.comm_iters(s) for s in (8, 1 << 20, 64 << 20, 256 << 20)] == [100, 50, 20, 20]


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
    from mingpt_ddp import bench, distributed
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


def test_wait_until_quiet_ends_on_the_same_round_on_every_rank(tmp_path):
    script = tmp_path / "skew.py"
    script.write_text(SKEWED_CLOCK)
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=150)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "rank 0 left the wait" in text and "rank 1 left the wait" in text, text


# ---- finding 9: snapshots streamed to the file, host buffers reused ------------------------------
def sample_state():
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(64, 32), "b": torch.zeros(32)}, "optimizer": {"state": {0: {
        "step": torch.tensor(3.0), "exp_avg": torch.randn(64, 32)}}, "param_groups": [{"lr": 1e-3}]},
        "train_state": {"step": 7}, "rng": [torch.get_rng_state()], "vocab": list("abc")}


def test_a_streamed_snapshot_is_the_encoded_snapshot_and_old_headers_still_load(tmp_path):
    import hashlib
    import io

    from mingpt_ddp.snapshot import SnapshotStore, decode, encode, header_step

    state = sample_state()
    store = SnapshotStore(str(tmp_path / "snapshot.pt"))
    store.save(state, 7)  # a state dict: streamed into the file
    streamed = (tmp_path / "snapshot.step000000007.pt").read_bytes()
    assert streamed == encode(state, 7)
    assert header_step(streamed[:256]) == 7
    loaded = decode(streamed)
    torch.testing.assert_close(loaded["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert store.load_latest()[0]["train_state"] == {"step": 7}
    # a snapshot written before the fixed-width header still loads
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    old = b"MINGPT-DDP-SNAPSHOT 1 step=7 bytes=%d sha256=%s\n" % (len(payload), hashlib.sha256(payload).hexdigest().encode())
    assert decode(old + payload)["train_state"] == {"step": 7}


def test_a_stream_that_fails_leaves_the_previous_snapshot_and_no_temp_file(tmp_path):
    from mingpt_ddp.snapshot import BackgroundSaver, SnapshotStore

    store = SnapshotStore(str(tmp_path / "snapshot.pt"))
    saver = BackgroundSaver(store, retry_minutes=0.01)
    saver.submit(sample_state(), 1)
    assert saver.wait() is None
    before = (tmp_path / "snapshot.pt").read_bytes()
    broken = {**sample_state(), "not_a_tensor": lambda: None}  # torch.save cannot pickle it mid-stream
    saver.submit(broken, 2)
    with pytest.raises(RuntimeError, match="encoding a snapshot"):
        saver.wait()
    assert (tmp_path / "snapshot.pt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snapshot.pt", "snapshot.step000000001.pt"]


def test_copies_to_host_memory_are_deep_on_cpu():
    from mingpt_ddp.snapshot import to_cpu

    state = sample_state()
    pinned = {}
    copy = to_cpu(state, pinned)
    state["model"]["w"].add_(1.0)  # training goes on changing the live tensors
    assert not torch.equal(copy["model"]["w"], state["model"]["w"])
    assert copy["optimizer"]["param_groups"] == [{"lr": 1e-3}] and copy["vocab"] == list("abc")
    assert pinned == {}  # host buffers are kept for GPU tensors only


def test_a_state_saved_to_an_object_store_goes_as_one_object(moto_s3):
    """S3 cannot patch a header after the payload: the state is encoded to bytes and PUT whole."""
    import uuid

    from conftest import s3_options
    from mingpt_ddp.snapshot import BackgroundSaver, SnapshotStore, encode

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    moto_s3.make_bucket(bucket)
    store = SnapshotStore(f"s3://{bucket}/run/snapshot.pt", storage_options=s3_options(moto_s3))
    saver = BackgroundSaver(store, retry_minutes=0.5)
    saver.submit(sample_state(), 7)
    assert saver.wait() is None
    assert store.fs.cat_file(store.step_path(7)) == encode(sample_state(), 7)
    assert store.load_latest()[0]["train_state"] == {"step": 7}


# ---- issue 23 item 13: smaller GPU settings ------------------------------------------------------
def test_gpt2_preset_trains_without_dropout_as_its_throughput_runs_do():
    from omegaconf import OmegaConf

    assert OmegaConf.load(REPO / "conf" / "model" / "gpt2.yaml").dropout == 0.0


def test_the_peak_probe_gives_its_gpu_memory_back(monkeypatch):
    """Only rank 0 measures: what the probe's matrices leave in the caching allocator would
    be ~0.9 GB that rank 0 alone lacks all run."""
    events = []
    monkeypatch.setattr(metrics, "matmul_flops", lambda device, dtype, n, seconds, *rows: events.append(("probe", n)) or 1e12)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append(("empty_cache",)))
    metrics._PEAK_CACHE.pop(("cuda:0", torch.bfloat16, torch.get_num_threads(), False, ()), None)
    assert metrics.measured_peak_flops(torch.device("cuda", 0), torch.bfloat16) == 1e12
    assert events[-1] == ("empty_cache",) and [e for e in events if e[0] == "probe"]
    events.clear()
    metrics.measured_peak_flops(torch.device("cpu"), torch.float32)
    assert ("empty_cache",) not in events


@pytest.mark.parametrize("value, device, minutes", [
    (None, "cuda", config.GPU_SNAPSHOT_EVERY_MINUTES), (None, "cpu", None), (0, "cuda", None), (0.0, "cpu", None),
    (5, "cuda", 5.0), (2.5, "cpu", 2.5),
])
def test_time_based_snapshots_default_on_gpus_only(value, device, minutes):
    assert config.snapshot_every_minutes(trainer_cfg(snapshot_every_minutes=value), device) == minutes


def test_a_negative_snapshot_interval_is_refused(tmp_path, small_corpus):
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path / 'run'}", f"data.path={small_corpus}",
                    "trainer.snapshot_every_minutes=-1"], timeout=120)
    assert proc.returncode == 2 and "trainer.snapshot_every_minutes=-1.0 must be >= 0" in output(proc), output(proc)
