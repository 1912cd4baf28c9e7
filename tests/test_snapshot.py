"""Snapshot encoding, checksums, retention and the newest-valid lookup."""
import io
import logging
import os
import pickle

import pytest
import torch

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.checkpoint.snapshot import CorruptSnapshot, SnapshotStore, decode, encode

pytestmark = pytest.mark.unit


def state(step: int) -> dict:
    return {"model": {"w": torch.full((4, 4), float(step))}, "train_state": {"step": step}, "vocab": "ab"}


def test_round_trip_keeps_tensors_and_plain_types():
    s = state(3)
    back = decode(encode(s, 3))
    assert torch.equal(back["model"]["w"], s["model"]["w"]) and back["train_state"] == {"step": 3}


@pytest.mark.parametrize("damage", ["truncate", "flip", "header"])
def test_damaged_files_are_detected(damage):
    blob = bytearray(encode(state(1), 1))
    if damage == "truncate":
        blob = blob[: len(blob) - 100]
    elif damage == "flip":
        blob[len(blob) // 2] ^= 0x01
    else:
        blob[:5] = b"XXXXX"
    with pytest.raises(CorruptSnapshot):
        decode(bytes(blob))


class RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_snapshot_crafted_to_run_code_is_refused():
    """Even with a valid header and checksum, unpickling is weights_only."""
    buf = io.BytesIO()
    torch.save({"model": RunsCode()}, buf, pickle_module=pickle)
    payload = buf.getvalue()
    import hashlib

    blob = b"MINGPT-DDP-SNAPSHOT 1 step=1 bytes=%d sha256=%s\n" % (
        len(payload), hashlib.sha256(payload).hexdigest().encode()) + payload
    with pytest.raises(CorruptSnapshot, match="refused to load"):
        decode(blob)


def test_store_keeps_last_k_and_points_latest_at_newest(tmp_path):
    store = SnapshotStore(str(tmp_path / "run" / "snapshot.pt"), keep_last=2)
    store.check_writable()
    for step in (5, 10, 100, 20):  # out of order on purpose: newest means highest step
        store.save(encode(state(step), step), step)
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == ["snapshot.pt", "snapshot.step000000020.pt", "snapshot.step000000100.pt"]
    loaded, where = store.load_latest()
    assert loaded["train_state"]["step"] == 100 and where.endswith("step000000100.pt")


def test_a_damaged_newest_snapshot_falls_back_with_a_warning(tmp_path, caplog):
    store = SnapshotStore(str(tmp_path / "snapshot.pt"), keep_last=3)
    for step in (1, 2):
        store.save(encode(state(step), step), step)
    newest = tmp_path / "snapshot.step000000002.pt"
    newest.write_bytes(newest.read_bytes()[:-10])  # truncates the hard-linked latest too
    with caplog.at_level(logging.WARNING):
        loaded, where = store.load_latest()
    assert loaded["train_state"]["step"] == 1
    assert "snapshot.step000000002.pt" in caplog.text and "truncated" in caplog.text


def test_no_usable_snapshot_is_an_error_not_a_fresh_start(tmp_path):
    (tmp_path / "snapshot.pt").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="no usable snapshot"):
        SnapshotStore(str(tmp_path / "snapshot.pt")).load_latest()
    assert SnapshotStore(str(tmp_path / "other.pt")).load_latest() is None


def test_unwritable_location_fails_early(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot write snapshots.*trainer.snapshot_path"):
        SnapshotStore(str(blocker / "sub" / "snapshot.pt")).check_writable()


@pytest.mark.unit
def test_whether_sharded_snapshots_may_be_beside_fails_open(tmp_path, monkeypatch):
    """A DDP run skips importing DCP only when `<snapshot>.dcp` surely is not there: a look
    that fails (EIO, a stale NFS handle) must not read as absent, or a DDP start would miss the
    FSDP run's snapshots and begin at step 0 (fsspec's exists() swallows every error)."""
    store = SnapshotStore(str(tmp_path / "snapshot.pt"))
    assert store.may_have_sharded() is False
    (tmp_path / "snapshot.pt.dcp").mkdir()
    assert store.may_have_sharded() is True

    def broken(path, **kwargs):
        raise OSError(5, "Input/output error", path)

    monkeypatch.setattr(store.fs, "info", broken)
    assert store.may_have_sharded() is True
