"""How long `trainer.precision=auto` takes to decide on each preset, first run, cold cache.

    .venv/bin/python benchmarks/auto_decision.py [--models gpt-nano,experiment=char_cpu_fast]

Each decision runs in a fresh process (kernels set up inside the decision, as at a real
start), natively and under the AVX2 emulation (bench.AVX2_ENV) alternated preset by
preset, at the preset's default batch and block (vocabulary 65). `bench precision` times
the decision too, but after its own passes have set the kernels up.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def decide(entry: str) -> dict:
    """One decision in this process, with a cache of its own."""
    import torch

    from mingpt_ddp.tools import bench
    from mingpt_ddp import precision
    from mingpt_ddp.model import GPT, GPTConfig

    cfg = bench.compose([entry if "=" in entry else f"model={entry}", "trainer.precision=fp32"])
    m, batch, block = cfg.model, cfg.trainer.batch_size, cfg.data.block_size
    model = GPT(GPTConfig(vocab_size=65, block_size=block, n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd,
                          dropout=m.dropout))
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        cache = os.path.join(scratch, "precision.json")
        started = time.perf_counter()
        choice = precision.measured_cpu_choice(model, batch, block, cache)
        seconds = time.perf_counter() - started
        entries = json.loads(Path(cache).read_text()) if os.path.exists(cache) else {}
    why = next(iter(entries.values()))["why"] if entries else "cut short by the deadline (not cached)"
    return {"config": entry, "shape": f"{m.n_layer}L/{m.n_embd}d", "batch_x_block": f"{batch}x{block}",
            "capability": torch.backends.cpu.get_cpu_capability(), "choice": choice, "seconds": round(seconds, 2),
            "load": round(load, 2), "why": why}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help="presets and experiments (default: bench's PRECISION_TABLE)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(decide(args.child)))
        return
    from mingpt_ddp.tools.bench import AVX2_ENV, PRECISION_TABLE

    rows = []
    for entry in args.models.split(",") if args.models else PRECISION_TABLE:
        for env in ({}, AVX2_ENV):
            out = subprocess.run([sys.executable, __file__, "--child", entry], cwd=REPO, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(REPO), **env}, check=True).stdout
            rows.append({**json.loads(out.splitlines()[-1]), "mode": "emulated AVX2" if env else "native"})
            r = rows[-1]
            print(f"{r['config']:<34}{r['shape']:>10}{r['batch_x_block']:>8}  {r['mode']:<14}{r['capability']:<7}"
                  f"{r['choice']:<5}{r['seconds']:>6.2f} s  load {r['load']:<5}  {r['why'][:70]}", flush=True)
    # By mode, not by the capability torch reports: on an AVX2-only CPU both modes report AVX2.
    print("longest: native %.2f s, emulated AVX2 %.2f s" % tuple(
        max(r["seconds"] for r in rows if r["mode"] == mode) for mode in ("native", "emulated AVX2")))


if __name__ == "__main__":
    main()
