"""Every CPU figure of the README's recipes, natively and as an AVX2-only CPU, in one command.

    .venv/bin/python benchmarks/cpu_recipes.py --nanogpt PATH/TO/nanoGPT [--shakespeare FILE]
        [--texts DIR] [--others python,german,man,logs] [--modes native,avx2] [--skip-precision]
        [--repeats 1] [--json out.json]

For each mode (`native`: this CPU as it is; `avx2`: torch, oneDNN and MKL limited to AVX2
with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2, which
makes a CPU with AVX-512/AMX run like an AVX2-only one, bf16 emulated), one after the other:

1. `python -m mingpt_ddp.bench precision models=all`: fp32 and bf16 speed per preset and
   what trainer.precision=auto decides, and in how many seconds (cold cache);
2. `benchmarks/vs_nanogpt.py`: nanoGPT's README CPU recipe against experiment=char_cpu_fast
   on each text, side by side (ours gets 0.4x nanoGPT's measured time on tiny-shakespeare,
   0.5x on the others; the issue's targets), then experiment=shakespeare_char_cpu once.

The texts: tiny-shakespeare (`--shakespeare`, default ../shared/data/tinyshakespeare.txt or
data/tinyshakespeare.txt, downloaded there as the quick start does when missing) and four ~1 MB texts unlike it, built by benchmarks/texts.py into
`--texts` (default: a temporary directory). Everything printed names the CPU's flags, the
load (uptime) before and after, the torch version and the commit.
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
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
FRACTIONS = "tinyshakespeare.txt=0.4,0.5"
TARGETS = "tinyshakespeare.txt=1.886"


def machine() -> str:
    flags = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma"))))
                break
    except OSError:
        pass
    import platform

    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return (f"CPU: {name}, {len(os.sched_getaffinity(0))} cores; flags: {flags}\n"
            f"torch {torch.__version__}, commit {commit.strip()}{' (uncommitted changes)' if dirty.strip() else ''}")


def uptime() -> str:
    try:
        return "load average " + open("/proc/loadavg").read().split(" 3 ")[0].rsplit(" ", 2)[0]
    except OSError:
        return "load average unknown"


def run(cmd: list[str], env: dict[str, str]) -> None:
    print("$ " + " ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "") + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env}, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", required=True, type=Path, help="a checkout of karpathy/nanoGPT")
    p.add_argument("--shakespeare", type=Path, default=None)
    p.add_argument("--texts", type=Path, default=None, help="where to build the other texts (default: a temp dir)")
    p.add_argument("--modes", default="native,avx2")
    p.add_argument("--skip-precision", action="store_true", help="leave out the bench precision tables")
    p.add_argument("--others", default="python,german,man,logs", help="which of benchmarks/texts.py's texts")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", type=Path, help="also write every row here")
    args = p.parse_args()
    shakespeare = args.shakespeare or next(
        (c for c in (REPO.parent / "shared" / "data" / "tinyshakespeare.txt", REPO / "data" / "tinyshakespeare.txt")
         if c.is_file()), None)
    if shakespeare is None:  # as the quick start does: the preset's own path, downloaded once
        try:
            run([sys.executable, "-m", "mingpt_ddp.prepare", "data.path=data/tinyshakespeare.txt"], {})
        except subprocess.CalledProcessError:
            raise SystemExit("no tiny-shakespeare (see the error above): pass --shakespeare FILE") from None
        shakespeare = REPO / "data" / "tinyshakespeare.txt"
    print(machine())
    with tempfile.TemporaryDirectory() as tmp:
        texts = args.texts or Path(tmp) / "texts"
        run([sys.executable, "benchmarks/texts.py", str(texts)], {})
        named = Path(tmp) / "tinyshakespeare.txt"
        named.write_bytes(shakespeare.read_bytes())
        paths = [str(named), *(str(texts / f"{n}.txt") for n in args.others.split(",") if n)]
        results = {}
        for mode in args.modes.split(","):
            env = AVX2_ENV if mode == "avx2" else {}
            print(f"\n######## {mode}: {uptime()} ########", flush=True)
            if not args.skip_precision:
                run([sys.executable, "-m", "mingpt_ddp.bench", "precision", "models=all", "avx2=false",
                     f"data.path={named}", f"out={Path(tmp) / f'precision-{mode}.json'}"], env)
            out = Path(tmp) / f"vs-{mode}.json"
            run([sys.executable, "benchmarks/vs_nanogpt.py", "--nanogpt", str(args.nanogpt), *paths,
                 "--fraction", FRACTIONS, "--target", TARGETS, "--repeats", str(args.repeats), "--json", str(out)], env)
            taste = Path(tmp) / f"taste-{mode}.json"
            run([sys.executable, "benchmarks/vs_nanogpt.py", "--nanogpt", str(args.nanogpt), str(named), "--ours-only",
                 "--ours", "experiment=shakespeare_char_cpu", "--json", str(taste)], env)
            results[mode] = {"vs_nanogpt": json.loads(out.read_text()), "shakespeare_char_cpu": json.loads(taste.read_text())}
            print(f"######## {mode} done: {uptime()} ########", flush=True)
    print("\n" + machine())
    for mode, r in results.items():
        print(f"\n{mode}: experiment=char_cpu_fast against nanoGPT's README CPU recipe")
        print(f"{'text':<22}{'nanoGPT val':>12}{'s':>8}{'target':>8}{'ours val':>10}{'s':>8}{'ratio':>7}  reached")
        for row in r["vs_nanogpt"]:
            print(f"{row['text']:<22}{row['nanogpt_val']:>12.4f}{row['nanogpt_s']:>8.1f}{row['target']:>8.4f}"
                  f"{row['ours_val']:>10.4f}{row['ours_s']:>8.1f}{row['time_ratio']:>7.2f}  "
                  f"{'yes' if row['reached'] else 'NO'}")
        for row in r["shakespeare_char_cpu"]:
            print(f"experiment=shakespeare_char_cpu: val {row['ours_val']:.4f} in {row['ours_s']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
