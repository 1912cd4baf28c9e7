"""Hydra multirun: one result file per sweep point, and a summary of the whole sweep.

Every point runs in its own directory (``<sweep dir>/<job number>``) with its own snapshot.
Rank 0 writes ``result.json`` there when the point ends; after the last point, the
:class:`SweepSummary` callback (registered in conf/config.yaml) collects the results and
the metrics into ``summary.csv`` and ``summary.md`` in the sweep directory, with a plot
of every point's losses when matplotlib is installed, and prints the table.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import statistics
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from mingpt_ddp.checkpoint import storage
from mingpt_ddp.tools.plot import plot_runs
from mingpt_ddp.tools.runs import RESULT_FILE, distinguishing_overrides, read_metrics, read_result, sweep_points

log = logging.getLogger(__name__)

# val_bpb: the validation loss in bits per byte of text, which compares points with
# different tokenizers (val_loss is per token of each point's own tokenizer).
COLUMNS = ["point", "overrides", "status", "final_train_loss", "final_val_loss", "best_val_loss",
           "final_val_bpb", "tokens_per_s", "wall_s", "snapshot", "error"]


def write_result(run_dir: str, record: dict[str, Any]) -> None:
    """Atomically record how a point ended (rank 0 only), through the one secrets boundary: a
    snapshot URL or error may carry a presigned query or a user:password."""
    record = {k: storage.redact(v) if isinstance(v, str) else v for k, v in record.items()}
    path = Path(run_dir) / RESULT_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def point_row(run_dir: Path, overrides: str) -> dict[str, Any]:
    """One summary row: the point's result file plus figures from its metrics."""
    result = read_result(run_dir)
    metrics = read_metrics(run_dir)
    train = [m["train_loss"] for m in metrics if "train_loss" in m]
    val = [m["val_loss"] for m in metrics if m.get("val_loss") is not None]
    # the best since the last data.continue_on_new_corpus: losses before it are another split's
    since = max((i for i, m in enumerate(metrics) if m.get("event") == "new corpus"), default=-1)
    best = [m["val_loss"] for m in metrics[since + 1:] if m.get("val_loss") is not None]
    bpb = [m["val_bpb"] for m in metrics if m.get("val_bpb") is not None]
    speed = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m]
    return {
        "point": run_dir.name,
        "overrides": overrides,
        "status": result.get("status", "unfinished"),
        "final_train_loss": train[-1] if train else None,
        "final_val_loss": val[-1] if val else None,
        "best_val_loss": min(best) if best else None,
        "final_val_bpb": bpb[-1] if bpb else None,
        "tokens_per_s": statistics.median(speed) if speed else None,
        "wall_s": result.get("wall_s"),
        "snapshot": result.get("snapshot"),
        "error": result.get("error", ""),
    }


_FORMATS = {"final_train_loss": "{:.4f}", "final_val_loss": "{:.4f}", "best_val_loss": "{:.4f}",
            "final_val_bpb": "{:.4f}", "tokens_per_s": "{:,.0f}", "wall_s": "{:.1f}"}


def _fmt(column: str, value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    text = _FORMATS[column].format(value) if column in _FORMATS else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def write_summary(sweep_dir: str) -> str:
    """Write summary.csv, summary.md (and losses.png when possible); return the Markdown."""
    root = Path(sweep_dir)
    points = sweep_points(root)
    labels = distinguishing_overrides(points) if points else {}
    rows = [point_row(p, labels[p]) for p in points]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    (root / "summary.csv").write_text(buf.getvalue())
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(c, r[c]) for c in COLUMNS) + " |" for r in rows]
    markdown = f"# Sweep {root.name}\n\n" + "\n".join(lines) + "\n"
    plot_note = _try_plot(root)
    if plot_note:
        markdown += f"\n{plot_note}\n"
    (root / "summary.md").write_text(markdown)
    return markdown


def _try_plot(root: Path) -> Optional[str]:
    try:
        png = plot_runs(root, root / "losses.png")
    except ImportError:
        return "(install the `plot` extra, matplotlib, for a plot of the losses)"
    except FileNotFoundError:  # every point failed before its first metrics line
        return "(no point logged a loss to plot)"
    return f"![losses]({png.name})"


class SweepSummary(Callback):
    """Hydra callback: after the last point, rank 0 writes and prints the sweep summary."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if int(os.environ.get("RANK", "0")) != 0:
            return
        sweep_dir = config.hydra.sweep.dir
        if not Path(sweep_dir).is_dir():
            return
        markdown = write_summary(sweep_dir)
        print(markdown, flush=True)
        log.info("sweep summary written to %s/summary.md and summary.csv", sweep_dir)
