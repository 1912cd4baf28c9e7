"""Where the tools (sample, export) find a trained model: the newest snapshot of a run
directory, a snapshot file or URL (an FSDP run's shards merged on this process), or an export
directory (export.read_export); and what they need of it.

Apart from sample.py and export.py so that each can import it: sample reads export's
directories, export reads snapshots.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

from mingpt_ddp.checkpoint import storage
from mingpt_ddp.checkpoint.snapshot import SnapshotStore
from mingpt_ddp.corpus import tokenizer
from mingpt_ddp.errors import ConfigError


class Trained(NamedTuple):
    """A trained model as sample needs it, whatever held it."""
    model_config: dict[str, Any]  # GPTConfig's fields
    state: dict[str, Any]  # the model's state dict
    tokenizer: tokenizer.Tokenizer
    where: str  # for messages
    failed_check: Optional[str] = None  # the end-of-run check its weights failed, in words


# An unreachable store is retried this long before a clear error.
RETRY_MINUTES = 0.5


def snapshot_store_for(target: str) -> SnapshotStore:
    """A snapshot file, or a run directory holding snapshot.pt (local or any fsspec URL;
    credentials and endpoint from the environment, e.g. AWS_PROFILE, AWS_ENDPOINT_URL)."""
    fs, path = storage.filesystem(target)
    try:
        is_dir = storage.retry_transient(lambda: fs.isdir(path), f"reading {target}", RETRY_MINUTES)
    except Exception as exc:
        raise ConfigError(f"cannot read {target} ({storage.describe(exc)}): check the path, the endpoint "
                          "(AWS_ENDPOINT_URL) and the credentials") from None
    if is_dir:
        return SnapshotStore(target.rstrip("/") + "/snapshot.pt", retry_minutes=RETRY_MINUTES)
    return SnapshotStore(target, retry_minutes=RETRY_MINUTES)


def load_latest(target: str) -> Optional[tuple[dict, str]]:
    """(snapshot, where) of the newest snapshot at `target`, on this process alone: a DDP
    snapshot file, or an FSDP run's shards merged into the whole model (no process group).
    The snapshot has the model's state dict and the metadata (vocab, model_config,
    train_state, ...); None when there is none."""
    from mingpt_ddp.checkpoint.sharded_snapshot import is_sharded, load_full_model_state

    store = snapshot_store_for(target)
    if is_sharded(store.url):
        model_state, meta = load_full_model_state(store.url)
        return {**meta, "model": model_state}, store.display(store.path) + ".dcp"
    return store.load_latest()


def failed_check(snapshot: dict) -> Optional[str]:
    """The end-of-run check the snapshot failed (the ranks' parameters differed; its weights
    are rank 0's and may be wrong), in words; None if it failed none."""
    failed = snapshot.get("failed_check")
    if not failed:
        return None
    return str(failed.get("message") if isinstance(failed, dict) else failed)


def from_snapshot(target: str) -> Trained:
    """The newest snapshot at `target` as a Trained, or the ConfigError that says there is none."""
    found = load_latest(target)
    if found is None:
        raise ConfigError(f"no snapshot at {target}: give a snapshot file or a run directory that has one, or an "
                          "export directory")
    snapshot, where = found
    return Trained(snapshot["model_config"], snapshot["model"], tokenizer.from_snapshot(snapshot), where,
                   failed_check(snapshot))
