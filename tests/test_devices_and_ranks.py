"""How a rank finds its device, process group, collective timeout, rendezvous host, CPU threads and
GPU-only defaults, tested on CPU: patched device counts, names and capabilities, Slurm
environments, and real torchrun workers with gloo where processes have to take part."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import MAIN, REPO, TINY, TORCHRUN, output, run_cli
from mingpt_ddp import config, distributed, metrics, precision
from mingpt_ddp.errors import ConfigError


# ---- finding 1: the device of a rank -----------------------------------------------------
@pytest.mark.dist
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


def gpu_listing(root, count):
    """A fake of the NVIDIA driver's list of the node's GPUs (/proc/driver/nvidia/gpus)."""
    root.mkdir()
    for i in range(count):
        (root / f"0000:{i + 0x18:02x}:00.0").mkdir()
    return str(root)


@pytest.mark.unit
def test_a_node_with_gpus_that_torch_cannot_use_is_refused_unless_cpu_was_asked_for(tmp_path):
    """This venv's torch is built without CUDA: on a node whose driver lists GPUs it must not
    train on CPU without a word (it would be gpt2 on CPUs, or gloo beside other nodes' NCCL)."""
    listed = {"GPU_INVENTORY": gpu_listing(tmp_path / "gpus", 2), "SLURMD_NODENAME": "gpu-7"}
    with pytest.raises(ConfigError, match=r"^node gpu-7 has 2 GPU\(s\) but torch sees none: this torch \(\S+\) is "
                                          r"built without CUDA: install a CUDA build.*trainer.device=cpu"):
        distributed.pick_device(0, 1, "auto", listed)
    for asked in ({"device": "cpu", "env": listed},  # trainer.device=cpu
                  {"device": "auto", "env": {**listed, "CUDA_VISIBLE_DEVICES": ""}},  # multinode.sh DEVICE=cpu
                  {"device": "auto", "env": {"GPU_INVENTORY": str(tmp_path / "none")}}):  # a node without GPUs
        assert distributed.pick_device(0, 1, **asked) == (torch.device("cpu"), "gloo"), asked
    with pytest.raises(ConfigError, match="trainer.device=cuda but torch on .* sees no GPU"):
        distributed.pick_device(0, 1, "cuda", {"GPU_INVENTORY": str(tmp_path / "none")})


@pytest.mark.unit
@pytest.mark.parametrize("cuda, init_error, visible, cause", [
    (None, "Torch not compiled with CUDA enabled", None, "this torch (2.13.0+cpu) is built without CUDA"),
    ("13.0", "The NVIDIA driver on your system is too old (found version 12080). Please update", None,
     "the NVIDIA driver is older than this torch's CUDA 13.0 needs (The NVIDIA driver on your system is too old "
     "(found version 12080)): install a torch built for the driver's CUDA"),
    ("12.8", "Found no NVIDIA driver on your system. Please check", None,
     "this process has no NVIDIA driver library (Found no NVIDIA driver on your system): the container was started "
     "without GPUs (docker run --gpus all"),
    ("12.8", "No CUDA GPUs are available", None,
     "CUDA 12.8 cannot use them (No CUDA GPUs are available): this job or container was given none of them (Slurm: "
     "--gpus-per-node=8"),
    ("12.8", "No CUDA GPUs are available", "NoDevFiles", "CUDA_VISIBLE_DEVICES=NoDevFiles names none of them, or"),
])
def test_the_refusal_names_the_likely_cause(cuda, init_error, visible, cause):
    """torch's own reasons (c10/cuda/CUDAFunctions.cpp), turned into a cause and its fix."""
    assert cause in distributed.why_no_gpu(8, "2.13.0+cpu", cuda, init_error, visible)


@pytest.mark.unit
def test_two_ranks_on_one_gpu_are_found_by_the_gpu_itself(monkeypatch):
    """`torchrun --nproc_per_node=2` on a one-GPU host put both ranks on cuda:0, which NCCL
    refuses (ncclInvalidUsage), reworded as a lost node. Not judged from counts (a wrapper may
    give each worker its own CUDA_VISIBLE_DEVICES, srun's per-task GPUs are each cuda:0): each
    rank names its GPU (UUID and PCI address, on the host) and agree_on_device refuses two ranks
    on one (test below). ROCm's GPUs without a unique id share the UUID "GPU-XX": the PCI
    address tells them apart. NCCL_MULTI_RANK_GPU_ENABLE=1 lets NCCL share a GPU: no identity.
    trainer.device=cuda with CUDA_VISIBLE_DEVICES= is refused, not CPU (review)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert distributed.pick_device(1, 2, "auto", {"TORCHELASTIC_RUN_ID": "x"}) == (torch.device("cuda", 0), "nccl")
    assert distributed.pick_device(1, 2, "cpu", {}) == (torch.device("cpu"), "gloo")

    class Props:
        uuid, pci_domain_id, pci_device_id = "GPU-XX", 0, 0

        def __init__(self, bus):
            self.pci_bus_id = bus

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props(0x1A + d.index))
    monkeypatch.setenv("NCCL_HOSTID", "h0")
    a, b = distributed._gpu_identity(torch.device("cuda", 0)), distributed._gpu_identity(torch.device("cuda", 1))
    assert a != b and a == distributed._gpu_identity(torch.device("cuda", 0)), (a, b)
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    assert distributed._gpu_identity(torch.device("cuda", 0)) is None

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.cpu_asked_for("auto", {"CUDA_VISIBLE_DEVICES": ""})
    assert not distributed.cpu_asked_for("cuda", {"CUDA_VISIBLE_DEVICES": ""})
    with pytest.raises(ConfigError, match="trainer.device=cuda but torch on"):
        distributed.pick_device(0, 1, "cuda", {"CUDA_VISIBLE_DEVICES": "-1"})


@pytest.mark.unit
def test_preflight_fails_a_node_whose_gpus_torch_cannot_use(tmp_path, monkeypatch):
    """Pre-flight compared only nodes that see GPUs: a job of such nodes passed, to train on CPUs."""
    from mingpt_ddp.tools import preflight

    monkeypatch.setenv("GPU_INVENTORY", gpu_listing(tmp_path / "gpus", 8))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    broken = preflight.node_facts(1, {})
    assert broken["gpus"] == 0 and "has 8 GPU(s) but torch sees none: this torch" in broken["gpu_problem"], broken
    healthy = {**broken, "host": "n0", "gpu_problem": None}
    assert preflight.check_nodes([healthy, healthy]) is None
    assert preflight.check_nodes([healthy, broken]) == broken["gpu_problem"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # launch/multinode.sh DEVICE=cpu
    assert preflight.node_facts(1, {})["gpu_problem"] is None


RANK_1_ON_A_GPU_NODE = textwrap.dedent("""
    import os, sys
    if os.environ["RANK"] == "1":  # this rank's node lists GPUs (a fake of the driver's list)
        os.environ["GPU_INVENTORY"] = sys.argv[1]
    os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
""")


@pytest.mark.dist
def test_a_rank_on_a_node_whose_gpus_torch_cannot_use_stops_every_rank_in_one_line(tmp_path, small_corpus):
    """Rank 1's node lists 2 GPUs that this (CPU-only) torch cannot use; rank 0's lists none.
    Before, both trained on CPU without a word (on real nodes: gloo beside NCCL, a hang until
    the timeout, reported as a lost peer and requeued). Now every rank stops at once, one line
    naming the rank, node and cause, exit 2 (a ConfigError: never requeued)."""
    wrapper = tmp_path / "rank_1_on_a_gpu_node.py"
    wrapper.write_text(RANK_1_ON_A_GPU_NODE)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "mingpt_ddp.torchrun", "--standalone", "--nproc_per_node=2", "--max-restarts=0",
         str(wrapper), gpu_listing(tmp_path / "gpus", 2), MAIN, *TINY, f"hydra.run.dir={tmp_path / 'run'}",
         f"data.path={small_corpus}", "trainer.max_steps=2"],
        cwd=REPO, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    text = output(proc)
    lines = [line for line in text.splitlines() if line.startswith(("error:", "[rank 1] error:"))]
    assert proc.returncode == 2 and "Traceback" not in text and "done:" not in text, text
    assert len(lines) == 1 and re.match(r"(\[rank 1\] )?error: on rank\(s\) 1 of 2: node \S+ has 2 GPU\(s\) but torch "
                                        r"sees none: this torch \(\S+\) is built without CUDA", lines[0]), text
    assert time.monotonic() - start < 60


def agree(votes):
    """agree_on_device on one real store, each vote (backend, problem, gpu) a rank in its thread;
    what each rank raised, or None."""
    import threading

    store, raised = torch.distributed.HashStore(), [None] * len(votes)

    def rank(r, backend, problem, gpu):
        try:
            distributed.agree_on_device(store, r, len(votes), backend, problem, gpu, f"rank {r} on n{r // 2}", 30)
        except Exception as exc:  # noqa: BLE001
            raised[r] = exc

    threads = [threading.Thread(target=rank, args=(r, *vote)) for r, vote in enumerate(votes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return raised


@pytest.mark.unit
def test_the_ranks_agree_on_their_devices_before_the_process_group():
    """Every rank raises the same ConfigError (no rank waits for the others until the timeout,
    then reports a lost peer): a rank that could not take its device, CPU ranks beside GPU
    ranks (gloo and NCCL cannot form one group), two ranks of one host on one GPU."""
    assert agree([("nccl", None, "h0/GPU-a"), ("nccl", None, "h0/GPU-b"), ("nccl", None, "h1/GPU-a")]) == [None] * 3
    assert agree([("gloo", None, None)] * 2) == [None] * 2

    raised = agree([("nccl", None, "h0/GPU-a"), ("", "node n0 has 8 GPU(s) but torch sees none: x", None),
                    ("nccl", None, "h1/GPU-a")])
    assert all(isinstance(e, ConfigError) for e in raised), raised
    assert {str(e) for e in raised} == {"on rank(s) 1 of 3: node n0 has 8 GPU(s) but torch sees none: x"}

    raised = agree([("nccl", None, "h0/GPU-a"), ("nccl", None, "h0/GPU-b"), ("gloo", None, None), ("gloo", None, None)])
    assert all(isinstance(e, ConfigError) for e in raised) and len({str(e) for e in raised}) == 1, raised
    assert str(raised[0]).startswith("the ranks disagree on their device: 2 would train on CPU with gloo (first: rank "), raised

    raised = agree([("nccl", None, "h0/GPU-a"), ("nccl", None, "h0/GPU-a")])
    assert all(isinstance(e, ConfigError) for e in raised) and len({str(e) for e in raised}) == 1, raised
    assert "uses the same GPU as rank" in str(raised[0]) and "ncclInvalidUsage" in str(raised[0]), raised


NCCL_ERROR = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, {what}, NCCL version "
              "2.27.5\n{code}: {detail}\nLast error:\n{last}")


@pytest.mark.unit
def test_an_nccl_usage_error_is_a_config_error_not_a_lost_peer():
    """The text of torch's DistBackendError (NCCLUtils.hpp C10D_NCCL_CHECK, getNcclErrorDetailStr):
    two ranks on one GPU was reworded as "a node left the job", exit 3, and requeued."""
    duplicate = torch.distributed.DistBackendError(NCCL_ERROR.format(
        what="invalid usage (run with NCCL_DEBUG=WARN for details)", code="ncclInvalidUsage",
        detail="This usually reflects invalid usage of NCCL library.",
        last="Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000"))
    assert distributed.communication_failure(duplicate) is None
    assert distributed.nccl_refused(duplicate).startswith(
        "NCCL refused this job's setup (ncclInvalidUsage: Duplicate GPU detected : rank 1 and rank 0 both on CUDA "
        "device 1a000): two ranks on one GPU")
    cuda = torch.distributed.DistBackendError(NCCL_ERROR.format(
        what="unhandled cuda error", code="ncclUnhandledCudaError", detail="Call to CUDA function failed.",
        last="Cuda failure 'out of memory'"))
    assert distributed.communication_failure(cuda) is None and distributed.nccl_refused(cuda) is None  # a traceback
    remote = torch.distributed.DistBackendError(NCCL_ERROR.format(
        what="remote process exited or there was a network error", code="ncclRemoteError",
        detail="A call failed possibly due to a network error or a remote process exiting prematurely.",
        last="socketProgress: Connection closed by remote peer"))
    assert distributed.nccl_refused(remote) is None
    assert distributed.communication_failure(remote).startswith("lost contact with the other ranks: NCCL error in")


@pytest.mark.unit
def test_process_group_is_bound_to_the_gpu_only_on_cuda():
    cuda = torch.device("cuda", 2)
    assert distributed.process_group_options(cuda) == {"device_id": cuda}
    assert distributed.process_group_options(torch.device("cpu")) == {}


@pytest.mark.dist
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


@pytest.mark.dist
def test_an_error_every_rank_hits_is_printed_once(tmp_path, small_corpus):
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path / 'run'}", f"data.path={small_corpus}", "data.block_size=5000"],
                   nproc=2, timeout=120)
    text = output(proc)
    assert proc.returncode != 0
    assert text.count("error: data.block_size=5000 is larger than the validation split") == 1, text
    assert "[rank 1] error" not in text, text  # rank 0 speaks for an error it hit too


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.cli
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


@pytest.mark.dist
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


@pytest.mark.unit
def test_bf16_is_refused_on_a_gpu_that_only_emulates_it(fake_gpu):
    fake_gpu((7, 0))
    with pytest.raises(ConfigError, match=r"Tesla V100-SXM2-32GB \(sm_70\) only emulates bf16.*trainer.precision=fp16"):
        precision.resolve("bf16", torch.device("cuda", 0))
    assert precision.resolve("auto", torch.device("cuda", 0)).name == "fp16"


@pytest.mark.unit
def test_bf16_is_accepted_on_ampere_and_newer(fake_gpu):
    fake_gpu((9, 0), "NVIDIA H100 80GB HBM3")
    assert precision.resolve("bf16", torch.device("cuda", 0)).name == "bf16"
    assert precision.resolve("auto", torch.device("cuda", 0)).name == "bf16"


# ---- finding 11: the rendezvous host under plain srun ----------------------------------------
@pytest.mark.unit
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


@pytest.mark.unit
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
@pytest.mark.dist
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


@pytest.mark.dist
def test_each_process_logs_its_thread_count(tmp_path, small_corpus):
    """trainer.cpu_threads reaches torchrun's workers (which torchrun gives OMP_NUM_THREADS=1)."""
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path / 'run'}", f"data.path={small_corpus}", "trainer.max_steps=1",
                    "trainer.cpu_threads=3"], nproc=2, timeout=180)
    text = output(proc)
    assert proc.returncode == 0, text
    for rank in (0, 1):
        assert f"rank {rank} (local {rank} of 2): cpu, 3 CPU threads" in text, text


# ---- issue 32 item 5: one setting for the threads of a run ----------------------------------------
@pytest.mark.unit
def test_cpu_threads_setting_per_process_and_its_default(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    torchrun = {"TORCHELASTIC_RUN_ID": "x"}
    assert distributed.cpu_threads(None, 2, torchrun) == 4  # the default: this process's share
    assert distributed.cpu_threads(3, 2, torchrun) == 3  # per process, whatever the local ranks
    for bad in (0, -2, "four"):
        with pytest.raises(ConfigError, match=r"trainer.cpu_threads=.* 1 or more: e.g. trainer.cpu_threads=4"):
            distributed.cpu_threads(bad, 2, torchrun)
    assert config.TrainerConfig().cpu_threads is None


@pytest.mark.unit
def test_the_corpus_encoding_uses_the_cores_the_nodes_processes_may_use(monkeypatch):
    """One process per node encodes while the node's others wait: it may use their threads,
    never more than its own cores; without trainer.cpu_threads its affinity, not the machine."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    torchrun = {"TORCHELASTIC_RUN_ID": "x"}
    assert distributed.encode_threads(None, 2, torchrun) == 8  # this process's affinity, not os.cpu_count()
    assert distributed.encode_threads(3, 2, torchrun) == 6  # 3 per process x the 2 processes of the node
    assert distributed.encode_threads(3, 1, torchrun) == 3  # the prepare tool: one process
    assert distributed.encode_threads(5, 2, torchrun) == 8  # at most its cores
    with pytest.raises(ConfigError, match=r"^trainer.cpu_threads=0 must be"):
        distributed.encode_threads(0, 2, torchrun)


# ---- issue 32 item 3: no allocator churn on CPU ------------------------------------------------------
FRESH_PROCESS = """
import resource, torch
from mingpt_ddp import distributed
env = distributed.setup(device="cpu", threads={threads})
def faults_per_page(mib, n=6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        torch.ones(mib << 18)  # a step's logits: mib MiB written, then freed
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (n * mib * 256)
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
faults, threads, interop = faults_per_page(48), torch.get_num_threads(), torch.get_num_interop_threads()
distributed.setup(device="cpu", threads=2)  # a sweep's next point: its own trainer.cpu_threads
next_point = torch.get_num_threads()
torch.ones(256 << 18)  # 256 MiB freed: kept on the heap ...
kept = rss_mib()
distributed.release_cached_memory()  # ... until the sweep's next point
print(faults, threads, interop, next_point, round(kept - rss_mib()))
"""


@pytest.mark.unit
@pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"), reason="glibc's malloc")
def test_a_cpu_process_reuses_the_memory_of_large_tensors():
    """glibc mapped each block over 32 MiB afresh and unmapped it at free: every page of a step's
    logits faulted (zeroed by the kernel) every step. Set up for CPU, a process keeps them: the
    first pass faults, the others reuse; between a sweep's points the heap is given back. Also
    trainer.cpu_threads sizes both thread pools, for each point of a sweep."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD", "RANK", "WORLD_SIZE",
                                                             *distributed.USERS_MALLOC_ENV)}
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS.format(threads=1)], capture_output=True, text=True,
                          timeout=60, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    faults, threads, interop, next_point, trimmed_mib = proc.stdout.split()
    assert float(faults) < 0.4, proc.stdout  # 1.0 (every page, every time) before
    assert (threads, interop, next_point) == ("1", "1", "2"), proc.stdout  # the sweep's next point kept 1 before
    assert int(trimmed_mib) > 200, proc.stdout  # the 256 MiB block stayed resident for the rest of a sweep


@pytest.mark.unit
def test_a_gpu_sweeps_point_without_cpu_threads_gets_torchs_own_count_back(monkeypatch):
    """On GPUs null means torch's own count: a sweep's later point kept the previous point's setting."""
    gpu = distributed.DistEnv(0, 0, 1, 1, torch.device("cuda", 0), "nccl")
    monkeypatch.setattr(distributed, "_current", gpu)
    monkeypatch.setattr(distributed, "_torch_threads", 2)
    threads = torch.get_num_threads()
    try:
        distributed.setup(threads=1)  # a point with trainer.cpu_threads=1
        assert torch.get_num_threads() == 1
        distributed.setup(threads=None)  # the next point, null
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.unit
def test_malloc_settings_the_user_chose_are_left_alone():
    for env in ({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=65536"}, {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"},
                {"MALLOC_TRIM_THRESHOLD_": "131072"}, {"MALLOC_MMAP_THRESHOLD_": "65536"}):
        assert distributed._set_malloc_options(env) is False


@pytest.mark.unit
@pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"), reason="glibc's malloc")
def test_the_benchs_before_case_is_glibcs_adaptive_default():
    """bench alloc's "before" names a tunable so the run leaves malloc alone; it must not be one
    of mmap_max/mmap_threshold/trim_threshold/top_pad, which freeze the mmap threshold at 128 KiB
    (every 1 MiB block mapped afresh: 33x the page faults of glibc's real default)."""
    from mingpt_ddp.tools import bench
    script = """
import ctypes, resource
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    p = libc.malloc(1 << 20); ctypes.memset(p, 1, 1 << 20); libc.free(p)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    faults = {}
    for name, tunables in (("glibc", None), ("bench", bench.GLIBC_DEFAULT_MALLOC)):
        env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", *distributed.USERS_MALLOC_ENV)}
        if tunables:
            env["GLIBC_TUNABLES"] = tunables
        faults[name] = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                                          env=env, check=True).stdout)
    assert distributed._set_malloc_options({"GLIBC_TUNABLES": bench.GLIBC_DEFAULT_MALLOC}) is False
    assert faults["bench"] < 2 * faults["glibc"] + 100, faults  # the frozen threshold: 256 faults per block


# ---- issue 23 item 13: smaller GPU settings ------------------------------------------------------
@pytest.mark.unit
def test_gpt2_preset_trains_without_dropout_as_its_throughput_runs_do():
    from omegaconf import OmegaConf

    assert OmegaConf.load(REPO / "conf" / "model" / "gpt2.yaml").dropout == 0.0


@pytest.mark.unit
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


@pytest.mark.unit
@pytest.mark.parametrize("value, device, minutes", [
    (None, "cuda", config.GPU_SNAPSHOT_EVERY_MINUTES), (None, "cpu", 10.0), (0, "cuda", None), (0.0, "cpu", None),
    (5, "cuda", 5.0), (2.5, "cpu", 2.5),
])
def test_time_based_snapshots_by_default_on_gpus_and_cpus(value, device, minutes):
    assert config.snapshot_every_minutes(trainer_cfg(snapshot_every_minutes=value), device) == minutes


@pytest.mark.cli
def test_a_negative_snapshot_interval_is_refused(tmp_path, small_corpus):
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path / 'run'}", f"data.path={small_corpus}",
                    "trainer.snapshot_every_minutes=-1"], timeout=120)
    assert proc.returncode == 2 and "trainer.snapshot_every_minutes=-1.0 must be >= 0" in output(proc), output(proc)
