#!/usr/bin/env bash
# The GPU check: everything that needs a GPU, proven on one GPU in at most 7 minutes (compiling
# included), with the node's own python3 and torch, no network; one report judges each step by
# its criterion (report.json and report.md in OUT_DIR). docs/gpu-check.md says what each step
# proves, how to bring the dependencies to an offline node, and how to read the report.
#
#   launch/gpu_smoke.sh [OUT_DIR]            # on a GPU node
#   launch/gpu_smoke.sh --dry-run [OUT_DIR]  # the plan: each step's time limit and command; runs nothing
#   launch/gpu_smoke.sh --cpu [OUT_DIR]      # the same steps on a CPU at toy sizes (a rehearsal)
#
# Steps (each under its time limit, the whole under TOTAL_SECONDS; a failed step is recorded
# and the next one runs; a step that would start past the total is recorded as not run):
#   api           torch >= the floor, the APIs the code uses, CUDA, NCCL, bf16
#   peak          python -m mingpt_ddp.bench peak: the measured matmul peak (bf16)
#   ddp_eager     bench train, GPT-2 small (124M, block 1024, bf16), DDP-wrapped over a process
#                 group even with one process (trainer.ddp_one_process: NCCL, no_sync)
#   fsdp          the same under trainer.strategy=fsdp: its loss against ddp_eager's
#   ddp_compiled  ddp_eager with trainer.compile=true: tokens/s and MFU (compiling included in its time)
#   run           a real main.py run with evaluations and snapshots: wall_tokens_per_s vs tokens_per_s
#   resume        main.py SIGKILLed after its first snapshot, resumed: parameters against an unbroken run
#   dcp           an FSDP main.py run writes a sharded (DCP) snapshot, the next run loads it
#   sample        python -m mingpt_ddp.sample from the run's snapshot
#
# Settings (environment): PYTHON (default .venv/bin/python if there is one, else python3: any
# interpreter with torch, hydra-core, omegaconf, antlr4-python3-runtime, PyYAML, fsspec, numpy),
# NPROC (processes, one GPU each; default 1), BATCH (micro-batch of the GPT-2 steps, default 8),
# SKIP (step names to leave out, comma-separated; --cpu leaves out ddp_compiled unless SKIP is
# set: compiling takes minutes on a CPU), TOTAL_SECONDS (default 420).
set -uo pipefail

usage() { sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; }
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
else py=$(command -v python3 || echo python3); fi
out=${out:-outputs/gpu_smoke-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out" && out=$(cd "$out" && pwd)
total=${TOTAL_SECONDS:-420}
report_limit=10  # kept for the report: no step starts into it
nproc=${NPROC:-1}
mode=$( ((cpu)) && echo cpu || echo gpu)
if ((cpu)); then skip=${SKIP-ddp_compiled}; else skip=${SKIP:-}; fi

if ((!dry)); then
  # Before any step, within seconds: the dependencies (one line naming what is missing and the wheels)...
  "$py" launch/gpu_smoke.py preflight || exit 2
  # ...and a GPU torch can use.
  if ((!cpu)) && ! "$py" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    listed=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    if ((listed > 0)); then
      echo "error: gpu_smoke: nvidia-smi lists $listed GPU(s) but $py's torch sees none (a CUDA build that does not match the driver, or a CPU-only torch): use a torch that can, or rehearse with --cpu" >&2
    else
      echo "error: gpu_smoke: $py sees no GPU here: run it on a GPU node, or rehearse with --cpu" >&2
    fi
    exit 2
  fi
fi

if ((nproc > 1)); then launch=("$py" -m torch.distributed.run --standalone "--nproc_per_node=$nproc")
else launch=("$py"); fi
corpus=$out/corpus.txt
data=("data.path=$corpus" data.download_url=null "data.cache_dir=$out/cache")
if ((cpu)); then
  device=cpu vocab=0
  # trainer.device=cpu: a rehearsal on a GPU node stays on its CPUs, as its criteria expect
  model=(model=gpt-nano data.block_size=32 "trainer.batch_size=${BATCH:-8}" trainer.precision=fp32 model.dropout=0 trainer.device=cpu)
  small=(model=gpt-nano data.block_size=32 trainer.batch_size=8 trainer.precision=fp32 trainer.device=cpu)
  bench=(steps=4 warmup=1) peak=(seconds=0.1) dcp_steps=4
  run_steps=(trainer.max_steps=8 trainer.log_every=2 trainer.eval_every=4 trainer.snapshot_every_steps=4)
  resume_steps=(trainer.max_steps=16 trainer.snapshot_every_steps=2 trainer.log_every=4 trainer.eval_every=8)
  scale=2  # the limits doubled: a CPU shared with other jobs
else
  device=cuda vocab=50257  # the corpus's characters: GPT-2's vocabulary, so the model is GPT-2 small's 124M
  model=(model=gpt2 data.block_size=1024 "trainer.batch_size=${BATCH:-8}" trainer.precision=bf16 model.dropout=0)
  small=(model=gpt-micro data.block_size=128 trainer.batch_size=16)
  bench=(steps=20 warmup=5) peak=(seconds=0.3) dcp_steps=20 scale=1
  run_steps=(trainer.max_steps=60 trainer.log_every=10 trainer.eval_every=30 trainer.snapshot_every_steps=30)
  resume_steps=(trainer.max_steps=200 trainer.snapshot_every_steps=20 trainer.log_every=20 trainer.eval_every=100)
fi
short_evals=(trainer.eval_batches=2 trainer.final_eval_batches=2)

if ((!dry)); then
  "$py" launch/gpu_smoke.py corpus "$corpus" "$vocab" || exit 2
fi
printf 'gpu_smoke: %s, %s, %s process(es), report in %s\n' "$( ((dry)) && echo 'plan (--dry-run)' || echo running)" \
  "$( ((cpu)) && echo 'CPU rehearsal' || echo GPU)" "$nproc" "$out"

((dry)) || : > "$out/steps.tsv"
planned=0
step() {  # NAME SECONDS COMMAND...: run one step under its limit and the total's, its output in NAME.log
  local name=$1 limit=$(($2 * scale)); shift 2
  if [[ ",$skip," == *",$name,"* ]]; then
    echo "[$name] skipped (SKIP=$skip)"
    ((dry)) || printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >> "$out/steps.tsv"
    return 0
  fi
  planned=$((planned + limit))
  if ((dry)); then
    printf '[%s] (at most %ss) %s\n' "$name" "$limit" "$*"
    return 0
  fi
  local left=$((total - report_limit - 10 - SECONDS))  # 10: the two --kill-after margins
  if ((left < 5)); then
    echo "[$name] not run: the check's total of ${total}s is spent"
    printf '%s\tnot run\t0\t%s\n' "$name" "$limit" >> "$out/steps.tsv"
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "== $name (at most ${limit}s): $*"
  local started=$SECONDS rc
  # Marked: torchrun's workers have sessions of their own, and a SIGKILLed torchrun (timeout's
  # --kill-after) leaves them running; whatever carries the mark goes when the step ends.
  GPU_SMOKE_RUN="step-$$-$name" timeout --kill-after=5 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  for proc in /proc/[0-9]*; do
    grep -qxz "GPU_SMOKE_RUN=step-$$-$name" "$proc/environ" 2>/dev/null && kill -KILL "${proc#/proc/}" 2>/dev/null
  done
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - started))" "$limit" >> "$out/steps.tsv"
  echo "   exit $rc after $((SECONDS - started))s (log: $out/$name.log)"
}

train=("${launch[@]}" -m mingpt_ddp.bench train "${model[@]}" "${data[@]}" "${short_evals[@]}" "${bench[@]}")
ddp=(trainer.ddp_one_process=true trainer.grad_accum_steps=2)
step api 20 "$py" launch/gpu_smoke.py api "$out/api.json" "$mode"
step peak 20 "$py" -m mingpt_ddp.bench peak "${model[@]}" "${peak[@]}" "out=$out/peak.json"
step ddp_eager 30 "${train[@]}" "${ddp[@]}" trainer.compile=false "out=$out/ddp_eager.json"
step fsdp 30 "${train[@]}" trainer.strategy=fsdp trainer.grad_accum_steps=2 trainer.compile=false "out=$out/fsdp.json"
step ddp_compiled 95 "${train[@]}" "${ddp[@]}" trainer.compile=true "out=$out/ddp_compiled.json"
# Eager: the compiled path is timed above; compiling training and evaluation again would not fit.
step run 45 "${launch[@]}" mingpt_ddp/main.py "${model[@]}" "${data[@]}" trainer.ddp_one_process=true \
  trainer.compile=false "${run_steps[@]}" trainer.eval_batches=4 trainer.final_eval_batches=8 "hydra.run.dir=$out/run"
# Bit-identical by the docs (docs/fault-tolerance.md): CPU, and GPUs under trainer.deterministic=true.
step resume 85 "$py" launch/gpu_smoke.py resume "$out/resume" -- "${launch[@]}" mingpt_ddp/main.py "${small[@]}" \
  "${data[@]}" trainer.ddp_one_process=true trainer.deterministic=true trainer.compile=false "${resume_steps[@]}" \
  "${short_evals[@]}"
step dcp 50 "$py" launch/gpu_smoke.py dcp "$out/dcp" -- "${launch[@]}" mingpt_ddp/main.py "${small[@]}" "${data[@]}" \
  trainer.strategy=fsdp trainer.compile=false trainer.max_steps=$dcp_steps trainer.log_every=10 trainer.eval_every=1000 \
  "${short_evals[@]}"
step sample 25 "$py" -m mingpt_ddp.sample "$out/run" "device=$device" max_new_tokens=100

if ((dry)); then
  printf '[report] (at most %ss) %s launch/gpu_smoke.py report %s %s\n' "$report_limit" "$py" "$out" "$mode"
  echo "total: the step limits sum to $((planned + report_limit))s; the check starts no step past ${total}s (TOTAL_SECONDS)"
  exit 0
fi
# The tree that ran: its commit, "-dirty" where anything differs from it (untracked files too),
# "unknown" where this checkout is not a repository of its own (a copy inside another one).
commit=unknown
if [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$repo" ]; then
  commit=$(git rev-parse --short=7 HEAD 2>/dev/null || echo unknown)
  [ -n "$(git status --porcelain 2>/dev/null | head -1)" ] && commit=$commit-dirty
fi
timeout --kill-after=5 "$report_limit" "$py" launch/gpu_smoke.py report "$out" "$mode" "$commit" "$total" "$SECONDS"
rc=$?
if ((rc == 0)); then
  echo "gpu_smoke: every step passed in ${SECONDS}s; report in $out/report.md"
else
  echo "gpu_smoke: some steps failed or did not run (report in $out/report.md, logs in $out)" >&2
fi
exit $((rc == 0 ? 0 : 1))
