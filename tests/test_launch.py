"""Launching on clusters as ParallelCluster and HyperPod users do, without a Slurm cluster:
a Python without this package (a mounted checkout in a container image), a missing
dependency, torch elastic's error record, EFA settings, and train.sbatch's decisions (Pyxis,
HyperPod, srun options, flight recorder) with fake `srun`/`fi_info`/`sinfo` on PATH. The
checks on the real two-node Slurm cluster are in tests/test_slurm.py."""
from __future__ import annotations

import os
import re
import socket
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import MAIN, REPO, TINY, output

MULTINODE = REPO / "launch" / "multinode.sh"
SBATCH_SCRIPT = REPO / "launch" / "train.sbatch"
SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**settings: str) -> dict:
    """No Slurm, no torchrun, no PYTHONPATH (which would import this checkout some other way)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "FI_", "EFA", "PREFLIGHT", "TORCH_FR", "TORCH_NCCL"))
           and k not in ("PYTHONPATH", "EC2_INSTANCE_TYPE", "HYPERPOD_MARKER", "SRUN_ARGS", "CONTAINER_IMAGE")}
    env.update(PYTHONUNBUFFERED="1", **settings)
    return env


def venv_without_package(root: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """A Python environment with this venv's third-party packages (torch, hydra-core,
    omegaconf, fsspec, ...) but not this package: a plain venv whose .pth names a directory of
    links to the packages, without the editable install's finder (and without `leave_out`)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, capture_output=True)
    shelf = root / "shelf"
    shelf.mkdir()
    for entry in SITE_PACKAGES.iterdir():
        name = entry.name.lower()
        if "mingpt" in name or name.endswith(".pth") or name.startswith(leave_out):
            continue
        (shelf / entry.name).symlink_to(entry)
    site = Path(subprocess.run([str(root / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "shelf.pth").write_text(f"{shelf}\n")
    return root / "bin" / "python"


def fake_command(bin_dir: Path, name: str, script: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/usr/bin/env bash\n" + script)
    (bin_dir / name).chmod(0o755)


# ---- a checkout without the package installed -------------------------------------------------
@pytest.mark.cli
def test_multinode_runs_a_checkout_with_a_python_that_lacks_the_package(tmp_path, small_corpus):
    """PYTHON= an environment with torch, hydra-core, omegaconf and fsspec but without this
    package (as a container image with the checkout mounted, or a conda env): multinode.sh
    trains with 2 workers, main.py importing the package from the checkout it lives in."""
    python = venv_without_package(tmp_path / "env")
    probe = subprocess.run([str(python), "-c", "import torch, hydra, omegaconf, fsspec; import mingpt_ddp"],
                           cwd=tmp_path, capture_output=True, text=True, env=clean_env())
    assert "No module named 'mingpt_ddp'" in probe.stderr, output(probe)  # the dependencies are there, the package is not

    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [str(MULTINODE), *TINY, f"data.path={small_corpus}", "trainer.max_steps=6", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env=clean_env(PYTHON=str(python), NPROC_PER_NODE="2", RDZV_PORT=str(free_port()), MAX_RESTARTS="0"),
    )
    out = output(proc)
    assert proc.returncode == 0, out
    assert f"python={python}" in out and "on 2 process(es)" in out and "done: step 6" in out, out
    assert (run_dir / "snapshot.pt").exists()


@pytest.mark.dist
def test_missing_dependency_is_one_line_from_one_rank(tmp_path, small_corpus):
    """hydra-core missing from the environment: under torchrun with 2 workers, one `error:`
    line naming the package and the pip command for this interpreter, exit code 2, no
    ImportError traceback from the workers."""
    python = venv_without_package(tmp_path / "env", leave_out=("hydra",))
    proc = subprocess.run(
        [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", MAIN, *TINY,
         f"data.path={small_corpus}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, env=clean_env(),
    )
    out = output(proc)
    assert proc.returncode != 0, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out
    assert "hydra-core" in errors[0] and f"{python} -m pip install 'hydra-core>=1.3'" in errors[0], errors
    assert "ModuleNotFoundError" not in out and "exitcode  : 2" in out, out


# ---- torch elastic's error record ---------------------------------------------------------------
BUG_ON_RANK_1 = '''
import importlib.abc, importlib.util, os, sys
class _InjectBug(importlib.abc.MetaPathFinder):
    """Make Trainer.fit raise on rank 1: a bug, not a user error."""
    def find_spec(self, name, path, target=None):
        if name != "mingpt_ddp.trainer" or os.environ.get("RANK") != "1":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            def fit(self):
                raise RuntimeError("injected bug on rank 1")
            module.Trainer.fit = fit
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _InjectBug())
'''


@pytest.mark.dist
def test_a_bug_reaches_torchruns_failure_summary_with_its_rank_and_traceback(tmp_path, small_corpus):
    """main is wrapped in torch elastic's @record: when rank 1 raises, torchrun's summary names
    rank 1 and shows the exception and its traceback (not "error_file: <N/A>"). The crash is
    recorded for train.sbatch (MINGPT_STEP_ERRORS/try-0/Crashed): requeued only after progress."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BUG_ON_RANK_1)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", MAIN, *TINY,
         f"data.path={small_corpus}", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env=clean_env(PYTHONPATH=f"{site}{os.pathsep}{REPO}", MINGPT_STEP_ERRORS=str(tmp_path / "records")),
    )
    out = output(proc)
    assert proc.returncode != 0, out
    assert (tmp_path / "records" / "try-0" / "Crashed").exists(), out
    summary = out[out.index("Root Cause"):] if "Root Cause" in out else out
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", summary), out
    assert "RuntimeError: injected bug on rank 1" in summary and "error_file: <N/A>" not in summary, out


# ---- EFA ------------------------------------------------------------------------------------------
def topology(tmp_path: Path, **settings: str) -> str:
    proc = subprocess.run([str(MULTINODE), "model=gpt-nano"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env=clean_env(DRY_RUN="1", **settings))
    assert proc.returncode == 0, output(proc)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("multinode: topology:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.cli
def test_efa_auto_on_off_and_user_values_kept(tmp_path):
    """EFA=auto turns on when `fi_info -p efa` finds a device, else stays off; EFA=1 forces it
    on, EFA=0 off. On: FI_PROVIDER=efa, and FI_EFA_USE_DEVICE_RDMA=1 only on instance types
    with RDMA read; a value the user exported is kept. The topology line says which."""
    with_efa, without_efa = tmp_path / "efa", tmp_path / "noefa"
    fake_command(with_efa, "fi_info", '[ "$*" = "-p efa" ] && echo "provider: efa" && exit 0\nexit 1\n')
    fake_command(without_efa, "fi_info", 'echo "fi_getinfo: -61 (No data available)" >&2\nexit 1\n')
    path = os.environ["PATH"]

    line = topology(tmp_path, PATH=f"{with_efa}:{path}", EC2_INSTANCE_TYPE="p5.48xlarge")
    assert "efa=on (auto: EFA devices found; FI_PROVIDER=efa set, FI_EFA_USE_DEVICE_RDMA=1 set" in line, line
    line = topology(tmp_path, PATH=f"{without_efa}:{path}", EC2_INSTANCE_TYPE="p5.48xlarge")
    assert "efa=off (auto: no EFA device)" in line and "FI_PROVIDER" not in line, line
    line = topology(tmp_path, PATH=f"{with_efa}:{path}", EFA="0")
    assert "efa=off (EFA=0)" in line, line
    line = topology(tmp_path, PATH=f"{without_efa}:{path}", EFA="1", EC2_INSTANCE_TYPE="g5.48xlarge")
    assert "FI_PROVIDER=efa set" in line and "FI_EFA_USE_DEVICE_RDMA left unset" in line, line
    line = topology(tmp_path, PATH=f"{with_efa}:{path}", FI_PROVIDER="tcp", FI_EFA_USE_DEVICE_RDMA="0",
                    EC2_INSTANCE_TYPE="p4d.24xlarge")
    assert "FI_PROVIDER=tcp kept" in line and "FI_EFA_USE_DEVICE_RDMA=0 kept" in line, line

    bad = subprocess.run([str(MULTINODE)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env=clean_env(DRY_RUN="1", EFA="yes"))
    assert bad.returncode == 1 and "EFA=yes" in bad.stderr, bad.stderr


@pytest.mark.dist
def test_efa_settings_reach_the_agent_environment(tmp_path):
    """What torchrun (and so every worker) inherits, seen by a stand-in PYTHON: the EFA
    variables set, the user's kept, and compile threads matching OMP_NUM_THREADS."""
    fake_bin = tmp_path / "bin"
    fake_command(fake_bin, "fi_info", "exit 0\n")
    fake_command(fake_bin, "python-env", 'env | grep -E "^(FI_|EFA=|TORCHINDUCTOR_COMPILE_THREADS|OMP_NUM_THREADS)" | sort\n')
    env = clean_env(PATH=f"{fake_bin}:{os.environ['PATH']}", PYTHON=str(fake_bin / "python-env"),
                    HEAD_NODE="127.0.0.1", IS_HEAD="1", FI_EFA_USE_DEVICE_RDMA="0", EC2_INSTANCE_TYPE="p4d.24xlarge",
                    NPROC_PER_NODE="2")
    env.pop("OMP_NUM_THREADS", None)
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    proc = subprocess.run([str(MULTINODE)], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, output(proc)
    seen = dict(line.split("=", 1) for line in proc.stdout.split())
    assert seen["FI_PROVIDER"] == "efa" and seen["FI_EFA_USE_DEVICE_RDMA"] == "0", seen
    assert seen["EFA"] == "1", seen  # resolved from auto: pre-flight expects EFA's transport
    assert seen["TORCHINDUCTOR_COMPILE_THREADS"] == seen["OMP_NUM_THREADS"], seen


@pytest.mark.dist
def test_preflight_commands(tmp_path):
    """PREFLIGHT=1: the checks run first, through torchrun with this node's topology, on their
    own rendezvous (id and port) and never restarted; then training. only: just the checks."""
    proc = subprocess.run([str(MULTINODE), "model=gpt-nano"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env=clean_env(DRY_RUN="1", PREFLIGHT="1", NPROC_PER_NODE="2", RDZV_PORT="31000",
                                                    RUN_ID="exp"))
    assert proc.returncode == 0, output(proc)
    check, train = proc.stdout.splitlines()
    for part in ("--nproc_per_node=2", "--rdzv_endpoint=127.0.0.1:31001", "--rdzv_id=exp-preflight",
                 "--max-restarts=0", "-m mingpt_ddp.preflight"):
        assert part in check, check
    assert "--rdzv_endpoint=127.0.0.1:31000" in train and "mingpt_ddp/main.py model=gpt-nano" in train, train
    only = subprocess.run([str(MULTINODE)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env=clean_env(DRY_RUN="1", PREFLIGHT="only"))
    assert only.stdout.count("\n") == 1 and "mingpt_ddp.preflight" in only.stdout, only.stdout


# ---- train.sbatch's decisions, with a fake srun ---------------------------------------------------
FAKE_SRUN = '''
if [ "$1" = --help ]; then
  echo "Usage: srun [OPTIONS(0)...]"
  [ -n "$FAKE_PYXIS" ] && echo "      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH"
  exit 0
fi
printf '%s\\n' "$@" > "$FAKE_SRUN_LOG"
env | grep -E '^(TORCH_(FR|NCCL)_|MINGPT_STEP_ERRORS=|PREFLIGHT=|MAX_RESTARTS=)' | sort >> "$FAKE_SRUN_LOG.env"
for error_class in ${FAKE_STEP_ERRORS:-}; do  # [try:]class: what a worker that ended with it records (errors.record)
  try=0; case "$error_class" in *:*) try=${error_class%%:*} error_class=${error_class#*:} ;; esac
  TORCHELASTIC_RESTART_COUNT=$try "$FAKE_PYTHON" -c "import sys; from mingpt_ddp import errors; errors.record_start(); errors.record(errors.by_name(sys.argv[1]), 'x')" "$error_class"
done
for try in ${FAKE_CRASHED_TRIES:-}; do  # a try in which a worker crashed (errors.record_crash)
  TORCHELASTIC_RESTART_COUNT=$try "$FAKE_PYTHON" -c "from mingpt_ddp import errors; errors.record_start(); errors.record_crash()"
done
for try in ${FAKE_TRIES_STARTED:-}; do  # a try of the step whose workers started (and recorded nothing)
  TORCHELASTIC_RESTART_COUNT=$try "$FAKE_PYTHON" -c "from mingpt_ddp import errors; errors.record_start()"
done
[ -n "${FAKE_SNAPSHOT_STEP:-}" ] && "$FAKE_PYTHON" -c "import sys; from mingpt_ddp import errors; errors.record_progress(int(sys.argv[1]))" "$FAKE_SNAPSHOT_STEP"
exit "${FAKE_SRUN_EXIT:-0}"
'''


def fake_sbatch_run(tmp_path: Path, *args: str, scontrol: str = "exit 1\n",
                    **settings: str) -> tuple[subprocess.CompletedProcess, list[str], str]:
    """train.sbatch run as Slurm would (its environment), with a fake srun (exiting with
    FAKE_SRUN_EXIT) and `scontrol` on PATH: (result, srun's arguments or [] when not called,
    the step's TORCH_* environment)."""
    fake_bin = tmp_path / "bin"
    fake_command(fake_bin, "srun", FAKE_SRUN)
    fake_command(fake_bin, "scontrol", scontrol)
    log = tmp_path / "srun.args"
    for stale in (log, Path(f"{log}.env")):
        stale.unlink(missing_ok=True)
    (tmp_path / "submit").mkdir(exist_ok=True)  # the job's records go under it (.mingpt-step/)
    env = clean_env(**{"PATH": f"{fake_bin}:{os.environ['PATH']}", "FAKE_SRUN_LOG": str(log), "SLURM_JOB_ID": "777",
                       "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]",
                       "SLURM_SUBMIT_DIR": str(tmp_path / "submit"), "FAKE_PYTHON": sys.executable,
                       "REPO_DIR": str(REPO), "HYPERPOD_MARKER": str(tmp_path / "no-such-dir"), **settings})
    proc = subprocess.run(["bash", str(SBATCH_SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env=env)
    srun_args = log.read_text().splitlines() if log.exists() else []
    step_env = Path(f"{log}.env").read_text() if Path(f"{log}.env").exists() else ""
    return proc, srun_args, step_env


@pytest.mark.cli
def test_sbatch_stops_when_pyxis_is_absent(tmp_path):
    """CONTAINER_IMAGE set but srun has no --container-image (Pyxis not in the compute nodes'
    plugstack.conf): one message saying what to check, no step started."""
    proc, srun_args, _ = fake_sbatch_run(tmp_path, "model=gpt-nano", CONTAINER_IMAGE="/fsx/apps/mingpt-ddp.sqsh")
    out = output(proc)
    assert proc.returncode == 1 and srun_args == [], out
    assert "no --container-image option" in out and "plugstack.conf" in out and "Pyxis" in out, out

    proc, srun_args, _ = fake_sbatch_run(tmp_path, "model=gpt-nano", CONTAINER_IMAGE="/fsx/apps/mingpt-ddp.sqsh",
                                         CONTAINER_MOUNTS="/fsx:/fsx", FAKE_PYXIS="1")
    assert proc.returncode == 0, output(proc)
    assert "--container-image=/fsx/apps/mingpt-ddp.sqsh" in srun_args, srun_args
    assert f"--container-mounts={REPO}:{REPO},/fsx:/fsx" in srun_args, srun_args
    assert "--container-name=mingpt-777" in srun_args, srun_args  # steps of the job reuse it (Pyxis)


@pytest.mark.cli
def test_sbatch_hyperpod_auto_resume_and_srun_args(tmp_path):
    """Where /opt/sagemaker_cluster exists (HYPERPOD_MARKER here), srun gets --auto-resume=1 and
    the log says so; elsewhere it does not. SRUN_ARGS adds options; --kill-on-bad-exit=1 always."""
    marker = tmp_path / "sagemaker_cluster"
    marker.mkdir()
    proc, srun_args, _ = fake_sbatch_run(tmp_path, "model=gpt-nano", HYPERPOD_MARKER=str(marker),
                                         SRUN_ARGS="--cpu-bind=none --mpi=none")
    out = output(proc)
    assert proc.returncode == 0, out
    assert "--auto-resume=1" in srun_args and "HyperPod" in out and "--auto-resume=1" in out, out
    assert {"--kill-on-bad-exit=1", "--cpu-bind=none", "--mpi=none"} <= set(srun_args), srun_args
    assert srun_args[-2:] == ["launch/multinode.sh", "model=gpt-nano"], srun_args

    proc, srun_args, _ = fake_sbatch_run(tmp_path, "model=gpt-nano")
    assert proc.returncode == 0 and "--auto-resume=1" not in srun_args and "HyperPod" not in output(proc)


@pytest.mark.cli
def test_sbatch_flight_recorder_dumps_into_the_run_directory(tmp_path):
    """The step runs with the NCCL flight recorder on (trace buffer, dump on timeout) dumping
    into the run directory (outputs/slurm-<job id>, or hydra.run.dir); exported values win.
    The header asks Slurm to start only when all nodes are up and to warn 300 s ahead."""
    _, _, step_env = fake_sbatch_run(tmp_path)
    assert f"TORCH_FR_DUMP_TEMP_FILE={REPO}/outputs/slurm-777/nccl_trace/rank_" in step_env, step_env
    assert f"TORCH_NCCL_DEBUG_INFO_TEMP_FILE={REPO}/outputs/slurm-777/nccl_trace/rank_" in step_env, step_env
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT=1" in step_env and "TORCH_FR_BUFFER_SIZE=2000" in step_env, step_env
    _, _, step_env = fake_sbatch_run(tmp_path, f"hydra.run.dir={tmp_path}/run", TORCH_FR_BUFFER_SIZE="500")
    assert f"TORCH_FR_DUMP_TEMP_FILE={tmp_path}/run/nccl_trace/rank_" in step_env, step_env
    assert "TORCH_FR_BUFFER_SIZE=500" in step_env and "TORCH_NCCL_TRACE_BUFFER_SIZE=500" in step_env, step_env
    header = SBATCH_SCRIPT.read_text()
    assert "\n#SBATCH --wait-all-nodes=1\n" in header and "\n#SBATCH --signal=B:USR1@300\n" in header


# A node of 8 GPUs as Slurm's scontrol shows it, and a job on it (exclusive unless told).
FAKE_SCONTROL = '''
echo "$*" >> "$FAKE_SCONTROL_LOG"
case "$1 $2" in
  "show job") echo "JobId=777 JobName=mingpt"; echo "   OverSubscribe=${FAKE_OVERSUBSCRIBE:-NO} Contiguous=0"
              echo "   ${FAKE_JOB_TRES:-TresPerTask=cpu=1}" ;;
  "show node") echo "NodeName=n1 Arch=x86_64 CoresPerSocket=48 Gres=${FAKE_GRES:-gpu:h100:8(S:0-1)} NodeAddr=n1" ;;
  "requeue $SLURM_JOB_ID") exit "${FAKE_REQUEUE_EXIT:-0}" ;;
  *) exit 1 ;;
esac
'''


@pytest.mark.cli
def test_sbatch_passes_an_exclusive_jobs_gpus_to_its_step(tmp_path):
    """An --exclusive job holds all of its nodes' GPUs, but Slurm gives a step only the GPUs
    the job asked for: without a request the step would see none and train on CPU. The
    script asks for the node's GPUs for the step (srun --gres=gpu:8); not when the job asked
    itself, when it is not exclusive, on nodes without GPUs, or with DEVICE=cpu. What the job
    asked is its request (--gpus-per-node, --gres as TresPerNode), not its allocation: an
    exclusive job that asked nothing has SLURM_JOB_GPUS and SLURM_GPUS_ON_NODE too."""
    log = tmp_path / "scontrol.log"
    run = lambda **env: fake_sbatch_run(tmp_path, "model=gpt-nano", scontrol=FAKE_SCONTROL,  # noqa: E731
                                        FAKE_SCONTROL_LOG=str(log), **env)
    proc, srun_args, _ = run()
    assert proc.returncode == 0 and "--gres=gpu:8" in srun_args, output(proc)
    assert "exclusive job on nodes with 8 GPU(s) each: the step asks for them" in output(proc)
    proc, srun_args, _ = run(SLURM_GPUS_ON_NODE="8", SLURM_JOB_GPUS="0,1,2,3,4,5,6,7")  # allocated, not asked
    assert proc.returncode == 0 and "--gres=gpu:8" in srun_args, output(proc)
    for settings in ({"SLURM_GPUS_PER_NODE": "8"}, {"FAKE_JOB_TRES": "TresPerNode=gres/gpu:4"},
                     {"FAKE_OVERSUBSCRIBE": "OK"}, {"FAKE_GRES": "(null)"}, {"DEVICE": "cpu"}):
        proc, srun_args, _ = run(**settings)
        assert proc.returncode == 0 and not any(a.startswith("--gres") for a in srun_args), (settings, srun_args)
    # --ntasks-per-node=8 --gpus-per-task=1: the step's one task per node asks for the node's 8
    proc, srun_args, _ = run(SLURM_GPUS_PER_TASK="1", SLURM_NTASKS_PER_NODE="8")
    assert proc.returncode == 0 and "--gpus-per-task=8" in srun_args, (output(proc), srun_args)
    proc, srun_args, _ = run(SLURM_GPUS_PER_TASK="h100:8", SLURM_NTASKS_PER_NODE="1")
    assert not any(a.startswith(("--gres", "--gpus-per-task")) for a in srun_args), srun_args


def multinode_dry_run(tmp_path: Path, **settings: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(MULTINODE), "model=gpt-nano"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env=clean_env(DRY_RUN="1", **settings))


@pytest.mark.dist
def test_multinode_refuses_a_node_whose_gpus_the_job_cannot_see(tmp_path):
    """The node has 8 GPUs (the NVIDIA driver's list, faked in GPU_INVENTORY; or Slurm's node
    record) but the workers' torch sees none (here: a torch built without CUDA): one line
    naming the count, the cause and DEVICE=cpu, instead of training on CPU workers. DEVICE=cpu
    trains on CPU on purpose; the workers are as many as torch's GPUs, not CUDA_VISIBLE_DEVICES'
    (a fake PYTHON answers for a CUDA torch); DEVICE=gpu refuses where torch sees none."""
    inventory = tmp_path / "gpus"
    inventory.mkdir()
    for i in range(8):
        (inventory / f"0000:{i:02x}:00.0").mkdir()
    path = f"{tmp_path / 'empty'}:{os.path.dirname(sys.executable)}:/usr/bin:/bin"  # no nvidia-smi

    for visible in ({}, {"CUDA_VISIBLE_DEVICES": "0,1"}):  # counted from torch, not from CUDA_VISIBLE_DEVICES
        proc = multinode_dry_run(tmp_path, GPU_INVENTORY=str(inventory), PATH=path, **visible)
        errors = [line for line in proc.stderr.splitlines() if "error" in line]
        assert proc.returncode == 1 and len(errors) == 1 and proc.stdout == "", output(proc)
        assert "has 8 GPU(s) but torch sees none: this torch" in errors[0], errors
        assert "is built without CUDA" in errors[0] and "DEVICE=cpu" in errors[0], errors

    proc = multinode_dry_run(tmp_path, GPU_INVENTORY=str(inventory), PATH=path, DEVICE="cpu")
    assert proc.returncode == 0 and "(DEVICE=cpu: 1 CPU worker" in proc.stderr, output(proc)
    proc = subprocess.run([str(MULTINODE), "model=gpt-nano", "trainer.device=cpu"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env=clean_env(DRY_RUN="1", GPU_INVENTORY=str(inventory), PATH=path))
    assert proc.returncode == 0 and "(DEVICE=cpu: 1 CPU worker" in proc.stderr, output(proc)  # the line's own advice
    cuda_python = tmp_path / "cuda-python"  # a CUDA torch that sees 2 of the node's GPUs
    cuda_python.write_text('#!/usr/bin/env bash\n[ "$3 $4" = "-m mingpt_ddp.devices" ] && { echo 2; exit 0; }\n'
                           f'exec {sys.executable} "$@"\n')
    cuda_python.chmod(0o755)
    proc = multinode_dry_run(tmp_path, GPU_INVENTORY=str(inventory), PATH=path, PYTHON=str(cuda_python))
    assert proc.returncode == 0 and "--nproc_per_node=2" in proc.stdout and "(GPUs; 2 GPU(s))" in proc.stderr, \
        output(proc)
    proc = multinode_dry_run(tmp_path, GPU_INVENTORY=str(tmp_path / "none"), PATH=path, DEVICE="gpu")
    assert proc.returncode == 1 and "DEVICE=gpu but torch sees no GPU" in proc.stderr, output(proc)
    proc = multinode_dry_run(tmp_path, DEVICE="tpu")
    assert proc.returncode == 1 and "DEVICE=tpu: give auto" in proc.stderr, output(proc)

    # Under Slurm, where the driver's list cannot be read: the node's Gres.
    fake_command(tmp_path / "bin", "scontrol", FAKE_SCONTROL)
    proc = multinode_dry_run(tmp_path, GPU_INVENTORY=str(tmp_path / "none"), PATH=f"{tmp_path / 'bin'}:{path}",
                             FAKE_SCONTROL_LOG=str(tmp_path / "scontrol.log"), FAKE_GRES="gpu:a100:4,gpu:v100:2",
                             SLURM_JOB_ID="777", SLURM_JOB_NODELIST="n[1-2]", SLURM_JOB_NUM_NODES="2",
                             SLURM_NODEID="0", SLURMD_NODENAME="n1")
    assert proc.returncode == 1 and "node n1 has 6 GPU(s) but torch sees none" in proc.stderr, output(proc)


@pytest.mark.cli
def test_sbatch_requeues_a_run_error_and_never_a_config_error(tmp_path):
    """The class the step's workers recorded (<run dir>/.step_errors, errors.record) decides,
    not srun's exit code, which is the highest of its nodes' (143 for the nodes
    --kill-on-bad-exit stopped, whichever failed first): a RunError is requeued whenever it
    came, a ConfigError never, even after a long step, nor when another node had a RunError.
    Without a record srun's code speaks: 4 is a RunError. A record left by an earlier step of
    the job does not count."""
    log = tmp_path / "scontrol.log"
    run_dir = tmp_path / "run"

    def run(**env: str) -> tuple[subprocess.CompletedProcess, list[str], str]:
        log.unlink(missing_ok=True)
        shutil.rmtree(tmp_path / "submit" / ".mingpt-step", ignore_errors=True)  # each run a new job
        proc, _, step_env = fake_sbatch_run(tmp_path, "model=gpt-nano", f"hydra.run.dir={run_dir}",
                                            scontrol=FAKE_SCONTROL, FAKE_SCONTROL_LOG=str(log), FAKE_GRES="(null)",
                                            FAKE_PYTHON=sys.executable, **env)
        return proc, log.read_text().splitlines() if log.exists() else [], step_env

    proc, calls, step_env = run(FAKE_SRUN_EXIT="143", FAKE_STEP_ERRORS="RunError")  # 0 s: within the 300 s
    assert proc.returncode == 0 and "requeue 777" in calls, output(proc)
    # the fake step takes under a second, but may straddle a second's boundary: "after 1s" (seen in a fresh clone)
    assert re.search(r"training step failed with a RunError after [01]s \(step exit code 143\): requeueing job 777",
                     output(proc)), output(proc)
    assert f"MINGPT_STEP_ERRORS={tmp_path}/submit/.mingpt-step/777/0\n" in step_env, step_env
    proc, calls, _ = run(FAKE_SRUN_EXIT="4")
    assert proc.returncode == 0 and "requeue 777" in calls and "with a RunError" in output(proc), output(proc)

    for settings in ({"FAKE_SRUN_EXIT": "143", "FAKE_STEP_ERRORS": "ConfigError"},
                     {"FAKE_SRUN_EXIT": "143", "FAKE_STEP_ERRORS": "RunError ConfigError"},
                     {"FAKE_SRUN_EXIT": "4", "FAKE_STEP_ERRORS": "ConfigError"}):
        proc, calls, _ = run(REQUEUE_MIN_STEP_SECONDS="0", **settings)
        assert proc.returncode == int(settings["FAKE_SRUN_EXIT"]) and "requeue 777" not in calls, (settings, output(proc))
        assert "refused its input (a ConfigError" in output(proc), (settings, output(proc))

    (run_dir / ".step_errors").mkdir(parents=True, exist_ok=True)
    (run_dir / ".step_errors" / "ConfigError").touch()  # an earlier step's
    proc, calls, _ = run(FAKE_SRUN_EXIT="1", REQUEUE_MIN_STEP_SECONDS="0")
    assert proc.returncode == 0 and "requeue 777" in calls and re.search(r"training step failed after [01]s", output(proc))

    # One step, several torchrun tries (MAX_RESTARTS): try 0 refused its input (data not staged
    # yet), try 1 trained, then lost a node: the last try's (no) class decides, requeued.
    proc, calls, _ = run(FAKE_SRUN_EXIT="143", FAKE_STEP_ERRORS="0:ConfigError", FAKE_TRIES_STARTED="1",
                         REQUEUE_MIN_STEP_SECONDS="0")
    assert proc.returncode == 0 and "requeue 777" in calls and re.search(r"training step failed after [01]s", output(proc))
    proc, calls, _ = run(FAKE_SRUN_EXIT="143", FAKE_STEP_ERRORS="0:RunError 1:ConfigError", REQUEUE_MIN_STEP_SECONDS="0")
    assert proc.returncode == 143 and "requeue 777" not in calls and "refused its input" in output(proc)


@pytest.mark.cli
def test_sbatch_records_are_per_job_and_per_attempt_outside_the_run_directory(tmp_path):
    """The records live under <submit dir>/.mingpt-step/<job id>/<restart count>, whatever
    hydra.run.dir says (an interpolation train.sbatch cannot resolve, a run directory another
    job was refused): another job's ConfigError in the same run directory, or in its own
    records, does not decide for this job; the records go when the job ends."""
    log = tmp_path / "scontrol.log"
    interpolated = "hydra.run.dir=runs/${oc.env:SLURM_JOB_ID}"
    other, _, other_env = fake_sbatch_run(tmp_path, "model=gpt-nano", interpolated, SLURM_JOB_ID="906",
                                          FAKE_SRUN_EXIT="2", FAKE_STEP_ERRORS="ConfigError", FAKE_GRES="(null)")
    assert other.returncode == 2 and "refused its input" in output(other), output(other)
    assert f"MINGPT_STEP_ERRORS={tmp_path}/submit/.mingpt-step/906/0\n" in other_env, other_env
    assert not (tmp_path / "submit" / ".mingpt-step" / "906").exists()  # gone with the job
    (tmp_path / "submit" / ".mingpt-step" / "905" / "0" / "try-0").mkdir(parents=True)  # a stale leftover
    (tmp_path / "submit" / ".mingpt-step" / "905" / "0" / "try-0" / "ConfigError").touch()
    proc, _, step_env = fake_sbatch_run(tmp_path, "model=gpt-nano", interpolated, SLURM_JOB_ID="905",
                                        FAKE_SRUN_EXIT="143", REQUEUE_MIN_STEP_SECONDS="0", FAKE_GRES="(null)",
                                        scontrol=FAKE_SCONTROL, FAKE_SCONTROL_LOG=str(log))
    assert proc.returncode == 0 and "requeue 905" in log.read_text(), output(proc)
    assert f"MINGPT_STEP_ERRORS={tmp_path}/submit/.mingpt-step/905/0\n" in step_env and not (REPO / "runs").exists()


@pytest.mark.cli
def test_sbatch_requeues_a_failed_step_only_while_the_run_advances(tmp_path):
    """A failed step is requeued when rank 0 saved a newer snapshot than the attempts before it,
    else once: a deterministic RunError (a data preparation that always outlasts its wait) or a
    late crash is not requeued MAX_REQUEUES times. A requeue after SIGUSR1 is not limited."""
    log = tmp_path / "scontrol.log"

    def attempt(restart: int, **env: str) -> tuple[int, bool, str]:
        log.unlink(missing_ok=True)
        proc, _, _ = fake_sbatch_run(tmp_path, "model=gpt-nano", scontrol=FAKE_SCONTROL, FAKE_SCONTROL_LOG=str(log),
                                     FAKE_GRES="(null)", SLURM_RESTART_COUNT=str(restart), **env)
        return proc.returncode, log.exists() and "requeue 777" in log.read_text(), output(proc)

    run_error = {"FAKE_SRUN_EXIT": "4", "FAKE_STEP_ERRORS": "RunError"}
    assert attempt(0, **run_error, FAKE_SNAPSHOT_STEP="100")[1]  # progress: step 100
    assert attempt(1, **run_error)[1]  # no newer snapshot: requeued once
    rc, requeued, out = attempt(2, **run_error)
    assert rc == 4 and not requeued and "no newer snapshot than step 100" in out, out
    assert not (tmp_path / "submit" / ".mingpt-step" / "777").exists()  # the job ended: records gone

    assert attempt(0, **run_error, FAKE_SNAPSHOT_STEP="100")[1]
    assert attempt(1, **run_error)[1]
    assert attempt(2, **run_error, FAKE_SNAPSHOT_STEP="150")[1]  # advanced again
    assert attempt(3, FAKE_SRUN_EXIT="1", REQUEUE_MIN_STEP_SECONDS="0")[1]  # a late lost peer, once
    rc, requeued, out = attempt(4, FAKE_SRUN_EXIT="1", REQUEUE_MIN_STEP_SECONDS="0")
    assert rc == 1 and not requeued and "no newer snapshot than step 150" in out, out


@pytest.mark.cli
def test_sbatch_requeues_a_crash_only_after_progress(tmp_path):
    """A worker that crashed (a traceback such as CUDA out of memory, or killed by the kernel:
    errors.record_crash) crashes again where the run resumes: requeued only when a newer
    snapshot was saved, never once without (a lost peer is). Its peers' RunErrors do not make
    it a RunError. The step runs with one torchrun restart and pre-flight on, unless exported."""
    log = tmp_path / "scontrol.log"

    def attempt(restart: int, **env: str) -> tuple[int, bool, str, str]:
        log.unlink(missing_ok=True)
        proc, _, step_env = fake_sbatch_run(tmp_path, "model=gpt-nano", scontrol=FAKE_SCONTROL,
                                            FAKE_SCONTROL_LOG=str(log), FAKE_GRES="(null)",
                                            SLURM_RESTART_COUNT=str(restart), REQUEUE_MIN_STEP_SECONDS="0", **env)
        return proc.returncode, log.exists() and "requeue 777" in log.read_text(), output(proc), step_env

    rc, requeued, out, step_env = attempt(0, FAKE_SRUN_EXIT="1", FAKE_CRASHED_TRIES="0 1")  # the first eval OOMs
    assert rc == 1 and not requeued and "crash" in out and "no snapshot saved" in out, out
    assert "MAX_RESTARTS=1\n" in step_env and "PREFLIGHT=1\n" in step_env, step_env
    assert attempt(0, FAKE_SRUN_EXIT="1", FAKE_CRASHED_TRIES="1", FAKE_SNAPSHOT_STEP="100")[1]  # crashed after progress
    rc, requeued, out, _ = attempt(1, FAKE_SRUN_EXIT="4", FAKE_CRASHED_TRIES="1", FAKE_STEP_ERRORS="1:RunError")
    assert rc == 4 and not requeued and "no newer snapshot than step 100" in out, out
    # A crash in an earlier try only (the last try lost a peer): not a crash, requeued once.
    rc, requeued, out, step_env = attempt(0, FAKE_SRUN_EXIT="1", FAKE_CRASHED_TRIES="0", FAKE_TRIES_STARTED="1",
                                          MAX_RESTARTS="3", PREFLIGHT="0")
    assert rc == 0 and requeued, out
    assert "MAX_RESTARTS=3\n" in step_env and "PREFLIGHT=0\n" in step_env, step_env


@pytest.mark.cli
def test_sbatch_requeues_a_failed_step_within_the_requeue_limit(tmp_path):
    """A step that fails mid-run (a lost node, a collective that timed out) is requeued like a
    preempted one: same job, resumes from its snapshot. Not when it failed within
    REQUEUE_MIN_STEP_SECONDS of its start (a setting or environment error a requeue would
    repeat), not for bad input (exit code 2), and not past MAX_REQUEUES."""
    log = tmp_path / "scontrol.log"

    def run(**env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        log.unlink(missing_ok=True)
        proc, _, _ = fake_sbatch_run(tmp_path, "model=gpt-nano", scontrol=FAKE_SCONTROL, FAKE_SCONTROL_LOG=str(log),
                                     FAKE_GRES="(null)", **env)
        return proc, log.read_text().splitlines() if log.exists() else []

    proc, calls = run(FAKE_SRUN_EXIT="1", REQUEUE_MIN_STEP_SECONDS="0", SLURM_RESTART_COUNT="3")
    assert proc.returncode == 0 and "requeue 777" in calls, output(proc)
    assert re.search(r"training step failed after [01]s \(step exit code 1\): requeueing job 777 \(4 of at most 20\)",
                     output(proc)), output(proc)

    for settings, why in (({"FAKE_SRUN_EXIT": "143"}, "within REQUEUE_MIN_STEP_SECONDS=300 of its start"),
                          ({"FAKE_SRUN_EXIT": "2", "REQUEUE_MIN_STEP_SECONDS": "0"}, "refused its input"),
                          ({"FAKE_SRUN_EXIT": "1", "REQUEUE_MIN_STEP_SECONDS": "0", "SLURM_RESTART_COUNT": "5",
                            "MAX_REQUEUES": "5"}, "already requeued 5 times (MAX_REQUEUES=5)")):
        proc, calls = run(**settings)
        assert proc.returncode == int(settings["FAKE_SRUN_EXIT"]), output(proc)
        assert "requeue 777" not in calls and why in output(proc), (settings, output(proc))
    proc, calls = run()
    assert proc.returncode == 0 and "train.sbatch: done" in output(proc) and "requeue 777" not in calls


# ---- pre-flight verdicts and the submitit CPU default (pure logic) -------------------------------
def facts(host: str, workers: int = 8, gpus: int = 8, torch_version: str = "2.5.1+cu124", **extra) -> dict:
    return {"host": host, "workers": workers, "gpus": gpus, "gpu_models": ["NVIDIA H100 80GB HBM3"] if gpus else [],
            "gpu_memory_gib": 79.1 if gpus else 0, "cpu_cores": 96, "torch": torch_version,
            "cuda": "12.4" if gpus else None, "nccl": "2.21.5" if gpus else None, "python": "3.11.9", **extra}


@pytest.mark.unit
def test_preflight_node_checks_name_the_node():
    from mingpt_ddp.tools.preflight import check_comm, check_nodes, own_failure

    assert check_nodes([facts("gpu-1"), facts("gpu-2")]) is None
    problem = check_nodes([facts("gpu-1"), facts("gpu-2", gpus=4)])
    assert "node gpu-2 has 4 GPU(s) for 8 worker(s)" in problem, problem
    problem = check_nodes([facts("gpu-1"), facts("gpu-2", gpus=0)])
    assert "node gpu-2 has 0 GPU(s) for 8 worker(s) while node gpu-1 has 8" in problem, problem
    problem = check_nodes([facts("gpu-1"), facts("gpu-2", torch_version="2.4.0+cu121")])
    assert "versions differ" in problem and "gpu-2 has torch 2.4.0+cu121" in problem, problem
    assert check_nodes([facts("cpu-1", workers=2, gpus=0), facts("cpu-2", workers=1, gpus=0)]) is None

    rows = [{"size": 1 << 20, "wrong": 0, "busbw_GBps": 40.0}, {"size": 1 << 28, "wrong": 0, "busbw_GBps": 180.5}]
    ranks = [facts("gpu-1")] * 8 + [facts("gpu-2")] * 8
    fine = [None] * 16
    assert check_comm({"ranks": 16, "rows": rows}, ranks, None, fine) is None
    assert check_comm({"ranks": 16, "rows": rows}, ranks, 150, fine) is None
    problem = check_comm({"ranks": 16, "rows": rows}, ranks, 300, fine)
    assert "busbw 180.500 GB/s at 268,435,456 bytes" in problem and "gpu-1, gpu-2" in problem, problem
    bad = [{**rows[0], "wrong": 3}, rows[1]]
    assert own_failure({"rows": rows}) is None
    failures = [None] * 9 + [own_failure({"rows": bad})] * 2 + [None] * 5
    problem = check_comm({"ranks": 16, "rows": rows}, ranks, None, failures)
    assert "3 wrong value(s) at 1048576 bytes on rank 9 (node gpu-2) (and on 1 more rank(s))" in problem, problem
    nan = [{**rows[0], "timed_data_finite": False}, rows[1]]
    problem = check_comm({"ranks": 16, "rows": rows}, ranks, None, [None] * 3 + [own_failure({"rows": nan})] + [None] * 12)
    assert "non-finite values (inf/NaN) at 1048576 bytes on rank 3 (node gpu-1)" in problem, problem


# NCCL INFO lines of one rank of a 2-node job (NCCL's formats: src/init.cc "Using network %s",
# src/transport/net.cc "... via NET/%s/%d"): over aws-ofi-nccl, and fallen back to NCCL's sockets.
NCCL_EFA_LOG = """\
gpu-1:6831:6840 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.9.1-aws
gpu-1:6831:6840 [0] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)
gpu-1:6831:6840 [0] NCCL INFO Using network Libfabric
gpu-1:6831:6840 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM
gpu-1:6831:6840 [0] NCCL INFO Channel 00/0 : 15[7] -> 0[0] [receive] via NET/Libfabric/0/GDRDMA
gpu-1:6831:6840 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Libfabric/0/GDRDMA
"""
NCCL_SOCKET_LOG = """\
gpu-2:7001:7010 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so. Using internal network plugin.
gpu-2:7001:7010 [0] NCCL INFO NET/Socket : Using [0]ens32:10.0.1.18<0>
gpu-2:7001:7010 [0] NCCL INFO Using network Socket
gpu-2:7001:7010 [0] NCCL INFO Channel 00/0 : 8[0] -> 9[1] via P2P/CUMEM
gpu-2:7001:7010 [0] NCCL INFO Channel 00/0 : 7[7] -> 8[0] [receive] via NET/Socket/0
gpu-2:7001:7010 [0] NCCL INFO Channel 00/0 : 8[0] -> 0[0] [send] via NET/Socket/0
"""


@pytest.mark.unit
def test_preflight_fails_where_efa_is_expected_and_nccl_fell_back_to_sockets():
    """NCCL's transport between nodes, read from the sweep's own INFO log: TCP sockets where a
    node expects EFA fail pre-flight naming the node; EFA's transport passes, and so do sockets
    where EFA is off, one node (no NET channel) and gloo."""
    from mingpt_ddp.tools import bench
    from mingpt_ddp.tools.preflight import check_transport

    def rank(r: int, host: str, log: str) -> dict:
        return {"rank": r, "host": host, "backend": "nccl", **bench.nccl_transport(log)}

    efa = [facts("gpu-1", efa=True), facts("gpu-2", efa=True)]
    assert check_transport([rank(0, "gpu-1", NCCL_EFA_LOG), rank(1, "gpu-2", NCCL_EFA_LOG)], efa) is None
    problem = check_transport([rank(0, "gpu-1", NCCL_EFA_LOG), rank(1, "gpu-2", NCCL_SOCKET_LOG)], efa)
    assert problem and problem.startswith("node gpu-2 (rank 1) has EFA but NCCL connects it to the other nodes over TCP "
                                          "sockets (NCCL ?: NET/Socket x2, P2P x1; network Socket)"), problem
    assert "aws-ofi-nccl" in problem and "EFA=0" in problem, problem
    no_efa = [facts("gpu-1", efa=False), facts("gpu-2", efa=False)]
    assert check_transport([rank(0, "gpu-1", NCCL_SOCKET_LOG), rank(1, "gpu-2", NCCL_SOCKET_LOG)], no_efa) is None
    one_node = NCCL_SOCKET_LOG.replace("via NET/Socket/0", "via P2P/CUMEM")
    assert check_transport([rank(0, "gpu-1", one_node)], efa) is None
    assert check_transport([{"rank": 0, "host": "cpu-1", "backend": "gloo"}], efa) is None
    # aws-ofi-nccl on libfabric's tcp provider (FI_PROVIDER=tcp kept from the user): not EFA either
    tcp_provider = NCCL_EFA_LOG.replace("Selected Provider is efa", "Selected Provider is tcp")
    problem = check_transport([rank(0, "gpu-1", NCCL_EFA_LOG), rank(1, "gpu-2", tcp_provider)], efa)
    assert problem and problem.startswith("node gpu-2 (rank 1) has EFA but aws-ofi-nccl runs on libfabric's 'tcp'"), problem


@pytest.mark.unit
def test_preflight_expects_efa_as_multinode_resolves_it(tmp_path):
    """EFA=1/0 (multinode.sh exports its resolved choice) decide; by hand (EFA unset or auto) a
    device bound to the efa driver under /sys/class/infiniband does, as multinode's auto."""
    from mingpt_ddp.tools.preflight import efa_expected

    sysfs, driver = tmp_path / "infiniband", tmp_path / "drivers" / "efa"
    driver.mkdir(parents=True)
    (sysfs / "rdmap16s27" / "device").mkdir(parents=True)
    assert efa_expected({"EFA": "1"}, str(sysfs)) and not efa_expected({"EFA": "0"}, str(sysfs))
    empty = dict(PATH=str(tmp_path / "no-bin"))  # no fi_info either
    assert not efa_expected(empty, str(sysfs))
    (sysfs / "rdmap16s27" / "device" / "driver").symlink_to(driver)
    assert efa_expected(empty, str(sysfs)) and efa_expected({"EFA": "auto"}, str(sysfs))
    assert not efa_expected({"EFA": "0"}, str(sysfs))


@pytest.mark.cli
def test_submitit_cpus_per_task_from_the_partitions_nodes(tmp_path, monkeypatch):
    """cpus_per_task defaults to the smallest node's CPUs (sinfo; the default partition is the
    one marked *) / tasks per node; None where sinfo is missing or fails."""
    from mingpt_ddp.tools import cluster

    fake_command(tmp_path, "sinfo", '''
if [ "$*" = "-h -N -o %c %P -p gpu" ]; then printf "96 gpu\\n192 gpu\\n"; exit 0; fi
if [ "$*" = "-h -N -o %c %P" ]; then printf "8 cpu*\\n8 cpu*\\n96 gpu\\n"; exit 0; fi
exit 1
''')
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    cluster.node_cpus.cache_clear()
    assert cluster.cpus_per_task("gpu", 8) == 12
    assert cluster.cpus_per_task(None, 1) == 8
    assert cluster.cpus_per_task("missing", 8) is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    cluster.node_cpus.cache_clear()
    assert cluster.cpus_per_task("gpu", 8) is None
    cluster.node_cpus.cache_clear()


@pytest.mark.cli
def test_missing_s3fs_for_an_s3_url_is_one_line_naming_it(tmp_path, small_corpus):
    """s3fs missing and trainer.snapshot_path=s3://...: one `error:` line naming s3fs and the pip
    command for this interpreter (not `pip install -e`, which would re-resolve torch), exit 2."""
    python = venv_without_package(tmp_path / "env", leave_out=("s3fs",))
    proc = subprocess.run(
        [str(python), MAIN, *TINY, f"data.path={small_corpus}", "trainer.snapshot_path=s3://bucket/run/snapshot.pt",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, env=clean_env(),
    )
    out = output(proc)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, out
    assert "s3fs" in errors[0] and f"{python} -m pip install 's3fs>=2024.12'" in errors[0], errors
    assert "Traceback" not in out, out
