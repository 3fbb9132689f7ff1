#!/usr/bin/env bash
# Installs the Debian packages cfmo needs to build, test and run its demo,
# and only those that are missing. As root it runs apt-get; otherwise it
# prints the one apt-get line to run and exits 1.
#
#   scripts/install-deps.sh            build, test and demo dependencies
#   scripts/install-deps.sh --bench    also the benchmark peers (python3-torch, the zstd command, ucx_perftest, skopeo)
#   scripts/install-deps.sh --list     print the package list and exit
set -euo pipefail

packages=(
  g++ meson ninja-build pkg-config   # toolchain
  libcli11-dev libfmt-dev libtomlplusplus-dev nlohmann-json3-dev  # flags, formatting, config, JSON
  libopenblas-dev zlib1g-dev libzstd-dev libxxhash-dev            # BLAS, gzip, compression, checksums
  libucx-dev                                                      # transport between workers
  libcurl4-openssl-dev libssl-dev                                 # cfmo-pull: registry client, SHA-256
  libarchive-dev libisal-dev                                      # cfmo-pull: unpacking layers, igzip (zlib is the fallback)
  libfuse3-dev fuse3                                              # cfmo-pull mount --lazy: FUSE (libfuse3, fusermount3)
  docker-registry umoci                                           # cfmo-pull tests: a real local registry, a layout reader
  crun busybox-static                                             # cfmo-pull tests: a real container on the lazy mount
  time                                                            # cfmo-pull's peak-RSS test: /usr/bin/time
  libgtest-dev googletest                                         # tests
  python3-dev pybind11-dev python3-numpy                          # the cfmo Python module (python/)
  python3-pytest python3-torch                                    # its tests (PyTorch models and optimizers)
  scdoc                                                           # man pages from source
  dataset-fashion-mnist                                           # the demo's data set
  fortunes                                                        # the GPT demo's text: fortune(6)'s files
  openmpi-bin libopenmpi-dev                                      # the mpirun test (and bench/moe_vs_mpi.sh's MPI peer)
  slurm-wlm munge                                                 # the single-node Slurm test: srun, sbatch, slurmctld, slurmd
  iproute2                                                        # the two-host test: network namespaces, veth, tc
)

case "${1:-}" in
  --bench) packages+=(python3-torch python3-numpy zstd ucx-utils skopeo) ;;
  --list) printf '%s\n' "${packages[@]}"; exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--bench|--list]" >&2; exit 2 ;;
esac

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "cfmo needs these Debian packages; run:" >&2
  echo "  sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# A fresh machine may have no package lists yet; an old list may name versions gone from the mirror.
if ! apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
  apt-get update -qq
  apt-get install -y --no-install-recommends "${missing[@]}"
fi
