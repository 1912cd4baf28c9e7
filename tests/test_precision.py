"""`trainer.precision=auto` on CPUs: decided by timing this model in fp32 and bf16, cached."""
from __future__ import annotations

import json

import pytest
import torch

from mingpt_ddp import precision
from mingpt_ddp.model import GPT, GPTConfig

pytestmark = pytest.mark.unit


def tiny_model(n_embd: int = 32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=1, n_head=2, n_embd=n_embd, dropout=0.1))


def fake_measure(times: dict[str, float], calls: list):
    def measure(model, name, batch, block):
        calls.append((name, batch, block))
        return times[name]
    return measure


def test_auto_picks_the_faster_precision_and_keeps_fp32_on_a_near_tie(tmp_path):
    model, calls = tiny_model(), []
    faster_bf16 = fake_measure({"fp32": 1.0, "bf16": 0.5}, calls)
    assert precision.measured_cpu_choice(model, 32, 16, str(tmp_path / "a.json"), faster_bf16) == "bf16"
    assert calls == [("fp32", 32, 16), ("bf16", 32, 16)] * 2  # alternated, at the real micro-batch
    near_tie = fake_measure({"fp32": 1.0, "bf16": 0.97}, [])
    assert precision.measured_cpu_choice(model, 32, 16, str(tmp_path / "b.json"), near_tie) == "fp32"
    slower_bf16 = fake_measure({"fp32": 1.0, "bf16": 1.6}, [])
    assert precision.measured_cpu_choice(model, 4, 16, str(tmp_path / "c.json"), slower_bf16) == "fp32"


def test_the_probe_runs_the_real_batch_unless_a_pass_would_be_costly():
    small = tiny_model()
    assert precision.probe_batch_size(small, 32, 16) == 32
    wide = GPT(GPTConfig(vocab_size=65, block_size=128, n_layer=4, n_head=8, n_embd=512))
    sequences = precision.probe_batch_size(wide, 32, 128)
    assert 1 < sequences < 32
    assert wide.flops_per_token(128) * 128 * sequences <= precision.PROBE_FLOPS
    assert wide.flops_per_token(128) * 128 * (sequences + 1) > precision.PROBE_FLOPS
    assert precision.probe_batch_size(wide, 32, 128 * 64) == 1  # never less than one sequence


def test_the_decision_is_cached_per_model_shape(tmp_path):
    cache, calls = str(tmp_path / "precision.json"), []
    measure = fake_measure({"fp32": 1.0, "bf16": 0.5}, calls)
    assert precision.measured_cpu_choice(tiny_model(), 32, 16, cache, measure) == "bf16"
    assert precision.measured_cpu_choice(tiny_model(), 32, 16, cache, measure) == "bf16"
    assert len(calls) == 4  # measured once (twice each), then read from the cache
    entry = next(iter(json.loads(open(cache).read()).values()))
    assert entry["choice"] == "bf16" and entry["fp32_ms"] == 1000.0
    precision.measured_cpu_choice(tiny_model(n_embd=64), 32, 16, cache, measure)  # another shape: measured
    precision.measured_cpu_choice(tiny_model(), 32, 8, cache, measure)  # another block size: measured
    assert len(calls) == 12


def test_a_damaged_cache_is_measured_again(tmp_path):
    cache, calls = tmp_path / "precision.json", []
    cache.write_text("{not json")
    assert precision.measured_cpu_choice(tiny_model(), 8, 16, str(cache), fake_measure({"fp32": 1, "bf16": 2}, calls))\
        == "fp32"
    assert len(calls) == 4 and json.loads(cache.read_text())


def test_timing_leaves_the_model_and_the_global_generators_as_they_were():
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    for name in ("fp32", "bf16"):
        assert 0 < precision.step_seconds(model, name, 2, 16, steps=1) < 60
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_only_auto_on_a_cpu_measures():
    calls = []
    measure = lambda: calls.append(1) or "bf16"  # noqa: E731
    assert precision.resolve("auto", torch.device("cpu"), measure_cpu=measure).name == "bf16"
    assert precision.resolve("fp32", torch.device("cpu"), measure_cpu=measure).name == "fp32"
    assert precision.resolve("bf16", torch.device("cpu"), measure_cpu=measure).name == "bf16"
    assert calls == [1]


def test_the_peak_measurement_skips_matmul_sizes_that_would_take_seconds(monkeypatch):
    """fp16 on a CPU without fp16 kernels: a 2048-size matmul takes tens of seconds, and
    every fp16 run waited for several of them at start."""
    from mingpt_ddp import metrics

    cpu = torch.device("cpu")
    for rate, expected in ((2e11, (1536, 2048)), (3e10, (1536,)), (2e9, (512,)), (1e8, (256,))):
        monkeypatch.setattr(metrics, "matmul_flops", lambda device, dtype, n, seconds=0.2, r=rate: r)
        sizes = metrics.affordable_peak_sizes(cpu, torch.float16)
        assert sizes == expected, (rate, sizes)
        assert all(2 * n**3 / rate <= metrics.MAX_MATMUL_SECONDS for n in sizes if n > 256)
