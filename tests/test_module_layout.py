"""The package's modules import each other without cycles (lazy imports inside functions
count too): each module can be read, tested and replaced on its own."""
import ast
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.unit

PACKAGE = REPO / "mingpt_ddp"


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "mingpt_ddp":
                found |= {alias.name for alias in node.names}
            elif node.module.startswith("mingpt_ddp."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("mingpt_ddp.")}
    return found - {path.stem}


def test_no_import_cycles_between_modules():
    graph = {p.stem: imported_modules(p) for p in PACKAGE.glob("*.py")}
    cycles = []

    def visit(module, trail):
        for dep in sorted(graph.get(module, ())):
            if dep in trail:
                cycles.append(trail[trail.index(dep):] + [dep])
            elif dep not in done:
                visit(dep, trail + [dep])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        visit(module, [module])
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)
