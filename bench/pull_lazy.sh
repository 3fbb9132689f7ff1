#!/usr/bin/env bash
# cfmo-pull mount --lazy against a full pull and against skopeo + umoci, on
# one local docker-registry (a free 127.0.0.1 port), over the 2 GB bench
# image (bench/oci-fixture: 4 gzip layers of 512M, files of 8M, half of them
# random):
#   full      cfmo-pull pull REF --output rootfs:DIR, then the entry point
#   skopeo    skopeo copy docker://REF oci:DIR && umoci unpack, then the entry point
#   lazy      cfmo-pull pull REF --output oci:DIR --cold lazy (the indexes
#             found in the registry, pushed there by `index --push`),
#             mount --lazy, then the entry point through the mount; and
#             mount --lazy REF alone (the lazy pull inside the mount
#             command), then the entry point, after the first
# The entry point reads the first 4 KiB of a few files (ENTRY_FILES, the
# first in path order): the time from the pull's start to that is the
# container's time to first output, without the container. Also: the bytes
# the lazy mount fetched by then (stats.json), the sequential read
# throughput of every file through the mount with a cold span cache (fetched
# by ranges), through a new mount over the cached spans, through the same
# mount again (the kernel's page cache of the mount), and of the full pull's
# rootfs (page cache warm); random reads (RANDOM_READS preads of
# RANDOM_BLOCK bytes at offsets drawn with a fixed seed over every file,
# the same ones everywhere) through a new mount over the cached spans and of
# the rootfs (page cache warm), the same reads again through that mount (its
# page cache), both sides again with the page cache dropped (the span files
# and the rootfs read from disk), and COLD_RANDOM_READS of them through a mount with its span
# cache emptied; the FUSE round trip (ROUND_TRIPS LOOKUPs of missing names
# and O_DIRECT 4 KiB preads of a file through a new mount over the span
# cache, against 4 KiB page-cache hits there and on the rootfs); the lazy path's phases (the pull, the mount command, each
# entry file's first read); and peak RSS from /usr/bin/time -v of each phase. The lazy phase runs in a PID namespace of its own (unshare
# --fork --pid --mount-proc) so that the mount's daemon, which detaches, is
# reaped inside it and counted in /usr/bin/time's figure (the largest
# process of the phase); the daemon's own VmHWM is printed beside it.
#
#   bench/pull_lazy.sh      LAYERS=4 LAYER_SIZE=512M FILE_SIZE=8M RANDOM_SHARE=0.5 ENTRY_FILES=3
#                           MAX_MEMORY=64M (the mount's --max-memory) SKOPEO=1 (0: no skopeo row)
#                           RANDOM_READS=20000 RANDOM_BLOCK=4096 COLD_RANDOM_READS=50 ROUND_TRIPS=20000
#
# Needs root (unshare; FUSE), Debian's docker-registry, and for the skopeo
# row skopeo and umoci (scripts/install-deps.sh --bench). The figures of the
# last run are in bench/RESULTS.md.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
PULL=$(realpath "$BUILD/tools/cfmo-pull")
FIXTURE=$BUILD/bench/oci-fixture
LAYERS=${LAYERS:-4}
LAYER_SIZE=${LAYER_SIZE:-512M}
FILE_SIZE=${FILE_SIZE:-8M}
RANDOM_SHARE=${RANDOM_SHARE:-0.5}
ENTRY_FILES=${ENTRY_FILES:-3}
MAX_MEMORY=${MAX_MEMORY:-64M}
SKOPEO=${SKOPEO:-1}
RANDOM_READS=${RANDOM_READS:-20000}
RANDOM_BLOCK=${RANDOM_BLOCK:-4096}
COLD_RANDOM_READS=${COLD_RANDOM_READS:-50}
ROUND_TRIPS=${ROUND_TRIPS:-20000}
for cmd in /usr/bin/docker-registry /usr/bin/time /usr/bin/unshare python3 curl; do
  command -v "$cmd" >/dev/null || { echo "pull_lazy.sh: $cmd is not installed" >&2; exit 2; }
done
if [ "$SKOPEO" = 1 ]; then
  for cmd in skopeo umoci; do
    command -v "$cmd" >/dev/null || { echo "pull_lazy.sh: $cmd is not installed (scripts/install-deps.sh --bench), or SKOPEO=0" >&2; exit 2; }
  done
fi
WORK=$(mktemp -d "${TMPDIR:-/var/tmp}/cfmo-lazy-bench-XXXXXX")
REG_PID=
cleanup() {
  [ -d "$WORK/mnt" ] && "$PULL" umount "$WORK/mnt" >/dev/null 2>&1 || true
  [ -n "$REG_PID" ] && kill "$REG_PID" 2>/dev/null || true
  for d in lazy full; do [ -d "$WORK/$d" ] && "$PULL" rm "$WORK/$d" -q 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
now() { printf '%s\n' "${EPOCHREALTIME:-$(date +%s.%N)}"; }  # bash's clock: no process started in the timed path
secs() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", b - a}'; }
json() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"; }
max_rss_mb() { awk -F': ' '/Maximum resident set size/ {printf "%.0f", $2 / 1024}' "$1"; }

"$FIXTURE" --layers "$LAYERS" --layer-size "$LAYER_SIZE" --file-size "$FILE_SIZE" --random "$RANDOM_SHARE" \
  --tag v1 "$WORK/image" >/dev/null
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
printf 'version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: 127.0.0.1:%s\n' \
  "$WORK/storage" "$PORT" >"$WORK/registry.yml"
/usr/bin/docker-registry serve "$WORK/registry.yml" >"$WORK/registry.log" 2>&1 &
REG_PID=$!
URL=http://127.0.0.1:$PORT
for _ in $(seq 100); do curl -sf "$URL/v2/" >/dev/null && break; sleep 0.1; done
for blob in "$WORK"/image/blobs/sha256/*; do
  loc=$(curl -si -X POST "$URL/v2/bench/lazy/blobs/uploads/" | awk -F': ' 'tolower($1)=="location" {print $2}' | tr -d '\r')
  case $loc in http*) ;; *) loc=$URL$loc ;; esac
  sep='?'; case $loc in *\?*) sep='&' ;; esac
  curl -sf -X PUT -H 'Content-Type: application/octet-stream' --data-binary "@$blob" \
    "$loc${sep}digest=sha256:$(basename "$blob")" >/dev/null
done
manifest=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["manifests"][0]["digest"][7:])' "$WORK/image/index.json")
curl -sf -X PUT -H 'Content-Type: application/vnd.oci.image.manifest.v1+json' \
  --data-binary "@$WORK/image/blobs/sha256/$manifest" "$URL/v2/bench/lazy/manifests/v1" >/dev/null
REF=127.0.0.1:$PORT/bench/lazy:v1
IMAGE_BYTES=$(du -cb "$WORK"/image/blobs/sha256/* | tail -1 | cut -f1)
rm -rf "$WORK/image"
sync

# Full: the rootfs, then the entry point's files.
t0=$(now)
/usr/bin/time -v -o "$WORK/time-full.txt" "$PULL" pull "$REF" --output "rootfs:$WORK/rootfs" --cache "$WORK/cache" --plain-http -q
mapfile -t FILES < <(cd "$WORK/rootfs" && find . -type f -size +0 | sort | head -"$ENTRY_FILES")
entry() { for f in "${FILES[@]}"; do head -c 4096 "$1/$f" >/dev/null; done; }
entry "$WORK/rootfs"
FULL_S=$(secs "$t0" "$(now)")
rm -rf "$WORK/cache"

# skopeo + umoci: the same, the rootfs umoci unpacks.
SKOPEO_S=-
if [ "$SKOPEO" = 1 ]; then
  sync
  t0=$(now)
  /usr/bin/time -v -o "$WORK/time-skopeo.txt" skopeo copy -q --src-tls-verify=false "docker://$REF" "oci:$WORK/skopeo:v1"
  /usr/bin/time -v -o "$WORK/time-umoci.txt" umoci unpack --image "$WORK/skopeo:v1" "$WORK/bundle" >/dev/null
  entry "$WORK/bundle/rootfs"
  SKOPEO_S=$(secs "$t0" "$(now)")
  rm -rf "$WORK/skopeo" "$WORK/bundle"
fi

# The indexes, made once from a full layout and pushed to the registry (not timed: done once per image).
"$PULL" pull "$REF" --output "oci:$WORK/full" --plain-http -q
"$PULL" index "$WORK/full" --push -q
"$PULL" rm "$WORK/full" -q

read_all() { # DIR: seconds to cat every file, and the bytes
  local t; t=$(now)
  local bytes; bytes=$(cd "$1" && find . -type f -print0 | xargs -0 cat | wc -c)
  echo "$(secs "$t" "$(now)") $bytes"
}
# Both sides of the disk-cold random row start with nothing in the page cache.
drop_caches() { sync && echo 3 >/proc/sys/vm/drop_caches; }
read_random() { # DIR COUNT: seconds for COUNT preads of RANDOM_BLOCK bytes at seeded offsets of its files, and the bytes
  python3 - "$1" "$2" "$RANDOM_BLOCK" <<'PY'
import os, random, sys, time
root, count, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
files = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names)
files = [f for f in files if os.path.getsize(os.path.join(root, f)) > block]
rng = random.Random(17)
picks = []
for _ in range(count):
    f = rng.randrange(len(files))
    picks.append((f, rng.randrange(os.path.getsize(os.path.join(root, files[f])) - block)))
fds = {}
start = time.monotonic()
got = 0
for f, at in picks:
    if f not in fds:
        fds[f] = os.open(os.path.join(root, files[f]), os.O_RDONLY)
    got += len(os.pread(fds[f], block, at))
print(f"{time.monotonic() - start:.3f} {got}")
PY
}
round_trip() { # DIR COUNT: microseconds per LOOKUP of a missing name, per O_DIRECT 4 KiB pread, per 4 KiB page-cache hit
  python3 - "$1" "$2" <<'PY'
import mmap, os, sys, time
# Through a FUSE mount a LOOKUP of a name that is not there and an O_DIRECT
# pread (past the page cache) are each one round trip to the daemon; the
# same pages read again without O_DIRECT are page-cache hits.
root, count = sys.argv[1], int(sys.argv[2])
start = time.monotonic()
for i in range(count):
    try:
        os.stat(os.path.join(root, f".cfmo-round-trip-{i}"))
    except FileNotFoundError:
        pass
lookup = (time.monotonic() - start) / count * 1e6
path = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names
              if os.path.getsize(os.path.join(d, f)) >= 1 << 20)[0]
pages = os.path.getsize(path) // 4096
buf = mmap.mmap(-1, 4096)
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
start = time.monotonic()
for i in range(count):
    os.preadv(fd, [buf], (i * 7919 % pages) * 4096)
direct = (time.monotonic() - start) / count * 1e6
os.close(fd)
fd = os.open(path, os.O_RDONLY)
for i in range(count):
    os.pread(fd, 4096, (i * 7919 % pages) * 4096)
start = time.monotonic()
for i in range(count):
    os.pread(fd, 4096, (i * 7919 % pages) * 4096)
hit = (time.monotonic() - start) / count * 1e6
print(f"{lookup:.1f} {direct:.1f} {hit:.1f}")
PY
}
# Lazy: the pull without layers, the mount, the entry point; then every file
# cold, then every file through a second mount over the cached spans.
lazy_phase() {
  # The daemon's pid from the mount's JSON, read once the mount is timed:
  # python3's start (0.4 s of CPU with this machine's site-packages, 2-6 s
  # at load 20) was timed as the mount's before.
  mount_lazy() {
    "$PULL" mount "$WORK/lazy" "$WORK/mnt" --lazy --json --max-memory "$MAX_MEMORY" --cache-size 4G >"$WORK/mount.json"
  }
  mount_pid() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pid"])' "$WORK/mount.json"; }
  local t0 t1 t2 pid f
  t0=$(now)
  "$PULL" pull "$REF" --output "oci:$WORK/lazy" --plain-http --cold lazy -q
  t1=$(now)
  mkdir -p "$WORK/mnt"
  mount_lazy
  t2=$(now)
  local stamps=()
  for f in "${FILES[@]}"; do
    head -c 4096 "$WORK/mnt/$f" >/dev/null
    stamps+=("$(now)")
  done
  secs "$t0" "${stamps[-1]}" >"$WORK/lazy-first.txt"
  : >"$WORK/lazy-phases.txt"
  for i in "${!FILES[@]}"; do
    echo "first read of ${FILES[$i]}: $(secs "$t2" "${stamps[$i]}") s after the mount" >>"$WORK/lazy-phases.txt"
  done
  pid=$(mount_pid)
  sed -i "1i pull --cold lazy: $(secs "$t0" "$t1") s; mount --lazy (the command, until it returns): $(secs "$t1" "$t2") s" \
    "$WORK/lazy-phases.txt"
  sleep 0.2  # the daemon's stats.json, written as it answers
  cp "$WORK/lazy/cfmo-lazy-cache/stats.json" "$WORK/stats-first.json"
  # The same in one command, mount --lazy REF (the lazy pull inside the
  # mount command), its layout in a cache of its own: a second first output.
  mkdir -p "$WORK/mnt-ref"
  t0=$(now)
  "$PULL" mount --lazy "$REF" "$WORK/mnt-ref" --cache "$WORK/ref-cache" --plain-http -q \
    --max-memory "$MAX_MEMORY" --cache-size 4G
  for f in "${FILES[@]}"; do head -c 4096 "$WORK/mnt-ref/$f" >/dev/null; done
  secs "$t0" "$(now)" >"$WORK/lazy-ref-first.txt"
  "$PULL" umount "$WORK/mnt-ref" -q
  "$PULL" rm "$WORK"/ref-cache/lazy/* -q
  read_all "$WORK/mnt" >"$WORK/lazy-cold.txt"
  cp "$WORK/lazy/cfmo-lazy-cache/stats.json" "$WORK/stats-all.json"
  read_all "$WORK/mnt" >"$WORK/lazy-again.txt"  # the kernel's page cache of this mount
  awk '/VmHWM/ {print $2}' "/proc/$pid/status" >"$WORK/hwm-cold.txt"
  "$PULL" umount "$WORK/mnt" -q
  mount_lazy
  pid=$(mount_pid)
  read_all "$WORK/mnt" >"$WORK/lazy-cached.txt"
  awk '/VmHWM/ {print $2}' "/proc/$pid/status" >"$WORK/hwm-cached.txt"
  "$PULL" umount "$WORK/mnt" -q
  mount_lazy
  round_trip "$WORK/mnt" "$ROUND_TRIPS" >"$WORK/lazy-round-trip.txt"
  "$PULL" umount "$WORK/mnt" -q
  mount_lazy
  read_random "$WORK/mnt" "$RANDOM_READS" >"$WORK/lazy-random-cached.txt"
  read_random "$WORK/mnt" "$RANDOM_READS" >"$WORK/lazy-random-again.txt"  # this mount's page cache
  "$PULL" umount "$WORK/mnt" -q
  drop_caches
  mount_lazy
  read_random "$WORK/mnt" "$RANDOM_READS" >"$WORK/lazy-random-disk.txt"  # the span files read from disk
  "$PULL" umount "$WORK/mnt" -q
  rm -rf "$WORK/lazy/cfmo-lazy-cache"
  mount_lazy
  read_random "$WORK/mnt" "$COLD_RANDOM_READS" >"$WORK/lazy-random-cold.txt"
  "$PULL" umount "$WORK/mnt" -q
}
export PULL REF WORK MAX_MEMORY RANDOM_BLOCK RANDOM_READS COLD_RANDOM_READS ROUND_TRIPS
export -f now secs entry read_all read_random round_trip drop_caches lazy_phase
FILES_LIST=$(printf '%q ' "${FILES[@]}")
sync
/usr/bin/time -v -o "$WORK/time-lazy.txt" /usr/bin/unshare --fork --pid --mount-proc \
  bash -c "FILES=($FILES_LIST); lazy_phase"
LAZY_S=$(cat "$WORK/lazy-first.txt")
FIRST_FETCHED=$(json "$WORK/stats-first.json" bytes_fetched)
ALL_FETCHED=$(json "$WORK/stats-all.json" bytes_fetched)
read -r COLD_S BYTES <"$WORK/lazy-cold.txt"
read -r CACHED_S _ <"$WORK/lazy-cached.txt"
read -r AGAIN_S _ <"$WORK/lazy-again.txt"
read -r RANDOM_CACHED_S RANDOM_BYTES <"$WORK/lazy-random-cached.txt"
read -r RANDOM_COLD_S RANDOM_COLD_BYTES <"$WORK/lazy-random-cold.txt"
read_all "$WORK/rootfs" >/dev/null  # the page cache warm for the local figure
read -r LOCAL_S _ < <(read_all "$WORK/rootfs")
read -r RANDOM_LOCAL_S _ < <(read_random "$WORK/rootfs" "$RANDOM_READS")
read -r RANDOM_AGAIN_S _ <"$WORK/lazy-random-again.txt"
read -r RANDOM_DISK_S _ <"$WORK/lazy-random-disk.txt"
drop_caches
read -r RANDOM_LOCAL_DISK_S _ < <(read_random "$WORK/rootfs" "$RANDOM_READS")

pct() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f", 100 * a / b}'; }
mbps() { awk -v b="$1" -v s="$2" 'BEGIN {printf "%.0f", b / 1048576 / (s > 0 ? s : 0.001)}'; }
echo "image: $LAYERS gzip layers of $LAYER_SIZE, files of $FILE_SIZE ($RANDOM_SHARE random): $IMAGE_BYTES bytes compressed, $BYTES uncompressed"
echo "entry point (the first 4 KiB of ${#FILES[@]} files: ${FILES[*]})"
echo "  full pull (cfmo-pull rootfs) + entry:   $FULL_S s; peak RSS $(max_rss_mb "$WORK/time-full.txt") MB; fetched $IMAGE_BYTES bytes"
if [ "$SKOPEO" = 1 ]; then
  echo "  skopeo copy + umoci unpack + entry:     $SKOPEO_S s; peak RSS $(max_rss_mb "$WORK/time-skopeo.txt") MB (skopeo), $(max_rss_mb "$WORK/time-umoci.txt") MB (umoci); fetched $IMAGE_BYTES bytes"
fi
echo "  lazy pull + mount --lazy + entry:       $LAZY_S s ($(pct "$LAZY_S" "$FULL_S")% of the full pull); fetched $FIRST_FETCHED bytes ($(pct "$FIRST_FETCHED" "$IMAGE_BYTES")% of the image)"
sed 's/^/  lazy phase: /' "$WORK/lazy-phases.txt"
LAZY_REF_S=$(cat "$WORK/lazy-ref-first.txt")
echo "  mount --lazy REF + entry (one command): $LAZY_REF_S s ($(pct "$LAZY_REF_S" "$FULL_S")% of the full pull)"
echo "reading every file (sequential): mount cold $(mbps "$BYTES" "$COLD_S") MB/s ($COLD_S s, $ALL_FETCHED bytes fetched), a new mount over its span cache $(mbps "$BYTES" "$CACHED_S") MB/s ($CACHED_S s; $(awk -v a="$LOCAL_S" -v b="$CACHED_S" 'BEGIN {printf "%.2f", a / b}')x local), the same mount again (its page cache) $(mbps "$BYTES" "$AGAIN_S") MB/s ($AGAIN_S s), local rootfs (page cache) $(mbps "$BYTES" "$LOCAL_S") MB/s ($LOCAL_S s)"
echo "random reads ($RANDOM_BLOCK bytes, seeded offsets over every file): a new mount over its span cache $RANDOM_READS in $RANDOM_CACHED_S s ($(mbps "$RANDOM_BYTES" "$RANDOM_CACHED_S") MB/s; $(awk -v a="$RANDOM_LOCAL_S" -v b="$RANDOM_CACHED_S" 'BEGIN {printf "%.2f", a / b}')x local), local rootfs (page cache) in $RANDOM_LOCAL_S s ($(mbps "$RANDOM_BYTES" "$RANDOM_LOCAL_S") MB/s); cold (span cache emptied) $COLD_RANDOM_READS in $RANDOM_COLD_S s ($(mbps "$RANDOM_COLD_BYTES" "$RANDOM_COLD_S") MB/s)"
echo "random reads, the same reads again through the same mount (its page cache) in $RANDOM_AGAIN_S s ($(awk -v a="$RANDOM_LOCAL_S" -v b="$RANDOM_AGAIN_S" 'BEGIN {printf "%.2f", a / b}')x local page cache); disk cold (page cache dropped before each): a new mount over its span cache in $RANDOM_DISK_S s, local rootfs in $RANDOM_LOCAL_DISK_S s ($(awk -v a="$RANDOM_LOCAL_DISK_S" -v b="$RANDOM_DISK_S" 'BEGIN {printf "%.2f", a / b}')x local)"
read -r RT_LOOKUP RT_READ RT_HIT <"$WORK/lazy-round-trip.txt" || true
read -r _ _ RT_LOCAL_HIT < <(round_trip "$WORK/rootfs" "$ROUND_TRIPS") || true
echo "FUSE round trip ($ROUND_TRIPS each, a new mount over its span cache): LOOKUP of a missing name $RT_LOOKUP us, O_DIRECT 4 KiB pread $RT_READ us; a 4 KiB page-cache hit $RT_HIT us through the mount, $RT_LOCAL_HIT us on the local rootfs"
echo "peak RSS of the lazy phase (/usr/bin/time -v, its largest process): $(max_rss_mb "$WORK/time-lazy.txt") MB; the mount daemon's VmHWM: $(($(cat "$WORK/hwm-cold.txt") / 1024)) MB cold, $(($(cat "$WORK/hwm-cached.txt") / 1024)) MB cached (--max-memory $MAX_MEMORY, --jobs 4)"
