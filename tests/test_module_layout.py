"""The package's layout shows its architecture, and the import order keeps it (read statically,
lazy imports inside functions count too): the training path sits flat in mingpt_ddp/, the
checkpoint stack, the corpus and the commands off the training path in subpackages; no import
cycles; the schema does not depend on a tracker; tools use the training path, never the reverse."""
import ast
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.unit

PACKAGE = REPO / "mingpt_ddp"
SUBPACKAGES = ("checkpoint", "corpus", "tools")
MAX_TOP_LEVEL_MODULES = 20  # issue 24: a newcomer takes the training path in at a glance


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The package's modules that `path` imports: `from mingpt_ddp.x import y` counts as
    mingpt_ddp.x.y when that is a module, else as mingpt_ddp.x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mingpt_ddp":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "mingpt_ddp"}
    return found - {module_name(path)}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported_modules(path, set(found)) for name, path in found.items()}


def test_every_import_names_a_module_that_exists(graph):
    """An old flat path (mingpt_ddp.storage) would still import through nothing, or through the
    tools' command-name alias as a second copy of the module: code names the real place."""
    known = set(graph)
    wrong = sorted(f"{m} imports {dep}" for m, deps in graph.items() for dep in deps if dep not in known)
    assert not wrong, wrong


def test_no_import_cycles_between_modules(graph):
    # A package imports nothing of its own modules here, so an edge to it is an edge to its __init__.
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


def test_at_most_twenty_modules_directly_in_the_package():
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules in mingpt_ddp/: {top}"
    for sub in SUBPACKAGES:
        init = PACKAGE / sub / "__init__.py"
        assert init.is_file(), f"mingpt_ddp/{sub}/ is not a package"
        assert ast.get_docstring(ast.parse(init.read_text())), f"mingpt_ddp/{sub}/__init__.py says not what it is for"


def test_the_schema_does_not_depend_on_a_tracker(graph):
    assert "mingpt_ddp.loggers" not in graph["mingpt_ddp.config"]


def test_no_tool_imports_main(graph):
    offenders = sorted(m for m, deps in graph.items() if m.startswith("mingpt_ddp.tools.") and "mingpt_ddp.main" in deps)
    assert not offenders, f"tools importing mingpt_ddp.main (move what they need to the training path): {offenders}"


def test_the_training_path_does_not_import_tools(graph):
    offenders = sorted(f"{m} imports {dep}" for m, deps in graph.items() if not m.startswith("mingpt_ddp.tools")
                       for dep in deps if dep == "mingpt_ddp.tools" or dep.startswith("mingpt_ddp.tools."))
    assert not offenders, offenders
