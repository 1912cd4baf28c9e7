"""Sampling options: bad values are one clear error, temperature 0 is greedy."""
import subprocess

import pytest

from conftest import PYTHON, REPO
from test_rank_agreement import expect_config_error


# ---- 9. sampling options ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_snapshot(tmp_path_factory):
    from mingpt_ddp.model import GPT, GPTConfig
    from mingpt_ddp.checkpoint.snapshot import encode

    cfg = GPTConfig(vocab_size=5, block_size=8, n_layer=1, n_head=1, n_embd=8, dropout=0.0)
    path = tmp_path_factory.mktemp("sample") / "snapshot.pt"
    path.write_bytes(encode({"vocab": "\nabcd", "model_config": dict(vars(cfg)),
                             "model": GPT(cfg).state_dict()}, 1))
    return path


@pytest.mark.cli
@pytest.mark.parametrize("option, phrase", [("top_k=0", "top_k=0 must be at least 1"),
                                            ("top_k=-1", "top_k=-1 must be at least 1"),
                                            ("temperature=-1", "temperature=-1.0 must be >= 0"),
                                            ("max_new_tokens=-5", "max_new_tokens=-5 must be >= 0")])
def test_bad_sampling_options_are_one_clear_error(tiny_snapshot, option, phrase):
    proc = subprocess.run([PYTHON, "-m", "mingpt_ddp.sample", str(tiny_snapshot), "prompt=ab", option],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    expect_config_error(proc, phrase)


@pytest.mark.cli
def test_temperature_zero_is_greedy(tiny_snapshot):
    outs = {subprocess.run([PYTHON, "-m", "mingpt_ddp.sample", str(tiny_snapshot), "prompt=ab", "temperature=0",
                            "max_new_tokens=20", f"seed={seed}"], capture_output=True, text=True, timeout=60,
                           cwd=REPO).stdout for seed in (0, 1)}
    assert len(outs) == 1 and len(next(iter(outs))) == 23




@pytest.mark.unit
def test_sampling_a_snapshot_that_failed_the_end_of_run_check_warns(tmp_path, capsys):
    from test_export import marked_snapshot

    from mingpt_ddp.tools import sample

    sample.cli([str(marked_snapshot(tmp_path / "snapshot.pt")), "prompt=ab", "max_new_tokens=5"])
    captured = capsys.readouterr()
    assert len(captured.out) == 8, captured.out  # the text is still written
    warning, = captured.err.splitlines()
    assert warning.startswith("warning: snapshot ") and "failed the end-of-run check (parameters differ" in warning
