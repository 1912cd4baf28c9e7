"""Reading what runs left on disk: metrics, overrides and the points of a sweep.

Shared by sweep.py (the summary) and plot.py (the figure), so that neither imports the other.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

RESULT_FILE = "result.json"  # how a sweep point ended, written by rank 0 (sweep.write_result)


# The result file's fields and their types (sweep.write_result, from main.py); each may be null.
RESULT_TYPES: dict[str, tuple[type, ...]] = {"status": (str,), "val_loss": (int, float), "wall_s": (int, float),
                                             "snapshot": (str,), "error": (str,), "corpus": (dict,)}


def read_result(run_dir: Union[str, Path]) -> dict[str, Any]:
    """How a sweep point ended, from its result file; {} when there is none (or it is
    unreadable). A field of another type (a file edited by hand, or another version's) is left
    out: the summary at a sweep's end must not fail on it."""
    try:
        result = json.loads((Path(run_dir) / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(result, dict):
        return {}
    return {k: v for k, v in result.items() if k not in RESULT_TYPES or v is None
            or (isinstance(v, RESULT_TYPES[k]) and not isinstance(v, bool))}


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def overrides_of(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    return [line[2:].strip() for line in path.read_text().splitlines() if line.startswith("- ")]


def distinguishing_overrides(run_dirs: list[Path]) -> dict[Path, str]:
    """Each point's overrides minus those every point shares: what the sweep varied."""
    per_run = {d: overrides_of(d) for d in run_dirs}
    shared = set.intersection(*(set(o) for o in per_run.values())) if len(per_run) > 1 else set()
    return {d: " ".join(o for o in overrides if o not in shared) for d, overrides in per_run.items()}


def sweep_points(sweep_dir: Path) -> list[Path]:
    """The point directories of a sweep, in job order."""
    points = [p for p in sweep_dir.iterdir() if p.is_dir() and ((p / RESULT_FILE).exists() or (p / ".hydra").exists()
                                                                or (p / "metrics.jsonl").exists())]
    return sorted(points, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))
