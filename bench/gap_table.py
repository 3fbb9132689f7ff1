"""One row of bench/cfmo_gap.sh's and bench/two_hosts_gap.sh's tables.

    gap_table.py DIR NAME "SEEDS" LABEL

DIR/NAME.SEED holds a variant's cfmo-train --json summary for each seed,
DIR/sync.SEED sync's; prints the mean test accuracy, the mean of the per-seed
differences to sync with its standard error, the median samples/s and the
mean rounds per rank.
"""
import json
import statistics as st
import sys

tmp, name, seeds, label = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4]
runs = [json.load(open(f"{tmp}/{name}.{s}")) for s in seeds]
sync = [json.load(open(f"{tmp}/sync.{s}"))["test_accuracy"] for s in seeds]
acc = [r["test_accuracy"] for r in runs]
gap = [a - b for a, b in zip(acc, sync)]
se = st.stdev(gap) / len(gap) ** 0.5 if len(gap) > 1 else 0.0
rounds = [w.get("rounds", 0) for r in runs for w in r["per_worker"]]
sps = [r["samples_per_s"] for r in runs]
print(f"| `{label}` | {st.mean(acc):.4f} | {100 * st.mean(gap):+.2f} | {100 * se:.2f} | {st.median(sps):.0f} "
      f"| {st.mean(rounds):.1f} |")
