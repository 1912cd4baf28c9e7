"""`trainer.precision=auto` on CPUs: decided by timing this model in fp32 and bf16, cached."""
from __future__ import annotations

import json

import pytest
import torch

from mingpt_ddp import metrics, precision
from mingpt_ddp.model import GPT, GPTConfig

pytestmark = pytest.mark.unit


def tiny_model(n_embd: int = 32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=1, n_head=2, n_embd=n_embd, dropout=0.1))


CLOCK = [0.0]  # the decision's clock: the fake timers below advance it by what they "took"
RUN_WAIT = [0.0, 0.0]  # this process's threads' seconds run and waited for a core (precision.cpu_wait)


@pytest.fixture(autouse=True)
def fake_clock(monkeypatch):
    CLOCK[0], RUN_WAIT[:] = 0.0, [0.0, 0.0]
    monkeypatch.setattr(precision, "_clock", lambda: CLOCK[0])
    monkeypatch.setattr(precision, "_cpu_wait", lambda: tuple(RUN_WAIT))


def fake_measure(times: dict[str, float], calls: list, overrun: float = 1.0, load=None):
    """One pass's seconds by precision, per sequence (`overrun` times what the calibration
    predicted: load that came after it). `load(name, call)`: (how many times slower, the share
    of its time its threads waited for a core) of the call-th pass (0, 1, ...) of `name`: a load spike."""
    def measure(model, name, batch, block):
        calls.append((name, batch, block))
        slower, waited = load(name, sum(c[0] == name for c in calls) - 1) if load else (1.0, 0.0)
        seconds = times[name] * batch * overrun * slower
        CLOCK[0] += seconds
        RUN_WAIT[0] += seconds * (1 - waited)
        RUN_WAIT[1] += seconds * waited
        return seconds
    return measure


def choose(model, batch, block, cache, times, calls, slowdown=1.0, overrun=1.0, load=None):
    """The matmul probe takes 0.05 s; the calibration (one block of one sequence) a quarter
    of what it predicts for a whole pass of one sequence, fp32's time."""
    def matmul_probe(n_embd, rows):
        CLOCK[0] += 0.05
        return slowdown

    def calibrate(model, tokens):
        CLOCK[0] += times["fp32"] / 4
        return times["fp32"]
    return precision.measured_cpu_choice(model, batch, block, str(cache), fake_measure(times, calls, overrun, load),
                                         matmul_probe, calibrate)


def test_auto_picks_the_faster_precision_and_keeps_fp32_on_a_near_tie(tmp_path):
    model, calls = tiny_model(), []
    assert choose(model, 32, 16, tmp_path / "a.json", {"fp32": 1e-3, "bf16": 5e-4}, calls) == "bf16"
    assert calls == [("fp32", 32, 16), ("bf16", 32, 16)] * 3  # warm-up, then two timed rounds, alternated
    assert choose(model, 32, 16, tmp_path / "b.json", {"fp32": 1e-3, "bf16": 9.7e-4}, []) == "fp32"


def test_a_losing_bf16_pass_ends_the_probe_at_once(tmp_path):
    """The decision's time bound: bf16 out at its first pass slower than 1.5x fp32's."""
    calls = []
    assert choose(tiny_model(), 32, 16, tmp_path / "a.json", {"fp32": 1e-3, "bf16": 1.6e-3}, calls) == "fp32"
    assert calls == [("fp32", 32, 16), ("bf16", 32, 16), ("fp32", 32, 16), ("bf16", 32, 16)]  # no second round
    calls.clear()  # far slower already when warming up (emulated bf16 the matmul probe missed): one pass each
    assert choose(tiny_model(), 32, 16, tmp_path / "b.json", {"fp32": 1e-3, "bf16": 3.1e-3}, calls) == "fp32"
    assert calls == [("fp32", 32, 16), ("bf16", 32, 16)]


def test_a_slow_bf16_warm_up_where_its_matmuls_are_faster_is_set_up_not_speed(tmp_path):
    """The first bf16 pass of a process sets its kernels up (a second on a busy machine)."""
    calls, measure = [], fake_measure({"fp32": 1e-3, "bf16": 5e-4}, [])

    def slow_first_bf16(model, name, batch, block):
        calls.append(name)
        return measure(model, name, batch, block) * (8 if calls == ["fp32", "bf16"] else 1)
    choice = precision.measured_cpu_choice(tiny_model(), 32, 16, str(tmp_path / "a.json"), slow_first_bf16,
                                           lambda d, rows: 0.5, lambda model, tokens: 1e-3)
    assert choice == "bf16" and calls == ["fp32", "bf16"] * 3


def spike(precision_name: str, slower: float, waited: float):
    """A load spike on every pass of one precision: `slower` times its quiet time, its threads
    waiting `waited` of it for a core."""
    return lambda name, call: (slower, waited) if name == precision_name else (1.0, 0.0)


def test_a_load_spike_during_the_bf16_passes_is_not_cached(tmp_path, monkeypatch):
    """Issue 32: "a bf16 pass took 5.8x fp32's (838 ms against 143 ms); probe stopped; cached",
    and every later run trained in fp32 at half speed. A pass that waited for the cores does
    not end the probe, and a loser whose passes waited is not cached: the next quiet
    measurement decides."""
    cache, calls = tmp_path / "a.json", []
    quiet = {"fp32": 1e-3, "bf16": 5e-4}
    choice = choose(tiny_model(), 32, 16, cache, quiet, calls, load=spike("bf16", 11.6, 0.8))
    assert choice == "fp32" and len(calls) == 6 and not cache.exists()  # no early stop, nothing cached
    assert choose(tiny_model(), 32, 16, cache, quiet, []) == "bf16"  # quiet: measured again, and cached
    assert json.loads(cache.read_text())
    # Where waits cannot be read (no /proc), other evidence: bf16 5.8x slower than fp32 where its
    # matmuls are 3x faster is load, not speed: the matmuls decide, nothing is cached ...
    monkeypatch.setattr(precision, "_cpu_wait", lambda: None)
    assert choose(tiny_model(), 32, 16, tmp_path / "b.json", quiet, [], slowdown=0.33,
                  load=spike("bf16", 11.6, 0.0)) == "bf16"
    assert not (tmp_path / "b.json").exists()
    # ... and a spike on one timed pass, which lost, against its own warm-up: load came and went.
    calls = []
    one_spike = lambda name, call: (4.0, 0.0) if (name, call) == ("bf16", 1) else (1.0, 0.0)  # noqa: E731
    assert choose(tiny_model(), 32, 16, tmp_path / "c.json", quiet, calls, load=one_spike) == "fp32"
    assert len(calls) == 4 and not (tmp_path / "c.json").exists()
    # A spike during the calibration alone sizes the passes smaller than the run's batch (fewer rows
    # understate bf16's gain): not cached either.
    monkeypatch.setattr(precision, "_cpu_wait", lambda: tuple(RUN_WAIT))

    def loaded_calibration(model, tokens):
        CLOCK[0] += 0.01
        RUN_WAIT[0], RUN_WAIT[1] = RUN_WAIT[0] + 0.003, RUN_WAIT[1] + 0.007
        return 8 * 0.2 / 32  # four times what one sequence takes when quiet
    calls = []
    choice = precision.measured_cpu_choice(tiny_model(), 32, 16, str(tmp_path / "d.json"),
                                           fake_measure({"fp32": 0.2 / 32, "bf16": 0.1 / 32}, calls),
                                           lambda d, rows: 1.0, loaded_calibration)
    assert choice == "bf16" and calls[0][1] < 32 and not (tmp_path / "d.json").exists()


def test_a_loser_on_its_warm_up_alone_is_not_trusted_where_waits_cannot_be_read(tmp_path, monkeypatch):
    """Review of issue 32: no schedstat (macOS, some containers) and matmuls that read bf16 no
    faster (narrow layers): one bf16 warm-up slowed by a spike ended the probe and was cached as
    trusted, the issue's own failure. One pass, unread waits, no spread: no evidence of a quiet machine."""
    monkeypatch.setattr(precision, "_cpu_wait", lambda: None)
    calls, cache = [], tmp_path / "a.json"
    warm_up_spike = lambda name, call: (6.25, 0.0) if (name, call) == ("bf16", 0) else (1.0, 0.0)  # noqa: E731
    assert choose(tiny_model(), 32, 16, cache, {"fp32": 1e-3, "bf16": 8e-4}, calls, slowdown=1.2,
                  load=warm_up_spike) == "fp32"
    assert len(calls) == 2 and not cache.exists()


def test_an_untrusted_re_measurement_leaves_the_cache_as_it_was(tmp_path, shakespeare):
    """Review of issue 32: a re-measurement under load (the cache bypassed: RunCheck)
    deleted the trusted entry, so the next run measured again, maybe under load too."""
    from test_trainer import make_trainer

    model, cache, calls = tiny_model(), tmp_path / "precision.json", []
    assert choose(model, 32, 16, cache, {"fp32": 1e-3, "bf16": 5e-4}, calls) == "bf16"
    kept = cache.read_text()
    decision = precision.cpu_decision(model, 32, 16, str(cache), fake_measure({"fp32": 1e-3, "bf16": 5e-4}, [],
                                      load=spike("fp32", 3.0, 0.8)), lambda d, rows: 0.5, lambda m, t: 1e-3,
                                      use_cache=False)
    assert decision.source == "untrusted" and cache.read_text() == kept
    # The run's check of a doubtful (older) entry that finds only load does not delete it either.
    trainer = make_trainer(shakespeare.read_text()[:20_000], log_every=5)
    trainer.precision_decision, key = cached_decision(
        trainer, cache, choice="fp32", why="older", fp32_ms=[3.0, 3.0], bf16_ms=[8.0, 8.0], bf16_matmul_slowdown=1.0,
        probe=[4, 16])
    kept = cache.read_text()
    steps = run_check(trainer, cache, {"fp32": 2.5e-3, "bf16": 1e-3}, calls, load=spike("fp32", 3.0, 0.8))
    steps.run(10, step_ms=10)
    assert "not trusted either" in steps.notes[0] and cache.read_text() == kept


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="Linux")
def test_waits_are_not_evidence_where_torch_runs_more_threads_than_the_cores(monkeypatch):
    """Review of issue 32: trainer.cpu_threads above the cores, the process's own threads wait
    for each other (68% at 6 threads on 2 cores), read as others' load: never trusted, never cached."""
    import os
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert precision.cpu_wait() is not None
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores + 1)
    assert precision.cpu_wait() is None


def test_a_quiet_measurement_is_cached_with_the_evidence_it_was_trusted_on(tmp_path):
    """Load only ever slows a pass: a winner whose passes waited for the cores won anyway, so
    that answer is cached; a quiet losing bf16 still ends the probe at once, cached."""
    cache, calls = tmp_path / "a.json", []
    assert choose(tiny_model(), 32, 16, cache, {"fp32": 1e-3, "bf16": 5e-4}, calls,
                  load=spike("bf16", 1.2, 0.5)) == "bf16"
    entry = next(iter(json.loads(cache.read_text()).values()))
    assert entry["trusted"] is True and entry["wait_share"] == {"fp32": [0.0] * 3, "bf16": [0.5] * 3,
                                                            "calibration": [0.0]}
    calls = []
    assert choose(tiny_model(), 32, 16, tmp_path / "b.json", {"fp32": 1e-3, "bf16": 1.6e-3}, calls) == "fp32"
    assert len(calls) == 4 and next(iter(json.loads((tmp_path / "b.json").read_text()).values()))["trusted"]


def test_a_cached_decision_that_is_not_believable_is_measured_again(tmp_path):
    """The entry an older version cached under a load spike: bf16 5.8x slower than fp32 where
    its matmuls were 3x faster. It is measured again (and dropped unless trusted)."""
    model, cache, calls = tiny_model(), tmp_path / "precision.json", []
    key = precision.decision_key(precision.cpu_facts(), model.cfg, 32, 16)
    cache.write_text(json.dumps({key: {"choice": "fp32", "why": "a bf16 pass took 5.8x fp32's; probe stopped",
                                       "fp32_ms": [150.0, 143.0], "bf16_ms": [400.0, 838.0],
                                       "bf16_matmul_slowdown": 0.33, "probe": [32, 16]}}))
    assert choose(model, 32, 16, cache, {"fp32": 1e-3, "bf16": 5e-4}, calls, slowdown=0.33) == "bf16"
    assert len(calls) == 6 and json.loads(cache.read_text())[key]["choice"] == "bf16"


def test_bf16_matmuls_several_times_slower_mean_no_bf16_pass_at_all(tmp_path):
    """30x: a real AVX2-only CPU; 2.5x: the least the AVX2 emulation showed on 64-row matmuls
    (3.0-8x at 128-1024 dims, 0.4-0.6x natively with AVX512-BF16)."""
    calls = []
    assert choose(tiny_model(), 32, 16, tmp_path / "a.json", {"fp32": 1e-3, "bf16": 5e-4}, calls, 30.0) == "fp32"
    assert choose(tiny_model(), 32, 16, tmp_path / "b.json", {"fp32": 1e-3, "bf16": 5e-4}, calls, 2.5) == "fp32"
    assert calls == []
    entry = next(iter(json.loads((tmp_path / "a.json").read_text()).values()))
    assert entry["choice"] == "fp32" and "no fast bf16 instructions" in entry["why"]


def test_no_pass_starts_that_would_run_past_the_deadline(tmp_path):
    """The calibration promised 0.2 s passes, but load came and they take 0.56 s (fp32) and
    0.48 s (bf16): after the warm-up round a third pass would end past the 2 s deadline (with
    its margin), so the warm-ups decide, and an answer that short is not cached."""
    calls, cache = [], tmp_path / "a.json"
    times = {"fp32": 0.2 / 8, "bf16": 0.17 / 8}
    assert choose(tiny_model(), 32, 16, cache, times, calls, overrun=2.8) == "bf16"
    assert calls == [("fp32", 8, 16), ("bf16", 8, 16)]  # 8 sequences: the 0.2 s pass aimed for
    assert CLOCK[0] <= precision.DECISION_SECONDS and not cache.exists()


def test_the_whole_decision_ends_within_3_seconds_on_any_machine(tmp_path):
    """The deadline covers the matmul probe, the calibration and every pass: from a fast
    machine to one where a single sequence takes seconds, with bf16 a little or far slower
    than the probe said, and load that makes passes up to 2.9x slower than calibrated."""
    for fp32 in (1e-5, 1e-3, 0.02, 0.1, 0.4, 3.0):
        for bf16_ratio in (0.5, 1.2, 2.9):
            for overrun in (1.0, 1.9, 2.9):
                CLOCK[0], calls = 0.0, []
                times = {"fp32": fp32, "bf16": fp32 * bf16_ratio}
                choice = choose(tiny_model(), 32, 16, tmp_path / f"{fp32}-{bf16_ratio}-{overrun}.json", times, calls,
                                overrun=overrun)
                assert choice == ("bf16" if bf16_ratio < 1 else "fp32") or fp32 >= 0.4, (fp32, bf16_ratio)
                assert CLOCK[0] <= 3.0, (fp32, bf16_ratio, overrun, calls)
                if overrun * max(bf16_ratio, 1) < precision.SAFETY:  # passes as long as foreseen, or a little longer
                    assert CLOCK[0] <= precision.DECISION_SECONDS, (fp32, bf16_ratio, overrun, calls)
    CLOCK[0], calls = 0.0, []  # a sequence takes 3 s: no pass at all, the matmuls decide
    assert choose(tiny_model(), 32, 16, tmp_path / "slow.json", {"fp32": 3.0, "bf16": 1.0}, calls, 0.5) == "bf16"
    assert calls == [] and CLOCK[0] < 1.0 and not (tmp_path / "slow.json").exists()


def test_the_calibration_runs_one_block_and_scales_it_to_the_whole_model():
    model = GPT(GPTConfig(vocab_size=65, block_size=32, n_layer=4, n_head=2, n_embd=32))
    before = [p.grad for p in model.parameters()]
    seconds = precision.one_block_pass_seconds(model, 32)
    assert seconds > 0 and [p.grad for p in model.parameters()] == before


def test_the_probe_runs_the_real_batch_unless_a_pass_would_be_costly():
    """The calibration pass (one sequence) gives seconds per FLOP: PASS_SECONDS of fp32 at most."""
    wide = GPT(GPTConfig(vocab_size=65, block_size=128, n_layer=4, n_head=8, n_embd=512))
    seconds_per_flop = precision.PASS_SECONDS / (wide.flops_per_token(128) * 128 * 5.5)  # 5 sequences fit
    assert precision.probe_shape(wide, 32, 128, seconds_per_flop) == (5, 128)
    assert precision.probe_shape(wide, 4, 128, seconds_per_flop) == (4, 128)  # the real batch, when it fits
    assert precision.probe_shape(wide, 32, 128, seconds_per_flop * 100) == (1, 64)  # shorter, not under 64


def test_the_decision_is_cached_per_model_shape(tmp_path):
    cache, calls = tmp_path / "precision.json", []
    times = {"fp32": 1e-3, "bf16": 5e-4}
    assert choose(tiny_model(), 32, 16, cache, times, calls) == "bf16"
    assert choose(tiny_model(), 32, 16, cache, times, calls) == "bf16"
    assert len(calls) == 6  # measured once, then read from the cache
    entry = next(iter(json.loads(cache.read_text()).values()))
    assert entry["choice"] == "bf16" and entry["fp32_ms"] == [32.0] * 3
    choose(tiny_model(n_embd=64), 32, 16, cache, times, calls)  # another shape: measured
    choose(tiny_model(), 32, 8, cache, times, calls)  # another block size: measured
    choose(tiny_model(), 16, 16, cache, times, calls)  # another batch: measured
    assert len(calls) == 24


def test_the_cache_key_holds_the_cpu_flags_kernels_torch_and_threads_not_only_the_name(tmp_path, monkeypatch):
    """Two VMs both called "AMD EPYC", one with AVX512-BF16 and one with AVX2 only, sharing a
    home directory (NFS): each measures for itself."""
    cache, calls = tmp_path / "precision.json", []
    times = {"fp32": 1e-3, "bf16": 5e-4}
    facts = {"cpu": "AMD EPYC", "flags": ["avx2", "avx512_bf16", "avx512f"], "capability": "AVX512", "env": {},
             "torch": "2.13.0", "threads": 2}
    monkeypatch.setattr(precision, "cpu_facts", lambda: dict(facts))
    choose(tiny_model(), 32, 16, cache, times, calls)
    measured = len(calls)
    for change in ({"flags": ["avx2"]}, {"capability": "AVX2"}, {"env": {"ONEDNN_MAX_CPU_ISA": "AVX2"}},
                   {"torch": "2.14.0"}, {"threads": 4}):
        monkeypatch.setattr(precision, "cpu_facts", lambda c=change: {**facts, **c})
        choose(tiny_model(), 32, 16, cache, times, calls)
        assert len(calls) == measured + 6, change  # not the other CPU's answer: measured
        measured = len(calls)
    monkeypatch.setattr(precision, "cpu_facts", lambda: dict(facts))
    choose(tiny_model(), 32, 16, cache, times, calls)
    assert len(calls) == measured  # the first CPU again: its cached answer
    assert len(json.loads(cache.read_text())) == 6


def test_cpu_facts_are_read_from_this_machine():
    facts = precision.cpu_facts()
    assert facts["torch"] == torch.__version__ and facts["threads"] == torch.get_num_threads()
    assert facts["capability"] == torch.backends.cpu.get_cpu_capability()
    assert all(precision.SPEED_FLAGS.search(f) for f in facts["flags"])


def _decide_many(model, cache, first_batch, ready):
    """A forked writer: trusted decisions for batches first_batch.. (one key each), at once."""
    precision._cpu_wait = lambda: None  # no load evidence: only the spread, which is none here
    measure = lambda model, name, batch, block: {"fp32": 1e-3, "bf16": 5e-4}[name]  # noqa: E731
    ready.wait()
    for batch in range(first_batch, first_batch + 30):
        precision.cpu_decision(model, batch, 16, cache, measure, lambda d, rows: 0.5, lambda m, t: 1e-3,
                               use_cache=False, announce=False)


def _peaks_many(first, ready):
    """A forked writer of matmul peaks, one key per shape."""
    ready.wait()
    for rows in range(first, first + 30):
        metrics.cached_peak(torch.device("cpu"), torch.float32, [(rows, 8, 8)])


def test_a_lock_file_this_user_cannot_write_still_lets_the_cache_be_updated(tmp_path, monkeypatch):
    """In a cache directory a group shares, the lock file is another user's (0644): opening it for
    writing is refused, so the update takes the lock on a read-only descriptor (it lost every entry)."""
    import os
    path = str(tmp_path / "precision.json")
    open(f"{path}.lock", "w").close()
    real_open = os.open

    def another_users_lock(name, flags, *mode):
        if name.endswith(".lock") and flags & (os.O_RDWR | os.O_WRONLY | os.O_APPEND):
            raise PermissionError(13, "Permission denied", name)
        return real_open(name, flags, *mode)
    monkeypatch.setattr(os, "open", another_users_lock)
    monkeypatch.setattr(precision, "open", lambda name, mode="r", *a, **k: (
        (_ for _ in ()).throw(PermissionError(13, "Permission denied", name)) if str(name).endswith(".lock")
        and mode != "r" else open(name, mode, *a, **k)), raising=False)
    precision.update_cache(path, "k", lambda old: {"choice": "bf16"})
    monkeypatch.undo()
    assert json.loads(open(path).read()) == {"k": {"choice": "bf16"}}


@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(), reason="needs fork")
def test_two_processes_writing_the_caches_at_once_keep_each_others_entries(tmp_path, monkeypatch):
    """Review of issue 32: each writer read the whole cache, changed it and replaced the file, so
    two runs deciding at once on one machine lost entries (a stale copy could also overwrite a
    run's correction). Each update now changes its own key under a lock."""
    import multiprocessing

    monkeypatch.setattr(metrics, "measured_peak", lambda device, dtype, shapes=None, seconds=0.3: metrics.Peak(1e11, "fp32"))
    monkeypatch.setenv("MINGPT_DDP_CACHE", str(tmp_path))
    fork = multiprocessing.get_context("fork")
    model, cache = tiny_model(), str(tmp_path / "precision.json")
    for target, args in ((_decide_many, [(model, cache, 1), (model, cache, 101)]), (_peaks_many, [(1,), (101,)])):
        ready = fork.Event()
        workers = [fork.Process(target=target, args=(*a, ready)) for a in args]
        for w in workers:
            w.start()
        ready.set()
        for w in workers:
            w.join(60)
        assert [w.exitcode for w in workers] == [0, 0]
    assert len(json.loads((tmp_path / "precision.json").read_text())) == 60
    assert len(json.loads((tmp_path / "matmul_peak.json").read_text())) == 60


def test_a_damaged_cache_is_measured_again(tmp_path):
    cache, calls = tmp_path / "precision.json", []
    cache.write_text("{not json")
    assert choose(tiny_model(), 8, 16, cache, {"fp32": 1e-3, "bf16": 2e-3}, calls) == "fp32"
    assert len(calls) == 4 and json.loads(cache.read_text())


def test_the_matmul_probe_is_quick_and_sees_bf16s_speed():
    slowdown = precision.bf16_matmul_slowdown(64, 4096)
    assert 0 < slowdown < 1e4


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


def test_the_peak_is_measured_at_the_models_matmuls_and_falls_back_to_fp32_where_bf16_is_emulated(monkeypatch):
    """MFU is quoted against the model's own matmul sizes (no square size flatters them), and
    where bf16 is slower than fp32 there (no bf16 instructions) against fp32's rate."""
    from mingpt_ddp import metrics

    measured = []

    def fake_rate(device, dtype, shape, seconds=0.2, min_rows=1):
        measured.append((dtype, shape))
        per_dtype = {torch.float32: 1e11, torch.bfloat16: rate_bf16[0]}[dtype]
        return per_dtype * shape[2] / 1024  # wider matmuls run faster

    monkeypatch.setattr(metrics, "matmul_flops", fake_rate)
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=256))
    shapes = model.matmul_shapes(32 * 64)
    assert (2048, 256, 1024) in shapes and all(m == 2048 for m, _, _ in shapes)
    for rate_bf16, expected in (([3e9], ("fp32", 1e11, True)), ([2e11], ("bf16", 2e11, False))):
        metrics._PEAK_CACHE.clear()
        measured.clear()
        peak = metrics.measured_peak(torch.device("cpu"), torch.bfloat16, shapes)
        assert (peak.dtype, peak.flops, peak.emulated) == expected
        assert {shape for _, shape in measured} == set(shapes)
    metrics._PEAK_CACHE.clear()


def test_a_matmul_too_slow_for_the_time_limit_is_rated_from_a_few_rows(monkeypatch):
    """bench peak and the start-up peak on a CPU that emulates bf16: a 2048-size bf16 matmul
    took over 15 minutes on an AVX2-only CPU; the rate of a 16-row one (a few seconds on
    the fake clock here) stands for it."""
    from mingpt_ddp import metrics

    clock = [0.0]
    per_row = {torch.float32: 1e-6, torch.bfloat16: 0.02}
    rows_timed = []

    def fake_matmul(a, b, out):
        clock[0] += per_row[a.dtype] * a.shape[0]
        rows_timed.append(a.shape[0])

    monkeypatch.setattr(metrics.torch, "matmul", fake_matmul)
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    for dtype in (torch.bfloat16, torch.float32):
        clock[0], rows_timed[:] = 0.0, []
        rate = metrics.matmul_flops(torch.device("cpu"), dtype, (2048, 64, 64), seconds=0.3, min_rows=2048)
        assert rate == pytest.approx(2 * 64 * 64 / per_row[dtype])
        if dtype == torch.bfloat16:
            assert set(rows_timed) == {metrics.GAUGE_ROWS} and clock[0] < 1.0
        else:
            assert max(rows_timed) == 2048 and clock[0] < 0.3 + 0.1


def test_mfu_stays_under_100_percent_when_the_start_up_peak_was_held_down(tmp_path, shakespeare):
    """Other processes on the cores while the peak was measured (issue 21 saw 232% and 274%):
    a rate above that peak replaces it, with a note, so MFU never reads over 100%."""
    from test_trainer import make_trainer
    from mingpt_ddp.metrics import MetricsLog

    trainer = make_trainer(shakespeare.read_text()[:20_000])
    trainer.metrics = MetricsLog(str(tmp_path / "metrics.jsonl"), enabled=True, total_steps=10)
    trainer.peak_flops = 1e6
    trainer._log_train(torch.tensor(2.0), steps=1, seconds=0.01, wall_seconds=0.01)
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["mfu"] == pytest.approx(1.0) and trainer.peak_flops > 1e6
    trainer.peak_flops = 1e15  # a plausible peak is left alone
    trainer._log_train(torch.tensor(2.0), steps=1, seconds=0.01, wall_seconds=0.01)
    assert trainer.peak_flops == 1e15


def test_a_model_built_on_the_meta_device_is_timed_on_a_filled_in_copy(tmp_path):
    """FSDP builds the model on the meta device: the calibration's block pass needs weights."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=2, n_head=2, n_embd=32))
    calls = []
    choice = precision.measured_cpu_choice(model, 8, 16, str(tmp_path / "a.json"),
                                           fake_measure({"fp32": 1e-3, "bf16": 5e-4}, calls), lambda d, rows: 1.0)
    assert choice == "bf16" and len(calls) == 6 and all(p.is_meta for p in model.parameters())


def test_a_cpu_matmul_peak_is_measured_once_and_kept_beside_the_precision_cache(monkeypatch, tmp_path):
    """The start-up peak MFU is quoted against (0.3 s of every run's start on a CPU) is kept in
    matmul_peak.json under the CPU's facts, dtype and shapes: measured again for another dtype
    or shape, never for the same ones."""
    from mingpt_ddp import metrics

    monkeypatch.setenv("MINGPT_DDP_CACHE", str(tmp_path))
    measured = []

    def fake_peak(device, dtype, shapes=None, seconds=0.3):
        measured.append((dtype, tuple(shapes)))
        return metrics.Peak(1e11 if dtype == torch.float32 else 1e11 / 8, "fp32", 1.0 if dtype == torch.float32 else 8.0)

    monkeypatch.setattr(metrics, "measured_peak", fake_peak)
    cpu, shapes = torch.device("cpu"), [(256, 48, 144), (256, 48, 192)]
    first = metrics.cached_peak(cpu, torch.float32, shapes)
    assert metrics.cached_peak(cpu, torch.float32, list(reversed(shapes))) == first and len(measured) == 1
    bf16 = metrics.cached_peak(cpu, torch.bfloat16, shapes)
    assert bf16.emulated and metrics.cached_peak(cpu, torch.bfloat16, shapes) == bf16
    metrics.cached_peak(cpu, torch.float32, shapes[:1])
    assert len(measured) == 3 and (tmp_path / "matmul_peak.json").exists()

    # Review: a peak measured under load was kept for good. A run that outruns it raises it for
    # the next runs; a damaged entry is measured again, not a traceback.
    metrics.raise_cached_peak(cpu, torch.float32, shapes, 3e11)
    assert metrics.cached_peak(cpu, torch.float32, shapes).flops == 3e11 and len(measured) == 3
    metrics.raise_cached_peak(cpu, torch.float32, shapes, 2e11)  # never lowered
    assert metrics.cached_peak(cpu, torch.float32, shapes).flops == 3e11
    import json
    cache = json.loads((tmp_path / "matmul_peak.json").read_text())
    for entry in cache.values():
        entry["slowdown"] = None
    (tmp_path / "matmul_peak.json").write_text(json.dumps(cache))
    assert metrics.cached_peak(cpu, torch.float32, shapes).flops == 1e11 and len(measured) == 4


class RunSteps:
    """Drives a RunCheck as the loop does, on a fake clock: `step_ms` per step, and per step the
    share its threads waited for a core (rank 0's cpu_wait), then the measurement it asks for."""

    def __init__(self, trainer, check):
        self.trainer, self.check, self.notes = trainer, check, []
        trainer.metrics.note = self.notes.append

    def run(self, steps, step_ms, waited=0.0):
        for _ in range(steps):
            CLOCK[0] += step_ms / 1e3
            RUN_WAIT[0] += step_ms / 1e3 * (1 - waited)
            RUN_WAIT[1] += step_ms / 1e3 * waited
            self.trainer.state.step += 1
            self.check(self.trainer)


def run_check(trainer, cache, quiet, calls, load=None):
    """A RunCheck on trainer's decision, measuring again with the fake timers (`quiet` times,
    `load` as fake_measure's)."""
    def measure_again(model, batch, block, path):
        def calibrate(model, tokens):
            CLOCK[0] += quiet["fp32"] / 4
            return quiet["fp32"]
        return precision.cpu_decision(model, batch, block, path, fake_measure(quiet, calls, load=load), lambda d, rows: 1.0,
                                      calibrate, use_cache=False)
    return RunSteps(trainer, precision.RunCheck(trainer.precision_decision, lambda: CLOCK[0], measure_again))


def cached_decision(trainer, cache, **entry):
    """The decision a run starts with when `entry` is cached for its model."""
    key = precision.decision_key(precision.cpu_facts(), trainer.model.cfg, trainer.cfg.batch_size, trainer.block_size)
    cache.write_text(json.dumps({key: entry}))
    calls = []
    decision = precision.cpu_decision(trainer.model, trainer.cfg.batch_size, trainer.block_size, str(cache),
                                      fake_measure({}, calls))
    assert decision.source == "cached" and not calls
    return decision, key


def test_a_wrong_cached_choice_is_corrected_by_the_runs_own_steps_once(tmp_path, shakespeare, monkeypatch):
    """Issue 32: an fp32 entry whose passes were timed under load (40 ms a pass, where this run's
    fp32 steps take 10 ms, the optimizer included). After a warm-up window, at the first
    window whose steps had the cores, rank 0 measures again: bf16 is faster, so every rank
    trains in bf16 from the next step, the snapshot says so, and the cache is corrected."""
    from test_trainer import make_trainer
    from mingpt_ddp import metrics, trainer as trainer_module

    monkeypatch.setattr(trainer_module, "cached_peak", lambda device, dtype, shapes: metrics.Peak(1e11, str(dtype)))
    trainer = make_trainer(shakespeare.read_text()[:20_000], log_every=5)
    cache, calls = tmp_path / "precision.json", []
    trainer.precision_decision, key = cached_decision(
        trainer, cache, choice="fp32", why="under load", fp32_ms=[45.0, 40.0, 41.0], bf16_ms=[70.0, 66.0, 67.0],
        bf16_matmul_slowdown=1.0, probe=[4, 16], trusted=True, wait_share={})
    assert precision.RunCheck.for_trainer(trainer) is not None
    steps = run_check(trainer, cache, {"fp32": 2.5e-3, "bf16": 1e-3}, calls)
    steps.run(10, step_ms=10, waited=0.5)  # warm-up, then a window under others' load: not now
    assert not calls and trainer.precision.name == "fp32"
    steps.run(5, step_ms=10)
    assert len(calls) == 6 and trainer.precision.name == "bf16" and trainer.state_dict()["precision"] == "bf16"
    assert len(steps.notes) == 1 and "switching from fp32 from step 16" in steps.notes[0], steps.notes
    assert json.loads(cache.read_text())[key]["choice"] == "bf16"
    steps.run(20, step_ms=5)  # once
    assert len(calls) == 6 and len(steps.notes) == 1


def test_a_choice_the_run_cannot_switch_is_corrected_for_the_next_runs(tmp_path, shakespeare, monkeypatch):
    """An entry of an older version (no load checks) is measured again once. Where the run
    cannot switch (a deterministic run), only the cache is."""
    from test_trainer import make_trainer

    trainer = make_trainer(shakespeare.read_text()[:20_000], log_every=5, deterministic=True)
    cache, calls = tmp_path / "precision.json", []
    trainer.precision_decision, key = cached_decision(
        trainer, cache, choice="fp32", why="older", fp32_ms=[3.0, 3.0], bf16_ms=[8.0, 8.0], bf16_matmul_slowdown=1.0,
        probe=[2, 16])
    assert trainer.precision_decision.doubt
    steps = run_check(trainer, cache, {"fp32": 2.5e-3, "bf16": 1e-3}, calls)
    steps.run(10, step_ms=10)
    assert trainer.precision.name == "fp32" and "this run stays in fp32 (trainer.deterministic=true" in steps.notes[0]
    assert json.loads(cache.read_text())[key]["choice"] == "bf16"
    # A trusted entry whose passes ran another batch than the run's says nothing about its steps: no check.
    trainer.precision_decision, _ = cached_decision(
        trainer, cache, choice="fp32", why="quiet", fp32_ms=[3.0, 3.0], bf16_ms=[8.0, 8.0], bf16_matmul_slowdown=1.0,
        probe=[2, 16], trusted=True)
    assert precision.RunCheck.for_trainer(trainer) is None


def test_fsdp_runs_are_not_checked_and_a_check_leaves_the_global_generators_as_they_were(tmp_path, shakespeare):
    """Review of issue 32: under FSDP the check built a whole unsharded GPT on rank 0 mid-run, whose
    __init__ drew from the global generator: rank 0's dropout stream moved at a timing-dependent
    step (a deterministic run not reproducible, a resume not bit-identical). FSDP has no check
    (it cannot switch anyway); elsewhere the re-measurement cannot move the global generators."""
    from test_trainer import make_trainer

    trainer = make_trainer(shakespeare.read_text()[:20_000], log_every=5)
    trainer.precision_decision = precision.Decision("fp32", "untrusted", {"untrusted": "load at start"},
                                                    str(tmp_path / "p.json"))
    assert precision.RunCheck.for_trainer(trainer) is not None
    trainer.strategy.fixed_precision = "FSDP fixed it"
    assert precision.RunCheck.for_trainer(trainer) is None
    trainer.strategy.fixed_precision = None

    def measure_again(model, batch, block, path):  # a measurement drawing from the global generators
        torch.rand(3)
        return precision.Decision("fp32", "measured", {"why": "stub"}, path)
    steps = RunSteps(trainer, precision.RunCheck(trainer.precision_decision, lambda: CLOCK[0], measure_again))
    before = torch.get_rng_state().clone()
    steps.run(10, step_ms=10)
    assert steps.check.done and "fp32 confirmed" in steps.notes[0]
    assert torch.equal(before, torch.get_rng_state())


def test_a_compiled_runs_steps_are_not_compared_with_eager_passes(tmp_path, shakespeare):
    """Review of issue 32: under trainer.compile=true on a CPU the compiled steps outran the
    decision's eager passes in every run, which measured again each time for nothing."""
    from test_trainer import make_trainer

    trainer = make_trainer(shakespeare.read_text()[:20_000], log_every=5)
    trainer.precision_decision, _ = cached_decision(
        trainer, tmp_path / "precision.json", choice="fp32", why="quiet", fp32_ms=[45.0, 40.0, 41.0],
        bf16_ms=[70.0, 66.0, 67.0], bf16_matmul_slowdown=1.0, probe=[4, 16], trusted=True, wait_share={})
    assert precision.RunCheck.for_trainer(trainer) is not None
    trainer.strategy.compiled = True
    assert precision.RunCheck.for_trainer(trainer) is None
