"""Bad input: one clear message naming the fix, non-zero exit, within seconds, no traceback."""
import os
import subprocess
import time

import pytest

from conftest import MAIN, PYTHON, REPO, TINY, load_snapshot, output, read_metrics, run_cli


def expect_error(args, pattern, code=2, cwd=None, nproc=0):
    start = time.monotonic()
    proc = run_cli(args, nproc=nproc, **({"cwd": cwd} if cwd else {}), timeout=120)
    text = output(proc)
    assert proc.returncode == code, text
    assert pattern.lower() in text.lower(), text
    assert "Traceback" not in text, text
    assert time.monotonic() - start < 60
    return text


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


def base(run_dir, corpus):
    return [*TINY, f"hydra.run.dir={run_dir}", f"data.path={corpus}", "trainer.max_steps=2"]


@pytest.mark.cli
def test_missing_data_file_without_download(run_dir, tmp_path):
    text = expect_error(base(run_dir, tmp_path / "nope.txt") + ["data.download_url=null"], "data file not found")
    assert "data.path" in text
    assert not run_dir.exists()  # refused at start: the run directory it made (Hydra's files only) is gone


@pytest.mark.unit
def test_a_refused_run_takes_away_only_a_run_directory_it_made(tmp_path, monkeypatch):
    """Never a directory that was there before, nor one with more than Hydra's files."""
    from mingpt_ddp.checkpoint import run_dir as run_dir_check

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)

    def hydra_wrote(path, *extra):
        (path / ".hydra").mkdir(parents=True)
        for name in (*run_dir_check.HYDRA_FILES, "../main.log", *extra):
            (path / ".hydra" / name).write_text("x")

    mine, theirs, busy = tmp_path / "outputs" / "new", tmp_path / "theirs", tmp_path / "busy"
    theirs.mkdir()
    for path in (mine, theirs, busy):
        run_dir_check.note_if_new(str(path))
    for path in (mine, theirs):
        hydra_wrote(path)
    hydra_wrote(busy, "../metrics.jsonl")
    assert [run_dir_check.remove_if_refused(str(p), ".hydra") for p in (mine, theirs, busy)] == [True, False, False]
    assert not (tmp_path / "outputs").exists() and (theirs / "main.log").exists() and busy.exists()

    # Under torchrun: made by another rank of this launch (its mark), or an earlier attempt's under
    # the same run id (no mark; it was taken away when a probe had touched it after the agent started)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job42")
    other_rank, earlier = tmp_path / "outputs" / "torchrun-a", tmp_path / "outputs" / "torchrun-b"
    other_rank.mkdir(parents=True)
    (other_rank / run_dir_check.MADE_MARK).write_text(run_dir_check._launch_id())
    earlier.mkdir()
    for path in (other_rank, earlier):
        run_dir_check.note_if_new(str(path))
        hydra_wrote(path)
    assert [run_dir_check.remove_if_refused(str(p), ".hydra") for p in (other_rank, earlier)] == [True, False]
    assert (earlier / "main.log").exists() and not other_rank.exists()


@pytest.mark.cli
def test_missing_data_file_with_unreachable_download_url(run_dir, tmp_path):
    """A server that refuses connections is retried for trainer.load_retry_minutes (a
    moment's outage), then the same one clear line."""
    text = expect_error(base(run_dir, tmp_path / "nope.txt") + ["data.download_url=http://127.0.0.1:9/x.txt",
                                                                "trainer.load_retry_minutes=0.02"],
                        "downloading it from http://127.0.0.1:9/x.txt failed")
    assert "retrying" in text and "Connection refused" in text
    assert "set data.path" in text
    assert not (tmp_path / "nope.txt").exists()


@pytest.mark.cli
def test_a_mistyped_data_path_is_one_error_and_nothing_is_downloaded_or_created(run_dir, tmp_path):
    """The preset's download URL is for its own path: a typo'd path (enwk9 for enwik9) is
    not filled with tiny-shakespeare and trained on."""
    typo = tmp_path / "corpora" / "enwk9"
    text = expect_error(base(run_dir, typo), f"data file not found: {typo}")
    assert text.count("error:") == 1 and "downloading" not in text.lower(), text
    assert not (tmp_path / "corpora").exists()


@pytest.mark.cli
def test_empty_data_file(run_dir, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    expect_error(base(run_dir, tmp_path / "empty.txt"), "is empty")


@pytest.mark.cli
def test_non_utf8_data_file(run_dir, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("naïve café\n".encode("latin-1") * 100)
    expect_error(base(run_dir, tmp_path / "latin1.txt"), "is not UTF-8")


@pytest.mark.cli
@pytest.mark.parametrize("override, message", [
    ("trainer.max_epochs=abc", "could not be converted to Integer"),
    ("trainer.max_epoch=3", "Key 'max_epoch' not in 'TrainerConfig'; did you mean trainer.max_epochs?"),
    ("+trainer.max_epoch=3", "trainer.max_epoch is not a config key (did you mean trainer.max_epochs?)"),
    ("trainer.precision=fp8", "Invalid value 'fp8'"),
    ("model=gpt-huge", "Could not find 'model/gpt-huge'"),
])
def test_hydra_rejects_wrong_types_unknown_keys_and_presets(run_dir, small_corpus, override, message):
    text = expect_error(base(run_dir, small_corpus) + [override], message)
    assert len(text.splitlines()) == 1 and text.startswith("error: "), text  # ConfigError's one line, exit 2


SIGNATURE = "9f1c0e6d2b7a4c3e8f5d1a0b6c7e8f9a0b1c2d3e4f5a6b7c8d"
PRESIGNED = f'"https://host.example.com/corpus.txt?X-Amz-Expires=3600&X-Amz-Signature={SIGNATURE}"'


@pytest.mark.cli
@pytest.mark.parametrize("args, says", [
    ([f"data.pth={PRESIGNED}"], "Key 'pth' not in 'DataConfig'"),  # Hydra's "did you mean +data.pth=..."
    ([f"+data.path={PRESIGNED}"], "An item is already at 'data.path'"),
    (["-m", "trainer.seed=1,2", f"data.pth={PRESIGNED}"], "Key 'pth' not in 'DataConfig'"),
    # a dict or list value under storage_options: masked whole, whatever names it holds
    ([f"trainer.storage_options.client_kwargs={{aws_secret_access_key:{SIGNATURE}}}"], "storage_options"),
    ([f"trainer.storage_options=[{SIGNATURE}]"], "storage_options"),
])
def test_a_bad_override_never_shows_a_presigned_urls_signature(run_dir, args, says):
    """Hydra prints the override it could not apply back as typed, before any of our code
    runs: main.py's is one masked line, ConfigError's exit 2, whether a run or a sweep."""
    text = expect_error([*args, f"hydra.run.dir={run_dir}", f"hydra.sweep.dir={run_dir}"], says)
    assert SIGNATURE not in text and len(text.splitlines()) == 1 and text.startswith("error: "), text
    assert "X-Amz-Signature=<redacted>" in text or "X-Amz" not in text
    assert not run_dir.exists()


# A bug in a library the run calls whose message quotes the URL it was handed (as aiohttp's
# and botocore's do): loggers.check is the first thing train() calls.
BUG_QUOTING_THE_URL = """
from mingpt_ddp import loggers
def check(cfg):
    raise RuntimeError(f"reading {cfg.data.download_url} failed")
loggers.check = check
"""


@pytest.mark.cli
def test_a_bugs_traceback_and_error_file_never_show_a_presigned_urls_signature(run_dir, small_corpus, tmp_path):
    """A bug keeps its traceback, but neither it, Hydra's "Error executing job with
    overrides: [...]" nor torch's @record error file (torchrun's failure summary) shows the
    signature typed on the command line."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BUG_QUOTING_THE_URL)
    error_file = tmp_path / "error.json"
    proc = run_cli(base(run_dir, small_corpus) + [f"data.download_url={PRESIGNED}"], timeout=120,
                   env={"PYTHONPATH": f"{site}{os.pathsep}{REPO}", "TORCHELASTIC_ERROR_FILE": str(error_file)})
    text = output(proc)
    assert proc.returncode == 1 and "Traceback" in text and "RuntimeError: reading https://host.example.com" in text, text
    assert "Error executing job with overrides" in text and SIGNATURE not in text, text
    assert "RuntimeError" in error_file.read_text() and SIGNATURE not in error_file.read_text()


@pytest.mark.cli
def test_an_unset_environment_variable_in_a_trainer_key_is_one_error_line(run_dir, small_corpus):
    """trainer.* is read before the config is checked (the process group's timeouts)."""
    text = expect_error(base(run_dir, small_corpus) + ["trainer.collective_timeout_minutes=${oc.env:MINGPT_UNSET_T}",
                                                       f"data.download_url={PRESIGNED}"],
                        "cannot resolve trainer.collective_timeout_minutes")
    assert [line for line in text.splitlines() if "WARNING" not in line] == [text.splitlines()[-1]], text
    assert text.splitlines()[-1].startswith("error: ") and SIGNATURE not in text, text


@pytest.mark.cli
@pytest.mark.parametrize("env, prints", [
    ({"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, True),
    ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, False),
    # plain `srun python main.py`: no RANK before distributed.setup maps SLURM_* to it
    ({"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, False),
])
def test_a_bad_override_is_printed_by_every_nodes_local_rank_0(run_dir, env, prints):
    """On another node than rank 0's (RANK=1, LOCAL_RANK=0) the line is printed too: rank 0's
    node may be slower, or gone, and the node would show nothing. Its other ranks stay quiet."""
    proc = run_cli([f"data.pth={PRESIGNED}", f"hydra.run.dir={run_dir}"], timeout=120, env=env)
    text = output(proc)
    assert proc.returncode == 2 and SIGNATURE not in text, text
    line = "error: Could not override 'data.pth'; Key 'pth' not in 'DataConfig'"
    assert text.count(line) == (1 if prints else 0) and len(text.splitlines()) == int(prints), text


@pytest.mark.dist
@pytest.mark.parametrize("launcher", ["torchrun", "mingpt_ddp.torchrun"])
def test_a_bad_override_under_torchrun_is_one_masked_line(run_dir, launcher):
    args = [f"data.pth={PRESIGNED}", f"hydra.run.dir={run_dir}"]
    if launcher == "torchrun":
        proc = run_cli(args, nproc=2, timeout=120)
    else:
        proc = subprocess.run([PYTHON, "-m", "mingpt_ddp.torchrun", "--standalone", "--nproc_per_node=2", MAIN, *args],
                              cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    text = output(proc)
    assert proc.returncode != 0 and SIGNATURE not in text, text
    assert text.count("error: Could not override 'data.pth'; Key 'pth' not in 'DataConfig'") == 1, text
    assert launcher != "torchrun" or "exitcode  : 2" in text, text  # the worker's: ConfigError's code
    # our launcher reads the class each worker recorded, whichever worker the agent stopped first
    assert launcher == "torchrun" or proc.returncode == 2, text


@pytest.mark.cli
@pytest.mark.parametrize("override, message", [
    ("data.block_size=5000", "data.block_size=5000 is larger than the validation split"),
    ("model.n_embd=50", "model.n_embd=50 is not divisible by model.n_head=3"),
    ("trainer.batch_size=0", "trainer.batch_size must be positive"),
    ("optimizer.lr=0", "optimizer.lr must be positive"),
    ("trainer.max_epochs=0", "trainer.max_epochs must be positive"),
    ("trainer.batch_size=100000", "lower trainer.batch_size"),
])
def test_values_that_cannot_work(run_dir, small_corpus, override, message):
    expect_error(base(run_dir, small_corpus) + [override], message)


@pytest.mark.cli
def test_unwritable_snapshot_location_fails_before_training(run_dir, small_corpus, tmp_path):
    (tmp_path / "a_file").write_text("x")
    text = expect_error(base(run_dir, small_corpus) + [f"trainer.snapshot_path={tmp_path}/a_file/sub/snapshot.pt"],
                        "cannot write snapshots")
    assert "step" not in text.split("cannot write")[0].split("\n")[-1]


@pytest.mark.cli
def test_snapshot_of_another_model_or_vocabulary_is_refused_and_kept(run_dir, small_corpus, tmp_path):
    ok = run_cli(base(run_dir, small_corpus))
    assert ok.returncode == 0, output(ok)
    snap = run_dir / "snapshot.pt"
    before = snap.read_bytes()
    expect_error(base(run_dir, small_corpus) + ["model.n_layer=2"], "trained with model.n_layer=3 but the config says 2")
    other_text = tmp_path / "other.txt"
    other_text.write_text(small_corpus.read_text() + "\n0123456789 {}~" * 50)
    expect_error(base(run_dir, other_text), "lacks")
    assert snap.read_bytes() == before
    assert load_snapshot(snap)["train_state"]["step"] == 2


def refused_and_kept(args, run_dir, *says):
    """A resume refused in one `error:` line holding every one of `says`: exit 2, no
    traceback, the snapshots and the run's .hydra/ files as they were."""
    kept = {p: p.read_bytes() for p in [*run_dir.glob("snapshot*.pt"), *(run_dir / ".hydra").iterdir()]}
    text = expect_error(args, says[0])
    errors = [line for line in text.splitlines() if "error:" in line]
    assert len(errors) == 1 and all(s in errors[0] for s in says), text
    assert {p: p.read_bytes() for p in kept} == kept
    assert sorted(run_dir.glob("snapshot*.pt")) == sorted(p for p in kept if p.name.startswith("snapshot"))
    return errors[0]


def must_pass(args):
    proc = run_cli(args, timeout=120)
    assert proc.returncode == 0, output(proc)
    return output(proc)


@pytest.mark.cli
def test_a_resume_on_a_changed_corpus_is_refused_unless_asked(run_dir, small_corpus, tmp_path):
    """A shard added, a file changed, another data.val_fraction: the validation split would
    hold trained-on text and the saved position would index another permutation. Refused in
    one line naming what changed; data.continue_on_new_corpus=true goes on, the epoch in
    progress from its first window, and says so. A finished run on another corpus is not
    finished for this one; a snapshot from before corpus identities resumes, with a note."""
    from mingpt_ddp.checkpoint.snapshot import decode, encode

    corpus = tmp_path / "text"
    corpus.mkdir()
    text = small_corpus.read_text()
    (corpus / "a.txt").write_text(text[:20_000])
    (corpus / "b.txt").write_text(text[20_000:])
    common = [*TINY, f"hydra.run.dir={run_dir}", f"data.path={corpus}"]
    must_pass([*common, "trainer.max_steps=5"])
    recorded = load_snapshot(run_dir / "snapshot.pt")["corpus"]
    assert recorded["train_tokens"] + recorded["val_tokens"] == 40_001 and recorded["val_fraction"] == 0.1

    (corpus / "c.txt").write_text("a shard added later\n")
    refused_and_kept([*common, "trainer.max_steps=10"], run_dir, "the corpus changed since the snapshot",
                     f"the text at data.path changed (sha256 {recorded['text_sha256'][:12]}.. then, ",
                     "40,001 tokens then, 40,022 now", "data.continue_on_new_corpus=true")
    (corpus / "c.txt").unlink()
    (corpus / "a.txt").write_text(text[:19_999] + "!")  # one character, same size
    refused_and_kept([*common, "trainer.max_steps=10"], run_dir, "the text at data.path changed")
    (corpus / "a.txt").write_text(text[:20_000])
    refused_and_kept([*common, "trainer.max_steps=10", "data.val_fraction=0.2"], run_dir,
                     "data.val_fraction 0.1 then, 0.2 now")

    (corpus / "c.txt").write_text("a shard added later\n")
    log = must_pass([*common, "trainer.max_steps=10", "data.continue_on_new_corpus=true"])
    said = [line for line in log.splitlines() if "continuing on a new corpus" in line]
    assert len(said) == 1 and "the epoch in progress starts again from its first window" in said[0], log
    assert "LR horizon 5 \u2192 10 steps" in log, log  # the cosine follows the new plan: said, not silent
    assert {"step": 5, "event": "new corpus"} in read_metrics(run_dir)  # the summary's best loss starts there
    snapshot = load_snapshot(run_dir / "snapshot.pt")
    assert snapshot["train_state"]["step"] == 10
    assert snapshot["train_state"]["epoch_position"] == 5 * 8  # 5 steps of 8 windows since the restart, not 10
    assert snapshot["corpus"]["train_tokens"] + snapshot["corpus"]["val_tokens"] == 40_022

    (corpus / "c.txt").unlink()  # finished at step 10, on the text with c.txt
    refused_and_kept([*common, "trainer.max_steps=10", "data.continue_on_new_corpus=true"], run_dir,
                     "finished on another corpus than this config's", "its result is not this corpus's")

    # Written before snapshots recorded their corpus: its text cannot be compared, its data settings can.
    newest = run_dir / "snapshot.step000000010.pt"
    old = decode(newest.read_bytes())
    del old["corpus"]
    newest.write_bytes(encode(old, 10))
    log = must_pass([*common, "trainer.max_steps=10"])
    assert "the snapshot predates recorded corpus identities" in log and "run already finished" in log, log


@pytest.mark.cli
def test_a_resume_under_other_result_defining_settings_is_refused_unless_asked(run_dir, small_corpus):
    """Another seed applies the saved position to another permutation; another lr trains
    on under values the run's result will be credited to. Refused in one line naming them;
    trainer.continue_with_new_settings=true goes on and says so (after a seed change, from
    the start of the epoch in progress). Limits, cadence and logging change freely."""
    common = [*TINY, f"hydra.run.dir={run_dir}", f"data.path={small_corpus}"]
    must_pass([*common, "trainer.max_steps=5"])
    refused_and_kept([*common, "trainer.max_steps=10", "trainer.seed=7", "optimizer.lr=1e-3"], run_dir,
                     "was trained under other settings than this config's",
                     "optimizer.lr=0.003 then, 0.001 now; trainer.seed=1337 then, 7 now",
                     "trainer.continue_with_new_settings=true")
    log = must_pass([*common, "trainer.max_steps=10", "trainer.seed=7", "trainer.continue_with_new_settings=true",
                     "trainer.log_every=1", "trainer.snapshot_every_steps=3"])
    said = [line for line in log.splitlines() if "continuing under other settings" in line]
    assert len(said) == 1 and "trainer.seed=1337 then, 7 now; the epoch in progress starts again" in said[0], log
    assert log.count("LR horizon 5 \u2192 10 steps") == 1, log  # the single run's "train more": a note
    snapshot = load_snapshot(run_dir / "snapshot.pt")
    assert snapshot["train_state"]["epoch_position"] == 5 * 8 and snapshot["config"]["trainer"]["seed"] == 7


@pytest.mark.dist
def test_errors_come_from_one_rank_under_torchrun(run_dir, small_corpus):
    proc = run_cli(base(run_dir, small_corpus) + ["model.n_embd=50"], nproc=2, timeout=120)
    assert proc.returncode != 0
    assert output(proc).count("error: model.n_embd=50 is not divisible") == 1, output(proc)


@pytest.mark.dist
def test_ranks_that_resolve_different_configurations_stop_naming_the_keys(run_dir, small_corpus, tmp_path):
    """A per-rank path (`${oc.env:RANK}`): only d_0.txt exists, and with the per-node token
    file only local rank 0 would read data.path, so nothing else notices. One line names the
    key and what each rank resolved; no snapshot is written."""
    (tmp_path / "d_0.txt").write_text(small_corpus.read_text())
    per_rank = f"data.path={tmp_path}/d_${{oc.env:RANK}}.txt"
    start = time.monotonic()
    proc = run_cli([*base(run_dir, small_corpus), per_rank, "trainer.seed=${oc.env:RANK}"], nproc=2, timeout=120)
    text = output(proc)
    assert proc.returncode != 0, text
    errors = [line for line in text.splitlines() if "error:" in line]
    assert len(errors) == 1, text
    assert "ranks resolved different configurations: data.path, trainer.seed" in errors[0], errors
    assert f"rank 0: {tmp_path}/d_0.txt, rank 1: {tmp_path}/d_1.txt" in errors[0], errors
    assert not list(run_dir.glob("snapshot*")), text
    assert time.monotonic() - start < 60
