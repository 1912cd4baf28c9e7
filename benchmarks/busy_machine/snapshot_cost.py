"""A snapshot's cost on CPU: the host copy the step waits for (BackgroundSaver.submit) and the
background write (submit -> wait), for a few model sizes; overhead at an interval."""
import os, sys, tempfile, time, resource
import torch
from mingpt_ddp.model import GPT, GPTConfig
from mingpt_ddp.checkpoint.snapshot import SnapshotStore, BackgroundSaver
from mingpt_ddp import config as mconfig

SIZES = {"gpt-nano": (3, 3, 48), "gpt-mini (default)": (6, 6, 192), "gopher-44m": (8, 16, 512),
         "gpt2 (124M)": (12, 12, 768)}
vocab = {"gpt2 (124M)": 50257}
minutes = mconfig.snapshot_every_minutes(type("T", (), {"snapshot_every_minutes": None})(), "cpu")
print(f"trainer.snapshot_every_minutes=null on CPU -> {minutes} minutes", flush=True)
for name, (l, h, e) in SIZES.items():
    if os.environ.get("SKIP_BIG") and "gpt2" in name:
        continue
    m = GPT(GPTConfig(vocab_size=vocab.get(name, 65), block_size=128 if "gpt2" not in name else 1024,
                      n_layer=l, n_head=h, n_embd=e))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    with tempfile.TemporaryDirectory(dir=os.environ.get("SAVE_DIR", "/tmp")) as d:
        saver = BackgroundSaver(SnapshotStore(os.path.join(d, "snapshot.pt")))
        copies, writes, cpus = [], [], []
        for step in range(1, 4):
            state = {"model": m.state_dict(), "optimizer": opt.state_dict(), "train_state": {"step": step}}
            cpu0 = time.thread_time()
            t0 = time.perf_counter()
            saver.submit(state, step)
            t1 = time.perf_counter()
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            assert saver.wait() is None
            t2 = time.perf_counter()
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            copies.append(t1 - t0); writes.append(t2 - t1)
            cpus.append(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime)
        size = os.path.getsize(saver.last_saved) if saver.last_saved and os.path.exists(saver.last_saved) else 0
    c, w, cpu = min(copies), min(writes), min(cpus)
    params = sum(p.numel() for p in m.parameters())
    line = (f"{name:20s} {params/1e6:7.2f} M params, file {size/2**20:7.1f} MiB: host copy (step waits) {c*1e3:8.1f} ms, "
            f"background write {w*1e3:8.1f} ms (CPU {cpu*1e3:7.1f} ms)")
    if minutes:
        line += f"; overhead at {minutes:g} min: {100*(c + w)/(60*minutes):.3f}% (copy+write, as if the write stopped training)"
    print(line, flush=True)
