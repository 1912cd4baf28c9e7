"""Every documented command keeps working after the tools moved to mingpt_ddp/tools/:
`python -m mingpt_ddp.<tool>` (README, docs/, launch/, benchmarks/) and pyproject's scripts."""
import json
import re
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO

pytestmark = pytest.mark.cli

TOOLS = sorted(p.stem for p in (REPO / "mingpt_ddp" / "tools").glob("*.py") if p.stem != "__init__")


def documented_module_commands() -> set[str]:
    sources = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "launch").iterdir(),
               *(REPO / "benchmarks").iterdir(), *(REPO / "mingpt_ddp").rglob("*.py")]
    found = set()
    for path in sources:
        if path.is_file():
            text = path.read_text(errors="replace")
            found |= set(re.findall(r"-m[\"',\s]+(mingpt_ddp(?:\.\w+)+)", text))
    return found


def test_every_documented_module_command_and_script_resolves():
    documented = documented_module_commands()
    assert {"mingpt_ddp.bench", "mingpt_ddp.sample"} <= documented  # the scan itself finds them
    names = sorted(documented | {f"mingpt_ddp.{t}" for t in TOOLS})
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    probe = ("import importlib, importlib.util, json, sys\n"
             "names, scripts = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
             "out = {n: (s.origin if (s := importlib.util.find_spec(n)) else None) for n in names}\n"
             "for name, target in scripts.items():\n"
             "    module, _, attr = target.partition(':')\n"
             "    out[name] = callable(getattr(importlib.import_module(module), attr, None))\n"
             "print(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", probe, json.dumps(names), json.dumps(scripts)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    for name in names:
        assert found[name], f"python -m {name} finds no module"
        short = name.split(".")[-1]
        if short in TOOLS and name.count(".") == 1:  # an old command name: the one file in tools/
            assert found[name] == str(REPO / "mingpt_ddp" / "tools" / f"{short}.py"), (name, found[name])
    assert {"mingpt-sample", "mingpt-torchrun"} <= set(scripts)
    for script in scripts:
        assert found[script] is True, f"pyproject script {script} = {scripts[script]} does not resolve"


def test_an_old_command_name_runs_the_tool():
    """`python -m mingpt_ddp.sample` with no target: the tool's own usage line, not 'No module named'."""
    proc = subprocess.run([sys.executable, "-m", "mingpt_ddp.sample"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert "usage: python -m mingpt_ddp.sample" in proc.stdout + proc.stderr, proc.stderr
