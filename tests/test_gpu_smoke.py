"""launch/gpu_smoke.sh, the one script for the day a GPU is lent (issue 23): its plan (the
GPU commands, in order) and a CPU rehearsal of its steps, report included. It has not run on
a GPU: no GPU was lent to this project yet."""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from conftest import REPO

SCRIPT = str(REPO / "launch" / "gpu_smoke.sh")
STEPS = ["api", "peak", "comm", "ddp_compiled", "ddp_eager", "fsdp", "fsdp_compiled", "run", "resume", "report"]


def smoke(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**{k: v for k, v in os.environ.items() if k not in ("NPROC", "SKIP", "TEXT")}, **env})


@pytest.mark.dist
def test_the_plan_runs_every_gpu_check_in_order(tmp_path):
    proc = smoke("--dry-run", str(tmp_path / "out"), NPROC="8", TEXT="/data/corpus.txt")
    assert proc.returncode == 0, proc.stderr
    plan = {m[1]: line for line in proc.stdout.splitlines() if (m := re.match(r"\[(\w+)\]", line))}
    assert list(plan) == STEPS, proc.stdout
    gpt2 = "model=gpt2 data.block_size=1024 model.dropout=0"
    for name, extra in (("ddp_compiled", "trainer.compile=true"), ("ddp_eager", "trainer.compile=false"),
                        ("fsdp", "trainer.strategy=fsdp trainer.compile=false"), ("fsdp_compiled", "trainer.strategy=fsdp trainer.compile=true")):
        assert "--nproc_per_node=8 -m mingpt_ddp.bench train " + gpt2 in plan[name] and extra in plan[name], plan[name]
        assert "data.path=/data/corpus.txt" in plan[name]
    assert "-m mingpt_ddp.bench peak" in plan["peak"] and "-m mingpt_ddp.bench comm max_bytes=256MB" in plan["comm"]
    assert "mingpt_ddp/main.py " + gpt2 in plan["run"] and "hydra.run.dir=" in plan["run"]
    assert "SIGKILL" in plan["resume"]
    assert sum(int(m) for m in re.findall(r"at most (\d+)s", proc.stdout)) <= 60 * 60  # caps; typical far less
    assert os.listdir(tmp_path / "out") == ["steps.tsv"] and not (tmp_path / "out" / "steps.tsv").read_text()


@pytest.mark.cli
def test_without_a_gpu_it_stops_in_one_line_naming_the_cpu_rehearsal(tmp_path):
    proc = smoke(str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "sees no GPU" in proc.stderr and "--cpu" in proc.stderr


@pytest.mark.cli
@pytest.mark.slow
def test_a_cpu_rehearsal_runs_its_steps_and_writes_one_report(tmp_path, small_corpus):
    """Compiling takes minutes on a CPU: those two steps are left out here (their commands are
    in the plan above); peak has its own tests (tests/test_bench.py)."""
    out = tmp_path / "out"
    proc = smoke("--cpu", str(out), timeout=900, TEXT=str(small_corpus), SKIP="ddp_compiled,fsdp_compiled,peak")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    assert [s[0] for s in steps] == ["api", "comm", "ddp_eager", "fsdp", "run", "resume"] and all(s[1] == "0" for s in steps)
    report = json.loads((out / "report.json").read_text())
    assert report["api"]["floor"] == "2.9" and report["comm"]["wrong"] == 0 and report["comm"]["busbw_GBps"] > 0
    for name in ("ddp_eager", "fsdp"):
        assert report[name]["tokens_per_s"] > 0 and report[name]["wall_tokens_per_s"] <= report[name]["tokens_per_s"]
    assert 0 < report["run"]["wall_over_steps"] <= 1.0 and report["run"]["windows"] >= 2
    assert report["resume"] == {"resumed": True, "finished": True}
    assert "| resume | 0 |" in (out / "report.md").read_text()
