"""Bits per byte where people read results: the sweep summary and the plot."""
import csv
import json
import struct

import pytest

from mingpt_ddp.tools import sweep
from mingpt_ddp.tools.plot import plot_runs

pytestmark = pytest.mark.unit


def fake_point(directory, override, val_bpb):
    directory.mkdir(parents=True)
    (directory / ".hydra").mkdir()
    (directory / ".hydra" / "overrides.yaml").write_text(f"- {override}\n- trainer.max_steps=20\n")
    records = [{"step": 10, "epoch": 0, "train_loss": 3.0, "lr": 1e-3, "tokens_per_s": 1000.0},
               {"step": 10, "epoch": 0, "val_loss": 2.9, **({"val_bpb": val_bpb + 0.5} if val_bpb else {})},
               {"step": 20, "epoch": 0, "train_loss": 2.5, "lr": 1e-3, "tokens_per_s": 1100.0},
               {"step": 20, "epoch": 0, "val_loss": 2.4, **({"val_bpb": val_bpb} if val_bpb else {})}]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    sweep.write_result(str(directory), {"status": "completed", "val_loss": 2.4, "wall_s": 3.0, "snapshot": "s",
                                        "error": ""})


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_the_sweep_summary_has_each_points_final_val_bpb(tmp_path):
    pytest.importorskip("matplotlib")
    fake_point(tmp_path / "0", "data.tokenizer=char", 2.25)
    fake_point(tmp_path / "1", "data.tokenizer=bpe", 1.75)
    fake_point(tmp_path / "2", "data.tokenizer=gpt2", None)  # a run from before val_bpb
    markdown = sweep.write_summary(str(tmp_path))
    with open(tmp_path / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["final_val_bpb"] for r in rows] == ["2.25", "1.75", ""]
    assert "| final_val_bpb |" in markdown and "| 2.2500 |" in markdown and "| 1.7500 |" in markdown
    # the plot has a bits-per-byte panel: taller than the two-panel figure
    width, height = png_size(tmp_path / "losses.png")
    (tmp_path / "0" / "metrics.jsonl").write_text(
        "\n".join(line for line in (tmp_path / "0" / "metrics.jsonl").read_text().splitlines()
                  if "val_bpb" not in line) + "\n")
    without = plot_runs(tmp_path / "0", tmp_path / "without.png")
    assert height > png_size(without)[1] and width == png_size(without)[0]
