#!/usr/bin/env bash
# Issue 32 item 2: a 0.75-minute time budget loaded for its first 12 s by 3 busy loops,
# old code against new, then the same finished run continued with another budget (0.25 min,
# quiet): seconds trained of the budget and the loss/LR before and after the continuation.
# About 3 minutes. OLD / NEW: checkouts to compare (each with its .venv); NEW defaults to this
# checkout, OLD must be given (e.g. a worktree of 1580a20, before issue 32).
set -u
OLD=${OLD:?OLD=<checkout to compare>}
NEW=${NEW:-$(cd "$(dirname "$0")/../.." && pwd)}
DATA=${DATA:-$NEW/../shared/data/tinyshakespeare.txt}
[ -f "$DATA" ] || DATA=$NEW/tests/data/tinyshakespeare-40k.txt
OUT=$(mktemp -d)
mkdir -p "$OUT"
COMMON=(experiment=char_cpu_fast "data.path=$DATA" trainer.precision=fp32 trainer.log_every=5 trainer.max_epochs=1000)
STAMP='import sys, time
for line in sys.stdin:
    print(f"{time.time():.3f} {line}", end="", flush=True)'

run() {  # code dir log overrides...
  local code=$1 dir=$2 log=$3; shift 3
  (cd "$code" && PYTHONUNBUFFERED=1 timeout 150 .venv/bin/python -m mingpt_ddp.main "${COMMON[@]}" "hydra.run.dir=$dir" "$@" 2>&1 \
     | python3 -u -c "$STAMP" > "$log")
}

for side in old new; do
  code=$OLD; [ $side = new ] && code=$NEW
  dir=$OUT/$side
  pids=()
  for i in 1 2 3; do python3 -c 'while 1: pass' & pids+=($!); done
  (sleep 12; kill "${pids[@]}" 2>/dev/null) & killer=$!
  t0=$(date +%s.%N)
  run "$code" "$dir" "$OUT/$side.log" trainer.time_budget_minutes=0.75
  t1=$(date +%s.%N)
  kill "${pids[@]}" 2>/dev/null; wait "$killer" 2>/dev/null
  wc -l < "$dir/metrics.jsonl" > "$OUT/$side.lines"
  run "$code" "$dir" "$OUT/$side.more.log" trainer.time_budget_minutes=0.25
  echo "$t0 $t1" > "$OUT/$side.wall"
done

python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
BUDGET = 45.0
for side in ("old", "new"):
    t0, t1 = map(float, open(f"{out}/{side}.wall").read().split())
    lines = [l.split(" ", 1) for l in open(f"{out}/{side}.log")]
    def at(text):
        return next((float(t) for t, l in lines if text in l), None)
    start, last, done = at("parameters on"), at("parameters identical"), at("done: step")
    if None in (start, last, done):
        print(f"{side}: run did not finish as expected, see {out}/{side}.log"); continue
    plans = [l.strip() for t, l in lines if "time budget" in l]
    print(f"{side}: first step to last step {last - start:.1f} s = {100 * (last - start) / BUDGET:.0f}% of the 45 s budget; "
          f"to the end of the final evaluation {done - start:.1f} s = {100 * (done - start) / BUDGET:.0f}%; "
          f"whole wall {t1 - t0:.1f} s")
    for p in plans[:1] + plans[-2:]:
        print(f"    {p.split(' - ', 1)[-1][:160]}")
    records = [json.loads(l) for l in open(f"{out}/{side}/metrics.jsonl")]
    n = int(open(f"{out}/{side}.lines").read())
    before = [r for r in records[:n] if "train_loss" in r][-2:]
    after = [r for r in records[n:] if "train_loss" in r][:4]
    show = lambda rs: ", ".join(f"step {r['step']} loss {r['train_loss']:.3f} lr {r['lr']:.1e}" for r in rs)
    print(f"    continuation: last logged before: {show(before)}")
    print(f"                  first logged after: {show(after)}")
print(f"logs: {out}")
PY
