#!/usr/bin/env bash
# Issue 15's training comparison of a Mixture-of-Experts GPT on this machine:
# WORKERS workers (4 by default), E = 12 experts, top-2 (the article's
# shape), a GPT of layers=2, heads=4, dim=128, context=64, one worker 1.25x
# slower (SLOWDOWN), at equal tokens.
#
#   moe-sync     every rank holds every expert (data parallel), --mode sync
#   moe-cfmo     the same, --mode cfmo
#   dense-sync   the dense GPT of the same active parameters (expert_dim 256:
#                two experts of 2 C D = the dense MLP's 8 C^2), --mode sync
#   moe-ep-*     expert parallel (--expert-parallel): moe-ep-sync (sync mode,
#                sync dispatch), moe-ep-sync-async (sync mode, --dispatch
#                async), moe-ep-cfmo (cfmo mode, --dispatch async: the
#                issue's target, >= 1.5x moe-ep-sync); the *-even rows are
#                moe-ep-sync and moe-ep-cfmo without the slowdown (async
#                should not be slower)
#   solo         one worker holding every expert, no slowdown, TOKENS/2
#                tokens: the CPU ceiling of this machine is its tokens/s
#                times the cores the workers can use (min(WORKERS, nproc);
#                with fewer workers than cores, each slowed worker counts
#                1/FACTOR of a core): no mode can go faster, whatever it
#                overlaps
#
# The rows run alternately (rep 1 of every row, then rep 2, ...) so that a
# change in the machine's load spreads over all of them. Rep N runs with
# --seed N (SEEDS=1 keeps --seed 1 for every rep): at 200k tokens the GPT is
# leaving its unigram plateau, and one seed's sync val_loss differs from
# another's by up to 0.09 (the MoE) and 0.5 (the dense GPT), more than the
# gaps measured, so a median over one seed says little. tokens/s, val_loss
# and the peak resident memory of the largest process (a rank: /usr/bin/time
# reports the largest child) are medians over REPS, each rank's own peak
# resident memory (getrusage, the summary's per_worker) too. Each share of
# the ceiling is split into its two factors, from the ranks' loop_cpu_s:
# the loop's CPU per token against solo's (work beyond solo's) and the
# cores kept busy against solo's core (idle), which the machine's other load
# changes less than tokens/s. Prints a
# Markdown table, the ratios, the ceiling and the memory per rank;
# --record appends them to bench/RESULTS.md.
#
#   bench/moe_train.sh [--record]
#   REPS=3 TOKENS=200000 WORKERS=4 SLOWDOWN=1=1.25 VAL_TOKENS=50000 SEEDS=reps   (the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/common.sh
. bench/common.sh
REPS=${REPS:-3}
TOKENS=${TOKENS:-200000}
WORKERS=${WORKERS:-4}
SLOWDOWN=${SLOWDOWN-1=1.25}
VAL_TOKENS=${VAL_TOKENS:-50000}
SEEDS=${SEEDS:-reps}
DATA=${DATA:-text:/usr/share/games/fortunes}
TRAIN=${TRAIN:-build/tools/cfmo-train}
record=false
[ "${1:-}" = "--record" ] && record=true
[ -x "$TRAIN" ] || { echo "build first: make build" >&2; exit 2; }

gpt=gpt:layers=2,heads=4,dim=128,context=64
moe=$gpt,experts=12,top_k=2,expert_dim=256
slow=${SLOWDOWN:+--slowdown $SLOWDOWN}
# name|model|flags|workers|tokens
rows=("moe-sync|$moe|--mode sync $slow|$WORKERS|$TOKENS" "moe-cfmo|$moe|--mode cfmo $slow|$WORKERS|$TOKENS"
  "dense-sync|$gpt|--mode sync $slow|$WORKERS|$TOKENS")
# The help in a variable: grep -q would close the pipe early, and pipefail fail the test.
help=$("$TRAIN" --help 2>/dev/null || true)
if grep -q -- '--expert-parallel' <<< "$help"; then
  rows+=("moe-ep-sync|$moe|--mode sync --expert-parallel $slow|$WORKERS|$TOKENS")
fi
if grep -q -- '--dispatch ' <<< "$help"; then
  rows+=("moe-ep-sync-async|$moe|--mode sync --expert-parallel --dispatch async $slow|$WORKERS|$TOKENS")
  rows+=("moe-ep-cfmo|$moe|--mode cfmo --expert-parallel --dispatch async $slow|$WORKERS|$TOKENS")
  rows+=("moe-ep-sync-even|$moe|--mode sync --expert-parallel|$WORKERS|$TOKENS")
  rows+=("moe-ep-cfmo-even|$moe|--mode cfmo --expert-parallel --dispatch async|$WORKERS|$TOKENS")
fi
rows+=("solo|$moe|--mode sync|1|$((TOKENS / 2))")
# ROWS=moe-ep-sync,moe-ep-cfmo runs only those rows.
if [ -n "${ROWS:-}" ]; then
  kept=()
  for row in "${rows[@]}"; do [[ ",$ROWS," == *",${row%%|*},"* ]] && kept+=("$row"); done
  rows=("${kept[@]}")
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
command="REPS=$REPS TOKENS=$TOKENS WORKERS=$WORKERS SLOWDOWN=$SLOWDOWN VAL_TOKENS=$VAL_TOKENS SEEDS=$SEEDS${ROWS:+ ROWS=$ROWS} bench/moe_train.sh"
common=(--data "$DATA" --batch-size 16 --epochs 0 --val-tokens "$VAL_TOKENS" --lr 0.003 --beta2 0.95 --quiet --json)
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
start=$(date +%s)
for rep in $(seq 1 "$REPS"); do
  seed=$rep
  [ "$SEEDS" = 1 ] && seed=1
  for row in "${rows[@]}"; do
    IFS='|' read -r name model flags workers tokens <<< "$row"
    # shellcheck disable=SC2086
    /usr/bin/time -v "$TRAIN" --model "$model" $flags --workers "$workers" --tokens "$tokens" --seed "$seed" "${common[@]}" \
      > "$tmp/$name.$rep.json" 2> "$tmp/$name.$rep.err" ||
      { echo "run failed: $name rep $rep" >&2; tail -3 "$tmp/$name.$rep.err" >&2; }
    echo "$name rep $rep: done" >&2
  done
done
elapsed=$(($(date +%s) - start))
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

report=$("$PY" - "$tmp" "$REPS" "$(nproc)" "$SLOWDOWN" "${rows[@]}" <<'EOF'
import json, os, re, statistics, sys
root, reps, cores, slowdown = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rows = [r.split("|") for r in sys.argv[5:]]
def median(values):
    return statistics.median(values) if values else float("nan")
out = {}
for name, model, flags, workers, tokens in rows:
    speed, loss, rss, ranks_rss, wait, cpu, busy = [], [], [], [], [], [], []
    for rep in range(1, reps + 1):
        try:
            j = json.loads(open(os.path.join(root, f"{name}.{rep}.json")).read().strip().splitlines()[-1])
        except (OSError, ValueError, IndexError):
            continue
        speed.append(j["tokens_per_s"]); loss.append(j["val_loss"])
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(os.path.join(root, f"{name}.{rep}.err")).read())
        if m: rss.append(int(m.group(1)) / 1024)
        moe = j.get("moe") or {}
        # Each rank's own peak (its report), and the ranks' time in expert dispatch.
        per = j.get("per_worker") or []
        ranks_rss.append([w.get("peak_rss_bytes", 0) / 2**20 for w in per])
        wait.append([w.get("dispatch_wait_s", 0) for w in per])
        # The loop's CPU time (every rank's processes, all their threads): per
        # token, and over the cores the run had for its longest loop.
        loop_cpu = sum(w.get("loop_cpu_s", 0) for w in per)
        longest = max((w.get("loop_s", 0) for w in per), default=0)
        if loop_cpu > 0 and j.get("tokens", 0) > 0 and longest > 0:
            cpu.append(loop_cpu / j["tokens"] * 1e6)
            busy.append(loop_cpu / (longest * min(int(workers), cores)))
    per_rank = [median([r[i] for r in ranks_rss if len(r) > i]) for i in range(max(map(len, ranks_rss), default=0))]
    waits = [median([r[i] for r in wait if len(r) > i]) for i in range(max(map(len, wait), default=0))]
    out[name] = (median(speed), median(loss), median(rss), len(speed), model, f"{flags} --workers {workers}", moe, per_rank,
                 waits, median(cpu), median(busy))
print("| row | model | flags | runs | tokens/s (median) | val_loss (median) | peak RSS of a rank, MB | each rank's peak RSS, MB | each rank's dispatch wait, s | dispatch/combine p50, us | late (rank 0) | aux loss | dropped |")
print("| --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- | --- | ---: | ---: | ---: |")
for name, (s, l, r, n, model, flags, moe, per_rank, waits, _, _) in out.items():
    aux = f"{moe['aux_loss']:.3f}" if moe else "-"
    drop = f"{100 * moe['dropped_share']:.1f}%" if moe else "-"
    d = (moe or {}).get("dispatch")
    times = f"{d['dispatch_p50_us']:.0f}/{d['combine_p50_us']:.0f}" if d else "-"
    late = f"{100 * d['late_share']:.1f}%" if d and "late_share" in d else "-"
    ranks = " ".join(f"{v:.0f}" for v in per_rank) or "-"
    waited = " ".join(f"{v:.2f}" for v in waits) if any(waits) else "-"
    print(f"| {name} | `{model}` | `{flags}` | {n} | {s:.0f} | {l:.4f} | {r:.0f} | {ranks} | {waited} | {times} | {late} | {aux} | {drop} |")
def ratio(a, b, what):
    if a in out and b in out and out[b][0] > 0:
        print(f"\n{a} / {b}: tokens/s {out[a][0] / out[b][0]:.2f}x, val_loss {out[a][1] / out[b][1]:.4f}x" +
              (f", peak RSS {out[a][2] / out[b][2]:.2f}x" if out[b][2] > 0 else "") + f" ({what})")
ratio("moe-cfmo", "moe-sync", "cfmo against sync, every rank holding every expert")
ratio("moe-sync", "dense-sync", "the MoE against the dense GPT of the same active parameters")
ratio("moe-ep-cfmo", "moe-ep-sync", "expert parallel: cfmo with async dispatch against sync with sync dispatch; target 1.5x")
ratio("moe-ep-cfmo-even", "moe-ep-sync-even", "the same without a slowdown: async should not be slower")
ratio("moe-ep-sync-async", "moe-ep-sync", "expert parallel, sync mode: async dispatch against sync dispatch")
ratio("moe-ep-sync", "moe-sync", "expert parallel against every rank holding every expert")
workers = next((int(r[3]) for r in rows if r[0] != "solo"), 0)
if "solo" in out and workers > 0:
    # With more workers than cores a slowed worker's sleep frees its core for
    # the others; with fewer, each worker has a core and a slowed one uses 1/FACTOR of it.
    factors = [1.0] * workers
    for item in filter(None, slowdown.split(",")):
        rank, factor = item.split("=")
        if int(rank) < workers:
            factors[int(rank)] = float(factor)
    used = cores if workers > cores else sum(1 / f for f in factors)
    ceiling = out["solo"][0] * used
    print(f"\nCPU ceiling: {ceiling:.0f} tokens/s = solo {out['solo'][0]:.0f} tokens/s x {used:.2f} cores "
          f"({workers} workers on {cores} cores, slowdown {slowdown or 'none'}); each row's share of it:")
    # A share is (solo's CPU per token / the row's) x (the row's busy cores /
    # solo's): what the row spends beyond solo's work, and what it leaves idle.
    # Both come from CPU time, which other load changes less than tokens/s.
    solo_cpu, solo_busy = out["solo"][9], out["solo"][10]
    for name, o in out.items():
        if name != "solo" and o[0] == o[0]:
            split = (f" (loop CPU per token {o[9] / solo_cpu:.2f}x solo's, cores busy {o[10] / solo_busy:.2f}x solo's)"
                     if o[9] == o[9] and solo_cpu == solo_cpu else "")
            print(f"- {name}: {o[0] / ceiling:.2f}{split}")
    if solo_cpu == solo_cpu:
        print(f"- solo: loop CPU {solo_cpu:.1f} ms per 1k tokens, its core busy {solo_busy:.2f} of the loop")
    if "moe-ep-sync" in out and out["moe-ep-sync"][0] > 0:
        print(f"- the most any mode can gain over moe-ep-sync here: {ceiling / out['moe-ep-sync'][0]:.2f}x")
def mean(values):
    return sum(values) / len(values) if values else float("nan")
if "moe-ep-sync" in out and "moe-sync" in out:
    ep, dp = mean(out["moe-ep-sync"][7]), mean(out["moe-sync"][7])
    print(f"\nMemory per rank (peak RSS, mean over ranks of the medians): expert parallel {ep:.0f} MB "
          f"(moe-ep-sync), every rank holding every expert {dp:.0f} MB (moe-sync): {dp - ep:.0f} MB less a rank")
    for name in ("moe-ep-cfmo", "moe-cfmo", "dense-sync"):
        if name in out:
            print(f"- {name}: {mean(out[name][7]):.0f} MB")
side = [n for n in ("moe-ep-sync", "moe-sync", "dense-sync") if n in out]
if len(side) > 1:
    print("\nSide by side (sync mode): " + "; ".join(f"{n} {out[n][0]:.0f} tokens/s, val_loss {out[n][1]:.4f}" for n in side))
EOF
)
echo "$report"
echo
echo "command: $command; ${elapsed}s; load average before $load_before, after $load_after"
if $record; then
  {
    echo
    echo "### bench/moe_train.sh ($(date -u +%Y-%m-%d))"
    echo
    echo "Command: \`$command\` (${elapsed} s; load average before $load_before, after $load_after)."
    echo
    echo "$report"
  } >> bench/RESULTS.md
fi
