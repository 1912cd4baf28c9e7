"""One run's safety edges: retention never deletes the snapshot just written, credentials in URL
query strings are used but never shown or stored, seed streams do not overlap, and an unwritable
run directory is one clear error."""
import time

import pytest
import torch

from conftest import TINY, load_snapshot, output, run_cli, serving
from test_rank_agreement import args, expect_config_error, must_pass


# ---- 4. retention next to a damaged snapshot -------------------------------------------------
@pytest.mark.unit
def test_retention_never_deletes_the_snapshot_just_written(tmp_path):
    from mingpt_ddp.checkpoint.snapshot import SnapshotStore, encode

    store = SnapshotStore(str(tmp_path / "snapshot.pt"), keep_last=2)
    for step in (10, 20):
        store.save(encode({"step": torch.tensor(step)}, step), step)
    damaged = tmp_path / "snapshot.step000000020.pt"
    damaged.write_bytes(damaged.read_bytes()[:-10])  # the run then resumes from step 10
    store.save(encode({"step": torch.tensor(15)}, 15), 15)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "snapshot.step000000015.pt" in names and "snapshot.step000000010.pt" in names, names
    assert "snapshot.step000000020.pt.corrupt" in names and "snapshot.step000000020.pt" not in names, names
    state, where = store.load_latest()
    assert int(state["step"]) == 15 and where.endswith("snapshot.step000000015.pt")


# ---- 10. credentials in URL query strings ------------------------------------------------------
@pytest.mark.cli
def test_url_query_secrets_are_used_but_never_shown_or_stored(tmp_path, small_corpus):
    served = tmp_path / "served"
    served.mkdir()
    (served / "input.txt").write_bytes(small_corpus.read_bytes())
    secrets = ("AKIASECRETCRED77", "SIGNATURE0123abcdef", "SESSIONTOKEN999", "tok42xyz")
    with serving(served) as base:
        url = (f"{base}/input.txt?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={secrets[0]}"
               f"&X-Amz-Signature={secrets[1]}&X-Amz-Security-Token={secrets[2]}&token={secrets[3]}")
        run_dir, target = tmp_path / "run", tmp_path / "data" / "text.txt"
        proc = run_cli(args(run_dir, target, "trainer.max_steps=2", f"data.download_url='{url}'"))
    text = must_pass(proc)
    assert target.read_bytes() == small_corpus.read_bytes()  # the real URL was read
    assert "X-Amz-Signature=<redacted>" in text
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in written) and any(p.name.startswith("snapshot") for p in written)
    for secret in secrets:
        assert secret not in text
        for path in written:
            assert secret.encode() not in path.read_bytes(), path
    stored = load_snapshot(run_dir / "snapshot.pt")["config"]["data"]["download_url"]
    assert "X-Amz-Signature=<redacted>" in stored and stored.startswith(f"{base}/input.txt?")


# ---- 11. seeding -------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_seeds_next_epoch_is_not_the_next_seeds_epoch():
    from mingpt_ddp.char_dataset import ResumableDistributedSampler, WindowDataset

    windows = WindowDataset(torch.arange(10_000), 10)

    def order(seed, epoch):
        sampler = ResumableDistributedSampler(windows, 1, 0, seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(7, 1) != order(8, 0) and order(7, 2) != order(9, 0)
    assert order(7, 1) == order(7, 1)  # still deterministic


@pytest.mark.unit
def test_measuring_peak_flops_leaves_the_global_rng_alone():
    from mingpt_ddp import metrics

    metrics._PEAK_CACHE.clear()
    torch.manual_seed(5)
    before = torch.get_rng_state()
    metrics.measured_peak_flops(torch.device("cpu"), torch.float32, seconds=0.05)
    assert torch.equal(torch.get_rng_state(), before)


# ---- 12. unwritable run or sweep directory ------------------------------------------------------
@pytest.mark.cli
@pytest.mark.parametrize("override, key, path, fix", [
    (["hydra.run.dir=/proc/x/y"], "hydra.run.dir", "/proc/x/y", ""),
    (["-m", "hydra.sweep.dir=/proc/x/y", "trainer.seed=1,2"], "hydra.sweep.dir", "/proc/x/y", ""),
    # A URL: Hydra would create ./s3:/bucket/run1 and the run would "succeed" there.
    (["hydra.run.dir=s3://my-bucket/run1"], "hydra.run.dir", "s3://my-bucket/run1", "trainer.snapshot_path=s3://"),
    (["-m", "hydra.sweep.dir=s3://my-bucket/sweep", "trainer.seed=1,2"], "hydra.sweep.dir", "s3://my-bucket/sweep",
     "trainer.snapshot_path=s3://")])
def test_unwritable_run_directory_is_one_clear_error(tmp_path, small_corpus, override, key, path, fix):
    start = time.monotonic()
    proc = run_cli([*override, *TINY, f"data.path={small_corpus}"], cwd=tmp_path, timeout=60)
    expect_config_error(proc, path, f"set {key}=", fix)
    assert "FileNotFoundError" not in output(proc) and time.monotonic() - start < 30
    assert not (tmp_path / "s3:").exists()




@pytest.mark.cli
def test_a_refused_or_finished_run_leaves_the_run_directorys_config_alone(tmp_path, small_corpus):
    """Hydra writes .hydra/ before any check: a resume refused for another model, and a run
    that had already finished, put back the files of the run whose snapshots are there."""
    run_dir = tmp_path / "run"
    must_pass(run_cli(args(run_dir, small_corpus, "trainer.max_steps=2")))
    hydra_files = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
    assert set(hydra_files) == {"config.yaml", "hydra.yaml", "overrides.yaml"}
    expect_config_error(run_cli(args(run_dir, small_corpus, "trainer.max_steps=2", "model.n_layer=2")),
                        "model.n_layer")
    assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == hydra_files
    text = must_pass(run_cli(args(run_dir, small_corpus, "trainer.max_steps=2", "trainer.log_every=1")))
    assert "run already finished" in text, text
    assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == hydra_files
