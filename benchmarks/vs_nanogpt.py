"""Our fast CPU recipe against nanoGPT's README CPU recipe, side by side, on any texts.

    .venv/bin/python benchmarks/vs_nanogpt.py --nanogpt PATH/TO/nanoGPT TEXT [TEXT ...]
        [--ours "experiment=char_cpu_fast"] [--repeats 1] [--json out.json]
    .venv/bin/python benchmarks/vs_nanogpt.py --nanogpt PATH/TO/nanoGPT --loop TEXT

`--loop` compares the training loops instead: tokens/s of nanoGPT's train.py and of our
`bench train` on the same model, block and batch (median step time of each, one after the
other), for the cases in LOOP_CASES.

For each text, in one run and one after the other on the same cores:

1. nanoGPT (a checkout of github.com/karpathy/nanoGPT, copied to a temp dir, never
   modified) trains with the README's CPU command (4L/128d, block 64, batch 12, 2000 iters)
   on the same contiguous split as ours (last 10% validation, one id per character). Its
   time to its final loss is the wall time from launching `train.py` to its `step 2000`
   line; its final loss is then measured on the whole validation split, in windows of 64,
   exactly as our final evaluation does (its own 20-batch estimate is noisy).
2. Ours: `python mingpt_ddp/main.py <--ours overrides> data.path=TEXT`, wall time from
   launch to exit (imports, encoding the text, training, the final evaluation), and the
   final validation loss from the run's result file.

The table gives both losses, both times and ours/nanoGPT's time: the recipe's target is
that our loss is at most nanoGPT's (or `--target`'s) in at most half its time. `--fraction 0.5` asks exactly
that: ours gets `trainer.time_budget_minutes` = 0.5 x nanoGPT's measured time less
`--startup` seconds, and its wall time (start-up included) is what the table compares. nanoGPT's loss curve still
falls at iter 2000, so its time to reach its final loss is its whole run.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
README_CPU_RECIPE = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                     "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                     "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
BLOCK = 64


def split_ids(text: str) -> tuple[np.ndarray, np.ndarray, dict]:
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n_val = int(len(ids) * 0.1)  # as data.val_fraction=0.1: the last 10%, contiguous
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}
    return ids[: len(ids) - n_val], ids[len(ids) - n_val :], meta


def full_val_loss(model: torch.nn.Module, val: np.ndarray, batch: int = 64) -> float:
    """Mean loss over every non-overlapping window of BLOCK in the split (as our evaluate)."""
    tokens = torch.from_numpy(val.astype(np.int64))
    n = (len(tokens) - 1) // BLOCK
    starts = torch.arange(n) * BLOCK
    cols = torch.arange(BLOCK + 1)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for chunk in starts.split(batch):
            w = tokens[chunk[:, None] + cols]
            _, loss = model(w[:, :-1].contiguous(), w[:, 1:].contiguous())
            total += loss.item() * len(chunk)
            count += len(chunk)
    return total / count


def prepare_nanogpt(nanogpt: Path, text: str, scratch: Path) -> Path:
    """A fresh copy of the checkout with `text` as its dataset `bench` (our split)."""
    work = scratch / "nanogpt"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(nanogpt, work, ignore=shutil.ignore_patterns(".git", "assets", "data"))
    data_dir = work / "data" / "bench"
    data_dir.mkdir(parents=True)
    train, val, meta = split_ids(text)
    train.tofile(data_dir / "train.bin")
    val.tofile(data_dir / "val.bin")
    with open(data_dir / "meta.pkl", "wb") as f:
        pickle.dump(meta, f)
    return work


def run_nanogpt(nanogpt: Path, text: str, scratch: Path) -> dict:
    work = prepare_nanogpt(nanogpt, text, scratch)
    _, val, _ = split_ids(text)
    cmd = [sys.executable, "train.py", *README_CPU_RECIPE, "--dataset=bench", "--out_dir=out",
           "--always_save_checkpoint=True"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reached, estimate = None, None
    for line in proc.stdout:
        if line.startswith("step 2000:"):
            reached = time.perf_counter() - start
            estimate = float(line.rsplit("val loss", 1)[1])
    if proc.wait() != 0 or reached is None:
        raise SystemExit(f"nanoGPT failed on this text (exit {proc.returncode})")
    sys.path.insert(0, str(work))
    try:
        from model import GPT, GPTConfig  # nanoGPT's own model.py, from the copy
        ckpt = torch.load(work / "out" / "ckpt.pt", map_location="cpu", weights_only=False)
        model = GPT(GPTConfig(**ckpt["model_args"]))
        model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()})
        loss = full_val_loss(model, val)
    finally:
        sys.path.remove(str(work))
        sys.modules.pop("model", None)
    return {"seconds": reached, "val_loss": loss, "val_loss_20_batch_estimate": estimate}


def run_ours(text_path: str, overrides: list[str], scratch: Path) -> dict:
    run_dir = scratch / f"ours-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(REPO / "mingpt_ddp" / "main.py"), *overrides, f"data.path={os.path.abspath(text_path)}",
           f"data.cache_dir={scratch / 'cache'}", f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"our run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if "val_loss" in r][-1]
    return {"seconds": seconds, "val_loss": final["val_loss"], "steps": final["step"]}


LOOP_CASES = [  # (label, layers, heads, dims, block, batch, our precision, steps); nanoGPT: fp32 on CPU
    ("4L/128d block 64 batch 12", 4, 4, 128, 64, 12, "fp32", 60),
    ("6L/384d block 256 batch 16", 6, 6, 384, 256, 16, "bf16", 25),
    ("6L/384d block 256 batch 16", 6, 6, 384, 256, 16, "auto", 25),
]


def nanogpt_loop_tokens_per_s(nanogpt: Path, text: str, scratch: Path, case: tuple) -> float:
    _, layers, heads, dims, block, batch, _, iters = case
    work = prepare_nanogpt(nanogpt, text, scratch)
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
           "--dataset=bench", "--out_dir=out", f"--n_layer={layers}", f"--n_head={heads}", f"--n_embd={dims}",
           f"--block_size={block}", f"--batch_size={batch}", f"--max_iters={iters}", "--eval_interval=100000",
           "--eval_iters=1", "--log_interval=1", "--dropout=0.0"]
    out = subprocess.run(cmd, cwd=work, capture_output=True, text=True, check=True).stdout
    ms = [float(m) for n, m in re.findall(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", out, re.M) if int(n) >= 5]
    return batch * block / (statistics.median(ms) / 1000)


def our_loop_tokens_per_s(text_path: str, scratch: Path, case: tuple) -> tuple[float, str]:
    _, layers, heads, dims, block, batch, prec, steps = case
    out = scratch / f"bench-{time.monotonic_ns()}.json"
    cmd = [sys.executable, "-m", "mingpt_ddp.bench", "train", f"model.n_layer={layers}", f"model.n_head={heads}",
           f"model.n_embd={dims}", "model.dropout=0.0", f"data.block_size={block}", f"trainer.batch_size={batch}",
           f"trainer.precision={prec}", f"data.path={os.path.abspath(text_path)}", f"data.cache_dir={scratch / 'cache'}",
           f"steps={steps}", "warmup=3", f"out={out}"]
    subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, check=True)
    r = json.loads(out.read_text())
    return batch * block / (r["ms_per_step_median"] / 1000), r["precision"]


def fraction_for(spec: str | None, path: str) -> float | None:
    """`--fraction` (or `--target`) for this text: 'F' for all, or 'name=F,...,F' with a default last."""
    if not spec:
        return None
    default = None
    for part in spec.split(","):
        name, eq, value = part.rpartition("=")
        if not eq:
            default = float(value)
        elif name == os.path.basename(path):
            return float(value)
    return default


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("texts", nargs="+")
    p.add_argument("--nanogpt", required=True, type=Path, help="a checkout of karpathy/nanoGPT")
    p.add_argument("--ours", default="experiment=char_cpu_fast", help="our overrides, space-separated")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--fraction", default=None,
                   help="give ours a time budget of this fraction of nanoGPT's measured time, less --startup: "
                        "'0.5' or per text 'tinyshakespeare.txt=0.4,0.5'")
    p.add_argument("--startup", type=float, default=6.0,
                   help="seconds of our start-up (imports, data, model) outside the time budget")
    p.add_argument("--target", default=None,
                   help="the loss ours must reach, per text ('tinyshakespeare.txt=1.886'); default nanoGPT's")
    p.add_argument("--ours-only", action="store_true", help="run ours alone (no nanoGPT, no budget)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--loop", action="store_true", help="compare loop throughput instead (first text)")
    args = p.parse_args()
    if args.loop:
        with tempfile.TemporaryDirectory() as tmp:
            text = Path(args.texts[0]).read_text(encoding="utf-8")
            print(f"{'case':<30}{'ours':>6}{'ours tok/s':>12}{'nanoGPT fp32 tok/s':>20}{'ratio':>7}")
            for case in LOOP_CASES:
                theirs = nanogpt_loop_tokens_per_s(args.nanogpt, text, Path(tmp), case)
                ours, used = our_loop_tokens_per_s(args.texts[0], Path(tmp), case)
                print(f"{case[0]:<30}{case[6] + ('->' + used if case[6] == 'auto' else ''):>6}{ours:>12,.0f}"
                      f"{theirs:>20,.0f}{ours / theirs:>7.2f}", flush=True)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for path in args.texts:
            text = Path(path).read_text(encoding="utf-8")
            for _ in range(args.repeats):
                overrides = args.ours.split()
                if args.ours_only:
                    ours = run_ours(path, overrides, scratch)
                    rows.append({"text": os.path.basename(path), "ours_val": ours["val_loss"], "ours_s": ours["seconds"],
                                 "ours_steps": ours["steps"], "ours": args.ours})
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                theirs = run_nanogpt(args.nanogpt, text, scratch)
                print(f"{path}: nanoGPT {json.dumps(theirs)}", flush=True)
                fraction = fraction_for(args.fraction, path)
                if fraction is not None:
                    budget_s = fraction * theirs["seconds"] - args.startup
                    overrides.append(f"trainer.time_budget_minutes={budget_s / 60:.4f}")
                ours = run_ours(path, overrides, scratch)
                target = fraction_for(args.target, path) or theirs["val_loss"]
                row = {"text": os.path.basename(path), "chars": len(text), "vocab": len(set(text)),
                       "nanogpt_val": theirs["val_loss"], "nanogpt_s": theirs["seconds"], "target": target,
                       "ours_val": ours["val_loss"], "ours_s": ours["seconds"], "ours_steps": ours["steps"],
                       "time_ratio": ours["seconds"] / theirs["seconds"], "fraction_given": fraction,
                       "reached": ours["val_loss"] <= target, "ours": args.ours}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.ours_only:
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        return
    print(f"\n{'text':<22}{'vocab':>6}{'nanoGPT val':>12}{'s':>8}{'target':>8}{'ours val':>10}{'s':>8}{'ratio':>7}  reached")
    for r in rows:
        print(f"{r['text']:<22}{r['vocab']:>6}{r['nanogpt_val']:>12.4f}{r['nanogpt_s']:>8.1f}{r['target']:>8.4f}"
              f"{r['ours_val']:>10.4f}{r['ours_s']:>8.1f}{r['time_ratio']:>7.2f}  {'yes' if r['reached'] else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
