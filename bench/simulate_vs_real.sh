#!/usr/bin/env bash
# cfmo-train simulate against the real runs it simulates: 2 and 4 workers,
# homogeneous and with --slowdown 1=2, in sync and cfmo. Each real run logs
# every step's compute time on every rank (metrics.jsonl for rank 0,
# metrics-rank-R.jsonl for rank R: compute_s); the simulation of the same job
# replays each rank's own steps in order (--step-times RUN/metrics.jsonl), so
# what is compared is the protocol and network model, not a guess of the
# compute. A slowed rank's recorded steps include its slowdown: the
# simulation is not slowed again. Prints a Markdown table of samples/s and
# efficiency, real and simulated, and their ratio; --record appends it to
# bench/RESULTS.md.
#
# This host's network is UCX over shared memory, not a switch of known
# links: each sync run's all-reduce time per step, its workers' wait less
# the part that was waiting for a slower worker's step (from the recorded
# steps), gives an effective link bandwidth for the simulation of that run;
# each cfmo row uses its scenario's sync run's.
#
#   bench/simulate_vs_real.sh [--record]
#   WORKERS="2 4" MODES="sync cfmo" STEPS=400 BATCH=64 MODEL=mlp:512,512   (the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS=${WORKERS:-"2 4"}
MODES=${MODES:-"sync cfmo"}
STEPS=${STEPS:-400}
BATCH=${BATCH:-64}
MODEL=${MODEL:-mlp:512,512}
DATA=${DATA:-synthetic:8192:784}
TRAIN=${TRAIN:-build/tools/cfmo-train}
. bench/common.sh
record=false
[ "${1:-}" = "--record" ] && record=true
[ -x "$TRAIN" ] || { echo "build first: make build" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
field() { "$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2], {}, {'d': d}))" "$1" "$2"; }
# The all-reduce's own seconds per step of a sync run, as Gb/s of a ring of W:
# each worker's wait less what it waited for the step's slowest worker (a
# worker reaches step k's all-reduce after its time between steps k-1 and k,
# and its compute of step k: the lines' compute_s, wait_s and wall_s).
allreduce_gbit() {
  "$PY" - "$1" "$2" "$3" <<'PY'
import json, os, sys
run, summary, w = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3])
def busy(path):
    lines = [l for l in map(json.loads, open(path)) if l.get("type") == "step" and "compute_s" in l]
    out = [lines[0]["compute_s"]]
    for a, b in zip(lines, lines[1:]):
        between = max(0.0, b["wall_s"] - a["wall_s"] - b["compute_s"] - b.get("wait_s", 0.0))
        out.append(between + b["compute_s"])
    return out
ranks = [busy(os.path.join(run, "metrics.jsonl"))]
ranks += [busy(os.path.join(run, f"metrics-rank-{r}.jsonl")) for r in range(1, w)]
n = min(len(x) for x in ranks)
slowest = [max(x[k] for x in ranks) for k in range(n)]
own = [(p["wait_s"] - sum(slowest[k] - ranks[p["rank"]][k] for k in range(n))) / n for p in summary["per_worker"]]
per_step = max(sum(own) / len(own), 1e-6)
print(f"{8 * 2 * (w - 1) / w * (summary['parameters'] + 3) * 4 / per_step / 1e9:.4f}")
PY
}
pct() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%+.0f%%", 100 * (a / b - 1)}'; }

links=""
table="| workers | scenario | mode | real samples/s | sim samples/s | diff | real efficiency | sim efficiency | diff |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for w in $WORKERS; do
  link=""
  for scenario in homogeneous slow; do
    slow=()
    [ "$scenario" = slow ] && slow=(--slowdown 1=2)
    for mode in $MODES; do
      run="$tmp/$w-$scenario-$mode"
      "$TRAIN" --workers "$w" --mode "$mode" --data "$DATA" --model "$MODEL" --steps "$STEPS" --batch-size "$BATCH" \
        --log-every 1 --out "$run" --quiet --json "${slow[@]}" > "$tmp/real.json"
      params=$(field "$tmp/real.json" 'd["parameters"]')
      if [ "$mode" = sync ]; then
        # A ring of W sends 2 (W-1)/W of (params + 3) floats per step in the all-reduce's own time.
        gbit=$(allreduce_gbit "$run" "$tmp/real.json" "$w")
        link="--link-bandwidth $gbit --link-latency 0"
        echo "$w workers, $scenario sync: effective link bandwidth $gbit Gb/s" >&2
        links+="$w $scenario: $gbit Gb/s; "
      fi
      [ -n "$link" ] || { echo "MODES must start with sync" >&2; exit 2; }
      # shellcheck disable=SC2086
      "$TRAIN" simulate --workers "$w" --mode "$mode" --steps "$STEPS" --batch-size "$BATCH" --params "$params" \
        --step-times "$run/metrics.jsonl" $link --json > "$tmp/sim.json"
      real_sps=$(field "$tmp/real.json" 'd["samples_per_s"]')
      real_eff=$(field "$tmp/real.json" 'd["efficiency"]')
      sim_sps=$(field "$tmp/sim.json" 'd["simulate"]["runs"][0]["samples_per_s"]')
      sim_eff=$(field "$tmp/sim.json" 'd["simulate"]["runs"][0]["efficiency"]')
      row=$(printf '| %s | %s | %s | %.0f | %.0f | %s | %.2f | %.2f | %s |' "$w" "$scenario" "$mode" "$real_sps" \
        "$sim_sps" "$(pct "$sim_sps" "$real_sps")" "$real_eff" "$sim_eff" "$(pct "$sim_eff" "$real_eff")")
      echo "$row" >&2
      table+=$'\n'"$row"
    done
  done
done
echo "$table"
if $record; then
  {
    echo
    echo "## cfmo-train simulate against real runs ($(date -u +%Y-%m-%d), $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg))"
    echo
    echo "\`WORKERS=\"$WORKERS\" MODES=\"$MODES\" STEPS=$STEPS BATCH=$BATCH bench/simulate_vs_real.sh\`: $MODEL on $DATA,"
    echo "$STEPS steps of $BATCH per worker, each simulated from its real run's own recorded steps (every rank's),"
    echo "with the effective link bandwidth of its sync run ($links)."
    echo
    echo "$table"
  } >> bench/RESULTS.md
fi
