"""trainer.strategy=fsdp end to end: the real CLI under torchrun with 2 gloo workers, FSDP2
against DDP, SIGKILL and resume, 2 -> 1 workers, snapshots on S3, sampling and export from
an FSDP run, and the inputs refused with one clear message."""
import json
import os
import signal
import subprocess
import uuid

import pytest
import torch

from conftest import PYTHON, REPO, TINY, TORCHRUN, load_snapshot, output, read_metrics, run_cli, s3_env
from test_fault_tolerance import args, children, must_pass, rank_of, start_torchrun, wait_for

pytestmark = pytest.mark.slow


def full_model(path, **options):
    """The newest FSDP snapshot's whole model and metadata, read on this process alone."""
    from mingpt_ddp.checkpoint.sharded_snapshot import load_full_model_state

    return load_full_model_state(str(path), options or None)


@pytest.mark.dist
def test_fsdp_matches_ddp_ties_the_head_and_samples_from_its_run_dir(tmp_path, small_corpus):
    """20 fp32 steps from the same seed, clipping active, 2 micro-batches per step: the same
    losses as DDP. The snapshot's head is still the embedding; sample and export read the
    sharded run directory on one process."""
    same = ["trainer.max_steps=20", "trainer.grad_accum_steps=2", "trainer.grad_clip=0.05", "model.dropout=0.0"]
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    must_pass(run_cli(args(ddp, small_corpus, *same), nproc=2))
    text = must_pass(run_cli(args(fsdp, small_corpus, *same, "trainer.strategy=fsdp"), nproc=2))
    assert "parameters identical on all 2 rank(s)" in text and "a sample of what the model writes now" in text
    losses = {name: [(r["step"], r["train_loss"]) for r in read_metrics(d) if "train_loss" in r]
              for name, d in (("ddp", ddp), ("fsdp", fsdp))}
    assert [s for s, _ in losses["fsdp"]] == [5, 10, 15, 20]
    assert [s for s, _ in losses["ddp"]] == [s for s, _ in losses["fsdp"]]
    for (_, a), (_, b) in zip(losses["ddp"], losses["fsdp"]):
        assert abs(a - b) <= 1e-3 * abs(a), losses
    assert losses["fsdp"][-1][1] < losses["fsdp"][0][1] - 0.2, losses  # it learned, so the steps were real

    assert not (fsdp / "snapshot.pt").exists() and (fsdp / "snapshot.pt.dcp").is_dir()
    state, meta = full_model(fsdp / "snapshot.pt")
    assert meta["train_state"]["step"] == 20 and meta["world_size"] == 2
    assert torch.equal(state["lm_head.weight"], state["wte.weight"])  # still tied after sharding
    from mingpt_ddp.checkpoint.snapshot import decode

    ddp_state = decode((ddp / "snapshot.pt").read_bytes())["model"]
    drift = max((ddp_state[k] - state[k]).abs().max().item() for k in state)
    assert drift < 1e-3, drift

    sampled = subprocess.run([PYTHON, "-m", "mingpt_ddp.sample", str(fsdp), "prompt=ROMEO:", "max_new_tokens=50"],
                             capture_output=True, text=True, timeout=120, cwd=REPO)
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith("ROMEO:") and len(sampled.stdout) == len("ROMEO:") + 50 + 1
    exported = subprocess.run([PYTHON, "-m", "mingpt_ddp.export", str(fsdp), str(tmp_path / "export")],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
    assert exported.returncode == 0, exported.stderr
    weights = torch.load(tmp_path / "export" / "weights.pt", weights_only=True)
    assert torch.equal(weights["wte.weight"], state["wte.weight"])
    assert json.loads((tmp_path / "export" / "config.json").read_text())["trained"]["step"] == 20
    transformers = pytest.importorskip("transformers")
    from mingpt_ddp.model import GPT, GPTConfig
    from mingpt_ddp.tools.export import export

    export(str(fsdp), str(tmp_path / "hf"), hf=True)  # the two ranks' shards, merged, in GPT-2's layout
    ours = GPT(GPTConfig(**meta["model_config"]))
    ours.load_state_dict(state)
    ids = torch.randint(0, ours.cfg.vocab_size, (2, ours.cfg.block_size))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits
        assert (ours.eval()(ids)[0] - theirs).abs().max().item() <= 1e-4


@pytest.mark.dist
def test_rank0_sigkilled_during_a_save_resumes_bit_identical_from_the_previous_snapshot(tmp_path, small_corpus,
                                                                                       monkeypatch):
    """Rank 0 dies after every rank wrote its shards and before its commit marker (each
    commit held back 2 s): that directory is never used, torchrun restarts the workers, and
    the run resumes from the previous snapshot and ends bit-identical to an uninterrupted
    one (dropout on: every rank's RNG comes back too)."""
    from mingpt_ddp.checkpoint.sharded_snapshot import COMMIT_DELAY_ENV, MARKER

    common = ["trainer.strategy=fsdp", "trainer.max_steps=40", "trainer.snapshot_every_steps=5",
              "optimizer.decay_steps=100"]
    reference = tmp_path / "reference"
    must_pass(run_cli(args(reference, small_corpus, *common), nproc=2))

    run_dir = tmp_path / "killed"
    dcp_dir = run_dir / "snapshot.pt.dcp"
    monkeypatch.setenv(COMMIT_DELAY_ENV, "2")
    proc = start_torchrun(args(run_dir, small_corpus, *common), max_restarts=1, log_path=tmp_path / "killed.log")

    def uncommitted_after_a_committed():
        steps = sorted(dcp_dir.glob("step*")) if dcp_dir.is_dir() else []
        done = [d for d in steps if (d / MARKER).exists()]
        pending = [d for d in steps if not (d / MARKER).exists() and (d / "__1_0.distcp").exists()
                   and (d / "__0_0.distcp").exists()]
        return done and pending and pending[-1] > done[-1] and (done[-1], pending[-1])

    try:
        committed, pending = wait_for(uncommitted_after_a_committed, 180, "shards written before their commit")
        rank0 = next(pid for pid in children(proc.pid) if rank_of(pid) == 0)
        os.kill(rank0, signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, (tmp_path / "killed.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "killed.log").read_text()
    assert f"resumed from {committed}" in log, (committed, pending, log)
    a, meta_a = full_model(reference / "snapshot.pt")
    b, meta_b = full_model(run_dir / "snapshot.pt")
    assert meta_a["train_state"] == meta_b["train_state"] and meta_b["train_state"]["step"] == 40
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), f"{name} differs"


@pytest.mark.dist
def test_fsdp_resumes_on_one_worker_keeping_the_global_batch(tmp_path, small_corpus):
    fixed = ["trainer.strategy=fsdp", "optimizer.decay_steps=60", "model.dropout=0.0"]
    two, mixed = tmp_path / "two", tmp_path / "mixed"
    must_pass(run_cli(args(two, small_corpus, "trainer.max_steps=20", *fixed), nproc=2))
    must_pass(run_cli(args(mixed, small_corpus, "trainer.max_steps=10", *fixed), nproc=2))
    text = must_pass(run_cli(args(mixed, small_corpus, "trainer.max_steps=20", *fixed), nproc=0))
    assert "world size changed from 2 to 1: global batch 16 kept" in text and "8 x 1 -> 8 x 2" in text
    a, meta_a = full_model(two / "snapshot.pt")
    b, meta_b = full_model(mixed / "snapshot.pt")
    assert meta_b["world_size"] == 1 and meta_b["global_batch"] == 16
    assert meta_a["train_state"]["tokens_seen"] == meta_b["train_state"]["tokens_seen"]
    drift = max((a[k] - b[k]).abs().max().item() for k in a)  # only the summation order differs
    assert drift < 0.05, drift


@pytest.mark.s3
def test_fsdp_snapshots_on_s3_and_resume_from_there(tmp_path, seaweedfs, small_corpus):
    bucket = f"run-{uuid.uuid4().hex[:12]}"
    seaweedfs.make_bucket(bucket)
    url = f"s3://{bucket}/runs/big/snapshot.pt"
    env = s3_env(seaweedfs, PYTHONPATH=str(REPO))
    common = ["trainer.strategy=fsdp", f"trainer.snapshot_path={url}", "trainer.snapshot_every_steps=5",
              "optimizer.decay_steps=100"]
    must_pass(run_cli(args(tmp_path / "run", small_corpus, "trainer.max_steps=10", *common), nproc=2, env=env))
    text = must_pass(run_cli(args(tmp_path / "run", small_corpus, "trainer.max_steps=15", *common), nproc=2,
                             env=env))
    assert f"resumed from s3://{bucket}/runs/big/snapshot.pt.dcp/" in text and "step 10" in text
    keys = [o["Key"] for o in seaweedfs.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert any(k.startswith("runs/big/snapshot.pt.dcp/") for k in keys), keys
    sampled = subprocess.run([PYTHON, "-m", "mingpt_ddp.sample", url, "max_new_tokens=20"], env=env,
                             capture_output=True, text=True, timeout=120, cwd=REPO)
    assert sampled.returncode == 0, sampled.stderr


def expect_error(proc, pattern, code=2):
    """`code`: the CLI's own exit code; None under torchrun (which exits 1 for a failed worker)."""
    text = output(proc)
    assert proc.returncode == code if code is not None else proc.returncode != 0, text
    assert pattern in text, text
    # torchrun prints its own traceback for a failed worker; no worker may print one
    assert f'File "{REPO / "mingpt_ddp"}' not in text and (code is None or "Traceback" not in text), text
    return text


@pytest.mark.dist
def test_inputs_fsdp_refuses_with_one_message(tmp_path, small_corpus):
    base = args(tmp_path / "bad", small_corpus, "trainer.max_steps=2", "trainer.strategy=fsdp")
    text = expect_error(run_cli([*base, "model.n_embd=1", "model.n_head=1"], nproc=2, timeout=120),
                        "the model is too small to shard over 2 processes", code=None)
    assert text.count("error:") == 1, text
    expect_error(run_cli([*base, "trainer.strategy=zero3"], timeout=120), "Invalid value 'zero3'", code=2)

    # DDP snapshots go on under FSDP (each rank takes its shard); FSDP's shards are not
    # resumed by DDP, which says how.
    run, straight = tmp_path / "switched", tmp_path / "straight"
    fixed = ["model.dropout=0.0", "optimizer.decay_steps=100"]
    must_pass(run_cli(args(straight, small_corpus, "trainer.max_steps=4", *fixed)))
    must_pass(run_cli(args(run, small_corpus, "trainer.max_steps=2", *fixed)))
    text = must_pass(run_cli(args(run, small_corpus, "trainer.max_steps=4", *fixed, "trainer.strategy=fsdp")))
    assert f"resumed from {run}/snapshot.step000000002.pt: epoch 0, step 2 (a DDP snapshot" in text, text
    state, meta = full_model(run / "snapshot.pt")
    assert meta["train_state"]["step"] == 4
    assert meta["corpus"] == load_snapshot(straight / "snapshot.pt")["corpus"]  # the sharded metadata records it too
    # The same steps as the DDP run, AdamW's moments included (lost moments would move each
    # weight by about the learning rate)
    reference = load_snapshot(straight / "snapshot.pt")["model"]
    drift = max((state[k] - reference[k]).abs().max().item() for k in reference)
    assert drift < 1e-5, drift
    before = {p.name: p.read_bytes() for p in run.glob("snapshot*.pt")}
    expect_error(run_cli(args(run, small_corpus, "trainer.max_steps=4")),
                 "were saved with trainer.strategy=fsdp: resume them with trainer.strategy=fsdp")
    assert {p.name: p.read_bytes() for p in run.glob("snapshot*.pt")} == before
    # and a sharded snapshot is not resumed on another split of the text
    expect_error(run_cli(args(run, small_corpus, "trainer.max_steps=6", *fixed, "trainer.strategy=fsdp",
                              "data.val_fraction=0.2")), "the corpus changed since the snapshot")
    assert full_model(run / "snapshot.pt")[1]["train_state"]["step"] == 4


@pytest.mark.dist
def test_bench_reports_each_ranks_share_of_parameters_gradients_and_optimizer_state(tmp_path, small_corpus):
    """Every way this can fail shows the bench's output (a timeout on a loaded machine too)."""
    out = tmp_path / "bench.json"
    try:
        proc = subprocess.run(
            [TORCHRUN, "--standalone", "--nproc_per_node=2",
             "-m", "mingpt_ddp.bench", "train", *TINY, f"data.path={small_corpus}", "steps=1", "warmup=0",
             "trainer.strategy=fsdp", f"out={out}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        partial = "".join(v.decode(errors="replace") if isinstance(v, bytes) else v or "" for v in (e.stdout, e.stderr))
        pytest.fail(f"bench train did not finish in {e.timeout:.0f} s:\n{partial}")
    text = output(proc)
    assert proc.returncode == 0 and "memory, trainer.strategy=fsdp" in proc.stdout and out.exists(), text
    r = json.loads(out.read_text())
    mine, whole = r["state_bytes_per_rank"], r["state_bytes_whole_model"]
    assert whole["parameters"] == 4 * r["parameters"] == whole["gradients"]  # fp32, the tied head once
    assert whole["optimizer_state"] >= 2 * whole["parameters"]  # AdamW's two moments (and its step counters)
    for key in whole:  # each rank holds about half: its shards, padded to whole rows
        assert 0.45 * whole[key] < mine[key] < 0.6 * whole[key], (key, mine, whole, text)
