"""Sharded (DCP) snapshots: commit marker, checksums, retention, safe loading, background
saves; FSDP2 round trips, resharding, a rank 0 killed before the commit, and S3 with real
processes (torchrun, gloo) in the slow tests."""
import json
import logging
import os
import pickle
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch

from conftest import REPO, TORCHRUN, s3_options
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.checkpoint.sharded_snapshot import (
    COMMIT_DELAY_ENV, MARKER, META, ShardedSnapshotStore, is_sharded, load_full_model_state,
)

WORKER = str(REPO / "tests" / "dcp_worker.py")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's "no process group" notice


def state(step: int) -> dict:
    return {"model": {"w": torch.full((4, 4), float(step)), "b": torch.arange(3.0) + step},
            "optimizer": {"param_groups": [{"lr": 0.1 * step, "betas": (0.9, 0.95)}]}}


def empty() -> dict:
    return {"model": {"w": torch.zeros(4, 4), "b": torch.zeros(3)}, "optimizer": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}}


def step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def saved_store(tmp_path: Path, steps, keep_last: int = 3) -> ShardedSnapshotStore:
    """A store with `steps` saved by this one process (no process group)."""
    store = ShardedSnapshotStore(str(tmp_path / "run" / "snapshot.pt"), keep_last=keep_last)
    store.check_writable()
    for step in steps:
        assert store.save(step, state(step), {"train_state": {"step": step}}) is None
    return store


def rewrite_marker(directory: Path, name: str) -> None:
    """What an attacker controlling the files would do: make the marker match them."""
    import hashlib

    marker = json.loads((directory / MARKER).read_text())
    blob = (directory / name).read_bytes()
    marker["files"][name] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    (directory / MARKER).write_text(json.dumps(marker))


# ---- one process, no process group ----------------------------------------------------------
@pytest.mark.unit
def test_a_save_is_a_step_directory_published_by_its_marker_and_loads_back(tmp_path):
    store = saved_store(tmp_path, [7])
    directory = tmp_path / "run" / "snapshot.pt.dcp" / "step000000007"
    marker = json.loads((directory / MARKER).read_text())
    assert marker["step"] == 7 and set(marker["files"]) == {".metadata", META, "__0_0.distcp"}
    assert set(os.listdir(directory)) == {*marker["files"], MARKER}
    target = empty()
    meta, where = store.load_latest(target)
    assert meta == {"train_state": {"step": 7}} and where == str(directory)
    assert torch.equal(target["model"]["w"], state(7)["model"]["w"])
    assert target["optimizer"]["param_groups"] == [{"lr": 0.1 * 7, "betas": (0.9, 0.95)}]
    assert is_sharded(store.url) and not is_sharded(str(tmp_path / "other" / "snapshot.pt"))


@pytest.mark.unit
def test_shards_are_hashed_as_written_not_read_back(tmp_path, monkeypatch):
    import mingpt_ddp.checkpoint.sharded_snapshot as sharded_snapshot

    read_back = []
    real = sharded_snapshot._sha256_of
    monkeypatch.setattr(sharded_snapshot, "_sha256_of", lambda fs, path: read_back.append(path) or real(fs, path))
    store = saved_store(tmp_path, [1])
    assert read_back and not [p for p in read_back if p.endswith(".distcp")]  # only the small files
    store.verify(store.candidates()[0])  # and what was hashed on the way is what is stored


@pytest.mark.unit
def test_keep_last_by_step_never_removing_the_one_just_committed(tmp_path):
    store = saved_store(tmp_path, [5, 10, 100, 20], keep_last=2)  # out of order: newest is the highest step
    assert step_dirs(tmp_path / "run" / "snapshot.pt.dcp") == ["step000000020", "step000000100"]
    assert [Path(c).name for c in store.candidates()] == ["step000000100", "step000000020"]
    assert store.latest_meta()[0]["train_state"]["step"] == 100
    store.keep_last = 1
    assert store.save(30, state(30), {}) is None  # 100 is newer and valid, 30 was just committed: both stay
    assert step_dirs(tmp_path / "run" / "snapshot.pt.dcp") == ["step000000030", "step000000100"]


@pytest.mark.unit
def test_an_unfinished_directory_is_never_loaded_and_a_later_save_removes_it(tmp_path):
    store = saved_store(tmp_path, [1, 2])
    root = tmp_path / "run" / "snapshot.pt.dcp"
    (root / "step000000002" / MARKER).unlink()  # what a crash before the commit leaves
    assert [Path(c).name for c in store.candidates()] == ["step000000001"]
    assert store.latest_meta()[0]["train_state"]["step"] == 1
    _, tensors_meta = load_full_model_state(store.url)
    assert tensors_meta["train_state"]["step"] == 1
    store.save(3, state(3), {"train_state": {"step": 3}})
    assert step_dirs(root) == ["step000000001", "step000000003"]


@pytest.mark.unit
@pytest.mark.parametrize("damage", ["flip", "truncate", "missing", "meta missing"])
def test_a_damaged_shard_falls_back_to_the_previous_snapshot_and_is_moved_aside(tmp_path, caplog, damage):
    store = saved_store(tmp_path, [1, 2])
    shard = tmp_path / "run" / "snapshot.pt.dcp" / "step000000002" / "__0_0.distcp"
    blob = bytearray(shard.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0x01  # same size: only the checksum can tell
        shard.write_bytes(bytes(blob))
    elif damage == "truncate":
        shard.write_bytes(bytes(blob[:-10]))
    elif damage == "missing":
        shard.unlink()
    else:
        (shard.parent / META).unlink()
    with caplog.at_level(logging.WARNING):
        model, meta = load_full_model_state(store.url)
    assert meta["train_state"]["step"] == 1 and torch.equal(model["w"], state(1)["model"]["w"])
    assert "step000000002" in caplog.text
    with pytest.raises(ConfigError, match=r"step000000002.*Move that directory away"):  # one line for the user
        store.load(store.candidates()[0], empty())
    target = empty()
    with caplog.at_level(logging.WARNING):
        meta, where = store.load_latest(target)
    assert meta["train_state"]["step"] == 1 and where.endswith("step000000001")
    assert torch.equal(target["model"]["w"], state(1)["model"]["w"])
    names = step_dirs(tmp_path / "run" / "snapshot.pt.dcp")
    assert names[0] == "step000000001" and names[1].startswith("step000000002.corrupt")  # never deleted
    expected = {"flip": "checksum mismatch", "truncate": "truncated", "missing": "__0_0.distcp is missing",
                "meta missing": f"{META} is missing"}[damage]
    assert expected in caplog.text


@pytest.mark.unit
@pytest.mark.parametrize("marker", ["{not json", "[1, 2]", '{"format": 1, "step": 1, "files": {"../../x": {}}}'])
def test_every_snapshot_damaged_is_an_error_not_a_fresh_start(tmp_path, marker):
    store = saved_store(tmp_path, [1])
    (tmp_path / "run" / "snapshot.pt.dcp" / "step000000001" / MARKER).write_text(marker)
    with pytest.raises(ConfigError, match="no usable sharded snapshot"):
        store.latest_meta()
    with pytest.raises(ConfigError, match="no usable sharded snapshot"):
        load_full_model_state(store.url)


class RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {RunsCode.proof}",))


@pytest.mark.unit
@pytest.mark.parametrize("crafted", [".metadata", META])
def test_a_snapshot_crafted_to_run_code_is_refused_even_with_matching_checksums(tmp_path, crafted):
    store = saved_store(tmp_path, [1])
    directory = tmp_path / "run" / "snapshot.pt.dcp" / "step000000001"
    RunsCode.proof = tmp_path / "pwned"
    if crafted == META:
        torch.save({"train_state": RunsCode()}, directory / META, pickle_module=pickle)
    else:
        (directory / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    rewrite_marker(directory, crafted)
    with pytest.raises(ConfigError, match="refused to load|cannot load sharded snapshot"):
        load_full_model_state(store.url)
    with pytest.raises(ConfigError):
        store.load_latest(empty())
    assert not RunsCode.proof.exists()


@pytest.mark.unit
def test_one_save_in_flight_and_the_snapshot_holds_the_state_at_save_time(tmp_path, monkeypatch):
    store = ShardedSnapshotStore(str(tmp_path / "snapshot.pt"))
    monkeypatch.setenv(COMMIT_DELAY_ENV, "1")
    live = state(1)
    first = store.save_async(1, live, {"train_state": {"step": 1}})
    live["model"]["w"].add_(100.0)  # training goes on while the first save is written
    second = store.save_async(2, state(2), {"train_state": {"step": 2}})
    assert first.done() and first.wait() is None  # the second save waited for the first (1 s at its commit)
    assert (tmp_path / "snapshot.pt.dcp" / "step000000001" / MARKER).exists()
    assert second.wait() is None
    target = empty()
    store.load(store.candidates()[1], target)
    assert torch.equal(target["model"]["w"], state(1)["model"]["w"])  # staged before the change


@pytest.mark.unit
def test_saving_the_same_step_again_replaces_it_whole(tmp_path):
    store = saved_store(tmp_path, [1, 2])
    assert store.save(2, state(5), {"train_state": {"step": 2, "again": True}}) is None
    meta, _ = store.latest_meta()
    assert meta["train_state"]["again"] is True
    model, _ = load_full_model_state(store.url)
    assert torch.equal(model["w"], state(5)["model"]["w"])


@pytest.mark.s3
@pytest.mark.parametrize("server", ["seaweedfs", "moto_s3"])
def test_s3_round_trip_in_one_process(request, server):
    s3 = request.getfixturevalue(server)  # DCP's fsspec reader and writer on both servers
    bucket = f"dcp-{uuid.uuid4().hex[:8]}"
    s3.make_bucket(bucket)
    url = f"s3://{bucket}/runs/a/snapshot.pt"
    store = ShardedSnapshotStore(url, keep_last=2, storage_options=s3_options(s3))
    store.check_writable()
    for step in (1, 2, 3):
        assert store.save(step, state(step), {"train_state": {"step": step}}) is None
    keys = sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", []))
    assert {k.split("/")[3] for k in keys} == {"step000000002", "step000000003"}
    assert f"runs/a/snapshot.pt.dcp/step000000003/{MARKER}" in keys
    target = empty()
    meta, where = store.load_latest(target)
    assert where == f"s3://{bucket}/runs/a/snapshot.pt.dcp/step000000003" and meta["train_state"]["step"] == 3
    assert torch.equal(target["model"]["b"], state(3)["model"]["b"])
    model, meta = load_full_model_state(url, s3_options(s3))
    assert torch.equal(model["w"], state(3)["model"]["w"])


# ---- FSDP2 with real processes ---------------------------------------------------------------
def worker(args: list[str], nproc: int, env: dict | None = None, timeout: float = 180) -> str:
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", WORKER, *args]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    return text


def assert_same_states(expected: dict, got: dict) -> None:
    assert expected["model"].keys() == got["model"].keys()
    for name, tensor in expected["model"].items():
        assert torch.equal(tensor, got["model"][name]), name
    assert expected["optimizer"]["param_groups"] == got["optimizer"]["param_groups"]
    assert expected["optimizer"]["state"].keys() == got["optimizer"]["state"].keys()
    for name, entries in expected["optimizer"]["state"].items():
        for key, value in entries.items():
            assert torch.equal(value, got["optimizer"]["state"][name][key]), (name, key)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """Steps 1, 2, 3 saved by 2 FSDP ranks (keep_last=2), training on while each is written,
    then loaded back into a differently initialised model on the same 2 ranks."""
    base = tmp_path_factory.mktemp("fsdp")
    path = base / "run" / "snapshot.pt"
    worker(["roundtrip", str(path), str(base), "1", "2", "3"], nproc=2)
    return path, torch.load(base / "saved.pt", weights_only=True), torch.load(base / "loaded.pt", weights_only=True)


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp_snapshot_loads_back_bit_identical_on_2_ranks(fsdp_run):
    path, saved, loaded = fsdp_run
    assert step_dirs(path.parent / "snapshot.pt.dcp") == ["step000000002", "step000000003"]
    marker = json.loads((path.parent / "snapshot.pt.dcp" / "step000000003" / MARKER).read_text())
    assert marker["world_size"] == 2 and {"__0_0.distcp", "__1_0.distcp"} <= set(marker["files"])
    assert loaded["meta"]["train_state"]["step"] == 3 and loaded["meta"]["world_size"] == 2
    assert_same_states(saved, loaded)


@pytest.mark.dist
@pytest.mark.slow
def test_a_2_rank_fsdp_snapshot_loads_resharded_on_1_rank(fsdp_run, tmp_path):
    path, saved, _ = fsdp_run
    worker(["load", str(path), str(tmp_path)], nproc=1)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert loaded["meta"]["train_state"]["step"] == 3 and loaded["meta"]["world_size"] == 2
    assert_same_states(saved, loaded)


@pytest.mark.dist
@pytest.mark.slow
def test_full_model_state_from_an_fsdp_run_in_one_process_without_a_process_group(fsdp_run):
    import torch.distributed as dist

    from mingpt_ddp.model import GPT
    from dcp_worker import CFG

    path, saved, _ = fsdp_run
    model_state, meta = load_full_model_state(str(path))
    assert not dist.is_initialized() and meta["train_state"]["step"] == 3
    model = GPT(CFG)
    model.load_state_dict(model_state)  # strict: every key, tied head included
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved["model"][name]), name
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.dist
@pytest.mark.slow
def test_a_corrupted_shard_is_detected_by_the_ranks_and_the_previous_snapshot_used(fsdp_run, tmp_path):
    import shutil

    path, _, _ = fsdp_run
    copy_root = tmp_path / "run"
    shutil.copytree(path.parent, copy_root)
    shard = copy_root / "snapshot.pt.dcp" / "step000000003" / "__1_0.distcp"
    blob = bytearray(shard.read_bytes())
    blob[len(blob) // 3] ^= 0x40
    shard.write_bytes(bytes(blob))
    text = worker(["load", str(copy_root / "snapshot.pt"), str(tmp_path)], nproc=2)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert loaded["meta"]["train_state"]["step"] == 2, text
    assert "checksum mismatch in __1_0.distcp" in text
    assert any(n.startswith("step000000003.corrupt") for n in step_dirs(copy_root / "snapshot.pt.dcp"))


@pytest.mark.dist
@pytest.mark.slow
def test_rank0_killed_between_the_shards_and_the_commit_leaves_the_previous_snapshot(tmp_path):
    path = tmp_path / "run" / "snapshot.pt"
    log_path = tmp_path / "save.log"
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", WORKER, "save", str(path), str(tmp_path), "1", "2"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "DCP_TEST_DELAY_AT_STEP": "2:120"})
    unfinished = path.parent / "snapshot.pt.dcp" / "step000000002"
    try:
        deadline = time.monotonic() + 150
        while "waiting before committing" not in log_path.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()
            time.sleep(0.05)
        assert {".metadata", META, "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(unfinished))
        # the two ranks' lines can interleave in the shared log ("rank 0 pid 10706rank 1 pid ...")
        rank0 = int(re.search(r"rank 0 pid (\d+)", log_path.read_text())[1])
        os.kill(rank0, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert not (unfinished / MARKER).exists()
    store = ShardedSnapshotStore(str(path))
    assert [Path(c).name for c in store.candidates()] == ["step000000001"]
    model_state, meta = load_full_model_state(str(path))
    assert meta["train_state"]["step"] == 1 and "wte.weight" in model_state


@pytest.mark.dist
@pytest.mark.slow
def test_a_save_failing_on_one_rank_is_not_committed_and_every_rank_hears_why(tmp_path):
    path = tmp_path / "run" / "snapshot.pt"
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", WORKER, "save", str(path), str(tmp_path), "1", "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "DCP_TEST_FAIL_RANK_AT_STEP": "1:2"})
    text = proc.stdout + proc.stderr
    errors = {line.split(": save failed: ", 1)[1] for line in text.splitlines() if ": save failed: " in line}
    assert proc.returncode != 0 and len(errors) == 1, text  # the same answer on both ranks
    assert "rank 1: hashing its files failed: PermissionError" in errors.pop()
    assert "rank 0: save failed" in text and "rank 1: save failed" in text
    assert [Path(c).name for c in ShardedSnapshotStore(str(path)).candidates()] == ["step000000001"]


@pytest.mark.s3
@pytest.mark.slow
def test_fsdp_snapshots_on_s3_round_trip_bit_identical(seaweedfs, tmp_path):
    bucket = f"dcp-{uuid.uuid4().hex[:8]}"
    seaweedfs.make_bucket(bucket)
    url = f"s3://{bucket}/runs/fsdp/snapshot.pt"
    env = {"DCP_TEST_STORAGE_OPTIONS": json.dumps(s3_options(seaweedfs))}
    worker(["roundtrip", url, str(tmp_path), "1", "2"], nproc=2, env=env)
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert loaded["where"] == f"{url}.dcp/step000000002"
    assert_same_states(saved, loaded)
    keys = [o["Key"] for o in seaweedfs.client().list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert f"runs/fsdp/snapshot.pt.dcp/step000000002/{MARKER}" in keys
    assert {"__0_0.distcp", "__1_0.distcp"} <= {k.rsplit("/", 1)[-1] for k in keys if "step000000002" in k}


def wait_until_retrying(handle, caplog):
    """Until the store logs that it will retry `handle`'s save, which must still be pending."""
    deadline = time.monotonic() + 60
    while "retrying in" not in caplog.text:
        assert time.monotonic() < deadline and not handle.done(), caplog.text
        time.sleep(0.1)


@pytest.mark.s3
def test_a_save_failing_while_the_store_is_down_is_retried_in_the_background(seaweedfs, caplog):
    bucket = f"dcp-{uuid.uuid4().hex[:8]}"
    seaweedfs.make_bucket(bucket)
    url = f"s3://{bucket}/runs/b/snapshot.pt"
    store = ShardedSnapshotStore(url, storage_options=s3_options(seaweedfs), save_retry_minutes=5)
    assert store.save(1, state(1), {"train_state": {"step": 1}}) is None
    seaweedfs.stop()
    try:
        with caplog.at_level(logging.WARNING):
            handle = store.save_async(2, state(2), {"train_state": {"step": 2}})
            wait_until_retrying(handle, caplog)
    finally:
        seaweedfs.start()
    assert handle.wait() is None
    assert store.latest_meta()[0]["train_state"]["step"] == 2


@pytest.mark.s3
def test_a_save_that_cannot_work_fails_at_once_with_the_reason(seaweedfs, caplog):
    url = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/snapshot.pt"
    store = ShardedSnapshotStore(url, storage_options=s3_options(seaweedfs), save_retry_minutes=5)
    with caplog.at_level(logging.WARNING):
        error = store.save(1, state(1), {})
    assert error and "step000000001" in error and "retrying" not in caplog.text


@pytest.mark.s3
def test_a_newer_save_replaces_one_waiting_to_be_retried(seaweedfs, caplog):
    bucket = f"dcp-{uuid.uuid4().hex[:8]}"
    seaweedfs.make_bucket(bucket)
    store = ShardedSnapshotStore(f"s3://{bucket}/snapshot.pt", storage_options=s3_options(seaweedfs),
                                 save_retry_minutes=5)
    seaweedfs.stop()
    try:
        with caplog.at_level(logging.WARNING):
            stale = store.save_async(2, state(2), {"train_state": {"step": 2}})
            wait_until_retrying(stale, caplog)
            newer = store.save_async(3, state(3), {"train_state": {"step": 3}})  # the store is still down
            assert stale.done() and stale.wait() is None and "a newer one replaces it" in caplog.text
    finally:
        seaweedfs.start()
    assert newer.wait() is None
    assert [c.rsplit("/", 1)[-1] for c in store.candidates()] == ["step000000003"]
