#!/usr/bin/env bash
# cfmo-pull mount --lazy against a full pull, on one local registry:
#   full      cfmo-pull pull REF --output rootfs:DIR, then the first file read
#   lazy      cfmo-pull pull REF --output oci:DIR --cold lazy, mount --lazy,
#             then the same file read through the mount
# (time from the pull's start to the file's bytes: the container's first
# output, without the container), the bytes the lazy mount fetched, the
# sequential read throughput of every file through the mount with a cold
# cache (fetched by ranges), through a new mount whose span cache is on
# disk (cached), and of the full pull's rootfs (local disk, page cache
# warm), and the mount daemon's peak RSS (VmHWM).
#
#   bench/pull_lazy.sh            LAYERS=2 LAYER_SIZE=128M FILE_SIZE=1M RANDOM_SHARE=0.5
#
# The image is bench/oci-fixture's, pushed with curl through the registry's
# upload API (skopeo is not needed). The indexes come from `cfmo-pull index`
# on the full pull, copied into the lazy pull's directory (the registry does
# not hold them yet). Needs root (FUSE and allow_other) and Debian's
# docker-registry.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
PULL=$(realpath "$BUILD/tools/cfmo-pull")
FIXTURE=$BUILD/bench/oci-fixture
LAYERS=${LAYERS:-2}
LAYER_SIZE=${LAYER_SIZE:-128M}
FILE_SIZE=${FILE_SIZE:-1M}
RANDOM_SHARE=${RANDOM_SHARE:-0.5}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/cfmo-lazy-bench-XXXXXX")
REG_PID=
cleanup() {
  for m in "$WORK"/mnt*; do [ -d "$m" ] && "$PULL" umount "$m" >/dev/null 2>&1 || true; done
  [ -n "$REG_PID" ] && kill "$REG_PID" 2>/dev/null || true
  "$PULL" rm "$WORK/lazy" -q 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2f", b - a}'; }

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

# Full: the rootfs, then its first file.
t0=$(now)
"$PULL" pull "$REF" --output "rootfs:$WORK/rootfs" --cache "$WORK/cache" --plain-http -q
FIRST=$(cd "$WORK/rootfs" && find . -type f -size +0 | sort | head -1)
head -c 4096 "$WORK/rootfs/$FIRST" >/dev/null
FULL_S=$(secs "$t0" "$(now)")

# The indexes, made once from a full layout.
"$PULL" pull "$REF" --output "oci:$WORK/full" --plain-http -q
"$PULL" index "$WORK/full" -q

# Lazy: the pull without layers, the indexes, the mount, the same file.
t0=$(now)
"$PULL" pull "$REF" --output "oci:$WORK/lazy" --plain-http --cold lazy -q
cp -r "$WORK/full/cfmo-index" "$WORK/lazy/"
mkdir -p "$WORK/mnt"
PID=$("$PULL" mount "$WORK/lazy" "$WORK/mnt" --lazy --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
head -c 4096 "$WORK/mnt/$FIRST" >/dev/null
LAZY_S=$(secs "$t0" "$(now)")
FIRST_FETCHED=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["bytes_fetched"])' "$WORK/lazy/cfmo-lazy-cache/stats.json")

read_all() { # DIR: seconds to cat every file, and the bytes
  local t; t=$(now)
  local bytes; bytes=$(cd "$1" && find . -type f -print0 | xargs -0 cat | wc -c)
  echo "$(secs "$t" "$(now)") $bytes"
}
read -r COLD_S BYTES < <(read_all "$WORK/mnt")
ALL_FETCHED=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["bytes_fetched"])' "$WORK/lazy/cfmo-lazy-cache/stats.json")
RSS_KB=$(awk '/VmHWM/ {print $2}' "/proc/$PID/status")
"$PULL" umount "$WORK/mnt" -q
PID=$("$PULL" mount "$WORK/lazy" "$WORK/mnt" --lazy --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
read -r CACHED_S _ < <(read_all "$WORK/mnt")
RSS2_KB=$(awk '/VmHWM/ {print $2}' "/proc/$PID/status")
"$PULL" umount "$WORK/mnt" -q
read_all "$WORK/rootfs" >/dev/null  # the page cache warm for the local figure
read -r LOCAL_S _ < <(read_all "$WORK/rootfs")

mbps() { awk -v b="$1" -v s="$2" 'BEGIN {printf "%.0f", b / 1048576 / (s > 0 ? s : 0.001)}'; }
echo "image: $LAYERS gzip layers of $LAYER_SIZE, files of $FILE_SIZE ($RANDOM_SHARE random): $IMAGE_BYTES bytes compressed, $BYTES uncompressed"
echo "first file ($FIRST): full pull + rootfs $FULL_S s; lazy pull + mount + read $LAZY_S s ($(awk -v a="$LAZY_S" -v b="$FULL_S" 'BEGIN {printf "%.0f", 100 * a / b}')% of the full)"
echo "bytes fetched by the mount before the first file: $FIRST_FETCHED ($(awk -v a="$FIRST_FETCHED" -v b="$IMAGE_BYTES" 'BEGIN {printf "%.2f", 100 * a / b}')% of the image); after every file: $ALL_FETCHED"
echo "reading every file: mount cold $(mbps "$BYTES" "$COLD_S") MB/s ($COLD_S s), mount with its span cache $(mbps "$BYTES" "$CACHED_S") MB/s ($CACHED_S s), local rootfs (page cache) $(mbps "$BYTES" "$LOCAL_S") MB/s ($LOCAL_S s)"
echo "mount daemon peak RSS: $((RSS_KB / 1024)) MB cold, $((RSS2_KB / 1024)) MB cached (default --max-memory 2G, --jobs 4)"
