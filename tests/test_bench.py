"""`python -m mingpt_ddp.bench`: each mode's table and JSON, comm under torchrun, the MFU formula.

Tiny sizes only, and no assertions on speed: the figures depend on the machine and on
whatever else runs on it.
"""
import json
import os
import subprocess

import pytest
import torch

from conftest import PYTHON, REPO, TORCHRUN
from mingpt_ddp.tools import bench
from mingpt_ddp.errors import ConfigError
from mingpt_ddp.metrics import mfu
from mingpt_ddp.model import GPT, GPTConfig

TINY_TRAIN = ["model=gpt-nano", "data.block_size=32", "trainer.batch_size=4", "trainer.precision=fp32"]


def run_bench(args, tmp_path, nproc=0, timeout=120):
    out = tmp_path / "bench.json"
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "-m", "mingpt_ddp.bench"] if nproc else \
        [PYTHON, "-m", "mingpt_ddp.bench"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([*cmd, *args, f"out={out}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


def table(stdout):
    """The header and rows of the printed table (lines after the '# title' line)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# ")) + 1
    rows = []
    for line in lines[start:]:
        if line.startswith(("#", "wrote", "best")):
            break
        rows.append(line)
    return rows[0], rows[1:]


def n_params_by_formula(n_layer, n_embd, vocab):
    """Parameters without position embeddings, counted by hand: per block two LayerNorms
    (4d), qkv (3d^2+3d), attention out (d^2+d), MLP (4d^2+4d and 4d^2+d); then the tied
    token embedding / head (V*d) and the final LayerNorm (2d)."""
    d = n_embd
    return n_layer * (12 * d * d + 13 * d) + vocab * d + 2 * d


@pytest.mark.unit
def test_flops_per_token_is_6n_plus_12_l_t_d():
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128))
    n = n_params_by_formula(4, 128, 65)
    assert model.num_params() == n
    assert model.flops_per_token(64) == 6 * n + 12 * 4 * 64 * 128


@pytest.mark.unit
def test_mfu_is_model_flops_over_the_peak_of_all_processes():
    assert mfu(1e6, 1000.0, 1e10, 1) == pytest.approx(0.1)
    assert mfu(1e6, 1000.0, 1e10, 2) == pytest.approx(0.05)


@pytest.mark.unit
def test_arguments_split_into_bench_options_and_hydra_overrides():
    mode, options, overrides = bench.parse_args(["train", "steps=7", "model=gpt-nano", "trainer.batch_size=3"])
    assert mode == "train" and options["steps"] == "7"
    assert overrides == ["model=gpt-nano", "trainer.batch_size=3"]
    assert [bench.parse_bytes(s) for s in ("8", "64KB", "256MB", "1G")] == [8, 65536, 256 << 20, 1 << 30]
    with pytest.raises(ConfigError):
        bench.parse_args(["fly"])


@pytest.mark.cli
def test_unknown_mode_is_one_line_and_exit_code_2(tmp_path):
    proc = subprocess.run([PYTHON, "-m", "mingpt_ddp.bench", "fly"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: usage: python -m mingpt_ddp.bench <peak|train")


@pytest.mark.cli
def test_peak(tmp_path):
    stdout, result = run_bench(["peak", "sizes=128,256", "seconds=0.05", *TINY_TRAIN], tmp_path)
    header, rows = table(stdout)
    assert header.split() == ["dtype", "matmul", "m", "x", "k", "x", "n", "TFLOP/s", "one", "matmul", "s"]
    assert [r.split()[:2] for r in rows] == [[d, m] for d in ("fp32", "bf16") for m in ("128", "256", "qkv", "mlp", "mlp")]
    assert {(r["dtype"], tuple(r["shape"])) for r in result["rows"]} == {
        (d, s) for d in ("fp32", "bf16") for s in ((128,) * 3, (256,) * 3, (128, 48, 144), (128, 48, 192), (128, 192, 48))}
    assert set(result["peak_tflops"]) == {"fp32", "bf16"} and all(v > 0 for v in result["peak_tflops"].values())
    assert result["model_peak_tflops"]["fp32"] == max(r["tflops"] for r in result["rows"]
                                                      if r["dtype"] == "fp32" and r["shape"][0] == 128 and r["shape"][1] != 128)
    assert "at the model's matmuls (3L/48d, 128 tokens per micro-batch" in stdout
    assert result["env"]["cpu"]["cores"] >= 1


@pytest.mark.cli
def test_results_go_under_outputs_not_into_the_current_directory(tmp_path):
    proc = subprocess.run([PYTHON, "-m", "mingpt_ddp.bench", "peak", "sizes=64", "seconds=0.01"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["outputs"]
    written = list((tmp_path / "outputs" / "bench").glob("peak-*.json"))
    assert len(written) == 1 and json.loads(written[0].read_text())["peak_tflops"]


@pytest.mark.cli
def test_train_reports_throughput_and_mfu_with_the_model_flop_count(tmp_path, small_corpus):
    stdout, r = run_bench(["train", *TINY_TRAIN, f"data.path={small_corpus}", "steps=4", "warmup=1"], tmp_path)
    header, rows = table(stdout)
    assert header.split()[:4] == ["tokens/s", "tokens/s/proc", "ms/step", "wall-tokens/s"] and len(rows) == 1
    assert 0 < r["wall_tokens_per_s"] <= r["tokens_per_s"]
    assert r["steps"] == 4 and r["precision"] == "fp32" and r["global_batch"] == 4 and r["block_size"] == 32
    vocab = len(set(small_corpus.read_text(encoding="utf-8")))
    n = n_params_by_formula(3, 48, vocab)  # gpt-nano: 3 layers, 48 dims
    assert r["flops_per_token"] == 6 * n + 12 * 3 * 32 * 48
    assert r["tokens_per_s"] == pytest.approx(4 * 4 * 32 / (r["ms_per_step"] * 4 / 1e3), rel=1e-6)
    assert r["mfu_measured"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / r["peak_flops_per_process"], rel=1e-6)
    assert r["peak_memory_bytes"] > 10 * 2**20 and r["peak_memory_kind"] == "max RSS"


HELD_DOWN_PEAK = """
import sys
import mingpt_ddp.trainer
from mingpt_ddp.tools import bench
from mingpt_ddp.metrics import Peak
mingpt_ddp.trainer.cached_peak = lambda *args, **kwargs: Peak(1e6, "fp32")  # as if others' load held it down
sys.exit(bench.main(sys.argv[1:]))
"""


@pytest.mark.cli
def test_train_mfu_stays_under_100_percent_when_the_steps_beat_the_start_up_peak(tmp_path, small_corpus):
    out = tmp_path / "bench.json"
    proc = subprocess.run([PYTHON, "-c", HELD_DOWN_PEAK, "train", *TINY_TRAIN, f"data.path={small_corpus}",
                           "steps=5", "warmup=1", f"out={out}"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["peak_raised_to_reached"] and r["peak_flops_per_process"] > 1e6
    best_mfu = mfu(r["flops_per_token"], r["tokens_per_s_best_window"], r["peak_flops_per_process"], 1)
    assert 0 < r["mfu_measured"] <= best_mfu <= 1.0 + 1e-9
    assert "quoted against the rate reached" in proc.stdout


@pytest.mark.dist
def test_train_runs_under_torchrun_and_counts_all_ranks(tmp_path, small_corpus):
    _, r = run_bench(["train", *TINY_TRAIN, f"data.path={small_corpus}", "steps=2", "warmup=1"], tmp_path, nproc=2)
    assert r["env"]["world_size"] == 2 and r["global_batch"] == 8
    assert r["tokens_per_s"] == pytest.approx(2 * r["tokens_per_s_per_process"])
    assert r["mfu_measured"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / (2 * r["peak_flops_per_process"]))


@pytest.mark.cli
def test_data(tmp_path, small_corpus):
    stdout, r = run_bench(["data", "data.block_size=32", "trainer.batch_size=4", f"data.path={small_corpus}",
                           "steps=500"], tmp_path)
    header, rows = table(stdout)
    assert header.split()[0] == "samples/s" and len(rows) == 1
    assert r["steps"] == 500 and r["samples_per_s"] > 0 and r["us_per_step_batch"] > 0
    assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 32)


@pytest.mark.cli
def test_data_with_a_bpe_reports_its_encoding_per_core(tmp_path, small_corpus):
    pytest.importorskip("tokenizers")
    stdout, r = run_bench(["data", "data.block_size=32", "trainer.batch_size=4", f"data.path={small_corpus}",
                           "data.tokenizer=bpe", "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}",
                           "steps=20"], tmp_path)
    assert r["encoded"] and r["tokenizer"] == "bpe (300 tokens)" and r["token_dtype"] == "uint16"
    assert r["encode_MBps"] > 0 and r["encode_MB_per_cpu_s"] > 0 and r["encode_cores"] == len(os.sched_getaffinity(0))
    assert 1.2 < r["bytes_per_token"] < 4  # a BPE of 300 tokens merges a little (1.4 bytes a token here)
    assert "MB/s per core" in stdout and "bpe (300 tokens)" in stdout


@pytest.mark.cli
def test_snapshot_to_a_local_url(tmp_path, small_corpus):
    target = tmp_path / "snaps"
    stdout, r = run_bench(["snapshot", "model=gpt-nano", "data.block_size=32", "trainer.batch_size=4",
                           f"data.path={small_corpus}", f"url={target}", "repeat=2"], tmp_path)
    header, rows = table(stdout)
    assert "blocks training s" in header and len(rows) == 1
    assert r["url"] == f"{target}/bench-snapshot.pt" and len(r["runs"]) == 2
    best = r["best"]
    for key in ("blocking_s", "copy_to_cpu_s", "background_write_s", "encode_s", "write_s", "save_s", "load_s"):
        assert best[key] > 0, key
    assert best["bytes"] > 4 * r["parameters"]  # weights and the two AdamW moments, at least
    assert not list(target.glob("bench-snapshot*"))  # the bench removes what it wrote


@pytest.mark.cli
def test_comm_alone(tmp_path):
    _, r = run_bench(["comm", "max_bytes=1KB"], tmp_path)
    assert r["ranks"] == 1 and [row["size"] for row in r["rows"]] == [8, 16, 32, 64, 128, 256, 512, 1024]


@pytest.mark.dist
def test_comm_under_torchrun_reports_like_nccl_tests(tmp_path):
    stdout, r = run_bench(["comm", "max_bytes=64KB", "iters=3", "warmup=1"], tmp_path, nproc=2)
    header, rows = table(stdout)
    assert header.split() == ["size(B)", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"]
    sizes = [row["size"] for row in r["rows"]]
    assert sizes == [8 * 2**i for i in range(14)] and len(rows) == 14  # 8 B .. 64 KiB, doubling
    assert r["ranks"] == 2 and r["env"]["backend"] == ("nccl" if torch.cuda.is_available() else "gloo")
    for row in r["rows"]:
        assert row["wrong"] == 0
        assert row["algbw_GBps"] == pytest.approx(row["size"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (2 - 1) / 2)
    assert "# Avg bus bandwidth" in stdout


@pytest.mark.cli
def test_precision_reports_fp32_and_bf16_and_the_auto_choice_here_and_under_avx2(tmp_path, small_corpus):
    tiny = [o for o in TINY_TRAIN if not o.startswith("model=")]
    stdout, r = run_bench(["precision", *tiny, f"data.path={small_corpus}", "steps=1", "avx2=true",
                           "models=gpt-nano,model.n_layer=1"], tmp_path, timeout=300)
    header, rows = table(stdout)
    assert header.split()[:3] == ["config", "layers/dim", "batch"] and "AVX2:" in header
    assert "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2" in stdout
    assert [row.split()[0] for row in rows][:2] == ["gpt-nano", "model.n_layer=1"]
    assert [(row["model"]["n_layer"], row["model"]["n_embd"]) for row in r["rows"]] == [(3, 48), (1, 192)]
    for row in r["rows"] + r["avx2_rows"]:
        assert row["fp32_tokens_per_s"] > 0 and row["bf16_vs_fp32"] > 0 and row["auto_seconds"] >= 0
        assert row["faster"] == ("bf16" if row["bf16_vs_fp32"] > 1 else "fp32")
        assert row["auto_choice"] in ("fp32", "bf16")
    assert len(r["avx2_rows"]) == 2

@pytest.mark.unit
def test_precision_row_times_bf16_in_one_bounded_pass_unless_its_matmuls_are_faster(monkeypatch):
    """gpt2 under the AVX2 emulation: bf16 matmuls 2.9x slower (under the 3x that skips bf16)
    made the bench time four full bf16 passes of ~90 s each (20 minutes for one table)."""
    from mingpt_ddp import precision

    calls = []
    model = GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=16))
    monkeypatch.setattr(precision, "step_seconds", lambda m, name, b, t, s=3: calls.append((name, b)) or 6.4)
    monkeypatch.setattr(precision, "pass_seconds", lambda m, name, b, t: calls.append((name, b)) or 6.4 / 32 * b * 2.9)
    monkeypatch.setattr(precision, "measured_cpu_choice", lambda *a: "fp32")
    for slowdown, full in ((2.9, False), (0.5, True)):
        calls.clear()
        monkeypatch.setattr(precision, "bf16_matmul_slowdown", lambda d, rows: slowdown)
        row = bench.precision_row(model, 32, 16, 3)
        assert calls[0] == ("fp32", 32)
        assert (("bf16", 32) in calls) == full, calls
        assert sum(b for name, b in calls if name == "bf16") * 6.4 / 32 * max(slowdown, 1) <= bench.SLOW_PASS_SECONDS \
            or full
        assert row["bf16_tokens_per_s"] > 0


@pytest.mark.unit
def test_sample_times_the_kv_cache_against_the_plain_loop_side_by_side(capsys):
    """bench sample (issue 33): tokens/s with and without the KV cache, `repeat` pairs, their
    ratios, the best of each, and the CPU's flags. In process, a tiny model, no assertion on
    speed."""
    from types import SimpleNamespace

    dist = SimpleNamespace(device=torch.device("cpu"), backend="gloo", world_size=1, local_world_size=1)
    options = {**bench.OPTIONS, "tokens": "6", "repeat": "2", "vocab": "11"}
    overrides = ["model=gpt-nano", "data.block_size=8"]
    result = {"env": bench.environment(dist), **bench.run_sample(dist, options, overrides)}
    assert result["model"] == {"n_layer": 3, "n_head": 3, "n_embd": 48, "block_size": 8, "vocab_size": 11}
    assert len(result["runs"]) == 2 and all(r["ratio"] > 0 for r in result["runs"])
    assert result["best_ratio"] == result["best_cached_tokens_per_s"] / result["best_plain_tokens_per_s"]
    bench.report("sample", result)
    out = capsys.readouterr().out
    assert out.startswith("# sampling 6 tokens, 3L/48d, block 8, vocabulary 11 (random weights")
    assert "KV cache tok/s" in out and "best: KV cache " in out and "\ncpu: " in out



@pytest.mark.unit
def test_sample_times_a_snapshots_model_when_given_one(tmp_path):
    """bench sample snapshot=PATH reads the snapshot (it failed with an AttributeError after
    the snapshot reading moved to tools/trained.py)."""
    from dataclasses import asdict
    from types import SimpleNamespace

    from mingpt_ddp.checkpoint.snapshot import encode
    from mingpt_ddp.model import GPT, GPTConfig
    from mingpt_ddp.trainer import TrainState

    cfg = GPTConfig(vocab_size=7, block_size=8, n_layer=1, n_head=1, n_embd=8)
    path = tmp_path / "snapshot.pt"
    path.write_bytes(encode({"model": GPT(cfg).state_dict(), "model_config": asdict(cfg), "vocab": "\nabcdef",
                             "train_state": asdict(TrainState(step=3))}, 3))
    dist = SimpleNamespace(device=torch.device("cpu"), backend="gloo", world_size=1, local_world_size=1)
    result = bench.run_sample(dist, {**bench.OPTIONS, "tokens": "4", "repeat": "1", "snapshot": str(path)}, [])
    assert result["model"]["vocab_size"] == 7 and len(result["runs"]) == 1


@pytest.mark.cli
def test_fixed_breaks_a_one_step_run_down_from_launch_to_exit(tmp_path):
    stdout, r = run_bench(["fixed", "runs=1", "text_mb=0.2"], tmp_path, timeout=300)
    phases = [p["phase"] for p in r["phases"]]
    for phase in ("imports", "config composed (Hydra)", "data (token cache)", "precision decided",
                  "first step starts", "last step ended", "final evaluation", "closing sample", "exit"):
        assert phase in phases, phases
    assert phases.index("first step starts") < phases.index("last step ended") < phases.index("final evaluation")
    total = sum(p["median_s"] for p in r["phases"])
    assert r["total_s"] == pytest.approx(total, abs=1e-6)
    assert r["total_s"] == pytest.approx(r["launch_to_first_step_s"] + r["step_s"] + r["last_step_to_exit_s"])
    assert "launch to first step" in stdout and "model=gpt-nano trainer.max_steps=1" in r["command"]


# main.py as a program, its atexit handlers observed: did a DDP run import DCP?
IMPORTED_AT_EXIT = """
import atexit, runpy, sys
main, out = sys.argv[1], sys.argv[2]
def report():
    heavy = sorted(m for m in sys.modules if m.startswith("torch.distributed.checkpoint"))
    open(out, "w").write(repr(heavy))
atexit.register(report)
sys.argv = [main, *sys.argv[3:]]
runpy.run_path(main, run_name="__main__")
"""


@pytest.mark.cli
def test_the_quick_exit_stops_idle_pools_as_the_interpreter_does(tmp_path):
    """main.py's end without finalisation joined the non-daemon threads before threading's own
    exit hooks ran: an idle ThreadPoolExecutor worker (inductor's C++ compile pool on a cold
    cache) waited for work forever, so a finished run hung until the scheduler killed it."""
    script = ("import concurrent.futures, sys\n"
              f"sys.path.insert(0, {str(REPO)!r})\n"
              "from mingpt_ddp.main import exit_without_finalising\n"
              "pool = concurrent.futures.ThreadPoolExecutor(2)\n"
              "pool.submit(print, 'worked', flush=True).result()\n"
              "exit_without_finalising(0)\n")
    proc = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "worked" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.cli
def test_a_ddp_run_imports_no_dcp_and_still_runs_its_atexit_handlers(tmp_path, small_corpus):
    """A DDP run without sharded snapshots beside it does not import torch.distributed.checkpoint;
    it ends without the interpreter's finalisation, but with its atexit handlers."""
    report = tmp_path / "heavy.txt"
    proc = subprocess.run([PYTHON, "-c", IMPORTED_AT_EXIT, str(REPO / "mingpt_ddp" / "main.py"), str(report),
                           *TINY_TRAIN, f"data.path={small_corpus}", "trainer.max_steps=1",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert report.read_text() == "[]"
    assert " -m mingpt_ddp.sample " in (proc.stdout + proc.stderr).split("sample more: ")[1]
