"""The real CLI under torchrun with 2 gloo workers: learning, agreement, one writer, resume."""
import math
import os
import subprocess
import re
import time

import pytest
import torch

from conftest import PYTHON, REPO, TINY, load_snapshot, output, read_metrics, run_cli, serving


def train(run_dir, corpus, *extra, nproc=2, env=None):
    proc = run_cli([*TINY, f"hydra.run.dir={run_dir}", f"data.path={corpus}", *extra], nproc=nproc, env=env)
    assert proc.returncode == 0, output(proc)
    return output(proc)


@pytest.mark.dist
def test_training_lowers_validation_loss_and_replicas_stay_identical(tmp_path, small_corpus):
    run_dir = tmp_path / "run"
    audit = tmp_path / "writes.log"
    text = train(run_dir, small_corpus, "trainer.max_epochs=3", "trainer.eval_every=30",
                 env={"PYTHONPATH": str(REPO / "tests" / "audit"), "MINGPT_AUDIT_LOG": str(audit)})
    records = read_metrics(run_dir)
    train_rows = [r for r in records if "train_loss" in r]
    assert {"step", "epoch", "train_loss", "lr", "tokens_per_s"} <= set(train_rows[0])
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) >= 4
    assert val[-1] < val[0] - 0.3 and val[-1] < math.log(60), val
    assert "parameters identical on all 2 rank(s)" in text
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "main.log").is_file()
    # Only global rank 0 ever wrote, renamed or linked a snapshot file.
    writers = {line.split()[0] for line in audit.read_text().splitlines()}
    assert writers == {"0"}, audit.read_text()
    assert (run_dir / "snapshot.pt").is_file()


@pytest.mark.dist
def test_stop_after_epoch_one_then_resume_equals_an_uninterrupted_run(tmp_path, small_corpus):
    """With a fixed LR horizon, 1 epoch + 1 resumed epoch is bit-identical to 2 epochs (dropout on)."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    fixed = "optimizer.decay_steps=200"
    train(straight, small_corpus, "trainer.max_epochs=2", fixed)
    train(split, small_corpus, "trainer.max_epochs=1", fixed)
    after_one = load_snapshot(split / "snapshot.pt")
    assert after_one["train_state"]["epoch"] == 1
    text = train(split, small_corpus, "trainer.max_epochs=2", fixed)
    assert f"resumed from {split}" in text and "epoch 1, step" in text
    # Rank 0 alone read the snapshot from storage; rank 1 read its header and received the rest.
    reads = re.search(r"sent to 1 other rank\(s\); bytes read from storage per rank: ([\d,]+), ([\d,]+)", text)
    assert reads, text
    assert int(reads[1].replace(",", "")) > 1000 >= 256 >= int(reads[2].replace(",", "")), reads[0]
    a, b = load_snapshot(straight / "snapshot.pt"), load_snapshot(split / "snapshot.pt")
    assert a["train_state"] == b["train_state"]
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    for key, s in a["optimizer"]["state"].items():
        assert torch.equal(s["exp_avg"], b["optimizer"]["state"][key]["exp_avg"])
    # Started again once finished: quick, says so, changes nothing.
    before = (split / "snapshot.pt").read_bytes()
    start = time.monotonic()
    assert "run already finished" in train(split, small_corpus, "trainer.max_epochs=2", fixed, nproc=0)
    assert time.monotonic() - start < 30
    assert (split / "snapshot.pt").read_bytes() == before


@pytest.mark.dist
def test_ranks_agree_on_the_run_directory_without_hydra_run_dir(tmp_path, small_corpus):
    proc = run_cli([*TINY, f"data.path={small_corpus}", "trainer.max_steps=3"], nproc=2, cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    dirs = list((tmp_path / "outputs").iterdir())
    assert len(dirs) == 1 and dirs[0].name.startswith("torchrun-"), dirs
    assert (dirs[0] / "snapshot.pt").is_file() and (dirs[0] / ".hydra" / "config.yaml").is_file()


@pytest.mark.cli
def test_sample_from_a_run_directory(tmp_path, small_corpus):
    run_dir = tmp_path / "run"
    train(run_dir, small_corpus, "trainer.max_steps=5", nproc=0)
    vocab = load_snapshot(run_dir / "snapshot.pt")["vocab"]
    proc = subprocess.run([PYTHON, "-m", "mingpt_ddp.sample", str(run_dir), "prompt=ROMEO:", "max_new_tokens=123"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout[:-1]  # the trailing newline
    assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 123
    assert set(text) <= set(vocab)


@pytest.mark.cli
def test_missing_corpus_is_downloaded_once_atomically_while_other_ranks_wait(tmp_path, small_corpus):
    """A real HTTP server on 127.0.0.1 stands in for the public URL."""
    served = tmp_path / "served"
    served.mkdir()
    (served / "input.txt").write_bytes(small_corpus.read_bytes())
    with serving(served) as base:
        target = tmp_path / "data" / "tinyshakespeare.txt"
        text = train(tmp_path / "run", target, "trainer.max_steps=3", f"data.download_url={base}/input.txt")
    assert target.read_bytes() == small_corpus.read_bytes()
    assert text.count("downloading http://127.0.0.1") == 1
    assert [p.name for p in target.parent.iterdir()] == ["tinyshakespeare.txt"]  # no temp file left


@pytest.mark.dist
def test_tensorboard_gets_the_same_scalars_as_metrics_jsonl(tmp_path, small_corpus):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run_dir = tmp_path / "run"
    train(run_dir, small_corpus, "trainer.max_steps=10", "trainer.tensorboard=true", nproc=0)
    events = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    rows = read_metrics(run_dir)
    expected = [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]
    assert [s for s, _ in logged["train_loss"]] == [s for s, _ in expected] == [5, 10]
    assert [v for _, v in logged["train_loss"]] == pytest.approx([v for _, v in expected])
    assert [s for s, _ in logged["val_loss"]] == [10] and "tokens_per_s" in logged and "lr" in logged
