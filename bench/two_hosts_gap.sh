#!/usr/bin/env bash
# cfmo's accuracy against sync at 100 Mbit over many seeds (issue 16): the
# slow test TwoHosts.CfmoLeadsSyncOnALinkOf100Mbit's set-up (two network
# namespaces joined by a veth pair, both ends shaped by tc tbf, ranks 0 and 1
# on one "host", rank 2 on the other, UCX on TCP), one cfmo run per seed and
# variant. sync's test accuracy does not depend on the link (its every step is
# the same whatever the timing): it is taken from one-host runs of the same
# seeds, and one sync run across the link per invocation checks that. Needs
# root (ip netns, tc). Prints a Markdown table like bench/cfmo_gap.sh's.
#
#   sudo bench/two_hosts_gap.sh [VARIANT...]     each VARIANT one quoted string of flags ("" for the defaults)
#   SEEDS="1 2 3 4 5 6" RATE=100mbit JOB="--data synthetic:8192:512 --model mlp:256,128 --epochs 2"   (the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
TRAIN=$(realpath "${TRAIN:-build/tools/cfmo-train}")
SEEDS=${SEEDS:-"1 2 3 4 5 6"}
RATE=${RATE:-100mbit}
JOB=${JOB:---data synthetic:8192:512 --model mlp:256,128 --epochs 2}
[ -x "$TRAIN" ] || { echo "build first: ninja -C build tools/cfmo-train" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "needs root: ip netns and tc" >&2; exit 2; }
[ $# -gt 0 ] || set -- ""
tag=gap$$
na=${tag}a nb=${tag}b va=${tag}va vb=${tag}vb
tmp=$(mktemp -d)
cleanup() {
  ip netns del "$na" 2>/dev/null || :
  ip netns del "$nb" 2>/dev/null || :
  rm -rf "$tmp"
}
trap cleanup EXIT
ip netns add "$na"
ip netns add "$nb"
ip link add "$va" type veth peer name "$vb"
ip link set "$va" netns "$na"
ip link set "$vb" netns "$nb"
ip -n "$na" addr add 10.213.78.1/30 dev "$va"
ip -n "$nb" addr add 10.213.78.2/30 dev "$vb"
for n in "$na" "$nb"; do ip -n "$n" link set lo up; done
ip -n "$na" link set "$va" up
ip -n "$nb" link set "$vb" up
ip netns exec "$na" tc qdisc add dev "$va" root tbf rate "$RATE" burst 128kb latency 50ms
ip netns exec "$nb" tc qdisc add dev "$vb" root tbf rate "$RATE" burst 128kb latency 50ms

across() {  # across OUT FLAGS...: three ranks across the link; rank 0's summary into OUT
  local out=$1 port=$((29600 + RANDOM % 300))
  shift
  local pids=()
  for r in 0 1 2; do
    local ns=$na dev=$va
    [ $r = 2 ] && ns=$nb dev=$vb
    # shellcheck disable=SC2086
    RANK=$r WORLD_SIZE=3 CFMO_RENDEZVOUS=10.213.78.1:$port UCX_TLS=tcp,self UCX_NET_DEVICES=$dev UCX_LOG_LEVEL=error \
      ip netns exec "$ns" "$TRAIN" $JOB --quiet --json --peer-timeout 5 "$@" >"$tmp/out.$r" 2>"$tmp/err.$r" &
    pids+=($!)
  done
  local ok=true
  for p in "${pids[@]}"; do wait "$p" || ok=false; done
  $ok || { echo "a rank failed: $*" >&2; cat "$tmp"/err.* >&2; return 1; }
  tail -1 "$tmp/out.0" >"$out"
}

first=${SEEDS%% *}
across "$tmp/sync-link" --mode sync --seed "$first"
for s in $SEEDS; do
  # shellcheck disable=SC2086
  "$TRAIN" $JOB --workers 3 --mode sync --quiet --json --seed "$s" >"$tmp/sync.$s"
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg); rate $RATE; seeds: $SEEDS; job: $JOB"
echo "sync across the link, seed $first: $(json_field "$tmp/sync-link" samples_per_s) samples/s," \
  "test acc $(json_field "$tmp/sync-link" test_accuracy) (one host: $(json_field "$tmp/sync.$first" test_accuracy))"
echo
echo "| cfmo flags | mean acc | against sync | std. error | samples/s (median) | rounds per rank (mean) |"
echo "| --- | ---: | ---: | ---: | ---: | ---: |"
i=0
for v in "$@"; do
  i=$((i + 1))
  # shellcheck disable=SC2086
  for s in $SEEDS; do across "$tmp/v$i.$s" --mode cfmo --seed "$s" $v; done
  "$PY" bench/gap_table.py "$tmp" "v$i" "$SEEDS" "${v:-(defaults)}"
done
