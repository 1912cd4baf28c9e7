"""The Python half of launch/gpu_smoke.sh: what its steps need beyond the trainer's own
commands, and the report that judges every step by its criterion (docs/gpu-check.md).

    python launch/gpu_smoke.py preflight                 # the dependencies, in one line (standard library only)
    python launch/gpu_smoke.py corpus FILE VOCAB         # the check's own text (VOCAB characters; 0: the fixture's)
    python launch/gpu_smoke.py api OUT.json gpu|cpu      # torch, its floor, CUDA, NCCL, bf16
    python launch/gpu_smoke.py resume DIR -- COMMAND...  # unbroken; SIGKILLed after a snapshot, resumed; compared
    python launch/gpu_smoke.py dcp DIR -- COMMAND...     # an FSDP run's sharded snapshot written, then resumed from
    python launch/gpu_smoke.py report OUT gpu|cpu COMMIT # report.json and report.md from the steps' files

Run from the checkout's root by the script; the steps' files are in OUT.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "data" / "tinyshakespeare-40k.txt"
DOCS = "docs/gpu-check.md"

# The three pure-Python packages an offline GPU image tends to lack, pinned as docs/gpu-check.md
# builds their wheels; then what else the trainer imports.
WHEELS = {"hydra": "hydra-core==1.3.2", "omegaconf": "omegaconf==2.3.0", "antlr4": "antlr4-python3-runtime==4.9.3"}
OTHERS = {"yaml": "PyYAML", "fsspec": "fsspec", "numpy": "numpy", "torch": "torch",
          "packaging": "packaging"}  # packaging: hydra-core's own dependency (the wheels come --no-deps)

GPT2_PARAMETERS = 124_439_808  # GPT-2 small: vocabulary 50,257, block 1,024, 12 x 768, head tied to wte
GPT2_VOCAB = 50_257
# FSDP2 against DDP from the same seed and data, loss at the last step: bf16 (FSDP computes in
# bf16 parameters and a bf16 residual stream, DDP's autocast keeps fp32 ones: a few bf16 ulps,
# 2^-8 each, apart) and fp32 (the same operations: equal up to summation order).
LOSS_TOLERANCE = {"bf16": 0.02, "fp32": 1e-5}
PEAK_OF_DATASHEET = 0.5  # a GPU below half its datasheet bf16 matmul rate is throttled, shared or misread


def fail(message: str, code: int = 2) -> None:
    print(f"error: gpu_smoke: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


# ---- before any step ----------------------------------------------------------------------
def found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def preflight() -> None:
    """One line and exit 2 when this interpreter lacks a dependency (or has a torch below the
    floor), before any step: standard library only, a fraction of a second."""
    missing_wheels = [req for module, req in WHEELS.items() if not found(module)]
    missing_others = [req for module, req in OTHERS.items() if not found(module)]
    if missing_wheels or missing_others:
        names = ", ".join(r.split("==")[0] for r in missing_wheels + missing_others)
        advice = []
        if missing_wheels:
            advice.append(f"bring {' '.join(missing_wheels)} as wheels (`pip wheel --no-deps ... -w .wheels` where "
                          f"there is an index) and install them here with `{sys.executable} -m pip install "
                          f"--no-index --no-deps .wheels/*.whl` ({DOCS})")
        if missing_others:
            advice.append("or set PYTHON= to an interpreter that has " + ", ".join(missing_others))
        fail(f"{sys.executable} lacks {names}, which the check needs before any step: " + "; ".join(advice))
    import mingpt_ddp  # noqa: F401  (exits with one line when torch is older than the floor)


def corpus(path: str, vocab: int) -> None:
    """The test fixture tiled to about 2 MB (no download); with `vocab`, one line of as many
    other characters first (CJK ideographs), so that the character vocabulary has `vocab`
    tokens: GPT-2's 50,257 make the model GPT-2 small's 124M parameters, its embedding and
    head included, as data.tokenizer=gpt2 would without tiktoken's file (not on an offline node)."""
    text = FIXTURE.read_text(encoding="utf-8")
    extra = ""
    if vocab:
        need = vocab - len(set(text))
        points = [*range(0x4E00, 0xA000), *range(0x20000, 0x2A6E0)]  # CJK Unified Ideographs, Extension B
        if not 0 <= need <= len(points):
            fail(f"cannot make a vocabulary of {vocab} characters from the fixture")
        chars = "".join(chr(c) for c in points[:need])
        extra = "\n".join(chars[i:i + 64] for i in range(0, len(chars), 64)) + "\n"
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(extra + text * max(1, 2_000_000 // len(text)))
    os.replace(tmp, path)


# ---- steps ---------------------------------------------------------------------------------
def api(out: str, mode: str) -> None:
    """torch and the APIs the code needs (the floor), CUDA, NCCL, bf16: facts and a verdict."""
    import torch
    import torch.distributed as torch_dist

    import mingpt_ddp  # noqa: F401  (refuses a torch below the floor)
    from mingpt_ddp import dependencies, metrics

    problems = []
    try:
        from torch._inductor.async_compile import maybe_warm_pool  # noqa: F401  (preemption.shield_compile_workers)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401  (2.9)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401  (public since 2.6)
    except ImportError as exc:
        problems.append(f"an API the code uses is missing: {exc}")
    floor = ".".join(map(str, dependencies.TORCH_FLOOR))
    facts: dict[str, Any] = {"python": sys.executable, "python_version": sys.version.split()[0],
                             "package": mingpt_ddp.__file__,  # this checkout's, also where another is installed
                             "torch": torch.__version__, "floor": floor,
                             "at_least_floor": dependencies.release(torch.__version__) >= dependencies.TORCH_FLOOR,
                             "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                             "gloo": torch_dist.is_gloo_available(), "nccl_available": torch_dist.is_nccl_available()}
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        lookup = getattr(metrics, "datasheet_peak_flops", None)  # the vendor table, where this checkout has it
        datasheet = lookup(device, torch.bfloat16) if lookup else None
        facts.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                     capability=list(torch.cuda.get_device_capability(0)), bf16=torch.cuda.is_bf16_supported(),
                     memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                     nccl=".".join(map(str, torch.cuda.nccl.version())) if facts["nccl_available"] else None,
                     datasheet_bf16_tflops=datasheet / 1e12 if datasheet else None)
    if not facts["at_least_floor"]:
        problems.append(f"torch {torch.__version__} is below the floor {floor}")
    if mode == "gpu":
        if not facts["cuda_available"]:
            problems.append("torch sees no CUDA device")
        elif not facts["bf16"]:
            problems.append(f"{facts['gpu']} has no bf16")
        if not facts["nccl_available"]:
            problems.append("this torch has no NCCL")
    facts["problems"] = problems
    Path(out).write_text(json.dumps(facts, indent=1) + "\n")
    print(json.dumps(facts))
    if problems:
        fail("; ".join(problems), 1)


class Children:
    """The runs this step starts, each in its own session: killed with it (SIGTERM from the
    script's time limit), so that no training outlives the step."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        signal.signal(signal.SIGTERM, self._terminate)

    def start(self, command: list[str], log: Path) -> subprocess.Popen:
        # Marked in its environment: torchrun starts each worker in a session of its own, out of
        # reach of a kill of this run's group, and a worker blocked in NCCL outlives its agent.
        env = {**os.environ, RUN_MARK: f"{os.getpid()}-{len(self.procs)}"}
        with open(log, "w") as f:
            proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
                                    env=env)
        proc.mark = env[RUN_MARK]
        self.procs.append(proc)
        return proc

    def run(self, command: list[str], log: Path) -> int:
        return self.start(command, log).wait()

    def _terminate(self, signum, frame) -> None:
        for proc in self.procs:
            kill_group(proc, wait=False)  # the main thread may be in proc.wait(): no wait here
        os._exit(124)


RUN_MARK = "GPU_SMOKE_RUN"


def marked(mark: str) -> list[int]:
    """The processes whose environment carries RUN_MARK=`mark` (a run and every worker it started)."""
    pids, needle = [], f"{RUN_MARK}={mark}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def kill_group(proc: subprocess.Popen, wait: bool = True) -> None:
    """SIGKILL the run: its process group and every process it started (torchrun's workers
    each have a session of their own)."""
    targets = marked(proc.mark) if getattr(proc, "mark", None) and os.path.isdir("/proc") else []
    for pgid in {proc.pid, *targets}:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in targets:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if wait:
        proc.wait()


def resumed_step(log: Path) -> Optional[int]:
    found_ = re.search(r"resumed from .*: epoch \d+, step (\d+)", log.read_text(errors="replace"))
    return int(found_[1]) if found_ else None


def last_line(log: Path) -> str:
    """The line that says why a run failed: its last `error:` line, else its last line (a
    traceback's exception; never the traceback)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^(\[rank \d+\] )?error:", line)]
    return (errors or lines or ["(no output)"])[-1][:300]


def parameters(run_dir: Path) -> tuple[dict[str, Any], int]:
    """(the model's parameters, step) of a run's newest snapshot (a DDP file or FSDP's shards merged)."""
    from mingpt_ddp.tools.trained import load_latest

    found_ = load_latest(str(run_dir))
    if found_ is None:
        raise FileNotFoundError(f"no snapshot in {run_dir}")
    snapshot = found_[0]
    return snapshot["model"], int(snapshot["train_state"]["step"])


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """How far two state dicts are apart: tensors that differ, the largest difference."""
    import torch

    names = sorted(set(a) | set(b))
    differ = [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]
    largest = max((float((a[n].double() - b[n].double()).abs().max()) for n in differ if n in a and n in b
                   and a[n].shape == b[n].shape), default=0.0)
    return {"tensors": len(names), "tensors_differing": len(differ), "max_abs_diff": largest,
            "identical": not differ}


def resume(out: str, command: list[str]) -> None:
    """A run of N steps unbroken; the same run SIGKILLed (its whole process group) once its
    first snapshot is on disk, then the same command again, which resumes from it; then the
    two runs' final snapshots compared parameter by parameter."""
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    children = Children()
    result: dict[str, Any] = {"command": command}
    unbroken, broken = root / "unbroken", root / "killed"
    rc = children.run([*command, f"hydra.run.dir={unbroken}"], root / "unbroken.log")
    result["unbroken_exit"] = rc
    if rc != 0:
        write_result(root, result, f"the unbroken run failed (exit {rc}): {last_line(root / 'unbroken.log')}")
    proc = children.start([*command, f"hydra.run.dir={broken}"], root / "killed.log")
    started = time.monotonic()
    while not glob.glob(str(broken / "snapshot.step*.pt")) and not glob.glob(str(broken / "snapshot.pt.dcp" / "step*" / "COMMITTED.json")):
        if proc.poll() is not None:
            write_result(root, {**result, "killed_exit": proc.returncode},
                         f"the run ended (exit {proc.returncode}) before its first snapshot: {last_line(root / 'killed.log')}")
        time.sleep(0.02)
    kill_group(proc)
    result.update(killed_after_s=round(time.monotonic() - started, 2), killed_exit=proc.returncode,
                  snapshots_at_kill=sorted(os.path.basename(p) for p in glob.glob(str(broken / "snapshot.step*.pt"))))
    if "done: step" in (broken / "main.log").read_text(errors="replace") if (broken / "main.log").exists() else False:
        write_result(root, result, "the run finished before the kill: make it longer")
    rc = children.run([*command, f"hydra.run.dir={broken}"], root / "resumed.log")
    result.update(resumed_exit=rc, resumed_from_step=resumed_step(root / "resumed.log"))
    if rc != 0:
        write_result(root, result, f"the resumed run failed (exit {rc}): {last_line(root / 'resumed.log')}")
    (a, step_a), (b, step_b) = parameters(unbroken), parameters(broken)
    result.update(final_step_unbroken=step_a, final_step_resumed=step_b, parameters=compare(a, b))
    write_result(root, result)


def dcp(out: str, command: list[str]) -> None:
    """An FSDP run (trainer.strategy=fsdp in `command`) that writes its sharded snapshot (DCP)
    at its last step, K; the same run directory again with trainer.max_steps=2K, which loads it
    and trains on: the sharded save and load on this device, and the shards' parameters read back."""
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    children = Children()
    first = [a for a in command if a.startswith("trainer.max_steps=")]
    if not first:
        fail("dcp needs trainer.max_steps=K in its command")
    k = int(first[-1].split("=", 1)[1])
    run = root / "run"
    result: dict[str, Any] = {"command": command, "first_steps": k}
    rc = children.run([*command, f"hydra.run.dir={run}"], root / "written.log")
    result["written_exit"] = rc
    committed = sorted(glob.glob(str(run / "snapshot.pt.dcp" / "step*" / "COMMITTED.json")))
    result["sharded_snapshots"] = [os.path.basename(os.path.dirname(p)) for p in committed]
    result["has_dcp_metadata"] = bool(committed) and os.path.exists(os.path.join(os.path.dirname(committed[-1]), ".metadata"))
    if rc != 0:
        write_result(root, result, f"the run that writes it failed (exit {rc}): {last_line(root / 'written.log')}")
    rc = children.run([*command, f"trainer.max_steps={2 * k}", f"hydra.run.dir={run}"], root / "loaded.log")
    result.update(loaded_exit=rc, resumed_from_step=resumed_step(root / "loaded.log"))
    if rc != 0:
        write_result(root, result, f"the run that loads it failed (exit {rc}): {last_line(root / 'loaded.log')}")
    device = re.search(r"on \d+ process\(es\) \((\w+), (\w+), (\w+)\)", (root / "loaded.log").read_text(errors="replace"))
    result["device"], result["backend"] = (device[1], device[2]) if device else (None, None)
    params, step = parameters(run)
    result.update(final_step=step, parameters_finite=all(bool(v.float().isfinite().all()) for v in params.values()))
    write_result(root, result)


def write_result(root: Path, result: dict[str, Any], error: Optional[str] = None) -> None:
    result["error"] = error
    (root.parent / f"{root.name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    if error:
        fail(error, 1)
    sys.exit(0)


# ---- the report ------------------------------------------------------------------------------
def load(out: Path, name: str) -> Optional[dict[str, Any]]:
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


def finite(values) -> bool:
    return bool(values) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def judge_train(r: dict[str, Any], mode: str, compiled: bool, strategy: str) -> list[str]:
    """What a `bench train` result of the check must show (empty: it passed)."""
    wrong = []
    if r.get("strategy") != strategy:
        wrong.append(f"strategy {r.get('strategy')}, not {strategy}")
    if bool(r.get("compile")) != compiled:
        wrong.append(f"compile={r.get('compile')}")
    elif compiled and not r.get("compiled_graphs"):
        wrong.append("compile asked for but dynamo compiled no graph (TORCHDYNAMO_DISABLE? a fallback to eager?)")
    backend = "nccl" if mode == "gpu" else "gloo"
    if r.get("process_group") != backend:
        wrong.append(f"process group {r.get('process_group')}, not {backend}")
    if strategy == "ddp":
        ddp = r.get("ddp") or {}
        if not ddp:
            wrong.append("the model was not DDP-wrapped")
        elif ddp.get("backend") != backend or not ddp.get("rebuilt_buckets") or not ddp.get("buckets_reduced"):
            wrong.append(f"DDP did not reduce through its buckets on {backend}: {ddp}")
        if r.get("grad_accum_steps", 1) < 2:
            wrong.append("no gradient accumulation: no_sync was not exercised")
    if mode == "gpu":
        if r.get("precision") != "bf16":
            wrong.append(f"precision {r.get('precision')}, not bf16")
        if abs(r.get("parameters", 0) - GPT2_PARAMETERS) > 0.005 * GPT2_PARAMETERS or r.get("block_size") != 1024:
            wrong.append(f"{r.get('parameters')} parameters at block {r.get('block_size')}: not GPT-2 small at 1024")
    if not (r.get("tokens_per_s") or 0) > 0:
        wrong.append("no tokens/s")
    if not finite(r.get("losses")):
        wrong.append(f"losses not finite: {r.get('losses')}")
    return wrong


def train_figures(r: dict[str, Any], peak_tflops: Optional[float], datasheet_tflops: Optional[float]) -> dict[str, Any]:
    """tokens/s and MFU against the measured peak (the peak step's) and against the datasheet,
    computed here from FLOPs per token, whatever the trainer's own `mfu` names."""
    world = (r.get("env") or {}).get("world_size", 1)
    achieved = r["flops_per_token"] * r["tokens_per_s"] / world / 1e12 if r.get("flops_per_token") and r.get("tokens_per_s") else None
    return {
        "parameters": r.get("parameters"), "block_size": r.get("block_size"), "precision": r.get("precision"),
        "batch": f"{r.get('batch_size')} x {r.get('grad_accum_steps')} accumulation x {world} process(es)",
        "tokens_per_s": r.get("tokens_per_s"), "wall_tokens_per_s": r.get("wall_tokens_per_s"),
        "ms_per_step": r.get("ms_per_step"), "first_step_s": r.get("first_step_s"),
        "achieved_tflops_per_process": achieved,
        "mfu_vs_measured_peak": achieved / peak_tflops if achieved and peak_tflops else None,
        "mfu_vs_datasheet": achieved / datasheet_tflops if achieved and datasheet_tflops else None,
        "peak_memory_gib": r["peak_memory_bytes"] / 2**30 if r.get("peak_memory_bytes") else None,
        "loss_first": (r.get("losses") or [None])[0], "loss_last": (r.get("losses") or [None])[-1],
        "ddp": r.get("ddp"), "process_group": r.get("process_group"),
    }


CRITERIA = {
    "api": "torch >= the floor, the APIs the code uses import; GPU: torch sees CUDA, the GPU has bf16, torch has NCCL",
    "peak": "a bf16 (CPU: fp32) matmul rate was measured; GPU: at least half the datasheet's dense bf16 peak where known",
    "ddp_eager": "bench train exits 0; the model is DDP-wrapped over a process group (NCCL; CPU: gloo) that reduced "
                 "through its buckets, with 2-step accumulation (no_sync); GPU: GPT-2 small (124M) at block 1024 "
                 "in bf16; tokens/s > 0 and every step's loss finite",
    "fsdp": "bench train under trainer.strategy=fsdp exits 0 (FSDP2, one-rank mesh); its loss at the last step "
            "equals ddp_eager's within 2% (bf16; fp32: 1e-5) from the same seed and data",
    "ddp_compiled": "as ddp_eager, with trainer.compile=true (compiling is in first_step_s)",
    "run": "main.py exits 0 with 2 or more steady metrics windows, each with 0 < wall_tokens_per_s <= tokens_per_s",
    "resume": "the run SIGKILLed after its first snapshot resumes from a step before the end, ends at the same step "
              "with parameters bit-identical to the unbroken run's (trainer.deterministic=true: docs/fault-tolerance.md)",
    "dcp": "an FSDP run writes a committed sharded snapshot (DCP .metadata); the next run loads it (resumed from "
           "that step, on the check's device and backend), trains to twice the steps, and its parameters are finite",
    "sample": "python -m mingpt_ddp.sample generates text from the run's snapshot on the check's device",
}


def judge(out: Path, mode: str) -> dict[str, dict[str, Any]]:
    """Each step's verdict: its criterion, the figures behind it, and why it failed."""
    steps: dict[str, dict[str, Any]] = {}
    for line in (out / "steps.tsv").read_text().splitlines() if (out / "steps.tsv").exists() else []:
        name, status, seconds, limit = line.split("\t")
        steps[name] = {"criterion": CRITERIA.get(name, ""), "limit_s": int(limit), "seconds": int(seconds),
                       "exit": int(status) if status.lstrip("-").isdigit() else None,
                       "status": status if not status.lstrip("-").isdigit() else "ran", "figures": {}, "reason": None}
    api_facts = load(out, "api.json") or {}
    datasheet = api_facts.get("datasheet_bf16_tflops")
    peak = load(out, "peak.json") or {}
    dtype = "bf16" if mode == "gpu" else "fp32"
    peak_tflops = (peak.get("peak_tflops") or {}).get(dtype)

    checks: dict[str, Callable[[dict[str, Any]], list[str]]] = {}

    def check(name):
        def register(fn):
            checks[name] = fn
            return fn
        return register

    @check("api")
    def _(s):
        s["figures"] = api_facts
        return list(api_facts.get("problems", [])) if api_facts else ["no api.json"]

    @check("peak")
    def _(s):
        s["figures"] = {f"measured_{dtype}_tflops": peak_tflops, "datasheet_bf16_tflops": datasheet,
                        "of_datasheet": peak_tflops / datasheet if peak_tflops and datasheet else None,
                        "all_tflops": peak.get("peak_tflops"), "model_peak_tflops": peak.get("model_peak_tflops")}
        if not peak_tflops:
            return [f"no {dtype} peak measured"]
        if mode == "gpu" and datasheet and peak_tflops < PEAK_OF_DATASHEET * datasheet:
            return [f"{peak_tflops:.0f} TFLOP/s is under half the datasheet's {datasheet:.0f}"]
        return []

    def train_check(name, compiled, strategy):
        def fn(s):
            r = load(out, f"{name}.json")
            if r is None:
                return [f"no {name}.json"]
            s["figures"] = train_figures(r, peak_tflops, datasheet)
            return judge_train(r, mode, compiled, strategy)
        return fn

    checks["ddp_eager"] = train_check("ddp_eager", False, "ddp")
    checks["ddp_compiled"] = train_check("ddp_compiled", True, "ddp")
    fsdp_train = train_check("fsdp", False, "fsdp")

    @check("fsdp")
    def _(s):
        wrong = fsdp_train(s)
        f, d = load(out, "fsdp.json"), load(out, "ddp_eager.json")
        if not f or not d or not f.get("losses") or not d.get("losses"):
            return wrong + ["no ddp_eager losses to compare with"]
        tolerance = LOSS_TOLERANCE["bf16" if f.get("precision") == "bf16" else "fp32"]
        n = min(len(f["losses"]), len(d["losses"]))
        a, b = f["losses"][n - 1], d["losses"][n - 1]
        s["figures"].update(step=n, fsdp_loss=a, ddp_loss=b, relative_difference=abs(a - b) / abs(b) if b else None,
                            tolerance=tolerance, first_step_difference=abs(f["losses"][0] - d["losses"][0]))
        if not abs(a - b) <= tolerance * abs(b):
            wrong.append(f"loss at step {n}: FSDP {a:.5f}, DDP {b:.5f}, beyond {tolerance:g} relative")
        return wrong

    @check("run")
    def _(s):
        path = out / "run" / "metrics.jsonl"
        if not path.exists():
            return ["no run/metrics.jsonl"]
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        windows = [r for r in rows if "tokens_per_s" in r and not r.get("includes_compile")]
        if not windows:
            return ["no steady metrics windows"]
        steps_only = statistics.median(w["tokens_per_s"] for w in windows)
        wall = statistics.median(w.get("wall_tokens_per_s", float("nan")) for w in windows)
        s["figures"] = {"windows": len(windows), "median_tokens_per_s": steps_only, "median_wall_tokens_per_s": wall,
                        "wall_over_steps": wall / steps_only if steps_only else None,
                        "evaluations": sum("val_loss" in r for r in rows),
                        "final_val_loss": next((r["val_loss"] for r in reversed(rows) if "val_loss" in r), None)}
        bad = [w["step"] for w in windows if not 0 < w.get("wall_tokens_per_s", 0) <= w["tokens_per_s"] * 1.0001]
        return (["fewer than 2 steady windows"] if len(windows) < 2 else []) + \
            ([f"wall_tokens_per_s not in (0, tokens_per_s] at steps {bad}"] if bad else [])

    @check("resume")
    def _(s):
        r = load(out, "resume.json")
        if r is None:
            return ["no resume.json"]
        s["figures"] = {k: r.get(k) for k in ("snapshots_at_kill", "killed_after_s", "resumed_from_step",
                                              "final_step_unbroken", "final_step_resumed", "parameters")}
        if r.get("error"):
            return [r["error"]]
        wrong = []
        if not 0 < (r.get("resumed_from_step") or 0) < (r.get("final_step_unbroken") or 0):
            wrong.append(f"the second run did not resume from a snapshot before the end (step "
                         f"{r.get('resumed_from_step')} of {r.get('final_step_unbroken')})")
        if r.get("final_step_unbroken") != r.get("final_step_resumed"):
            wrong.append(f"final steps differ: {r.get('final_step_unbroken')} vs {r.get('final_step_resumed')}")
        p = r.get("parameters") or {}
        if not p.get("identical"):
            wrong.append(f"{p.get('tensors_differing')} of {p.get('tensors')} parameter tensors differ "
                         f"(largest difference {p.get('max_abs_diff')})")
        return wrong

    @check("dcp")
    def _(s):
        r = load(out, "dcp.json")
        if r is None:
            return ["no dcp.json"]
        s["figures"] = {k: r.get(k) for k in ("sharded_snapshots", "has_dcp_metadata", "resumed_from_step",
                                              "final_step", "device", "backend", "parameters_finite")}
        if r.get("error"):
            return [r["error"]]
        wrong = []
        if not r.get("has_dcp_metadata"):
            wrong.append("no committed sharded snapshot with DCP's .metadata")
        if r.get("resumed_from_step") != r.get("first_steps"):
            wrong.append(f"resumed from step {r.get('resumed_from_step')}, not {r.get('first_steps')}")
        if r.get("final_step") != 2 * r.get("first_steps", 0):
            wrong.append(f"ended at step {r.get('final_step')}")
        want = ("cuda", "nccl") if mode == "gpu" else ("cpu", "gloo")
        if (r.get("device"), r.get("backend")) != want:
            wrong.append(f"ran on {r.get('device')}/{r.get('backend')}, not {'/'.join(want)}")
        if not r.get("parameters_finite"):
            wrong.append("parameters not finite")
        return wrong

    @check("sample")
    def _(s):
        log = out / "sample.log"
        text = log.read_text(errors="replace").strip() if log.exists() and s["exit"] == 0 else ""
        s["figures"] = {"text": text[:300]} if text else {}
        return [] if text or s["exit"] != 0 else ["no text"]

    for name, s in steps.items():
        if s["status"] == "not run":
            s["reason"] = "not started: the check's total time was spent"
        if s["status"] != "ran":
            continue
        wrong = []
        if s["exit"] != 0:
            reason = "stopped at its time limit" if s["exit"] in (124, 137) else f"exit {s['exit']}"
            log = out / f"{name}.log"
            wrong.append(f"{reason}: {last_line(log)}" if log.exists() else reason)
        try:
            figures_wrong = checks[name](s) if name in checks else []
        except Exception as exc:  # a figure the step did not write: a failed criterion, not a traceback
            figures_wrong = [f"its figures could not be read ({type(exc).__name__}: {exc})"]
        wrong += [w for w in figures_wrong if not wrong or w not in wrong[0]]
        s["status"] = "failed" if wrong else "passed"
        s["reason"] = "; ".join(wrong)[:600] if wrong else None
    return steps


def report(out_dir: str, mode: str, commit: str, total_limit: str, elapsed: str) -> None:
    out = Path(out_dir)
    steps = judge(out, mode)
    api_facts = load(out, "api.json") or {}
    failed = [n for n, s in steps.items() if s["status"] in ("failed", "not run")]
    result = {"commit": commit, "mode": mode, "total_limit_s": int(total_limit), "elapsed_s": int(elapsed),
              "machine": {k: api_facts.get(k) for k in ("gpu", "gpus", "memory_gib", "capability", "torch", "cuda",
                                                        "nccl", "python", "python_version")},
              "passed": not failed, "failed": failed, "steps": steps}
    (out / "report.json").write_text(json.dumps(result, indent=1, default=str) + "\n")

    def short(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return json.dumps(v, default=str) if isinstance(v, (dict, list)) or "\n" in str(v) else str(v)

    lines = [f"# gpu_smoke report ({mode}, commit {commit}): {'passed' if not failed else 'FAILED: ' + ', '.join(failed)}",
             "", f"machine: {json.dumps(result['machine'])}", f"wall time: {elapsed} s of {total_limit} s", "",
             "| step | status | seconds (limit) | criterion | figures / reason |", "| --- | --- | --- | --- | --- |"]
    for name, s in steps.items():
        shown = s["reason"] or ", ".join(f"{k}={short(v)}" for k, v in s["figures"].items()
                                         if v is not None and k not in ("all_tflops", "model_peak_tflops", "problems"))
        lines.append(f"| {name} | {s['status']} | {s['seconds']} ({s['limit_s']}) | {s['criterion']} | "
                     f"{shown.replace('|', '/')} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(1 if failed else 0)


def main(argv: list[str]) -> None:
    # This checkout's package, also where another checkout's is installed (an editable install)
    sys.path.insert(0, str(REPO))
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    command, args = argv[0], argv[1:]
    if command == "preflight":
        preflight()
    elif command == "corpus":
        corpus(args[0], int(args[1]))
    elif command == "api":
        api(args[0], args[1])
    elif command in ("resume", "dcp"):
        split = args.index("--")
        (resume if command == "resume" else dcp)(args[0], args[split + 1:])
    elif command == "report":
        report(*args)
    else:
        fail(f"unknown command {command} (see --help)")


if __name__ == "__main__":
    main(sys.argv[1:])
