"""Export: a trained model that plain PyTorch loads, without this package."""
import json
import re
import subprocess

import pytest
import torch

from conftest import PYTHON, REPO, TINY, load_snapshot, output, run_cli


def docs_snippet(section: str) -> str:
    """The first Python block of a section of docs/export-and-sampling.md: the test runs what users are shown."""
    text = (REPO / "docs" / "export-and-sampling.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", body, re.S)[1]


# Runs with -I (no PYTHONPATH, no current directory on the path) and mingpt_ddp made
# unimportable: only torch and the exported files.
PLAIN_PYTORCH = """
import sys
sys.modules["mingpt_ddp"] = None
{snippet}
import json as _json
torch.manual_seed(0)
x = torch.randint(0, len(meta["vocab"]), (2, 24))
with torch.no_grad():
    logits, _ = model(x)
print(_json.dumps({{"x": x.tolist(), "logits": logits.tolist(), "modules": sorted(m for m, mod in sys.modules.items() if m.startswith("mingpt") and mod is not None)}}))
"""


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, small_corpus):
    """A 10-step run (characters), shared by the tests that export it."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    proc = run_cli([*TINY, f"hydra.run.dir={run_dir}", f"data.path={small_corpus}", "trainer.max_steps=10"])
    assert proc.returncode == 0, output(proc)
    return run_dir


@pytest.mark.cli
def test_an_exported_model_loads_with_plain_pytorch_and_gives_the_snapshots_logits(tmp_path, trained_run):
    run_dir = trained_run
    exported = tmp_path / "exported"
    proc = subprocess.run([PYTHON, "-m", "mingpt_ddp.export", str(run_dir), str(exported)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "exported step 10" in proc.stdout
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.py", "weights.pt"]
    meta = json.loads((exported / "config.json").read_text())
    snapshot = load_snapshot(run_dir / "snapshot.pt")
    assert meta["vocab"] == list(snapshot["vocab"]) and meta["trained"]["step"] == 10

    plain = subprocess.run([PYTHON, "-I", "-c", PLAIN_PYTORCH.format(snippet=docs_snippet("Export"))],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0, plain.stderr
    result = json.loads(plain.stdout.splitlines()[-1])
    assert result["modules"] == []

    from mingpt_ddp.model import GPT, GPTConfig

    model = GPT(GPTConfig(**snapshot["model_config"]))
    model.load_state_dict(snapshot["model"])
    model.eval()
    with torch.no_grad():
        expected, _ = model(torch.tensor(result["x"]))
    torch.testing.assert_close(torch.tensor(result["logits"]), expected, rtol=0, atol=1e-6)


@pytest.mark.cli
def test_a_run_exported_with_hf_continues_a_prompt_in_transformers_with_the_sample_tools_greedy_tokens(
        tmp_path, trained_run, capsys):
    """issue 33's check: AutoModelForCausalLM's greedy generate, our GPT.generate at temperature
    0, `python -m mingpt_ddp.sample ... temperature=0` (its cli, in process) and the docs'
    example agree."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from mingpt_ddp.corpus import tokenizer
    from mingpt_ddp.model import GPT, GPTConfig
    from mingpt_ddp.tools import export, sample

    out = tmp_path / "hf"
    export.cli([str(trained_run), str(out), "--hf"])
    assert "exported step 10" in capsys.readouterr().out
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompt, new = "ROMEO:", 20  # as the docs' example; transformers does not crop: at most 32 positions
    ids = their_tokenizer(prompt, return_tensors="pt").input_ids
    generated = theirs.generate(ids, max_new_tokens=new, do_sample=False)[0].tolist()

    snapshot = load_snapshot(trained_run / "snapshot.pt")
    model = GPT(GPTConfig(**snapshot["model_config"]))
    model.load_state_dict(snapshot["model"])
    ours = model.eval().generate(torch.tensor([tokenizer.from_snapshot(snapshot).encode(prompt).tolist()]), new,
                                 temperature=0)[0].tolist()
    assert generated == ours and len(ours) == len(prompt) + new
    sample.cli([str(trained_run), f"prompt={prompt}", f"max_new_tokens={new}", "temperature=0"])
    printed = capsys.readouterr().out
    assert printed == their_tokenizer.decode(generated) + "\n"
    exec(docs_snippet("Export to transformers (`--hf`)").replace('"exported-hf"', repr(str(out))), {})
    assert capsys.readouterr().out == printed  # the docs' example prints the sample tool's text


@pytest.mark.cli
def test_export_needs_a_snapshot(tmp_path):
    proc = subprocess.run([PYTHON, "-m", "mingpt_ddp.export", str(tmp_path), str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: no snapshot at") and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.s3
def test_export_from_an_s3_snapshot_with_safetensors(tmp_path, moto_s3):
    """A snapshot written straight to S3 (no local run directory), exported with --safetensors."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from dataclasses import asdict

    from conftest import s3_env
    from mingpt_ddp.model import GPT, GPTConfig
    from mingpt_ddp.checkpoint.snapshot import encode
    from mingpt_ddp.trainer import TrainState

    cfg = GPTConfig(vocab_size=5, block_size=8, n_layer=1, n_head=2, n_embd=8)
    torch.manual_seed(1)
    model = GPT(cfg)
    state = {"model": model.state_dict(), "model_config": asdict(cfg), "vocab": "abcde",
             "train_state": asdict(TrainState(step=7))}
    moto_s3.make_bucket("exports")
    moto_s3.client().put_object(Bucket="exports", Key="runs/a/snapshot.pt", Body=encode(state, 7))
    out = tmp_path / "out"
    proc = subprocess.run([PYTHON, "-m", "mingpt_ddp.export", "s3://exports/runs/a", str(out), "--safetensors"],
                          cwd=REPO, env=s3_env(moto_s3), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = GPT(cfg)
    missing, unexpected = safetensors_torch.load_model(loaded, out / "model.safetensors")
    assert not missing and not unexpected
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert json.loads((out / "config.json").read_text())["trained"]["source"] == "s3://exports/runs/a/snapshot.pt"


FAILED_CHECK = {"check": "parameters identical on all ranks",
                "message": "parameters differ between ranks at the end of training (rank 0: a, rank 1: b)"}


def marked_snapshot(path):
    """A tiny snapshot file marked as failing the end-of-run check, as trainer.py saves one."""
    from dataclasses import asdict

    from mingpt_ddp.checkpoint.snapshot import encode
    from mingpt_ddp.model import GPT, GPTConfig
    from mingpt_ddp.trainer import TrainState

    cfg = GPTConfig(vocab_size=5, block_size=8, n_layer=1, n_head=1, n_embd=8)
    path.write_bytes(encode({"model": GPT(cfg).state_dict(), "model_config": asdict(cfg), "vocab": "\nabcd",
                             "train_state": asdict(TrainState(step=3)), "failed_check": FAILED_CHECK}, 3))
    return path


@pytest.mark.unit
def test_a_snapshot_that_failed_the_end_of_run_check_is_exported_only_on_request(tmp_path, capsys):
    """Its weights are rank 0's of replicas that diverged: refused in one line, unless
    --accept-failed-check, and then config.json carries the mark on to whoever loads it."""
    from mingpt_ddp.tools import export

    snapshot = marked_snapshot(tmp_path / "snapshot.pt")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as refused:
        export.cli([str(snapshot), str(out)])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and not out.exists(), err
    assert err.startswith("error: snapshot ") and "failed the end-of-run check (parameters differ" in err, err
    assert "--accept-failed-check" in err and len(err.splitlines()) == 1, err

    export.cli([str(snapshot), str(out), "--accept-failed-check"])
    assert "failed the end-of-run check" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["trained"]["failed_check"] == FAILED_CHECK


@pytest.mark.unit
def test_sample_reads_an_export_directory_as_it_reads_the_snapshot(tmp_path, capsys):
    """`python -m mingpt_ddp.sample <export dir>`: the model and tokenizer from weights.pt and
    config.json, or from an --hf directory's model.safetensors and sidecar (it said "no
    snapshot at <dir>")."""
    from dataclasses import asdict

    from mingpt_ddp.checkpoint.snapshot import encode
    from mingpt_ddp.model import GPT, GPTConfig
    from mingpt_ddp.tools import export, sample
    from mingpt_ddp.trainer import TrainState

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=5, block_size=8, n_layer=1, n_head=1, n_embd=8)
    snapshot = tmp_path / "snapshot.pt"
    snapshot.write_bytes(encode({"model": GPT(cfg).state_dict(), "model_config": asdict(cfg), "vocab": "\nabcd",
                                 "train_state": asdict(TrainState(step=3))}, 3))
    export.export(str(snapshot), str(tmp_path / "out"))
    export.export(str(snapshot), str(tmp_path / "hf"), hf=True)  # transformers' layout, with its sidecar
    texts = []
    for target in (snapshot, tmp_path / "out", tmp_path / "hf"):
        sample.cli([str(target), "prompt=ab", "max_new_tokens=30", "temperature=0"])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] == texts[2] and len(texts[0]) == 33, texts
