"""trainer.deterministic (issue 23 item 9): what can be checked without a GPU: the switches it
sets for the GPU path, the refusal where inductor cannot follow, the one-line error for an op
without a deterministic kernel, and a real run with it on."""
from __future__ import annotations

import os

import pytest
import torch

from conftest import TINY, output, run_cli
from mingpt_ddp import determinism
from mingpt_ddp.errors import ConfigError


@pytest.fixture
def restore_switches(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]
    if determinism.inductor_has_deterministic_mode():
        import torch._inductor.config as inductor_config
        inductor_config.deterministic = False


@pytest.mark.unit
def test_on_it_sets_every_switch_and_off_clears_them(restore_switches):
    import torch._inductor.config as inductor_config

    torch.backends.cudnn.benchmark = True
    determinism.apply(True, compiled=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert inductor_config.deterministic is True
    determinism.apply(False, compiled=True)  # the next point of a sweep
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
    assert inductor_config.deterministic is False


@pytest.mark.unit
def test_a_compiled_run_is_refused_where_inductor_has_no_deterministic_mode(restore_switches, monkeypatch):
    monkeypatch.setattr(determinism, "inductor_has_deterministic_mode", lambda: False)
    with pytest.raises(ConfigError, match="set trainer.compile=false"):
        determinism.apply(True, compiled=True)
    determinism.apply(True, compiled=False)  # eager is fine
    assert torch.are_deterministic_algorithms_enabled()


@pytest.mark.unit
def test_an_op_without_a_deterministic_kernel_is_one_line(restore_switches):
    torch.use_deterministic_algorithms(True)
    x = torch.zeros(4)
    with pytest.raises(RuntimeError) as caught:  # put_ without accumulate has no deterministic CPU kernel
        x.put_(torch.tensor([0, 0]), torch.tensor([1.0, 2.0]), accumulate=False)
    error = determinism.explain(caught.value)
    assert error is not None and "\n" not in str(error)
    assert str(error).startswith("trainer.deterministic=true: ") and "put_" in str(error)
    assert "set trainer.deterministic=false" in str(error)
    assert determinism.explain(RuntimeError("CUDA out of memory")) is None


@pytest.mark.cli
def test_a_run_with_it_on_trains(tmp_path, small_corpus):
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path / 'run'}", f"data.path={small_corpus}", "trainer.max_steps=6",
                    "trainer.deterministic=true"], timeout=180)
    assert proc.returncode == 0 and "done: step 6" in output(proc), output(proc)
