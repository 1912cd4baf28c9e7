#!/usr/bin/env bash
# Issue 32.1: trainer.precision=auto decided under a load spike, then a quiet run. For the old code
# (OLD_REF, default 1580a20, the base of branch i32-precision, exported with git archive) and the new
# (NEW, default this checkout), both with NEW's venv (.venv/bin/python, or PYTHON).
# Prints what each decided and cached under the spike and what the next quiet run trains in, with
# tok/s (median of the log windows after the first). About 1.5 minutes on the quiet 2-core EPYC (7 runs of 10-15 s; each stopped at 30 s, so 3.5 min at most).
set -u
NEW=${NEW:-$(cd "$(dirname "$0")/../.." && pwd)}
OLD_REF=${OLD_REF:-1580a20}
PY=${PYTHON:-$NEW/.venv/bin/python}
DATA=${DATA:-$NEW/../shared/data/tinyshakespeare.txt}
[ -f "$DATA" ] || DATA=$NEW/tests/data/tinyshakespeare-40k.txt
W=$(mktemp -d)
OLD=$W/old && mkdir -p "$OLD" && git -C "$NEW" archive "$OLD_REF" | tar -x -C "$OLD" || { echo "no $OLD_REF in $NEW"; exit 1; }
# char_cpu_fast's model (2L/128d, block 64, batch 32): bf16 beats fp32 on this AVX512-BF16 CPU when quiet (ref-* runs)
ARGS="experiment=char_cpu_fast trainer.time_budget_minutes=null trainer.max_steps=80 trainer.log_every=10
      trainer.final_eval_batches=2 trainer.eval_batches=2 trainer.device=cpu data.path=$DATA"

run() {  # run NAME REPO CACHE SPIKED [extra args]: prints the precision lines and the steady tok/s
  local name=$1 repo=$2 cache=$3 spiked=$4; shift 4
  local script=$repo/mingpt_ddp/main.py
  [ "$spiked" = spiked ] && script=$NEW/benchmarks/busy_machine/spiked_main.py
  (cd "$repo" && MINGPT_DDP_CACHE=$cache PYTHONPATH=$repo timeout 30 "$PY" "$script" $ARGS \
      hydra.run.dir=$W/$name "$@" > "$W/$name.log" 2>&1) || echo "  ($name exited $?; see $W/$name.log)"
  echo "== $name ($([ "$spiked" = spiked ] && echo "3 busy processes during the first decision's bf16 passes" || echo quiet); cache $cache)"
  grep -o "precision auto:.*\|process(es) ([^)]*)" "$W/$name.log" | sed 's/^/  /' | cut -c1-330
  "$PY" - "$W/$name/metrics.jsonl" "$cache/precision.json" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
tps = [r["tokens_per_s"] for r in rows[1:]]
print(f"  steady tok/s: median {statistics.median(tps):,.0f} over {len(tps)} windows (min {min(tps):,.0f}, max {max(tps):,.0f})" if tps else "  no log windows")
try:
    cache = json.load(open(sys.argv[2]))
except (OSError, ValueError):
    cache = {}
print("  cache now:", [(e["choice"], "trusted" if e.get("trusted") else "untrusted/old", e.get("fp32_ms"), e.get("bf16_ms"))
                       for e in cache.values()] or "empty")
PY
}

echo "old: $OLD_REF ($OLD), new: $NEW ($(git -C "$NEW" rev-parse --short HEAD)); machine load before: $(cat /proc/loadavg)"
for which in OLD NEW; do
  repo=${!which}
  mkdir -p "$W/cache-$which"
  run "$which-spiked" "$repo" "$W/cache-$which" spiked
  run "$which-next-quiet" "$repo" "$W/cache-$which" quiet
done
# A user upgrading with the old code's wrong entry in the cache: the new code on a copy of it.
mkdir -p "$W/cache-upgrade" && cp "$W/cache-OLD/precision.json" "$W/cache-upgrade/" 2>/dev/null
run "NEW-on-OLDs-cache" "$NEW" "$W/cache-upgrade" quiet
# What each precision trains at, quiet (the answer auto should reach)
mkdir -p "$W/cache-ref"
run "ref-fp32" "$NEW" "$W/cache-ref" quiet trainer.precision=fp32
run "ref-bf16" "$NEW" "$W/cache-ref" quiet trainer.precision=bf16
echo "machine load after: $(cat /proc/loadavg); logs in $W"
