#!/usr/bin/env bash
# cfmo-pull against skopeo (and skopeo + umoci) on the same local registry,
# in the same run: a large image of few layers and an image of many small
# files, pulled to an OCI layout and unpacked to a root filesystem.
#
#   bench/pull_vs_skopeo.sh [--record]
#
# Sizes (defaults: the issue's 2 GB, 4-layer image):
#   BIG_LAYERS=4 BIG_LAYER_SIZE=512M BIG_FILE_SIZE=8M RANDOM_SHARE=0.5
#   SMALL_LAYERS=2 SMALL_LAYER_SIZE=64M SMALL_FILE_SIZE=4K  REPS=3 LEVEL=6
# FIXTURES=DIR keeps the generated layouts between runs (they take a while to
# build: every byte is generated and gzipped); by default they go to
# ${XDG_CACHE_HOME:-~/.cache}/cfmo-bench-fixtures, keyed by their parameters.
#
# The registry is Debian's docker-registry on a free 127.0.0.1 port with its
# own temporary storage; the fixtures are pushed with `skopeo copy`. Each rep
# runs every pair of peers (cfmo-pull first in odd reps, the peer first in
# even ones), each on a fresh output directory that is removed only at the
# end (so $TMPDIR needs room for every run's output: about 7 times the image
# per rep, unpacked trees included):
#   cfmo-pull pull REF --output oci:DIR          vs  skopeo copy docker://REF oci:DIR
#   cfmo-pull pull REF --output rootfs:DIR       vs  skopeo copy ... && umoci unpack
#     (with --cache on a fresh directory, so it downloads everything)
# Then the hot/cold part (HOTCOLD=1, the default; PEERS=0 runs it alone), on
# the big image with one small layer (HOT_LAYER_SIZE=4M) put first:
#   full pull       cfmo-pull pull REF --output oci:DIR                     (wall)
#   eager, hot 0    the same with --hot 0: ready_s while the rest still comes
#   lazy, hot 0     --hot 0 --cold lazy: ready_s, the cold layers left pending
# (target: ready in at most 10% of the full pull's time), and the peak RSS
# of a full pull with default settings (target under 64 MB) and with
# --max-memory CAP_MEMORY (default 32M), an image far larger than the cap.
# Wall time is the clock's; peak RSS (for skopeo + umoci the larger of the
# two) and CPU time (user + system, both of them) come from /usr/bin/time -v.
# CPU time is the figure that survives a loaded machine; the registry's own
# CPU is in neither. Medians of REPS; the ratios are the peer's over
# cfmo-pull's. The registry's files are in the page cache for every run.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
PULL=$BUILD/tools/cfmo-pull
FIXTURE=$BUILD/bench/oci-fixture
BIG_LAYERS=${BIG_LAYERS:-4}
BIG_LAYER_SIZE=${BIG_LAYER_SIZE:-512M}
BIG_FILE_SIZE=${BIG_FILE_SIZE:-8M}
RANDOM_SHARE=${RANDOM_SHARE:-0.5}
SMALL_LAYERS=${SMALL_LAYERS:-2}
SMALL_LAYER_SIZE=${SMALL_LAYER_SIZE:-64M}
SMALL_FILE_SIZE=${SMALL_FILE_SIZE:-4K}
LEVEL=${LEVEL:-6}
REPS=${REPS:-3}
JOBS=${JOBS:-4}
PEERS=${PEERS:-1}
HOTCOLD=${HOTCOLD:-1}
HOT_LAYER_SIZE=${HOT_LAYER_SIZE:-4M}
CAP_MEMORY=${CAP_MEMORY:-32M}
FIXTURES=${FIXTURES:-${XDG_CACHE_HOME:-$HOME/.cache}/cfmo-bench-fixtures}
record=false
[ "${1:-}" = "--record" ] && record=true

for tool in "$PULL" "$FIXTURE"; do
  [ -x "$tool" ] || { echo "build first: ninja -C $BUILD ($tool missing)" >&2; exit 2; }
done
for cmd in skopeo umoci docker-registry /usr/bin/time python3; do
  command -v "$cmd" >/dev/null || { echo "$cmd is missing: scripts/install-deps.sh --bench" >&2; exit 2; }
done
rootless=()
[ "$(id -u)" -ne 0 ] && rootless=(--rootless)

tmp=$(mktemp -d)
registry_pid=
cleanup() {
  # Under set -e a failing command here would end the trap before the rm:
  # wait reports the killed registry's signal, so nothing here may fail.
  if [ -n "$registry_pid" ]; then
    kill "$registry_pid" 2>/dev/null || true
    wait "$registry_pid" 2>/dev/null || true
  fi
  chmod -R u+rwx "$tmp" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

# The fixtures, built once per parameter set.
big=$FIXTURES/big-$BIG_LAYERS-$BIG_LAYER_SIZE-$BIG_FILE_SIZE-$RANDOM_SHARE-$LEVEL
small=$FIXTURES/small-$SMALL_LAYERS-$SMALL_LAYER_SIZE-$SMALL_FILE_SIZE-$LEVEL
build_fixture() {  # DIR ARGS...
  local dir=$1; shift
  [ -f "$dir/index.json" ] && return
  echo "building $dir ..." >&2
  rm -rf "$dir.tmp"
  "$FIXTURE" "$dir.tmp" "$@" --level "$LEVEL" >&2
  mv "$dir.tmp" "$dir"
}
mkdir -p "$FIXTURES"
build_fixture "$big" --layers "$BIG_LAYERS" --layer-size "$BIG_LAYER_SIZE" --file-size "$BIG_FILE_SIZE" \
  --random "$RANDOM_SHARE" --seed 1
build_fixture "$small" --layers "$SMALL_LAYERS" --layer-size "$SMALL_LAYER_SIZE" --file-size "$SMALL_FILE_SIZE" \
  --random 0.2 --seed 2
hot=$FIXTURES/hot-$HOT_LAYER_SIZE-$LEVEL
if [ "$HOTCOLD" = 1 ]; then
  build_fixture "$hot" --layers 1 --layer-size "$HOT_LAYER_SIZE" --file-size 64K --random 0.2 --seed 3
fi

# A registry of our own.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$tmp/registry.yml" <<EOF
version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: $tmp/storage
http:
  addr: 127.0.0.1:$port
EOF
docker-registry serve "$tmp/registry.yml" > "$tmp/registry.log" 2>&1 &
registry_pid=$!
for _ in $(seq 100); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/v2/')" 2>/dev/null && break
  sleep 0.1
done
host=127.0.0.1:$port
for name in big small; do
  layout=$big; [ $name = small ] && layout=$small
  skopeo copy -q --dest-tls-verify=false "oci:$layout:latest" "docker://$host/bench/$name:latest" >&2
done
if [ "$HOTCOLD" = 1 ]; then
  # bench/big:hot is the big image with the small layer of $hot first: its
  # blobs go into the same repository, then a config and manifest naming both.
  skopeo copy -q --dest-tls-verify=false "oci:$hot:latest" "docker://$host/bench/big:hotpart" >&2
  python3 - "$host" "$big" "$hot" <<'EOF'
import hashlib, json, os, sys, urllib.request
host, big, hot = sys.argv[1:4]
def load(layout):
    index = json.load(open(os.path.join(layout, "index.json")))
    blob = lambda d: open(os.path.join(layout, "blobs", "sha256", d[7:]), "rb").read()
    manifest = json.loads(blob(index["manifests"][0]["digest"]))
    return manifest, json.loads(blob(manifest["config"]["digest"]))
def request(method, url, data=None, ctype=None):
    r = urllib.request.Request(url, data=data, method=method)
    if ctype: r.add_header("Content-Type", ctype)
    return urllib.request.urlopen(r)
big_m, big_c = load(big)
hot_m, hot_c = load(hot)
config = dict(big_c)
config["rootfs"] = {"type": "layers", "diff_ids": hot_c["rootfs"]["diff_ids"] + big_c["rootfs"]["diff_ids"]}
config.pop("history", None)
body = json.dumps(config).encode()
digest = "sha256:" + hashlib.sha256(body).hexdigest()
loc = request("POST", f"http://{host}/v2/bench/big/blobs/uploads/").headers["Location"]
loc = (loc if loc.startswith("http") else f"http://{host}{loc}") + ("&" if "?" in loc else "?") + "digest=" + digest
request("PUT", loc, body, "application/octet-stream")
manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest, "size": len(body)},
            "layers": hot_m["layers"] + big_m["layers"]}
request("PUT", f"http://{host}/v2/bench/big/manifests/hot", json.dumps(manifest).encode(),
        "application/vnd.oci.image.manifest.v1+json")
EOF
fi
sizes() {  # LAYOUT -> "compressed uncompressed-estimate files"
  python3 - "$1" <<'EOF'
import json, sys, os
d = sys.argv[1]
index = json.load(open(os.path.join(d, "index.json")))
m = json.load(open(os.path.join(d, "blobs", "sha256", index["manifests"][0]["digest"][7:])))
print(sum(l["size"] for l in m["layers"]))
EOF
}

# One measured command: prints "wall_s rss_kb cpu_s" (wall from the clock,
# peak RSS and user + system CPU time from /usr/bin/time -v, whose own wall
# time has only 10 ms steps).
measure() {
  local start end
  start=$(date +%s.%N)
  /usr/bin/time -v -o "$tmp/time.txt" "$@" > "$tmp/out.txt" 2> "$tmp/err.txt" || {
    echo "failed: $*" >&2; cat "$tmp/err.txt" >&2; exit 1; }
  end=$(date +%s.%N)
  awk -F': ' -v s="$start" -v e="$end" '/Maximum resident set size/ {r = $2}
    /User time \(seconds\)|System time \(seconds\)/ {c += $2} END {printf "%.3f %d %.2f\n", e - s, r, c}' \
    "$tmp/time.txt"
}

declare -A wall rss cpu
add() { wall[$1]="${wall[$1]:-} $2"; rss[$1]="${rss[$1]:-} $3"; cpu[$1]="${cpu[$1]:-} $4"; }
# Outputs are moved aside, not deleted, until the end: ext4 skips inodes
# freed in the last minute or more when it allocates, and tens of thousands
# of them (a removed rootfs) make the next run's file creation crawl.
# Their pages leave the page cache, though: kept there, a rep's outputs (about
# 11 GB) filled this machine's memory in the second rep, and reclaim doubled
# every run's CPU time, dd's too.
trash=0
evict() {  # DIR: written back, then dropped from the page cache
  sync
  python3 - "$1" <<'EOF_EVICT'
import os, sys
for root, dirs, files in os.walk(sys.argv[1]):
    for name in files:
        try:
            fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
EOF_EVICT
}
fresh() {
  if [ -e "$tmp/out" ]; then
    evict "$tmp/out"
    mv "$tmp/out" "$tmp/trash-$((trash += 1))"
  fi
  mkdir -p "$tmp/out"
}
run_one() {  # KEY LABEL COMMAND...
  local key=$1 label=$2 w r c; shift 2
  fresh
  sync  # the last run's writeback (umoci does not sync its tree) is not this run's
  read -r w r c < <(measure "$@")
  add "$key" "$w" "$r" "$c"
  echo "rep $rep $label $w s $r KB ${c} s CPU" >&2
}
for rep in $(seq 1 "$REPS"); do
  [ "$PEERS" = 1 ] || break
  for name in big small; do
    ref=$host/bench/$name:latest
    out=$tmp/out
    cfmo_oci=("$PULL" pull "$ref" --plain-http --jobs "$JOBS" --output "oci:$out/layout:latest")
    skopeo_oci=(skopeo copy -q --src-tls-verify=false "docker://$ref" "oci:$out/layout:latest")
    cfmo_rootfs=("$PULL" pull "$ref" --plain-http --jobs "$JOBS" --output "rootfs:$out/rootfs" --cache "$out/cache")
    skopeo_rootfs=(/bin/sh -c "skopeo copy -q --src-tls-verify=false 'docker://$ref' 'oci:$out/layout:latest' \
      && umoci unpack ${rootless[*]} --image '$out/layout:latest' '$out/bundle' > /dev/null")
    # Odd reps run cfmo-pull first, even reps the peer.
    # The disk's reference for an OCI layout: the same blobs written by dd,
    # one stream per blob in parallel as the pullers do, each fsynced at its
    # end (dd writes into the page cache at once and leaves the whole flush
    # to the fsync; cfmo-pull flushes along the way, so it may beat it).
    layout=$big; [ $name = small ] && layout=$small
    run_one "$name-disk" "$name disk:   dd conv=fsync" /bin/sh -c "for f in '$layout'/blobs/sha256/*; do
      dd if=\"\$f\" of='$out'/\"\${f##*/}\" bs=1M conv=fsync status=none & done; wait"
    if [ $((rep % 2)) -eq 1 ]; then
      run_one "$name-oci-cfmo" "$name oci:    cfmo-pull   " "${cfmo_oci[@]}"
      run_one "$name-oci-skopeo" "$name oci:    skopeo      " "${skopeo_oci[@]}"
      run_one "$name-rootfs-cfmo" "$name rootfs: cfmo-pull   " "${cfmo_rootfs[@]}"
      run_one "$name-rootfs-skopeo" "$name rootfs: skopeo+umoci" "${skopeo_rootfs[@]}"
    else
      run_one "$name-oci-skopeo" "$name oci:    skopeo      " "${skopeo_oci[@]}"
      run_one "$name-oci-cfmo" "$name oci:    cfmo-pull   " "${cfmo_oci[@]}"
      run_one "$name-rootfs-skopeo" "$name rootfs: skopeo+umoci" "${skopeo_rootfs[@]}"
      run_one "$name-rootfs-cfmo" "$name rootfs: cfmo-pull   " "${cfmo_rootfs[@]}"
    fi
  done
done

median() { printf '%s\n' $@ | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", a / b}'; }
mb() { awk -v k="$1" 'BEGIN {printf "%.1f", k / 1024}'; }
row() {  # image output peer-label cfmo-label target
  local key=$1-$2 label=$3 target=$4
  local wc ws rc rs cc cs
  wc=$(median ${wall[$key-cfmo]}); ws=$(median ${wall[$key-skopeo]})
  rc=$(median ${rss[$key-cfmo]}); rs=$(median ${rss[$key-skopeo]})
  cc=$(median ${cpu[$key-cfmo]}); cs=$(median ${cpu[$key-skopeo]})
  echo "| $1 | $label | $ws | $wc | **$(ratio "$ws" "$wc")x**${target:+ ($target)} | $cs | $cc | $(ratio "$cs" "$cc")x | $(mb "$rs") | $(mb "$rc") |"
}
big_bytes=$(sizes "$big"); small_bytes=$(sizes "$small")
load=$(cut -d' ' -f1-3 /proc/loadavg)
table=
if [ "$PEERS" = 1 ]; then
  table="| image | peer | peer s | cfmo-pull s | speed-up | peer CPU s | cfmo-pull CPU s | CPU ratio | peer peak RSS MB | cfmo-pull peak RSS MB |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
$(row big oci 'skopeo copy → oci:' 'target 2x')
$(row big rootfs 'skopeo copy + umoci unpack → rootfs' 'target 3x')
$(row small oci 'skopeo copy → oci:' '')
$(row small rootfs 'skopeo copy + umoci unpack → rootfs' '')"
  table+="
"
  for name in big small; do
    d=$(median ${wall[$name-disk]}); ws=$(median ${wall[$name-oci-skopeo]}); wc=$(median ${wall[$name-oci-cfmo]})
    table+="
- $name, disk reference: the same blobs written by dd (conv=fsync, one stream per blob in parallel, no network) took $d s;
  to an OCI layout skopeo runs at $(ratio "$d" "$ws")x of its speed, cfmo-pull at $(ratio "$d" "$wc")x."
  done
  echo
  echo "big: $BIG_LAYERS layers of $BIG_LAYER_SIZE ($big_bytes bytes gzip), small: $SMALL_LAYERS layers of $SMALL_LAYER_SIZE in $SMALL_FILE_SIZE files ($small_bytes bytes gzip); medians of $REPS; load $load"
  echo "$table"
fi

# The hot/cold part: one JSON report per run (ready_s, wall_s, peak_rss_bytes),
# the peak RSS also from /usr/bin/time.
hot_table=
if [ "$HOTCOLD" = 1 ]; then
  ref=$host/bench/big:hot
  declare -A hc
  hadd() { hc[$1]="${hc[$1]:-} $2"; }
  hot_one() {  # KEY LABEL ARGS...
    local key=$1 label=$2 w r c ready wall rss; shift 2
    fresh
    mkdir -p "$tmp/shm"
    sync
    read -r w r c < <(measure "$PULL" pull "$ref" --plain-http --jobs "$JOBS" --output "oci:$tmp/out/layout" \
      --memory-dir "$tmp/shm" --progress none --json "$@")
    read -r ready wall rss < <(python3 -c 'import json, sys; j = json.load(open(sys.argv[1]))
print(j["ready_s"] if j["ready_s"] is not None else -1, j["wall_s"], j["peak_rss_bytes"])' "$tmp/out.txt")
    hadd "$key-ready" "$ready"; hadd "$key-wall" "$wall"; hadd "$key-rss" "$r"; hadd "$key-report" "$rss"
    echo "rep $rep $label ready $ready s, wall $wall s, peak RSS $r KB (report $rss B)" >&2
    rm -rf "$tmp/shm"
  }
  for rep in $(seq 1 "$REPS"); do
    # The order rotates with the rep, so no configuration always runs first.
    order=(full eager lazy capped)
    for _ in $(seq 1 $(( (rep - 1) % 4 ))); do order=("${order[@]:1}" "${order[0]}"); done
    for which in "${order[@]}"; do
      case $which in
        full) hot_one full "full pull             " ;;
        eager) hot_one eager "--hot 0, cold eager  " --hot 0 ;;
        lazy) hot_one lazy "--hot 0, cold lazy   " --hot 0 --cold lazy ;;
        capped) hot_one capped "--max-memory $CAP_MEMORY     " --max-memory "$CAP_MEMORY" ;;
      esac
    done
  done
  hot_bytes=$(sizes "$hot")
  s3() { awk -v v="$(median "$@")" 'BEGIN {printf "%.3f", v}'; }
  full=$(s3 ${hc[full-wall]})
  pct() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f%%", 100 * a / b}'; }
  rmb() { awk -v b="$(median "$@")" 'BEGIN {printf "%.1f", b / 1048576}'; }
  hot_table="| run | ready s | wall s | ready / full pull's wall | peak RSS MB (time) | peak_rss_bytes (report), MB |
| --- | --- | --- | --- | --- | --- |
| full pull, default settings | | $full | | **$(mb "$(median ${hc[full-rss]})")** (target < 64) | $(rmb ${hc[full-report]}) |
| --hot 0, cold eager | $(s3 ${hc[eager-ready]}) | $(s3 ${hc[eager-wall]}) | **$(pct "$(s3 ${hc[eager-ready]})" "$full")** (target <= 10%) | $(mb "$(median ${hc[eager-rss]})") | $(rmb ${hc[eager-report]}) |
| --hot 0, cold lazy | $(s3 ${hc[lazy-ready]}) | $(s3 ${hc[lazy-wall]}) | **$(pct "$(s3 ${hc[lazy-ready]})" "$full")** (target <= 10%) | $(mb "$(median ${hc[lazy-rss]})") | $(rmb ${hc[lazy-report]}) |
| full pull, --max-memory $CAP_MEMORY | | $(s3 ${hc[capped-wall]}) | | **$(mb "$(median ${hc[capped-rss]})")** (cap $CAP_MEMORY) | $(rmb ${hc[capped-report]}) |"
  echo
  echo "hot/cold: bench/big:hot = one hot layer of $HOT_LAYER_SIZE ($hot_bytes bytes gzip) first, then the big image's layers ($big_bytes bytes); medians of $REPS; load $load"
  echo "$hot_table"
fi

if $record; then
  cpu=$(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)
  {
    echo
    title="cfmo-pull against skopeo and umoci"
    [ "$PEERS" = 1 ] || title="cfmo-pull: time to ready with a hot layer, peak RSS against --max-memory"
    echo "### $title ($(date +%Y-%m-%d))"
    echo
    echo "Machine: $cpu, $(nproc) cores; $(skopeo --version), $(umoci --version); load average at the end $load."
    echo "Command: \`BIG_LAYERS=$BIG_LAYERS BIG_LAYER_SIZE=$BIG_LAYER_SIZE BIG_FILE_SIZE=$BIG_FILE_SIZE RANDOM_SHARE=$RANDOM_SHARE SMALL_LAYERS=$SMALL_LAYERS SMALL_LAYER_SIZE=$SMALL_LAYER_SIZE SMALL_FILE_SIZE=$SMALL_FILE_SIZE LEVEL=$LEVEL REPS=$REPS JOBS=$JOBS PEERS=$PEERS HOTCOLD=$HOTCOLD HOT_LAYER_SIZE=$HOT_LAYER_SIZE CAP_MEMORY=$CAP_MEMORY bench/pull_vs_skopeo.sh --record\`"
    echo "Images: big, $BIG_LAYERS gzip layers of $BIG_LAYER_SIZE uncompressed ($big_bytes bytes compressed, ${RANDOM_SHARE} of the files random);"
    echo "small, $SMALL_LAYERS layers of $SMALL_LAYER_SIZE in files of about $SMALL_FILE_SIZE ($small_bytes bytes compressed)."
    echo
    if [ -n "$table" ]; then echo "$table"; fi
    if [ -n "$hot_table" ]; then
      if [ -n "$table" ]; then echo; fi
      echo "Hot and cold layers: bench/big:hot, one hot layer of $HOT_LAYER_SIZE uncompressed ($hot_bytes bytes compressed) first, then the big image's layers; ready_s and peak_rss_bytes from cfmo-pull's --json report, peak RSS also from /usr/bin/time."
      echo
      echo "$hot_table"
    fi
  } >> bench/RESULTS.md
  echo "appended to bench/RESULTS.md" >&2
fi
