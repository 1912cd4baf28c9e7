"""Plot losses and throughput of one run or of every point of a sweep.

    python -m mingpt_ddp.plot <run dir | sweep dir> [out.png]

Reads each run's metrics.jsonl; writes one PNG with train and validation loss against
step (top), the validation loss in bits per byte (middle: the one that compares runs
with different tokenizers) and tokens/s (bottom). Needs matplotlib: ``pip install -e '.[plot]'``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from mingpt_ddp.errors import ConfigError
from mingpt_ddp.tools import usage
from mingpt_ddp.tools.runs import distinguishing_overrides, read_metrics, sweep_points

USAGE = "usage: python -m mingpt_ddp.plot <run dir | sweep dir> [out.png]"


def runs_in(target: Path) -> list[Path]:
    """A run directory is itself; a sweep directory holds one per point."""
    if (target / "metrics.jsonl").exists():
        return [target]
    return [p for p in sweep_points(target) if (p / "metrics.jsonl").exists()]


def _last_per_step(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Values by step; a step logged twice (replayed after a restart) keeps its last value."""
    by_step = {r["step"]: r[key] for r in records if r.get(key) is not None}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_runs(target: Path, out: Optional[Path] = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = runs_in(target)
    if not runs:
        raise FileNotFoundError(f"no metrics.jsonl in {target} or its sweep points")
    out = out or target / "losses.png"
    metrics = {run: read_metrics(run) for run in runs}
    with_bpb = any(r.get("val_bpb") is not None for records in metrics.values() for r in records)
    fig, axes = plt.subplots(3 if with_bpb else 2, 1, figsize=(10, 10 if with_bpb else 8), sharex=True,
                             gridspec_kw={"height_ratios": [3, 2, 1] if with_bpb else [3, 1]})
    ax_loss, ax_speed = axes[0], axes[-1]
    labels = distinguishing_overrides(runs)
    for i, run in enumerate(runs):
        records = metrics[run]
        label = f"{run.name}: {labels[run]}" if len(runs) > 1 else (labels[run] or run.name)
        color = f"C{i % 10}"
        steps, train = _last_per_step(records, "train_loss")
        ax_loss.plot(steps, train, color=color, alpha=0.5, linewidth=1)
        steps, val = _last_per_step(records, "val_loss")
        ax_loss.plot(steps, val, color=color, marker="o", linewidth=2, label=label)
        if with_bpb:
            steps, bpb = _last_per_step(records, "val_bpb")
            axes[1].plot(steps, bpb, color=color, marker="o", linewidth=2)
        steps, speed = _last_per_step(records, "tokens_per_s")
        ax_speed.plot(steps, speed, color=color, linewidth=1)
    ax_loss.set_ylabel("loss (nats/token)")
    if with_bpb:
        axes[1].set_ylabel("validation bits/byte")
        axes[1].grid(alpha=0.3)
    ax_loss.set_title(f"{target.name}\ntrain loss (thin lines), validation loss (dots)", fontsize=10)
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8, loc="upper right")
    ax_speed.set_ylabel("tokens/s (all ranks)")
    ax_speed.set_xlabel("optimizer step")
    ax_speed.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def cli(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        _, argv = usage.options(argv, __doc__, USAGE)
        if not 1 <= len(argv) <= 2:
            raise ConfigError(f"give a run or sweep directory ({USAGE})")
        out = plot_runs(Path(argv[0]), Path(argv[1]) if len(argv) == 2 else None)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(ConfigError.exit_code)
    except ImportError:
        print("error: plotting needs matplotlib: pip install -e '.[plot]'", file=sys.stderr)
        raise SystemExit(2)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2)
    print(out)


if __name__ == "__main__":
    cli()
