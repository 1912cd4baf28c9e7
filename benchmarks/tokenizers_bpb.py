"""val_bpb of char against BPE at two vocabulary sizes, each in the same time budget with
char_cpu_fast's settings, on any texts (README "Tokenizers, Parquet and JSON-lines shards").

    .venv/bin/python benchmarks/tokenizers_bpb.py TEXT [TEXT ...] [--budget 0.75] [--vocab 512,2048]
        [--json out.json]
    .venv/bin/python benchmarks/tokenizers_bpb.py --python-text OUT.txt   # the "own text" below

For each text the runs go one after the other on the same cores, rotating the order per
text (so slow patches of a shared machine do not always hit the same tokenizer), each
`python mingpt_ddp/main.py experiment=char_cpu_fast data.path=TEXT data.tokenizer=...
trainer.time_budget_minutes=BUDGET` in a fresh run directory and token cache (BPE training
and encoding are part of the wall time, not of the budget). The table gives each run's final
val_loss (per token of its own tokenizer), val_bpb (bits per byte of the same validation
text, whatever the tokenizer), steps, tokens per step's worth of text, and the load average
the run saw. `--python-text` writes the first 1.1 MB of this Python's standard library
source (sorted paths): a text unlike Shakespeare, the same on any machine with this Python.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAIN = REPO / "mingpt_ddp" / "main.py"


def python_text(out: Path, limit: int = 1_100_000) -> None:
    root = sysconfig.get_paths()["stdlib"]
    written = 0
    with open(out, "w", encoding="utf-8") as f:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                try:
                    text = open(os.path.join(dirpath, name), encoding="utf-8").read()
                except (UnicodeDecodeError, OSError):
                    continue
                f.write(text)
                written += len(text)
                if written >= limit:
                    return


def run(text: str, tokenizer: list[str], budget: float, scratch: Path) -> dict:
    run_dir = scratch / f"run-{len(list(scratch.iterdir()))}"
    cmd = [sys.executable, str(MAIN), "experiment=char_cpu_fast", f"data.path={text}", *tokenizer,
           f"trainer.time_budget_minutes={budget}", f"hydra.run.dir={run_dir}", f"data.cache_dir={scratch / 'cache'}"]
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if r.get("val_loss") is not None][-1]
    steps = final["step"]
    return {"text": text, "tokenizer": " ".join(tokenizer) or "data.tokenizer=char", "val_loss": final["val_loss"],
            "val_bpb": final["val_bpb"], "val_windows": final["val_windows"], "val_bytes": final["val_bytes"],
            "steps": steps, "wall_s": wall, "load": (load_before + os.getloadavg()[0]) / 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("texts", nargs="*")
    parser.add_argument("--budget", type=float, default=0.75, help="trainer.time_budget_minutes of every run")
    parser.add_argument("--vocab", default="512,2048", help="the BPE vocabulary sizes")
    parser.add_argument("--json")
    parser.add_argument("--python-text", type=Path, help="write the Python-source text there and exit")
    args = parser.parse_args()
    if args.python_text:
        python_text(args.python_text)
        return
    choices = [[]] + [["data.tokenizer=bpe", f"data.vocab_size={v}"] for v in args.vocab.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tokenizers-bpb-") as scratch:
        for i, text in enumerate(args.texts):
            order = choices[i % len(choices):] + choices[:i % len(choices)]
            for choice in order:
                row = run(text, choice, args.budget, Path(scratch))
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| text | tokenizer | val_loss (per token) | val_bpb | steps | wall s | load avg |\n|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["text"], r["tokenizer"])):
        print(f"| {Path(r['text']).name} | {r['tokenizer']} | {r['val_loss']:.4f} | **{r['val_bpb']:.4f}** | "
              f"{r['steps']} | {r['wall_s']:.0f} | {r['load']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
