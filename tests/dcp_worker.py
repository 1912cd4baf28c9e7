"""A torchrun worker for tests/test_sharded_snapshot.py: a tiny FSDP2-sharded GPT that saves to,
or loads from, a ShardedSnapshotStore.

    dcp_worker.py save <snapshot_path> <out_dir> <step> [<step> ...]
        train one step before each listed step's save; after the last save, rank 0 writes
        <out_dir>/saved.pt: the full model and optimizer state that was saved last.
    dcp_worker.py load <snapshot_path> <out_dir>
        a differently initialised model loads the newest valid snapshot; rank 0 writes
        <out_dir>/loaded.pt (full states, the meta and where it came from).
    dcp_worker.py roundtrip <snapshot_path> <out_dir> <step> [<step> ...]
        save, then load (one process group for both).

Storage options come as JSON in DCP_TEST_STORAGE_OPTIONS; DCP_TEST_KEEP_LAST sets keep_last;
DCP_TEST_DELAY_AT_STEP=<step>:<seconds> turns on the store's commit-delay hook for that step's save;
DCP_TEST_FAIL_RANK_AT_STEP=<rank>:<step> makes that rank fail (alone) after writing that step's shards.
"""
import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from mingpt_ddp.distributed import shutdown
from mingpt_ddp.model import GPT, GPTConfig
from mingpt_ddp.checkpoint.sharded_snapshot import COMMIT_DELAY_ENV, ShardedSnapshotStore

CFG = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)


def build(seed: int):
    torch.manual_seed(seed)
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def train_step(model, optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step * 10 + dist.get_rank())
    x = torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=g)
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def full_states(model, optimizer) -> dict:
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optimizer": osd}


def main() -> None:
    action, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    delay_step, _, delay = os.environ.get("DCP_TEST_DELAY_AT_STEP", "-1:0").partition(":")
    options = json.loads(os.environ.get("DCP_TEST_STORAGE_OPTIONS", "{}"))
    store = ShardedSnapshotStore(path, keep_last=int(os.environ.get("DCP_TEST_KEEP_LAST", "2")),
                                 storage_options=options, collective_timeout_minutes=5)
    if action in ("save", "roundtrip"):
        store.check_writable()
        model, optimizer = build(seed=0)
        expected = None
        for step in map(int, sys.argv[4:]):
            train_step(model, optimizer, step)
            expected = copy.deepcopy(full_states(model, optimizer))  # (optimizer steps are live tensors)
            msd, osd = get_state_dict(model, optimizer)
            meta = {"train_state": {"step": step}, "world_size": dist.get_world_size(),
                    "rng": [torch.get_rng_state()] * dist.get_world_size()}
            if step == int(delay_step):
                os.environ[COMMIT_DELAY_ENV] = delay
            if f"{rank}:{step}" == os.environ.get("DCP_TEST_FAIL_RANK_AT_STEP"):
                def cannot_list(*args, **kwargs):
                    raise PermissionError("injected: this rank cannot list its files")
                store._files_of_rank = cannot_list
            handle = store.save_async(step, {"model": msd, "optimizer": osd}, meta)
            # Training goes on while the save is written: the snapshot must hold the staged
            # state, not the live one, and the loop's collectives must not mix with the save's.
            train_step(model, optimizer, step + 1000)
            error = handle.wait()
            if error is not None:
                print(f"rank {rank}: save failed: {error}", flush=True)
                shutdown(clean=True)
                sys.exit(3)
            print(f"rank {rank}: committed step {step}", flush=True)
        assert store.close() is None
        if rank == 0:
            torch.save(expected, os.path.join(out, "saved.pt"))
    if action in ("load", "roundtrip"):
        model, optimizer = build(seed=123)
        msd, osd = get_state_dict(model, optimizer)
        sharded = {"model": msd, "optimizer": osd}
        found = store.load_latest(sharded)
        assert found is not None, "no snapshot found"
        meta, where = found
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, optimizer, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"])
        states = full_states(model, optimizer)
        if rank == 0:
            torch.save({**states, "meta": meta, "where": where}, os.path.join(out, "loaded.pt"))
    shutdown(clean=True)  # the project's ordered teardown (gloo can SIGABRT at interpreter exit otherwise)


if __name__ == "__main__":
    main()
