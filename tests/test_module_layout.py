"""The package's layout keeps its architecture: no import cycles, a flat training path of at
most 20 modules, the schema free of trackers, and tools off the training path."""
import ast
import os
import re
import subprocess
import sys
import tomllib

import pytest

from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "mingpt_ddp"
TOOLS = ("bench", "sample", "export", "plot", "preflight", "prepare", "network", "torchrun", "devices")


def documented_tools() -> set[str]:
    """The `-m mingpt_ddp.<name>` commands that the docs, launch/, benchmarks/ and the package's
    own messages show, where <name> is not a module of the package itself (so: a tool's old name)."""
    sources = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "launch").iterdir(),
               *(REPO / "benchmarks").iterdir(), *PACKAGE.rglob("*.py")]
    found = set()
    for path in filter(Path.is_file, sources):
        found |= set(re.findall(r"-m[\"',\s]+mingpt_ddp\.(\w+)\b(?!\.)", path.read_text(errors="replace")))
    return {name for name in found if not (PACKAGE / f"{name}.py").is_file()}


def module_name(path):
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules():
    return {module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def imports_of(path, known):
    """The package's modules that `path` imports (at any depth: lazy imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return {name: imports_of(path, known) - {name} for name, path in known.items()}


def cycle(graph):
    """One import cycle between the package's modules (their __init__s left out), or None."""
    edges = {m: {d for d in deps if not PACKAGE.joinpath(*d.split(".")[1:], "__init__.py").exists()}
             for m, deps in graph.items()}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.mark.unit
def test_no_import_cycles(graph):
    assert cycle(graph) is None, " -> ".join(cycle(graph))


@pytest.mark.unit
def test_cycle_finder_finds_one():
    assert cycle({"mingpt_ddp.a": {"mingpt_ddp.b"}, "mingpt_ddp.b": {"mingpt_ddp.a"}}) is not None


@pytest.mark.unit
def test_at_most_20_modules_directly_in_the_package():
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(flat) <= 20, flat


@pytest.mark.unit
def test_the_design_cards_modules_stay_where_they_are():
    for name in ("main", "model", "char_dataset", "trainer", "config", "parallel"):
        assert (PACKAGE / f"{name}.py").is_file(), name


@pytest.mark.unit
def test_the_schema_does_not_depend_on_a_tracker(graph):
    assert "mingpt_ddp.loggers" not in graph["mingpt_ddp.config"]


@pytest.mark.unit
def test_tools_are_off_the_training_path(graph):
    """Tools import the training path, never main; the training path (main, the composition
    root, aside) never imports a tool."""
    for name, deps in graph.items():
        if name.startswith("mingpt_ddp.tools."):
            assert "mingpt_ddp.main" not in deps, name
        elif name != "mingpt_ddp.main":
            assert not [d for d in deps if d.startswith("mingpt_ddp.tools")], (name, deps)


@pytest.mark.cli
def test_every_python_m_command_and_script_still_resolves():
    """`python -m mingpt_ddp.<tool>` (the documented names, from before tools/ existed) and
    pyproject's scripts."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    documented = documented_tools()
    assert {"bench", "sample", "torchrun"} <= documented  # the scan itself finds them
    code = ("import importlib, importlib.util, sys\n"
            f"for name in {sorted(set(TOOLS) | documented)!r}:\n"
            "    spec = importlib.util.find_spec('mingpt_ddp.' + name)\n"
            "    assert spec and spec.origin.endswith('/tools/' + name + '.py'), (name, spec)\n"
            f"for target in {list(scripts.values())!r}:\n"
            "    module, attr = target.split(':')\n"
            "    assert callable(getattr(importlib.import_module(module), attr)), target\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    silent = [name for name in documented
              if 'if __name__ == "__main__"' not in (REPO / "mingpt_ddp" / "tools" / f"{name}.py").read_text()]
    assert not silent, f"documented as `python -m mingpt_ddp.<name>` but do nothing when run: {silent}"
    help_text = subprocess.run([sys.executable, "-m", "mingpt_ddp.plot"], capture_output=True, text=True,
                               timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "mingpt_ddp.plot" in help_text.stdout + help_text.stderr


@pytest.mark.unit
def test_every_import_names_a_module_where_it_is_now():
    """`from mingpt_ddp.bench import X` would still work through the old command names (the
    package also looks in tools/), as a second copy of the module with its own state; an old
    flat path of a checkpoint/ or corpus/ module would fail only when that line runs. The
    package, tests/ and benchmarks/."""
    known = set(modules())
    others = {str(p.relative_to(REPO)): p for d in ("tests", "benchmarks") for p in (REPO / d).glob("*.py")}
    wrong = []
    for name, path in {**modules(), **others}.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                wrong += [f"{name}: import {a.name}" for a in node.names
                          if a.name.split(".")[0] == "mingpt_ddp" and a.name not in known]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "mingpt_ddp":
                if node.module not in known:
                    wrong.append(f"{name}: from {node.module} import ...")
                elif node.module == "mingpt_ddp":  # a module's old flat name, e.g. `from mingpt_ddp import storage`
                    wrong += [f"{name}: from mingpt_ddp import {a.name}" for a in node.names
                              if f"mingpt_ddp.{a.name}" not in known and any(k.endswith(f".{a.name}") for k in known)]
    assert not wrong, wrong
