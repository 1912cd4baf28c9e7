"""Command-line conventions of every documented command: -h/--help prints the usage and exits
0, an unknown option is one `error:` line naming the usage and exits 2; console scripts."""
import importlib
import subprocess
import tomllib

import pytest

from conftest import MAIN, PYTHON, REPO
from test_module_layout import TOOLS, documented_tools


def entry(name: str):
    """What `python -m mingpt_ddp.<name>` runs: the tool's cli(argv) or main(argv)."""
    module = importlib.import_module(f"mingpt_ddp.tools.{name}")
    return getattr(module, "cli", None) or module.main


def call(name: str, argv: list[str]) -> int:
    try:
        code = entry(name)(argv)
    except SystemExit as exc:
        code = exc.code
    return code or 0


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(set(TOOLS) | documented_tools()))
def test_every_tool_answers_help_and_refuses_an_unknown_option_in_one_line(name, capsys):
    """`mingpt-sample --help` said "error: no snapshot at --help" and exited 2."""
    for flag in ("--help", "-h"):
        assert call(name, [flag]) == 0, name
        out = capsys.readouterr().out
        assert "usage: " in out and (f"mingpt_ddp.{name}" in out or "mingpt-torchrun" in out), out
    assert call(name, ["--no-such-option", "x"]) == 2, name
    captured = capsys.readouterr()
    line, = captured.err.strip().splitlines()  # one line, no argparse usage block, no traceback
    assert line.startswith("error: ") and "--no-such-option" in line and "usage: " in line, captured


@pytest.mark.unit
def test_main_refuses_an_unknown_option_in_one_line():
    from mingpt_ddp import config

    config.check_options(["--multirun", "--cfg", "job", "trainer.max_epochs=1"])  # Hydra's own: left to Hydra
    with pytest.raises(config.BadOverrides) as bad:
        config.check_options(["trainer.max_epochs=1", "--no-such-option"])
    assert str(bad.value.error).startswith("unknown option --no-such-option (usage: python mingpt_ddp/main.py")
    assert bad.value.error.exit_code == 2


@pytest.mark.cli
def test_main_answers_help_with_its_config():
    proc = subprocess.run([PYTHON, MAIN, "--help"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "model: gopher-44m, gpt-micro, gpt-mini, gpt-nano, gpt2" in proc.stdout and "max_epochs: 5" in proc.stdout


@pytest.mark.unit
def test_export_prepare_and_plot_have_console_scripts_like_sample():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for name in ("sample", "export", "prepare", "plot", "torchrun"):
        module, attr = scripts[f"mingpt-{name}"].split(":")
        assert module == f"mingpt_ddp.tools.{name}" and callable(getattr(importlib.import_module(module), attr))
