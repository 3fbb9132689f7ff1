#!/usr/bin/env bash
# Goodput under failures (issue 16): 4 rank processes on this host, started
# by hand as a launcher would (RANK, WORLD_SIZE, CFMO_RENDEZVOUS), for
# DURATION seconds of --time-limit, in sync --elastic, localsgd --elastic and
# cfmo, once without faults and once with a rank killed (SIGKILL, reaped at
# once) every KILL_EVERY seconds and restarted RESTART_AFTER seconds later
# with the same command, so it rejoins. The victims rotate 3, 2, 1, 3, ...
# and the last is rank 0 (not special: its loss moves the budget, the
# summary and the joins to the lowest live rank; but a restarted rank 0, or
# any rank below the one that serves the joins, is not taken back in: it
# shows as a kill without a join). The last kill leaves its joiner at least
# KILL_EVERY - RESTART_AFTER seconds to train. With the defaults (7 kills a
# run) the six runs take about 13 minutes.
#
# Goodput: samples trained per second of wall time with faults over the
# fault-free run's, the seconds from the first rank's start to the last
# process's end as the script measures them; the samples, in every mode the
# same way, from the step lines of every process's metrics (--log-every 10;
# a joiner from one step before its own joined line; a killed process up to
# its last line), and each run's summary's samples over those below the
# table (cfmo's and asgd's count a killed process up to its last
# reconciliation, so a little under 1). Accuracy: the final test accuracy with faults and
# without. Join: each joiner's first_step_s (seconds from its start to its
# first training step; its metrics line), median and max, and how many kills
# ended in a join. A process that does not exit 0, a run whose summary is
# missing or not unique, a kill without a join: listed under "problems"
# (the script exits 1 only when a mode has no figures).
#
# The two runs of a mode alternate their order over REPS (fault-free first in
# odd reps); the figures are medians over REPS. Prints a Markdown table;
# --record appends it to bench/RESULTS.md with the load average.
#
#   bench/elastic.sh [--record]
#   DURATION=120 KILL_EVERY=15 RESTART_AFTER=5 REPS=1 MODES="sync localsgd cfmo"   (the defaults)
#   DURATION=40 KILL_EVERY=10 RESTART_AFTER=3 MODES=cfmo bench/elastic.sh             (a quick look)
#   EXTRA="--peer-timeout 5" bench/elastic.sh                                          (flags for every rank)
#   KEEP=1 bench/elastic.sh                                   (keeps the runs' files: out-R, err-R, run/metrics*.jsonl)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/common.sh
. bench/common.sh
DURATION=${DURATION:-120}
KILL_EVERY=${KILL_EVERY:-15}
RESTART_AFTER=${RESTART_AFTER:-5}
REPS=${REPS:-1}
MODES=${MODES:-"sync localsgd cfmo"}
EXTRA=${EXTRA:-}
TRAIN=${TRAIN:-build/tools/cfmo-train}
W=4
record=false
[ "${1:-}" = "--record" ] && record=true
[ -x "$TRAIN" ] || { echo "build first: make build" >&2; exit 2; }
[ "$RESTART_AFTER" -lt "$KILL_EVERY" ] || { echo "RESTART_AFTER must be below KILL_EVERY" >&2; exit 2; }

tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ "${KEEP:-0}" = 1 ]; then echo "the runs' files: $tmp" >&2; else rm -rf "$tmp"; fi
}
trap cleanup EXIT

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
now() { date +%s.%N; }

# run MODE FAULTS REP: the run's processes write DIR/out-R[-K], err-R[-K],
# status-R[-K] (exit status; "killed" for a victim) and DIR/run (--out); DIR/wall_s.
run() {
  local mode=$1 faults=$2 dir="$tmp/$1-$2-$3" port
  mkdir -p "$dir"
  port=$(free_port)
  local flags=(--mode "$mode" --epochs 0 --time-limit "${DURATION}s" --json --quiet --log-every 10 --out "$dir/run")
  [ "$mode" != cfmo ] && flags+=(--elastic)
  # shellcheck disable=SC2206
  flags+=($EXTRA)
  local env=("WORLD_SIZE=$W" "CFMO_RENDEZVOUS=127.0.0.1:$port")
  local names=() start
  pids=()
  start=$(now)
  for r in $(seq 0 $((W - 1))); do
    env RANK="$r" "${env[@]}" "$TRAIN" "${flags[@]}" >"$dir/out-$r" 2>"$dir/err-$r" &
    pids+=($!)
    names+=("$r")
  done
  if [ "$faults" = faults ]; then
    local k=0 victim t
    # Kills at KILL_EVERY, 2 KILL_EVERY, ... while the joiner still has KILL_EVERY
    # seconds left; ranks 3, 2, 1, 3, ... and rank 0 last (see the header).
    while t=$(( (k + 1) * KILL_EVERY )); [ $((t + KILL_EVERY)) -le "$DURATION" ]; do
      sleep "$("$PY" -c "print(max(0, $start + $t - $(now)))")"
      victim=$(( W - 1 - k % (W - 1) ))
      [ $((t + 2 * KILL_EVERY)) -gt "$DURATION" ] && victim=0
      kill -9 "${pids[$victim]}" 2>/dev/null || true
      wait "${pids[$victim]}" 2>/dev/null || true  # reaped at once, as a launcher does
      echo killed >"$dir/status-${names[$victim]}"
      sleep "$RESTART_AFTER"
      k=$((k + 1))
      names[victim]="$victim-$k"
      env RANK="$victim" "${env[@]}" "$TRAIN" "${flags[@]}" >"$dir/out-$victim-$k" 2>"$dir/err-$victim-$k" &
      pids[victim]=$!
    done
    echo "$k" >"$dir/kills"
  fi
  for i in "${!pids[@]}"; do
    local st=0
    wait "${pids[$i]}" || st=$?
    echo "$st" >"$dir/status-${names[$i]}"
  done
  pids=()
  "$PY" -c "print($(now) - $start)" >"$dir/wall_s"
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
began=$(date +%s)
for mode in $MODES; do
  for rep in $(seq 1 "$REPS"); do
    order="none faults"
    [ $((rep % 2)) = 0 ] && order="faults none"
    for faults in $order; do
      run "$mode" "$faults" "$rep"
      echo "$mode $faults rep $rep: done" >&2
    done
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
elapsed=$(( $(date +%s) - began ))

# shellcheck disable=SC2086
batch=$("$TRAIN" $EXTRA --print-config | sed -n 's/^batch_size = //p')
report=$("$PY" - "$tmp" "$REPS" "$MODES" "$batch" <<'EOF'
import glob, json, os, re, statistics, sys
root, reps, modes, batch = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), int(sys.argv[4])
problems = []

def logged_samples(d):
    """The samples every process trained, from the step lines of its rank's
    metrics (every 10 steps): a process that joined starts one step before
    its own joined line, at the position it was given. Every mode the same
    way, whatever its summary counts."""
    total = 0
    for path in glob.glob(os.path.join(d, "run", "metrics*.jsonl")):
        start, last = 0, None
        for line in open(path):
            m = json.loads(line)
            if m.get("type") == "membership" and m.get("event") == "joined" and "first_step_s" in m:
                if last is not None:
                    total += (last - start) * batch
                start, last = m["step"] - 1, None
            elif m.get("type") == "step":
                last = m["step"]
        if last is not None:
            total += (last - start) * batch
    return total

def summary_of(d):
    """The run's one summary (a JSON line on a process's stdout), and who wrote it."""
    found = []
    for path in sorted(glob.glob(os.path.join(d, "out-*"))):
        for line in open(path):
            if line.startswith("{"):
                found.append((os.path.basename(path), json.loads(line)))
    if len(found) != 1:
        problems.append("%s: %d summaries (%s)" % (os.path.basename(d), len(found), ", ".join(f for f, _ in found)))
    return found[-1] if found else (None, None)

def joins_of(d):
    """first_step_s of each joiner: the membership line of its own metrics."""
    out = []
    for path in glob.glob(os.path.join(d, "run", "metrics*.jsonl")):
        for line in open(path):
            try:
                m = json.loads(line)
            except ValueError:
                continue
            if m.get("type") == "membership" and m.get("event") == "joined" and "first_step_s" in m:
                out.append(m["first_step_s"])
    return out

def check_statuses(d):
    for path in sorted(glob.glob(os.path.join(d, "status-*"))):
        st = open(path).read().strip()
        if st not in ("0", "killed"):
            name = os.path.basename(path)[len("status-"):]
            err = open(os.path.join(d, "err-" + name)).read().strip().splitlines()
            problems.append("%s: rank process %s exited %s: %s" % (os.path.basename(d), name, st,
                                                                   err[-1] if err else "(no stderr)"))

counted = []
rows = ["| mode | fault-free samples/s | with faults samples/s | goodput | accuracy fault-free / faults | kills / joins | first step of a join, median / max s |",
        "|---|---|---|---|---|---|---|"]
for mode in modes:
    rate = {"none": [], "faults": []}
    acc = {"none": [], "faults": []}
    firsts, kills, joined = [], 0, 0
    for rep in range(1, reps + 1):
        for faults in ("none", "faults"):
            d = os.path.join(root, "%s-%s-%d" % (mode, faults, rep))
            check_statuses(d)
            _, s = summary_of(d)
            if s is None:
                continue
            wall = float(open(os.path.join(d, "wall_s")).read())
            logged = logged_samples(d)
            rate[faults].append(logged / wall)
            counted.append("%s %s: %.3f" % (mode, faults, s["samples"] / logged if logged else 0))
            acc[faults].append(s["test_accuracy"])
            if faults == "faults":
                k = int(open(os.path.join(d, "kills")).read())
                f = joins_of(d)
                kills += k
                joined += len(f)
                firsts += f
                if len(f) != k:
                    problems.append("%s: %d kills, %d joins in the metrics" % (os.path.basename(d), k, len(f)))
    name = {"sync": "sync --elastic", "localsgd": "localsgd --elastic"}.get(mode, mode)
    if not rate["none"] or not rate["faults"]:
        rows.append("| %s | - | - | - | - | - | - |" % name)
        continue
    r0, r1 = statistics.median(rate["none"]), statistics.median(rate["faults"])
    first = "%.2f / %.2f" % (statistics.median(firsts), max(firsts)) if firsts else "-"
    rows.append("| %s | %.0f | %.0f | %.2f | %.4f / %.4f | %d / %d | %s |" % (
        name, r0, r1, r1 / r0, statistics.median(acc["none"]), statistics.median(acc["faults"]), kills, joined, first))
print("\n".join(rows))
print()
print("summary's samples over the step lines': " + ", ".join(counted))
if problems:
    print()
    print("problems:")
    for p in problems:
        print("- " + p)
EOF
)
what="$W ranks, ${DURATION}s of --time-limit each run; with faults, one killed (SIGKILL) every ${KILL_EVERY}s (ranks 3, 2, 1, 3, ... in turn, rank 0 last) and restarted with the same command ${RESTART_AFTER}s later"
echo "$what"
echo "$report"
echo "samples: every mode's from the metrics' step lines of every process"
echo "load average before/after (1, 5, 15 min): $load_before / $load_after; $((elapsed / 60)) min $((elapsed % 60)) s"
if $record; then
  {
    echo
    echo "### Goodput under failures with restarts (bench/elastic.sh, $(date -u +%Y-%m-%d))"
    echo
    echo "Command: \`DURATION=$DURATION KILL_EVERY=$KILL_EVERY RESTART_AFTER=$RESTART_AFTER REPS=$REPS MODES=\"$MODES\"${EXTRA:+ EXTRA=\"$EXTRA\"} bench/elastic.sh --record\`: $what."
    echo "Machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores. Load average before/after (1, 5, 15 min): $load_before / $load_after. Took $((elapsed / 60)) min $((elapsed % 60)) s."
    echo
    echo "$report"
  } >>bench/RESULTS.md
fi
# Figures for every mode: 0, whatever the problems listed; a mode without them: 1.
grep -q '| - | - |' <<<"$report" && exit 1
exit 0
