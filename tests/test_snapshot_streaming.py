"""Snapshots streamed to their file (no whole-snapshot buffer), host copies reused, the previous
snapshot kept when a stream fails, one object per save on an object store."""
from __future__ import annotations

import pytest
import torch


# ---- finding 9: snapshots streamed to the file, host buffers reused ------------------------------
def sample_state():
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(64, 32), "b": torch.zeros(32)}, "optimizer": {"state": {0: {
        "step": torch.tensor(3.0), "exp_avg": torch.randn(64, 32)}}, "param_groups": [{"lr": 1e-3}]},
        "train_state": {"step": 7}, "rng": [torch.get_rng_state()], "vocab": list("abc")}


@pytest.mark.unit
def test_a_streamed_snapshot_is_the_encoded_snapshot_and_old_headers_still_load(tmp_path):
    import hashlib
    import io

    from mingpt_ddp.checkpoint.snapshot import SnapshotStore, decode, encode, header_step

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


@pytest.mark.unit
def test_a_stream_that_fails_leaves_the_previous_snapshot_and_no_temp_file(tmp_path):
    from mingpt_ddp.checkpoint.snapshot import BackgroundSaver, SnapshotStore

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


@pytest.mark.unit
def test_copies_to_host_memory_are_deep_on_cpu():
    from mingpt_ddp.checkpoint.snapshot import to_cpu

    state = sample_state()
    pinned = {}
    copy = to_cpu(state, pinned)
    state["model"]["w"].add_(1.0)  # training goes on changing the live tensors
    assert not torch.equal(copy["model"]["w"], state["model"]["w"])
    assert copy["optimizer"]["param_groups"] == [{"lr": 1e-3}] and copy["vocab"] == list("abc")
    assert pinned == {}  # host buffers are kept for GPU tensors only


@pytest.mark.s3
def test_a_state_saved_to_an_object_store_goes_as_one_object(moto_s3):
    """S3 cannot patch a header after the payload: the state is encoded to bytes and PUT whole."""
    import uuid

    from conftest import s3_options
    from mingpt_ddp.checkpoint.snapshot import BackgroundSaver, SnapshotStore, encode

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    moto_s3.make_bucket(bucket)
    store = SnapshotStore(f"s3://{bucket}/run/snapshot.pt", storage_options=s3_options(moto_s3))
    saver = BackgroundSaver(store, retry_minutes=0.5)
    saver.submit(sample_state(), 7)
    assert saver.wait() is None
    assert store.fs.cat_file(store.step_path(7)) == encode(sample_state(), 7)
    assert store.load_latest()[0]["train_state"] == {"step": 7}


