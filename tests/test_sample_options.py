"""Sampling options: bad values are one clear error, temperature 0 is greedy."""
import shlex
import subprocess
import sys

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
def test_sample_tool_at_temperature_zero_writes_the_plain_loops_text(tiny_snapshot):
    """The tool samples with the KV cache: at temperature 0 its text within the block is the
    plain loop's (what it wrote before the cache), token for token."""
    import torch
    from mingpt_ddp.checkpoint.snapshot import decode
    from mingpt_ddp.model import GPT, GPTConfig
    from mingpt_ddp.tools import sample

    text = sample.generate_text(str(tiny_snapshot), sample.SampleConfig(prompt="ab", max_new_tokens=7,
                                                                        temperature=0))
    snapshot = decode(tiny_snapshot.read_bytes())
    model = GPT(GPTConfig(**snapshot["model_config"]))
    model.load_state_dict(snapshot["model"])
    plain = model.eval().generate(torch.tensor([[1, 2]]), 7, temperature=0, use_cache=False)
    assert text == "".join("\nabcd"[i] for i in plain[0].tolist())


@pytest.mark.unit
def test_sampling_a_snapshot_that_failed_the_end_of_run_check_warns(tmp_path, capsys):
    from test_export import marked_snapshot

    from mingpt_ddp.tools import sample

    sample.cli([str(marked_snapshot(tmp_path / "snapshot.pt")), "prompt=ab", "max_new_tokens=5"])
    captured = capsys.readouterr()
    assert len(captured.out) == 8, captured.out  # the text is still written
    warning, = captured.err.splitlines()
    assert warning.startswith("warning: snapshot ") and "failed the end-of-run check (parameters differ" in warning


@pytest.mark.unit
def test_the_closing_sample_is_bounded_in_time_and_says_so(tmp_path):
    """A run's closing sample (sample.preview) stops writing after its time bound and says
    where; unbounded, it writes the same tokens as one call (chunks keep the seed's order)
    and leaves the thread count as it found it."""
    import torch
    from mingpt_ddp.char_dataset import Vocabulary
    from mingpt_ddp.corpus.tokenizer import CharTokenizer
    from mingpt_ddp.model import GPT, GPTConfig
    from mingpt_ddp.tools import sample

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=5, block_size=8, n_layer=1, n_head=1, n_embd=8, dropout=0.0))
    tok = CharTokenizer(Vocabulary("\nabcd"))
    threads = torch.get_num_threads()
    cut = sample.preview(model, tok, str(tmp_path), tokens=240, seconds=0)
    assert "a sample of what the model writes now:\n" in cut
    assert "sampling stopped after 0 s, at 1 of 240 tokens; sample more: " in cut and " -m mingpt_ddp.sample " in cut
    whole = sample.preview(model, tok, str(tmp_path), tokens=40, seconds=None, lines=100)
    assert "sampling stopped" not in whole and torch.get_num_threads() == threads
    start = torch.from_numpy(tok.encode("\n").astype("int64"))[None]
    once = model.generate(start, 40, temperature=0.8, generator=torch.Generator().manual_seed(0))
    assert whole.split(":\n", 1)[1].split("\nsample more")[0] == "\n".join(
        "    " + line for line in tok.decode(once[0, 1:].tolist()).strip("\n").splitlines())


@pytest.mark.unit
def test_the_closing_command_names_this_interpreter_a_corpus_prompt_and_pastes_whole(tmp_path, monkeypatch):
    """The hint said `python -m mingpt_ddp.sample <dir> prompt="ROMEO:"`: no such `python` where
    the venv is not activated (the quick start's), and ROMEO: for any corpus."""
    from mingpt_ddp.char_dataset import Vocabulary
    from mingpt_ddp.corpus.tokenizer import CharTokenizer
    from mingpt_ddp.tools import sample

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    prompt = "O'er the $HOME; `ls` \\"
    assert shlex.split(sample.sample_command(str(tmp_path / "outputs" / "a b"), prompt)) == [
        ".venv/bin/python", "-m", "mingpt_ddp.sample", "outputs/a b", f"prompt={prompt}", "max_new_tokens=500"]
    assert shlex.split(sample.sample_command("/elsewhere/run"))[3] == "/elsewhere/run"
    text = "rt sys\n\ndef main(argv: list[str]) -> int:  # the entry point of it all\n    return 0\n"
    tok = CharTokenizer(Vocabulary.from_text(text))
    assert sample.corpus_prompt(tok, tok.encode(text)) == "def main(argv:"  # whole words, at most 24 characters


TOGETHER = """
import gc, os, sys, torch, torch.distributed as dist
from mingpt_ddp.char_dataset import Vocabulary
from mingpt_ddp.corpus.tokenizer import CharTokenizer
from mingpt_ddp.model import GPT, GPTConfig
from mingpt_ddp.tools import sample
dist.init_process_group("gloo")
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=5, block_size=8, n_layer=1, n_head=1, n_embd=8, dropout=0.0))
# rank 0 is out of time at once, rank 1 never would be: both must stop after rank 0's first chunk
seconds = 0 if dist.get_rank() == 0 else 3600
text = sample.preview(model, CharTokenizer(Vocabulary("\\nabcd")), sys.argv[1], tokens=240, seconds=seconds,
                      together=True)
print(f"rank {dist.get_rank()}: " + text.splitlines()[-1], flush=True)
# as distributed.shutdown and main.py end: gloo's threads still holding work objects abort an
# interpreter that finalises ("terminate called without an active exception")
dist.barrier()
dist.destroy_process_group()
gc.collect()
os._exit(0)
"""


@pytest.mark.dist
def test_ranks_sampling_together_stop_after_the_same_chunk_by_rank0s_clock(tmp_path):
    """Under FSDP every rank runs each forward of the closing sample, so a rank that stopped
    alone would leave the others waiting in a collective: rank 0's clock bounds it for all
    (unbounded, it took 9 s on an H200 and pushed the GPU check's dcp step past its limit)."""
    from conftest import TORCHRUN
    script = tmp_path / "together.py"
    script.write_text(TOGETHER)
    done = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        # rank 1's line names its own bound, but it stopped at rank 0's: after the same first chunk (4 tokens)
        assert f"rank {rank}: sampling stopped after {0 if rank == 0 else 3600} s, at 4 of 240 tokens" in done.stdout


# ---- issue 32 item 5: the sample tool's threads ------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("value", ["0", "-2", "four", "1.5"])
def test_a_bad_cpu_threads_is_one_clear_line(tiny_snapshot, value, capsys):
    from mingpt_ddp.tools import sample

    with pytest.raises(SystemExit) as stopped:
        sample.cli([str(tiny_snapshot), "prompt=ab", f"cpu_threads={value}"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: cpu_threads={value} must be a number of threads per process, 1 or more"), err


@pytest.mark.unit
def test_the_sample_tool_runs_on_cpu_threads_or_its_share_of_the_cores(tiny_snapshot, monkeypatch, capsys):
    """cpu_threads=N sizes torch's pool as trainer.cpu_threads does for a run; without it, this
    process's share (its affinity), not torch's own count (OMP_NUM_THREADS or every core)."""
    import os

    import torch
    from mingpt_ddp.tools import sample

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    before = torch.get_num_threads()
    try:
        for option, expected in (("cpu_threads=1", 1), ("cpu_threads=null", 3)):
            torch.set_num_threads(5)
            sample.cli([str(tiny_snapshot), "prompt=ab", "max_new_tokens=2", option])
            assert torch.get_num_threads() == expected, option
    finally:
        torch.set_num_threads(before)
    assert sample.parse_args(["x", "cpu_threads=4"])[1].cpu_threads == 4


@pytest.mark.unit
def test_a_prompt_is_taken_as_typed():
    """The closing command's prompt comes from the corpus: a line with "${" or the word None
    made the pasted command fail (an interpolation, a null; review)."""
    from mingpt_ddp.tools import sample

    for prompt in ("open ${ brace", "None", "null", "x=1: y", ""):
        assert sample.parse_args(["x", f"prompt={prompt}", "top_k=null"])[1].prompt == prompt
