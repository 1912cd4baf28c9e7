#!/usr/bin/env bash
# For the day a GPU is lent: every check that needs a GPU, in order, in about 30 minutes on
# one GPU node, into one report (report.json and report.md in OUT_DIR).
#
#   launch/gpu_smoke.sh [OUT_DIR]            # on a GPU node (all its GPUs; NPROC=1 for one)
#   launch/gpu_smoke.sh --dry-run [OUT_DIR]  # print the plan and the commands, run nothing
#   launch/gpu_smoke.sh --cpu [OUT_DIR]      # the same steps on CPU processes at toy sizes (a rehearsal)
#
# Steps (each under its own time limit; a failed step is recorded and the next one runs):
#   1 api          torch and the APIs the code needs (the torch>=2.9 floor), CUDA, NCCL, GPU
#   2 peak         python -m mingpt_ddp.bench peak
#   3 comm         bench comm over NPROC processes (NCCL; nothing to move with one GPU)
#   4 ddp_compiled bench train model=gpt2 data.block_size=1024 model.dropout=0 trainer.compile=true
#   5 ddp_eager    the same with trainer.compile=false
#   6 fsdp         the same with trainer.strategy=fsdp trainer.compile=false (eager)
#   7 fsdp_compiled the same with trainer.strategy=fsdp trainer.compile=true
#   8 run          a real main.py run: wall_tokens_per_s (evaluations and saves included)
#                  against tokens_per_s (steps only) from its metrics.jsonl
#   9 resume       the same run killed with SIGKILL after its first snapshot, then resumed
#
# Settings (environment): PYTHON (default .venv/bin/python, else python3), NPROC (default: the
# GPUs nvidia-smi lists; --cpu: 2), BATCH (per-process micro-batch, default 8), TEXT (a UTF-8
# corpus; default ../shared/data/tinyshakespeare.txt, else the test fixture tiled to 2 MB: the
# node may have no network), STEPS (timed bench steps, default 30), SKIP (step names to leave
# out, comma-separated, e.g. SKIP=ddp_compiled,fsdp_compiled: compiling takes minutes on a CPU).
set -uo pipefail

usage() { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; }
dry=0 cpu=0 out=""
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 ;;
    --cpu) cpu=1 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "error: gpu_smoke: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) out=$arg ;;
  esac
done

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo" || exit 2
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x .venv/bin/python ]; then py=$repo/.venv/bin/python
else py=$(command -v python3); fi
out=${out:-outputs/gpu_smoke-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out" && out=$(cd "$out" && pwd)

if ((cpu)); then
  nproc=${NPROC:-2}
  model=(model=gpt-nano data.block_size=32 "trainer.batch_size=${BATCH:-8}" trainer.precision=fp32)
  steps=${STEPS:-6} warmup=2 run_steps=60 log_every=5 eval_every=20 snapshot_every=5
else
  nproc=${NPROC:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')}
  ((nproc > 0)) || nproc=1  # (--dry-run on a machine without GPUs: the plan for one)
  model=(model=gpt2 data.block_size=1024 model.dropout=0 "trainer.batch_size=${BATCH:-8}")
  steps=${STEPS:-30} warmup=5 run_steps=300 log_every=10 eval_every=100 snapshot_every=100
  if ((!dry)) && ! "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    echo "error: gpu_smoke: $py sees no GPU here: run it on a GPU node, or rehearse with --cpu" >&2
    exit 2
  fi
fi
torchrun=("$py" -m torch.distributed.run --standalone "--nproc_per_node=$nproc")

# A corpus that needs no network, large enough for windows of 1024.
text=${TEXT:-}
if [ -z "$text" ]; then
  if [ -f ../shared/data/tinyshakespeare.txt ]; then text=$(cd ../shared/data && pwd)/tinyshakespeare.txt
  else
    text=$out/corpus.txt
    if ((!dry)) && [ ! -f "$text" ]; then
      for _ in $(seq 50); do cat tests/data/tinyshakespeare-40k.txt; done > "$text"
    fi
  fi
fi
data=("data.path=$text" data.download_url=null)

: > "$out/steps.tsv"
step() {  # NAME SECONDS COMMAND...: run one step under a time limit, its output in NAME.log
  local name=$1 limit=$2; shift 2
  if [[ ",${SKIP:-}," == *",$name,"* ]]; then
    echo "[$name] skipped (SKIP=$SKIP)"
    return 0
  fi
  if ((dry)); then
    printf '[%s] (at most %ss) %s\n' "$name" "$limit" "$*"
    return 0
  fi
  echo "== $name (at most ${limit}s): $*"
  local started=$SECONDS rc
  timeout --kill-after=30 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - started))" >> "$out/steps.tsv"
  echo "   exit $rc after $((SECONDS - started))s (log: $out/$name.log)"
}

echo "gpu_smoke: $( ((dry)) && echo 'plan (--dry-run)' || echo 'running'), $( ((cpu)) && echo "CPU rehearsal, $nproc process(es)" || echo "$nproc GPU(s)"), report in $out"

step api 120 "$py" - "$out/api.json" <<'PY'
import json, sys
import torch
import mingpt_ddp  # refuses a torch below the floor, in one line
from mingpt_ddp import dependencies
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401  (2.9)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401  (public since 2.6)
from torch._inductor.async_compile import maybe_warm_pool  # noqa: F401  (preemption.shield_compile_workers)
facts = {"torch": torch.__version__, "floor": ".".join(map(str, dependencies.TORCH_FLOOR)),
         "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    facts.update(gpu=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                 gpus=torch.cuda.device_count(), nccl=".".join(map(str, torch.cuda.nccl.version())),
                 bf16=torch.cuda.is_bf16_supported())
json.dump(facts, open(sys.argv[1], "w"), indent=1)
print(facts)
PY
step peak 180 "$py" -m mingpt_ddp.bench peak "out=$out/peak.json"
step comm 180 "${torchrun[@]}" -m mingpt_ddp.bench comm "max_bytes=$( ((cpu)) && echo 1MB || echo 256MB)" "out=$out/comm.json"
bench_train() {  # NAME OVERRIDES...
  local name=$1; shift
  step "$name" 420 "${torchrun[@]}" -m mingpt_ddp.bench train "${model[@]}" "${data[@]}" "$@" \
    "steps=$steps" "warmup=$warmup" "out=$out/$name.json"
}
bench_train ddp_compiled trainer.compile=true
bench_train ddp_eager trainer.compile=false
bench_train fsdp trainer.strategy=fsdp trainer.compile=false
bench_train fsdp_compiled trainer.strategy=fsdp trainer.compile=true

run_args=("${model[@]}" "${data[@]}" "trainer.max_steps=$run_steps" "trainer.log_every=$log_every"
          "trainer.eval_every=$eval_every" "trainer.snapshot_every_steps=$snapshot_every")
step run 480 "${torchrun[@]}" mingpt_ddp/main.py "${run_args[@]}" "hydra.run.dir=$out/run"

resume() {  # a run killed (SIGKILL, its whole process group) after its first snapshot, then resumed
  local dir=$out/resume pid waited=0
  setsid "${torchrun[@]}" mingpt_ddp/main.py "${run_args[@]}" "hydra.run.dir=$dir" > "$out/resume_killed.log" 2>&1 &
  pid=$!
  until compgen -G "$dir/snapshot.step*.pt" > /dev/null; do
    sleep 0.2; waited=$((waited + 1))
    if ! kill -0 "$pid" 2>/dev/null || ((waited > 2000)); then echo "no snapshot before the kill"; return 1; fi
  done
  kill -KILL -- "-$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  echo "killed after the first snapshot: $(cd "$dir" && ls snapshot.step*.pt | tr '\n' ' ')"
  grep -q "done: step" "$dir/main.log" 2>/dev/null && { echo "the run finished before the kill"; return 1; }
  "${torchrun[@]}" mingpt_ddp/main.py "${run_args[@]}" "hydra.run.dir=$dir" || return 1
}
if [[ ",${SKIP:-}," == *",resume,"* ]]; then
  echo "[resume] skipped (SKIP=$SKIP)"
elif ((dry)); then
  printf '[resume] (at most %ss) %s &  # killed with SIGKILL after its first snapshot, then run again\n' \
    600 "${torchrun[*]} mingpt_ddp/main.py ${run_args[*]} hydra.run.dir=$out/resume"
else
  export -f resume
  export out py
  step resume 600 bash -c "$(declare -p torchrun run_args); resume"
fi

if ((dry)); then
  echo "[report] $out/report.json and $out/report.md"
  exit 0
fi
"$py" - "$out" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" <<'PY'
"""The figures of every step in one report (report.json, report.md)."""
import json, statistics, sys
from pathlib import Path

out, commit = Path(sys.argv[1]), sys.argv[2]
load = lambda name: json.loads((out / name).read_text()) if (out / name).exists() else None  # noqa: E731
steps = {n: {"exit": int(rc), "seconds": int(s)} for n, rc, s in
         (line.split("\t") for line in (out / "steps.tsv").read_text().splitlines() if line)}
report = {"commit": commit, "api": load("api.json"), "steps": steps}
peak = load("peak.json")
if peak:
    report["peak_tflops"] = peak["peak_tflops"]
comm = load("comm.json")
if comm:
    last = comm["rows"][-1]
    report["comm"] = {"ranks": comm["ranks"], "largest_bytes": last["size"], "busbw_GBps": last["busbw_GBps"],
                      "wrong": sum(r["wrong"] for r in comm["rows"])}
for name in ("ddp_compiled", "ddp_eager", "fsdp", "fsdp_compiled"):
    r = load(f"{name}.json")
    if r:
        report[name] = {k: r.get(k) for k in ("tokens_per_s", "wall_tokens_per_s", "ms_per_step", "mfu", "mfu_datasheet",
                                               "peak_memory_bytes", "precision", "compile", "strategy")}
metrics = out / "run" / "metrics.jsonl"
if metrics.exists():
    rows = [json.loads(l) for l in metrics.read_text().splitlines()]
    windows = [r for r in rows if "tokens_per_s" in r and not r.get("includes_compile")]
    if windows:
        steps_only = statistics.median(w["tokens_per_s"] for w in windows)
        wall = statistics.median(w["wall_tokens_per_s"] for w in windows)
        report["run"] = {"windows": len(windows), "median_tokens_per_s": steps_only, "median_wall_tokens_per_s": wall,
                         "wall_over_steps": wall / steps_only}
resumed = out / "resume.log"
if resumed.exists():
    text = resumed.read_text()
    report["resume"] = {"resumed": "resumed from" in text, "finished": steps.get("resume", {}).get("exit") == 0}
(out / "report.json").write_text(json.dumps(report, indent=1) + "\n")

lines = [f"# gpu_smoke report (commit {commit})", "", f"machine: {json.dumps(report['api'])}", "",
         "| step | exit | seconds |", "| --- | --- | --- |"]
lines += [f"| {n} | {s['exit']} | {s['seconds']} |" for n, s in steps.items()]
lines += ["", "| figure | value |", "| --- | --- |"]
for key in ("peak_tflops", "comm", "ddp_compiled", "ddp_eager", "fsdp", "fsdp_compiled", "run", "resume"):
    if key in report:
        lines.append(f"| {key} | `{json.dumps(report[key])}` |")
(out / "report.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
failed=$(awk -F'\t' '$2 != 0 {print $1}' "$out/steps.tsv" | tr '\n' ' ')
if [ -n "$failed" ]; then
  echo "gpu_smoke: steps that failed: $failed(logs in $out)" >&2
  exit 1
fi
echo "gpu_smoke: every step passed; report in $out/report.md"
